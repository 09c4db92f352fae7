"""Where a dataset's files are: the seam between :class:`fastio.Dataset` and storage (which only moves bytes:
the dataset layout, ``shards/``, ``samples.fxi``, ``splits.json``, is known here and in :mod:`fastio.dataset.manifest`).

:class:`LocalFiles` is a DEST directory read in place. :class:`RemoteFiles` is a DEST on an object store: its
manifest and ``.idx`` files are copied (verified) into the cache's metadata folder, and its shards are read
through the :class:`~fastio.storage.cache.ShardCache`, so the reader always gets local files to ``pread``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastio.dataset.manifest import (
    LOOK_AT,
    MANIFEST_NAME,
    MARKER_NAME,
    SHARDS_DIR,
    SPLITS_NAME,
    IndexRecord,
    Manifest,
    ShardRecord,
    empty_not_dataset,
    file_not_dataset,
    file_of_dataset,
    holds_datasets,
    holds_of,
    holds_pairs,
    images_not_dataset,
    load_manifest,
    media_not_dataset,
    missing_split,
    no_dataset,
    no_such_dataset,
    pairs_not_dataset,
    shard_pattern,
    split_names,
    split_unfinished,
    tar_not_dataset,
    tars_not_dataset,
    unfinished_marked,
)
from fastio.errors import DatasetError, StorageError
from fastio.storage.base import Storage, open_storage
from fastio.storage.cache import CachedShardFiles, CacheEntry, ShardCache, default_cache_dir
from fastio.storage.options import StorageOptions
from fastio.storage.url import local_or_url
from fastio.words import count

__all__ = ["DatasetFiles", "LocalFiles", "RemoteFiles", "dest_child", "dest_split_names", "names_object", "no_manifest",
           "open_files", "unfinished_split_of"]


class DatasetFiles:
    """What :class:`fastio.Dataset` asks of the place a DEST lives."""

    display: str | Path
    """The DEST for messages (a path, or the URL)."""
    cache_size: int | None = None
    """Bytes of the node-local cache shards are read through (None: shards are read in place)."""

    def load_manifest(self) -> Manifest:
        raise NotImplementedError

    def shard_path(self, record: ShardRecord) -> Path:
        """The local file a shard is read from (for a remote DEST: its cache entry, maybe not filled yet)."""
        raise NotImplementedError

    def idx_path(self, record: ShardRecord) -> Path:
        raise NotImplementedError

    def mask_path(self, record: ShardRecord) -> Path:
        """The local file of a chat shard's loss mask (``NAME.mask`` beside its ``.bin``; a remote DEST's fetched
        into the metadata folder, sha256-checked, the first time it is asked for)."""
        raise NotImplementedError

    def index_path(self, record: IndexRecord, what: str = "sample index") -> Path:
        """The local file of the dataset's sample index (``samples.fxi``), or of another file its manifest
        records the same way (``what``: the probe table)."""
        raise NotImplementedError

    def check(self, records: list[ShardRecord]) -> None:
        """Raise DatasetError naming the first shard or ``.idx`` that is missing (``samples.fxi`` is checked
        when :class:`~fastio.dataset.sample_table.SampleIndex` opens it)."""
        raise NotImplementedError

    def shard_files(self, records: list[ShardRecord], *, read_ahead: int = 2,
                    working_set: int | None = None) -> CachedShardFiles | None:
        """Descriptors for a reader (None: read :meth:`shard_path` directly); ``working_set``: the bytes of the
        cache they need at once, claimed beside this process's other readers of the same cache
        (:meth:`~fastio.storage.cache.CachedShardFiles.claim`)."""
        return None

    @contextmanager
    def local_shard(self, record: ShardRecord) -> Iterator[Path]:
        """A local file holding the shard for the duration of the ``with`` (filled and held if remote)."""
        yield self.shard_path(record)


class LocalFiles(DatasetFiles):
    def __init__(self, root: Path):
        self.root = self.display = Path(root)

    def load_manifest(self) -> Manifest:
        if not (self.root / MANIFEST_NAME).is_file():
            _refuse_split_parent(self.root, split_names(self.root) if self.root.is_dir() else None)
        return load_manifest(self.root)

    def shard_path(self, record: ShardRecord) -> Path:
        return self._local(record.tar_key)

    def idx_path(self, record: ShardRecord) -> Path:
        return self._local(record.idx_key)

    def index_path(self, record: IndexRecord, what: str = "sample index") -> Path:
        return self.root / record.name

    def mask_path(self, record: ShardRecord) -> Path:
        return self.shard_path(record).with_name(record.mask_name)

    def _local(self, key: str) -> Path:
        """A record's location as a local path (relative ones below DEST)."""
        if key.startswith("s3://"):
            raise DatasetError(f"{self.root}: shard {key} is on an object store: a local DEST reads local shards "
                               "(index it with an s3:// --dest)")
        return Path(key) if key.startswith("/") else self.root / key

    def check(self, records: list[ShardRecord]) -> None:
        # One listing per folder holding shards, not a stat per file (2 x 10^5 metadata calls per rank at scale).
        # A key's folder is made a Path once (a Path a key: ~10 us each, 2 a shard, in every Loader(): issue 45).
        listed: dict[Path, set[str]] = {}
        folders: dict[str, Path] = {}  # a key's text up to its last "/" -> that folder
        for r in records:
            for key in (r.tar_key, r.idx_key):
                name = key.rpartition("/")[2]
                head = key[:len(key) - len(name)]
                if name in ("", "."):  # a name Path would normalise: its own reading
                    path = self._local(key)
                    folder, name = path.parent, path.name
                elif head not in folders:
                    folder = folders[head] = self._local(key).parent
                else:
                    folder = folders[head]
                if folder not in listed:
                    try:
                        listed[folder] = {e.name for e in os.scandir(folder) if e.is_file()}
                    except OSError:
                        listed[folder] = set()
                if name not in listed[folder]:
                    where = name if key.startswith(f"{SHARDS_DIR}/") else self._local(key)
                    raise DatasetError(f"{self.root}: shard file {where} is missing")


def no_manifest(url: str, storage: Storage) -> DatasetError:
    """The error for a DEST ``url`` on an object store (``storage``: its client's options) whose manifest is
    missing, as :func:`~fastio.dataset.manifest.not_a_dataset` says it of a local path: its bucket does not exist
    (asked with one GET of a key that is never there: S3 names ``NoSuchBucket`` in the body), the URL is an object
    (a dataset's file: the dataset named), no object is below the prefix (no such dataset), the prefix holds
    datasets, tar shards or images (the first objects listed: which to open, the command that makes it a dataset),
    or it is not a fastio dataset: each in the words of a local folder's error."""
    bucket = url.split("/", 3)[2] if url.startswith("s3://") else None
    if bucket:
        try:
            open_storage(f"s3://{bucket}", storage.options).get(".fastio-no-such-key")
        except StorageError as err:
            if "NoSuchBucket" in str(err):
                return DatasetError(f"{url}: no such bucket {bucket!r} (at this endpoint)")
    options = storage.options
    return (shard_pattern(url, lambda folder: open_storage(folder, options).exists(MANIFEST_NAME))
            or _object_not_dataset(url, options) or _prefix_not_dataset(url, options) or no_dataset(url))


def names_object(url: str, options: StorageOptions | dict | None) -> bool:
    """Whether the ``s3://`` URL names an object (a dataset's ``manifest.json``), not a prefix: one HEAD."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return bool(name) and parent.count("/") >= 2 and open_storage(parent, options).exists(name)


def _object_not_dataset(url: str, options: StorageOptions) -> DatasetError | None:
    """The error for a URL that names an object (:func:`names_object`), not a prefix: a file of the dataset beside
    it (or above its ``shards/``), a tar shard of none, or another file; None where no such object exists."""
    if not names_object(url, options):
        return None
    parent = url.rstrip("/").rpartition("/")[0]
    owners = (parent, parent.rpartition("/")[0]) if parent.endswith(f"/{SHARDS_DIR}") else (parent,)
    for owner in owners:
        if _holds_dataset(open_storage(owner, options)):
            return file_of_dataset(url, owner)
    return tar_not_dataset(url, parent) if url.rstrip("/").lower().endswith(".tar") else file_not_dataset(url)


def _folders(storage: Storage) -> list[str]:
    """:meth:`Storage.folders` of a prefix for an error's words: none where the role may not list it (a policy
    that lets it list some prefixes only), the message then without what that look adds."""
    try:
        return storage.folders()
    except StorageError:
        return []


def _holds_dataset(folder: Storage) -> bool:
    """Whether the prefix ``folder`` holds a dataset's manifest or a ``split`` DEST's ``splits.json`` (HEADs)."""
    return folder.exists(MANIFEST_NAME) or folder.exists(SPLITS_NAME)


def _prefix_not_dataset(url: str, options: StorageOptions) -> DatasetError | None:
    """The error for a prefix with no object below it (no such dataset: the prefix beside it nearest a typo's
    name), a dataset's ``shards/`` prefix (naming the dataset), a prefix holding a run's marker (an unfinished run:
    its shards are not a source), Megatron pairs (directly in it), datasets (in the first 64 sub-prefixes: which
    to open), tar shards or images (in it or one folder below, as a local folder is looked at); None for any
    other. Lists the first :data:`~fastio.dataset.manifest.LOOK_AT` objects only."""
    parent, _, name = url.rstrip("/").rpartition("/")
    if name == SHARDS_DIR and parent.count("/") >= 2 and open_storage(parent, options).exists(MANIFEST_NAME):
        return file_of_dataset(url, parent, "folder")  # not `fastio index`: it refuses that folder
    storage = open_storage(url, options)
    keys = [o.key for o in storage.list("", limit=LOOK_AT)]
    if not keys:  # a bucket's root or a console's folder (a "name/" object), or nothing written below (a typo?)
        beside = _folders(open_storage(parent, options)) if parent.count("/") >= 2 else [name]
        if name in beside:
            return empty_not_dataset(url)
        return _missing_split_of(url, parent, name, options) or no_such_dataset(url, beside)
    if MARKER_NAME in keys:
        try:
            return unfinished_marked(url, storage.get(MARKER_NAME)[:64])  # a line fastio wrote
        except StorageError:  # deleted since it was listed (the run's cleanup): what else is there is no source
            return None
    pairs = holds_pairs({k for k in keys if "/" not in k and not k.startswith(".")})
    tops = [k.rsplit("/", 1)[-1] for k in keys if k.count("/") <= 1]
    holds = holds_of(tops)
    tars = "tar" in holds
    if pairs or tars:
        unfinished = unfinished_split_of(url, options)  # its shards are part of the source only: not `fastio index`
        if unfinished is not None:
            return unfinished
    if pairs:
        return pairs_not_dataset(url, url, "a folder of Megatron .bin/.idx pairs")
    datasets = [n for n in _folders(storage)[:64] if not n.startswith(".") and _holds_dataset(storage.child(n))]
    if datasets:  # before the tars: a dataset indexed in place holds its tars
        return holds_datasets(url, "dataset", datasets)
    if tars:
        return tars_not_dataset(url)
    return images_not_dataset(url) if "image" in holds else media_not_dataset(url, tops)


def _missing_split_of(url: str, parent: str, name: str, options: StorageOptions) -> DatasetError | None:
    """:func:`~fastio.dataset.manifest.missing_split` for an empty prefix ``url`` below ``parent`` (its
    ``splits.json`` read where there is one); None where ``parent`` is no ``split`` DEST."""
    if parent.count("/") < 2:  # url is a bucket
        return None
    try:
        names = dest_split_names(parent, options)
    except (DatasetError, StorageError):  # a splits.json that is not fastio's, or one we may not read
        return None
    return missing_split(url, parent, name, names)


def unfinished_split_of(url: str, options: StorageOptions | dict | None) -> DatasetError | None:
    """The error for an ``s3://`` prefix that is a split (``DEST/train``) of an unfinished ``fastio convert``
    (:func:`~fastio.dataset.manifest.unfinished_split` of a local folder); None for any other."""
    parent = url.rstrip("/").rpartition("/")[0]
    if parent.count("/") >= 2 and unfinished_convert(open_storage(parent, options)):
        return split_unfinished(url.rstrip("/"), parent)
    return None


def unfinished_convert(run: Storage) -> bool:
    """Whether the prefix ``run`` holds the marker of a ``fastio convert`` and neither a manifest nor a split list
    (its folders are the splits of an unfinished conversion)."""
    try:
        marker = run.get(MARKER_NAME)[:64]
    except StorageError:
        return False
    return marker.startswith(b"fastio convert") and not run.exists(MANIFEST_NAME) and not run.exists(SPLITS_NAME)


class RemoteFiles(DatasetFiles):
    """A DEST on an object store, read through a node-local :class:`ShardCache`."""

    def __init__(self, storage: Storage, cache: ShardCache):
        self.storage, self.cache = storage, cache
        self.display = storage.url
        self.cache_size = cache.size
        self.meta = cache.meta_dir(hashlib.sha256(storage.url.encode()).hexdigest()[:20], url=storage.url,
                                   subfolders=(SHARDS_DIR,))
        self._fetched: set[str] = set()  # metadata files verified in this process
        self._buckets: dict[str, Storage] = {}  # bucket roots of shards named by URL (fastio index --dest)

    def _where(self, key: str) -> tuple[Storage, str]:
        """The storage and key of a record's location (relative to DEST, or an ``s3://`` URL)."""
        if not key.startswith("s3://"):
            if key.startswith("/"):
                raise DatasetError(f"{self.storage.url}: shard {key} is a local path: an s3:// DEST reads shards "
                                   "on the object store")
            return self.storage, key
        bucket, rest = key[len("s3://"):].split("/", 1)
        if bucket not in self._buckets:
            self._buckets[bucket] = open_storage(f"s3://{bucket}", self.storage.options)
        return self._buckets[bucket], rest

    def load_manifest(self) -> Manifest:
        url = self.storage.url
        try:
            data = self.storage.get(MANIFEST_NAME)
        except StorageError as err:
            if err.missing:
                _refuse_split_parent(url, dest_split_names(url, self.storage.options))
                raise no_manifest(url, self.storage) from None
            raise
        self.cache.put_meta(self.meta / MANIFEST_NAME, data, self.storage.url_of(MANIFEST_NAME))
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
            self._fetch(*self._where(record.idx_key), path, record.idx_sha256, f"shard index {record.idx_name}")
            self._fetched.add(record.idx_name)
        return path

    def index_path(self, record: IndexRecord, what: str = "sample index") -> Path:
        path = self.meta / record.name
        if record.name not in self._fetched:
            self._fetch(self.storage, record.name, path, record.sha256, what)
            self._fetched.add(record.name)
        return path

    def mask_path(self, record: ShardRecord) -> Path:
        path = self.meta / SHARDS_DIR / record.mask_name
        if record.mask_name not in self._fetched:
            self._fetch(self.storage, f"{SHARDS_DIR}/{record.mask_name}", path, record.mask_sha256,
                        f"loss mask {record.mask_name}")
            self._fetched.add(record.mask_name)
        return path

    def check(self, records: list[ShardRecord]) -> None:
        # One listing per prefix holding shards (for a converted DEST: shards/), not a HEAD per file.
        listed: dict[tuple[int, str], dict[str, int]] = {}
        for r in records:
            for location, size in ((r.tar_key, r.bytes), (r.idx_key, None)):
                storage, key = self._where(location)
                parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
                if (id(storage), parent) not in listed:
                    listed[(id(storage), parent)] = {o.key: o.size for o in storage.list(parent)}
                found = listed[(id(storage), parent)]
                if key not in found:
                    where = key.rsplit("/", 1)[1] if location.startswith(f"{SHARDS_DIR}/") else storage.url_of(key)
                    raise DatasetError(f"{self.storage.url}: shard file {where} is missing")
                if size is not None and found[key] != size:
                    raise DatasetError(f"{storage.url_of(key)}: shard {r.name} is {count(found[key], 'byte')}, "
                                       f"the manifest says {size}")

    def _fetch(self, storage: Storage, key: str, path: Path, sha256: str, what: str) -> None:
        """Make ``path`` a verified copy of object ``key`` (kept across runs: a copy that still matches is reused)."""
        try:
            if hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
                return
        except FileNotFoundError:
            pass
        for _ in range(2):
            data = storage.get(key)
            if hashlib.sha256(data).hexdigest() == sha256:
                self.cache.put_meta(path, data, storage.url_of(key))
                return
        raise DatasetError(f"{storage.url_of(key)}: {what} does not match the manifest's checksum after 2 downloads")

    def _entries(self, records: list[ShardRecord]) -> tuple[Storage, list[CacheEntry]]:
        """The one storage the shards are read from, and their cache entries."""
        where = [self._where(r.tar_key) for r in records]
        storages = {id(st): st for st, _ in where}
        if len(storages) > 1:
            raise DatasetError(f"{self.storage.url}: shards lie in {count(len(storages), 'place')} (DEST and buckets "
                               f"{', '.join(sorted(self._buckets))}); one dataset reads shards from one")
        storage = next(iter(storages.values()), self.storage)
        return storage, [CacheEntry(r.name, key, r.sha256, r.bytes, r.xxh3_128) for r, (_, key) in zip(records, where)]

    def shard_files(self, records: list[ShardRecord], *, read_ahead: int = 2,
                    working_set: int | None = None) -> CachedShardFiles:
        storage, entries = self._entries(records)
        files = CachedShardFiles(self.cache, storage, entries, depth=read_ahead, threads=max(2, read_ahead))
        if working_set is not None:
            try:
                files.claim(working_set, self.storage.url)
            except BaseException:
                files.close()
                raise
        return files

    @contextmanager
    def local_shard(self, record: ShardRecord) -> Iterator[Path]:
        files = CachedShardFiles(self.cache, *self._entries([record]), depth=0)
        try:
            files.acquire(0)
            yield self.shard_path(record)
        finally:
            files.close()


def _refuse_split_parent(dest: str | Path, splits: list[str] | None) -> None:
    """DatasetError naming the splits a DEST written with ``split`` holds (it is not a dataset itself)."""
    if splits:
        raise holds_datasets(dest, "split", splits)


def open_files(dest: str | Path, *, cache_dir: str | Path | None = None, cache_size: int | str | None = None,
                storage_options: StorageOptions | dict | None = None) -> DatasetFiles:
    """The :class:`DatasetFiles` of a DEST: a local directory, or an ``s3://`` URL read through a cache in
    ``cache_dir`` (default :func:`~fastio.storage.cache.default_cache_dir`) bounded by ``cache_size``."""
    storage = open_storage(dest, storage_options)
    if not storage.remote:
        return LocalFiles(storage.location.path)
    return RemoteFiles(storage, ShardCache(cache_dir or default_cache_dir(), cache_size))


def dest_child(dest: str | Path, name: str) -> str | Path:
    """``dest/name`` for a folder or a URL (a split of a ``split`` DEST)."""
    where = local_or_url(dest)
    return where / name if isinstance(where, Path) else f"{where.rstrip('/')}/{name}"


def dest_split_names(dest: str | Path, storage_options: StorageOptions | dict | None = None) -> list[str] | None:
    """:func:`fastio.dataset.manifest.split_names` for a folder or a URL DEST."""
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
