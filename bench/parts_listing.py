"""What it costs every part of a conversion in parts to list the source itself: scan + listing digest.

    python -m bench.parts_listing --files 1000000 [--per-class 1000] [--work DIR]

Creates FILES empty ``.jpg`` files in ImageNet layout (the scan never opens an image), then times what each
``fastio convert --part K/N`` does before converting: ``fastio.converters.scan`` (sorted directory walk, one
stat per file), ``fastio.convert.parts.listing_digest`` and ``fastio.convert.parts.predicted_shard_starts`` (one more stat
per file). Prints per-file costs and the extrapolation to 10^8 files.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from fastio import converters
from fastio.convert.parts import listing_digest, predicted_shard_starts


def make_tree(root: Path, files: int, per_class: int) -> None:
    for c in range(-(-files // per_class)):
        folder = root / f"class{c:05d}"
        folder.mkdir(parents=True)
        for i in range(min(per_class, files - c * per_class)):
            (folder / f"img{i:07d}.jpg").touch()


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.parts_listing``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--per-class", type=int, default=1000)
    p.add_argument("--work", type=Path, default=None, help="where to create the tree (default: a temp dir)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fastio-listing-", dir=args.work))
    try:
        t0 = time.perf_counter()
        make_tree(work / "src", args.files, args.per_class)
        t1 = time.perf_counter()
        scan = converters.scan(work / "src", "imagefolder")
        t2 = time.perf_counter()
        digest = listing_digest(scan)
        t3 = time.perf_counter()
        predicted_shard_starts(scan.entries, 256 * 10**6, None)
        t4 = time.perf_counter()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        n = len(scan.entries)
        result = {"files": n, "create_s": round(t1 - t0, 2), "scan_s": round(t2 - t1, 2),
                  "digest_s": round(t3 - t2, 2), "scan_us_per_file": round((t2 - t1) / n * 1e6, 2),
                  "digest_us_per_file": round((t3 - t2) / n * 1e6, 2), "predict_s": round(t4 - t3, 2),
                  "predict_us_per_file": round((t4 - t3) / n * 1e6, 2), "peak_rss_bytes_per_file": rss // n,
                  "extrapolated_1e8": {"per_part_s": round((t4 - t1) / n * 1e8),
                                       "memory_gb": round(rss / n * 1e8 / 1e9, 1)},
                  "digest": digest[:16]}
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
