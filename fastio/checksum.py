"""The one sha256 loop: of a file by path, of an open descriptor, or of bytes as they are written."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["CHUNK", "sha256_file", "sha256_fd", "HashingWriter"]

CHUNK = 1 << 22  # 4 MiB reads: large enough for parallel file systems, small enough to stay in cache


def sha256_fd(fd: int, *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of everything an open descriptor holds, read with ``pread`` (no seek)."""
    h, pos = hashlib.sha256(), 0
    while data := os.pread(fd, chunk, pos):
        h.update(data)
        pos += len(data)
    return pos, h.hexdigest()


def sha256_file(path: str | Path, *, chunk: int = CHUNK) -> tuple[int, str]:
    """``(size, hex digest)`` of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return sha256_fd(fd, chunk=chunk)
    finally:
        os.close(fd)


class HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it (hash while writing)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        return self.sha.hexdigest()
