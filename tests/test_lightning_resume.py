"""Lightning resumes that lost samples (issue 28, points 1 and 2), with real Lightning processes on the CPU
(``tests/lightning_counts.py``; 2 and 3 processes: ``strategy="ddp"`` on gloo) counting the samples each rank
trained per epoch: every sample of every epoch exactly once across the resume. The six multi-process runs share
one set of 3 processes (``ddp_runs``, ``tests/plan_runs.py``); the one-process runs run in this process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from plan_runs import launch
from trainer_counts import assert_exactly_once, dataset80, per_epoch, read_logs

from fastio import Raw

# Lightning itself is imported by the runs (lightning_counts.py), not at collection (~1.4 s, in both workers)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs fastio[lightning]")

SCRIPT = Path(__file__).resolve().parent / "lightning_counts.py"
SAMPLES = 80


def _end_of_epoch_runs(where: Path, data: Path, devices: int, stop: str, validate: bool) -> list[list[str]]:
    """Run 1 (stops at the end of epoch 0, saving there) and run 2 (resumes from that checkpoint), as
    ``lightning_counts.py`` arguments (without ``--devices``)."""
    steps = SAMPLES // (4 * devices)  # an epoch's
    limit = {"--max-epochs": ("1", "2"), "--max-steps": (str(steps), str(2 * steps))}[stop]
    extra = ["--validate"] if validate else []
    return [[str(data), str(where / "first"), stop, limit[0], "--save-every-epoch", str(where / "ckpt"), *extra],
            [str(data), str(where / "second"), stop, limit[1], "--resume", str(where / "ckpt" / f"step={steps}.ckpt"),
             *extra]]


def _mid_epoch_runs(where: Path, data: Path, before: int, step: int | None = None) -> list[list[str]]:
    """Run 1 (epoch 0, saving after step 6 on 2 processes, step 4 on 3, or after ``step``) and run 2 (resumes from
    there; to the end of epoch 1), as ``lightning_counts.py`` arguments (without ``--devices``)."""
    step = step or {2: 6, 3: 4}[before]
    return [[str(data), str(where / "first"), "--max-epochs", "1", "--save-every-steps", str(step),
             "--ckpt-dir", str(where / "ckpt")],
            [str(data), str(where / "second"), "--max-epochs", "2",
             "--resume", str(where / "ckpt" / f"step={step}.ckpt")]]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """Every multi-process run of this file, in one set of 3 processes (in the order the resumes need): the
    directory that holds each test's ``end-2``, ``mid-2-3`` and ``mid-3-2`` runs (their logs and checkpoints)."""
    base = tmp_path_factory.mktemp("lightning-ddp")
    data = dataset80(base)
    end2 = _end_of_epoch_runs(base / "end-2", data, 2, "--max-epochs", False)
    mid23, mid32 = _mid_epoch_runs(base / "mid-2-3", data, 2), _mid_epoch_runs(base / "mid-3-2", data, 3)
    last32 = _mid_epoch_runs(base / "last-3-2", data, 3, step=7)
    launch(SCRIPT, base, [(2, end2[0]), (2, end2[1]), (2, mid23[0]), (3, mid32[0]), (3, last32[0]), (3, mid23[1]),
                          (2, mid32[1]), (2, last32[1])])
    return base


@pytest.mark.parametrize("devices, stop, validate", [
    (1, "--max-epochs", False), (1, "--max-steps", False), (2, "--max-epochs", False),
    (1, "--max-epochs", True), (1, "--max-steps", True)])
def test_a_resume_from_an_end_of_epoch_checkpoint_trains_the_whole_next_epoch(tmp_path, devices, stop, validate,
                                                                             one_thread, request):
    """Run 1 stops at the end of epoch 0 and saves there (ModelCheckpoint(every_n_epochs=1); after validation
    where there is one); run 2 resumes from that checkpoint: its epoch 1 trains all 80 samples (it trained
    none; with max_steps, one batch labelled epoch 0 then the next epoch's order, or with validation the
    next epoch's order labelled epoch 2). On 2 processes the runs are ``ddp_runs``'s."""
    if devices == 1:
        import lightning_counts

        where = tmp_path
        for argv in _end_of_epoch_runs(where, dataset80(tmp_path), devices, stop, validate):
            lightning_counts.main([*argv, "--devices", "1"])
    else:
        where = request.getfixturevalue("ddp_runs") / f"end-{devices}"
    ckpt = where / "ckpt" / f"step={SAMPLES // (4 * devices)}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (where / "ckpt").iterdir())
    first, second = read_logs(where, "first"), read_logs(where, "second")
    assert len(first) == len(second) == devices
    assert sorted(per_epoch(first)) == [0] and sorted(per_epoch(second)) == [1]
    assert_exactly_once(per_epoch(first)[0], "epoch 0")
    assert_exactly_once(per_epoch(second)[1], "epoch 1, after the resume")


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_a_mid_epoch_checkpoint_resumed_at_another_world_size_trains_each_sample_once(ddp_runs, before, after):
    """2 processes x 4 a batch: 10 steps an epoch, saved after step 6 (48 samples); 3 processes resume with
    12 a step: the 32 left take 3 steps, though Lightning counts 6 done of 7 (it trained 1: 60 of 80).
    3 -> 2: 7 steps, saved after step 4 (48 samples); 2 processes: the 32 left take 4 steps of 10. The runs
    are ``ddp_runs``'s."""
    where, step = ddp_runs / f"mid-{before}-{after}", {2: 6, 3: 4}[before]
    first, second = read_logs(where, "first"), read_logs(where, "second")
    assert (len(first), len(second)) == (before, after)
    before_ckpt = [batches[:step] for batches in first]  # what run 1 trained up to its checkpoint
    counts = per_epoch(before_ckpt, second)
    assert sorted(counts) == [0, 1]
    assert_exactly_once(counts[0], f"epoch 0, {before} processes then {after}")
    assert_exactly_once(counts[1], f"epoch 1, on {after} processes")
    assert len({len(batches) for batches in second}) == 1, "every rank ran the same number of steps"


def test_a_checkpoint_at_an_epochs_last_step_resumed_at_a_smaller_global_batch_trains_the_next_epoch(ddp_runs):
    """3 processes x 4 a batch: 7 steps an epoch, saved after step 7, the epoch's last (the Loader's position: the
    start of epoch 1); 2 processes resume, where an epoch has 10 steps. Lightning counts 7 done of 10, and went on
    in epoch 0 for 3 more steps, for which its set_epoch(0) moved the Loader back to epoch 0's start: 24 samples
    of epoch 0 trained twice. Epoch 0 ends at the resume now, and epoch 1 is trained once."""
    where = ddp_runs / "last-3-2"
    first, second = read_logs(where, "first"), read_logs(where, "second")
    counts = per_epoch([batches[:7] for batches in first], second)
    assert sorted(counts) == [0, 1]
    assert_exactly_once(counts[0], "epoch 0, on 3 processes")
    assert_exactly_once(counts[1], "epoch 1, on 2 processes after the resume")


def test_batches_left_is_what_a_restored_loader_delivers(tmp_path):
    """The count the Lightning adapter reconciles with: 48 of 80 consumed by 2 ranks x 4, restored on 3 ranks
    x 4: 3 batches left of 7 (the last padded); at an epoch's start, len(loader)."""
    from fastio import Loader

    data = dataset80(tmp_path)
    options = dict(batch_size=4, pipeline=Raw(fields=()), device="cpu", num_threads=1, reader_threads=1)
    with Loader(data, rank=0, world_size=2, **options) as two:
        state = {**two.state_dict(), "consumed": 48}
    with Loader(data, rank=1, world_size=3, **options) as three:
        assert (len(three), three.batches_left()) == (7, 7)
        three.load_state_dict(state)
        assert three.batches_left() == 3
        assert len(list(three)) == 3 and three.batches_left() == 7  # the next epoch, from its start
