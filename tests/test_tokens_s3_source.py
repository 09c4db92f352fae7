"""fastio convert s3://bucket/corpus/ DEST --tokenizer: documents read from a real S3 server (moto) on loopback."""

from __future__ import annotations

import filecmp
import json
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli
from tokens_helpers import train_tokenizer

from fastio.dataset.manifest import load_manifest
from fastio.storage import open_storage

TEXTS = ["the quick brown fox", "", "héllo wörld — 日本語", "packing documents into sequences",
         "a stream of tokens", "megatron indexed datasets"] * 5


@pytest.fixture
def corpus(tmp_path, aws_env, s3_bucket, monkeypatch):
    """The same documents in a local folder and under s3://BUCKET/corpus/ (with a folder marker, and a neighbour
    prefix that is not part of it); the endpoint only on the command line (--endpoint-url).
    (folder, url, tokenizer, endpoint)."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    pq.write_table(pa.table({"text": TEXTS[::-1]}), src / "b.parquet", row_group_size=4)
    (src / "sub" / "c.txt").write_text("one document in a text file")
    store = open_storage(f"s3://{s3_bucket}")
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        store.put_file(f"corpus/{path.relative_to(src).as_posix()}", path)
    store.put_bytes("corpus-other/z.csv", b"not,part,of,it\n")
    endpoint = aws_env_endpoint(monkeypatch)
    import boto3  # a folder marker ("corpus/sub/", empty), as the console and some tools write: not a document

    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=s3_bucket, Key="corpus/sub/", Body=b"")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the objects are downloaded to
    return src, f"s3://{s3_bucket}/corpus/", train_tokenizer(tmp_path / "tokenizer.json"), endpoint


def aws_env_endpoint(monkeypatch) -> str:
    import os

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    return endpoint


def tokens_convert(capsys, source, dest, tok, *extra):
    return run_cli(["convert", str(source), str(dest), "--tokenizer", str(tok), "--workers", "1", "-q", *extra],
                   capsys)


def same_shards(a, b) -> bool:
    names = sorted(p.name for p in (a / "shards").iterdir())
    return names == sorted(p.name for p in (b / "shards").iterdir()) and all(
        filecmp.cmp(a / "shards" / n, b / "shards" / n, shallow=False) for n in names)


def test_a_prefix_converts_like_the_local_folder(tmp_path, corpus, capsys):
    src, url, tok, endpoint = corpus
    assert tokens_convert(capsys, src, tmp_path / "local", tok, "--max-samples-per-shard", "7")[0] == 0
    code, _, err = tokens_convert(capsys, url, tmp_path / "ds", tok, "--max-samples-per-shard", "7",
                                  "--endpoint-url", endpoint)
    assert code == 0, err
    assert same_shards(tmp_path / "local", tmp_path / "ds")  # the same documents in the same order
    local, remote = load_manifest(tmp_path / "local"), load_manifest(tmp_path / "ds")
    assert remote.converted_from == {**local.converted_from, "path": url} and remote.converted_from["files"] == 3
    assert remote.fingerprint == local.fingerprint
    assert list((tmp_path / "tmp").iterdir()) == []  # each downloaded object removed once read


def test_one_object_and_parts_from_s3(tmp_path, corpus, capsys):
    src, url, tok, endpoint = corpus
    assert tokens_convert(capsys, src / "a.jsonl", tmp_path / "local", tok)[0] == 0
    assert tokens_convert(capsys, url + "a.jsonl", tmp_path / "one", tok, "--endpoint-url", endpoint)[0] == 0
    assert same_shards(tmp_path / "local", tmp_path / "one")
    assert tokens_convert(capsys, src, tmp_path / "whole", tok, "--shard-size", "200")[0] == 0
    for k in range(2):
        code, _, err = tokens_convert(capsys, url, tmp_path / "ds", tok, "--shard-size", "200", "--part", f"{k}/2",
                                      "--endpoint-url", endpoint, "--workers", "2")  # worker processes too
        assert code == 0, err
    assert run_cli(["merge", str(tmp_path / "ds")], capsys)[0] == 0
    assert same_shards(tmp_path / "whole", tmp_path / "ds")


def test_refusals_name_the_url_in_one_line(tmp_path, corpus, capsys, s3_bucket, fault_proxy, moto_server):
    src, url, tok, endpoint = corpus
    store = open_storage(f"s3://{s3_bucket}", {"endpoint": endpoint})
    store.put_bytes("bad/x.txt", b"\xff\xfe not utf-8")
    store.put_bytes("locked/a.jsonl", b'{"text": "fine"}\n')
    fault_proxy.forbidden.add("locked/a.jsonl")
    cases = [(f"s3://{s3_bucket}/nothing/", endpoint, f"s3://{s3_bucket}/nothing: no such object or prefix"),
             (f"s3://{s3_bucket}/corpus-other", endpoint,
              f"s3://{s3_bucket}/corpus-other/z.csv: not a document file"),
             (f"s3://{s3_bucket}/bad", endpoint, f"s3://{s3_bucket}/bad/x.txt: not UTF-8 text"),
             (f"s3://{s3_bucket}/locked/", fault_proxy.endpoint, f"s3://{s3_bucket}/locked/a.jsonl: GET failed")]
    for source, at, message in cases:
        code, _, err = tokens_convert(capsys, source, tmp_path / "ds", tok, "--endpoint-url", at)
        assert code == 2 and err.startswith("fastio: error: ") and err.count("\n") == 1, err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "ds" / "manifest.json").exists()


def test_an_s3_dest_gets_the_local_conversion_uploaded_manifest_last(tmp_path, corpus, capsys, s3_bucket):
    src, url, tok, endpoint = corpus
    assert tokens_convert(capsys, src, tmp_path / "local", tok, "--shard-size", "300")[0] == 0
    dest = f"s3://{s3_bucket}/tokens"
    code, _, err = tokens_convert(capsys, url, dest, tok, "--shard-size", "300", "--endpoint-url", endpoint,
                                  "--staging-dir", str(tmp_path / "staging"))
    assert code == 0, err
    store = open_storage(dest, {"endpoint": endpoint})
    local = tmp_path / "local"
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()
                   and p.name != ".fastio-lock")
    assert [o.key for o in store.list() if o.key != ".fastio-lock"] == files
    for key in files:
        if key != "manifest.json":
            assert store.get(key) == (local / key).read_bytes(), key
    assert json.loads(store.get("manifest.json"))["source"]["path"] == url
    assert list((tmp_path / "staging").iterdir()) == []  # the staging copy removed after the upload
    code, out, err = run_cli(["verify", dest, "--endpoint-url", endpoint], capsys)
    assert code == 0, err
    code, _, err = tokens_convert(capsys, src, dest, tok, "--part", "0/2", "--endpoint-url", endpoint)
    assert code == 2 and err.count("\n") == 1 and "--part: needs a DEST on a (shared) file system" in err, err


def test_overwriting_an_s3_token_dataset_leaves_none_of_its_old_shards(tmp_path, corpus, capsys, s3_bucket):
    src, url, tok, endpoint = corpus
    dest = f"s3://{s3_bucket}/tokens"
    assert tokens_convert(capsys, src, dest, tok, "--max-samples-per-shard", "3", "--endpoint-url", endpoint)[0] == 0
    store = open_storage(dest, {"endpoint": endpoint})
    assert len([o for o in store.list() if o.key.endswith(".bin")]) > 2
    code, _, err = tokens_convert(capsys, src, dest, tok, "--overwrite", "--endpoint-url", endpoint)
    assert code == 0, err
    assert sorted(o.key for o in store.list() if o.key.startswith("shards/")) == [
        "shards/shard-000000.bin", "shards/shard-000000.idx"]  # the old dataset's other pairs deleted
