"""Checkpoints for an exact continuation: async torchsnapshot saves, atomic publish, retention, preemption.

Names are imported lazily: ``fastio ckpt ls`` and ``verify`` read the layout without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Checkpointer": "fastio.checkpoint.checkpointer",
    "TrainState": "fastio.checkpoint.checkpointer",
    "CheckpointConfig": "fastio.checkpoint.config",
    "verify": "fastio.checkpoint.layout",
    "requeue_slurm_job": "fastio.checkpoint.preemption",
    "slurm_job_id": "fastio.checkpoint.preemption",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastio.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
