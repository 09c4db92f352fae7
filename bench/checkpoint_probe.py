"""Where a background checkpoint write costs the training loop: per-step times split by writer phase.

Trains on one torch thread (the other core is the writer's) with ~``size_mib`` of model + Adam state and
saves every ``every`` steps. Each step records wall time and the training thread's CPU time; the writer's
phases (staging, engine write, commit: hash + fsync) are timestamped. Excess per step over the steps with
no write in flight is attributed to the phase that was running: excess CPU time of the training thread
means it ran slower (memory bandwidth, caches), excess run-queue wait means another thread had its core
(the writer's threads, the kernel), and the rest of the excess wall is time blocked (the GIL, locks, I/O).

    python -m bench.checkpoint_probe [--size-mib 512] [--saves 4] [--mode thread|process]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.checkpoint_overhead import _schedstat
from bench.model import build, train_step

__all__ = ["probe"]


def _runnable_others(main: int, me: int) -> int:
    """How many threads of this process other than ``main`` and ``me`` are running or runnable now."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in (main, me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            pass
    return n


def probe(work: Path, size_mib: int, saves: int, every: int, streams: int | None = None, **options) -> dict:
    import resource
    import threading

    from fastio.checkpoint import Checkpointer, publish
    from fastio.checkpoint.engines import torchsnapshot_engine

    if streams is not None:
        torchsnapshot_engine.WRITE_STREAMS = streams

    torch.set_num_threads(1)
    model, optim = build(size_mib)
    app = {"model": model, "optim": optim}
    for _ in range(3):
        train_step(model, optim)
    shutil.rmtree(work, ignore_errors=True)
    phases: list[tuple[str, float, float]] = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.append((name, t, time.perf_counter()))
        return wrapper

    orig_save, orig_commit = torchsnapshot_engine.TorchSnapshotEngine.save, publish.commit
    torchsnapshot_engine.TorchSnapshotEngine.save = timed("engine", orig_save)
    publish.commit = timed("commit", orig_commit)
    ckpt = Checkpointer(work, keep=1, signals=(), **options)
    samples: list[tuple[float, int]] = []  # (time, the writer's threads running or runnable)
    done = threading.Event()
    main_tid = threading.get_native_id()

    def sample() -> None:
        me = threading.get_native_id()
        while not done.wait(0.005):
            samples.append((time.perf_counter(), _runnable_others(main_tid, me)))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        steps: list[tuple[float, float, float, float]] = []  # start, end, thread cpu, run-queue wait
        step = 0
        ckpt.save(0, app, blocking=True)  # warm: buffers allocated, files exist once
        sampler.start()
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        main_cpu0 = time.thread_time()
        writes = []
        for _ in range(saves * every + every):
            t = time.perf_counter()
            c, w = _schedstat()
            train_step(model, optim)
            step += 1
            if step % every == every // 2 and step < saves * every:
                t1 = time.perf_counter()
                ckpt.save(step, app)
                phases.append(("stage", t1, time.perf_counter()))
            c1, w1 = _schedstat()
            steps.append((t, time.perf_counter(), c1 - c, w1 - w))
            if ckpt.last_write_s and (not writes or writes[-1] != ckpt.last_write_s):
                writes.append(ckpt.last_write_s)
        ckpt.wait()
        main_cpu = time.thread_time() - main_cpu0
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        done.set()
        sampler.join()
    finally:
        ckpt.close()
        torchsnapshot_engine.TorchSnapshotEngine.save, publish.commit = orig_save, orig_commit
    # classify each step by the phase overlapping its middle (staging steps separately)
    def phase_of(a, b):
        best, share = "idle", 0.0
        for name, p0, p1 in phases:
            ov = min(b, p1) - max(a, p0)
            if ov > share and ov > 0.3 * (b - a):
                best, share = name, ov
        return best

    by: dict[str, list[tuple[float, float, float]]] = {}
    for a, b, c, w in steps:
        by.setdefault(phase_of(a, b), []).append((b - a, c, w))
    idle = by.get("idle", [(0.0, 0.0, 0.0)])
    idle_wall, idle_cpu, idle_wait = (statistics.median(v[i] for v in idle) for i in range(3))
    rows = {}
    for name, vals in by.items():
        wall, cpu, wait = (sum(v[i] for v in vals) for i in range(3))
        rows[name] = {"steps": len(vals), "wall_s": wall, "cpu_s": cpu, "wait_s": wait,
                      "excess_wall_s": wall - len(vals) * idle_wall, "excess_cpu_s": cpu - len(vals) * idle_cpu,
                      "excess_wait_s": wait - len(vals) * idle_wait}
    n_saves = sum(1 for p in phases if p[0] == "stage")
    writing = [(p0, p1) for name, p0, p1 in phases if name in ("engine", "commit")]
    busy = [n for t, n in samples if any(p0 <= t <= p1 for p0, p1 in writing)]
    return {"size_mib": size_mib, "every": every, "saves": n_saves, "idle_step_wall_s": idle_wall,
            "idle_step_cpu_s": idle_cpu, "phases": rows, "write_s": writes,
            "loss_per_save_s": sum(r["excess_wall_s"] for r in rows.values()) / max(1, n_saves),
            "main_thread_cpu_s": main_cpu,
            "writer_cpu_per_save_s": (usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime - main_cpu)
            / max(1, n_saves),
            "writer_runnable_threads_mean": statistics.mean(busy) if busy else None,
            "writer_runnable_threads_max": max(busy) if busy else None}


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint_probe``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--every", type=int, default=13)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "probe")
    p.add_argument("--streams", type=int, default=None, help="the torchsnapshot engine's WRITE_STREAMS")
    p.add_argument("--option", action="append", default=[], help="CheckpointConfig KEY=JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    print(json.dumps(probe(args.workdir, args.size_mib, args.saves, args.every, args.streams, **options), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
