"""End to end: examples/train.py on a tiny dataset, interrupted (SIGKILL, SIGUSR1) and resumed, ends bitwise equal."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import free_port

from fastio.checkpoint import catalog, scan

REPO = Path(__file__).resolve().parents[1]
STEPS = 16


def command(data: Path, ckpt: Path) -> list[str]:
    return [sys.executable, str(REPO / "examples" / "train.py"), "--data", str(data), "--ckpt-dir", str(ckpt),
            "--steps", str(STEPS), "--every-steps", "2", "--keep", "2", "--batch-size", "8",
            "--image-size", "32", "--loader-threads", "1", "--resume", "auto"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_until(warm, cmd: list[str], step: int, sig: int) -> tuple[int, str]:
    """``cmd`` (``[python, script, *args]``, started by ``warm``), sent ``sig`` as it prints ``step <step>``; its
    exit code and output (stdout, then stderr)."""
    script, *args = cmd[1:]
    rc, out, err = warm.run(Path(script), Path.cwd(), *args, env=env(), timeout=180, signal_at=(f"step {step} ", sig))
    return rc, out + err


def digest(out: str) -> str:
    found = [line.split(": ")[1] for line in out.splitlines() if line.startswith("final weights sha256: ")]
    assert len(found) == 1, out
    return found[0]


def test_killed_and_preempted_runs_resume_bitwise_equal(image_dataset, tmp_path, warm_one_thread):
    """train.py SIGKILLed, then SIGUSR1-preempted, then run to its end (started by the warm interpreter, one thread
    each, while a reference run, a fresh python, runs alongside): the final weights are the reference's, bit for
    bit."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    kill_at = rnd.randint(3, 8)
    usr1_at = rnd.randint(kill_at + 2, STEPS - 3)
    why = f"seed {seed}: SIGKILL at step {kill_at}, SIGUSR1 at step {usr1_at}"

    reference = subprocess.Popen(command(image_dataset, tmp_path / "ref"), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env())
    ckpt = tmp_path / "ck"
    cmd = command(image_dataset, ckpt)

    rc, out = run_until(warm_one_thread, cmd, kill_at, signal.SIGKILL)
    assert rc == -signal.SIGKILL, why + out
    # The child ends as it prints step kill_at: nothing after it can be committed, and the newest write may not
    # have committed yet.
    reached = max(int(line.split()[1]) for line in out.splitlines() if line.startswith("step "))
    before = [e.step for e in scan.committed(ckpt)]
    assert reached == kill_at and (not before or max(before) <= reached), why + out

    rc, out = run_until(warm_one_thread, cmd, usr1_at, signal.SIGUSR1)
    assert rc == 0, why + out
    assert (f"resumed from step {max(before)}" if before else "fresh start") in out, why + out
    preempted = [line for line in out.splitlines() if line.startswith("preempted: saved step")]
    assert len(preempted) == 1 and "final weights" not in out, why + out
    saved = int(preempted[0].split()[3])
    # The signal comes as step usr1_at is printed; the save is that step, and no step after it was trained.
    last = max(int(line.split()[1]) for line in out.splitlines() if line.startswith("step "))
    assert usr1_at == saved == last, why + out
    assert max(e.step for e in scan.committed(ckpt)) == saved

    rc, out, err = warm_one_thread.run(Path(cmd[1]), Path.cwd(), *cmd[2:], env=env(), timeout=180)
    assert rc == 0, why + out + err
    assert f"resumed from step {saved}" in out
    ref_out = reference.communicate(timeout=180)[0]
    assert reference.returncode == 0, ref_out
    assert digest(out) == digest(ref_out), why
    kept = sorted({*range(2, STEPS + 1, 2), saved})[-2:]  # keep=2: the last two saves (the preempted one may be odd)
    assert catalog.verify(ckpt) == [] and [e.step for e in scan.committed(ckpt)] == kept, why


def test_sbatch_script_forwards_usr1_saves_requeues_and_resumes(image_dataset, tmp_path):
    """examples/slurm/train.sbatch run by bash with stand-ins for srun and scontrol (Slurm is not the
    thing under test): B:USR1 to the batch shell reaches train.py, which saves, requeues and exits."""
    bindir, record = tmp_path / "bin", tmp_path / "scontrol.log"
    bindir.mkdir()
    (bindir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\n'
                                 'export SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0\nexec "$@"\n')
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n'
                                     '[ "$1" = show ] && echo 127.0.0.1\nexit 0\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    ckpt = tmp_path / "ck"
    run_env = {**env(), "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "777",
               "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NAME": "t", "DATA": str(image_dataset), "CKPT": str(ckpt),
               "PYTHON": sys.executable, "FASTIO": str(REPO), "MASTER_PORT": str(free_port()),
               "TRAIN_ARGS": f"--steps {STEPS} --every-steps 100 --loader-threads 1 --step-delay 0.05"}
    script = REPO / "examples" / "slurm" / "train.sbatch"
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=run_env)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step 4 "):
            proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@120` does
            break
    out += proc.stdout.readlines()
    text = "".join(out)
    assert proc.wait(timeout=180) == 0, text
    assert "SIGUSR1: asking ranks to checkpoint" in text and "preempted: saved step" in text, text
    saved = max(e.step for e in scan.committed(ckpt))
    assert 4 <= saved < STEPS
    assert "requeue 777" in record.read_text()
    again = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=run_env, timeout=180)
    assert again.returncode == 0 and f"resumed from step {saved}" in again.stdout, again.stdout + again.stderr
    assert "final weights sha256" in again.stdout


SLURM_JOB = r"""
set -u
cd "$WORK"
jid=$(sbatch --parsable --gpus-per-node=0 --cpus-per-task=1 "$FASTIO/examples/slurm/train.sbatch") || exit 1
out=fastio-train-$jid.out
for i in $(seq 480); do grep -q "^step 4 " "$out" 2>/dev/null && break; sleep 0.25; done
scancel --signal=USR1 --batch "$jid"       # what --signal=B:USR1@120 does before the time limit
for i in $(seq 480); do scontrol show job "$jid" | grep -q "Restarts=1" && break; sleep 0.25; done
forced=0
for i in $(seq 960); do  # a requeued job is held back a while (BeginTime); let it start now
  state=$(scontrol show job "$jid" | grep -o "JobState=[A-Z]*")
  [ "$state" = JobState=COMPLETED ] && break
  # Only once the first run has left the node, and not within the second of the requeue: slurmd
  # refuses such a restart ("Job credential revoked") and the job ends instead of running again.
  if [ $forced = 0 ] && [ "$state" = JobState=PENDING ] && sinfo -h -o %T | grep -qx idle; then
    sleep 2
    scontrol update jobid="$jid" StartTime=now 2>/dev/null && forced=1
  fi
  sleep 0.25
done
scontrol show job "$jid" | grep -o "JobState=[A-Z]*\|Restarts=[0-9]*"
cat "$out"
"""


needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(x) for x in ("slurmctld", "slurmd", "munged", "sbatch", "unshare")),
    reason="needs root and Slurm (slurm-wlm, munge) for a one-node cluster: make test-slurm")


def on_one_node(tmp_path: Path, job: str, job_env: dict[str, str]) -> str:
    """The bash script ``job`` run against a one-node Slurm cluster (tests/slurm/with-cluster.sh): its stdout."""
    script = tmp_path / "job.sh"
    script.write_text(job)
    proc = subprocess.run(["bash", str(REPO / "tests" / "slurm" / "with-cluster.sh"), str(tmp_path / "cluster"),
                           "bash", str(script)], capture_output=True, text=True, env=job_env, timeout=480,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slurm
@needs_slurm
def test_real_slurm_usr1_requeues_and_resumes_bitwise(image_dataset, tmp_path):
    """sbatch examples/slurm/train.sbatch on a one-node Slurm cluster (tests/slurm/with-cluster.sh):
    B:USR1 -> checkpoint, real `scontrol requeue`, the requeued job resumes and ends like an uninterrupted run."""
    steps = 24
    reference = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "train.py"), "--data", str(image_dataset), "--ckpt-dir",
         str(tmp_path / "ref"), "--steps", str(steps), "--every-steps", "100", "--loader-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    work = tmp_path / "job"
    work.mkdir()
    job_env = {**env(), "WORK": str(work), "DATA": str(image_dataset), "CKPT": str(tmp_path / "ck"),
               "PYTHON": sys.executable, "FASTIO": str(REPO),
               "TRAIN_ARGS": f"--steps {steps} --every-steps 100 --loader-threads 1 --step-delay 0.1"}
    out = on_one_node(tmp_path, SLURM_JOB, job_env)
    assert "JobState=COMPLETED" in out and "Restarts=1" in out, out
    saved = [line for line in out.splitlines() if line.startswith("preempted: saved step")]
    assert len(saved) == 1, out
    step = int(saved[0].split()[3])
    assert f"resumed from step {step}" in out and "job" in out and "restart 1" in out, out
    assert digest(out) == digest(reference.communicate(timeout=120)[0])


SCANCEL_JOB = r"""
set -u
cd "$WORK"
jid=$(sbatch --parsable --gpus-per-node=0 --cpus-per-task=1 "$FASTIO/examples/slurm/train.sbatch") || exit 1
out=fastio-train-$jid.out
for i in $(seq 480); do grep -q "^step 4 " "$out" 2>/dev/null && break; sleep 0.25; done
scancel "$jid"                             # SIGTERM to every task, SIGKILL KillWait (30 s) later
for i in $(seq 480); do
  scontrol show job "$jid" | grep -q "JobState=CANCELLED" && sinfo -h -o %T | grep -qx idle && break
  sleep 0.25
done
sleep 5                                    # a requeue (what the bug did) would show by now: PENDING, Restarts=1
scontrol show job "$jid" | grep -o "JobState=[A-Z]*\|Restarts=[0-9]*"
cat "$out"
"""


@pytest.mark.slurm
@needs_slurm
def test_real_slurm_scancel_saves_and_does_not_requeue(image_dataset, tmp_path):
    """`scancel` of a running examples/slurm/train.sbatch job (which runs train.py --requeue) on a one-node Slurm
    cluster: SIGTERM reaches train.py, which saves at the next step and exits; the job stays cancelled. Found by the
    Slurm review: a SIGTERM requeued the job like the warning does, so a job the user cancelled ran again."""
    work = tmp_path / "job"
    work.mkdir()
    job_env = {**env(), "WORK": str(work), "DATA": str(image_dataset), "CKPT": str(tmp_path / "ck"),
               "PYTHON": sys.executable, "FASTIO": str(REPO),
               "TRAIN_ARGS": "--steps 400 --every-steps 1000 --loader-threads 1 --step-delay 0.1"}
    out = on_one_node(tmp_path, SCANCEL_JOB, job_env)
    assert "JobState=CANCELLED" in out and "Restarts=0" in out, out
    assert "restart 1" not in out, out
    saved = [e.step for e in scan.committed(tmp_path / "ck")]  # --every-steps 1000: only the SIGTERM's save
    assert len(saved) == 1 and 4 <= saved[0] < 400, (saved, out)
    assert catalog.verify(tmp_path / "ck") == [], out


def test_train_on_a_dataset_without_labels_is_one_line(tmp_path, warm_one_thread):
    """Found by the integrations review: a flat image folder converted (no class folders, no labels) gave the model 4
    classes (`num_classes or 4`) and ended at the first step in a KeyError: 'label' traceback, its checkpoint folder
    made; now one line naming the dataset (exit 2), before any checkpoint folder is made."""
    from PIL import Image

    from fastio.convert.run import ConvertConfig, convert

    (tmp_path / "flat").mkdir()
    for k in range(8):
        Image.new("RGB", (40, 30), (20 * k, 90, 200)).save(tmp_path / "flat" / f"p{k}.png")
    convert(ConvertConfig(source=tmp_path / "flat", dest=tmp_path / "ds", workers=1, progress=False))
    cmd = command(tmp_path / "ds", tmp_path / "ck")  # started by the warm interpreter: torch is imported already
    rc, out, err = warm_one_thread.run(Path(cmd[1]), Path.cwd(), *cmd[2:], "--steps", "2", env=env(), timeout=180)
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"train.py: error: {tmp_path / 'ds'}: a dataset without "
                                                   "labels"), err
    assert not (tmp_path / "ck").exists()
