"""Several multi-process training runs in ONE set of processes (tests/test_lightning_resume.py,
tests/test_accelerate.py): each process imports torch and the trainer once for all the runs instead of once a
run, the costly part of a run on a small dataset; and that import is done once for all the ranks: ``launch`` (in
the test) starts one fresh python that does the script's imports, then forks one process a rank of the largest
run, each running the script as ``python script --plan PLAN`` would; ``run_plan`` (in each of them) runs the
runs in order, a fresh gloo group each. With ``fresh=True`` each run gets processes of its own instead, forked
from that python as the run starts (a resume in new processes, as a restarted job's: nothing of an earlier run
left in memory), the import still done once for all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from warm_python import ready_to_fork, run_as_main, wait_forked


def run_plan(path: str, main: Callable[[list[str]], object], after: Callable[[], None]) -> None:
    """The runs of the JSON plan at ``path`` (``{"runs": [{"devices": N, "argv": [...]}, ...], "done": DIR}``), in
    order, as rank ``LOCAL_RANK`` of each run it is in: ``main(argv)`` with ``RANK``, ``WORLD_SIZE`` and
    ``MASTER_PORT`` set for a group of N ranks on a port rank 0 picks as the run starts (:func:`_run_port`), then
    ``after()`` (it must destroy the group). A run it is not in (``LOCAL_RANK >= N``) it waits out, until rank 0
    marks it done in DIR, so that the checkpoints the next run resumes from exist."""
    rank = int(os.environ["LOCAL_RANK"])
    plan = json.loads(Path(path).read_text())
    only = os.environ.get("PLAN_RUN")  # a process of one run only (``launch(fresh=True)``)
    for i, run in enumerate(plan["runs"]):
        if only is not None and i != int(only):
            continue
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


def launch(script: Path, where: Path, runs: list[tuple[int, list[str]]], timeout: float = 300, *,
           fresh: bool = False) -> None:
    """The ``(devices, arguments)`` runs in order, by ``python script --plan PLAN`` in one process a rank of the
    largest run (``run_plan``), started here as forks of one fresh python that did the script's imports first
    (``_start_ranks``: Lightning's or Accelerate's import once, not once a rank); with ``fresh``, new processes
    for each run, forked as it starts; fail with the output of the ranks that failed (the run that failed, with
    ``fresh``: each rank's output of all runs is in ``rankR.out``)."""
    plan = where / "plan.json"
    plan.write_text(json.dumps({"done": str(where), "fresh": fresh,
                                "runs": [{"devices": devices, "argv": argv} for devices, argv in runs]}))
    ranks = max(devices for devices, _ in runs)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "NODE_RANK": "0", "OMP_NUM_THREADS": "1"}
    with open(where / "launch.out", "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(script), str(plan), str(ranks)], env=env, cwd=where,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the processes ran past {timeout:.0f} s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (where / "ranks.rc").exists(), f"no rank started: {(where / 'launch.out').read_text()[-3000:]}"
    codes = json.loads((where / "ranks.rc").read_text())
    failed = [rank for rank, rc in enumerate(codes) if rc != 0]
    assert not failed, "\n".join(f"rank {r} (exit code {codes[r]}): " + (where / f"rank{r}.out").read_text()[-3000:]
                                  for r in failed)


def _start_ranks(script: str, plan: str, ranks: int) -> None:
    """In ``launch``'s python: the script's top-level imports (its module run under another name than
    ``__main__``) and torch._dynamo (torch imports it by itself at a process's first optimizer: ~1 s of CPU a
    rank), then one fork a rank that runs it as ``LOCAL_RANK=r python script --plan PLAN`` would, its
    output in ``rankR.out``; until each ended or one failed (the others killed then); their exit codes in
    ``ranks.rc``. A ``fresh`` plan: that for each run in turn (``PLAN_RUN=i``), its ranks only, until one
    fails."""
    import runpy

    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="plan_runs_preload")
    ready_to_fork()
    runs = json.loads(Path(plan).read_text())
    if not runs.get("fresh"):
        codes = wait_forked([_fork_rank(script, plan, rank) for rank in range(ranks)])
    for i, run in enumerate(runs["runs"] if runs.get("fresh") else []):
        codes = wait_forked([_fork_rank(script, plan, rank, run=i) for rank in range(run["devices"])])
        if any(codes):
            break
    Path("ranks.rc").write_text(json.dumps(codes))


def _fork_rank(script: str, plan: str, rank: int, run: int | None = None) -> int:
    """A child that becomes rank ``rank``'s ``python script --plan plan`` (the warm interpreter's way,
    tests/warm_python.py) and exits as it would (of the plan's run ``run`` only, where given); its process id."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    out = os.open(f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | (os.O_APPEND if run else os.O_TRUNC))
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ["LOCAL_RANK"] = str(rank)
    if run is not None:
        os.environ["PLAN_RUN"] = str(run)
    sys.argv = [script, "--plan", plan]
    run_as_main(script)  # SystemExit out of _start_ranks too: never back in its loop


if __name__ == "__main__":
    _start_ranks(sys.argv[1], sys.argv[2], int(sys.argv[3]))
