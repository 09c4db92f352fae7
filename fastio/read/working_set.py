"""What a Loader over an object-store dataset needs in its node-local cache at once, and the refusal when
``cache_size`` cannot hold it (at construction, not after a fill has waited for room in vain).

A reader thread holds the shards of the batch it reads (every shard the batch has a sample in) until it has read
them all, and ``batches`` of them are read at once (the reader threads, at most the read-ahead batches + 2: see
:class:`Reading`). What one batch of ``batch_size`` samples can touch, whatever the epoch, the rank, a resume's
start or the padded last batch (which wraps to the epoch's start), by shuffle mode (a ``batch_size`` past the
epoch, which ``remainder='partial'`` takes, is one batch of the epoch's samples: every shard; a refusal names that
batch, the one the Loader makes, in the kind's units: a packed kind's batch of at least as many sequences as the
dataset has stored samples by what it reads, all of them):

- ``global``: every batch draws from the whole dataset, so every shard is wanted at once: all of it;
- ``block``: the windows of ``block_shards`` shards its positions span: the two at its ends (any shards of them:
  samples are shuffled within a window) and those wholly inside it, at most the smallest shards whose samples add
  up to ``batch_size - 2``; the ``batches x`` that many largest shards bound the bytes held at once (the windows
  are shuffled anew each epoch);
- ``none``: the consecutive shards its positions span (the order is fixed: the widest run of ``batch_size``
  positions, the epoch's end wrapping to its start), ``batches`` times.

A source of a mixture takes a batch's samples from up to two stretches of its own order (the padded last batch
wraps to the mixture epoch's start): ``runs=2``, twice the end windows. On top of that, ``shard_read_ahead``
shards filled ahead (the largest). The read-ahead is an optimisation: where the cache holds what the batches
need but not the read-ahead on top, it shrinks to the shards that fit (down to none), with one warning line on
the ``fastio`` logger. Only a cache that cannot hold the batches' own shards is refused, when the Loader is made,
with the smallest ``cache_size`` that holds them (and the ``block_shards`` or ``reader_threads`` that fit the
one given); with a cache accepted, an epoch never finds it full of this process's own shards in use (a fill that
did would fail at once: :class:`fastio.storage.cache.ShardCache`). One sort and prefix sums: O(S log S) for S
shards, whatever the samples.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastio.errors import StorageError
from fastio.progress import human_bytes, parse_size
from fastio.words import agree, count

__all__ = ["Reading", "Shards", "check_shared_working_set", "check_working_set"]


@dataclass(frozen=True)
class Reading:
    """How a Loader reads a dataset, as far as its working set goes."""

    shuffle: str
    block_shards: int
    batch_size: int
    """Stored samples one of this rank's batches reads at most: the Loader's ``batch_size`` times the kind's
    ``ReadFields.per_unit`` (a packed sequence reads several)."""
    batches: int = 1
    """Batches read at once: the reader threads, at most ``read_ahead + 2`` (the batches whose reads the feeder
    started ahead, and the one it waits for)."""
    runs: int = 1
    """Stretches of the dataset's order one batch covers: 1 for a dataset (its padded last batch wraps around its
    own order), 2 for a source of a mixture (its part of the mixture's padded last batch comes from the mixture
    epoch's end and its start)."""
    threads_hint: bool = True
    """Whether a refusal may name ``reader_threads`` (the Loader's batches at once are its reader threads)."""
    holders: int = 0
    """Reader threads that may each hold one of its shards at once, whatever the batch: a token reader's threads
    (each reads one shard at a time, of any source of a mixture: all of ``reader_threads``, where a source's
    stored-sample reader has its share of them)."""
    per_unit: int = 1
    """Stored samples one unit of the batch reads at most (``batch_size`` counts them all): for the words only."""
    unit: str = "sample"
    """What the Loader's ``batch_size`` counts (the kind's ``unit``: a packed kind's is a packed sequence): for the
    words only."""
    stored: str = "stored sample"
    """What the dataset's shards hold (a token dataset's: documents): for the words only."""
    block_hint: bool = True
    """Whether a refusal may suggest ``shuffle='block'`` (a packed kind reads ``global`` or ``none`` only: it
    suggests ``shuffle='none'`` instead)."""


class Shards:
    """The shards of a dataset that are ever read (those with samples), sorted once for the bounds below."""

    def __init__(self, shard_bytes: Sequence[int], shard_samples: Sequence[int]):
        size = np.asarray(shard_bytes, np.int64).reshape(-1)
        samples = np.asarray(shard_samples, np.int64).reshape(-1)
        if size.shape != samples.shape:
            raise ValueError(f"{len(size)} shard sizes for {len(samples)} shard sample counts")
        read = samples > 0
        self.size, self.samples = size[read], samples[read]  # in shard order
        self.count, self.n = len(self.size), int(self.samples.sum())
        self._top = np.concatenate([[0], np.cumsum(np.sort(self.size)[::-1])])  # _top[k]: bytes of the k largest
        self._fewest = np.cumsum(np.sort(self.samples))  # samples of the k + 1 smallest shards
        self._widest: dict[int, int] = {}

    @property
    def total(self) -> int:
        return int(self._top[-1])

    def largest(self, k: int) -> int:
        """Bytes of the ``k`` largest shards (all of them past their count)."""
        return int(self._top[min(max(k, 0), self.count)])

    def per_batch(self, reading: Reading, block_shards: int | None = None) -> int:
        """The most shards one batch can touch (see the module docstring)."""
        b = reading.batch_size
        if b >= self.n:
            return self.count
        bs = (reading.block_shards if block_shards is None else block_shards) if reading.shuffle == "block" else 1
        ends = 2 * reading.runs
        inside = int(np.searchsorted(self._fewest, b - ends, "right")) if b >= ends else 0
        return min(self.count, b, ends * bs + inside)

    def widest_run(self, b: int) -> int:
        """Bytes of the shards ``b`` consecutive positions of the fixed order touch at most (the end wrapping to the
        start): from each shard's last sample on, one searchsorted over the shards twice over."""
        if b >= self.n:
            return self.total
        if b not in self._widest:
            ends = np.cumsum(np.concatenate([self.samples, self.samples]))
            first = ends[:self.count] - 1  # each shard's last position
            last = np.searchsorted(ends, first + b - 1, "right")  # the shard of the batch's last position
            last = np.minimum(last, np.arange(self.count) + self.count - 1)  # round to its first shard: each once
            prefix = np.concatenate([[0], np.cumsum(np.concatenate([self.size, self.size]))])
            self._widest[b] = int((prefix[last + 1] - prefix[:self.count]).max()) if self.count else 0
        return self._widest[b]

    def need(self, reading: Reading, read_ahead: int = 0, block_shards: int | None = None) -> int:
        """Bytes the cache must hold at once: the shards of ``reading.batches`` batches and ``read_ahead`` more."""
        if reading.shuffle == "global":
            return self.total
        held = max(reading.batches * self.per_batch(reading, block_shards), reading.holders)
        bound = self.largest(held + read_ahead)
        if reading.shuffle == "none" and reading.runs == 1:
            batches = max(reading.batches * self.widest_run(reading.batch_size), self.largest(reading.holders))
            bound = min(bound, batches + self.largest(read_ahead))
        return bound


def _at_least(n: int) -> str:
    """``n`` bytes as :func:`human_bytes` writes them, rounded up: a size that, given as ``cache_size``, is not below
    ``n`` (``307.2 kB`` for 307,245 bytes would be: ``307.25 kB``), with a decimal more where rounding up to one
    would change what :func:`human_bytes` shows (``5.12 MB``, not ``5.2 MB`` beside a need shown as ``5.1 MB``)."""
    shown = human_bytes(n)
    unit = shown.split()[1]
    if unit == "B":
        return shown
    scale = 1000 ** ("B", "kB", "MB", "GB", "TB").index(unit)
    for digits in (1, 2, 3):
        q = -(-n * 10**digits // scale)  # rounded up, in integers
        text = f"{q // 10**digits}.{q % 10**digits:0{digits}d} {unit}"
        if parse_size(text, "cache_size") >= n and (digits > 1 or text == shown):
            return text
    return count(n, "byte")


def _fitting_read_ahead(need, shard_read_ahead: int, cache_size: int) -> int:
    """The largest read-ahead ``r <= shard_read_ahead`` with ``need(r) <= cache_size`` (``need(0)`` fits; ``need``
    grows with ``r``: a binary search)."""
    low, high = 0, shard_read_ahead
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= cache_size else (low, mid - 1)
    return low


def _largest_fitting(fits, high: int) -> int:
    """The largest ``k`` in ``1..high`` with ``fits(k)`` (``fits`` turns False once, as ``k`` grows), else 0."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _warn_shrunk(where: str, shard_read_ahead: int, fits: int, cache_size: int, what: str) -> None:
    logging.getLogger("fastio").warning(
        "%s: shard_read_ahead %d shrunk to %d: cache_size %s holds %s but not %s read ahead (raise "
        "cache_size, or set shard_read_ahead=%d to silence this)", where, shard_read_ahead, fits,
        human_bytes(cache_size), what, count(shard_read_ahead, "more shard"), fits)


def check_working_set(shards: Shards, reading: Reading, shard_read_ahead: int, cache_size: int, url: str) -> int:
    """The shard read-ahead the cache has room for: ``shard_read_ahead``, or fewer with one warning line when the
    cache holds what the batches of ``reading`` read at once but not the read-ahead on top. A StorageError naming
    ``cache_size``, the bytes needed and what would fit when it cannot hold even that."""
    _refuse_unless_it_fits(shards, reading, cache_size, url)
    fits = _fitting_read_ahead(lambda r: shards.need(reading, r), shard_read_ahead, cache_size)
    if fits < shard_read_ahead:
        what = human_bytes(shards.need(reading))
        _warn_shrunk(url, shard_read_ahead, fits, cache_size, f"what shuffle={reading.shuffle!r} reads at once ({what})")
    return fits


def _what(shards: Shards, reading: Reading) -> str:
    """What the batches of ``reading`` hold at once, in words."""
    if reading.shuffle == "global":
        return "every shard: a global shuffle draws each batch from the whole dataset"
    k, t = reading.batches, shards.per_batch(reading)
    batches = f"{k} {agree(k, 'batch', 'batches')} of {_batch(shards, reading)} read at once"
    if reading.shuffle == "block":
        return (f"the largest shards of {batches}, each touching up to {count(t, 'shard')} of the windows of "
                f"{reading.block_shards} it spans: a batch crossing into the next window holds shards of both")
    return f"the shards of {batches}, each touching up to {t} consecutive {agree(t, 'shard')}"


def _batch(shards: Shards, reading: Reading) -> str:
    """One batch of ``reading`` in words, the batch the Loader makes: its units (``8 samples``, ``2 packed sequences
    of up to 9 stored samples``); one of at least as many units as the dataset has stored samples (a ``batch_size``
    past the epoch, which ``remainder='partial'`` takes, or one counted as every shard anyway) by what it reads,
    the dataset's samples (``48 samples``, ``packed sequences reading all 120 documents``): how many units a packed
    epoch holds is not known here."""
    units, per = reading.batch_size // reading.per_unit, reading.per_unit
    if reading.unit == "sample" and per == 1:
        return count(min(units, shards.n), "sample")
    if units >= shards.n:
        return f"{agree(2, reading.unit)} reading all {count(shards.n, reading.stored)}"
    return count(units, reading.unit) + (f" of up to {count(per, reading.stored)}" if per > 1 else "")


def _refuse_unless_it_fits(shards: Shards, reading: Reading, cache_size: int, url: str) -> None:
    """StorageError naming ``cache_size``, the bytes needed and what would fit, when the cache cannot hold the
    shards the batches of ``reading`` read at once (no read-ahead)."""
    need = shards.need(reading)
    if need <= cache_size:
        return
    have, want = human_bytes(cache_size), human_bytes(need)
    if have == want:  # rounded alike: the bytes say which is larger
        have, want = count(cache_size, "byte"), count(need, "byte")
    raise StorageError(f"{url}: cache_size {have} cannot hold what shuffle={reading.shuffle!r} reads at once: {want} "
                       f"({_what(shards, reading)}); {_hint(shards, reading, cache_size, need)}", url=url)


def _hint(shards: Shards, reading: Reading, cache_size: int, need: int) -> str:
    """What to change: the ``block_shards`` (for ``block``, or ``block`` instead of ``global``) or the
    ``reader_threads`` that fit this cache, else the smallest ``cache_size`` (each size named holds what it is
    named for)."""
    block = reading if reading.shuffle == "block" else dataclasses.replace(reading, shuffle="block")
    fewer = "shuffle='block' with " if reading.shuffle == "global" else ""
    options = []
    if reading.shuffle != "none" and reading.block_hint:
        fits = _largest_fitting(lambda bs: shards.need(block, block_shards=bs) <= cache_size,
                                max(shards.count, 1))
        if fits:
            options.append(f"use {fewer}block_shards <= {fits}")
    if reading.shuffle != "global" and reading.batches > 1 and reading.threads_hint:
        def threads_of(k: int) -> Reading:  # read with k reader threads
            return dataclasses.replace(reading, batches=k, holders=min(reading.holders, k))

        threads = _largest_fitting(lambda k: shards.need(threads_of(k)) <= cache_size, reading.batches - 1)
        if threads:
            options.append(f"reader_threads={threads}")
    options.append(f"raise cache_size to at least {_at_least(need)}")
    if reading.shuffle != "none" and not reading.block_hint:
        none = shards.need(dataclasses.replace(reading, shuffle="none"))
        if none < need:
            options.append(f"use shuffle='none' with cache_size at least {_at_least(none)}")
    elif reading.shuffle != "none" and not options[:-1]:
        one = shards.need(block, block_shards=1)
        if one < need:
            options.append(f"use {fewer}block_shards=1 with cache_size at least {_at_least(one)}")
    if not options[0].startswith(("use ", "raise ")):
        options[0] = f"use {options[0]}"
    return ", or ".join(options)


def check_shared_working_set(sources: dict[str, Shards], readings: dict[str, Reading], shard_read_ahead: int,
                             cache_size: int, where: str) -> int:
    """The shard read-ahead each of the sources of a mixture that read through one cache (``where``: its
    directory) has room for: each reads its own working set at the same time (``sources``: name -> shards,
    ``readings``: name -> how it is read). Fewer than ``shard_read_ahead`` with one warning line; a StorageError
    when ``cache_size`` cannot hold the sources' batches together even without read-ahead. Each one alone is
    checked by :func:`check_working_set`."""
    def need(r: int) -> int:
        return sum(shards.need(readings[name], r) for name, shards in sources.items())

    shuffle = next(iter(readings.values())).shuffle
    block = all(r.block_hint for r in readings.values())
    fewer = ("shuffle='block' with a smaller block_shards" if block else "shuffle='none'") + ", fewer reader_threads"
    if need(0) > cache_size:
        each = {name: shards.need(readings[name]) for name, shards in sources.items()}
        parts = ", ".join(f"{name!r} {human_bytes(b)}" for name, b in each.items())
        raise StorageError(f"mixture sources {', '.join(map(repr, each))} read through one cache ({where}) at the "
                           f"same time: cache_size {human_bytes(cache_size)} cannot hold their working sets together "
                           f"({parts}: {human_bytes(need(0))} for shuffle={shuffle!r}); raise cache_size to at least "
                           f"{_at_least(need(0))}, or read fewer shards at once ({fewer})", url=where)
    fits = _fitting_read_ahead(need, shard_read_ahead, cache_size)
    if fits < shard_read_ahead:
        _warn_shrunk(where, shard_read_ahead, fits, cache_size,
                     f"what mixture sources {', '.join(map(repr, sources))} read at once ({human_bytes(need(0))})")
    return fits
