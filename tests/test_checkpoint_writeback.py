"""Each file a checkpoint engine writes starts on its way to the disk as soon as it is written: the commit's fsyncs,
which still make every file durable before the commit marker, find the bytes written or in flight instead of
writing all of them at once (measured on 528 MiB: the commit's flush 0.17-0.21 s -> 0.01 s, see the checkpoint
section of docs/performance.md)."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fastio.checkpoint import Checkpointer, compress, publish

_CACHESTAT = 451  # cachestat(2), Linux >= 6.5, the same number on every architecture


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def page_cache(path: Path) -> tuple[int, int] | None:
    """(pages cached, pages dirty and not yet on their way to the disk) of a file; None without cachestat(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Stat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
            return None
        return stat.cache, stat.dirty
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the page cache is read through Linux's cachestat(2)")
@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_the_engines_files_are_on_their_way_to_the_disk_when_the_commit_starts(tmp_path, monkeypatch, engine):
    """The engines wrote every file into the page cache and left all of it dirty: the commit's fsyncs (4 threads, 97
    files for 528 MiB) then wrote it all, 0.17-0.21 s a save on the path the training thread waits for at a
    checkpoint every ~1x its write time. Now every file's writeback has started when the commit begins (written
    through the page cache: ``direct_writes=False``; the DCP engine always is)."""
    seen: dict[str, tuple[int, int] | None] = {}
    real = publish.commit

    def looking(tmp, final, **kwargs):  # what the engine left in the page cache, as the commit starts
        seen.update({p.name: page_cache(p) for p in publish.data_files(tmp) if p.stat().st_size >= 1 << 20})
        return real(tmp, final, **kwargs)

    monkeypatch.setattr(publish, "commit", looking)
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)  # 4 MiB of weights, 8 MiB more of Adam's moments
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine, direct_writes=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
    if any(v is None for v in seen.values()):
        pytest.skip("this kernel has no cachestat(2) (Linux < 6.5)")
    assert seen and sum(cached for cached, _ in seen.values()) > 0, seen  # the files were in the page cache
    assert {name: dirty for name, (_, dirty) in seen.items() if dirty} == {}, seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the page cache is read through Linux's cachestat(2)")
def test_by_default_the_torchsnapshot_engines_files_never_enter_the_page_cache(tmp_path, monkeypatch):
    """``direct_writes`` (the default): the torchsnapshot engine writes its data files with ``O_DIRECT``, so at the
    commit no page of them is cached but the last one of a file whose size no page divides (the cut to its size goes
    through the page cache): the kernel's work for those pages was most of the write's CPU beside the training
    thread (see the checkpoint section of docs/performance.md)."""
    seen: dict[str, tuple[int, int] | None] = {}
    real = publish.commit

    def looking(tmp, final, **kwargs):
        seen.update({p.name: (page_cache(p), p.stat().st_size % os.sysconf("SC_PAGE_SIZE") != 0)
                     for p in publish.data_files(tmp) if p.stat().st_size >= 1 << 20})
        return real(tmp, final, **kwargs)

    monkeypatch.setattr(publish, "commit", looking)
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    with Checkpointer(tmp_path / "ck", signals=(), engine="torchsnapshot") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim}, blocking=True)
        assert ckpt.steps() == [1]
    if any(stat is None for stat, _ in seen.values()):
        pytest.skip("this kernel has no cachestat(2) (Linux < 6.5)")
    assert seen and all(stat[0] <= partial for stat, partial in seen.values()), seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the page cache is read through Linux's cachestat(2)")
@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_with_compression_only_the_compressed_files_go_to_the_disk_before_the_commit(tmp_path, monkeypatch, engine):
    """With ``compression=`` the engine's files are replaced by their compressed copies before the commit: starting
    their writeback would write every raw byte to the disk for nothing. The engine leaves them in the page cache;
    each compressed file starts on its way to the disk as it is written."""
    raw: dict[str, tuple[int, int] | None] = {}
    stored: dict[str, tuple[int, int] | None] = {}
    real_compress, real_commit = compress.compress_file, publish.commit

    def compressing(path, comp):  # the engine's file, as compression finds it
        if Path(path).stat().st_size >= 1 << 20:
            raw[Path(path).name] = page_cache(Path(path))
        return real_compress(path, comp)

    def looking(tmp, final, **kwargs):
        stored.update({p.name: page_cache(p) for p in publish.data_files(tmp) if p.stat().st_size >= 1 << 20})
        return real_commit(tmp, final, **kwargs)

    monkeypatch.setattr(compress, "compress_file", compressing)
    monkeypatch.setattr(publish, "commit", looking)
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    with Checkpointer(tmp_path / "ck", signals=(), engine=engine, compression="zstd") as ckpt:
        ckpt.save(1, {"model": model}, blocking=True)
    if any(v is None for v in [*raw.values(), *stored.values()]):
        pytest.skip("this kernel has no cachestat(2) (Linux < 6.5)")
    assert raw and all(dirty == cached > 0 for cached, dirty in raw.values()), raw  # never started to the disk
    assert stored and all(name.endswith(".zst") for name in stored), stored
    assert {name: dirty for name, (_, dirty) in stored.items() if dirty} == {}, stored
