"""The records' and configs' rules are declared on their dataclass fields (``fastio.checks``), and every declared
field refused names itself and the offending value: the manifest's records, the commit marker, the conversion
configs."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from fastio.checkpoint.record import COMMIT_FORMAT, CommitRecord, Progress, parse_commit
from fastio.convert.run import ConvertConfig
from fastio.convert.token_convert import TokenConvertConfig
from fastio.convert.token_index import TokenIndexConfig
from fastio.convert.wds_index import IndexConfig
from fastio.dataset.manifest import ChatInfo, IndexRecord, ShardRecord, TokenInfo
from fastio.errors import CheckpointError, DatasetError
from fastio.formats.token_mask import MASK_FORMAT

SHARD = {"name": "s-000000.tar", "samples": 3, "bytes": 10, "sha256": "a" * 64, "idx_sha256": "b" * 64}
INDEX = {"name": "samples.fxi", "bytes": 10, "sha256": "c" * 64}
TOKENS = {"dtype": "uint16", "eos_id": 0, "total_tokens": 5}
CHAT = {"template_sha256": "d" * 64, "train_on": "all", "trained_tokens": 4, "longest": 9, "mask": MASK_FORMAT}
BAD = {"name": "../x.tar", "samples": -1, "bytes": "10", "sha256": "A" * 64, "idx_sha256": 7, "xxh3_128": "f" * 31,
       "location": "a/../b", "idx_location": "", "tokens": 1.5, "dtype": "int8", "eos_id": True, "total_tokens": -2,
       "vocab_size": "1", "one_sequence_per_document": "yes", "max_id": -3, "mask_sha256": "0" * 63,
       "template_sha256": None, "train_on": "assistant", "trained_tokens": "7", "longest": -1,
       "tokenizer_sha256": "g" * 64}


def checked_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if "check" in f.metadata}


@pytest.mark.parametrize("cls,entry,unchecked", [(ShardRecord, SHARD, set()), (IndexRecord, INDEX, set()),
                                                 (TokenInfo, TOKENS, {"starts", "chat"}),
                                                 (ChatInfo, CHAT, {"mask"})])
def test_a_manifest_record_names_each_declared_field_and_its_value(cls, entry, unchecked):
    fields = {f.name for f in dataclasses.fields(cls)}
    assert checked_names(cls) == fields - unchecked  # each field's rule on it (starts, chat: records of their own)
    for key in sorted(checked_names(cls)):
        bad = {**entry, key: BAD[key if key != "name" or cls is ShardRecord else "location"]}
        with pytest.raises(DatasetError) as err:
            cls.from_dict(bad, "M: shards[4]")
        assert str(err.value).startswith(f"M: shards[4].{key}: {bad[key]!r} "), str(err.value)
    assert cls.from_dict({**entry, **{k: None for k in fields - set(entry) if k != "one_sequence_per_document"}},
                         "M") == cls.from_dict(entry, "M")  # null where the default is None: absent


def marker(**fields) -> bytes:
    return json.dumps({"format": COMMIT_FORMAT, "version": 2, "step": 3, "files": {}, **fields}).encode()


def test_the_commit_marker_names_each_declared_field_and_its_value():
    assert checked_names(CommitRecord) == {"time", "time_utc", "checksum", "bytes", "engine", "compression", "optimizers"}
    assert checked_names(Progress) == {f.name for f in dataclasses.fields(Progress)}
    for key in sorted(checked_names(CommitRecord) | checked_names(Progress)):
        with pytest.raises(CheckpointError, match=rf"^F: commit marker field '{key}' is \[1\], expected "):
            parse_commit(marker(**{key: [1]}), "F")
    record = parse_commit(marker(time=5, elapsed=2, epoch=1, time_utc=None, compression=""), "F")
    assert (record.time, record.progress.elapsed, record.progress.epoch) == (5.0, 2.0, 1)
    assert type(record.time) is float and record.time_utc is None and record.compression is None


@pytest.mark.parametrize("make,key,value,message", [
    (lambda **kw: ConvertConfig("src", "dst", **kw), "quality", 0, "quality must be in 1..100, got 0"),
    (lambda **kw: ConvertConfig("src", "dst", **kw), "on_error", "stop", "on_error must be one of skip, fail, got 'stop'"),
    (lambda **kw: ConvertConfig("src", "dst", **kw), "max_pixels", True,
     "max_pixels must be positive (or None for no limit), got True"),
    (lambda **kw: TokenConvertConfig("src", "dst", "tok.json", **kw), "batch_size", 0,
     "batch_size must be a positive integer, got 0"),
    (lambda **kw: TokenConvertConfig("src", "dst", "tok.json", **kw), "text_field", "",
     "text_field must be a field name, got ''"),
    (lambda **kw: TokenIndexConfig("src", **{"eos_id": 0, **kw}), "eos_id", -1,
     "eos_id must be a token id (an integer >= 0), got -1"),
    (lambda **kw: IndexConfig("src", **kw), "threads", 0, "threads: must be a positive integer, got 0"),
    (lambda **kw: IndexConfig("src", **kw), "label_field", "a b", "label_field: must be a field name"),
])
def test_a_config_names_each_declared_field_and_its_value(make, key, value, message):
    config = make()
    assert key in checked_names(type(config))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make(**{key: value})
