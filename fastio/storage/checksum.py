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
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CHUNK", "DIGESTS", "ShortRead", "digest_bytes", "digest_fd", "digest_file", "digests_fd", "digests_file",
           "read_chunks", "read_hashed", "sha256_file", "sha256_fd", "HashingWriter"]

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


def read_hashed(path: str | Path, algo: str, size: int, *, chunk: int = CHUNK) -> tuple[int, str, mmap.mmap | None]:
    """``(size, hex digest, buffer)``: the file at ``path`` read into memory of its own (an anonymous mapping,
    huge pages where the kernel has them) and hashed chunk by chunk as it arrives, so that the bytes hashed are the
    bytes the caller then loads, whatever happens to the file afterwards. Never a mapping of the file itself: a
    mapped file that another process truncates (a cleanup, a full disk, a network file system) is a SIGBUS at the
    next touch of a page past its new end, which kills the process with no message. ``size`` is what the file should
    hold: a file of another size (or one no memory can be had for now) is hashed by reading it (``buffer`` None),
    as :func:`digests_fd`; one that holds less than ``size`` by the time it is read is a :class:`ShortRead`."""
    with open(path, "rb") as f:
        buffer = _fresh(size) if os.fstat(f.fileno()).st_size == size else None
        if buffer is None:
            found, digests = digests_fd(f.fileno(), (algo,), chunk=chunk)
            return found, digests[algo], None
        try:
            h = DIGESTS[algo]()
            for part in read_chunks(f.fileno(), buffer, str(path), chunk=chunk):
                h.update(part)
        except BaseException:
            buffer.close()
            raise
        return size, h.hexdigest(), buffer


def _fresh(size: int) -> mmap.mmap | None:
    """``size`` bytes of fresh anonymous memory (huge pages asked for: on this KVM guest a 4 KiB page's first touch
    is what fresh memory costs, three times the read and hash of it); None when empty or none can be had now."""
    if not size:
        return None
    try:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


class ShortRead(OSError):
    """A file that held less than it should while it was read (truncated by another process meanwhile)."""

    def __init__(self, path: str, offset: int, size: int):
        super().__init__(errno.EIO, f"ended at offset {offset} of the {size} bytes expected (truncated while read?)",
                         path)
        self.offset, self.size = offset, size


def read_chunks(fd: int, buffer: mmap.mmap, path: str, *, chunk: int = CHUNK) -> Iterator[memoryview]:
    """Read the open descriptor ``fd`` into ``buffer`` (all of it: ``len(buffer)`` bytes from offset 0, ``pread``
    into place, no copy but the read's), yielding each part as it lands (to hash it while it is in the cache);
    :class:`ShortRead` naming ``path``, the offset reached and the size expected when the file ends before."""
    size, pos = len(buffer), 0
    with memoryview(buffer) as view:
        while pos < size:
            n = os.preadv(fd, [view[pos:pos + chunk]], pos)
            if n <= 0:
                raise ShortRead(path, pos, size)
            with view[pos:pos + n] as part:
                yield part
            pos += n


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
