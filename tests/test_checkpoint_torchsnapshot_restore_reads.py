"""What a torchsnapshot restore reads: the files the check hashed for this rank are read again by ``pread`` (never
mapped), copied into the app's tensors (in place where the target has them, new ones where it has none: a fresh
optimizer's moments), with no mapping of the step left afterwards; a byte flipped in a file is still refused with
nothing loaded. One process, real torchsnapshot steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import StateHolder, rchar, reseal
from torch import nn
from torchsnapshot import Snapshot

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.engines import get_engine
from fastio.errors import CheckpointError


class _Counter:
    """A Stateful that is not a module: a tensor and plain objects (torchsnapshot reads it with no target)."""

    def __init__(self, seed: int):
        self.seen = torch.arange(5) * seed
        self.names = [f"n{seed}", {"k": seed}, None]

    def state_dict(self) -> dict:
        return {"seen": self.seen, "names": self.names}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.names = state["seen"], state["names"]


def _app(seed: int, trained: bool) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    if trained:
        model(torch.randn(4, 512)).sum().backward()
        optim.step()
        optim.zero_grad()
    return {"model": model, "optim": optim, "counter": _Counter(seed)}


def _tensors(app: dict) -> list[torch.Tensor]:
    model, optim = app["model"], app["optim"]
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(optim.state[p].items())]
    return out + [app["counter"].seen.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _mapped(step: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(step) in line]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict, torch.Tensor, int]:
    """A torchsnapshot step of a trained model + Adam + a counter: (root, app, the RNG draw after the save, the
    bytes of its data files)."""
    root = tmp_path_factory.mktemp("ts") / "ck"
    app = _app(1, trained=True)
    with Checkpointer(root, signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, app, blocking=True)
    data = sum(f.stat().st_size for f in (root / "step-1" / "0").rglob("*") if f.is_file())
    return root, app, torch.rand(3), data


def test_a_restore_into_a_fresh_app_reads_each_file_twice_at_most_and_loads_it_bitwise(saved):
    """The check hashes this rank's files (a 4 MiB model and its 2 Adam moments here) and torchsnapshot's reads of
    them are served by ``pread`` (``CheckedFile``): each byte read twice, no more. (For a while they were served from
    a mapping the check made, which read(2) does not count, but which a truncation turned into a SIGBUS.)"""
    root, app, draw, data = saved
    into = _app(2, trained=False)  # no optimizer state at all: torchsnapshot makes the moments
    assert data > 10 << 20
    torch.manual_seed(99)
    with Checkpointer(root, signals=()) as ckpt:
        before = rchar()
        assert ckpt.restore_latest(into).step == 1
        read = rchar() - before
        assert _mapped(root / "step-1") == []  # nothing refers to the mappings once the restore returns
    assert read < 2.25 * data, (read, data)  # (a mapping read none, but died of a truncation: SIGBUS)
    assert _same(_tensors(into), _tensors(app))
    assert into["counter"].names == app["counter"].names
    assert torch.equal(torch.rand(3), draw)  # the RNG as it was at the save


def test_restored_tensors_are_writable_and_independent_of_the_files(saved):
    root, app, _, _ = saved
    into = _app(3, trained=False)
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.restore_latest(into)
        for t in [*into["model"].parameters(), *(v for s in into["optim"].state.values() for v in s.values())]:
            with torch.no_grad():
                t.add_(1)  # a read-only view of a file's bytes would refuse; a shared one would change the next
        again = _app(4, trained=False)
        ckpt.restore_latest(again)
    assert _same(_tensors(again), _tensors(app))


def test_an_existing_optimizer_state_is_loaded_in_place(saved):
    root, app, _, _ = saved
    into = _app(5, trained=True)
    moments = {id(v): v.data_ptr() for s in into["optim"].state.values() for v in s.values()}
    params = [p.data_ptr() for p in into["model"].parameters()]
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.restore_latest(into)
    assert [p.data_ptr() for p in into["model"].parameters()] == params
    after = {v.data_ptr() for s in into["optim"].state.values() for v in s.values() if v.dim()}
    assert after <= set(moments.values())
    assert _same(_tensors(into), _tensors(app))


def test_a_flipped_byte_is_refused_and_nothing_loads(tmp_path):
    app = _app(6, trained=True)
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, app, blocking=True)
    weight = max((f for f in (tmp_path / "ck" / "step-1" / "0").rglob("*") if f.is_file()),
                 key=lambda f: f.stat().st_size)
    data = bytearray(weight.read_bytes())
    data[len(data) // 2] ^= 0x10
    weight.write_bytes(data)
    into = _app(7, trained=False)
    before = _tensors(into)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(into, step=1)
    assert weight.name in str(err.value) and "xxh3_128" in str(err.value)
    assert _same(_tensors(into), before)
    assert _mapped(tmp_path / "ck" / "step-1") == []


def test_reads_foresees_each_ranks_files_and_the_replicated_ones_at_the_saved_world_size():
    files = [".snapshot_metadata", "0/model/w", "1/model/w", "1/optim/state/0/exp_avg", "replicated/model/b",
             "fastio-commit.json"]
    engine = get_engine("torchsnapshot")
    assert engine.reads(files, 2, 2) == {"0/model/w": 0, "1/model/w": 1, "1/optim/state/0/exp_avg": 1,
                                         "replicated/model/b": 0}
    assert engine.reads(files, 2, 3) == {}  # elastic: read key by key, nothing foreseen


class _NotPlain:
    """An object ``torch.load(weights_only=True)`` refuses to unpickle."""


def test_an_object_refused_while_loading_from_the_mappings_leaves_none_mapped(tmp_path):
    """The counter's ``None`` (an object file torchsnapshot reads through the held mapping) replaced by an object
    torch.load refuses, the marker resealed: the restore's error names the file and no mapping outlives it."""
    app = _app(8, trained=True)
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, app, blocking=True)
    step = tmp_path / "ck" / "step-1"
    victim = step / "0" / "counter" / "names" / "2"
    assert victim.is_file()
    torch.save(_NotPlain(), victim)
    reseal(step)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(_app(9, trained=False))
    assert str(err.value).startswith(f"{victim}: refused to load"), str(err.value)
    assert _mapped(step) == []


# ---------------------------------------------------------------- every layout torchsnapshot stores differently
def _layouts() -> dict[str, torch.Tensor]:
    """Tensors torchsnapshot reads through each of its paths: viewed in place from the file (its buffer-protocol
    dtypes, at odd sizes, 0-dim, empty, NaN payloads and -0.0), torch.save'd (complex, a conj view, quantized), and
    split into chunk files (``chunked``, with the chunk size lowered)."""
    g = torch.Generator().manual_seed(5)
    specials = torch.tensor([0x7FF8000000000123, -(1 << 63), 0x7FF0000000000000, 1], dtype=torch.int64)
    return {
        "f64": specials.view(torch.float64), "f32": torch.randn(7, 3, generator=g),
        "bf16": torch.randn(33, generator=g).bfloat16(), "f16": torch.randn(3, 5, generator=g).half(),
        "bool": torch.rand(17, generator=g) > 0.5, "i64": torch.arange(-5, 6), "i8": torch.tensor([-3, 0, 7],
                                                                                                  dtype=torch.int8),
        "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4), "noncontig": torch.randn(4, 6, generator=g).t(),
        "c128": torch.randn(7, dtype=torch.complex128, generator=g),
        "conj": torch.randn(5, dtype=torch.complex128, generator=g).conj(),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "chunked": torch.randn(64, 33, dtype=torch.float64, generator=g),
        "chunked_bf16": torch.randn(9, 3, generator=g).bfloat16(), "bf16_one": torch.tensor(0.5).bfloat16(),
        "qint8": torch.quantize_per_tensor(torch.randn(6, generator=g), 0.1, 3, torch.qint8),
    }



def _bits(t: torch.Tensor) -> tuple:
    """Everything a tensor holds, bit for bit (a conj view by its values)."""
    if t.is_quantized:
        return t.dtype, tuple(t.shape), t.q_scale(), t.q_zero_point(), _bits(t.int_repr())[2]
    flat = t.resolve_conj().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def _step_bytes(step: Path) -> dict[str, bytes]:
    return {str(f.relative_to(step)): f.read_bytes() for f in sorted(step.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("into", ["fresh", "in_place"])
def test_every_layout_restores_bitwise_writable_and_unmapped(tmp_path, monkeypatch, into):
    """Each tensor comes back bit for bit (a bfloat16 tensor of an odd number of elements was written one element
    short before, and the restore refused it) (made by torchsnapshot, or copied into the target's own tensor), none refers
    to the mappings afterwards, writing into them changes neither the files nor the next restore."""
    saved = _layouts()
    monkeypatch.setenv("TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE", "4096")  # chunked: 5 files; bf16 alone: 1
    root = tmp_path / "ck"
    with Checkpointer(root, signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"t": StateHolder(saved)}, blocking=True)
    step = root / "step-1"
    chunked = [e for e in Snapshot(str(step)).get_manifest().values() if getattr(e, "type", None) == "ChunkedTensor"]
    assert chunked and all(len(e.chunks) > 1 for e in chunked)
    files = _step_bytes(step)

    def target() -> StateHolder:  # fresh: it offers no tensor, torchsnapshot makes each one (a fresh optimizer's moments)
        if into == "fresh":
            return StateHolder({})
        return StateHolder({k: (v.clone() if v.is_quantized else torch.zeros_like(v.resolve_conj()))
                         for k, v in saved.items()})

    with Checkpointer(root, signals=()) as ckpt:
        got = target()
        ckpt.restore_latest({"t": got})
        assert _mapped(step) == []
        assert {k: _bits(v) for k, v in got.state.items()} == {k: _bits(v) for k, v in saved.items()}
        for t in got.state.values():
            if not t.is_quantized:
                t.fill_(1)
        again = target()
        ckpt.restore_latest({"t": again})
    assert {k: _bits(v) for k, v in again.state.items()} == {k: _bits(v) for k, v in saved.items()}
    assert _step_bytes(step) == files
    assert _mapped(step) == []


def _largest(step: Path) -> Path:
    return max((f for f in (step / "0").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_a_damaged_newest_step_falls_back_to_the_previous_one_read_from_its_own_mappings(tmp_path):
    """Step 2's largest file flipped after its commit: the check maps (and drops) step 2's files, then maps step 1's
    and loads them; twice in a row in one process, nothing mapped after either."""
    root = tmp_path / "ck"
    first, second = _app(10, trained=True), _app(11, trained=True)
    with Checkpointer(root, signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, first, blocking=True)
        ckpt.save(2, second, blocking=True)
    victim = _largest(root / "step-2")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(data)
    for seed in (12, 13):
        into = _app(seed, trained=False)
        with Checkpointer(root, signals=()) as ckpt:
            assert ckpt.restore_latest(into).step == 1
        assert _same(_tensors(into), _tensors(first))
        assert _mapped(tmp_path) == []


def test_a_compressed_step_restores_bitwise_from_its_decompressed_copies(tmp_path):
    root = tmp_path / "ck"
    app = _app(14, trained=True)
    with Checkpointer(root, signals=(), engine="torchsnapshot", compression="zstd") as ckpt:
        ckpt.save(1, app, blocking=True)
    into = _app(15, trained=False)
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))
    assert _mapped(tmp_path) == []
