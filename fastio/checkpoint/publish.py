"""Publishing a step on disk: ``step-N.tmp/`` while writing, ``step-N/`` once committed.

:func:`start_tmp` creates the temporary with the writer's mark (made durable by :func:`sync_tmp` on the writer thread
before the engine writes into it); the engine writes into it; :func:`commit` checksums
every file it holds (:func:`data_files`: xxh3-128, flushed to disk through the same descriptor; the engines started
their writeback as they wrote them, :func:`~fastio.storage.atomic.start_writeback`, so little is left to flush),
fsyncs every directory down to them, writes the commit marker last (:class:`~fastio.checkpoint.record.CommitRecord`,
fsync) and renames the temporary to ``step-N``.
:func:`file_record` and :func:`commit_data` make the same records for a step committed on a store.
"""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastio.checkpoint.naming import COMMIT_FILE, WRITING_FILE, tmp_dir
from fastio.checkpoint.record import CHECKSUM, CommitInfo, CommitRecord
from fastio.checkpoint.removal import quarantine, remove_step
from fastio.checkpoint.scan import StepEntry
from fastio.storage.atomic import atomic_write_bytes, fsync_dir, sync_file
from fastio.storage.checksum import digest_fd, digest_file

__all__ = ["commit", "commit_data", "data_files", "file_record", "start_tmp", "sync_tmp"]

_HASH_THREADS = 4
_NOT_FILES = (COMMIT_FILE, WRITING_FILE)


def data_files(path: Path) -> list[Path]:
    """The files of a step directory that its commit marker lists (all but fastio's marks and ``*.tmp``)."""
    return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name not in _NOT_FILES
                  and not p.name.endswith(".tmp"))


def start_tmp(root: Path, step: int) -> Path:
    """Create ``step-N.tmp`` with the writer's mark, moving an earlier one aside (or deleting it when it
    is this fastio's abandoned temporary). The caller holds the directory's lock. Nothing waits on the disk here
    (this runs on the training thread, where an fsync behind the last write's deletions took milliseconds to
    seconds): :func:`sync_tmp`, on the writer thread before the engine writes, makes it durable."""
    tmp = tmp_dir(root, step)
    if tmp.exists():
        entry = StepEntry(step, tmp)
        if entry.abandoned:
            remove_step(tmp)
        else:
            quarantine(tmp)
    tmp.mkdir(parents=True)
    atomic_write_bytes(tmp / WRITING_FILE, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                       "time": time.time()}).encode(), sync=False)
    return tmp


def sync_tmp(tmp: Path) -> None:
    """Make what :func:`start_tmp` made durable (the writer's mark, the temporary and its name in the checkpoint
    directory) before any data file is written into it."""
    sync_file(tmp / WRITING_FILE)
    fsync_dir(tmp.parent)


def _hash_and_sync(path: Path, known: dict[str, Any] | None = None) -> tuple[int, str]:
    """``(size, checksum)`` of a freshly written file, flushed to disk through the same descriptor: ``known``'s
    (the engine's record of the bytes it wrote) when it has this checksum and the file's size, else read back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if known and CHECKSUM in known and known["bytes"] == os.fstat(fd).st_size:
            result = known["bytes"], known[CHECKSUM]
        else:
            result = digest_fd(fd, CHECKSUM)
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _directories(tmp: Path, paths: list[Path]) -> list[Path]:
    """Every directory from ``tmp`` down to each of ``paths``, deepest first: also those holding only directories
    (torchsnapshot's ``0/``), whose entries an fsync of the files' own directories does not make durable."""
    found = {tmp}
    for path in paths:
        found.update(p for p in path.parents if p.is_relative_to(tmp))
    return sorted(found, key=lambda p: -len(p.parts))


def file_record(path: Path) -> dict[str, Any]:
    """What a commit marker lists for one file: ``{"bytes": size, CHECKSUM: digest}``."""
    size, digest = digest_file(path, CHECKSUM)
    return {"bytes": size, CHECKSUM: digest}


def commit_data(files: dict[str, dict[str, Any]], *, step: int, info: CommitInfo) -> CommitRecord:
    """The commit marker of ``step`` listing ``files`` (relative path -> :func:`file_record`)."""
    return CommitRecord.new(files, step=step, info=info)


def commit(tmp: Path, final: Path, *, step: int, info: CommitInfo,
           known: dict[str, dict[str, Any]] | None = None) -> CommitRecord:
    """Checksum every file of the fully written ``tmp``, write the marker last, rename to ``final``
    (an existing ``final`` is moved aside by :func:`~fastio.checkpoint.removal.quarantine`, not deleted). ``info``
    with a ``compression`` makes a version 3 marker. ``known``: files (relative to ``tmp``) whose size and checksum
    the engine took from the bytes it wrote; those are not read back (the rest are)."""
    paths = data_files(tmp)
    known = known or {}
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:  # overlaps the fsyncs' waits on the disk
        sums = list(pool.map(lambda p: _hash_and_sync(p, known.get(p.relative_to(tmp).as_posix())), paths))
    files = {p.relative_to(tmp).as_posix(): {"bytes": size, CHECKSUM: digest}
             for p, (size, digest) in zip(paths, sums)}
    for d in _directories(tmp, paths):
        fsync_dir(d)
    data = commit_data(files, step=step, info=info)
    atomic_write_bytes(tmp / COMMIT_FILE, data.encode())
    if final.exists():
        quarantine(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return data
