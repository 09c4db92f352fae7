"""What ``fastio ckpt ls`` and ``fastio ckpt verify`` show, and the check of a step's files against its marker: the
checkpoints of a directory or of an ``s3://`` prefix.

A directory is read by :func:`fastio.checkpoint.scan.scan`; every committed step's files are checked against its
commit marker (:func:`verify_step`; a restore checks the step it loads with :func:`verify_files`). On an object
store a step is committed when ``step-N/fastio-commit.json`` exists (the Checkpointer uploads it last); a
``step-N/`` without it is an upload in progress or one that failed (shown as incomplete, and verified only with
``include_uncommitted``); a ``step-N.quarantined/`` prefix (a superseded step moved aside by a new step of its
number) is listed as quarantined. Verifying a committed step on a store downloads it into a temporary directory,
one step at a time, and checks every file against its marker exactly as on disk; nothing on the store is
changed. Superseded steps (:mod:`fastio.checkpoint.rollback`) are listed as such and not verified.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.checkpoint.naming import COMMIT_FILE, QUARANTINE_SUFFIX, parse_quarantined_name, step_name
from fastio.checkpoint.publish import data_files
from fastio.checkpoint.record import CommitRecord, parse_commit
from fastio.checkpoint.rollback import SUPERSEDED, SUPERSEDED_FILE, pending_remote_rollback
from fastio.checkpoint.scan import (
    StepEntry,
    is_checkpoint_dir,
    read_commit,
    refuse_dataset_dir,
    refuse_empty_prefix,
    refuse_file_or_step,
    remote_steps,
    scan,
)
from fastio.errors import CheckpointError, StorageError
from fastio.storage import open_storage, parse_location
from fastio.storage.base import Storage
from fastio.storage.checksum import DIGESTS, digest_file, open_hashed
from fastio.storage.lock import LOCK_NAME
from fastio.storage.mirror import DirMirror
from fastio.words import count

__all__ = [
    "VerifyReport",
    "list_checkpoints",
    "list_steps",
    "listing_row",
    "share_files",
    "still_committed",
    "verify",
    "verify_files",
    "verify_report",
    "verify_step",
    "verify_steps",
]


# ---------------------------------------------------------------- checking a step's files


def _check_file(p: Path, want: dict[str, Any], held: dict[str, Any] | None = None, name: str = "") -> str | None:
    """The problem with file ``p`` against its marker entry ``want``, None when intact: its size first (a file of
    another size is named with both sizes, nothing of it read), then its checksum (a file cut short while it is read
    is named with the offset reached). With ``held`` (a dict), the file is kept open when intact, under ``name``, for
    the restore to read again (:func:`fastio.storage.checksum.open_hashed`: by ``pread``, never mapped)."""
    algo = next((a for a in DIGESTS if a in want), None)
    if algo is None:
        return f"{p}: the commit marker records no known checksum ({', '.join(sorted(want))})"
    opened = None
    try:
        size = p.stat().st_size
        if size != want.get("bytes"):
            return f"{p}: size {size}, commit marker says {want.get('bytes')}"
        if held is None:
            found, digest = digest_file(p, algo)
        else:
            found, digest, opened = open_hashed(p, algo, size)
    except FileNotFoundError:
        return f"{p}: missing"
    except OSError as err:
        return f"{p}: unreadable: {err.strerror or err}"
    if found != size:  # another process's truncation or append meanwhile
        how = f"cut short while read: it ended at offset {found}" if found < size else f"grew to {count(found, 'byte')}"
        return f"{p}: {how}, commit marker says {count(size, 'byte')}"
    if digest != want[algo]:
        return f"{p}: {algo} {digest[:16]}..., commit marker says {str(want[algo])[:16]}..."
    if held is not None:
        held[name] = opened
    return None


def share_files(files: list[str], part: tuple[int, int], owners: dict[str, int] | None = None) -> list[str]:
    """Part ``i`` of ``n``'s files (``part=(i, n)``), sorted: each file ``owners`` gives a part to (the part that
    will read it anyway) goes to that part, the others are dealt out every n-th from the i-th. Every file goes to
    exactly one part."""
    i, n = part
    owner = {f: o for f, o in (owners or {}).items() if 0 <= o < n}
    rest = sorted(f for f in files if f not in owner)
    return sorted([f for f in files if owner.get(f) == i] + rest[i::n])


def verify_files(entry: StepEntry, *, part: tuple[int, int] = (0, 1), owners: dict[str, int] | None = None,
                 held: dict[str, Any] | None = None) -> list[str]:
    """Problems with the listed files of a committed step, one line each: ``part=(i, n)`` checks its share of
    the files (:func:`share_files`: n ranks share the reading). With ``held``, the files ``owners`` gives this
    part are kept open in ``held`` (by path relative to the step) when intact: the restore reads them there."""
    listed = entry.commit.files
    # One thread: xxh3 runs at memory speed, and threads measured slower (bench/checkpoint.py, integrity).
    mine = (owners or {}) if held is not None else {}

    def check(rel: str) -> str | None:
        if mine.get(rel) == part[0]:
            return _check_file(entry.path / rel, listed[rel], held, rel)
        return _check_file(entry.path / rel, listed[rel])

    return [p for p in map(check, share_files(list(listed), part, owners)) if p]


def verify_step(entry: StepEntry) -> list[str]:
    """Problems with one step directory, one line each (empty when every checksum matches)."""
    if not entry.committed:
        return [f"{entry.path}: {entry.problem}" if not entry.problem.startswith(str(entry.path))
                else entry.problem]
    problems = verify_files(entry)
    listed = entry.commit.files
    for p in data_files(entry.path):
        if p.relative_to(entry.path).as_posix() not in listed:
            problems.append(f"{p}: not listed in the commit marker")
    return problems


def still_committed(entry: StepEntry) -> bool:
    """True when committed ``entry``'s directory still holds the commit marker it was listed with (False once
    retention has renamed it away to delete it, or a rollback superseded it, after :func:`scan` listed it)."""
    try:
        return read_commit(entry.path) == entry.commit
    except CheckpointError:
        return False


# ---------------------------------------------------------------- a directory


@dataclass
class VerifyReport:
    """What :func:`verify_report` found."""

    problems: list[str]
    """One line per problem, naming the file or directory; empty when everything checked out."""
    steps: list[int]
    """The committed steps that were checked, oldest first."""
    vanished: list[int] = field(default_factory=list)
    """Committed steps that retention deleted (or a rollback superseded) while they were being checked: skipped,
    not damaged."""


def _local_root(root: Path) -> Path:
    """``root`` as a directory the commands read: CheckpointError when it is missing, a file, one step of a
    checkpoint directory (a mistake for the directory holding it, named) or a dataset (whose writer's lock file,
    ``.fastio-lock``, is no Checkpointer's)."""
    root = Path(root)
    refuse_file_or_step(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    refuse_dataset_dir(root)
    return root


def _check_root(root: Path) -> Path:
    root = _local_root(root)
    if not is_checkpoint_dir(root):
        raise CheckpointError(f"{root}: not a checkpoint directory (no step-N directories, no {LOCK_NAME})")
    return root


def verify_report(root: Path, *, include_uncommitted: bool = False) -> VerifyReport:
    """Check every committed checkpoint under ``root`` against its commit marker (and report step
    directories that are not committed: always a ``step-N`` without a valid marker, ``step-N.tmp``
    ones too when ``include_uncommitted``). Superseded steps are skipped, and so is a committed step that is
    deleted while it is checked (``vanished``). CheckpointError when ``root`` is not a checkpoint directory."""
    root = _check_root(root)
    report = VerifyReport([], [])
    for entry in scan(root):
        if entry.superseded:  # no checkpoint any more, and not damaged either
            continue
        found = verify_step(entry) if entry.committed or include_uncommitted or not entry.temporary else []
        if found and entry.committed and not still_committed(entry):
            report.vanished.append(entry.step)  # being deleted by retention (renamed away first), not damaged
            continue
        report.problems += found
        if entry.committed:
            report.steps.append(entry.step)
    return report


def verify(root: Path, *, include_uncommitted: bool = False) -> list[str]:
    """Problems found in every committed checkpoint under ``root`` (and in-progress ones when asked)."""
    return verify_report(root, include_uncommitted=include_uncommitted).problems


def list_checkpoints(root: Path) -> list[dict]:
    """One row per step directory (quarantined ones too): step, committed, bytes (as stored), engine, checksum,
    compression, time, epoch, metrics, problem."""
    root = _local_root(root)
    rows = []
    entries = scan(root)
    for child in sorted(root.iterdir()):
        step = parse_quarantined_name(child.name)
        if step is not None and child.is_dir():
            entries.append(StepEntry(step, child, None, "quarantined: moved aside by fastio (damaged, "
                                     "unrecognised or replaced); inspect it, then delete it or rename it back"))
    entries.sort(key=lambda e: (e.step, e.path.name))
    for e in entries:
        size = e.commit.bytes if e.commit else None
        if size is None:
            size = sum(p.stat().st_size for p in e.path.rglob("*") if p.is_file())
        rows.append(listing_row(e.step, str(e.path), e.commit, size, e.problem,
                                marker=not e.temporary and (e.path / COMMIT_FILE).is_file()))
    return rows


def listing_row(step: int, where: str, commit: CommitRecord | None, size: int, problem: str | None, *,
                marker: bool = False) -> dict:
    """One row of :func:`list_checkpoints` (``commit``: the parsed marker of a committed step, else None; ``marker``:
    the step holds a commit marker, which, not parsed, is one this fastio cannot read: ``unrecognised``, never
    ``incomplete``, the state of an interrupted write, whose cleanup would delete a whole checkpoint)."""
    c = commit
    state = ("committed" if c else "superseded" if problem == SUPERSEDED else
             "quarantined" if QUARANTINE_SUFFIX in where else "unrecognised" if marker else "incomplete")
    return {"step": step, "path": where, "committed": c is not None, "state": state, "bytes": size,
            "engine": c.engine if c else None, "checksum": c.checksum if c else None,
            "compression": c.compression if c else None, "time_utc": c.time_utc if c else None,
            "epoch": c.progress.epoch if c else None, "metrics": dict(c.progress.metrics) if c else {},
            "files": len(c.files) if c else 0, "problem": problem}


# ---------------------------------------------------------------- a directory or an s3:// prefix
def _location(where: str | Path):
    """``where`` parsed; CheckpointError for an empty one (an unset shell variable), which would be the current
    directory."""
    if not str(where).strip():
        raise CheckpointError(f"the checkpoint directory given is empty ({str(where)!r})")
    return parse_location(str(where))


def list_steps(where: str | Path, storage_options: dict | None = None) -> tuple[str, list[dict]]:
    """``(where, rows)``: one row per step (see :func:`list_checkpoints`) of a checkpoint
    directory or ``s3://`` prefix, oldest first."""
    loc = _location(where)
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
                                sum(sizes.values()) if size is None else size, problem, marker=COMMIT_FILE in sizes))
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
    loc = _location(where)
    if not loc.remote:
        return str(loc.path), verify_report(loc.path, include_uncommitted=include_uncommitted)
    storage = open_storage(loc, storage_options)
    steps = remote_steps(storage)
    refuse_empty_prefix(storage, steps)
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
            except StorageError as err:  # an object gone is damage; an unreachable store or a full disk is not
                if not err.missing:
                    raise CheckpointError(f"{url}: cannot be verified: {err}") from None
                found = [str(err)]
            except CheckpointError as err:
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
