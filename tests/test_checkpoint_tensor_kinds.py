"""Tensor kinds beyond plain ones, on both engines, by a real save and restore: a tensor subclass is refused at save
(naming its key path and type: no checkpoint that cannot be restored is committed), a parameter of a subclass type
is saved by its data and restores bitwise, and a quantized tensor restores as saved also where the app has no
tensor for it (its key missing from the app's state, or a plain tensor there)."""

from __future__ import annotations

import pytest
import torch
from helpers import StateHolder
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError

ENGINES = ["torchsnapshot", "dcp"]


class _Scaled(torch.Tensor):
    """A tensor subclass: ``torch.load(weights_only=True)`` refuses its pickle, torchsnapshot keeps only its data."""


class _Tagged(nn.Parameter):
    """A parameter of a subclass type."""


def _with_buffer() -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer("odd", torch.Tensor._make_subclass(_Scaled, torch.randn(3)))
    return m


SUBCLASSED = {
    "holder": (lambda: {"t": StateHolder({"x": {"y": torch.arange(4.0).as_subclass(_Scaled)}})}, "t/x/y"),
    "buffer": (lambda: {"m": _with_buffer()}, "m/odd"),
}


@pytest.mark.parametrize("where", sorted(SUBCLASSED))
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_subclass_is_refused_at_save_naming_its_key_and_type(tmp_path, engine, where):
    """Before: the save was committed and its restore failed (DCP: ``refused to load``) or lost the class and its
    attributes (torchsnapshot: a plain tensor). Now the save itself is refused and no step is written."""
    app, key = SUBCLASSED[where]
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.save(1, app(), blocking=True)
        assert ckpt.steps() == []
    text = str(err.value)
    assert f"state key {key!r}" in text and "_Scaled" in text and "\n" not in text, text
    assert not list((tmp_path / "ck").glob("step-*"))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_parameter_of_a_subclass_type_restores_bitwise_by_its_data(tmp_path, engine):
    saved, into = nn.Linear(3, 2), nn.Linear(3, 2)
    saved.weight, into.weight = _Tagged(torch.randn(2, 3)), _Tagged(torch.zeros(2, 3))
    holder = StateHolder({"p": _Tagged(torch.randn(5))})
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"m": saved, "h": holder}, blocking=True)
        back = StateHolder({})
        ckpt.restore_latest({"m": into, "h": back})
    assert type(into.weight) is _Tagged and torch.equal(into.weight, saved.weight)
    assert torch.equal(back.state["p"], holder.state["p"])


def _quantized() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"q8": torch.quantize_per_tensor(torch.randn(6, generator=g), 0.1, 3, torch.qint8),
            "qu8": torch.quantize_per_channel(torch.randn(2, 4, generator=g), torch.tensor([0.5, 0.25]),
                                              torch.tensor([1, 2]), 0, torch.quint8)}


def _bits(t: torch.Tensor) -> tuple:
    if t.qscheme() == torch.per_tensor_affine:
        params = (t.q_scale(), t.q_zero_point())
    else:
        params = (t.q_per_channel_scales().tolist(), t.q_per_channel_zero_points().tolist(), t.q_per_channel_axis())
    return t.dtype, t.qscheme(), params, t.int_repr().tolist()


@pytest.mark.parametrize("target", ["missing", "plain"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_quantized_tensor_restores_as_saved_without_a_quantized_target(tmp_path, engine, target):
    """Before (torchsnapshot): ``cannot read its state from 0/t/q8: RuntimeError: false INTERNAL ASSERT FAILED ...
    cannot call qscheme on UnknownQuantizer`` (it made an empty quantized tensor to copy into). Now the stored
    tensor itself is restored, as DCP does."""
    saved = _quantized()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"t": StateHolder(saved)}, blocking=True)
        back = StateHolder({} if target == "missing" else {k: torch.zeros(v.shape) for k, v in saved.items()})
        ckpt.restore_latest({"t": back})
    assert {k: _bits(v) for k, v in back.state.items()} == {k: _bits(v) for k, v in saved.items()}


def _quantized_buffer(quantized: bool) -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer("b", _quantized()["q8"] if quantized else torch.full((6,), 7.0))
    return m


@pytest.mark.parametrize("engine", ENGINES)
def test_a_quantized_tensor_into_a_module_s_plain_one_is_refused_naming_the_keys(tmp_path, engine):
    """Before: DCP ``step-1: RuntimeError: Copying from quantized Tensor to non-quantized Tensor is not allowed ...``
    (no key); torchsnapshot ``While copying the parameter named "b", whose dimensions in the model are torch.Size([6])
    and whose dimensions in the checkpoint are torch.Size([6]) ...`` (no app key, the shapes the same). Now one line
    naming both, nothing loaded; ``strict=False`` loads the rest and lists it."""
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"m": _quantized_buffer(True)}, blocking=True)
        into = _quantized_buffer(False)
        before = {k: v.clone() for k, v in into.state_dict().items()}
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"m": into})
        assert all(torch.equal(v, into.state_dict()[k]) for k, v in before.items())
        state = ckpt.restore_latest({"m": into}, strict=False)
    text = str(err.value)
    assert "app key m: quantized in the checkpoint, not in the app: b (torch.qint8, app torch.float32)" in text, text
    assert "\n" not in text
    assert torch.equal(into.b, before["b"]) and not torch.equal(into.weight, before["weight"])
    assert any("b (torch.qint8" in line for line in state.skipped), state.skipped


UNWRITABLE = {  # a tensor either engine cannot checkpoint, or torchsnapshot cannot: (make it, engines, words)
    "meta": (lambda: torch.empty(3, device="meta"), ENGINES, "a meta tensor has no data"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), ENGINES, "a nested tensor"),
    "sparse": (lambda: torch.eye(3).to_sparse(), ["torchsnapshot"], "a sparse_coo tensor"),
    "uint16": (lambda: torch.tensor([1, 2]).to(torch.uint16), ["torchsnapshot"], "torch.uint16 tensor"),
    "float8": (lambda: torch.ones(2).to(torch.float8_e4m3fn), ["torchsnapshot"], "torch.float8_e4m3fn tensor"),
}


@pytest.mark.parametrize("kind", sorted(UNWRITABLE))
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_the_engine_cannot_write_is_refused_at_save_naming_its_key(tmp_path, engine, kind):
    """Before: a meta or nested tensor failed the staging with torch's own words and no key (``NotImplementedError:
    Cannot copy out of meta tensor; no data!``); a sparse, uint16 or float8 tensor with torchsnapshot failed in the
    background write, raised at the next call without its key (``checkpoint write failed: ValueError: Unsupported
    dtype torch.uint16``). Now the save is refused before anything is written, naming the key path; DCP writes what it
    can and restores it."""
    make, refusing, words = UNWRITABLE[kind]
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine) as ckpt:
        if engine not in refusing:
            ckpt.save(1, {"t": StateHolder({"x": {"y": make()}})}, blocking=True)
            back = StateHolder({})
            ckpt.restore_latest({"t": back})
            assert torch.equal(back.state["x"]["y"].to_dense().float(), make().to_dense().float())
            return
        with pytest.raises(CheckpointError) as err:
            ckpt.save(1, {"t": StateHolder({"x": {"y": make()}})}, blocking=True)
        assert ckpt.steps() == []
    text = str(err.value)
    assert text.startswith("state key 't/x/y': ") and words in text and "\n" not in text, text
    assert not list((tmp_path / "ck").glob("step-*"))
