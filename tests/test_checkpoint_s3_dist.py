"""Two real ranks (gloo on 127.0.0.1) with a Checkpointer on s3:// (moto): the staging directory must be one
that every writing rank sees; ranks given different ones (simulated nodes) are refused by name."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError
from fastio.lock import LOCK_NAME
from fastio.storage import open_storage

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused_worker(rank: int, port: int, url: str, options: dict, staging: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        try:
            Checkpointer(url, storage_options=options, staging_dir=staging[rank], signals=()).close()
            result = "constructed"
        except CheckpointError as err:
            result = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_ranks_that_do_not_share_the_staging_dir_are_refused_by_name(moto_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/runs/apart"
    options = moto_server.options()
    staging = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    mp.spawn(refused_worker, args=(free_port(), url, options, staging, str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]  # every rank fails, with the same one line
    assert results[0] == (f"{staging[0]}: the staging directory of rank 0 is not seen by rank(s) 1 "
                          f"({socket.gethostname()}); an s3:// Checkpointer commits each step there, so every "
                          "writing rank must see it: give staging_dir= on a shared file system")
    # rank 0 let go of the prefix's lease and of its staging lock; no probe files are left behind
    assert open_storage(url, options).head(LOCK_NAME) is None
    assert sorted(p.name for p in Path(staging[0]).iterdir()) == [LOCK_NAME]
    assert sorted(p.name for p in Path(staging[1]).iterdir()) == []
    Checkpointer(url, storage_options=options, staging_dir=staging[0], signals=()).close()


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
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01), "loader": Position()}


def round_trip_worker(rank: int, port: int, url: str, options: dict, staging: list[str], restore_staging: list[str],
                      engine: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        app = build()
        torch.manual_seed(100 + rank)
        with Checkpointer(url, every_steps=2, keep=1, storage_options=options, staging_dir=staging[rank],
                          engine=engine, signals=()) as ckpt:
            for step in range(1, 5):
                loss = app["model"](torch.randn(8, 16)).square().mean()
                app["optim"].zero_grad()
                loss.backward()
                app["optim"].step()
                app["loader"].consumed += 8 * (rank + 1)
                ckpt.maybe_save(step, app)
        expected = {"consumed": app["loader"].consumed, "draw": torch.rand(4).tolist(),
                    "weight": app["model"].module.weight.detach().flatten().tolist(),
                    "exp_avg": app["optim"].state_dict()["state"][0]["exp_avg"].flatten().tolist()}
        fresh = build()
        torch.manual_seed(999)
        with Checkpointer(url, storage_options=options, staging_dir=restore_staging[rank], signals=()) as ckpt:
            state = ckpt.restore_latest(fresh)
            steps = ckpt.steps()
        got = {"consumed": fresh["loader"].consumed, "draw": torch.rand(4).tolist(),
               "weight": fresh["model"].module.weight.detach().flatten().tolist(),
               "exp_avg": fresh["optim"].state_dict()["state"][0]["exp_avg"].flatten().tolist()}
        Path(out, f"rank{rank}.json").write_text(json.dumps({"expected": expected, "got": got, "step": state.step,
                                                            "steps": steps}))
    finally:
        dist.destroy_process_group()


def run_round_trip(moto_server, bucket: str, tmp_path: Path, staging: list[str], restore_staging: list[str],
                   engine: str) -> list[dict]:
    url = f"s3://{bucket}/runs/{engine}"
    mp.spawn(round_trip_worker, args=(free_port(), url, moto_server.options(), staging, restore_staging, engine,
                                      str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in results:
        assert r["step"] == 4 and r["steps"] == [4] and r["got"] == r["expected"]
    assert results[0]["got"]["consumed"] != results[1]["got"]["consumed"]  # per-rank state came back per rank
    return results


def test_two_ranks_sharing_a_staging_dir_round_trip_through_s3(moto_server, s3_bucket, tmp_path):
    shared = str(tmp_path / "shared")
    run_round_trip(moto_server, s3_bucket, tmp_path, [shared, shared], [str(tmp_path / "fresh")] * 2,
                   "torchsnapshot")
