"""What a Loader over an object-store dataset needs in its node-local cache at once, by shuffle mode, and the
refusal when ``cache_size`` cannot hold it (at construction, not after a fill has waited for room in vain):

- ``global``: every batch draws from the whole dataset, so every shard is wanted at once: all of it;
- ``block``: two windows of ``block_shards`` shards (the largest ones, as a bound whatever the epoch's order):
  the batches that cross from one window into the next (or into the next epoch) hold shards of both; plus
  ``shard_read_ahead`` shards filled ahead;
- ``none``: two shards (a batch crossing from one into the next) plus the read-ahead.

The read-ahead is an optimisation: where the cache holds what the batches need but not the read-ahead on top,
it shrinks to the shards that fit (down to none), with one warning line on the ``fastio`` logger. Only a cache
that cannot hold the batches' own shards is refused, when the Loader is made; with it, an epoch never finds the
cache full of this process's own shards in use (a fill that did would fail at once:
:class:`fastio.storage.cache.ShardCache`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fastio.errors import StorageError
from fastio.progress import human_bytes
from fastio.words import agree, count

__all__ = ["check_shared_working_set", "check_working_set", "working_set_bytes"]


def _largest(shard_bytes: Sequence[int], count: int) -> int:
    """Bytes of the ``count`` largest shards."""
    sizes = np.sort(np.asarray(shard_bytes, np.int64))[::-1]
    return int(sizes[:max(count, 0)].sum())


def working_set_bytes(shard_bytes: Sequence[int], shuffle: str, block_shards: int, shard_read_ahead: int) -> int:
    """Shard bytes a reader of ``shuffle`` mode needs in the cache at the same time (see the module docstring)."""
    if shuffle == "global":
        return int(np.asarray(shard_bytes, np.int64).sum())
    return _largest(shard_bytes, 2 * (block_shards if shuffle == "block" else 1) + shard_read_ahead)


def _fitting_read_ahead(need, shard_read_ahead: int, cache_size: int) -> int:
    """The largest read-ahead ``r <= shard_read_ahead`` with ``need(r) <= cache_size`` (``need(0)`` fits; ``need``
    grows with ``r``: a binary search)."""
    low, high = 0, shard_read_ahead
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= cache_size else (low, mid - 1)
    return low


def _warn_shrunk(where: str, shard_read_ahead: int, fits: int, cache_size: int, what: str) -> None:
    logging.getLogger("fastio").warning(
        "%s: shard_read_ahead %d shrunk to %d: cache_size %s holds %s but not %s read ahead (raise "
        "cache_size, or set shard_read_ahead=%d to silence this)", where, shard_read_ahead, fits,
        human_bytes(cache_size), what, count(shard_read_ahead, "more shard"), fits)


def check_working_set(shard_bytes: Sequence[int], shuffle: str, block_shards: int, shard_read_ahead: int,
                      cache_size: int, url: str) -> int:
    """The shard read-ahead the cache has room for: ``shard_read_ahead``, or fewer with one warning line when the
    cache holds what the batches of ``shuffle`` read at once but not the read-ahead on top. A StorageError naming
    ``cache_size``, the bytes needed and what would fit when it cannot hold even that."""
    _refuse_unless_it_fits(shard_bytes, shuffle, block_shards, cache_size, url)
    fits = _fitting_read_ahead(lambda r: working_set_bytes(shard_bytes, shuffle, block_shards, r), shard_read_ahead,
                               cache_size)
    if fits < shard_read_ahead:
        what = human_bytes(working_set_bytes(shard_bytes, shuffle, block_shards, 0))
        _warn_shrunk(url, shard_read_ahead, fits, cache_size, f"what shuffle={shuffle!r} reads at once ({what})")
    return fits


def _refuse_unless_it_fits(shard_bytes: Sequence[int], shuffle: str, block_shards: int, cache_size: int,
                           url: str) -> None:
    """StorageError naming ``cache_size``, the bytes needed and what would fit, when the cache cannot hold the
    shards the batches of ``shuffle`` read at once (no read-ahead)."""
    need = working_set_bytes(shard_bytes, shuffle, block_shards, 0)
    if need <= cache_size:
        return
    what = {"global": "every shard: a global shuffle draws each batch from the whole dataset",
            "block": f"two windows of the {block_shards} largest {agree(block_shards, 'shard')} (a batch crossing "
                     "into the next window holds shards of both)",
            "none": "the two largest shards (a batch crossing into the next)"}[shuffle]
    # a size named is always enough for the mode it is named with
    fits = _largest_block_shards(shard_bytes, cache_size)
    smallest = human_bytes(_largest(shard_bytes, 2))  # block_shards=1, two windows
    block = "shuffle='block' with " if shuffle == "global" else ""
    if shuffle == "none" or (shuffle == "block" and block_shards == 1 and not fits):
        hint = f"raise cache_size to at least {smallest}"
    elif fits:
        hint = f"use {block}block_shards <= {fits}, or raise cache_size to {human_bytes(need)}"
    else:
        hint = (f"raise cache_size to {human_bytes(need)}, or use {block}block_shards=1 with cache_size at least "
                f"{smallest}")
    have, want = human_bytes(cache_size), human_bytes(need)
    if have == want:  # rounded alike: the bytes say which is larger
        have, want = count(cache_size, "byte"), count(need, "byte")
        hint = hint.replace(human_bytes(need), want)
    raise StorageError(f"{url}: cache_size {have} cannot hold what shuffle={shuffle!r} reads at once: {want} "
                       f"({what}); {hint}", url=url)


def _largest_block_shards(shard_bytes: Sequence[int], cache_size: int) -> int:
    """The largest ``block_shards`` whose two windows (no read-ahead) ``cache_size`` holds, 0 where not even one
    shard a window fits: one sort, not one per candidate (quadratic at 10^5 shards)."""
    top = np.cumsum(np.sort(np.asarray(shard_bytes, np.int64))[::-1])  # top[k - 1]: bytes of the k largest
    k = int(np.searchsorted(top, cache_size, "right"))  # the most of the largest shards that fit together
    return len(top) if k == len(top) else k // 2


def check_shared_working_set(sources: dict[str, Sequence[int]], shuffle: str, block_shards: int,
                             shard_read_ahead: int, cache_size: int, where: str) -> int:
    """The shard read-ahead each of the sources of a mixture that read through one cache (``where``: its
    directory) has room for: each reads its own working set at the same time (``sources``: name -> shard bytes).
    Fewer than ``shard_read_ahead`` with one warning line; a StorageError when ``cache_size`` cannot hold the
    sources' batches together even without read-ahead. Each one alone is checked by :func:`check_working_set`."""
    def need(r: int) -> int:
        return sum(working_set_bytes(sizes, shuffle, block_shards, r) for sizes in sources.values())

    if need(0) > cache_size:
        each = {name: working_set_bytes(sizes, shuffle, block_shards, 0) for name, sizes in sources.items()}
        parts = ", ".join(f"{name!r} {human_bytes(b)}" for name, b in each.items())
        raise StorageError(f"mixture sources {', '.join(map(repr, each))} read through one cache ({where}) at the "
                           f"same time: cache_size {human_bytes(cache_size)} cannot hold their working sets together "
                           f"({parts}: {human_bytes(need(0))} for shuffle={shuffle!r}); raise cache_size, or read "
                           "fewer shards at once (shuffle='block' with a smaller block_shards)", url=where)
    fits = _fitting_read_ahead(need, shard_read_ahead, cache_size)
    if fits < shard_read_ahead:
        _warn_shrunk(where, shard_read_ahead, fits, cache_size,
                     f"what mixture sources {', '.join(map(repr, sources))} read at once ({human_bytes(need(0))})")
    return fits
