"""Helpers every benchmark shares: interleaved timing, medians and ratios, machine facts, JSON results."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.quiet import Quiet, add_wait_option

__all__ = ["RESULTS_DIR", "interleaved", "machine_info", "median_ratio", "met", "section_parser", "time_call",
           "verdict", "write_results"]

# Where a run writes its results: bench/out/ (not tracked by git). bench/results/ holds the reference results
# someone chose to commit (copy them there from bench/out/ by hand).
RESULTS_DIR = Path(__file__).resolve().parent / "out"


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work when ``device`` is ``"cuda"`` (a timing of GPU work ends there)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int,
                before: Callable[[str], Any] | None = None) -> dict[str, list[float]]:
    """Time each of ``runs`` ``repeats`` times, alternating between them so that drift in machine
    load hits all alike; ``before(name)`` (untimed) runs ahead of each timed call."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            if before is not None:
                before(name)
            times[name].append(time_call(fn))
    return times


def median_ratio(ours: list[float], peer: list[float]) -> dict[str, float]:
    """Median seconds of each side and ``speedup`` = peer median / our median (> 1: we are faster)."""
    ours_s, peer_s = statistics.median(ours), statistics.median(peer)
    return {"ours_median_s": ours_s, "peer_median_s": peer_s, "speedup": peer_s / ours_s}


def met(ratio: dict[str, Any]) -> bool:
    """Whether a ratio ``{"value", "target", "better": "higher"|"lower"}`` meets its target."""
    higher = ratio.get("better", "higher") == "higher"
    return ratio["value"] >= ratio["target"] if higher else ratio["value"] <= ratio["target"]


def verdict(ratio: dict[str, Any], *conditions: Quiet | dict | None) -> str:
    """``met`` or ``MISSED``; where one of ``conditions`` (:class:`bench.quiet.Quiet`, or its dict from a JSON
    result) found the machine busy, no verdict but what kept it busy, and what the figure would say."""
    word = "met" if met(ratio) else "MISSED"
    notes = [c.note() for c in (Quiet(**c) if isinstance(c, dict) else c for c in conditions if c) if c.busy]
    return f"not judged, {'; '.join(notes)}; as measured: {word}" if notes else word


def cores() -> int:
    """The CPUs this process may run on (:func:`fastio.dist.usable_cpus`): what every section counts its cores,
    workers and threads by."""
    from fastio.dist import usable_cpus

    return len(usable_cpus())


def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": cores(),
            "processor": platform.processor() or platform.machine()}


def write_results(name: str, data: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``results_dir/NAME.json`` atomically and return its path."""
    from fastio.storage.atomic import atomic_write_bytes

    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    atomic_write_bytes(path, json.dumps(data, indent=2, sort_keys=True).encode() + b"\n")
    return path


def section_parser(doc: str, repeats: int | None = 3) -> argparse.ArgumentParser:
    """The command line every section's module shares: its description (``doc``'s first paragraph), ``--repeats``
    (unless None), ``--out DIR`` (where the results go) and ``--quiet-wait`` (:mod:`bench.quiet`)."""
    p = argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=f"rounds per measurement (default {repeats})")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, metavar="DIR",
                   help="where the results go (default: bench/out)")
    add_wait_option(p)
    return p
