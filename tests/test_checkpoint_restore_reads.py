"""What a DCP restore reads: each rank checks the data files it will load itself and loads their tensors by ``pread``
straight into the app's; DCP's ``.metadata`` is
unpickled only by the allow-list; a byte flipped inside a tensor's data is still refused on every rank, naming the
file, with nothing of that step loaded. FSDP2 on 2 real gloo ranks, and plain modules of unusual layouts in one
process."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, fsdp2_adam, rchar, restore_flipped_shard, spawn_ranks
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.catalog import share_files


def _local_state(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and of every optimizer state tensor, copied."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    out = [local(p) for p in model.parameters()]
    for p in model.parameters():
        out += [local(v) for _, v in sorted(optim.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 512)).sum().backward()
    optim.step()
    optim.zero_grad()


def _spy_pickle_load(seen: list[str]) -> None:
    """Record every ``pickle.load`` of a file named ``.metadata`` (DCP's own reader unpickles it so)."""
    real = pickle.load

    def load(f, *args, **kwargs):
        if str(getattr(f, "name", "")).endswith(".metadata"):
            seen.append(str(f.name))
        return real(f, *args, **kwargs)
    pickle.load = load


def _worker(rank: int, port: int, root: str, out: str) -> None:
    model, optim = fsdp2_adam(rank, port, (512, 1024, 512))
    app = {"model": model, "optim": optim}
    seen: dict = {}
    with Checkpointer(root, signals=()) as ckpt:
        _train(model, optim)
        ckpt.save(1, app, blocking=True)
        step1 = _local_state(model, optim)
        _train(model, optim)
        ckpt.save(2, app, blocking=True)
        step2 = _local_state(model, optim)
        _train(model, optim)
        unpickled: list[str] = []
        _spy_pickle_load(unpickled)
        dist.barrier()
        before = rchar()
        seen["intact"] = ckpt.restore_latest(app).step
        seen["read"] = rchar() - before
        seen["own_shard"] = Path(root, "step-2", f"__{rank}_0.distcp").stat().st_size
        seen["unpickled"] = unpickled
        seen["intact_loaded"] = _same(_local_state(model, optim), step2)
        _train(model, optim)
        now = _local_state(model, optim)
        # one bit in the middle of rank 0's shard (inside a tensor's data) flipped
        seen["damaged"] = restore_flipped_shard(ckpt, app, rank, Path(root, "step-2"), 0x01)
        seen["unchanged"] = _same(_local_state(model, optim), now)
        seen["fallback"] = ckpt.restore_latest(app).step
        seen["fallback_loaded"] = _same(_local_state(model, optim), step1)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo teardown can abort at interpreter exit; the result is in the file


@pytest.fixture(scope="module")
def fsdp_restores(tmp_path_factory) -> list[dict]:
    """Each rank's findings from one 2-rank FSDP2 run: an intact restore, a damaged one refused, the fallback."""
    tmp = tmp_path_factory.mktemp("reads")
    port = free_port()
    spawn_ranks(_worker, lambda r: (r, port, str(tmp / "ck"), str(tmp)), 2, timeout=180)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_reads_its_own_shard_for_the_check_and_the_load(fsdp_restores):
    """``/proc/self/io`` rchar (bytes through read(2) and pread): the check reads the rank's own shard (foreseen by
    ``DcpEngine.reads``) and the load reads each of its tensors by ``pread`` straight into the app's tensor: 2x the
    shard with the small files (2.06x here), and no more. (For a while the check mapped the shard and the load copied
    out of the mapping, which read(2) does not count, 5-6 %; a truncation of the file by another process meanwhile
    was a SIGBUS: tests/test_checkpoint_truncated_files.py.)"""
    for seen in fsdp_restores:
        assert seen["intact"] == 2 and seen["intact_loaded"]
        assert seen["own_shard"] > 4 << 20
        assert seen["read"] < 2.25 * seen["own_shard"], seen


def test_dcp_metadata_is_unpickled_only_by_the_allow_list(fsdp_restores):
    """Before: the engine unpickled ``.metadata`` by its allow-list, then DCP read the file again with
    ``pickle.load``. Now DCP is handed the checked object."""
    for seen in fsdp_restores:
        assert seen["unpickled"] == []


def test_a_byte_flipped_inside_a_shard_is_refused_everywhere_and_nothing_of_it_loads(fsdp_restores):
    for seen in fsdp_restores:
        assert "__0_0.distcp" in (seen["damaged"] or "") and "xxh3_128" in seen["damaged"], seen["damaged"]
        assert seen["unchanged"]  # the refused restore left every parameter and optimizer state as it was
        assert seen["fallback"] == 1 and seen["fallback_loaded"]  # step 1's, bitwise


def test_every_file_is_checked_by_exactly_one_part():
    files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "fastio-dcp.json", "rank-0/a.pt",
             "rank-1/a.pt"]
    owners = {"__0_0.distcp": 0, "__1_0.distcp": 1, "__2_0.distcp": 5}  # part 5 of 2 does not exist: dealt out
    parts = [share_files(files, (i, 2), owners) for i in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(files)
    assert "__0_0.distcp" in parts[0] and "__1_0.distcp" in parts[1]
    assert share_files(files, (0, 1), owners) == sorted(files)


class _Odd(nn.Module):
    """Parameters and buffers whose stored layout is not a plain contiguous float tensor."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.t = nn.Parameter(torch.randn(6, 4, generator=g).t())  # transposed: stored with its strides
        self.register_buffer("ints", torch.randint(-9, 9, (7,), generator=g, dtype=torch.int64))
        self.register_buffer("flags", torch.rand(5, generator=g) > 0.5)
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("f16", torch.randn(3, 3, generator=g).to(torch.float16))


def test_a_dcp_restore_loads_unusual_layouts_exactly(tmp_path):
    """In one process every data file is this rank's: loaded from the checked bytes, each tensor viewed where it
    is stored."""
    saved, into = _Odd(1), _Odd(2)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"m": saved}, blocking=True)
        assert ckpt.restore_latest({"m": into}).step == 1
    for (name, a), b in zip(saved.state_dict().items(), into.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_tensor_stored_in_the_other_byte_order_is_swapped(monkeypatch):
    """A ``torch.save`` blob that records big-endian bytes is not viewed in place: torch.load's swap applies."""
    from fastio.checkpoint.engines.dcp_engine import _stored_tensor

    want = torch.arange(6, dtype=torch.int32)
    swapped = want.view(torch.uint8).view(-1, 4).flip(1).contiguous().view(torch.int32).view(-1)
    buf = io.BytesIO()
    monkeypatch.setattr(sys, "byteorder", "big" if sys.byteorder == "little" else "little")
    torch.save(swapped, buf)  # recorded as the other order: its loader swaps every element back
    monkeypatch.undo()
    assert torch.equal(_stored_tensor(memoryview(bytearray(buf.getvalue()))), want)
