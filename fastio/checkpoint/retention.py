"""Retention: a checkpoint directory keeps its newest ``keep`` committed steps (0 keeps all; the newest always
stays); the older ones are deleted. A store applies the same rule (:func:`expired`) to its committed steps
(:mod:`fastio.checkpoint.remote`). Superseded steps are no checkpoints: they neither count nor go.

A save applies it in two halves (:mod:`fastio.checkpoint.commit`): :func:`expire` on the save's path, after the new
step is published (the expired steps renamed away: no checkpoints from then on, nothing waiting on the disk), and
the files' deletion (:func:`~fastio.checkpoint.removal.finish_removal`) after the save counts as done, so that
neither the caller's ``wait()`` nor the next save waits for it (at a checkpoint every ~1x its write time, deleting
the previous 512 MiB step took 0.22-0.33 s of each save's path: ``docs/performance.md``)."""

from __future__ import annotations

from pathlib import Path

from fastio.checkpoint.removal import hide_step
from fastio.checkpoint.scan import committed

__all__ = ["expire", "expired"]


def expired(steps: list, keep: int) -> list:
    """The committed ``steps`` (oldest first) that retention keeping ``keep`` deletes: all but the newest ``keep``
    (none when ``keep`` is 0)."""
    return steps[:-keep] if keep > 0 else []


def expire(root: Path, keep: int) -> list[Path]:
    """Retention's first half: rename every committed checkpoint older than the newest ``keep`` away
    (:func:`~fastio.checkpoint.removal.hide_step`); returns the hidden directories, whose files
    :func:`~fastio.checkpoint.removal.finish_removal` deletes."""
    if keep <= 0:
        return []
    hidden = (hide_step(entry.path) for entry in expired(committed(root), keep))
    return [path for path in hidden if path is not None]
