"""Loader benchmark: fastio against the loaders a user would otherwise pick, on the same shards, one run.

Each contender delivers one epoch of the ``image-train`` transform at 224 px (random resized crop,
horizontal flip, normalize, float32 CHW) over the same ~1200 JPEGs of 400x300..640x480:

- ``fastio``: ``fastio.Loader(device=...)``;
- ``dataloader``: ``torch.utils.data.DataLoader(num_workers=cores)`` over ``webdataset.WebDataset`` with PIL
  decode and the same transforms written with PIL + numpy + torch (no torchvision);
- ``dali``: DALI's own ``fn.readers.webdataset`` with the same graph (its worker threads unpinned, DALI's default;
  fastio's Loader pins its own, one to a CPU, as it does by default in a process alone on its node). The crop is
  ``fn.decoders.image_random_crop`` (DALI's fused decode + random-resized-crop, the ROI decode its own
  ResNet example uses), because fastio's graph also decodes only the crop window; its outputs become torch
  tensors the way ``DALIGenericIterator`` makes them (``torch.from_dlpack``, no copy, with DALI's dynamic
  executor), as fastio's do;
- ``ceiling``: a tight single-process PIL decode + resize loop, multiplied by the core count.

Runs are interleaved in paired rounds: fastio runs between its two peers, each peer on the other side of it
every round (DALI fastio DataLoader, then DataLoader fastio DALI, ...), then the ceiling; each figure is the
median samples/s, next to the median CPU time per sample (this process, all its threads, and its reaped
children), which is far less sensitive than wall time to other load on a shared machine. The verdicts come
from paired ratios: the median over the rounds of fastio's figure over the peer's in the same round. Each line
a round prints names its round; each round also records what the other processes used of the cores
(``bench.quiet``), and where a round found the machine busy the verdicts say so instead of met or MISSED. For
fastio and DALI the CPU time is also split by thread group (DALI's worker threads, its other threads, the
Python threads): where each spends it.

Besides the epoch: the time to the first batch (fastio: ``Loader(...)`` to the first batch of a fresh
epoch, and ``Loader(...)`` + ``load_state_dict`` of a mid-epoch state to its first batch; DALI: pipeline
build to the first batch), ``FIRSTS`` of each in every round (taking turns in first place), its ratios paired
too (each turn's); and the steady RSS of a process that runs
three epochs with fastio or with DALI's reader (median of the RSS sampled after every batch of the
second and third epochs, each in its own fresh process). And the cost of the tar-header check every read
makes (``fastio.read.reader``: each member's header, read with its data, against the index): raw reads of every
sample's ``jpg`` and ``cls`` in CPU microseconds per sample, beside the check alone on the same headers.
``python bench/loader.py [--device cuda] [--repeats N] [--samples N]`` writes
``bench/out/loader[-cuda].json`` and a PNG bar chart next to it.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, cores, machine_info, section_parser, verdict, write_results
from bench.quiet import before_section, during, read_sample
from fastio import ImageTrain

__all__ = ["make_shards", "run", "table"]

SIZE = 224
BATCH = 64
FIRSTS = 4
"""First batches per contender each round (fastio fresh, fastio resumed, DALI's reader, taking turns in first place):
one first batch (~0.08 s) swings by more than the difference being judged, so each round pairs several."""
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def make_shards(workdir: Path, samples: int = 1200, shards: int = 8) -> Path:
    """``workdir/shards-N-S`` (a fastio dataset) with ``samples`` JPEGs in ``shards`` shards; reused if there."""
    from fastio.convert.synthetic import photo_jpeg
    from fastio.dataset.shards import ShardWriter

    dest = Path(workdir) / f"shards-{samples}-{shards}"
    if (dest / "manifest.json").is_file():
        return dest
    rng = np.random.default_rng(0)
    writer = ShardWriter(dest, name="bench", max_samples=-(-samples // shards))
    for i in range(samples):
        w, h = int(rng.integers(400, 641)), int(rng.integers(300, 481))
        writer.write({"__key__": f"img{i:06d}", "jpg": photo_jpeg(rng, w, h), "cls": str(i % 10).encode()})
    writer.close(image_field="jpg", label_field="cls")
    return dest


# -- contenders: each returns (samples delivered, seconds) for one epoch -------------------------------

def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of every live thread of this process: ``{tid: (group, seconds)}``, the group from the
    thread's name: ``dali_workers`` (DALI's thread pool, where decoding and augmentation run), ``dali_other``
    (its executor, reader and input threads) or ``python`` (the interpreter's threads: the training loop,
    the DALI input callback, fastio's reader threads)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        group = ("dali_workers" if comm.startswith("[DALI][TP") else
                 "dali_other" if comm.startswith("[DALI]") or comm == "PrefetchWorker" else "python")
        out[int(tid)] = (group, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _cpu_by_group(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group since ``before`` (threads alive now; call it before the pipeline goes)."""
    by: dict[str, float] = {}
    for tid, (group, seconds) in _thread_cpu().items():
        by[group] = by.get(group, 0.0) + seconds - before.get(tid, (group, 0.0))[1]
    return by


def _fastio(dest: Path, device: str, threads: dict | None = None) -> tuple[int, float]:
    import torch

    from fastio import Loader

    before = _thread_cpu()
    t = time.perf_counter()
    loader = Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE), device=device, world_size=1, rank=0)
    n = 0
    for batch in loader:
        n += int((~batch["padded"]).sum())
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if threads is not None:
        threads.update(_cpu_by_group(before))
    loader.close()
    return n, seconds


def _resume_state(dest: Path, device: str) -> dict:
    """A mid-epoch state (half an epoch consumed) of the loader ``_first_fastio`` makes."""
    from fastio import Loader

    with Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE), device=device, world_size=1, rank=0) as loader:
        it = iter(loader)
        for _ in range(len(loader) // 2):
            next(it)
        state = loader.state_dict()
        it.close()
    return state


def _first_fastio(dest: Path, device: str, state: dict | None = None) -> float:
    """Seconds from ``Loader(...)`` (and ``load_state_dict(state)``) to its first batch."""
    import torch

    from fastio import Loader

    t = time.perf_counter()
    loader = Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE), device=device, world_size=1, rank=0)
    if state is not None:
        loader.load_state_dict(state)
    next(iter(loader))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    loader.close()
    return seconds


def _rrc_params(rng, width: int, height: int):
    import math

    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    s = min(width, height)
    return (width - s) // 2, (height - s) // 2, s, s


class PeerTransform:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize, with PIL, numpy and torch: the peers'
    transform (also bench/restart.py's)."""

    def __init__(self, size: int = SIZE):
        self.rng = np.random.default_rng()
        self.size = size

    def __call__(self, sample):
        import torch

        img, cls = sample
        x, y, w, h = _rrc_params(self.rng, *img.size)
        img = img.convert("RGB").resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + w, y + h))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        arr = (np.asarray(img, np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), int(cls)


def _dataloader(dest: Path, workers: int, device: str) -> tuple[int, float]:
    import torch
    import webdataset as wds

    urls = sorted(str(p) for p in (dest / "shards").glob("*.tar"))
    t = time.perf_counter()
    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker)
          .shuffle(256).decode("pil").to_tuple("jpg", "cls").map(PeerTransform()).batched(BATCH))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=device == "cuda")
    n = 0
    for images, labels in loader:
        if device == "cuda":
            images = images.to(device, non_blocking=True)
        n += len(labels)
    if device == "cuda":
        torch.cuda.synchronize()
    return n, time.perf_counter() - t


def _dali_pipe(dest: Path, device: str, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    tars = sorted(str(p) for p in (dest / "shards").glob("*.tar"))
    idxs = [str(Path(t).with_suffix(".idx")) for t in tars]
    decoder = "mixed" if device == "cuda" else "cpu"

    @pipeline_def(batch_size=BATCH, num_threads=threads, device_id=0 if device == "cuda" else None,
                  prefetch_queue_depth=2)
    def graph():
        jpg, cls = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["jpg", "cls"], random_shuffle=True,
                                         initial_fill=256, missing_component_behavior="error", name="reader")
        img = fn.decoders.image_random_crop(jpg, device=decoder, output_type=types.RGB,
                                            random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        img = fn.resize(img, resize_x=SIZE, resize_y=SIZE, antialias=True)
        img = fn.crop_mirror_normalize(img, mirror=fn.random.coin_flip(), mean=list(MEAN * 255),
                                       std=list(STD * 255), dtype=types.FLOAT, output_layout="CHW")
        return img, cls

    pipe = graph()
    pipe.build()
    return pipe


def _dali(dest: Path, device: str, threads: int, by_thread: dict | None = None) -> tuple[int, float]:
    before = _thread_cpu()
    t = time.perf_counter()
    pipe = _dali_pipe(dest, device, threads)
    total = pipe.epoch_size("reader")
    n = 0
    for _ in range(-(-total // BATCH)):
        img, _ = pipe.run()
        n += len(_to_torch(img, device, pipe))  # what DALIGenericIterator does for a training loop
    seconds = time.perf_counter() - t
    if by_thread is not None:
        by_thread.update(_cpu_by_group(before))
    del pipe
    return min(n, total), seconds


def _first_dali(dest: Path, device: str, threads: int) -> float:
    """Seconds from building DALI's pipeline to its first batch (as torch)."""
    t = time.perf_counter()
    pipe = _dali_pipe(dest, device, threads)
    img, _ = pipe.run()
    _to_torch(img, device, pipe)
    seconds = time.perf_counter() - t
    del pipe
    return seconds


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _steady_rss(name: str, dest: Path, device: str, epochs: int = 3) -> float:
    """Median RSS (MiB) after each batch of epochs 2..``epochs`` of one contender, in this process."""
    threads = cores()
    samples: list[float] = []
    if name == "fastio":
        from fastio import Loader

        with Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE), device=device, world_size=1, rank=0) as loader:
            for epoch in range(epochs):
                for _ in loader:
                    if epoch:
                        samples.append(_rss_mib())
    else:
        pipe = _dali_pipe(dest, device, threads)
        per_epoch = -(-pipe.epoch_size("reader") // BATCH)
        for epoch in range(epochs):
            for _ in range(per_epoch):
                img, _ = pipe.run()
                _to_torch(img, device, pipe)
                if epoch:
                    samples.append(_rss_mib())
    return statistics.median(samples)


def _steady_rss_in_child(name: str, dest: Path, device: str) -> float:
    """:func:`_steady_rss` in a fresh interpreter, so that one contender's memory does not count for another."""
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
            f"from pathlib import Path; from bench.loader import _steady_rss; "
            f"print(_steady_rss({name!r}, Path({str(dest)!r}), {device!r}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _to_torch(tl, device: str, pipe, sync: bool = True):
    """What ``DALIGenericIterator`` does with an output: ``torch.from_dlpack`` (no copy) when the pipeline's
    outputs own their memory (the dynamic executor), else a copy into a torch tensor; then, on cuda and with
    ``sync``, waits for the whole GPU (``DALIGenericIterator`` does not: a training loop passes ``sync=False``, as
    a synchronize per batch would wait for the model's queued steps too)."""
    import torch

    t = tl.as_tensor()
    if getattr(pipe, "exec_dynamic", False):
        with torch.device("cuda" if device == "cuda" else "cpu"):
            out = torch.from_dlpack(t)
    elif device != "cuda":
        return torch.from_numpy(tl.as_array())
    else:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        out = torch.empty(t.shape(), dtype=torch.float32, device="cuda")
        feed_ndarray(t, out, cuda_stream=torch.cuda.current_stream())
    if device == "cuda" and sync:
        torch.cuda.synchronize()
    return out


def _ceiling(dest: Path, limit: int = 300) -> tuple[int, float]:
    from fastio.dataset.dataset import Dataset
    from fastio.read.reader import Reader

    ds = Dataset(dest)
    with Reader(ds, ["jpg"], threads=1) as reader:
        blobs = [b.tobytes() for b in reader.read(np.arange(min(limit, len(ds))))["jpg"]]
    t = time.perf_counter()
    for data in blobs:
        Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    return len(blobs), time.perf_counter() - t


def _member_check(dest: Path, rounds: int = 3) -> dict[str, float]:
    """CPU microseconds per sample of raw reads (``jpg`` + ``cls``, batches of BATCH, one reader thread) and of
    the member check alone on the same tar headers (median of ``rounds``), and the check's share of the read."""
    import zlib

    from fastio.dataset.dataset import Dataset
    from fastio.read.reader import _HEADER, Reader, _member_matches, _tar_header

    ds = Dataset(dest)
    idx = np.arange(len(ds), dtype=np.int64)
    rows, members = ds.locate(idx), []
    for s, shard in enumerate(ds.shards):
        data = shard.path.read_bytes()
        keys = [zlib.crc32(e.key.encode()) for e in ds.read_index(shard)]
        for j in np.flatnonzero(rows.shard == s).tolist():
            for f in ("jpg", "cls"):
                o, z = int(rows.offsets[f][j]), int(rows.sizes[f][j])
                members.append((data[o - _HEADER:o], keys[j - shard.first], f, z))
    reads, checks = [], []
    with Reader(ds, ["jpg", "cls"], threads=1) as reader:
        reader.read(idx[:BATCH])  # the shards opened, their keys read
        for _ in range(rounds):
            t = time.process_time()
            for b in range(0, len(ds), BATCH):
                reader.read(idx[b:b + BATCH])
            reads.append(1e6 * (time.process_time() - t) / len(ds))
            t = time.process_time()
            for header, crc, f, z in members:
                if not _member_matches(*_tar_header(header), crc, f, z):
                    raise AssertionError(f"{dest}: member check failed on an intact shard ({f}, {z} bytes)")
            checks.append(1e6 * (time.process_time() - t) / len(ds))
    read, check = statistics.median(reads), statistics.median(checks)
    return {"raw_read_us_per_sample": read, "check_us_per_sample": check, "check_share_of_read": check / read}


def run(workdir: Path, repeats: int = 3, device: str = "cpu", samples: int = 1200,
        results_dir: Path | None = RESULTS_DIR) -> dict:
    """Run the comparison, print the table, write ``loader[-DEVICE].json`` + ``.png`` under ``results_dir``
    (None: write nothing) and return the result dict."""
    n = cores()
    dest = make_shards(Path(workdir), samples, shards=max(8, 2 * n))  # every DataLoader worker gets shards
    _fastio(dest, device)  # warm the page cache and DALI's lazy initialisation before timing
    rounds = _rounds(dest, device, n, repeats)
    result = _result(rounds, device, n, samples, repeats)
    result["steady_rss_mib"] = {name: _steady_rss_in_child(name, dest, device) for name in ("fastio", "dali")}
    result["member_check"] = _member_check(dest, repeats)
    print(table(result))
    if results_dir is not None:
        stem = "loader" if device == "cpu" else f"loader-{device}"
        write_results(stem, result, results_dir)
        _chart(result, results_dir / f"{stem}.png")
    return result


def _round_order(r: int) -> list[str]:
    """The contenders of round ``r``: fastio between its two peers, so that each pair runs back to back, with each
    peer on the other side of fastio every round (neither always first nor always second), then the ceiling."""
    return (["dali", "fastio", "dataloader"] if r % 2 == 0 else ["dataloader", "fastio", "dali"]) + ["ceiling"]


def _rounds(dest: Path, device: str, cores: int, repeats: int) -> dict:
    """``repeats`` interleaved rounds of every contender's epoch and of the first batches: per contender, each
    round's samples/s (``runs``), CPU ms per sample (``cpu``, and ``by_thread``), first-batch seconds
    (``first``), and each round's :class:`bench.quiet.Quiet` (``quiet``: what the other processes used)."""
    last: dict[str, dict[str, float]] = {"fastio": {}, "dali": {}}
    contenders = {
        "fastio": lambda: _fastio(dest, device, last["fastio"]),
        "dataloader": lambda: _dataloader(dest, cores, device),
        "dali": lambda: _dali(dest, device, cores, last["dali"]),
        "ceiling": lambda: _ceiling(dest),
    }
    scale = {"ceiling": cores}  # the ceiling is one core's loop; `cores` of them run side by side
    state = _resume_state(dest, device)
    firsts = {
        "fastio": lambda: _first_fastio(dest, device),
        "fastio_resumed": lambda: _first_fastio(dest, device, state),
        "dali": lambda: _first_dali(dest, device, cores),
    }
    out: dict = {"runs": {k: [] for k in contenders}, "cpu": {k: [] for k in contenders},
                 "first": {k: [] for k in firsts}, "by_thread": {"fastio": {}, "dali": {}}, "quiet": []}
    for r in range(repeats):
        start = read_sample()
        for name in _round_order(r):
            before = _cpu_seconds()
            n, seconds = contenders[name]()
            out["cpu"][name].append(1000 * (_cpu_seconds() - before) / n)
            out["runs"][name].append(scale.get(name, 1) * n / seconds)
            for group, secs in last.get(name, {}).items():  # where that CPU went, by thread group
                out["by_thread"][name].setdefault(group, []).append(1000 * secs / n)
            print(f"  round {r + 1}/{repeats}  {name:<11} {out['runs'][name][-1]:9.1f} samples/s  "
                  f"{out['cpu'][name][-1]:6.2f} CPU ms/sample", file=sys.stderr, flush=True)
        names = list(firsts)  # rotated each time: the first of them always came right after the ceiling's epoch
        for k in range(r * FIRSTS, (r + 1) * FIRSTS):
            for name in names[k % len(names):] + names[:k % len(names)]:
                out["first"][name].append(firsts[name]())
        out["quiet"].append(during(start, read_sample()))
        print(_round_line(out, r, repeats), file=sys.stderr, flush=True)
    return out


def _round_line(out: dict, r: int, repeats: int) -> str:
    """Round ``r``'s paired ratios, first batches and what the other processes used, on one line."""
    runs, first, quiet = out["runs"], out["first"], out["quiet"][r]
    return (f"  round {r + 1}/{repeats}  fastio / DataLoader {runs['fastio'][r] / runs['dataloader'][r]:.3f}, "
            f"fastio / DALI {runs['fastio'][r] / runs['dali'][r]:.3f}; first batch "
            + " ".join(f"{k} {statistics.median(v[r * FIRSTS:(r + 1) * FIRSTS]):.3f}s" for k, v in first.items())
            + f"; other processes used {quiet.others:.2f} of {quiet.cores} cores")


def _result(rounds: dict, device: str, cores: int, samples: int, repeats: int) -> dict:
    """The result dict of :func:`run` from :func:`_rounds`'s figures: medians, and paired ratios (the median over
    the rounds of fastio's figure over the peer's in the same round; the first batches: of each of the :data:`FIRSTS`
    turns of every round)."""
    runs, first = rounds["runs"], rounds["first"]
    median = {k: statistics.median(v) for k, v in runs.items()}
    quiet = rounds["quiet"]
    busy = [q for q in quiet if q.busy]
    return {
        "benchmark": "loader", "device": device, "machine": machine_info(), "cores": cores, "samples": samples,
        "batch_size": BATCH, "image_size": SIZE, "repeats": repeats, "samples_per_s": median, "runs": runs,
        # CPU time (this process and its reaped children) per delivered sample: the efficiency figure,
        # much less sensitive than wall time to other load on a shared machine.
        "cpu_ms_per_sample": {k: statistics.median(v) for k, v in rounds["cpu"].items()},
        # the same, split by thread group (see _thread_cpu), up to the end of the epoch
        "cpu_ms_per_sample_by_thread": {k: {g: statistics.median(v) for g, v in groups.items()}
                                        for k, groups in rounds["by_thread"].items()},
        "first_batch_s": {k: statistics.median(v) for k, v in first.items()}, "first_batch_runs": first,
        # each round's figure of the other processes; the verdicts are withheld if any round was busy
        "quiet_rounds": [q.as_dict() for q in quiet],
        "quiet": max(busy or quiet, key=lambda q: q.others).as_dict(),
        "ratios": [
            {"name": f"loader {device} samples/s vs DataLoader+WebDataset", "better": "higher", "target": 1.3,
             "value": _paired(runs, "fastio", "dataloader")},
            {"name": f"loader {device} samples/s vs DALI webdataset reader", "better": "higher", "target": 1.02,
             "value": _paired(runs, "fastio", "dali")},
            {"name": f"loader {device} first batch vs DALI's", "better": "lower", "target": 1.0,
             "value": _paired(first, "fastio", "dali")},
            {"name": f"loader {device} first batch of a resumed epoch vs DALI's", "better": "lower",
             "target": 1.0, "value": _paired(first, "fastio_resumed", "dali")},
        ],
        "fastio_vs_ceiling": median["fastio"] / median["ceiling"],
    }


def _paired(runs: dict[str, list[float]], a: str, b: str) -> float:
    """Median over the rounds of ``a``'s figure over ``b``'s in the same round (a paired ratio: the load of a
    shared machine drifts between rounds, much less within one)."""
    return statistics.median(x / y for x, y in zip(runs[a], runs[b]))


def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def table(result: dict) -> str:
    sps, cpu = result["samples_per_s"], result["cpu_ms_per_sample"]
    lines = [f"loader benchmark ({result['device']}, {result['cores']} cores, {result['samples']} JPEGs, "
             f"image-train {result['image_size']}, median of {result['repeats']})",
             f"{'contender':<12}{'samples/s':>12}{'fastio x':>10}{'CPU ms/sample':>15}"]
    for name, v in sps.items():
        lines.append(f"{name:<12}{v:12.1f}{sps['fastio'] / v:10.2f}{cpu[name]:15.2f}")
    for name, groups in result.get("cpu_ms_per_sample_by_thread", {}).items():
        lines.append(f"{name} CPU ms/sample by thread: " + ", ".join(f"{g} {v:.3f}" for g, v in sorted(groups.items())))
    first = result.get("first_batch_s", {})
    if first:
        lines.append("first batch: " + ", ".join(f"{k} {v:.3f} s" for k, v in first.items()))
    rss = result.get("steady_rss_mib", {})
    if rss:
        lines.append("steady RSS: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss.items()))
    check = result.get("member_check")
    if check:
        lines.append(f"tar header check: {check['check_us_per_sample']:.2f} CPU us/sample of a raw read's "
                     f"{check['raw_read_us_per_sample']:.1f} ({100 * check['check_share_of_read']:.1f}%)")
    for r in result["ratios"]:
        sign = ">=" if r.get("better", "higher") == "higher" else "<="
        lines.append(f"{r['name']}: {r['value']:.3f}x, paired over {result['repeats']} rounds (target {sign} "
                     f"{r['target']}: {verdict(r, result.get('quiet'))})")
    return "\n".join(lines)


def _chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, values = zip(*result["samples_per_s"].items())
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, values, color=["#2a7" if n == "fastio" else "#888" for n in names])
    ax.set_ylabel("samples/s (median)")
    ax.set_title(f"image-train 224, {result['device']}, {result['cores']} cores")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    from fastio.storage.atomic import atomic_write_bytes

    atomic_write_bytes(path, buf.getvalue())


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.loader``."""
    p = section_parser(__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "loader")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(args.workdir, args.repeats, args.device, args.samples, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
