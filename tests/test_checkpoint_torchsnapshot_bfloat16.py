"""The torchsnapshot engine writes a bfloat16 tensor whole: torchsnapshot 0.1.0 views its bytes as float32 (numpy has
no bfloat16), which dropped the last 2 bytes of one with an odd number of elements (the file one element short, the
restore refused) and failed every save of one with a single element."""

from __future__ import annotations

import pytest
import torch
from helpers import StateHolder
from torchsnapshot import Snapshot, serialization

from fastio.checkpoint import Checkpointer


@pytest.mark.parametrize("shape", [(33,), (), (3, 5)])
def test_a_bfloat16_tensor_is_written_whole_and_restored_bitwise(tmp_path, shape):
    saved = torch.randn(shape).bfloat16()
    theirs = serialization._tensor_as_memoryview_via_untyped_storage
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"h": StateHolder({"w": saved})}, blocking=True)
    assert serialization._tensor_as_memoryview_via_untyped_storage is theirs  # put back after the write
    entry = Snapshot(str(tmp_path / "ck" / "step-1")).get_manifest()["0/h/w"]
    start, end = entry.byte_range or (0, (tmp_path / "ck" / "step-1" / entry.location).stat().st_size)
    assert end - start == 2 * saved.numel()
    into = StateHolder({})
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.restore_latest({"h": into})
    got = into.state["w"]
    assert got.dtype == torch.bfloat16 and got.shape == saved.shape
    assert torch.equal(got.reshape(-1).view(torch.int16), saved.reshape(-1).view(torch.int16))
