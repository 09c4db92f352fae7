"""Checkpoint overhead as a user sees it: training on one torch thread, a checkpoint every K steps.

The cadence rule (from the issue): K is the smallest number of steps with K x step time >= ``factor`` x the
background write time, both measured here first: at 4x the writer is idle three quarters of the time, at 1x it is
always busy. Savers are measured in adjacent windows of K steps: a window without saves, a window with one save
at its first step (and the wait for that write, if it is not done by the window's end), a window without, the
next saver's window, ... (savers in a rotating order). Each saver's ratio is its window's time over the mean of
the two windows beside it, so slow drifts of the host cancel; the median over rounds is reported. Each window
also records the training thread's CPU time and its run-queue wait (``/proc/self/task/TID/schedstat``: extra wait
means the writer, or the kernel working for it, took the training thread's core; extra CPU, that the training
thread itself ran slower), and what blocked it directly, measured with ``perf_counter``: the save call, the wait
for an unfinished write at the window's end, and the steps' excess over the neighbouring windows' median step.
Before each round it waits for a quiet machine (:mod:`bench.quiet`, ``quiet_wait`` seconds at most) and records
what the other processes used during it.

Savers: ``fastio`` (the Checkpointer as configured by default), ``fastio:KEY=VALUE`` variants (CheckpointConfig
options, and the torchsnapshot engine's ``streams`` and ``slab_bytes``; ``placed=false``: staging buffers as torch
allocates them, every byte of a direct write copied through the aligned chunks, as before the buffers were placed),
``dcp_process`` (``torch.distributed.checkpoint.async_save`` with
``async_checkpointer_type=AsyncCheckpointerType.PROCESS``, used directly; waits for the previous save before the
next, as the Checkpointer does) and ``minimal``
(:class:`bench.checkpoint_peers.MinimalWriter`: stage, then hash, one file, fsync, rename).

    python -m bench.checkpoint_overhead [--size-mib 512] [--rounds 3] [--factor 1 --factor 4] [--saver minimal]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.model import build, state_mib, train_step

__all__ = ["SAVERS", "Window", "cadence", "compare", "measure", "window"]


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
        self.slab_bytes = options.pop("slab_bytes", torchsnapshot_engine.SLAB_BYTES)  # the same for SLAB_BYTES
        placed = options.pop("placed", True)
        self.ckpt = Checkpointer(root, keep=1, signals=(), **options)
        if not placed:  # the engine made here, the Checkpointer's from its first save on (a bench may look)
            from fastio.checkpoint.engines import get_engine

            engine = self.ckpt._engines["torchsnapshot"] = get_engine("torchsnapshot")
            engine.placements = lambda: None
        self.app, self.writes = app, []

    def save(self, step: int) -> None:
        from fastio.checkpoint.engines import torchsnapshot_engine

        torchsnapshot_engine.WRITE_STREAMS = self.streams
        torchsnapshot_engine.SLAB_BYTES = self.slab_bytes
        self.ckpt.save(step, self.app)

    def busy(self) -> bool:
        thread = self.ckpt._thread  # the Checkpointer's writer thread (a bench may look)
        return thread is not None and thread.is_alive()

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
        self.pending = dcp.async_save(sd, checkpoint_id=str(self.root / str(self.n)),
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    def _future(self) -> Any:
        fut = self.pending
        return fut.upload_completion if hasattr(fut, "upload_completion") else fut

    def busy(self) -> bool:
        return self.pending is not None and not self._future().done()

    def finish(self) -> None:
        """Wait for the write in flight; then the checkpoint before it goes (keep=1, as the Checkpointer), removed
        on a thread of its own: each save writes new files, as the Checkpointer's do."""
        if self.pending is not None:
            self._future().result()
            self.pending = None
            self.writes.append(time.perf_counter() - self.started)
            old = self.root / str(self.n - 1)
            threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True}, daemon=True).start()

    def close(self) -> None:
        import torch.distributed as dist

        self.finish()
        if self.own_group:
            dist.destroy_process_group()


class _Minimal:
    """:class:`bench.checkpoint_peers.MinimalWriter` over the app's state_dicts."""

    def __init__(self, root: Path, app: dict, options: dict[str, Any]):
        from bench.checkpoint_peers import MinimalWriter

        self.writer, self.app = MinimalWriter(root / "state.bin"), app
        self.writes = self.writer.writes

    def save(self, step: int) -> None:
        self.writer.save({k: v.state_dict() for k, v in self.app.items()})

    def busy(self) -> bool:
        return self.writer.busy()

    def finish(self) -> None:
        self.writer.wait()

    def close(self) -> None:
        self.writer.wait()


SAVERS = {"fastio": _Fastio, "dcp_process": _DcpProcess, "minimal": _Minimal}
"""Saver kinds by name (``fastio:KEY=JSON,...`` passes options to the kind)."""


def _saver(name: str, root: Path, app: dict) -> Any:
    kind, _, rest = name.partition(":")
    if kind not in SAVERS:
        raise ValueError(f"unknown saver {name!r} (kinds: {', '.join(SAVERS)})")
    options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if kv)}
    return SAVERS[kind](root / name.replace(":", "_"), app, options)


@dataclass
class Window:
    """One window of training steps: its ``wall`` time, the training thread's ``cpu`` and run-queue ``wait``,
    the seconds in save calls (``save_s``) and waiting for an unfinished write at its end (``finish_s``), and
    each step's time (``steps``, save calls excluded)."""

    wall: float
    cpu: float
    wait: float
    save_s: float
    finish_s: float
    steps: list[float]


def window(model: Any, optim: Any, steps: int, saver: Any = None, every: int = 0, step_no: list[int] | None = None,
           step: Any = train_step) -> Window:
    """``steps`` training steps; with a ``saver``, a save after the first step and after every ``every``-th after
    it, and a wait for the last write at the end (an unfinished write counts in the window)."""
    times, save_s, finish_s = [], 0.0, 0.0
    t, (c, w) = time.perf_counter(), _schedstat()
    for i in range(steps):
        s = time.perf_counter()
        step(model, optim)
        times.append(time.perf_counter() - s)
        if saver is not None and i % max(every, 1) == 0:
            if step_no is not None:
                step_no[0] += 1
            s = time.perf_counter()
            saver.save(step_no[0] if step_no is not None else i + 1)
            save_s += time.perf_counter() - s
    if saver is not None:
        s = time.perf_counter()
        saver.finish()
        finish_s = time.perf_counter() - s
    c1, w1 = _schedstat()
    return Window(time.perf_counter() - t, c1 - c, w1 - w, save_s, finish_s, times)


def compare(with_save: Window, before: Window, after: Window) -> dict[str, float]:
    """A saver's window against the mean of the windows without saves on either side of it: ``ratio`` of the
    wall times, the extra ``cpu`` and run-queue ``wait`` of the training thread, ``blocked`` (save calls plus
    the wait at the end) and ``slowed`` (the steps' time over that many steps at the neighbours' median step)."""
    base_wall, base_cpu, base_wait = ((getattr(before, f) + getattr(after, f)) / 2 for f in ("wall", "cpu", "wait"))
    step = statistics.median(before.steps + after.steps)
    off_cpu = with_save.wall - with_save.cpu - with_save.wait - (base_wall - base_cpu - base_wait)
    return {"ratio": with_save.wall / base_wall, "cpu": with_save.cpu - base_cpu, "wait": with_save.wait - base_wait,
            "off_cpu": off_cpu, "blocked": with_save.save_s + with_save.finish_s, "save_call": with_save.save_s,
            "finish": with_save.finish_s, "slowed": sum(with_save.steps) - step * len(with_save.steps)}


def _calibrate(model: Any, optim: Any, first: Any) -> tuple[float, float]:
    """The step time without saves, and ``first``'s background write time while training (median of three)."""
    t = time.perf_counter()
    for _ in range(5):
        train_step(model, optim)
    step_s = (time.perf_counter() - t) / 5
    for i in range(3):
        first.save(i + 1)
        while first.busy():
            train_step(model, optim)
        first.finish()
    return step_s, statistics.median(first.writes[-3:])


def _rounds(model: Any, optim: Any, objs: dict[str, Any], k: int, rounds: int, saves: int,
            quiet_wait: float, step_no: list[int]) -> dict:
    """Adjacent windows of ``k * saves`` steps, savers in a rotating order; per saver the :func:`compare` rows,
    and per round what the other processes used of the cores before and during it. ``step_no``: the last step
    number saved, counted on across cadences (a Checkpointer given a step below its last commit warns that it
    superseded the later ones)."""
    from bench.quiet import during, read_sample, wait_quiet

    names, rows, quiet = list(objs), {n: [] for n in objs}, []
    for r in range(rounds):
        before = wait_quiet(max_wait=quiet_wait)
        start = read_sample()
        prev = window(model, optim, k * saves)
        for name in names[r % len(names):] + names[:r % len(names)]:
            ours = window(model, optim, k * saves, objs[name], k, step_no)
            nxt = window(model, optim, k * saves)
            rows[name].append(compare(ours, prev, nxt))
            prev = nxt
        quiet.append({"before": before.as_dict(), "during": during(start, read_sample()).as_dict()})
    return {"rows": rows, "quiet": quiet}


def _summary(rows: list[dict[str, float]], saves: int, writes: list[float]) -> dict:
    """A saver's figures over the rounds: the median ratio - 1 as ``overhead``, and per save the medians of the
    blocked and slowed seconds and of the training thread's extra CPU and run-queue wait."""
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    return {"overhead": med["ratio"] - 1.0, "ratios": [r["ratio"] for r in rows],
            "write_s": statistics.median(writes) if writes else None,
            "blocked_per_save_s": med["blocked"] / saves, "save_call_s": med["save_call"] / saves,
            "finish_wait_s": med["finish"], "slowed_per_save_s": med["slowed"] / saves,
            "extra_cpu_per_save_s": med["cpu"] / saves, "extra_wait_per_save_s": med["wait"] / saves,
            "off_cpu_per_save_s": med["off_cpu"] / saves}


#: A cadence is measured again, once, when ``savers[0]``'s median write in its windows took longer than this factor
#: times the write time its K came from (a calibration write that hit a cold or a flushed page cache once gave
#: 0.29 s for writes of 1.03 s: every saver then waited at the window's end, and the "1x" cadence was not one).
#: Writes that came out shorter leave K as it is: this host's write time flips between ~0.3 and ~1.4 s, and a K
#: cut to a short write's made every saver wait again.
RECALIBRATE = 1.5


def _cadence(model: Any, optim: Any, objs: dict[str, Any], factor: float, step_s: float, write_s: float,
             every: int | None, args: tuple[int, int, float], step_no: list[int]) -> tuple[dict, float]:
    """One cadence's rounds (``args``: rounds, saves per round, quiet wait) and each saver's summary; measured
    again with K from the windows' own write time when the first saver's writes there took longer than
    :data:`RECALIBRATE` x ``write_s``. Returns the cadence's record and the write time the next cadence's K comes
    from: the longer of ``write_s`` and the one its windows measured."""
    rounds, saves, quiet_wait = args
    first, recalibrated_from = next(iter(objs)), None
    while True:
        k = every or cadence(step_s, write_s, factor)
        for obj in objs.values():
            obj.writes.clear()
        got = _rounds(model, optim, objs, k, rounds, saves, quiet_wait, step_no)
        seen = statistics.median(objs[first].writes) if objs[first].writes else write_s
        if every or recalibrated_from is not None or seen <= RECALIBRATE * write_s:
            break
        recalibrated_from, write_s = write_s, seen
    record = {"factor": factor, "every": k, "write_s": write_s, "windows_write_s": seen, "quiet": got["quiet"],
              "savers": {n: _summary(got["rows"][n], saves, objs[n].writes) for n in objs}}
    if recalibrated_from is not None:
        record["recalibrated_from_write_s"] = recalibrated_from
    return record, max(write_s, seen)


def measure(work: Path, size_mib: int = 512, rounds: int = 3, savers: tuple[str, ...] = ("fastio",),
            saves_per_round: int = 1, every: int | None = None, factors: tuple[float, ...] = (4.0,),
            quiet_wait: float = 0.0) -> dict:
    """Per cadence (``factors``: K x step >= factor x write, or K = ``every``) and saver: the median over rounds of
    (window with saves / its neighbours without) - 1 and what blocked the training thread, on one torch thread.
    ``savers[0]``'s write time sets K for all: measured while training at first, then the one each cadence's windows
    measured sets the next (narrower) cadence's K; a cadence whose windows' writes were off by more than
    :data:`RECALIBRATE` is measured again with theirs (:func:`_cadence`)."""
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
        for obj in objs.values():  # warm every saver: buffers, files, the DCP process
            obj.save(0)
            obj.finish()
        step_s, write_s = _calibrate(model, optim, objs[savers[0]])
        out = {"size_mib": round(state_mib(model, optim)), "step_s": step_s, "write_s": write_s, "rounds": rounds,
               "saves_per_round": saves_per_round, "cadences": {}}
        step_no = [1000]  # above the warm-up's and the calibration's steps; counted on by every cadence's windows
        for factor in sorted(factors, reverse=True):  # the widest first: its windows time writes between steps
            out["cadences"][f"{factor:g}x"], write_s = _cadence(model, optim, objs, factor, step_s, write_s, every,
                                                                (rounds, saves_per_round, quiet_wait), step_no)
        for obj in objs.values():
            obj.close()
        return out
    finally:
        torch.set_num_threads(threads)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint_overhead``."""
    from bench.quiet import add_wait_option

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves-per-round", type=int, default=1, help="saves in a saver's window, K steps apart")
    p.add_argument("--every", type=int, default=None, help="fixed K instead of the cadence rule")
    p.add_argument("--factor", type=float, action="append", default=None,
                   help="cadence: K x step >= FACTOR x write (repeatable; default 4)")
    p.add_argument("--saver", action="append", default=None, help="fastio, fastio:KEY=JSON,..., dcp_process, minimal")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "overhead")
    add_wait_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = measure(args.workdir, args.size_mib, args.rounds, tuple(args.saver or ["fastio"]), args.saves_per_round,
                  args.every, tuple(args.factor or [4.0]), args.quiet_wait)
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
