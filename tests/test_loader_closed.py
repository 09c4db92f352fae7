"""A closed Loader: ``state_dict`` still answers its last position (a trainer may close the Loader, then save) and
``close`` again is harmless; iteration, ``load_state_dict`` (and the ``check_state_dict`` a restore makes first) and
``set_epoch`` are refused in one line naming the dataset and that the Loader is closed (before: ``load_state_dict``
and ``set_epoch`` quietly moved the closed Loader, iteration died in its reader's thread pool: ``RuntimeError:
cannot schedule new futures after shutdown``). A new Loader continues from the closed one's state."""

from __future__ import annotations

import pytest
import torch

import fastio
from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError, LoaderClosedError


@pytest.fixture
def closed(image_dataset):
    """A Loader closed after one batch, with its state before the close."""
    loader = fastio.Loader(image_dataset, batch_size=4, device="cpu", num_threads=1)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    loader.close()
    return loader, state, first


def test_state_dict_after_close_is_the_last_position_and_close_again_is_harmless(closed):
    loader, state, _ = closed
    assert loader.state_dict() == state and state["consumed"] == 4
    loader.close()
    assert loader.state_dict() == state


@pytest.mark.parametrize("call", ["iter", "load_state_dict", "check_state_dict", "set_epoch"])
def test_moving_a_closed_loader_is_refused_in_one_line(closed, image_dataset, call):
    loader, state, _ = closed
    act = {"iter": lambda: next(iter(loader)), "load_state_dict": lambda: loader.load_state_dict(state),
           "check_state_dict": lambda: loader.check_state_dict(state), "set_epoch": lambda: loader.set_epoch(3)}[call]
    with pytest.raises(LoaderClosedError) as err:
        act()
    assert isinstance(err.value, ValueError)
    assert "closed fastio.Loader" in str(err.value) and str(image_dataset) in str(err.value)
    assert "\n" not in str(err.value)
    assert loader.state_dict() == state  # nothing moved


def test_a_new_loader_continues_from_the_closed_ones_state(closed, image_dataset):
    loader, state, first = closed
    with fastio.Loader(image_dataset, batch_size=4, device="cpu", num_threads=1) as fresh:
        want = next(iter(fresh))
        assert torch.equal(want["label"], first["label"])
        second = next(iter(fresh))
    with fastio.Loader(image_dataset, batch_size=4, device="cpu", num_threads=1) as again:
        again.load_state_dict(loader.state_dict())
        assert torch.equal(next(iter(again))["label"], second["label"])


def test_a_checkpoint_restore_into_a_closed_loader_is_refused_before_anything_loads(closed, tmp_path):
    loader, state, _ = closed
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "loader": loader}, blocking=True)  # saving after the close: its position
        before = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1)
        with pytest.raises(CheckpointError, match="closed fastio.Loader"):
            ckpt.restore_latest({"model": model, "loader": loader})
    assert torch.equal(model.weight, before + 1)  # refused at the check: the model is left as it was
