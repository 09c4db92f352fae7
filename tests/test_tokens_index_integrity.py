"""A token dataset's index kept true (issue 30): ``fastio index`` of Megatron pairs (local and s3://: reruns,
races, faults, interrupted runs, foreign and hidden files, DEST spellings, hostile pairs), the document-starts table
(doc-starts.fxs: stale, short, truncated, extended or swapped tables refused at open and by verify) and the
manifest's ``tokens.one_sequence_per_document`` (old manifests, false claims), with real files."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

import fastio
from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import load_manifest, write_manifest
from fastio.errors import DatasetError, FastioError
from fastio.formats.megatron import MegatronWriter
from fastio.report.verify import verify
from fastio.tokens.starts import STARTS_EVERY, STARTS_NAME

EOS = 0


def _pair(path, lengths, seed=0):
    """A pair of documents of ``lengths`` tokens (ids 1..299, each ending with EOS)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    tokens = rng.integers(1, 300, int(lengths.sum()))
    tokens[np.cumsum(lengths)[lengths > 0] - 1] = EOS
    w = MegatronWriter(path, "uint16")
    w.add_documents(tokens, lengths)
    w.close()


def _corpus(folder, shards=(2500, 1024, 700), seed=4):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for k, docs in enumerate(shards):
        _pair(folder / f"s-{k}.bin", rng.integers(1, 9, docs), seed + k)
    index_tokens(TokenIndexConfig(folder, EOS))
    return folder


def _batches(folder, window=2 * STARTS_EVERY, packing="concat", **options):
    with fastio.Loader(folder, pipeline=fastio.Tokens(seq_len=32, window=window, packing=packing), batch_size=4,
                       device="cpu", seed=1, **options) as ld:
        return [b["tokens"].tolist() for b in ld]


def _bare(folder, dest, **fields):
    """``folder``'s pairs (hard links) under a manifest whose tokens info has ``fields`` replaced."""
    dest.mkdir()
    for p in folder.iterdir():
        if p.suffix in (".bin", ".idx"):
            os.link(p, dest / p.name)
    m = load_manifest(folder)
    write_manifest(dest, replace(m, tokens=replace(m.tokens, **fields)))
    return dest


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_stale_table_after_a_same_size_idx_is_replaced_is_refused_not_read(tmp_path, packing):
    """s-0's pair replaced by one of the same documents and tokens, other lengths: the table's block edges are
    no longer the .idx's; reading must refuse (naming the .idx) rather than deliver batches that cut documents
    at the table's edges while reading them at the .idx's."""
    folder = _corpus(tmp_path / "c")
    m = load_manifest(folder)
    lengths = np.full(2500, 4)
    lengths[:1024] = 3  # 2500 documents, the same 10,000 tokens as before? made equal below
    total = m.shards[0].tokens
    lengths[-1] += total - int(lengths.sum())
    assert lengths.min() > 0
    _pair(folder / "s-0.bin", lengths, seed=9)
    with pytest.raises(DatasetError, match=r"s-0\.idx: the document starts table disagrees with it"):
        _batches(folder, packing=packing)


def test_an_old_manifest_without_the_new_fields_gives_bitwise_the_same_batches(tmp_path):
    folder = _corpus(tmp_path / "c")
    old = _bare(folder, tmp_path / "old", starts=None, one_sequence_per_document=False)
    text = (old / "manifest.json").read_text()
    assert "one_sequence_per_document" not in text and STARTS_NAME not in text
    assert _batches(old) == _batches(folder)
    assert verify(old).ok


@pytest.mark.parametrize("window", [1000, 1536, 3 * STARTS_EVERY, 100])
def test_a_window_off_the_tables_grid_gives_the_batches_of_no_table(tmp_path, window):
    folder = _corpus(tmp_path / "c")
    assert _batches(folder, window) == _batches(_bare(folder, tmp_path / "b", starts=None), window)


def test_empty_bin_and_empty_documents_index_load_and_verify(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    _pair(folder / "a.bin", [])  # no documents: an empty .bin
    _pair(folder / "b.bin", [0] * 1500 + [5] * 600)  # empty documents on the table's grid, then some tokens
    _pair(folder / "c.bin", [0, 0])  # documents, no tokens: an empty .bin
    _pair(folder / "d.bin", [3] * 40)
    index_tokens(TokenIndexConfig(folder, EOS))
    m = load_manifest(folder)
    assert [s.samples for s in m.shards] == [0, 2100, 2, 40] and m.tokens.total_tokens == 3120
    assert verify(folder).ok
    got = _batches(folder, shuffle="none", remainder="partial")
    assert got == _batches(_bare(folder, tmp_path / "b", starts=None), shuffle="none", remainder="partial")
    flat = [t for batch in got for row in batch for t in row[:-1]]
    assert len(flat) == (3120 - 1) // 32 * 32 and 640 - 16 <= flat.count(EOS) <= 640


def test_index_twice_is_refused_then_overwrite_rewrites_the_table_for_changed_pairs(tmp_path, capsys):
    from fastio.cli import main

    folder = _corpus(tmp_path / "c")
    before = (folder / STARTS_NAME).read_bytes()
    capsys.readouterr()
    assert main(["index", str(folder), "--eos-id", str(EOS)]) == 2
    out = capsys.readouterr().err
    assert out.startswith("fastio: error: ") and "already holds a manifest" in out and len(out.splitlines()) == 1
    _pair(folder / "s-1.bin", np.full(1024, 5), seed=2)  # another pair under the same name
    assert main(["index", str(folder), "--eos-id", str(EOS), "--overwrite"]) == 0
    assert (folder / STARTS_NAME).read_bytes() != before
    assert verify(folder).ok
    assert _batches(folder) == _batches(_bare(folder, tmp_path / "b", starts=None))


def test_verify_finds_a_manifest_claiming_one_sequence_per_document_wrongly(tmp_path):
    """Documents of several sequences, as many as the sequences (an empty document and a two-sequence one): the
    counts agree, only doc_index says otherwise."""
    import struct

    from fastio.formats.megatron import HEADER_BYTES, MAGIC

    folder = _corpus(tmp_path / "c", shards=(40,))
    idx = folder / "s-0.idx"
    raw = bytearray(idx.read_bytes())
    n = struct.unpack_from("<Q", raw, 18)[0]
    docs = np.arange(n + 1, dtype="<i8")
    docs[1] = 0  # document 0: no sequence; document 1: sequences 0 and 1
    raw[HEADER_BYTES + 12 * n:] = docs.tobytes()
    assert raw[:9] == MAGIC
    idx.write_bytes(bytes(raw))
    problems = [str(p) for p in verify(folder).problems]
    assert any("s-0" in p and "spans several sequences" in p for p in problems), problems


def _race(folder, overwrite, queue):
    from fastio.errors import FastioError

    try:
        index_tokens(TokenIndexConfig(folder, EOS, overwrite=overwrite))
        queue.put("ok")
    except FastioError as err:
        queue.put(f"refused: {err}")


@pytest.mark.parametrize("overwrite", [False, True])
def test_concurrent_index_into_one_dest(tmp_path, overwrite):
    import multiprocessing

    folder = tmp_path / "c"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for k in range(3):
        _pair(folder / f"s-{k}.bin", rng.integers(1, 9, 3000), k)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(folder, overwrite, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got.count("ok") >= 1 and all(g == "ok" or "\n" not in g for g in got), got
    if not overwrite:
        assert all(g == "ok" or "already holds a manifest" in g or "lock" in g.lower() for g in got), got
    assert verify(folder).ok
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".") and "lock" not in p.name]


def _s3_corpus(tmp_path, bucket, prefix="mega"):
    """Pairs (one of them empty) uploaded under ``prefix`` beside files that are not pairs; the local folder."""
    from fastio.storage import open_storage

    local = tmp_path / "local"
    local.mkdir()
    rng = np.random.default_rng(2)
    _pair(local / "a.bin", [])
    _pair(local / "b.bin", rng.integers(1, 9, 1500), 1)
    _pair(local / "c.bin", rng.integers(1, 9, 300), 2)
    store = open_storage(f"s3://{bucket}")
    for path in sorted(local.iterdir()):
        store.put_file(f"{prefix}/{path.name}", path)
    store.put_bytes(f"{prefix}/README.md", b"# the web crawl, tokenized\n")
    store.put_bytes(f"{prefix}/tokenizer.json", b"{}")
    store.put_bytes(f"{prefix}/sub/z.bin", b"below the prefix")
    index_tokens(TokenIndexConfig(local, EOS))
    return store, local


def test_s3_index_beside_foreign_files_and_an_interrupted_earlier_run(tmp_path, aws_env, s3_bucket, capsys):
    """A prefix holding other files, an empty pair, and what an interrupted earlier index left (its table, its
    marker, no manifest): indexed in place and elsewhere without --overwrite; verify on s3:// passes; a Loader
    through the cache gives the local folder's batches."""
    from fastio.cli import main

    store, local = _s3_corpus(tmp_path, s3_bucket)
    store.put_bytes(f"mega/{STARTS_NAME}", b"half a table")
    store.put_bytes(f"meta/{STARTS_NAME}", b"half a table")
    store.put_bytes("meta/.fastio-output", b"fastio index output; complete once manifest.json exists\n")
    capsys.readouterr()
    url = f"s3://{s3_bucket}/mega"
    assert main(["index", url, "--eos-id", str(EOS)]) == 0, capsys.readouterr()
    assert main(["index", url, "--eos-id", str(EOS), "--dest", f"s3://{s3_bucket}/meta"]) == 0, capsys.readouterr()
    want = _batches(local)
    for where in (url, f"s3://{s3_bucket}/meta"):
        report = verify(where)
        assert report.ok, report.problems
        assert _batches(where, cache_dir=str(tmp_path / "cache"), cache_size="1GB") == want
    assert main(["index", url, "--eos-id", str(EOS)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastio: error: {url}") and "already holds a manifest" in err and err.count("\n") == 1


def test_s3_verify_and_loader_refuse_a_damaged_or_swapped_table(tmp_path, aws_env, s3_bucket, capsys):
    from fastio.cli import main

    store, local = _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    assert main(["index", url, "--eos-id", str(EOS)]) == 0
    other = _corpus(tmp_path / "other", shards=(1500, 300, 2))  # another dataset's table, same shard count
    store.put_file(f"mega/{STARTS_NAME}", other / STARTS_NAME)
    problems = [str(p) for p in verify(url).problems]
    assert problems and all(STARTS_NAME in p for p in problems), problems
    with pytest.raises(DatasetError, match=r"doc-starts\.fxs: document starts table does not match the manifest"):
        _batches(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB")
    capsys.readouterr()
    assert main(["verify", url]) != 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and STARTS_NAME in out.out + out.err


def test_concurrent_s3_index_into_one_prefix(tmp_path, aws_env, s3_bucket):
    """Three processes index one s3:// prefix in place at once: one publishes, the others are refused in one line
    (the prefix's lease, or its manifest); the result verifies."""
    import multiprocessing

    _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(url, False, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got.count("ok") == 1 and all(g == "ok" or (url in g and "\n" not in g) for g in got), got
    report = verify(url)
    assert report.ok, report.problems


def test_a_dest_that_is_the_source_spelled_otherwise_indexes_in_place(tmp_path, monkeypatch):
    """--dest data/, ./data, its absolute path or a link to it: the pairs are named relative to DEST (as without
    --dest), not by absolute path (which would tie a moved or copied folder to the old one's files)."""
    folder = _corpus(tmp_path / "data", shards=(30,))
    want = load_manifest(folder)
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    for dest in ("data/", "./data", str(folder), "link"):
        index_tokens(TokenIndexConfig("data", EOS, dest=dest, overwrite=True))
        assert [s.location for s in load_manifest(folder).shards] == [s.location for s in want.shards] == ["s-0.bin"]


def test_an_s3_dest_that_is_the_source_with_a_slash_indexes_in_place(tmp_path, aws_env, s3_bucket):
    _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    index_tokens(TokenIndexConfig(url, EOS, dest=url + "/"))
    assert [s.location for s in fastio.Dataset(url, cache_dir=tmp_path / "c").manifest.shards] == [
        "a.bin", "b.bin", "c.bin"]


def test_a_missing_table_is_one_line_naming_it_locally_and_on_s3(tmp_path, aws_env, s3_bucket, capsys):
    from fastio.cli import main

    folder = _corpus(tmp_path / "c", shards=(30, 40))
    (folder / STARTS_NAME).unlink()
    with pytest.raises(DatasetError, match=r"doc-starts\.fxs: document starts table cannot be read"):
        _batches(folder)
    assert [str(p) for p in verify(folder).problems] == [f"Problem(shard='{STARTS_NAME}', key=None, "
                                                         "what='document starts table is missing')"]
    store, _ = _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    index_tokens(TokenIndexConfig(url, EOS))
    store.delete(f"mega/{STARTS_NAME}")
    with pytest.raises(FastioError, match=rf"{url}/doc-starts\.fxs: GET failed: not found"):
        _batches(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB")
    capsys.readouterr()
    rc = main(["verify", url])
    out = capsys.readouterr()
    assert rc != 0 and "Traceback" not in out.err and STARTS_NAME in out.out + out.err, out


def test_local_pairs_into_an_s3_dest_are_refused_in_one_line(tmp_path, aws_env, s3_bucket, capsys):
    """A manifest on s3:// cannot name files on this machine's disk: refused before anything is uploaded."""
    from fastio.cli import main
    from fastio.storage import open_storage

    folder = tmp_path / "data"
    folder.mkdir()
    _pair(folder / "a.bin", [3] * 20)
    capsys.readouterr()
    rc = main(["index", str(folder), "--eos-id", str(EOS), "--dest", f"s3://{s3_bucket}/meta"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"fastio: error: s3://{s3_bucket}/meta") and err.count("\n") == 1, err
    assert not list(open_storage(f"s3://{s3_bucket}").list(""))


@pytest.mark.parametrize("dest,message", [("afile", "afile: DEST exists and is not a directory"),
                                          ("afile/sub", "afile/sub: DEST cannot be made: .*afile is not a directory")])
def test_a_dest_that_cannot_be_a_folder_is_named_as_such(tmp_path, monkeypatch, capsys, dest, message):
    import re

    from fastio.cli import main

    folder = tmp_path / "data"
    folder.mkdir()
    _pair(folder / "a.bin", [3] * 20)
    (tmp_path / "afile").write_text("a file")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["index", "data", "--eos-id", str(EOS), "--dest", dest]) == 2
    err = capsys.readouterr().err
    assert re.match(f"fastio: error: .*{message}", err) and err.count("\n") == 1, err


@pytest.mark.parametrize("cut", [22, 30, 40, 60])
def test_a_short_table_that_its_record_matches_is_one_line(tmp_path, cut):
    """A table cut inside its counts or entries, under a manifest record made for it: DatasetError naming it (at
    open and in verify), never numpy's ValueError."""
    import hashlib

    import xxhash

    from fastio.dataset.manifest import IndexRecord
    from fastio.storage.atomic import atomic_write_bytes

    folder = _corpus(tmp_path / "c", shards=(30, 40, 50))
    m = load_manifest(folder)
    data = (folder / STARTS_NAME).read_bytes()[:cut]
    record = IndexRecord(name=STARTS_NAME, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                         xxh3_128=xxhash.xxh3_128_hexdigest(data))
    atomic_write_bytes(folder / STARTS_NAME, data)
    write_manifest(folder, replace(m, tokens=replace(m.tokens, starts=record)))
    with pytest.raises(DatasetError, match=r"doc-starts\.fxs: "):
        _batches(folder)
    problems = [str(p) for p in verify(folder).problems]
    assert problems and all(STARTS_NAME in p for p in problems), problems


def test_documents_of_several_sequences_and_none_read_the_same_through_the_table(tmp_path):
    """A Megatron .idx whose documents are 0 to 3 sequences (sentence splitting): the table's entries are the
    doc_index's, and a Loader gives the batches of no table; verify passes."""
    import struct

    from fastio.formats.megatron import HEADER_BYTES, MAGIC

    folder = tmp_path / "c"
    folder.mkdir()
    rng = np.random.default_rng(6)
    _pair(folder / "s-0.bin", rng.integers(1, 9, 6000), 3)  # 6,000 sequences, each ending with EOS
    raw = (folder / "s-0.idx").read_bytes()
    n = struct.unpack_from("<Q", raw, 18)[0]
    per_doc = rng.integers(0, 4, 4000)
    per_doc[-1] += n - int(per_doc.sum()) if per_doc.sum() < n else 0
    docs = np.minimum(np.r_[0, np.cumsum(per_doc)], n).astype("<i8")
    docs[-1] = n
    head = MAGIC + struct.pack("<QBQQ", 1, 8, n, docs.size)
    (folder / "s-0.idx").write_bytes(head + raw[HEADER_BYTES:HEADER_BYTES + 12 * n] + docs.tobytes())
    index_tokens(TokenIndexConfig(folder, EOS))
    m = load_manifest(folder)
    assert not m.tokens.one_sequence_per_document and m.shards[0].samples == 4000 and m.tokens.starts
    assert verify(folder).ok
    assert _batches(folder) == _batches(_bare(folder, tmp_path / "b", starts=None))


def test_s3_index_through_faults_gives_the_clean_runs_manifest(tmp_path, aws_env, moto_server, s3_bucket,
                                                                 fault_proxy):
    """503s, then GETs cut halfway (retried by fastio.storage): the same shard records and tokens info as without.
    Every request is faulted once (rate 1, one fault in a row), a proxy for each kind: which requests a seeded
    rate hits depends on the bucket's random name."""
    from s3server import FaultProxy

    from fastio.storage import open_storage

    _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    index_tokens(TokenIndexConfig(url, EOS, dest=f"s3://{s3_bucket}/clean"))
    fault_proxy.slowdown, fault_proxy.max_faults = 1.0, 1
    cutter = FaultProxy(moto_server.port, cut=1.0, max_faults=1)
    try:
        for proxy, dest in ((fault_proxy, "slowed"), (cutter, "cut")):
            options = moto_server.options(proxy.endpoint, backoff_s=0.01)
            index_tokens(TokenIndexConfig(url, EOS, dest=f"s3://{s3_bucket}/{dest}", storage_options=options))
    finally:
        cutter.stop()
    assert fault_proxy.counts["slowdown"] > 0 and cutter.counts["cut"] > 0
    store = open_storage(f"s3://{s3_bucket}")
    for dest in ("slowed", "cut"):
        for name in ("manifest.json", STARTS_NAME):
            assert store.get(f"{dest}/{name}") == store.get(f"clean/{name}"), (dest, name)


def test_s3_index_whose_manifest_upload_is_refused_publishes_nothing_readable_and_reruns(
        tmp_path, aws_env, moto_server, s3_bucket, fault_proxy, capsys):
    """The manifest's PUT refused (403): one line, no manifest under DEST (nothing a reader would take for a
    dataset); the rerun without --overwrite publishes it."""
    from fastio.cli import main
    from fastio.storage import open_storage

    _s3_corpus(tmp_path, s3_bucket)
    url = f"s3://{s3_bucket}/mega"
    fault_proxy.forbidden = {"meta/manifest.json"}
    options = moto_server.options(fault_proxy.endpoint, backoff_s=0.01)
    with pytest.raises(FastioError, match=rf"s3://{s3_bucket}/meta/manifest\.json"):
        index_tokens(TokenIndexConfig(url, EOS, dest=f"s3://{s3_bucket}/meta", storage_options=options))
    store = open_storage(f"s3://{s3_bucket}")
    assert not store.exists("meta/manifest.json")
    capsys.readouterr()
    assert main(["index", url, "--eos-id", str(EOS), "--dest", f"s3://{s3_bucket}/meta"]) == 0, capsys.readouterr()
    assert verify(f"s3://{s3_bucket}/meta").ok


def test_a_run_begun_on_an_old_manifest_resumes_bitwise_after_fastio_index_adds_the_new_fields(tmp_path):
    """A checkpoint taken mid-epoch under a manifest without tokens.starts / one_sequence_per_document, resumed
    after the folder is indexed again (both fields now there): the rest of the epoch, bitwise."""
    folder = _corpus(tmp_path / "c")
    old = _bare(folder, tmp_path / "old", starts=None, one_sequence_per_document=False)
    options = {"pipeline": fastio.Tokens(seq_len=32, window=2 * STARTS_EVERY), "batch_size": 4, "device": "cpu",
               "seed": 1}
    with fastio.Loader(old, **options) as ld:
        it = iter(ld)
        head = [next(it)["tokens"].tolist() for _ in range(7)]
        state = ld.state_dict()
        rest = [b["tokens"].tolist() for b in it]
    index_tokens(TokenIndexConfig(old, EOS, overwrite=True))
    m = load_manifest(old)
    assert m.tokens.starts is not None and m.tokens.one_sequence_per_document
    with fastio.Loader(old, **options) as ld:
        ld.load_state_dict(state)
        assert [b["tokens"].tolist() for b in ld] == rest
    assert len(head) == 7 and len(rest) > 10


def _negative_id_pair(folder):
    """An int32 pair whose document 3 holds token id -7 (a corrupted .bin: an embedding lookup's device assert)."""
    folder.mkdir()
    lengths = np.full(10, 5)
    tokens = np.arange(1, 51, dtype=np.int64)
    tokens[np.cumsum(lengths) - 1] = EOS
    w = MegatronWriter(folder / "a.bin", "int32")
    w.add_documents(tokens, lengths)
    w.close()
    raw = bytearray((folder / "a.bin").read_bytes())
    raw[4 * 17:4 * 18] = np.int32(-7).tobytes()  # token 17: document 3's third
    (folder / "a.bin").write_bytes(bytes(raw))
    return folder


def test_a_negative_token_id_is_refused_by_index_and_found_by_verify(tmp_path, aws_env, s3_bucket, capsys):
    from fastio.cli import main
    from fastio.storage import open_storage

    folder = _negative_id_pair(tmp_path / "c")
    capsys.readouterr()
    assert main(["index", str(folder), "--eos-id", str(EOS)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastio: error: {folder / 'a.bin'}: document 3 holds token id -7") and err.count("\n") == 1
    store = open_storage(f"s3://{s3_bucket}")
    for name in ("a.bin", "a.idx"):
        store.put_file(f"mega/{name}", folder / name)
    with pytest.raises(DatasetError, match=rf"s3://{s3_bucket}/mega/a\.bin: document 3 holds token id -7"):
        index_tokens(TokenIndexConfig(f"s3://{s3_bucket}/mega", EOS))
    good = tmp_path / "good"
    good.mkdir()
    raw = bytearray((folder / "a.bin").read_bytes())
    raw[4 * 17:4 * 18] = np.int32(18).tobytes()
    (good / "a.bin").write_bytes(bytes(raw))
    (good / "a.idx").write_bytes((folder / "a.idx").read_bytes())
    index_tokens(TokenIndexConfig(good, EOS))
    (good / "a.bin").write_bytes((folder / "a.bin").read_bytes())  # the negative id back, after indexing
    problems = [str(p) for p in verify(good).problems]
    assert any("a.bin" in p and "token id -7" in p for p in problems), problems


@pytest.mark.parametrize("damage", ["truncated", "extended", "swapped"])
def test_a_table_truncated_extended_or_swapped_in_is_refused_at_open_and_by_verify(tmp_path, damage):
    folder = _corpus(tmp_path / "c")
    table = folder / STARTS_NAME
    if damage == "truncated":
        table.write_bytes(table.read_bytes()[:-8])
    elif damage == "extended":
        table.write_bytes(table.read_bytes() + np.int64(99).tobytes())
    else:  # another dataset's table, same shard count and document counts, other tokens
        table.write_bytes((_corpus(tmp_path / "other", seed=8) / STARTS_NAME).read_bytes())
    with pytest.raises(DatasetError, match=r"doc-starts\.fxs: document starts table does not match the manifest"):
        _batches(folder)
    problems = [str(p) for p in verify(folder).problems]
    assert problems and all(STARTS_NAME in p for p in problems), problems


def test_a_manifest_falsely_claiming_one_sequence_per_document_is_caught_through_the_table(tmp_path):
    """Documents as many as the sequences, but document 1,023 empty and 1,024 two sequences: the counts agree, so
    the claim passes the open; the table (taken through doc_index) then disagrees with the .idx read as if each
    document were its sequence: refused when the block is read, and by verify."""
    import struct

    from fastio.formats.megatron import HEADER_BYTES, MAGIC

    folder = tmp_path / "c"
    folder.mkdir()
    _pair(folder / "s-0.bin", np.random.default_rng(7).integers(1, 9, 3000), 3)
    raw = (folder / "s-0.idx").read_bytes()
    n = struct.unpack_from("<Q", raw, 18)[0]
    per_doc = np.ones(n, np.int64)
    per_doc[1023], per_doc[1024] = 0, 2
    docs = np.r_[0, np.cumsum(per_doc)].astype("<i8")
    (folder / "s-0.idx").write_bytes(MAGIC + struct.pack("<QBQQ", 1, 8, n, n + 1) + raw[HEADER_BYTES:HEADER_BYTES + 12 * n]
                                     + docs.tobytes())
    index_tokens(TokenIndexConfig(folder, EOS))
    m = load_manifest(folder)
    assert not m.tokens.one_sequence_per_document and m.shards[0].samples == n
    write_manifest(folder, replace(m, tokens=replace(m.tokens, one_sequence_per_document=True)))
    with pytest.raises(DatasetError, match=r"s-0\.idx: the document starts table disagrees with it"):
        _batches(folder)
    assert any("spans several sequences" in str(p) for p in verify(folder).problems)


def test_token_parts_merged_give_the_whole_runs_table_and_batches(tmp_path):
    """fastio convert --part K/3 then fastio merge over 3,000 documents (shards of 1,300: table entries past 0,
    shards re-packed across the parts' cuts): the table and every batch are the single conversion's."""
    import json

    from tokens_helpers import train_tokenizer

    from fastio.convert.merge import merge
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    tok = train_tokenizer(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta".split()
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 6))))}) + "\n"
                           for _ in range(3000)))
    options = {"workers": 1, "batch_size": 256, "max_samples_per_shard": 1300}
    convert_tokens(TokenConvertConfig(src, tmp_path / "whole", tok, **options))
    for k in (2, 0, 1):
        convert_tokens(TokenConvertConfig(src, tmp_path / "ds", tok, part=(k, 3), **options))
    merge(tmp_path / "ds")
    assert (tmp_path / "ds" / STARTS_NAME).read_bytes() == (tmp_path / "whole" / STARTS_NAME).read_bytes()
    assert [s.samples for s in load_manifest(tmp_path / "ds").shards] == [1300, 1300, 400]
    assert verify(tmp_path / "ds").ok
    assert _batches(tmp_path / "ds") == _batches(tmp_path / "whole")


@pytest.mark.parametrize("cut", [20, 40, -8])
def test_a_partly_uploaded_idx_on_s3_is_refused_naming_its_url(tmp_path, aws_env, s3_bucket, capsys, cut):
    """An .idx object that is the start of the file (an upload cut short, copied as it was): one line naming it."""
    from fastio.cli import main

    store, local = _s3_corpus(tmp_path, s3_bucket)
    store.put_bytes("mega/b.idx", (local / "b.idx").read_bytes()[:cut])
    url = f"s3://{s3_bucket}/mega"
    capsys.readouterr()
    assert main(["index", url, "--eos-id", str(EOS)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastio: error: {url}/b.idx: ") and err.count("\n") == 1, err
    assert not store.exists("mega/manifest.json")


def test_hidden_files_are_not_pairs_locally_or_on_s3(tmp_path, aws_env, s3_bucket):
    """macOS's AppleDouble ``._a.bin``/``._a.idx`` and a hidden ``.old.bin`` beside the pairs: left out of the listing,
    as fastio index of WebDataset shards leaves hidden files out (and verify does)."""
    store, local = _s3_corpus(tmp_path, s3_bucket)
    want = load_manifest(local)
    for name, data in (("._b.bin", b"\x00\x05\x16\x07" * 8), ("._b.idx", b"\x00\x05\x16\x07" * 8),
                       (".old.bin", b"\x01\x00" * 4)):
        (local / name).write_bytes(data)
        store.put_bytes(f"mega/{name}", data)
    for where in (local, f"s3://{s3_bucket}/mega"):
        index_tokens(TokenIndexConfig(where, EOS, overwrite=True))
        m = fastio.Dataset(where, cache_dir=tmp_path / "cache").manifest
        assert [(s.name, s.sha256) for s in m.shards] == [(s.name, s.sha256) for s in want.shards]
    assert verify(local).ok
