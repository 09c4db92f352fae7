"""Retention: a checkpoint directory keeps its newest ``keep`` committed steps (0 keeps all; the newest always
stays); the older ones are deleted (:func:`~fastio.checkpoint.removal.remove_step`). A store applies the same
rule (:func:`expired`) to its committed steps (:mod:`fastio.checkpoint.remote`). Superseded steps are no
checkpoints: they neither count nor go."""

from __future__ import annotations

from pathlib import Path

from fastio.checkpoint.removal import remove_step
from fastio.checkpoint.scan import committed

__all__ = ["apply_retention", "expired"]


def expired(steps: list, keep: int) -> list:
    """The committed ``steps`` (oldest first) that retention keeping ``keep`` deletes: all but the newest ``keep``
    (none when ``keep`` is 0)."""
    return steps[:-keep] if keep > 0 else []


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep`` (0 keeps all; the newest always stays)."""
    if keep <= 0:
        return []
    old = expired(committed(root), keep)
    for entry in old:
        remove_step(entry.path)
    return [e.path for e in old]
