"""Two real processes under torch.distributed (gloo on 127.0.0.1): rank defaults, equal lengths, disjoint data."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from helpers import start_ranks

from fastio import ImageTrain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, dest: str, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from fastio.loader import Loader

    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)  # the defaults must come from torch.distributed itself
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        loader = Loader(dest, batch_size=5, pipeline=ImageTrain(size=32), device="cpu", num_threads=1)
        indices, padded, steps = [], [], 0
        for batch in loader:
            indices += batch["index"].tolist()
            padded += batch["padded"].tolist()
            steps += 1
            dist.all_reduce(torch.ones(1))  # a DDP step: would hang if one rank ran out of batches
        state = loader.state_dict()
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "rank": loader.rank, "world": loader.world_size, "len": len(loader), "steps": steps,
            "indices": indices, "padded": padded, "state": state}))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks(image_dataset, tmp_path):
    start_ranks(_worker, (2, _free_port(), str(image_dataset), str(tmp_path)), 2)
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [x["rank"] for x in r] == [0, 1] and {x["world"] for x in r} == {2}
    assert r[0]["len"] == r[1]["len"] == r[0]["steps"] == r[1]["steps"] == 5  # ceil(48 / 10)
    real = [[i for i, p in zip(x["indices"], x["padded"]) if not p] for x in r]
    assert not set(real[0]) & set(real[1])
    assert sorted(real[0] + real[1]) == list(range(48))
    assert r[0]["state"] == r[1]["state"] and r[0]["state"]["epoch"] == 1
