"""A restore is all or nothing (issue 28, point 10): a loader state that cannot be loaded (a mixture whose
weights changed mid-epoch) is found before anything is loaded, so the model keeps its weights; the message names
what a Checkpointer user can do, ``restore_latest(..., loader_policy="next-epoch")``, which restores everything
else and starts the loader at the next epoch. An app module of another shape leaves every other app key as it
was; under Lightning the refusal names a Lightning way (a checkpoint saved at an epoch's end)."""

from __future__ import annotations

from itertools import islice

import pytest
import torch
from conftest import write_image_dataset
from test_mixture import _small
from torch import nn

from fastio import Checkpointer, ImageTrain, Loader, Mixture, Raw
from fastio.errors import CheckpointError


def _loader(sources, weights):
    return Loader(Mixture(sources, weights=weights), batch_size=6, pipeline=Raw(), device="cpu", seed=5,
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


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_module_of_another_shape_leaves_every_other_app_key_as_it_was(tmp_path, engine):
    """Point 10, all or nothing: app key ``b`` changed shape. The restore refused it, but with torchsnapshot only
    once it reached ``b``: the model ``a`` and the optimizer before it were already loaded (keys load one by one,
    in place)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    a(torch.ones(1, 4)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"a": a, "opt": opt, "b": b}, blocking=True)
    a2, b2 = nn.Linear(4, 2), nn.Linear(4, 3)
    with torch.no_grad():
        a2.weight.zero_()
        a2.bias.zero_()
    opt2 = torch.optim.SGD(a2.parameters(), lr=0.5, momentum=0.9)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError, match=r"app key b: other shape: bias \(checkpoint 2, app 3\)"):
            ckpt.restore_latest({"a": a2, "opt": opt2, "b": b2})
    assert torch.count_nonzero(a2.weight) == 0 and torch.count_nonzero(a2.bias) == 0, "model a was loaded"
    assert opt2.param_groups[0]["lr"] == 0.5, "the optimizer was loaded"


def test_lightning_mixture_weights_changed_mid_epoch_names_a_lightning_way(tmp_path, image_dataset, image_folder,
                                                                         one_thread):
    """Resuming a mid-epoch Lightning checkpoint with other mixture weights is refused with a hint Lightning can
    follow (a checkpoint saved at an epoch's end), and resuming from such a checkpoint with the new weights works."""
    from example_scripts import load_example

    pl = pytest.importorskip("lightning.pytorch")
    from fastio import Mixture
    from fastio.errors import LoaderStateError
    from fastio.integrations.lightning import FastioDataModule

    example = load_example("lightning_train")

    resharded = write_image_dataset(tmp_path / "ds8", image_folder, max_samples=8)  # one dataset twice is refused

    def data(weights: dict) -> FastioDataModule:
        return FastioDataModule(Mixture({"a": image_dataset, "b": resharded}, weights=weights), batch_size=8,
                                pipeline=ImageTrain(size=32), device="cpu", num_threads=1, reader_threads=1)

    def trainer(**kw) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp_path, **kw)

    every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1,
                                         every_n_train_steps=2)
    trainer(max_epochs=1, callbacks=[every]).fit(example.Classifier(4), datamodule=data({"a": 1, "b": 1}))
    saved = sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt"))
    last = max(int(name[5:-5]) for name in saved)  # the epoch's last step: its end
    assert last > 2, saved
    with pytest.raises(LoaderStateError) as err:
        trainer(max_epochs=1).fit(example.Classifier(4), datamodule=data({"a": 3, "b": 1}),
                                  ckpt_path=tmp_path / "ck" / "step=2.ckpt")
    text = str(err.value)
    assert "weights can change only from the next epoch" in text and "\n" not in text, text
    assert "under Lightning" in text and "ModelCheckpoint(every_n_epochs=1)" in text, text
    model = example.Classifier(4)
    trainer(max_epochs=2).fit(model, datamodule=data({"a": 3, "b": 1}), ckpt_path=tmp_path / "ck" / f"step={last}.ckpt")
    assert [epoch for epoch, _ in model.seen] and {epoch for epoch, _ in model.seen} == {1}


class Refusing:
    """An app object of the app's own whose load_state_dict refuses what was saved (a changed format)."""

    def __init__(self, value: int):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        raise ValueError(f"counter state {state!r} is of another format")


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_an_app_object_that_refuses_its_state_leaves_the_model_optimizer_loader_and_rng_untouched(tmp_path, engine):
    """Issue 40, 11: an app object raising in its own load_state_dict failed the restore after the model (and
    optimizer) had loaded. The app's own objects load first, so the refusal leaves the rest as it was."""
    sources = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1)}
    torch.manual_seed(0)
    saved_model = nn.Linear(4, 2)
    saved_optim = torch.optim.SGD(saved_model.parameters(), lr=0.1, momentum=0.9)
    saved_model(torch.ones(3, 4)).sum().backward()
    saved_optim.step()
    old = _loader(sources, {"a": 1, "b": 1})
    list(islice(iter(old), 2))
    app = {"model": saved_model, "optim": saved_optim, "counter": Refusing(3), "loader": old}
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(7, app, blocking=True)
    old.close()
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    new = _loader(sources, {"a": 1, "b": 1})
    rng = torch.get_rng_state()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "optim": optim, "counter": Refusing(0), "loader": new})
    assert torch.count_nonzero(model.weight) == 0  # the model was not loaded
    assert optim.param_groups[0]["lr"] == 0.5 and not optim.state  # nor the optimizer
    assert (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (0, 0)  # nor the loader
    assert torch.equal(torch.get_rng_state(), rng)  # nor the RNG
    text = str(err.value)
    assert "counter state" in text and "another format" in text and "left as they were" in text, text
    new.close()


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_model_that_does_not_match_leaves_the_apps_own_objects_untouched_though_they_load_first(tmp_path, engine):
    """The app's own objects load before the model (above), so the model's strict check (state keys, shapes)
    is made before them: a model of another shape still leaves every object as it was."""
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(3, {"model": nn.Linear(4, 2), "counter": Counter(5)}, blocking=True)
    counter = Counter(0)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError, match=r"app key model: other shape: bias \(checkpoint 2, app 3\)"):
            ckpt.restore_latest({"model": nn.Linear(4, 3), "counter": counter})
        assert counter.value == 0
        ckpt.restore_latest({"model": nn.Linear(4, 2), "counter": counter})
    assert counter.value == 5


class Counter(Refusing):
    """An app object of the app's own that loads what was saved."""

    def load_state_dict(self, state):
        self.value = int(state["value"])


class WrappedOptimizer:
    """An optimizer wrapper that is no ``torch.optim.Optimizer`` (as accelerate's ``AcceleratedOptimizer`` and
    Lightning's ``LightningOptimizer`` are): its groups and state are the wrapped optimizer's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_an_app_object_that_refuses_its_state_leaves_a_wrapped_optimizer_and_its_scheduler_untouched(tmp_path,
                                                                                                    engine):
    """The refusal says the optimizers are left as they were: so they are when the optimizer is wrapped (not an
    ``Optimizer`` itself) and for torch's LR scheduler, whose state goes with the optimizer's; they loaded in the
    first phase, with the app's own objects, before."""
    torch.manual_seed(0)
    saved_model = nn.Linear(4, 2)
    saved_optim = torch.optim.Adam(saved_model.parameters(), lr=0.1)
    saved_sched = torch.optim.lr_scheduler.StepLR(saved_optim, step_size=1, gamma=0.5)
    saved_model(torch.ones(3, 4)).sum().backward()
    saved_optim.step()
    saved_sched.step()
    app = {"model": saved_model, "optim": WrappedOptimizer(saved_optim), "sched": saved_sched,
           "counter": Refusing(3)}
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(7, app, blocking=True)
    model = nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError, match="left as they were"):
            ckpt.restore_latest({"model": model, "optim": WrappedOptimizer(optim), "sched": sched,
                                 "counter": Refusing(0)})
    assert not optim.state and sched.last_epoch == 0  # neither was loaded
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:  # without the refusing object: both load
        ckpt.restore_latest({"model": model, "optim": WrappedOptimizer(optim), "sched": sched}, strict=False)
    assert optim.state and sched.last_epoch == 1 and torch.equal(model.weight, saved_model.weight)
