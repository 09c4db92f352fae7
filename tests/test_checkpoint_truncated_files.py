"""A checkpoint file cut short by another process (a cleanup, a full disk, a network file system) never kills the
restoring process: a file already shorter than its commit marker says is refused naming it and both sizes before
any of it is read; one cut after the check, while the engine loads it, is a CheckpointError naming it, the offset
reached and the size expected (before: the load read a mapping of the file, and the truncation was a SIGBUS: the
process gone, with no message, exit code -7). The files the check keeps are read again by ``pread``
(``CheckedFile``), never mapped, and a file replaced since the check is refused too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import rank_process, rchar
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError
from fastio.storage.checksum import ShortRead, open_hashed


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
        size = _largest(Path(root, "step-1")).stat().st_size
        try:
            ckpt.restore_latest({"m": into, "cut": cutter})
            error = None
        except CheckpointError as err:
            error = str(err)
    Path(out).write_text(json.dumps({"error": error, "cut": cutter.cut, "size": size,
                                     "now": os.path.getsize(cutter.cut)}))


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_a_file_truncated_between_the_check_and_the_load_is_named_and_the_process_lives(tmp_path, engine):
    """Before: the check mapped the file and the load read the mapping; the truncation in between unmapped its pages
    and the load's first touch was a SIGBUS (exit code -7, no message, no traceback). Now the load reads the file by
    ``pread``: one CheckpointError naming the file, the offset it ended at and the size expected."""
    out = tmp_path / "seen.json"
    p = rank_process(_restore_after_a_cut, (str(tmp_path / "ck"), engine, str(out)))
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"the restoring process ended with {p.exitcode}"
    seen = json.loads(out.read_text())
    assert seen["now"] == 0 and seen["cut"]  # the data file really was cut before the load
    assert seen["error"] and "\n" not in seen["error"], seen
    assert f"{seen['cut']}: unreadable: ended at offset 0, {seen['size']} bytes expected" in seen["error"], seen


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


def test_a_checked_file_cut_short_or_replaced_is_a_short_read_naming_it(tmp_path):
    """What the engines read a checked file with: a truncation after the check is a ShortRead naming the file, the
    offset reached and the size expected; a file replaced since (another inode) is refused before any read."""
    path = tmp_path / "shard"
    data = os.urandom(3 * 4096)
    path.write_bytes(data)
    size, _, checked = open_hashed(path, "xxh3_128", 3 * 4096)
    assert size == 3 * 4096 and checked.read(4096, 100) == data[4096:4196]
    checked.close()
    os.truncate(path, 4096 + 100)  # another process's cleanup
    with pytest.raises(ShortRead) as err:
        checked.read(0, 3 * 4096)
    assert (err.value.offset, err.value.size, err.value.filename) == (4196, 3 * 4096, str(path))
    assert "ended at offset 4196, 12288 bytes expected" in str(err.value)
    checked.close()
    path.write_bytes(b"x" * (3 * 4096))  # the same size again, rewritten
    replaced = tmp_path / "new"
    replaced.write_bytes(data)
    os.replace(replaced, path)
    with pytest.raises(ShortRead, match="changed since it was checked"):
        checked.read(0, 10)
    assert open_hashed(path, "xxh3_128", 5)[2] is None  # not the size the marker says: nothing to read again
