"""A real two-node Slurm cluster on this machine (tests/slurm/with-cluster.sh --nodes 2: two slurmd in their
own network and UTS namespaces, one slurmctld, a private bridge): DDP training across both nodes with a
preemption, `scontrol requeue` and a bitwise-equal resume; and the conversion array job + merge."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import write_image_dataset

from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tests" / "slurm" / "with-cluster.sh"


def _cannot_run_cluster() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, daemons): make test-slurm"
    missing = [x for x in ("slurmctld", "slurmd", "munged", "sbatch", "srun", "unshare", "ip") if not shutil.which(x)]
    if missing:
        return f"needs Slurm (slurm-wlm, munge) and iproute2; missing {', '.join(missing)}: make test-slurm"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--fork", "sh", "-c",
                            "ip link add fastio-probe type bridge && ip link add fastio-p0 type veth peer name p1"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"needs network namespaces with bridges and veth pairs: {probe.stderr.strip()[:200]}"
    return None


WHY_NOT = _cannot_run_cluster()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
            "FASTIO": str(REPO), **extra}


def on_cluster(tmp_path: Path, script: str, job_env: dict[str, str], timeout: int) -> str:
    (tmp_path / "job.sh").write_text(script)
    proc = subprocess.run(["bash", str(CLUSTER), "--nodes", "2", str(tmp_path / "c"), "bash", str(tmp_path / "job.sh")],
                          capture_output=True, text=True, env=job_env, timeout=timeout, check=False)
    logs = "".join(f"\n== {p.name}\n" + "".join(p.read_text().splitlines(True)[-15:])
                   for p in sorted((tmp_path / "c" / "log").glob("*.log")))
    (tmp_path / "cluster.out").write_text(proc.stdout + proc.stderr + logs)
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return proc.stdout


TRAIN_JOB = r"""
set -u
cd "$WORK"
submit() { sbatch --parsable --nodes=2 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 "$@" \
           "$FASTIO/examples/slurm/train.sbatch"; }
ended() { scontrol show job "$1" | grep -q "JobState=COMPLETED\|JobState=FAILED\|JobState=CANCELLED"; }
wait_done() { for i in $(seq 1200); do ended "$1" && break; sleep 0.25; done; }
# The uninterrupted reference: the same job, same 2 x 2 tasks, never signalled.
ref=$(CKPT=$WORK/ref-ckpt TRAIN_ARGS="$TRAIN_ARGS --step-delay 0" submit --output=ref-%j.out) || exit 1
wait_done "$ref"
echo "== reference"; cat "ref-$ref.out"
jid=$(CKPT=$WORK/ckpt TRAIN_ARGS="$TRAIN_ARGS --sample-log $WORK/samples" submit) || exit 1
out=fastio-train-$jid.out
for i in $(seq 1200); do grep -q "^step $SIGNAL_AT " "$out" 2>/dev/null && break; sleep 0.25; done
scancel --signal=USR1 --batch "$jid"       # what --signal=B:USR1@120 does before the time limit
for i in $(seq 1200); do scontrol show job "$jid" | grep -q "Restarts=1" && break; sleep 0.25; done
forced=0
for i in $(seq 2400); do  # a requeued job is held back a while (BeginTime); let it start now
  state=$(scontrol show job "$jid" | grep -o "JobState=[A-Z]*")
  [ "$state" = JobState=COMPLETED ] || [ "$state" = JobState=FAILED ] && break
  # Only once the first run has left both nodes (slurmd refuses a restart within the second of the
  # requeue: "Job credential revoked").
  if [ $forced = 0 ] && [ "$state" = JobState=PENDING ] && [ "$(sinfo -h -N -o %T | grep -cx idle)" = 2 ]; then
    sleep 2
    scontrol update jobid="$jid" StartTime=now 2>/dev/null && forced=1
  fi
  sleep 0.25
done
echo "== job"
scontrol show job "$jid" | grep -o "JobState=[A-Z]*\|Restarts=[0-9]*\|NodeList=[^ ]*"
cat "$out"
"""


def test_two_nodes_ddp_preempt_requeue_resume_bitwise(tmp_path):
    """2 nodes x 2 tasks of examples/train.py (DDP over gloo, Loader, Checkpointer) through the unchanged
    examples/slurm/train.sbatch: B:USR1 -> save at the next step boundary -> `scontrol requeue` -> the job
    runs again on both nodes and ends with the weights of an uninterrupted 2 x 2 run; across the 4 ranks and
    both runs every sample is trained on exactly once per epoch."""
    data = write_image_dataset(tmp_path / "ds", make_imagefolder(tmp_path / "src", classes=4, per_class=16))
    steps, per_epoch = 16, 64 // (4 * 4)  # 64 samples, 4 ranks x batch 4: 4 steps per epoch, 4 epochs
    work = tmp_path / "job"
    work.mkdir()
    out = on_cluster(tmp_path, TRAIN_JOB, env(
        WORK=str(work), DATA=str(data), SIGNAL_AT="5",
        TRAIN_ARGS=f"--steps {steps} --batch-size 4 --every-steps 100 --loader-threads 1 --step-delay 0.5"),
        timeout=900)
    ref, job = out.split("== job", 1)
    assert "JobState=COMPLETED" in job and "Restarts=1" in job and "NodeList=n[1-2]" in job, out
    assert "restart 0 on n[1-2]" in job and "restart 1 on n[1-2]" in job, out
    saved = [line for line in job.splitlines() if line.startswith("preempted: saved step")]
    assert len(saved) == 1, out
    step = int(saved[0].split()[3])
    assert 5 <= step < steps and f"resumed from step {step}" in job, out

    def digest(text: str) -> str:
        found = [line.split(": ")[1] for line in text.splitlines() if line.startswith("final weights sha256: ")]
        assert len(found) == 1, out
        return found[0]

    assert digest(job) == digest(ref), out

    logs = sorted((work / "samples").glob("rank-*.log"))
    assert [p.name for p in logs] == ["rank-0.n1.log", "rank-1.n1.log", "rank-2.n2.log", "rank-3.n2.log"], logs
    seen = Counter(tuple(map(int, line.split())) for p in logs for line in p.read_text().splitlines())
    assert set(seen.values()) == {1}, [k for k, v in seen.items() if v > 1][:10]
    epochs = steps // per_epoch
    assert sorted(seen) == [(e, i) for e in range(epochs) for i in range(64)]


CONVERT_JOB = r"""
set -u
cd "$WORK"
line=$(bash "$FASTIO/examples/slurm/convert.sbatch" --shuffle --seed 3 --split val=0.25 --shard-size 40k) || exit 1
echo "$line"
merge=$(echo "$line" | grep -o "merge job [0-9]*" | grep -o "[0-9]*$")
for i in $(seq 1200); do
  scontrol show job "$merge" | grep -q "JobState=COMPLETED\|JobState=FAILED\|JobState=CANCELLED" && break
  sleep 0.25
done
scontrol show job "$merge" | grep -o "JobState=[A-Z]*\|Dependency=[^ ]*"
cat fastio-convert-*.out fastio-merge-*.out
"""


def test_conversion_array_job_and_merge_on_two_nodes(tmp_path, image_folder):
    """examples/slurm/convert.sbatch: 4 array tasks convert their parts on both nodes, the dependent job merges;
    the result equals a single `fastio convert` with the same options, byte for byte."""
    work = tmp_path / "job"
    work.mkdir()
    out = on_cluster(tmp_path, CONVERT_JOB, env(WORK=str(work), SOURCE=str(image_folder), DEST=str(tmp_path / "parted"),
                                                PARTS="4", SBATCH_ARGS="--cpus-per-task=1"), timeout=600)
    assert "JobState=COMPLETED" in out and "merged 4 parts into" in out and "ok: " in out, out
    hosts = {line.rsplit(" on ", 1)[1] for line in out.splitlines() if " part " in line and " of 4 on " in line}
    assert hosts == {"n1", "n2"}, out
    convert(ConvertConfig(source=image_folder, dest=tmp_path / "single", shuffle=True, seed=3, split="val=0.25",
                          shard_size="40k", workers=1))

    def tree(dest: Path) -> dict[str, bytes]:
        return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*"))
                if p.is_file() and p.name != ".fastio-lock"}

    assert tree(tmp_path / "single") == tree(tmp_path / "parted")
