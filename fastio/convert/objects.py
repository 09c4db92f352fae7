"""Objects a conversion reads by URL (an image-text line's images at ``s3://bucket/key``, its JSONL at one), through
:mod:`fastio.storage`: the endpoint, region, credentials, retries and deadline of ``storage_options`` over the
environment's (:class:`fastio.storage.StorageOptions`), as for any ``s3://`` path of fastio.

- :func:`object_sizes`: the scan asks each object's size (one HEAD an object, :data:`HEAD_THREADS` at once, in
  the converting process), so a missing object is refused before DEST is touched and a part predicts its shards.
- :func:`read_object`: an object's bytes, fetched in the worker process that checks them (each worker holds one
  GET at a time: ``workers`` GETs at once), through one storage per bucket and process, opened on first use in
  that process (a client is never used across a fork).
- :func:`downloaded`: one object (a JSONL) in a temporary file while the caller reads it.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from fastio.errors import ConvertError
from fastio.storage import Storage, open_storage, parse_location

__all__ = ["HEAD_THREADS", "downloaded", "object_sizes", "read_object"]

HEAD_THREADS = 32
"""HEAD requests a scan keeps in flight."""

_STORES: dict[tuple[int, str, str], Storage] = {}


def _store(bucket: str, storage_options: Any) -> Storage:
    """The storage of ``s3://bucket`` in this process (opened once per process, bucket and options)."""
    options = repr(sorted(storage_options.items())) if isinstance(storage_options, dict) else repr(storage_options)
    key = (os.getpid(), bucket, options)
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = open_storage(f"s3://{bucket}", storage_options)
    return store


def read_object(url: str, storage_options: Any = None) -> bytes:
    """The bytes of the object at ``url`` (a StorageError names it: missing, refused, or failing past the
    retries)."""
    loc = parse_location(url)
    return _store(loc.bucket, storage_options).get(loc.prefix)


def object_sizes(urls: Iterable[str], storage_options: Any = None) -> Iterator[int | None]:
    """The size of each object at ``urls``, in their order (None: no such object), asked :data:`HEAD_THREADS` at
    once; a StorageError (naming the URL) is raised where its object's turn comes."""
    with ThreadPoolExecutor(HEAD_THREADS, thread_name_prefix="fastio-head") as pool:
        pending: deque = deque()
        try:
            for url in urls:
                loc = parse_location(url)
                pending.append(pool.submit(_store(loc.bucket, storage_options).head, loc.prefix))
                if len(pending) >= 4 * HEAD_THREADS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


@contextmanager
def downloaded(url: str, storage_options: Any = None) -> Iterator[Path]:
    """The object at ``url`` downloaded into a temporary file (named as the object), removed after; ConvertError
    naming the URL when there is no such object."""
    loc = parse_location(url)
    store = _store(loc.bucket, storage_options)
    size = store.head(loc.prefix) if loc.prefix else None
    if size is None:
        raise ConvertError(f"{url}: no such object")
    with tempfile.TemporaryDirectory(prefix="fastio-object-") as tmp:
        path = Path(tmp) / PurePosixPath(loc.prefix).name
        store.get_to_file(loc.prefix, path, size)
        yield path
