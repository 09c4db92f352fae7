"""Where a save's time goes from the save call to its completion: the Checkpointer's phases against the minimal writer's.

No training runs: each round makes one save of the Checkpointer (``keep=1``, its defaults) and one of
:class:`bench.checkpoint_peers.MinimalWriter`, alternating in one process (so that a busy host slows both alike),
over the model and Adam state :mod:`bench.checkpoint_overhead` trains (``bench.model.build``). Each save is
timed from the save call to the return of the caller's wait (``Checkpointer.wait``, ``MinimalWriter.wait``:
what the end-of-window wait of the overhead benchmark waits for), and its phases are timestamped by wrapping
the functions that do them (the library carries no timers):

- fastio: ``stage`` (the save call), ``engine`` (the engine's write), ``commit`` (``publish.commit``: inside it
  ``files`` (each file's checksum and flush, a span over the commit's threads), ``dirs`` (the directories'
  fsyncs), ``marker`` (the commit marker written and fsynced), the rest being the rename and its fsync),
  ``retention`` (expired steps hidden and, where it still runs on the write's path, deleted), and ``delete``
  (the expired steps' files deleted, wherever that runs);
- minimal: ``stage``, ``write`` (hash and write), ``fsync``, ``rename``.

Wall seconds per phase (``perf_counter``), and CPU seconds (user + system of the whole process, ``getrusage``) of
the phases that run one at a time while the caller waits (``engine``, ``commit``, ``retention``, the total):
the calling thread sleeps in its wait then, so the process's CPU is the write's. Medians over the rounds.

    python -m bench.checkpoint_phases [--size-mib 512] [--rounds 5] [--gap 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.model import build, train_step

__all__ = ["phases"]


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


class _Timeline:
    """Events ``(name, start, end, cpu or None)`` of one save, recorded by wrapped functions on any thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, float | None]] = []
        self.lock = threading.Lock()

    def wrap(self, name: str, fn: Callable, *, cpu: bool = False) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            c, t = (_cpu() if cpu else None), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                end = time.perf_counter()
                with self.lock:
                    self.events.append((name, t, end, _cpu() - c if cpu else None))
        return timed


@contextmanager
def _patched(targets: list[tuple[Any, str, str, bool]], line: _Timeline) -> Iterator[None]:
    """Wrap ``getattr(obj, attr)`` as event ``name`` (with CPU when asked) for the duration; attributes a version
    of the library lacks are skipped."""
    saved = []
    for obj, attr, name, cpu in targets:
        if hasattr(obj, attr):
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, line.wrap(name, getattr(obj, attr), cpu=cpu))
    try:
        yield
    finally:
        for obj, attr, fn in reversed(saved):
            setattr(obj, attr, fn)


def _fastio_targets() -> list[tuple[Any, str, str, bool]]:
    from fastio.checkpoint import publish, removal, retention
    from fastio.checkpoint.engines import torchsnapshot_engine

    # apply_retention: the name before retention's deletion left the save's path (to time older revisions too)
    return [(torchsnapshot_engine.TorchSnapshotEngine, "save", "engine", True), (publish, "commit", "commit", True),
            (publish, "_hash_and_sync", "files", False), (publish, "fsync_dir", "dirs", False),
            (publish, "atomic_write_bytes", "marker", False), (retention, "apply_retention", "retention", True),
            (retention, "expire", "retention", True), (removal, "finish_removal", "delete", True),
            (shutil, "rmtree", "delete", False)]


def _minimal_targets(peers: types.ModuleType) -> tuple[list, Callable[[], None]]:
    """The minimal writer's ``os.fsync`` and ``os.replace``, through a stand-in for its module's ``os``."""
    fake = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    real = peers.os
    peers.os = fake
    return [(fake, "fsync", "fsync", False), (fake, "replace", "rename", False)], lambda: setattr(peers, "os", real)


_SPANS = ("files", "delete")
"""Phases whose events overlap (the commit's threads; a deletion's nested calls): their first start to last end. The
others are summed."""
_IN_COMMIT = ("files", "dirs", "marker")
"""Phases counted only inside the commit (``fsync_dir`` also makes the temporary durable before the engine writes)."""


def _one(save: Callable[[], None], wait: Callable[[], None]) -> dict[str, float]:
    """One save: the save call, then the wait; its times (the phases are read from the timeline afterwards)."""
    t0, c0 = time.perf_counter(), _cpu()
    save()
    staged = time.perf_counter()
    wait()
    end = time.perf_counter()
    return {"t0": t0, "waited": end, "stage_wall": staged - t0, "total_wall": end - t0, "total_cpu": _cpu() - c0}


def _phase_rows(line: _Timeline, saves: list[dict[str, float]], until: float) -> list[dict[str, float]]:
    """Each save's row: its times and the span of each phase whose events start between its call and the next
    save's; ``after_wait_wall``: how long its events went on past its wait's return (0 when the wait covered them)."""
    rows = []
    for i, got in enumerate(saves):
        end = saves[i + 1]["t0"] if i + 1 < len(saves) else until
        events = [e for e in line.events if got["t0"] <= e[1] < end]
        row = {k: v for k, v in got.items() if k not in ("t0", "waited")}
        commit = min([e[1] for e in events if e[0] == "commit"], default=got["t0"])
        for name in sorted({e[0] for e in events}):
            mine = [e for e in events if e[0] == name and (name not in _IN_COMMIT or e[1] >= commit)]
            row[f"{name}_wall"] = (max(e[2] for e in mine) - min(e[1] for e in mine) if name in _SPANS
                                   else sum(e[2] - e[1] for e in mine))
            cpu = [e[3] for e in mine if e[3] is not None]
            if cpu:
                row[f"{name}_cpu"] = sum(cpu)
        row["after_wait_wall"] = max([0.0] + [e[2] - got["waited"] for e in events])
        rows.append(row)
    return rows


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 4) for k in keys}


def phases(work: Path, size_mib: int = 512, rounds: int = 5, gap: float = 0.0) -> dict:
    """Per saver the median wall (and CPU where measured) seconds of each phase over ``rounds`` alternating saves,
    after one untimed save each; ``gap`` seconds idle after each save (as the overhead benchmark's window without
    saves after a saver's: work a save left in the background runs there, not in the next saver's save)."""
    import bench.checkpoint_peers as peers
    from fastio.checkpoint import Checkpointer

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model, optim = build(size_mib)
    train_step(model, optim)
    app = {"model": model, "optim": optim}
    ckpt = Checkpointer(work / "fastio", keep=1, signals=())
    minimal = peers.MinimalWriter(work / "minimal" / "state.bin")
    line = _Timeline()
    fake_targets, restore_os = _minimal_targets(peers)
    saves: dict[str, list] = {"fastio": [], "minimal": []}
    step = [0]

    def fastio_save() -> None:
        step[0] += 1
        ckpt.save(step[0], app)

    def minimal_save() -> None:
        minimal.save({k: v.state_dict() for k, v in app.items()})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the overhead benchmark trains
    try:
        with _patched(_fastio_targets() + fake_targets, line):
            for _ in range(rounds + 1):
                for name, save, wait in (("fastio", fastio_save, ckpt.wait), ("minimal", minimal_save, minimal.wait)):
                    saves[name].append(_one(save, wait))
                    time.sleep(gap)
            ckpt.close()
            until = time.perf_counter()
    finally:
        restore_os()
        torch.set_num_threads(threads)
    shutil.rmtree(work, ignore_errors=True)
    order = sorted(saves["fastio"] + saves["minimal"], key=lambda g: g["t0"])
    out: dict[str, Any] = {"size_mib": size_mib, "rounds": rounds, "gap": gap}
    rows = _phase_rows(line, order, until)
    for name, got in saves.items():  # the first round warms: buffers allocated, files written once
        out[name] = _medians([rows[order.index(g)] for g in got[1:]])
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint_phases``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gap", type=float, default=0.0, help="seconds idle after each save")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "phases")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(json.dumps(phases(args.workdir, args.size_mib, args.rounds, args.gap), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
