"""compression="zstd": stored files are .zst and smaller, restore needs no flag and is exact, damage is caught."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import join_group, start_ranks
from torch import nn

from fastio.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    catalog,
    checkpointer,
    compress,
    naming,
    publish,
    record,
    removal,
    scan,
)
from fastio.cli import main as fastio_main
from fastio.errors import CheckpointError

ENGINE_NAMES = ("torchsnapshot", "dcp")


@pytest.fixture(params=ENGINE_NAMES)
def engine(request, monkeypatch) -> str:
    """Runs a test once per engine: the Checkpointer's engine="auto" picks this one."""
    chosen = request.param
    monkeypatch.setattr(checkpointer, "choose_engine", lambda name, app: chosen if name == "auto" else name)
    return chosen




class Counter:
    def __init__(self):
        self.consumed, self.epoch = 0, 0

    def state_dict(self):
        return {"consumed": self.consumed, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.consumed, self.epoch = state["consumed"], state["epoch"]


def make_app(seed: int = 0, width: int = 64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-2), "loader": Counter()}


def train(app, steps: int, width: int = 64) -> None:
    for _ in range(steps):
        loss = app["model"](torch.randn(8, width)).square().mean()
        app["optim"].zero_grad()
        loss.backward()
        app["optim"].step()
        app["loader"].consumed += 8


def tensors(app) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in app["model"].state_dict().items()}
    for i, s in app["optim"].state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".fastio-lock")


def save(root: Path, app, step: int, **options) -> dict:
    with Checkpointer(root, signals=(), **options) as ckpt:
        ckpt.save(step, app, blocking=True)
    return scan.read_commit(naming.step_dir(root, step))


@pytest.mark.parametrize("value", [None, "zstd", "zstd:1", "zstd:19", "zstd+shuffle", "zstd+shuffle:3"])
def test_compression_values_accepted(value, tmp_path):
    assert CheckpointConfig(dir=tmp_path, compression=value).compression == value


@pytest.mark.parametrize("value", ["gzip", "zstd:0", "zstd:23", "zstd:fast", "ZSTD", "", "shuffle", "zstd+shuffle:", 3,
                                   True])
def test_bad_compression_is_named(value, tmp_path):
    with pytest.raises(ValueError, match=r"CheckpointConfig\.compression") as err:
        CheckpointConfig(dir=tmp_path, compression=value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("codec", ["zstd", "zstd+shuffle"])
def test_round_trip_is_exact_and_needs_no_flag(tmp_path, engine, codec):
    root = tmp_path / "ck"
    app = make_app()
    train(app, 3)
    commit = save(root, app, 3, compression=codec)
    want = tensors(app)
    assert commit.compression == codec and commit.version == record.COMPRESSED_VERSION
    assert commit.engine == engine
    step = root / "step-3"
    stored = sorted(p.relative_to(step).as_posix() for p in publish.data_files(step))
    assert stored == sorted(commit.files) and all(f.endswith(".zst") for f in stored), stored
    assert catalog.verify(root) == []
    draw = torch.rand(3)  # what the RNG gives right after the save
    fresh = make_app(seed=1)
    torch.manual_seed(123)
    with Checkpointer(root, signals=()) as ckpt:  # no compression= here: the marker says it
        state = ckpt.restore_latest(fresh)
    assert state.step == 3 and state.path == step
    assert_equal(tensors(fresh), want)
    assert fresh["loader"].consumed == 24
    assert torch.equal(torch.rand(3), draw)  # RNG restored exactly
    assert entries(root) == ["step-3"]  # the private decompressed copy is gone


def test_compressible_state_is_stored_smaller(tmp_path, engine):
    app = make_app(width=256)
    with torch.no_grad():  # few distinct values, as in pruned or quantised weights
        for p in app["model"].parameters():
            p.copy_(torch.round(p * 8) / 8)
    plain = save(tmp_path / "plain", app, 1)
    packed = save(tmp_path / "zstd", app, 1, compression="zstd:3")
    assert plain.compression is None and plain.version == record.COMMIT_VERSION
    assert packed.bytes < 0.5 * plain.bytes, (packed.bytes, plain.bytes)
    on_disk = sum(p.stat().st_size for p in publish.data_files(tmp_path / "zstd" / "step-1"))
    assert on_disk == packed.bytes
    assert {f.removesuffix(".zst") for f in packed.files} == set(plain.files)
    rows = catalog.list_checkpoints(tmp_path / "zstd")
    assert rows[0]["compression"] == "zstd" and rows[0]["bytes"] == packed.bytes


@pytest.mark.parametrize("size", [0, 3, 64, 1001, 4 * 64 + 2])
def test_shuffled_files_restore_exactly_across_blocks(tmp_path, monkeypatch, size):
    monkeypatch.setattr(compress, "_BLOCK", 64)  # several blocks, and a last one that is short and not whole words
    data = torch.randn(size // 4).numpy().tobytes() + bytes(range(size % 4))
    for codec in compress.CODECS:
        plain = tmp_path / codec / "f.bin"
        plain.parent.mkdir()
        plain.write_bytes(data)
        stored = compress.compress_file(plain, compress.Compression(codec, 1))
        assert stored.name == "f.bin.zst" and not plain.exists() and not list(plain.parent.glob("*.tmp"))
        compress.restore_file(stored, tmp_path / codec / "back", codec)
        assert (tmp_path / codec / "back").read_bytes() == data


@pytest.mark.parametrize("codec", compress.CODECS)
def test_a_write_that_fails_while_compressing_is_named_and_leaves_no_part(tmp_path, codec):
    """Before: with "zstd+shuffle", a write of the compressed file that failed (a disk full mid-save) surfaced as
    zstandard's `ZstdError: zstd compress error: Src size is incorrect` (the stream's close after the failed write),
    naming neither the file nor the cause, and left NAME.zst.tmp behind. Now every codec says the OS's error,
    naming the file; the plain file is left as it was. The failing write: a file-size limit (RLIMIT_FSIZE)."""
    import os
    import resource
    import signal

    src = tmp_path / "0" / "weights"
    src.parent.mkdir()
    data = os.urandom(3 << 20)  # does not compress: the stored file passes the limit
    src.write_bytes(data)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=rf"^{src}: cannot compress: File too large$"):
            compress.compress_file(src, compress.parse_compression(codec))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(p.name for p in src.parent.iterdir()) == ["weights"] and src.read_bytes() == data


def test_shuffle_pays_on_float_state(tmp_path):
    torch.manual_seed(0)
    data = (torch.randn(1 << 18) * 0.02).numpy().tobytes()  # 1 MiB of weight-like fp32 values
    sizes = {}
    for codec in compress.CODECS:
        plain = tmp_path / codec / "w"
        plain.parent.mkdir()
        plain.write_bytes(data)
        sizes[codec] = compress.compress_file(plain, compress.Compression(codec, 1)).stat().st_size
    assert sizes["zstd+shuffle"] < 0.95 * sizes["zstd"] < len(data), sizes


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_is_caught_and_restore_falls_back(tmp_path, caplog, capsys, engine):
    root = tmp_path / "ck"
    app = make_app()
    train(app, 2)
    save(root, app, 2, compression="zstd")
    want = tensors(app)
    train(app, 2)
    save(root, app, 4, compression="zstd")
    victim = max(publish.data_files(root / "step-4"), key=lambda p: p.stat().st_size)
    assert victim.name.endswith(".zst")
    flip_byte(victim)
    problems = catalog.verify(root)
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: xxh3_128"), problems
    assert fastio_main(["ckpt", "verify", str(root)]) == 1
    assert capsys.readouterr().out.startswith(f"{victim}: xxh3_128")
    assert fastio_main(["ckpt", "ls", str(root)]) == 0
    assert f"{engine}+zstd" in capsys.readouterr().out
    fresh = make_app(seed=1)
    with caplog.at_level(logging.WARNING, logger="fastio"), Checkpointer(root, signals=()) as ckpt:
        state = ckpt.restore_latest(fresh)
    assert state.step == 2
    assert_equal(tensors(fresh), want)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"skipping checkpoint {root}/step-4: {victim.relative_to(root / 'step-4')}" in w
               or str(victim) in w for w in warned), warned
    assert entries(root) == ["step-2", "step-4.quarantined"]


def test_uncompressed_checkpoints_still_restore(tmp_path, engine):
    root = tmp_path / "ck"
    app = make_app()
    train(app, 1)
    old = save(root, app, 1)  # written without compression (as every checkpoint before the option)
    want1 = tensors(app)
    assert old.compression is None and not any(f.endswith(".zst") for f in old.files)
    fresh = make_app(seed=1)
    with Checkpointer(root, signals=(), compression="zstd") as ckpt:
        assert ckpt.restore_latest(fresh).step == 1
        assert_equal(tensors(fresh), want1)
        train(fresh, 1)
        ckpt.save(2, fresh, blocking=True)  # the same directory now gets a compressed step
    assert scan.read_commit(root / "step-2").compression == "zstd"
    again = make_app(seed=2)
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(again, step=1).step == 1
        assert_equal(tensors(again), want1)
        assert ckpt.restore_latest(again).step == 2
        assert_equal(tensors(again), tensors(fresh))


def test_unknown_codec_in_marker_is_skipped(tmp_path, caplog):
    root = tmp_path / "ck"
    app = make_app()
    save(root, app, 1, compression="zstd")
    save(root, app, 2, compression="zstd")
    marker = root / "step-2" / naming.COMMIT_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "compression": "lz4"}))
    with caplog.at_level(logging.WARNING, logger="fastio"), Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(make_app()).step == 1
    assert any("compressed with 'lz4', this fastio reads zstd" in r.getMessage() for r in caplog.records)
    with Checkpointer(root, signals=()) as ckpt, pytest.raises(CheckpointError, match="no committed checkpoint"):
        ckpt.restore_latest(make_app(), step=2)  # moved aside by the restore above, not deleted
    assert entries(root) == ["step-1", "step-2.quarantined"]


def test_only_fastio_restore_leftovers_are_removed(tmp_path):
    root = tmp_path / "ck"
    save(root, make_app(), 1, compression="zstd")
    killed = removal.start_restore_dir(root, 1)  # what a restore killed mid-way leaves
    (killed / "model.pt").write_bytes(b"x" * 100)
    killed.rename(root / ".step-1.restore-99999")
    foreign = root / ".step-1.restore-5"  # same shape, no fastio mark: not ours
    foreign.mkdir()
    (foreign / "keep").write_text("mine")
    assert [e.step for e in scan.scan(root)] == [1] and catalog.verify(root) == []
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(make_app()).step == 1
    assert entries(root) == [".step-1.restore-5", "step-1"]
    assert (foreign / "keep").read_text() == "mine"


# ---------------------------------------------------------------- two gloo ranks
WORLD = 2


class Position:
    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def build():
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(32, 8))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-2), "loader": Position()}


def worker(rank: int, root: str, out: str, engine: str) -> None:
    join_group(rank, WORLD, Path(out, "group.port"))
    try:
        app = build()
        torch.manual_seed(100 + rank)
        with Checkpointer(root, signals=(), engine=engine, compression="zstd+shuffle") as ckpt:
            for _ in range(3):
                loss = app["model"](torch.randn(8, 32)).square().mean()
                app["optim"].zero_grad()
                loss.backward()
                app["optim"].step()
                app["loader"].consumed += 8 * (rank + 1)
            ckpt.save(3, app, blocking=True)
        want = {"consumed": app["loader"].consumed, "draw": torch.rand(4).tolist(),
                "state": [t.flatten().tolist() for t in tensors_of(app)]}
        fresh = build()
        torch.manual_seed(999)
        with Checkpointer(root, signals=()) as ckpt:
            step = ckpt.restore_latest(fresh).step
        got = {"consumed": fresh["loader"].consumed, "draw": torch.rand(4).tolist(),
               "state": [t.flatten().tolist() for t in tensors_of(fresh)]}
        Path(out, f"rank{rank}.json").write_text(json.dumps({"step": step, "want": want, "got": got}))
    finally:
        dist.destroy_process_group()


def tensors_of(app) -> list[torch.Tensor]:
    out = list(app["model"].state_dict().values())
    for s in app["optim"].state_dict()["state"].values():
        out += [s[k] for k in sorted(s)]
    return out


def engines_worker(rank: int, base: str) -> None:
    """``worker`` for each engine in turn (a fresh group each), into ``base/ENGINE``."""
    for engine in ENGINE_NAMES:
        worker(rank, str(Path(base, engine, "ck")), str(Path(base, engine)), engine)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    """One spawn of 2 ranks running ``worker`` for every engine: the directory holding each engine's run."""
    base = tmp_path_factory.mktemp("two-ranks")
    for engine in ENGINE_NAMES:
        (base / engine).mkdir()
    start_ranks(engines_worker, (str(base),), WORLD)
    return base


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_two_ranks_compress_and_restore_exactly(two_rank_runs, engine_name):
    tmp_path = two_rank_runs / engine_name
    root = tmp_path / "ck"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert res["step"] == 3 and res["got"] == res["want"], r
        assert len(res["want"]["state"]) >= 5  # weight, bias, Adam step/exp_avg/exp_avg_sq
    assert results[0]["got"]["consumed"] == 24 and results[1]["got"]["consumed"] == 48
    commit = scan.read_commit(root / "step-3")
    assert commit.compression == "zstd+shuffle" and commit.progress.world_size == WORLD
    assert all(f.endswith(".zst") for f in commit.files), sorted(commit.files)
    assert catalog.verify(root) == [] and entries(root) == ["step-3"]
