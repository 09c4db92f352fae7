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


def _made_before_init(rank: int, world: int, port: int, dest: str, out: str) -> None:
    import os

    import torch.distributed as dist

    from fastio import FastioError
    from fastio.loader import Loader

    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    loader = Loader(dest, batch_size=5, pipeline=ImageTrain(size=32), device="cpu", num_threads=1)  # rank 0 of 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        try:
            next(iter(loader))
            said = None
        except FastioError as err:
            said = str(err)
        explicit = Loader(dest, batch_size=5, pipeline=ImageTrain(size=32), device="cpu", num_threads=1, rank=0,
                          world_size=1)  # given: every rank reads the whole dataset, as asked
        whole = sum(int((~b["padded"]).sum()) for b in explicit)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"said": said, "whole": whole}))
        loader.close()
        explicit.close()
    finally:
        dist.destroy_process_group()


def test_a_loader_made_before_init_process_group_refuses_to_iterate_as_the_wrong_rank(image_dataset, tmp_path):
    """Found by the integrations review: a Loader made at the top of a script that Lightning's strategy="ddp" runs
    (the obvious thing) is made before torch.distributed starts: rank 0 of 1 in the first process, while Lightning's
    second process (WORLD_SIZE=2 in its environment) made rank 0 of 2. Both trained rank 0's samples, with
    different numbers of batches, and the run died in gloo ("Connection closed by peer"; NCCL would hang). A Loader
    whose rank and world size were found (not given) refuses to iterate once torch.distributed says otherwise."""
    start_ranks(_made_before_init, (2, _free_port(), str(image_dataset), str(tmp_path)), 2)
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    for rank, x in enumerate(r):
        assert x["said"] == (f"{image_dataset}: this Loader was made as rank 0 of 1, before torch.distributed was "
                             f"initialized, and this process is rank {rank} of 2: make it after init_process_group "
                             "(under Lightning: in train_dataloader(), as "
                             "fastio.integrations.lightning.FastioDataModule does), or give rank= and world_size="), x
        assert x["whole"] == 48
