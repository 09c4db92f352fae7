"""The background writer's footprint: one file at a time (one core), settings put back, the cadence rule."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer


def _tensors(n: int = 12, numel: int = 1 << 18) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((numel,), float(i)) for i in range(n)}


def test_torchsnapshot_writes_one_file_at_a_time_and_puts_its_settings_back(tmp_path, monkeypatch):
    """torchsnapshot writes up to 16 files at once through 6 executor threads by default, which took the
    training thread's core; a save writes one at a time, and torchsnapshot's own settings come back after."""
    from torchsnapshot import scheduler, snapshot

    from fastio.checkpoint.engines import torchsnapshot_engine

    inflight, peak, lock = [0], [0], threading.Lock()
    original = torchsnapshot_engine._LaterErrors._write_file

    def counting_write(self, path, buf):
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        try:
            time.sleep(0.002)  # a slow disk: concurrent writes would overlap here
            return original(self, path, buf)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(torchsnapshot_engine, "SLAB_BYTES", 0)  # a file per tensor: many writes that could overlap
    monkeypatch.setattr(torchsnapshot_engine._LaterErrors, "_write_file", counting_write)
    before = (scheduler._MAX_PER_RANK_IO_CONCURRENCY, scheduler._MAX_PER_RANK_CPU_CONCURRENCY, dict(os.environ),
              snapshot.batch_write_requests)
    state = _tensors()
    with Checkpointer(tmp_path / "ck", engine="torchsnapshot", signals=()) as ckpt:
        ckpt.save(1, {"state": StateHolder(state)}, blocking=True)
    assert peak[0] == torchsnapshot_engine.WRITE_STREAMS == 1
    assert (scheduler._MAX_PER_RANK_IO_CONCURRENCY, scheduler._MAX_PER_RANK_CPU_CONCURRENCY, dict(os.environ),
            snapshot.batch_write_requests) == before
    fresh = StateHolder({k: torch.zeros_like(v) for k, v in state.items()})
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.restore_latest({"state": fresh})
    assert all(torch.equal(fresh.state[k], v) for k, v in state.items())


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_the_engine_writes_at_the_writer_nice_and_the_training_thread_keeps_its_own(tmp_path, monkeypatch, engine):
    """The writer thread (and the threads it starts) run at ``writer_nice``; the caller's priority is unchanged."""
    from fastio.checkpoint import checkpointer

    seen: list[int] = []
    real_get_engine = checkpointer.get_engine

    def recording_get_engine(name):
        eng = real_get_engine(name)
        save = eng.save

        def recording_save(*args, **kwargs):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return save(*args, **kwargs)

        eng.save = recording_save
        return eng

    monkeypatch.setattr(checkpointer, "get_engine", recording_get_engine)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with Checkpointer(tmp_path / "ck", engine=engine, signals=(), writer_nice=7) as ckpt:
        ckpt.save(1, {"state": StateHolder(_tensors(2))}, blocking=True)
    assert seen == [max(mine, 7)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_cadence_rule():
    from bench.checkpoint_overhead import cadence

    assert cadence(step_s=0.274, write_s=0.87) == 13  # the quiet-machine figures
    assert cadence(step_s=1.0, write_s=0.1) == 1
    assert cadence(step_s=0.5, write_s=1.0, factor=2) == 4
