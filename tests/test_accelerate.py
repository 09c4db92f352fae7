"""fastio inside Hugging Face Accelerate (``fastio[accelerate]``), on the CPU: ``register_for_checkpointing(loader)``,
``save_state`` mid-epoch, ``load_state`` in a new process, and the run ends with the weights of the run that was
never interrupted, bit for bit; on one process and on two (torchrun, gloo). Runs ``examples/accelerate_train.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from resume import same_batch

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "accelerate_train.py"



@pytest.mark.parametrize("processes", [1, 2])
def test_save_state_mid_epoch_then_load_state_in_a_new_process_is_bitwise(tmp_path, image_dataset, processes):
    from s3server import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_DISABLE_RICH": "1"}
    launch = [sys.executable, str(EXAMPLE)] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(EXAMPLE)]

    def run(*args: str) -> None:
        done = subprocess.run([*launch, "--data", str(image_dataset), "--epochs", "2", *args], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # 48 samples, 8 a batch per process: 6 (1 process) or 3 (2 processes) steps an epoch; saved mid epoch 1
    save_at = 8 if processes == 1 else 4
    run("--save-at", str(save_at), "--state-dir", "state", "--save-weights", "full.pt")
    run("--resume", "state", "--save-weights", "resumed.pt")
    full, resumed = (torch.load(tmp_path / name, weights_only=True) for name in ("full.pt", "resumed.pt"))
    assert same_batch(full, resumed)
    # the saved position is mid-epoch, so the check above is not trivially an epoch restart
    saved = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl", weights_only=False)
    assert (saved["epoch"], saved["consumed"]) == (1, 16)
