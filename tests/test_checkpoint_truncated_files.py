"""A checkpoint file cut short by another process (a cleanup, a full disk, a network file system) never kills the
restoring process: a file already shorter than its commit marker says is refused naming it and both sizes before
any of it is read; one cut short while the check reads it is refused naming it, the offset reached and the size
expected; one cut after the check is restored from the bytes the check read and hashed (before: from a mapping of
the file, where the truncation was a SIGBUS: the process gone, with no message)."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest
import torch
from helpers import rank_process, rchar
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError
from fastio.storage.checksum import ShortRead, read_chunks


def _largest(step: Path) -> Path:
    """The step's largest file: the model's data (DCP's ``__0_0.distcp``, torchsnapshot's ``0/m/...``)."""
    return max((p for p in step.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


class _Cutter:
    """An app object whose ``load_state_dict`` (the app's own objects load first) truncates the step's largest file:
    another process's cleanup landing between the restore's check and its load, at a known point."""

    def __init__(self, step: Path):
        self.step, self.cut = step, ""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        victim = _largest(self.step)
        os.truncate(victim, 0)
        self.cut = str(victim)


def _restore_after_a_cut(root: str, engine: str, out: str) -> None:
    torch.manual_seed(0)
    saved, into = nn.Linear(512, 512), nn.Linear(512, 512)
    cutter = _Cutter(Path(root, "step-1"))
    with Checkpointer(root, signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"m": saved, "cut": cutter}, blocking=True)
        step = ckpt.restore_latest({"m": into, "cut": cutter}).step
    same = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), into.state_dict().values()))
    Path(out).write_text(json.dumps({"step": step, "same": same, "cut": cutter.cut,
                                     "size": os.path.getsize(cutter.cut)}))


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_a_file_truncated_between_the_check_and_the_load_does_not_kill_the_restore(tmp_path, engine):
    """Before: the check mapped the file and the load read the mapping; the truncation in between unmapped its pages
    and the load's first touch was a SIGBUS (exit code -7, no message, no traceback). Now the load takes the bytes the
    check read into memory of its own and hashed: the restore completes, exactly as saved."""
    out = tmp_path / "seen.json"
    p = rank_process(_restore_after_a_cut, (str(tmp_path / "ck"), engine, str(out)))
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"the restoring process ended with {p.exitcode}"
    seen = json.loads(out.read_text())
    assert seen["size"] == 0 and seen["cut"]  # the data file really was cut before the load
    assert seen == {**seen, "step": 1, "same": True}


def test_a_shard_already_shorter_than_its_marker_is_refused_naming_it_and_both_sizes_unread(tmp_path):
    """Refused from its size alone, naming the file and both sizes: nothing of it read (before, the check read the
    whole of it to hash it first)."""
    torch.manual_seed(0)
    saved, into = nn.Linear(1024, 1024), nn.Linear(1024, 1024)
    before_state = {k: v.clone() for k, v in into.state_dict().items()}
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"m": saved}, blocking=True)
        shard = tmp_path / "ck" / "step-1" / "__0_0.distcp"
        full = shard.stat().st_size
        os.truncate(shard, full // 2)
        start = rchar()
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"m": into}, step=1)
        read = rchar() - start
    assert f"{shard}: size {full // 2}, commit marker says {full}" in str(err.value)
    assert "\n" not in str(err.value)
    assert read < full // 8, (read, full)
    assert all(torch.equal(v, into.state_dict()[k]) for k, v in before_state.items())


def test_a_file_cut_short_while_read_is_a_short_read_naming_it_the_offset_and_the_size(tmp_path):
    """The check's read loop itself (what ``read_hashed`` runs), the file truncated between two of its chunks."""
    path = tmp_path / "shard"
    path.write_bytes(os.urandom(3 * 4096))
    buffer = mmap.mmap(-1, 3 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = read_chunks(fd, buffer, str(path), chunk=4096)
        assert len(next(chunks)) == 4096
        os.truncate(path, 4096 + 100)  # another process's cleanup, after the first chunk
        assert len(next(chunks)) == 100
        with pytest.raises(ShortRead) as err:
            next(chunks)
    finally:
        os.close(fd)
        buffer.close()  # no view of it left by the loop
    assert (err.value.offset, err.value.size, err.value.filename) == (4196, 3 * 4096, str(path))
    assert "4196" in str(err.value) and str(3 * 4096) in str(err.value) and str(path) in str(err.value)
