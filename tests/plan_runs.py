"""Several multi-process training runs in ONE set of processes (tests/test_lightning_resume.py,
tests/test_accelerate.py): each process imports torch and the trainer once for all the runs instead of once a
run, the costly part of a run on a small dataset. ``launch`` (in the test) starts one process a rank of the
largest run; ``run_plan`` (in each of them) runs the runs in order, a fresh gloo group each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def run_plan(path: str, main: Callable[[list[str]], object], after: Callable[[], None]) -> None:
    """The runs of the JSON plan at ``path`` (``{"runs": [{"devices": N, "port": P, "argv": [...]}, ...], "done":
    DIR}``), in order, as rank ``LOCAL_RANK`` of each run it is in: ``main(argv)`` with ``RANK``, ``WORLD_SIZE``
    and ``MASTER_PORT`` set for a group of N ranks on port P, then ``after()`` (it must destroy the group). A run
    it is not in (``LOCAL_RANK >= N``) it waits out, until rank 0 marks it done in DIR, so that the checkpoints
    the next run resumes from exist."""
    rank = int(os.environ["LOCAL_RANK"])
    plan = json.loads(Path(path).read_text())
    for i, run in enumerate(plan["runs"]):
        done = Path(plan["done"]) / f"run{i}.done"
        if rank >= run["devices"]:
            while not done.exists():
                time.sleep(0.05)
            continue
        os.environ.update(MASTER_PORT=str(run["port"]), WORLD_SIZE=str(run["devices"]), RANK=str(rank))
        main(run["argv"])
        after()
        if rank == 0:
            done.touch()


def launch(script: Path, where: Path, runs: list[tuple[int, list[str]]], timeout: float = 300) -> None:
    """The ``(devices, arguments)`` runs in order, by ``python script --plan PLAN`` in one process a rank of the
    largest run (``run_plan``), started here; fail with the output of the ranks that failed."""
    from s3server import free_port

    plan = where / "plan.json"
    plan.write_text(json.dumps({"done": str(where), "runs": [
        {"devices": devices, "port": free_port(), "argv": argv} for devices, argv in runs]}))
    outs = [where / f"rank{r}.out" for r in range(max(devices for devices, _ in runs))]
    procs = []
    for rank, out in enumerate(outs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": str(rank), "NODE_RANK": "0",
               "OMP_NUM_THREADS": "1"}
        with open(out, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(script), "--plan", str(plan)], env=env, cwd=where,
                                          stdout=f, stderr=subprocess.STDOUT))
    try:
        _wait(procs, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [rank for rank, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"rank {r}: " + outs[r].read_text()[-3000:] for r in failed)


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Until every process ended or one failed."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and all(p.returncode in (None, 0) for p in procs):
        assert time.monotonic() < deadline, f"the processes ran past {timeout:.0f} s"
        time.sleep(0.2)
