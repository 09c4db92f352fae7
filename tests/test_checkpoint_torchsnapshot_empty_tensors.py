"""The torchsnapshot engine saves and restores a tensor with no elements (an optimizer's state for an empty
parameter, a buffer of length 0): torchsnapshot 0.1.0 failed every save holding one (``memoryview: cannot cast view
with zeros in shape``), and could not view an empty file as one on restore (``torch.frombuffer`` of 0 bytes)."""

from __future__ import annotations

import pytest
import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer


@pytest.mark.parametrize("into", ["fresh", "in_place"])
def test_an_empty_tensor_is_saved_and_restored(tmp_path, into):
    saved = {"empty": torch.empty(0, 4), "bf16": torch.empty(3, 0).bfloat16(), "kept": torch.arange(3)}
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"h": StateHolder(saved)}, blocking=True)
    target = StateHolder({} if into == "fresh" else {k: torch.ones_like(v) for k, v in saved.items()})
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest({"h": target}).step == 1
    got = target.state
    assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {k: (v.dtype, tuple(v.shape))
                                                                       for k, v in saved.items()}
    assert torch.equal(got["kept"], saved["kept"])
