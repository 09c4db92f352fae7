"""What has not moved out of the on-disk layout module yet:  (the names and rules that the final
``fastio.checkpoint`` modules of those names hold), and checking and listing a directory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.checkpoint.naming import QUARANTINE_SUFFIX, parse_quarantined_name
from fastio.checkpoint.publish import data_files
from fastio.checkpoint.record import CommitRecord
from fastio.checkpoint.rollback import SUPERSEDED
from fastio.checkpoint.scan import StepEntry, is_checkpoint_dir, read_commit, scan
from fastio.errors import CheckpointError
from fastio.storage.checksum import DIGESTS, digest_file
from fastio.storage.lock import LOCK_NAME

# ---------------------------------------------------------------- checking a step's files


def _check_file(p: Path, want: dict[str, Any]) -> str | None:
    algo = next((a for a in DIGESTS if a in want), None)
    if algo is None:
        return f"{p}: the commit marker records no known checksum ({', '.join(sorted(want))})"
    try:
        size, digest = digest_file(p, algo)
    except FileNotFoundError:
        return f"{p}: missing"
    except OSError as err:
        return f"{p}: unreadable: {err.strerror or err}"
    if size != want.get("bytes"):
        return f"{p}: size {size}, commit marker says {want.get('bytes')}"
    if digest != want[algo]:
        return f"{p}: {algo} {digest[:16]}..., commit marker says {str(want[algo])[:16]}..."
    return None


def verify_files(entry: StepEntry, *, part: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with the listed files of a committed step, one line each: ``part=(i, n)`` checks every
    n-th file from the i-th (so n ranks can share the reading)."""
    i, n = part
    listed = sorted(entry.commit.files.items())[i::n]
    # One thread: xxh3 runs at memory speed, and threads measured slower (bench/checkpoint.py, integrity).
    found = (_check_file(entry.path / rel, want) for rel, want in listed)
    return [p for p in found if p]


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


def _check_root(root: Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
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
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
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
        rows.append(listing_row(e.step, str(e.path), e.commit, size, e.problem))
    return rows


def listing_row(step: int, where: str, commit: CommitRecord | None, size: int, problem: str | None) -> dict:
    """One row of :func:`list_checkpoints` (``commit``: the parsed marker of a committed step, else None)."""
    c = commit
    state = ("committed" if c else "superseded" if problem == SUPERSEDED else
             "quarantined" if QUARANTINE_SUFFIX in where else "incomplete")
    return {"step": step, "path": where, "committed": c is not None, "state": state, "bytes": size,
            "engine": c.engine if c else None, "checksum": c.checksum if c else None,
            "compression": c.compression if c else None, "time_utc": c.time_utc if c else None,
            "epoch": c.progress.epoch if c else None, "metrics": dict(c.progress.metrics) if c else {},
            "files": len(c.files) if c else 0, "problem": problem}
