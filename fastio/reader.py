"""Sample bytes by dataset-wide index: byte ranges from the ``.idx`` (via ``Dataset.table``), ``os.pread``
on cached file descriptors, a thread pool so that reads run ahead of the consumer.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from struct import error as struct_error
from typing import Protocol

import numpy as np

from fastio.checksum import sha256_fd
from fastio.dataset import Dataset
from fastio.errors import DatasetError
from fastio.images import image_size

__all__ = ["ReadBatch", "Reader", "ShardFiles", "parse_label", "sample_where"]


class ShardFiles(Protocol):
    """A source of shard descriptors other than opening the shard paths (see ``Reader(files=...)``)."""

    def acquire(self, shard_index: int) -> int: ...

    def release(self, shard_index: int) -> None: ...

    def read_ahead(self, order: Iterable[int]) -> None: ...

    def close(self) -> None: ...


def sample_where(ds: Dataset, index: int) -> str:
    """``"DEST: shard NAME key KEY"`` for error messages."""
    return f"{ds.root}: shard {ds.shards[int(ds.table.shard[index])].name} key {ds.table.keys[index]!r}"


def parse_label(ds: Dataset, field: str, index: int, data: np.ndarray | bytes) -> int:
    """The integer class label stored as ASCII text in ``field`` of sample ``index``."""
    text = bytes(data)
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DatasetError(f"{sample_where(ds, index)}: field {field!r} is not an integer label: {text[:32]!r}") \
            from None


class ReadBatch:
    """The bytes of one batch: ``fields[f][j]`` is a uint8 array; ``sizes`` is [B, 2] (w, h) if requested."""

    def __init__(self, indices: np.ndarray, fields: dict[str, list[np.ndarray]], sizes: np.ndarray | None):
        self.indices, self.fields, self.sizes = indices, fields, sizes


class Reader:
    """Read fields of samples from a dataset's shards.

    Args:
        dataset: the opened dataset.
        fields: the fields to read (each must exist in the dataset).
        threads: reader threads; ``submit`` keeps up to this many batches being read at once.
        verify: check each shard's sha256 against the manifest the first time it is opened.
        size_field: also parse (width, height) from this image field's header, in the reader thread.
        files: where shard descriptors come from when not the shard paths themselves (an object-store DEST's
            cache: :class:`fastio.storage.cache.CachedShardFiles`, which verifies shards as it fills them);
            the reader holds the shards of a batch while it reads it, and releases them after.
    """

    def __init__(self, dataset: Dataset, fields: list[str], threads: int = 2, verify: bool = False,
                 size_field: str | None = None, files: ShardFiles | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        dataset.require_fields(list(fields))
        self.ds, self.fields, self.verify, self.size_field = dataset, list(fields), verify, size_field
        self.table = dataset.table
        self._files = files
        self._fds = _Descriptors()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fastio-read")
        # A reader dropped without close() still releases its threads and file descriptors.
        self._finalizer = weakref.finalize(self, _release, self._pool, self._fds, files)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._finalizer()

    def read_ahead_shards(self, batches: Iterable[np.ndarray]) -> None:
        """Tell the shard source the coming batches (dataset-wide indices, in order), so that it fetches their
        shards ahead of need; a no-op for shards read in place."""
        if self._files is not None:
            shard = self.table.shard
            self._files.read_ahead(int(s) for idx in batches for s in dict.fromkeys(shard[idx].tolist()))

    def submit(self, indices: np.ndarray) -> Future:
        """Start reading a batch in the pool; the future's result is a :class:`ReadBatch`."""
        return self._pool.submit(self.read_batch, np.asarray(indices, dtype=np.int64))

    def read(self, indices: np.ndarray) -> dict[str, list[np.ndarray]]:
        return self.read_batch(np.asarray(indices, dtype=np.int64)).fields

    def read_batch(self, indices: np.ndarray) -> ReadBatch:
        t = self.table
        out: dict[str, list] = {f: [None] * len(indices) for f in self.fields}
        fds = self._hold(np.unique(t.shard[indices]).tolist())
        try:
            self._read_into(out, indices, fds)
        finally:
            if self._files is not None:
                for s in fds:
                    self._files.release(s)
        sizes = None
        if self.size_field is not None:
            sizes = np.empty((len(indices), 2), np.int64)
            for j, (i, data) in enumerate(zip(indices.tolist(), out[self.size_field])):
                try:
                    sizes[j] = image_size(data)
                except (ValueError, IndexError, struct_error) as err:
                    raise DatasetError(f"{sample_where(self.ds, i)}: field {self.size_field!r} failed to "
                                       f"decode: {err}") from None
        return ReadBatch(indices, out, sizes)

    def _hold(self, shards: list[int]) -> dict[int, int]:
        """Descriptors of these shards, held (in use) until released when they come from a shard source."""
        if self._files is None:
            return {s: self._fd(s) for s in shards}
        held: dict[int, int] = {}
        try:
            for s in shards:
                held[s] = self._files.acquire(s)
        except BaseException:
            for s in held:
                self._files.release(s)
            raise
        return held

    def _read_into(self, out: dict[str, list], indices: np.ndarray, fds: dict[int, int]) -> None:
        t = self.table
        # Read in (shard, offset) order, which storage likes; results keep the batch's order.
        for j in np.lexsort((t.span_offset[indices], t.shard[indices])).tolist():
            i = int(indices[j])
            fd = fds[int(t.shard[i])]
            for f in self.fields:
                offset, size = int(t.offsets[f][i]), int(t.sizes[f][i])
                if size < 0:
                    raise DatasetError(f"{sample_where(self.ds, i)}: sample has no field {f!r}")
                data = os.pread(fd, size, offset)
                if len(data) != size:
                    raise DatasetError(f"{sample_where(self.ds, i)}: field {f!r} is truncated "
                                       f"({len(data)} of {size} bytes at offset {offset})")
                out[f][j] = np.frombuffer(data, dtype=np.uint8)

    def _fd(self, shard_index: int) -> int:
        fd = self._fds.get(shard_index)
        if fd is not None:
            return fd
        # One thread opens (and, with verify, hashes) a given shard; others wait for that shard only.
        with self._fds.opening(shard_index):
            fd = self._fds.get(shard_index)
            if fd is None:
                fd = self._open(shard_index)
                if not self._fds.publish(shard_index, fd):
                    os.close(fd)
                    raise RuntimeError(f"{self.ds.root}: the reader is closed")
        return fd

    def _open(self, shard_index: int) -> int:
        shard = self.ds.shards[shard_index]
        try:
            fd = os.open(shard.path, os.O_RDONLY)
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} cannot be opened: {err.strerror}") from None
        if not self.verify:
            return fd
        try:
            _, digest = sha256_fd(fd)
        except OSError as err:
            os.close(fd)
            raise DatasetError(f"{self.ds.root}: shard {shard.name} cannot be read: {err.strerror}") from None
        if digest != shard.sha256:
            os.close(fd)
            raise DatasetError(f"{self.ds.root}: shard {shard.name} sha256 mismatch "
                               f"(manifest {shard.sha256[:16]}…, file {digest[:16]}…)")
        return fd


class _Descriptors:
    """Open shard file descriptors by shard index; every one is closed by :meth:`close_all`."""

    def __init__(self):
        self._fds: dict[int, int] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the two dicts and `closed`, never held during I/O
        self.closed = False

    def __len__(self) -> int:
        return len(self._fds)

    def get(self, shard_index: int) -> int | None:
        return self._fds.get(shard_index)

    def opening(self, shard_index: int) -> threading.Lock:
        """The lock a thread holds while it opens this shard."""
        with self._lock:
            return self._opening.setdefault(shard_index, threading.Lock())

    def publish(self, shard_index: int, fd: int) -> bool:
        """Keep ``fd`` as this shard's; False (and nothing kept) once closed."""
        with self._lock:
            if self.closed:
                return False
            self._fds[shard_index] = fd
            return True

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _release(pool: ThreadPoolExecutor, fds: _Descriptors, files: ShardFiles | None = None) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    fds.close_all()
    if files is not None:  # its shards stop being in use (evictable) and its read-ahead stops
        files.close()
