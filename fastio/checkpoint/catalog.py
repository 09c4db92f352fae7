"""What ``fastio ckpt ls`` and ``fastio ckpt verify`` show: the checkpoints of a directory or of an ``s3://`` prefix.

A directory is read by :mod:`fastio.checkpoint.layout`. On an object store a step is committed when
``step-N/fastio-commit.json`` exists (the Checkpointer uploads it last); a ``step-N/`` without it is an upload in
progress or one that failed (shown as incomplete, and verified only with ``include_uncommitted``); a
``step-N.quarantined/`` prefix (a superseded step moved aside by a new step of its number) is listed as
quarantined. Verifying a
committed step downloads it into a temporary directory, one step at a time, and checks every file against its
marker exactly as on disk; nothing on the store is changed.
"""


from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fastio.checkpoint.layout import VerifyReport, list_checkpoints, listing_row, verify_report, verify_step
from fastio.checkpoint.naming import COMMIT_FILE, parse_quarantined_name, step_name
from fastio.checkpoint.record import parse_commit
from fastio.checkpoint.rollback import SUPERSEDED, SUPERSEDED_FILE, pending_remote_rollback
from fastio.checkpoint.scan import StepEntry, read_commit, remote_steps
from fastio.errors import CheckpointError, StorageError
from fastio.storage import open_storage, parse_location
from fastio.storage.base import Storage
from fastio.storage.lock import LOCK_NAME
from fastio.storage.mirror import DirMirror

__all__ = ["list_steps", "verify_steps"]


def list_steps(where: str | Path, storage_options: dict | None = None) -> tuple[str, list[dict]]:
    """``(where, rows)``: one row per step (see :func:`list_checkpoints`) of a checkpoint
    directory or ``s3://`` prefix, oldest first."""
    loc = parse_location(str(where))
    if not loc.remote:
        return str(loc.path), list_checkpoints(loc.path)
    storage = open_storage(loc, storage_options)
    rows = []
    doomed = pending_remote_rollback(storage)
    for step, sizes in remote_steps(storage).items():
        name = step_name(step)
        commit, problem = None, None
        if step in doomed:
            problem = SUPERSEDED
        elif COMMIT_FILE in sizes:
            try:
                commit = parse_commit(_get(storage, f"{name}/{COMMIT_FILE}"),
                                      storage.url_of(f"{name}/{COMMIT_FILE}"))
            except CheckpointError as err:
                problem = str(err)
        elif SUPERSEDED_FILE in sizes:
            problem = SUPERSEDED
        else:
            problem = f"{storage.url_of(name)}: no {COMMIT_FILE} (an upload in progress, or one that failed)"
        size = commit.bytes if commit else None
        rows.append(listing_row(step, storage.url_of(name), commit,
                                sum(sizes.values()) if size is None else size, problem))
    for name, (step, size) in _quarantined(storage).items():
        rows.append(listing_row(step, storage.url_of(name), None, size, "quarantined: moved aside by fastio "
                                "(a superseded step of the number a new one took)"))
    return storage.url, sorted(rows, key=lambda r: (r["step"], r["path"]))


def _quarantined(storage: Storage) -> dict[str, tuple[int, int]]:
    """``{name: (step, bytes)}`` of every ``step-N.quarantined/`` prefix on the store."""
    try:
        objects = storage.list()  # a store lists by whole path segments: no "step-" prefix
    except StorageError as err:
        raise CheckpointError(f"{storage.url}: cannot list checkpoints: {err}") from None
    found: dict[str, tuple[int, int]] = {}
    for o in objects:
        top = o.key.partition("/")[0]
        step = parse_quarantined_name(top)
        if step is not None:
            found[top] = (step, found.get(top, (step, 0))[1] + o.size)
    return found


def verify_steps(where: str | Path, *, include_uncommitted: bool = False,
                 storage_options: dict | None = None) -> tuple[str, VerifyReport]:
    """``(where, report)``: every committed checkpoint of a directory or ``s3://`` prefix checked against its
    commit marker (see :func:`verify_report`). CheckpointError when ``where`` holds no
    checkpoints at all (no step, no lock)."""
    loc = parse_location(str(where))
    if not loc.remote:
        return str(loc.path), verify_report(loc.path, include_uncommitted=include_uncommitted)
    storage = open_storage(loc, storage_options)
    steps = remote_steps(storage)
    if not steps and storage.head(LOCK_NAME) is None:
        raise CheckpointError(f"{storage.url}: not a checkpoint prefix (no step-N/, no {LOCK_NAME})")
    mirror = DirMirror(storage, COMMIT_FILE)
    problems, verified, vanished = [], [], []
    doomed = pending_remote_rollback(storage)
    with tempfile.TemporaryDirectory(prefix="fastio-ckpt-verify-") as tmp:
        for step, sizes in steps.items():
            name = step_name(step)
            url = storage.url_of(name)
            if step in doomed or COMMIT_FILE not in sizes and SUPERSEDED_FILE in sizes:
                continue  # superseded: no checkpoint any more, and not damaged either
            if COMMIT_FILE not in sizes:
                if include_uncommitted:
                    problems.append(f"{url}: no {COMMIT_FILE} (an upload in progress, or one that failed)")
                continue
            local = Path(tmp) / name
            try:
                mirror.pull(name, local)
                found = verify_step(StepEntry(step, local, read_commit(local)))
            except (StorageError, CheckpointError) as err:
                found = [str(err)]
            shutil.rmtree(local, ignore_errors=True)
            if found and not _marked(storage, name):  # retention deletes the marker first: being deleted
                vanished.append(step)
                continue
            problems += [p.replace(str(local), url) for p in found]
            verified.append(step)
    return storage.url, VerifyReport(problems, verified, vanished)


def _marked(storage: Storage, name: str) -> bool:
    """True when ``name/`` still holds its commit marker (an unreachable store counts as marked: not skipped)."""
    try:
        return storage.head(f"{name}/{COMMIT_FILE}") is not None
    except StorageError:
        return True


def _get(storage: Storage, key: str) -> bytes:
    try:
        return storage.get(key)
    except StorageError as err:
        raise CheckpointError(f"{storage.url_of(key)}: cannot read: {err}") from None
