"""The order of a mixture of datasets: which source fills each position, and which of its samples.

Pure arithmetic beside :mod:`fastio.order.sampler`: no bytes, files or tensors.

**Which source.** The weights become integers ``n_s`` (exactly when they are small rationals, else an
apportionment of ``MAX_PERIOD``) and one period of ``W = sum(n_s)`` positions is laid out by the *largest
deficit* rule: position ``q`` goes to the source with the largest ``n_s * (q + 1) - W * C_s(q)``, where
``C_s(q)`` counts the source's earlier positions (ties to the earlier source). That sequence repeats
forever; mixture epoch ``e`` is its stretch ``[phase + e*N, phase + (e+1)*N)`` (``N`` samples per epoch,
``phase`` from the seed, names and fingerprints). Every prefix of it stays within quota
(``|C_s - w_s * q| < 1``), so any window of ``n`` consecutive positions holds ``w_s * n`` samples of ``s``
up to less than 2; with two sources (and with equal weights) less than 1. :func:`window_spread` measures it.

**Which sample.** The count of ``s``'s positions before stream position ``Q`` is
``(Q // W) * n_s + rank[Q % W]`` (O(1)); the ``k``-th sample of source ``s`` is position ``k % size_s`` of
that source's own epoch ``k // size_s`` (:class:`fastio.order.sampler.EpochOrder`, seeded per source). So a
source never repeats a sample before all of its samples were delivered, a small source cycles through its
own epochs, a large one is partly covered per mixture epoch, and nothing is stored: everything follows
from the position.

**A schedule.** Weights may change at chosen stream positions (:class:`MixSchedule`'s ``changes``): the
*stream position* of position ``p`` of mixture epoch ``e`` is ``e * N + p``, so epochs keep their length and a
schedule's phases change what each epoch holds. Phase ``i`` runs from its start ``P_i`` to the next one's; in it the
largest-deficit schedule of its own weights is laid out afresh (from an offset of its own), so its windows hold
its weights as above, and each source's count runs on across the change (its samples before ``P_i`` plus its
positions in the phase so far): a source never repeats a sample before all were delivered, across phases too.
A lookup is O(1) per position plus a search among the phases' starts.

Samples of a mixture are named by *mixture ids*: source ``s``'s sample ``i`` is ``base_s + i`` (sources laid
end to end in mapping order), which is what :class:`MixOrder` returns and what the reader is given.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from fastio.order.feistel import domain_bits, permute, round_keys
from fastio.order.sampler import EpochOrder, Sampler, SamplerSpec
from fastio.words import count

__all__ = ["MAX_PERIOD", "MIX_ALGORITHM", "MixOrder", "MixSampler", "MixSchedule", "check_positions", "check_shares",
           "integer_weights", "window_spread"]

MIX_ALGORITHM = "deficit-v1"
"""Names the schedule :class:`MixSchedule` computes."""
MAX_PERIOD = 1 << 16
"""Longest period of the source schedule; weights that need more are apportioned over this many positions
(each proportion then within 1/MAX_PERIOD of the asked one). A share below 1/MAX_PERIOD cannot be represented
and is refused (:func:`check_shares`)."""
_LAST_STREAM = 2**63 - 1  # the last stream position a schedule's int64 arithmetic counts
_ORDERS = 64  # per-source epoch orders kept beyond two per source (a tiny source goes through many of its
# epochs per chunk; with more sources than this a lookup rebuilt every source's order: 0.4 s at 1,000)


def check_shares(names: Sequence[str], weights: Sequence[float], note: str = "") -> None:
    """ValueError naming the first source whose share ``w / sum(weights)`` is below ``1 / MAX_PERIOD``, the
    smallest share one period of the schedule can hold (it was raised to that share without a word before);
    ``note`` ends the message (e.g. where the weights came from)."""
    total = float(sum(weights))
    for name, w in zip(names, weights):
        if w * MAX_PERIOD < total * (1 - 1e-12):
            raise ValueError(f"weight {w:g} of mixture source {name!r} is a share of {w / total:.3g}, below the "
                             f"smallest share a mixture can represent, 1/{MAX_PERIOD} = {1 / MAX_PERIOD:.3g}: give it "
                             f"a weight of at least {_round_up((total - w) / (MAX_PERIOD - 1)):.6g} (with the other "
                             f"weights as they are) or leave the source out{note}")


def _round_up(x: float, digits: int = 6) -> float:
    """``x`` rounded up to ``digits`` significant digits (a suggested least weight printed with ``:.6g`` must not
    fall below the least one)."""
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return math.ceil(x / unit * (1 - 1e-12)) * unit


def integer_weights(weights: Sequence[float]) -> tuple[int, ...]:
    """Positive integers in the proportions of ``weights`` (positive numbers, each a share of at least
    1/MAX_PERIOD: :func:`check_shares`), summing to at most MAX_PERIOD: exact for rationals with small
    denominators (``3, 1`` -> ``3, 1``; ``0.7, 0.3`` -> ``7, 3``), else the largest-remainder apportionment of
    MAX_PERIOD (every source keeps at least 1)."""
    fr = [Fraction(w).limit_denominator(MAX_PERIOD) for w in weights]
    if all(f > 0 for f in fr):
        lcm = math.lcm(*(f.denominator for f in fr))
        ints = [int(f * lcm) for f in fr]
        g = math.gcd(*ints)
        ints = [i // g for i in ints]
        if sum(ints) <= MAX_PERIOD and all(abs(i / sum(ints) - w / sum(weights)) < 1e-12 for i, w in zip(ints, weights)):
            return tuple(ints)
    total = float(sum(weights))
    quota = [w / total * MAX_PERIOD for w in weights]
    ints = [max(1, int(q)) for q in quota]
    order = sorted(range(len(quota)), key=lambda s: quota[s] - int(quota[s]), reverse=True)
    for k in range(MAX_PERIOD - sum(ints)):  # the largest remainders first
        ints[order[k % len(order)]] += 1
    while sum(ints) > MAX_PERIOD:  # only when shares at 1/MAX_PERIOD were rounded up to 1 position
        s = max(range(len(ints)), key=lambda s: ints[s])
        ints[s] -= 1
    return tuple(ints)


@lru_cache(maxsize=16)
def _period(n: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One period of the largest-deficit schedule for integer weights ``n``: the source of each position and
    how many positions of that source come before it in the period.

    Each source's deficit ``n_s * (q + 1) - W * C_s(q)`` is kept in one array: every position adds ``n_s`` to
    all of them and takes ``W`` from the one it picks, whose ``argmax`` is the first largest (ties to the earlier
    source). O(W) numpy steps of O(sources) each; a Python ``max`` over the sources per position took about a
    second per 100 sources."""
    w = sum(n)
    steps = np.asarray(n, np.int64)
    deficit = steps.copy()  # at position 0: n_s * 1 - W * 0
    argmax = deficit.argmax
    picks = [0] * w
    for q in range(w):
        s = argmax()
        picks[q] = s
        deficit[s] -= w
        deficit += steps
    src = np.array(picks, np.int64)
    rank = _ranks(src, len(n))
    src.flags.writeable = rank.flags.writeable = False
    return src, rank


def _ranks(src: np.ndarray, sources: int) -> np.ndarray:
    """For each entry of ``src``, how many earlier entries hold the same source."""
    order = np.argsort(src, kind="stable")
    first = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=sources))[:-1]])
    rank = np.empty(src.size, np.int64)
    rank[order] = np.arange(src.size, dtype=np.int64) - first[src[order]]
    return rank


def _u63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def check_positions(positions: Sequence[Any], what: str = "weights") -> None:
    """ValueError naming the first entry of a schedule (``what[i]``) whose position is not an integer, the first
    not 0, or one not after the entry before it: a schedule starts at 0 and its positions strictly increase."""
    for i, pos in enumerate(positions):
        if isinstance(pos, bool) or not isinstance(pos, numbers.Integral) or pos < 0:
            raise ValueError(f"{what}[{i}]: the position must be an integer >= 0 (samples since training began), "
                             f"got {pos!r}")
        if i == 0 and pos != 0:
            raise ValueError(f"{what}[0]: a schedule starts at position 0, got {pos!r}")
        if pos > _LAST_STREAM:
            raise ValueError(f"{what}[{i}]: position {pos!r} is past 2**63 - 1, the last stream position a mixture's "
                             "order counts")
        if i and pos <= positions[i - 1]:
            raise ValueError(f"{what}[{i}]: position {pos!r} is not after the previous entry's {positions[i - 1]!r} "
                             "(a schedule's positions strictly increase)")


def _check_weights(names: Sequence[str], weights: Sequence[float], note: str = "") -> None:
    for name, w in zip(names, weights):
        if isinstance(w, bool) or not (isinstance(w, numbers.Real) and math.isfinite(w) and w > 0):
            raise ValueError(f"weight of {name!r} must be a positive number, got {w!r}{note}")
    check_shares(names, weights, note)


@dataclass(frozen=True)
class _Phase:
    """One phase of a schedule: the periodic largest-deficit sequence of ``counts`` from ``offset`` on, filling
    stream positions from ``start``; ``base``: each source's samples delivered before ``start``."""

    start: int
    counts: tuple[int, ...]
    offset: int
    base: np.ndarray

    @property
    def period(self) -> int:
        return sum(self.counts)

    def before(self, q: int) -> np.ndarray:
        """Positions of each source in ``[0, q)`` of the periodic sequence."""
        src, _ = _period(self.counts)
        return (q // self.period) * np.asarray(self.counts, np.int64) + np.bincount(
            src[:q % self.period], minlength=len(self.counts))

    def delivered(self, stream: int) -> np.ndarray:
        """Each source's samples delivered before stream position ``stream`` (in this phase or before it)."""
        return self.base + self.before(self.offset + stream - self.start) - self.before(self.offset)

    def sources(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` at stream positions ``stream`` (all in this phase)."""
        src, rank = _period(self.counts)
        # q = offset + stream - start, its turns of the period and place in it, without forming q: offset +
        # stream passes int64 in the last positions of the stream (2**63 - 1 is the last a mixture counts)
        turns, r = np.divmod(np.asarray(stream, np.int64) - self.start, self.period)
        r = r + self.offset
        carry = r >= self.period  # offset < period: one turn more at most
        turns, r = turns + carry, r - self.period * carry
        s = src[r]
        first = self.base - self.before(self.offset)
        return s, turns * np.asarray(self.counts, np.int64)[s] + rank[r] + first[s]


@dataclass(frozen=True)
class MixSchedule:
    """Which source fills each position of each mixture epoch, and its running count of that source.

    A pure function of (seed, names, weights, changes, fingerprints, samples_per_epoch). Without ``changes`` the
    weights hold everywhere; each change ``(position, weights)`` starts a phase at that stream position (see the
    module docstring).
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    """Relative weights (positive) from stream position 0; only their proportions matter."""
    fingerprints: tuple[str, ...]
    samples_per_epoch: int
    seed: int = 0
    changes: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """Later phases: ``(stream position, weights)``, positions after 0 and strictly increasing."""

    def __post_init__(self):
        if not (len(self.names) == len(self.weights) == len(self.fingerprints)) or not self.names:
            raise ValueError("names, weights and fingerprints must be non-empty and of the same length")
        _check_weights(self.names, self.weights)
        check_positions([0, *(pos for pos, _ in self.changes)], "schedule")  # schedule[0]: weights, at 0
        for i, (pos, weights) in enumerate(self.changes):
            if len(weights) != len(self.names):
                raise ValueError(f"changes[{i}] (position {pos}): {count(len(weights), 'weight')} for "
                                 f"{count(len(self.names), 'source')}")
            _check_weights(self.names, weights, f" (the schedule's entry at position {pos})")
        if self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be >= 1, got {self.samples_per_epoch!r}")

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Positions of each source in one period of the first phase (:func:`integer_weights`)."""
        return integer_weights(self.weights)

    @property
    def period(self) -> int:
        return sum(self.counts)

    @cached_property
    def phase(self) -> int:
        """Where epoch 0 starts in the first phase's periodic sequence."""
        return self._offset(self.counts, 0)

    def _offset(self, counts: tuple[int, ...], start: int) -> int:
        key = f"fastio-mix:{MIX_ALGORITHM}:{self.seed}:{self.names}:{counts}:{self.fingerprints}"
        return _u63(key if start == 0 else f"{key}:{start}") % sum(counts)

    @cached_property
    def _phases(self) -> tuple[_Phase, ...]:
        first = _Phase(0, self.counts, self.phase, np.zeros(len(self.names), np.int64))
        phases = [first]
        for start, weights in self.changes:
            counts = integer_weights(weights)
            base = phases[-1].delivered(start)
            phases.append(_Phase(start, counts, self._offset(counts, start), base))
        for p in phases:
            p.base.flags.writeable = False
        return tuple(phases)

    @cached_property
    def starts(self) -> np.ndarray:
        """The stream position where each phase starts (the first: 0)."""
        return np.array([p.start for p in self._phases], np.int64)

    def phase_of(self, stream: np.ndarray) -> np.ndarray:
        """The phase (0, 1, ...) of each of stream positions ``stream``."""
        return np.searchsorted(self.starts, np.asarray(stream, np.int64), "right") - 1

    def sources(self, epoch: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` for positions ``pos`` of mixture epoch ``epoch``: the source filling each one and how
        many samples of that source the stream delivered before it (since position 0 of mixture epoch 0)."""
        stream = epoch * self.samples_per_epoch + np.asarray(pos, np.int64)
        if len(self._phases) == 1:
            return self._phases[0].sources(stream)
        which = self.phase_of(stream)
        s, k = np.empty(stream.shape, np.int64), np.empty(stream.shape, np.int64)
        for i in np.unique(which).tolist():
            sel = which == i
            s[sel], k[sel] = self._phases[i].sources(stream[sel])
        return s, k

    def delivered(self, stream: int) -> np.ndarray:
        """Each source's samples in stream positions ``[0, stream)`` (O(log phases))."""
        return self._phases[int(self.phase_of(np.array([stream]))[0])].delivered(int(stream))

    def per_epoch(self, epoch: int) -> np.ndarray:
        """Samples of each source in mixture epoch ``epoch`` (O(sources + log phases))."""
        start = epoch * self.samples_per_epoch
        return self.delivered(start + self.samples_per_epoch) - self.delivered(start)


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's own order in a mixture (by name: adding a source leaves the others' orders)."""
    return _u63(f"fastio-mix-source:{seed}:{name}")


class MixOrder:
    """The delivery order of one mixture epoch, lazily: ``order[positions]`` are mixture ids (see the module
    docstring); ``len(order)`` is the epoch's samples. Same interface as :class:`~fastio.order.sampler.EpochOrder`."""

    def __init__(self, sampler: MixSampler, epoch: int):
        self.sampler, self.epoch = sampler, epoch

    def __len__(self) -> int:
        return self.sampler.schedule.samples_per_epoch

    def __repr__(self) -> str:
        return f"MixOrder(epoch={self.epoch}, samples={len(self)})"

    def __getitem__(self, key) -> np.ndarray | int:
        n = len(self)
        if isinstance(key, slice):
            return self._at(np.arange(*key.indices(n), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            p = int(key) + n if key < 0 else int(key)
            if not 0 <= p < n:
                raise IndexError(f"position {int(key)} out of range for a mixture epoch of {count(n, 'sample')}")
            return int(self._at(np.array([p], np.int64))[0])
        pos = np.asarray(key).astype(np.int64, copy=False)
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            raise IndexError(f"positions out of range for a mixture epoch of {count(n, 'sample')}")
        return self._at(pos)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def sources(self, pos: np.ndarray) -> np.ndarray:
        """The source filling each of positions ``pos``."""
        return self.sampler.schedule.sources(self.epoch, pos)[0]

    @cached_property
    def _first_cycle(self) -> np.ndarray:
        """Each source's own epoch at its first delivery in this mixture epoch (the count before it // size)."""
        schedule = self.sampler.schedule
        return schedule.delivered(self.epoch * schedule.samples_per_epoch) // np.asarray(self.sampler.sizes, np.int64)

    @cached_property
    def repeats(self) -> bool:
        """Whether a source crosses one of its own epochs' ends within this mixture epoch, so that some of its
        samples come twice (or more) in it: only then do :meth:`draw_keys` differ from the ids."""
        schedule, n = self.sampler.schedule, self.sampler.schedule.samples_per_epoch
        before, after = schedule.delivered(self.epoch * n), schedule.delivered((self.epoch + 1) * n)
        sizes = np.asarray(self.sampler.sizes, np.int64)
        return bool(((after > before) & ((after - 1) // sizes > before // sizes)).any())

    def draw_keys(self, pos: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        """The keys the random draws of the samples at positions ``pos`` (delivered as ``ids``) hash, or None
        where they are the ids: ``id + c * total`` (``total``: every source's samples), where ``c`` counts how
        many of its own epochs the source began in this mixture epoch before this delivery. A sample a source
        delivers again in the same mixture epoch is in another of its own epochs, so its draws differ; ``c = 0``
        (a delivery in the own epoch the source was in when this mixture epoch began) keeps the id's draws."""
        if not self.repeats:
            return None
        src, k = self.sampler.schedule.sources(self.epoch, np.asarray(pos, np.int64))
        cycle = k // np.asarray(self.sampler.sizes, np.int64)[src] - self._first_cycle[src]
        return np.asarray(ids, np.int64) + cycle * sum(self.sampler.sizes)

    def _at(self, pos: np.ndarray) -> np.ndarray:
        flat = pos.reshape(-1)
        sampler = self.sampler
        src, k = sampler.schedule.sources(self.epoch, flat)
        size = sampler.size_array[src]
        epochs, offsets = k // size, k % size
        if sampler.spec.shuffle == "global":
            local = sampler.global_orders(src, epochs, offsets)
        else:
            local = np.empty(flat.size, np.int64)
            for s, e, part in _groups(src, epochs):
                local[part] = sampler.source_order(s, e)[offsets[part]]
        return sampler.unit_ids(src, epochs, local).reshape(pos.shape)


def _groups(src: np.ndarray, epochs: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """``(source, epoch, indices)`` for each distinct pair of ``src[i], epochs[i]``: one sort, not a scan of the
    positions per source (a thousand sources were a thousand scans per lookup)."""
    if not src.size:
        return []
    order = np.lexsort((epochs, src))
    s, e = src[order], epochs[order]
    cuts = np.flatnonzero((s[1:] != s[:-1]) | (e[1:] != e[:-1])) + 1
    parts = np.split(order, cuts)
    return list(zip(s[np.r_[0, cuts]].tolist(), e[np.r_[0, cuts]].tolist(), parts))


@lru_cache(maxsize=4096)
def _samples_keys(seed: int, epoch: int, fingerprint: str) -> tuple[np.uint64, ...]:
    """The round keys of a source's own ``global`` order in its epoch ``epoch`` (as :class:`EpochOrder` draws them)."""
    return round_keys(seed, "global", epoch, fingerprint, "samples")


@dataclass(frozen=True)
class MixSampler(Sampler):
    """A :class:`~fastio.order.sampler.Sampler` whose epochs are mixture epochs (``schedule``) over sources of
    ``source_shards`` (shard sizes per source); plans, batches, rank slicing and resume arithmetic are the
    sampler's. ``shard_sizes`` is ``(samples_per_epoch,)``: the epoch's length, which is all plans use."""

    schedule: MixSchedule | None = None
    source_shards: tuple[tuple[int, ...], ...] = ()

    _orders: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    _orders_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def make(cls, spec: SamplerSpec, schedule: MixSchedule, source_shards: Sequence[Sequence[int]], world_size: int = 1,
             rank: int = 0) -> MixSampler:
        shards = tuple(tuple(int(x) for x in s) for s in source_shards)
        if len(shards) != len(schedule.names) or any(sum(s) < 1 for s in shards):
            raise ValueError("every source of a mixture needs at least one sample")
        fp = hashlib.sha256(repr((schedule.names, schedule.fingerprints)).encode()).hexdigest()[:16]
        return cls(spec, (schedule.samples_per_epoch,), fp, world_size, rank, schedule=schedule, source_shards=shards)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sum(s) for s in self.source_shards)

    @cached_property
    def base(self) -> tuple[int, ...]:
        """Mixture id of each source's first sample."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.sizes)[:-1]]))

    def check_epoch(self, epoch: int) -> None:
        """ValueError where mixture epoch ``epoch`` ends past stream position ``2**63 - 1``: the schedule counts
        stream positions (``epoch * samples_per_epoch + position``) in int64; or where its draw keys would leave
        int64 (:meth:`_check_draw_keys`)."""
        n = self.schedule.samples_per_epoch
        end = (epoch + 1) * n - 1
        if end > _LAST_STREAM:
            raise ValueError(f"epoch {epoch} of a mixture of {count(n, 'sample')} per epoch ends at stream position "
                             f"{end}, past 2**63 - 1, the last one a mixture's order counts (its last epoch is "
                             f"{(_LAST_STREAM + 1) // n - 1})")
        self._check_draw_keys(epoch)

    def _check_draw_keys(self, epoch: int) -> None:
        """ValueError naming ``epoch`` and the source where :meth:`MixOrder.draw_keys` of a delivery in it (``id +
        c * total``, ``c``: the source's own epochs begun in it before the delivery) would leave int64: a tiny source
        filling most of a long epoch (numpy wrapped such keys silently: another sample's draws)."""
        n, total = self.schedule.samples_per_epoch, sum(self.sizes)
        before = self.schedule.delivered(epoch * n).tolist()
        after = self.schedule.delivered(min((epoch + 1) * n, _LAST_STREAM)).tolist()
        for name, b, a, size in zip(self.schedule.names, before, after, self.sizes):
            c = (a - 1) // size - b // size if a > b else 0
            if (c + 1) * total > _LAST_STREAM + 1:
                raise ValueError(f"epoch {epoch} is past the draw keys' reach: source {name!r} ({count(size, 'sample')}) "
                                 f"begins {c} of its own epochs in it, and a repeat's draw key (sample id + c * "
                                 f"{total}) must fit int64: lower samples_per_epoch ({n}) or that source's weight")

    def order(self, epoch: int) -> MixOrder:
        return MixOrder(self, epoch)

    @cached_property
    def size_array(self) -> np.ndarray:
        """:attr:`sizes` as int64."""
        return np.asarray(self.sizes, np.int64)

    @cached_property
    def base_array(self) -> np.ndarray:
        """:attr:`base` as int64."""
        return np.asarray(self.base, np.int64)

    def unit_ids(self, src: np.ndarray, epochs: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The ids the order hands out for samples ``local`` of sources ``src`` in their own epochs ``epochs``
        (arrays of one length): the mixture ids ``base[src] + local`` (a kind whose units change with the source's
        epoch adds it)."""
        return self.base_array[src] + local

    @cached_property
    def _source_seeds(self) -> tuple[int, ...]:
        return tuple(source_seed(self.spec.seed, name) for name in self.schedule.names)

    @cached_property
    def _domain_bits(self) -> np.ndarray:
        return np.array([domain_bits(n) for n in self.sizes], np.int64)

    def _source_spec(self, s: int) -> SamplerSpec:
        return SamplerSpec(seed=self._source_seeds[s], shuffle=self.spec.shuffle, block_shards=self.spec.block_shards)

    def global_orders(self, src: np.ndarray, epochs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """``source_order(src[j], epochs[j])[offsets[j]]`` for every j, in one evaluation (``global`` shuffle):
        every element's own size, domain and round keys (what :class:`EpochOrder` computes one epoch at a time)."""
        if not src.size:
            return np.empty(0, np.int64)
        groups = _groups(src, epochs)
        keys = np.array([_samples_keys(self._source_seeds[s], e, self.schedule.fingerprints[s]) for s, e, _ in groups],
                        np.uint64)
        which = np.empty(src.size, np.int64)
        for i, (_, _, part) in enumerate(groups):
            which[part] = i
        return permute(offsets, self.size_array[src], self._domain_bits[src],
                       tuple(keys[which, r] for r in range(keys.shape[1])), 0)

    def source_order(self, s: int, epoch: int) -> EpochOrder:
        """Source ``s``'s own order in its epoch ``epoch`` (its seed derived from the loader's and its name)."""
        key = (s, epoch)
        with self._orders_lock:
            if key in self._orders:
                self._orders.move_to_end(key)
                return self._orders[key]
        order = EpochOrder(self.source_shards[s], self._source_spec(s), epoch, self.schedule.fingerprints[s])
        with self._orders_lock:
            self._orders[key] = order
            while len(self._orders) > _ORDERS + 2 * len(self.sizes):  # O(shards): as source_shards
                self._orders.popitem(last=False)
        return order


def window_spread(sources: np.ndarray, weights: Sequence[float], count: int) -> np.ndarray:
    """For each source, ``max |c - w_s * n|`` over every window of ``n`` consecutive entries of ``sources`` and
    every n (c: the source's entries in the window, w_s: its share of ``weights``): how far any window strays
    from the proportions. It is the spread (max - min) of the prefix error, O(len * sources)."""
    share = np.asarray(weights, float) / float(sum(weights))
    out = np.empty(count)
    steps = np.arange(len(sources) + 1)
    for s in range(count):
        err = np.concatenate([[0], np.cumsum(sources == s)]) - share[s] * steps
        out[s] = err.max() - err.min()
    return out
