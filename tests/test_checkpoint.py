"""Checkpointer: staged async saves, restore, RNG, retention, policies, disk errors, kills, signals, CLI."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import StateHolder
from torch import nn

from fastio import ImageTrain
from fastio.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    catalog,
    checkpointer,
    naming,
    publish,
    record,
    requeue_slurm_job,
    rollback,
    scan,
    slurm_job_id,
)
from fastio.cli import main as fastio_main
from fastio.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
ENGINE_NAMES = ("torchsnapshot", "dcp")


@pytest.fixture(params=ENGINE_NAMES)
def engine(request, monkeypatch) -> str:
    """Runs a test once per engine: the Checkpointer's engine="auto" picks this one (as engine= would)."""
    chosen = request.param
    monkeypatch.setattr(checkpointer, "choose_engine", lambda name, app: chosen if name == "auto" else name)
    monkeypatch.setenv("FASTIO_TEST_ENGINE", chosen)  # for the worker processes below
    return chosen


def step_dirs(root: Path) -> list[str]:
    """The names under a checkpoint directory, less its lock file."""
    return sorted(p.name for p in root.iterdir() if p.name != ".fastio-lock")




class Counter:
    """A stand-in for the Loader: small versioned state that moves every step."""

    def __init__(self, rank: int = 0):
        self.consumed, self.epoch, self.rank = 0, 0, rank

    def state_dict(self):
        return {"version": 1, "consumed": self.consumed, "epoch": self.epoch, "rank": self.rank}

    def load_state_dict(self, state):
        assert state["version"] == 1
        self.consumed, self.epoch, self.rank = state["consumed"], state["epoch"], state["rank"]


def make_app(width: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "loader": Counter()}


def train_step(app, width: int = 64):
    model, optim = app["model"], app["optim"]
    loss = model(torch.randn(8, width)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    app["loader"].consumed += 8
    return loss.item()


def snapshot_tensors(app) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in app["model"].state_dict().items()}
    for i, s in app["optim"].state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim/{i}/{k}"] = v.clone()
    return out


def run_py(code: str, tmp_path: Path, *args: str, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), *args], check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def run_warm(warm, code: str, tmp_path: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    """``run_py``'s run, started by the warm interpreter (conftest's ``warm``: torch already imported), for a
    worker whose output is small (it goes to files, not pipes)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(code))
    rc, out, err = warm.run(script, REPO, *args, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.CompletedProcess(script, rc, out, err)


# ---------------------------------------------------------------- save / restore
def test_mutation_right_after_async_save_does_not_reach_the_checkpoint(tmp_path, engine):
    width = 1024  # ~1M params + 2M Adam moments: the background write outlasts the mutation below
    app = make_app(width)
    ckpt = Checkpointer(tmp_path / "ck", every_steps=1)
    train_step(app, width)
    expected = snapshot_tensors(app)
    assert ckpt.maybe_save(1, app, metrics={"loss": 1.5}) is True
    with torch.no_grad():  # every parameter and every optimizer moment, in place
        for p in app["model"].parameters():
            p.add_(1000.0)
        for s in app["optim"].state.values():
            s["exp_avg"].mul_(-3.0)
            s["exp_avg_sq"].add_(7.0)
    ckpt.close()
    fresh = make_app(width, seed=1)
    state = Checkpointer(tmp_path / "ck").restore_latest(fresh)
    assert state.step == 1 and state.metrics == {"loss": 1.5}
    got = snapshot_tensors(fresh)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_restore_brings_back_loader_rng_progress_and_hparams(tmp_path, engine):
    app = make_app()
    ckpt = Checkpointer(tmp_path / "ck", every_steps=2, hparams={"lr": 0.01, "seed": 7})
    for step in range(1, 5):
        train_step(app)
        app["loader"].epoch = step // 3
        ckpt.maybe_save(step, app, metrics={"loss": float(step)})
    ckpt.wait()
    after = (random.random(), np.random.rand(), torch.rand(3))
    expected = snapshot_tensors(app)
    ckpt.close()
    assert sorted(ckpt.steps()) == [2, 4]

    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    fresh = make_app(seed=5)
    state = Checkpointer(tmp_path / "ck").restore_latest(fresh)
    assert (state.step, state.epoch, state.metrics, state.hparams) == (4, 1, {"loss": 4.0}, {"lr": 0.01, "seed": 7})
    assert state.path == tmp_path / "ck" / "step-4"
    assert fresh["loader"].state_dict() == {"version": 1, "consumed": 32, "epoch": 1, "rank": 0}
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[:2] == after[:2] and torch.equal(again[2], after[2])
    for key, value in snapshot_tensors(fresh).items():
        assert torch.equal(value, expected[key]), key


def test_restore_specific_step_and_missing_step(tmp_path, engine):
    app = make_app()
    with Checkpointer(tmp_path / "ck", every_steps=1) as ckpt:
        for step in (1, 2, 3):
            app["loader"].consumed = step * 100
            ckpt.maybe_save(step, app)
    fresh = make_app()
    state = Checkpointer(tmp_path / "ck").restore_latest(fresh, step=2)
    assert state.step == 2 and fresh["loader"].consumed == 200
    with pytest.raises(CheckpointError, match=r"no committed checkpoint for step 9 \(committed: 1, 2, 3\)"):
        Checkpointer(tmp_path / "ck").restore_latest(fresh, step=9)
    assert Checkpointer(tmp_path / "empty").restore_latest(fresh) is None


def test_restore_deletes_only_its_own_abandoned_temporaries(tmp_path, caplog):
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, every_steps=1) as ckpt:
        ckpt.maybe_save(1, app)
    publish.start_tmp(root, 4)  # what a killed writer leaves: step-4.tmp with fastio's mark
    (root / "step-4.tmp" / "0").mkdir()
    # not fastio's: a step-5.tmp without the mark, and a newer step-7 without a commit marker
    (root / "step-5.tmp" / "0").mkdir(parents=True)
    (root / "step-5.tmp" / "0" / "junk").write_bytes(b"x" * 10)
    (root / "step-7").mkdir()
    (root / "step-7" / ".snapshot_metadata").write_text("partial")
    with caplog.at_level("WARNING", logger="fastio"):
        state = Checkpointer(root).restore_latest(make_app())
    assert state.step == 1
    assert step_dirs(root) == ["step-1", "step-5.tmp", "step-7.quarantined"]
    assert (root / "step-5.tmp" / "0" / "junk").read_bytes() == b"x" * 10
    assert (root / "step-7.quarantined" / ".snapshot_metadata").read_text() == "partial"
    warned = [r.getMessage() for r in caplog.records]
    assert f"fastio: leaving {root}/step-5.tmp alone: uncommitted, and without fastio's mark" in warned[0]
    assert warned[1] == (f"fastio: skipping checkpoint {root}/step-7: no commit marker fastio-commit.json "
                         "(uncommitted checkpoint); moved aside to step-7.quarantined")


def test_app_without_a_saved_key_is_named(tmp_path, engine):
    app = make_app()
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, {"model": app["model"]}, blocking=True)
    with pytest.raises(CheckpointError, match=r"step-1: checkpoint has no state for app keys loader, optim on rank 0 "
                       r"\(it holds: model; written by 1 rank, this run has 1\)"):
        Checkpointer(tmp_path / "ck").restore_latest(app)


def test_unsupported_state_value_is_named(tmp_path):
    class Bad:
        def state_dict(self):
            return {"ok": 1, "gen": np.random.default_rng(0)}

        def load_state_dict(self, s):
            pass

    ckpt = Checkpointer(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"state key 'bad/gen': cannot checkpoint a numpy"):
        ckpt.save(1, {"bad": Bad()})
    ckpt.close()


@pytest.mark.parametrize("bad", [{"every_steps": -1}, {"keep": 1.5}, {"policy": "queue"},
                                 {"signals": ("SIGNOPE",)}, {"every_seconds": -2}, {"engine": "nope"},
                                 {"every_seconds": float("nan")}, {"signals": ("SIGKILL",)}, {"signals": (19,)},
                                 {"direct_writes": 1}, {"direct_writes": "no"}])
def test_config_validation(bad, tmp_path):
    """Each bad field is a ValueError naming it; a NaN period passed ``< 0`` and silently never saved, and SIGKILL or
    SIGSTOP (which no handler can catch) was a raw 'OSError: [Errno 22] Invalid argument' once the lock was taken."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        CheckpointConfig(dir=tmp_path, **bad)


def test_app_key_with_a_percent_sign_round_trips(tmp_path):
    """torchsnapshot escapes '%' in manifest paths; the restore must look the key up escaped."""
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"a%b": StateHolder({"t": torch.arange(3.0), "n": 5})}, blocking=True)
    fresh = StateHolder({"t": torch.zeros(3), "n": 0})
    assert Checkpointer(tmp_path / "ck", signals=()).restore_latest({"a%b": fresh}).step == 1
    assert torch.equal(fresh.state["t"], torch.arange(3.0)) and fresh.state["n"] == 5


def test_loader_is_found_by_its_state_not_by_its_app_key(image_dataset, tmp_path, engine):
    from fastio import Loader

    def make():
        return Loader(image_dataset, batch_size=4, pipeline=ImageTrain(size=32), device="cpu", seed=3, num_threads=1,
                      reader_threads=1, prefetch=1)

    data = make()
    data.set_epoch(2)
    batches = iter(data)
    next(batches), next(batches)
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.save(7, {"model": nn.Linear(4, 4), "train_data": data}, blocking=True)  # no epoch= given
        ckpt.save(8, {"model": nn.Linear(4, 4)}, blocking=True)  # no loader: epoch unknown
    data.close()
    assert scan.read_commit(root / "step-7").progress.epoch == 2
    assert scan.read_commit(root / "step-8").progress.epoch == -1
    fresh = make()
    state = Checkpointer(root, signals=()).restore_latest({"model": nn.Linear(4, 4), "train_data": fresh}, step=7)
    assert state.epoch == 2 and (fresh.epoch, fresh.consumed) == (2, 8)
    fresh.close()
    assert Checkpointer(root, signals=()).restore_latest({"model": nn.Linear(4, 4)}).epoch is None


def test_world_size_from_the_environment_needs_a_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match=r"WORLD_SIZE=2 \(rank 1\) but torch.distributed is not initialised"):
        Checkpointer(tmp_path / "ck")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert (ckpt.rank, ckpt.world_size) == (0, 1)


def test_engine_leaves_the_environment_as_it_found_it(tmp_path):
    """torchsnapshot's batching switch is an environment variable: a save, also a failing one, restores it."""
    from fastio.checkpoint.engines import get_engine

    engine = get_engine("torchsnapshot")
    before = dict(os.environ)
    (tmp_path / "ok").mkdir()
    engine.save(tmp_path / "ok", {"m": {"t": torch.ones(3)}})
    assert dict(os.environ) == before
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(Exception):  # noqa: B017 - whatever the storage layer raises; the environment is the point
        engine.save(tmp_path / "file" / "sub", {"m": {"t": torch.ones(3)}})
    assert dict(os.environ) == before


def test_restore_uses_the_engine_named_in_the_commit_marker(tmp_path):
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
    marker = root / "step-1" / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    assert data["engine"] == "torchsnapshot"
    marker.write_text(json.dumps({**data, "engine": "from-the-future"}))
    with pytest.raises(CheckpointError, match=rf"{root}: no intact checkpoint: 1 step director\(ies\) damaged or "
                       rf"unrecognised, newest {root}/step-1: {marker}: written by checkpoint engine 'from-the-future', "
                       r"this fastio has dcp, torchsnapshot"):
        Checkpointer(root, signals=()).restore_latest(make_app())
    del data["engine"]  # a marker written before engines were recorded: torchsnapshot
    marker.write_text(json.dumps(data))
    assert Checkpointer(root, signals=()).restore_latest(make_app()).step == 1


# ---------------------------------------------------------------- retention and in-flight policy
def test_retention_keeps_newest_k_after_commit(tmp_path, engine):
    """After wait() the expired steps are gone as steps (renamed away, their files deleted in the background: see
    tests/test_checkpoint_retention.py); after close() nothing of them is left."""
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, every_steps=1, keep=2) as ckpt:
        for step in range(1, 6):
            train_step(app)
            ckpt.maybe_save(step, app)
            ckpt.wait()
            kept = [f"step-{s}" for s in range(max(1, step - 1), step + 1)]
            assert [n for n in step_dirs(root) if not n.startswith(".")] == kept
            assert ckpt.steps() == [int(n.split("-")[1]) for n in kept]
    assert step_dirs(root) == ["step-4", "step-5"]
    assert catalog.verify(root) == []


@pytest.mark.parametrize("keep", [1, 2])
def test_a_rollback_supersedes_the_abandoned_branch_keeping_its_files(tmp_path, keep, capsys):
    """restore_latest(step=20) while step 30 is committed, then saves from there: retention counted step 30
    as the newest and deleted each save of the new branch (keep=1: the step just committed), and a relaunch
    resumed on the abandoned branch. Now step 30 is superseded (its files kept), the new branch is the latest."""
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:  # keep=0: both stay
        ckpt.save(20, app, blocking=True)
        train_step(app)
        ckpt.save(30, app, blocking=True)
    branch = make_app(seed=1)
    with Checkpointer(root, keep=keep, signals=()) as ckpt:
        assert ckpt.restore_latest(branch, step=20).step == 20
        train_step(branch)
        ckpt.save(21, branch, blocking=True)
        assert ckpt.steps() == ([20, 21] if keep == 2 else [21])
        train_step(branch)
        ckpt.save(22, branch, blocking=True)
        assert ckpt.steps() == [21, 22][-keep:]
    relaunched = make_app(seed=2)
    assert Checkpointer(root, signals=()).restore_latest(relaunched).step == 22
    assert all(torch.equal(a, b) for a, b in zip(relaunched["model"].state_dict().values(),
                                                 branch["model"].state_dict().values()))
    kept = root / "step-30"
    assert (kept / rollback.SUPERSEDED_FILE).is_file() and not (kept / naming.COMMIT_FILE).exists()
    marker = record.parse_commit((kept / rollback.SUPERSEDED_FILE).read_bytes(), str(kept / rollback.SUPERSEDED_FILE))
    assert catalog.verify_step(scan.StepEntry(30, kept, marker)) == [  # every file of it kept, intact
        f"{kept / rollback.SUPERSEDED_FILE}: not listed in the commit marker"]
    assert fastio_main(["ckpt", "ls", str(root)]) in (0, None)
    assert "superseded" in capsys.readouterr().out


def test_what_a_kill_leaves_in_the_middle_of_a_commit_or_a_deletion_is_removed(tmp_path):
    """A kill between writing the commit marker into ``step-N.tmp`` and its rename left a marked temporary with
    a marker, and one in the middle of a retention deletion a ``step-N`` without its marker: both were left
    forever (the first moved aside, full size, by the next save of that step). The next Checkpointer's restore
    removes what is provably its own: the marked temporary, and a hidden ``.step-N.deleting-PID``."""
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.save(5, app, blocking=True)
    import shutil

    shutil.copytree(root / "step-5", root / "step-6.tmp")  # its marker written, the rename not done
    (root / "step-6.tmp" / naming.WRITING_FILE).write_text("{}")
    shutil.copytree(root / "step-5", root / ".step-4.deleting-123")  # renamed for deletion, then killed
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(make_app()).step == 5  # a restore cleans the directory first
    assert step_dirs(root) == ["step-5"]


def test_policy_skip_and_wait_never_interleave(tmp_path, engine):
    width = 2048  # ~50 MB of state: the first write is still running when the next step asks
    for policy, expect in (("skip", [1, 3]), ("wait", [1, 2, 3])):
        app = make_app(width)
        root = tmp_path / policy
        ckpt = Checkpointer(root, every_steps=1, policy=policy)
        assert ckpt.maybe_save(1, app)
        started = ckpt.maybe_save(2, app)
        assert started is (policy == "wait")
        ckpt.wait()
        assert ckpt.maybe_save(3, app)
        ckpt.close()
        assert ckpt.steps() == expect
        assert catalog.verify(root) == []


def test_every_seconds_schedule(tmp_path):
    app = make_app()
    with Checkpointer(tmp_path / "ck", every_seconds=0.3, signals=()) as ckpt:
        assert not ckpt.maybe_save(1, app)
        time.sleep(0.35)
        assert ckpt.maybe_save(2, app)
        assert not ckpt.maybe_save(3, app)  # the clock restarted at the save
    assert ckpt.steps() == [2]


# ---------------------------------------------------------------- failures
FSIZE_WORKER = """
    import os, resource, signal, sys, torch
    from fastio.checkpoint import Checkpointer, catalog, naming, publish, record, rollback, scan
    from fastio.errors import CheckpointError
    model = torch.nn.Linear(256, 256)
    ckpt = Checkpointer(sys.argv[1], every_steps=1, engine=os.environ.get("FASTIO_TEST_ENGINE", "auto"))
    ckpt.maybe_save(1, {"model": model}); ckpt.wait()
    # from now on no file of this process may grow past 4 KiB: writes fail with EFBIG, as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    with torch.no_grad():
        model.weight.add_(1)
    try:
        ckpt.maybe_save(2, {"model": model})
        ckpt.maybe_save(3, {"model": model})
        ckpt.close()
    except CheckpointError as err:
        print("ERROR", err)
    else:
        print("NO ERROR")
"""


def test_write_error_in_background_surfaces_at_next_call_and_keeps_previous(tmp_path, engine):
    root = tmp_path / "ck"
    proc = run_py(FSIZE_WORKER, tmp_path, str(root))
    out = proc.stdout.strip()
    assert proc.returncode == 0, proc.stderr
    assert out.startswith("ERROR ") and "\n" not in out, out
    assert f"{root}/step-2: checkpoint write failed" in out and "File too large" in out
    if engine == "torchsnapshot":  # and the file it could not write: the model's slab
        assert f"File too large: '{root}/step-2.tmp/0/_fastio_slabs/" in out, out
    else:  # the file it could not write (a rank's file, DCP's data), named: was 'OSError: [Errno 27] File too large'
        assert re.search(rf"checkpoint write failed: {re.escape(str(root))}/step-2\.tmp/\S+: File too large "
                         r"\(the previous", out), out
    assert "previous checkpoint is intact" in out
    assert step_dirs(root) == ["step-1"]
    assert catalog.verify(root) == []
    model = torch.nn.Linear(256, 256)
    assert Checkpointer(root).restore_latest({"model": model}).step == 1


def test_unusable_directory_is_named(tmp_path, engine):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"{blocker}/ck: cannot create checkpoint directory"):
        Checkpointer(blocker / "ck")
    with pytest.raises(CheckpointError, match=rf"^{blocker}: is a file, not a checkpoint directory$"):
        Checkpointer(blocker)  # was 'cannot create checkpoint directory: File exists'
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, every_steps=1)
    app = make_app()
    ckpt.maybe_save(1, app)
    ckpt.wait()
    root.rename(tmp_path / "moved")
    root.write_text("a file where the checkpoint directory was")  # (root ignores modes: a file it is)
    try:
        with pytest.raises(CheckpointError, match=rf"{root}/step-2.tmp: cannot create checkpoint directory"):
            ckpt.maybe_save(2, app)
    finally:
        root.unlink()
        (tmp_path / "moved").rename(root)
    ckpt.close()
    assert Checkpointer(root).restore_latest(make_app()).step == 1
    for read_only in (False, True):  # a step given for its directory: no lock, no steps written into a checkpoint
        with pytest.raises(CheckpointError, match=rf"^{root}/step-1: is one checkpoint \(step 1\), not a checkpoint "
                                                  rf"directory: give the directory holding it, {root}$"):
            Checkpointer(root / "step-1", read_only=read_only)
    assert sorted(p.name for p in (root / "step-1").iterdir() if p.name.startswith(".fastio")) == []


KILL_WORKER = """
    import os, signal, sys, torch
    from fastio.checkpoint import Checkpointer
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB: the kill below lands while step 2 is being written
    ckpt = Checkpointer(sys.argv[1], every_steps=1, engine=os.environ.get("FASTIO_TEST_ENGINE", "auto"))
    ckpt.maybe_save(1, {"model": model}); ckpt.wait()
    torch.save(model.state_dict(), sys.argv[2])
    with torch.no_grad():
        model.weight.mul_(2)
    ckpt.maybe_save(2, {"model": model})
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_during_write_leaves_previous_checkpoint_loadable(tmp_path, engine, warm):
    root = tmp_path / "ck"
    proc = run_warm(warm, KILL_WORKER, tmp_path, str(root), str(tmp_path / "ref.pt"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = step_dirs(root)
    assert "step-1" in names and "step-2" not in names and "step-2.tmp" in names, names
    assert catalog.verify(root) == []
    model = torch.nn.Linear(2048, 2048)
    assert Checkpointer(root).restore_latest({"model": model}).step == 1
    ref = torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    assert step_dirs(root) == ["step-1"]


# ---------------------------------------------------------------- preemption
SIGNAL_WORKER = """
    import sys, time, torch
    from fastio.checkpoint import Checkpointer
    model = torch.nn.Linear(8, 8)
    ckpt = Checkpointer(sys.argv[1], every_steps=1000, requeue=True)
    for step in range(1, 100000):
        with torch.no_grad():
            model.weight.add_(1)
        print(f"step {step}", flush=True)
        ckpt.maybe_save(step, {"model": model})
        if ckpt.preempted:
            print(f"preempted {step} {model.weight[0, 0].item()}", flush=True)
            break
        time.sleep(0.02)
    ckpt.close()
"""


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A folder holding an ``scontrol`` that only appends its arguments to a file (Slurm is not the thing under
    test here: tests/test_checkpoint_resume.py runs a real one), and that file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "scontrol.args"
    fake = bindir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    fake.chmod(0o755)
    return bindir, record


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)],
                         ids=["SIGUSR1", "SIGTERM"])
def test_signal_makes_a_blocking_save_and_only_the_warning_requeues(tmp_path, warm, sig, requeued):
    """SIGUSR1 or SIGTERM to a script (started by the warm interpreter) under a Slurm job with ``requeue=True``: a
    blocking save at the next step, the step restorable; SIGUSR1 (Slurm's warning, ``--signal=B:USR1@120``) runs
    ``scontrol requeue JOBID``, SIGTERM (``scancel``) does not: found by the Slurm review, SIGTERM requeued too, so
    a job the user cancelled came back."""
    bindir, record = fake_scontrol(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(SIGNAL_WORKER))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bindir}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "4242"}
    env.pop("SLURM_ARRAY_JOB_ID", None)
    rc, out, err = warm.run(script, tmp_path, str(tmp_path / "ck"), timeout=120, env=env, signal_at=("step 5", sig))
    assert rc == 0, out + err
    last = [line for line in out.splitlines() if line.startswith("preempted")]
    assert len(last) == 1, out
    _, step, value = last[0].split()
    assert int(step) == 5  # the signal came as step 5 was printed: that step's save is the blocking one
    if requeued:
        assert record.read_text().split() == ["requeue", "4242"]
    else:
        assert not record.exists(), record.read_text()
    model = torch.nn.Linear(8, 8)
    state = Checkpointer(tmp_path / "ck").restore_latest({"model": model})
    assert state.step == int(step) and model.weight[0, 0].item() == float(value)


def test_warning_then_sigterm_still_requeues_and_sigterm_alone_does_not(tmp_path, monkeypatch):
    """The warning (SIGUSR1) and then SIGTERM before the next step (a time limit close behind the warning) still
    requeue: the warning asked for it. SIGTERM alone saves without; ``request_preemption()`` acts as the warning."""
    bindir, record = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    runs = {"usr1-term": (signal.SIGUSR1, signal.SIGTERM), "term": (signal.SIGTERM,), "request": ()}
    for name, sent in runs.items():
        with Checkpointer(tmp_path / name, every_steps=100, requeue=True) as ckpt:
            for sig in sent:
                os.kill(os.getpid(), sig)  # would end pytest without the Checkpointer's handlers
            time.sleep(0.01)
            if not sent:
                ckpt.request_preemption()
            assert ckpt.maybe_save(1, make_app()) and ckpt.preempted, name
        lines = record.read_text().splitlines() if record.exists() else []
        record.unlink(missing_ok=True)
        assert lines == ([] if name == "term" else ["requeue 99"]), name


def test_requeue_with_only_stop_signals_warns_once(tmp_path, caplog):
    """requeue=True with signals that all ask the job to end (SIGTERM) could never requeue: one warning says so,
    naming them and the warning signal to add; a warning signal among them, or signals=(), is not warned about."""
    with caplog.at_level("WARNING", logger="fastio"):
        Checkpointer(tmp_path / "a", requeue=True, signals=("SIGTERM", "SIGINT")).close()
        Checkpointer(tmp_path / "b", requeue=True, signals=("SIGUSR2", "SIGTERM")).close()
        Checkpointer(tmp_path / "c", requeue=True, signals=()).close()
        Checkpointer(tmp_path / "d", signals=("SIGTERM",)).close()
    assert [r.getMessage() for r in caplog.records] == [
        "fastio: Checkpointer(requeue=True, signals=SIGTERM, SIGINT): none of these signals requeues the Slurm job "
        "(they ask it to end: scancel sends SIGTERM); add Slurm's warning, SIGUSR1, and #SBATCH --signal=B:USR1@120"]


def test_a_refused_requeue_is_one_warning_quoting_scontrol(tmp_path, monkeypatch, caplog):
    """A job submitted with --no-requeue (or JobRequeue=0): scontrol refuses (Slurm 22.05's words, checked on the
    test cluster); the warning quotes its last line as scontrol wrote it (it read ``exited 1: ['Requested ...']``,
    a Python list) and says the job is not requeued; the run goes on."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/sh\necho 'Requested operation is presently disabled "
                                     "for job 42' >&2\nexit 1\n")
    (bindir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    with caplog.at_level("WARNING", logger="fastio"):
        assert requeue_slurm_job({"SLURM_JOB_ID": "42"}) is False
    assert [r.getMessage() for r in caplog.records] == [
        "fastio: scontrol requeue 42 exited 1: Requested operation is presently disabled for job 42; "
        "the job is not requeued (resubmit it to resume)"]


def test_slurm_job_id_for_plain_and_array_jobs():
    assert slurm_job_id({}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    assert slurm_job_id({"SLURM_JOB_ID": "18", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3"}) == "10_3"


def test_request_preemption_sets_preempted_after_save(tmp_path, engine):
    app = make_app()
    ckpt = Checkpointer(tmp_path / "ck", every_steps=100, signals=())
    assert not ckpt.maybe_save(1, app)
    ckpt.request_preemption()
    assert ckpt.maybe_save(2, app) and ckpt.preempted
    assert ckpt.steps() == [2]  # blocking: committed before maybe_save returned
    ckpt.close()


# ---------------------------------------------------------------- CLI
def test_cli_ls_and_verify(tmp_path, engine, capsys):
    root = tmp_path / "ck"
    app = make_app()
    with Checkpointer(root, every_steps=1) as ckpt:
        for step in (1, 2):
            ckpt.maybe_save(step, app, metrics={"loss": step / 4})
    (root / "step-3.tmp").mkdir()
    assert fastio_main(["ckpt", "ls", "--json", str(root)]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(r["step"], r["committed"], r["metrics"], r["engine"]) for r in rows] == [
        (1, True, {"loss": 0.25}, engine), (2, True, {"loss": 0.5}, engine), (3, False, {}, None)]
    assert all(r["bytes"] > 0 for r in rows[:2])
    assert fastio_main(["ckpt", "ls", str(root)]) == 0
    table = capsys.readouterr().out
    assert "loss=0.5" in table and "incomplete" in table
    assert fastio_main(["ckpt", "verify", str(root)]) == 0
    assert "2 committed checkpoints verified" in capsys.readouterr().out

    victim = next(p for p in sorted((root / "step-2").rglob("*")) if p.is_file() and p.stat().st_size > 100
                  and p.name != naming.COMMIT_FILE)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert fastio_main(["ckpt", "verify", str(root)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"{victim}: xxh3_128 " + lines[0].split(": xxh3_128 ")[1]] and "commit marker says" in lines[0]
    assert fastio_main(["ckpt", "ls", str(tmp_path / "nope")]) == 2
    assert "nope: checkpoint directory does not exist" in capsys.readouterr().err


def test_cli_ls_json_is_strict_json_with_non_finite_metrics(tmp_path, capsys):
    root = tmp_path / "ck"
    with Checkpointer(root, every_steps=1) as ckpt:
        ckpt.maybe_save(1, make_app(), metrics={"loss": float("nan"), "grad": float("inf"), "lr": 0.5})
    assert fastio_main(["ckpt", "ls", "--json", str(root)]) == 0
    out = capsys.readouterr().out
    refuse = json.JSONDecoder(parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))
    assert refuse.decode(out)["checkpoints"][0]["metrics"] == {"loss": None, "grad": None, "lr": 0.5}


@pytest.mark.gpu
def test_cuda_state_is_staged_and_restored(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(512, 512).cuda()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512, device="cuda")).sum().backward()
    optim.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    cuda_rng = torch.cuda.get_rng_state()
    ckpt = Checkpointer(tmp_path / "ck", every_steps=1)
    ckpt.maybe_save(1, {"model": model, "optim": optim})
    with torch.no_grad():
        model.weight.add_(1)
    torch.cuda.manual_seed(5)
    ckpt.close()
    fresh = nn.Linear(512, 512).cuda()
    with Checkpointer(tmp_path / "ck") as restorer:  # closed: its SIGTERM handler must not outlive the test
        restorer.restore_latest({"model": fresh, "optim": torch.optim.Adam(fresh.parameters())})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)


def test_hparams_must_be_plain_values(tmp_path):
    with pytest.raises(ValueError, match="hparams must hold plain JSON values.*PosixPath"):
        Checkpointer(tmp_path / "ck", hparams={"data": tmp_path})


def test_signal_only_sets_a_flag_and_close_restores_handlers(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = Checkpointer(tmp_path / "ck", every_steps=100)
    os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the Checkpointer's handler
    time.sleep(0.01)
    assert ckpt.preemption_requested and not ckpt.preempted and ckpt.steps() == []
    assert ckpt.maybe_save(3, make_app()) and ckpt.preempted and ckpt.steps() == [3]
    assert not ckpt.preemption_requested
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_preempted_exit_code_is_configurable_and_validated(tmp_path):
    app = {"model": nn.Linear(2, 2)}
    with Checkpointer(tmp_path / "a", signals=()) as ckpt:
        assert ckpt.exit_code == 0
        ckpt.request_preemption()
        assert ckpt.maybe_save(1, app) and ckpt.preempted
        assert ckpt.exit_code == 0  # the default: a preempted run exits as it did before the option existed
    with Checkpointer(tmp_path / "b", signals=(), preempted_exit_code=75) as ckpt:
        ckpt.maybe_save(1, app)
        assert ckpt.exit_code == 0  # not preempted
        ckpt.request_preemption()
        ckpt.maybe_save(2, app)
        assert ckpt.exit_code == 75
    for bad in (-1, 256, True, "75"):
        with pytest.raises(ValueError, match="preempted_exit_code"):
            Checkpointer(tmp_path / "c", preempted_exit_code=bad)


def test_checkpointer_refuses_a_dataset_directory(tmp_path, image_dataset):
    from fastio.dataset.manifest import load_manifest, write_splits

    parent = tmp_path / "parent"  # a split dataset's parent: splits.json, no manifest of its own
    parent.mkdir()
    write_splits(parent, {"train": load_manifest(image_dataset)})
    for ds, name in ((image_dataset, "manifest.json"), (parent, "splits.json")):
        before = sorted(p.name for p in ds.iterdir())
        with pytest.raises(CheckpointError, match=rf"{ds}: is a fastio dataset \({name}\), not a checkpoint"):
            Checkpointer(ds, signals=())
        assert sorted(p.name for p in ds.iterdir()) == before  # no lock file dropped there


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", None, float("nan")])
def test_a_step_that_is_not_an_int_of_zero_or_more_is_refused_before_anything_is_written(tmp_path, bad):
    """Before: save(-1), save(1.5), save(True) committed 'step--1', 'step-1.5', 'step-True', which no restore lists:
    the relaunch started from scratch beside them; save('4') committed a marker no restore could read."""
    app = make_app()
    with Checkpointer(tmp_path / "ck", signals=(), every_steps=1) as ckpt:
        for call in (ckpt.save, ckpt.maybe_save):
            with pytest.raises(ValueError, match=r"^step must be an int >= 0, got "):
                call(bad, app)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".fastio-lock"]


def test_a_numpy_integer_step_is_saved_as_its_int(tmp_path):
    """Before: 'checkpoint write failed: TypeError: Object of type int64 is not JSON serializable'."""
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(np.int64(3), make_app(), blocking=True)
        assert ckpt.steps() == [3]
        assert ckpt.restore_latest(make_app()).step == 3


@pytest.mark.parametrize("state, path", [({"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "h/a/b"),
                                         ({1: torch.ones(2), "1": torch.zeros(2)}, "h/1")])
def test_two_entries_of_one_key_path_are_refused_not_merged(tmp_path, engine, state, path):
    """Before: both entries were staged into one buffer (and flattened to one path by either engine): the save was
    committed and the restore gave both the second's value, the first's lost without a word."""
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.save(1, {"h": StateHolder(state)}, blocking=True)
        assert ckpt.steps() == []
    text = str(err.value)
    assert text.startswith(f"state key {path!r}: two entries of the state have this key path") and "\n" not in text
    assert not list((tmp_path / "ck").glob("step-*"))


def test_bad_metrics_epoch_or_restore_step_are_named_before_anything_is_written(tmp_path):
    """Before: metrics={'loss': 'x'} was 'CheckpointError: ValueError: could not convert string to float: 'x'' (no
    key), epoch=1.7 was recorded as epoch 1 without a word, restore_latest(step='3') said 'no committed checkpoint for
    step 3 (committed: 3)' and step=3.0 called a step-3.0 that does not exist a damaged checkpoint."""
    app = make_app()
    with Checkpointer(tmp_path / "ck", signals=(), every_steps=1) as ckpt:
        for call in (ckpt.save, ckpt.maybe_save):
            with pytest.raises(ValueError, match=r"^metrics\['loss'\] must be a number, got 'x'$"):
                call(1, app, metrics={"loss": "x"})
            with pytest.raises(ValueError, match=r"^metrics must be a dict of numbers, got \[1\]$"):
                call(1, app, metrics=[1])
            with pytest.raises(ValueError, match=r"^epoch must be an int >= 0, got 1.7$"):
                call(1, app, epoch=1.7)
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".fastio-lock"]
        ckpt.save(3, app, metrics={"loss": torch.tensor(0.5)}, epoch=np.int64(2), blocking=True)
        for bad in ("3", 3.0, True, -1):
            with pytest.raises(ValueError, match=r"^step must be an int >= 0, got "):
                ckpt.restore_latest(app, step=bad)
        state = ckpt.restore_latest(app, step=np.int64(3))
    assert (state.step, state.epoch, state.metrics) == (3, 2, {"loss": 0.5})


def test_a_closed_checkpointer_refuses_to_save_or_restore(tmp_path):
    """Before: save() after close() wrote and committed step-2 without the directory's lock (released by close: another
    job may hold it by then), and restore_latest() cleaned and moved steps aside without it."""
    app = make_app()
    ckpt = Checkpointer(tmp_path / "ck", signals=(), every_steps=1)
    ckpt.save(1, app, blocking=True)
    ckpt.close()
    ckpt.close()  # again: nothing to do
    for call in (lambda: ckpt.save(2, app), lambda: ckpt.maybe_save(2, app), lambda: ckpt.restore_latest(app)):
        with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'ck'}: this Checkpointer is closed"):
            call()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".fastio-lock", "step-1"]


def test_a_state_dict_that_raises_is_named_by_its_app_key(tmp_path):
    """Before: 'CheckpointError: ValueError: boom', no app key; now the key and the call, nothing written."""
    class Broken:
        def state_dict(self):
            raise ValueError("boom")

        def load_state_dict(self, state):
            pass

    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError, match=r"^app key broken: state_dict\(\) failed: ValueError: boom$"):
            ckpt.save(1, {"model": torch.nn.Linear(2, 2), "broken": Broken()}, blocking=True)
        assert ckpt.steps() == []
    assert not list((tmp_path / "ck").glob("step-*"))


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_directory_name_is_refused_not_the_current_directory(empty, tmp_path, monkeypatch):
    """CheckpointConfig(dir='') (an unset variable) became Path('.'): its check for an empty dir compared str(Path(''))
    == '.' with '' and never fired, so a Checkpointer wrote its lock and steps into the current directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^CheckpointConfig.dir must not be empty"):
        Checkpointer(empty, signals=())
    assert list(tmp_path.iterdir()) == []
