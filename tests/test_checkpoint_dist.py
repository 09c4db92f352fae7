"""Two real ranks (gloo on 127.0.0.1, torch.multiprocessing spawn): DDP state written once, per-rank state per rank."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fastio.checkpoint import Checkpointer, layout

WORLD = 2


class Position:
    """Per-rank loader-like state."""

    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"version": 1, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def build():
    torch.manual_seed(0)  # same initial weights on both ranks, as DDP requires
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": optim, "loader": Position()}


def worker(rank: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        app = build()
        torch.manual_seed(100 + rank)  # per-rank RNG streams
        ckpt = Checkpointer(root, every_steps=2, signals=())
        for step in range(1, 6):
            x = torch.randn(8, 16)
            loss = app["model"](x).square().mean()
            app["optim"].zero_grad()
            loss.backward()
            app["optim"].step()
            app["loader"].consumed += 8 * (rank + 1)  # different on each rank
            if step == 5 and rank == 1:
                ckpt.request_preemption()  # only rank 1 was signalled: both must save and stop
            ckpt.maybe_save(step, app, metrics={"loss": loss.item()})
            if ckpt.preempted:
                break
        preempted = ckpt.preempted
        ckpt.close()
        expected = {"consumed": app["loader"].consumed, "draw": torch.rand(4).tolist(),
                    "weight": app["model"].module.weight.detach().flatten().tolist(), "step": step}
        fresh = build()
        torch.manual_seed(999)
        state = Checkpointer(root, signals=()).restore_latest(fresh)
        got = {"consumed": fresh["loader"].consumed, "draw": torch.rand(4).tolist(),
               "weight": fresh["model"].module.weight.detach().flatten().tolist(), "step": state.step}
        Path(out, f"rank{rank}.json").write_text(json.dumps({"preempted": preempted, "expected": expected,
                                                            "got": got}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_per_rank_state_and_agreed_preemption(tmp_path):
    root = tmp_path / "ck"
    mp.spawn(worker, args=(free_port(), str(root), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert res["preempted"] is True, r
        assert res["got"] == res["expected"], r
        assert res["got"]["step"] == 5
    assert results[0]["got"]["consumed"] == 40 and results[1]["got"]["consumed"] == 80
    assert results[0]["got"]["draw"] != results[1]["got"]["draw"]
    assert [e.step for e in layout.committed(root)] == [2, 4, 5]
    assert layout.verify(root) == []
    files = layout.read_commit(root / "step-5")["files"]
    # the DDP model and its optimizer are replicated (written once, not per rank); loader and RNG are per rank
    for key in ("model", "optim"):
        assert not any(f.startswith((f"0/{key}", f"1/{key}")) for f in files), sorted(files)
        assert any(f.startswith(f"replicated/{key}") for f in files), sorted(files)
    manifest = (root / "step-5" / ".snapshot_metadata").read_text()
    for r in range(WORLD):
        assert any(f.startswith(f"{r}/_fastio_rng/") for f in files), sorted(files)
        assert f"{r}/loader/consumed" in manifest  # small ints live in torchsnapshot's manifest, per rank
