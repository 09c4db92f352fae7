"""Conversion benchmark: ``fastio convert --workers 2`` (the real CLI, as a subprocess) against a
single-process loop over ``webdataset.ShardWriter`` writing the same image bytes and checking that
each decodes with PIL, as fastio does. Runs are interleaved; medians; the ratio is printed next to the
CPU seconds per 1,000 images of each side (all processes: fastio's CLI, its workers; the peer's loop),
the figure that does not depend on what else the machine runs.

    python -m bench.convert [--images N] [--repeats R]   # writes bench/out/convert.json
"""

from __future__ import annotations

import argparse
import io
import resource
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, interleaved, machine_info, median_ratio, section_parser, write_results
from bench.quiet import before_section
from fastio.convert.synthetic import photo_jpeg

__all__ = ["make_photos", "run", "run_fastio", "run_peer"]

CLASSES = ("class_a", "class_b", "class_c", "class_d")
TARGET = 1.7


def make_photos(dest: Path, count: int = 1500, seed: int = 0) -> Path:
    """``dest/<class>/<n>.jpg``: ``count`` JPEGs of 400x300 .. 640x480, the same bytes on every run.
    Reuses ``dest`` when a previous call left it complete."""
    done = dest.with_name(dest.name + ".complete")
    stamp = f"{count} images, seed {seed}, generator v2\n"
    if done.is_file() and done.read_text() == stamp:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = dest / CLASSES[i % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        width, height = int(rng.integers(400, 641)), int(rng.integers(300, 481))
        (folder / f"{i:06d}.jpg").write_bytes(photo_jpeg(rng, width, height))
    done.write_text(stamp)
    return dest


def run_fastio(src: Path, out: Path, workers: int = 2) -> None:
    """The real CLI in a fresh process (start-up included in the time)."""
    cmd = [sys.executable, "-m", "fastio.cli", "convert", str(src), str(out), "--workers", str(workers),
           "--quiet", "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fastio convert failed ({proc.returncode}): {proc.stderr.strip()}")


def cli_startup() -> None:
    """``fastio --version``: interpreter start plus every import the CLI makes before any work."""
    subprocess.run([sys.executable, "-m", "fastio.cli", "--version"], capture_output=True, check=True)


def run_peer(src: Path, out: Path) -> None:
    """The baseline: one process, read each image, decode it fully with PIL, write it with wds.ShardWriter."""
    import webdataset as wds
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    with wds.ShardWriter(str(out / "peer-%06d.tar"), maxsize=256 * 10**6, maxcount=10**9, verbose=0) as sink:
        for label, name in enumerate(classes):
            for path in sorted((src / name).iterdir()):
                data = path.read_bytes()
                Image.open(io.BytesIO(data)).load()
                sink.write({"__key__": f"{name}/{path.stem}", "jpg": data, "cls": str(label).encode()})


def run(workdir: Path, repeats: int = 3, images: int = 1500,
        results_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    """Generate the photos under ``workdir`` (once), time both sides ``repeats`` times, interleaved;
    write ``convert.json`` under ``results_dir`` (None: nothing written), print the one-line result and return it."""
    import webdataset  # noqa: F401  (imported before timing so the peer's import cost is not counted)

    workdir = Path(workdir)
    src = make_photos(workdir / "photos", images)
    files = sorted(src.rglob("*.jpg"))
    total_bytes = sum(p.stat().st_size for p in files)
    outs = {"fastio": workdir / "out-fastio", "peer": workdir / "out-peer"}
    cpu: dict[str, list[float]] = {"fastio": [], "peer": []}

    def with_cpu(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` that also records the CPU seconds it used (its processes included): a figure that,
        unlike wall time, does not depend on what else the machine is running."""
        def timed() -> None:
            before = _cpu_seconds()
            fn()
            cpu[name].append(_cpu_seconds() - before)
        return timed

    times = interleaved(
        {"fastio": with_cpu("fastio", lambda: run_fastio(src, outs["fastio"])),
         "peer": with_cpu("peer", lambda: run_peer(src, outs["peer"]))},
        repeats, before=lambda name: shutil.rmtree(outs[name], ignore_errors=True),
    )
    startup = interleaved({"startup": cli_startup}, repeats)["startup"]
    result = _result(times, cpu, startup, len(files), total_bytes, repeats)
    path = write_results("convert", result, results_dir) if results_dir is not None else None
    print(_line(result, path), flush=True)
    return result


def _result(times: dict[str, list[float]], cpu: dict[str, list[float]], startup: list[float], n: int,
            total_bytes: int, repeats: int) -> dict[str, Any]:
    """The section's result from both sides' times, CPU seconds and the CLI's start-up times over ``n`` images."""
    ratio = median_ratio(times["fastio"], times["peer"])
    cpu_per_1000 = {k: 1000 * statistics.median(v) / n for k, v in cpu.items()}
    return {
        "benchmark": "convert",
        "images": n, "bytes": total_bytes, "repeats": repeats,
        "fastio": {"command": "fastio convert --workers 2", "seconds": times["fastio"],
                   "median_s": ratio["ours_median_s"], "samples_per_s": n / ratio["ours_median_s"],
                   "mb_per_s": total_bytes / ratio["ours_median_s"] / 1e6,
                   "cli_startup_median_s": statistics.median(startup), "cpu_s": cpu["fastio"],
                   "cpu_s_per_1000_images": cpu_per_1000["fastio"]},
        "peer": {"command": "webdataset.ShardWriter loop + PIL decode, 1 process", "seconds": times["peer"],
                 "median_s": ratio["peer_median_s"], "samples_per_s": n / ratio["peer_median_s"],
                 "mb_per_s": total_bytes / ratio["peer_median_s"] / 1e6, "cpu_s": cpu["peer"],
                 "cpu_s_per_1000_images": cpu_per_1000["peer"]},
        "speedup": ratio["speedup"], "target": TARGET, "machine": machine_info(),
        "notes": "fastio is timed as a fresh `fastio convert` process (start-up, scan, 2 workers, fsync'd"
                 " shards, .idx, manifest); the peer as an in-process loop after its imports.",
        "ratios": [{"name": "convert samples/s: fastio --workers 2 / webdataset loop", "value": ratio["speedup"],
                    "target": TARGET, "better": "higher"}],
    }


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every child process it has waited for."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _line(result: dict[str, Any], path: Path | None) -> str:
    f, p = result["fastio"], result["peer"]
    return (f"convert: fastio {f['samples_per_s']:.0f} samples/s {f['mb_per_s']:.1f} MB/s vs "
            f"webdataset loop {p['samples_per_s']:.0f} samples/s {p['mb_per_s']:.1f} MB/s: "
            f"{result['speedup']:.2f}x (target >= {TARGET}x; CLI start-up {f['cli_startup_median_s']:.2f}s"
            f" of fastio's {f['median_s']:.2f}s; CPU s per 1,000 images fastio {f['cpu_s_per_1000_images']:.2f}"
            f" / peer {p['cpu_s_per_1000_images']:.2f})" + (f" -> {path}" if path else ""))


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.convert``."""
    p = section_parser(__doc__)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "convert")
    p.add_argument("--images", type=int, default=1500)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(args.workdir, args.repeats, args.images, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
