"""Lightning resumes that lost samples (issue 28, points 1 and 2), with real Lightning processes on the CPU
(``tests/lightning_counts.py``; 2 and 3 processes: ``strategy="ddp"`` on gloo) counting the samples each rank
trained per epoch: every sample of every epoch exactly once across the resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")

from trainer_counts import assert_exactly_once, dataset80, per_epoch, read_logs  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "lightning_counts.py"
SAMPLES = 80


def _run(tmp_path: Path, data: Path, log: str, devices: int, *args: str) -> list[list]:
    """Run the script on ``devices`` processes (one: in this process); every rank's batches ``[epoch, indices]``,
    rank by rank."""
    argv = [str(data), str(tmp_path / log), "--devices", str(devices), *args]
    if devices == 1:
        import lightning_counts

        lightning_counts.main(argv)
        return read_logs(tmp_path, log)
    from s3server import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_logs(tmp_path, log)


@pytest.mark.parametrize("devices, stop, validate", [
    (1, "--max-epochs", False), (1, "--max-steps", False), (2, "--max-epochs", False),
    (1, "--max-epochs", True), (1, "--max-steps", True)])
def test_a_resume_from_an_end_of_epoch_checkpoint_trains_the_whole_next_epoch(tmp_path, devices, stop, validate,
                                                                             one_thread):
    """Run 1 stops at the end of epoch 0 and saves there (ModelCheckpoint(every_n_epochs=1); after validation
    where there is one); run 2 resumes from that checkpoint: its epoch 1 trains all 80 samples (it trained
    none; with max_steps, one batch labelled epoch 0 then the next epoch's order, or with validation the
    next epoch's order labelled epoch 2)."""
    data = dataset80(tmp_path)
    steps = SAMPLES // (4 * devices)  # an epoch's
    limit = {"--max-epochs": ("1", "2"), "--max-steps": (str(steps), str(2 * steps))}[stop]
    extra = ["--validate"] if validate else []
    first = _run(tmp_path, data, "first", devices, stop, limit[0], "--save-every-epoch", str(tmp_path / "ckpt"),
                 *extra)
    ckpt = tmp_path / "ckpt" / f"step={steps}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    second = _run(tmp_path, data, "second", devices, stop, limit[1], "--resume", str(ckpt), *extra)
    assert sorted(per_epoch(first)) == [0] and sorted(per_epoch(second)) == [1]
    assert_exactly_once(per_epoch(first)[0], "epoch 0")
    assert_exactly_once(per_epoch(second)[1], "epoch 1, after the resume")


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_a_mid_epoch_checkpoint_resumed_at_another_world_size_trains_each_sample_once(tmp_path,
                                                                                      before, after):
    """2 processes x 4 a batch: 10 steps an epoch, saved after step 6 (48 samples); 3 processes resume with
    12 a step: the 32 left take 3 steps, though Lightning counts 6 done of 7 (it trained 1: 60 of 80).
    3 -> 2: 7 steps, saved after step 4 (48 samples); 2 processes: the 32 left take 4 steps of 10."""
    data, step = dataset80(tmp_path), {2: 6, 3: 4}[before]
    first = _run(tmp_path, data, "first", before, "--max-epochs", "1", "--save-every-steps", str(step),
                 "--ckpt-dir", str(tmp_path / "ckpt"))
    before_ckpt = [batches[:step] for batches in first]  # what run 1 trained up to its checkpoint
    second = _run(tmp_path, data, "second", after, "--max-epochs", "2",
                  "--resume", str(tmp_path / "ckpt" / f"step={step}.ckpt"))
    counts = per_epoch(before_ckpt, second)
    assert sorted(counts) == [0, 1]
    assert_exactly_once(counts[0], f"epoch 0, {before} processes then {after}")
    assert_exactly_once(counts[1], f"epoch 1, on {after} processes")
    assert len({len(batches) for batches in second}) == 1, "every rank ran the same number of steps"


def test_batches_left_is_what_a_restored_loader_delivers(tmp_path):
    """The count the Lightning adapter reconciles with: 48 of 80 consumed by 2 ranks x 4, restored on 3 ranks
    x 4: 3 batches left of 7 (the last padded); at an epoch's start, len(loader)."""
    from fastio import Loader

    data = dataset80(tmp_path)
    options = dict(batch_size=4, pipeline="raw", fields=(), device="cpu", num_threads=1, reader_threads=1)
    with Loader(data, rank=0, world_size=2, **options) as two:
        state = {**two.state_dict(), "consumed": 48}
    with Loader(data, rank=1, world_size=3, **options) as three:
        assert (len(three), three.batches_left()) == (7, 7)
        three.load_state_dict(state)
        assert three.batches_left() == 3
        assert len(list(three)) == 3 and three.batches_left() == 7  # the next epoch, from its start
