"""A checkpoint directory spelt through a folder that does not exist and ``..`` (``runs/new/../ckpt``) is the
directory the OS finds once its missing folders are made (``runs/ckpt``): no ``runs/new`` is made on the way and
left behind; through an existing link, ``..`` keeps the meaning the OS gives it (the folder above the target)."""

from __future__ import annotations

import torch
from helpers import StateHolder

from fastio.checkpoint import Checkpointer


def _save_and_restore(where, into) -> None:
    with Checkpointer(where, signals=()) as ckpt:
        ckpt.save(1, {"model": StateHolder({"w": torch.arange(4.0)})}, blocking=True)
    holder = StateHolder({"w": torch.zeros(4)})
    with Checkpointer(into, signals=(), read_only=True) as ckpt:
        assert ckpt.restore_latest({"model": holder}).step == 1
    assert torch.equal(holder.state["w"], torch.arange(4.0))


def test_a_checkpoint_dir_spelt_through_a_new_folder_and_dotdot_is_made_where_the_os_finds_it(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    _save_and_restore(runs / "new" / ".." / "ckpt", runs / "ckpt")
    assert sorted(p.name for p in runs.iterdir()) == ["ckpt"]
    with Checkpointer(runs / "new" / ".." / "ckpt", signals=(), read_only=True) as ckpt:
        assert ckpt.dir == runs / "ckpt"


def test_dotdot_after_an_existing_link_keeps_the_meaning_the_os_gives_it(tmp_path):
    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    (elsewhere / "target").mkdir(parents=True)
    runs.mkdir()
    (runs / "link").symlink_to(elsewhere / "target")
    _save_and_restore(runs / "link" / ".." / "new" / ".." / "ckpt", elsewhere / "ckpt")
    assert sorted(p.name for p in runs.iterdir()) == ["link"]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["ckpt", "target"]
