"""Hostile review of checkpoint round 6: parameter groups checked before anything loads (real torchsnapshot and
DCP checkpoints), and the agreements' watching threads on real gloo ranks (no false 'waiting for rank' line for
ranks that are slow but alive, no thread left behind, no beat after close)."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import free_port, spawn_ranks
from torch import nn

from fastio.checkpoint import Checkpointer


def net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def trained(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()


def same(a, b) -> bool:
    """Two (nested) state dicts equal, tensors bitwise."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------- 1. an optimizer's parameter groups
def test_dcp_not_strict_optimizer_of_other_groups_keeps_the_apps_groups_and_trains(tmp_path):
    """DCP, strict=False: an app optimizer (of an app module) with more parameter groups than the checkpoint's
    loads each parameter's state by name and keeps the app's groups (listed), and trains on. The checkpoint's
    group 0 (all four parameters) was loaded over the app's, leaving an optimizer whose next step failed in
    torch (KeyError: 'betas')."""
    model = net()
    optim = torch.optim.Adam(model.parameters())  # one group of 4
    trained(model, optim)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    model2 = net(1)
    optim2 = torch.optim.Adam([{"params": model2[0].parameters()}, {"params": model2[1].parameters(), "lr": 0.01}])
    trained(model2, optim2)
    groups = copy.deepcopy(optim2.state_dict()["param_groups"])
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        skipped = ckpt.restore_latest({"model": model2, "optim": optim2}, strict=False).skipped
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert same(optim2.state_dict()["param_groups"], groups)  # the app's, as they were
    assert same(optim2.state_dict()["state"], optim.state_dict()["state"])  # each parameter's, by name
    assert "app key optim: the checkpoint's optimizer has 1 parameter group, the app's 2 parameter groups (the " \
           "app's groups kept, each parameter's state loaded by name)" in skipped, skipped
    trained(model2, optim2)  # and it trains on


# ---------------------------------------------------------------- 3. the agreements' watching threads
class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _burn(stop: threading.Event) -> None:
    """A busy machine: a thread of the rank's own that holds the GIL most of the time."""
    while not stop.is_set():
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        time.sleep(0.002)


def load_worker(rank: int, port: int, root: str, out: str) -> None:
    """Blocking and background saves and a restore on 2 ranks slowed by a GIL-holding thread each (alive, not
    stopped); what the watching threads said, which threads are left, and whether beats go on after close."""
    from fastio.checkpoint import group
    from fastio.dist import default_store

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group.ABSENT_WARN_S = 2.0  # the looks come sooner: a false line would show within the test's time
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    stop = threading.Event()
    threading.Thread(target=_burn, args=(stop,), daemon=True).start()
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(root, signals=(), keep=2)
    for step in range(1, 11):
        trained_linear(model, optim)
        ckpt.save(step, {"model": model, "optim": optim}, blocking=step % 2 == 0)
    ckpt.restore_latest({"model": model, "optim": optim})
    keys = [ckpt._ranks._key, ckpt._writer_ranks._key]
    ckpt.close()
    stop.set()
    time.sleep(1.0)  # a watching thread ends within a store request of its collective's end
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("fastio-"))
    beats = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    time.sleep(1.2)
    beats_later = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": lines.lines, "left": left, "beats": beats,
                                                         "beats_later": beats_later}))
    dist.destroy_process_group()


def trained_linear(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()
    optim.step()


def test_slow_ranks_are_not_named_and_no_thread_or_beat_is_left(tmp_path):
    port = free_port()
    spawn_ranks(load_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=240)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        assert not [line for line in got["lines"] if "waiting" in line], (rank, got["lines"])
        assert got["left"] == [], (rank, got["left"])
        assert got["beats"] == got["beats_later"], (rank, got)
