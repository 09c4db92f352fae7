"""Checkpoint engines: the libraries that turn state dicts into the files of one ``step-N`` directory.

``get_engine(name)`` returns one; see :mod:`fastio.checkpoint.engines.base` for the interface. Each
engine lives in its own module and is the only importer of its library; this package imports none of
them until one is asked for.

- ``torchsnapshot`` (:mod:`~fastio.checkpoint.engines.torchsnapshot_engine`): plain and DDP state,
  per-rank and replicated, elastic restore of unsharded state. Cannot save DTensor.
- ``dcp`` (:mod:`~fastio.checkpoint.engines.dcp_engine`, ``torch.distributed.checkpoint``): DTensor
  (FSDP2, tensor parallel) and plain state; modules and their optimizers reshard to any world size.

``"auto"`` (:data:`AUTO`, the Checkpointer's default) means :func:`choose_engine`: DCP when the app holds
DTensor state, torchsnapshot otherwise.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

from fastio.checkpoint.engines.base import Engine, SavedCheckpoint, Stateful, first_line

__all__ = ["AUTO", "DEFAULT_ENGINE", "ENGINES", "Engine", "SavedCheckpoint", "Stateful", "check_engine_name",
           "choose_engine", "first_line", "get_engine", "holds_dtensor", "meta_refusal"]

ENGINES: dict[str, str] = {
    "torchsnapshot": "fastio.checkpoint.engines.torchsnapshot_engine:TorchSnapshotEngine",
    "dcp": "fastio.checkpoint.engines.dcp_engine:DcpEngine",
}
"""Registry: engine name -> ``module:class``. A new engine adds one line here."""

DEFAULT_ENGINE = "torchsnapshot"
"""The engine of checkpoints whose commit marker names none (written before engines were recorded),
and :func:`choose_engine`'s choice for state without DTensors."""

AUTO = "auto"
"""Engine name meaning: choose by the state (:func:`choose_engine`)."""


def check_engine_name(name: object, *, allow_auto: bool = False) -> str:
    """``name`` when it is a registered engine (or ``"auto"`` when allowed); ValueError naming it otherwise."""
    if not isinstance(name, str) or not (name in ENGINES or allow_auto and name == AUTO):
        choices = sorted(ENGINES) + ([AUTO] if allow_auto else [])
        raise ValueError(f"unknown checkpoint engine {name!r} (choose from {', '.join(choices)})")
    return name


def holds_dtensor(app: dict[str, Any]) -> list[str]:
    """The app keys whose module parameters/buffers or optimizer parameters include a ``DTensor``."""
    import torch

    if not torch.distributed.is_available():
        return []
    from torch.distributed.tensor import DTensor

    found = []
    for key, obj in app.items():
        if isinstance(obj, torch.nn.Module):
            tensors = itertools.chain(obj.parameters(), obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = (p for g in obj.param_groups for p in g["params"])
        else:
            continue
        if any(isinstance(t, DTensor) for t in tensors):
            found.append(key)
    return found


def meta_refusal(app: dict[str, Any]) -> str | None:
    """One line naming the first app key whose module parameters/buffers or optimizer parameters are on the meta
    device (made there, not yet materialised): no engine can restore into a tensor without storage (torchsnapshot's
    copies into one do nothing, DCP's state dict fails). None when there is none."""
    import torch

    for key, obj in app.items():
        if isinstance(obj, torch.nn.Module):  # its state (a non-persistent buffer left on meta is not restored)
            named = obj.state_dict(keep_vars=True).items()
        elif isinstance(obj, torch.optim.Optimizer):
            named = enumerate(p for g in obj.param_groups for p in g["params"])
        else:
            continue
        names = [f"parameter {n}" if isinstance(n, int) else n for n, t in named
                 if isinstance(t, torch.Tensor) and t.is_meta]
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            return (f"app key {key}: its tensors are on the meta device, with no storage to restore into: {shown} "
                    "(materialise the model first: model.to_empty(device=...))")
    return None


def choose_engine(name: str, app: dict[str, Any]) -> str:
    """The engine for saving ``app``: ``name`` itself, or for ``"auto"`` DCP when the app holds DTensor state
    and torchsnapshot otherwise."""
    if name != AUTO:
        return check_engine_name(name)
    return "dcp" if holds_dtensor(app) else DEFAULT_ENGINE


def get_engine(name: str = DEFAULT_ENGINE) -> Engine:
    """A new engine of the registered ``name`` (its library is imported now)."""
    module, _, cls = ENGINES[check_engine_name(name)].partition(":")
    return getattr(importlib.import_module(module), cls)()
