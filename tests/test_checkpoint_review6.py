"""Hostile review of checkpoint round 6: parameter groups checked before anything loads (real torchsnapshot and
DCP checkpoints), and the agreements' watching threads on real gloo ranks (no false 'waiting for rank' line for
ranks that are slow but alive, no thread left behind, no beat after close)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastio.checkpoint import Checkpointer


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def trained(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()


def same(a, b) -> bool:
    """Two (nested) state dicts equal, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------- 1. an optimizer's parameter groups
def test_dcp_not_strict_optimizer_of_other_groups_keeps_the_apps_groups_and_trains(tmp_path):
    """DCP, strict=False: an app optimizer (of an app module) with more parameter groups than the checkpoint's
    loads each parameter's state by name and keeps the app's groups (listed), and trains on. The checkpoint's
    group 0 (all four parameters) was loaded over the app's, leaving an optimizer whose next step failed in
    torch (KeyError: 'betas')."""
    model = net()
    optim = torch.optim.Adam(model.parameters())  # one group of 4
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    model2 = net(1)
    optim2 = torch.optim.Adam([{"params": model2[0].parameters()}, {"params": model2[1].parameters(), "lr": 0.01}])
    trained(model2, optim2)
    groups = copy.deepcopy(optim2.state_dict()["param_groups"])
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        skipped = ckpt.restore_latest({"model": model2, "optim": optim2}, strict=False).skipped
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert same(optim2.state_dict()["param_groups"], groups)  # the app's, as they were
    assert same(optim2.state_dict()["state"], optim.state_dict()["state"])  # each parameter's, by name
    assert "app key optim: the checkpoint's optimizer has 1 parameter group, the app's 2 parameter groups (the " \
           "app's groups kept, each parameter's state loaded by name)" in skipped, skipped
    trained(model2, optim2)  # and it trains on
