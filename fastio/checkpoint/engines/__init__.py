"""Checkpoint engines: the libraries that turn state dicts into the files of one ``step-N`` directory.

``get_engine(name)`` returns one; see :mod:`fastio.checkpoint.engines.base` for the interface. Each
engine lives in its own module and is the only importer of its library; this package imports none of
them until one is asked for.

- ``torchsnapshot`` (:mod:`~fastio.checkpoint.engines.torchsnapshot_engine`, the default): plain and
  DDP state, per-rank and replicated, elastic restore of unsharded state.
"""

from __future__ import annotations

import importlib

from fastio.checkpoint.engines.base import Engine, SavedCheckpoint, Stateful, first_line

__all__ = ["DEFAULT_ENGINE", "ENGINES", "Engine", "SavedCheckpoint", "Stateful", "check_engine_name", "first_line",
           "get_engine"]

ENGINES: dict[str, str] = {
    "torchsnapshot": "fastio.checkpoint.engines.torchsnapshot_engine:TorchSnapshotEngine",
}
"""Registry: engine name -> ``module:class``. A new engine adds one line here."""

DEFAULT_ENGINE = "torchsnapshot"
"""The engine of new checkpoints when none is chosen, and of checkpoints whose marker names none."""


def check_engine_name(name: object) -> str:
    """``name`` when it is a registered engine; ValueError naming it and the choices otherwise."""
    if not isinstance(name, str) or name not in ENGINES:
        raise ValueError(f"unknown checkpoint engine {name!r} (choose from {', '.join(sorted(ENGINES))})")
    return name


def get_engine(name: str = DEFAULT_ENGINE) -> Engine:
    """A new engine of the registered ``name`` (its library is imported now)."""
    module, _, cls = ENGINES[check_engine_name(name)].partition(":")
    return getattr(importlib.import_module(module), cls)()
