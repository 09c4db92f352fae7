"""fastio.storage.lock: one writer per directory, and no stale lock after the holder dies."""

import os
import signal
import subprocess
import sys

import pytest

from fastio.storage.lock import LOCK_NAME, DirLock, LockedError


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
