"""``fastio verify`` reads each image-text sample's ``tokens.i32`` and names, with the shard and key, the first id
that is negative, outside the manifest's ``image_text.vocab_size`` or above its ``image_text.max_id`` (a model sized
from ``embedding_size`` would crash on it, or read the wrong embedding row); a manifest without the record gets the
negative check only. The damaged shards keep their ``.idx``, ``samples.fxi`` and manifest checksums consistent, so
the id is the only problem (docs/image-text.md#check-parts-merge)."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest
from fastio.errors import DatasetError
from fastio.formats.image_text import TOKENS_FIELD
from fastio.progress import count
from fastio.report.verify import verify
from fastio.storage import open_storage
from fastio.storage.checksum import digests_file
from tests.helpers import run_cli
from tests.tokens_helpers import image_text_source

SHARD = "shard-000001.tar"
"""The shard the tests damage (of two: four samples, then two)."""


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-ids")
    src = image_text_source(root, n=6)
    convert_image_text(ConvertConfig(src["source"], root / "ds", workers=1, max_samples_per_shard=4),
                       ImageTextOptions(src["tokenizer"], src["config"]))
    return root / "ds"


@pytest.fixture
def dataset(converted, tmp_path) -> Path:
    """A copy of the converted dataset (the tests damage it)."""
    return Path(shutil.copytree(converted, tmp_path / "ds"))


def _put_ids(dest: Path, key: str, ids: dict[int, int]) -> None:
    """Write token ``ids`` (position -> id) into sample ``key``'s ``tokens.i32`` in :data:`SHARD`, in place (the
    member's size, the ``.idx`` and ``samples.fxi`` unchanged), and record the shard's new checksums in the
    manifest, as a consistent dataset would have them."""
    path = dest / "shards" / SHARD
    with tarfile.open(path) as tar:
        member = tar.getmember(f"{key}.{TOKENS_FIELD}")
    assert max(ids) < member.size // 4
    with path.open("r+b") as f:
        for position, value in ids.items():
            f.seek(member.offset_data + 4 * position)
            f.write(np.int32(value).astype("<i4").tobytes())
    manifest = json.loads((dest / "manifest.json").read_text())
    record = next(s for s in manifest["shards"] if s["name"] == SHARD)
    size, digests = digests_file(path, ("sha256", "xxh3_128"))
    assert size == record["bytes"]
    record.update(digests)
    (dest / "manifest.json").write_text(json.dumps(manifest))


def _drop_record(dest: Path, *keys: str) -> None:
    """Remove ``keys`` of the manifest's ``image_text`` entry (none given: the entry), as a dataset converted before
    fastio recorded them."""
    manifest = json.loads((dest / "manifest.json").read_text())
    for key in keys:
        del manifest["image_text"][key]
    if not keys:
        del manifest["image_text"]
    (dest / "manifest.json").write_text(json.dumps(manifest))


def _lines(dest: Path | str, capsys) -> list[str]:
    """``fastio verify DEST``'s problem lines (asserting exit 1, a one-line summary and no traceback)."""
    code, out, err = run_cli(["verify", str(dest)], capsys)
    lines = out.splitlines()
    assert code == 1 and "Traceback" not in out + err, out + err
    assert err.strip() == f"fastio: verify: {count(len(lines), 'problem')} in {dest}", err
    return lines


def test_a_converted_dataset_verifies_clean(converted, capsys):
    assert verify(converted).ok
    code, out, err = run_cli(["verify", str(converted)], capsys)
    assert code == 0 and out.strip() == f"ok: {converted}: 2 shards, 6 samples verified", out + err


def test_an_id_equal_to_the_vocabulary_size_is_named_with_shard_key_and_vocabulary(dataset, capsys):
    vocab = load_manifest(dataset).image_text.vocab_size
    _put_ids(dataset, "00000005", {2: vocab, 4: -1})  # the first bad id is the one named
    line = f"{SHARD}: 00000005: {TOKENS_FIELD} holds token id {vocab}, outside the vocabulary of {vocab} ids"
    assert _lines(dataset, capsys) == [line]
    assert [p.line() for p in verify(dataset).problems] == [line]


def test_a_negative_id_is_named(dataset, capsys):
    _put_ids(dataset, "00000004", {0: -7})
    assert _lines(dataset, capsys) == [
        f"{SHARD}: 00000004: {TOKENS_FIELD} holds token id -7: token ids are never negative (a damaged shard)"]


def test_an_id_inside_the_vocabulary_but_above_the_recorded_largest_is_named(dataset, capsys):
    info = load_manifest(dataset).image_text
    assert info.max_id + 1 < info.vocab_size
    _put_ids(dataset, "00000004", {1: info.max_id + 1})
    _put_ids(dataset, "00000005", {3: info.max_id})  # the largest recorded: fine
    assert _lines(dataset, capsys) == [
        f"{SHARD}: 00000004: {TOKENS_FIELD} holds token id {info.max_id + 1}, above the largest the manifest records "
        f"({info.max_id})"]


def test_a_manifest_without_the_record_is_checked_for_negative_ids_only(dataset, capsys):
    vocab = load_manifest(dataset).image_text.vocab_size
    _drop_record(dataset)
    _put_ids(dataset, "00000004", {1: vocab + 1000})  # nothing recorded to hold it against
    _put_ids(dataset, "00000005", {3: -2})
    assert load_manifest(dataset).image_text is None
    assert _lines(dataset, capsys) == [
        f"{SHARD}: 00000005: {TOKENS_FIELD} holds token id -2: token ids are never negative (a damaged shard)"]


def test_a_record_of_the_vocabulary_alone_holds_the_ids_to_it(dataset, capsys):
    info = load_manifest(dataset).image_text
    _drop_record(dataset, "max_id")  # as where no sample held a token
    _put_ids(dataset, "00000004", {1: info.max_id + 1})  # inside the vocabulary: nothing recorded to hold it against
    _put_ids(dataset, "00000005", {0: info.vocab_size + 1})
    assert load_manifest(dataset).image_text.max_id is None
    assert _lines(dataset, capsys) == [f"{SHARD}: 00000005: {TOKENS_FIELD} holds token id {info.vocab_size + 1}, "
                                       f"outside the vocabulary of {info.vocab_size} ids"]


def test_an_s3_dest_names_the_same_id(dataset, capsys, aws_env, s3_bucket):
    vocab = load_manifest(dataset).image_text.vocab_size
    _put_ids(dataset, "00000005", {0: vocab + 3})
    store = open_storage(f"s3://{s3_bucket}/vlm")
    for path in sorted(p for p in dataset.rglob("*") if p.is_file() and not p.name.startswith(".")):
        store.put_file(path.relative_to(dataset).as_posix(), path)
    assert _lines(f"s3://{s3_bucket}/vlm", capsys) == [
        f"{SHARD}: 00000005: {TOKENS_FIELD} holds token id {vocab + 3}, outside the vocabulary of {vocab} ids"]


def test_an_image_token_without_its_image_is_named_as_the_loader_names_it(dataset, capsys):
    image_id = load_manifest(dataset).convert_options["image_text"]["image_token_id"]
    _put_ids(dataset, "00000004", {1: image_id})  # sample 4 holds no image: its samples.fxi plans none
    assert _lines(dataset, capsys) == [
        f"{SHARD}: 00000004: {TOKENS_FIELD} holds 1 image token (id {image_id}) but the sample has 0 images"]
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=1023, image_seq_len=4)
    with fastio.Loader(dataset, pipeline=pipe, batch_size=1, device="cpu") as loader, pytest.raises(
            DatasetError, match=r"key '00000004': 1 image token \(id \d+\) but a different number of image members: "
                                r".*run fastio verify$"):
        list(loader)
