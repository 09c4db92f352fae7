"""Rollbacks: ``restore_latest(step=S)`` while higher steps are committed, then saves from there; the rules in one
place, on disk and on an ``s3://`` store.

Before the first commit after it, every committed step numbered above S (the whole abandoned branch, also the
steps below the new one) is superseded: its marker is renamed to :data:`SUPERSEDED_FILE` (on a store: copied, then
deleted), every file kept, so the latest checkpoint is the newest of the run's current branch, a fallback never
reaches the abandoned branch, and retention counts only the current branch; nothing of the abandoned branch is
deleted. Crash-safe: :func:`start_rollback` first writes :data:`ROLLBACK_FILE` (the steps about to be superseded,
:func:`doomed_steps`; while it exists a scan counts them as superseded), :func:`finish_rollback` renames their
markers and then removes it, all before the new step is committed; a kill anywhere leaves restore the new branch
or S. :func:`start_remote_rollback` and :func:`finish_remote_rollback` do the same on a store (``PREFIX/``), each
write only after the caller's lease is confirmed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from fastio.checkpoint.naming import COMMIT_FILE, step_dir, step_name
from fastio.errors import CheckpointError, StorageError
from fastio.storage.atomic import atomic_write_bytes, fsync_dir
from fastio.storage.base import Storage

__all__ = [
    "ROLLBACK_FILE",
    "SUPERSEDED",
    "SUPERSEDED_FILE",
    "doomed_steps",
    "encode_rollback",
    "finish_remote_rollback",
    "finish_rollback",
    "parse_rollback",
    "pending_remote_rollback",
    "pending_rollback",
    "start_remote_rollback",
    "start_rollback",
    "supersede",
]

SUPERSEDED_FILE = "fastio-superseded.json"
"""A committed step's marker, renamed by :func:`supersede` when an older step was restored and saved after it."""
SUPERSEDED = ("superseded: a lower step was restored and saved after it (a rollback); its files are kept, "
              "it is no longer a checkpoint")
ROLLBACK_FILE = "fastio-rollback.json"
"""A rollback in progress (:func:`start_rollback`): the committed steps being superseded; none is a checkpoint."""
ROLLBACK_FORMAT = "fastio-rollback"


def encode_rollback(floor: int, steps: list[int]) -> bytes:
    """The bytes of a rollback record: steps above ``floor`` being superseded."""
    return json.dumps({"format": ROLLBACK_FORMAT, "version": 1, "rollback_to": floor, "steps": sorted(steps),
                       "time": time.time()}).encode()


def parse_rollback(text: bytes, where: str) -> frozenset[int]:
    """The steps a rollback record lists; CheckpointError naming ``where`` when it is not one."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where}: unreadable rollback record: {err}") from None
    steps = data.get("steps") if isinstance(data, dict) and data.get("format") == ROLLBACK_FORMAT else None
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise CheckpointError(f"{where}: not a fastio rollback record")
    return frozenset(steps)


def doomed_steps(pending: frozenset[int], committed: Iterable[int], floor: int) -> list[int]:
    """The steps a rollback to ``floor`` supersedes: every committed step above it, and those of a rollback a
    kill cut short (``pending``)."""
    return sorted(pending | {s for s in committed if s > floor})


def pending_rollback(root: Path) -> frozenset[int]:
    """The steps of a rollback in progress under ``root`` (:data:`ROLLBACK_FILE`); empty when there is none."""
    record = Path(root) / ROLLBACK_FILE
    try:
        return parse_rollback(record.read_bytes(), str(record))
    except FileNotFoundError:
        return frozenset()
    except OSError as err:
        raise CheckpointError(f"{record}: unreadable rollback record: {err.strerror or err}") from None


def start_rollback(root: Path, floor: int, committed: Iterable[int]) -> list[int]:
    """Before a commit that follows a restore of step ``floor``: record the :func:`doomed_steps` of the
    ``committed`` steps under ``root`` in :data:`ROLLBACK_FILE`, durably; from then on none of them is a
    checkpoint. Returns them (nothing is written when there are none)."""
    doomed = doomed_steps(pending_rollback(root), committed, floor)
    if doomed:
        atomic_write_bytes(Path(root) / ROLLBACK_FILE, encode_rollback(floor, doomed))
    return doomed


def supersede(path: Path) -> None:
    """Make committed ``path`` no checkpoint, keeping every file: its commit marker becomes ``SUPERSEDED_FILE``."""
    os.replace(Path(path) / COMMIT_FILE, Path(path) / SUPERSEDED_FILE)
    fsync_dir(Path(path))


def finish_rollback(root: Path) -> list[int]:
    """Supersede every step of the rollback recorded under ``root`` whose marker is still a commit marker, then
    remove the record; returns the steps it listed (none when there was no record)."""
    root = Path(root)
    doomed = sorted(pending_rollback(root))
    for step in doomed:
        path = step_dir(root, step)
        if (path / COMMIT_FILE).is_file():
            supersede(path)
    if doomed:
        (root / ROLLBACK_FILE).unlink()
        fsync_dir(root)
    return doomed


def pending_remote_rollback(storage: Storage) -> frozenset[int]:
    """The steps of a rollback in progress on the store (``PREFIX/fastio-rollback.json``): superseded, whatever
    their marker is still called."""
    try:
        if storage.head(ROLLBACK_FILE) is None:
            return frozenset()
    except StorageError as err:
        raise CheckpointError(f"{storage.url}: cannot list checkpoints: {err}") from err  # the cause tells an outage
    try:
        text = storage.get(ROLLBACK_FILE)
    except StorageError as err:
        raise CheckpointError(f"{storage.url_of(ROLLBACK_FILE)}: cannot read: {err}") from err
    return parse_rollback(text, storage.url_of(ROLLBACK_FILE))


def start_remote_rollback(storage: Storage, floor: int, committed: Callable[[frozenset[int]], Iterable[int]],
                          confirm: Callable[[], None]) -> list[int]:
    """:func:`start_rollback` on the store: the record written to ``PREFIX/`` after ``confirm()`` (the lease);
    ``committed(pending)`` lists the store's committed steps, given the steps of the rollback record just read
    (``pending``), so that it does not read the record again. StorageError and the lease's errors propagate."""
    pending = pending_remote_rollback(storage)
    doomed = doomed_steps(pending, committed(pending), floor)
    if doomed:
        confirm()
        storage.put_bytes(ROLLBACK_FILE, encode_rollback(floor, doomed))
    return doomed


def finish_remote_rollback(storage: Storage, confirm: Callable[[], None]) -> list[int]:
    """:func:`finish_rollback` on the store: each listed step's marker copied to ``SUPERSEDED_FILE``, then deleted
    (every other object kept), then the record deleted, after ``confirm()``; returns the steps it listed."""
    doomed = sorted(pending_remote_rollback(storage))
    if doomed:
        confirm()
    for s in doomed:
        sub = storage.child(step_name(s))
        if sub.head(COMMIT_FILE) is not None:
            sub.put_bytes(SUPERSEDED_FILE, sub.get(COMMIT_FILE))
            sub.delete(COMMIT_FILE)
    if doomed:
        storage.delete(ROLLBACK_FILE)
    return doomed
