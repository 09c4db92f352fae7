"""The checksum loops: sha256 (datasets, and checkpoints before xxh3) and xxh3-128 (checkpoints; shards too, for
the fills of object-store caches), of a file by path, of an open descriptor, or of bytes as they are written.

xxh3-128 (the maintained ``xxhash`` binding) is a non-cryptographic checksum that runs at memory speed
(tens of GB/s against sha256's ~1 GB/s): it catches flipped bits and truncation, not deliberate tampering.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from fastio.words import count

__all__ = ["CHUNK", "DIGESTS", "CheckedFile", "ShortRead", "digest_bytes", "digest_fd", "digest_file", "digests_fd",
           "digests_file", "open_hashed", "sha256_file", "sha256_fd", "HashingWriter"]

CHUNK = 1 << 22  # 4 MiB reads: large enough for parallel file systems, small enough to stay in cache


def _xxh3_128():
    import xxhash

    return xxhash.xxh3_128()


DIGESTS = {"sha256": hashlib.sha256, "xxh3_128": _xxh3_128}
"""Checksum name (as recorded next to a file's size) -> a new hash object with ``update``/``hexdigest``."""


def digest_bytes(data: bytes | memoryview, algo: str = "sha256") -> tuple[int, str]:
    """``(size, hex digest)`` of a bytes-like object in memory (``algo`` as in :func:`digest_fd`): hashing what is
    about to be, or was just, written, instead of reading the file back."""
    h = DIGESTS[algo]()
    h.update(data)
    return memoryview(data).nbytes, h.hexdigest()


def digests_fd(fd: int, algos: tuple[str, ...], *, chunk: int = CHUNK) -> tuple[int, dict[str, str]]:
    """``(size, {algo: hex digest})`` of everything an open descriptor holds, every ``algo`` (keys of
    :data:`DIGESTS`) in one read with ``pread`` (no seek): the one checksum loop."""
    hashes, pos = {a: DIGESTS[a]() for a in algos}, 0
    while data := os.pread(fd, chunk, pos):
        for h in hashes.values():
            h.update(data)
        pos += len(data)
    return pos, {a: h.hexdigest() for a, h in hashes.items()}


def digests_file(path: str | Path, algos: tuple[str, ...], *, chunk: int = CHUNK) -> tuple[int, dict[str, str]]:
    """:func:`digests_fd` of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return digests_fd(fd, algos, chunk=chunk)
    finally:
        os.close(fd)


class ShortRead(OSError):
    """A file that held less than it should when it was read (truncated by another process meanwhile), or that is no
    longer the file that was checked (replaced meanwhile)."""

    def __init__(self, path: str, offset: int, size: int, why: str = ""):
        expected = f"ended at offset {offset}, {count(size, 'byte')} expected (truncated meanwhile?)"
        super().__init__(errno.EIO, why or expected, path)
        self.offset, self.size = offset, size


class CheckedFile:
    """A file :func:`open_hashed` hashed, to read its bytes again where they are needed: with ``pread`` (never a
    mapping of the file, which another process's truncation would turn into a SIGBUS at the next touch of a page
    past its new end: the process gone, with no message). Opened at the first read and kept open until
    :meth:`close` (so that holding many costs no descriptors); a file shorter than checked or a read it cannot fill
    is a :class:`ShortRead` naming it, the offset it ends at and the size expected; a file that is no longer the one
    checked (another inode, or written to since) is one too."""

    def __init__(self, path: str, size: int, identity: tuple[int, ...]):
        self.path, self.size, self.identity, self.fd = path, size, identity, -1

    def readinto(self, view: memoryview, offset: int) -> None:
        """Fill the writable bytes ``view`` from ``offset`` of the file."""
        fd, done, want = self._open(), 0, view.nbytes
        while done < want:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ShortRead(self.path, offset + done, self.size)
            done += n

    def read(self, offset: int, length: int) -> bytearray:
        """``length`` bytes from ``offset``, in a new buffer."""
        data = bytearray(length)
        self.readinto(memoryview(data), offset)
        return data

    def _open(self) -> int:
        if self.fd < 0:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._same(os.fstat(fd))
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        return self.fd

    def _same(self, st: os.stat_result) -> None:
        """ShortRead unless ``st`` is the file checked: its inode, its size (else it ends at its size now), its
        modification time."""
        found = _identity(st)
        if found[:2] != self.identity[:2]:
            raise ShortRead(self.path, 0, self.size, "changed since it was checked (replaced by another file)")
        if st.st_size != self.size:
            raise ShortRead(self.path, min(st.st_size, self.size), self.size)
        if found != self.identity:
            raise ShortRead(self.path, 0, self.size, "changed since it was checked (written to)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_hashed(path: str | Path, algo: str, size: int, *, chunk: int = CHUNK) -> tuple[int, str, CheckedFile | None]:
    """``(size, hex digest, file)``: the file at ``path`` hashed by reading it (:func:`digests_fd`) and, when it held
    ``size`` bytes, a :class:`CheckedFile` to read it again (None otherwise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        identity = _identity(os.fstat(fd))
        found, digests = digests_fd(fd, (algo,), chunk=chunk)
    finally:
        os.close(fd)
    checked = CheckedFile(str(path), size, identity) if found == size == identity[2] else None
    return found, digests[algo], checked


def digest_fd(fd: int, algo: str = "sha256", *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of everything an open descriptor holds; ``algo`` is a key of :data:`DIGESTS`."""
    size, digests = digests_fd(fd, (algo,), chunk=chunk)
    return size, digests[algo]


def digest_file(path: str | Path, algo: str = "sha256", *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of the file at ``path`` (``algo`` as in :func:`digest_fd`)."""
    size, digests = digests_file(path, (algo,), chunk=chunk)
    return size, digests[algo]


def sha256_fd(fd: int, *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of everything an open descriptor holds, read with ``pread`` (no seek)."""
    return digest_fd(fd, "sha256", chunk=chunk)


def sha256_file(path: str | Path, *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of the file at ``path``."""
    return digest_file(path, "sha256", chunk=chunk)


class HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it (hash while writing): sha256
    (:meth:`hexdigest`) and xxh3-128 (:meth:`xxh3_hexdigest`)."""

    def __init__(self, f):
        self.f, self.sha, self.xxh3 = f, hashlib.sha256(), _xxh3_128()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.xxh3.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        return self.sha.hexdigest()

    def xxh3_hexdigest(self) -> str:
        return self.xxh3.hexdigest()
