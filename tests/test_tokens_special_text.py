"""Special tokens and a token conversion: a special-token string in document text is encoded as plain text (or
refused with ``special_in_text="refuse"``), so the end-of-document id never appears inside a document; ``--eos``
must be one of the tokenizer's special tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli
from tokens_helpers import CORPUS, train_tokenizer

from fastio.convert.token_convert import TokenConvertConfig, convert_tokens, load_tokenizer
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError
from fastio.formats.megatron import MegatronShard
from fastio.report.verify import verify

EOS, PAD = "<|endoftext|>", "<|pad|>"
TEXTS = ["the quick brown fox", f"alpha {EOS} beta", "a stream of tokens", f"x{PAD}y{EOS}", EOS, "",
         f"héllo {EOS}{EOS} wörld"]
HOLDING = 4  # the documents of TEXTS with a special-token string


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", specials=(PAD,), vocab_size=600,
                           texts=[*CORPUS, "alpha beta gamma"] * 8)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def documents(dest):
    m = load_manifest(dest)
    return [MegatronShard(dest / "shards" / s.name).document(j).tolist() for s in m.shards for j in range(s.samples)]


@pytest.mark.parametrize("workers", [1, 2])
def test_special_token_strings_in_text_are_plain_text_and_counted(tmp_path, tokenizer, capsys, workers):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS * 3)
    code, out, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer),
                              "--workers", str(workers), "--max-samples-per-shard", "4"], capsys)
    assert code == 0, err
    tok = load_tokenizer(tokenizer)
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    docs = documents(tmp_path / "ds")
    assert len(docs) == 3 * (len(TEXTS) - 1)
    for doc, text in zip(docs, [t for t in TEXTS * 3 if t]):
        assert doc[-1] == eos and eos not in doc[:-1] and pad not in doc, (text, doc)
        assert tok.decode(doc[:-1]) == text  # the special-token string is there, as text
    flat = np.concatenate([np.asarray(d) for d in docs])
    assert int((flat == eos).sum()) == len(docs)  # position_ids and cu_seqlens: one boundary per document
    assert verify(tmp_path / "ds").ok
    assert f"{3 * HOLDING} documents with special-token text encoded as plain text" in out, out
    m = load_manifest(tmp_path / "ds")
    assert m.tokens.eos_id == eos and m.converted_from["special_text_documents"] == 3 * HOLDING
    assert m.convert_options["special_in_text"] == "plain"


def test_refuse_names_the_document_and_leaves_nothing(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    with pytest.raises(ConvertError, match=r"c\.jsonl:2: field 'text' holds the special token '<\|endoftext\|>' "
                                           r"\(special_in_text='refuse'"):
        convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1, special_in_text="refuse"))
    assert not (tmp_path / "ds").exists()
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer), "--workers",
                            "2", "--special-in-text", "refuse"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "c.jsonl:2: field 'text' holds the special token '<|endoftext|>' (--special-in-text refuse" in err, err
    assert not (tmp_path / "ds").exists()
    clean = write_jsonl(tmp_path / "clean.jsonl", [t for t in TEXTS if EOS not in t and PAD not in t])
    result = convert_tokens(TokenConvertConfig(clean, tmp_path / "ok", tokenizer, workers=1,
                                               special_in_text="refuse"))
    assert result.documents == 2 and result.special_text == 0
    with pytest.raises(ValueError, match=r"special_in_text must be 'plain' or 'refuse', got 'drop'"):
        TokenConvertConfig(clean, tmp_path / "x", tokenizer, special_in_text="drop")


def test_eos_must_be_a_special_token(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", ["alpha beta", "gamma alpha"])
    tok = load_tokenizer(tokenizer)
    assert tok.token_to_id("alpha") is not None  # an ordinary word of the vocabulary
    with pytest.raises(ConvertError, match=r"tokenizer\.json: 'alpha' is not a special token \(eos='alpha'\); its "
                                           r"special tokens: <\|endoftext\|>, <\|pad\|>"):
        convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1, eos="alpha"))
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer),
                            "--eos", "alpha"], capsys)
    assert code == 2 and err.count("\n") == 1 and "'alpha' is not a special token (--eos alpha)" in err, err
    assert not (tmp_path / "ds").exists()
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer),
                            "--workers", "1", "--eos", PAD], capsys)
    assert code == 0, err
    assert load_manifest(tmp_path / "ds").tokens.eos_id == tok.token_to_id(PAD)
    assert all(d.count(tok.token_to_id(PAD)) == 1 for d in documents(tmp_path / "ds"))
