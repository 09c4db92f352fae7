"""A restore is all or nothing (issue 28, point 10): a loader state that cannot be loaded (a mixture whose
weights changed mid-epoch) is found before anything is loaded, so the model keeps its weights; the message names
what a Checkpointer user can do, ``restore_latest(..., loader_policy="next-epoch")``, which restores everything
else and starts the loader at the next epoch."""

from __future__ import annotations

from itertools import islice

import pytest
import torch
from test_mixture import _small
from torch import nn

from fastio import Checkpointer, Loader, Mixture
from fastio.errors import CheckpointError


def _loader(sources, weights):
    return Loader(Mixture(sources, weights=weights), batch_size=6, pipeline="raw", device="cpu", seed=5,
                  world_size=1, rank=0, num_threads=1, prefetch=2)


def test_a_loader_that_refuses_its_state_leaves_the_app_untouched(tmp_path):
    sources = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1)}
    torch.manual_seed(0)
    old = _loader(sources, {"a": 1, "b": 1})
    list(islice(iter(old), 2))
    saved_model = nn.Linear(4, 2)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(7, {"model": saved_model, "loader": old}, blocking=True)
    old.close()
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()
    new = _loader(sources, {"a": 1, "b": 2})
    app = {"model": model, "loader": new}
    ckpt = Checkpointer(tmp_path / "ck", signals=())
    with pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(app)
    assert torch.count_nonzero(model.weight) == 0  # nothing was loaded
    text = str(err.value)
    assert "app key 'loader'" in text and "weights can change only from the next epoch" in text, text
    assert "restore_latest(..., loader_policy='next-epoch')" in text, text
    assert (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (0, 0)
    with pytest.raises(ValueError, match="loader_policy must be one of exact, next-epoch, got 'later'"):
        ckpt.restore_latest(app, loader_policy="later")
    state = ckpt.restore_latest(app, loader_policy="next-epoch")
    assert (state.step, state.epoch) == (7, 1)
    assert torch.equal(model.weight, saved_model.weight) and torch.equal(model.bias, saved_model.bias)
    assert (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (1, 0)
    batch = next(iter(new))
    assert len(batch["source"]) == 6
    with pytest.raises(ValueError, match="no app object has check_state_dict"):
        ckpt.restore_latest({"model": model}, loader_policy="next-epoch")
    ckpt.close()
    new.close()
