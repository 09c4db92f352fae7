"""The manifest's token fields: written by make_manifest, validated on read, one DatasetError naming the field."""

from __future__ import annotations

import json

import pytest

from fastio.dataset.manifest import ShardRecord, TokenInfo, load_manifest, make_manifest, write_manifest
from fastio.errors import DatasetError

SHA = "a" * 64


SHARDS = [ShardRecord(name="t-000000.bin", samples=2, bytes=20, sha256=SHA, idx_sha256=SHA, tokens=10),
          ShardRecord(name="t-000001.bin", samples=1, bytes=8, sha256=SHA, idx_sha256=SHA, tokens=4)]
INFO = TokenInfo(dtype="uint16", eos_id=0, total_tokens=14, vocab_size=300)


def token_manifest(**changes):
    """A token manifest's JSON object with ``changes``."""
    m = make_manifest(name="t", shards=SHARDS, fields=[], kind="tokens", tokens=INFO)
    data = m.as_dict()
    data.update(changes)
    return data


def test_round_trip(tmp_path):
    write_manifest(tmp_path, make_manifest(name="t", shards=SHARDS, fields=[], kind="tokens", tokens=INFO))
    m = load_manifest(tmp_path)
    assert m.kind == "tokens" and m.format_version == 3
    assert m.tokens == TokenInfo(dtype="uint16", eos_id=0, total_tokens=14, vocab_size=300)
    assert "one_sequence_per_document" not in json.loads((tmp_path / "manifest.json").read_text())["tokens"]
    one = TokenInfo(dtype="uint16", eos_id=0, total_tokens=14, one_sequence_per_document=True)
    write_manifest(tmp_path, make_manifest(name="t", shards=SHARDS, fields=[], kind="tokens", tokens=one))
    assert load_manifest(tmp_path).tokens == one
    assert [(s.name, s.idx_name, s.tokens) for s in m.shards] == [("t-000000.bin", "t-000000.idx", 10),
                                                                  ("t-000001.bin", "t-000001.idx", 4)]


def test_the_largest_id_is_written_only_where_recorded_and_sizes_the_embedding(tmp_path):
    indexed = TokenInfo(dtype="uint16", eos_id=0, total_tokens=14, max_id=299)
    write_manifest(tmp_path, make_manifest(name="t", shards=SHARDS, fields=[], kind="tokens", tokens=indexed))
    assert json.loads((tmp_path / "manifest.json").read_text())["tokens"]["max_id"] == 299
    assert load_manifest(tmp_path).tokens == indexed and indexed.embedding_size == 300
    assert "max_id" not in INFO.as_dict() and INFO.embedding_size == 300  # the vocabulary where known
    assert TokenInfo(dtype="uint16", eos_id=0, total_tokens=14).embedding_size is None


@pytest.mark.parametrize("change,message", [
    ({"tokens": {"dtype": "float32", "eos_id": 0, "total_tokens": 14}}, r"tokens\.dtype: 'float32' is not one of"),
    ({"tokens": {"dtype": "uint16", "eos_id": 70000, "total_tokens": 14}}, r"tokens\.eos_id: 70000 does not fit uint16"),
    ({"tokens": {"dtype": "uint16", "eos_id": 0, "total_tokens": 15}}, r"total_tokens does not equal the sum"),
    ({"tokens": {"dtype": "uint16", "eos_id": 300, "total_tokens": 14, "vocab_size": 300}},
     r"tokens\.vocab_size: 300 does not include eos_id 300"),
    ({"tokens": None}, r"tokens: is null, not an object"),
    ({"tokens": {"dtype": "uint16", "eos_id": 0, "total_tokens": 14, "one_sequence_per_document": 1}},
     r"tokens\.one_sequence_per_document: 1 is not true or false"),
    ({"kind": "video"}, r"kind: 'video' is not one of samples, tokens"),
    ({"kind": "samples"}, r"t-000000\.bin is not a \.tar shard, as a dataset of samples has"),
    ({"format_version": 2}, r"kind 'tokens' needs format_version 3"),
    ({"tokens": {"dtype": "uint16", "eos_id": 5, "total_tokens": 14, "max_id": 4}},
     r"tokens\.max_id: 4 is below eos_id 5, which ends every document"),
    ({"tokens": {"dtype": "uint16", "eos_id": 0, "total_tokens": 14, "max_id": 300, "vocab_size": 300}},
     r"tokens\.max_id: 300 is outside the vocabulary of 300 ids"),
    ({"tokens": {"dtype": "uint16", "eos_id": 0, "total_tokens": 14, "max_id": 70000}},
     r"tokens\.max_id: 70000 does not fit uint16"),
    ({"tokens": {"dtype": "uint16", "eos_id": 0, "total_tokens": 14, "max_id": "9"}},
     r"tokens\.max_id: '9' is not an integer"),
])
def test_validated_on_read(tmp_path, change, message):
    (tmp_path / "manifest.json").write_text(json.dumps(token_manifest(**change)))
    with pytest.raises(DatasetError, match=message):
        load_manifest(tmp_path)


def test_shard_records_are_checked(tmp_path):
    m = token_manifest()
    m["shards"][1]["tokens"] = -1
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=r"shards\[1\]\.tokens: -1 is negative"):
        load_manifest(tmp_path)
    m = token_manifest()
    del m["shards"][0]["tokens"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=r"shards\[0\] lacks tokens"):
        load_manifest(tmp_path)
    m = token_manifest()
    m["shards"][0]["name"] = "t-000000.tar"
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=r"t-000000\.tar is not a \.bin shard, as a dataset of tokens has"):
        load_manifest(tmp_path)
