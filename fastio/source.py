"""Where a dataset's files are: the seam between :class:`fastio.Dataset` and storage (which only moves bytes:
the dataset layout, ``shards/``, ``samples.fxi``, ``splits.json``, is known here and in :mod:`fastio.manifest`).

:class:`LocalSource` is a DEST directory read in place. :class:`RemoteSource` is a DEST on an object store: its
manifest and ``.idx`` files are copied (verified) into the cache's metadata folder, and its shards are read
through the :class:`~fastio.storage.cache.ShardCache`, so the reader always gets local files to ``pread``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastio.errors import DatasetError, StorageError
from fastio.manifest import (
    MANIFEST_NAME,
    SHARDS_DIR,
    SPLITS_NAME,
    IndexRecord,
    Manifest,
    ShardRecord,
    load_manifest,
    split_names,
)
from fastio.storage.base import Storage, open_storage
from fastio.storage.cache import CachedShardFiles, CacheEntry, ShardCache, default_cache_dir
from fastio.storage.options import StorageOptions
from fastio.storage.url import parse_location

__all__ = ["DatasetSource", "LocalSource", "RemoteSource", "dest_child", "dest_split_names", "open_source"]


class DatasetSource:
    """What :class:`fastio.Dataset` asks of the place a DEST lives."""

    display: str | Path
    """The DEST for messages (a path, or the URL)."""

    def load_manifest(self) -> Manifest:
        raise NotImplementedError

    def shard_path(self, record: ShardRecord) -> Path:
        """The local file a shard is read from (for a remote DEST: its cache entry, maybe not filled yet)."""
        raise NotImplementedError

    def idx_path(self, record: ShardRecord) -> Path:
        raise NotImplementedError

    def index_path(self, record: IndexRecord) -> Path:
        """The local file of the dataset's sample index (``samples.fxi``)."""
        raise NotImplementedError

    def check(self, records: list[ShardRecord]) -> None:
        """Raise DatasetError naming the first shard or ``.idx`` that is missing (``samples.fxi`` is checked
        when :class:`~fastio.dsindex.SampleIndex` opens it)."""
        raise NotImplementedError

    def shard_files(self, records: list[ShardRecord], *, read_ahead: int = 2) -> CachedShardFiles | None:
        """Descriptors for a reader (None: read :meth:`shard_path` directly)."""
        return None

    @contextmanager
    def local_shard(self, record: ShardRecord) -> Iterator[Path]:
        """A local file holding the shard for the duration of the ``with`` (filled and held if remote)."""
        yield self.shard_path(record)


class LocalSource(DatasetSource):
    def __init__(self, root: Path):
        self.root = self.display = Path(root)

    def load_manifest(self) -> Manifest:
        if not (self.root / MANIFEST_NAME).is_file():
            _refuse_split_parent(self.root, split_names(self.root) if self.root.is_dir() else None)
        return load_manifest(self.root)

    def shard_path(self, record: ShardRecord) -> Path:
        return self.root / SHARDS_DIR / record.name

    def idx_path(self, record: ShardRecord) -> Path:
        return self.root / SHARDS_DIR / record.idx_name

    def index_path(self, record: IndexRecord) -> Path:
        return self.root / record.name

    def check(self, records: list[ShardRecord]) -> None:
        # One listing of the shard folder, not a stat per file (2 x 10^5 metadata calls per rank at scale).
        try:
            present = {e.name for e in os.scandir(self.root / SHARDS_DIR) if e.is_file()}
        except OSError:
            present = set()
        for r in records:
            for name in (r.name, r.idx_name):
                if name not in present:
                    raise DatasetError(f"{self.root}: shard file {name} is missing")


def _write_unique_tmp(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` through a temporary name of this process and thread (several processes of
    a node may write the same verified file at once; each rename is atomic)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class RemoteSource(DatasetSource):
    """A DEST on an object store, read through a node-local :class:`ShardCache`."""

    def __init__(self, storage: Storage, cache: ShardCache):
        self.storage, self.cache = storage, cache
        self.display = storage.url
        self.meta = cache.meta_dir(hashlib.sha256(storage.url.encode()).hexdigest()[:20])
        self._fetched: set[str] = set()  # metadata files verified in this process
        (self.meta / SHARDS_DIR).mkdir(exist_ok=True)

    def load_manifest(self) -> Manifest:
        url = self.storage.url
        try:
            data = self.storage.get(MANIFEST_NAME)
        except StorageError as err:
            if err.missing:
                _refuse_split_parent(url, dest_split_names(url, self.storage.options))
                raise DatasetError(f"{url}: not a fastio dataset (no {MANIFEST_NAME}; an interrupted conversion?)") \
                    from None
            raise
        _write_unique_tmp(self.meta / MANIFEST_NAME, data)
        try:
            return load_manifest(self.meta)
        except DatasetError as err:  # name the URL, not the cached copy
            raise DatasetError(str(err).replace(str(self.meta / MANIFEST_NAME), self.storage.url_of(MANIFEST_NAME))
                               .replace(str(self.meta), url)) from None

    def shard_path(self, record: ShardRecord) -> Path:
        return self.cache.path(record.sha256)

    def idx_path(self, record: ShardRecord) -> Path:
        """The ``.idx`` in the metadata folder, fetched (and verified) the first time it is asked for."""
        path = self.meta / SHARDS_DIR / record.idx_name
        if record.idx_name not in self._fetched:
            self._fetch(f"{SHARDS_DIR}/{record.idx_name}", path, record.idx_sha256, f"shard index {record.idx_name}")
            self._fetched.add(record.idx_name)
        return path

    def index_path(self, record: IndexRecord) -> Path:
        path = self.meta / record.name
        if record.name not in self._fetched:
            self._fetch(record.name, path, record.sha256, "sample index")
            self._fetched.add(record.name)
        return path

    def check(self, records: list[ShardRecord]) -> None:
        listed = {o.key: o.size for o in self.storage.list(SHARDS_DIR + "/")}
        for r in records:
            for key, size in ((f"{SHARDS_DIR}/{r.name}", r.bytes), (f"{SHARDS_DIR}/{r.idx_name}", None)):
                if key not in listed:
                    raise DatasetError(f"{self.storage.url}: shard file {key.rsplit('/', 1)[1]} is missing")
                if size is not None and listed[key] != size:
                    raise DatasetError(f"{self.storage.url_of(key)}: shard {r.name} is {listed[key]} bytes, "
                                       f"the manifest says {size}")

    def _fetch(self, key: str, path: Path, sha256: str, what: str) -> None:
        """Make ``path`` a verified copy of object ``key`` (kept across runs: a copy that still matches is reused)."""
        try:
            if hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
                return
        except FileNotFoundError:
            pass
        for _ in range(2):
            data = self.storage.get(key)
            if hashlib.sha256(data).hexdigest() == sha256:
                _write_unique_tmp(path, data)
                return
        raise DatasetError(f"{self.storage.url_of(key)}: {what} does not match the manifest's checksum after 2 downloads")

    def _entries(self, records: list[ShardRecord]) -> list[CacheEntry]:
        return [CacheEntry(r.name, f"{SHARDS_DIR}/{r.name}", r.sha256, r.bytes, r.xxh3_128) for r in records]

    def shard_files(self, records: list[ShardRecord], *, read_ahead: int = 2) -> CachedShardFiles:
        return CachedShardFiles(self.cache, self.storage, self._entries(records), depth=read_ahead,
                                threads=max(2, read_ahead))

    @contextmanager
    def local_shard(self, record: ShardRecord) -> Iterator[Path]:
        files = CachedShardFiles(self.cache, self.storage, self._entries([record]), depth=0)
        try:
            files.acquire(0)
            yield self.shard_path(record)
        finally:
            files.close()


def _refuse_split_parent(dest: str | Path, splits: list[str] | None) -> None:
    """DatasetError naming the splits a DEST written with ``split`` holds (it is not a dataset itself)."""
    if splits:
        children = " or ".join(str(dest_child(dest, name)) for name in splits)
        raise DatasetError(f"{dest}: holds the splits {', '.join(splits)}, not one dataset: open {children}")


def open_source(dest: str | Path, *, cache_dir: str | Path | None = None, cache_size: int | str | None = None,
                storage_options: StorageOptions | dict | None = None) -> DatasetSource:
    """The :class:`DatasetSource` of a DEST: a local directory, or an ``s3://`` URL read through a cache in
    ``cache_dir`` (default :func:`~fastio.storage.cache.default_cache_dir`) bounded by ``cache_size``."""
    storage = open_storage(dest, storage_options)
    if not storage.remote:
        return LocalSource(storage.location.path)
    return RemoteSource(storage, ShardCache(cache_dir or default_cache_dir(), cache_size))


def dest_child(dest: str | Path, name: str) -> str | Path:
    """``dest/name`` for a folder or a URL (a split of a ``split`` DEST)."""
    if isinstance(dest, Path) or not parse_location(dest).remote:
        return Path(dest) / name
    return f"{str(dest).rstrip('/')}/{name}"


def dest_split_names(dest: str | Path, storage_options: StorageOptions | dict | None = None) -> list[str] | None:
    """:func:`fastio.manifest.split_names` for a folder or a URL DEST."""
    storage = open_storage(dest, storage_options)
    if not storage.remote:
        return split_names(storage.location.path)
    if storage.exists(MANIFEST_NAME):
        return None
    try:
        data = storage.get(SPLITS_NAME)
    except StorageError as err:
        if err.missing:
            return None
        raise
    with tempfile.TemporaryDirectory(prefix="fastio-splits-") as tmp:
        (Path(tmp) / SPLITS_NAME).write_bytes(data)
        try:
            return split_names(Path(tmp))
        except DatasetError as err:
            raise DatasetError(str(err).replace(str(Path(tmp) / SPLITS_NAME), storage.url_of(SPLITS_NAME))) from None
