"""`make bench`: every section in one run, each comparing fastio with its peer; ratios, JSON and a plot.

Usage: python -m bench.run [--only SECTION,...] [--repeats N] [--out DIR] [--quiet-wait SECONDS] [--tiny]
                           [--checkpoint-mib MIB]
Writes bench/out/ (not tracked by git; --out DIR elsewhere): each section's SECTION.json (written by the section
as it ends), summary.json (this run's sections, plus the last results of sections not run this time, each with
its start time and what the other processes used of the cores before and during it) and summary.png.
bench/results/ holds reference results that someone chose to commit. Before each section it waits for a quiet
machine (bench/quiet.py); a ratio measured while other processes kept the cores busy gets no verdict, only
that note. ``--tiny``: the sections whose ``run`` takes ``tiny`` (image_text) run at their smallest size, a check
that they run, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import sys
import time
import traceback
from pathlib import Path

from bench.common import cores, met, section_parser, verdict
from bench.quiet import before_section, during, read_sample, readings
from fastio.storage.atomic import atomic_write_bytes

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "work"
# The sections, in the order they run: each is the module bench/NAME.py with run(workdir, repeats=) -> dict.
SECTIONS = (
    "convert",
    "loader",
    "checkpoint",
    "scale",
    "storage",
    "mixture",
    "index",
    "tokens",
    "chat",
    "image_text",
    "media",
    "restart",
    "torchft_steps",
)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(sec, r) for sec, res in summary["sections"].items() for r in res.get("ratios", [])]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.8))
    names = [f"{sec}: {r['name']}" for sec, r in rows]
    values = [max(r["value"], 1e-3) for _, r in rows]  # a log axis: a ratio of 0 is drawn at 0.001
    busy = {sec for sec, res in summary["sections"].items()
            if any(q and q["busy"] for q in res.get("machine_quiet", {}).values())}
    colors = ["tab:gray" if sec in busy or any(q["busy"] for q in readings(r.get("quiet")))
              else "tab:green" if met(r) else "tab:red" for sec, r in rows]
    y = range(len(rows))
    # Bars grow from 1 (parity) on a log axis, so 0.16 and 31x are both visible and symmetric about parity.
    ax.set_xscale("log")
    ax.barh(y, [v - 1 for v in values], left=1, color=colors)
    ax.axvline(1, color="grey", lw=0.8)
    for i, (_, r) in enumerate(rows):
        ax.plot([r["target"], r["target"]], [i - 0.4, i + 0.4], color="black", lw=2)
        sign = ">=" if r["better"] == "higher" else "<="
        ax.text(max(values[i], r["target"], 1) * 1.15, i, f"{r['value']:.3g} (target {sign} {r['target']})",
                va="center", fontsize=8)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    lo, hi = min(values + [r["target"] for _, r in rows]), max(values + [r["target"] for _, r in rows])
    ax.set_xlim(min(lo, 1) / 2, max(hi, 1) * 40)  # room on the right for the labels
    ax.set_xlabel("ratio, log scale (fastio vs peer; 1 = parity)\n"
                  "black bar = target; green = met, red = missed, gray = not judged (machine busy)")
    runs = sorted({res.get("repeats", "?") for res in summary["sections"].values()}, key=str)
    ax.set_title(f"fastio bench, {summary['host']['cpus']} CPUs, medians of {'/'.join(map(str, runs))} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.run``: the sections' (``--repeats``, ``--out``, ``--quiet-wait``) and
    ``--only``."""
    p = section_parser(__doc__)
    p.add_argument("--only", default=",".join(SECTIONS), metavar="SECTION,...",
                   help=f"comma-separated sections to run, of: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--tiny", action="store_true",
                   help="sections that have a smallest size (image_text) run at it: checks that they run")
    p.add_argument("--checkpoint-mib", type=int, default=None, metavar="MIB",
                   help="the checkpoint section's state size (MiB; default its own: 1024, and 512 for the cadence "
                        "and CPU rows); a small one makes a quick run")
    return p


def section_options(module: object, args: argparse.Namespace) -> dict:
    """The options beyond ``repeats`` and ``results_dir`` that section ``module``'s ``run`` accepts: ``quiet_wait``
    (a section that waits before each of its measurements), ``tiny`` when asked for, and, for the checkpoint
    section, its state size."""
    accepted = inspect.signature(module.run).parameters
    options = {"quiet_wait": args.quiet_wait, **({"tiny": True} if args.tiny else {})}
    if args.checkpoint_mib is not None and module.__name__ == "bench.checkpoint":
        options.update(size_mib=args.checkpoint_mib, cadence_mib=args.checkpoint_mib)
    return {k: v for k, v in options.items() if k in accepted}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}; the sections are: {', '.join(SECTIONS)}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    # Sections not run now keep their last results (each records when it ran and how many repeats).
    previous = json.loads(summary_path.read_text()).get("sections", {}) if summary_path.exists() else {}
    summary = {"host": {"cpus": cores(), "python": platform.python_version(),
                        "machine": platform.machine()},
               "sections": {k: v for k, v in previous.items() if k in SECTIONS and k not in wanted}}
    failed = [name for name in wanted if not _run_section(name, args, summary)]
    print(f"\n=== summary (fastio vs peer, medians) ===\n{summary_lines(summary)}")
    atomic_write_bytes(summary_path, json.dumps(summary, indent=2, sort_keys=True).encode() + b"\n")
    plot(summary, out / "summary.png")
    print(f"\nwrote {summary_path} and {out / 'summary.png'}")
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _run_section(name: str, args: argparse.Namespace, summary: dict) -> bool:
    """Wait for a quiet machine, run section ``name`` into ``summary`` (with what the other processes used of the
    cores before and during it); False if it failed."""
    print(f"\n=== {name} ===", flush=True)
    module = importlib.import_module(f"bench.{name}")
    before = before_section(args.quiet_wait)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    start = read_sample()
    try:
        result = module.run(WORK / name, repeats=args.repeats, results_dir=args.out, **section_options(module, args))
    except Exception:
        traceback.print_exc()
        return False
    quiet = {"before": before.as_dict(), "during": during(start, read_sample()).as_dict()}
    summary["sections"][name] = {**result, "started": started, "repeats": args.repeats, "machine_quiet": quiet}
    return True


def summary_lines(summary: dict) -> str:
    """One line per ratio of every section: its value, target and verdict (none where the machine was busy)."""
    lines = []
    for name in (s for s in SECTIONS if s in summary["sections"]):
        result = summary["sections"][name]
        when = f"(ran {result.get('started', '?')}, {result.get('repeats', '?')} repeats)"
        quiet = result.get("machine_quiet", {})
        for r in result.get("ratios", []):
            sign = ">=" if r["better"] == "higher" else "<="
            conditions = (quiet.get("before"), quiet.get("during"), *readings(r.get("quiet")))
            lines.append(f"{name:>10}  {r['name']:<48} {r['value']:7.3f}   target {sign} {r['target']:<5} "
                         f"{verdict(r, *conditions)} {when}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
