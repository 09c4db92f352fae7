"""The checksum loops: sha256 (datasets, and checkpoints before xxh3) and xxh3-128 (checkpoints; shards too, for
the fills of object-store caches), of a file by path, of an open descriptor, or of bytes as they are written.

xxh3-128 (the maintained ``xxhash`` binding) is a non-cryptographic checksum that runs at memory speed
(tens of GB/s against sha256's ~1 GB/s): it catches flipped bits and truncation, not deliberate tampering.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import sys
from pathlib import Path

__all__ = ["CHUNK", "DIGESTS", "digest_bytes", "digest_fd", "digest_file", "digests_fd", "digests_file", "read_hashed",
           "sha256_file", "sha256_fd", "HashingWriter"]

CHUNK = 1 << 22  # 4 MiB reads: large enough for parallel file systems, small enough to stay in cache
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)
"""``madvise``'s prefault that reports a read error instead of raising SIGBUS later (Linux 5.14; Python 3.12 names it)."""
_READ_ERRORS = {errno.EFAULT, errno.EIO, getattr(errno, "EHWPOISON", errno.EIO)}
"""What ``MADV_POPULATE_READ`` answers for a page that cannot be read (where a touch would raise SIGBUS)."""


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


def read_hashed(path: str | Path, algo: str, size: int, *, chunk: int = CHUNK) -> tuple[int, str, mmap.mmap | None]:
    """``(size, hex digest, mapping)``: the file at ``path`` mapped into memory (copy-on-write, never written: its
    page-cache pages themselves), its pages read in at once (``MADV_POPULATE_READ``, so that a read error is an
    OSError here rather than a SIGBUS at a later touch) and hashed there, with no copy out of the page cache.
    ``size`` is what the file should hold: a file of another size, or one the kernel cannot populate a mapping of
    (before Linux 5.14), is hashed by reading it (``mapping`` None), as :func:`digests_fd`.

    A mapped file that another process truncates while it is mapped is a SIGBUS at the next touch of a page past
    its new end: callers keep the mapping only while they need it."""
    with open(path, "rb") as f:
        mapping = _populated(f, size) if os.fstat(f.fileno()).st_size == size and size else None
        if mapping is None:
            found, digests = digests_fd(f.fileno(), (algo,), chunk=chunk)
            return found, digests[algo], None
        h = DIGESTS[algo]()
        h.update(mapping)
        return size, h.hexdigest(), mapping


def _populated(f, size: int) -> mmap.mmap | None:
    """The open file ``f`` of ``size`` bytes mapped copy-on-write with every page read in; None where it cannot
    be (no ``MADV_POPULATE_READ``, a file system without mappings, no memory now); OSError (EIO) naming the file
    where a page cannot be read."""
    if _POPULATE_READ is None:
        return None
    try:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError:
        return None
    try:
        mapping.madvise(_POPULATE_READ)
    except OSError as err:
        mapping.close()
        if err.errno in _READ_ERRORS:  # where a touch would be a SIGBUS: the file's read error, as a read's
            raise OSError(errno.EIO, os.strerror(errno.EIO), f.name) from None
        return None
    return mapping


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
