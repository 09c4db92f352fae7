"""What a checkpoint directory (or ``s3://`` prefix) holds: its step directories, which are committed, and whether
it is a checkpoint directory at all.

A checkpoint counts only when its directory is named ``step-N`` and holds a valid commit marker
(``fastio-commit.json``, :class:`~fastio.checkpoint.record.CommitRecord`: step, time, the save's progress, the
engine that wrote the files, and the size and checksum of every other file: xxh3-128 since marker version 2,
sha256 in version 1), written last with fsync before the rename (:mod:`fastio.checkpoint.publish`). Anything else
under DIR that looks like a step is not committed. A compressed checkpoint (:mod:`fastio.checkpoint.compress`) has a
version 3 marker with ``"compression": "zstd"``, and its files are listed as stored (``NAME.zst``); older fastio
versions refuse version 3 instead of misreading it. A step of a rollback in progress, or superseded by one
(:mod:`fastio.checkpoint.rollback`), is no checkpoint. A restore's ``.step-N.restore-PID`` is never seen here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastio.checkpoint.naming import (
    COMMIT_FILE,
    WRITING_FILE,
    is_step_like_name,
    parse_step_dir_name,
    parse_step_name,
)
from fastio.checkpoint.record import CommitRecord, parse_commit
from fastio.checkpoint.rollback import SUPERSEDED, SUPERSEDED_FILE, pending_rollback
from fastio.dataset.manifest import FORMAT, MANIFEST_NAME, SPLITS_FORMAT, SPLITS_NAME
from fastio.errors import CheckpointError, StorageError
from fastio.storage.atomic import tmp_path_for
from fastio.storage.base import Storage
from fastio.storage.lock import LOCK_NAME

__all__ = [
    "StepEntry",
    "committed",
    "holds_only_writer_marks",
    "is_checkpoint_dir",
    "read_commit",
    "refuse_dataset_dir",
    "refuse_empty_prefix",
    "refuse_file_or_step",
    "remote_steps",
    "scan",
]

_WRITER_MARKS = frozenset({WRITING_FILE, tmp_path_for(Path(WRITING_FILE)).name})


@dataclass
class StepEntry:
    """One ``step-N`` or ``step-N.tmp`` directory; ``commit`` is its parsed marker when committed."""

    step: int
    path: Path
    commit: CommitRecord | None = None
    problem: str | None = field(default=None)
    superseded: bool = False
    """A committed step made no checkpoint by a later commit of a lower step (a rollback)."""

    @property
    def committed(self) -> bool:
        return self.commit is not None

    @property
    def temporary(self) -> bool:
        return self.path.name.endswith(".tmp")

    @property
    def abandoned(self) -> bool:
        """This fastio's own temporary: ``step-N.tmp`` with the writer's mark (also one a kill left with its commit
        marker already written: a temporary is never a checkpoint until renamed to ``step-N``), or one holding
        nothing but the writer's mark half-written (a kill inside
        :func:`~fastio.checkpoint.publish.start_tmp`)."""
        return self.temporary and ((self.path / WRITING_FILE).is_file() or holds_only_writer_marks(self.path))


def holds_only_writer_marks(path: Path) -> bool:
    """True when directory ``path`` holds nothing but fastio's writer's mark and its half-written temporary
    (``fastio-writing.json``, ``.fastio-writing.json.tmp``), or nothing at all: no data that could be lost."""
    try:
        return all(child.name in _WRITER_MARKS and child.is_file() and not child.is_symlink()
                   for child in Path(path).iterdir())
    except OSError:
        return False


def read_commit(path: Path) -> CommitRecord:
    """Parse and check ``path``'s commit marker; CheckpointError naming the file when it is bad."""
    marker = Path(path) / COMMIT_FILE
    try:
        text = marker.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no commit marker {COMMIT_FILE} (uncommitted checkpoint)") from None
    except OSError as err:
        raise CheckpointError(f"{marker}: unreadable commit marker: {err}") from None
    return parse_commit(text, str(marker))


def _temporary(step: int, child: Path) -> StepEntry:
    entry = StepEntry(step, child, None)
    entry.problem = ("uncommitted (write in progress or interrupted)" if entry.abandoned else
                     f"uncommitted, and without fastio's mark {WRITING_FILE}: not fastio's own temporary")
    return entry


def _named(step: int, child: Path, doomed: frozenset[int]) -> StepEntry | None:
    """The entry of ``step-N`` directory ``child`` (None when it was deleted since it was listed)."""
    try:
        data = read_commit(child)
    except CheckpointError as err:
        if not child.exists():  # deleted (renamed away first) since it was listed: no step any more
            return None
        superseded = not (child / COMMIT_FILE).exists() and (child / SUPERSEDED_FILE).is_file()
        return StepEntry(step, child, None, SUPERSEDED if superseded else str(err), superseded)
    if data.step != step:
        return StepEntry(step, child, None, f"{child}: commit marker says step {data.step}")
    if step in doomed:  # a rollback a kill cut short: superseded, whatever its marker is still called
        return StepEntry(step, child, None, SUPERSEDED, True)
    return StepEntry(step, child, data)


_RESCANS = 5
"""How many times a listing that lost a step while it was read is taken again (:func:`scan`)."""


def scan(root: Path) -> list[StepEntry]:
    """Every step directory under ``root``, oldest step first (a missing ``root`` has none). A step deleted between
    the listing and the read of its marker (a writer's retention beside a read-only restore or ``ckpt ls``) makes
    the listing be taken again: with ``keep=1`` the step committed meanwhile is then seen, where the listing would
    otherwise hold no step at all."""
    root = Path(root)
    if not root.is_dir():
        return []
    for _ in range(_RESCANS):
        entries, lost = _scan_once(root)
        if not lost:
            break
    return entries


def _scan_once(root: Path) -> tuple[list[StepEntry], bool]:
    """:func:`scan`'s listing, and whether a step listed was gone when its marker was read."""
    entries, lost = [], False
    doomed = pending_rollback(root)
    for child in root.iterdir():
        parsed = parse_step_dir_name(child.name)
        if not parsed or not child.is_dir():
            lost = lost or bool(parsed) and not os.path.lexists(child)  # renamed away since listed (not a dead link)
            continue
        step, temporary = parsed
        entry = _temporary(step, child) if temporary else _named(step, child, doomed)
        if entry is not None:
            entries.append(entry)
        lost = lost or entry is None
    return sorted(entries, key=lambda e: (e.step, e.committed)), lost


def committed(root: Path) -> list[StepEntry]:
    """The committed step directories under ``root``, oldest first."""
    return [e for e in scan(root) if e.committed]


def is_checkpoint_dir(root: Path) -> bool:
    """True when ``root`` holds a Checkpointer's lock file or anything named like a step directory."""
    root = Path(root)
    return (root / LOCK_NAME).exists() or any(is_step_like_name(p.name) for p in root.iterdir())


def refuse_dataset_dir(root: Path | Storage) -> None:
    """CheckpointError when ``root`` (a directory, or an ``s3://`` prefix's Storage) is a fastio dataset (its
    ``manifest.json`` or ``splits.json`` says so): a Checkpointer must not drop its lock (lease) and steps among a
    dataset's files."""
    for name, fmt in ((MANIFEST_NAME, FORMAT), (SPLITS_NAME, SPLITS_FORMAT)):
        try:
            data = json.loads(_read(root, name))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == fmt:
            where = root.url if isinstance(root, Storage) else root
            raise CheckpointError(f"{where}: is a fastio dataset ({name}), not a checkpoint directory; give the "
                                  "Checkpointer a directory of its own, e.g. a sibling such as ckpt/")


def _read(root: Path | Storage, name: str) -> bytes:
    """``name`` under ``root``; OSError if there is none (a store that cannot be read is a CheckpointError)."""
    if not isinstance(root, Storage):
        return (Path(root) / name).read_bytes()
    try:
        if root.head(name) is None:
            raise FileNotFoundError(name)
        return root.get(name)
    except StorageError as err:
        if err.missing:
            raise FileNotFoundError(name) from None
        raise CheckpointError(f"{root.url}: cannot read: {err}") from None


def refuse_file_or_step(root: Path) -> None:
    """CheckpointError when ``root``, given as a checkpoint directory, is a file, or one step of a checkpoint
    directory (``step-N`` holding its commit marker, a ``step-N.tmp`` holding the writer's mark): a mistake for the
    directory holding it, named. A Checkpointer there would write into a checkpoint (which retention then deletes
    with everything in it)."""
    root = Path(root)
    if root.is_file():
        raise CheckpointError(f"{root}: is a file, not a checkpoint directory")
    step = parse_step_dir_name(root.name)
    if step is not None and ((root / COMMIT_FILE).is_file() or (root / WRITING_FILE).is_file()):
        raise CheckpointError(f"{root}: is one checkpoint (step {step[0]}), not a checkpoint directory: give the "
                              f"directory holding it, {root.parent}")


def refuse_empty_prefix(storage: Storage, steps: dict[int, dict[str, int]], why: str = "") -> None:
    """CheckpointError when an ``s3://`` prefix, given as a checkpoint directory, holds no ``step-N/`` (``steps``:
    :func:`remote_steps`) and no writer's lease (``.fastio-lock``): a mistyped prefix, or another thing's (a dataset),
    not a run that has not saved yet (its writer holds the lease). ``why`` ends the message."""
    if not steps and _lease_size(storage) is None:
        raise CheckpointError(f"{storage.url}: not a checkpoint prefix (no step-N/, no {LOCK_NAME}){why}")


def _lease_size(storage: Storage) -> int | None:
    try:
        return storage.head(LOCK_NAME)
    except StorageError as err:
        raise CheckpointError(f"{storage.url}: cannot list checkpoints: {err}") from None


def remote_steps(storage: Storage) -> dict[int, dict[str, int]]:
    """``{step: {key under step-N/: size}}`` of every ``step-N/`` prefix on a store, oldest step first."""
    try:
        objects = storage.list()
    except StorageError as err:
        raise CheckpointError(f"{storage.url}: cannot list checkpoints: {err}") from None
    steps: dict[int, dict[str, int]] = {}
    for o in objects:
        top, _, rest = o.key.partition("/")
        step = parse_step_name(top)
        if step is not None and rest:
            steps.setdefault(step, {})[rest] = o.size
    return dict(sorted(steps.items()))
