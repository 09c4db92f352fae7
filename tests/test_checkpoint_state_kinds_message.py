"""The refusal of a value no checkpoint holds lists every kind a state dict may hold, as checkpoints.md does:
it named tensors, numbers, strings, bytes and None only, though torch dtypes, devices and sizes (and DTensors)
are saved and restored too, so a user reading it would take those out of a state dict for nothing."""

from __future__ import annotations

import pytest
import torch

from fastio import Checkpointer
from fastio.errors import CheckpointError


class _State:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"v": self.value}

    def load_state_dict(self, state):
        self.value = state["v"]


def test_the_refusal_names_the_kinds_that_are_saved(tmp_path):
    kinds = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])}
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"k": _State(kinds)}, blocking=True)  # these are saved...
        with pytest.raises(CheckpointError, match=r"state key 'k/v': cannot checkpoint a builtins\.object") as err:
            ckpt.save(2, {"k": _State(object())}, blocking=True)
    assert all(w in str(err.value) for w in ("torch dtypes", "devices", "sizes", "DTensors")), err.value
    back = _State(None)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.restore_latest({"k": back})
    assert back.value == kinds  # ...and restored as they were
