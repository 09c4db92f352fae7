"""Every random generator a training step draws from, as a state_dict that torch.load(weights_only) accepts."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNG_VERSION", "capture_rng", "restore_rng"]

RNG_VERSION = 1
KEY_VERSION, KEY_PYTHON, KEY_NUMPY, KEY_TORCH, KEY_CUDA = "version", "python", "numpy", "torch", "cuda"


def capture_rng() -> dict[str, Any]:
    """Python ``random``, NumPy's global generator, torch CPU and every CUDA device."""
    py_version, py_state, py_gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        KEY_VERSION: RNG_VERSION,
        KEY_PYTHON: {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                     "gauss": [] if py_gauss is None else [float(py_gauss)]},
        KEY_NUMPY: {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        KEY_TORCH: torch.get_rng_state(),
        KEY_CUDA: [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[KEY_CUDA] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned (CUDA states only for devices that exist here)."""
    if state.get(KEY_VERSION) != RNG_VERSION:
        raise ValueError(f"RNG state version {state.get(KEY_VERSION)!r}, expected {RNG_VERSION}")
    py = state[KEY_PYTHON]
    gauss = py["gauss"][0] if len(py["gauss"]) else None
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), gauss))
    npy = state[KEY_NUMPY]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state[KEY_TORCH].cpu())
    cuda = list(state.get(KEY_CUDA) or [])
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)

