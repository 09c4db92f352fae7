"""Restart benchmark: time back to training after a preemption, fastio against what a user would otherwise run.

Each round starts a fresh interpreter per contender (``python -m bench.restart --child NAME``) that restores
``size_mib`` of state (a model + Adam, :mod:`bench.model`) saved mid-epoch over a dataset of ``samples`` small
JPEGs, and takes its first trained step: the figure is the wall time from the parent starting the process to
that step's end. Contenders:

- ``fastio``: ``fastio.Loader`` (``ImageTrain(size=32)``) and ``Checkpointer.restore_latest`` of
  ``{"model", "optim", "loader"}`` (the loader resumes at the saved position: nothing replayed);
- ``dcp_stateful``: ``torch.distributed.checkpoint.load`` of the model and optimizer (``get_state_dict`` /
  ``set_state_dict``) with torchdata's ``StatefulDataLoader`` over ``webdataset.WebDataset`` (PIL decode, the
  same crop/resize/flip/normalize; its state pickled into the checkpoint, as torchtitan does); a WebDataset
  keeps no state, so ``StatefulDataLoader`` fast-forwards it by the samples its workers had yielded;
- ``torch_load``: ``torch.load`` of one file and a plain ``DataLoader`` over the same WebDataset that skips the
  consumed batches (what ``accelerate.skip_first_batches`` does).

The DataLoaders run ``cores`` worker processes. Rounds are interleaved and rotated; figures are medians, and
each ratio is fastio's median over the peer's (lower is better; target <= 0.667: at least 1.5x faster). Inside the fastio
child, timestamps show where its time goes: interpreter start and imports (torch, fastio), the model built,
the Loader open, ``restore_latest`` (and the checksum check of every file inside it), the first batch
(DALI's import and pipeline build included) and the first step.

``python -m bench.restart [--repeats 3] [--samples 100000] [--size-mib 512]`` writes ``bench/out/restart.json``;
``--tiny`` (2,000 samples, 48 MiB) checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, cores, machine_info, section_parser, write_results
from bench.quiet import before_section

__all__ = ["make_dataset", "run"]

CONTENDERS = ("fastio", "dcp_stateful", "torch_load")
BATCH = 64
SIZE = 32
SHARD_SAMPLES = 1000
TARGET = 0.667  # fastio's time over each peer's: at least 1.5x faster
PHASES = ("started", "imported", "model", "loader_open", "restored", "first_batch", "stepped")


def make_dataset(workdir: Path, samples: int) -> Path:
    """``workdir/small-N``: a fastio dataset of ``samples`` small JPEGs (40..64 px; 256 distinct images, repeated)
    with labels, in shards of 1,000; reused if there."""
    import numpy as np

    from fastio.convert.synthetic import photo_jpeg
    from fastio.dataset.shards import ShardWriter

    dest = Path(workdir) / f"small-{samples}"
    if (dest / "manifest.json").is_file():
        return dest
    rng = np.random.default_rng(0)
    images = [photo_jpeg(rng, int(rng.integers(40, 65)), int(rng.integers(40, 65))) for _ in range(256)]
    with ShardWriter(dest, name="small", max_samples=SHARD_SAMPLES) as writer:
        for i in range(samples):
            writer.write({"__key__": f"s{i:07d}", "jpg": images[i % len(images)], "cls": str(i % 10).encode()})
        writer.close(image_field="jpg", label_field="cls")
    return dest


# -- the peers' data: WebDataset over the same shards, PIL decode, the same transform ------------------

def _webdataset(dest: Path):
    import webdataset as wds

    from bench.loader import PeerTransform

    urls = sorted(str(p) for p in (Path(dest) / "shards").glob("*.tar"))
    return (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker)
            .decode("pil").to_tuple("jpg", "cls").map(PeerTransform(SIZE)))


def _workers() -> int:
    return cores()


# -- the children: one restart each, timestamps on stdout ----------------------------------------------

def _child_fastio(stamp, work: Path, data: Path, size_mib: int) -> None:
    import torch  # noqa: F401  (the training script's imports)

    import fastio
    from bench.model import build, train_step

    stamp("imported")
    model, optim = build(size_mib, seed=1)
    stamp("model")
    loader = fastio.Loader(data, batch_size=BATCH, pipeline=fastio.ImageTrain(size=SIZE), device="cpu", seed=0,
                           rank=0, world_size=1)
    stamp("loader_open")
    checksum = _timing_checksums()
    with fastio.Checkpointer(work / "fastio", signals=()) as ckpt:
        state = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
        if state is None:
            raise SystemExit("bench.restart: fastio's checkpoint is missing")
        stamp("restored", checksum_s=checksum())
        batch = next(iter(loader))
        stamp("first_batch")
        train_step(model, optim, batch["image"])
        stamp("stepped", consumed=loader.state_dict()["consumed"])
    loader.close()


def _timing_checksums():
    """Time spent in the Checkpointer's check of every file (``catalog.verify_files``), as a callable; it
    returns None when this fastio checks elsewhere (e.g. while reading)."""
    from fastio.checkpoint import catalog

    original = getattr(catalog, "verify_files", None)
    if original is None:
        return lambda: None
    spent = [0.0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    catalog.verify_files = timed
    return lambda: spent[0]


def _child_dcp_stateful(stamp, work: Path, data: Path, size_mib: int) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torchdata.stateful_dataloader import StatefulDataLoader

    from bench.model import build, train_step

    stamp("imported")
    model, optim = build(size_mib, seed=1)
    stamp("model")
    loader = StatefulDataLoader(_webdataset(data), batch_size=BATCH, num_workers=_workers())
    stamp("loader_open")
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "loader": b""}
    dcp.load(state, checkpoint_id=str(work / "dcp"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loader.load_state_dict(pickle.loads(state["loader"]))
    stamp("restored")
    images, _ = next(iter(loader))
    stamp("first_batch")
    train_step(model, optim, images)
    stamp("stepped")


def _child_torch_load(stamp, work: Path, data: Path, size_mib: int) -> None:
    import torch

    from bench.model import build, train_step

    stamp("imported")
    model, optim = build(size_mib, seed=1)
    stamp("model")
    loader = torch.utils.data.DataLoader(_webdataset(data), batch_size=BATCH, num_workers=_workers())
    stamp("loader_open")
    state = torch.load(work / "plain.pt")
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    stamp("restored")
    it = iter(loader)
    for _ in range(state["batches"]):  # skip what the run before the restart consumed
        next(it)
    images, _ = next(it)
    stamp("first_batch")
    train_step(model, optim, images)
    stamp("stepped")


_CHILDREN = {"fastio": _child_fastio, "dcp_stateful": _child_dcp_stateful, "torch_load": _child_torch_load}


def child(name: str, work: Path, data: Path, size_mib: int) -> None:
    """One restart of contender ``name`` in this (fresh) interpreter; prints one JSON line of wall-clock
    timestamps (``time.time()``, comparable with the parent's) and extras."""
    out: dict = {}

    def stamp(phase: str, **extra) -> None:
        out[phase] = time.time()
        out.update(extra)

    stamp("started")
    _CHILDREN[name](stamp, work, data, size_mib)
    print(json.dumps(out), flush=True)


def _run_child(name: str, work: Path, data: Path, size_mib: int) -> dict:
    """Seconds from launching the child to each of its phases (and its extras)."""
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "bench.restart", "--child", name, "--workdir", str(work),
                           "--data", str(data), "--size-mib", str(size_mib)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise RuntimeError(f"bench.restart child {name} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: (v - launched if k in PHASES else v) for k, v in got.items()}


# -- the checkpoints every child restores ---------------------------------------------------------------

def prepare(work: Path, data: Path, size_mib: int, batches: int) -> None:
    """The state of a run preempted after ``batches`` batches of its first epoch, saved by each contender's
    way: ``work/fastio`` (Checkpointer), ``work/dcp`` (DCP, the StatefulDataLoader's state in it),
    ``work/plain.pt`` (torch.save)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torchdata.stateful_dataloader import StatefulDataLoader

    import fastio
    from bench.model import build, train_step

    for old in ("fastio", "dcp", "plain.pt"):
        shutil.rmtree(work / old, ignore_errors=True) if old != "plain.pt" else (work / old).unlink(missing_ok=True)
    model, optim = build(size_mib, seed=1)
    train_step(model, optim)  # Adam's moments exist: the state is model + optimizer, about size_mib
    with fastio.Loader(data, batch_size=BATCH, pipeline=fastio.ImageTrain(size=SIZE), device="cpu", seed=0,
                       rank=0, world_size=1) as loader:
        loader.load_state_dict({**loader.state_dict(), "consumed": batches * BATCH})  # that position, not replayed
        with fastio.Checkpointer(work / "fastio", signals=()) as ckpt:
            ckpt.save(batches, {"model": model, "optim": optim, "loader": loader}, blocking=True)
    sdl = StatefulDataLoader(_webdataset(data), batch_size=BATCH, num_workers=_workers())
    it = iter(sdl)
    for _ in range(batches):
        next(it)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "loader": pickle.dumps(sdl.state_dict())},
             checkpoint_id=str(work / "dcp"))
    del it, sdl
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "batches": batches}, work / "plain.pt")


def run(workdir: Path, repeats: int = 3, samples: int = 100_000, size_mib: int = 512,
        results_dir: Path | None = RESULTS_DIR) -> dict:
    """Prepare, run ``repeats`` interleaved rounds, print the table, write ``restart.json`` under
    ``results_dir`` (None: nothing written); returns the result dict."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = make_dataset(work, samples)
    batches = samples // BATCH // 2  # preempted mid-epoch
    prepare(work, data, size_mib, batches)
    for name in CONTENDERS:  # untimed: the page cache holds the checkpoints and shards for every contender
        _run_child(name, work, data, size_mib)
    rounds: dict[str, list[dict]] = {k: [] for k in CONTENDERS}
    for r in range(repeats):
        for name in CONTENDERS[r % 3:] + CONTENDERS[:r % 3]:
            rounds[name].append(_run_child(name, work, data, size_mib))
            print(f"  {name:<13} {rounds[name][-1]['stepped']:7.2f} s to the first trained step", file=sys.stderr,
                  flush=True)
    result = _result(rounds, samples, size_mib, batches, repeats)
    print(table(result))
    if results_dir is not None:
        write_results("restart", result, results_dir)
    return result


def _result(rounds: dict[str, list[dict]], samples: int, size_mib: int, batches: int, repeats: int) -> dict:
    total = {k: statistics.median(r["stepped"] for r in v) for k, v in rounds.items()}
    # where each contender's time goes: each phase's median length (from the previous phase's end)
    phases = {name: {p: statistics.median(r[p] - (r[q] if q else 0.0) for r in runs)
                     for q, p in zip((None, *PHASES[:-1]), PHASES)} for name, runs in rounds.items()}
    checksums = [r["checksum_s"] for r in rounds["fastio"] if r.get("checksum_s") is not None]
    phases["fastio"]["checksum_in_restore"] = statistics.median(checksums) if checksums else None
    return {
        "benchmark": "restart", "machine": machine_info(), "samples": samples, "size_mib": size_mib,
        "batch_size": BATCH, "image_size": SIZE, "consumed_batches": batches, "repeats": repeats,
        "seconds_to_first_step": total, "phases_s": phases,
        "runs": {k: [r["stepped"] for r in v] for k, v in rounds.items()},
        "ratios": [  # fastio over the peer (the table's order); 1.5x faster is a ratio of 1 / 1.5
            {"name": "restart to first trained step vs DCP + StatefulDataLoader", "better": "lower",
             "target": TARGET, "value": total["fastio"] / total["dcp_stateful"]},
            {"name": "restart to first trained step vs torch.load + skipping DataLoader", "better": "lower",
             "target": TARGET, "value": total["fastio"] / total["torch_load"]},
        ],
    }


def table(result: dict) -> str:
    lines = [f"restart benchmark ({result['machine']['cpus']} cores, {result['samples']} samples, "
             f"{result['size_mib']} MiB of state, resumed after {result['consumed_batches']} batches of "
             f"{result['batch_size']}, median of {result['repeats']})"]
    for name, s in result["seconds_to_first_step"].items():
        lines.append(f"{name:<14}{s:8.2f} s to the first trained step")
    for name, phases in result["phases_s"].items():
        lines.append(f"{name}, where the time goes: " + ", ".join(
            f"{p} {s:.3f} s" for p, s in phases.items() if s is not None))
    for r in result["ratios"]:
        met = r["value"] <= r["target"]
        lines.append(f"{r['name']}: {r['value']:.3f}x, fastio {1 / r['value']:.2f}x faster (target <= {r['target']}: "
                     f"{'met' if met else 'MISSED'})")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.restart``."""
    p = section_parser(__doc__)
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tiny", action="store_true", help="2,000 samples and 48 MiB of state: checks that it runs")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "restart")
    p.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        child(args.child, args.workdir, args.data, args.size_mib)
        return 0
    samples, size_mib = (2000, 48) if args.tiny else (args.samples, args.size_mib)
    before_section(args.quiet_wait)
    run(args.workdir, args.repeats, samples, size_mib, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
