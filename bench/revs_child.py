"""One workload of ``bench.revs`` in a fresh process, against the fastio that ``PYTHONPATH`` names.

``python bench/revs_child.py WORKLOAD DATA EXPECT [--seq-len N] [--out DIR] [--check]`` imports fastio, refuses
(exit 3, one line) when ``fastio.__file__`` is not under ``EXPECT`` (the revision's tree), runs ``WORKLOAD`` once on
``DATA`` and prints one JSON line: ``items`` delivered, wall ``seconds``, process ``cpu_s`` (all threads, and
reaped children: the convert CLI's workers), the ``spelling`` of the options that worked. ``--check`` reads one
batch only (can this revision read that dataset?). It imports nothing from ``bench`` and takes its own folder off
``sys.path`` before any import, so every fastio it touches is the revision's own.

The options a revision takes may be spelled differently (``pipeline=fastio.ImageTrain(size=224)`` now,
``pipeline="image-train", image_size=224`` before): each workload tries the spellings in order and keeps the first
one the revision accepts (feature detection, no version numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIZE, BATCH = 224, 64
FRAMES, STRIDE, CLIP_SIZE, CLIP_BATCH = 16, 2, 112, 8
TOKEN_BATCH = 8
COMMON = dict(device="cpu", world_size=1, rank=0, seed=0)


def _cpu() -> float:
    """CPU seconds of this process (all threads, at the clock's nanosecond resolution: ``os.times`` counts 10 ms
    ticks, and a tiny workload takes less) plus its reaped children's."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _first_loader(fastio, dest: str, spellings: list[tuple[str, callable]], batch_size: int):
    """``fastio.Loader(dest, **spelling())`` for the first spelling this revision accepts, and its name."""
    errors = []
    for name, make in spellings:
        try:
            return fastio.Loader(dest, batch_size=batch_size, **COMMON, **make()), name
        except (TypeError, AttributeError, ValueError) as e:  # not this revision's spelling
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise SystemExit(f"revs_child: no option spelling works on this revision: {'; '.join(errors)}")


def _delivered(batch) -> int:
    """Samples in a batch that are not padding."""
    return int((~batch["padded"]).sum()) if "padded" in batch else len(batch["label"])


def _image(fastio, dest: str, seq_len: int):
    return _first_loader(fastio, dest, [
        ("pipeline=fastio.ImageTrain(size=224)", lambda: {"pipeline": fastio.ImageTrain(size=SIZE)}),
        ("pipeline='image-train', image_size=224", lambda: {"pipeline": "image-train", "image_size": SIZE}),
    ], BATCH), _delivered


def _tokens(fastio, dest: str, seq_len: int):
    return _first_loader(fastio, dest, [
        ("pipeline=fastio.Tokens(seq_len, packing='best-fit')",
         lambda: {"pipeline": fastio.Tokens(seq_len=seq_len, packing="best-fit")}),
        ("pipeline='tokens', seq_len, packing='best-fit'",
         lambda: {"pipeline": "tokens", "seq_len": seq_len, "packing": "best-fit"}),
    ], TOKEN_BATCH), lambda b: int(b["tokens"][:, :-1].numel())


def _video(fastio, dest: str, seq_len: int):
    opts = dict(frames=FRAMES, stride=STRIDE, size=CLIP_SIZE, crop="center", dtype="uint8", layout="FCHW")
    return _first_loader(fastio, dest, [
        ("pipeline=fastio.VideoClips(...)", lambda: {"pipeline": fastio.VideoClips(**opts)}),
        ("pipeline='video-clips', ...", lambda: {"pipeline": "video-clips", **opts}),
    ], CLIP_BATCH), _delivered


LOADERS = {"loader": _image, "tokens": _tokens, "video": _video}


def run_loader(workload: str, dest: str, seq_len: int, check: bool) -> dict:
    """One epoch (``check``: one batch) of ``workload``'s Loader, made untimed before."""
    import fastio

    (loader, spelling), count = LOADERS[workload](fastio, dest, seq_len)
    items, cpu, start = 0, _cpu(), time.perf_counter()
    for batch in loader:
        items += count(batch)
        if check:
            break
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    loader.close()
    return {"items": items, "seconds": seconds, "cpu_s": cpu, "spelling": spelling}


def run_convert(src: str, out: str) -> dict:
    """``fastio convert SRC OUT --workers 2`` of this revision, its CLI in a child process (start-up counted)."""
    files = sum(1 for p in Path(src).rglob("*") if p.is_file())
    cmd = [sys.executable, "-m", "fastio.cli", "convert", src, out, "--workers", "2", "--quiet", "--overwrite"]
    cpu, start = _cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"revs_child: fastio convert {src} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return {"items": files, "seconds": seconds, "cpu_s": cpu, "spelling": "fastio convert SRC DEST --workers 2"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=[*LOADERS, "convert"])
    p.add_argument("data", help="the dataset (convert: the image folder)")
    p.add_argument("expect", help="the revision's tree: fastio must be imported from under it")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", default=None, help="convert: where its output goes")
    p.add_argument("--check", action="store_true", help="read one batch only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import fastio

    where, expect = Path(fastio.__file__).resolve(), Path(args.expect).resolve()
    if expect not in where.parents:
        print(f"revs_child: fastio imported from {where}, not from the revision's tree {expect}", file=sys.stderr)
        return 3
    if args.workload == "convert":
        result = run_convert(args.data, args.out)
    else:
        result = run_loader(args.workload, args.data, args.seq_len, args.check)
    print(json.dumps({**result, "fastio": str(where)}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # bench/ (its tokens.py, convert.py, ...) must not shadow what the revision imports
    sys.exit(main())
