"""On-disk layout of a checkpoint directory: ``step-N.tmp/`` while writing, ``step-N/`` once committed.

A checkpoint counts only when its directory is named ``step-N`` and holds a valid commit marker
(``fastio-commit.json``, :class:`~fastio.checkpoint.record.CommitRecord`: step, time, the save's progress, the
engine that wrote the files, and the size and checksum of every other file: xxh3-128 since marker version 2,
sha256 in version 1), written last with fsync before the rename. Anything else under DIR that looks like a step
is not committed. A compressed checkpoint (:mod:`fastio.checkpoint.compress`) has a version 3 marker with
``"compression": "zstd"``, and its files are listed as stored (``NAME.zst``); older fastio versions
refuse version 3 instead of misreading it.

A restore of a compressed checkpoint decompresses into ``.step-N.restore-PID`` (hidden, marked with
``fastio-restoring.json``), deleted when the restore ends; :func:`scan` never sees it.

What may be deleted (the rules in one place):

- a ``step-N.tmp`` holding the writer's mark ``fastio-writing.json`` (with or without a commit marker: a
  kill can come between writing the marker and the rename) is this fastio's own abandoned temporary (a
  Checkpointer only looks while it holds the directory's lock, so no other writer is alive):
  :func:`remove_abandoned` deletes it;
- committed checkpoints older than the newest ``keep`` (:func:`apply_retention`), each renamed to a hidden
  ``.step-N.deleting-PID`` first and then deleted (:func:`remove_step`); :func:`remove_abandoned` finishes
  such a deletion a kill cut short;
- with an ``s3://`` dir staged node-locally, each node's ``step-N.tmp`` once its files are uploaded and the
  commit marker is on the store (:mod:`fastio.checkpoint.remote`; no node holds the whole step);
- on an ``s3://`` store, while holding its lease: committed steps older than the newest ``keep`` (marker
  first), and ``step-N/`` objects without a commit marker older than the newest committed step (a deletion
  cut short), :mod:`fastio.checkpoint.remote`;
- a ``step-N.tmp``, or one moved aside as ``step-N.tmp.quarantined``, that holds nothing at all but the writer's
  mark or its half-written ``.fastio-writing.json.tmp`` (a kill between creating the temporary and publishing
  its mark): :func:`remove_abandoned` deletes it (no data can be in it);
- a ``.step-N.restore-PID`` holding ``fastio-restoring.json`` (a restore's decompressed copy of a committed
  step, left by a killed process): :func:`remove_abandoned` deletes it once process PID of the host its mark
  names has ended (another host's: a day after its mark was written), never under a restore still reading it
  (a read-only one beside training);
- nothing else. A ``step-N`` with a missing, unreadable or unknown commit marker, or whose files do not
  match it, and a ``step-N.tmp`` without the writer's mark holding anything else are left alone or moved aside by rename to
  ``step-N.quarantined`` (:func:`quarantine`), never deleted. A committed ``step-N`` about to be replaced
  by a new commit of the same step is moved aside too.

A rollback (``restore_latest(step=S)`` while higher steps are committed, then saves from there): before the
first commit after it, every committed step numbered above S (the whole abandoned branch, also the steps below
the new one) is superseded (:func:`supersede`: its marker is renamed to ``fastio-superseded.json``, every file
kept), so the latest checkpoint is the newest of the run's current branch, a fallback never reaches the
abandoned branch, and retention counts only the current branch; nothing of the abandoned branch is deleted.
Crash-safe: :func:`start_rollback` first writes ``fastio-rollback.json`` (the steps about to be superseded;
while it exists :func:`scan` counts them as superseded), :func:`finish_rollback` renames their markers and
then removes it, all before the new step is committed; a kill anywhere leaves restore the new branch or S.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.checkpoint.record import (
    CHECKSUM,
    COMMIT_FORMAT,
    COMMIT_VERSION,
    COMPRESSED_VERSION,
    READ_VERSIONS,
    CommitInfo,
    CommitRecord,
    parse_commit,
)
from fastio.dataset.manifest import FORMAT, MANIFEST_NAME, SPLITS_FORMAT, SPLITS_NAME
from fastio.errors import CheckpointError
from fastio.storage.atomic import atomic_write_bytes, fsync_dir, tmp_path_for
from fastio.storage.checksum import DIGESTS, digest_fd, digest_file
from fastio.storage.lock import LOCK_NAME

__all__ = [
    "CHECKSUM",
    "COMMIT_FILE",
    "COMMIT_FORMAT",
    "COMMIT_VERSION",
    "COMPRESSED_VERSION",
    "QUARANTINE_SUFFIX",
    "READ_VERSIONS",
    "RESTORING_FILE",
    "ROLLBACK_FILE",
    "WRITING_FILE",
    "CommitInfo",
    "CommitRecord",
    "StepEntry",
    "apply_retention",
    "commit",
    "commit_data",
    "committed",
    "data_files",
    "encode_commit",
    "encode_rollback",
    "finish_rollback",
    "file_record",
    "holds_only_writer_marks",
    "list_checkpoints",
    "listing_row",
    "parse_commit",
    "parse_quarantined_name",
    "quarantine_names",
    "parse_rollback",
    "pending_rollback",
    "quarantine",
    "read_commit",
    "refuse_dataset_dir",
    "remove_abandoned",
    "remove_step",
    "restore_dir",
    "scan",
    "start_restore_dir",
    "start_rollback",
    "start_tmp",
    "parse_step_name",
    "step_dir",
    "step_name",
    "still_committed",
    "supersede_above",
    "tmp_dir",
    "verify",
    "verify_files",
    "verify_report",
    "verify_step",
    "VerifyReport",
]

COMMIT_FILE = "fastio-commit.json"
WRITING_FILE = "fastio-writing.json"
"""The writer's mark in a ``step-N.tmp``: proof that fastio made it (host, pid, time)."""
QUARANTINE_SUFFIX = ".quarantined"
SUPERSEDED_FILE = "fastio-superseded.json"
"""A committed step's marker, renamed by :func:`supersede` when an older step was restored and saved after it."""
SUPERSEDED = ("superseded: a lower step was restored and saved after it (a rollback); its files are kept, "
              "it is no longer a checkpoint")
ROLLBACK_FILE = "fastio-rollback.json"
"""A rollback in progress (:func:`start_rollback`): the committed steps being superseded; none is a checkpoint."""
ROLLBACK_FORMAT = "fastio-rollback"
_DELETING_RE = re.compile(r"^\.step-(\d+)(\.tmp)?\.deleting-(\d+)$")
_STEP_RE = re.compile(r"^step-(\d+)(\.tmp)?$")
_QUARANTINE_RE = re.compile(r"^step-(\d+)(\.tmp)?\.quarantined(-\d+)?$")
_RESTORE_RE = re.compile(r"^\.step-(\d+)\.restore-(\d+)$")
RESTORING_FILE = "fastio-restoring.json"
"""The mark in a restore's private directory: proof that fastio made it."""
_HASH_THREADS = 4
_NOT_FILES = (COMMIT_FILE, WRITING_FILE)
_WRITER_MARKS = frozenset({WRITING_FILE, tmp_path_for(Path(WRITING_FILE)).name})


def step_name(step: int) -> str:
    """The name of ``step``'s committed directory (and of its prefix on an object store): ``step-N``."""
    return f"step-{step}"


def parse_step_name(name: str) -> int | None:
    """The step of a committed directory's name ``step-N``; None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m and not m.group(2) else None


def parse_quarantined_name(name: str) -> int | None:
    """The step of a name moved aside by :func:`quarantine` (``step-N.quarantined``, ``-2``...; also on a store);
    None for any other name."""
    m = _QUARANTINE_RE.match(name)
    return int(m.group(1)) if m else None


def quarantine_names(name: str):
    """``name.quarantined``, then ``name.quarantined-2``, ``-3``...: the names :func:`quarantine` tries in turn."""
    yield name + QUARANTINE_SUFFIX
    n = 2
    while True:
        yield f"{name}{QUARANTINE_SUFFIX}-{n}"
        n += 1


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{step_name(step)}.tmp"


def restore_dir(root: Path, step: int, pid: int | None = None) -> Path:
    """The private directory a restore of ``step`` decompresses into (hidden: never a step's name)."""
    return Path(root) / f".{step_name(step)}.restore-{os.getpid() if pid is None else pid}"


def start_restore_dir(root: Path, step: int) -> Path:
    """Create (empty, marked) this process's restore directory for ``step``."""
    path = restore_dir(root, step)
    if path.exists():  # this pid's own, from an earlier restore that could not clean up
        shutil.rmtree(path)
    path.mkdir()
    (path / RESTORING_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                   "time": time.time()}))
    return path


@dataclass
class StepEntry:
    """One ``step-N`` or ``step-N.tmp`` directory; ``commit`` is its parsed marker when committed."""

    step: int
    path: Path
    commit: CommitRecord | None = None
    problem: str | None = field(default=None)
    superseded: bool = False
    """A committed step made no checkpoint by a later commit of a lower step (:func:`supersede`)."""

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
        nothing but the writer's mark half-written (a kill inside :func:`start_tmp`)."""
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


def scan(root: Path) -> list[StepEntry]:
    """Every step directory under ``root``, oldest step first (a missing ``root`` has none)."""
    root = Path(root)
    if not root.is_dir():
        return []
    entries = []
    doomed = pending_rollback(root)
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        step = int(m.group(1))
        if m.group(2):
            entry = StepEntry(step, child, None)
            entry.problem = ("uncommitted (write in progress or interrupted)" if entry.abandoned else
                             f"uncommitted, and without fastio's mark {WRITING_FILE}: not fastio's own temporary")
            entries.append(entry)
            continue
        try:
            data = read_commit(child)
        except CheckpointError as err:
            if not child.exists():  # deleted (renamed away first) since it was listed: no step any more
                continue
            superseded = not (child / COMMIT_FILE).exists() and (child / SUPERSEDED_FILE).is_file()
            entries.append(StepEntry(step, child, None, SUPERSEDED if superseded else str(err), superseded))
            continue
        if data.step != step:
            entries.append(StepEntry(step, child, None, f"{child}: commit marker says step {data.step}"))
        elif step in doomed:  # a rollback a kill cut short: superseded, whatever its marker is still called
            entries.append(StepEntry(step, child, None, SUPERSEDED, True))
        else:
            entries.append(StepEntry(step, child, data))
    return sorted(entries, key=lambda e: (e.step, e.committed))


def committed(root: Path) -> list[StepEntry]:
    """The committed step directories under ``root``, oldest first."""
    return [e for e in scan(root) if e.committed]


def is_checkpoint_dir(root: Path) -> bool:
    """True when ``root`` holds a Checkpointer's lock file or anything named like a step directory."""
    root = Path(root)
    return (root / LOCK_NAME).exists() or any(_STEP_RE.match(p.name) or _QUARANTINE_RE.match(p.name)
                                              for p in root.iterdir())


def refuse_dataset_dir(root: Path) -> None:
    """CheckpointError when ``root`` is a fastio dataset (its ``manifest.json`` or ``splits.json`` says so): a
    Checkpointer must not drop its lock and steps among a dataset's files."""
    for name, fmt in ((MANIFEST_NAME, FORMAT), (SPLITS_NAME, SPLITS_FORMAT)):
        try:
            data = json.loads((Path(root) / name).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == fmt:
            raise CheckpointError(f"{root}: is a fastio dataset ({name}), not a checkpoint directory; give the "
                                  "Checkpointer a directory of its own, e.g. a sibling such as ckpt/")


def _hash_and_sync(path: Path) -> tuple[int, str]:
    """``(size, checksum)`` of a freshly written file, flushed to disk through the same descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        result = digest_fd(fd, CHECKSUM)
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in _NOT_FILES
                  and not p.name.endswith(".tmp"))


def data_files(path: Path) -> list[Path]:
    """The files of a step directory that its commit marker lists (all but fastio's marks and ``*.tmp``)."""
    return _files(path)


def start_tmp(root: Path, step: int) -> Path:
    """Create ``step-N.tmp`` with the writer's mark, moving an earlier one aside (or deleting it when it
    is this fastio's abandoned temporary). The caller holds the directory's lock."""
    tmp = tmp_dir(root, step)
    if tmp.exists():
        entry = StepEntry(step, tmp)
        if entry.abandoned:
            remove_step(tmp)
        else:
            quarantine(tmp)
    tmp.mkdir(parents=True)
    atomic_write_bytes(tmp / WRITING_FILE, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                       "time": time.time()}).encode())
    return tmp


def file_record(path: Path) -> dict[str, Any]:
    """What a commit marker lists for one file: ``{"bytes": size, CHECKSUM: digest}``."""
    size, digest = digest_file(path, CHECKSUM)
    return {"bytes": size, CHECKSUM: digest}


def commit_data(files: dict[str, dict[str, Any]], *, step: int, info: CommitInfo) -> CommitRecord:
    """The commit marker of ``step`` listing ``files`` (relative path -> :func:`file_record`)."""
    return CommitRecord.new(files, step=step, info=info)


def encode_commit(record: CommitRecord) -> bytes:
    return record.encode()


def commit(tmp: Path, final: Path, *, step: int, info: CommitInfo) -> CommitRecord:
    """Checksum every file of the fully written ``tmp``, write the marker last, rename to ``final``
    (an existing ``final`` is moved aside by :func:`quarantine`, not deleted). ``info`` with a
    ``compression`` makes a version 3 marker."""
    paths = _files(tmp)
    with ThreadPoolExecutor(max_workers=_HASH_THREADS) as pool:  # overlaps the fsyncs' waits on the disk
        sums = list(pool.map(_hash_and_sync, paths))
    files = {p.relative_to(tmp).as_posix(): {"bytes": size, CHECKSUM: digest}
             for p, (size, digest) in zip(paths, sums)}
    for d in sorted({p.parent for p in paths} | {tmp}, key=lambda p: -len(p.parts)):
        fsync_dir(d)
    data = commit_data(files, step=step, info=info)
    atomic_write_bytes(tmp / COMMIT_FILE, encode_commit(data))
    if final.exists():
        quarantine(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return data


def remove_step(path: Path) -> None:
    """Delete a step directory: first renamed to a hidden ``.step-N.deleting-PID`` (atomic: it is no step from
    then on), then deleted; a deletion a kill cut short is finished by :func:`remove_abandoned`."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    try:
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        fsync_dir(path.parent)
    except FileNotFoundError:
        return
    except OSError:  # cannot rename (e.g. busy): its marker first, so a half-deleted one reads as uncommitted
        doomed = path
        try:
            (path / COMMIT_FILE).unlink()
            fsync_dir(path)
        except FileNotFoundError:
            pass
    shutil.rmtree(doomed, ignore_errors=True)


def supersede(path: Path) -> None:
    """Make committed ``path`` no checkpoint, keeping every file: its commit marker becomes ``SUPERSEDED_FILE``."""
    os.replace(Path(path) / COMMIT_FILE, Path(path) / SUPERSEDED_FILE)
    fsync_dir(Path(path))


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


def pending_rollback(root: Path) -> frozenset[int]:
    """The steps of a rollback in progress under ``root`` (:data:`ROLLBACK_FILE`); empty when there is none."""
    record = Path(root) / ROLLBACK_FILE
    try:
        return parse_rollback(record.read_bytes(), str(record))
    except FileNotFoundError:
        return frozenset()
    except OSError as err:
        raise CheckpointError(f"{record}: unreadable rollback record: {err.strerror or err}") from None


def start_rollback(root: Path, floor: int) -> list[int]:
    """Before a commit that follows a restore of step ``floor``: record every committed step above it (and those
    of a rollback a kill cut short) in :data:`ROLLBACK_FILE`, durably; from then on none of them is a
    checkpoint. Returns them (nothing is written when there are none)."""
    doomed = sorted(pending_rollback(root) | {e.step for e in committed(root) if e.step > floor})
    if doomed:
        atomic_write_bytes(Path(root) / ROLLBACK_FILE, encode_rollback(floor, doomed))
    return doomed


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


def supersede_above(root: Path, floor: int) -> list[int]:
    """A rollback to ``floor`` on disk (:func:`start_rollback` then :func:`finish_rollback`): the superseded
    steps."""
    start_rollback(root, floor)
    return finish_rollback(root)


def quarantine(path: Path) -> Path:
    """Move a step directory aside as ``<name>.quarantined`` (``-2``, ``-3``... when taken); returns the new path.
    Nothing is deleted: what was there may be the only copy."""
    path = Path(path)
    target = next(path.with_name(n) for n in quarantine_names(path.name) if not path.with_name(n).exists())
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


OTHER_HOST_RESTORE_S = 24 * 3600.0
"""A restore directory marked by another host (whose processes this one cannot see) is abandoned this long after
its mark was written."""


def _restore_abandoned(child: Path) -> bool:
    """``child`` is a marked ``.step-N.restore-PID`` whose restore has ended: PID (its name's) gone from the host
    its mark names, or another host's mark older than :data:`OTHER_HOST_RESTORE_S`."""
    found = _RESTORE_RE.match(child.name)
    if not found or not child.is_dir() or not (child / RESTORING_FILE).is_file():
        return False
    try:
        mark = json.loads((child / RESTORING_FILE).read_text())
        host, started = mark.get("host"), float(mark.get("time", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return True  # a mark cut short by a kill
    if host != socket.gethostname():
        return time.time() - started > OTHER_HOST_RESTORE_S
    pid = int(found.group(2))
    if pid == os.getpid():
        return True  # this process's own, from a restore that could not clean up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    try:  # a zombie has ended
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def remove_abandoned(root: Path) -> tuple[list[Path], list[StepEntry]]:
    """Delete this fastio's abandoned temporaries under ``root`` (see the module docstring): marked
    ``step-N.tmp``, a ``step-N.tmp`` or ``step-N.tmp.quarantined`` holding nothing but writer's marks, and marked
    ``.step-N.restore-PID`` (after finishing a rollback a kill cut short); returns ``(deleted, left)``: ``left``
    are the other uncommitted step directories, untouched."""
    removed, left = [], []
    if Path(root).is_dir():
        finish_rollback(root)  # one a kill cut short
        for child in sorted(Path(root).iterdir()):
            if (_restore_abandoned(child)
                    or _DELETING_RE.match(child.name) and child.is_dir()):  # also a deletion a kill cut short
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
            elif _is_empty_quarantined_tmp(child):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    for entry in scan(root):
        if entry.committed:
            continue
        if entry.abandoned:
            remove_step(entry.path)
            removed.append(entry.path)
        else:
            left.append(entry)
    return removed, left


def _is_empty_quarantined_tmp(path: Path) -> bool:
    """A ``step-N.tmp`` moved aside (``step-N.tmp.quarantined``) that holds nothing but writer's marks: what a kill
    inside :func:`start_tmp` left, quarantined by an older fastio; nothing of it can be data."""
    m = _QUARANTINE_RE.match(path.name)
    return bool(m and m.group(2)) and path.is_dir() and not path.is_symlink() and holds_only_writer_marks(path)


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep`` (0 keeps all; the newest always stays)."""
    if keep <= 0:
        return []
    done = committed(root)
    old = done[:-keep] if len(done) > keep else []
    for entry in old:
        remove_step(entry.path)
    return [e.path for e in old]


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


def still_committed(entry: StepEntry) -> bool:
    """True when committed ``entry``'s directory still holds the commit marker it was listed with (False once
    retention has renamed it away to delete it, or a rollback superseded it, after :func:`scan` listed it)."""
    try:
        return read_commit(entry.path) == entry.commit
    except CheckpointError:
        return False


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
        m = _QUARANTINE_RE.match(child.name)
        if m and child.is_dir():
            entries.append(StepEntry(int(m.group(1)), child, None, "quarantined: moved aside by fastio (damaged, "
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
