"""Writes past the page cache (:mod:`fastio.storage.direct`): the bytes that land are exactly the bytes given, whatever
their sizes against the aligned chunks, and a file system that takes ``O_DIRECT`` at open but refuses its writes
gets the checkpoint written through the page cache instead of a failed save."""

from __future__ import annotations

import errno
import mmap
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fastio.checkpoint import Checkpointer
from fastio.checkpoint.staging import Stager
from fastio.storage import direct

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")

SIZES = [
    [0],
    [1],
    [direct.ALIGN - 1, 3],
    [direct.CHUNK_BYTES],
    [direct.CHUNK_BYTES - 5, 10, direct.ALIGN],
    [3, 2 * direct.CHUNK_BYTES + 7, direct.CHUNK_BYTES + direct.ALIGN],
]


def _write_direct(path, pieces) -> direct.DirectFile:
    """``pieces`` (byte views) written to a new file at ``path`` through a DirectFile, finished and closed; the
    DirectFile (its ``size``, ``copied``, ``misplaced``). Skips where the file system refuses ``O_DIRECT``."""
    fd = direct.open_direct(str(path))
    if fd is None:
        pytest.skip(f"{path.parent}'s file system refuses O_DIRECT")
    try:
        out = direct.DirectFile(fd)
        try:
            for piece in pieces:
                out.write(piece)
            out.finish()
        finally:
            out.close()
    finally:
        os.close(fd)
    return out


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "+".join(map(str, s)))
def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path, sizes):
    """Pieces of any size, across chunk and block boundaries: the file is their concatenation, no padding left."""
    gen = torch.Generator().manual_seed(sum(sizes))
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes() for n in sizes]
    path = tmp_path / "f"
    out = _write_direct(path, [memoryview(piece) for piece in pieces])
    assert out.size == sum(sizes) and path.read_bytes() == b"".join(pieces)


def test_placed_bytes_are_written_from_where_they_are(tmp_path):
    """Bytes whose address lies as far past a page boundary as their file offset are written from where they are: only
    the head before the first block boundary and the tail after the last go through the aligned buffers; bytes placed
    otherwise are copied whole, and a run of ``PLACE_BYTES`` or more is reported with the phase it wanted."""
    align = direct.ALIGN
    memory = mmap.mmap(-1, 64 * align)  # page-aligned
    data = np.frombuffer(memory, dtype=np.uint8)
    data[:] = np.random.default_rng(0).integers(0, 256, data.size, dtype=np.uint8)
    whole = memoryview(memory)
    pieces = [whole[0:5], whole[5:5 + 20 * align], whole[100:100 + 17 * align + 3], whole[align:3 * align]]
    path = tmp_path / "f"
    out = _write_direct(path, pieces)
    assert out.size == sum(p.nbytes for p in pieces) and path.read_bytes() == b"".join(bytes(p) for p in pieces)
    # 5 (no block), 20 blocks at phase 5: head 4091 + tail 5 copied; then two pieces placed otherwise, copied whole
    assert out.copied == 5 + (align - 5) + 5 + (17 * align + 3) + 2 * align
    third = np.frombuffer(pieces[2], dtype=np.uint8).ctypes.data
    assert out.misplaced == [(third, 17 * align + 3, 5)]  # the fourth is below PLACE_BYTES: not reported
    del data
    for piece in pieces:
        piece.release()
    whole.release()
    memory.close()


def test_an_error_of_a_chunk_write_is_raised_by_finish(tmp_path):
    """A chunk written on the file's own thread that fails (here: a descriptor opened read-only, EBADF) raises from
    the writer's next call, not lost on that thread."""
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        out = direct.DirectFile(fd)
        try:
            with pytest.raises(OSError) as err:
                out.write(memoryview(bytes(direct.CHUNK_BYTES + 1)))
                out.finish()
            assert err.value.errno == errno.EBADF
        finally:
            out.close()
    finally:
        os.close(fd)


def _app():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 301), nn.Linear(301, 7))  # sizes no block divides
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    optim.step()
    return model, optim


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "_fastio_slabs" in p.as_posix()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_a_checkpoint_written_direct_is_the_same_files_and_restores(tmp_path):
    """direct_writes (the default) changes where the bytes go, not the bytes: the same slab files as a buffered save,
    and a restore of them gives the state back."""
    model, optim = _app()
    for name, flag in (("direct", True), ("buffered", False)):
        with Checkpointer(tmp_path / name, signals=(), engine="torchsnapshot", direct_writes=flag) as ckpt:
            ckpt.save(3, {"model": model, "optim": optim}, blocking=True)
    assert _files(tmp_path / "direct") == _files(tmp_path / "buffered") != {}
    fresh = nn.Sequential(nn.Linear(300, 301), nn.Linear(301, 7))
    fresh_optim = torch.optim.Adam(fresh.parameters())
    with Checkpointer(tmp_path / "direct", signals=()) as ckpt:
        ckpt.restore_latest({"model": fresh, "optim": fresh_optim})
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_a_file_system_refusing_direct_writes_gets_the_files_through_the_page_cache(tmp_path, monkeypatch):
    """Some file systems take ``O_DIRECT`` at open and refuse the writes (EINVAL): the file is written again through
    the page cache, and the save succeeds with the same files."""
    model, optim = _app()
    refused = []

    def refusing(fd, view):
        refused.append(view.nbytes)
        raise OSError(errno.EINVAL, "Invalid argument")

    with Checkpointer(tmp_path / "buffered", signals=(), direct_writes=False) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim}, blocking=True)
    monkeypatch.setattr(direct, "_write_all", refusing)
    with Checkpointer(tmp_path / "refused", signals=()) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim}, blocking=True)
        assert ckpt.steps() == [3]
    assert refused  # the direct write was tried
    assert _files(tmp_path / "refused") == _files(tmp_path / "buffered") != {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_from_the_second_save_on_the_staged_bytes_are_written_from_where_they_are(tmp_path):
    """The Stager places its buffers as their bytes' offsets in the files (the first save tells where the slab files
    put them): from the second save on, only the tensors below ``PLACE_BYTES`` and each placed tensor's unaligned head
    and tail go through the aligned buffers. The files are still a buffered save's, byte for byte, and hold the state
    as staged (a training step between the saves is in the second one)."""
    model, optim = _app()
    app = {"model": model, "optim": optim}
    with Checkpointer(tmp_path / "direct", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, app, blocking=True)
        engine = ckpt._engines["torchsnapshot"]
        first = engine.direct_copied
        model(torch.randn(2, 300)).sum().backward()
        optim.step()
        ckpt.save(2, app, blocking=True)
        sizes = [buf.nbytes for buf in ckpt._stager._buffers.values()]
    placed = [n for n in sizes if n >= direct.PLACE_BYTES]
    assert placed and engine.direct_bytes >= sum(sizes) > sum(placed)  # every staged byte went past the page cache
    bound = engine.direct_bytes - sum(placed) + 2 * direct.ALIGN * len(placed)  # (and the pickled objects' files)
    assert engine.direct_copied <= bound < first, (engine.direct_copied, bound, first)
    assert engine.placements() == {}  # nothing left to place
    with Checkpointer(tmp_path / "buffered", signals=(), engine="torchsnapshot", direct_writes=False) as ckpt:
        ckpt.save(2, app, blocking=True)
    direct_files = {k: v for k, v in _files(tmp_path / "direct").items() if k.startswith("step-2/")}
    assert direct_files == {k: v for k, v in _files(tmp_path / "buffered").items() if k.startswith("step-2/")} != {}


def test_the_stager_places_its_buffers_as_the_writer_asks():
    """Placed buffers start at a page boundary, or as far past one as the last write asked (an address in a buffer ->
    where it should have been), hold the state's values, are kept while asked nothing new, and are plain torch
    buffers again without placements; a phase the dtype cannot start at leaves a plain buffer, not made anew at every
    save."""
    align = direct.ALIGN
    state = {"m": {"w": torch.randn(100_000), "small": torch.zeros(3)}}
    stager = Stager()
    first = stager.stage(state, placements={})["m"]
    assert first["w"].data_ptr() % align == 0 and torch.equal(first["w"], state["m"]["w"])
    assert first["small"].untyped_storage().nbytes() == 12  # below PLACE_BYTES: as torch allocates it
    moved = stager.stage(state, placements={first["w"].data_ptr() + 8: 20})["m"]["w"]
    assert moved.data_ptr() % align == 12 and torch.equal(moved, state["m"]["w"])
    assert stager.stage(state, placements={})["m"]["w"].data_ptr() == moved.data_ptr()  # kept
    plain = stager.stage(state)["m"]["w"]
    assert plain.untyped_storage().nbytes() == plain.nbytes and torch.equal(plain, state["m"]["w"])
    stager.stage(state, placements={})
    odd = stager.stage(state, placements={stager._buffers["m/w"].data_ptr(): 2})["m"]["w"]  # no float32 starts there
    assert torch.equal(odd, state["m"]["w"])
    assert stager.stage(state, placements={odd.data_ptr(): 2})["m"]["w"].data_ptr() == odd.data_ptr()


@pytest.mark.gpu
def test_a_gpu_tensors_pinned_buffer_is_placed_by_its_exact_size_at_a_page_only():
    """torch's CUDA host allocator rounds a pinned block up to a power of two: a buffer one page larger than a 64 MiB
    weight would take 128 MiB of page-locked memory. A pinned buffer is placed at a page boundary by its exact size,
    and one a slab's offset would place elsewhere stays a plain pinned buffer (its bytes copied at the write)."""
    w = torch.randn(4096, 4096, device="cuda")
    stager = Stager()
    buf = stager.stage({"m": {"w": w}}, placements={})["m"]["w"]
    stager.wait_copies()
    assert buf.is_pinned() and buf.data_ptr() % direct.ALIGN == 0
    assert buf.untyped_storage().nbytes() == w.nbytes and torch.equal(buf, w.cpu())
    other = stager.stage({"m": {"w": w}}, placements={buf.data_ptr(): 64})["m"]["w"]
    stager.wait_copies()
    assert other.is_pinned() and other.untyped_storage().nbytes() == w.nbytes and torch.equal(other, w.cpu())


class _Box:
    """A Stateful holding a dict of tensors, loaded in place."""

    def __init__(self, tensors):
        self.tensors = tensors

    def state_dict(self):
        return dict(self.tensors)

    def load_state_dict(self, state):
        for key, value in state.items():
            self.tensors[key].copy_(value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_a_tensor_torchsnapshot_pickles_is_written_as_a_buffered_save_writes_it(tmp_path):
    """torchsnapshot writes a dtype numpy has no type for (complex) with ``torch.save``, which writes a tensor's whole
    storage: a placed buffer (a view into an allocation a page larger) would put a page of never-written memory into
    the file. Its file is a buffered save's, byte for byte, at every save, and restores."""
    gen = torch.Generator().manual_seed(0)
    state = {"c": torch.randn(10_000, dtype=torch.complex64, generator=gen),  # 80 000 bytes: >= PLACE_BYTES
             "w": torch.randn(30_000, generator=gen)}
    for name, flag in (("direct", True), ("buffered", False)):
        with Checkpointer(tmp_path / name, signals=(), engine="torchsnapshot", direct_writes=flag) as ckpt:
            ckpt.save(1, {"box": _Box(state)}, blocking=True)
            ckpt.save(2, {"box": _Box({k: v + 1 for k, v in state.items()})}, blocking=True)
    for step in ("step-1", "step-2"):
        files = [(tmp_path / name / step / "0" / "box" / "c").read_bytes() for name in ("direct", "buffered")]
        assert files[0] == files[1], (step, len(files[0]), len(files[1]))
    out = _Box({k: torch.zeros_like(v) for k, v in state.items()})
    with Checkpointer(tmp_path / "direct", signals=(), read_only=True) as ckpt:
        ckpt.restore_latest({"box": out})
    assert all(torch.equal(out.tensors[k], v + 1) for k, v in state.items())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_a_buffer_whose_pieces_want_different_placements_is_not_made_anew_at_every_save(tmp_path, monkeypatch):
    """torchsnapshot writes a tensor above its chunk size (512 MiB; here 100 000 bytes) as chunks, each its own file
    (here every tensor is: no slabs), which want the buffer at different phases when the chunk size is no multiple of a
    page: the buffer keeps the phase its placed chunk has (most of its pieces', ties to where it is) instead of moving
    to whichever misplaced chunk asked first, save after save (a fresh allocation, and as much copied, every time)."""
    from fastio.checkpoint.engines import torchsnapshot_engine

    monkeypatch.setenv("TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE", "100000")
    monkeypatch.setattr(torchsnapshot_engine, "SLAB_BYTES", 0)
    w = torch.randn(100_000)  # 4 chunks of 100 000 bytes: at phases 0, 1696, 3392 and 992 of the buffer's start
    with Checkpointer(tmp_path / "c", signals=(), engine="torchsnapshot", keep=1) as ckpt:
        addresses = []
        for step in range(1, 5):
            w += 1
            ckpt.save(step, {"box": _Box({"w": w})}, blocking=True)
            addresses.append(ckpt._stager._buffers["box/w"].data_ptr())
    assert len(set(addresses)) == 1, [a % direct.ALIGN for a in addresses]
    out = _Box({"w": torch.zeros_like(w)})
    with Checkpointer(tmp_path / "c", signals=(), read_only=True) as ckpt:
        ckpt.restore_latest({"box": out})
    assert torch.equal(out.tensors["w"], w)


def test_the_stager_places_a_buffer_where_most_of_its_pieces_want_it():
    """Of the phases a buffer's pieces ask (each written at offset 0 of a file of its own), the most asked wins, and a
    tie leaves the buffer where it is; a single ask moves it."""
    align = direct.ALIGN
    state = {"m": {"w": torch.randn(100_000)}}
    stager = Stager()
    start = stager.stage(state, placements={})["m"]["w"].data_ptr()
    assert start % align == 0
    most = {start + align // 2: 0, start: 0, start + align: 0}  # the start wanted at phases 2048, 0 and 0
    assert stager.stage(state, placements=most)["m"]["w"].data_ptr() == start
    tie = {start + align // 2: 0, start: 0}
    assert stager.stage(state, placements=tie)["m"]["w"].data_ptr() == start
    moved = stager.stage(state, placements={start + align // 2: 0})["m"]["w"]
    assert moved.data_ptr() % align == align // 2 and torch.equal(moved, state["m"]["w"])
