"""The O(N) checks of a token shard (.idx structure, fastio index's scan, fastio verify's documents) run a chunk of
entries at a time: a fault in a later chunk is named exactly as one pass over the whole shard names it, and peak
memory stays a few chunks' worth whatever the shard's size."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from fastio.cli import main
from fastio.convert import token_index
from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import TokenInfo
from fastio.errors import DatasetError
from fastio.formats import megatron
from fastio.formats.megatron import HEADER_BYTES, MegatronIndex, MegatronShard, MegatronWriter
from fastio.report import verify

N = 3000  # documents: several chunks of 256 (or 300: not aligned with the starts table's 1024)


def write_pair(path, n=N, dtype="uint16", seed=0):
    """``n`` documents of 1..5 tokens, each ending with the end-of-document id 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, n)
    tokens = rng.integers(1, 100, int(lengths.sum()))
    tokens[np.cumsum(lengths) - 1] = 0
    w = MegatronWriter(path, dtype)
    w.add_documents(tokens, lengths)
    return w.close(), lengths


def patch_idx(path, column, at, value):
    """Overwrite entry ``at`` of ``column`` (lengths, pointers, doc_index) of the .idx at ``path``."""
    n = MegatronIndex(path).sequences
    offset, size = {"lengths": (HEADER_BYTES, 4), "pointers": (HEADER_BYTES + 4 * n, 8),
                    "doc_index": (HEADER_BYTES + 12 * n, 8)}[column]
    data = bytearray(path.read_bytes())
    data[offset + size * at:offset + size * (at + 1)] = int(value).to_bytes(size, "little", signed=True)
    path.write_bytes(bytes(data))


def structure_error(path, one_per_document=False):
    with pytest.raises(DatasetError) as err:
        MegatronIndex(path, one_per_document=one_per_document).check_structure()
    return str(err.value)


@pytest.mark.parametrize("damage,names", [
    ([("pointers", 2500, 7)], "sequence 2500's pointer 7 is not the end"),
    ([("pointers", 100, 7), ("lengths", 2900, -3)], "sequence 2900 has a negative length"),  # negatives first
    ([("doc_index", 512, 510)], "document indices do not run from 0 up to the 3000 sequences"),  # across a boundary
    ([("doc_index", 2600, 2601)], "a document spans several sequences"),
])
def test_structure_fault_in_a_later_chunk_is_named_as_in_one_pass(tmp_path, monkeypatch, damage, names):
    written, _ = write_pair(tmp_path / "s.bin")
    for column, at, value in damage:
        patch_idx(written.idx_path, column, at, value)
    one = damage[0][0] == "doc_index" and damage[0][2] == 2601
    whole = structure_error(written.idx_path, one)  # one chunk: the whole shard in one pass
    monkeypatch.setattr(megatron, "CHECK_CHUNK", 256)
    assert structure_error(written.idx_path, one) == whole
    assert whole.startswith(f"{written.idx_path}: ") and names in whole and "\n" not in whole


def test_index_names_a_later_chunks_bad_document_as_in_one_pass(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    written, lengths = write_pair(data / "s.bin")
    raw = np.fromfile(written.bin_path, np.uint16)
    raw[int(lengths[:2501].sum()) - 1] = 7  # document 2500 ends with 7
    raw.tofile(written.bin_path)
    with pytest.raises(DatasetError) as whole:
        index_tokens(TokenIndexConfig(data, 0))
    monkeypatch.setattr(megatron, "CHECK_CHUNK", 256)
    monkeypatch.setattr(token_index, "_RANGE", 512)  # the .bin in many ranges, documents across their edges
    with pytest.raises(DatasetError) as chunked:
        index_tokens(TokenIndexConfig(data, 0))
    assert str(chunked.value) == str(whole.value) == (f"{data / 's.bin'}: document 2500 ends with token 7, not eos_id "
                                                     "0 (documents are taken as they are: each must end with its "
                                                     "end-of-document token; Megatron's preprocess_data.py appends "
                                                     "it only with --append-eod: made without it, make the pairs "
                                                     "again with it)")


def test_index_names_the_document_of_a_negative_id_in_a_later_chunk(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    written, lengths = write_pair(data / "s.bin", dtype="int32")
    raw = np.fromfile(written.bin_path, np.int32)
    raw[int(lengths[:2700].sum())] = -5  # document 2700's first token
    raw.tofile(written.bin_path)
    monkeypatch.setattr(megatron, "CHECK_CHUNK", 256)
    monkeypatch.setattr(token_index, "_RANGE", 512)
    with pytest.raises(DatasetError, match=r"s\.bin: document 2700 holds token id -5: token ids are never negative"):
        index_tokens(TokenIndexConfig(data, 0))


def run(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_verify_checks_documents_chunk_by_chunk(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    written, lengths = write_pair(data / "s.bin")
    assert run(capsys, "index", data, "--eos-id", 0)[0] == 0
    monkeypatch.setattr(megatron, "CHECK_CHUNK", 300)  # chunks not aligned with the starts table's entries
    rc, out = run(capsys, "verify", data)
    assert rc == 0, out
    raw = np.fromfile(written.bin_path, np.uint16)
    raw[int(lengths[:2501].sum()) - 1] = 7
    raw.tofile(written.bin_path)
    rc, out = run(capsys, "verify", data)
    assert rc == 1 and "document 2500 does not end with the end-of-document id 0" in out
    assert "disagree" not in out


def test_peak_memory_of_the_checks_is_a_few_chunks_whatever_the_shard(tmp_path, monkeypatch):
    n, chunk = 1 << 17, 1 << 12
    w = MegatronWriter(tmp_path / "s.bin", "uint16")
    w.add_documents(np.zeros(n, np.uint16), np.ones(n, np.int64))  # n documents of one token: the eos id
    written = w.close()
    monkeypatch.setattr(megatron, "CHECK_CHUNK", chunk)
    pair = MegatronShard(written.bin_path, one_per_document=False)
    info = TokenInfo(dtype="uint16", eos_id=0, total_tokens=n)
    ends = token_index._LastTokens(pair.index, 0)
    raw = written.bin_path.read_bytes()
    tracemalloc.start()
    try:
        pair.index.check_structure()
        assert pair.index.is_one_per_document()
        assert verify._document_problems(pair, info, None, verify.VerifyReport(tmp_path)) == []
        for start in range(0, len(raw), 1 << 14):
            ends.see(start, np.frombuffer(raw[start:start + (1 << 14)], np.uint16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ends.wrong is None and not ends._at.size
    assert peak < 12 * 8 * chunk, peak  # a dozen int64 chunks; one pass over the shard takes several times n * 8


def mapped_kb(path) -> int:
    """Resident KB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range, perms, ..., path
            inside = line.rstrip().endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_resident_pages_of_the_mapped_files_are_dropped_chunk_by_chunk(tmp_path, monkeypatch):
    n = 1 << 21  # 4 MB of .bin, 40 MB of .idx (documents of one token)
    w = MegatronWriter(tmp_path / "s.bin", "uint16")
    w.add_documents(np.zeros(n, np.uint16), np.ones(n, np.int64))
    written = w.close()
    monkeypatch.setattr(megatron, "CHECK_CHUNK", 1 << 16)
    pair = MegatronShard(written.bin_path)
    pair.index.check_structure()
    assert pair.index.is_one_per_document()
    assert verify._document_problems(pair, TokenInfo(dtype="uint16", eos_id=0, total_tokens=n), None,
                                      verify.VerifyReport(tmp_path)) == []
    # one pass each, every page read; what stays resident is at most the last chunk's (512 KB of each column)
    assert mapped_kb(written.idx_path) < 4096 and mapped_kb(written.bin_path) < 1024
