"""Checkpoint overhead as a user sees it: training on one torch thread, a checkpoint every K steps.

The cadence rule (from the issue): K is the smallest number of steps with K x step time >= 4 x the
background write time, both measured here first, so the writer is idle three quarters of the time and
only what the write takes from the training loop shows. Savers are compared in paired, interleaved
rounds against rounds without checkpoints (the machine may be busy: a ratio is taken per round against
the neighbouring round without, and the median of those ratios is reported). Each round also records
the training thread's CPU time and its run-queue wait (``/proc/self/task/TID/schedstat``): extra wait
means the writer (or the kernel working for it) took the training thread's core, extra CPU means the
training thread itself ran slower (memory bandwidth, caches).

Savers: ``fastio`` (the Checkpointer as configured by default), ``fastio:KEY=VALUE`` variants, and
``dcp_process`` (``torch.distributed.checkpoint.async_save`` with
``async_checkpointer_type=AsyncCheckpointerType.PROCESS``, used directly; waits for the previous save
before the next, as the Checkpointer does).

    python -m bench.checkpoint_overhead [--size-mib 512] [--rounds 3] [--saver fastio --saver dcp_process]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.model import build, state_mib, train_step

__all__ = ["cadence", "measure"]


def cadence(step_s: float, write_s: float, factor: float = 4.0) -> int:
    """The smallest K with K x ``step_s`` >= ``factor`` x ``write_s`` (at least 1)."""
    return max(1, math.ceil(factor * write_s / step_s))


def _schedstat() -> tuple[float, float]:
    """(CPU seconds, run-queue wait seconds) of the calling thread."""
    with open(f"/proc/self/task/{__import__('threading').get_native_id()}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


class _Fastio:
    def __init__(self, root: Path, app: dict, options: dict[str, Any]):
        from fastio.checkpoint import Checkpointer
        from fastio.checkpoint.engines import torchsnapshot_engine

        # "streams": the torchsnapshot engine's WRITE_STREAMS for this saver's writes (for comparisons); set before
        # every save, so savers interleaved in one process each write with their own (default: the shipped value)
        self.streams = options.pop("streams", torchsnapshot_engine.WRITE_STREAMS)
        self.ckpt = Checkpointer(root, keep=1, signals=(), **options)
        self.app, self.writes = app, []

    def save(self, step: int) -> None:
        from fastio.checkpoint.engines import torchsnapshot_engine

        torchsnapshot_engine.WRITE_STREAMS = self.streams
        self.ckpt.save(step, self.app)

    def finish(self) -> None:
        self.ckpt.wait()
        self.writes.append(self.ckpt.last_write_s)

    def close(self) -> None:
        self.ckpt.close()


class _DcpProcess:
    """DCP's own async save in its checkpoint process (one rank, a gloo group on loopback)."""

    def __init__(self, root: Path, app: dict, options: dict[str, Any]):
        import torch.distributed as dist

        self.own_group = not dist.is_initialized()
        if self.own_group:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.root, self.app, self.pending, self.writes, self.n = root, app, None, [], 0
        self.started = 0.0

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.finish()
        self.n += 1
        self.started = time.perf_counter()
        sd = {"model": self.app["model"].state_dict(), "optim": self.app["optim"].state_dict()}
        self.pending = dcp.async_save(sd, checkpoint_id=str(self.root / str(self.n % 2)),
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    def finish(self) -> None:
        if self.pending is not None:
            fut, self.pending = self.pending, None
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            self.writes.append(time.perf_counter() - self.started)

    def close(self) -> None:
        import torch.distributed as dist

        self.finish()
        if self.own_group:
            dist.destroy_process_group()


def _saver(name: str, root: Path, app: dict) -> Any:
    kind, _, rest = name.partition(":")
    options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if kv)}
    return {"fastio": _Fastio, "dcp_process": _DcpProcess}[kind](root / name.replace(":", "_"), app, options)


def measure(work: Path, size_mib: int = 512, rounds: int = 3, savers: tuple[str, ...] = ("fastio",),
            saves_per_round: int = 1, every: int | None = None, factor: float = 4.0) -> dict:
    """Per saver: the median over paired rounds of (round time with checkpoints / round time without) - 1,
    with K from the cadence rule (or ``every``), training on one torch thread."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optim = build(size_mib)
        app = {"model": model, "optim": optim}
        for _ in range(3):
            train_step(model, optim)
        objs = {name: _saver(name, work, app) for name in savers}
        # calibration: step time without saves, then the first saver's background write time while training
        t = time.perf_counter()
        for _ in range(5):
            train_step(model, optim)
        step_s = (time.perf_counter() - t) / 5
        first = objs[savers[0]]
        for obj in objs.values():  # warm every saver: buffers, files, the DCP process
            obj.save(0)
            obj.finish()
        for i in range(2):
            first.save(i + 1)
            while (first.ckpt._thread.is_alive() if isinstance(first, _Fastio) else not first.pending.done()):
                train_step(model, optim)
            first.finish()
        write_s = statistics.median(first.writes[-2:])
        k = every or cadence(step_s, write_s, factor)
        steps = k * saves_per_round
        base = [1000]

        def run(obj: Any) -> tuple[float, float, float]:
            t, (c, w) = time.perf_counter(), _schedstat()
            for i in range(steps):
                train_step(model, optim)
                if obj is not None and i % k == k // 2:
                    base[0] += 1
                    obj.save(base[0])
            if obj is not None:
                obj.finish()  # by the rule the write is long done; an unfinished one counts here
            c1, w1 = _schedstat()
            return time.perf_counter() - t, c1 - c, w1 - w

        rows: dict[str, dict[str, list[float]]] = {n: {"ratio": [], "cpu": [], "wait": []} for n in savers}
        without: list[tuple[float, float, float]] = []
        for _ in range(rounds):
            for name in savers:
                base_run = run(None)
                without.append(base_run)
                ours = run(objs[name])
                rows[name]["ratio"].append(ours[0] / base_run[0])
                rows[name]["cpu"].append((ours[1] - base_run[1]) / saves_per_round)
                rows[name]["wait"].append((ours[2] - base_run[2]) / saves_per_round)
        out = {"size_mib": round(state_mib(model, optim)), "step_s": step_s, "write_s": write_s, "every": k,
               "factor": factor, "rounds": rounds, "saves_per_round": saves_per_round,
               "without_round_s": [w for w, _, _ in without], "savers": {}}
        for name, obj in objs.items():
            r = rows[name]
            out["savers"][name] = {
                "overhead": statistics.median(r["ratio"]) - 1.0, "ratios": r["ratio"],
                "write_s": statistics.median(obj.writes) if obj.writes else None,
                "extra_cpu_per_save_s": statistics.median(r["cpu"]), "extra_wait_per_save_s": statistics.median(r["wait"]),
                "lost_per_save_s": (statistics.median(r["ratio"]) - 1.0) * statistics.median(w for w, _, _ in without)
                / saves_per_round}
            obj.close()
        return out
    finally:
        torch.set_num_threads(threads)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint_overhead``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves-per-round", type=int, default=1)
    p.add_argument("--every", type=int, default=None, help="fixed K instead of the cadence rule")
    p.add_argument("--saver", action="append", default=None, help="fastio, fastio:KEY=JSON,..., dcp_process")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "overhead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = measure(args.workdir, args.size_mib, args.rounds, tuple(args.saver or ["fastio"]), args.saves_per_round,
                  args.every)
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
