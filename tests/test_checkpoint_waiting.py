"""What a rank waiting for another in a checkpoint's agreement says, on real gloo ranks: a rank stopped (SIGSTOP)
inside a save or a restore is named once; one busy there, slow in the Checkpointer's own work (its lock, its
engine, a node leader removing its temporary copy) or slowed by a GIL-holding thread is not; a rank killed while
the other watches its beats is named gone; no watching thread or beat is left after close."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Lines
from helpers import free_port, spawn_ranks, stop_for
from torch import nn

from fastio.checkpoint import Checkpointer, group
from fastio.errors import CheckpointError

# The library's intervals made shorter in the rank processes (a beat every 0.125 s, looks 0.375 s apart, a rank
# named after 0.5 s: against 0.5, 1.5 and 5 s), in the library's proportions (looks three beats apart), so that a
# rank stopped or busy STOP_S (twice the time after which one is named, as 4 s were against 2 s before) shows what
# it shows in about a second.
STOP_S = 1.0


def quick_looks() -> None:
    """In a rank process: a rank waiting in a collective notes its arrival, counts its beats and looks at the others'
    sooner (``group``'s module attributes)."""
    group.ARRIVED_AFTER_S, group.LOOKS_APART_S, group.ABSENT_WARN_S = 0.125, 0.375, 0.5


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
    from fastio.dist import default_store

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()  # the looks come sooner: a false line would show within the test's time
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    stop = threading.Event()
    threading.Thread(target=_burn, args=(stop,), daemon=True).start()
    model = nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(root, signals=(), keep=2)
    for step in range(1, 7):  # three background saves, each followed by a blocking one (was 10 saves: ~2.5 s of
        # two busy cores for each pair on a loaded 2-core machine)
        trained_linear(model, optim)
        ckpt.save(step, {"model": model, "optim": optim}, blocking=step % 2 == 0)
    ckpt.restore_latest({"model": model, "optim": optim})
    keys = [ckpt._ranks._key, ckpt._writer_ranks._key]
    ckpt.close()
    stop.set()
    left = threads_left(0.5)  # a watching thread ends within a store request of its collective's end
    beats = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    time.sleep(0.3)  # beats (were any still counted) come every 0.125 s
    beats_later = [int(default_store().add(f"{k}/beat/{rank}", 0)) for k in keys]
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": lines.lines, "left": left, "beats": beats,
                                                         "beats_later": beats_later}))
    dist.destroy_process_group()


def threads_left(within: float) -> list[str]:
    """The names of this process's fastio threads still running ``within`` seconds from now (sooner when none is)."""
    deadline = time.monotonic() + within
    while True:
        left = sorted(t.name for t in threading.enumerate() if t.name.startswith("fastio-"))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


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


def kill_worker(rank: int, victim: int, port: int, root: str, out: str) -> None:
    """Rank ``victim`` busy STOP_S at the end of the write phase (beating), then SIGKILLed; the other waits for it
    in the phase's agreement, its watching thread looking at the victim's beats, the store on rank 0."""
    from fastio.checkpoint import group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    ckpt = Checkpointer(root, signals=())
    app = {"model": nn.Linear(4, 2)}
    ckpt.save(1, app, blocking=True)

    def hook(group_name: str, phase: str) -> None:
        if (group_name, phase) == ("checkpoint writer", "write") and rank == victim:
            time.sleep(STOP_S)
            os.kill(os.getpid(), signal.SIGKILL)

    group.fault_hook = hook
    started = time.monotonic()
    try:
        ckpt.save(2, app, blocking=True)
        error = None
    except CheckpointError as err:
        error = str(err)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "error": error, "took": time.monotonic() - started, "lines": lines.lines,
        "steps": sorted(p.name for p in Path(root).glob("step-*"))}))
    os._exit(0)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_while_the_other_watches_its_beats_is_named_gone(tmp_path, victim):
    """A rank SIGKILLed inside a save while another waits for it (watching thread on, the store maybe gone with
    it): the waiting rank raises the usual one line naming the rank that went away, soon, and is not told it is
    'waiting' for a rank that was busy; the previous checkpoint stays the only committed one."""
    port = free_port()
    spawn_ranks(kill_worker, lambda r: (r, victim, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    got = json.loads((tmp_path / f"rank{1 - victim}.json").read_text())
    assert not (tmp_path / f"rank{victim}.json").exists()
    assert got["error"] and "\n" not in got["error"], got
    assert f"checkpoint write: rank {victim} (pid" in got["error"] and "went away" in got["error"], got["error"]
    assert got["took"] < 60, got
    assert not [line for line in got["lines"] if "waiting" in line], got["lines"]
    assert [s for s in got["steps"] if not s.endswith(".tmp")] == ["step-1"], got["steps"]  # the killed leader's
    # temporary directory is the next Checkpointer's to clean, as before


RESTORE_CASES = (("stopped in open", "open", True), ("stopped in load", "load", True), ("busy in load", "load", False))


def stop_restore_worker(rank: int, port: int, root: str, out: str) -> None:
    """Rank 1 stopped (SIGSTOP, continued STOP_S later) or busy STOP_S at the end of a restore's phase; rank 0 waits
    for it in the phase's agreement."""
    from fastio.checkpoint import group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    app = {"model": nn.Linear(4, 2)}
    ckpt = Checkpointer(root, signals=())
    ckpt.save(1, app, blocking=True)
    seen: dict = {}
    for label, phase, stop in RESTORE_CASES:
        def hook(group_name: str, at: str, phase=phase, stop=stop) -> None:
            if (group_name, at) != ("checkpointer", phase):
                return
            if not stop:
                time.sleep(STOP_S)
                return
            stop_for(STOP_S)  # stopped in here

        group.fault_hook = hook if rank == 1 else None
        lines.lines.clear()
        seen[label] = {"step": ckpt.restore_latest(app).step, "lines": list(lines.lines)}
    group.fault_hook = None
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_rank_stopped_inside_a_restore_is_named_once_and_a_busy_one_not(tmp_path):
    port = free_port()
    spawn_ranks(stop_restore_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for label, phase, stop in RESTORE_CASES:
        assert seen[0][label]["step"] == seen[1][label]["step"] == 1, label
        warned = [line for line in seen[0][label]["lines"] if "waiting" in line]
        if stop:
            assert len(warned) == 1 and f"checkpoint {phase}: waiting" in warned[0], (label, warned)
            assert "for rank 1 (pid" in warned[0] and "checkpointer group" in warned[0], warned
        else:
            assert warned == [], (label, warned)


def slow_worker(rank: int, port: int, root: str, out: str) -> None:
    """Ranks slow (STOP_S) in the Checkpointer's own work outside its phases' functions: rank 0 taking the
    directory at construction (its lock; an s3:// dir's lease, requests that can retry), rank 1 making the
    engine at its first save (importing torchsnapshot, seconds on a loaded node); the other waits for it."""
    from fastio.checkpoint.checkpointer import Checkpointer as Ck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    take, make = Ck._take_dir, Ck._engine

    def slow_take(self):
        time.sleep(STOP_S if rank == 0 else 0)
        return take(self)

    def slow_make(self, name):
        time.sleep(STOP_S if rank == 1 and name not in self._engines else 0)
        return make(self, name)

    Ck._take_dir, Ck._engine = slow_take, slow_make
    seen = {}
    ckpt = Checkpointer(root, signals=())
    seen["construction"], lines.lines = lines.lines, []
    ckpt.save(1, {"model": nn.Linear(4, 2)}, blocking=True)
    seen["first save"] = lines.lines
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_rank_slow_in_the_checkpointers_own_work_is_not_named(tmp_path):
    """A rank slow in the Checkpointer's own work between agreements is busy, not stopped: the other is not told
    it waits for it ('checkpoint open: waiting 5 s for rank 0 (...) (stopped, or busy outside the
    Checkpointer?)' was logged at construction, 'checkpoint stage: waiting ... for rank 1' at the first save)."""
    port = free_port()
    spawn_ranks(slow_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        for when, lines in got.items():
            assert not [line for line in lines if "waiting" in line], (rank, when, lines)


def node_worker(rank: int, port: int, url: str, options: dict, root: str, out: str) -> None:
    """2 simulated nodes of an s3:// dir (a staging directory each): rank 0, its node's leader, slow (STOP_S)
    removing its node's temporary copy after the commit; rank 1 goes on to the blocking save's last agreement."""
    from fastio.checkpoint import commit

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    remove = commit.removal.remove_step

    def slow_remove(path):
        time.sleep(STOP_S if rank == 0 and str(path).endswith(".tmp") else 0)
        return remove(path)

    commit.removal.remove_step = slow_remove
    with Checkpointer(url, storage_options=options, staging_dir=f"{root}/node{rank}", signals=()) as ckpt:
        ckpt.save(1, {"model": nn.Linear(4, 2)}, blocking=True)
        steps = ckpt.steps()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"lines": lines.lines, "steps": steps}))
    dist.destroy_process_group()


def test_a_node_leader_slow_removing_its_temporary_copy_is_not_named(moto_server, tmp_path):
    """An s3:// dir staged per node: the node's leader removing its temporary copy after the commit is the
    save's own work (a large step: seconds), not a stop; rank 1 logged 'checkpoint save: waiting ... for rank
    0 (...) (stopped, or busy outside the Checkpointer?)'."""
    bucket = f"waiting-{uuid.uuid4().hex[:8]}"
    moto_server.create_bucket(bucket)
    port = free_port()
    spawn_ranks(node_worker, lambda r: (r, port, f"s3://{bucket}/ck", moto_server.options(), str(tmp_path),
                                        str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(seen):
        assert got["steps"] == [1], (rank, got)
        assert not [line for line in got["lines"] if "waiting" in line], (rank, got["lines"])


CASES = (("stopped in stage", "checkpointer", "stage"), ("stopped in write", "checkpoint writer", "write"),
         ("busy in stage", "checkpointer", "stage"))


def stop_worker(rank: int, port: int, root: str, out: str) -> None:
    """Rank 1 stops itself (SIGSTOP, continued STOP_S later) at the end of a save's phase, after the save was entered
    (or, busy, sleeps STOP_S there); rank 0 waits for it in the phase's agreement."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    quick_looks()
    lines = Lines()
    logging.getLogger("fastio.checkpoint.group").addHandler(lines)
    app = {"model": nn.Linear(4, 2)}
    seen: dict = {}
    ckpt = Checkpointer(root, signals=())
    for step, (label, name, phase) in enumerate(CASES, start=1):
        def hook(group_name: str, at: str, name=name, phase=phase, label=label) -> None:
            if (group_name, at) != (name, phase):
                return
            if label.startswith("busy"):
                time.sleep(STOP_S)
                return
            stop_for(STOP_S)  # stopped in here

        group.fault_hook = hook if rank == 1 else None
        lines.lines.clear()
        ckpt.save(step, app, blocking=True)
        seen[label] = list(lines.lines)
    seen["steps"] = ckpt.steps()
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_rank_stopped_inside_a_save_is_named_once_and_a_busy_one_not(tmp_path):
    port = free_port()
    spawn_ranks(stop_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0]["steps"] == seen[1]["steps"] == [1, 2, 3]  # each save went through once the rank came back
    for label, name, phase in CASES[:2]:
        warned = [line for line in seen[0][label] if "waiting" in line]
        assert len(warned) == 1, (label, seen[0][label])
        assert f"checkpoint {phase}: waiting" in warned[0] and "for rank 1 (pid" in warned[0], warned
        assert f"{name} group" in warned[0], warned
    assert not [line for line in seen[0]["busy in stage"] if "waiting" in line], seen[0]["busy in stage"]
