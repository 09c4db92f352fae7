"""One interface for bytes by URL: :class:`Storage` over a local directory or an S3 prefix.

Keys are ``/``-separated paths relative to the storage's root (a DEST). Every failure is a
:class:`~fastio.errors.StorageError` naming the full URL of the object. Remote calls are retried on
transient faults (:mod:`fastio.storage.retry`); missing objects and refusals fail at once.
:mod:`fastio.storage._obstore` (and with it ``obstore``) is imported only when an S3 storage is opened.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fastio.errors import StorageError
from fastio.storage.atomic import fsync_dir, tmp_path_for
from fastio.storage.options import StorageOptions
from fastio.storage.retry import Permanent, retrying
from fastio.storage.url import Location, join_key, parse_location
from fastio.words import count

__all__ = ["LocalStorage", "ObjectInfo", "S3Storage", "Storage", "Versioned", "open_storage"]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    """Relative to the storage root."""
    size: int


@dataclass(frozen=True)
class Versioned:
    """One version of an object: its bytes, entity tag and the server's last-modified time."""

    data: bytes
    e_tag: str
    last_modified: datetime


class Storage(ABC):
    """Bytes under one root URL. ``url_of(key)`` names an object in messages."""

    location: Location

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def remote(self) -> bool:
        return self.location.remote

    def url_of(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key.lstrip('/')}" if key else self.url

    @abstractmethod
    def child(self, sub: str) -> Storage:
        """The storage rooted at ``sub`` below this one (same client and options)."""

    @abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or its bytes ``[start, end)``."""

    def get_buffer(self, key: str) -> bytes | memoryview:
        """The whole object as bytes or a read-only buffer (S3: no copy of what the client received)."""
        return self.get(key)

    @abstractmethod
    def head(self, key: str) -> int | None:
        """The object's size in bytes, or None if it does not exist."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart when large); readers never see a partial object."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object whole."""

    @abstractmethod
    def list(self, prefix: str = "", limit: int | None = None) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively), sorted by key; with ``limit``, the first
        ``limit`` of them (on S3, only the pages of the listing that hold them are asked for)."""

    @abstractmethod
    def folders(self, prefix: str = "") -> list[str]:
        """The names of the folders directly below ``prefix`` (on S3: the common prefixes of one listing with a
        ``/`` delimiter), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object (callers delete only what fastio wrote)."""

    def get_to_file(self, key: str, path: Path, size: int | None = None) -> int:
        """Download the object into ``path`` (created or truncated); returns its size. Every failure is a
        StorageError naming the object: one of the local file (a full or read-only disk) names ``path``'s folder
        too, not an OSError."""
        try:
            return self._get_to_file(key, Path(path), size)
        except OSError as err:
            raise StorageError(f"{self.url_of(key)}: cannot download into {Path(path).parent}: "
                               f"{err.strerror or err}", url=self.url_of(key)) from None

    def _get_to_file(self, key: str, path: Path, size: int | None) -> int:
        data = self.get(key)
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    def publish_dir(self, local: Path, keys_last: tuple[str, ...] = (),
                    before_last: Callable[[], None] | None = None, keys_first: tuple[str, ...] = ()) -> list[str]:
        """Upload every file under ``local`` to the same relative keys; the keys in ``keys_first`` are uploaded
        before all others, in that order (an unfinished-output marker: no other object is ever there without it),
        those in ``keys_last`` after all others, in that order (a manifest or commit marker makes the upload
        visible), after calling ``before_last`` (a writer's last chance to refuse, e.g. a lease check). Returns the
        keys."""
        local = Path(local)
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        head = [k for k in keys_first if k in files]
        last = [k for k in keys_last if k in files and k not in head]
        middle = [k for k in files if k not in last and k not in head]
        for k in head:
            self.put_file(k, local / k)
        self._put_many(local, middle)
        if before_last is not None:
            before_last()
        for k in last:
            self.put_file(k, local / k)
        return head + middle + last

    def _put_many(self, local: Path, keys: list[str]) -> None:
        for k in keys:
            self.put_file(k, local / k)


class LocalStorage(Storage):
    """A directory on a local or parallel file system."""

    def __init__(self, location: Location):
        self.location = location
        self.root: Path = location.path

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def child(self, sub: str) -> LocalStorage:
        path = self.root / sub.strip("/")
        return LocalStorage(Location("file", str(path), path=path))

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if start is None and end is None:
                    return f.read()
                f.seek(start or 0)
                return f.read(-1 if end is None else end - (start or 0))
        except OSError as err:
            raise StorageError(f"{self.url_of(key)}: cannot read: {err.strerror}", url=self.url_of(key),
                               missing=isinstance(err, FileNotFoundError)) from None

    def head(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return st.st_size if not os.path.isdir(self._path(key)) else None

    def put_file(self, key: str, path: Path) -> None:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path_for(final)
        shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        from fastio.storage.atomic import atomic_write_bytes

        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(final, data)

    def list(self, prefix: str = "", limit: int | None = None) -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.rglob("*"):
            rel = p.relative_to(self.root).as_posix()
            if rel.startswith(prefix) and p.is_file():
                out.append(ObjectInfo(rel, p.stat().st_size))
        return sorted(out, key=lambda o: o.key)[:limit]

    def folders(self, prefix: str = "") -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self._path(prefix)) if e.is_dir())
        except OSError:
            return []

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass


class S3Storage(Storage):
    """A prefix in an S3 or S3-compatible bucket, through the adapter :mod:`fastio.storage._obstore`."""

    def __init__(self, location: Location, options: StorageOptions):
        from fastio.storage._obstore import S3Client

        self.location, self.options = location, options
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        try:
            self._client = S3Client(location.bucket, options)
        except Permanent as err:
            raise StorageError(f"{location.url}: cannot configure the S3 client: {err}", url=location.url) from None
        self.retry_count = 0
        """Transient faults retried so far (all calls, all threads)."""

    def _key(self, key: str) -> str:
        return join_key(self.location.prefix, key)

    def child(self, sub: str) -> S3Storage:
        loc = self.location
        prefix = join_key(loc.prefix, sub.strip("/"))
        out = object.__new__(S3Storage)
        out.__dict__.update(self.__dict__)  # the same client, options and retry counter source
        out.location = Location(loc.scheme, f"{loc.scheme}://{join_key(loc.bucket, prefix)}", bucket=loc.bucket,
                                prefix=prefix)
        return out

    def _retrying(self, fn, key: str, what: str, deadline: bool = True) -> Any:
        o = self.options
        with self._rng_lock:
            rng = random.Random(self._rng.random())

        def counted(attempt: int, err: Exception) -> None:
            self.retry_count += 1

        return retrying(fn, url=self.url_of(key), what=what, retries=o.retries if deadline else o.upload_retries,
                        backoff_s=o.backoff_s,
                        backoff_max_s=o.backoff_max_s, deadline_s=o.deadline_s if deadline else None,
                        attempt_s=o.timeout_s + o.connect_timeout_s, rng=rng, on_retry=counted)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        what = "GET" if start is None and end is None else f"GET bytes {start or 0}-{'' if end is None else end - 1}"
        full = self._key(key)
        data = self._retrying(lambda: self._client.get(full, start, end), key, what)
        if end is not None and len(data) != end - (start or 0):
            raise StorageError(f"{self.url_of(key)}: {what} returned {count(len(data), 'byte')}", url=self.url_of(key))
        return data

    def get_buffer(self, key: str) -> memoryview:
        full = self._key(key)
        return self._retrying(lambda: self._client.get_buffer(full), key, "GET")

    def head(self, key: str) -> int | None:
        full = self._key(key)
        return self._retrying(lambda: self._client.head(full), key, "HEAD")

    def put_if(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """Write a small object only if there is none (``if_absent``) or only if its entity tag is still
        ``if_match``; returns the new entity tag. A refused write is a StorageError with ``precondition`` set
        (at once, not retried). A retry after a lost response can be refused by the write that did land, so a
        caller that sees a refusal compares what is stored with what it wrote (:meth:`get_versioned`)."""
        full = self._key(key)
        return self._retrying(lambda: self._client.put_if(full, data, if_absent=if_absent, if_match=if_match),
                              key, "conditional PUT")

    def get_versioned(self, key: str) -> Versioned | None:
        """The object with its entity tag and last-modified time, or None if there is none."""
        full = self._key(key)
        got = self._retrying(lambda: self._client.get_versioned(full), key, "GET")
        return None if got is None else Versioned(*got)

    def put_file(self, key: str, path: Path) -> None:
        full = self._key(key)
        self._retrying(lambda: self._client.put_file(full, Path(path)), key, "PUT", deadline=False)

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._key(key)
        self._retrying(lambda: self._client.put_bytes(full, data), key, "PUT")

    def list(self, prefix: str = "", limit: int | None = None) -> list[ObjectInfo]:
        base = self._key("")
        full = join_key(base, prefix) if prefix else (base + "/" if base else "")
        items = self._retrying(lambda: self._client.list(full, limit), prefix, "LIST")
        cut = len(base) + 1 if base else 0
        return sorted((ObjectInfo(k[cut:], s) for k, s in items if k.startswith(full)), key=lambda o: o.key)

    def folders(self, prefix: str = "") -> list[str]:
        full = self._key(prefix)
        keys = self._retrying(lambda: self._client.folders(full), prefix, "LIST")
        return sorted(k.rstrip("/").rpartition("/")[2] for k in keys)

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._retrying(lambda: self._client.delete(full), key, "DELETE")

    def presign(self, keys: list[str], expires_s: float = 3600.0) -> list[str]:
        """Presigned HTTP GET URLs of ``keys``, valid ``expires_s`` seconds (signed by the client, offline)."""
        full = [self._key(k) for k in keys]
        return self._retrying(lambda: self._client.presign(full, expires_s), keys[0] if keys else "", "presign")

    def _get_to_file(self, key: str, path: Path, size: int | None) -> int:
        """Ranged GETs of ``part_size`` bytes, ``concurrency`` at once, written in place with ``pwrite`` (the file
        is set to ``size`` bytes first, not truncated to zero)."""
        if size is None:
            size = self.head(key)
            if size is None:
                raise StorageError(f"{self.url_of(key)}: not found", url=self.url_of(key), missing=True)
        part = self.options.part_size
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)  # full size at once: a cache's space accounting sees it reserved
            if size <= part:
                data = self.get(key) if size else b""
                if len(data) != size:
                    raise StorageError(f"{self.url_of(key)}: object is {count(len(data), 'byte')}, expected {size}",
                                       url=self.url_of(key))
                os.pwrite(fd, data, 0)
                return size

            def fetch(start: int) -> None:
                os.pwrite(fd, self.get(key, start, min(size, start + part)), start)

            starts = range(0, size, part)
            with ThreadPoolExecutor(min(self.options.concurrency, len(starts)),
                                    thread_name_prefix="fastio-get") as pool:
                for f in [pool.submit(fetch, s) for s in starts]:
                    f.result()
            return size
        finally:
            os.close(fd)

    def _put_many(self, local: Path, keys: list[str]) -> None:
        if not keys:
            return
        with ThreadPoolExecutor(min(self.options.concurrency, len(keys)), thread_name_prefix="fastio-put") as pool:
            for f in [pool.submit(self.put_file, k, local / k) for k in keys]:
                f.result()


def open_storage(dest: str | Path | Location, storage_options: StorageOptions | dict[str, Any] | None = None) -> Storage:
    """The :class:`Storage` for a DEST: a local path / ``file://`` URL, or ``s3://bucket/prefix``.

    ``storage_options`` (a dict of :class:`~fastio.storage.options.StorageOptions` fields, or one) overrides
    what the environment says; it is ignored for local paths.
    """
    loc = dest if isinstance(dest, Location) else parse_location(dest)
    if loc.scheme == "file":
        return LocalStorage(loc)
    return S3Storage(loc, StorageOptions.resolve(storage_options))
