"""Publishing files so that nothing half-written is ever visible: write a temporary name, fsync, rename.

The temporary name is hidden (``.NAME.tmp``) and removed when the write or the rename fails; a rename is followed
by an fsync of the directory. :func:`place_file` puts a file in place for a merge by a link, a rename or a copy.
:func:`start_writeback` starts a freshly written file on its way to the disk, so that the fsync that makes it
durable later finds little left to do. Imports nothing of fastio."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["TMP_SUFFIX", "tmp_path_for", "atomic_write_bytes", "publish", "fsync_dir", "place_file", "start_writeback",
           "sync_file"]

_SYNC_FILE_RANGE_WRITE = 2

TMP_SUFFIX = ".tmp"


def tmp_path_for(path: Path) -> Path:
    """The hidden temporary name ``path`` is written under before it is published."""
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path`` (or any file: it is opened read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing the dirty pages of the open file ``fd`` to the disk, without waiting for them (Linux:
    ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``; ``nbytes`` 0: to the end of the file), so that
    they are written while the caller writes on instead of all at once in the fsync that follows the last. A page
    already on its way is skipped, not waited for: a caller that starts part of a file it is still writing passes
    whole pages it will not write again. No durability by itself (no metadata, no wait, no error reported): the
    caller still fsyncs. Nothing where the call is missing or fails (the fsync then does all of it)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def publish(tmp: Path, final: Path, *, sync: bool = True) -> None:
    """Rename a fully written and fsynced ``tmp`` to ``final`` and make the rename durable (``sync=False``: the rename
    alone, made durable later by the caller)."""
    os.replace(tmp, final)
    if sync:
        fsync_dir(final.parent)


def atomic_write_bytes(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` under its hidden temporary name, fsync it, rename it into place and fsync the
    directory. ``sync=False``: the same write and rename without the fsyncs (never half-written, but not yet
    durable: for a caller that must not wait on the disk now and calls :func:`sync_file` later)."""
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        publish(tmp, path, sync=sync)
    except BaseException:  # nothing half-written left behind (a full disk, a folder in the way)
        tmp.unlink(missing_ok=True)
        raise


def sync_file(path: Path) -> None:
    """Make a file written with ``atomic_write_bytes(..., sync=False)`` durable: the file, then its directory."""
    fsync_dir(path)
    fsync_dir(Path(path).parent)


def place_file(src: Path, dst: Path, *, link: bool) -> None:
    """Put ``src`` at ``dst`` without a half-written moment: a hard link (``src`` stays) or, without ``link``, a
    rename; a copy where links fail (another file system, no link support)."""
    tmp = tmp_path_for(dst)
    tmp.unlink(missing_ok=True)
    if not link:
        os.replace(src, dst)
        return
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    publish(tmp, dst)
