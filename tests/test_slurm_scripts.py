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
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "srun %s\\n" "$*"\nprintf "FASTIO=%s\\n" "$FASTIO"\n')
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
    assert f"FASTIO={ROOT}\n" in done.stdout and '"$FASTIO/examples/train.py" --data' in done.stdout, done.stdout


def test_train_sbatch_without_the_repository_says_to_set_fastio(tmp_path):
    done = run_as_sbatch_copy(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path))
    assert done.returncode == 2 and "srun" not in done.stdout, done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"train.sbatch: {tmp_path}/examples/train.py: no such file: set FASTIO to the fastio repository root "
        "(sbatch runs a copy of this script, so it is found from the folder sbatch was run in)"), done.stderr


def test_train_sbatch_passes_folders_with_spaces_whole(tmp_path):
    """Found by the integrations review: the task's command line was pasted into `bash -c '...'` unquoted, so a
    DATA or CKPT holding a space ("$HOME/my data/ds") reached train.py as two arguments (and PYTHON, FASTIO
    likewise). Each arrives whole now; TRAIN_ARGS is still split into its options."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\n'
                                  'export SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0\nexec "$@"\n')
    python = tmp_path / "a python" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\nprintf '<%s>\\n' \"$@\"\n")
    for stub in (*bin_dir.iterdir(), python):
        stub.chmod(0o755)
    job_env = {k: v for k, v in os.environ.items() if k != "FASTIO"}
    job_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42", SLURM_JOB_NODELIST="node1",
                   SLURM_JOB_NAME="t", DATA=str(tmp_path / "my data" / "ds"), CKPT=str(tmp_path / "ck pt"),
                   PYTHON=str(python), FASTIO=str(ROOT), TRAIN_ARGS="--epochs 2 --keep 3")
    done = subprocess.run(["bash", str(TRAIN)], cwd=tmp_path, capture_output=True, text=True, env=job_env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    args = [line[1:-1] for line in done.stdout.splitlines() if line.startswith("<")]
    assert args == [f"{ROOT}/examples/train.py", "--data", str(tmp_path / "my data" / "ds"), "--ckpt-dir",
                    str(tmp_path / "ck pt"), "--resume", "auto", "--requeue", "--epochs", "2", "--keep", "3"], \
        done.stdout
