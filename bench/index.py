"""Index benchmark: ``fastio index`` against DALI's ``wds2idx`` over the same WebDataset shards.

Both read every shard once. ``wds2idx`` (run once per shard, as its users do) lists each tar twice with GNU
``tar`` and writes the ``.idx``; ``fastio index --dest`` (one process for all shards, ``--threads 1`` so that
both read one shard at a time) reads each tar's headers, checksums it (sha256 + xxh3-128: what ``verify`` and
the S3 cache check), writes each ``.idx``, ``samples.fxi`` and the manifest. Runs are interleaved; medians;
shards/s and MB/s of each, and the ratio (fastio shards/s over wds2idx's).

``python bench/index.py [--repeats N] [--shards N] [--samples-per-shard N]`` writes ``bench/out/index.json``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import RESULTS_DIR, interleaved, machine_info, median_ratio, section_parser, write_results
from bench.quiet import before_section

__all__ = ["run"]

TARGET = 1.0  # fastio does more per shard (two checksums, the consolidated index): at least as fast
BIN = Path(sys.executable).parent


def make_shards(workdir: Path, shards: int, per_shard: int) -> Path:
    """``workdir/wds-S-N``: ``shards`` tars by ``webdataset.ShardWriter`` of ``per_shard`` JPEG + cls samples."""
    import webdataset as wds

    from fastio.convert.synthetic import photo_jpeg

    folder = Path(workdir) / f"wds-{shards}-{per_shard}"
    if folder.is_dir() and len(list(folder.glob("*.tar"))) == shards:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sink.write({"__key__": f"img{i:07d}", "jpg": photo_jpeg(rng, 320, 240), "cls": str(i % 10).encode()})
    return folder


def run(workdir: Path, repeats: int = 3, shards: int = 32, per_shard: int = 100,
        results_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    """Time ``fastio index`` against ``wds2idx`` on the same shards, interleaved; write ``index.json`` under
    ``results_dir`` (None: nothing written), print one line and return the result."""
    workdir = Path(workdir)
    folder = make_shards(workdir, shards, per_shard)
    tars = sorted(folder.glob("*.tar"))
    total = sum(p.stat().st_size for p in tars)
    out = {"fastio": workdir / "out-fastio", "wds2idx": workdir / "out-wds2idx"}

    def fastio() -> None:
        subprocess.run([str(BIN / "fastio"), "index", str(folder), "--dest", str(out["fastio"]), "--threads", "1",
                        "-q"], check=True)

    def wds2idx() -> None:
        out["wds2idx"].mkdir(parents=True, exist_ok=True)
        for tar in tars:
            subprocess.run([str(BIN / "wds2idx"), str(tar), str(out["wds2idx"] / f"{tar.stem}.idx")], check=True,
                           capture_output=True)

    times = interleaved({"fastio": fastio, "wds2idx": wds2idx}, repeats,
                        before=lambda name: shutil.rmtree(out[name], ignore_errors=True))
    ratio = median_ratio(times["fastio"], times["wds2idx"])
    side = {name: {"median_s": ratio[key], "shards_per_s": len(tars) / ratio[key],
                   "mb_per_s": total / ratio[key] / 1e6, "seconds": times[name]}
            for name, key in (("fastio", "ours_median_s"), ("wds2idx", "peer_median_s"))}
    result = {
        "benchmark": "index", "shards": len(tars), "samples": len(tars) * per_shard, "bytes": total,
        "repeats": repeats, "fastio": {"command": "fastio index DIR --dest OUT --threads 1", **side["fastio"]},
        "wds2idx": {"command": "wds2idx TAR IDX, once per shard", **side["wds2idx"]},
        "speedup": ratio["speedup"], "target": TARGET, "machine": machine_info(),
        "ratios": [{"name": "index shards/s: fastio index / wds2idx", "value": ratio["speedup"], "target": TARGET,
                    "better": "higher"}],
    }
    path = write_results("index", result, results_dir) if results_dir is not None else None
    f, w = side["fastio"], side["wds2idx"]
    print(f"index: fastio {f['shards_per_s']:.1f} shards/s {f['mb_per_s']:.0f} MB/s vs wds2idx "
          f"{w['shards_per_s']:.1f} shards/s {w['mb_per_s']:.0f} MB/s: {ratio['speedup']:.2f}x "
          f"({len(tars)} shards, {total / 1e6:.0f} MB) -> {path}", flush=True)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.index``."""
    p = section_parser(__doc__)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "index")
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--samples-per-shard", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(args.workdir, args.repeats, args.shards, args.samples_per_shard, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
