"""On-disk layout of a checkpoint directory: ``step-N.tmp/`` while writing, ``step-N/`` once committed.

A checkpoint counts only when its directory is named ``step-N`` and holds a valid commit marker
(``fastio-commit.json``: step, time, metrics, the engine that wrote the files, and the size and sha256
of every other file), written last with fsync before the rename. Anything else under DIR that looks
like a step is uncommitted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.atomic import atomic_write_bytes, fsync_dir
from fastio.checkpoint.engines import DEFAULT_ENGINE
from fastio.checksum import sha256_fd, sha256_file
from fastio.errors import CheckpointError

__all__ = [
    "COMMIT_FILE",
    "COMMIT_FORMAT",
    "COMMIT_VERSION",
    "StepEntry",
    "apply_retention",
    "clean_uncommitted",
    "commit",
    "committed",
    "list_checkpoints",
    "read_commit",
    "remove_step",
    "scan",
    "step_dir",
    "tmp_dir",
    "verify",
    "verify_report",
    "verify_step",
    "VerifyReport",
]

COMMIT_FILE = "fastio-commit.json"
COMMIT_FORMAT = "fastio-checkpoint"
COMMIT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)(\.tmp)?$")
_HASH_THREADS = 4


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}.tmp"


@dataclass
class StepEntry:
    """One ``step-N`` or ``step-N.tmp`` directory; ``commit`` is its parsed marker when committed."""

    step: int
    path: Path
    commit: dict[str, Any] | None = None
    problem: str | None = field(default=None)

    @property
    def committed(self) -> bool:
        return self.commit is not None


def read_commit(path: Path) -> dict[str, Any]:
    """Parse and check ``path``'s commit marker; CheckpointError naming the file when it is bad."""
    marker = Path(path) / COMMIT_FILE
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no commit marker {COMMIT_FILE} (uncommitted checkpoint)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{marker}: unreadable commit marker: {err}") from None
    if not isinstance(data, dict) or data.get("format") != COMMIT_FORMAT:
        raise CheckpointError(f"{marker}: not a fastio commit marker")
    if data.get("version") != COMMIT_VERSION:
        raise CheckpointError(f"{marker}: commit marker version {data.get('version')!r}, expected {COMMIT_VERSION}")
    if not isinstance(data.get("files"), dict) or not isinstance(data.get("step"), int):
        raise CheckpointError(f"{marker}: commit marker lacks 'files' or 'step'")
    return data


def scan(root: Path) -> list[StepEntry]:
    """Every step directory under ``root``, oldest step first (a missing ``root`` has none)."""
    root = Path(root)
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        step = int(m.group(1))
        if m.group(2):
            entries.append(StepEntry(step, child, None, "uncommitted (write in progress or interrupted)"))
            continue
        try:
            data = read_commit(child)
        except CheckpointError as err:
            entries.append(StepEntry(step, child, None, str(err)))
            continue
        if data["step"] != step:
            entries.append(StepEntry(step, child, None, f"{child}: commit marker says step {data['step']}"))
        else:
            entries.append(StepEntry(step, child, data))
    return sorted(entries, key=lambda e: (e.step, e.committed))


def committed(root: Path) -> list[StepEntry]:
    """The committed step directories under ``root``, oldest first."""
    return [e for e in scan(root) if e.committed]


def _hash_and_sync(path: Path) -> tuple[int, str]:
    """``(size, sha256)`` of a freshly written file, flushed to disk through the same descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        result = sha256_fd(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != COMMIT_FILE
                  and not p.name.endswith(".tmp"))


def commit(tmp: Path, final: Path, *, step: int, info: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file of the fully written ``tmp``, write the marker last, rename to ``final``."""
    paths = _files(tmp)
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:  # overlaps the fsyncs' waits on the disk
        sums = list(pool.map(_hash_and_sync, paths))
    files = {p.relative_to(tmp).as_posix(): {"bytes": size, "sha256": digest}
             for p, (size, digest) in zip(paths, sums)}
    for d in sorted({p.parent for p in paths} | {tmp}, key=lambda p: -len(p.parts)):
        fsync_dir(d)
    now = time.time()
    data = {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "step": step, "time": now,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "bytes": sum(f["bytes"] for f in files.values()), **info, "files": files}
    atomic_write_bytes(tmp / COMMIT_FILE, json.dumps(data, indent=1, sort_keys=True).encode())
    if final.exists():
        remove_step(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return data


def remove_step(path: Path) -> None:
    """Delete a step directory; its marker goes first so a half-deleted one reads as uncommitted."""
    try:
        (Path(path) / COMMIT_FILE).unlink()
        fsync_dir(Path(path))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def clean_uncommitted(root: Path) -> list[Path]:
    """Delete every uncommitted step directory under ``root``; returns what was deleted."""
    removed = []
    for entry in scan(root):
        if not entry.committed:
            remove_step(entry.path)
            removed.append(entry.path)
    return removed


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep`` (0 keeps all; the newest always stays)."""
    if keep <= 0:
        return []
    done = committed(root)
    old = done[:-keep] if len(done) > keep else []
    for entry in old:
        remove_step(entry.path)
    return [e.path for e in old]


def verify_step(entry: StepEntry) -> list[str]:
    """Problems with one step directory, one line each (empty when every checksum matches)."""
    if not entry.committed:
        return [f"{entry.path}: {entry.problem}"]
    problems = []
    listed = entry.commit["files"]
    for rel, want in sorted(listed.items()):
        p = entry.path / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size, digest = sha256_file(p)
        if size != want.get("bytes"):
            problems.append(f"{p}: size {size}, commit marker says {want.get('bytes')}")
        elif digest != want.get("sha256"):
            problems.append(f"{p}: sha256 {digest[:16]}..., commit marker says {str(want.get('sha256'))[:16]}...")
    for p in _files(entry.path):
        if p.relative_to(entry.path).as_posix() not in listed:
            problems.append(f"{p}: not listed in the commit marker")
    return problems


@dataclass
class VerifyReport:
    """What :func:`verify_report` found."""

    problems: list[str]
    """One line per problem, naming the file or directory; empty when everything checked out."""
    steps: list[int]
    """The committed steps that were checked, oldest first."""


def verify_report(root: Path, *, include_uncommitted: bool = False) -> VerifyReport:
    """Check every committed checkpoint under ``root`` against its commit marker (and report step
    directories that are not committed: always a ``step-N`` without a valid marker, ``step-N.tmp``
    ones too when ``include_uncommitted``)."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    problems, steps = [], []
    for entry in scan(root):
        if entry.committed or include_uncommitted or not entry.path.name.endswith(".tmp"):
            problems += verify_step(entry)
        if entry.committed:
            steps.append(entry.step)
    return VerifyReport(problems, steps)


def verify(root: Path, *, include_uncommitted: bool = False) -> list[str]:
    """Problems found in every committed checkpoint under ``root`` (and in-progress ones when asked)."""
    return verify_report(root, include_uncommitted=include_uncommitted).problems


def list_checkpoints(root: Path) -> list[dict]:
    """One row per step directory: step, committed, bytes, engine, time, epoch, metrics, problem."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    rows = []
    for e in scan(root):
        c = e.commit or {}
        size = c.get("bytes")
        if size is None:
            size = sum(p.stat().st_size for p in e.path.rglob("*") if p.is_file())
        rows.append({"step": e.step, "path": str(e.path), "committed": e.committed, "bytes": size,
                     "engine": c.get("engine", DEFAULT_ENGINE) if e.committed else None,
                     "time_utc": c.get("time_utc"), "epoch": c.get("epoch"), "metrics": c.get("metrics", {}),
                     "files": len(c.get("files", {})), "problem": e.problem})
    return rows
