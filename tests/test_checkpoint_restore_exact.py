"""A DCP restore gives back exactly what was saved, loading its tensors from the bytes the check mapped (each viewed
where its ``torch.save`` record lies in the data file, at whatever address that is): every dtype and layout, tied
weights, a buffer viewing a larger storage, non-tensor items, an optimizer's parameter groups, twice in a row with no
mapping of the step left behind; an item that is not a plain tensor is refused naming its file. One process (every
data file is the rank's own, so every item goes the mapped way) and, for a crash, one child process."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import rank_process
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.engines.dcp_engine import DcpEngine, _stored_tensor
from fastio.errors import CheckpointError


class _Complex(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("a", torch.randn(3, generator=g))
        self.register_buffer("z", torch.randn(5, 7, generator=g, dtype=torch.complex128))  # 16-byte elements
        self.register_buffer("zt", torch.randn(7, 3, generator=g, dtype=torch.complex128).t())


def _restore_complex(root: str, out: str) -> None:
    saved, into = _Complex(1), _Complex(2)
    with Checkpointer(root, signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"m": saved}, blocking=True)
        ckpt.restore_latest({"m": into})
    same = [torch.equal(a, b) for a, b in zip(saved.state_dict().values(), into.state_dict().values())]
    Path(out).write_text(json.dumps(same))


def test_complex128_stored_at_an_address_not_a_multiple_of_16_restores_without_a_crash(tmp_path):
    """Before: a complex128 record lying at an address not a multiple of 16 in the mapped data file (a record is
    64-byte aligned within its item, an item at any offset of the file) was copied by torch's typed kernel, which
    assumes that alignment: the process died of SIGSEGV. Now such bytes are copied as bytes."""
    p = rank_process(_restore_complex, (str(tmp_path / "ck"), str(tmp_path / "same.json")))
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"the restoring process ended with {p.exitcode}"
    assert json.loads((tmp_path / "same.json").read_text()) == [True, True, True]


@pytest.mark.parametrize("view", [torch.conj, torch._neg_view, lambda x: x.conj().imag], ids=["conj", "neg", "imag"])
def test_a_stored_tensor_with_a_conj_or_neg_bit_reads_as_saved(view):
    """``torch.save`` keeps a tensor's conj and neg bits beside its storage: before, the in-place view left them out
    (the conjugate or the negation silently lost)."""
    want = view(torch.randn(3, 4, dtype=torch.complex64))
    buf = io.BytesIO()
    torch.save(want, buf)
    got = _stored_tensor(memoryview(bytearray(buf.getvalue())))
    assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())


@pytest.mark.parametrize("layout", [(-1, 0, (3, 4), (4, 1)), (12, 0, (4, 4), (4, 1)), (12, -1, (3, 4), (4, 1)),
                                    (12, 0, (3, 4), (-4, 1))], ids=["negative-numel", "past-the-storage",
                                                                    "negative-offset", "negative-stride"])
def test_a_stored_layout_outside_its_storage_is_left_to_torch_load(monkeypatch, layout):
    """A record whose layout reaches outside its storage (a crafted checkpoint: torch.save never writes one) is not
    viewed in place, where it would read other bytes of the file; torch.load reads the record as it is."""
    from fastio.checkpoint.engines import dcp_engine

    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(want, buf)
    numel, offset, size, stride = layout
    real = dcp_engine._Layout.load
    monkeypatch.setattr(dcp_engine._Layout, "load",
                        lambda self: (*real(self)[:2], numel, offset, size, stride))
    got = _stored_tensor(memoryview(bytearray(buf.getvalue())))
    assert torch.equal(got, want)


class _Subclass(torch.Tensor):
    """Not a plain tensor: ``torch.load(weights_only=True)`` refuses its pickle."""


class _Refused(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("plain", torch.randn(3))
        self.register_buffer("odd", torch.randn(4).as_subclass(_Subclass))


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read-by-dcp"])
def test_an_item_that_is_not_a_plain_tensor_is_refused_naming_its_file(tmp_path, monkeypatch, mapped):
    """Before: ``step-1: Check the documentation of torch.load to learn more ...`` (torch's last line, no file). The
    save refuses a tensor subclass now (tests/test_checkpoint_tensor_kinds.py): the step is written as an earlier
    fastio wrote it, without that check."""
    from fastio.checkpoint import staging

    monkeypatch.setattr(staging, "_refuse_subclass", lambda t, path: None)
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp") as ckpt:
        ckpt.save(1, {"m": _Refused()}, blocking=True)
        with pytest.raises(CheckpointError) as err:
            if mapped:
                ckpt.restore_latest({"m": _Refused()})
            else:  # nothing held: every item through DCP's own reader
                DcpEngine().open(tmp_path / "ck" / "step-1").restore(DcpEngine().prepare({"m": _Refused()})[0])
    assert str(tmp_path / "ck" / "step-1" / "__0_0.distcp") in str(err.value), err.value
    assert "refused" in str(err.value) and "\n" not in str(err.value)
    assert _mapped_files(tmp_path / "ck" / "step-1") == []  # not kept by the error's frames (held here)


class _Odd(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: two keys, one tensor
        self.register_buffer("view", torch.randn(40, generator=g)[10:20])  # a view into a larger storage
        self.register_buffer("count", torch.tensor(float(seed)))  # 0-dim
        self.register_buffer("i64", torch.randint(-2**62, 2**62, (9,), generator=g))
        self.register_buffer("bf", torch.randn(3, 5, generator=g).to(torch.bfloat16).t())
        self.register_buffer("c64", torch.randn(3, 3, generator=g, dtype=torch.complex64))
        self.register_buffer("empty", torch.zeros(2, 0))
        self.register_buffer("flags", torch.rand(11, generator=g) > 0.5)
        self.extra = {"n": seed, "name": f"s{seed}", "lst": [seed, "a", [1, 2]], "nested": {"x": {"y": seed * 1.5}}}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def _adam(m: _Odd, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [m.a.weight], "lr": lr},
                              {"params": [m.a.bias, m.b.bias], "lr": 2 * lr, "betas": (0.8, 0.9)}])


def _mapped_files(step: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(step) in line]


def test_every_layout_restores_bitwise_twice_and_leaves_no_mapping(tmp_path):
    saved, into = _Odd(1), _Odd(2)
    opt_saved, opt_into = _adam(saved, 0.1), _adam(into, 0.5)
    saved.b(saved.a(torch.randn(2, 4))).sum().backward()
    opt_saved.step()
    app, back = {"m": saved, "o": opt_saved}, {"m": into, "o": opt_into}
    with Checkpointer(tmp_path / "ck", signals=(), engine="dcp", keep=1) as ckpt:
        ckpt.save(1, app, blocking=True)
        for _ in range(2):
            with warnings.catch_warnings():  # torch.frombuffer's (a buffer it cannot write) among them
                warnings.simplefilter("error", UserWarning)
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                assert ckpt.restore_latest(back).step == 1
            assert _mapped_files(tmp_path / "ck" / "step-1") == []
            for (name, a), b in zip(saved.state_dict().items(), into.state_dict().values()):
                same = a == b if name.endswith("_extra_state") else a.dtype == b.dtype and torch.equal(a, b)
                assert same, name
            assert into.a.weight is into.b.weight
            want, got = opt_saved.state_dict(), opt_into.state_dict()
            assert want["param_groups"] == got["param_groups"]
            for p, state in want["state"].items():
                assert all(torch.equal(v, got["state"][p][k]) for k, v in state.items()), p
            into.view.add_(1)  # the second restore overwrites it again
        ckpt.save(2, app, blocking=True)  # retention (keep=1) deletes the restored step
    assert not (tmp_path / "ck" / "step-1").exists()


def _fsdp_worker(rank: int, port: int, root: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from helpers import fsdp2_adam

    model, _ = fsdp2_adam(rank, port, (64, 96, 64))
    g = torch.Generator().manual_seed(3)
    model.register_buffer("bf", torch.randn(3, 5, generator=g).to(torch.bfloat16).t())  # replicated, not sharded
    model.register_buffer("z", torch.randn(5, 7, generator=g, dtype=torch.complex128))
    model.register_buffer("i64", torch.randint(-2**62, 2**62, (9,), generator=g))
    optim = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                               {"params": model[1].parameters(), "lr": 0.2, "betas": (0.8, 0.9)}])
    app = {"model": model, "optim": optim}

    def state() -> list:
        local = [(t.to_local() if hasattr(t, "to_local") else t).detach().clone() for t in model.state_dict().values()]
        return local + [v.to_local() if hasattr(v, "to_local") else v for s in optim.state.values() for v in s.values()]

    def train() -> None:
        model(torch.randn(4, 64)).sum().backward()
        optim.step()
        optim.zero_grad()

    seen: dict = {"same": [], "maps": []}
    with Checkpointer(root, signals=(), keep=1) as ckpt:
        train()
        ckpt.save(1, app, blocking=True)
        want, groups, rand = state(), optim.state_dict()["param_groups"], torch.rand(4)
        for _ in range(2):
            train()
            ckpt.restore_latest(app)
            seen["same"].append(all(torch.equal(a, b) for a, b in zip(want, state())) and len(want) == len(state())
                                and optim.state_dict()["param_groups"] == groups and torch.equal(torch.rand(4), rand))
            seen["maps"] += _mapped_files(Path(root, "step-1"))
        ckpt.save(2, app, blocking=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo teardown can abort at interpreter exit; the result is in the file


def test_fsdp2_restores_bitwise_twice_with_its_groups_and_rng_and_no_mapping_left(tmp_path):
    """2 gloo ranks, FSDP2: each rank's own shard loaded from its mapping, the replicated buffers (which DCP writes
    once, into either rank's file) from the mapping or the file, the optimizer's two groups and the RNG as saved."""
    from helpers import free_port, spawn_ranks

    port = free_port()
    spawn_ranks(_fsdp_worker, lambda r: (r, port, str(tmp_path / "ck"), str(tmp_path)), 2, timeout=180)
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == {"same": [True, True], "maps": []}, (r, seen)
    assert not (tmp_path / "ck" / "step-1").exists()  # keep=1: the restored step deleted by the next save
