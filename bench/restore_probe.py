"""Where an FSDP2 restore through the Checkpointer spends its time against ``dcp.load``: phase by phase.

2 gloo ranks on the CPU, an FSDP2 model (every layer ``fully_shard``) and its Adam state of ~``size_mib``, as
:func:`bench.checkpoint.measure_fsdp`. One Checkpointer save and one ``dcp.save``, then ``rounds`` paired rounds
of ``Checkpointer.restore_latest`` and the peer (``get_state_dict``, ``dcp.load``, ``set_state_dict``), their
order alternating from round to round, each after a full garbage collection on both ranks
(:func:`bench.model.line_up`). The library's functions that a restore runs are wrapped here (the
library itself carries no timers): each phase's wall time and the process's CPU time (all its threads) are
summed per restore, and the collectives of ``torch.distributed`` it makes are counted. Phases nest (``load``
holds ``dcp.load``), so they do not add up; ``rest`` is the restore's time outside its top-level phases.

Medians over the rounds, rank 0. On a busy machine the wall times are noise: compare CPU, and fastio
against the peer of the same round.

    python -m bench.restore_probe [--size-mib 256] [--rounds 5] [--out bench/out]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import shutil
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.model import build_fsdp, end_rank, line_up

__all__ = ["PHASES", "probe"]

PHASES = (  # (label, module, attribute path, top level): what restore_latest runs, in order
    ("enter", "fastio.checkpoint.group", "RankGroup.enter", True),
    ("plan (scan, clean)", "fastio.checkpoint.restore", "Restorer._plan", True),
    ("choose (fetch + check)", "fastio.checkpoint.restore", "Restorer._choose", True),
    ("check: verify_files", "fastio.checkpoint.catalog", "verify_files", False),
    ("read_commit", "fastio.checkpoint.scan", "read_commit", True),
    ("open", "fastio.checkpoint.restore", "Restorer._open", True),
    ("open: engine.open", "fastio.checkpoint.engines.dcp_engine", "DcpEngine.open", False),
    ("open: loaders' check", "fastio.checkpoint.restore", "check_state_dicts", False),
    ("open: precheck", "fastio.checkpoint.restore", "_precheck", False),
    ("load", "fastio.checkpoint.restore", "Restorer._load_all", True),
    ("load: metadata check", "fastio.checkpoint.engines.dcp_engine", "check_metadata", False),
    ("load: get state_dict", "fastio.checkpoint.engines.dcp_engine", "ModuleState.state_dict", False),
    ("load: get state_dict", "fastio.checkpoint.engines.dcp_engine", "OptimizerState.state_dict", False),
    ("load: dcp.load", "torch.distributed.checkpoint", "load", False),
    ("load: dcp.load: planner setup", "fastio.checkpoint.engines.dcp_engine", "_SafeLoadPlanner.set_up_planner",
     False),
    ("load: dcp.load: planner bytes", "fastio.checkpoint.engines.dcp_engine", "_SafeLoadPlanner.load_bytes", False),
    ("load: dcp.load: read_data", "torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data", False),
    ("load: dcp.load: read_data", "fastio.checkpoint.engines.dcp_engine", "_HeldReader.read_data", False),
    ("load: set state_dict", "fastio.checkpoint.engines.dcp_engine", "ModuleState.load_state_dict", False),
    ("load: set state_dict", "fastio.checkpoint.engines.dcp_engine", "OptimizerState.load_state_dict", False),
    ("load: per-rank files", "fastio.checkpoint.engines.dcp_engine", "DcpCheckpoint.read", False),
    ("rng", "fastio.checkpoint.restore", "capture_rng", True),
    ("rng", "fastio.checkpoint.restore", "restore_rng", True),
)
COLLECTIVES = ("all_gather_object", "broadcast_object_list", "all_reduce", "barrier", "all_gather", "broadcast",
               "scatter_object_list", "gather_object")


class Clock:
    """Per-phase wall and CPU seconds of the current measurement, and its count of collectives."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._open: set[str] = set()

    @contextlib.contextmanager
    def phase(self, label: str):
        if label in self._open:  # re-entered (a phase calling itself): counted once, at the outer call
            yield
            return
        self._open.add(label)
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[label] += time.perf_counter() - w
            self.cpu[label] += time.process_time() - c
            self._open.discard(label)

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(label):
                return fn(*args, **kwargs)
        return timed

    def count(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def _install(clock: Clock) -> list[str]:
    """Wrap every phase of :data:`PHASES` and count the collectives; the labels of the top-level phases."""
    import torch.distributed as dist

    for label, module, attr, _ in PHASES:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if hasattr(owner, name):  # a phase an older revision lacks is left out (bench/revs-style comparisons)
            setattr(owner, name, clock.wrap(label, getattr(owner, name)))
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, clock.count(name, getattr(dist, name)))
    return list(dict.fromkeys(label for label, *_, top in PHASES if top))


def _worker(rank: int, port: int, work: str, size_mib: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fastio.checkpoint import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, optim = build_fsdp(size_mib)
    app = {"model": model, "optim": optim}
    ckpt = Checkpointer(Path(work) / "fastio", keep=1, signals=())
    ckpt.save(1, app, blocking=True)
    peer_dir = str(Path(work) / "dcp")
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=peer_dir)
    dist.barrier()

    clock = Clock()
    tops = _install(clock)  # after the saves: only restores are timed

    def peer() -> None:
        with clock.phase("peer: get state_dict"):
            msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        with clock.phase("peer: dcp.load"):
            dcp.load(sd, checkpoint_id=peer_dir)
        with clock.phase("peer: set state_dict"):
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    rows = []
    for i in range(rounds):
        row = {}
        for name, fn in sorted({"fastio": lambda: ckpt.restore_latest(app), "dcp": peer}.items(),
                               reverse=i % 2 == 1):
            line_up()  # no full collection left to land inside the restore (bench.model.line_up)
            clock.reset()
            w, c = time.perf_counter(), time.process_time()
            fn()
            row[name] = {"wall": time.perf_counter() - w, "cpu": time.process_time() - c,
                         "phases": {k: [clock.wall[k], clock.cpu[k]] for k in clock.wall},
                         "collectives": dict(clock.calls)}
            if name == "fastio":
                row[name]["phases"]["rest"] = [row[name]["wall"] - sum(clock.wall[k] for k in tops),
                                               row[name]["cpu"] - sum(clock.cpu[k] for k in tops)]
        rows.append(row)
    ckpt.close()
    end_rank(rank, Path(work, "rounds.json"), rows)


def probe(size_mib: int, rounds: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work = tempfile.mkdtemp(prefix="fastio-restore-probe-")
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, port, work, size_mib, rounds)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        rows = json.loads(Path(work, "rounds.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summarise(rows)


def summarise(rows: list[dict]) -> dict:
    """Medians over the rounds: totals, the paired ratio, each phase's wall and CPU, the collectives."""
    def med(values) -> float:
        return statistics.median(values)

    out: dict = {"rounds": rows, "ratio_wall": med(r["fastio"]["wall"] / r["dcp"]["wall"] for r in rows),
                 "ratio_cpu": med(r["fastio"]["cpu"] / r["dcp"]["cpu"] for r in rows)}
    for name in ("fastio", "dcp"):
        labels = list(dict.fromkeys(k for r in rows for k in r[name]["phases"]))
        out[name] = {"wall": med(r[name]["wall"] for r in rows), "cpu": med(r[name]["cpu"] for r in rows),
                     "phases": {k: [med(r[name]["phases"].get(k, [0, 0])[i] for r in rows) for i in (0, 1)]
                                for k in labels},
                     "collectives": rows[-1][name]["collectives"]}
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="the model's state, MiB")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (fastio and dcp.load, order alternating)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rounds and medians here as JSON")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    result = probe(args.size_mib, args.rounds)
    for name in ("fastio", "dcp"):
        r = result[name]
        print(f"{name}: wall {r['wall']:.3f} s, cpu {r['cpu']:.3f} s; collectives {r['collectives']}")
        for label, (w, c) in r["phases"].items():
            print(f"  {label:28s} wall {w:.3f}  cpu {c:.3f}")
    print(f"paired ratio (median of rounds): wall {result['ratio_wall']:.2f}, cpu {result['ratio_cpu']:.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "restore_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
