"""A file one rank cannot read while the engine restores: every rank raises one CheckpointError naming the rank and
the file, none hangs (issue 28, point 9).

One run of 2 gloo ranks on 127.0.0.1. The files are intact (the restore's check passes); then, inside the engine's
load, rank 1's view of one file fails: torchsnapshot's read of a tensor file gives EIO (an NFS client losing its
server) or half its bytes (a truncated view), or DCP's ``.metadata`` is missing on rank 1 only (a node that sees
other files). Each hung before: the rank that failed left the engine's collectives while the other waited inside
them. For the torchsnapshot cases rank 1 reads its files through torchsnapshot's own reader (as for a compressed
step), where these faults are put (tests/test_checkpoint_truncated_files.py: the files the check keeps).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from pathlib import Path

import torch.distributed as dist
from helpers import Position, free_port, spawn_ranks
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError


def _from_disk():
    """This rank keeps none of the files it checks (as for a compressed step): the engine reads them all itself."""
    from fastio.checkpoint import restore

    original = restore.Restorer._owners
    restore.Restorer._owners = lambda self, commit: ({}, False)
    return lambda: setattr(restore.Restorer, "_owners", original)


def eio_on_data_files():
    """torchsnapshot's file reads fail on this rank for tensor files (not the metadata), as an I/O error."""
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

    original = FSStoragePlugin.read
    undo_disk = _from_disk()

    async def read(self, read_io):
        if "model" in read_io.path or "/_fastio_slabs/" in read_io.path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(self.root, read_io.path))
        return await original(self, read_io)
    FSStoragePlugin.read = read
    return lambda: (setattr(FSStoragePlugin, "read", original), undo_disk())


def short_reads():
    """torchsnapshot's reads of tensor files return half the bytes on this rank (a truncated view of the file)."""
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

    original = FSStoragePlugin.read
    undo_disk = _from_disk()

    async def read(self, read_io):
        await original(self, read_io)
        if "model" in read_io.path or "/_fastio_slabs/" in read_io.path:
            data = read_io.buf.getvalue()
            read_io.buf = io.BytesIO(data[:len(data) // 2])
    FSStoragePlugin.read = read
    return lambda: (setattr(FSStoragePlugin, "read", original), undo_disk())


def no_dcp_metadata():
    """On this rank, DCP's ``.metadata`` is not there (opened by name)."""
    original = builtins.open

    def fake(file, *args, **kwargs):
        if str(file).endswith("/.metadata"):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(file))
        return original(file, *args, **kwargs)
    builtins.open = fake
    return lambda: setattr(builtins, "open", original)


def other_dcp_record():
    """On this rank, the DCP engine's record of the checkpoint lists the modules as per-rank state (another
    checkpoint's record: a node that sees other files)."""
    original = Path.read_text

    def fake(self, *args, **kwargs):
        text = original(self, *args, **kwargs)
        if self.name != "fastio-dcp.json":
            return text
        info = json.loads(text)
        info["rank_keys"], info["global_keys"] = info["rank_keys"] + info["global_keys"], []
        return json.dumps(info)
    Path.read_text = fake
    return lambda: setattr(Path, "read_text", original)


CASES = {"torchsnapshot:eio": eio_on_data_files, "torchsnapshot:short": short_reads, "dcp:metadata": no_dcp_metadata,
         "dcp:record": other_dcp_record}


def worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    app = {"model": nn.Linear(4, 2), "loader": Position()}
    seen: dict[str, object] = {}
    for label, breaks in CASES.items():
        engine = label.split(":")[0]
        ckpt = Checkpointer(Path(root) / label.replace(":", "-"), signals=(), engine=engine)
        ckpt.save(1, app, blocking=True)
        undo = breaks() if rank == 1 else None
        try:
            ckpt.restore_latest(app)
            seen[label] = None
        except CheckpointError as err:
            seen[label] = str(err)
        if undo:
            undo()
        seen[f"{label}:after"] = ckpt.restore_latest(app).step  # the ranks are still in step
        ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_file_one_rank_cannot_read_fails_every_rank(tmp_path):
    port = free_port()
    # about 20 s on a quiet machine; each case hung before
    spawn_ranks(worker, lambda r: (r, 2, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # DCP's metadata and record are read when the step is opened (the keys and shapes are checked before anything
    # loads)
    for label, file, phase in (("torchsnapshot:eio", "/1/_fastio_slabs/", "load"),
                               ("torchsnapshot:short", "from 1/_fastio_slabs/", "load"),
                               ("dcp:metadata", "/.metadata", "open"),
                               ("dcp:record", "checkpoint has no state for app key model on saving rank 1", "open")):
        texts = {s[label] for s in seen}
        assert len(texts) == 1 and None not in texts, (label, texts)  # the same error on every rank
        text = texts.pop()
        assert file in text and f"({phase} failed on rank 1)" in text and "\n" not in text, (label, text)
        assert all(s[f"{label}:after"] == 1 for s in seen), seen
