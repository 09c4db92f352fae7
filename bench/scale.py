"""Scale benchmark: what one rank pays at 10^9 samples, 10^5 shards and 8,192 ranks (a simulation on one machine).

- sampler: time and peak memory (tracemalloc, which sees numpy's buffers) of one rank's first batch, of its
  whole-epoch plan (``EpochPlan.batches()``, one vectorised lookup) and of a mid-epoch resume, for the lazy
  ``global`` and ``block`` orders at full size, against the materialised numpy permutation fastio used
  before (``rng.permutation(N)``; run at ``--legacy-samples``, where it still fits) and the lazy order at
  that same size; the lazy orders materialised at that size and checked to be permutations;
- order statistics of the lazy order against numpy's permutation: mean displacement, neighbour
  correlation, class mixing per batch (``fastio.report.inspect.order_quality``'s measure);
- requests: the shards one node's ranks touch in a step and in an epoch (what caching whole shards per node
  would fetch);
- start-up: a real DEST with ``--startup-shards`` shard files (empty tars, real manifest and sample
  index): time and bytes to open it as a rank does (manifest, one listing of ``shards/``, index map), the
  index's bytes per sample, and, against it, parsing ``.idx`` text files as fastio did before (measured on
  ``--idx-samples`` samples, per sample).

``python -m bench.scale [--samples N] [--shards S] [--ranks W] ...`` writes ``bench/out/scale.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, write_results
from bench.quiet import before_section

__all__ = ["legacy_order", "run"]


def legacy_order(shard_sizes, seed: int, epoch: int, fingerprint: str, shuffle: str = "global",
                 block_shards: int = 4) -> np.ndarray:
    """The materialised order fastio computed before the lazy one (its sampler, verbatim): O(N) memory."""
    n = int(sum(shard_sizes))
    if shuffle == "none":
        return np.arange(n, dtype=np.int64)
    digest = hashlib.sha256(f"fastio-order:{seed}:{epoch}:{fingerprint}:{shuffle}".encode()).digest()
    rng = np.random.Generator(np.random.Philox(key=int.from_bytes(digest[:16], "little")))
    if shuffle == "global":
        return rng.permutation(n).astype(np.int64)
    firsts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]]).astype(np.int64)
    shard_order = rng.permutation(len(shard_sizes))
    parts = []
    for w in range(0, len(shard_order), block_shards):
        window = np.concatenate([np.arange(firsts[s], firsts[s] + shard_sizes[s], dtype=np.int64)
                                 for s in shard_order[w:w + block_shards]])
        parts.append(window[rng.permutation(len(window))])
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _measure(fn):
    """(seconds, peak traced bytes, result): one untimed-for-memory call for the time, then one under
    tracemalloc for the peak (tracing slows Python allocations down several-fold)."""
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    tracemalloc.reset_peak()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, result


def _sampler(samples: int, shards: int, ranks: int, batch: int, shuffle: str, block_shards: int) -> dict:
    from fastio.order.sampler import Sampler, SamplerSpec

    sizes = np.full(shards, samples // shards, np.int64)
    sizes[: samples % shards] += 1
    spec = SamplerSpec(seed=0, shuffle=shuffle, block_shards=block_shards, batch_size=batch)
    rank = ranks // 2 + 1

    def first():
        return Sampler(spec, sizes, "0123456789abcdef", ranks, rank).plan(0).batch(0)

    def epoch():
        return Sampler(spec, sizes, "0123456789abcdef", ranks, rank).plan(0).batches()

    def resume():
        return Sampler(spec, sizes, "0123456789abcdef", ranks, rank).plan(0, samples // 2).batch(0)

    t1, m1, (idx, _) = _measure(first)
    te, me, (all_idx, pad) = _measure(epoch)
    tr, mr, _ = _measure(resume)
    assert len(idx) == batch and ((0 <= all_idx) & (all_idx < samples)).all()
    return {"shuffle": shuffle, "samples": samples, "shards": shards, "ranks": ranks, "batch_size": batch,
            "first_batch_s": t1, "first_batch_peak_bytes": m1, "epoch_plan_s": te, "epoch_plan_peak_bytes": me,
            "epoch_plan_positions": int(len(all_idx)), "resume_batch_s": tr, "resume_batch_peak_bytes": mr,
            "distinct_in_epoch_plan": int(len(np.unique(all_idx[~pad])) == int((~pad).sum()))}


def _requests(samples: int, shards: int, ranks: int, batch: int, block_shards: int, per_node: int = 8) -> dict:
    """Which shards one node's ranks read: per step (its share of one global batch) and over the epoch."""
    from fastio.order.sampler import Sampler, SamplerSpec

    sizes = np.full(shards, samples // shards, np.int64)
    sizes[: samples % shards] += 1
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = {"ranks_per_node": per_node}
    for mode in ("global", "block"):
        spec = SamplerSpec(seed=0, shuffle=mode, block_shards=block_shards, batch_size=batch)
        plans = [Sampler(spec, sizes, "0123456789abcdef", ranks, r).plan(0) for r in range(per_node)]
        step = np.concatenate([p.batch(0)[0] for p in plans])
        epoch = np.concatenate([p.batches()[0] for p in plans])
        shard_step = np.searchsorted(starts, step, "right") - 1
        shard_epoch = np.searchsorted(starts, epoch, "right") - 1
        out[mode] = {"samples_per_step": int(len(step)), "shards_per_step": int(len(np.unique(shard_step))),
                     "samples_per_epoch": int(len(epoch)), "shards_per_epoch": int(len(np.unique(shard_epoch))),
                     "adjacent_pairs_per_step": int((np.diff(np.sort(step)) == 1).sum())}
    return out


def _legacy(samples: int, shards: int, ranks: int, batch: int) -> dict:
    sizes = [samples // shards] * shards
    sizes[0] += samples - sum(sizes)
    b0 = (ranks // 2 + 1) * batch

    def first():
        order = legacy_order(sizes, 0, 0, "0123456789abcdef")
        return order[b0:b0 + batch].copy()

    t, m, _ = _measure(first)
    return {"samples": samples, "first_batch_s": t, "first_batch_peak_bytes": m,
            "note": "the materialised order: every rank builds all N indices for its first batch; the epoch "
                    "plan costs the same (it slices the same array)"}


def _is_permutation(samples: int, shards: int, block_shards: int) -> dict:
    """Materialise the lazy order of each mode in chunks and check that every index appears exactly once."""
    from fastio.order.sampler import epoch_order

    sizes = np.random.default_rng(0).integers(1, 2 * samples // shards, shards)
    sizes[-1] += max(0, samples - int(sizes.sum()))
    out = {"samples": int(sizes.sum()), "shards": shards}
    for mode in ("global", "block"):
        order = epoch_order(sizes, 0, 0, "fp", mode, block_shards)
        seen = np.zeros(len(order), np.uint8)
        start = time.perf_counter()
        for i in range(0, len(order), 1 << 22):
            seen[order[i:i + (1 << 22)]] = 1
        out[f"{mode}_s"] = time.perf_counter() - start
        out[mode] = bool(seen.all())  # N values in range, all N seen: a permutation
        assert out[mode], f"the lazy {mode} order is not a permutation of {len(order)} samples"
    return out


def _statistics(samples: int, classes: int, batch: int, block_shards: int) -> dict:
    """Mean displacement, neighbour correlation and classes per batch of the lazy orders and numpy's, on a
    dataset stored in class order in 100 shards (the worst case for ``block``)."""
    from fastio.order.sampler import epoch_order
    from fastio.report.inspect import order_quality

    labels = np.repeat(np.arange(classes), samples // classes)
    n = len(labels)
    shards = [n // 100] * 100
    out = {}
    for mode in ("global", "block"):
        for name, order in (("lazy", epoch_order(shards, 0, 0, "fp", mode, block_shards)[:]),
                            ("numpy", legacy_order(shards, 0, 0, "fp", mode, block_shards))):
            full = n // batch
            per_batch = np.sort(labels[order[: full * batch]].reshape(full, batch), axis=1)
            mixing = float((np.diff(per_batch, axis=1) != 0).sum(1).mean() + 1)
            out[f"{name}_{mode}"] = {"mean_displacement": float(np.abs(order - np.arange(n)).mean() / n),
                                     "neighbour_correlation": float(np.corrcoef(order[:-1], order[1:])[0, 1]),
                                     "class_mixing": mixing}
        q = order_quality(shards, labels, batch_size=batch, fingerprint="fp", mode=mode, block_shards=block_shards)
        assert abs(q["class_mixing"] - out[f"lazy_{mode}"]["class_mixing"]) < 1e-9
    out.update(samples=n, classes=classes, batch_size=batch, block_shards=block_shards,
               class_mixing_ideal=q["class_mixing_ideal"], mean_displacement_ideal=q["mean_displacement_ideal"])
    return out


def _startup(work: Path, shards: int, per_shard: int) -> dict:
    """A real DEST of ``shards`` (empty) tar/idx files with a real manifest and sample index; open it."""
    from fastio.dataset.dataset import Dataset
    from fastio.dataset.manifest import SHARDS_DIR, ShardRecord, make_manifest, write_manifest
    from fastio.dataset.sample_table import INDEX_NAME, IndexBuilder

    dest = work / f"startup-{shards}x{per_shard}"
    if not (dest / "manifest.json").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        (dest / SHARDS_DIR).mkdir(parents=True)
        rng = np.random.default_rng(0)
        builder, records = IndexBuilder(), []
        for s in range(shards):
            jpg = rng.integers(20_000, 200_000, per_shard)
            member = 512 + 512 + 512 + (jpg + 511) // 512 * 512  # cls (3 bytes) then jpg: headers + padded data
            span = 512 + np.concatenate([[0], np.cumsum(member)[:-1]])
            name = f"shard-{s:06d}"
            record = ShardRecord(name=f"{name}.tar", samples=per_shard, bytes=int(span[-1] + member[-1] + 1024),
                                 sha256=hashlib.sha256(name.encode()).hexdigest(),
                                 idx_sha256=hashlib.sha256(name.encode() + b"idx").hexdigest())
            (dest / SHARDS_DIR / record.name).touch()
            (dest / SHARDS_DIR / record.idx_name).touch()
            builder.add_columns(record, span, {"cls": np.full(per_shard, 3), "jpg": jpg})
            records.append(record)
        index = builder.publish(dest / INDEX_NAME, ["cls", "jpg"])
        write_manifest(dest, make_manifest(name="scale", shards=records, fields=["cls", "jpg"], index=index,
                                           image_field="jpg", label_field="cls"))
    os.sync()
    manifest_bytes = (dest / "manifest.json").stat().st_size
    index_bytes = (dest / INDEX_NAME).stat().st_size
    t, m, ds = _measure(lambda: Dataset(dest))
    n = len(ds)
    rows_t, _, _ = _measure(lambda: ds.locate(np.random.default_rng(1).integers(0, n, 256)))  # first: cold pages
    warm_t, _, _ = _measure(lambda: ds.locate(np.random.default_rng(2).integers(0, n, 256)))
    epoch_t, epoch_m, _ = _measure(lambda: ds.locate(np.random.default_rng(3).integers(0, n, 122_070)))
    return {"shards": shards, "samples": n, "manifest_bytes": manifest_bytes, "index_bytes": index_bytes,
            "index_bytes_per_sample": index_bytes / n, "open_s": t, "open_peak_bytes": m,
            "locate_256_random_s": rows_t, "locate_256_random_warm_s": warm_t,
            "locate_122070_random_s": epoch_t, "locate_122070_random_peak_bytes": epoch_m,
            "columns": "span_offset uint32, size:cls uint8, size:jpg uint32"}


def _idx_parse(work: Path, samples: int) -> dict:
    """Per-sample cost of what opening a dataset did before: parse every .idx into a table."""
    from fastio.dataset.dataset import Dataset
    from fastio.dataset.shards import ShardWriter

    dest = work / f"idx-{samples}"
    if not (dest / "manifest.json").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        with ShardWriter(dest, max_samples=max(1, samples // 20)) as w:
            for i in range(samples):
                w.write({"__key__": f"{i:09d}", "cls": b"7", "jpg": b"\xff" * 700})
        manifest = json.loads((dest / "manifest.json").read_text())
        del manifest["index"]  # a dataset from before the consolidated index
        (dest / "manifest.json").write_text(json.dumps(manifest))
    t, m, ds = _measure(lambda: Dataset(dest).table)
    return {"samples": samples, "parse_s": t, "parse_peak_bytes": m, "parse_s_per_sample": t / samples,
            "parse_bytes_per_sample": m / samples}


def run(workdir: Path, repeats: int = 1, samples: int = 10**9, shards: int = 10**5, ranks: int = 8192,
        batch: int = 32, block_shards: int = 16, legacy_samples: int = 10**7, stats_samples: int = 10**6,
        startup_shards: int = 10**5, startup_per_shard: int = 100, idx_samples: int = 20_000,
        results_dir: Path | None = RESULTS_DIR) -> dict:
    """Run every measurement once (they are deterministic in what they compute; ``repeats`` is accepted
    for ``bench.run`` and ignored), print a table, write ``scale.json`` and return the result dict."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    lazy = {m: _sampler(samples, shards, ranks, batch, m, block_shards) for m in ("global", "block")}
    lazy_small = _sampler(legacy_samples, min(shards, max(1, legacy_samples // 100)), ranks, batch, "global",
                          block_shards)
    legacy = _legacy(legacy_samples, min(shards, max(1, legacy_samples // 100)), ranks, batch)
    stats = _statistics(stats_samples, 1000, 256, 4)
    requests = _requests(samples, shards, ranks, batch, block_shards)
    permutation = _is_permutation(legacy_samples, min(shards, max(1, legacy_samples // 100)), block_shards)
    startup = _startup(work, startup_shards, startup_per_shard)
    idx = _idx_parse(work, idx_samples)
    per_1e9 = {"index_bytes": startup["index_bytes_per_sample"] * 1e9,
               "legacy_table_bytes": idx["parse_bytes_per_sample"] * 1e9,
               "legacy_parse_s": idx["parse_s_per_sample"] * 1e9,
               "legacy_order_bytes": 8e9}
    result = {
        "machine": machine_info(), "lazy": lazy, "lazy_at_legacy_size": lazy_small, "legacy": legacy,
        "statistics": stats, "requests": requests,
        "permutation": permutation, "startup": startup, "idx_parse": idx, "per_1e9_samples": per_1e9,
        "ratios": [
            {"name": f"first batch time: materialised@{legacy_samples:.0e} / lazy@{samples:.0e}",
             "value": legacy["first_batch_s"] / lazy["global"]["first_batch_s"], "target": 10, "better": "higher"},
            {"name": f"first batch memory: materialised@{legacy_samples:.0e} / lazy@{samples:.0e}",
             "value": legacy["first_batch_peak_bytes"] / lazy["global"]["first_batch_peak_bytes"], "target": 10,
             "better": "higher"},
            {"name": "class mixing per batch: lazy / numpy permutation",
             "value": stats["lazy_global"]["class_mixing"] / stats["numpy_global"]["class_mixing"], "target": 0.99,
             "better": "higher"},
        ],
    }
    table(result)
    if results_dir is not None:
        write_results("scale", result, results_dir)
    return result


def table(r: dict) -> None:
    mib = 2**20
    for mode, x in r["lazy"].items():
        print(f"lazy {mode:<6} N={x['samples']:.0e} S={x['shards']:.0e} W={x['ranks']} B={x['batch_size']}: "
              f"first batch {x['first_batch_s'] * 1e3:.1f} ms / {x['first_batch_peak_bytes'] / mib:.1f} MiB; "
              f"epoch plan ({x['epoch_plan_positions']} positions) {x['epoch_plan_s'] * 1e3:.0f} ms / "
              f"{x['epoch_plan_peak_bytes'] / mib:.1f} MiB; resume at N/2 {x['resume_batch_s'] * 1e3:.1f} ms")
    x, y = r["legacy"], r["lazy_at_legacy_size"]
    print(f"materialised N={x['samples']:.0e}: first batch {x['first_batch_s']:.2f} s / "
          f"{x['first_batch_peak_bytes'] / mib:.0f} MiB (lazy at the same N: {y['first_batch_s'] * 1e3:.1f} ms / "
          f"{y['first_batch_peak_bytes'] / mib:.1f} MiB)")
    s = r["statistics"]
    for name in ("lazy_global", "numpy_global", "lazy_block", "numpy_block"):
        print(f"order {name:<12} N={s['samples']:.0e}: mean displacement {s[name]['mean_displacement']:.4f} "
              f"(ideal {s['mean_displacement_ideal']:.4f}), neighbour correlation "
              f"{s[name]['neighbour_correlation']:+.5f}, classes per batch of {s['batch_size']} "
              f"{s[name]['class_mixing']:.2f} (ideal {s['class_mixing_ideal']:.2f})")
    q = r["requests"]
    for mode in ("global", "block"):
        x = q[mode]
        print(f"one node ({q['ranks_per_node']} ranks), {mode}: a step reads {x['samples_per_step']} samples from "
              f"{x['shards_per_step']} shards ({x['adjacent_pairs_per_step']} adjacent pairs); an epoch "
              f"{x['samples_per_epoch']} samples from {x['shards_per_epoch']} shards")
    x = r["permutation"]
    print(f"lazy order materialised at N={x['samples']:.0e} in {x['shards']} ragged shards: a permutation in "
          f"global mode {x['global']} ({x['global_s']:.1f} s), block mode {x['block']} ({x['block_s']:.1f} s)")
    u = r["startup"]
    print(f"start-up S={u['shards']} N={u['samples']:.0e}: manifest {u['manifest_bytes'] / mib:.1f} MiB, index "
          f"{u['index_bytes'] / mib:.1f} MiB ({u['index_bytes_per_sample']:.2f} B/sample); Dataset() "
          f"{u['open_s']:.2f} s / {u['open_peak_bytes'] / mib:.0f} MiB peak; locate 256 random "
          f"{u['locate_256_random_s'] * 1e3:.2f} ms (then {u['locate_256_random_warm_s'] * 1e3:.2f} ms), 122070 "
          f"(a rank's epoch) {u['locate_122070_random_s'] * 1e3:.0f} ms / "
          f"{u['locate_122070_random_peak_bytes'] / mib:.0f} MiB")
    i, p = r["idx_parse"], r["per_1e9_samples"]
    print(f"before (.idx text parsed into a table): {i['parse_s_per_sample'] * 1e6:.1f} us and "
          f"{i['parse_bytes_per_sample']:.0f} B per sample -> per 1e9 samples {p['legacy_parse_s'] / 3600:.1f} h "
          f"and {p['legacy_table_bytes'] / 1e9:.0f} GB per rank; now the index: {p['index_bytes'] / 1e9:.1f} GB "
          f"per 1e9 samples, mapped (shared by a node's ranks)")
    for ratio in r["ratios"]:
        print(f"  {ratio['name']}: {ratio['value']:.3g} (target >= {ratio['target']})")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.scale``."""
    p = section_parser(__doc__, None)
    p.add_argument("--samples", type=int, default=10**9)
    p.add_argument("--shards", type=int, default=10**5)
    p.add_argument("--ranks", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per batch")
    p.add_argument("--block-shards", type=int, default=16)
    p.add_argument("--legacy-samples", type=int, default=10**7, help="size for the materialised order")
    p.add_argument("--stats-samples", type=int, default=10**6)
    p.add_argument("--startup-shards", type=int, default=10**5)
    p.add_argument("--startup-per-shard", type=int, default=100)
    p.add_argument("--idx-samples", type=int, default=20_000)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "scale")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(args.workdir, samples=args.samples, shards=args.shards, ranks=args.ranks, batch=args.batch,
        block_shards=args.block_shards, legacy_samples=args.legacy_samples, stats_samples=args.stats_samples,
        startup_shards=args.startup_shards, startup_per_shard=args.startup_per_shard, idx_samples=args.idx_samples,
        results_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
