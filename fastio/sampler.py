"""The global sample order of an epoch, each rank's slice of it, and the arithmetic of (elastic) resume.

The order of epoch ``e`` is a pure function of ``(seed, e, fingerprint, shuffle)`` and the shard sizes;
it does not depend on the world size. A plan cuts ``order[start:]`` into global batches of
``batch_size * world_size`` samples; rank ``r`` takes positions ``[r*B, (r+1)*B)`` of each. Resuming
at any world size is therefore "start the plan at ``consumed``": with the same world size the batches
are the ones the uninterrupted run would have produced, with another every remaining sample is still
delivered exactly once.

Arguments are checked once, where they enter: :class:`SamplerSpec` (shuffle, block_shards, batch_size,
remainder), :class:`Sampler` (rank, world_size) and :meth:`Sampler.plan` (start). Nothing here touches
bytes, files or tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["REMAINDER_MODES", "SHUFFLE_MODES", "EpochPlan", "Sampler", "SamplerSpec", "epoch_order"]

SHUFFLE_MODES = ("global", "block", "none")
# What happens to the last, incomplete global batch when it is not dropped. Both keep every rank at
# the same number of batches, so DDP never waits on a missing one:
# "pad": it is filled by wrapping to the start of the epoch order; repeats are flagged in batch["padded"].
# "partial": its samples are split as evenly as possible over the ranks (sizes differ by at most one);
#   a rank left with none gets one padded sample.
REMAINDER_MODES = ("pad", "partial")


@dataclass(frozen=True)
class SamplerSpec:
    """How epochs are ordered and cut into batches, independent of the dataset and of the rank."""

    seed: int = 0
    """Seeds the order of every epoch."""
    shuffle: str = "global"
    """``global`` (full permutation), ``block`` (shuffled shards, samples shuffled in windows) or ``none``."""
    block_shards: int = 4
    """Shards per window in ``block`` mode."""
    batch_size: int = 1
    """Samples per batch on each rank."""
    drop_last: bool = False
    """Drop the last incomplete global batch of each epoch."""
    remainder: str = "pad"
    """Without drop_last: ``pad`` or ``partial`` (see ``REMAINDER_MODES``)."""

    def __post_init__(self):
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {', '.join(SHUFFLE_MODES)}, got {self.shuffle!r}")
        if self.block_shards < 1:
            raise ValueError(f"block_shards must be >= 1, got {self.block_shards!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.remainder not in REMAINDER_MODES:
            raise ValueError(f"remainder must be one of {', '.join(REMAINDER_MODES)}, got {self.remainder!r}")


def epoch_order(shard_sizes: Sequence[int], seed: int, epoch: int, fingerprint: str, shuffle: str = "global",
                block_shards: int = 4) -> np.ndarray:
    """The dataset-wide indices of epoch ``epoch`` in the order they are delivered (int64).

    ``block`` shuffles the shards, then shuffles samples within each window of ``block_shards``
    consecutive (shuffled) shards, so that a reader touches few shards at a time.
    """
    spec = SamplerSpec(seed=seed, shuffle=shuffle, block_shards=block_shards)
    return _epoch_order(shard_sizes, spec, epoch, fingerprint)


@dataclass(frozen=True)
class Sampler:
    """Rank ``rank`` of ``world_size``: its batches of every epoch of one dataset (``shard_sizes``)."""

    spec: SamplerSpec
    shard_sizes: tuple[int, ...]
    fingerprint: str
    world_size: int = 1
    rank: int = 0

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        object.__setattr__(self, "shard_sizes", tuple(int(s) for s in self.shard_sizes))

    @cached_property
    def samples(self) -> int:
        """Samples in an epoch (the dataset's size)."""
        return sum(self.shard_sizes)

    @property
    def global_batch(self) -> int:
        return self.spec.batch_size * self.world_size

    def __len__(self) -> int:
        """Batches of a full epoch (the same on every rank)."""
        n, gb = self.samples, self.global_batch
        return n // gb if self.spec.drop_last else -(-n // gb)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset-wide indices of epoch ``epoch`` in delivery order (see :func:`epoch_order`)."""
        return _epoch_order(self.shard_sizes, self.spec, epoch, self.fingerprint)

    def plan(self, epoch: int, start: int = 0) -> EpochPlan:
        """This rank's batches of epoch ``epoch`` from global position ``start`` (samples consumed) on."""
        if not 0 <= start <= self.samples:
            raise ValueError(f"start must be in 0..{self.samples}, got {start}")
        return EpochPlan(self, epoch, self.order(epoch), start)


def _generator(seed: int, epoch: int, fingerprint: str, shuffle: str) -> np.random.Generator:
    digest = hashlib.sha256(f"fastio-order:{seed}:{epoch}:{fingerprint}:{shuffle}".encode()).digest()
    return np.random.Generator(np.random.Philox(key=int.from_bytes(digest[:16], "little")))


def _epoch_order(shard_sizes: Sequence[int], spec: SamplerSpec, epoch: int, fingerprint: str) -> np.ndarray:
    n = int(sum(shard_sizes))
    if spec.shuffle == "none":
        return np.arange(n, dtype=np.int64)
    rng = _generator(spec.seed, epoch, fingerprint, spec.shuffle)
    if spec.shuffle == "global":
        return rng.permutation(n).astype(np.int64)
    firsts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]]).astype(np.int64)
    shard_order = rng.permutation(len(shard_sizes))
    parts = []
    for w in range(0, len(shard_order), spec.block_shards):
        window = np.concatenate([np.arange(firsts[s], firsts[s] + shard_sizes[s], dtype=np.int64)
                                 for s in shard_order[w:w + spec.block_shards]])
        parts.append(window[rng.permutation(len(window))])
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """How ``order[start:]`` of one epoch is cut into global batches, and which part of each one rank gets.

    Made by :meth:`Sampler.plan`, which checks its arguments.
    """

    sampler: Sampler
    epoch: int
    order: np.ndarray
    start: int

    def __len__(self) -> int:
        """Batches every rank gets from ``start`` to the end of the epoch (the same on all ranks)."""
        rest, gb = len(self.order) - self.start, self.sampler.global_batch
        return rest // gb if self.sampler.spec.drop_last else -(-rest // gb)

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's indices of global batch ``g`` (counted from ``start``) and its padding mask."""
        if not 0 <= g < len(self):
            raise IndexError(f"batch {g} out of range 0..{len(self) - 1}")
        n, gb, b = len(self.order), self.sampler.global_batch, self.sampler.spec.batch_size
        rank, w = self.sampler.rank, self.sampler.world_size
        first = self.start + g * gb
        if self.sampler.spec.remainder == "partial" and first + gb > n:
            rest = n - first
            size = rest // w + (rank < rest % w)
            offset = rank * (rest // w) + min(rank, rest % w)
            if size == 0:
                return self.order[[first]], np.ones(1, dtype=bool)
            pos = first + offset + np.arange(size)
        else:
            pos = first + rank * b + np.arange(b)
        return self.order[pos % n], pos >= n

    def consumed_after(self, g: int) -> int:
        """Global samples consumed once global batch ``g`` has been delivered (the state's ``consumed``)."""
        return min(self.start + (g + 1) * self.sampler.global_batch, len(self.order))

