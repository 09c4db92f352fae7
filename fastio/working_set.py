"""What a Loader over an object-store dataset needs in its node-local cache at once, by shuffle mode, and the
refusal when ``cache_size`` cannot hold it (at construction, not after a fill has waited for room in vain):

- ``global``: every batch draws from the whole dataset, so every shard is wanted at once: all of it;
- ``block``: two windows of ``block_shards`` shards (the largest ones, as a bound whatever the epoch's order):
  the batches that cross from one window into the next (or into the next epoch) hold shards of both; plus
  ``shard_read_ahead`` shards filled ahead;
- ``none``: two shards (a batch crossing from one into the next) plus the read-ahead.

A cache below that is refused when the Loader is made; with it, an epoch never finds the cache full of this
process's own shards in use (a fill that did would fail at once: :class:`fastio.storage.cache.ShardCache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastio.errors import StorageError
from fastio.progress import human_bytes

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


def check_working_set(shard_bytes: Sequence[int], shuffle: str, block_shards: int, shard_read_ahead: int,
                      cache_size: int, url: str) -> None:
    """StorageError naming ``cache_size``, the bytes needed and what would fit, when the cache cannot hold the
    working set of ``shuffle``."""
    need = working_set_bytes(shard_bytes, shuffle, block_shards, shard_read_ahead)
    if need <= cache_size:
        return
    what = {"global": "every shard: a global shuffle draws each batch from the whole dataset",
            "block": f"two windows of the {block_shards} largest shards (a batch crossing into the next window "
                     f"holds shards of both) + {shard_read_ahead} read ahead",
            "none": f"the two largest shards (a batch crossing into the next) + {shard_read_ahead} read ahead"}[shuffle]
    # a size named is always enough for the mode it is named with
    fits = [b for b in range(1, len(shard_bytes) + 1)
            if working_set_bytes(shard_bytes, "block", b, shard_read_ahead) <= cache_size]
    smallest = human_bytes(_largest(shard_bytes, 2 + shard_read_ahead))  # block_shards=1, two windows
    block = "shuffle='block' with " if shuffle == "global" else ""
    if shuffle == "none" or (shuffle == "block" and block_shards == 1 and not fits):
        hint = f"lower shard_read_ahead, or raise cache_size to at least {smallest}"
    elif fits:
        hint = f"use {block}block_shards <= {max(fits)}, or raise cache_size to {human_bytes(need)}"
    else:
        hint = (f"raise cache_size to {human_bytes(need)}, or use {block}block_shards=1 with cache_size at least "
                f"{smallest} (less with a lower shard_read_ahead)")
    have, want = human_bytes(cache_size), human_bytes(need)
    if have == want:  # rounded alike: the bytes say which is larger
        have, want = f"{cache_size} bytes", f"{need} bytes"
        hint = hint.replace(human_bytes(need), want)
    raise StorageError(f"{url}: cache_size {have} cannot hold what shuffle={shuffle!r} reads at once: {want} "
                       f"({what}); {hint}", url=url)


def check_shared_working_set(sources: dict[str, Sequence[int]], shuffle: str, block_shards: int,
                             shard_read_ahead: int, cache_size: int, where: str) -> None:
    """StorageError when the sources of a mixture that read through one cache (``where``: its directory) need
    more than ``cache_size`` together: each reads its own working set at the same time (``sources``: name ->
    shard bytes). Each one alone is checked by :func:`check_working_set`."""
    each = {name: working_set_bytes(sizes, shuffle, block_shards, shard_read_ahead) for name, sizes in sources.items()}
    need = sum(each.values())
    if need <= cache_size:
        return
    parts = ", ".join(f"{name!r} {human_bytes(b)}" for name, b in each.items())
    raise StorageError(f"mixture sources {', '.join(map(repr, each))} read through one cache ({where}) at the same "
                       f"time: cache_size {human_bytes(cache_size)} cannot hold their working sets together "
                       f"({parts}: {human_bytes(need)} for shuffle={shuffle!r}); raise cache_size, or read fewer "
                       "shards at once (shuffle='block' with a smaller block_shards)", url=where)
