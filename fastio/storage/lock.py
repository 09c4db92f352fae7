"""One writer per directory: an advisory lock that a dead holder cannot leave behind.

``DirLock(dir)`` creates ``dir/.fastio-lock`` and takes an exclusive ``flock`` on it for as long as it is
held. The kernel drops the lock when the holding process ends in any way (exit, exception, SIGKILL), so a
requeued job never finds a stale lock; the file's content (host, pid, Slurm job, start time) only names the
holder in the error a second writer gets (a lock file that is a link is refused: nothing is written through it,
see ``O_NOFOLLOW``). The file itself is left in place, but by a holder that made the
directory for a run that failed and takes it back (:class:`fastio.convert.dest.Claim`): it deletes the file while
it still holds the lock, and :meth:`DirLock.acquire` checks, once it holds a lock, that the file it locked is still
the one at the path (else it opens the new one and locks again), so a process that opened the old file just before
it went can never hold a lock beside the next writer's. A directory, or a folder above it, that such a run takes
back while another process is making it is made again.

Shared file systems: on NFSv4 ``flock`` is carried out as a POSIX byte-range lock by the server, and the
server releases it when the client's lease expires (about 90 s after a node dies). On Lustre, ``flock``
works across nodes when the client is mounted with ``-o flock`` (the default on most sites);
with ``-o localflock`` it only excludes writers on the same node, and with ``-o noflock`` it fails: fastio
then raises rather than run unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "DirLock", "LockedError", "current_holder", "describe_holder", "holder_of", "holder_record"]

LOCK_NAME = ".fastio-lock"
_TRIES = 100  # of DirLock.acquire, while the file it locked is removed under it


class LockedError(Exception):
    """Another process holds the directory's lock, or another writer the prefix's lease
    (:mod:`fastio.storage.lease`); the message names the directory or URL and the holder."""


def holder_record(purpose: str) -> dict[str, object]:
    """Who this process is, as stored in a lock file or lease object: purpose, host, pid, Slurm job, time."""
    return {"purpose": purpose, "host": socket.gethostname(), "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "since": time.time()}


def describe_holder(info: object) -> str:
    """A :func:`holder_record` (as read back) as one phrase for messages."""
    if not isinstance(info, dict) or not info:
        return "an unknown process"
    out = str(info.get("purpose") or "fastio")
    if info.get("pid") is not None:
        out += f" pid {info['pid']}"
    out += f" on {info['host']}" if info.get("host") else " on an unknown host"
    if info.get("slurm_job"):
        out += f", Slurm job {info['slurm_job']}"
    try:
        out += ", since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        pass
    return out


def holder_of(directory: str | Path) -> str:
    """Who holds (or last held) the lock of ``directory``, as one phrase for messages."""
    try:
        info = json.loads((Path(directory) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return "an unknown process"
    return describe_holder(info)


def current_holder(directory: str | Path) -> str | None:
    """Who holds the lock of ``directory`` right now (:func:`holder_of`'s phrase), or None when no process does.

    A shared ``flock`` taken and dropped at once: probes never exclude one another, and a holder of the
    exclusive lock makes the probe fail. (A :class:`DirLock` acquired during the instant of a probe is refused.)"""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return holder_of(directory)
        raise
    finally:
        os.close(fd)
    return None


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` (the same device and inode)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


class DirLock:
    """An exclusive, process-lifetime lock on a directory. Use as a context manager or ``acquire``/``release``.

    Args:
        directory: the directory to guard (created if missing).
        purpose: what the holder does, shown to a second writer (e.g. ``"fastio convert"``).
    """

    def __init__(self, directory: str | Path, purpose: str = "fastio"):
        self.directory, self.purpose = Path(directory), purpose
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DirLock:
        """Take the lock or raise :class:`LockedError` at once (never waits)."""
        if self._fd is not None:
            return self
        for _ in range(_TRIES):
            fd = self._locked_fd()
            if fd is not None:
                break
        else:
            self.directory.mkdir(parents=True, exist_ok=True)  # a folder that cannot be made: its own error
            raise LockedError(f"{self.directory}: {LOCK_NAME} keeps being removed while this process locks it")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record(self.purpose)).encode(), 0)
        self._fd = fd
        return self

    def _locked_fd(self) -> int | None:
        """A descriptor of ``directory/.fastio-lock`` holding its flock; None when the file locked is no longer the
        one at that path (its holder, a run that made the directory, removed it, or the directory, on failure), or when
        the directory or a folder above it went while it was made (another run that had made it took it back): try
        again, making what is missing, so that two writers never hold locks on two different files."""
        path = self.directory / LOCK_NAME
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:  # a folder on the way went after mkdir made it sure (a failed run took it back)
            return None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise LockedError(f"{self.directory}: {LOCK_NAME} is a link, not a lock file (nothing was written through "
                              "it); remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockedError(f"{self.directory}: in use by {holder_of(self.directory)}"
                                  f" (one writer per directory; {LOCK_NAME} is released when that process ends)") from None
            raise LockedError(f"{self.directory}: cannot lock {LOCK_NAME} ({err.strerror}); on Lustre mount with "
                              "-o flock") from None
        if not _is_at(fd, path):
            os.close(fd)
            return None
        return fd

    def owns_path(self) -> bool:
        """Whether this lock is held and the file it holds is still the one at ``directory/.fastio-lock`` (not
        removed or replaced since: then another writer may hold the file now there, and the directory is no longer
        this holder's alone)."""
        return self._fd is not None and _is_at(self._fd, self.directory / LOCK_NAME)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
