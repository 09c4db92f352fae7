"""The consolidated sample index: written by the shard writer, recorded in the manifest, the only thing
besides the manifest a Dataset reads at open; old datasets without it still open; verify checks it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fastio import ImageTrain, Loader
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, IndexRecord, ShardRecord, load_manifest
from fastio.dataset.sample_table import INDEX_NAME, SampleIndex, build_index
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError
from fastio.formats.dali_idx import IndexEntry, parse_index
from fastio.report.verify import verify
from fastio.storage.checksum import digest_file


def _rows_from_idx(dest):
    """Every sample's (shard, key, {field: (offset, size)}, span) straight from the .idx text files."""
    out = []
    ds = Dataset(dest)
    for s, shard in enumerate(ds.shards):
        for entry in parse_index(shard.idx_path.read_text()):
            out.append((s, entry.key, {ext: (o, n) for ext, o, n in entry.members}, entry.span))
    return out


def _ragged(dest, **kw):
    """Samples of 1..3 fields (some lack a field), sizes 0..3000 bytes, 4 shards."""
    rng = np.random.default_rng(1)
    with ShardWriter(dest, max_samples=7, **kw) as w:
        for i in range(25):
            sample = {"__key__": f"k{i:03d}", "bin": rng.bytes(int(rng.integers(0, 3000)))}
            if i % 3:
                sample["txt"] = b"x" * (i % 5)
            if i % 4 == 0:
                sample["cls"] = str(i % 10).encode()
            w.write(sample)
    return dest


def test_writer_publishes_the_index_and_records_it_in_the_manifest(tmp_path):
    dest = _ragged(tmp_path / "ds")
    manifest = load_manifest(dest)
    path = dest / INDEX_NAME
    assert manifest.index == IndexRecord(name=INDEX_NAME, bytes=path.stat().st_size,
                                         sha256=__import__("hashlib").sha256(path.read_bytes()).hexdigest(),
                                         xxh3_128=digest_file(path, "xxh3_128")[1])
    assert not [p for p in dest.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert verify(dest).ok


def test_locate_gives_every_field_of_every_sample_as_the_idx_files_do(tmp_path):
    dest = _ragged(tmp_path / "ds")
    ds = Dataset(dest)
    rows = ds.locate(np.arange(len(ds)))
    assert ds.index.derived  # fastio's own tars: offsets follow from the sizes
    for i, (shard, key, members, span) in enumerate(_rows_from_idx(dest)):
        assert rows.shard[i] == shard and ds.key(i) == key and ds.shard_of(i) is ds.shards[shard]
        assert (rows.span_offset[i], rows.span_size[i]) == span
        for f in ds.fields:
            assert (rows.offsets[f][i], rows.sizes[f][i]) == members.get(f, (-1, -1)), (i, f)
    # A batch in any order and with repeats: the same rows.
    pick = np.array([24, 0, 7, 7, 13])
    sub = ds.locate(pick)
    assert np.array_equal(sub.offsets["bin"], rows.offsets["bin"][pick]) and np.array_equal(sub.shard, rows.shard[pick])
    with pytest.raises(IndexError, match="out of range"):
        ds.locate(np.array([25]))


def test_a_dataset_opens_and_loads_from_manifest_and_index_without_reading_any_idx(image_dataset):
    ref = Loader(image_dataset, batch_size=8, pipeline=ImageTrain(size=32), device="cpu", world_size=1, rank=0,
                 num_threads=1)
    want = [b["image"] for b in ref]
    ref.close()
    for idx in (image_dataset / "shards").glob("*.idx"):
        idx.chmod(0o644)
        idx.write_text("garbage that no parser accepts\n")  # same names: only the content is gone
    ds = Dataset(image_dataset)
    loader = Loader(ds, batch_size=8, pipeline=ImageTrain(size=32), device="cpu", world_size=1, rank=0, num_threads=1)
    got = [b["image"] for b in loader]
    loader.close()
    assert len(got) == len(want) and all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(want, got))
    with pytest.raises(DatasetError, match="shard-000001.idx"):  # keys come from the .idx, on demand
        ds.key(20)


def test_a_dataset_without_the_index_still_opens_from_its_idx_files(tmp_path):
    dest = _ragged(tmp_path / "ds")
    new = Dataset(dest)
    want_rows, want_keys = new.locate(np.arange(len(new))), new.table.keys
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    del manifest["index"]
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    os.unlink(dest / INDEX_NAME)
    old = Dataset(dest)
    rows = old.locate(np.arange(len(old)))
    assert old.table.keys == want_keys and [old.key(i) for i in range(len(old))] == want_keys
    for f in old.fields:
        assert np.array_equal(rows.offsets[f], want_rows.offsets[f]) and np.array_equal(rows.sizes[f], want_rows.sizes[f])
    assert np.array_equal(rows.span_size, want_rows.span_size)
    assert verify(dest).ok


def _record(name, samples):
    return ShardRecord(name=name, samples=samples, bytes=10240, sha256="0" * 64, idx_sha256="0" * 64)


def test_build_index_stores_offsets_that_do_not_follow_the_fastio_layout(tmp_path):
    # What another tar writer may produce: fields out of order, gaps between members, a 5 GiB shard.
    shards = [
        (_record("a.tar", 2), [IndexEntry("x", (("txt", 512, 3), ("jpg", 2048, 100))),
                               IndexEntry("y", (("jpg", 4096, 10),))]),
        (_record("b.tar", 1), [IndexEntry("z", (("jpg", 5 * 2**30, 7), ("txt", 5 * 2**30 + 1024, 1)))]),
    ]
    record = build_index(tmp_path / INDEX_NAME, shards, ["jpg", "txt"])
    assert record.bytes == (tmp_path / INDEX_NAME).stat().st_size
    index = SampleIndex.open(tmp_path / INDEX_NAME, [2, 1], ["txt", "jpg"], record, verify=True)
    assert not index.derived
    rows = index.locate(np.array([0, 1, 2]))
    assert rows.shard.tolist() == [0, 0, 1]
    assert rows.offsets["jpg"].tolist() == [2048, 4096, 5 * 2**30] and rows.sizes["jpg"].tolist() == [100, 10, 7]
    assert rows.offsets["txt"].tolist() == [512, -1, 5 * 2**30 + 1024] and rows.sizes["txt"].tolist() == [3, -1, 1]
    assert rows.span_offset.tolist() == [512, 4096, 5 * 2**30] and rows.span_size.tolist() == [1636, 10, 1025]
    with pytest.raises(ValueError, match="shard a.tar: index lists 2 samples, record says 3"):
        build_index(tmp_path / "other", [(_record("a.tar", 3), shards[0][1])], ["jpg", "txt"])
    with pytest.raises(ValueError, match="field.*txt.*that fields does not list"):
        build_index(tmp_path / "other", shards, ["jpg"])
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".*.tmp"))


def test_the_index_costs_a_few_bytes_a_sample(tmp_path):
    dest = tmp_path / "ds"
    with ShardWriter(dest, max_samples=1000) as w:
        for i in range(5000):
            w.write({"__key__": f"sample{i:07d}", "jpg": b"j" * (70000 + i), "cls": str(i % 1000).encode()})
    ds = Dataset(dest)
    # span_offset uint32 + jpg size uint32 + cls size uint8 (keys and shards are not stored)
    assert ds.index.nbytes == 5000 * 9
    assert (dest / INDEX_NAME).stat().st_size < 5000 * 9 + 1024
    assert ds.locate(np.array([4999])).sizes["jpg"][0] == 74999 and ds.key(4999) == "sample0004999"


def test_a_damaged_index_is_refused_naming_the_file(tmp_path):
    dest = _ragged(tmp_path / "ds")
    path = dest / INDEX_NAME
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(DatasetError, match=rf"{INDEX_NAME}: sample index is {len(data) - 8} bytes, the manifest "
                                           rf"says {len(data)}"):
        Dataset(dest)
    assert [p.line() for p in verify(dest).problems] == [
        f"{INDEX_NAME}: size {len(data) - 8} bytes, manifest says {len(data)}",
        f"{INDEX_NAME}: sha256 does not match the manifest",
        f"{INDEX_NAME}: xxh3_128 does not match the manifest",
        f"{INDEX_NAME}: does not match the index rebuilt from the shards' .idx files"]
    path.write_bytes(b"NOTANIDX" + data[8:])
    with pytest.raises(DatasetError, match="not a fastio sample index"):
        Dataset(dest)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(DatasetError, match="sample index xxh3_128 does not match the manifest"):
        Dataset(dest)  # the header and size check out; the content is checked on every open
    with pytest.raises(DatasetError, match="sample index sha256 does not match the manifest"):
        Dataset(dest, verify=True)
    path.unlink()
    with pytest.raises(DatasetError, match=f"{INDEX_NAME}: sample index cannot be read"):
        Dataset(dest)
    assert [p.line() for p in verify(dest).problems] == [f"{INDEX_NAME}: is missing"]


def test_an_index_of_another_dataset_is_refused(tmp_path):
    a, b = _ragged(tmp_path / "a"), tmp_path / "b"
    with ShardWriter(b, max_samples=5) as w:
        for i in range(25):
            w.write({"__key__": f"k{i:03d}", "bin": b"1", "txt": b"2", "cls": b"3"})
    manifest = json.loads((a / MANIFEST_NAME).read_text())
    manifest["index"] = json.loads((b / MANIFEST_NAME).read_text())["index"]
    (a / MANIFEST_NAME).write_text(json.dumps(manifest))
    (a / INDEX_NAME).write_bytes((b / INDEX_NAME).read_bytes())
    with pytest.raises(DatasetError, match="lists 25 samples in 5 shards, the manifest 25 in 4"):
        Dataset(a)


@pytest.mark.parametrize("entry,match", [
    ("nope", "index: is str 'nope', not an object"),
    ({"name": "x", "bytes": 1}, "index lacks sha256"),
    ({"name": "../x", "bytes": 1, "sha256": "0" * 64}, "index.name: '../x' is not an index file name"),
    ({"name": "x", "bytes": -1, "sha256": "0" * 64}, "index.bytes: -1 is negative"),
    ({"name": "x", "bytes": 1, "sha256": "zz"}, "index.sha256: 'zz' is not a hex sha256"),
])
def test_a_bad_index_record_in_the_manifest_is_named(tmp_path, entry, match):
    dest = _ragged(tmp_path / "ds")
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    manifest["index"] = entry
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=match):
        Dataset(dest)


def test_index_record_round_trips():
    record = IndexRecord(name=INDEX_NAME, bytes=3, sha256="a" * 64)
    assert IndexRecord.from_dict(record.as_dict(), "index") == record


def test_columns_give_the_same_index_as_parsed_entries(tmp_path):
    """What a merge of converted parts can do: pass each shard's columns instead of re-parsing text."""
    from fastio.dataset.sample_table import IndexBuilder

    dest = _ragged(tmp_path / "ds")
    ds = Dataset(dest)
    by_entries, by_columns, mixed = IndexBuilder(), IndexBuilder(), IndexBuilder()
    odd = _record("odd.tar", 1), [IndexEntry("q", (("txt", 512, 1), ("bin", 1536, 2)))]  # not fastio's order
    for shard in ds.shards:
        rows = ds.locate(np.arange(shard.first, shard.first + shard.samples))
        by_entries.add(shard, ds.read_index(shard))
        by_columns.add_columns(shard, rows.span_offset, rows.sizes)
        mixed.add_columns(shard, rows.span_offset, rows.sizes)
    mixed.add(*odd)
    assert by_columns.to_bytes(ds.fields) == by_entries.to_bytes(ds.fields) == (dest / INDEX_NAME).read_bytes()
    index = SampleIndex.from_bytes(mixed.to_bytes(ds.fields), "mixed", [s.samples for s in ds.shards] + [1],
                                   ds.fields)
    assert not index.derived
    want = ds.locate(np.arange(len(ds)))
    got = index.locate(np.arange(len(ds) + 1))
    for f in ds.fields:  # the offsets of the fastio-layout shards were derived and stored
        assert np.array_equal(got.offsets[f][:-1], want.offsets[f]) and np.array_equal(got.sizes[f][:-1], want.sizes[f])
    assert got.offsets["bin"][-1] == 1536 and got.offsets["txt"][-1] == 512 and got.offsets["cls"][-1] == -1
    with pytest.raises(ValueError, match="columns of 2 samples, record says 7"):
        IndexBuilder().add_columns(ds.shards[0], np.zeros(2), {"bin": np.zeros(2)})
