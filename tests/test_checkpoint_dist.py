"""Two real ranks (gloo on 127.0.0.1, processes of helpers.start_ranks): DDP state written once, per-rank state per rank.
Each spawn runs both engines in turn (a fresh group each, helpers.join_group: its port picked when rank 0 binds it),
once for the file: the tests of each engine read its results (``preemption_runs``, ``elastic_runs``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import Position, StateHolder, join_group, start_ranks
from torch import nn
from torchsnapshot import Snapshot

from fastio import ImageTrain
from fastio.checkpoint import Checkpointer, catalog, scan
from fastio.errors import CheckpointError

WORLD = 2
ENGINES = ("torchsnapshot", "dcp")


def build():
    torch.manual_seed(0)  # same initial weights on both ranks, as DDP requires
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": optim, "loader": Position()}


def under_fake_slurm(out: str, rank: int) -> dict[str, str]:
    """This rank's environment for a Slurm job 31 whose ``scontrol`` only appends its arguments to
    ``out/scontrol-RANK.args``; the environment it replaces (to put back)."""
    bindir = Path(out, f"bin-{rank}")
    bindir.mkdir()
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {Path(out, f"scontrol-{rank}.args")}\n')
    (bindir / "scontrol").chmod(0o755)
    saved = dict(os.environ)
    os.environ.update(PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="31")
    return saved


def worker(rank: int, root: str, out: str, engine: str) -> None:
    join_group(rank, WORLD, Path(out, "group.port"))
    saved_env = under_fake_slurm(out, rank)
    try:
        app = build()
        torch.manual_seed(100 + rank)  # per-rank RNG streams
        ckpt = Checkpointer(root, every_steps=2, signals=(), engine=engine, requeue=True)
        for step in range(1, 6):
            x = torch.randn(8, 16)
            loss = app["model"](x).square().mean()
            app["optim"].zero_grad()
            loss.backward()
            app["optim"].step()
            app["loader"].consumed += 8 * (rank + 1)  # different on each rank
            if step == 5 and rank == 1:
                ckpt.request_preemption()  # only rank 1 got the warning: both must save and stop, rank 0 requeue
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
        os.environ.clear()
        os.environ.update(saved_env)
        dist.destroy_process_group()


def engines_worker(rank: int, base: str) -> None:
    """``worker`` for each engine in turn, into ``base/ENGINE``."""
    for engine in ENGINES:
        worker(rank, str(Path(base, engine, "ck")), str(Path(base, engine)), engine)


@pytest.fixture(scope="module")
def preemption_runs(tmp_path_factory) -> Path:
    """One spawn of 2 ranks running ``worker`` for both engines: the directory holding each engine's."""
    base = tmp_path_factory.mktemp("preemption")
    for engine in ENGINES:
        (base / engine).mkdir()
    start_ranks(engines_worker, (str(base),), WORLD)
    return base


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_per_rank_state_and_agreed_preemption(preemption_runs, engine):
    tmp_path = preemption_runs / engine
    root = tmp_path / "ck"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert res["preempted"] is True, r
        assert res["got"] == res["expected"], r
        assert res["got"]["step"] == 5
    assert results[0]["got"]["consumed"] == 40 and results[1]["got"]["consumed"] == 80
    assert (tmp_path / "scontrol-0.args").read_text().split() == ["requeue", "31"]  # rank 1's warning, agreed
    assert not (tmp_path / "scontrol-1.args").exists()  # only rank 0 requeues
    assert results[0]["got"]["draw"] != results[1]["got"]["draw"]
    assert [e.step for e in scan.committed(root)] == [2, 4, 5]
    assert catalog.verify(root) == []
    files = scan.read_commit(root / "step-5").files
    if engine == "dcp":  # the DDP model and its optimizer are global DCP state; loader and RNG one file per rank
        side = json.loads((root / "step-5" / "fastio-dcp.json").read_text())
        assert side["global_keys"] == ["model", "optim"] and side["world_size"] == WORLD
        assert {f"rank-{r}/{k}.pt" for r in range(WORLD) for k in ("loader", "_fastio_rng")} <= set(files)
        assert ".metadata" in files and not any("model" in f or "optim" in f for f in files), sorted(files)
        return
    # the DDP model and its optimizer are replicated (written once, not per rank); loader and RNG are per rank
    tensors = {path: entry for path, entry in Snapshot(str(root / "step-5")).get_manifest().items()
               if getattr(entry, "location", None)}
    for key in ("model", "optim"):
        assert not any(f.startswith((f"0/{key}", f"1/{key}")) for f in files), sorted(files)
        mine = [entry for path, entry in tensors.items() if path.split("/")[1] == key]
        assert mine and all(entry.location.startswith("replicated/") for entry in mine), mine
    manifest = (root / "step-5" / ".snapshot_metadata").read_text()
    for r in range(WORLD):
        rng = [entry for path, entry in tensors.items() if path.startswith(f"{r}/_fastio_rng/")]
        assert rng and all(entry.location.startswith(f"{r}/") for entry in rng), rng
        assert f"{r}/loader/consumed" in manifest  # small ints live in torchsnapshot's manifest, per rank


# ---------------------------------------------------------------- elastic resume: 2 ranks save, 3 and 1 restore
SAVED_WORLD, BATCH, SAVE_AFTER = 2, 4, 2  # 48 samples, global batch 8: the save lands after 16 samples


def elastic_app(data: str):
    from fastio import Loader

    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = Loader(data, batch_size=BATCH, pipeline=ImageTrain(size=32), device="cpu", seed=3, num_threads=1,
                    reader_threads=1, prefetch=1)
    return {"model": model, "optim": optim, "loader": loader}


def delivered(batch) -> list[int]:
    return batch["index"][~batch["padded"]].tolist()


def elastic_worker(rank: int, data: str, root: str, out: str, engine: str) -> None:
    def group(world: int) -> None:
        join_group(rank, world, Path(out, f"w{world}.port"))

    def restore_rest(world: int) -> None:  # restore at `world` ranks, then take the rest of the epoch
        group(world)
        try:
            torch.manual_seed(1000)  # weights unlike the saved ones: the restore has to bring those
            app = elastic_app(data)
            state = Checkpointer(root, signals=()).restore_latest(app)
            epoch = app["loader"].epoch
            seen = [i for batch in app["loader"] for i in delivered(batch)]
            app["loader"].close()
            Path(out, f"w{world}-rank{rank}.json").write_text(json.dumps({
                "step": state.step, "epoch": epoch, "seen": seen,
                "weight": app["model"].module.weight.detach().flatten().tolist()}))
        finally:
            dist.destroy_process_group()

    if rank < SAVED_WORLD:
        group(SAVED_WORLD)
        try:
            torch.manual_seed(0)  # same initial weights on both ranks, as DDP requires
            app = elastic_app(data)
            ckpt = Checkpointer(root, signals=(), engine=engine)
            batches = iter(app["loader"])
            before = []
            for _ in range(SAVE_AFTER):
                batch = next(batches)
                before += delivered(batch)
                loss = app["model"](batch["image"].flatten(1)[:, :16]).square().mean()
                app["optim"].zero_grad()
                loss.backward()
                app["optim"].step()
            ckpt.save(SAVE_AFTER, app, blocking=True)
            ckpt.close()
            weight = app["model"].module.weight.detach().flatten().tolist()
            after = [i for batch in batches for i in delivered(batch)]  # what this run would still deliver
            app["loader"].close()
            Path(out, f"w2-rank{rank}.json").write_text(json.dumps({"before": before, "after": after,
                                                                    "weight": weight}))
        finally:
            dist.destroy_process_group()
    restore_rest(3)  # waits at the rendezvous until the 2-rank run has saved
    if rank == 0:
        restore_rest(1)


def elastic_engines_worker(rank: int, data: str, base: str) -> None:
    """``elastic_worker`` for each engine in turn, into ``base/ENGINE``."""
    for engine in ENGINES:
        elastic_worker(rank, data, str(Path(base, engine, "ck")), str(Path(base, engine)), engine)


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory, _image_originals) -> Path:
    """One spawn of 3 ranks running ``elastic_worker`` for both engines, on a copy of the session's image
    dataset (48 samples): the directory holding each engine's."""
    base = tmp_path_factory.mktemp("elastic")
    data = shutil.copytree(_image_originals[1], base / "ds")
    for engine in ENGINES:
        (base / engine).mkdir()
    start_ranks(elastic_engines_worker, (str(data), str(base)), 3)
    return base


@pytest.mark.parametrize("engine", ENGINES)
def test_elastic_restore_at_three_and_one_ranks_sees_every_remaining_sample_once(elastic_runs, engine):
    from collections import Counter

    tmp_path = elastic_runs / engine
    root = tmp_path / "ck"
    saved = [json.loads((tmp_path / f"w2-rank{r}.json").read_text()) for r in range(SAVED_WORLD)]
    commit = scan.read_commit(root / f"step-{SAVE_AFTER}")
    assert commit.progress.world_size == SAVED_WORLD and commit.engine == engine
    before = Counter(i for s in saved for i in s["before"])
    remaining = Counter(i for s in saved for i in s["after"])
    assert sum(before.values()) == SAVED_WORLD * BATCH * SAVE_AFTER
    assert before + remaining == Counter(range(48))  # sanity: the 2-rank epoch is every sample once
    assert saved[0]["weight"] == saved[1]["weight"]
    for world in (3, 1):
        results = [json.loads((tmp_path / f"w{world}-rank{r}.json").read_text()) for r in range(world)]
        for r, res in enumerate(results):
            assert res["step"] == SAVE_AFTER and res["epoch"] == 0, (world, r)
            assert res["weight"] == saved[0]["weight"], (world, r)
        got = Counter(i for res in results for i in res["seen"])
        assert got == remaining, (world, sorted((got - remaining).elements()), sorted((remaining - got).elements()))


def test_engine_reads_back_nested_per_rank_state_exactly(tmp_path):
    from collections import OrderedDict

    from fastio.checkpoint.engines import get_engine

    state = {"version": 1, "t": torch.arange(6.0).reshape(2, 3), "blob": b"\x00\x01", "none": None,
             "list": [1, {"a": torch.ones(2, dtype=torch.int64)}, "x"], "pair": (3, 4.5),
             "od": OrderedDict([("z", 1), ("a", [2.0])]), 7: "int key"}
    ckpt = Checkpointer(tmp_path / "ck", signals=())
    ckpt.save(1, {"per%rank": StateHolder(state)}, blocking=True)
    ckpt.close()
    saved = get_engine("torchsnapshot").open(tmp_path / "ck" / "step-1")
    assert saved.world_size == 1 and {"per%rank", "_fastio_rng"} <= saved.keys(0)
    assert "_fastio_progress" not in saved.keys(0)  # the progress is the commit marker's, written once
    assert saved.is_replicated("per%rank", 0) is False
    assert same(saved.read("per%rank", 0), state)
    with pytest.raises(CheckpointError, match="absent"):
        saved.read("absent", 0)


def same(a, b) -> bool:
    """Equal values of equal types, all the way down (tensors compared exactly)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
