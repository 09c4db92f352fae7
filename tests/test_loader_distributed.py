"""Two real processes under torch.distributed (gloo on 127.0.0.1): rank defaults, equal lengths, disjoint data."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import join_group, start_ranks

from fastio import ImageTrain, Raw


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


_ALIKE = "a fastio Loader's order is global"
AGREE = {  # name: (rank -> the Loader's options, the field named, rank 0's value, rank 1's value) or no field
    "same": (lambda rank, other: {}, None),
    "seed_per_rank": (lambda rank, other: {"seed": 100 + rank}, ("seed", 100, 101)),
    "given_ranks_seed_per_rank": (lambda rank, other: {"seed": rank, "rank": rank, "world_size": 2}, ("seed", 0, 1)),
    "batch_per_rank": (lambda rank, other: {"batch_size": 4 + rank}, ("batch_size", 4, 5)),
    "shuffle_per_rank": (lambda rank, other: {"shuffle": ("global", "none")[rank]}, ("shuffle", "global", "none")),
    "drop_last_per_rank": (lambda rank, other: {"drop_last": bool(rank)}, ("drop_last", False, True)),
    "dataset_per_rank": (lambda rank, other: {"dest": other} if rank else {}, ("fingerprint", None, None)),
    "rank_local": (lambda rank, other: {"seed": rank, "rank": 0, "world_size": 1}, None),  # each rank's own Loader
}


def _agree_worker(rank: int, dest: str, other: str, base: str) -> None:
    import torch.distributed as dist

    from fastio import FastioError
    from fastio.dist import default_store
    from fastio.loader import Loader

    for name, (options, _) in AGREE.items():
        out = Path(base, name)
        join_group(rank, 2, out / "group.port")
        try:
            chosen = {"dest": dest, "batch_size": 4, "pipeline": Raw(), "device": "cpu", "seed": 3,
                      "num_threads": 1, **options(rank, other)}
            if rank == 0:  # a Loader of this rank's own, iterated here only: no agreement, nothing to wait for
                with Loader(dest, batch_size=4, pipeline=Raw(), device="cpu", num_threads=1, rank=0,
                            world_size=1) as own:
                    next(iter(own))
            loader = Loader(chosen.pop("dest"), **chosen)
            said, again, indices = None, None, []
            try:
                indices = next(iter(loader))["index"].tolist()
            except FastioError as err:
                said = str(err)
                try:  # asked again: the same answer, without a second exchange the other rank would not join
                    next(iter(loader))
                except FastioError as err2:
                    again = str(err2)
            if rank == 0 and said is None:  # later iter() calls exchange nothing: rank 1 does not join this one
                next(iter(loader))
            loader.close()
            dist.barrier()  # both ranks' exchanges are over: the last rank out removed its keys from the store
            left = [k for k in default_store().list_keys() if k.startswith("fastio/")]
            Path(out, f"rank{rank}.json").write_text(json.dumps({"said": said, "again": again, "indices": indices,
                                                                 "left": left}))
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def agree_runs(tmp_path_factory, _image_originals, image_ds) -> Path:
    base = tmp_path_factory.mktemp("loader-ranks-agree")
    for name in AGREE:
        (base / name).mkdir()
    start_ranks(_agree_worker, (str(_image_originals[1]), str(image_ds), str(base)), 2)
    return base


@pytest.mark.parametrize("name", list(AGREE))
def test_ranks_whose_loaders_differ_refuse_at_the_first_iter(agree_runs, _image_originals, name):
    """Found by the resume review: ranks that made their Loader with another seed each (``seed=base + rank``, a
    DataLoader habit), batch size, shuffle, drop_last or dataset sliced different global orders: samples came twice
    and others never, silently, and only a Checkpointer's save noticed (its agreement on the loader state), if there
    was one. Now the first ``iter()`` of a Loader whose ranks are torch.distributed's exchanges what must agree (one
    exchange through the group's store, once in the Loader's life), and every rank refuses naming the field and both
    values; a Loader of one rank's own (world_size=1) exchanges nothing."""
    r = [json.loads((agree_runs / name / f"rank{k}.json").read_text()) for k in range(2)]
    field = AGREE[name][1]
    assert [x["left"] for x in r] == [[], []], r  # a group made again on the same store starts clean
    if field is None:
        assert [x["said"] for x in r] == [None, None], r
        if name == "same":
            assert r[0]["indices"] and r[1]["indices"] and not set(r[0]["indices"]) & set(r[1]["indices"])
        return
    key, a, b = field
    root = _image_originals[1]
    for x in r:
        said = x["said"] or ""
        assert said.startswith(f"{root}: {key} differs across ranks: rank 0 has "), r
        if a is not None:
            assert f"{key} differs across ranks: rank 0 has {a!r}, rank 1 has {b!r}; " in said, said
        assert _ALIKE in said and "\n" not in said, said
        assert x["again"] == said, x
    assert r[0]["said"] == r[1]["said"]


def _one_rank_iterates(rank: int, dest: str, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from fastio import FastioError
    from fastio.loader import Loader

    join_group(rank, 2, Path(out, "group.port"))
    try:
        loader = Loader(dest, batch_size=4, pipeline=Raw(), device="cpu", num_threads=1)
        said, noted = None, []
        if rank == 0:  # rank 1 never iterates its Loader: rank 0 notes that it waits, then refuses at the timeout
            import logging

            import fastio.dist
            fastio.dist.NOTICE_AFTER_S = 1.0
            fastio.dist.default_store().set_timeout(timedelta(seconds=3))
            handler = logging.Handler()
            handler.emit = lambda record: noted.append(record.getMessage())
            logging.getLogger("fastio").addHandler(handler)
            try:
                next(iter(loader))
            except FastioError as err:
                said = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"said": said, "noted": noted}))
        dist.barrier()
        loader.close()
    finally:
        dist.destroy_process_group()


def test_a_loader_iterated_on_one_rank_only_is_refused_after_the_stores_timeout(image_dataset, tmp_path):
    """A Loader whose ranks are torch.distributed's, iterated by rank 0 alone (an evaluation under ``if rank == 0``,
    which would read half of the data): the first iter() waits for the other ranks' word, and after the store's
    timeout refuses naming how many ranks came and the way out, rather than hanging; while it waits, it says so
    once (after ``fastio.dist.NOTICE_AFTER_S``), so a job that waits the store's 30 minutes shows why in its log."""
    start_ranks(_one_rank_iterates, (str(image_dataset), str(tmp_path)), 2)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["noted"] == [f"fastio: 1 of 2 ranks came after 1 s; {image_dataset}: this Loader's first iteration "
                              "waits for the other ranks to check that their Loaders are alike (a Loader one rank "
                              "iterates alone: give it rank=0, world_size=1)"], rank0
    said = rank0["said"]
    assert said is not None and said.startswith(f"{image_dataset}: this Loader's first iteration waited for the "
                                                "other ranks to check that their Loaders are alike, and 1 of 2 "
                                                "ranks came within the store's timeout ("), said
    assert said.endswith("give it rank=0, world_size=1)") and "\n" not in said, said
