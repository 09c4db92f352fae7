"""The shard writer and the reading side of a DEST: write a tiny dataset, read it back."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, Manifest, fingerprint
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError
from fastio.formats.dali_idx import parse_index
from fastio.formats.wds import sanitize_key

WDS2IDX = Path(sys.executable).with_name("wds2idx")


def _samples(n: int, size: int = 700) -> list[dict]:
    return [{"__key__": f"k/{i:04d}", "bin": bytes([i % 251]) * (size + 600 * i), "cls": str(i % 3).encode()}
            for i in range(n)]


def _write(dest: Path, samples, **kw) -> Manifest:
    writer = ShardWriter(dest, **kw)
    for s in samples:
        writer.write(s)
    return writer.close(label_field="cls")


def test_round_trip_counts_checksums_and_index(tmp_path):
    manifest = _write(tmp_path / "ds", _samples(10), max_samples=4)
    assert [s.samples for s in manifest.shards] == [4, 4, 2]
    ds = Dataset(tmp_path / "ds")
    assert len(ds) == 10 and ds.fields == ["bin", "cls"]
    assert ds.table.keys == [f"k/{i:04d}" for i in range(10)]
    for i in (0, 5, 9):
        shard = ds.shards[ds.table.shard[i]]
        with open(shard.path, "rb") as f:
            f.seek(ds.table.offsets["bin"][i])
            assert f.read(ds.table.sizes["bin"][i]) == _samples(10)[i]["bin"]
    with tarfile.open(ds.shards[0].path) as tf:
        members = tf.getmembers()
    assert [m.name for m in members[:2]] == ["k/0000.bin", "k/0000.cls"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o444)}


@pytest.mark.skipif(not WDS2IDX.exists(), reason="wds2idx comes with DALI")
def test_index_is_byte_equal_to_wds2idx(tmp_path):
    _write(tmp_path / "ds", _samples(9), max_samples=5)
    for shard in Dataset(tmp_path / "ds").shards:
        ref = tmp_path / "ref.idx"
        subprocess.run([str(WDS2IDX), str(shard.path), str(ref)], check=True, capture_output=True)
        assert ref.read_bytes() == shard.idx_path.read_bytes()


def test_size_limit_starts_new_shards_and_output_is_reproducible(tmp_path):
    a = _write(tmp_path / "a", _samples(12), max_bytes=30000)
    b = _write(tmp_path / "b", _samples(12), max_bytes=30000)
    assert len(a.shards) > 2 and all(s.bytes <= 30000 for s in a.shards)
    assert (tmp_path / "a" / MANIFEST_NAME).read_bytes() == (tmp_path / "b" / MANIFEST_NAME).read_bytes()
    assert fingerprint(a.shards) == fingerprint(b.shards) == a.fingerprint


def test_nothing_but_hidden_temporaries_before_publish(tmp_path):
    writer = ShardWriter(tmp_path / "ds", max_samples=100)
    for s in _samples(3):
        writer.write(s)
    visible = [p.name for p in (tmp_path / "ds" / "shards").iterdir() if not p.name.startswith(".")]
    assert visible == [] and not (tmp_path / "ds" / MANIFEST_NAME).exists()
    writer.abort()
    assert list((tmp_path / "ds" / "shards").iterdir()) == []


def test_context_manager_aborts_on_error_and_closes_otherwise(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path / "bad", max_samples=2) as writer:
            for s in _samples(3):
                writer.write(s)
            raise RuntimeError("boom")
    # the first shard was complete and published; the open one is dropped; no manifest
    assert sorted(p.name for p in (tmp_path / "bad" / "shards").iterdir()) == ["shard-000000.idx", "shard-000000.tar"]
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    with ShardWriter(tmp_path / "good", max_samples=2) as writer:
        for s in _samples(3):
            writer.write(s)
    assert len(Dataset(tmp_path / "good")) == 3 and writer.manifest.total_samples == 3
    with pytest.raises(ValueError, match="closed"):
        writer.write(_samples(4)[3])


def test_close_refuses_a_manifest_readers_would_reject(tmp_path):
    writer = ShardWriter(tmp_path, max_samples=2)
    writer.write(_samples(1)[0])
    with pytest.raises(ValueError, match=r"label_map: \{'a': 'x'\} is not an object of class name to integer"):
        writer.close(label_map={"a": "x"})
    assert not (tmp_path / MANIFEST_NAME).exists()


@pytest.mark.parametrize("sample, words", [
    ({"__key__": "a.b", "x": b"1"}, "not a safe"),
    ({"__key__": "ok", "x": "text"}, "not bytes"),
    ({"__key__": "ok"}, "no fields"),
    ({"__key__": "ok", "x y": b"1"}, "field name"),
])
def test_bad_samples_are_rejected_by_name(tmp_path, sample, words):
    with pytest.raises(ValueError, match=words):
        ShardWriter(tmp_path).write(sample)


def test_duplicate_key_is_rejected(tmp_path):
    writer = ShardWriter(tmp_path)
    writer.write({"__key__": "a", "x": b"1"})
    with pytest.raises(ValueError, match="duplicate sample key 'a'"):
        writer.write({"__key__": "a", "x": b"2"})


def test_sanitize_key():
    assert sanitize_key("cat/img.001 (copy)") == "cat/img_001__copy_"
    long = sanitize_key("x" * 200)
    assert len(long) <= 80 and long != sanitize_key("x" * 199)


def test_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset directory"):
        Dataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="an empty folder, not a dataset"):
        Dataset(tmp_path / "empty")
    _write(tmp_path / "ds", _samples(6), max_samples=3)
    (tmp_path / "ds" / "shards" / "shard-000001.tar").unlink()
    with pytest.raises(DatasetError, match="shard file shard-000001.tar is missing"):
        Dataset(tmp_path / "ds")
    manifest_path = tmp_path / "ds" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    assert manifest["format_version"] == 1  # nothing of version 2 needed: older fastio reads converted datasets
    manifest["format_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="format_version 99, this fastio reads 1, 2"):
        Dataset(tmp_path / "ds")


def test_index_parse_errors_name_the_file():
    with pytest.raises(ValueError, match="x.idx: header says 2 samples"):
        parse_index("v1.2 2\nbin 512 3 a.bin\n", source="x.idx")
    with pytest.raises(ValueError, match="not a v1.2"):
        parse_index("v9 1\n", source="x.idx")
