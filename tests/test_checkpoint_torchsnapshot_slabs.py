"""The torchsnapshot engine's slab files: tensors below ``SLAB_BYTES`` share files of at most that size, written from
the staged tensors themselves (no slab is allocated or filled); the manifest gives each its file and byte range, as
torchsnapshot's own batching writes them, so fastio and plain torchsnapshot both read them back bitwise. Real
torchsnapshot steps, one process."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from helpers import StateHolder
from torch import nn
from torchsnapshot import Snapshot

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.engines import torchsnapshot_engine


def _app(seed: int, trained: bool = True) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(12)), nn.Linear(64, 300))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    if trained:
        model(torch.randn(4, 64)).sum().backward()
        optim.step()
        optim.zero_grad()
    return {"model": model, "optim": optim}


def _tensors(app: dict) -> list[torch.Tensor]:
    model, optim = app["model"], app["optim"]
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(optim.state[p].items())]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _entries(step: Path) -> dict[str, object]:
    """The manifest's tensor entries of a step, by path."""
    manifest = Snapshot(str(step)).get_manifest()
    return {path: entry for path, entry in manifest.items() if getattr(entry, "type", None) == "Tensor"}


def _files(step: Path) -> dict[str, int]:
    return {str(f.relative_to(step)): f.stat().st_size for f in (step / "0").rglob("*") if f.is_file()}


def _save(root: Path, app: dict) -> Path:
    with Checkpointer(root, signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, app, blocking=True)
    return root / "step-1"


def test_small_tensors_share_one_slab_file_and_restore_bitwise(tmp_path):
    app = _app(1)
    step = _save(tmp_path / "ck", app)
    entries = _entries(step)
    ours = [e for path, e in entries.items() if path.split("/")[1] in ("model", "optim")]
    assert len(ours) == 26 * 4  # 26 parameters, Adam's 2 moments and step tensor for each
    slabbed = {e.location for e in entries.values()}
    assert len(slabbed) == 1 and next(iter(slabbed)).startswith("0/_fastio_slabs/")  # 0.6 MB, RNG states too: one slab
    ranges = sorted(tuple(e.byte_range) for e in entries.values() if e.location in slabbed)
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # packed, in order
    assert _files(step)[next(iter(slabbed))] == ranges[-1][1]

    into = _app(2, trained=False)  # no optimizer state: torchsnapshot makes the moments from the slab's ranges
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))


def test_plain_torchsnapshot_reads_fastios_slabs(tmp_path):
    """Another tool's ``Snapshot.restore`` reads the step as torchsnapshot's own batched layout."""
    app = _app(3)
    step = _save(tmp_path / "ck", app)
    into = _app(4)  # trained: Adam's state exists and is loaded in place
    Snapshot(str(step)).restore({"model": into["model"], "optim": into["optim"]})
    assert _same(_tensors(into), _tensors(app))


def test_slabs_are_at_most_slab_bytes_and_larger_tensors_keep_their_own_file(tmp_path, monkeypatch):
    monkeypatch.setattr(torchsnapshot_engine, "SLAB_BYTES", 40_000)  # a 64x64 float32 weight is 16,384 bytes
    app = _app(5)
    step = _save(tmp_path / "ck", app)
    entries, files = _entries(step), _files(step)
    big = [e for e in entries.values() if e.shape == [300, 64]]  # 76,800 bytes, its weight and two moments
    assert len(big) == 3 and all(not e.location.startswith("0/_fastio_slabs/") and e.byte_range is None for e in big)
    slabs = {name: size for name, size in files.items() if "/_fastio_slabs/" in name}
    assert len(slabs) > 10 and max(slabs.values()) <= 40_000
    into = _app(6, trained=False)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))


def test_a_step_written_one_file_per_tensor_restores_with_slabs_on(tmp_path, monkeypatch):
    """Steps of earlier releases (one file per tensor, ``SLAB_BYTES = 0`` now) read as before."""
    app = _app(7)
    with monkeypatch.context() as patched:
        patched.setattr(torchsnapshot_engine, "SLAB_BYTES", 0)
        step = _save(tmp_path / "ck", app)
    assert not any("/_fastio_slabs/" in name for name in _files(step))
    locations = [e.location for e in _entries(step).values()]
    assert len(set(locations)) == len(locations) and set(locations) <= set(_files(step))  # one file per tensor
    into = _app(8, trained=False)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))


@pytest.mark.parametrize("flip_at", ["first", "last"])
def test_a_flipped_byte_in_a_slab_is_refused(tmp_path, flip_at):
    """A slab's checksum covers every tensor in it: a byte flipped in its first or last tensor is found at restore,
    and the damaged step is not loaded."""
    from fastio.errors import CheckpointError

    app = _app(9)
    step = _save(tmp_path / "ck", app)
    slab = next(step / name for name in _files(step) if "/_fastio_slabs/" in name)
    data = bytearray(slab.read_bytes())
    data[0 if flip_at == "first" else -1] ^= 0x10
    slab.write_bytes(bytes(data))
    into = _app(10, trained=False)
    before = _tensors(into)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, pytest.raises(CheckpointError, match="_fastio_slabs"):
        ckpt.restore_latest(into, step=1)
    assert _same(_tensors(into), before)


def test_a_slab_read_short_fails_the_restore_instead_of_leaving_tensors_unloaded(tmp_path, monkeypatch):
    """torchsnapshot 0.1.0 awaited a slab's tensors with ``asyncio.wait``, which keeps their errors to itself: a read
    that gave too few bytes left those tensors as they were, and the restore reported success."""
    from fastio.errors import CheckpointError

    app = _app(11)
    _save(tmp_path / "ck", app)
    real = torchsnapshot_engine._HeldReads.read

    async def short(self, read_io):
        await real(self, read_io)
        if "/_fastio_slabs/" in read_io.path:
            read_io.buf = torchsnapshot_engine._HeldView(read_io.buf.getvalue()[:100])

    monkeypatch.setattr(torchsnapshot_engine._HeldReads, "read", short)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, pytest.raises(CheckpointError, match="_fastio_slabs"):
        ckpt.restore_latest(_app(12, trained=False), step=1)


def _rss_mib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) >> 10 for line in status if line.startswith(field))


def test_a_restore_holds_a_bounded_part_of_a_slabbed_state_not_all_of_it_again(tmp_path, monkeypatch):
    """torchsnapshot 0.1.0 merges all of a file's byte ranges into one read and reads far ahead of the copies into the
    app's tensors, within a budget of a share of the host's memory: a small-tensor state in slabs was held once more
    in read buffers (one file per tensor had, by luck of the scheduling, held ~100 MiB of 600). Read in pieces
    (``_READ_BYTES``) within ``_READ_BUDGET``, the peak above the app's own tensors stays near the budget: here
    192 MiB of 0.5 MiB tensors in two slabs, pieces of 1 MiB, a budget of 32 MiB (RSS high-water mark from /proc,
    reset before the restore)."""
    monkeypatch.setattr(torchsnapshot_engine, "_READ_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(torchsnapshot_engine, "_READ_BUDGET", 32 << 20, raising=False)
    state = {f"t{i}": torch.full((1 << 17,), float(i)) for i in range(384)}  # 384 x 0.5 MiB
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"s": StateHolder(state)}, blocking=True)
    assert len([f for f in _files(tmp_path / "ck" / "step-1") if "/_fastio_slabs/" in f]) == 2
    into = StateHolder({name: torch.zeros_like(t) for name, t in state.items()})
    del state
    with Checkpointer(tmp_path / "ck", signals=(), read_only=True) as ckpt:
        ctypes.CDLL(None).malloc_trim(0)  # freed memory back to the kernel: read buffers cannot hide in it
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _rss_mib("VmRSS")
        assert ckpt.restore_latest({"s": into}).step == 1
        peak = _rss_mib("VmHWM") - before
    assert all(into.state[f"t{i}"][-1].item() == i for i in range(384))
    assert peak < 96, f"the restore peaked {peak} MiB above the app's tensors"


def _files_of(step: Path) -> list[str]:
    return sorted(str(f.relative_to(step)) for f in step.rglob("*") if f.is_file())


def test_an_app_key_named_batched_whose_state_is_one_tensor_saves_and_restores(tmp_path, monkeypatch):
    """torchsnapshot stores a state that is one tensor (or a dict it does not flatten) as the file ``R/KEY``: an app
    key ``batched`` made ``0/batched`` a file where the slabs of the other keys needed a directory, and every save of
    that app failed (``FileExistsError``)."""
    monkeypatch.setattr(torchsnapshot_engine, "SLAB_BYTES", 4096)
    app = _app(13)
    app["batched"] = StateHolder(torch.arange(2048, dtype=torch.float32))  # 8 KiB: a file of its own
    app["keyed"] = StateHolder({(0, 1): torch.arange(5)})  # a tuple key: torchsnapshot pickles the dict whole
    step = _save(tmp_path / "ck", app)
    assert "0/batched" in _files_of(step)
    into = _app(14, trained=False)
    into["batched"], into["keyed"] = StateHolder(torch.zeros(2048)), StateHolder({(0, 1): torch.zeros(5)})
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))
    assert torch.equal(into["batched"].state, app["batched"].state)
    assert torch.equal(into["keyed"].state[(0, 1)], torch.arange(5))


def test_a_state_key_spelling_a_slab_name_keeps_its_own_file(tmp_path, monkeypatch):
    """Slab names come from their tensors' paths: an app key ``batched`` holding a large tensor under the name of the
    other keys' slab was written to the same file as that slab; the save reported success, the checksum recorded was
    the last write's, and the restore loaded the large tensor's first bytes as the model's (or failed)."""
    monkeypatch.setattr(torchsnapshot_engine, "SLAB_BYTES", 4096)
    small = {"w": torch.full((10,), 2.0)}
    first = _save(tmp_path / "a", {"model": StateHolder(small)})
    (name,) = [f.rsplit("/", 1)[1] for f in _files_of(first) if f.startswith("0/") and "/_fastio_rng/" not in f]
    big = torch.arange(4096, dtype=torch.float32)  # 16 KiB: a file of its own, 0/batched/NAME
    _save(tmp_path / "b", {"model": StateHolder(small), "batched": StateHolder({name: big})})
    into = {"model": StateHolder({"w": torch.zeros(10)}), "batched": StateHolder({name: torch.zeros(4096)})}
    with Checkpointer(tmp_path / "b", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert torch.equal(into["model"].state["w"], small["w"]) and torch.equal(into["batched"].state[name], big)


def test_a_step_with_slabs_in_batched_restores(tmp_path, monkeypatch):
    """Steps written before slabs moved out of the app keys' names (``R/batched/NAME``) read as before: the manifest
    gives each tensor's file."""
    app = _app(15)
    with monkeypatch.context() as patched:
        patched.setattr(torchsnapshot_engine, "SLAB_DIR", "batched")
        step = _save(tmp_path / "ck", app)
    assert {e.location.rsplit("/", 1)[0] for e in _entries(step).values()} == {"0/batched"}
    into = _app(16, trained=False)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(into).step == 1
    assert _same(_tensors(into), _tensors(app))
