"""Review round 4 (issue 28), a hostile pass over the merged fixes: each test is a case that still lost data, hung
or misled after the merge, kept as a regression."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, spawn_ranks
from torch import nn

from fastio import Checkpointer
from fastio.checkpoint import layout
from fastio.errors import CheckpointError
from fastio.order.mixorder import MixSchedule


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_module_of_another_shape_leaves_every_other_app_key_as_it_was(tmp_path, engine):
    """Point 10, all or nothing: app key ``b`` changed shape. The restore refused it, but with torchsnapshot only
    once it reached ``b``: the model ``a`` and the optimizer before it were already loaded (keys load one by one,
    in place)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    a(torch.ones(1, 4)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"a": a, "opt": opt, "b": b}, blocking=True)
    a2, b2 = nn.Linear(4, 2), nn.Linear(4, 3)
    with torch.no_grad():
        a2.weight.zero_()
        a2.bias.zero_()
    opt2 = torch.optim.SGD(a2.parameters(), lr=0.5, momentum=0.9)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError, match=r"app key b: other shape: bias \(checkpoint 2, app 3\)"):
            ckpt.restore_latest({"a": a2, "opt": opt2, "b": b2})
    assert torch.count_nonzero(a2.weight) == 0 and torch.count_nonzero(a2.bias) == 0, "model a was loaded"
    assert opt2.param_groups[0]["lr"] == 0.5, "the optimizer was loaded"


@pytest.mark.parametrize("big", [1e6, 3e7, 86415.0, 1e12])
def test_the_smallest_weight_a_refusal_suggests_is_accepted(big):
    """Point 6: the refusal of ``1e6:1`` said "give it a weight of at least 15.259", the exact minimum (15.2590219)
    rounded down to 6 digits: 15.259 was refused in turn."""
    with pytest.raises(ValueError, match="give it a weight of at least") as err:
        MixSchedule(("a", "b"), (big, 1.0), ("fa", "fb"), 10)
    least = float(re.search(r"at least (\S+) \(with", str(err.value)).group(1))
    MixSchedule(("a", "b"), (big, least), ("fa", "fb"), 10)  # accepted
    assert least <= (big / (65536 - 1)) * (1 + 1e-5)  # and still about the smallest


def test_a_restore_of_another_live_process_keeps_its_directory_when_a_writer_restores(tmp_path):
    """Point 14: an evaluation restoring a compressed checkpoint (read-only) decompresses into its
    ``.step-N.restore-PID``; the trainer's own restore (a relaunch) deleted every such directory as abandoned,
    the live reader's too, under its feet. Only a dead process's is abandoned."""
    root = tmp_path / "ck"
    model = nn.Linear(4, 2)
    with Checkpointer(root, signals=(), compression="zstd") as ckpt:
        ckpt.save(1, {"m": model}, blocking=True)
    reader = subprocess.Popen(["sleep", "60"])  # a live process of this host, as the reader
    try:
        live = layout.start_restore_dir(root, 1).rename(root / f".step-1.restore-{reader.pid}")
        (live / "m.bin").write_bytes(b"being read")
        dead = layout.start_restore_dir(root, 1).rename(root / ".step-1.restore-999999")
        with Checkpointer(root, signals=()) as ckpt:  # the trainer, relaunched
            assert ckpt.restore_latest({"m": nn.Linear(4, 2)}).step == 1
        assert (live / "m.bin").read_bytes() == b"being read"
        assert not dead.exists()
    finally:
        reader.kill()
        reader.wait()
    with Checkpointer(root, signals=()) as ckpt:  # once it has ended, its directory is a leftover
        ckpt.restore_latest({"m": nn.Linear(4, 2)})
    assert not live.exists()


def _compression_worker(rank: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ckpt = Checkpointer(root, signals=(), compression="zstd" if rank == 0 else None, agree_timeout=20)
        ckpt.save(1, {"m": nn.Linear(4, 2)}, blocking=True)
        ckpt.close()
        seen = None
    except CheckpointError as err:
        seen = str(err)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    os._exit(0)


def test_ranks_with_other_compression_are_refused_on_every_rank(tmp_path):
    """Point 8, ranks that disagree: rank 0 with compression="zstd", rank 1 without. Both hung (rank 0 in the
    writer's "compress" barrier, rank 1 already in the commit's gather); codecs that differ would commit files
    that the marker's codec cannot read."""
    port = free_port()
    spawn_ranks(_compression_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = {json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert len(seen) == 1, seen
    text = seen.pop()
    assert text and "ranks disagree on the compression: rank 0 zstd, rank 1 none" in text, text
    assert not (tmp_path / "ck").exists()  # refused before anything was created
