"""fastio index DIR --eos-id N: Megatron pairs (written by megatron-core) become a token dataset without copying."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from fastio.cli import main
from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import load_manifest
from fastio.formats.megatron import MegatronIndex, MegatronWriter

EOS = 2
DOCS = [[5, 6, 7, EOS], [1, EOS], [9, 9, 9, 9, EOS]]


def megatron_pair(folder, stem, docs, dtype=np.uint16):
    """A pair written by megatron-core's IndexedDatasetBuilder, as its preprocess_data.py does."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    folder.mkdir(exist_ok=True)
    builder = idx.IndexedDatasetBuilder(str(folder / f"{stem}.bin"), dtype=dtype)
    for d in docs:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(str(folder / f"{stem}.idx"))


def run(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_index_in_place_then_verify_and_inspect(tmp_path, capsys):
    data = tmp_path / "data"
    megatron_pair(data, "web_text_document", DOCS)
    megatron_pair(data, "code_text_document", DOCS[:2])
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    rc, out = run(capsys, "index", data, "--eos-id", EOS)
    assert rc == 0 and "indexed 2 shards, 5 documents" in out, out
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.name in before} == before  # nothing rewritten
    m = load_manifest(data)
    assert m.kind == "tokens" and m.tokens.eos_id == EOS and m.tokens.dtype == "uint16" and m.tokens.vocab_size is None
    assert m.tokens.one_sequence_per_document  # one item per document, as preprocess_data.py writes
    assert [(s.name, s.samples, s.tokens) for s in m.shards] == [("code_text_document.bin", 2, 6),
                                                                 ("web_text_document.bin", 3, 11)]
    assert [s.location for s in m.shards] == ["code_text_document.bin", "web_text_document.bin"]
    rc, out = run(capsys, "verify", data)
    assert rc == 0 and "2 shards, 5 samples verified" in out, out
    rc, out = run(capsys, "inspect", data)
    assert rc == 0 and "5 documents, 17 uint16 tokens" in out and "not recorded" in out, out


def test_index_elsewhere_names_pairs_by_path(tmp_path, capsys):
    data = tmp_path / "data"
    megatron_pair(data, "a", DOCS, dtype=np.int32)
    rc, out = run(capsys, "index", data, "--eos-id", EOS, "--dest", tmp_path / "meta")
    assert rc == 0, out
    m = load_manifest(tmp_path / "meta")
    assert m.shards[0].location == str((data / "a.bin").resolve()) and m.tokens.dtype == "int32"
    assert not (data / "manifest.json").exists()
    rc, out = run(capsys, "verify", tmp_path / "meta")
    assert rc == 0, out
    rc, out = run(capsys, "index", data, "--eos-id", EOS, "--dest", tmp_path / "meta")
    assert rc == 2 and "already holds a manifest; pass --overwrite" in out


def test_a_dest_spelt_through_a_new_folder_and_dotdot_is_made_where_the_os_finds_it(tmp_path, capsys):
    """``--dest x/new/../meta`` (``x/new`` missing) is ``x/meta``: no ``x/new`` is made on the way and left
    behind."""
    data, x = tmp_path / "data", tmp_path / "x"
    megatron_pair(data, "a", DOCS)
    x.mkdir()
    rc, out = run(capsys, "index", data, "--eos-id", EOS, "--dest", x / "new" / ".." / "meta")
    assert rc == 0, out
    assert sorted(p.name for p in x.iterdir()) == ["meta"]
    assert load_manifest(x / "meta").shards[0].location == str((data / "a.bin").resolve())


def test_verify_finds_a_changed_pair(tmp_path, capsys):
    data = tmp_path / "data"
    megatron_pair(data, "a", DOCS)
    assert run(capsys, "index", data, "--eos-id", EOS)[0] == 0
    raw = bytearray((data / "a.bin").read_bytes())
    raw[0] ^= 1
    (data / "a.bin").write_bytes(bytes(raw))
    rc, out = run(capsys, "verify", data)
    assert rc == 1 and "a.bin: sha256 does not match the manifest" in out


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"a\.bin: 20 bytes, but a\.idx indexes 22 .*truncated"),
    ("other-dtype", r"b\.idx: holds int32 tokens, expected uint16"),
    ("no-idx", r"a\.bin: has no partner a\.idx"),
    ("no-bin", r"a\.idx: has no partner a\.bin"),
    ("magic", r"a\.idx: not a Megatron \.idx"),
    ("wrong-eos", r"a\.bin: document 0 ends with token 2, not eos_id 3 .*Megatron's preprocess_data\.py appends "
                  r"it only with --append-eod"),
    ("empty", r"data: holds no Megatron \.bin/\.idx pairs"),
])
def test_hostile_pairs_refused_in_one_line(tmp_path, capsys, damage, message):
    data = tmp_path / "data"
    megatron_pair(data, "a", DOCS)
    eos = EOS
    if damage == "truncate":
        with open(data / "a.bin", "r+b") as f:
            f.truncate(20)
    elif damage == "other-dtype":
        megatron_pair(data, "b", DOCS, dtype=np.int32)
    elif damage == "no-idx":
        (data / "a.idx").unlink()
    elif damage == "no-bin":
        (data / "a.bin").unlink()
    elif damage == "magic":
        (data / "a.idx").write_bytes(b"NOTMEGA" + (data / "a.idx").read_bytes()[7:])
    elif damage == "wrong-eos":
        eos = 3
    else:
        for p in data.iterdir():
            p.unlink()
    rc, out = run(capsys, "index", data, "--eos-id", eos)
    assert rc == 2 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert out.startswith("fastio: error: ")
    import re

    assert re.search(message, out), out
    assert not (data / "manifest.json").exists()


def test_fastio_writer_pairs_index_too_and_flags_checked(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    w = MegatronWriter(data / "s.bin", "uint16")
    for d in DOCS:
        w.add(np.array(d))
    w.close()
    result = index_tokens(TokenIndexConfig(data, EOS))
    assert (result.shards, result.documents, result.tokens) == (1, 3, 11)
    rc, out = run(capsys, "index", data, "--eos-id", EOS, "--label-field", "cls")
    assert rc == 2 and "--label-field: not an option of a Megatron index" in out
    rc, out = run(capsys, "index", data, "--eos-id", -1)
    assert rc == 2 and "--eos-id must be a token id" in out
    assert json.loads((data / "manifest.json").read_text())["name"] == "megatron"


def test_documents_of_several_sequences_are_indexed_and_read_whole(tmp_path):
    """Megatron pairs with sentence splitting (a document of several sequences): the manifest does not claim one
    sequence per document, and a reader takes each document whole through doc_index."""
    import torch

    from bench.token_dataset import TokenDataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    data = tmp_path / "data"
    data.mkdir()
    builder = idx.IndexedDatasetBuilder(str(data / "s.bin"), dtype=np.uint16)
    for doc in ([[5, 6], [7, EOS]], [[1, EOS]], [[9], [9, 9], [9, EOS]]):
        for sentence in doc:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(str(data / "s.idx"))
    index_tokens(TokenIndexConfig(data, EOS))
    assert not load_manifest(data).tokens.one_sequence_per_document
    ds = TokenDataset(data)
    assert [ds.shards[0].document(j).tolist() for j in range(3)] == DOCS
    assert ds.shards[0].index.starts(np.array([0, 2, 3])).tolist() == [0, 6, 11]


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_megatron_pairs_with_empty_documents_and_a_one_document_shard_pack_every_token(tmp_path, packing):
    """megatron-core pairs holding documents of length 0 (one shard nothing else) and a shard of one document:
    indexed, then packed at seq_len 1, at a document's length and past the corpus: every token once (concat: every
    input token but the tail; best-fit: every token, padding masked), the same sequences at world sizes 1, 2, 3, 5."""
    import fastio

    data = tmp_path / "data"
    megatron_pair(data, "a", [DOCS[0], [], DOCS[1]])
    megatron_pair(data, "b", [[]])
    megatron_pair(data, "c", [DOCS[2]])
    index_tokens(TokenIndexConfig(data, EOS))
    every = sorted(t for d in (DOCS[0], DOCS[1], DOCS[2]) for t in d)
    total = len(every)
    for seq_len in (1, len(DOCS[2]) - 1, total + 5):
        if packing == "concat" and seq_len >= total:
            with pytest.raises(fastio.DatasetError, match=rf"seq_len {seq_len} needs more than"):
                fastio.Loader(data, pipeline=fastio.Tokens(seq_len=seq_len), batch_size=1, device="cpu")
            continue
        seen = {}
        for world in (1, 2, 3, 5):
            tokens, ids = [], []
            for rank in range(world):
                with fastio.Loader(data, pipeline=fastio.Tokens(seq_len=seq_len, packing=packing), batch_size=1,
                                   device="cpu", world_size=world, rank=rank, drop_last=False) as ld:
                    for b in ld:
                        if b["padded"].item():
                            continue
                        row = b["tokens"][0]
                        tokens += (row[:-1] if packing == "concat" else row[b["loss_mask"][0]]).tolist()
                        ids.append(b["index"].item())
            seen[world] = sorted(ids)
            if packing == "concat":
                assert len(tokens) == (total - 1) // seq_len * seq_len and set(tokens) <= set(every)
            else:
                assert sorted(tokens) == every
        assert len({tuple(v) for v in seen.values()}) == 1 and len(set(seen[1])) == len(seen[1])


# -- s3:// ---------------------------------------------------------------------------------------------------------

def _pairs_folder(folder, dtype="uint16", shards=2, docs=120):
    """``shards`` pairs written by fastio's MegatronWriter: documents of 1..40 tokens, each ending with EOS."""
    rng = np.random.default_rng(5)
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        w = MegatronWriter(folder / f"part-{k:03d}.bin", dtype)
        for _ in range(docs):
            w.add(np.r_[rng.integers(3, 500, int(rng.integers(0, 40))), EOS])
        w.close()
    return folder


def _upload(store, folder, prefix):
    for path in sorted(folder.iterdir()):
        store.put_file(f"{prefix}/{path.name}", path)


def _records(m):
    return [(s.name, s.samples, s.bytes, s.sha256, s.xxh3_128, s.idx_sha256, s.tokens) for s in m.shards]


def test_s3_pairs_indexed_in_place_and_elsewhere_read_through_the_cache(tmp_path, aws_env, moto_server, s3_bucket,
                                                                       capsys, monkeypatch):
    """fastio index s3://bucket/prefix --eos-id: the same records as the local folder's, the .idx fetched by ranged
    GETs and the .bin streamed (never downloaded to a file), and a Loader through the cache reads the tokens a
    local read gives."""
    import torch

    import fastio
    from fastio.storage import open_storage
    from fastio.storage.base import S3Storage

    local = _pairs_folder(tmp_path / "local")
    store = open_storage(f"s3://{s3_bucket}")
    _upload(store, local, "mega")
    store.put_bytes("mega/sub/x.bin", b"not a pair of this prefix")  # below the prefix: not listed
    store.put_bytes("mega-other/y.bin", b"a neighbour prefix")
    downloads, get_to_file = [], S3Storage.get_to_file
    monkeypatch.setattr(S3Storage, "get_to_file", lambda self, key, *a, **k: downloads.append(key) or
                        get_to_file(self, key, *a, **k))
    assert run(capsys, "index", local, "--eos-id", EOS)[0] == 0
    rc, out = run(capsys, "index", f"s3://{s3_bucket}/mega/", "--eos-id", EOS)
    assert rc == 0 and "indexed 2 shards, 240 documents" in out, out
    assert sorted(downloads) == ["part-000.idx", "part-001.idx"]  # the .bin files: streamed, not downloaded
    remote = fastio.Dataset(f"s3://{s3_bucket}/mega", cache_dir=tmp_path / "c0").manifest
    assert _records(remote) == _records(load_manifest(local)) and remote.tokens == load_manifest(local).tokens
    assert [s.location for s in remote.shards] == ["part-000.bin", "part-001.bin"]
    rc, out = run(capsys, "index", f"s3://{s3_bucket}/mega", "--eos-id", EOS, "--dest", f"s3://{s3_bucket}/meta")
    assert rc == 0, out
    meta = fastio.Dataset(f"s3://{s3_bucket}/meta", cache_dir=tmp_path / "c1").manifest
    assert [s.location for s in meta.shards] == [f"s3://{s3_bucket}/mega/part-000.bin",
                                                 f"s3://{s3_bucket}/mega/part-001.bin"]
    options = {"pipeline": fastio.Tokens(seq_len=16, window=8), "batch_size": 4, "device": "cpu", "seed": 3}
    for url in (f"s3://{s3_bucket}/mega", f"s3://{s3_bucket}/meta"):
        with fastio.Loader(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB", **options) as ld, \
                fastio.Loader(local, **options) as want:
            got = list(ld)
            assert len(got) == len(want) > 10
            assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want, strict=True))
    rc, out = run(capsys, "index", f"s3://{s3_bucket}/mega", "--eos-id", EOS, "--dest", tmp_path / "here")
    assert rc == 2 and "pairs on an object store are indexed into an s3:// DEST" in out, out


@pytest.mark.parametrize("damage,message", [
    ("no-idx", r"s3://{b}/mega/part-000\.bin: has no partner part-000\.idx"),
    ("truncate", r"s3://{b}/mega/part-001\.bin: 20 bytes, but part-001\.idx indexes \d+ .*truncated"),
    ("other-dtype", r"s3://{b}/mega/part-001\.idx: holds int32 tokens, expected uint16"),
    ("wrong-eos", r"s3://{b}/mega/part-000\.bin: document 0 ends with token \d+, not eos_id 2"),
])
def test_hostile_s3_pairs_refused_in_one_line_naming_the_url(tmp_path, aws_env, s3_bucket, capsys, damage, message):
    from fastio.storage import open_storage

    local = _pairs_folder(tmp_path / "local", docs=20)
    if damage == "no-idx":
        (local / "part-000.idx").unlink()
    elif damage == "truncate":
        with open(local / "part-001.bin", "r+b") as f:
            f.truncate(20)
    elif damage == "other-dtype":
        other = _pairs_folder(tmp_path / "other", dtype="int32", docs=20)
        for suffix in (".bin", ".idx"):
            (local / f"part-001{suffix}").write_bytes((other / f"part-001{suffix}").read_bytes())
    else:
        raw = bytearray((local / "part-000.bin").read_bytes())
        end = int(np.diff(np.r_[0, MegatronIndex(local / "part-000.idx").starts(np.array([1]))])[0])
        raw[2 * end - 2] = 7  # document 0's last token (uint16): 7, not EOS
        (local / "part-000.bin").write_bytes(bytes(raw))
    store = open_storage(f"s3://{s3_bucket}")
    _upload(store, local, "mega")
    rc, out = run(capsys, "index", f"s3://{s3_bucket}/mega", "--eos-id", EOS)
    assert rc == 2 and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert out.startswith("fastio: error: ")
    import re

    assert re.search(message.format(b=s3_bucket), out), out
    assert not store.exists("mega/manifest.json")


def test_a_megatron_data_prefix_or_one_file_of_a_pair_is_named_with_its_folder(tmp_path, capsys):
    # Found by review: a Megatron user names data by its prefix (--data-path data/web_text_document) or one file of
    # the pair; fastio index said 'no such folder' of a file that exists, not what it takes instead.
    data = tmp_path / "data"
    megatron_pair(data, "web_text_document", DOCS)
    for given in ("web_text_document", "web_text_document.bin", "web_text_document.idx"):
        rc, out = run(capsys, "index", data / given, "--eos-id", EOS)
        assert rc == 2 and out.count("\n") == 1, out
        assert out.startswith(f"fastio: error: {data / given}: ") and "no such folder" not in out, out
        assert f"give its folder, {data}" in out, out
    assert not (data / "manifest.json").exists()
    rc, out = run(capsys, "index", data / "nope", "--eos-id", EOS)
    assert rc == 2 and f"{data / 'nope'}: no such folder" in out, out


def test_the_loader_given_megatron_pairs_not_yet_indexed_names_fastio_index(tmp_path, capsys):
    # Found by review: a Loader (or verify, inspect) given a folder of Megatron pairs, a data prefix or a .bin said
    # 'not a fastio dataset (no manifest.json; an interrupted conversion?)', or 'no such dataset directory' /
    # 'a file' without the command that makes the pairs a dataset.
    import fastio
    from fastio.errors import DatasetError

    data = tmp_path / "data"
    megatron_pair(data, "web_text_document", DOCS)
    index = rf"`fastio index {data} --eos-id N`"
    for given in ("", "web_text_document", "web_text_document.bin"):
        with pytest.raises(DatasetError, match=rf"^{data / given if given else data}: .*Megatron.*{index}"):
            fastio.Loader(data / given if given else data, pipeline=fastio.Tokens(seq_len=4), batch_size=1,
                          device="cpu")
    rc, out = run(capsys, "verify", data)
    assert rc == 2 and out.count("\n") == 1 and f"fastio index {data} --eos-id N" in out, out


def test_indexing_the_shards_folder_of_a_dataset_is_refused_and_leaves_that_dataset_whole(tmp_path, capsys):
    # Found by review: `fastio index DATASET/shards --eos-id N` (the folder that holds the .bin/.idx files) wrote a
    # manifest.json and doc-starts.fxs among DATASET's shards, and `fastio verify DATASET` then failed ('file is not
    # listed in the manifest').
    data = tmp_path / "data"
    megatron_pair(data, "web_text_document", DOCS)
    index_tokens(TokenIndexConfig(data, eos_id=EOS, dest=tmp_path / "ds"))
    shards = tmp_path / "conv" / "shards"
    shards.mkdir(parents=True)
    for f in data.iterdir():
        (shards / f.name).write_bytes(f.read_bytes())
    (tmp_path / "conv" / "manifest.json").write_text((tmp_path / "ds" / "manifest.json").read_text())
    before = sorted(p.name for p in shards.iterdir())
    for args in ([shards], [data, "--dest", shards], [shards, "--overwrite"]):
        rc, out = run(capsys, "index", *args, "--eos-id", EOS)
        assert rc == 2 and out.count("\n") == 1, out
        assert f"{shards}: the shards/ folder of the dataset {tmp_path / 'conv'}" in out, out
    assert sorted(p.name for p in shards.iterdir()) == before
    rc, out = run(capsys, "index", shards, "--eos-id", EOS, "--dest", tmp_path / "view")  # a view elsewhere: fine
    assert rc == 0, out
