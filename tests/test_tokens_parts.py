"""fastio convert --tokenizer --part K/N, then fastio merge: the dataset a single token conversion writes."""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli
from tokens_helpers import train_tokenizer

from fastio.convert.merge import merge
from fastio.convert.parts import part_dir
from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
from fastio.errors import ConvertError
from fastio.storage.lock import DirLock

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of JSONL (with blank lines and empty documents), Parquet (several row groups) and .txt documents,
    and a tokenizer; (folder, tokenizer)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(0, 25)))) for _ in range(240)]
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + ("\n\n" if i % 7 == 0 else "\n")
                                         for i, t in enumerate(texts[:100])))
    pq.write_table(pa.table({"text": texts[100:200]}), src / "b.parquet", row_group_size=16)
    for i, t in enumerate(texts[200:]):
        (src / "sub" / f"c{i:02d}.txt").write_text(t)
    return src, train_tokenizer(root / "tokenizer.json")


def convert(src, dest, tok, **kw):
    return convert_tokens(TokenConvertConfig(src, dest, tok, workers=1, batch_size=16, **kw))


def assert_same_dataset(a, b):
    """Same manifest bytes (no path of DEST is in it), same shard files, byte for byte."""
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    names = sorted(p.name for p in (a / "shards").iterdir())
    assert names == sorted(p.name for p in (b / "shards").iterdir())
    assert all(filecmp.cmp(a / "shards" / n, b / "shards" / n, shallow=False) for n in names)
    assert not (b / ".parts").exists()


@pytest.mark.parametrize("options", [{"shard_size": 400}, {"max_samples_per_shard": 10}],
                         ids=["bytes", "documents"])
def test_two_parts_merged_equal_the_whole_conversion(tmp_path, corpus, options):
    src, tok = corpus
    whole = convert(src, tmp_path / "whole", tok, **options)
    parts = [convert(src, tmp_path / "ds", tok, part=(k, 2), **options) for k in (1, 0)]  # any order
    assert sum(p.documents for p in parts) == whole.documents and sum(p.empty for p in parts) == whole.empty > 0
    assert all(p.documents for p in parts)  # both parts did work
    result = merge(tmp_path / "ds")
    assert result.linked > 0  # the first part's shards are the whole run's
    assert_same_dataset(tmp_path / "whole", tmp_path / "ds")


def test_more_parts_than_files_and_empty_parts(tmp_path, corpus):
    src, tok = corpus
    convert(src / "sub", tmp_path / "whole", tok, shard_size=300)  # 40 one-document .txt files
    for k in range(50):  # more parts than documents: some parts are empty
        convert(src / "sub", tmp_path / "ds", tok, shard_size=300, part=(k, 50))
    merge(tmp_path / "ds")
    assert_same_dataset(tmp_path / "whole", tmp_path / "ds")


def test_cli_parts_from_a_slurm_array_then_merge(tmp_path, corpus, capsys, monkeypatch):
    src, tok = corpus
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "whole"), "--tokenizer", str(tok), "--workers", "1",
                            "--shard-size", "500", "-q"], capsys)
    assert code == 0, err
    for k in range(3):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(k))
        code, out, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--tokenizer", str(tok), "--workers",
                                  "2", "--shard-size", "500", "--part", "auto/3"], capsys)
        assert code == 0 and f"part {k}/3 of {tmp_path / 'ds'}" in out, err
    code, out, err = run_cli(["merge", str(tmp_path / "ds")], capsys)
    assert code == 0 and "merged 3 parts" in out and " documents in " in out, err
    assert_same_dataset(tmp_path / "whole", tmp_path / "ds")
    code, _, err = run_cli(["verify", str(tmp_path / "ds")], capsys)
    assert code == 0, err


def test_a_missing_part_is_named_with_the_command_that_makes_it(tmp_path, corpus, capsys):
    src, tok = corpus
    convert(src, tmp_path / "ds", tok, part=(0, 2), text_field="text", max_samples_per_shard=7)
    code, _, err = run_cli(["merge", str(tmp_path / "ds")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "part-1-of-2 (missing)" in err
    assert (f"fastio convert {src} {tmp_path / 'ds'} --tokenizer {tok} --max-samples-per-shard 7 --part K/2"
            in err), err
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_parts_of_another_tokenizer_eos_or_options_are_refused(tmp_path, corpus, capsys):
    src, tok = corpus
    other = train_tokenizer(tmp_path / "other.json", eos="</s>")
    cases = [({"tokenizer": other}, "tokenizer_sha256"),
             ({"eos": "<|endoftext|>"}, "eos '<|endoftext|>' (part 0: None)"),
             ({"max_samples_per_shard": 5}, "max_samples_per_shard 5 (part 0: None)"),
             ({"special_in_text": "refuse"}, "special_in_text 'refuse' (part 0: 'plain')")]
    for i, (change, named) in enumerate(cases):
        dest = tmp_path / f"ds{i}"
        convert(src, dest, tok, part=(0, 2))
        convert(src, dest, change.pop("tokenizer", tok), part=(1, 2), **change)
        code, _, err = run_cli(["merge", str(dest)], capsys)
        assert code == 2 and err.count("\n") == 1 and "part-1-of-2:" in err and named in err, err
        assert not (dest / "manifest.json").exists() and (dest / ".parts").is_dir()


def test_one_tokenizer_named_relatively_absolutely_or_copied_merges(tmp_path, corpus, monkeypatch):
    src, tok = corpus
    convert(src, tmp_path / "whole", tok, max_samples_per_shard=9)
    convert(src, tmp_path / "ds", tok, part=(0, 3), max_samples_per_shard=9)  # as the whole run names it
    shutil.copy(tok, tmp_path / "copy.json")
    convert(src, tmp_path / "ds", tmp_path / "copy.json", part=(2, 3), max_samples_per_shard=9)
    monkeypatch.chdir(tok.parent)
    convert(src, tmp_path / "ds", Path(tok.name), part=(1, 3), max_samples_per_shard=9)
    merge(tmp_path / "ds")  # the same tokenizer by content (sha256), however named
    assert_same_dataset(tmp_path / "whole", tmp_path / "ds")


def test_a_damaged_part_is_named(tmp_path, corpus):
    src, tok = corpus
    for k in range(2):
        convert(src, tmp_path / "ds", tok, part=(k, 2), shard_size=400)
    shard = sorted((tmp_path / "ds" / ".parts" / "part-1-of-2" / "shards").glob("*.bin"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with pytest.raises(ConvertError, match=rf"{shard}: .*(truncated|damaged)"):
        merge(tmp_path / "ds")


def test_a_listing_that_changed_between_parts_is_refused(tmp_path, corpus, capsys):
    src, tok = corpus
    mine = tmp_path / "src"
    shutil.copytree(src, mine)
    convert(mine, tmp_path / "ds", tok, part=(0, 2))
    with open(mine / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    convert(mine, tmp_path / "ds", tok, part=(1, 2))
    code, _, err = run_cli(["merge", str(tmp_path / "ds")], capsys)
    assert code == 2 and err.count("\n") == 1 and "part-1-of-2: source listing" in err, err


def test_a_whole_conversion_leaves_a_running_part_alone(tmp_path, corpus):
    src, tok = corpus
    convert(src, tmp_path / "ds", tok, part=(0, 2))
    running = DirLock(part_dir(tmp_path / "ds", 1, 2), "fastio convert --part 1/2").acquire()  # a part at work
    try:
        with pytest.raises(ConvertError, match="part 1/2 of a conversion in parts is running"):
            convert(src, tmp_path / "ds", tok)
        assert (part_dir(tmp_path / "ds", 0, 2) / "part.json").is_file()  # nothing deleted
    finally:
        running.release()
    convert(src, tmp_path / "ds", tok)
    assert (tmp_path / "ds" / "manifest.json").is_file() and not (tmp_path / "ds" / ".parts").exists()


def test_spans_cut_a_file_into_contiguous_runs_with_their_line_and_row_names(tmp_path):
    from fastio.converters.documents import file_documents

    rng = np.random.default_rng(5)
    lines = [json.dumps({"text": "x" * int(rng.integers(0, 9))}) if rng.random() > 0.2 else "" for _ in range(60)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": [str(i) for i in range(37)]}), tmp_path / "b.parquet", row_group_size=5)
    for name in ("a.jsonl", "b.parquet"):
        path = tmp_path / name
        whole = list(file_documents(path))
        size = path.stat().st_size
        for cuts in ([0, size], [0, 1, size], *([0, *sorted(rng.integers(0, size, 3).tolist()), size]
                                               for _ in range(20))):
            runs = [list(file_documents(path, span=(a, b))) for a, b in zip(cuts, cuts[1:])]
            assert [d for run in runs for d in run] == whole, (name, cuts)
    assert whole[-1][0] == f"{tmp_path / 'b.parquet'}: row 36"


def test_the_merge_cuts_where_the_writer_cuts():
    from fastio.convert.token_convert import starts_new_token_shard, token_shard_cuts

    rng = np.random.default_rng(9)
    for _ in range(200):
        sizes = rng.integers(1, 60, int(rng.integers(1, 80))) * 2
        size, limit = int(rng.integers(10, 300)), [None, int(rng.integers(1, 9))][int(rng.integers(0, 2))]
        cuts, start, docs, nbytes = [], 0, 0, 0
        for i, n in enumerate(sizes.tolist()):  # the writer's streaming rule, one document at a time
            if starts_new_token_shard(docs, nbytes, n, size, limit):
                cuts.append((start, i))
                start, docs, nbytes = i, 0, 0
            docs, nbytes = docs + 1, nbytes + n
        cuts.append((start, len(sizes)))
        assert token_shard_cuts(sizes, size, limit) == cuts, (sizes, size, limit)


def test_a_tampered_part_record_is_named(tmp_path, corpus):
    src, tok = corpus
    for k in range(2):
        convert(src, tmp_path / "ds", tok, part=(k, 2))
    record = part_dir(tmp_path / "ds", 1, 2) / "part.json"
    data = json.loads(record.read_text())
    data["datasets"][""]["shards"][0]["name"] = "../../../elsewhere.bin"
    record.write_text(json.dumps(data))
    with pytest.raises(ConvertError, match=rf"{record}: part record has a malformed shard"):
        merge(tmp_path / "ds")
    assert not (tmp_path / "ds" / "manifest.json").exists()
