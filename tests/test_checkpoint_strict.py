"""Strict restores (issue 19.5): a checkpoint and an app that differ in keys or shapes are refused on both
engines, naming the keys; ``strict=False`` loads what matches and lists what it skipped."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError

ENGINES = ["torchsnapshot", "dcp"]


def model(layers: int, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def saved(tmp_path, engine: str, app: dict) -> Checkpointer:
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, app, blocking=True)
    return Checkpointer(tmp_path / "ck", signals=())


@pytest.mark.parametrize("engine", ENGINES)
def test_fewer_layers_is_refused_naming_the_keys(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(3)})
    small = model(2)
    with pytest.raises(CheckpointError, match=r"app key model: in the checkpoint, not in the app: 2\.bias, 2\.weight"):
        ckpt.restore_latest({"model": small})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_more_layers_and_other_shapes_are_refused(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(2)})
    with pytest.raises(CheckpointError, match=r"in the app, not in the checkpoint: 2\.bias, 2\.weight"):
        ckpt.restore_latest({"model": model(3)})
    with pytest.raises(CheckpointError, match=r"other shape: 0\.bias \(checkpoint 8, app 4\)"):
        ckpt.restore_latest({"model": nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8))})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_app_key_missing_from_the_app_is_refused(tmp_path, engine):
    ckpt = saved(tmp_path, engine, {"model": model(1), "extra": model(1)})
    with pytest.raises(CheckpointError, match=r"app key\(s\) extra, which this app lacks"):
        ckpt.restore_latest({"model": model(1)})
    ckpt.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_not_strict_loads_what_matches_and_lists_the_rest(tmp_path, engine, caplog):
    big = model(3)
    with torch.no_grad():
        for p in big.parameters():
            p.add_(1.0)
    ckpt = saved(tmp_path, engine, {"model": big, "extra": model(1)})
    small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # layer 1: another shape; layer 2: not here
    untouched = small[1].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="fastio.checkpoint.checkpointer"):
        state = ckpt.restore_latest({"model": small}, strict=False)
    ckpt.close()
    assert torch.equal(small[0].weight, big[0].weight) and torch.equal(small[0].bias, big[0].bias)
    assert torch.equal(small[1].weight, untouched)
    text = "; ".join(state.skipped)
    assert "app key extra (not in this app)" in text
    assert "not in the app: 2.bias, 2.weight" in text
    assert "other shape: 1.bias (checkpoint 8, app 4), 1.weight (checkpoint 8x8, app 4x8)" in text
    assert "strict=False" in caplog.text and "2.weight" in caplog.text
