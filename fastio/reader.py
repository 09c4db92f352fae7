"""Sample bytes by dataset-wide index: byte ranges from the sample index (``Dataset.locate``), ``os.pread``
on cached file descriptors, a thread pool so that reads run ahead of the consumer.

A shard file is checked when it is opened: its size against the manifest (always), its sha256 (with
``verify``). A shard replaced or rewritten while it is read (a new file renamed over it, or the old one
written in place) is detected after each batch's reads: the descriptor's and the path's (device, inode,
size, mtime) must still be those seen at open, else :class:`~fastio.errors.DatasetError` (two ``stat``
calls per shard per batch). Not detected: an in-place rewrite that keeps size and restores the mtime;
on NFS, a change the client's attribute cache has not seen yet (``actimeo``, seconds).
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from struct import error as struct_error

import numpy as np

from fastio.checksum import sha256_fd
from fastio.dataset import Dataset
from fastio.errors import DatasetError
from fastio.images import image_size
from fastio.labels import parse_label as _parse_label_bytes

__all__ = ["ReadBatch", "Reader", "parse_label", "sample_where"]


def sample_where(ds: Dataset, index: int) -> str:
    """``"DEST: shard NAME key KEY"`` for error messages."""
    return f"{ds.root}: shard {ds.shard_of(int(index)).name} key {ds.key(int(index))!r}"


def parse_label(ds: Dataset, field: str, index: int, data: np.ndarray | bytes) -> int:
    """The integer class label stored as ASCII text in ``field`` of sample ``index`` (:mod:`fastio.labels`)."""
    text = bytes(data)
    try:
        return _parse_label_bytes(text)
    except ValueError as err:
        raise DatasetError(f"{sample_where(ds, index)}: field {field!r} is not an integer label: {text[:32]!r} "
                           f"({err})") from None


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
    """

    def __init__(self, dataset: Dataset, fields: list[str], threads: int = 2, verify: bool = False,
                 size_field: str | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        dataset.require_fields(list(fields))
        self.ds, self.fields, self.verify, self.size_field = dataset, list(fields), verify, size_field
        self.index = dataset.index  # opened (and checked) now, not in the first read
        self._shard_bytes = np.array([s.bytes for s in dataset.shards], np.int64)
        self._fds = _Descriptors()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fastio-read")
        # A reader dropped without close() still releases its threads and file descriptors.
        self._finalizer = weakref.finalize(self, _release, self._pool, self._fds)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._finalizer()

    def submit(self, indices: np.ndarray) -> Future:
        """Start reading a batch in the pool; the future's result is a :class:`ReadBatch`."""
        return self._pool.submit(self.read_batch, np.asarray(indices, dtype=np.int64))

    def read(self, indices: np.ndarray) -> dict[str, list[np.ndarray]]:
        return self.read_batch(np.asarray(indices, dtype=np.int64)).fields

    def read_batch(self, indices: np.ndarray) -> ReadBatch:
        t = self.ds.locate(indices)  # row j: sample indices[j]
        outside = np.flatnonzero(t.span_offset + t.span_size > self._shard_bytes[t.shard])
        if outside.size:  # a damaged or tampered index: never hand pread an absurd range
            j = int(outside[0])
            raise DatasetError(f"{self.index.source}: {sample_where(self.ds, int(indices[j]))}: byte range "
                               f"{int(t.span_offset[j])}+{int(t.span_size[j])} lies outside the shard's "
                               f"{int(self._shard_bytes[t.shard[j]])} bytes")
        out: dict[str, list] = {f: [None] * len(indices) for f in self.fields}
        # Read in (shard, offset) order, which storage likes; results keep the batch's order.
        for j in np.lexsort((t.span_offset, t.shard)).tolist():
            i = int(indices[j])
            fd = self._fd(int(t.shard[j]))
            for f in self.fields:
                offset, size = int(t.offsets[f][j]), int(t.sizes[f][j])
                if size < 0:
                    raise DatasetError(f"{sample_where(self.ds, i)}: sample has no field {f!r}")
                data = os.pread(fd, size, offset)
                if len(data) != size:
                    raise DatasetError(f"{sample_where(self.ds, i)}: field {f!r} is truncated "
                                       f"({len(data)} of {size} bytes at offset {offset})")
                out[f][j] = np.frombuffer(data, dtype=np.uint8)
        for s_i in np.unique(t.shard).tolist():  # the bytes above came from the file opened
            self._check_unchanged(int(s_i))
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

    def _check_unchanged(self, shard_index: int) -> None:
        """DatasetError if the shard's file changed or was replaced since it was opened."""
        shard = self.ds.shards[shard_index]
        fd, seen = self._fds.get(shard_index), self._fds.identity.get(shard_index)
        if fd is None or seen is None:
            return
        try:
            now = (_identity(os.fstat(fd)), _identity(os.stat(shard.path)))
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} vanished while being read ({err.strerror})") \
                from None
        if now != (seen, seen):
            raise DatasetError(f"{self.ds.root}: shard {shard.name} was replaced or modified while being read "
                               "(inode, size or mtime changed since it was opened); restart to read the new file")

    def _open(self, shard_index: int) -> int:
        shard = self.ds.shards[shard_index]
        try:
            fd = os.open(shard.path, os.O_RDONLY)
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} cannot be opened: {err.strerror}") from None
        st = os.fstat(fd)
        if st.st_size != shard.bytes:
            os.close(fd)
            raise DatasetError(f"{self.ds.root}: shard {shard.name} is {st.st_size} bytes, manifest says {shard.bytes}")
        self._fds.identity[shard_index] = _identity(st)
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
        self.identity: dict[int, tuple[int, int, int, int]] = {}  # (dev, inode, size, mtime) at open
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


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _release(pool: ThreadPoolExecutor, fds: _Descriptors) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    fds.close_all()
