"""Publishing files so that nothing half-written is ever visible: write a temporary name, fsync, rename.

The temporary name is hidden (``.NAME.tmp``) and removed when the write or the rename fails; a rename is followed
by an fsync of the directory. :func:`place_file` puts a file in place for a merge by a link, a rename or a copy.
Imports nothing of fastio."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["TMP_SUFFIX", "tmp_path_for", "atomic_write_bytes", "publish", "fsync_dir", "place_file"]

TMP_SUFFIX = ".tmp"


def tmp_path_for(path: Path) -> Path:
    """The hidden temporary name ``path`` is written under before it is published."""
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a fully written and fsynced ``tmp`` to ``final`` and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:  # nothing half-written left behind (a full disk, a folder in the way)
        tmp.unlink(missing_ok=True)
        raise


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
