"""An image-text dataset's manifest records its vocabulary (``image_text``: the tokenizer's size and the largest id
written), so a model sizes its token embedding from the dataset (``manifest.image_text.embedding_size``) as from a
token dataset's; a manifest written before it loads without it, one claiming too small a vocabulary is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.merge import merge
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError, DatasetError
from fastio.formats.image_text import TOKENS_FIELD
from fastio.storage.checksum import sha256_file
from tests.helpers import run_cli
from tests.tokens_helpers import image_text_source, stored_image_text, word_corpus


def _convert(src: dict, dest: Path, **config) -> None:
    convert_image_text(ConvertConfig(src["source"], dest, workers=1, **config),
                       ImageTextOptions(src["tokenizer"], src["config"]))


def _tokenizer_ids(tokenizer: Path) -> int:
    """The ids of ``tokenizer``: its largest (added tokens included) + 1, read from the file itself."""
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    added = [t["id"] for t in json.loads(tokenizer.read_text())["added_tokens"]]
    return max([*vocab.values(), *added]) + 1


def _largest_written(dest: Path) -> int:
    """The largest token id of the samples stored in ``dest``'s shards."""
    return max(int(np.frombuffer(s[TOKENS_FIELD], "<i4").max(initial=0)) for s in stored_image_text(dest))


def _edit(dest: Path, **image_text) -> Path:
    """Rewrite ``dest``'s manifest with its ``image_text`` entry updated (a key given None: removed)."""
    path = dest / "manifest.json"
    data = json.loads(path.read_text())
    entry = {**data.get("image_text", {}), **image_text}
    data["image_text"] = {k: v for k, v in entry.items() if v is not None}
    if not data["image_text"]:
        del data["image_text"]
    path.write_text(json.dumps(data))
    return path


def _copy(dest: Path, to: Path) -> Path:
    """A dataset at ``to`` whose manifest and sample table are copies of ``dest``'s (to be edited), its shards
    ``dest``'s."""
    to.mkdir()
    (to / "shards").symlink_to(dest / "shards")
    for name in ("manifest.json", "samples.fxi"):
        (to / name).write_bytes((dest / name).read_bytes())
    return to


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-vocab")
    src = image_text_source(root, n=10)
    _convert(src, root / "ds", max_samples_per_shard=4)
    return src, root / "ds"


def test_the_manifest_records_the_tokenizers_vocabulary_and_the_largest_id_written(converted):
    src, dest = converted
    info = load_manifest(dest).image_text
    vocab, largest = _tokenizer_ids(src["tokenizer"]), _largest_written(dest)
    assert largest < vocab
    assert (info.vocab_size, info.max_id, info.embedding_size) == (vocab, largest, vocab)


def test_each_split_records_the_largest_id_of_its_own_samples(tmp_path):
    src = image_text_source(tmp_path, n=16)
    _convert(src, tmp_path / "ds", split="val=0.25", seed=3)
    largest = {name: _largest_written(tmp_path / "ds" / name) for name in ("train", "val")}
    for name, want in largest.items():
        info = load_manifest(tmp_path / "ds" / name).image_text
        assert (info.vocab_size, info.max_id) == (_tokenizer_ids(src["tokenizer"]), want)


def test_parts_merge_to_the_largest_of_their_ids_and_refuse_parts_of_other_vocabularies(tmp_path):
    src = image_text_source(tmp_path, n=12)
    parts = [tmp_path / "merged" / ".parts" / f"part-{k}-of-3" for k in range(3)]
    for k in range(3):
        _convert(src, tmp_path / "merged", max_samples_per_shard=3, part=(k, 3))
    per_part = [load_manifest(p).image_text.max_id for p in parts]
    merge(tmp_path / "merged", keep_parts=True)
    info = load_manifest(tmp_path / "merged").image_text
    assert info.max_id == max(per_part) == _largest_written(tmp_path / "merged")
    assert info.vocab_size == _tokenizer_ids(src["tokenizer"])
    _edit(parts[2], vocab_size=info.vocab_size + 7)
    with pytest.raises(ConvertError, match=rf"part-2-of-3: .*image_text\.vocab_size: {info.vocab_size + 7}.*"
                                           rf"{info.vocab_size}"):
        merge(tmp_path / "merged", overwrite=True)


def test_a_manifest_written_before_the_record_loads_with_nothing_known(converted, tmp_path, capsys):
    old = _copy(converted[1], tmp_path / "old")
    _edit(old, vocab_size=None, max_id=None, tokenizer_sha256=None, total_tokens=None, trained_tokens=None)
    assert "image_text" not in json.loads((old / "manifest.json").read_text())
    assert load_manifest(old).image_text is None
    code, out, err = run_cli(["inspect", str(old)], capsys)
    assert code == 0, err
    assert "vocabulary: not recorded" in out


def test_a_vocabulary_smaller_than_an_id_it_holds_is_refused_naming_the_field(converted, tmp_path, capsys):
    dest = converted[1]
    bad = _copy(dest, tmp_path / "bad")
    largest = load_manifest(dest).image_text.max_id
    path = _edit(bad, vocab_size=largest)
    with pytest.raises(DatasetError, match=rf"^{path}: image_text\.max_id: {largest} is outside the vocabulary of "
                                           rf"{largest} ids$"):
        load_manifest(bad)
    code, out, err = run_cli(["inspect", str(bad)], capsys)
    assert code != 0 and err.count("\n") == 1 and "image_text.max_id" in err and "Traceback" not in err
    _edit(bad, vocab_size="many")
    with pytest.raises(DatasetError, match=r"image_text\.vocab_size: 'many'"):
        load_manifest(bad)


def test_inspect_shows_the_vocabulary_and_the_embedding_size(converted, capsys):
    src, dest = converted
    vocab, largest = _tokenizer_ids(src["tokenizer"]), _largest_written(dest)
    code, out, err = run_cli(["inspect", str(dest)], capsys)
    assert code == 0, err
    assert f"vocabulary: {vocab}, largest id {largest}; a token embedding of {vocab} rows" in out
    code, out, err = run_cli(["inspect", str(dest), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["image_text"] == {"vocab_size": vocab, "max_id": largest, "embedding_size": vocab,
                                             "tokenizer_sha256": sha256_file(src["tokenizer"])[1]}


def test_the_embedding_size_is_the_largest_id_plus_one_where_the_vocabulary_is_not_known(converted, tmp_path):
    _, dest = converted
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "manifest.json").write_bytes((dest / "manifest.json").read_bytes())
    _edit(copy, vocab_size=None)
    info = load_manifest(copy).image_text
    assert info.vocab_size is None and info.embedding_size == _largest_written(dest) + 1


def test_a_token_datasets_manifest_with_an_image_text_entry_is_refused_naming_it(tmp_path):
    dest = word_corpus(tmp_path)
    path = dest / "manifest.json"
    data = json.loads(path.read_text())
    data["image_text"] = {"vocab_size": data["tokens"]["vocab_size"]}
    path.write_text(json.dumps(data))
    with pytest.raises(DatasetError, match=rf"^{path}: image_text: a dataset of kind 'tokens' has no image-text "):
        load_manifest(dest)
