"""A file one rank cannot read while the engine restores: every rank raises one CheckpointError naming the rank and
the file, none hangs (issue 28, point 9).

One run of 2 gloo ranks on 127.0.0.1. The files are intact (the restore's check passes); then, inside the engine's
load, rank 1's view of one file fails: torchsnapshot's read of a tensor file gives EIO (an NFS client losing its
server), or DCP's ``.metadata`` is missing on rank 1 only (a node that sees other files). Both hung before: the
rank that failed left the engine's collectives while the other waited inside them.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import Position
from test_checkpoint_ranks import free_port
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError


def eio_on_data_files():
    """torchsnapshot's file reads fail on this rank for tensor files (not the metadata), as an I/O error."""
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

    original = FSStoragePlugin.read

    async def read(self, read_io):
        if "model" in read_io.path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(self.root, read_io.path))
        return await original(self, read_io)
    FSStoragePlugin.read = read
    return lambda: setattr(FSStoragePlugin, "read", original)


def no_dcp_metadata():
    """On this rank, DCP's ``.metadata`` is not there (opened by name)."""
    original = builtins.open

    def fake(file, *args, **kwargs):
        if str(file).endswith("/.metadata"):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(file))
        return original(file, *args, **kwargs)
    builtins.open = fake
    return lambda: setattr(builtins, "open", original)


def worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    app = {"model": nn.Linear(4, 2), "loader": Position()}
    seen: dict[str, object] = {}
    for engine, breaks in (("torchsnapshot", eio_on_data_files), ("dcp", no_dcp_metadata)):
        ckpt = Checkpointer(Path(root) / engine, signals=(), engine=engine)
        ckpt.save(1, app, blocking=True)
        undo = breaks() if rank == 1 else None
        try:
            ckpt.restore_latest(app)
            seen[engine] = None
        except CheckpointError as err:
            seen[engine] = str(err)
        if undo:
            undo()
        seen[f"{engine}:after"] = ckpt.restore_latest(app).step  # the ranks are still in step
        ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def test_a_file_one_rank_cannot_read_fails_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, str(tmp_path / "ck"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for engine, file in (("torchsnapshot", "/model/"), ("dcp", "/.metadata")):
        texts = {s[engine] for s in seen}
        assert len(texts) == 1 and None not in texts, (engine, texts)  # the same error on every rank
        text = texts.pop()
        assert file in text and "(load failed on rank 1)" in text and "\n" not in text, (engine, text)
        assert all(s[f"{engine}:after"] == 1 for s in seen), seen
