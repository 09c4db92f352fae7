"""The one resume check every resume test uses: run N batches, take the state, rebuild a fresh loader,
load the state, and compare the next K batches bitwise with the uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch

__all__ = ["batches", "check_resume", "killed_and_resumed", "same_batch"]


def batches(loader) -> Iterator[dict[str, Any]]:
    """Batches across epoch boundaries (iteration advances the epoch by itself)."""
    while True:
        yield from loader


def same_batch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bitwise equality of two batches (tensor bytes, dtype, shape, device type; lists element-wise)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):  # raw batches' presence masks: {field: tensor}
            if not isinstance(y, dict) or not same_batch(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.device.type != y.device.type:
                return False
            if x.cpu().contiguous().view(torch.uint8).numpy().tobytes() != \
                    y.cpu().contiguous().view(torch.uint8).numpy().tobytes():
                return False
        elif x != y:
            return False
    return True


def check_resume(make_loader: Callable[[], Any], n: int, k: int) -> dict[str, Any]:
    """Assert that batches n..n+k-1 after a save at n and a restore in a fresh loader equal the uninterrupted run.

    The state is taken from the running loader while its prefetch queue is full, so this also checks
    that prefetched-but-undelivered batches are not counted as consumed. Returns the saved state.
    """
    ref = make_loader()
    stream = batches(ref)
    first = list(islice(stream, n))
    state = ref.state_dict()
    rest = list(islice(stream, k))
    assert len(first) == n and len(rest) == k
    ref.close()

    resumed = make_loader()
    resumed.load_state_dict(state)
    again = list(islice(batches(resumed), k))
    resumed.close()
    for j, (want, got) in enumerate(zip(rest, again)):
        assert same_batch(want, got), f"batch {n + j} differs after resume from state {state}"
    # The position really moved: the resumed run does not restart the epoch.
    fresh = make_loader()
    restart = next(iter(fresh))
    fresh.close()
    if state["consumed"]:
        assert not same_batch(restart, again[0]), "resumed loader restarted the epoch"
    return state


def run_ranks(loaders: list, n: int | None = None, state: dict[str, Any] | None = None,
              epoch: int | None = None) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Batches of every rank's loader in lockstep (``n`` steps; None: to the end of the current epoch), after
    loading ``state`` or setting ``epoch`` in each; then each rank's state. The loaders are closed."""
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
        if epoch is not None:
            ld.set_epoch(epoch)
    iters = [iter(ld) for ld in loaders]
    steps: list[list[dict[str, Any]]] = []
    while n is None or len(steps) < n:
        step = [next(it, None) for it in iters]
        if all(b is None for b in step):
            break
        assert all(b is not None for b in step), "ranks got different numbers of batches"
        steps.append(step)
    states = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    return steps, states


def killed_and_resumed(warm, command: list[str], ckpt_dir: Path, kill_at: int = 13, steps: int = 18
                       ) -> tuple[dict[int, str], dict[int, str], int]:
    """An example training script (``command``: ``[python, script, *args]``; it prints ``step N loss ...`` lines and
    checkpoints into ``ckpt_dir``) SIGKILLed after step ``kill_at`` once a checkpoint is committed, then run again to
    ``steps``, both with ``OMP_NUM_THREADS=1`` and started by ``warm`` (conftest's ``warm_one_thread``): (each step's
    line after ``step N`` before the kill, the same after the resume, the step it resumed at)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script, *args = command[1:]
    killed = warm.start(Path(script), Path.cwd(), *args, "--steps", "500", env=env)
    for line in killed.lines():
        if line.startswith(f"step {kill_at} "):
            break
    deadline = time.monotonic() + 60
    while not list(ckpt_dir.glob("step-*[0-9]")) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    rc, before, _ = killed.wait()
    assert rc == -signal.SIGKILL
    rc, after, err = warm.run(Path(script), Path.cwd(), *args, "--steps", str(steps), env=env)
    assert rc == 0, after + err

    def each_step(text):
        return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) (loss .*)$", text, re.M)}

    start = int(re.search(r"^resumed at step (\d+)$", after, re.M)[1])
    return each_step(before), each_step(after), start
