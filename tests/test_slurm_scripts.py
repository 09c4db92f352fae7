"""examples/slurm/train.sbatch finds the repository as sbatch runs it: sbatch copies the script into slurmd's spool
folder (``/var/spool/slurmd/jobN/slurm_script``), so ``$0`` does not locate the repository there. Run here (no Slurm
needed) as that copy, with ``srun`` and ``scontrol`` stand-ins that print what they were given; the real cluster
run is tests/test_slurm_cluster.py (``make test-slurm``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "slurm" / "train.sbatch"


def run_as_sbatch_copy(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The script run from a copy in a spool-like folder, as slurmd runs it, with stub srun/scontrol on PATH."""
    spool = tmp_path / "spool" / "job00042"
    spool.mkdir(parents=True)
    shutil.copy(TRAIN, spool / "slurm_script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "srun %s\\n" "$*"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    job_env = {k: v for k, v in os.environ.items() if k != "FASTIO"}
    job_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42", SLURM_JOB_NODELIST="node1",
                   SLURM_JOB_NAME="fastio-train", **env)
    return subprocess.run(["bash", str(spool / "slurm_script")], cwd=tmp_path, capture_output=True, text=True,
                          env=job_env, timeout=60, check=False)


def test_train_sbatch_finds_the_repository_from_the_submit_folder(tmp_path):
    """Found by the newcomer review (round 4): `sbatch examples/slurm/train.sbatch` from the repository root, as
    docs/cluster.md shows it, ran /var/spool/slurmd/examples/train.py (FASTIO defaulted to $0's ../..)."""
    done = run_as_sbatch_copy(tmp_path, SLURM_SUBMIT_DIR=str(ROOT))
    assert done.returncode == 0, done.stderr
    assert f"{ROOT}/examples/train.py --data" in done.stdout, done.stdout


def test_train_sbatch_without_the_repository_says_to_set_fastio(tmp_path):
    done = run_as_sbatch_copy(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode == 2 and "srun" not in done.stdout, done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"train.sbatch: {tmp_path}/examples/train.py: no such file: set FASTIO to the fastio repository root "
        "(sbatch runs a copy of this script, so it is found from the folder sbatch was run in)"), done.stderr
