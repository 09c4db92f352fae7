"""fastio inside Hugging Face Accelerate (``fastio[accelerate]``), on the CPU: ``register_for_checkpointing(loader)``,
``save_state`` mid-epoch, ``load_state`` in a new process, and the run ends with the weights of the run that was
never interrupted, bit for bit; on one process and on two (gloo); at another number of processes (2 -> 3,
3 -> 2) every sample of the epoch is trained once (the multi-process runs each in processes of their own, started
as torchrun would, forked from one python that imported Accelerate once: ``tests/accelerate_counts.py``); the
docs' block under torchrun itself. Runs ``examples/accelerate_train.py``."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from plan_runs import launch
from resume import same_batch
from trainer_counts import assert_exactly_once, dataset80, per_epoch, read_logs

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "accelerate_train.py"
COUNTS = Path(__file__).resolve().parent / "accelerate_counts.py"



def _example():
    spec = importlib.util.spec_from_file_location("accelerate_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(tmp_path: Path, saved_after: tuple[int, int]) -> None:
    full, resumed = (torch.load(tmp_path / name, weights_only=True) for name in ("full.pt", "resumed.pt"))
    assert same_batch(full, resumed)
    # the saved position is mid-epoch, so the check above is not trivially an epoch restart
    saved = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl", weights_only=False)
    assert (saved["epoch"], saved["consumed"]) == saved_after


def test_one_process_save_state_mid_epoch_then_load_state(tmp_path, image_dataset, monkeypatch, one_thread):
    """In this process (two Accelerators in turn, as in a notebook): 6 steps an epoch, saved after step 8."""
    monkeypatch.chdir(tmp_path)
    main = _example().main
    common = ["--data", str(image_dataset), "--epochs", "2"]
    main([*common, "--save-at", "8", "--state-dir", "state", "--save-weights", "full.pt"])
    main([*common, "--resume", "state", "--save-weights", "resumed.pt"])
    _check(tmp_path, (1, 16))


def test_two_processes_save_state_mid_epoch_then_load_state_in_new_processes(example_runs):
    """2 processes x 8 a batch (gloo), 3 steps an epoch, saved after step 4; the state loaded by 2 new processes
    (``example_runs``' first two runs, each in processes of its own, started as torchrun would)."""
    _check(example_runs / "bitwise", (1, 16))


SLOW_MAIN_SAVE = """
import os
if os.environ.get("RANK") == "0":  # the main process writes its files 3 s late: the other one must wait for them
    import time

    import accelerate.accelerator as acc

    def _late(*args, _save=acc.save_accelerator_state, **kwargs):
        time.sleep(3)
        return _save(*args, **kwargs)

    acc.save_accelerator_state = _late
"""


def test_the_docs_accelerate_snippet_runs_under_torchrun_on_two_processes(tmp_path):
    """docs/trainers.md's Accelerate block, as written, under ``torchrun --nproc-per-node 2``: ``save_state`` returns
    on the other process before the main one has written the files, and the block's ``load_state`` right after it
    read them half-written (``EOFError``, or a ``FileNotFoundError`` of ``pytorch_model.bin``) in one run of two
    where no collective followed the save (saved at the epoch's last step); the block waits for everyone in between
    now. The main process's write is made 3 s late (a ``sitecustomize``),
    so the race is lost every time without that wait."""
    import re
    import subprocess

    from s3server import free_port

    from fastio.cli import main as cli
    from fastio.convert.synthetic import make_imagefolder

    page = (REPO / "docs" / "trainers.md").read_text()
    block = re.search(r"^## Accelerate$.*?^```python\n(.*?)^```$", page, re.MULTILINE | re.DOTALL).group(1)
    (tmp_path / "snippet.py").write_text(block)
    # 81 to train: 3 steps of 2 x 16, so the save is at the epoch's last step and no gradient sync follows it
    make_imagefolder(tmp_path / "images", classes=3, per_class=30, seed=0)
    assert cli(["convert", str(tmp_path / "images"), str(tmp_path / "ds"), "--split", "train=0.9,val=0.1",
                "--quiet"]) == 0  # in this process: a python of its own imported torch for it (seconds of CPU)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_MAIN_SAVE)
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                          str(free_port()), "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # each process prints the position saved after the epoch's last step (the lines may interleave)
    assert run.stdout.replace("\n", "") == "00", run.stdout


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory, _image_originals) -> Path:
    """``examples/accelerate_train.py``'s multi-process runs, each in new processes forked from one python that
    imported Accelerate once (``tests/accelerate_counts.py``, ``launch(fresh=True)``; in the order the resumes
    need): in ``bitwise``, a 2-process run that saves mid-epoch (``full.pt``, ``state``) and its resume on 2
    (``resumed.pt``); the runs of both world-size changes, in the directory of each change (``2-3``, ``3-2``: logs
    and states)."""
    base = tmp_path_factory.mktemp("accelerate-runs")
    where = base / "bitwise"
    where.mkdir()
    common = ["--data", str(_image_originals[1]), "--epochs", "2"]
    bitwise = [(2, [*common, "--save-at", "4", "--state-dir", str(where / "state"), "--save-weights",
                    str(where / "full.pt")]),
               (2, [*common, "--resume", str(where / "state"), "--save-weights", str(where / "resumed.pt")])]
    data = dataset80(base)
    runs = {}
    for before in (2, 3):
        where, step = base / f"{before}-{5 - before}", {2: 6, 3: 4}[before]
        where.mkdir()
        common = ["--data", str(data), "--batch-size", "4", "--image-size", "16"]
        runs[before] = [[*common, "--epochs", "1", "--save-at", str(step), "--state-dir", str(where / "state"),
                         "--log-indices", str(where / "first")],
                        [*common, "--epochs", "2", "--resume", str(where / "state"), "--log-indices",
                         str(where / "second")]]
    launch(COUNTS, base, [*bitwise, (2, runs[2][0]), (3, runs[3][0]), (3, runs[2][1]), (2, runs[3][1])], fresh=True)
    return base


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_a_mid_epoch_state_loaded_by_another_number_of_processes_trains_each_sample_once(example_runs, before,
                                                                                        after):
    """80 samples, 4 a batch: 2 processes save after step 6 (48 samples), 3 processes load the state and train
    the 32 left in 3 steps of 12 (and 3 -> 2: saved after step 4, the 32 left in 4 steps of 8). The runs are
    ``example_runs``'."""
    where, step = example_runs / f"{before}-{after}", {2: 6, 3: 4}[before]
    first, second = read_logs(where, "first"), read_logs(where, "second")
    assert (len(first), len(second)) == (before, after)
    counts = per_epoch([batches[:step] for batches in first], second)
    assert sorted(counts) == [0, 1]
    assert_exactly_once(counts[0], f"epoch 0, {before} processes then {after}")
    assert_exactly_once(counts[1], f"epoch 1, on {after} processes")


def test_skip_first_batches_on_a_loader_names_why_it_is_not_needed(image_dataset):
    """Accelerate's skip_first_batches reaches for a DataLoader's sampler; the Loader's AttributeError says it
    resumes by itself (was Python's bare "'Loader' object has no attribute 'sampler'")."""
    from accelerate.data_loader import skip_first_batches

    import fastio

    with fastio.Loader(image_dataset, batch_size=4, device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(AttributeError, match="skip_first_batches is not needed"):
            skip_first_batches(loader, 2)
        assert not hasattr(loader, "batch_sampler") and hasattr(loader, "dataset")
        with pytest.raises(AttributeError, match="'Loader' object has no attribute 'nope'"):
            loader.nope  # noqa: B018


def test_the_example_refuses_a_missing_resume_state_and_a_save_without_a_directory(tmp_path, image_dataset, capsys):
    """``--resume`` of a directory that is not there ended in Accelerate's ValueError traceback, ``--save-at``
    without ``--state-dir`` in a TypeError from posixpath after the steps it trained: both are usage errors now,
    before anything runs, naming the option."""
    main = _example().main
    for args, said in ((["--resume", str(tmp_path / "none")], f"--resume {tmp_path / 'none'}: no such state "
                        "directory"), (["--save-at", "2"], "--save-at needs --state-dir")):
        with pytest.raises(SystemExit) as stop:
            main(["--data", str(image_dataset), *args])
        assert stop.value.code == 2 and said in capsys.readouterr().err
