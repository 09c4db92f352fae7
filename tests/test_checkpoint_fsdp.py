"""FSDP2 (``fully_shard``) on real gloo ranks: exact resume after a kill, and resharding 2 -> 1 and 2 -> 3.

Workers are started by ``helpers.rank_process`` (forked from a fresh server process, as a spawned one would start)
and judged only by the files they write: torch's gloo teardown can abort a process at exit, so exit codes say
nothing here (every worker ends with ``destroy_process_group`` and ``os._exit(0)`` after flushing its files).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import rank_process
from torch import nn

from fastio.checkpoint import Checkpointer, catalog, scan
from fastio.errors import CheckpointError

STEPS, SAVE_AT = 6, 3


class Position:
    """Per-rank loader-like state."""

    def __init__(self, rank: int = 0):
        self.consumed, self.epoch, self.rank = 0, 0, rank

    def state_dict(self):
        return {"version": 1, "consumed": self.consumed, "epoch": self.epoch, "rank": self.rank}

    def load_state_dict(self, state):
        self.consumed, self.epoch, self.rank = state["consumed"], state["epoch"], state["rank"]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 5))


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def build(seed: int, rank: int, *, sharded: bool = True):
    model = make_model(seed)
    if sharded:
        shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return {"model": model, "optim": optim, "loader": Position(rank)}


def step(app, n: int, rank: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(1000 * n + rank)  # each rank its own batch of step n
    loss = app["model"](torch.randn(8, 16, generator=g).to(device)).square().mean()
    app["optim"].zero_grad()
    loss.backward()
    app["optim"].step()
    app["loader"].consumed += 8


def full(app) -> dict[str, list]:
    """Every parameter and optimizer tensor as a full (unsharded) tensor, by name: collective for DTensors."""
    out = {}
    names = {id(p): n for n, p in app["model"].named_parameters()}
    for n, p in app["model"].named_parameters():
        out[f"model/{n}"] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    for p, s in app["optim"].state.items():
        for k, v in s.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: v.detach().clone() for k, v in out.items()}


def init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def finish(distributed: bool = True) -> None:
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


# ---------------------------------------------------------------- workers
def run_and_kill(rank: int, port: int, root: str, out: str) -> None:
    """The uninterrupted reference run, then the run that saves at SAVE_AT and is SIGKILLed a step later."""
    init(rank, 2, port)
    app = build(0, rank)
    for n in range(1, STEPS + 1):
        step(app, n, rank)
    ref = full(app)
    if rank == 0:
        torch.save(ref, Path(out, "ref.pt"))
    app = build(0, rank)
    ckpt = Checkpointer(root, every_steps=SAVE_AT, signals=())
    for n in range(1, STEPS + 1):
        step(app, n, rank)
        ckpt.maybe_save(n, app)  # returns once staged: step SAVE_AT + 1 changes the shards while they are written
        if n == SAVE_AT + 1:
            ckpt.wait()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, port: int, root: str, out: str) -> None:
    init(rank, 2, port)
    app = build(7, rank)  # other initial weights: the restore must bring the saved ones
    ckpt = Checkpointer(root, every_steps=SAVE_AT, signals=())
    state = ckpt.restore_latest(app)
    for n in range(state.step + 1, STEPS + 1):
        step(app, n, rank)
        ckpt.maybe_save(n, app)
    ckpt.close()
    got = full(app)
    if rank == 0:
        torch.save({"got": got, "step": state.step, "consumed": app["loader"].consumed}, Path(out, "resumed.pt"))
    finish()


def reshard(rank: int, ports: list[int], root: str, out: str) -> None:
    """Ranks 0..2 restore the final 2-rank checkpoint as FSDP2 on 3 ranks; rank 3 alone into a plain model,
    from a copy (two jobs at once on one directory: the second would be refused)."""
    if rank == 3:
        app = build(9, 0, sharded=False)
        state = Checkpointer(f"{root}-copy", signals=()).restore_latest(app)
        torch.save({"got": full(app), "step": state.step, "loader": app["loader"].state_dict()},
                   Path(out, "reshard1.pt"))
        finish(distributed=False)
    init(rank, 3, ports[0])
    app = build(9, rank)
    state = Checkpointer(root, signals=()).restore_latest(app)
    got = full(app)
    step(app, STEPS + 1, rank)  # the resharded optimizer takes a step
    if rank == 0:
        torch.save({"got": got, "step": state.step}, Path(out, "reshard3.pt"))
    finish()


# ---------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target, nprocs: int, *args, timeout: float = 240) -> None:
    procs = [rank_process(target, (r, *args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()


def assert_same(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), (what, sorted(set(got) ^ set(ref)))
    for k in ref:
        assert torch.equal(got[k], ref[k]), (what, k)


def test_fsdp2_exact_resume_after_kill_and_resharding(tmp_path):
    root, out = tmp_path / "ck", tmp_path
    launch(run_and_kill, 2, free_port(), str(root), str(out))
    commit = scan.read_commit(root / f"step-{SAVE_AT}")
    assert commit.engine == "dcp" and commit.progress.world_size == 2  # engine="auto" chose DCP for DTensor state
    assert [e.step for e in scan.committed(root)] == [SAVE_AT]  # killed before the next save
    ref = torch.load(out / "ref.pt")

    launch(resume, 2, free_port(), str(root), str(out))
    resumed = torch.load(out / "resumed.pt")
    assert resumed["step"] == SAVE_AT and resumed["consumed"] == 8 * STEPS
    assert_same(resumed["got"], ref, "2-rank resume")  # bitwise equal to the uninterrupted run
    assert [e.step for e in scan.committed(root)] == [SAVE_AT, STEPS] and catalog.verify(root) == []

    shutil.copytree(root, f"{root}-copy", ignore=shutil.ignore_patterns(".fastio-lock"))
    launch(reshard, 4, [free_port()], str(root), str(out))
    one = torch.load(out / "reshard1.pt")
    assert one["step"] == STEPS and one["loader"]["consumed"] == 8 * STEPS
    assert_same(one["got"], ref, "2 -> 1 unsharded")
    three = torch.load(out / "reshard3.pt")
    assert three["step"] == STEPS
    assert_same(three["got"], ref, "2 -> 3 FSDP2")


def test_plain_checkpoint_into_fsdp2_dcp_restores_and_torchsnapshot_refuses(tmp_path):
    """A plain model's checkpoint into an FSDP2 (DTensor) model: DCP reshards it; torchsnapshot cannot and says so."""
    plain = build(0, 0, sharded=False)
    step(plain, 1, 0)
    for engine in ("dcp", "torchsnapshot"):
        with Checkpointer(tmp_path / engine, engine=engine, signals=()) as ckpt:
            ckpt.save(1, plain, blocking=True)
    torch.save(full(plain), tmp_path / "plain.pt")
    launch(_restore_plain_into_fsdp, 1, free_port(), str(tmp_path))
    assert_same(torch.load(tmp_path / "fsdp-from-dcp.pt"), torch.load(tmp_path / "plain.pt"), "plain -> FSDP2")
    msg = (tmp_path / "error.txt").read_text()
    root = tmp_path / "torchsnapshot"
    assert msg.startswith(f"{root}/step-1: written by the torchsnapshot engine, which cannot restore into DTensor")
    assert "model, optim" in msg and "\n" not in msg


@pytest.mark.gpu
def test_fsdp2_cuda_dtensors_round_trip_through_dcp(tmp_path):
    """FSDP2 on the GPU (nccl, one rank in this process): DCP stages the CUDA DTensors in host memory while the
    save is written, and a restore into other weights brings back the saved ones, on the GPU."""
    def app_on_gpu(seed: int) -> dict:
        model = shard(make_model(seed).cuda())
        return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "loader": Position(0)}

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        app = app_on_gpu(0)
        for n in (1, 2):
            step(app, n, 0, "cuda")
        with Checkpointer(tmp_path / "ck", every_steps=2, signals=()) as ckpt:
            ckpt.maybe_save(2, app)  # returns once staged: the next step changes the weights while they are written
            step(app, 3, 0, "cuda")
        assert scan.read_commit(tmp_path / "ck" / "step-2").engine == "dcp"
        fresh = app_on_gpu(7)
        state = Checkpointer(tmp_path / "ck", signals=()).restore_latest(fresh)
        assert state.step == 2 and all(p.is_cuda for p in fresh["model"].parameters())
        again = app_on_gpu(0)
        for n in (1, 2):
            step(again, n, 0, "cuda")
        assert_same(full(fresh), full(again), "FSDP2 on cuda, restored")
    finally:
        dist.destroy_process_group()


def _restore_plain_into_fsdp(rank: int, port: int, out: str) -> None:
    init(rank, 1, port)
    app = build(3, rank)
    Checkpointer(Path(out, "dcp"), signals=()).restore_latest(app)
    torch.save(full(app), Path(out, "fsdp-from-dcp.pt"))
    try:
        Checkpointer(Path(out, "torchsnapshot"), signals=()).restore_latest(build(0, rank))
        Path(out, "error.txt").write_text("no error")
    except CheckpointError as err:
        Path(out, "error.txt").write_text(str(err))
    finish()


def _save_optimizer_over_two_modules(rank: int, port: int, out: str) -> None:
    init(rank, 1, port)
    body, head = shard(make_model(0)), shard(nn.Sequential(nn.Linear(5, 2)))
    optim = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-2)
    try:
        Checkpointer(Path(out, "ck"), signals=()).save(1, {"body": body, "head": head, "optim": optim}, blocking=True)
        Path(out, "error.txt").write_text("no error")
    except CheckpointError as err:
        Path(out, "error.txt").write_text(str(err))
    finish()


def test_an_optimizer_over_two_fsdp2_app_modules_is_refused_naming_them(tmp_path):
    """One optimizer over the DTensor parameters of two app modules (``body``, ``head``): DCP keys its state by
    parameter name within one module, so the save is refused; the message said its module was not in the app
    (both were), now it names the modules and the two ways out. Nothing is committed."""
    launch(_save_optimizer_over_two_modules, 1, free_port(), str(tmp_path))
    msg = (tmp_path / "error.txt").read_text()
    assert msg.startswith("app key optim: its parameters span the app modules body, head"), msg
    assert "nn.ModuleDict" in msg and "needs its module in the app" not in msg
    assert scan.committed(tmp_path / "ck") == []


def _save_fsdp2_with_torchsnapshot(rank: int, port: int, out: str) -> None:
    init(rank, 1, port)
    try:
        Checkpointer(Path(out, "ck"), engine="torchsnapshot", signals=()).save(1, build(0, rank), blocking=True)
        Path(out, "error.txt").write_text("no error")
    except CheckpointError as err:
        Path(out, "error.txt").write_text(str(err))
    finish()


def test_fsdp2_state_saved_with_torchsnapshot_is_refused_at_staging_naming_the_key(tmp_path):
    """``engine="torchsnapshot"`` forced on an FSDP2 app: the save failed in the background write with torch's
    ``RuntimeError: .numpy() is not supported for tensor subclasses.``, naming no key and no way out; it is refused
    while staging now, naming the first DTensor's key and the engine that writes it. Nothing is committed."""
    launch(_save_fsdp2_with_torchsnapshot, 1, free_port(), str(tmp_path))
    msg = (tmp_path / "error.txt").read_text()
    assert msg.startswith("state key 'model/0.weight': torchsnapshot cannot checkpoint a DTensor"), msg
    assert "engine='dcp'" in msg and "numpy" not in msg and "\n" not in msg
    assert scan.committed(tmp_path / "ck") == []


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
