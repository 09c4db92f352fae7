"""Hostile review of checkpoint round 6: parameter groups checked before anything loads (real torchsnapshot and
DCP checkpoints), and the agreements' watching threads on real gloo ranks (no false 'waiting for rank' line for
ranks that are slow but alive, no thread left behind, no beat after close)."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Lines
from helpers import free_port, spawn_ranks
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
    model = net()
    optim = swapped(model, 0)
    trained(model, optim)
    app = {"model": model, "optim": optim} if engine == "torchsnapshot" else {"optim": optim}
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, app, blocking=True)
    for strict in (True, False):
        model2 = net(1)
        optim2 = swapped(model2, 1)
        trained(model2, optim2)
        app2 = {"model": model2, "optim": optim2} if engine == "torchsnapshot" else {"optim": optim2}
        before = copy.deepcopy({"model": model2.state_dict(), "optim": optim2.state_dict()})
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            if strict:
                with pytest.raises(CheckpointError) as err:
                    ckpt.restore_latest(app2)
                assert "app key optim: the checkpoint's optimizer state of parameter 0 (group 0) has exp_avg of " \
                       "8x8, the app's parameter 4x8" in str(err.value), str(err.value)
                assert "\n" not in str(err.value)
                assert same({"model": model2.state_dict(), "optim": optim2.state_dict()}, before)
                continue
            skipped = ckpt.restore_latest(app2, strict=False).skipped
        assert same(optim2.state_dict(), before["optim"])  # left as it was
        assert any(s.startswith("app key optim: the checkpoint's optimizer state of parameter 0") and
                   s.endswith("(optimizer left as it was)") for s in skipped), skipped
        if engine == "torchsnapshot":
            assert same(model2.state_dict(), model.state_dict())  # the model loads
        trained(model2, optim2)


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


# ---------------------------------------------------------------- 3. the agreements' watching threads


def _burn(stop: threading.Event) -> None:
    """A busy machine: a thread of the rank's own that holds the GIL most of the time."""
    while not stop.is_set():
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        time.sleep(0.002)


def load_worker(rank: int, port: int, root: str, out: str) -> None:
    """Blocking and background saves and a restore on 2 ranks slowed by a GIL-holding thread each (alive, not
    stopped); what the watching threads said, which threads are left, and whether beats go on after close."""
    from fastio.checkpoint import group
    from fastio.dist import default_store

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0  # the looks come sooner: a false line would show within the test's time
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    stop = threading.Event()
    threading.Thread(target=_burn, args=(stop,), daemon=True).start()
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(root, signals=(), keep=2)
    for step in range(1, 11):
        trained_linear(model, optim)
        ckpt.save(step, {"model": model, "optim": optim}, blocking=step % 2 == 0)
    ckpt.restore_latest({"model": model, "optim": optim})
    keys = [ckpt._ranks._key, ckpt._writer_ranks._key]
    ckpt.close()
    stop.set()
    time.sleep(1.0)  # a watching thread ends within a store request of its collective's end
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("fastio-"))
    beats = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    time.sleep(1.2)
    beats_later = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": lines.lines, "left": left, "beats": beats,
                                                         "beats_later": beats_later}))
    dist.destroy_process_group()


def trained_linear(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()
    optim.step()


def test_slow_ranks_are_not_named_and_no_thread_or_beat_is_left(tmp_path):
    port = free_port()
    spawn_ranks(load_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=240)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        assert not [line for line in got["lines"] if "waiting" in line], (rank, got["lines"])
        assert got["left"] == [], (rank, got["left"])
        assert got["beats"] == got["beats_later"], (rank, got)


def kill_worker(rank: int, victim: int, port: int, root: str, out: str) -> None:
    """Rank ``victim`` busy 3 s at the end of the write phase (beating), then SIGKILLed; the other waits for it
    in the phase's agreement, its watching thread looking at the victim's beats, the store on rank 0."""
    from fastio.checkpoint import group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    ckpt = Checkpointer(root, signals=())
    app = {"model": nn.Linear(4, 2)}
    ckpt.save(1, app, blocking=True)

    def hook(group_name: str, phase: str) -> None:
        if (group_name, phase) == ("checkpoint writer", "write") and rank == victim:
            time.sleep(3)
            os.kill(os.getpid(), signal.SIGKILL)

    group.fault_hook = hook
    started = time.monotonic()
    try:
        ckpt.save(2, app, blocking=True)
        error = None
    except CheckpointError as err:
        error = str(err)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "error": error, "took": time.monotonic() - started, "lines": lines.lines,
        "steps": sorted(p.name for p in Path(root).glob("step-*"))}))
    os._exit(0)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_while_the_other_watches_its_beats_is_named_gone(tmp_path, victim):
    """A rank SIGKILLed inside a save while another waits for it (watching thread on, the store maybe gone with
    it): the waiting rank raises the usual one line naming the rank that went away, soon, and is not told it is
    'waiting' for a rank that was busy; the previous checkpoint stays the only committed one."""
    port = free_port()
    spawn_ranks(kill_worker, lambda r: (r, victim, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    got = json.loads((tmp_path / f"rank{1 - victim}.json").read_text())
    assert not (tmp_path / f"rank{victim}.json").exists()
    assert got["error"] and "\n" not in got["error"], got
    assert f"checkpoint write: rank {victim} (pid" in got["error"] and "went away" in got["error"], got["error"]
    assert got["took"] < 60, got
    assert not [line for line in got["lines"] if "waiting" in line], got["lines"]
    assert [s for s in got["steps"] if not s.endswith(".tmp")] == ["step-1"], got["steps"]  # the killed leader's
    # temporary directory is the next Checkpointer's to clean, as before


RESTORE_CASES = (("stopped in open", "open", True), ("stopped in load", "load", True), ("busy in load", "load", False))


def stop_restore_worker(rank: int, port: int, root: str, out: str) -> None:
    """Rank 1 stopped (SIGSTOP, continued 4 s later) or busy 4 s at the end of a restore's phase; rank 0 waits
    for it in the phase's agreement."""
    from fastio.checkpoint import group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    app = {"model": nn.Linear(4, 2)}
    ckpt = Checkpointer(root, signals=())
    ckpt.save(1, app, blocking=True)
    seen: dict = {}
    for label, phase, stop in RESTORE_CASES:
        def hook(group_name: str, at: str, phase=phase, stop=stop) -> None:
            if (group_name, at) != ("checkpointer", phase):
                return
            if not stop:
                time.sleep(4)
                return
            subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 4; kill -CONT {os.getpid()}"])
            time.sleep(1)  # stopped in here

        group.fault_hook = hook if rank == 1 else None
        lines.lines.clear()
        seen[label] = {"step": ckpt.restore_latest(app).step, "lines": list(lines.lines)}
    group.fault_hook = None
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_rank_stopped_inside_a_restore_is_named_once_and_a_busy_one_not(tmp_path):
    port = free_port()
    spawn_ranks(stop_restore_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for label, phase, stop in RESTORE_CASES:
        assert seen[0][label]["step"] == seen[1][label]["step"] == 1, label
        warned = [line for line in seen[0][label]["lines"] if "waiting" in line]
        if stop:
            assert len(warned) == 1 and f"checkpoint {phase}: waiting" in warned[0], (label, warned)
            assert "for rank 1 (pid" in warned[0] and "checkpointer group" in warned[0], warned
        else:
            assert warned == [], (label, warned)


def slow_worker(rank: int, port: int, root: str, out: str) -> None:
    """Ranks slow (4 s) in the Checkpointer's own work outside its phases' functions: rank 0 taking the
    directory at construction (its lock; an s3:// dir's lease, requests that can retry), rank 1 making the
    engine at its first save (importing torchsnapshot, seconds on a loaded node); the other waits for it."""
    from fastio.checkpoint import group
    from fastio.checkpoint.checkpointer import Checkpointer as Ck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    take, make = Ck._take_dir, Ck._engine

    def slow_take(self):
        time.sleep(4 if rank == 0 else 0)
        return take(self)

    def slow_make(self, name):
        time.sleep(4 if rank == 1 and name not in self._engines else 0)
        return make(self, name)

    Ck._take_dir, Ck._engine = slow_take, slow_make
    seen = {}
    ckpt = Checkpointer(root, signals=())
    seen["construction"], lines.lines = lines.lines, []
    ckpt.save(1, {"model": nn.Linear(4, 2)}, blocking=True)
    seen["first save"] = lines.lines
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_rank_slow_in_the_checkpointers_own_work_is_not_named(tmp_path):
    """A rank slow in the Checkpointer's own work between agreements is busy, not stopped: the other is not told
    it waits for it ('checkpoint open: waiting 5 s for rank 0 (...) (stopped, or busy outside the
    Checkpointer?)' was logged at construction, 'checkpoint stage: waiting ... for rank 1' at the first save)."""
    port = free_port()
    spawn_ranks(slow_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        for when, lines in got.items():
            assert not [line for line in lines if "waiting" in line], (rank, when, lines)


def node_worker(rank: int, port: int, url: str, options: dict, root: str, out: str) -> None:
    """2 simulated nodes of an s3:// dir (a staging directory each): rank 0, its node's leader, slow (4 s)
    removing its node's temporary copy after the commit; rank 1 goes on to the blocking save's last agreement."""
    from fastio.checkpoint import commit, group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    remove = commit.layout.remove_step

    def slow_remove(path):
        time.sleep(4 if rank == 0 and str(path).endswith(".tmp") else 0)
        return remove(path)

    commit.layout.remove_step = slow_remove
    with Checkpointer(url, storage_options=options, staging_dir=f"{root}/node{rank}", signals=()) as ckpt:
        ckpt.save(1, {"model": nn.Linear(4, 2)}, blocking=True)
        steps = ckpt.steps()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": lines.lines, "steps": steps}))
    dist.destroy_process_group()


def test_a_node_leader_slow_removing_its_temporary_copy_is_not_named(moto_server, tmp_path):
    """An s3:// dir staged per node: the node's leader removing its temporary copy after the commit is the
    save's own work (a large step: seconds), not a stop; rank 1 logged 'checkpoint save: waiting ... for rank
    0 (...) (stopped, or busy outside the Checkpointer?)'."""
    bucket = f"review6-{uuid.uuid4().hex[:8]}"
    moto_server.create_bucket(bucket)
    port = free_port()
    spawn_ranks(node_worker, lambda r: (r, port, f"s3://{bucket}/ck", moto_server.options(), str(tmp_path),
                                        str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        assert got["steps"] == [1], (rank, got)
        assert not [line for line in got["lines"] if "waiting" in line], (rank, got["lines"])
