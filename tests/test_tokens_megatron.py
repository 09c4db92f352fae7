"""The Megatron .bin/.idx format: fastio's writer and reader against megatron-core's, both ways, and hostile pairs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fastio.errors import DatasetError
from fastio.formats.megatron import MegatronIndex, MegatronShard, MegatronWriter, token_dtype

DOCS = [np.array([5, 6, 7, 0]), np.array([1, 0]), np.array([9, 9, 9, 9, 9, 0]), np.array([0])]


def _indexed_dataset():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                  reason="megatron-core is installed by make install (pip install --no-deps)")
    return idx


def _write(path, docs, dtype="uint16"):
    w = MegatronWriter(path, dtype)
    for d in docs:
        w.add(d)
    return w.close()


def test_token_dtype_follows_megatron():
    assert token_dtype(50257) == "uint16"
    assert token_dtype(65499) == "uint16"
    assert token_dtype(65500) == "int32"
    assert token_dtype(128256) == "int32"
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_megatron_core_reads_fastio_shards(tmp_path, dtype):
    idx = _indexed_dataset()
    written = _write(tmp_path / "s.bin", DOCS, dtype)
    assert (written.documents, written.tokens) == (4, 13)
    ds = idx.IndexedDataset(str(tmp_path / "s"))
    assert len(ds) == 4 and ds.index.dtype == np.dtype(dtype)
    assert list(ds.document_indices) == [0, 1, 2, 3, 4]
    for j, d in enumerate(DOCS):
        assert ds[j].tolist() == d.tolist()
    assert ds.get(2, offset=1, length=3).tolist() == [9, 9, 9]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_fastio_reads_megatron_core_shards(tmp_path, dtype):
    import torch

    idx = _indexed_dataset()
    builder = idx.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for d in DOCS:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = _write(tmp_path / "f.bin", DOCS, np.dtype(dtype).name)
    assert (tmp_path / "m.idx").read_bytes() == ours.idx_path.read_bytes()  # byte-equal to megatron-core's
    assert (tmp_path / "m.bin").read_bytes() == ours.bin_path.read_bytes()
    shard = MegatronShard(tmp_path / "m.bin")
    shard.index.check_structure()
    assert shard.documents == 4 and shard.dtype == np.dtype(dtype).name
    assert [shard.document(j).tolist() for j in range(4)] == [d.tolist() for d in DOCS]
    assert shard.index.starts(np.arange(5)).tolist() == [0, 4, 6, 12, 13]


def test_megatron_documents_of_several_sequences(tmp_path):
    """A Megatron document may hold several sequences (sentence splitting): fastio reads it as one document."""
    import torch

    idx = _indexed_dataset()
    builder = idx.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.add_item(torch.tensor([1, 2]))
    builder.add_item(torch.tensor([3, 0]))
    builder.end_document()
    builder.add_item(torch.tensor([4, 0]))
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    shard = MegatronShard(tmp_path / "m.idx")
    assert shard.documents == 2
    assert shard.document(0).tolist() == [1, 2, 3, 0] and shard.document(1).tolist() == [4, 0]


def test_writer_refuses_ids_that_do_not_fit(tmp_path):
    w = MegatronWriter(tmp_path / "s.bin", "uint16")
    with pytest.raises(ValueError, match="70000"):
        w.add(np.array([1, 70000]))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_nothing_visible_before_close(tmp_path):
    w = MegatronWriter(tmp_path / "s.bin", "uint16")
    w.add(np.array([1, 2]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".s.bin.tmp"]
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]


def test_truncated_bin_is_named(tmp_path):
    _write(tmp_path / "s.bin", DOCS)
    with open(tmp_path / "s.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DatasetError, match=r"s\.bin: 10 bytes, but s\.idx indexes 26 .*truncated"):
        MegatronShard(tmp_path / "s.bin")


def test_idx_of_another_dtype_is_named(tmp_path):
    _write(tmp_path / "s.bin", DOCS, "uint16")
    _write(tmp_path / "t.bin", DOCS, "int32")
    (tmp_path / "s.idx").write_bytes((tmp_path / "t.idx").read_bytes())
    with pytest.raises(DatasetError, match=r"s\.bin: 26 bytes, but s\.idx indexes 52 .*another token type"):
        MegatronShard(tmp_path / "s.bin")
    with pytest.raises(DatasetError, match=r"t\.idx: holds int32 tokens, expected uint16"):
        MegatronShard(tmp_path / "t.bin", dtype="uint16")


def test_bad_magic_short_idx_and_missing_partners(tmp_path):
    written = _write(tmp_path / "s.bin", DOCS)
    good = written.idx_path.read_bytes()
    written.idx_path.write_bytes(b"XXXXXXX" + good[7:])
    with pytest.raises(DatasetError, match=r"s\.idx: not a Megatron \.idx"):
        MegatronShard(tmp_path / "s.bin")
    written.idx_path.write_bytes(good[:-8])
    with pytest.raises(DatasetError, match=r"s\.idx: .* bytes, its header .*truncated"):
        MegatronShard(tmp_path / "s.bin")
    written.idx_path.write_bytes(good[:9] + bytes([2]) + good[10:])  # version 2
    with pytest.raises(DatasetError, match=r"s\.idx: Megatron \.idx version"):
        MegatronIndex(written.idx_path)
    written.idx_path.unlink()
    with pytest.raises(DatasetError, match=r"s\.idx: no such Megatron \.idx file \(the partner of s\.bin\)"):
        MegatronShard(tmp_path / "s.bin")
    _write(tmp_path / "u.bin", DOCS)
    (tmp_path / "u.bin").unlink()
    with pytest.raises(DatasetError, match=r"u\.bin: no such Megatron \.bin file \(the partner of u\.idx\)"):
        MegatronShard(tmp_path / "u.idx")


def test_float_idx_is_refused(tmp_path):
    written = _write(tmp_path / "s.bin", DOCS)
    data = bytearray(written.idx_path.read_bytes())
    data[17] = 7  # float32
    written.idx_path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"s\.idx: token type float32 is not one fastio reads"):
        MegatronIndex(written.idx_path)


def test_check_structure_names_a_bad_pointer(tmp_path):
    written = _write(tmp_path / "s.bin", DOCS)
    data = bytearray(written.idx_path.read_bytes())
    at = 34 + 4 * 4 + 8 * 1  # the second pointer
    data[at:at + 8] = (7).to_bytes(8, "little")
    written.idx_path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"s\.idx: sequence 1's pointer 7"):
        MegatronIndex(written.idx_path).check_structure()


def test_sparse_starts_read_with_pread_agree_with_the_mapping(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 100, int(rng.integers(0, 9))) for _ in range(5000)]
    written = _write(tmp_path / "s.bin", docs)
    index = MegatronIndex(written.idx_path)
    few = np.array([0, 7, 4999, 5000, 1234])  # 5 of 5000: read entry by entry
    dense = index.starts(np.arange(5001))
    assert index.starts(few).tolist() == dense[few].tolist()
    assert dense[-1] == written.tokens and np.diff(dense).tolist() == [d.size for d in docs]


def test_a_block_of_documents_is_looked_up_in_one_read_per_column(tmp_path, monkeypatch):
    import os

    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 100, int(rng.integers(1, 9))) for _ in range(5000)]
    index = MegatronIndex(_write(tmp_path / "s.bin", docs).idx_path)
    dense = index.starts(np.arange(5001))
    block = 3000 + rng.permutation(8)  # a packing block's documents, shuffled: 8 of 5000, looked up sparsely
    calls, pread = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: calls.append(n) or pread(fd, n, at))
    assert index.starts(block).tolist() == dense[block].tolist()
    assert len(calls) == 2  # the span of doc_index, then of pointers: not one read per document (16)
    calls.clear()
    edges = np.array([0, 4096, 4999, 5000, 17])  # far apart: entry by entry
    assert index.starts(edges).tolist() == dense[edges].tolist() and len(calls) == 2 * 5 - 1  # 5000: no pointer


def test_one_per_document_skips_doc_index_reads(tmp_path, monkeypatch):
    """With the manifest's one_sequence_per_document, a document's start is one read (its pointer), not two."""
    import os

    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 100, int(rng.integers(1, 9))) for _ in range(5000)]
    path = _write(tmp_path / "s.bin", docs).idx_path
    dense = MegatronIndex(path).starts(np.arange(5001))
    index = MegatronIndex(path, one_per_document=True)
    assert index.is_one_per_document()
    index.check_structure()
    calls, pread = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: calls.append(n) or pread(fd, n, at))
    edges = np.array([0, 4096, 4999, 5000, 17])
    assert index.starts(edges).tolist() == dense[edges].tolist() and len(calls) == 4  # 5000: the end, no read
    assert index.starts(np.arange(5001)).tolist() == dense.tolist()


def test_one_per_document_claim_is_checked(tmp_path):
    """A manifest's one-sequence-per-document claim that the .idx breaks is refused naming the file: a count
    that disagrees at open, a doc_index that is not 0, 1, ..., N in check_structure (fastio verify)."""
    import struct

    from fastio.formats.megatron import HEADER_BYTES, MAGIC

    # 2 documents of 2 sequences: document 0 has none, document 1 both (doc_index 0, 0, 2)
    lengths, pointers = np.array([2, 2], "<i4"), np.array([0, 4], "<i8")
    (tmp_path / "m.idx").write_bytes(MAGIC + struct.pack("<QBQQ", 1, 8, 2, 3) + lengths.tobytes()
                                     + pointers.tobytes() + np.array([0, 0, 2], "<i8").tobytes())
    (tmp_path / "m.bin").write_bytes(bytes(8))
    assert len((tmp_path / "m.idx").read_bytes()) == HEADER_BYTES + 2 * 12 + 3 * 8
    shard = MegatronShard(tmp_path / "m.bin")
    assert shard.document(1).tolist() == [0, 0, 0, 0] and not shard.index.is_one_per_document()
    claimed = MegatronIndex(tmp_path / "m.idx", one_per_document=True)
    with pytest.raises(DatasetError, match=r"m\.idx: a document spans several sequences, and its manifest says one"):
        claimed.check_structure()
    w = MegatronWriter(tmp_path / "three.bin", "uint16")
    for d in DOCS[:3]:
        w.add(d)
    w.close()
    raw = bytearray((tmp_path / "three.idx").read_bytes())
    raw[26:34] = (3).to_bytes(8, "little")  # 2 documents (3 entries) for 3 sequences
    (tmp_path / "three.idx").write_bytes(bytes(raw[:HEADER_BYTES + 3 * 12 + 3 * 8]))
    assert MegatronIndex(tmp_path / "three.idx").documents == 2
    with pytest.raises(DatasetError, match=r"three\.idx: 3 sequences for 2 documents, and its manifest says one"):
        MegatronIndex(tmp_path / "three.idx", one_per_document=True)


def test_an_old_megatron_index_and_a_cut_header_are_named_as_such(tmp_path):
    # Found by review: Megatron's older 'lazy'/'cached' indexed format (magic TNTIDX, what preprocess_data.py wrote
    # with --dataset-impl lazy/cached) and an .idx cut inside its 34-byte header were both 'no MMIDIDX header':
    # the one says nothing of the fix (make the pairs again as mmap), the other has that header's magic.
    written = _write(tmp_path / "s.bin", DOCS)
    good = written.idx_path.read_bytes()
    written.idx_path.write_bytes(b"TNTIDX\x00\x00" + (1).to_bytes(8, "little") + bytes(32))
    with pytest.raises(DatasetError, match=r"s\.idx: Megatron's older lazy/cached index format \(TNTIDX\), not the "
                                           r"mmap one \(MMIDIDX\).*--dataset-impl mmap"):
        MegatronShard(tmp_path / "s.bin")
    written.idx_path.write_bytes(good[:20])
    with pytest.raises(DatasetError, match=r"s\.idx: 20 bytes, cut inside the 34-byte header of a Megatron \.idx: "
                                           r"truncated"):
        MegatronShard(tmp_path / "s.bin")


@pytest.mark.parametrize("one_per_document", [False, True])
def test_an_idx_cut_short_after_it_was_opened_is_named_not_read_as_zeros(tmp_path, one_per_document):
    """An .idx cut short while an index holds it mapped (a Loader's, for its life): a lookup of document starts is
    refused naming the file and both sizes; it read zeros from the mapping's last page (every document starting at
    token 0: other tokens, silently), or died with SIGBUS past it."""
    _write(tmp_path / "s.bin", DOCS)
    index = MegatronIndex(tmp_path / "s.idx", one_per_document=one_per_document)
    want = index.starts(np.arange(len(DOCS) + 1)).tolist()
    full = (tmp_path / "s.idx").stat().st_size
    with open(tmp_path / "s.idx", "r+b") as f:
        f.truncate(34)
    with pytest.raises(DatasetError, match=rf"s\.idx: 34 bytes, {full} when it was opened: cut short"):
        index.starts(np.arange(len(DOCS) + 1))
    assert want == [0, 4, 6, 12, 13]  # what it read before the cut
