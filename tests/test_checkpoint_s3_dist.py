"""Two real ranks (gloo on 127.0.0.1) with a Checkpointer on s3:// (moto): one staging directory both see, or
one each (simulated nodes: each node uploads its own files, rank 0 commits on the store, restores pull the step
into every node's directory); a rank that cannot use its staging directory is refused by name; a save during a
store outage with a staging dir per node fails and the next one commits. The six runs are
one spawn of 2 ranks for the file, one after the other (a fresh gloo group and bucket each: ``runs``); each test
checks its run's results."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import Position, join_group, start_ranks
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.remote import STAGING_RECORD
from fastio.errors import CheckpointError
from fastio.storage import open_storage
from fastio.storage.lock import LOCK_NAME

WORLD = 2


def runs_worker(rank: int, plan: list[tuple]) -> None:
    """Each ``(worker, meeting, *args)`` of the plan in turn: ``worker(rank, meeting, *args)``, each run's gloo group
    met through its own file (:func:`helpers.join_group`: a port picked when the test started could be taken by the
    time a later run starts)."""
    for worker, meeting, *args in plan:
        worker(rank, meeting, *args)


@pytest.fixture(scope="module")
def runs(moto_server, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The run of each test below, all in one spawn of 2 ranks: its directory and its bucket, by name."""
    base, options = tmp_path_factory.mktemp("s3-dist"), moto_server.options()
    cases, plan = {}, []
    for name in ("refused", "shared", "nodes-torchsnapshot", "nodes-dcp", "fallback", "outage"):
        cases[name] = (base / name, f"{name}-{uuid.uuid4().hex[:8]}")
        cases[name][0].mkdir()
        moto_server.create_bucket(cases[name][1])
    where, bucket = cases["refused"]
    (where / "a-file").write_text("not a directory")
    plan.append((refused_worker, f"s3://{bucket}/runs/apart", options, refused_staging(where), str(where)))
    where, bucket = cases["shared"]
    plan.append((round_trip_worker, f"s3://{bucket}/runs/torchsnapshot", options, [str(where / "shared")] * 2,
                 [str(where / "fresh")] * 2, "torchsnapshot", None, str(where)))
    for engine, compression in (("torchsnapshot", None), ("dcp", "zstd")):
        where, bucket = cases[f"nodes-{engine}"]
        plan.append((round_trip_worker, f"s3://{bucket}/runs/{engine}", options,
                     [str(where / "node0"), str(where / "node1")], [str(where / "new0"), str(where / "new1")],
                     engine, compression, str(where)))
    where, bucket = cases["fallback"]
    plan.append((fallback_worker, f"s3://{bucket}/runs/fallback", options, str(where), str(where)))
    where, bucket = cases["outage"]
    plan.append((outage_worker, f"s3://{bucket}/runs/outage", moto_server.port, str(where)))
    start_ranks(runs_worker, ([(worker, str(base / f"meet-{n}"), *args) for n, (worker, *args) in enumerate(plan)],),
                WORLD)
    return cases


def refused_staging(where: Path) -> list[str]:
    """Rank 0's staging directory, and rank 1's under a file."""
    return [str(where / "node0"), str(where / "a-file" / "node1")]


def refused_worker(rank: int, meeting: str, url: str, options: dict, staging: list[str], out: str) -> None:
    join_group(rank, WORLD, meeting)
    try:
        try:
            Checkpointer(url, storage_options=options, staging_dir=staging[rank], signals=()).close()
            result = "constructed"
        except CheckpointError as err:
            result = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_use_its_staging_dir_is_refused_by_name(moto_server, runs):
    tmp_path, bucket = runs["refused"]
    url = f"s3://{bucket}/runs/apart"
    options = moto_server.options()
    staging = refused_staging(tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]  # every rank fails, with the same one line
    assert results[0] == (f"{staging[1]}: rank 1 ({socket.gethostname()}) cannot use this staging directory (its "
                          "probe file could not be written or listed); give staging_dir= a writable directory")
    # rank 0 let go of the prefix's lease and of its staging lock; no probe files are left behind
    assert open_storage(url, options).head(LOCK_NAME) is None
    assert sorted(p.name for p in Path(staging[0]).iterdir()) == [LOCK_NAME, STAGING_RECORD]
    Checkpointer(url, storage_options=options, staging_dir=staging[0], signals=()).close()


def build():
    torch.manual_seed(0)  # same initial weights on both ranks, as DDP requires
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01), "loader": Position()}


def round_trip_worker(rank: int, meeting: str, url: str, options: dict, staging: list[str], restore_staging: list[str],
                      engine: str, compression: str | None, out: str) -> None:
    join_group(rank, WORLD, meeting)
    try:
        app = build()
        torch.manual_seed(100 + rank)
        with Checkpointer(url, every_steps=2, keep=1, storage_options=options, staging_dir=staging[rank],
                          engine=engine, compression=compression, signals=()) as ckpt:
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


def check_round_trip(tmp_path: Path) -> list[dict]:
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in results:
        assert r["step"] == 4 and r["steps"] == [4] and r["got"] == r["expected"]
    assert results[0]["got"]["consumed"] != results[1]["got"]["consumed"]  # per-rank state came back per rank
    return results


def test_two_ranks_sharing_a_staging_dir_round_trip_through_s3(runs):
    """Both ranks stage in ``shared``, restore through ``fresh``."""
    check_round_trip(runs["shared"][0])


@pytest.mark.parametrize(("engine", "compression"), [("torchsnapshot", None), ("dcp", "zstd")])
def test_two_nodes_with_their_own_staging_dirs_round_trip_through_s3(moto_server, runs, engine, compression):
    """Rank r stages in ``node<r>``, restores through ``new<r>``."""
    tmp_path, bucket = runs[f"nodes-{engine}"]
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    check_round_trip(tmp_path)
    store = open_storage(f"s3://{bucket}/runs/{engine}", moto_server.options())
    keys = [o.key for o in store.list()]
    assert {k.split("/")[0] for k in keys} == {"step-4"} and "step-4/fastio-commit.json" in keys
    assert all(k.endswith(".zst") for k in keys if not k.endswith("fastio-commit.json")) == bool(compression)
    # each node wrote part of the step and uploaded it; no node kept a temporary or a partial step
    for node in nodes:
        assert sorted(p.name for p in Path(node).iterdir()) == [LOCK_NAME, STAGING_RECORD]
    # the restore pulled the whole step into each node's staging dir
    for new in ("new0", "new1"):
        got = sorted(p.relative_to(tmp_path / new / "step-4").as_posix() for p in (tmp_path / new / "step-4").rglob("*")
                     if p.is_file())
        assert got == sorted(k[len("step-4/"):] for k in keys)


def fallback_worker(rank: int, meeting: str, url: str, options: dict, root: str, out: str) -> None:
    join_group(rank, WORLD, meeting)
    try:
        app = build()
        saved = {}
        with Checkpointer(url, every_steps=2, storage_options=options, staging_dir=f"{root}/node{rank}",
                          signals=()) as ckpt:
            for step in range(1, 5):
                loss = app["model"](torch.randn(8, 16)).square().mean()
                app["optim"].zero_grad()
                loss.backward()
                app["optim"].step()
                app["loader"].consumed += rank + 1
                ckpt.maybe_save(step, app)
                saved[step] = app["loader"].consumed
        if rank == 0:  # damage one stored file of the newest step (rank 1's, written on the other node)
            store = open_storage(url, options)
            victim = next(o.key for o in store.list("step-4/") if o.key.startswith("step-4/1/"))
            data = bytearray(store.get(victim))
            data[len(data) // 2] ^= 0xFF
            store.put_bytes(victim, bytes(data))
        dist.barrier()
        fresh = build()
        ckpt = Checkpointer(url, every_steps=1, storage_options=options, staging_dir=f"{root}/new{rank}", signals=())
        state = ckpt.restore_latest(fresh)
        # another job takes the prefix over: the next save fails on every rank, and uploads nothing
        if rank == 0:
            open_storage(url, options).put_bytes(LOCK_NAME, b'{"purpose": "intruder", "host": "node-x", "pid": 5}')
        dist.barrier()
        ckpt.maybe_save(5, fresh)
        try:
            ckpt.maybe_save(6, fresh)
            lost = None
        except CheckpointError as err:
            lost = str(err)
        ckpt.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"step": state.step, "consumed": fresh["loader"].consumed,
                                                            "saved": saved[2], "lost": lost}))
    finally:
        dist.destroy_process_group()


def test_two_nodes_fall_back_together_past_a_step_damaged_on_the_store(moto_server, runs):
    tmp_path, bucket = runs["fallback"]
    url = f"s3://{bucket}/runs/fallback"
    for r in range(WORLD):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["step"] == 2 and got["consumed"] == got["saved"] == 2 * (r + 1)
        # each node's download of step 4 was removed (the store keeps step 4: no copy of it on each node's disk at
        # each restart); step 2 was pulled and restored; each node's staging dir is locked by its own lowest rank
        names = sorted(p.name for p in (tmp_path / f"new{r}").iterdir())
        assert names == [LOCK_NAME, STAGING_RECORD, "step-2"]
        assert "step-5: checkpoint write failed: " in got["lost"] and "lease lost: taken over by intruder" in got["lost"]
    assert {o.key.split("/")[0] for o in open_storage(url, moto_server.options()).list()} == {
        LOCK_NAME, "step-2", "step-4"}  # step 5 never uploaded; the intruder's lease left alone


def outage_worker(rank: int, meeting: str, url: str, moto_port: int, root: str) -> None:
    """Steps 1 to 3 with a staging dir each; the store out (503 past deadline_s, through a fault proxy in rank 0's
    process) for step 2's save."""
    from s3server import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy

    join_group(rank, WORLD, meeting)
    proxy = FaultProxy(moto_port) if rank == 0 else None
    try:
        port = torch.tensor([proxy.port if proxy else 0])
        dist.broadcast(port, 0)
        options = {"endpoint": f"http://127.0.0.1:{int(port)}", "region": REGION, "access_key_id": ACCESS_KEY,
                   "secret_access_key": SECRET_KEY, "deadline_s": 1, "backoff_s": 0.05}
        app, said = build(), {}
        with Checkpointer(url, storage_options=options, staging_dir=f"{root}/node{rank}", signals=()) as ckpt:
            for step in (1, 2, 3):
                dist.barrier()
                if proxy is not None:
                    proxy.down = {f"/{url.split('/')[2]}"} if step == 2 else set()
                dist.barrier()
                app["loader"].consumed = step
                try:
                    ckpt.save(step, app, blocking=True)
                except CheckpointError as err:
                    said[step] = str(err)
            said["steps"] = ckpt.steps()
        said["node"] = sorted(p.name for p in Path(root, f"node{rank}").iterdir())
        Path(root, f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        if proxy is not None:
            proxy.stop()
        dist.destroy_process_group()


def test_two_nodes_with_their_own_staging_dirs_fail_a_save_during_an_outage_and_go_on_after_it(moto_server, runs):
    """What the model cannot do (docs/storage.md): with a staging dir per node no node holds a whole step, so a save
    during an outage fails on every rank, naming the step by its URL and the store's error, and leaves nothing
    in either node's staging dir; the next save once the store answers commits."""
    tmp_path, bucket = runs["outage"]
    url = f"s3://{bucket}/runs/outage"
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert said[0] == said[1]
    assert said[0]["2"].startswith(f"{url}/step-2: checkpoint write failed: {url}/{LOCK_NAME}: "), said[0]
    assert "(HTTP 503" in said[0]["2"] and "nothing uploaded (confirm failed on rank 0)" in said[0]["2"], said[0]
    assert "1" not in said[0] and "3" not in said[0] and said[0]["steps"] == [1, 3]
    assert said[0]["node"] == [LOCK_NAME, STAGING_RECORD]
    keys = {o.key.split("/")[0] for o in open_storage(url, moto_server.options()).list()}
    assert keys == {"step-1", "step-3"}, keys
