"""What a background save leaves on the training thread: the staging copy, and no wait on the disk; the durability
the write needs happens on the writer thread, in the order a crash needs (the writer's mark before any data)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.naming import COMMIT_FILE, WRITING_FILE


def _fsyncs(monkeypatch) -> list[tuple[int, str]]:
    """Every ``os.fsync`` from now on, as (thread ident, the path of the descriptor when it was called)."""
    calls: list[tuple[int, str]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        calls.append((threading.get_ident(), os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_save_does_not_wait_on_the_disk_on_the_training_thread(tmp_path, monkeypatch, engine):
    """The temporary and its writer's mark are made on the caller's thread (a failure there is the caller's
    error at once), but fsynced on the writer thread before the engine writes a byte into it: an fsync on the
    training thread waited behind the last write's deletions and writeback (milliseconds to seconds)."""
    app = {"state": StateHolder({f"t{i}": torch.full((1 << 16,), float(i)) for i in range(4)})}
    calls = _fsyncs(monkeypatch)
    with Checkpointer(tmp_path / "ck", engine=engine, signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
        calls.clear()
        ckpt.save(2, app)
        on_caller = [path for ident, path in calls if ident == threading.get_ident()]
        ckpt.wait()
        assert ckpt.steps()[-1] == 2
    assert on_caller == []
    synced = [path for _, path in calls]
    tmp = tmp_path / "ck" / "step-2.tmp"
    mark = synced.index(str(tmp / WRITING_FILE))
    assert synced.index(str(tmp)) > mark  # then the temporary's directory entry, then its parent's
    data = [i for i, path in enumerate(synced) if path.startswith(f"{tmp}/") and not path.endswith(WRITING_FILE)]
    assert data and min(data) > mark


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_every_file_is_durable_before_the_marker_and_the_marker_before_the_rename(tmp_path, monkeypatch, engine):
    """The engines now start each file's writeback as they write it (``storage.atomic.start_writeback``), which makes
    nothing durable: the commit still fsyncs every data file and its directories before the commit marker, the
    marker before the rename to ``step-N``, and the checkpoint directory after it."""
    app = {"state": StateHolder({f"t{i}": torch.full((1 << 16,), float(i)) for i in range(4)})}
    calls = _fsyncs(monkeypatch)
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        calls.append((threading.get_ident(), f"rename {src} -> {dst}"))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "ck"
    with Checkpointer(root, engine=engine, signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
    seen = [what for _, what in calls]
    tmp, final = root / "step-1.tmp", root / "step-1"
    files = json.loads((final / COMMIT_FILE).read_text())["files"]
    marker = seen.index(str(tmp / f".{COMMIT_FILE}.tmp"))
    renamed = seen.index(f"rename {tmp} -> {final}")
    for rel in files:
        assert seen.index(str(tmp / rel)) < marker, rel
        for parent in Path(rel).parents:  # each directory holding it, up to the temporary itself
            assert str(tmp / parent).rstrip("/.") in seen[:marker], (rel, parent)
    assert marker < seen.index(f"rename {tmp / f'.{COMMIT_FILE}.tmp'} -> {tmp / COMMIT_FILE}") < renamed
    assert str(tmp) in seen[marker + 1:renamed]  # the marker's name in the temporary, durable before the rename
    assert str(root) in seen[renamed + 1:]  # and the rename itself
