"""The names in a checkpoint directory (and under an ``s3://`` prefix): the one spelling of each.

``step-N/`` a committed step (its marker :data:`COMMIT_FILE`), ``step-N.tmp/`` one being written (the writer's mark
:data:`WRITING_FILE`), ``step-N.quarantined[-k]/`` one moved aside, ``.step-N.deleting-PID/`` one being deleted,
``.step-N.restore-PID[-K]/`` a restore's decompressed copy (its mark :data:`RESTORING_FILE`). Only names here: what the
files in them mean is in :mod:`fastio.checkpoint.scan` (what is committed) and :mod:`fastio.checkpoint.removal`
(what may be deleted).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "COMMIT_FILE",
    "QUARANTINE_SUFFIX",
    "RESTORING_FILE",
    "WRITING_FILE",
    "deleting_name",
    "is_deleting_name",
    "is_quarantined_tmp_name",
    "is_step_like_name",
    "parse_quarantined_name",
    "parse_restore_name",
    "parse_step_dir_name",
    "parse_step_name",
    "quarantine_names",
    "restore_dir",
    "step_dir",
    "step_name",
    "tmp_dir",
]

COMMIT_FILE = "fastio-commit.json"
WRITING_FILE = "fastio-writing.json"
"""The writer's mark in a ``step-N.tmp``: proof that fastio made it (host, pid, time)."""
QUARANTINE_SUFFIX = ".quarantined"
RESTORING_FILE = "fastio-restoring.json"
"""The mark in a restore's private directory: proof that fastio made it."""
_N = r"(0|[1-9][0-9]*)"
"""A step in a name: as :func:`step_name` spells it (ASCII digits, no leading zero): ``step-02`` (a directory renamed
by hand) is no step, or it would be a second step 2 beside ``step-2``, and a restore would look for it as ``step-2``."""
_DELETING_RE = re.compile(rf"^\.step-{_N}(\.tmp)?\.deleting-([0-9]+)$")
_STEP_RE = re.compile(rf"^step-{_N}(\.tmp)?$")
_QUARANTINE_RE = re.compile(rf"^step-{_N}(\.tmp)?\.quarantined(-[0-9]+)?$")
_RESTORE_RE = re.compile(rf"^\.step-{_N}\.restore-([0-9]+)(-[0-9]+)?$")


def step_name(step: int) -> str:
    """The name of ``step``'s committed directory (and of its prefix on an object store): ``step-N``."""
    return f"step-{step}"


def parse_step_name(name: str) -> int | None:
    """The step of a committed directory's name ``step-N``; None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m and not m.group(2) else None


def parse_step_dir_name(name: str) -> tuple[int, bool] | None:
    """``(step, temporary)`` of ``step-N`` (False) or ``step-N.tmp`` (True); None for any other name."""
    m = _STEP_RE.match(name)
    return (int(m.group(1)), bool(m.group(2))) if m else None


def parse_quarantined_name(name: str) -> int | None:
    """The step of a name moved aside by :func:`~fastio.checkpoint.removal.quarantine` (``step-N.quarantined``,
    ``-2``...; also on a store); None for any other name."""
    m = _QUARANTINE_RE.match(name)
    return int(m.group(1)) if m else None


def is_quarantined_tmp_name(name: str) -> bool:
    """True for a ``step-N.tmp`` moved aside: ``step-N.tmp.quarantined`` (``-2``...)."""
    m = _QUARANTINE_RE.match(name)
    return bool(m and m.group(2))


def is_step_like_name(name: str) -> bool:
    """True for ``step-N``, ``step-N.tmp`` and their quarantined names: what only a checkpoint directory holds."""
    return bool(_STEP_RE.match(name) or _QUARANTINE_RE.match(name))


def quarantine_names(name: str):
    """``name.quarantined``, then ``name.quarantined-2``, ``-3``...: the names
    :func:`~fastio.checkpoint.removal.quarantine` tries in turn."""
    yield name + QUARANTINE_SUFFIX
    n = 2
    while True:
        yield f"{name}{QUARANTINE_SUFFIX}-{n}"
        n += 1


def deleting_name(name: str) -> str:
    """The hidden name a step directory ``name`` is renamed to before this process deletes it."""
    return f".{name}.deleting-{os.getpid()}"


def is_deleting_name(name: str) -> bool:
    """True for a name :func:`deleting_name` makes (of any process)."""
    return bool(_DELETING_RE.match(name))


def parse_restore_name(name: str) -> int | None:
    """The pid of a restore directory's name ``.step-N.restore-PID`` (``-K``: another restore of that process at
    once); None for any other name."""
    m = _RESTORE_RE.match(name)
    return int(m.group(2)) if m else None


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{step_name(step)}.tmp"


def restore_dir(root: Path, step: int, pid: int | None = None, k: int = 1) -> Path:
    """The private directory a restore of ``step`` decompresses into (hidden: never a step's name); ``k`` > 1: the
    ``k``-th restore of that step by one process at once (``.step-N.restore-PID-K``)."""
    return Path(root) / f".{step_name(step)}.restore-{os.getpid() if pid is None else pid}{f'-{k}' if k > 1 else ''}"
