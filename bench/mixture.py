"""Mixture benchmark: a ``fastio.Mixture`` of two datasets against one dataset of the same samples.

The same ``samples`` JPEGs (400x300..640x480, each made from its own seed) are written once as one dataset
and once as two halves; the mixture reads the halves with weights by size and ``samples_per_epoch`` equal to
the total, so both contenders decode the same amount of the same kind of images per epoch through the
``image-train`` graph. Rounds are paired (single then mixture, then the other way round in the next round);
the figure is the median over rounds of the mixture's samples/s over the single dataset's in the same round
(target >= 0.97: mixing costs nothing measurable). Beside it, ``cpu_ratio``: the median over rounds of the
single dataset's CPU time per sample over the mixture's (this process, all threads), which a busy machine
disturbs far less than wall time.

``python bench/mixture.py [--repeats N] [--samples N] [--device cpu|cuda]`` writes ``bench/out/mixture.json``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, write_results
from bench.quiet import before_section
from fastio import ImageTrain

__all__ = ["make_datasets", "run"]

BATCH = 64


def _write(dest: Path, first: int, count: int, shards: int) -> Path:
    from fastio.convert.synthetic import photo_jpeg
    from fastio.dataset.shards import ShardWriter

    if (dest / "manifest.json").is_file():
        return dest
    with ShardWriter(dest, name="bench", max_samples=-(-count // shards)) as writer:
        for i in range(first, first + count):
            rng = np.random.default_rng(i)  # sample i has the same bytes in every dataset that holds it
            w, h = int(rng.integers(400, 641)), int(rng.integers(300, 481))
            writer.write({"__key__": f"img{i:06d}", "jpg": photo_jpeg(rng, w, h), "cls": str(i % 10).encode()})
        writer.close(image_field="jpg", label_field="cls")
    return dest


def make_datasets(workdir: Path, samples: int) -> tuple[Path, Path, Path]:
    """``(single, half_a, half_b)`` under ``workdir`` (reused when there)."""
    half = samples // 2
    root = Path(workdir) / f"mix-{samples}"
    return (_write(root / "single", 0, samples, 8), _write(root / "a", 0, half, 4),
            _write(root / "b", half, samples - half, 4))


def _cpu() -> float:
    """CPU seconds of this process so far (all its threads)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _epoch(make) -> tuple[int, float, float]:
    """Samples, wall seconds and CPU seconds of one epoch (the loader made outside the timing)."""
    loader = make()
    start, cpu = time.perf_counter(), _cpu()
    n = 0
    for batch in loader:
        n += int((~batch["padded"]).sum())
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    loader.close()
    return n, seconds, cpu


def run(workdir: Path, repeats: int = 3, samples: int = 1200, device: str = "cpu",
        results_dir: Path | None = RESULTS_DIR) -> dict:
    from fastio import Loader, Mixture

    single, a, b = make_datasets(workdir, samples)
    opts = dict(batch_size=BATCH, device=device, pipeline=ImageTrain(), seed=0, world_size=1, rank=0)

    def one():
        return Loader(single, **opts)

    def mixed():
        return Loader(Mixture({"a": a, "b": b}, samples_per_epoch=samples), **opts)

    _epoch(one)  # warm the page cache and DALI once for both
    rounds = []
    for r in range(repeats):
        pair = {}
        for name, make in ((("single", one), ("mixture", mixed)) if r % 2 == 0 else (("mixture", mixed),
                                                                                     ("single", one))):
            n, s, cpu = _epoch(make)
            pair[name], pair[f"{name}_cpu_ms_per_sample"] = n / s, 1000 * cpu / n
        rounds.append(pair)
        print(f"round {r + 1}/{repeats}: single {pair['single']:.1f} samples/s "
              f"({pair['single_cpu_ms_per_sample']:.2f} CPU ms/sample), mixture {pair['mixture']:.1f} samples/s "
              f"({pair['mixture_cpu_ms_per_sample']:.2f} CPU ms/sample), "
              f"ratio {pair['mixture'] / pair['single']:.3f}", flush=True)
    ratio = statistics.median(p["mixture"] / p["single"] for p in rounds)
    cpu_ratio = statistics.median(p["single_cpu_ms_per_sample"] / p["mixture_cpu_ms_per_sample"] for p in rounds)
    result = {
        "samples": samples, "device": device, "batch_size": BATCH, "rounds": rounds,
        "single_samples_per_s": statistics.median(p["single"] for p in rounds),
        "mixture_samples_per_s": statistics.median(p["mixture"] for p in rounds),
        "cpu_ratio": cpu_ratio,
        "machine": machine_info(),
        "ratios": [{"name": "mixture of 2 vs one dataset, samples/s (paired)", "better": "higher", "target": 0.97,
                    "value": ratio}],
    }
    if results_dir is not None:
        write_results("mixture", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.mixture``."""
    p = section_parser(__doc__)
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(Path(__file__).resolve().parent / "work" / "mixture", repeats=args.repeats, samples=args.samples,
        device=args.device, results_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
