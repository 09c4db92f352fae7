"""fastio convert --tokenizer: JSONL, Parquet and text into Megatron shards + a token manifest; verify, inspect."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from tokens_helpers import train_tokenizer

from fastio import Raw
from fastio.cli import main
from fastio.convert.token_convert import TokenConvertConfig, convert_tokens, load_tokenizer
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError
from fastio.formats.megatron import MegatronShard

TEXTS = ["the quick brown fox", "", "héllo wörld — 日本語", "   ", "packing documents into sequences",
         "a stream of tokens", "megatron indexed datasets"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def expected_docs(tokenizer, texts):
    tok = load_tokenizer(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts if t], eos


def all_documents(dest):
    m = load_manifest(dest)
    return [MegatronShard(dest / "shards" / s.name).document(j).tolist() for s in m.shards for j in range(s.samples)]


class Ran:
    def __init__(self, rc, output):
        self.exit_code, self.output = rc, output


def fastio(capsys, *args):
    """``fastio ARGS`` as the console script runs it: exit code and what it printed."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return Ran(rc, out.out + out.err)


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_a_truncation_or_padding_saved_in_the_tokenizer_is_not_applied(tmp_path, tokenizer):
    """A tokenizer.json saved with a truncation cut every document at its max_length (the rest of the text lost,
    silently), and one saved with a padding refused every short document (its pad ids, the end-of-text token,
    taken for text). transformers' tokenizer applies neither unless asked; nor does a conversion now."""
    spec = json.loads(tokenizer.read_text())
    texts = [t for t in TEXTS if t]
    want, _ = expected_docs(tokenizer, texts)
    for saved in ({"truncation": {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}},
                  {"padding": {"strategy": {"Fixed": 40}, "direction": "Right", "pad_to_multiple_of": None,
                               "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}}):
        (tmp_path / "saved.json").write_text(json.dumps({**spec, **saved}))
        dest = tmp_path / next(iter(saved))
        convert_tokens(TokenConvertConfig(write_jsonl(tmp_path / "c.jsonl", texts), dest, tmp_path / "saved.json",
                                          workers=1))
        assert all_documents(dest) == want and max(map(len, want)) > 3


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_in_order_across_shards(tmp_path, tokenizer, workers):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS * 3)
    result = convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=workers, batch_size=4,
                                               max_samples_per_shard=4))
    docs, eos = expected_docs(tokenizer, TEXTS * 3)
    assert all_documents(tmp_path / "ds") == docs  # input order, EOS appended, the empty one skipped
    assert result.empty == 3 and result.documents == len(docs) and result.shards == -(-len(docs) // 4)
    m = load_manifest(tmp_path / "ds")
    assert m.kind == "tokens" and m.format_version == 3
    assert m.tokens.dtype == "uint16" and m.tokens.eos_id == eos and m.tokens.vocab_size == 300
    assert m.tokens.one_sequence_per_document  # what MegatronWriter writes: readers skip doc_index
    assert m.tokens.total_tokens == sum(map(len, docs)) == sum(s.tokens for s in m.shards)
    assert [s.name for s in m.shards] == sorted(s.name for s in m.shards)
    assert m.converted_from["empty_documents"] == 3
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == [".fastio-lock", ".fastio-output", "doc-starts.fxs",
                                                                     "manifest.json", "shards"]


def test_non_ascii_round_trips(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "c.jsonl", ["héllo wörld — 日本語 🙂"])
    convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1))
    tok = load_tokenizer(tokenizer)
    (doc,) = all_documents(tmp_path / "ds")
    assert tok.decode(doc[:-1]) == "héllo wörld — 日本語 🙂"


def test_parquet_and_text_folder(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": TEXTS[:3] + [None]}), tmp_path / "c.parquet")
    convert_tokens(TokenConvertConfig(tmp_path / "c.parquet", tmp_path / "p", tokenizer, text_field="body", workers=1))
    assert all_documents(tmp_path / "p") == expected_docs(tokenizer, TEXTS[:3])[0]
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(TEXTS):
        (folder / f"{i:02d}.txt").write_text(t)
    result = convert_tokens(TokenConvertConfig(folder, tmp_path / "t", tokenizer, workers=1))
    assert all_documents(tmp_path / "t") == expected_docs(tokenizer, TEXTS)[0]
    assert result.empty == 1


def test_megatron_core_opens_converted_shards(tmp_path, tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1))
    ds = idx.IndexedDataset(str(tmp_path / "ds" / "shards" / "shard-000000"))
    assert [ds[j].tolist() for j in range(len(ds))] == expected_docs(tokenizer, TEXTS)[0]


def test_eos_default_given_and_refused(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    bare = train_tokenizer(tmp_path / "bare.json", eos=None, specials=("<sep>",))
    with pytest.raises(ConvertError, match=r"bare\.json: no end-of-text token among its special tokens \(<sep>\).* "
                                           r"eos=TOKEN"):
        convert_tokens(TokenConvertConfig(src, tmp_path / "ds", bare, workers=1))
    assert not (tmp_path / "ds").exists()  # refused before DEST was touched
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(bare)])
    assert r.exit_code == 2 and "--eos TOKEN" in r.output and "Traceback" not in r.output
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(bare), "--eos", "<nope>"])
    assert r.exit_code == 2 and "'<nope>' is not a special token (--eos <nope>); its special tokens: <sep>" in r.output
    tok = load_tokenizer(bare)
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(bare), "--eos", "<sep>"])
    assert r.exit_code == 0, r.output
    assert load_manifest(tmp_path / "ds").tokens.eos_id == tok.token_to_id("<sep>")


def test_hostile_inputs_named(tmp_path, tokenizer):
    cases = {
        "bad.jsonl": (b'{"text": "ok"}\n{not json\n', r"bad\.jsonl:2: not a JSON object"),
        "nofield.jsonl": (b'{"text": "ok"}\n{"body": "x"}\n', r"nofield\.jsonl:2: has no field 'text'"),
        "num.jsonl": (b'{"text": 3}\n', r"num\.jsonl:1: field 'text' is a number, not text"),
        "latin.txt": ("caf\xe9".encode("latin-1"), r"latin\.txt: not UTF-8 text \(byte 3\)"),
        "deep.jsonl": (b'{"text": "ok"}\n{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n",
                       r"deep\.jsonl:2: JSON nested too deeply to read"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConvertError, match=message):
            convert_tokens(TokenConvertConfig(tmp_path / name, tmp_path / f"out-{name}", tokenizer, workers=1))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x")
    (mixed / "b.csv").write_text("x")
    with pytest.raises(ConvertError, match=r"b\.csv: not a document file"):
        convert_tokens(TokenConvertConfig(mixed, tmp_path / "o", tokenizer, workers=1))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConvertError, match=r"broken\.json: not a tokenizer\.json"):
        convert_tokens(TokenConvertConfig(mixed / "a.txt", tmp_path / "o", tmp_path / "broken.json", workers=1))
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ConvertError, match=r"empty\.jsonl: holds no document with text \(1 empty document\)"):
        convert_tokens(TokenConvertConfig(tmp_path / "empty.jsonl", tmp_path / "e", tokenizer, workers=1))
    assert not (tmp_path / "e" / "manifest.json").exists()


@pytest.mark.parametrize("flag, said", [(["--format", "csv"], "--format"), (["-q", "--shuffle"], "--shuffle"),
                                        (["--split-by", "random"], "--split-by")])
def test_an_image_option_of_a_token_conversion_is_refused_by_the_flag_the_user_typed(tmp_path, tokenizer, capsys,
                                                                                     flag, said):
    """The refusal names the flag as typed: ``--format`` (its parameter is called ``fmt``) was named ``--fmt``."""
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    r = fastio(capsys, "convert", src, tmp_path / "ds", "--tokenizer", tokenizer, *flag)
    assert r.exit_code == 2 and r.output == f"fastio: error: {said}: not an option of a token conversion (--tokenizer)\n"
    assert not (tmp_path / "ds").exists()


def test_cli_refuses_image_options_and_verify_inspect_work(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer), "--max-side", "64"])
    assert r.exit_code == 2 and "--max-side: not an option of a token conversion" in r.output
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--eos", "x"])
    assert r.exit_code == 2 and "need --tokenizer" in r.output
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tokenizer), "--workers", "1",
                  "--max-samples-per-shard", "2", "--name", "web"])
    assert r.exit_code == 0, r.output
    assert "6 documents" in r.output and "1 empty document skipped" in r.output and "tokens/s" in r.output
    r = fastio(capsys, *["verify", str(tmp_path / "ds")])
    assert r.exit_code == 0 and "3 shards, 6 samples verified" in r.output, r.output
    r = fastio(capsys, *["inspect", str(tmp_path / "ds")])
    assert r.exit_code == 0, r.output
    assert "tokens:" in r.output and "uint16" in r.output and "6 documents" in r.output
    shard = tmp_path / "ds" / "shards" / "web-000001.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    r = fastio(capsys, *["verify", str(tmp_path / "ds")])
    assert r.exit_code == 1 and "web-000001.bin: sha256 does not match the manifest" in r.output
    shard.write_bytes(bytes(data[:-2]))
    r = fastio(capsys, *["verify", str(tmp_path / "ds")])
    assert r.exit_code == 1 and "truncated" in r.output


def test_tokens_are_below_vocab_and_documents_end_with_eos(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS * 5)
    convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=2, shard_size=200))
    m = load_manifest(tmp_path / "ds")
    assert len(m.shards) > 1 and all(s.bytes <= 200 for s in m.shards)
    docs = all_documents(tmp_path / "ds")
    assert all(d[-1] == m.tokens.eos_id and m.tokens.eos_id not in d[:-1] for d in docs)
    assert max(max(d) for d in docs) < m.tokens.vocab_size
    assert np.array(sum(docs, [])).size == m.tokens.total_tokens


def test_dataset_refuses_a_token_dataset_as_samples(tmp_path, tokenizer):
    from fastio.dataset.dataset import Dataset
    from fastio.errors import DatasetError

    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1))
    with pytest.raises(DatasetError, match=r"ds: a token dataset .*read by fastio\.tokens"):
        Dataset(tmp_path / "ds").index  # noqa: B018
    import fastio

    with pytest.raises(DatasetError, match=r"ds: a token dataset .*pipeline 'raw' reads stored samples: read it with "
                                           r"fastio\.Tokens"):
        next(iter(fastio.Loader(tmp_path / "ds", batch_size=2, device="cpu", pipeline=Raw())))


def test_failed_run_leaves_no_dataset_and_the_same_command_redoes_it(tmp_path, tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", TEXTS * 4)
    (src / "b.jsonl").write_text('{"text": "fine"}\n{broken\n')
    config = TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1, max_samples_per_shard=3, batch_size=2)
    with pytest.raises(ConvertError, match=r"b\.jsonl:2: not a JSON object"):
        convert_tokens(config)
    assert not (tmp_path / "ds" / "manifest.json").exists()
    assert not list((tmp_path / "ds" / "shards").glob(".*.tmp"))  # the shard being written was dropped
    write_jsonl(src / "b.jsonl", ["fine"])
    result = convert_tokens(config)  # no overwrite needed: DEST is fastio's interrupted output
    assert result.documents == len(expected_docs(tokenizer, TEXTS * 4 + ["fine"])[0])
    with pytest.raises(ConvertError, match="already holds a converted dataset; pass overwrite=True"):
        convert_tokens(config)


def hole_tokenizer(path, tokenizer, top=70_000):
    """``tokenizer`` with the byte ``a`` moved to id ``top``: ids 300..top - 1 are a hole (300 tokens in all)."""
    data = json.loads(tokenizer.read_text())
    data["model"]["vocab"]["a"] = top
    path.write_text(json.dumps(data))
    return path


def test_the_token_type_fits_the_largest_id_of_a_vocabulary_with_a_hole(tmp_path, tokenizer, capsys):
    hole = hole_tokenizer(tmp_path / "hole.json", tokenizer)
    tok = load_tokenizer(hole)
    assert tok.get_vocab_size(with_added_tokens=True) == 300  # fewer ids than the largest one
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    r = fastio(capsys, *["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(hole), "--workers", "2"])
    assert r.exit_code == 0 and "int32 tokens" in r.output, r.output
    m = load_manifest(tmp_path / "ds")
    assert m.tokens.dtype == "int32" and m.tokens.vocab_size == 70_001  # ids 0 .. 70,000
    docs = all_documents(tmp_path / "ds")
    assert docs == expected_docs(hole, TEXTS)[0] and any(70_000 in d for d in docs)
    r = fastio(capsys, *["verify", str(tmp_path / "ds")])
    assert r.exit_code == 0, r.output


def test_a_refused_conversion_leaves_nothing_in_dest(tmp_path, tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", TEXTS * 4)
    (src / "b.jsonl").write_text('{"text": "fine"}\n{broken\n')
    convert = lambda dest, **kw: convert_tokens(TokenConvertConfig(src, dest, tokenizer, workers=1,  # noqa: E731
                                                                   max_samples_per_shard=3, **kw))
    with pytest.raises(ConvertError, match=r"b\.jsonl:2: not a JSON object"):
        convert(tmp_path / "new")
    assert not (tmp_path / "new").exists()  # made by the run: gone with it
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConvertError, match=r"b\.jsonl:2"):
        convert(tmp_path / "mine")
    assert list((tmp_path / "mine").iterdir()) == []  # the user's folder stays, empty as it was
    with pytest.raises(ConvertError, match=r"b\.jsonl:2"):
        convert(tmp_path / "parts", part=(1, 2))
    assert not (tmp_path / "parts").exists()
    convert(tmp_path / "half", part=(0, 2))
    with pytest.raises(ConvertError, match=r"b\.jsonl:2"):
        convert(tmp_path / "half", part=(1, 2))
    assert sorted(p.name for p in (tmp_path / "half" / ".parts").iterdir()) == ["part-0-of-2"]  # the other kept
    assert (tmp_path / "half" / ".parts" / "part-0-of-2" / "part.json").is_file()


def test_a_second_writer_is_refused(tmp_path, tokenizer):
    from fastio.storage.lock import DirLock

    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    with DirLock(tmp_path / "ds", purpose="another conversion"):
        with pytest.raises(ConvertError, match=r"ds: in use by .*another conversion"):
            convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tokenizer, workers=1))
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_utf8_byte_order_mark_is_no_text_in_a_txt_file_as_in_jsonl(tmp_path, tokenizer):
    # Found by review: a .txt saved "UTF-8 with BOM" (Windows Notepad) had the mark's three bytes tokenized at its
    # document's start, while the same mark before a JSONL line was dropped (json reads it as the encoding's mark).
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"\xef\xbb\xbf" + "the quick brown fox".encode())
    (folder / "b.txt").write_bytes(b"\xef\xbb\xbf")  # only the mark: an empty document
    (tmp_path / "c.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "the quick brown fox"}).encode() + b"\n")
    result = convert_tokens(TokenConvertConfig(folder, tmp_path / "t", tokenizer, workers=1))
    convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "j", tokenizer, workers=1))
    expected = expected_docs(tokenizer, ["the quick brown fox"])[0]
    assert all_documents(tmp_path / "t") == all_documents(tmp_path / "j") == expected
    assert result.empty == 1
    (folder / "c.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9")  # a byte past the mark is counted from the file's start
    with pytest.raises(ConvertError, match=r"c\.txt: not UTF-8 text \(byte 6\)"):
        convert_tokens(TokenConvertConfig(folder, tmp_path / "t2", tokenizer, workers=1))


@pytest.mark.parametrize("kind", ["dictionary", "large_string", "string_view"])
def test_a_parquet_text_column_of_any_arrow_string_type_is_text(tmp_path, tokenizer, kind):
    # Found by review: a dictionary-encoded text column (pandas' category dtype, or a writer's dictionary) was
    # refused as 'dictionary<values=string, ...>, not text'; its values are text.
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.array(TEXTS[:3] + [None])
    column = {"dictionary": lambda: column.dictionary_encode(), "large_string": lambda: column.cast(pa.large_string()),
              "string_view": lambda: column.cast(pa.string_view())}[kind]()
    pq.write_table(pa.table({"body": column}), tmp_path / "c.parquet")
    assert kind in str(pq.ParquetFile(tmp_path / "c.parquet").schema_arrow.field("body").type)
    convert_tokens(TokenConvertConfig(tmp_path / "c.parquet", tmp_path / "p", tokenizer, text_field="body", workers=1))
    assert all_documents(tmp_path / "p") == expected_docs(tokenizer, TEXTS[:3])[0]
    pq.write_table(pa.table({"body": pa.array([b"a", b"b"]).dictionary_encode()}), tmp_path / "n.parquet")
    with pytest.raises(ConvertError, match=r"n\.parquet: column 'body' is dictionary<values=binary"):
        convert_tokens(TokenConvertConfig(tmp_path / "n.parquet", tmp_path / "q", tokenizer, text_field="body",
                                          workers=1))


def test_a_jsonl_null_text_is_an_empty_document_as_a_parquet_null_and_other_values_are_named_in_json_words(
        tmp_path, tokenizer):
    # Found by review: the same table exported as Parquet and as JSONL (pandas' to_json writes a missing text as
    # null) converted differently: a Parquet null is an empty document, a JSONL null stopped the run with "field
    # 'text' is NoneType, not text" (Python's type names: 'dict', 'list', 'NoneType' where the file says null).
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["the quick brown fox", None, "a stream of tokens"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    from_parquet = convert_tokens(TokenConvertConfig(tmp_path / "c.parquet", tmp_path / "p", tokenizer, workers=1))
    from_jsonl = convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "j", tokenizer, workers=1))
    assert all_documents(tmp_path / "j") == all_documents(tmp_path / "p") == expected_docs(tokenizer, texts[::2])[0]
    assert from_jsonl.empty == from_parquet.empty == 1
    for value, said in [({"a": 1}, "an object"), ([1], "a list"), (True, "a boolean"), (1.5, "a number")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(ConvertError, match=rf"bad\.jsonl:2: field 'text' is {said}, not text$"):
            convert_tokens(TokenConvertConfig(tmp_path / "bad.jsonl", tmp_path / "b", tokenizer, workers=1))


def test_a_megatron_loose_json_file_and_a_compressed_one_are_named_with_the_way_on(tmp_path, tokenizer):
    # Found by review: Megatron's preprocess_data.py reads 'loose JSON' (one object a line) named .json, and
    # pretraining corpora ship as .jsonl.gz / .json.zst; each was 'not a document file' with nothing on what to do.
    data = b'{"text": "the quick brown fox"}\n'
    cases = {"corpus.json": r"corpus\.json: not a document file .*one JSON object a line, as Megatron's loose JSON "
                            r"is, is JSONL: name it corpus\.jsonl",
             "corpus.jsonl.gz": r"corpus\.jsonl\.gz: not a document file .*compressed \(\.gz\): decompress it first",
             "corpus.json.zst": r"corpus\.json\.zst: not a document file .*compressed \(\.zst\): decompress it first"}
    for name, message in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConvertError, match=message):
            convert_tokens(TokenConvertConfig(tmp_path / name, tmp_path / "out", tokenizer, workers=1))
    (tmp_path / "corpus.jsonl").write_bytes(data)  # renamed: converted as it is
    convert_tokens(TokenConvertConfig(tmp_path / "corpus.jsonl", tmp_path / "out", tokenizer, workers=1))
    assert all_documents(tmp_path / "out") == expected_docs(tokenizer, ["the quick brown fox"])[0]
