"""What fastio may delete or move aside in a checkpoint directory (the rules in one place), and the deletions.

- a ``step-N.tmp`` holding the writer's mark ``fastio-writing.json`` (with or without a commit marker: a
  kill can come between writing the marker and the rename) is this fastio's own abandoned temporary (a
  Checkpointer only looks while it holds the directory's lock, so no other writer is alive):
  :func:`remove_abandoned` deletes it;
- committed checkpoints older than the newest ``keep`` (:mod:`fastio.checkpoint.retention`), each renamed to a
  hidden ``.step-N.deleting-PID`` first (:func:`hide_step`, on the save's path) and then deleted
  (:func:`finish_removal`, after the save counts as done; both: :func:`remove_step`); :func:`remove_abandoned`
  finishes such a deletion a kill cut short; a step that is a link goes as a link, its target (outside DIR)
  left in place with a warning;
- with an ``s3://`` dir staged node-locally, each node's ``step-N.tmp`` once its files are uploaded and the
  commit marker is on the store (:mod:`fastio.checkpoint.commit`; no node holds the whole step);
- on an ``s3://`` store, while holding its lease: committed steps older than the newest ``keep`` (marker
  first), and ``step-N/`` objects without a commit marker older than the newest committed step (a deletion
  cut short), :mod:`fastio.checkpoint.remote`;
- a ``step-N.tmp``, or one moved aside as ``step-N.tmp.quarantined``, that holds nothing at all but the writer's
  mark or its half-written ``.fastio-writing.json.tmp`` (a kill between creating the temporary and publishing
  its mark): :func:`remove_abandoned` deletes it (no data can be in it);
- a ``.step-N.restore-PID`` holding ``fastio-restoring.json`` (a restore's decompressed copy of a committed
  step, made by :func:`start_restore_dir`, left by a killed process): :func:`remove_ended_restores` deletes it
  once process PID of the host its mark names has ended (by pid and, where the mark has it, the process's start
  time; another host's: a day after its mark was written), never under a restore still reading it (a read-only
  one beside training); a writer's :func:`remove_abandoned` and a read-only restore's start of its own copy
  call it;
- a private download directory of a read-only restore of an ``s3://`` dir without ``staging_dir``
  (``<tmp>/fastio-ckpt-restore-*``, marked with its process's host, pid and start time: :func:`start_private_staging`),
  which ``close`` removes, left by a killed process: the next :func:`start_private_staging` of this host deletes it
  once that process has ended (its pid gone, or taken by a process that started at another time), never a live
  process's; one without a readable mark (an older fastio's, or a kill before the mark) is left alone;
- nothing else. A ``step-N`` with a missing, unreadable or unknown commit marker, or whose files do not
  match it, and a ``step-N.tmp`` without the writer's mark holding anything else are left alone or moved aside by
  rename to ``step-N.quarantined`` (:func:`quarantine`), never deleted. A committed ``step-N`` about to be
  replaced by a new commit of the same step is moved aside too. A rollback supersedes steps, deleting nothing
  (:mod:`fastio.checkpoint.rollback`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from fastio.checkpoint.naming import (
    COMMIT_FILE,
    RESTORING_FILE,
    deleting_name,
    is_deleting_name,
    is_quarantined_tmp_name,
    parse_restore_name,
    quarantine_names,
    restore_dir,
)
from fastio.checkpoint.rollback import finish_rollback
from fastio.checkpoint.scan import StepEntry, holds_only_writer_marks, scan
from fastio.dist import process_ended, process_start
from fastio.storage.atomic import atomic_write_bytes, fsync_dir

__all__ = ["OTHER_HOST_RESTORE_S", "end_restore_dir", "finish_removal", "hide_step", "quarantine",
           "remove_abandoned", "remove_ended_restores", "remove_step", "start_private_staging", "start_restore_dir"]

log = logging.getLogger(__name__)

PRIVATE_STAGING_PREFIX = "fastio-ckpt-restore-"
"""The name of a read-only restore's private download directory begins so (:func:`start_private_staging`)."""

OTHER_HOST_RESTORE_S = 24 * 3600.0
"""A restore directory marked by another host (whose processes this one cannot see) is abandoned this long after
its mark was written."""


def remove_step(path: Path) -> None:
    """Delete a step directory: first renamed to a hidden ``.step-N.deleting-PID`` (atomic: it is no step from
    then on), then deleted; a deletion a kill cut short is finished by :func:`remove_abandoned`."""
    doomed = hide_step(path)
    if doomed is not None:
        finish_removal([doomed])


def hide_step(path: Path) -> Path | None:
    """:func:`remove_step`'s first half, nothing waiting on the disk: ``path`` renamed to a hidden
    ``.step-N.deleting-PID`` (no step from then on; where it cannot be renamed, e.g. busy, its commit marker is
    deleted first and that made durable, so a half-deleted one reads as uncommitted). Returns what
    :func:`finish_removal` deletes, None when ``path`` is gone already."""
    path = Path(path)
    doomed = path.with_name(deleting_name(path.name))
    try:
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        return doomed
    except FileNotFoundError:
        return None
    except OSError:  # cannot rename
        try:
            (path / COMMIT_FILE).unlink()
            fsync_dir(path)
        except FileNotFoundError:
            pass
        return path


def finish_removal(doomed: list[Path]) -> None:
    """:func:`remove_step`'s second half for what :func:`hide_step` returned: the renames made durable (one fsync of
    each directory holding them: a crash then cannot bring back a step whose files are half deleted), then the
    files deleted. Where that fsync fails, the hidden directories are left for :func:`remove_abandoned`."""
    try:
        for parent in sorted({Path(d).parent for d in doomed}):
            fsync_dir(parent)
    except OSError:
        return
    for path in doomed:
        _delete(path)


def _delete(path: Path) -> None:
    """Delete a renamed-away step's files; a step that is a link (moved to another disk and linked back) goes as
    a link: its target, outside DIR and maybe the only copy, is left in place, with a warning naming it."""
    path = Path(path)
    if path.is_symlink():
        target = os.readlink(path)
        path.unlink(missing_ok=True)
        log.warning("fastio: expired checkpoint %s was a link to %s: the link removed, %s left in place", path,
                    target, target)
        return
    shutil.rmtree(path, ignore_errors=True)


def quarantine(path: Path) -> Path:
    """Move a step directory aside as ``<name>.quarantined`` (``-2``, ``-3``... when taken); returns the new path.
    Nothing is deleted: what was there may be the only copy."""
    path = Path(path)
    target = next(path.with_name(n) for n in quarantine_names(path.name) if not path.with_name(n).exists())
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


_LIVE: set[str] = set()
"""This process's restore directories in use (:func:`start_restore_dir` to :func:`end_restore_dir`): another
restore of the process (another Checkpointer, another thread) neither takes nor deletes them."""
_LIVE_LOCK = threading.Lock()


def start_restore_dir(root: Path, step: int) -> Path:
    """Create (empty, marked with this process's host, pid and start time) a restore directory of this process for
    ``step``, its own until :func:`end_restore_dir` (``-K`` when another restore of the process uses the plain name):
    the mark is what :func:`remove_ended_restores` recognises."""
    with _LIVE_LOCK:
        path = next(p for p in map(partial(restore_dir, root, step, None), itertools.count(1))
                    if str(p) not in _LIVE)
        _LIVE.add(str(path))
    try:
        if path.exists():  # this process's own, from an earlier restore that could not clean up
            shutil.rmtree(path)
        path.mkdir()
        (path / RESTORING_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                       "start": process_start(os.getpid()), "time": time.time()}))
    except BaseException:
        end_restore_dir(path)
        raise
    return path


def end_restore_dir(path: Path) -> None:
    """Delete a restore directory :func:`start_restore_dir` made, once its restore is done with it."""
    shutil.rmtree(path, ignore_errors=True)
    with _LIVE_LOCK:
        _LIVE.discard(str(path))


def start_private_staging() -> Path:
    """A new private download directory (in the system's temporary directory) for a read-only restore of an
    ``s3://`` dir without ``staging_dir``, marked (:data:`~fastio.checkpoint.naming.RESTORING_FILE`: host, pid,
    start time) as this process's; first the ones of this host's ended processes (killed before ``close``) go."""
    tmp = Path(tempfile.gettempdir())
    for child in tmp.glob(f"{PRIVATE_STAGING_PREFIX}*"):
        if _private_staging_abandoned(child):
            shutil.rmtree(child, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=PRIVATE_STAGING_PREFIX, dir=tmp))
    atomic_write_bytes(path / RESTORING_FILE, json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
        "time": time.time()}).encode())
    return path


def _private_staging_abandoned(child: Path) -> bool:
    """``child`` is this user's marked private download directory of a process of this host that has ended: its pid
    gone, or now another process's (another start time). Unmarked, unreadable or another host's: not known."""
    try:
        if child.is_symlink() or child.lstat().st_uid != os.getuid():
            return False
        mark = json.loads((child / RESTORING_FILE).read_text())
        host, pid, start = mark["host"], mark["pid"], mark["start"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    if host != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid == os.getpid():
        return False
    return process_ended(pid, start if isinstance(start, int) else None)


def _restore_abandoned(child: Path) -> bool:
    """``child`` is a marked ``.step-N.restore-PID`` whose restore has ended: PID (its name's) of the host its mark
    names ended (:func:`~fastio.dist.process_ended`, by the start time its mark holds: a reused pid is another
    process), or another host's mark older than :data:`OTHER_HOST_RESTORE_S`."""
    pid = parse_restore_name(child.name)
    if pid is None or child.is_symlink() or not child.is_dir() or not (child / RESTORING_FILE).is_file():
        return False
    try:
        mark = json.loads((child / RESTORING_FILE).read_text())
        host, started, start = mark.get("host"), float(mark.get("time", 0)), mark.get("start")
    except (OSError, ValueError, TypeError, AttributeError):
        return True  # a mark cut short by a kill
    if host != socket.gethostname():
        return time.time() - started > OTHER_HOST_RESTORE_S
    if pid == os.getpid():  # this process's own: a leftover unless a restore of the process is using it
        with _LIVE_LOCK:
            return str(child) not in _LIVE
    return process_ended(pid, start if isinstance(start, int) and not isinstance(start, bool) else None)


def _is_empty_quarantined_tmp(path: Path) -> bool:
    """A ``step-N.tmp`` moved aside (``step-N.tmp.quarantined``) that holds nothing but writer's marks: what a kill
    inside :func:`~fastio.checkpoint.publish.start_tmp` left, quarantined by an older fastio; nothing of it can be
    data."""
    return (is_quarantined_tmp_name(path.name) and path.is_dir() and not path.is_symlink()
            and holds_only_writer_marks(path))


def remove_ended_restores(root: Path) -> list[Path]:
    """Delete the restore directories (``.step-N.restore-PID``) of ended restores under ``root`` (see the module
    docstring), never a live process's; returns them. What cannot be deleted (a read-only mount) is left."""
    removed = []
    for child in sorted(Path(root).iterdir()):
        if _restore_abandoned(child):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _remove_hidden_leftovers(root: Path) -> list[Path]:
    """Delete the ended restores' directories, the deletions a kill cut short and the empty quarantined
    temporaries under ``root``; returns them."""
    removed = remove_ended_restores(root)
    for child in sorted(Path(root).iterdir()):
        if is_deleting_name(child.name) and (child.is_dir() or child.is_symlink()):  # a deletion a kill cut short
            _delete(child)
            removed.append(child)
        elif _is_empty_quarantined_tmp(child):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def remove_abandoned(root: Path) -> tuple[list[Path], list[StepEntry]]:
    """Delete this fastio's abandoned temporaries under ``root`` (see the module docstring): marked
    ``step-N.tmp``, a ``step-N.tmp`` or ``step-N.tmp.quarantined`` holding nothing but writer's marks, and marked
    ``.step-N.restore-PID`` (after finishing a rollback a kill cut short); returns ``(deleted, left)``: ``left``
    are the other uncommitted step directories, untouched."""
    removed, left = [], []
    if Path(root).is_dir():
        finish_rollback(root)  # one a kill cut short
        removed += _remove_hidden_leftovers(root)
    for entry in scan(root):
        if entry.committed:
            continue
        if entry.abandoned:
            remove_step(entry.path)
            removed.append(entry.path)
        else:
            left.append(entry)
    return removed, left
