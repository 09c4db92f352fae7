"""Storage benchmark: a dataset on S3 (a moto server on loopback), read through fastio's node-local cache.

Figures (medians over the repeats), all on the same shards, the raw sample bytes (``pipeline=fastio.Raw()``, no
decode, so that the storage tier is what is measured):

- ``fastio cold`` / ``fastio warm``: epoch 1 (empty cache: downloads, verifies, reads) and epoch 2 (cached)
  of ``fastio.Loader("s3://...", cache_dir=...)``;
- ``webdataset cold`` / ``webdataset warm``: ``webdataset.WebDataset`` over presigned ``http://`` URLs of the
  same shards with its own ``cache_dir=`` (downloads with ``curl``), epochs 1 and 2;
- ``local``: fastio's Loader on the same shards on local disk (page cache warm): the warm epoch's target
  (interleaved: five pairs of figures per repeat, each timing three consecutive epochs; the ratio is the
  median of the pairs' ratios, which cancels the drift of a shared machine);
- ``stall``: the Loader's stall fraction over a cold epoch with a simulated training step per batch (as long
  as a batch takes to arrive in the cold epoch), with read-ahead (4 shards, the default batch read-ahead) and
  without any (shards fetched and batches read on demand), and on local disk; the first window of shards is
  a wait either way, so the figure is taken after the first batch, and the Loader's own per-batch work in
  ``next()`` stalls local disk too, so the ratio is the excess over local disk's stall;
- ``download``: cache fills (ranged GETs, xxh3-128 check, fsync, rename) against the client's raw GETs of the
  same objects into memory, same concurrency.

``python bench/storage.py [--repeats N] [--samples N]`` writes ``bench/out/storage.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, write_results
from bench.loader import make_shards
from bench.quiet import before_section
from fastio import Raw

__all__ = ["run"]

BATCH = 64
BUCKET = "fastio-bench"
THREADS = 8
WARM_EPOCHS = 3
WARM_PAIRS = 5


def _s3server():
    """tests/s3server.py (the moto server and fault proxy the tests use), loaded by path."""
    path = Path(__file__).resolve().parent.parent / "tests" / "s3server.py"
    spec = importlib.util.spec_from_file_location("fastio_bench_s3server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loader(dest, cache: Path | None, options: dict | None, read_ahead: bool = True):
    """A raw-bytes Loader; ``read_ahead=False`` turns every look-ahead off (shards fetched and batches read on
    demand, one batch decoded ahead)."""
    from fastio import Loader

    extra = {} if cache is None else {"cache_dir": str(cache), "cache_size": "10GB", "storage_options": options,
                                      "shard_read_ahead": 4 if read_ahead else 0}
    if not read_ahead:
        extra.update(read_ahead=0, prefetch=1)
    return Loader(dest, batch_size=BATCH, device="cpu", pipeline=Raw(fields=("jpg", "cls")), shuffle="block",
                  world_size=1, rank=0, **extra)


def _stall_epoch(loader, step_s: float) -> tuple[float, float]:
    """(stall fraction of the whole epoch from the Loader's stats, stall fraction after the first batch): a
    simulated training step of ``step_s`` per batch; the first batch always waits for the first shards."""
    waits, t = [], time.perf_counter()
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t0)
        time.sleep(step_s)
    total = time.perf_counter() - t
    steady = sum(waits[1:]) / max(total - waits[0], 1e-9)
    return loader.stats()["last_epoch"]["stall_fraction"], steady


def _epoch(loader, epochs: int = 1) -> tuple[int, float]:
    """(samples, seconds) of ``epochs`` consecutive epochs."""
    n, t = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            n += int((~batch["padded"]).sum())
    return n, time.perf_counter() - t


def _wds_epoch(urls: list[str], cache: Path) -> tuple[int, float]:
    import webdataset as wds

    cache.mkdir(parents=True, exist_ok=True)
    n, t = 0, time.perf_counter()
    for sample in wds.WebDataset(urls, cache_dir=str(cache), shardshuffle=False, empty_check=False):
        n += "jpg" in sample
    return n, time.perf_counter() - t


def _download(storage, entries, cache_dir: Path) -> tuple[float, float]:
    """(raw GET MB/s, cache fill MB/s) over the same objects with the same concurrency."""
    from fastio.storage.cache import ShardCache

    total = sum(e.size for e in entries)
    t = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        got = sum(len(b) for b in pool.map(lambda e: storage.get(e.key), entries))
    raw = got / (time.perf_counter() - t) / 1e6
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache = ShardCache(cache_dir, "10GB")
    t = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda e: cache.fill(storage, e), entries))
    return raw, total / (time.perf_counter() - t) / 1e6


def run(workdir: Path, repeats: int = 3, samples: int = 2400, results_dir: Path | None = RESULTS_DIR) -> dict:
    from fastio.dataset.manifest import MANIFEST_NAME, SHARDS_DIR, load_manifest
    from fastio.storage import open_storage
    from fastio.storage.cache import CacheEntry

    workdir = Path(workdir)
    dest = make_shards(workdir, samples, shards=32)
    s3 = _s3server()
    server = s3.MotoServer()
    try:
        server.create_bucket(BUCKET)
        options = server.options()
        url = f"s3://{BUCKET}/bench"
        storage = open_storage(url, options)
        storage.publish_dir(dest, keys_last=(MANIFEST_NAME,))
        records = load_manifest(dest).shards
        entries = [CacheEntry(r.name, f"{SHARDS_DIR}/{r.name}", r.sha256, r.bytes, r.xxh3_128) for r in records]
        urls = storage.presign([e.key for e in entries], 3600)
        total_bytes = sum(e.size for e in entries)
        figures: dict[str, list[float]] = {k: [] for k in (
            "fastio_cold", "fastio_warm", "wds_cold", "wds_warm", "local", "stall_read_ahead",
            "stall_on_demand", "stall_local", "steady_stall_read_ahead", "steady_stall_on_demand",
            "steady_stall_local", "raw_get_MBps", "fill_MBps", "warm_vs_local_pairs")}
        local = _loader(dest, None, None)
        _epoch(local)  # page cache and DALI warm-up
        for _ in range(repeats):
            cache = workdir / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            with _loader(url, cache, options) as loader:
                n, cold = _epoch(loader)
                figures["fastio_cold"].append(n / cold)
                # warm epochs of the cached dataset and of the local one, interleaved (a shared machine drifts),
                # timed WARM_EPOCHS at a time (one epoch is a tenth of a second: too short to time alone)
                warm, near = [], []
                for _ in range(WARM_PAIRS):
                    n, seconds = _epoch(loader, WARM_EPOCHS)
                    warm.append(n / seconds)
                    n, seconds = _epoch(local, WARM_EPOCHS)
                    near.append(n / seconds)
                    figures["warm_vs_local_pairs"].append(warm[-1] / near[-1])
            figures["fastio_warm"].append(statistics.median(warm))
            figures["local"].append(statistics.median(near))
            wcache = workdir / "wds-cache"
            shutil.rmtree(wcache, ignore_errors=True)
            n, cold = _wds_epoch(urls, wcache)
            n2, warm = _wds_epoch(urls, wcache)
            figures["wds_cold"].append(n / cold)
            figures["wds_warm"].append(n2 / warm)
            # a training step as long as a batch of the cold epoch takes to arrive: data can keep up only by
            # fetching ahead while the step runs
            step_s = BATCH / figures["fastio_cold"][-1]
            for key, ahead in (("read_ahead", True), ("on_demand", False), ("local", True)):
                shutil.rmtree(cache, ignore_errors=True)
                with _loader(dest if key == "local" else url, cache, options, read_ahead=ahead) as loader:
                    whole, steady = _stall_epoch(loader, step_s)
                figures[f"stall_{key}"].append(whole)
                figures[f"steady_stall_{key}"].append(steady)
            raw, fill = _download(storage, entries, workdir / "fill-cache")
            figures["raw_get_MBps"].append(raw)
            figures["fill_MBps"].append(fill)
            print("  " + "  ".join(f"{k} {v[-1]:.3g}" for k, v in figures.items()), file=sys.stderr, flush=True)
        local.close()
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in figures.items()}
    result = {
        "benchmark": "storage", "machine": machine_info(), "samples": samples, "shards": len(entries),
        "bytes": total_bytes, "batch_size": BATCH, "repeats": repeats, "median": med, "runs": figures,
        "ratios": [
            {"name": "s3 cold epoch samples/s vs webdataset+curl", "better": "higher", "target": 1.0,
             "value": med["fastio_cold"] / med["wds_cold"]},
            {"name": "s3 warm epoch samples/s vs webdataset cache", "better": "higher", "target": 1.0,
             "value": med["fastio_warm"] / med["wds_warm"]},
            {"name": "s3 warm epoch vs same shards on local disk", "better": "higher", "target": 0.95,
             "value": med["warm_vs_local_pairs"]},
            {"name": "cache fill MB/s vs raw client GET MB/s", "better": "higher", "target": 0.8,
             "value": med["fill_MBps"] / med["raw_get_MBps"]},
            {"name": "cold-epoch stall after batch 1 minus local disk's", "better": "lower", "target": 0.05,
             "value": med["steady_stall_read_ahead"] - med["steady_stall_local"]},
        ],
    }
    print(table(result))
    if results_dir is not None:
        write_results("storage", result, results_dir)
    return result


def table(result: dict) -> str:
    m = result["median"]
    lines = [f"storage: {result['samples']} samples in {result['shards']} shards ({result['bytes'] / 1e6:.1f} MB), "
             f"moto S3 on loopback, medians of {result['repeats']}",
             f"  fastio      cold {m['fastio_cold']:9.1f}  warm {m['fastio_warm']:9.1f} samples/s",
             f"  webdataset  cold {m['wds_cold']:9.1f}  warm {m['wds_warm']:9.1f} samples/s",
             f"  local disk       {m['local']:9.1f} samples/s",
             f"  stall fraction   read-ahead {m['stall_read_ahead']:.3f}  on demand {m['stall_on_demand']:.3f}"
             f"  local disk {m['stall_local']:.3f}  (after batch 1: {m['steady_stall_read_ahead']:.3f}, "
             f"{m['steady_stall_on_demand']:.3f}, {m['steady_stall_local']:.3f})",
             f"  download         cache fill {m['fill_MBps']:.0f} MB/s  raw GET {m['raw_get_MBps']:.0f} MB/s"]
    for r in result["ratios"]:
        lines.append(f"  {r['name']:<48} {r['value']:.3f} (target {'>=' if r['better'] == 'higher' else '<='} "
                     f"{r['target']})")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.storage``."""
    p = section_parser(__doc__)
    p.add_argument("--samples", type=int, default=2400)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(Path(__file__).resolve().parent / "work" / "storage", repeats=args.repeats, samples=args.samples,
        results_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
