"""Checkpoint benchmark: fastio.Checkpointer against torch.save and torch.distributed.checkpoint (DCP).

Medians of ``repeats`` interleaved runs, for a model + Adam state of ``size_mib``:

- blocked: seconds the training loop is held by one steady-state ``maybe_save`` vs a synchronous
  ``torch.save`` (target <= 0.15) and vs DCP's own ``async_save`` with its default stager, staging
  before it returns (target <= 1.0); the first save of a new Checkpointer (staging buffers allocated)
  vs ``torch.save``;
- overhead: steady steps/s with a checkpoint every ``every`` steps vs none, training on every core; and
  (:mod:`bench.checkpoint_overhead`) training on one torch thread with ``cadence_mib`` of state, in adjacent
  windows of K steps (one save at the first step of a saver's window, between two windows without; the median
  of the ratios over rounds), K from the cadence rule K x step time >= 1x and 4x the write time, for the
  Checkpointer (target <= 3% at 4x), DCP's ``async_save`` with its process checkpointer and the minimal writer
  (:class:`bench.checkpoint_peers.MinimalWriter`); targets: fastio's overhead <= the minimal writer's + 2
  points and <= DCP's, at both cadences; with the seconds the training thread was blocked (save call, wait for
  an unfinished write) and slowed (its steps over the neighbouring windows');
- CPU: user and system seconds per GiB written, whole process, steady saves of ``cadence_mib``
  (:func:`bench.checkpoint_peers.cpu_per_gib`): the Checkpointer with each engine, the minimal writer, and
  ``dcp.save``/``dcp.async_save`` used directly;
- resume: process start to the first batch after ``restore_latest`` vs to the first batch of a fresh
  start (target <= 1.5x); both are fresh interpreters, the page cache is warm in both;
- integrity: seconds per GiB to check a checkpoint's files against their recorded checksums (what
  every restore pays), xxh3-128 against the sha256 of older commits;
- fsdp2: 2 gloo ranks, an FSDP2 model: blocking save (to commit) and restore through the Checkpointer
  vs ``dcp.save``/``dcp.load`` of ``get_state_dict`` used directly (target <= 1.25); each restore and load
  timed after a full garbage collection on both ranks (:func:`bench.model.line_up`), so that none lands inside
  one (0.15-0.28 s against restores of ~0.2 s; the saves, 1-2 s, are timed as before);
- compression: bytes and MB/s of zstd, with and without a byte shuffle of float tensors, on the weights
  and Adam moments of a small model trained a few hundred steps; then the Checkpointer on that same state
  with ``compression=None``, ``"zstd"`` and ``"zstd+shuffle"`` (both engines): bytes written, blocking save
  to commit, restore.

Each measurement first waits for a quiet machine (:mod:`bench.quiet`, ``--quiet-wait`` seconds at most); a figure
measured while other processes kept the cores busy is printed with that note, and its ratios carry it.

    python -m bench.checkpoint [--size-mib 1024] [--repeats 3] [--cadence-mib 512]   # writes bench/out/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.checkpoint_peers import cpu_per_gib
from bench.common import RESULTS_DIR, cores, interleaved, machine_info, section_parser, time_call, write_results
from bench.model import build, end_rank, line_up, state_mib, train_step
from bench.quiet import MAX_WAIT_S, Quiet, before_section, during, read_sample, readings, wait_quiet
from fastio import ImageTrain

__all__ = ["run"]

def make_dataset(dest: Path) -> Path:
    """A tiny image dataset for the Loader in the resume measurement."""
    from fastio.convert.run import ConvertConfig, convert
    from fastio.convert.synthetic import make_imagefolder

    if (dest / "manifest.json").exists():
        return dest
    src = make_imagefolder(dest.parent / "src", classes=4, per_class=16)
    convert(ConvertConfig(source=src, dest=dest, max_samples_per_shard=16, workers=1, overwrite=True))
    return dest


# ------------------------------------------------------------------ blocked time
def measure_blocked(work: Path, size_mib: int, repeats: int) -> dict:
    from fastio.checkpoint import Checkpointer

    model, optim = build(size_mib)
    train_step(model, optim)
    app = {"model": model, "optim": optim}
    ckpt = Checkpointer(work / "blocked", keep=1, signals=())
    target = work / "torch_save.pt"
    step = [0]

    def fastio_save():
        step[0] += 1
        ckpt.maybe_save(step[0], app, force=True)

    def torch_save():
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, target)

    def torch_save_fsync():  # what a synchronous save that survives a crash costs
        with open(target, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def before(name: str):
        ckpt.wait()  # the previous background write is not part of the next measurement
        target.unlink(missing_ok=True)

    dcp_dir = work / "dcp_async"
    pending: list = []

    def dcp_async_save():  # DCP's own async save: stages (default stager) before it returns
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pinned = torch.cuda.is_available()
        stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=pinned))
        pending.append(dcp.async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                                      checkpoint_id=str(dcp_dir / str(len(pending))), async_stager=stager,
                                      no_dist=True))

    def before_all(name: str):
        before(name)
        while pending:
            fut = pending.pop()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        shutil.rmtree(dcp_dir, ignore_errors=True)
        # The previous contender's file is still being written back by the kernel (torch.save's and DCP's are
        # never fsynced); that writeback would land on whichever call comes next. Every timed call starts clean.
        os.sync()

    first_s = time_call(fastio_save)  # the first save allocates the staging buffers; steady state reuses them
    times = interleaved({"fastio_maybe_save": fastio_save, "torch_save": torch_save,
                         "torch_save_fsync": torch_save_fsync, "dcp_async_save": dcp_async_save}, repeats,
                        before=before_all)
    before_all("")
    ckpt.close()
    target.unlink(missing_ok=True)
    dcp_median = statistics.median(times["dcp_async_save"])
    ours, peer = statistics.median(times["fastio_maybe_save"]), statistics.median(times["torch_save"])
    return {"state_mib": state_mib(model, optim), "fastio_blocked_s": times["fastio_maybe_save"],
            "torch_save_s": times["torch_save"], "torch_save_fsync_s": times["torch_save_fsync"],
            "fastio_median_s": ours, "torch_save_median_s": peer,
            "torch_save_fsync_median_s": statistics.median(times["torch_save_fsync"]),
            "ratio": ours / peer, "ratio_vs_fsync": ours / statistics.median(times["torch_save_fsync"]),
            "dcp_async_save_s": times["dcp_async_save"], "dcp_async_save_median_s": dcp_median,
            "ratio_vs_dcp_async": ours / dcp_median, "first_save_s": first_s, "first_ratio": first_s / peer}


# ------------------------------------------------------------------ steady throughput
def measure_overhead(work: Path, size_mib: int, repeats: int, steps: int, every: int, threads: int) -> dict:
    """Steps/s with and without checkpoints, training on ``threads`` torch threads."""
    from fastio.checkpoint import Checkpointer

    torch.set_num_threads(threads)
    model, optim = build(size_mib)
    train_step(model, optim)
    app = {"model": model, "optim": optim}
    shutil.rmtree(work / "steady", ignore_errors=True)
    ckpt = Checkpointer(work / "steady", every_steps=every, keep=1, signals=())
    base = [every // 2]  # saves fall mid-window, so each one's background write is timed in full
    writes: list[float] = []

    def loop(save: bool):
        for i in range(1, steps + 1):
            loss = train_step(model, optim)
            if save and ckpt.maybe_save(base[0] + i, app, metrics={"loss": loss}):
                saves[0] += 1
        base[0] += steps

    saves = [0]

    def before(name: str):
        ckpt.wait()
        if ckpt.last_write_s:
            writes.append(ckpt.last_write_s)

    loop(True)  # warm-up: staging buffers, page cache, allocator
    times = interleaved({"with_checkpoints": lambda: loop(True), "without": lambda: loop(False)}, repeats,
                        before=before)
    ckpt.close()
    ours, peer = statistics.median(times["with_checkpoints"]), statistics.median(times["without"])
    return {"steps": steps, "every_steps": every, "torch_threads": threads,
            "checkpoints_per_run": saves[0] / (repeats + 1),
            "write_s_median": statistics.median(writes) if writes else None,
            "with_checkpoints_s": times["with_checkpoints"],
            "without_s": times["without"], "step_s_with": ours / steps, "step_s_without": peer / steps,
            "overhead": ours / peer - 1.0}


# ------------------------------------------------------------------ time to first batch
def child(mode: str, ckpt_dir: str, data: str, size_mib: int) -> None:
    """Run in a fresh interpreter: build, restore (or not), fetch one batch, print the wall time."""
    from fastio.checkpoint import Checkpointer
    from fastio.loader import Loader

    model, optim = build(size_mib, seed=1)
    loader = Loader(data, batch_size=8, device="cpu", pipeline=ImageTrain(size=32), seed=0,
                    rank=0, world_size=1)
    app = {"model": model, "optim": optim, "loader": loader}
    ckpt = Checkpointer(ckpt_dir, signals=())
    state = ckpt.restore_latest(app) if mode == "resume" else None
    if (mode == "resume") != (state is not None):
        raise SystemExit(f"bench child: mode {mode} but restore_latest returned {state}")
    batch = next(iter(loader))
    stamp = time.time()
    train_step(model, optim, batch["image"])
    print(json.dumps({"first_batch_at": stamp, "step": state.step if state else None}), flush=True)
    loader.close()
    ckpt.close()


def _run_child(mode: str, ckpt_dir: Path, data: Path, size_mib: int) -> float:
    start = time.time()
    out = subprocess.run([sys.executable, "-m", "bench.checkpoint", "--child", mode, "--ckpt-dir", str(ckpt_dir),
                          "--data", str(data), "--size-mib", str(size_mib)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["first_batch_at"] - start


def measure_resume(work: Path, size_mib: int, repeats: int) -> dict:
    from fastio.checkpoint import Checkpointer
    from fastio.loader import Loader

    data = make_dataset(work / "dataset")
    ckpt_dir, empty = work / "resume", work / "resume-empty"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    empty.mkdir(parents=True, exist_ok=True)
    model, optim = build(size_mib, seed=1)
    loader = Loader(data, batch_size=8, device="cpu", pipeline=ImageTrain(size=32), seed=0,
                    rank=0, world_size=1)
    it = iter(loader)
    for _ in range(3):  # a mid-epoch position, so the resumed loader must skip what was consumed
        train_step(model, optim, next(it)["image"])
    with Checkpointer(ckpt_dir, signals=()) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim, "loader": loader}, blocking=True)
    loader.close()
    del model, optim
    times: dict[str, list[float]] = {"resume": [], "fresh": []}
    for _ in range(repeats):
        times["resume"].append(_run_child("resume", ckpt_dir, data, size_mib))
        times["fresh"].append(_run_child("fresh", empty, data, size_mib))
    ours, peer = statistics.median(times["resume"]), statistics.median(times["fresh"])
    return {"resume_s": times["resume"], "fresh_s": times["fresh"], "resume_median_s": ours,
            "fresh_median_s": peer, "ratio": ours / peer}


# ------------------------------------------------------------------ integrity: what restore's check costs
def measure_integrity(work: Path, size_mib: int) -> dict:
    """Seconds per GiB to check every file of a committed checkpoint (warm page cache), both checksums."""
    from fastio.checkpoint import Checkpointer, catalog, scan
    from fastio.storage.checksum import digest_file

    model, optim = build(size_mib)
    train_step(model, optim)
    with Checkpointer(work / "integrity", signals=()) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    del model, optim
    entry = scan.committed(work / "integrity")[0]
    gib = entry.commit.bytes / 2**30
    files = [entry.path / rel for rel in entry.commit.files]
    for f in files:  # warm the page cache: the figure is the checksum's, not the disk's
        digest_file(f, "xxh3_128")
    xxh3 = time_call(lambda: catalog.verify_files(entry))  # what restore_latest runs
    with ThreadPoolExecutor(4) as pool:
        xxh3_four = time_call(lambda: list(pool.map(lambda f: digest_file(f, "xxh3_128"), files)))
        sha = time_call(lambda: list(pool.map(lambda f: digest_file(f, "sha256"), files)))
    restore_s = time_call(lambda: _restore_once(work / "integrity", size_mib))
    shutil.rmtree(work / "integrity", ignore_errors=True)
    return {"gib": gib, "xxh3_s_per_gib": xxh3 / gib, "xxh3_four_threads_s_per_gib": xxh3_four / gib,
            "sha256_s_per_gib": sha / gib, "restore_s": restore_s, "restore_check_share": xxh3 / restore_s}


def _restore_once(root: Path, size_mib: int) -> None:
    from fastio.checkpoint import Checkpointer

    model, optim = build(size_mib, seed=1)
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.restore_latest({"model": model, "optim": optim})


# ------------------------------------------------------------------ FSDP2 on 2 gloo ranks
def _fsdp_worker(rank: int, port: int, work: str, size_mib: int, repeats: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from fastio.checkpoint import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, optim = build(size_mib)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)  # over the sharded parameters
    train_step(model, optim)
    app = {"model": model, "optim": optim}
    root = Path(work) / "fsdp-fastio"
    ckpt = Checkpointer(root, keep=1, signals=())
    step = [0]

    def timed(fn, *, collected: bool = False) -> float:
        if collected:  # the restores: no full collection left to land inside the call (bench.model.line_up)
            line_up()
        else:
            dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def fastio_save():
        step[0] += 1
        ckpt.save(step[0], app, blocking=True)

    # The peer saves into a new directory each time and then deletes the previous one, as the Checkpointer does
    # (keep=1: write step-N beside step-N-1, commit, prune). Overwriting one directory in place instead recycles
    # the pages and blocks it frees at once, which on this project's VM made the same dcp.save up to 3x faster
    # than writing new files, and leaves no intact checkpoint while it runs.
    dcp_dirs: list[Path] = []
    dcp_saves = [0]

    def dcp_save():
        msd, osd = get_state_dict(model, optim)
        dcp_saves[0] += 1
        dcp_dirs.append(Path(work) / f"fsdp-dcp-{dcp_saves[0]}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dirs[-1]))
        dist.barrier()
        if rank == 0:
            for old in dcp_dirs[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        del dcp_dirs[:-1]

    def dcp_load():
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(dcp_dirs[-1]))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    times: dict[str, list[float]] = {"fastio_save": [], "dcp_save": [], "fastio_restore": [], "dcp_load": []}
    fastio_save()  # warm-up: staging buffers
    dcp_save()
    for _ in range(repeats):
        times["fastio_save"].append(timed(fastio_save))
        times["dcp_save"].append(timed(dcp_save))
        times["fastio_restore"].append(timed(lambda: ckpt.restore_latest(app), collected=True))
        times["dcp_load"].append(timed(dcp_load, collected=True))
    ckpt.close()
    end_rank(rank, Path(work, "fsdp.json"), times)


def measure_fsdp(work: Path, size_mib: int, repeats: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fsdp_worker, args=(r, port, str(work), size_mib, repeats)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    times = json.loads((work / "fsdp.json").read_text())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"times": times, "median_s": med, "save_ratio": med["fastio_save"] / med["dcp_save"],
            "restore_ratio": med["fastio_restore"] / med["dcp_load"]}


# ------------------------------------------------------------------ compression (measurement)
def trained_state(steps: int = 300, width: int = 512) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of an MLP trained ``steps`` steps on a synthetic 10-class problem."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 64, generator=g) * 2
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        y = torch.randint(0, 10, (128,), generator=g)
        x = centers[y] + torch.randn(128, 64, generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, st in optim.state.items():
        out.update({f"optim/{i}/{k}": v for k, v in st.items() if v.dim() > 0})
    return out


def _shuffle(raw: bytes, width: int) -> bytes:
    """Byte shuffle: all first bytes of each element, then all second bytes, ... (as blosc/HDF5 do)."""
    import numpy as np

    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.tobytes()


def measure_compression(state: dict[str, torch.Tensor], levels: tuple[int, ...] = (1, 3)) -> dict:
    import zstandard

    blobs = [v.detach().contiguous().numpy().tobytes() for v in state.values()]
    total = sum(map(len, blobs))
    rows = {}
    for level in levels:
        for shuffle in (False, True):
            data = [_shuffle(b, 4) if shuffle else b for b in blobs]
            comp = zstandard.ZstdCompressor(level=level)
            t = time.perf_counter()
            packed = [comp.compress(b) for b in data]
            c_s = time.perf_counter() - t
            dec = zstandard.ZstdDecompressor()
            t = time.perf_counter()
            for p in packed:
                dec.decompress(p)
            d_s = time.perf_counter() - t
            size = sum(map(len, packed))
            rows[f"zstd{level}{'+shuffle' if shuffle else ''}"] = {
                "bytes": size, "ratio": total / size, "compress_mb_s": total / c_s / 1e6,
                "decompress_mb_s": total / d_s / 1e6}
    return {"raw_bytes": total, "tensors": len(blobs), "codecs": rows}


class _Tensors:
    """App object over a dict of tensors (state_dict as is, load_state_dict copies in place)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.tensors[k].copy_(v)


def measure_checkpointer_compression(work: Path, state: dict[str, torch.Tensor], repeats: int) -> dict:
    """The Checkpointer with and without ``compression="zstd"`` on the trained state, both engines: bytes in
    the commit, blocking save to commit and restore (medians; each save into a new directory)."""
    from fastio.checkpoint import Checkpointer

    state = {f"t{j}": v for j, v in enumerate(state.values())}  # plain keys: they become file names
    rows = {}
    for engine in ("torchsnapshot", "dcp"):
        for compression in (None, "zstd", "zstd+shuffle"):
            saves, restores, size = [], [], 0
            for i in range(repeats):
                root = work / f"compress-{engine}-{compression}-{i}"
                with Checkpointer(root, signals=(), engine=engine, compression=compression) as ckpt:
                    t = time.perf_counter()
                    ckpt.save(1, {"state": _Tensors(state)}, blocking=True)
                    saves.append(time.perf_counter() - t)
                size = json.loads((root / "step-1" / "fastio-commit.json").read_text())["bytes"]
                fresh = _Tensors({k: torch.empty_like(v) for k, v in state.items()})
                with Checkpointer(root, signals=()) as ckpt:
                    t = time.perf_counter()
                    ckpt.restore_latest({"state": fresh})
                    restores.append(time.perf_counter() - t)
                assert all(torch.equal(fresh.tensors[k], v) for k, v in state.items())
                shutil.rmtree(root, ignore_errors=True)
            rows[f"{engine}/{compression or 'none'}"] = {"bytes": size, "save_median_s": statistics.median(saves),
                                                          "restore_median_s": statistics.median(restores)}
    return rows


def run(workdir: Path, repeats: int = 3, size_mib: int = 1024, steps: int = 20, every: int = 10,
        cadence_mib: int = 512, results_dir: Path | None = RESULTS_DIR, quiet_wait: float = MAX_WAIT_S) -> dict:
    """All the measurements, each after a wait of at most ``quiet_wait`` seconds for a quiet machine (what the other
    processes used before and during it is recorded as its ``quiet`` and printed beside its figure); writes
    ``checkpoint.json`` under ``results_dir`` (None: nothing written) and returns the JSON-able result (``ratios``
    for bench.run's summary)."""
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    n = cores()
    torch.set_num_threads(n)
    t0 = time.perf_counter()
    result = {"size_mib": size_mib, "repeats": repeats, "machine": machine_info()}
    result["blocked"] = _quietly(quiet_wait, measure_blocked, workdir, size_mib, repeats)
    _print_blocked(result["blocked"])
    result["steady"] = _quietly(quiet_wait, measure_overhead, workdir, size_mib, repeats, steps, every, threads=n)
    _print_steady(result["steady"], n)
    result["cadence"] = _cadence(workdir, cadence_mib, repeats, quiet_wait)
    result["cpu"] = _quietly(quiet_wait, cpu_per_gib, workdir / "cpu", cadence_mib, max(2, repeats))
    _print_cpu(result["cpu"])
    torch.set_num_threads(n)
    result["resume"] = _quietly(quiet_wait, measure_resume, workdir, size_mib, repeats)
    _print_resume(result["resume"])
    result["integrity"] = _quietly(quiet_wait, measure_integrity, workdir, size_mib)
    _print_integrity(result["integrity"])
    result["fsdp2"] = _quietly(quiet_wait, measure_fsdp, workdir, size_mib, repeats)
    _print_fsdp(result["fsdp2"])
    result["compression"] = _quietly(quiet_wait, _compression, workdir, repeats)
    shutil.rmtree(workdir, ignore_errors=True)
    result["seconds"] = time.perf_counter() - t0
    result["ratios"] = _ratios(result)
    if results_dir is not None:
        print(f"wrote {write_results('checkpoint', result, results_dir)}")
    return result


def _quietly(quiet_wait: float, measure: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
    """``measure(*args, **kwargs)`` after waiting for a quiet machine (at most ``quiet_wait`` s), with ``quiet``:
    what the other processes used of the cores before and during it."""
    before = wait_quiet(max_wait=quiet_wait)
    start = read_sample()
    result = measure(*args, **kwargs)
    result["quiet"] = {"before": before.as_dict(), "during": during(start, read_sample()).as_dict()}
    return result


def busy_note(*quiets: Any) -> str:
    """`` [machine busy: ...]`` for beside a figure when any reading in ``quiets`` (see
    :func:`bench.quiet.readings`) found the machine busy; empty when all were quiet."""
    found = [Quiet(**q).note() for one in quiets for q in readings(one) if q["busy"]]
    return f" [{'; '.join(dict.fromkeys(found))}]" if found else ""


def _print_blocked(blocked: dict) -> None:
    print(f"blocked: maybe_save {blocked['fastio_median_s']:.3f}s vs torch.save {blocked['torch_save_median_s']:.3f}s"
          f" = {blocked['ratio']:.3f} (target <= 0.15) for {blocked['state_mib']:.0f} MiB; torch.save + fsync "
          f"{blocked['torch_save_fsync_median_s']:.3f}s = {blocked['ratio_vs_fsync']:.3f}; DCP async_save "
          f"{blocked['dcp_async_save_median_s']:.3f}s = {blocked['ratio_vs_dcp_async']:.3f} (target <= 1.0)"
          f"{busy_note(blocked['quiet'])}", flush=True)
    print(f"first save of a new Checkpointer: {blocked['first_save_s']:.3f}s = {blocked['first_ratio']:.3f} x "
          "torch.save", flush=True)


def _print_steady(steady: dict, cores: int) -> None:
    print(f"steady, all {cores} cores busy: {steady['step_s_with']:.3f}s/step with a checkpoint every "
          f"{steady['every_steps']} steps vs {steady['step_s_without']:.3f}s/step without = "
          f"{100 * steady['overhead']:+.1f}%; one background write took {steady['write_s_median'] or 0:.2f}s"
          f"{busy_note(steady['quiet'])}", flush=True)


def _print_cpu(cpu: dict) -> None:
    for name, row in cpu["savers"].items():
        print(f"CPU per GiB written, steady, {cpu['gib'] * 1024:.0f} MiB, whole process: {name:<21} "
              f"{row['user_s_per_gib']:.3f} s user + {row['sys_s_per_gib']:.3f} s sys; read back "
              f"{row['read_gib_per_gib']:.2f} GiB, wrote {row['written_gib_per_gib']:.2f} GiB{busy_note(cpu['quiet'])}",
              flush=True)


def _print_resume(resume: dict) -> None:
    print(f"resume: first batch {resume['resume_median_s']:.2f}s after start vs fresh {resume['fresh_median_s']:.2f}s"
          f" = {resume['ratio']:.2f}x (target <= 1.5){busy_note(resume['quiet'])}", flush=True)


def _print_integrity(integrity: dict) -> None:
    print(f"integrity: restore checks {integrity['xxh3_s_per_gib']:.3f}s/GiB (xxh3-128, one thread; "
          f"{integrity['xxh3_four_threads_s_per_gib']:.3f}s/GiB on four) vs sha256 {integrity['sha256_s_per_gib']:.3f}"
          f"s/GiB (four threads); {100 * integrity['restore_check_share']:.0f}% of a {integrity['restore_s']:.2f}s "
          f"restore{busy_note(integrity['quiet'])}", flush=True)


def _print_fsdp(fsdp: dict) -> None:
    m = fsdp["median_s"]
    print(f"fsdp2, 2 gloo ranks: save to commit {m['fastio_save']:.3f}s vs dcp.save {m['dcp_save']:.3f}s = "
          f"{fsdp['save_ratio']:.2f}; restore {m['fastio_restore']:.3f}s vs dcp.load {m['dcp_load']:.3f}s = "
          f"{fsdp['restore_ratio']:.2f} (targets <= 1.25){busy_note(fsdp['quiet'])}", flush=True)


CADENCE_SAVERS = ("fastio", "dcp_process", "minimal")
"""The cadence rows' savers: the Checkpointer, DCP's ``async_save`` (process checkpointer), the minimal writer."""


def _cadence(workdir: Path, cadence_mib: int, repeats: int, quiet_wait: float) -> dict:
    """The cadence rows (printed as measured): on a GPU node the host cores mostly wait on the device; training on
    one torch thread is the CPU-only stand-in for that (the writer gets the other core). Adjacent windows of K
    steps, K from the cadence rule K x step >= factor x write, at 1x (the writer always busy) and 4x; each round
    waits for a quiet machine."""
    from bench.checkpoint_overhead import measure as measure_cadence

    cadence = measure_cadence(workdir / "cadence", cadence_mib, repeats, CADENCE_SAVERS, factors=(1.0, 4.0),
                              quiet_wait=quiet_wait)
    for name, c in sorted(cadence["cadences"].items(), key=lambda item: item[1]["factor"]):
        rows, again = c["savers"], c.get("recalibrated_from_write_s")
        redo = f" (measured again: the calibration's {again:.2f}s was off)" if again else ""
        print(f"cadence {name}, one torch thread, {cadence['size_mib']} MiB: step {cadence['step_s']:.3f}s, write "
              f"{c['write_s']:.2f}s{redo} -> a checkpoint every {c['every']} steps, adjacent windows, median of "
              f"{cadence['rounds']}: " + "; ".join(
                  f"{n} {100 * r['overhead']:+.1f}% (blocked {r['blocked_per_save_s']:.3f}s, steps slowed "
                  f"{r['slowed_per_save_s']:+.3f}s per save)" for n, r in rows.items()) + busy_note(c["quiet"]),
              flush=True)
    return cadence


def _compression(workdir: Path, repeats: int) -> dict:
    """zstd on trained state, and the Checkpointer with each compression (printed as measured)."""
    trained = trained_state()
    compression = measure_compression(trained)
    for name, row in compression["codecs"].items():
        print(f"compression {name:<14} {compression['raw_bytes'] / 2**20:.1f} MiB -> {row['bytes'] / 2**20:.1f} MiB "
              f"(x{row['ratio']:.3f}), {row['compress_mb_s']:.0f} MB/s in, {row['decompress_mb_s']:.0f} MB/s out",
              flush=True)
    compression["checkpointer"] = measure_checkpointer_compression(workdir, trained, repeats)
    for name, row in compression["checkpointer"].items():
        print(f"compression Checkpointer {name:<20} {row['bytes'] / 2**20:.2f} MiB written, save to commit "
              f"{row['save_median_s']:.3f}s, restore {row['restore_median_s']:.3f}s", flush=True)
    return compression


def _ratios(result: dict) -> list[dict]:
    """The section's ratios against their targets (bench.run's summary), each with the ``quiet`` of what it was
    measured in."""
    blocked, fsdp, resume = result["blocked"], result["fsdp2"], result["resume"]

    def row(name: str, value: float, target: float, quiet: Any) -> dict:
        return {"name": name, "value": value, "target": target, "better": "lower", "quiet": quiet}

    rows = [row("maybe_save blocked / torch.save", blocked["ratio"], 0.15, blocked["quiet"]),
            row("maybe_save blocked / DCP async_save", blocked["ratio_vs_dcp_async"], 1.0, blocked["quiet"])]
    for name, c in result["cadence"]["cadences"].items():
        ours, dcp, minimal = (c["savers"][n]["overhead"] for n in CADENCE_SAVERS)
        where = f"one torch thread, a checkpoint every {c['every']} steps ({name} its write)"
        if c["factor"] >= 4:
            rows.append(row(f"overhead, {where} (fraction)", ours, 0.03, c["quiet"]))
        rows += [row(f"overhead - the minimal writer's, {where}", ours - minimal, 0.02, c["quiet"]),
                 row(f"overhead - DCP async_save's, {where}", ours - dcp, 0.0, c["quiet"])]
    return rows + [
        row("fsdp2 save to commit / dcp.save", fsdp["save_ratio"], 1.25, fsdp["quiet"]),
        row("fsdp2 restore / dcp.load", fsdp["restore_ratio"], 1.25, fsdp["quiet"]),
        row("first batch: resume / fresh start", resume["ratio"], 1.5, resume["quiet"]),
    ]


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint``."""
    p = section_parser(__doc__)
    p.add_argument("--size-mib", type=int, default=1024, help="model + Adam state size (MiB)")
    p.add_argument("--steps", type=int, default=20, help="steps per steady-throughput run")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps in the steady run")
    p.add_argument("--cadence-mib", type=int, default=512, help="state size (MiB) of the one-thread cadence rows")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "checkpoint")
    p.add_argument("--child", choices=("fresh", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        child(args.child, args.ckpt_dir, args.data, args.size_mib)
        return 0
    before_section(args.quiet_wait)
    run(args.workdir, repeats=args.repeats, size_mib=args.size_mib, steps=args.steps, every=args.every,
        cadence_mib=args.cadence_mib, results_dir=args.out, quiet_wait=args.quiet_wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
