"""Retention's deletion is off the save's path: a save counts as done (``wait()``, the next save) once its step is
published and the expired steps are renamed away; their files are deleted after that, crash-safely, and by
``close()`` at the latest."""

from __future__ import annotations

import os
import shutil
import textwrap
import threading
from pathlib import Path

import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer, naming, removal

REPO = Path(__file__).resolve().parents[1]


def app_at(tag: float) -> dict:
    return {"model": StateHolder({"w": torch.full((4,), float(tag))})}


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if naming.is_deleting_name(p.name))


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_wait_returns_once_published_and_the_expired_steps_files_go_after(tmp_path, monkeypatch):
    """keep=1 deleted the previous step on the save's path (0.22-0.33 s a save for 512 MiB, the writer always
    busy at a checkpoint every ~1x its write time): wait() and the next save waited for the deletion. Now wait()
    returns with the expired step renamed away, its files deleted after (held here), by close() at the latest."""
    root = tmp_path / "ck"
    gate, real = threading.Event(), shutil.rmtree

    def held(path, *args, **kwargs):  # the deletion of a renamed-away step's files waits for the gate
        if naming.is_deleting_name(Path(path).name) and Path(path).exists():
            gate.wait(10)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(removal.shutil, "rmtree", held)
    ckpt = Checkpointer(root, keep=1, signals=())
    try:
        ckpt.save(1, app_at(1), blocking=True)
        ckpt.save(2, app_at(2))
        waiting = threading.Thread(target=ckpt.wait)
        waiting.start()
        waiting.join(5)
        assert not waiting.is_alive(), "wait() waited for retention's deletion"
        assert ckpt.steps() == [2] and visible(root) == ["step-2"]
        assert hidden(root) == [naming.deleting_name("step-1")]  # renamed away, its files not deleted yet
        ckpt.save(3, app_at(3))  # the training thread does not wait for it either
        assert (root / "step-3.tmp").is_dir() and hidden(root) == [naming.deleting_name("step-1")]
    finally:
        gate.set()
        ckpt.close()
    assert visible(root) == ["step-3"] and hidden(root) == []
    fresh = app_at(0)
    assert Checkpointer(root, signals=()).restore_latest(fresh).step == 3
    assert torch.equal(fresh["model"].state["w"], torch.full((4,), 3.0))


KILLED_WHILE_DELETING = """
    import os, shutil, signal, sys, threading
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    from fastio.checkpoint import Checkpointer, naming

    real, started = shutil.rmtree, threading.Event()

    def held(path, *args, **kwargs):  # the deletion of step-1's files starts, and the process is killed in it
        if naming.is_deleting_name(os.path.basename(path)) and os.path.exists(path):
            started.set()
            threading.Event().wait(10)
        return real(path, *args, **kwargs)

    shutil.rmtree = held
    ckpt = Checkpointer(sys.argv[1], keep=1, signals=())
    ckpt.save(1, {"model": StateHolder({"w": torch.ones(4)})}, blocking=True)
    ckpt.save(2, {"model": StateHolder({"w": torch.full((4,), 2.0)})})
    ckpt.wait()
    if started.wait(10):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_kill_while_an_expired_step_is_deleted_leaves_it_hidden_for_the_next_restore(tmp_path, warm):
    """The deletion now runs after the save counts as done, so a kill can come in it with wait() returned: step-1
    stays renamed away (never read as a checkpoint, never half-deleted under its own name), step-2 restores, and
    the restore deletes the leftover."""
    root = tmp_path / "ck"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_WHILE_DELETING))
    rc, out, err = warm.run(script, REPO, str(root), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rc in (-9, 137), out + err
    assert visible(root) == ["step-2"] and len(hidden(root)) == 1 and hidden(root)[0].startswith(".step-1.deleting-")
    app = app_at(0)
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(app).step == 2
    assert torch.equal(app["model"].state["w"], torch.full((4,), 2.0))
    assert hidden(root) == [] and visible(root) == ["step-2"]


def test_an_expired_step_that_is_a_symlink_goes_as_a_link_and_its_target_stays(tmp_path, caplog):
    """Before: a step directory moved to another disk and symlinked back (step-1 -> elsewhere/step-1) was renamed to
    `.step-1.deleting-PID` by retention, and then the deletion failed silently (rmtree refuses a link): the hidden
    link stayed in DIR for good, every later start failing again, and the target was never said to be left. Now the
    link is removed, the target (which may be the only copy, and is not under DIR) is kept and a warning names it."""
    import logging

    root, away = tmp_path / "ck", tmp_path / "elsewhere"
    away.mkdir()
    with Checkpointer(root, signals=(), keep=2) as ckpt:
        ckpt.save(1, app_at(1), blocking=True)
        ckpt.save(2, app_at(2), blocking=True)
    shutil.move(root / "step-1", away / "step-1")
    (root / "step-1").symlink_to(away / "step-1")
    files = sorted(p.relative_to(away) for p in away.rglob("*"))
    with caplog.at_level(logging.WARNING, logger="fastio"), Checkpointer(root, signals=(), keep=2) as ckpt:
        restored = app_at(0)
        assert ckpt.restore_latest(restored).step == 2
        ckpt.save(3, app_at(3), blocking=True)
    assert visible(root) == ["step-2", "step-3"] and hidden(root) == []
    assert sorted(p.relative_to(away) for p in away.rglob("*")) == files
    assert any(str(away / "step-1") in r.getMessage() and "left in place" in r.getMessage() for r in caplog.records)
