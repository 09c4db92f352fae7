"""torchft benchmark: the time per step a ``fastio.Loader(replicas=manager)`` takes against a plain Loader.

Two replica groups of one rank each run in this process on a real torchft lighthouse and Managers
(ProcessGroupGloo, loopback); each step, both start the quorum, wait for it (torchft's time, not the Loader's),
then each takes its batch: its half of the global batch of ``batch_size`` samples. The peer is two plain Loaders,
rank 0 and 1 of a world of 2 with ``batch_size // 2`` each: the same samples decoded per step, the same pipeline
(``image-train``, 32 px). The figure is the time the two ``next()`` calls of a step take, median over the steps of a
round, then over rounds (interleaved, the peer first in even rounds); the ratio is torchft's over the plain
Loaders' (lower is better; target <= 1.10: the Loader adds at most a tenth to a step under torchft). ``added_ms``
is the difference per step. The first ``warmup`` steps of each round (DALI's build, the first quorum) are left out.

``python -m bench.torchft_steps [--repeats 3] [--samples 4096] [--steps 40]`` writes ``bench/out/torchft_steps.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, time_call, write_results
from bench.quiet import before_section
from bench.restart import make_dataset

__all__ = ["run"]

BATCH = 64
TARGET = 1.10  # torchft's time per step over the plain Loaders': at most 10 % more
OPTIONS = {"seed": 0, "drop_last": True, "device": "cpu"}  # and pipeline=fastio.ImageTrain(size=32)


def _managers(lighthouse: str, stores: list) -> list:
    from torchft import Manager, ProcessGroupGloo

    return [Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=None, state_dict=None,
                    min_replica_size=1, store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                    lighthouse_addr=lighthouse, replica_id=f"bench{g}", hostname="127.0.0.1", init_sync=False,
                    timeout=timedelta(seconds=30)) for g, store in enumerate(stores)]


def _torchft_round(dest: Path, steps: int, warmup: int) -> list[float]:
    """Seconds of each step's two ``next()`` calls, two groups on a fresh lighthouse."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from fastio import ImageTrain, Loader

    house = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=10)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    managers = _managers(house.address(), stores)
    loaders = [Loader(dest, batch_size=BATCH, replicas=m, pipeline=ImageTrain(size=32), **OPTIONS) for m in managers]
    its, times = [iter(loader) for loader in loaders], []
    try:
        for _ in range(steps):
            for m in managers:
                m.start_quorum()
            for m in managers:
                m.wait_quorum()
            times.append(time_call(lambda: [next(it) for it in its]))
            for m in managers:
                m.should_commit()
    finally:
        for loader, m in zip(loaders, managers):
            loader.close()
            m.shutdown(wait=False)
        house.shutdown()
    return times[warmup:]


def _plain_round(dest: Path, steps: int, warmup: int) -> list[float]:
    """Seconds of each step's two ``next()`` calls, ranks 0 and 1 of 2 plain Loaders."""
    from fastio import ImageTrain, Loader

    loaders = [Loader(dest, batch_size=BATCH // 2, rank=r, world_size=2, pipeline=ImageTrain(size=32), **OPTIONS)
               for r in range(2)]
    its, times = [_forever(loader) for loader in loaders], []
    for _ in range(steps):
        times.append(time_call(lambda: [next(it) for it in its]))
    for loader in loaders:
        loader.close()
    return times[warmup:]


def _forever(loader):
    while True:
        yield from loader


def run(workdir: Path, repeats: int = 3, samples: int = 4096, steps: int = 40, warmup: int = 5,
        results_dir: Path | None = RESULTS_DIR) -> dict:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the groups talk over loopback
    dest = make_dataset(workdir, samples)
    rounds = []
    for r in range(repeats):
        pair = {}
        for name, fn in ((("plain", _plain_round), ("torchft", _torchft_round)) if r % 2 == 0
                         else (("torchft", _torchft_round), ("plain", _plain_round))):
            pair[name] = statistics.median(fn(dest, steps, warmup))
        rounds.append(pair)
        print(f"round {r + 1}/{repeats}: plain {1000 * pair['plain']:.2f} ms/step, torchft "
              f"{1000 * pair['torchft']:.2f} ms/step", flush=True)
    plain, torchft = (statistics.median(p[k] for p in rounds) for k in ("plain", "torchft"))
    result = {
        "samples": samples, "batch_size": BATCH, "steps": steps, "warmup": warmup, "rounds": rounds,
        "plain_ms_per_step": 1000 * plain, "torchft_ms_per_step": 1000 * torchft, "added_ms": 1000 * (torchft - plain),
        "machine": machine_info(),
        "ratios": [{"name": "torchft Loader vs plain Loader, time per step", "better": "lower", "target": TARGET,
                    "value": torchft / plain}],
    }
    if results_dir is not None:
        write_results("torchft_steps", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.torchft_steps``."""
    p = section_parser(__doc__)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--steps", type=int, default=40, help="steps per round (the first 5 left out)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    run(Path(__file__).resolve().parent / "work" / "torchft_steps", repeats=args.repeats, samples=args.samples,
        steps=args.steps, results_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
