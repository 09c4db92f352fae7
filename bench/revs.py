"""Two revisions of fastio in one run, in paired rounds: what a change costs, measured honestly.

``python -m bench.revs OLD [NEW] [--repeats N] [--only loader,tokens,video,convert] [--out DIR]`` (NEW: the
working tree, uncommitted changes included) exports each named revision with ``git archive`` into a temporary
folder outside the repository (removed at the end). Each round waits for a quiet machine (:mod:`bench.quiet`),
then runs every workload once per revision, OLD first in odd rounds and NEW first in even ones, each run in a fresh
``python`` of this venv with ``PYTHONPATH`` set to that revision's tree (``bench/revs_child.py``, which refuses to
run when ``fastio.__file__`` is not under it). Workloads (each run a few seconds at ``--size small``):

- ``loader``: one epoch of ``fastio.Loader`` with the image-train transform at 224 px, batches of 64 (samples/s,
  and CPU seconds per sample from the process's CPU times);
- ``tokens``: one epoch of ``fastio.Tokens`` with ``packing="best-fit"``, seq_len 2048 (input tokens/s);
- ``video``: one epoch of ``fastio.VideoClips`` (16 frames, stride 2, 112 px; clips/s);
- ``convert``: ``fastio convert`` (the revision's CLI, ``--workers 2``) of an image folder (samples/s).

All revisions read the same datasets, made once by NEW's converter, after a check that OLD reads one batch of
each; where OLD cannot, that workload's data is made per revision (each by its own converter) and the result says
so. Per workload: the median over rounds of the paired ratio NEW/OLD of each figure (throughput: > 1 is NEW
faster; CPU per sample: < 1 is NEW cheaper), the verdict ``met`` when NEW's throughput is at least
``1 - tolerance`` of OLD's, ``MISSED`` when not, and ``not judged, machine busy: ...`` where a round found the
machine busy. Writes ``DIR/revs.json`` (default ``bench/out/``); sources are kept in ``bench/out/revs-data/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, machine_info, section_parser, verdict, write_results
from bench.quiet import Quiet, during, read_sample, wait_quiet

__all__ = ["Revision", "compare", "compiled", "export", "main", "parser", "summarise"]

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "revs_child.py"
WORKLOADS = ("loader", "tokens", "video", "convert")
UNITS = {"loader": "samples/s", "tokens": "tokens/s", "video": "clips/s", "convert": "samples/s"}
SIZES = {  # photos (loader and convert), token documents, seq_len, videos, frames per video
    "small": dict(photos=600, docs=20_000, seq_len=2048, videos=24, frames=150),
    "tiny": dict(photos=80, docs=200, seq_len=128, videos=8, frames=40),
}
TOLERANCE = 0.05


@dataclass(frozen=True)
class Revision:
    """A revision to measure: its ``label`` (what the user named, or ``working tree``), ``commit`` and ``tree``
    (the folder ``PYTHONPATH`` names)."""

    label: str
    commit: str
    tree: Path


def _git(*args: str) -> str:
    proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ValueError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def export(rev: str, into: Path) -> Revision:
    """Revision ``rev`` exported (``git archive``) into a new folder under ``into``; ValueError naming ``rev``
    where git does not know it."""
    try:
        commit = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except ValueError:
        raise ValueError(f"revision {rev!r}: not a commit of {REPO}") from None
    tree = Path(tempfile.mkdtemp(prefix=f"rev-{commit[:10]}-", dir=into))
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise ValueError(f"revision {rev!r}: git archive failed")
    return Revision(rev, commit, tree)


def compiled(rev: Revision) -> Revision:
    """``rev`` with its packages' bytecode written (``compileall``): an exported tree has none, and where
    ``PYTHONDONTWRITEBYTECODE`` is set no run writes it, so each of its processes would compile fastio again (about
    a second of CPU, counted in a workload that starts a process, as convert's CLI: it made an older revision look
    ~20-40 % slower in convert's rounds)."""
    for package in ("fastio", "converters"):
        if (rev.tree / package).is_dir():
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(rev.tree / package)], check=True,
                           stdout=subprocess.DEVNULL)
    return rev


def working_tree() -> Revision:
    return Revision("working tree", _git("rev-parse", "HEAD") + "+", REPO)


def child(rev: Revision, workload: str, data: Path, seq_len: int, out: Path | None = None,
          check: bool = False) -> dict[str, Any]:
    """One run of ``workload`` in a fresh process importing ``rev``'s fastio; its JSON figures."""
    env = {**os.environ, "PYTHONPATH": str(rev.tree)}
    cmd = [sys.executable, str(CHILD), workload, str(data), str(rev.tree), "--seq-len", str(seq_len)]
    cmd += ["--out", str(out)] if out is not None else []
    cmd += ["--check"] if check else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=rev.tree, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise RuntimeError(f"{workload} on {rev.label} ({rev.commit[:10]}): {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- data -------------------------------------------------------------------------------------------------------

def sources(cache: Path, size: str, only: tuple[str, ...]) -> dict[str, Path]:
    """The inputs (made by this checkout, kept in ``cache``): ``photos`` (an image folder), ``corpus`` (JSONL) and
    its ``tokenizer``, ``videos`` (a folder of VP9 ``.webm``)."""
    from bench.convert import make_photos

    s, root = SIZES[size], cache / size
    out = {}
    if {"loader", "convert"} & set(only):
        out["photos"] = make_photos(root / "photos", s["photos"])
    if "tokens" in only:
        out["corpus"], out["tokenizer"] = _corpus(root, s["docs"])
    if "video" in only:
        out["videos"] = _videos(root / "videos", s["videos"], s["frames"])
    return out


def _corpus(root: Path, docs: int) -> tuple[Path, Path]:
    from bench.tokens import make_corpus

    corpus, tok = root / f"corpus-{docs}.jsonl", root / "tokenizer.json"
    if not (corpus.is_file() and tok.is_file()):
        root.mkdir(parents=True, exist_ok=True)
        make_corpus(root, docs)
    return corpus, tok


def _videos(root: Path, count: int, frames: int) -> Path:
    from bench.media import _video

    for i in range(count):
        path = root / f"c{i % 2}" / f"v{i:04d}.webm"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _video(path, i, frames=frames)
    return root


def make_dataset(rev: Revision, src: dict[str, Path], workload: str, dest: Path) -> Path:
    """``workload``'s dataset made by ``rev``'s ``fastio convert`` into ``dest``."""
    source = {"loader": src.get("photos"), "tokens": src.get("corpus"), "video": src.get("videos")}[workload]
    cmd = [sys.executable, "-m", "fastio.cli", "convert", str(source), str(dest), "--quiet", "--overwrite"]
    cmd += ["--tokenizer", str(src["tokenizer"])] if workload == "tokens" else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=rev.tree, check=False,
                          env={**os.environ, "PYTHONPATH": str(rev.tree)})
    if proc.returncode != 0:
        raise RuntimeError(f"fastio convert {source} by {rev.label}: {proc.stderr.strip()[-400:]}")
    return dest


def datasets(old: Revision, new: Revision, src: dict[str, Path], only: tuple[str, ...], tmp: Path,
             seq_len: int) -> tuple[dict, dict[str, str]]:
    """Per workload and revision label, the dataset it reads: NEW's, where OLD reads one batch of it; else each
    revision's own. And per workload a line saying which."""
    data, made = {}, {}
    for w in (w for w in only if w != "convert"):
        shared = make_dataset(new, src, w, tmp / f"{w}-new")
        try:
            child(old, w, shared, seq_len, check=True)
            data[w], made[w] = {old.label: shared, new.label: shared}, f"made by NEW ({new.label}), read by both"
        except RuntimeError as e:
            own = make_dataset(old, src, w, tmp / f"{w}-old")
            data[w] = {old.label: own, new.label: shared}
            made[w] = f"made per revision, each by its own converter (OLD could not read NEW's: {e})"
    if "convert" in only:
        data["convert"] = {old.label: src["photos"], new.label: src["photos"]}
        made["convert"] = "the same image folder for both"
    return data, made


# -- rounds -----------------------------------------------------------------------------------------------------

def figures(workload: str, run: dict[str, Any]) -> dict[str, float]:
    """Throughput (``per_s``) and CPU seconds per item of one child run."""
    return {"per_s": run["items"] / run["seconds"], "cpu_per_item": run["cpu_s"] / max(run["items"], 1)}


def one_round(k: int, old: Revision, new: Revision, data: dict, tmp: Path, seq_len: int,
              quiet_wait: float) -> dict[str, Any]:
    """Round ``k`` (from 0): wait for a quiet machine, then each workload once per revision (OLD first when ``k``
    is even); the figures, and how quiet the machine was before and during it."""
    before = wait_quiet(max_wait=quiet_wait)
    start, runs = read_sample(), {}
    order = (old, new) if k % 2 == 0 else (new, old)
    for w, per_rev in data.items():
        runs[w] = {}
        for rev in order:
            out = tmp / f"convert-out-{'old' if rev is old else 'new'}" if w == "convert" else None
            runs[w][rev.label] = child(rev, w, per_rev[rev.label], seq_len, out=out)
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
    return {"order": [r.label for r in order], "runs": runs, "quiet_before": before.as_dict(),
            "quiet_during": during(start, read_sample()).as_dict()}


def round_lines(k: int, repeats: int, rnd: dict[str, Any], old: Revision, new: Revision) -> list[str]:
    lines = []
    for w, runs in rnd["runs"].items():
        a, b = figures(w, runs[old.label]), figures(w, runs[new.label])
        lines.append(f"round {k + 1}/{repeats} {w}: OLD {a['per_s']:,.1f} NEW {b['per_s']:,.1f} {UNITS[w]} "
                     f"(NEW/OLD {b['per_s'] / a['per_s']:.3f}); CPU ms/item OLD {a['cpu_per_item'] * 1e3:.3f} "
                     f"NEW {b['cpu_per_item'] * 1e3:.3f}; first: {rnd['order'][0]}")
    busy = [Quiet(**q).note() for q in (rnd["quiet_before"], rnd["quiet_during"]) if q["busy"]]
    return lines + ([f"round {k + 1}/{repeats}: {'; '.join(busy)}"] if busy else [])


def summarise(rounds: list[dict[str, Any]], old: str, new: str, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Per workload: the median over rounds of the paired ratios NEW/OLD (throughput, CPU per item) and the
    verdict on throughput (``not judged, machine busy: ...`` where a round was busy)."""
    conditions = [q for r in rounds for q in (r["quiet_before"], r["quiet_during"])]
    busiest = max(conditions, key=lambda q: (q["busy"], q["others"]))  # one note for the verdict, not one a round
    out = {}
    for w in rounds[0]["runs"]:
        pairs = [(figures(w, r["runs"][w][old]), figures(w, r["runs"][w][new])) for r in rounds]
        ratio = statistics.median(b["per_s"] / a["per_s"] for a, b in pairs)
        cpu_pairs = [b["cpu_per_item"] / a["cpu_per_item"] for a, b in pairs if a["cpu_per_item"] > 0]
        cpu = statistics.median(cpu_pairs) if cpu_pairs else None  # None: OLD's CPU time was too small to count
        out[w] = {"unit": UNITS[w], "ratio_new_over_old": ratio, "cpu_ratio_new_over_old": cpu,
                  "old_median": statistics.median(a["per_s"] for a, _ in pairs),
                  "new_median": statistics.median(b["per_s"] for _, b in pairs),
                  "verdict": verdict({"value": ratio, "target": 1 - tolerance, "better": "higher"}, busiest)}
    return out


def _ratio(value: float | None) -> str:
    return "not measurable" if value is None else f"{value:.3f}"


def summary_lines(summary: dict[str, Any], made: dict[str, str]) -> list[str]:
    return [f"{w}: NEW/OLD {s['ratio_new_over_old']:.3f} (median of paired rounds; OLD {s['old_median']:,.1f}, NEW "
            f"{s['new_median']:,.1f} {s['unit']}), CPU per item NEW/OLD {_ratio(s['cpu_ratio_new_over_old'])}: "
            f"{s['verdict']}; data {made[w]}" for w, s in summary.items()]


def compare(old_rev: str, new_rev: str | None = None, repeats: int = 3, only: tuple[str, ...] = WORKLOADS,
            size: str = "small", quiet_wait: float = 60.0, tolerance: float = TOLERANCE,
            cache: Path = RESULTS_DIR / "revs-data") -> dict[str, Any]:
    """Measure ``old_rev`` against ``new_rev`` (None: the working tree) in ``repeats`` paired rounds; the result
    (what :func:`main` writes), printing each round's lines as it goes."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    src = sources(cache, size, only)
    with tempfile.TemporaryDirectory(prefix="fastio-revs-") as tmp:
        tmp = Path(tmp)
        old = compiled(export(old_rev, tmp))
        new = compiled(working_tree() if new_rev is None else export(new_rev, tmp))
        if old.label == new.label:
            old = Revision(f"{old.label} (OLD)", old.commit, old.tree)
        seq_len = SIZES[size]["seq_len"]
        data, made = datasets(old, new, src, only, tmp, seq_len)
        rounds = []
        for k in range(repeats):
            rounds.append(one_round(k, old, new, data, tmp, seq_len, quiet_wait))
            print("\n".join(round_lines(k, repeats, rounds[-1], old, new)), flush=True)
        summary = summarise(rounds, old.label, new.label, tolerance)
    print("\n".join(summary_lines(summary, made)), flush=True)
    return {"benchmark": "revs", "old": {"label": old.label, "commit": old.commit},
            "new": {"label": new.label, "commit": new.commit}, "size": size, "repeats": repeats,
            "tolerance": tolerance, "data": made, "rounds": rounds, "summary": summary, "machine": machine_info()}


def _workloads(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--only {text!r}: choose from {','.join(WORKLOADS)}")
    return names


def parser() -> argparse.ArgumentParser:
    p = section_parser(__doc__)
    p.prog = "python -m bench.revs"
    p.add_argument("old", metavar="OLD", help="the revision before the change (a commit, tag or branch)")
    p.add_argument("new", metavar="NEW", nargs="?", default=None,
                   help="the revision after it (default: the working tree, uncommitted changes included)")
    p.add_argument("--only", type=_workloads, default=WORKLOADS, metavar="LIST",
                   help=f"comma-separated workloads (default: {','.join(WORKLOADS)})")
    p.add_argument("--size", choices=tuple(SIZES), default="small", help="workload size (tiny: a smoke test)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"met when NEW/OLD throughput >= 1 - this (default {TOLERANCE})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result = compare(args.old, args.new, args.repeats, args.only, args.size, args.quiet_wait, args.tolerance)
    except (ValueError, RuntimeError) as e:
        print(f"bench.revs: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {write_results('revs', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
