"""The source files DALI's conditionals write while a graph is built, kept out of the shared temporary directory.

A graph with per-sample ``if`` (``GraphDef.conditionals``: DALI's ``enable_conditionals``, as :class:`fastio.VideoClips`'
still images) is converted by DALI's copy of autograph, which writes each converted function's source to a temporary
file (``<tempdir>/__autograph_generated_file<random>.py``, one or more per build) and removes it only at the
interpreter's exit (``atexit``): a process killed (``kill -9``, the OOM killer, a preempted job) leaves every one in
``/tmp`` for good. :func:`generated_sources_kept_private` runs a build with those files written in a directory of
this build's own (``<tempdir>/fastio-autograph-<pid>-<random>``, Python's ``tempfile.tempdir`` pointed there for the build
only, every build holding :data:`fastio.pipelines.base._BUILDING`), deletes the ones the build loaded once it is
done (the graph is defined by then: nothing reads them again), and first deletes the directories of processes that
no longer exist (what a kill during a build left). Nothing of DALI's is touched: only the standard library's
temporary directory, and only files this process's builds wrote. Another thread of the process that makes a temporary
file during a build gets it in that directory too: it is never deleted (only DALI's generated sources are; the
directory stays while anything else is in it).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastio.dist import process_gone

__all__ = ["PREFIX", "generated_sources_kept_private"]

PREFIX = "fastio-autograph-"
"""How a build's directory in the temporary directory is named, before its process's pid."""
_SETTLED_S = 60.0
"""A dead process's directory is deleted once unchanged this long (a process of another pid namespace sharing the
temporary directory may have the same pid number, and its build takes well under this)."""


@contextmanager
def generated_sources_kept_private() -> Iterator[Path]:
    """Run the ``with`` body (a DALI build) with temporary files written in a directory of its own, and delete
    the generated sources it loaded afterwards (the directory too, once empty); first delete what dead processes
    left. Not thread-safe against another such build: callers hold the build lock."""
    root = Path(tempfile.gettempdir())
    clean_dead(root)
    mine = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))  # this build's own, private
    before, kept = set(sys.modules), tempfile.tempdir
    tempfile.tempdir = str(mine)
    try:
        yield mine
    finally:
        tempfile.tempdir = kept
        _delete_loaded(mine, before)


def _delete_loaded(mine: Path, before: set[str]) -> None:
    """Delete the files in ``mine`` that modules imported since ``before`` (the names in ``sys.modules`` then) were
    loaded from, then ``mine`` if nothing else is in it (another thread's temporary file made meanwhile stays)."""
    for name in set(sys.modules) - before:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and Path(origin).parent == mine:
            Path(origin).unlink(missing_ok=True)
    try:
        mine.rmdir()
    except OSError:
        pass


GENERATED = "__autograph_generated_file*"
"""How DALI's autograph names the sources it writes (and their ``__pycache__`` entries)."""


def clean_dead(root: Path) -> None:
    """In ``root``'s ``fastio-autograph-<pid>-*`` directories whose process no longer exists and which have not
    changed for a minute (what a kill during a build left), delete DALI's generated sources, then the directory if
    nothing else is in it: a file another thread of that process made there is kept."""
    now = time.time()
    for path in root.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-")[0]
        try:
            settled = now - path.lstat().st_mtime > _SETTLED_S
        except OSError:
            continue
        if pid.isdigit() and settled and path.is_dir() and not path.is_symlink() and process_gone(int(pid)):
            _delete_generated(path)


def _delete_generated(path: Path) -> None:
    for generated in [*path.glob(GENERATED), *path.glob(f"__pycache__/{GENERATED}")]:
        generated.unlink(missing_ok=True)
    for folder in (path / "__pycache__", path):
        try:
            folder.rmdir()
        except OSError:  # not there, or something else is in it: kept
            pass
