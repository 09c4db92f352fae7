"""The global sample order of an epoch, each rank's slice of it, and the arithmetic of (elastic) resume.

The order of epoch ``e`` is a pure function of ``(seed, e, fingerprint, shuffle)`` and the shard sizes;
it does not depend on the world size. It is lazy (:class:`EpochOrder`): a rank evaluates only the
positions it needs, in O(shards) memory, so 10^9 samples cost a rank what its own batches cost.
A plan cuts ``order[start:]`` into global batches of
``batch_size * world_size`` samples; rank ``r`` takes positions ``[r*B, (r+1)*B)`` of each. Resuming
at any world size is therefore "start the plan at ``consumed``": with the same world size the batches
are the ones the uninterrupted run would have produced, with another every remaining sample is still
delivered exactly once.

Arguments are checked once, where they enter: :class:`SamplerSpec` (shuffle, block_shards, batch_size,
remainder), :class:`Sampler` (rank, world_size) and :meth:`Sampler.plan` (start). Nothing here touches
bytes, files or tensors.
"""

from __future__ import annotations

import numbers
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from fastio.order.feistel import GOLDEN, ORDER_ALGORITHM, domain_bits, permute, round_keys
from fastio.words import agree

__all__ = ["ORDER_ALGORITHM", "REMAINDER_MODES", "SHUFFLE_MODES", "EpochOrder", "EpochPlan", "Sampler",
           "SamplerSpec", "epoch_order"]

SHUFFLE_MODES = ("global", "block", "none")
# What happens to the last, incomplete global batch when it is not dropped. Both keep every rank at
# the same number of batches, so DDP never waits on a missing one:
# "pad": it is filled by wrapping to the start of the epoch order; repeats are flagged in batch["padded"].
# "partial": its samples are split as evenly as possible over the ranks (sizes differ by at most one);
#   a rank left with none gets one padded sample. An epoch smaller than one batch is that one batch.
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

    @property
    def partial_batches(self) -> bool:
        """Whether an epoch's last global batch is delivered as the samples there are (``remainder="partial"``
        without drop_last): then an epoch smaller than one batch is one batch of them, as a torch DataLoader's
        ``drop_last=False`` gives."""
        return self.remainder == "partial" and not self.drop_last

    def __post_init__(self):
        # integers only: a loader state stores them, and a resume reads them back as integers
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {', '.join(SHUFFLE_MODES)}, got {self.shuffle!r}")
        if isinstance(self.block_shards, bool) or not isinstance(self.block_shards, numbers.Integral):
            raise ValueError(f"block_shards must be an integer >= 1, got {self.block_shards!r}")
        if self.block_shards < 1:
            raise ValueError(f"block_shards must be >= 1, got {self.block_shards!r}")
        object.__setattr__(self, "block_shards", int(self.block_shards))
        if isinstance(self.batch_size, (bool, np.bool_)) or not isinstance(self.batch_size, numbers.Integral) \
                or self.batch_size < 1:  # a numpy integer too (a config read with numpy); True is not 1 sample
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        object.__setattr__(self, "batch_size", int(self.batch_size))
        if self.remainder not in REMAINDER_MODES:
            raise ValueError(f"remainder must be one of {', '.join(REMAINDER_MODES)}, got {self.remainder!r}")


def epoch_order(shard_sizes: Sequence[int], seed: int, epoch: int, fingerprint: str, shuffle: str = "global",
                block_shards: int = 4) -> EpochOrder:
    """The order of epoch ``epoch``: ``order[p]`` is the dataset-wide index delivered at position ``p``.

    Lazy (see :class:`EpochOrder`): nothing of size N is built; ``block`` shuffles the shards, then
    shuffles samples within each window of ``block_shards`` consecutive (shuffled) shards, so that a
    reader touches few shards at a time.
    """
    spec = SamplerSpec(seed=seed, shuffle=shuffle, block_shards=block_shards)
    return EpochOrder(shard_sizes, spec, epoch, fingerprint)


@dataclass(frozen=True)
class Sampler:
    """Rank ``rank`` of ``world_size``: its batches of every epoch of one dataset (``shard_sizes``)."""

    spec: SamplerSpec
    shard_sizes: tuple[int, ...]
    fingerprint: str
    world_size: int = 1
    rank: int = 0

    _chunks: _ChunkCache = field(default_factory=lambda: _ChunkCache(), init=False, repr=False, compare=False)
    """Recent :meth:`EpochPlan.iter_batches` chunks (shared by the plans of this sampler)."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        if self.global_batch > 2**62:  # a plan's positions (a padded batch's past the epoch's end) are int64
            raise ValueError(f"global batch {self.spec.batch_size} x world_size {self.world_size} = "
                             f"{self.global_batch} is past 2**62, the largest a plan's int64 positions hold")
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

    def order(self, epoch: int) -> EpochOrder:
        """The lazy delivery order of epoch ``epoch`` (see :func:`epoch_order`)."""
        return EpochOrder(self.shard_sizes, self.spec, epoch, self.fingerprint)

    def check_epoch(self, epoch: int) -> None:
        """ValueError naming ``epoch`` where this sampler cannot order it (a dataset's order takes any epoch >= 0:
        it hashes it; a mixture's counts its stream positions in int64)."""

    def plan(self, epoch: int, start: int = 0) -> EpochPlan:
        """This rank's batches of epoch ``epoch`` from global position ``start`` (samples consumed) on."""
        if not 0 <= start <= self.samples:
            raise ValueError(f"start must be in 0..{self.samples}, got {start}")
        self.check_epoch(epoch)
        return EpochPlan(self, epoch, self.order(epoch), start)


class _ChunkCache:
    """The last few chunks of batches a sampler looked up, read-only. The Loader's feeder and its shard
    read-ahead walk the same chunks of the same epoch, so whichever comes second finds them here."""

    def __init__(self, size: int = 8):
        self.size = size
        self._chunks: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, compute: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return self._chunks[key]
        value = compute()
        for a in value:
            a.flags.writeable = False
        with self._lock:
            self._chunks[key] = value
            while len(self._chunks) > self.size:
                self._chunks.popitem(last=False)
        return value


# -- the lazy order: the keyed permutation of order/feistel.py over positions ----------------------------
_CHUNK = 1 << 20  # positions evaluated at once (bounds the temporaries of a big request)


class EpochOrder:
    """The delivery order of one epoch, evaluated lazily: ``order[p]`` for an int, a slice or an int64
    array of positions is the dataset-wide index delivered at position ``p``.

    Memory is O(shards) (the shard permutation and window table of ``block``), whatever the dataset
    size; ``order[positions]`` costs O(len(positions)). ``np.asarray(order)`` materialises all N
    indices (for small datasets and tests). A pure function of (seed, epoch, fingerprint, shuffle,
    block_shards, shard sizes), and a true permutation of ``range(N)``.
    """

    def __init__(self, shard_sizes: Sequence[int], spec: SamplerSpec, epoch: int, fingerprint: str):
        sizes = np.asarray(shard_sizes, dtype=np.int64).reshape(-1)
        if (sizes < 0).any():
            raise ValueError(f"shard sizes must be >= 0, got {int(sizes.min())}")
        self.shuffle = spec.shuffle
        self._n = int(sizes.sum())
        if spec.shuffle == "global":
            self._keys = round_keys(spec.seed, spec.shuffle, epoch, fingerprint, "samples")
            self._nbits = domain_bits(self._n)
        elif spec.shuffle == "block":
            self._keys = round_keys(spec.seed, spec.shuffle, epoch, fingerprint, "windows")
            s = len(sizes)
            shard_keys = round_keys(spec.seed, spec.shuffle, epoch, fingerprint, "shards")
            perm = (permute(np.arange(s, dtype=np.int64), s, domain_bits(s), shard_keys, 0) if s
                    else np.empty(0, np.int64))
            firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if s else sizes
            self._slot_first = firsts[perm]  # dataset-wide first index of the shard in each (permuted) slot
            self._slot_start = np.concatenate([[0], np.cumsum(sizes[perm])]).astype(np.int64)  # S + 1
            step = min(spec.block_shards, s)  # one window from s up (an int64 step: block_shards may be larger)
            edges = self._slot_start[np.r_[np.arange(0, s, step), s]] if s else np.zeros(1, np.int64)
            self._win_start, win_size = edges[:-1], np.diff(edges)
            self._win_bits = np.array([domain_bits(m) for m in win_size.tolist()], dtype=np.int64)
            self._win_size = win_size

    repeats = False
    """No sample comes twice in an epoch: its index is the key of its random draws (a mixture's order may
    repeat samples: :meth:`fastio.order.mixorder.MixOrder.draw_keys`)."""

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"EpochOrder(samples={self._n}, shuffle={self.shuffle!r})"

    def __getitem__(self, key) -> np.ndarray | int:
        if isinstance(key, slice):
            return self._at(np.arange(*key.indices(self._n), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            p = int(key) + self._n if key < 0 else int(key)
            if not 0 <= p < self._n:
                raise IndexError(f"position {int(key)} out of range for an order of {self._n} {agree(self._n, 'sample')}")
            return int(self._at(np.array([p], np.int64))[0])
        pos = np.asarray(key)
        if pos.dtype.kind not in "iu":
            raise IndexError(f"positions must be integers, got dtype {pos.dtype}")
        pos = pos.astype(np.int64, copy=False)
        if pos.size and (pos.min() < 0 or pos.max() >= self._n):
            bad = int(pos[(pos < 0) | (pos >= self._n)][0])
            raise IndexError(f"position {bad} out of range for an order of {self._n} {agree(self._n, 'sample')}")
        return self._at(pos)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def _at(self, pos: np.ndarray) -> np.ndarray:
        flat = pos.reshape(-1)
        if flat.size <= _CHUNK:
            return self._eval(flat).reshape(pos.shape)
        out = np.empty(flat.size, np.int64)
        for i in range(0, flat.size, _CHUNK):
            out[i:i + _CHUNK] = self._eval(flat[i:i + _CHUNK])
        return out.reshape(pos.shape)

    def _eval(self, pos: np.ndarray) -> np.ndarray:
        if self.shuffle == "none" or not pos.size:
            return pos.astype(np.int64, copy=True)
        if self.shuffle == "global":
            return permute(pos, self._n, self._nbits, self._keys, 0)
        w = np.searchsorted(self._win_start, pos, "right") - 1
        start = self._win_start[w]
        t = start + permute(pos - start, self._win_size[w], self._win_bits[w], self._keys, w.astype(np.uint64) * GOLDEN)
        j = np.searchsorted(self._slot_start, t, "right") - 1
        return self._slot_first[j] + (t - self._slot_start[j])


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """How ``order[start:]`` of one epoch is cut into global batches, and which part of each one rank gets.

    Made by :meth:`Sampler.plan`, which checks its arguments.
    """

    sampler: Sampler
    epoch: int
    order: EpochOrder
    start: int

    def __len__(self) -> int:
        """Batches every rank gets from ``start`` to the end of the epoch (the same on all ranks)."""
        rest, gb = len(self.order) - self.start, self.sampler.global_batch
        return rest // gb if self.sampler.spec.drop_last else -(-rest // gb)

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's indices of global batch ``g`` (counted from ``start``) and its padding mask."""
        if not 0 <= g < len(self):
            raise IndexError(f"batch {g} out of range 0..{len(self) - 1}")
        pos = self._positions(g)
        n = len(self.order)
        return self.order[pos % n], pos >= n

    def batches(self, first: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """This rank's indices and padding mask of batches ``first .. first + count - 1`` (default: to the
        end of the epoch), concatenated, in one vectorised lookup of the order (what read-ahead and
        start-up planning use; ``batch(g)`` one at a time gives the same values)."""
        last = len(self) if count is None else first + count
        if count is not None and count < 0 or not 0 <= first <= last <= len(self):
            raise IndexError(f"batches {first}..{last - 1} out of range 0..{len(self) - 1}")
        n, gb = len(self.order), self.sampler.global_batch
        tail = last
        if self.sampler.spec.remainder == "partial" and last > first and self.start + last * gb > n:
            tail = last - 1  # the partial last batch is cut differently
        parts = [self._full_positions(first, tail)] + ([self._positions(tail)] if tail < last else [])
        pos = np.concatenate(parts)
        return self.order[pos % n], pos >= n

    def iter_chunks(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """``(indices, padded, count)``: ``batches(g, count)`` for consecutive chunks of ``chunk`` batches from
        ``first`` to the end of the epoch (read-only arrays, shared with the other plans of the sampler at this
        position: the feeder and the shard read-ahead look each chunk up once between them)."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        for g in range(first, len(self), chunk):
            count = min(chunk, len(self) - g)
            indices, padded = self.sampler._chunks.get((self.epoch, self.start, g, count),
                                                       lambda g=g, count=count: self.batches(g, count))
            yield indices, padded, count

    def iter_batches(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``batch(g)`` for ``g = first ..`` the end of the epoch, looked up ``chunk`` batches at a time (one
        vectorised evaluation of the order per chunk instead of one per batch: what the feeder uses)."""
        b = self.sampler.spec.batch_size
        for indices, padded, count in self.iter_chunks(first, chunk):
            for j in range(count):  # only the epoch's last batch can be shorter than batch_size
                end = (j + 1) * b if j < count - 1 else len(indices)
                yield indices[j * b:end], padded[j * b:end]

    def _full_positions(self, first: int, tail: int) -> np.ndarray:
        """Global positions of this rank's part of the full batches ``first .. tail - 1``, concatenated (none made
        for none: a ``partial`` epoch smaller than one batch has no full batch, and its batch_size may be far
        larger than the epoch)."""
        if tail <= first:
            return np.empty(0, np.int64)
        b = self.sampler.spec.batch_size
        g = np.arange(first, tail, dtype=np.int64)
        return ((self.start + g * self.sampler.global_batch + self.sampler.rank * b)[:, None]
                + np.arange(b, dtype=np.int64)).reshape(-1)

    def _positions(self, g: int) -> np.ndarray:
        """Global positions (``>= len(order)`` where padding wraps) of this rank's part of batch ``g``."""
        n, gb, b = len(self.order), self.sampler.global_batch, self.sampler.spec.batch_size
        rank, w = self.sampler.rank, self.sampler.world_size
        first = self.start + g * gb
        if self.sampler.spec.remainder == "partial" and first + gb > n:
            rest = n - first
            size = rest // w + (rank < rest % w)
            if size == 0:  # fewer samples left than ranks: one repeat of the epoch's first, flagged padded
                return np.array([first + n], np.int64)
            offset = rank * (rest // w) + min(rank, rest % w)
            return first + offset + np.arange(size, dtype=np.int64)
        return first + rank * b + np.arange(b, dtype=np.int64)

    def draw_keys(self, g: int, ids: np.ndarray) -> np.ndarray | None:
        """The keys of the random draws of this rank's part of batch ``g`` (delivered as ``ids``): None where they
        are the ids (a dataset: nothing looked up), else the order's ``draw_keys`` at the batch's positions."""
        if not self.order.repeats:
            return None
        return self.order.draw_keys(self._positions(g) % len(self.order), ids)

    def consumed_after(self, g: int) -> int:
        """Global samples consumed once global batch ``g`` has been delivered (the state's ``consumed``)."""
        return min(self.start + (g + 1) * self.sampler.global_batch, len(self.order))

