"""The commit marker as a typed record (fastio.checkpoint.record): one progress record, older markers still read."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from fastio.checkpoint import Checkpointer, catalog, naming, scan
from fastio.checkpoint.record import (
    CHECKSUM,
    COMMIT_FORMAT,
    COMMIT_VERSION,
    COMPRESSED_VERSION,
    CommitInfo,
    CommitRecord,
    Progress,
    parse_commit,
)
from fastio.errors import CheckpointError

BEFORE = Path(__file__).parent / "fixtures" / "checkpoint_before_records"
"""A step written by fastio before the typed record (tests/fixtures/make_checkpoint_before_records.py): its
progress is in the marker and in the engine's per-rank ``_fastio_progress`` record."""


class Loader:
    def __init__(self):
        self.epoch, self.consumed = 0, 0

    def state_dict(self):
        return {"version": 1, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def fresh_app() -> dict:
    torch.manual_seed(123)
    return {"model": nn.Linear(2, 2), "loader": Loader()}


def old_checkpoint(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(BEFORE, root)
    return root


def test_a_checkpoint_written_before_the_typed_record_restores(tmp_path):
    root = old_checkpoint(tmp_path)
    app = fresh_app()
    state = Checkpointer(root, signals=()).restore_latest(app)
    assert (state.step, state.epoch, state.metrics, state.hparams) == (3, 1, {"loss": 0.25}, {"lr": 0.5})
    assert state.elapsed > 0 and state.time > 0 and state.path == root / "step-3"
    torch.manual_seed(0)
    saved = nn.Linear(2, 2)  # the model the fixture's writer saved
    assert all(torch.equal(a, b) for a, b in zip(app["model"].state_dict().values(), saved.state_dict().values()))
    assert (app["loader"].epoch, app["loader"].consumed) == (1, 12)
    assert catalog.verify(root) == []


def test_the_markers_progress_wins_over_an_old_progress_record(tmp_path):
    """Old checkpoints hold the progress twice; the restore reads the marker's only (the engine's per-rank record
    still says loss 0.25, epoch 1)."""
    root = old_checkpoint(tmp_path)
    marker = root / "step-3" / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({**data, "metrics": {"loss": 9.0}, "epoch": 4, "hparams": {"lr": 0.125},
                                  "elapsed": 77.0}))
    state = Checkpointer(root, signals=()).restore_latest(fresh_app())
    assert (state.epoch, state.metrics, state.hparams, state.elapsed) == (4, {"loss": 9.0}, {"lr": 0.125}, 77.0)


def test_a_save_writes_its_progress_once_into_the_marker(tmp_path):
    root = tmp_path / "ck"
    app = fresh_app()
    app["loader"].epoch = 2
    with Checkpointer(root, signals=(), hparams={"seed": 7}) as ckpt:
        ckpt.save(5, app, metrics={"loss": 1.5}, blocking=True)
    record = scan.read_commit(root / "step-5")
    assert record.progress.epoch == 2 and record.progress.metrics == {"loss": 1.5}
    assert record.progress.hparams == {"seed": 7} and record.progress.world_size == 1
    assert not any("_fastio_progress" in str(p) for p in (root / "step-5").rglob("*"))
    assert b"_fastio_progress" not in (root / "step-5" / ".snapshot_metadata").read_bytes()


def test_a_record_round_trips_through_its_bytes():
    info = CommitInfo(engine="dcp", progress=Progress(epoch=3, metrics={"loss": 0.5}, elapsed=1.25,
                                                      hparams={"lr": 0.1}, world_size=4), compression="zstd")
    record = CommitRecord.new({"a.pt": {"bytes": 4, CHECKSUM: "00"}}, step=9, info=info)
    assert record.version == COMPRESSED_VERSION and record.bytes == 4
    assert parse_commit(record.encode(), "m") == record
    plain = CommitRecord.new({}, step=1, info=CommitInfo(engine="torchsnapshot", progress=Progress()))
    assert plain.version == COMMIT_VERSION and "compression" not in json.loads(plain.encode())


def test_a_version_1_marker_reads_with_that_versions_meaning():
    """Version 1: sha256 per file, no ``checksum`` or ``engine`` field (torchsnapshot)."""
    text = json.dumps({"format": COMMIT_FORMAT, "version": 1, "step": 2, "time": 5.0, "bytes": 3,
                       "epoch": 0, "metrics": {}, "world_size": 2, "elapsed": 1.0, "hparams": {},
                       "files": {"x": {"bytes": 3, "sha256": "ab"}}}).encode()
    record = parse_commit(text, "m")
    assert (record.checksum, record.engine, record.compression, record.progress.world_size) == (
        "sha256", "torchsnapshot", None, 2)


@pytest.mark.parametrize(("field", "value"), [("engine", 5), ("epoch", "one"), ("metrics", [1]), ("step", True),
                                              ("world_size", 1.5), ("metrics", {"loss": "x"}),
                                              ("metrics", {"loss": True})])
def test_a_marker_field_of_the_wrong_type_is_one_error_naming_the_file_and_field(tmp_path, field, value):
    """A metric that is no number (a marker edited by hand) was read as is: `fastio ckpt ls` then failed with a
    raw `ValueError: Unknown format code 'g' for object of type 'str'`, and a restore handed it back as a metric."""
    good = CommitRecord.new({}, step=1, info=CommitInfo(engine="torchsnapshot", progress=Progress()))
    text = json.dumps({**json.loads(good.encode()), field: value}).encode()
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/m: commit marker (field '{field}'|lacks 'files' or 'step')"):
        parse_commit(text, f"{tmp_path}/m")


@pytest.mark.parametrize("rel", ["../step-1/fastio-commit.json", "/etc/hostname", "a/../../b", "", "a//b", "./a"])
def test_a_marker_listing_a_path_outside_its_step_is_one_error_naming_it(tmp_path, rel):
    """Before: a marker (edited by hand, or untrusted) could list `../step-1/...` or `/etc/hostname`: ckpt verify and a
    restore read (hashed) that file outside the step, and a restore of a compressed step wrote its decompressed copy
    to the same path under its working directory's parent. Now a listed path must be a plain relative path inside
    the step (as the writer lists them): anything else is one error naming the file and the path."""
    good = CommitRecord.new({"x": {"bytes": 1, CHECKSUM: "ab"}}, step=1,
                            info=CommitInfo(engine="torchsnapshot", progress=Progress()))
    data = json.loads(good.encode())
    data["files"][rel] = data["files"]["x"]
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/m: commit marker lists {re.escape(repr(rel))}, not a "
                                              r"relative path inside the step$"):
        parse_commit(json.dumps(data).encode(), f"{tmp_path}/m")


def test_a_marker_whose_files_do_not_add_up_to_its_total_is_one_error(tmp_path):
    """Before: a marker that lost a file's entry (edited by hand; `"files": {}` at worst) still parsed, and a
    restore loaded the step reading the unlisted files unchecked (ckpt verify said `not listed in the commit
    marker`, exit 1). Now the listed sizes must add up to the marker's own total (`bytes`, which every marker since
    version 2 holds): one error naming the file, and the step is unrecognised, so a restore falls back."""
    good = CommitRecord.new({"a": {"bytes": 3, CHECKSUM: "ab"}, "b": {"bytes": 4, CHECKSUM: "cd"}}, step=1,
                            info=CommitInfo(engine="torchsnapshot", progress=Progress()))
    data = json.loads(good.encode())
    assert parse_commit(json.dumps(data).encode(), "m").bytes == 7
    for files in ({"a": data["files"]["a"]}, {}):
        with pytest.raises(CheckpointError, match=rf"^{tmp_path}/m: commit marker lists {len(files)} files? of "
                                                  rf"{sum(f['bytes'] for f in files.values())} bytes, its total "
                                                  r"says 7 \(a file's entry lost\?\)$"):
            parse_commit(json.dumps({**data, "files": files}).encode(), f"{tmp_path}/m")
