"""Token datasets mix only where their ids mean the same tokens: every dataset ``fastio convert`` tokenizes (plain,
chat, image-text) records the sha256 of the tokenizer file it was given (``tokens.tokenizer_sha256``,
``image_text.tokenizer_sha256``), and a ``fastio.Mixture`` refuses sources whose records differ, naming both
sources and both checksums; an image-text dataset converted before the record is known by its
``convert_options.image_text``. A source without any record (``fastio index``ed shards, a token dataset converted
before fastio recorded it) mixes as before; one whose recorded vocabulary size differs from another's is mixed with
a warning (logged). Sources of one file ending documents with other ids are refused by the Loader, naming both.
``fastio inspect`` prints the checksum; a damaged one is refused naming the field."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import ImageTextInfo, load_manifest
from fastio.errors import DatasetError
from tests.helpers import run_cli
from tests.tokens_helpers import chat_dataset, image_text_source, word_corpus

SEQ = 191


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One tokenizer file (the image-text source's: the chat tokenizer and ``<image>``) tokenizing an image-text,
    a chat and a plain dataset; and a plain dataset of another tokenizer (its own, 300 ids)."""
    root = tmp_path_factory.mktemp("mix-tokenizers")
    (root / "src").mkdir()
    src = image_text_source(root / "src", n=8)
    vlm = root / "vlm"
    convert_image_text(ConvertConfig(src["source"], vlm, workers=1), ImageTextOptions(src["tokenizer"], src["config"]))
    (root / "chat").mkdir()
    shutil.copy(src["tokenizer"], root / "chat" / "tokenizer.json")
    (root / "plain").mkdir()
    (root / "other").mkdir()
    return {"tokenizer": src["tokenizer"], "vlm": vlm, "chat": chat_dataset(root / "chat", n=20),
            "plain": word_corpus(root / "plain", src["tokenizer"]), "other": word_corpus(root / "other")}


def test_each_conversion_records_the_sha256_of_the_tokenizer_file_it_was_given(data):
    want = _sha(data["tokenizer"])
    plain, chat, vlm = (load_manifest(data[k]) for k in ("plain", "chat", "vlm"))
    assert plain.tokens.tokenizer_sha256 == chat.tokens.tokenizer_sha256 == vlm.image_text.tokenizer_sha256 == want
    assert plain.tokenizer_sha256 == chat.tokenizer_sha256 == vlm.tokenizer_sha256 == want
    other = load_manifest(data["other"])
    assert other.tokenizer_sha256 == _sha(data["other"].parent / "tokenizer.json") != want


def test_plain_chat_and_image_text_datasets_of_one_tokenizer_file_mix(data):
    mix = fastio.Mixture({"vlm": data["vlm"], "chat": data["chat"], "plain": data["plain"]})
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8, dtype="uint8", crop_ratio=1.0), seq_len=SEQ,
                            image_seq_len=12, window=16)
    with fastio.Loader(mix, pipeline=pipe, batch_size=4, device="cpu", num_threads=1) as ld:
        sources = {s for batch in ld for s in batch["source"].tolist()}
    assert sources == {0, 1, 2}
    tokens = fastio.Tokens(seq_len=SEQ, packing="best-fit", window=16)
    with fastio.Loader(fastio.Mixture({"chat": data["chat"], "plain": data["plain"]}), pipeline=tokens,
                       batch_size=4, device="cpu") as ld:
        assert next(iter(ld))["tokens"].shape == (4, SEQ + 1)


@pytest.mark.parametrize("first", ["plain", "chat", "vlm"])
def test_datasets_of_different_tokenizers_are_refused_naming_both(data, first):
    mine, theirs = _sha(data["tokenizer"])[:12], _sha(data["other"].parent / "tokenizer.json")[:12]
    expected = (rf"mixture sources {first!r} \({re.escape(str(data[first]))}, tokenizer sha256 {mine}\S*\) and "
                rf"'other' \({re.escape(str(data['other']))}, tokenizer sha256 {theirs}\S*\) were tokenized with "
                "different tokenizers")
    with pytest.raises(ValueError, match=expected) as err:
        fastio.Mixture({first: data[first], "other": data["other"]})
    assert isinstance(err.value, DatasetError)  # the CLI's one line (below)


def test_the_cli_refuses_a_mixture_file_of_different_tokenizers_in_one_line(data, tmp_path, capsys):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": {"plain": str(data["plain"]), "other": str(data["other"])}}))
    code, out, err = run_cli(["inspect", str(mix), "--seq-len", "16"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"fastio: error: {mix}: mixture sources 'plain'") and "different tokenizers" in err


def test_datasets_of_one_tokenizer_ending_documents_with_other_ids_are_refused_naming_both(data, tmp_path):
    plain = data["plain"]
    convert_tokens(TokenConvertConfig(plain.parent / "c.jsonl", tmp_path / "turns", data["tokenizer"],
                                      eos="<|im_end|>", workers=1))
    ids = load_manifest(plain).tokens.eos_id, load_manifest(tmp_path / "turns").tokens.eos_id
    assert ids[0] != ids[1]
    mix = fastio.Mixture({"plain": plain, "turns": tmp_path / "turns"})  # one tokenizer file: made
    with pytest.raises(DatasetError, match=rf"sources 'plain' \(end-of-document id {ids[0]}\) and 'turns' "
                                           rf"\({ids[1]}\) end documents with different ids"):
        fastio.Loader(mix, pipeline=fastio.Tokens(seq_len=16), batch_size=4, device="cpu")


def _without_record(dest: Path, to: Path) -> Path:
    """A copy of token dataset ``dest`` whose manifest lacks ``tokens.tokenizer_sha256`` (a dataset converted
    before fastio recorded it)."""
    shutil.copytree(dest, to)
    data = json.loads((to / "manifest.json").read_text())
    del data["tokens"]["tokenizer_sha256"]
    (to / "manifest.json").write_text(json.dumps(data))
    return to


def test_a_dataset_without_the_record_mixes_as_before(data, tmp_path, caplog):
    eos = load_manifest(data["other"]).tokens.eos_id
    index_tokens(TokenIndexConfig(data["other"] / "shards", eos_id=eos, dest=tmp_path / "indexed"))
    assert load_manifest(tmp_path / "indexed").tokenizer_sha256 is None
    with caplog.at_level(logging.WARNING, logger="fastio"):
        mix = fastio.Mixture({"plain": data["plain"], "indexed": tmp_path / "indexed"})
    assert not caplog.records  # no vocabulary recorded: nothing to compare, not a word
    with fastio.Loader(mix, pipeline=fastio.Tokens(seq_len=16), batch_size=4, device="cpu") as ld:
        assert next(iter(ld))["tokens"].shape == (4, 17)


def test_a_dataset_without_the_record_and_of_another_vocabulary_size_mixes_with_a_warning(data, tmp_path, caplog):
    old = _without_record(data["other"], tmp_path / "old")
    sizes = load_manifest(data["plain"]).tokens.vocab_size, load_manifest(old).tokens.vocab_size
    assert sizes[0] != sizes[1]
    with caplog.at_level(logging.WARNING, logger="fastio"):
        mix = fastio.Mixture({"plain": data["plain"], "old": old})
    assert mix.names == ("plain", "old")
    assert len(caplog.records) == 1 and re.match(
        rf"fastio: mixture sources 'plain' \(.*{sizes[0]} ids\) and 'old' \(.*{sizes[1]} ids\) record different "
        "vocabulary sizes", caplog.records[0].getMessage())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastio"):
        fastio.Mixture({"chat": data["chat"], "old": _without_record(data["plain"], tmp_path / "old-plain")})
    assert not caplog.records  # the same vocabulary size: nothing to say


def test_an_image_text_dataset_converted_before_the_record_is_known_by_its_convert_options(data, tmp_path):
    old = tmp_path / "old-vlm"
    shutil.copytree(data["vlm"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["image_text"]["tokenizer_sha256"]  # what an image-text conversion wrote before it was recorded
    (old / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_manifest(old)
    assert loaded.image_text.tokenizer_sha256 is None
    assert loaded.tokenizer_sha256 == _sha(data["tokenizer"])  # convert_options.image_text: (size, sha256)
    fastio.Mixture({"old": old, "plain": data["plain"]})
    with pytest.raises(ValueError, match=r"mixture sources 'old' .* and 'other' .* different tokenizers"):
        fastio.Mixture({"old": old, "other": data["other"]})


def test_a_damaged_tokenizer_sha256_is_refused_naming_the_field(data, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(data["plain"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["tokens"]["tokenizer_sha256"] = "abc"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"manifest\.json: tokens\.tokenizer_sha256: 'abc' is not a hex sha256"):
        load_manifest(bad)
    code, _, err = run_cli(["verify", str(bad)], capsys)
    assert code == 2 and "tokens.tokenizer_sha256: 'abc' is not a hex sha256" in err and err.count("\n") == 1
    with pytest.raises(DatasetError, match=r"image_text\.tokenizer_sha256: 5 is not a hex sha256"):
        ImageTextInfo.from_dict({"vocab_size": 4, "tokenizer_sha256": 5}, "image_text")


def test_parts_join_the_record_of_one_tokenizer_and_refuse_two():
    a, b = "a" * 64, "b" * 64
    assert ImageTextInfo(401, 300, a).joined(ImageTextInfo(401, 350, a)) == ImageTextInfo(401, 350, a)
    with pytest.raises(ValueError, match=f"image_text.tokenizer_sha256: {b} where another part records {a}"):
        ImageTextInfo(401, 300, a).joined(ImageTextInfo(401, 350, b))
    assert ImageTextInfo(401, 300, a).joined(ImageTextInfo(401, 350)).tokenizer_sha256 is None  # not known for all


def test_inspect_prints_the_tokenizer_sha256(data, capsys):
    want = _sha(data["tokenizer"])
    for name in ("plain", "vlm"):
        code, out, _ = run_cli(["inspect", str(data[name])], capsys)
        assert code == 0 and f"tokenizer sha256 {want[:12]}" in out, out
        code, out, _ = run_cli(["inspect", str(data[name]), "--json"], capsys)
        info = json.loads(out)
        assert (info.get("tokens") or info.get("image_text"))["tokenizer_sha256"] == want
