"""GPU benchmark (issue 47): fastio with ``device="cuda"`` against its peers on one GPU, section by section.

Sections (``python -m bench.gpu SECTION [--out DIR] [--repeats N]``; each writes ``DIR/gpu-SECTION.json``):

- ``prepare``: makes the data of every section under ``--workdir`` (run it first, beside the tests: the CPUs are
  idle meanwhile): ``UNIQUE`` photo-like JPEGs of 400-640 x 300-480 px (``bench.loader``'s), each stored
  ``COPIES`` times under keys of its own (decode work is per sample; the page cache holds them all either way);
  ``VIDEOS`` H.264 ``.mp4`` (``bench.media``'s: 10 s, 30 fps, 320 x 240, x264 defaults), converted with
  ``--video-decoder nvdec``; the token corpus of ``bench.tokens``; the image-text conversations of
  ``bench.image_text``.
- ``decode``: the card's decode ceiling: ``fn.decoders.image(device="mixed")`` of the same JPEGs fed from memory,
  nothing else in the graph, for each ``hw_decoder_load`` of ``LOADS`` (0: all on nvJPEG's CUDA decoder, 1: all on
  the hardware JPEG decoder); and ``crop decode``: ``fn.decoders.image_slice`` of only the window fastio's
  ``ImageTrain`` crops from each image (what its graph decodes), the ceiling fastio's ``loader`` figure at the same
  load is a fraction of (the whole-image figure is not: a crop decodes less).
- ``loader``: one epoch each, rounds interleaved: fastio ``Loader(device="cuda", pipeline=ImageTrain(size=224,
  hw_decoder_load=L))`` for each L of ``LOADS``; DALI's own ``fn.readers.webdataset`` with the same mixed graph
  (``bench.loader``'s; like fastio's Loaders, its pipeline is made once and each run is its next epoch);
  ``torch.utils.data.DataLoader`` + WebDataset + PIL with ``num_workers`` = CPU cores, ``pin_memory`` and
  ``non_blocking`` copies. images/s, CPU cores busy (process and reaped children), and each contender's GPU memory
  in a process of its own (``memory``: the most in use over the epoch, less what torch's context held before).
- ``train``: ResNet-50 (torchvision), bf16 autocast, channels-last, SGD, batches of 64 at 224 px: the stall
  fraction of an epoch fed by each contender: 1 - (steps x the step time on one batch kept in GPU memory) / the
  epoch's time, and the host time spent waiting in ``next()``.
- ``video``: H.264 clips (16 frames, stride 2, 112 x 112 center crop, uint8): fastio ``VideoClips(device="cuda")``
  (NVDEC) against DALI's ``fn.readers.video(device="gpu")`` on the same files; frames/s.
- ``tokens``: packed sequences (``seq_len`` 2048, batches of 8) delivered in GPU memory: fastio ``Tokens`` with
  ``device="cuda"`` (pinned staging, non-blocking copies) against Megatron-Core's ``GPTDataset`` in a DataLoader
  (one worker, ``pin_memory``, ``.to("cuda", non_blocking=True)``); tokens/s.
- ``image_text``: ``fastio.ImageText`` (bench.image_text's packing) with ``device="cuda"`` against the same Loader on
  the CPU; conversations/s.

``bench/gpu.sh`` runs the ``gpu`` tests and every section; ``bench/results/gpu/`` holds a run's output. A section
stopped by SIGTERM (``timeout`` at its cap) writes what it measured so far (:data:`PARTIAL`), marked ``cut_off``; one
that fails writes it marked ``failed``; a peer that cannot be made is left out (``left_out``, with why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cores, synchronize
from bench.loader import BATCH, SIZE, _dataloader
from bench.media import VIDEO_FRAMES, cpu_seconds

TINY = bool(os.environ.get("FASTIO_GPU_BENCH_TINY"))
"""Set: every size cut down, to check on the CPU that the sections run (``--device cpu``); no figures."""
UNIQUE, COPIES = (64, 2) if TINY else (2000, 3)
VIDEOS, FRAMES, STRIDE, CLIP_SIZE, CLIP_BATCH = 8 if TINY else 32, 16, 2, 112, 8
VIDEO_LENGTH = 40 if TINY else VIDEO_FRAMES
"""Frames of each video (``bench.media``'s 300; cut down: a clip spans ``(FRAMES - 1) * STRIDE + 1`` = 31)."""
LOADS = (0.0, 0.65, 1.0)
TOKEN_DOCS, SEQ_LEN = (2000, 256) if TINY else (10_000, 2048)
CONVERSATIONS = 64 if TINY else 600
MODEL = "tiny conv" if TINY else "resnet50"
"""The train section's model: ResNet-50 (torchvision), or a small conv net where the check runs on the CPU."""
SECTIONS = ("prepare", "decode", "loader", "train", "video", "tokens", "image_text")
PARTIAL: dict[str, Any] = {}
"""What the running section has measured so far (its rounds, its train runs, GPU memory), written out by :func:`main`
if the section is stopped (``bench/gpu.sh`` caps each section with ``timeout``) instead of being lost with it."""


def machine() -> dict[str, Any]:
    """The GPU, its driver and the versions the figures were taken with."""
    import subprocess

    import torch

    out: dict[str, Any] = {"cpus": cores(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import nvidia.dali as dali

        out["dali"] = dali.__version__
    except ImportError:
        out["dali"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            out["driver"] = f"unknown ({err})"
    return out


# -- data ----------------------------------------------------------------------------------------------------------

def image_shards(work: Path) -> Path:
    """``UNIQUE`` JPEGs, each ``COPIES`` times, in ``2 x cores`` shards (made once)."""
    from fastio.convert.synthetic import photo_jpeg
    from fastio.dataset.shards import ShardWriter

    dest = work / f"images-{UNIQUE}x{COPIES}"
    if (dest / "manifest.json").is_file():
        return dest
    rng = np.random.default_rng(0)
    jpegs = [photo_jpeg(rng, int(rng.integers(400, 641)), int(rng.integers(300, 481))) for _ in range(UNIQUE)]
    samples = UNIQUE * COPIES
    writer = ShardWriter(dest, name="gpu-bench", max_samples=-(-samples // max(8, 2 * cores())))
    for i in range(samples):
        writer.write({"__key__": f"img{i:06d}", "jpg": jpegs[(i * 7919) % UNIQUE], "cls": str(i % 10).encode()})
    writer.close(image_field="jpg", label_field="cls")
    return dest


def _one_video(args: tuple[str, int, int]) -> None:
    from bench.media import _video

    path, seed, frames = args
    if not Path(path).exists():
        _video(Path(path), seed, frames)


def videos(work: Path) -> tuple[Path, list[str]]:
    """``VIDEOS`` H.264 ``.mp4`` in four class folders (made in parallel, once), converted for NVDEC."""
    from multiprocessing import get_context

    from bench.media import _converted

    src = work / (f"h264-{VIDEOS}" if VIDEO_LENGTH == VIDEO_FRAMES else f"h264-{VIDEOS}x{VIDEO_LENGTH}")
    paths = [str(src / f"c{i % 4}" / f"v{i:05d}.mp4") for i in range(VIDEOS)]
    for c in range(4):
        (src / f"c{c}").mkdir(parents=True, exist_ok=True)
    with get_context("spawn").Pool(min(cores(), VIDEOS)) as pool:
        pool.map(_one_video, [(p, i, VIDEO_LENGTH) for i, p in enumerate(paths)])
    return _converted(src, "nvdec"), paths


def tokens(work: Path) -> Path:
    """``bench.tokens``' corpus of ``TOKEN_DOCS`` documents converted to one shard (made once)."""
    from bench.tokens import make_corpus
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    dest = work / f"tokens-{TOKEN_DOCS}"
    if not (dest / "manifest.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        corpus, tok, _ = make_corpus(work, TOKEN_DOCS)
        convert_tokens(TokenConvertConfig(corpus, dest, tok, overwrite=True))
    return dest


def image_text(work: Path) -> Path:
    from bench.image_text import make_dataset

    return make_dataset(work, CONVERSATIONS)


def prepare(work: Path, repeats: int) -> dict[str, Any]:
    out = {}
    for name, make in (("images", image_shards), ("videos", lambda w: videos(w)[0]), ("tokens", tokens),
                       ("image_text", image_text)):
        t = time.perf_counter()
        out[name] = {"path": str(make(work)), "seconds": round(time.perf_counter() - t, 1)}
        print(f"prepared {name} in {out[name]['seconds']} s", flush=True)
    return out


# -- timing helpers ----------------------------------------------------------------------------------------------

def _timed(run: Callable[[], int]) -> dict[str, float]:
    """``run()`` (returning the items it delivered, its GPU work done) timed: items/s and CPU cores busy."""
    cpu, t = cpu_seconds(), time.perf_counter()
    n = run()
    wall, used = time.perf_counter() - t, cpu_seconds() - cpu
    return {"items": n, "seconds": wall, "per_s": n / wall, "cpu_cores_busy": used / wall}


def _rounds(contenders: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[dict[str, float]]]:
    """``repeats`` rounds of every contender, the order reversed every other round; each run once untimed first."""
    for name, run in contenders.items():
        run()
        print(f"  warm {name}", flush=True)
    out: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
    PARTIAL["rounds"] = out
    names = list(contenders)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(_timed(contenders[name]))
            print(f"  round {r + 1}/{repeats} {name:<16} {out[name][-1]['per_s']:10.1f}/s  "
                  f"{out[name][-1]['cpu_cores_busy']:.2f} cores busy", flush=True)
    return out


def _add_peer(contenders: dict[str, Callable[[], int]], name: str, make: Callable[[], Callable[[], int]]) -> None:
    """``make()`` added to ``contenders`` as ``name``; a peer that cannot be made here (megatron-core missing or its
    helpers not built, a reader refusing the files) is left out, said and recorded in the section's ``left_out``,
    so that the section still measures fastio."""
    try:
        contenders[name] = make()
    except Exception as err:  # noqa: BLE001 - any failure of a peer's set-up
        why = f"{type(err).__name__}: {str(err).strip()[:300]}"
        PARTIAL.setdefault("left_out", {})[name] = why
        print(f"  {name} left out: {why}", flush=True)


def _summary(rounds: dict[str, list[dict[str, float]]], ours: str, peers: tuple[str, ...]) -> dict[str, Any]:
    """Medians, and paired ratios of ``ours`` over each peer (median over the rounds of the same round's ratio)."""
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("per_s", "cpu_cores_busy")} for k, v in rounds.items()}
    ratios = {p: statistics.median(a["per_s"] / b["per_s"] for a, b in zip(rounds[ours], rounds[p]))
              for p in peers if p in rounds}
    return {"median": med, "ratios_vs": ratios, "rounds": rounds}


# -- sections ---------------------------------------------------------------------------------------------------

def _blobs(dest: Path, limit: int | None = None) -> list[np.ndarray]:
    from fastio.dataset.dataset import Dataset
    from fastio.read.reader import Reader

    ds = Dataset(dest)
    n = len(ds) if limit is None else min(limit, len(ds))
    with Reader(ds, ["jpg"], threads=4) as reader:
        return [np.array(b) for b in reader.read(np.arange(n))["jpg"]]


def _crops(blobs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(anchor, shape)`` of fastio ``ImageTrain``'s crop window of each blob (seed 0, epoch 0, its position as its
    index): what its graph decodes of each image (``fn.decoders.image_slice``)."""
    import io

    from PIL import Image

    from fastio.pipelines.augment import random_resized_crop

    sizes = np.array([Image.open(io.BytesIO(b.tobytes())).size for b in blobs], np.int64).reshape(-1, 2)
    crop = random_resized_crop(0, 0, np.arange(len(blobs)), sizes[:, 0], sizes[:, 1])
    return crop.anchor, crop.shape


def _decode_run(blobs: list[np.ndarray], load: float, device: str,
                crops: tuple[np.ndarray, np.ndarray] | None = None) -> Callable[[], int]:
    """One pass of mixed decode over ``blobs`` (batches of BATCH fed from memory), nothing else in the graph: each
    whole image, or with ``crops`` only its window, as fastio's ``ImageTrain`` decodes it."""
    from nvidia.dali import fn, pipeline_def, types

    starts = range(0, len(blobs) - BATCH + 1, BATCH)
    batches = [(blobs[i:i + BATCH],) if crops is None else (blobs[i:i + BATCH], crops[0][i:i + BATCH],
                                                             crops[1][i:i + BATCH]) for i in starts]
    state = {"i": 0}

    def feed():
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        return b

    @pipeline_def(batch_size=BATCH, num_threads=cores(), device_id=0 if device == "cuda" else None,
                  prefetch_queue_depth=2)
    def graph():
        inputs = fn.external_source(source=feed, batch=True, num_outputs=len(batches[0]),
                                    dtype=[types.UINT8, types.FLOAT, types.FLOAT][:len(batches[0])])
        args = {"device": "mixed" if device == "cuda" else "cpu", "output_type": types.RGB,
                "adjust_orientation": False, **({"hw_decoder_load": load} if device == "cuda" else {})}
        if crops is None:
            return fn.decoders.image(inputs[0], **args)
        return fn.decoders.image_slice(*inputs, normalized_anchor=False, normalized_shape=False, axis_names="WH",
                                       **args)

    pipe = graph()
    pipe.build()

    def run() -> int:
        state["i"] = 0
        out = None
        for _ in batches:
            (out,) = pipe.run()
        out.as_cpu() if device == "cuda" else None  # the last batch done: the GPU's work is finished
        return len(batches) * BATCH
    return run


def decode(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    blobs = _blobs(image_shards(work))
    crops = _crops(blobs)
    contenders = {f"decode hw={load}": _decode_run(blobs, load, device) for load in LOADS}
    contenders.update({f"crop decode hw={load}": _decode_run(blobs, load, device, crops) for load in LOADS})
    rounds = _rounds(contenders, repeats)
    return {"images": len(blobs), "batch": BATCH, "threads": cores(), **_summary(rounds, next(iter(rounds)), ())}


def _fastio_epoch(dest: Path, device: str, load: float | None) -> Callable[[], int]:
    """A call iterating the next epoch of one Loader (made once: as training iterates one over its epochs)."""
    from fastio import ImageTrain, Loader

    loader = Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE, hw_decoder_load=load), device=device,
                    world_size=1, rank=0)

    def run() -> int:
        n = sum(int((~b["padded"]).sum()) for b in loader)
        synchronize(device)
        return n
    return run


def _dali_epoch(dest: Path, device: str) -> Callable[[], int]:
    """A call running the next epoch of one DALI reader pipeline (built once, as fastio's Loader is made once: a
    pipeline built per epoch would time DALI's build, its index reads and its shuffle buffer's fill each round)."""
    from bench.loader import _dali_pipe, _to_torch

    pipe = _dali_pipe(dest, device, cores())
    total = pipe.epoch_size("reader")

    def run() -> int:
        for _ in range(-(-total // BATCH)):
            img, _ = pipe.run()
            _to_torch(img, device, pipe, sync=False)
        synchronize(device)
        return total
    return run


def _loader_contenders(dest: Path, device: str, names: tuple[str, ...] | None = None) -> dict[str, Callable[[], int]]:
    """Each contender's epoch by name (``names``: only those, nothing else made; a peer that cannot be made is left
    out, :func:`_add_peer`)."""
    out = {f"fastio hw={load}": _fastio_epoch(dest, device, load) for load in LOADS
           if names is None or f"fastio hw={load}" in names}
    peers = {"dali reader": lambda: _dali_epoch(dest, device),
             "dataloader": lambda: lambda: _dataloader(dest, cores(), device)[0]}
    for name, make in peers.items():
        if names is None or name in names:
            _add_peer(out, name, make)
    return out


def loader(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    dest = image_shards(work)
    rounds = _rounds(_loader_contenders(dest, device), repeats)
    result = _summary(rounds, "fastio hw=0.65", ("dali reader", "dataloader", "fastio hw=0.0", "fastio hw=1.0"))
    if device == "cuda":
        result["gpu_memory_mib"] = PARTIAL["gpu_memory_mib"] = {}
        for name in ("fastio hw=0.65", "dali reader", "dataloader"):
            result["gpu_memory_mib"][name] = _in_child("memory", work, name)
    return {"samples": UNIQUE * COPIES, "batch": BATCH, "size": SIZE, **result}


def _gpu_used_mib() -> float:
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def memory(work: Path, name: str) -> float:
    """GPU memory (MiB) one contender keeps in use over an epoch, less what this process held before it started
    (torch's context): sampled after each batch, the most."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    base, peak = _gpu_used_mib(), 0.0
    dest = image_shards(work)
    run = _loader_contenders(dest, "cuda", (name,))[name]
    import threading

    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _gpu_used_mib())
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    run()
    done.set()
    t.join()
    return round(max(peak, _gpu_used_mib()) - base, 1)


def _in_child(section: str, work: Path, name: str) -> Any:
    import subprocess

    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
            f"from pathlib import Path; from bench.gpu import {section}; "
            f"print(json.dumps({section}(Path({str(work)!r}), {name!r})))")
    out = None
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as err:  # a figure missing is reported, not fatal to the section
        said = (out.stderr.strip().splitlines() or [""])[-1] if out is not None else ""  # the child's own error
        return f"failed: {type(err).__name__}: {str(err)[:200]}" + (f" ({said[:300]})" if said else "")


def _model(device: str):
    import torch

    torch.backends.cudnn.benchmark = True
    if MODEL == "tiny conv":  # a check that the section runs (no torchvision needed)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=8), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                    torch.nn.Flatten(), torch.nn.Linear(8, 1000))
    else:
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y.to(device, non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _batches_of(name: str, dest: Path, device: str):
    """An iterator over one epoch of (images, labels) from contender ``name``."""
    import torch

    if name.startswith("fastio"):
        from fastio import ImageTrain, Loader

        load = float(name.split("=")[1]) if "=" in name else None

        def fastio_epoch():
            with Loader(dest, batch_size=BATCH, pipeline=ImageTrain(size=SIZE, hw_decoder_load=load), device=device,
                        world_size=1, rank=0, drop_last=True) as ld:
                yield from ((b["image"], b["label"]) for b in ld)
        return fastio_epoch()
    if name == "dali reader":
        from bench.loader import _dali_pipe, _to_torch

        pipe = _dali_pipe(dest, device, cores())
        total = pipe.epoch_size("reader") // BATCH

        def gen():
            for _ in range(total):
                img, cls = pipe.run()
                labels = torch.tensor([int(bytes(np.array(cls[j])).decode()) for j in range(len(cls))])
                # as DALIGenericIterator: no synchronize, which would wait for the model's queued steps each batch
                yield _to_torch(img, device, pipe, sync=False), labels.pin_memory() if device == "cuda" else labels
        return gen()
    import webdataset as wds

    from bench.loader import PeerTransform

    urls = sorted(str(p) for p in (dest / "shards").glob("*.tar"))
    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker)
          .shuffle(256).decode("pil").to_tuple("jpg", "cls").map(PeerTransform()).batched(BATCH, partial=False))
    return iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=cores(), pin_memory=device == "cuda"))


def train(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    """The stall fraction of a ResNet-50 bf16 epoch fed by each contender (see the module docstring)."""
    import torch

    dest = image_shards(work)
    tiny = MODEL == "tiny conv"
    step = _model(device)
    x = torch.randn(BATCH, 3, SIZE, SIZE, device=device)
    y = torch.randint(0, 1000, (BATCH,), device=device)
    for _ in range(20):
        step(x, y)
    synchronize(device)
    t, n = time.perf_counter(), 60 if not tiny else 3
    for _ in range(n):
        step(x, y)
    synchronize(device)
    step_s = (time.perf_counter() - t) / n
    out: dict[str, Any] = {"model": MODEL, "dtype": "bfloat16", "batch": BATCH,
                           "step_s_on_resident_batch": step_s, "compute_images_per_s": BATCH / step_s, "runs": {}}
    names = ["fastio hw=0.65", "fastio hw=1.0", "dali reader", "dataloader"]
    PARTIAL.update(runs=out["runs"], step_s_on_resident_batch=step_s)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out["runs"].setdefault(name, []).append(_train_epoch(name, dest, device, step, step_s))
            last = out["runs"][name][-1]
            print(f"  train round {r + 1}/{repeats} {name:<16} stall {last['stall_fraction']:.3f}  "
                  f"{last['images_per_s']:.0f} images/s  waited {last['host_wait_fraction']:.3f}", flush=True)
    out["stall_fraction"] = {k: statistics.median(r["stall_fraction"] for r in v) for k, v in out["runs"].items()}
    out["images_per_s"] = {k: statistics.median(r["images_per_s"] for r in v) for k, v in out["runs"].items()}
    return out


def _train_epoch(name: str, dest: Path, device: str, step, step_s: float) -> dict[str, float]:
    it = _batches_of(name, dest, device)
    first = next(it)  # the loader started: its start-up is not a stall of the steady state
    step(*first)
    synchronize(device)
    steps, waited, t = 0, 0.0, time.perf_counter()
    while True:
        w = time.perf_counter()
        try:
            images, labels = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - w
        step(images, labels)
        steps += 1
    synchronize(device)
    wall = time.perf_counter() - t
    return {"steps": steps, "seconds": wall, "images_per_s": steps * BATCH / wall,
            "stall_fraction": max(0.0, 1 - steps * step_s / wall), "host_wait_fraction": waited / wall}


def _video_fastio(dest: Path, device: str) -> Callable[[], int]:
    import fastio

    pipe = fastio.VideoClips(frames=FRAMES, stride=STRIDE, size=CLIP_SIZE, crop="center", dtype="uint8",
                             layout="FCHW")
    ld = fastio.Loader(dest, pipeline=pipe, batch_size=CLIP_BATCH, device=device, seed=0, world_size=1, rank=0)

    def run() -> int:
        n = 0
        for _ in range(4):  # four epochs: 4 x VIDEOS clips
            n += sum(len(b["video"]) for b in ld)
        synchronize(device)
        return n * FRAMES
    return run


def _video_dali(paths: list[str], device: str) -> Callable[[], int]:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=CLIP_BATCH, num_threads=cores(), device_id=0, prefetch_queue_depth=2)
    def graph():
        clip = fn.readers.video(device="gpu", filenames=paths, sequence_length=FRAMES, stride=STRIDE,
                                random_shuffle=True, initial_fill=16, name="reader", dtype=types.UINT8)
        clip = fn.resize(clip, resize_shorter=CLIP_SIZE, antialias=True)
        return fn.crop(clip, crop=(CLIP_SIZE, CLIP_SIZE))

    pipe = graph()
    pipe.build()
    batches = 4 * VIDEOS // CLIP_BATCH  # the clips fastio's run delivers

    def run() -> int:
        out = None
        for _ in range(batches):
            (out,) = pipe.run()
        out.as_cpu()
        return batches * CLIP_BATCH * FRAMES
    return run


def video(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    dest, paths = videos(work)
    contenders = {"fastio VideoClips": _video_fastio(dest, device)}
    if device == "cuda":
        _add_peer(contenders, "dali readers.video", lambda: _video_dali(paths, device))
    rounds = _rounds(contenders, repeats)
    return {"videos": VIDEOS, "clip": [FRAMES, STRIDE, CLIP_SIZE], "unit": "frames",
            **_summary(rounds, "fastio VideoClips", ("dali readers.video",))}


def tokens_section(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    from bench.tokens import fastio_reader, megatron_reader
    from fastio.dataset.manifest import load_manifest

    dest = tokens(work)
    prefix = str(dest / "shards" / load_manifest(dest).shards[0].name[:-len(".bin")])
    contenders = {"fastio Tokens": fastio_reader(dest, SEQ_LEN, device)}
    _add_peer(contenders, "megatron GPTDataset", lambda: megatron_reader(prefix, SEQ_LEN, work / "megatron-cache", device))
    rounds = _rounds(contenders, repeats)
    return {"seq_len": SEQ_LEN, "unit": "tokens", **_summary(rounds, "fastio Tokens", ("megatron GPTDataset",))}


def image_text_section(work: Path, repeats: int, device: str = "cuda") -> dict[str, Any]:
    from bench.image_text import fastio_loader, samples_in
    from bench.image_text_peer import Packing

    dest, packing = image_text(work), Packing()

    def side(dev: str) -> Callable[[], int]:
        ld = fastio_loader(dest, packing, workers=cores(), device=dev)

        def run() -> int:
            n = sum(samples_in(b) for b in ld)
            synchronize(dev)
            return n
        return run

    rounds = _rounds({f"fastio ImageText {device}": side(device), "fastio ImageText cpu": side("cpu")}, repeats)
    return {"conversations": CONVERSATIONS, "unit": "conversations",
            **_summary(rounds, f"fastio ImageText {device}", ("fastio ImageText cpu",))}


RUN = {"prepare": prepare, "decode": decode, "loader": loader, "train": train, "video": video,
       "tokens": tokens_section, "image_text": image_text_section}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=SECTIONS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "gpu")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the same code on the CPU, a check that it runs (no GPU figures)")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    head = {"section": args.section, "machine": machine()}
    PARTIAL.clear()
    previous = _keep_partial_on_term(args.out, head, t)
    kw = {} if args.section == "prepare" else {"device": args.device}
    try:
        result = {**head, **RUN[args.section](args.workdir, args.repeats, **kw)}
    except BaseException as err:  # what the section measured before it failed is kept, then the error raised
        _write(args.out, {**head, "failed": f"{type(err).__name__}: {str(err)[:500]}", **PARTIAL})
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if "left_out" in PARTIAL:
        result["left_out"] = PARTIAL["left_out"]
    result["section_seconds"] = round(time.perf_counter() - t, 1)
    _write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "runs")}, indent=1, default=str))
    return 0


def _write(out: Path, result: dict[str, Any]) -> None:
    (out / f"gpu-{result['section']}.json").write_text(json.dumps(result, indent=1, default=str))


def _keep_partial_on_term(out: Path, head: dict[str, Any], started: float) -> Any:
    """On SIGTERM (``timeout`` in bench/gpu.sh, at the section's cap): write what the section measured so far
    (:data:`PARTIAL`, marked ``cut_off``) and exit 124, as ``timeout`` does, instead of losing it. Returns the
    handler it replaced."""

    def cut_off(signum: int, frame: Any) -> None:
        _write(out, {**head, "cut_off": f"stopped by signal {signum} after {time.perf_counter() - started:.0f} s",
                     **PARTIAL})
        print(f"bench.gpu {head['section']}: cut off; what it measured is in gpu-{head['section']}.json", flush=True)
        os._exit(124)

    return signal.signal(signal.SIGTERM, cut_off)


if __name__ == "__main__":
    sys.exit(main())
