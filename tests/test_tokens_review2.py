"""Hostile review of the packed-token read path (issue 30): resume with grouped reads in flight, epoch jumps,
block tables through the Loader, int32 tokens, documents longer than a block, an ``s3://`` dataset read through
a small cache, ``.bin`` files cut or replaced under a running Loader, and no map or fd left after close."""

from __future__ import annotations

import gc
import json
import os
import shutil
from itertools import islice

import numpy as np
import pytest
from resume import batches, check_resume
from test_tokens_read import _reference
from tokens_helpers import word_corpus

import fastio
from fastio.errors import DatasetError
from fastio.tokens import packing as packing_module
from fastio.tokens.dataset import TokenDataset


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("review2"))


def _loader(data, packing="concat", seq_len=16, window=8, **options):
    options = {"batch_size": 3, "device": "cpu", "seed": 5, "reader_threads": 1, "prefetch": 8, "read_ahead": 8,
               **options}
    return fastio.Loader(data, pipeline=fastio.Tokens(seq_len=seq_len, packing=packing, window=window), **options)


def _own(corpus, tmp_path, name="own"):
    """A copy of the corpus mapped by this test's Loaders alone."""
    own = tmp_path / name
    shutil.copytree(corpus, own)
    return own


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
@pytest.mark.parametrize("table", ["whole", "blocks"])
def test_resume_mid_epoch_with_grouped_reads_in_flight_is_bitwise(corpus, packing, table, monkeypatch):
    if table == "blocks":
        monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    state = check_resume(lambda: _loader(corpus, packing), n=5, k=12)  # past the epoch's end too
    assert state["consumed"] > 0


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_set_epoch_jumps_read_that_epochs_tokens(corpus, packing, monkeypatch):
    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    with _loader(corpus, packing) as ld:
        for epoch in (7, 2, 7):
            ld.set_epoch(epoch)
            plan = [ids for ids, _ in ld._sampler.plan(epoch).iter_batches()]
            got = list(ld)
            assert len(got) == len(plan)
            for batch, ids in zip(got, plan):
                tokens, mask = _reference(ld._reader, ids)
                assert np.array_equal(batch["tokens"].numpy(), tokens)
                assert np.array_equal(batch["loss_mask"].numpy() if "loss_mask" in batch else np.ones_like(mask), mask)


def _vocab_corpus(root, vocab=70_000, docs=60, long=0):
    """A token dataset of a word-level tokenizer of ``vocab`` words (int32 tokens past 65535), ``docs`` documents
    of 1..20 words (``long``: one more of that many words), 20 documents per shard."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    words = {f"w{i}": i for i in range(vocab)}
    words["<|endoftext|>"] = vocab
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(1)
    texts = [" ".join(f"w{i}" for i in rng.integers(0, vocab, int(rng.integers(1, 20)))) for _ in range(docs)]
    if long:
        texts.insert(docs // 2, " ".join(f"w{i}" for i in rng.integers(0, vocab, long)))
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    convert_tokens(TokenConvertConfig(root / "c.jsonl", root / "ds", root / "tokenizer.json", workers=1,
                                      max_samples_per_shard=20))
    return root / "ds"


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_int32_tokens_and_a_document_longer_than_a_block(tmp_path, packing, monkeypatch):
    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    ds = _vocab_corpus(tmp_path, long=100)  # 101 tokens: longer than a block of 3 documents' sequences
    assert TokenDataset(ds).manifest.tokens.dtype in ("int32", "uint32")
    seen = 0
    with _loader(ds, packing, seq_len=8, window=3, batch_size=4) as ld:
        for epoch in (0, 1):
            plan = [ids for ids, _ in ld._sampler.plan(epoch).iter_batches()]
            for batch, ids in zip(ld, plan, strict=True):
                tokens, mask = _reference(ld._reader, ids)
                assert np.array_equal(batch["tokens"].numpy(), tokens)
                assert np.array_equal(batch["loss_mask"].numpy() if "loss_mask" in batch else np.ones_like(mask), mask)
                seen = max(seen, int(tokens.max()))
    assert seen > 65535


def _maps_and_fds(under):
    """This process's mappings and open fds of files under ``under`` (after a garbage collection)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = [line for line in f if str(under) in line]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(under)):
                fds.append(fd)
        except OSError:
            pass
    return maps, fds


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_close_with_reads_in_flight_leaves_no_map_or_fd(corpus, tmp_path):
    own = _own(corpus, tmp_path)
    for j in range(12):  # many Loaders, closed at once, mid-epoch or before the first batch
        ld = _loader(own, "best-fit" if j % 2 else "concat", batch_size=1, prefetch=16, read_ahead=16)
        it = iter(ld)
        if j % 3:
            next(it)
        ld.close()
    del ld, it
    assert _maps_and_fds(own) == ([], [])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_bin_cut_short_leaves_no_map_after_the_error(corpus, tmp_path):
    own = _own(corpus, tmp_path)
    ld = _loader(own, read_ahead=1, prefetch=1)
    it = iter(ld)
    next(it)
    for shard in (own / "shards").glob("*.bin"):
        os.truncate(shard, 2)
    with pytest.raises(DatasetError, match=r"own: shard shard-\d+\.bin: .*truncated"):
        list(it)
    ld.close()
    del ld, it
    assert _maps_and_fds(own) == ([], [])


def test_a_bin_replaced_by_rename_under_a_running_loader_reads_the_file_it_opened(corpus, tmp_path):
    """A shard replaced by a new file (a new inode, as an atomic rewrite makes it) after the Loader opened it:
    the Loader keeps reading the file it opened (never a mix of the two files' bytes)."""
    own = _own(corpus, tmp_path)
    with _loader(corpus, batch_size=4) as ref:
        want = list(islice(batches(ref), 20))
    with _loader(own, batch_size=4, read_ahead=1, prefetch=1) as ld:
        it = batches(ld)
        got = list(islice(it, 12))  # every shard opened by now (a concat epoch touches each)
        for shard in (own / "shards").glob("*.bin"):
            fresh = shard.with_suffix(".new")
            fresh.write_bytes(bytes(len(shard.read_bytes())))
            os.replace(fresh, shard)
        got += list(islice(it, 8))
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_an_s3_dataset_read_through_a_small_cache_is_the_local_one(corpus, moto_server, s3_bucket, tmp_path, threads):
    """A cache that holds a few shards (sequential order, so shards are evicted while others are read), one or two
    reader threads: the batches are the local dataset's, and no evicted shard stays mapped or open (two threads
    once leaked a released shard's descriptor, whose lock then kept the cache from evicting it)."""
    from resume import same_batch

    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/corpus"
    open_storage(url, moto_server.options()).publish_dir(corpus, keys_last=(MANIFEST_NAME,))
    biggest = max(s.stat().st_size for s in (corpus / "shards").glob("*.bin"))
    cache = tmp_path / "cache"
    opening = dict(cache_dir=str(cache), storage_options=moto_server.options(), cache_size=3 * biggest,
                   shuffle="none", reader_threads=threads)
    with _loader(url, **opening) as remote, _loader(corpus, shuffle="none", reader_threads=1) as local:
        for _ in range(2):
            for x, y in zip(remote, local, strict=True):
                assert same_batch(x, y)
        storage = remote.stats()["storage"]
        assert storage["waited_fills"] + storage["ahead_fills"] > 5  # 5 shards: some evicted and filled again
        maps, _ = _maps_and_fds(cache)
        assert not [m for m in maps if m.rstrip().endswith("(deleted)")]  # no evicted shard kept mapped
    del remote, local
    assert _maps_and_fds(cache) == ([], [])


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_local_and_s3_mixture_with_a_schedule_resumes_as_the_local_one(corpus, moto_server, s3_bucket, tmp_path,
                                                                         packing):
    """A mixture of a local and an ``s3://`` token dataset whose weights change mid-epoch, read with grouped reads in
    flight: its batches are the all-local mixture's, and a resume across the change is bitwise."""
    from resume import same_batch

    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/b"
    open_storage(url, moto_server.options()).publish_dir(corpus, keys_last=(MANIFEST_NAME,))
    schedule = [(0, {"a": 3, "b": 1}), (20, {"a": 1, "b": 2})]
    cache = dict(cache_dir=str(tmp_path / "cache"), cache_size="1GB", storage_options=moto_server.options())

    def make(remote=True):
        data = fastio.Mixture({"a": corpus, "b": url if remote else corpus}, weights=schedule,
                              **(cache if remote else {}))
        return _loader(data, packing, batch_size=4, reader_threads=2)

    with make() as ld, make(remote=False) as local:
        for x, y in zip(islice(batches(ld), 20), islice(batches(local), 20), strict=True):
            assert same_batch(x, y)
    check_resume(make, n=4, k=10)


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_elastic_resume_through_grouped_reads_and_block_tables(corpus, packing, old, new, monkeypatch):
    """An elastic resume (world size ``old`` -> ``new``) with reads grouped and block tables: every remaining
    sequence once, each batch's tokens the ones its sequences' pieces name."""
    from collections import Counter

    from resume import run_ranks

    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)

    def ids(steps):
        return [i for step in steps for b in step for i, p in zip(b["index"].tolist(), b["padded"].tolist()) if not p]

    before, states = run_ranks([_loader(corpus, packing, world_size=old, rank=r) for r in range(old)], n=3)
    ranks = [_loader(corpus, packing, world_size=new, rank=r) for r in range(new)]
    reader = ranks[0]._reader
    after, _ = run_ranks(ranks, state=states[0])
    whole, _ = run_ranks([_loader(corpus, packing)])
    assert Counter(ids(before) + ids(after)) == Counter(ids(whole)) and len(set(ids(whole))) == len(ids(whole))
    for batch in (b for step in after for b in step):
        tokens, _ = _reference(reader, batch["index"].numpy())  # epoch 0: the unit ids are the sequence ids
        assert np.array_equal(batch["tokens"].numpy(), tokens)


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_empty_shards_and_empty_documents_read_as_the_pieces(tmp_path, dtype, packing, monkeypatch):
    """Indexed Megatron pairs: an empty shard first and between two others, empty documents, ids past 65535
    (int32): every batch of two epochs (block tables) is the tokens its pieces name."""
    from fastio.convert.token_index import TokenIndexConfig, index_tokens
    from fastio.formats.megatron import MegatronWriter

    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    rng = np.random.default_rng(3)
    folder = tmp_path / "pairs"
    folder.mkdir()
    high = 70_000 if dtype == "int32" else 300
    for k, docs in enumerate([0, 90, 0, 40]):
        lengths = rng.integers(0, 12, docs)
        tokens = rng.integers(1, high, int(lengths.sum()))
        tokens[np.cumsum(lengths)[lengths > 0] - 1] = 0
        writer = MegatronWriter(folder / f"s-{k}.bin", dtype)
        writer.add_documents(tokens, lengths)
        writer.close()
    index_tokens(TokenIndexConfig(folder, 0))
    with _loader(folder, packing, seq_len=8, window=5) as ld:
        for epoch in (0, 1):
            plan = [ids for ids, _ in ld._sampler.plan(epoch).iter_batches()]
            for batch, ids in zip(ld, plan, strict=True):
                tokens, mask = _reference(ld._reader, ids)
                assert np.array_equal(batch["tokens"].numpy(), tokens)
                assert np.array_equal(batch["loss_mask"].numpy() if "loss_mask" in batch else np.ones_like(mask),
                                      mask)
