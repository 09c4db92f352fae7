"""Checkpoints for an exact continuation: async saves through an engine (torchsnapshot, or DCP for DTensor
state), atomic publish, retention, verified restore with fallback, one writer per directory.

Names are imported lazily: ``fastio ckpt ls`` and ``verify`` read a checkpoint directory without importing torch.
"""

from __future__ import annotations

from fastio.lazy import lazy_exports

_LAZY = {
    "Checkpointer": "fastio.checkpoint.checkpointer",
    "TrainState": "fastio.checkpoint.restore",
    "CheckpointConfig": "fastio.checkpoint.config",
    "verify": "fastio.checkpoint.catalog",
    "requeue_slurm_job": "fastio.checkpoint.preemption",
    "slurm_job_id": "fastio.checkpoint.preemption",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
