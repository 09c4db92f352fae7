"""Fault-tolerant training (torchft): which samples one member of one replica group takes at one step.

Step ``s``'s global batch is batch ``s`` of a one-process plan of ``batch_size`` samples per batch, counted
through the epochs in order: a pure function of (seed, step) and the same samples a one-process Loader gives at
its batch ``s``. It is split over the groups taking part in that step's quorum (:class:`Share`: ``participant`` of
``participants``), in shares that differ by at most one sample, and each group's share again over the group's
ranks (``rank`` of ``world_size``). :class:`SharePlan` is a plan of one epoch cut that way, so the Loader's feeder
walks it as it walks a :class:`~fastio.order.sampler.EpochPlan`. Nothing here knows torchft, bytes or tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastio.words import agree

__all__ = ["Share", "SharePlan", "split", "step_position"]


def split(length: int, parts: int, part: int) -> tuple[int, int]:
    """``(offset, size)`` of part ``part`` of ``parts`` of ``length`` items: sizes differ by at most one, the first
    ``length % parts`` parts take one more."""
    base, extra = divmod(length, parts)
    return part * base + min(part, extra), base + (part < extra)


def step_position(step: int, batches_per_epoch: int, batch_size: int) -> tuple[int, int]:
    """``(epoch, start)`` of global batch ``step``: the epoch it is in and the samples of that epoch before it."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if batches_per_epoch < 1:
        raise ValueError(f"an epoch has no global batch of {batch_size} {agree(batch_size, 'sample')}: no step can be taken")
    epoch, g = divmod(int(step), batches_per_epoch)
    return epoch, g * batch_size


@dataclass(frozen=True)
class Share:
    """One rank's part of a step's global batch: participating replica group ``participant`` of ``participants``,
    and rank ``rank`` of the group's ``world_size``."""

    participants: int
    participant: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.participants < 1 or not 0 <= self.participant < self.participants:
            raise ValueError(f"participant must be in 0..participants-1 (participants >= 1), got participant="
                             f"{self.participant!r} of participants={self.participants!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..world_size-1, got rank={self.rank!r} of world_size={self.world_size!r}")

    def pick(self, length: int) -> tuple[slice, bool]:
        """Which of a global batch's ``length`` positions are this rank's, and whether they are a padding repeat: a
        rank left with none (fewer samples than ranks) gets the batch's first sample again, flagged padded, as the
        Loader's ``remainder="partial"`` does."""
        offset, size = split(length, self.participants, self.participant)
        inner, size = split(size, self.world_size, self.rank)
        if size == 0 and length:
            return slice(0, 1), True
        return slice(offset + inner, offset + inner + size), False

    def plans(self, plans: Callable[[int, int], Any], batch_size: int) -> Callable[[int, int], SharePlan]:
        """``plans(epoch, start)`` of a one-process sampler of ``batch_size`` samples per batch, cut to this share."""
        return lambda epoch, start: SharePlan(plans(epoch, start), self, batch_size)


class SharePlan:
    """A one-process plan (:class:`~fastio.order.sampler.EpochPlan`, or a kind's plan of its units) whose every
    global batch is cut to one :class:`Share`: the same epoch, start, length and positions, this rank's samples."""

    def __init__(self, plan: Any, share: Share, batch_size: int):
        self._plan, self.share, self._batch_size = plan, share, batch_size
        self.epoch, self.start = plan.epoch, plan.start

    def __len__(self) -> int:
        return len(self._plan)

    def consumed_after(self, g: int) -> int:
        return self._plan.consumed_after(g)

    def _cut(self, ids: np.ndarray, padded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        where, repeat = self.share.pick(len(ids))
        return ids[where], (np.ones(1, bool) if repeat else padded[where])

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's ids of global batch ``g`` (counted from ``start``) and its padding mask."""
        return self._cut(*self._plan.batch(g))

    def iter_chunks(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """``(ids, padded, count)`` of ``count`` consecutive batches, each cut to the share, concatenated."""
        for ids, padded, count in self._plan.iter_chunks(first, chunk):
            cut = [self._cut(ids[a:b], padded[a:b]) for a, b in self._edges(len(ids), count)]
            yield np.concatenate([c[0] for c in cut]), np.concatenate([c[1] for c in cut]), count

    def iter_batches(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``batch(g)`` for ``g = first ..`` the end of the epoch, looked up a chunk at a time."""
        for ids, padded, count in self._plan.iter_chunks(first, chunk):
            for a, b in self._edges(len(ids), count):
                yield self._cut(ids[a:b], padded[a:b])

    def _edges(self, total: int, count: int) -> list[tuple[int, int]]:
        """Where each of ``count`` global batches concatenated into ``total`` ids lies: all of ``batch_size`` but
        the last, which holds the rest (an epoch's last batch may be shorter)."""
        b = self._batch_size
        return [(j * b, (j + 1) * b if j < count - 1 else total) for j in range(count)]

    def draw_keys(self, g: int, ids: np.ndarray) -> np.ndarray | None:
        """The keys of the random draws of this rank's part of batch ``g``: the one-process plan's, cut the same way
        (None where they are the ids)."""
        draw_keys = getattr(self._plan, "draw_keys", None)
        if draw_keys is None:
            return None
        whole = self._plan.batch(g)[0]
        keys = draw_keys(g, whole)
        return None if keys is None else keys[self.share.pick(len(whole))[0]]
