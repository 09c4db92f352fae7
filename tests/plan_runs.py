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
    """The runs of the JSON plan at ``path`` (``{"runs": [{"devices": N, "argv": [...]}, ...], "done": DIR}``), in
    order, as rank ``LOCAL_RANK`` of each run it is in: ``main(argv)`` with ``RANK``, ``WORLD_SIZE`` and
    ``MASTER_PORT`` set for a group of N ranks on a port rank 0 picks as the run starts (:func:`_run_port`), then
    ``after()`` (it must destroy the group). A run it is not in (``LOCAL_RANK >= N``) it waits out, until rank 0
    marks it done in DIR, so that the checkpoints the next run resumes from exist."""
    rank = int(os.environ["LOCAL_RANK"])
    plan = json.loads(Path(path).read_text())
    for i, run in enumerate(plan["runs"]):
        done = Path(plan["done"]) / f"run{i}.done"
        if rank >= run["devices"]:
            while not done.exists():
                time.sleep(0.05)
            continue
        port = _run_port(Path(plan["done"]) / f"run{i}.port", rank)
        os.environ.update(MASTER_PORT=str(port), WORLD_SIZE=str(run["devices"]), RANK=str(rank))
        main(run["argv"])
        after()
        if rank == 0:
            done.touch()


def _run_port(meeting: Path, rank: int, timeout: float = 300) -> int:
    """The port of a run's group: rank 0 picks a free one now and publishes it in ``meeting``, the other ranks read
    it there. Picked as the run starts, not when the test did: by a later run's start another process (a gloo
    listener, another test's server) could have bound a port picked then (EADDRINUSE in full-suite runs)."""
    if rank == 0:
        from s3server import free_port

        part = meeting.with_name(meeting.name + ".part")
        part.write_text(str(free_port()))
        os.replace(part, meeting)
    deadline = time.monotonic() + timeout
    while not meeting.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{meeting}: rank 0 published no port within {timeout} s")
        time.sleep(0.05)
    return int(meeting.read_text())


def launch(script: Path, where: Path, runs: list[tuple[int, list[str]]], timeout: float = 300) -> None:
    """The ``(devices, arguments)`` runs in order, by ``python script --plan PLAN`` in one process a rank of the
    largest run (``run_plan``), started here; fail with the output of the ranks that failed."""
    plan = where / "plan.json"
    plan.write_text(json.dumps({"done": str(where), "runs": [{"devices": devices, "argv": argv} for devices, argv in runs]}))
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
