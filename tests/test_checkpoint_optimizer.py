"""An optimizer's state through a restore, on real torchsnapshot and DCP checkpoints: state of another parameter
shape refused before anything loads (or, with ``strict=False``, left as it was and listed), the app's parameter
groups kept under DCP, each of torch's optimizers restored as saved, lr schedulers made before or after the
restore, groups the manifest does not show, Accelerate's wrapped optimizer, and LBFGS refused by DCP at save."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError


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


def swapped(model: nn.Module, first: int) -> torch.optim.Optimizer:
    """Adam of two groups of 2 parameters each: the model's layer ``first`` in group 0, the other in group 1."""
    return torch.optim.Adam([{"params": model[first].parameters()}, {"params": model[1 - first].parameters()}])


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_positional_state_of_another_parameter_shape_refused_before_anything_loads(tmp_path, engine):
    """An optimizer whose groups hold as many parameters as the checkpoint's, in another order (the layers'
    groups swapped): its positional state (torchsnapshot; DCP's optimizer of no app module) has other shapes
    than the app's parameters. strict: refused before anything loads, naming the app key, the state and both
    shapes; strict=False: left as it was (listed), and it trains on. It was loaded, and its next step failed in
    torch (RuntimeError: The size of tensor a (8) must match the size of tensor b (4))."""
    skipped = _refused_then_left(tmp_path, engine, lambda m: swapped(m, 0), lambda m: swapped(m, 1),
                                 "app key optim: the checkpoint's optimizer state of parameter 0 (group 0) has "
                                 "exp_avg of 8x8, the app's parameter 4x8")
    assert any(s.startswith("app key optim: the checkpoint's optimizer state of parameter 0") and
               s.endswith("(optimizer left as it was)") for s in skipped), skipped


def _refused_then_left(tmp_path: Path, engine: str, saved_kind, app_kind, said: str) -> list[str]:
    """Save an optimizer made by ``saved_kind(model)`` (with its model under torchsnapshot, alone under DCP), then
    restore into one made by ``app_kind(model)``: strict, refused before anything loads, the error holding ``said``
    (one line); strict=False, the optimizer left as it was, the model loaded (torchsnapshot), and it trains on. The
    strict=False restore's ``skipped``."""
    model = net()
    optim = saved_kind(model)
    trained(model, optim)
    app = {"model": model, "optim": optim} if engine == "torchsnapshot" else {"optim": optim}
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, app, blocking=True)
    for strict in (True, False):
        model2 = net(1)
        optim2 = app_kind(model2)
        trained(model2, optim2)
        app2 = {"model": model2, "optim": optim2} if engine == "torchsnapshot" else {"optim": optim2}
        before = copy.deepcopy({"model": model2.state_dict(), "optim": optim2.state_dict()})
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            if strict:
                with pytest.raises(CheckpointError) as err:
                    ckpt.restore_latest(app2)
                assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
                assert same({"model": model2.state_dict(), "optim": optim2.state_dict()}, before)
                continue
            skipped = ckpt.restore_latest(app2, strict=False).skipped
        assert same(optim2.state_dict(), before["optim"])  # left as it was
        if engine == "torchsnapshot":
            assert same(model2.state_dict(), model.state_dict())  # the model loads
        trained(model2, optim2)
    return skipped


OTHER_KINDS = {"SGD into Adam": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.optim.Adam,
                                   "betas, eps"),
               "Adam into SGD": (torch.optim.Adam, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                 "dampening, momentum")}


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_an_optimizer_of_another_kind_refused_before_anything_loads(tmp_path, engine, kind):
    """A checkpoint of one kind of torch optimizer restored into another (positional state: torchsnapshot, DCP's
    optimizer of no app module): its parameter groups lack settings the app's optimizer needs. strict: refused
    before anything loads, naming the app key and the settings; strict=False: left as it was (listed), and it
    trains on. SGD into Adam failed in the load (`restore failed: KeyError: 'step'`) after the model had loaded;
    Adam into SGD loaded without a word and the next step failed in torch (KeyError: 'momentum')."""
    saved_kind, app_kind, missing = OTHER_KINDS[kind]
    app_name = type(app_kind(net().parameters())).__name__
    skipped = _refused_then_left(tmp_path, engine, lambda m: saved_kind(m.parameters()),
                                 lambda m: app_kind(m.parameters()),
                                 f"app key optim: the checkpoint's optimizer has no {missing} in parameter group 0, "
                                 f"which the app's {app_name} needs")
    assert any(s.startswith(f"app key optim: the checkpoint's optimizer has no {missing}") and
               s.endswith("(optimizer left as it was)") for s in skipped), skipped


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
@pytest.mark.parametrize("saved_kind, app_kind", [(torch.optim.AdamW, torch.optim.Adam),
                                                  (torch.optim.Adam, torch.optim.AdamW)])
def test_adam_and_adamw_are_told_apart(tmp_path, engine, saved_kind, app_kind):
    """Before: Adam and AdamW keep the same state and settings (torch >= 2.6: AdamW is an Adam with
    decoupled_weight_decay=True), so a checkpoint of one restored into the other without a word, and the group's
    saved decoupled_weight_decay made the app's Adam train as an AdamW (or its AdamW as an Adam). Now the commit
    marker records each optimizer's class, and another class is refused before anything loads, naming both;
    strict=False leaves that optimizer as it was."""
    saved, app = saved_kind.__name__, app_kind.__name__
    skipped = _refused_then_left(tmp_path, engine, lambda m: saved_kind(m.parameters(), weight_decay=0.1),
                                 lambda m: app_kind(m.parameters(), weight_decay=0.1),
                                 f"app key optim: the checkpoint's optimizer is a torch.optim.{saved.lower()}.{saved}, "
                                 f"the app's a torch.optim.{app.lower()}.{app}")
    assert any(s.startswith("app key optim: the checkpoint's optimizer is a ") and
               s.endswith("(optimizer left as it was)") for s in skipped), skipped


class AdamW(torch.optim.AdamW):
    """Another library's optimizer of the same class name as torch's (bitsandbytes' ``AdamW``): here a subclass,
    so that its state and settings are torch's and only its class tells it apart."""


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_an_optimizer_of_another_module_with_the_same_class_name_is_told_apart(tmp_path, engine):
    """Before: the classes the commit marker records were compared by their last name only, so a checkpoint of
    torch's AdamW restored into another library's AdamW (bitsandbytes') without a word. Now module and qualified
    name are compared: refused before anything loads, naming both; strict=False leaves that optimizer as it was."""
    skipped = _refused_then_left(tmp_path, engine, lambda m: torch.optim.AdamW(m.parameters()),
                                 lambda m: AdamW(m.parameters()),
                                 "app key optim: the checkpoint's optimizer is a torch.optim.adamw.AdamW, the app's a "
                                 f"{__name__}.AdamW")
    assert any(s.startswith("app key optim: the checkpoint's optimizer is a ") for s in skipped), skipped


@pytest.mark.parametrize("recorded", ["AdamW", "torch.optim._multi_tensor.adamw.AdamW"])
def test_a_marker_naming_the_class_only_or_another_module_of_torch_still_restores(tmp_path, recorded):
    """A marker that records an optimizer's class by its name only (an older fastio), or in another module of
    torch.optim (another torch's layout), restores into torch's class of that name as before."""
    import json

    from fastio.checkpoint import naming

    model = net()
    optim = torch.optim.AdamW(model.parameters())
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    marker = tmp_path / "ck" / "step-1" / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    data["optimizers"] = {"optim": recorded}
    marker.write_text(json.dumps(data))
    model2 = net(1)
    optim2 = torch.optim.AdamW(model2.parameters())
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest({"model": model2, "optim": optim2}).step == 1
    assert same(optim2.state_dict(), optim.state_dict())
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, pytest.raises(CheckpointError, match="optimizer is a"):
        ckpt.restore_latest({"model": net(1), "optim": torch.optim.Adam(net(1).parameters())})


def test_a_checkpoint_without_the_optimizers_class_still_restores(tmp_path):
    """A commit marker of an older fastio records no optimizer class: its optimizer restores as before."""
    import json

    from fastio.checkpoint import naming

    model = net()
    optim = torch.optim.AdamW(model.parameters())
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    marker = tmp_path / "ck" / "step-1" / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    assert data.pop("optimizers") == {"optim": "torch.optim.adamw.AdamW"}
    marker.write_text(json.dumps(data))
    model2 = net(1)
    optim2 = torch.optim.AdamW(model2.parameters())
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest({"model": model2, "optim": optim2}).step == 1
    assert same(optim2.state_dict(), optim.state_dict())


TORCH_OPTIMIZERS = {
    "Adam amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True), "AdamW": torch.optim.AdamW,
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "Adagrad": torch.optim.Adagrad,
    "RMSprop centered": lambda ps: torch.optim.RMSprop(ps, centered=True, momentum=0.9), "Rprop": torch.optim.Rprop,
    "ASGD": torch.optim.ASGD, "Adadelta": torch.optim.Adadelta, "NAdam": torch.optim.NAdam, "RAdam": torch.optim.RAdam,
    "Adamax": torch.optim.Adamax, "Adafactor": torch.optim.Adafactor}


def test_torch_optimizers_of_the_same_parameters_restore_with_their_state(tmp_path):
    """No false refusal by the state-shape check: each of torch's optimizers (whose state is kept in the
    parameter's shape, or not: Adafactor) restores its state as saved (torchsnapshot, positional)."""
    for name, make in TORCH_OPTIMIZERS.items():
        model = net()
        optim = make(model.parameters())
        trained(model, optim)
        with Checkpointer(tmp_path / name, signals=(), engine="torchsnapshot") as ckpt:
            ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
        model2 = net(1)
        optim2 = make(model2.parameters())
        with Checkpointer(tmp_path / name, signals=()) as ckpt:
            assert ckpt.restore_latest({"model": model2, "optim": optim2}).skipped == [], name
        assert same(optim2.state_dict(), optim.state_dict()), name


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_scheduler_made_after_the_restore_finds_its_initial_lr(tmp_path, engine):
    """An lr scheduler writes initial_lr into the optimizer's groups; a run that builds its scheduler after the
    restore (StepLR(optim, ..., last_epoch=N)) needs it from the checkpoint, as torch's load_state_dict gives it.
    DCP refused the checkpoint ('in the checkpoint, not in the app: param_groups.0.initial_lr'), and with
    strict=False left it out, so that the scheduler failed (KeyError: param 'initial_lr' is not specified)."""
    model = net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    for _ in range(3):
        trained(model, optim)
        sched.step()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim}, blocking=True)
    for strict in (True, False):
        model2 = net(1)
        optim2 = torch.optim.SGD(model2.parameters(), lr=0.1)
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            assert ckpt.restore_latest({"model": model2, "optim": optim2}, strict=strict).skipped == []
        assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 0.0125
        torch.optim.lr_scheduler.StepLR(optim2, 1, gamma=0.5, last_epoch=2)  # resumes: its first step on build
        assert optim2.param_groups[0]["lr"] == 0.00625


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_scheduler_new_in_the_resumed_run_keeps_its_initial_lr(tmp_path, engine):
    """The other way round: a run that saved without an lr scheduler, resumed by one that builds its scheduler
    (initial_lr in the groups) before the restore. torch's load_state_dict takes the checkpoint's groups; DCP
    refused ('in the app, not in the checkpoint: param_groups.0.initial_lr'). Now the app's setting stays."""
    model = net()
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    model2 = net(1)
    optim2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim2, 1, gamma=0.5)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest({"model": model2, "optim": optim2}).skipped == []
    assert optim2.param_groups[0]["lr"] == 0.05  # the checkpoint's
    sched.step()
    assert optim2.param_groups[0]["lr"] == 0.025


class TupleGroups(torch.optim.SGD):
    """An optimizer whose state dict holds its parameter groups as a tuple (torchsnapshot pickles it whole)."""

    def state_dict(self):
        state = super().state_dict()
        return {**state, "param_groups": tuple(state["param_groups"])}

    def load_state_dict(self, state_dict):
        super().load_state_dict({**state_dict, "param_groups": list(state_dict["param_groups"])})


def test_groups_the_manifest_does_not_show_are_not_refused(tmp_path):
    """torchsnapshot stores parameter groups it cannot flatten (a tuple) as one object: the manifest shows no
    group, which read as '0 parameter groups (none parameters)' and refused an optimizer that loads; the
    groups are now left to torch's own check."""
    model = net()
    optim = TupleGroups(model.parameters(), lr=0.1, momentum=0.9)
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    model2 = net(1)
    optim2 = TupleGroups(model2.parameters(), lr=0.1, momentum=0.9)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.restore_latest({"model": model2, "optim": optim2})
    assert same(optim2.state_dict(), optim.state_dict())


def test_an_accelerate_wrapped_optimizer_of_swapped_groups_refused(tmp_path):
    """The same check through Accelerate's AcceleratedOptimizer (accelerator.prepare's optimizer, a wrapper of
    torch's): it was not looked into (not a torch.optim class), loaded, and its next step failed in torch."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(net())
    optim = accelerator.prepare(swapped(model, 0))
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    model2 = net(1)
    optim2 = accelerator.prepare(swapped(model2, 1))
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError, match="app key optim: the checkpoint's optimizer state of parameter 0"):
            ckpt.restore_latest({"model": model2, "optim": optim2})


@pytest.mark.parametrize("stepped", [False, True])
def test_dcp_refuses_lbfgs_of_an_app_module_at_save_naming_the_key(tmp_path, stepped):
    """DCP keys an app module's optimizer state by parameter name and needs it for every parameter; LBFGS keeps
    state for its first parameter only. Saved before its first step, the save failed with 'TypeError: 'NoneType'
    object is not callable' (DCP stepping it without a closure); after one, the save went through and every
    restore failed ('Missing optimizer state for parameter '0.bias''). Now the save is refused at once, naming
    the app key and the way out, and nothing is written; torchsnapshot saves and restores it."""
    model = net()
    optim = torch.optim.LBFGS(model.parameters())
    if stepped:
        def closure():
            optim.zero_grad()
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            return loss
        optim.step(closure)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    assert str(err.value).startswith("app key optim: LBFGS keeps state for its first parameter only, and DCP "
                                     "needs it per parameter name: save with engine='torchsnapshot'"), str(err.value)
    assert list((tmp_path / "ck").glob("step-*")) == []
    with Checkpointer(tmp_path / "ts", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
        model2 = net(1)
        optim2 = torch.optim.LBFGS(model2.parameters())
        ckpt.restore_latest({"model": model2, "optim": optim2})
    assert same(optim2.state_dict(), optim.state_dict())
