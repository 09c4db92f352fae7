"""fastio.storage.lock: one writer per directory, and no stale lock after the holder dies."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastio.convert.dest import Claim
from fastio.storage.lock import LOCK_NAME, DirLock, LockedError

_AT_MKDIR: dict[str, list] = {}
"""Steps to run just before this process calls ``os.mkdir`` on a path (the path's string: its steps, one a call)."""


def _at_mkdir(event: str, args: tuple) -> None:
    if event == "os.mkdir" and _AT_MKDIR:
        steps = _AT_MKDIR.get(os.fspath(args[0]))
        if steps:
            steps.pop(0)()  # popped first: a mkdir the step makes runs no step


def _before_mkdirs(steps: dict[Path, list]) -> None:
    """Run ``steps[path]`` in turn at this process's next calls of ``os.mkdir(path)`` (an audit hook: the real calls
    in their real order, no stand-in for the code that makes them)."""
    if not _AT_MKDIR.get("hooked"):
        sys.addaudithook(_at_mkdir)
        _AT_MKDIR["hooked"] = [None]  # no path is named so
    _AT_MKDIR.update({str(path): list(calls) for path, calls in steps.items()})


def test_second_holder_is_refused_with_directory_and_holder(tmp_path):
    with DirLock(tmp_path, "fastio convert"):
        with pytest.raises(LockedError) as err:
            DirLock(tmp_path, "other").acquire()
    msg = str(err.value)
    assert str(tmp_path) in msg and "fastio convert" in msg and f"pid {os.getpid()}" in msg
    DirLock(tmp_path).acquire().release()  # free again once released


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    code = ("import sys, time; from fastio.storage.lock import DirLock; lock = DirLock(sys.argv[1], 'job').acquire(); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match="job pid"):
            DirLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert (tmp_path / LOCK_NAME).exists()  # the file stays; only the flock went with the process
    with DirLock(tmp_path, "requeued"):
        pass


def test_a_lock_file_that_is_a_link_is_refused_and_what_it_leads_to_is_untouched(tmp_path):
    """``DIR/.fastio-lock`` planted as a link (in a folder others can write in) would have the writer truncate and
    overwrite the file it leads to with its holder record; the lock is refused naming it, the file keeps its bytes."""
    (tmp_path / "yours.txt").write_text("the only copy")
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / LOCK_NAME).symlink_to(tmp_path / "yours.txt")
    with pytest.raises(LockedError, match=f"{LOCK_NAME}.*link"):
        DirLock(tmp_path / "dest").acquire()
    assert (tmp_path / "yours.txt").read_text() == "the only copy"


def test_a_lock_whose_new_parent_another_run_removes_meanwhile_makes_it_again(tmp_path):
    """Two conversions into new DESTs under one new folder: the first makes ``new/``, then fails and takes it back
    (empty) just after the second made sure ``new/`` was there and just before it makes its DEST in it. The second
    makes ``new/`` again and holds its lock: no "No such file or directory"."""
    new = tmp_path / "new"
    first, second = Claim(new / "a", "first"), Claim(new / "b", "second")
    _before_mkdirs({new: [first.take],  # the first run makes new/ and new/a while the second makes sure new/ is there
                    new / "b": [lambda: None,  # the second's first try: new/ is not there yet
                                lambda: first.__exit__(RuntimeError, RuntimeError("failed"), None)]})
    with second:
        second.take()
        assert second.lock.owns_path() and not (new / "a").exists()
    assert not first.lock.held
