"""Tensor kinds beyond plain ones, on both engines, by a real save and restore: a quantized tensor restores as saved
also where the app has no tensor for it (its key missing from the app's state, or a plain tensor there)."""

from __future__ import annotations

import pytest
import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer

ENGINES = ["torchsnapshot", "dcp"]


def _quantized() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"q8": torch.quantize_per_tensor(torch.randn(6, generator=g), 0.1, 3, torch.qint8),
            "qu8": torch.quantize_per_channel(torch.randn(2, 4, generator=g), torch.tensor([0.5, 0.25]),
                                              torch.tensor([1, 2]), 0, torch.quint8)}


def _bits(t: torch.Tensor) -> tuple:
    if t.qscheme() == torch.per_tensor_affine:
        params = (t.q_scale(), t.q_zero_point())
    else:
        params = (t.q_per_channel_scales().tolist(), t.q_per_channel_zero_points().tolist(), t.q_per_channel_axis())
    return t.dtype, t.qscheme(), params, t.int_repr().tolist()


@pytest.mark.parametrize("target", ["missing", "plain"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_quantized_tensor_restores_as_saved_without_a_quantized_target(tmp_path, engine, target):
    """Before (torchsnapshot): ``cannot read its state from 0/t/q8: RuntimeError: false INTERNAL ASSERT FAILED ...
    cannot call qscheme on UnknownQuantizer`` (it made an empty quantized tensor to copy into). Now the stored
    tensor itself is restored, as DCP does."""
    saved = _quantized()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"t": StateHolder(saved)}, blocking=True)
        back = StateHolder({} if target == "missing" else {k: torch.zeros(v.shape) for k, v in saved.items()})
        ckpt.restore_latest({"t": back})
    assert {k: _bits(v) for k, v in back.state.items()} == {k: _bits(v) for k, v in saved.items()}
