"""A run's scratch folder in the temporary directory (downloads of shards, staged files), named after its process
so that what a killed run left is found and removed by a later one.

:func:`scratch_dir` makes ``TMP/PREFIX<pid>-<start>-XXXX`` (``<start>``: :func:`fastio.dist.process_start`) and removes
it when the run ends; first it removes every ``PREFIX<pid>-<start>-*`` folder whose process is gone (the pid has
ended, or is now another process: another start time) and in which nothing changed for a minute (a process of
another pid namespace sharing the temporary directory may show as gone: a download it writes changes within that
time). A live process's folder is never touched, nor a folder of another name (an older fastio's ``PREFIX`` +
random letters: whose it is cannot be told).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastio.dist import process_ended, process_start

__all__ = ["INDEX_SCRATCH", "scratch_dir"]

INDEX_SCRATCH = "fastio-index-"
"""The prefix of ``fastio index``'s scratch folders (WebDataset shards and token pairs, ``fastio merge`` of them)."""

_SETTLED_S = 60.0
"""How long nothing in a gone process's folder has changed before it is removed."""


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A folder of this run's own in the temporary directory, removed after the ``with`` body; what runs of
    ``prefix`` that were killed left there is removed first."""
    root = Path(tempfile.gettempdir())
    remove_abandoned(root, prefix)
    start = process_start(os.getpid()) or "0"
    with tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-{start}-", dir=root) as tmp:
        yield Path(tmp)


def remove_abandoned(root: Path, prefix: str) -> None:
    """Remove each ``PREFIX<pid>-<start>-*`` folder of ``root`` whose process is gone (see the module docstring)."""
    named = re.compile(re.escape(prefix) + r"(\d+)-(\d+)-[^/]+")
    for path in root.glob(f"{prefix}*"):
        got = named.fullmatch(path.name)
        if got is None or path.is_symlink() or not path.is_dir():
            continue
        start = int(got.group(2)) or None  # 0: not known when it was made
        if process_ended(int(got.group(1)), start) and _settled(path):
            shutil.rmtree(path, ignore_errors=True)  # another user's, or one removed meanwhile: left as it is


def _settled(path: Path) -> bool:
    """Whether nothing in the folder ``path`` (its entries, one level down, and itself) changed for ``_SETTLED_S``."""
    try:
        newest = max([path.lstat().st_mtime, *(p.lstat().st_mtime for p in path.rglob("*"))])
    except OSError:
        return False
    return time.time() - newest > _SETTLED_S
