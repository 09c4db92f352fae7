"""The vectorised token read path against the reference one: ``spans`` against ``pieces`` (both packings, empty
documents and shards, sequences over many blocks), ``boundaries`` against the per-row rule, the reader's batches
(one dataset, several shards, a mixture) bitwise against the tokens ``pieces`` name, and a ``.bin`` cut short
under a running Loader refused in one line naming the shard;
resumes and epoch jumps with grouped reads in flight, int32 tokens, ``.bin`` files cut or replaced under a running
Loader, an s3:// dataset through a small cache, and no map or fd left after close."""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
from itertools import islice

import numpy as np
import pytest
from resume import batches, check_resume
from test_tokens_packing import Table
from tokens_helpers import word_corpus

import fastio
from bench.token_dataset import TokenDataset
from fastio.errors import DatasetError
from fastio.tokens import packing as packing_module
from fastio.tokens.packing import BestFitPacking, ConcatPacking, boundaries, cu_seqlens, position_ids
from fastio.words import count

EOS = 0


def _tables(seed):
    """Three shards of documents of 0..30 tokens (some empty, ending with EOS otherwise), the middle shard
    sometimes with no document at all."""
    rng = np.random.default_rng(seed)
    tables = []
    for k in range(3):
        docs = [] if (k == 1 and seed % 2) else [
            np.r_[rng.integers(1, 9, int(rng.integers(0, 30))), EOS] if rng.random() > 0.1 else np.zeros(0, np.int64)
            for _ in range(int(rng.integers(1, 40)))]
        tables.append(Table([np.asarray(d, np.int64) for d in docs]))
    return tables


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["concat", "best", "first"])
@pytest.mark.parametrize("table", ["whole", "blocks"])
def test_spans_are_the_pieces_of_each_sequence(seed, kind, table, monkeypatch):
    if table == "blocks":  # a table of the blocks a batch touches, not of the whole corpus
        monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    tables = _tables(seed)
    rng = np.random.default_rng(100 + seed)
    for seq_len, block_docs, shuffle in [(5, 1, "global"), (24, 3, "global"), (200, 7, "none"), (9, 4096, "global")]:
        common = {"seed": seed, "shuffle": shuffle, "block_docs": block_docs}
        try:
            packing = (ConcatPacking(tables, seq_len, **common) if kind == "concat"
                       else BestFitPacking(tables, seq_len, fit=kind, **common))
        except ValueError:  # too few tokens for this seq_len
            continue
        for epoch in (0, 5):
            seqs = rng.integers(0, packing.sequences, 40)  # unsorted, with repeats
            spans = packing.spans(epoch, seqs)
            want = [(row, p.shard, p.start, p.count) for row, q in enumerate(seqs.tolist())
                    for p in packing.pieces(epoch, q)]
            got = list(zip(*(a.tolist() for a in (spans.row, spans.shard, spans.start, spans.count))))
            assert got == want


class _Counting(Table):
    """A Table that counts the documents looked up (each block table built looks up its block's)."""

    looked_up = 0

    def starts(self, docs):
        _Counting.looked_up += np.asarray(docs).size
        return super().starts(docs)


def _counting_corpus(shards=4, docs=300, seed=0):
    rng = np.random.default_rng(seed)
    return [_Counting([np.r_[rng.integers(1, 9, int(rng.integers(0, 20))), EOS] for _ in range(docs)])
            for _ in range(shards)]


@pytest.mark.parametrize("kind", ["concat", "best"])
def test_block_tables_stay_built_within_the_cache_bytes(kind, monkeypatch):
    """Above STREAM_TABLE_DOCS, every block of a corpus whose tables fit BLOCK_CACHE_BYTES is built once: a second
    pass over the epoch looks nothing up (a cache of 16 blocks rebuilt them: 40 blocks here); a cache too small
    for them stays within its bytes and the spans stay the pieces."""
    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    tables = _counting_corpus()
    make = (lambda: ConcatPacking(tables, 16, seed=3, block_docs=30)) if kind == "concat" else (
        lambda: BestFitPacking(tables, 16, seed=3, block_docs=30))
    packing = make()
    order = np.random.default_rng(1).permutation(packing.sequences)
    batches = np.array_split(order, packing.sequences // 8)
    first = [packing.spans(0, b) for b in batches]
    _Counting.looked_up = 0
    again = [packing.spans(0, b) for b in batches]
    assert _Counting.looked_up == 0
    cached = [a for value, _ in packing._cache.values() for a in value]
    assert cached and all(a.base is None for a in cached)  # no view keeps a bigger array than its bytes say
    assert all(np.array_equal(x.start, y.start) and np.array_equal(x.count, y.count) for x, y in zip(first, again))
    monkeypatch.setattr(packing_module, "BLOCK_CACHE_BYTES", 2000)
    packing = make()
    for b, want in zip(batches, first):
        got = packing.spans(0, b)
        assert packing._cache_bytes <= 2000 or len(packing._cache) == 1
        assert np.array_equal(got.row, want.row) and np.array_equal(got.start, want.start)
        assert np.array_equal(got.shard, want.shard) and np.array_equal(got.count, want.count)


class _Huge:
    """Documents of 10^9 tokens (a fake shard: offsets only) starting past 2^33: block tables beyond int32."""

    documents = 40

    @property
    def tokens(self):
        return 40 * 10**9

    def starts(self, docs):
        return np.asarray(docs, np.int64) * 10**9 + (3 << 32)


@pytest.mark.parametrize("block_docs", [2, 3])  # blocks of 2e9 tokens (int32 within), of 3e9 (int64)
def test_spans_past_int32_are_the_pieces(block_docs, monkeypatch):
    monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    packing = ConcatPacking([_Huge(), _Huge()], 10**9 + 7, seed=1, block_docs=block_docs)
    seqs = np.arange(packing.sequences)
    spans = packing.spans(1, seqs)
    want = [(row, p.shard, p.start, p.count) for row in seqs.tolist() for p in packing.pieces(1, row)]
    assert list(zip(*(a.tolist() for a in (spans.row, spans.shard, spans.start, spans.count)))) == want
    assert spans.start.max() > 1 << 33 and spans.count.sum() == packing.sequences * (10**9 + 8)


def test_the_tabled_feistel_is_the_per_element_one():
    """The block order's Feistel rounds looked up in tables (many values, scalar keys) equal the rounds computed
    for each value, for every width and some tweaks: for every value at once (the width given per element, which
    keeps the per-element rounds), and for two values at a time at 128 places spread over the domain."""
    from fastio.order.feistel import feistel, round_keys

    keys = round_keys(3, "global", 1, "fingerprint", "token-docs")
    for bits in range(2, 17):
        x = np.arange(1 << bits, dtype=np.uint64)
        for tweak in (0, 12345678901234567, 2**64 - 5):
            whole = feistel(x, np.uint64(bits), keys, np.uint64(tweak))
            each = feistel(x, np.full(x.size, bits, np.uint64), keys, np.uint64(tweak))
            assert whole.dtype == np.uint64 and np.array_equal(whole, each)
            at = range(0, x.size, max(2, x.size // 128))
            alone = [feistel(x[i:i + 2], np.uint64(bits), keys, np.uint64(tweak)) for i in at]
            assert np.array_equal(np.concatenate(alone), np.concatenate([whole[i:i + 2] for i in at]))
            assert np.array_equal(np.sort(whole), x)


def test_spans_refuse_a_sequence_out_of_range():
    packing = ConcatPacking(_tables(0), 8)
    with pytest.raises(IndexError, match=rf"sequence {packing.sequences} out of range"):
        packing.spans(0, np.array([0, packing.sequences]))


def _rule_starts(rows, mask):
    starts = np.zeros(rows.shape, bool)
    starts[:, 0] = True
    starts[:, 1:] = rows[:, :-1] == EOS
    if mask is not None:
        starts[:, 1:] &= mask[:, 1:]
        starts[:, 1:] |= mask[:, :-1] & ~mask[:, 1:]
    return starts


def test_boundaries_follow_the_per_row_rule():
    """position_ids: the distance to the row's last start; cu_seqlens: the starts within the inputs
    ``tokens[:, :-1]``; a start at each row's start, after each EOS, where padding begins (masks of any form)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n, width = int(rng.integers(1, 5)), int(rng.integers(2, 12))
        rows = rng.integers(0, 4, (n, width))
        for mask in (None, rng.random((n, width)) < 0.7, np.arange(width) < rng.integers(0, width + 1, n)[:, None]):
            j = np.broadcast_to(np.arange(width), rows.shape)
            want_pos = j - np.maximum.accumulate(np.where(_rule_starts(rows, mask), j, 0), axis=1)
            inputs = _rule_starts(rows[:, :-1], None if mask is None else mask[:, :-1])
            want_cu = np.r_[np.flatnonzero(inputs.reshape(-1)), n * (width - 1)]
            pos, cu = boundaries(rows, EOS, mask)
            assert np.array_equal(pos, want_pos) and np.array_equal(cu, want_cu) and cu.dtype == np.int32
            assert np.array_equal(position_ids(rows, EOS, mask), pos) and np.array_equal(cu_seqlens(rows, EOS, mask), cu)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("read-a")), word_corpus(tmp_path_factory.mktemp("read-b"))


@functools.lru_cache
def _opened(root):
    return TokenDataset(root)


def _reference(reader, ids):
    """The batch as the reference path reads it: each sequence's ``pieces``, each piece's tokens read alone."""
    src, epochs, seqs = reader.split(ids)
    tokens = np.full((ids.size, reader.width), reader.eos_id, np.int64)
    mask = np.zeros(tokens.shape, bool)
    for row, (s, e, q) in enumerate(zip(src.tolist(), epochs.tolist(), seqs.tolist())):
        got = _opened(str(reader.sources[s].ds.root)).read(reader.sources[s].packing.pieces(e, q))
        tokens[row, :got.size], mask[row, :got.size] = got, True
    return tokens, mask


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
@pytest.mark.parametrize(("mixed", "table"), [(False, "whole"), (True, "whole"), (False, "blocks")])
def test_batches_are_bitwise_the_tokens_the_pieces_name(corpora, packing, mixed, table, monkeypatch):
    if table == "blocks":  # the tables of the blocks a batch touches, as above STREAM_TABLE_DOCS documents
        monkeypatch.setattr(packing_module, "STREAM_TABLE_DOCS", 0)
    a, b = corpora
    data = fastio.Mixture({"a": a, "b": b}, weights={"a": 2, "b": 1}) if mixed else a
    seen = 0
    for seq_len, window in [(16, 8), (40, 3)]:  # sequences across blocks and shards
        pipeline = fastio.Tokens(seq_len=seq_len, packing=packing, window=window)
        with fastio.Loader(data, pipeline=pipeline, batch_size=6, device="cpu", seed=1, reader_threads=2) as ld:
            reader = ld._reader
            for epoch in (0, 1):
                for ids, _ in ld._sampler.plan(epoch).iter_batches():
                    got = reader.read_batch(ids).arrays
                    tokens, mask = _reference(reader, ids)
                    assert np.array_equal(got["tokens"], tokens) and np.array_equal(got["loss_mask"], mask)
                    assert np.array_equal(got["position_ids"], position_ids(tokens, reader.eos_id, mask))
                    assert np.array_equal(got["cu_seqlens"], cu_seqlens(tokens, reader.eos_id, mask))
                    seen += 1
            for batch, (ids, _) in zip(ld, ld._sampler.plan(0).iter_batches(), strict=True):  # the threads' way
                assert np.array_equal(batch["tokens"].numpy(), _reference(reader, ids)[0])
    assert seen > 20


def test_a_bin_cut_short_under_a_running_loader_is_named(corpora, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpora[0], bad)
    pipeline = fastio.Tokens(seq_len=16, window=8)
    with fastio.Loader(bad, pipeline=pipeline, batch_size=4, device="cpu", seed=1, reader_threads=1,
                       read_ahead=1, prefetch=1) as ld:
        it = iter(ld)
        next(it)  # every shard's .bin mapped by now or soon: cut them all
        for shard in (bad / "shards").glob("*.bin"):
            os.truncate(shard, shard.stat().st_size // 2)
        with pytest.raises(DatasetError, match=r"bad: shard shard-\d+\.bin: .*truncated"):
            list(it)


@pytest.mark.parametrize("change", ["cut", "grown", "odd"])
def test_a_bin_of_another_size_than_the_manifests_is_refused_when_opened(corpora, tmp_path, change):
    """A .bin cut short, grown (bytes appended) or cut to an odd size before the Loader opens it: refused on its
    first read naming the shard and both sizes, even where no sequence reads past its end (a grown one delivered its
    first tokens as if nothing were wrong)."""
    bad = tmp_path / "bad"
    shutil.copytree(corpora[0], bad)
    shard = sorted((bad / "shards").glob("*.bin"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        if change == "grown":
            f.seek(0, os.SEEK_END)
            f.write(b"\0\0")
        else:
            f.truncate(size - (1 if change == "odd" else 2))
    now = shard.stat().st_size
    with fastio.Loader(bad, pipeline=fastio.Tokens(seq_len=16, window=8), batch_size=4, device="cpu", seed=1,
                       reader_threads=1) as ld:
        with pytest.raises(DatasetError) as err:
            list(ld)
    line = str(err.value)
    assert f"shard {shard.name}: {count(now, 'byte')}, the manifest says {size}" in line


def test_batches_read_together_are_the_batches_read_alone(corpora):
    pipeline = fastio.Tokens(seq_len=16, packing="best-fit", window=8)
    with fastio.Loader(corpora[0], pipeline=pipeline, batch_size=5, device="cpu", seed=2) as ld:
        reader = ld._reader
        batches = [ids for ids, _ in ld._sampler.plan(0).iter_batches()][:4]
        together = reader.read_batches(batches)
        futures = [reader.submit(ids) for ids in batches]  # submitted at once: read in groups
        for ids, got, future in zip(batches, together, futures, strict=True):
            alone = reader.read_batch(ids)
            for batch in (got, future.result(timeout=30)):
                assert np.array_equal(batch.indices, alone.indices)
                assert batch.arrays.keys() == alone.arrays.keys()
                assert all(np.array_equal(batch.arrays[k], alone.arrays[k]) for k in alone.arrays)


def test_a_failing_batch_of_a_group_fails_alone():
    from concurrent.futures import Future

    from fastio.tokens.loading import _settle

    def read(batches):
        if any(int(ids[0]) == 13 for ids in batches):
            raise DatasetError("batch 13 is bad")
        return [f"read {int(ids[0])}" for ids in batches]

    group = [(np.array([i]), Future()) for i in (11, 13, 17)]
    for _, future in group:
        future.set_running_or_notify_cancel()
    _settle(group, read)
    assert group[0][1].result() == "read 11" and group[2][1].result() == "read 17"
    with pytest.raises(DatasetError, match="batch 13 is bad"):
        group[1][1].result()


def test_a_local_dataset_is_read_in_one_thread_whatever_reader_threads_says(corpora, monkeypatch):
    import threading

    from fastio.tokens.loading import TokenReader

    threads, read = set(), TokenReader.read_batches

    def recording(self, batches):
        threads.add(threading.current_thread().name)
        return read(self, batches)

    monkeypatch.setattr(TokenReader, "read_batches", recording)
    pipeline = fastio.Tokens(seq_len=16, window=8)
    with fastio.Loader(corpora[0], pipeline=pipeline, batch_size=2, device="cpu", seed=1, reader_threads=4,
                       read_ahead=8) as ld:
        assert len(list(ld)) == len(ld) > 8
    assert len(threads) == 1 and next(iter(threads)).startswith("fastio-tokens")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_a_bin_is_mapped_for_random_reads(corpora, tmp_path):
    """A local shard's ``.bin`` is mapped advised random (``rr`` in its VmFlags): no read-around of 32 pages at
    each first touch of a sequence's few pages."""
    import shutil

    own = tmp_path / "own"  # mapped by this Loader alone (other tests' readers map the fixture's)
    shutil.copytree(corpora[0], own)
    pipeline = fastio.Tokens(seq_len=16, window=8)
    with fastio.Loader(own, pipeline=pipeline, batch_size=4, device="cpu", seed=1) as ld:
        next(iter(ld))
        flags = [f for path, f in _vm_flags(str(own)) if path.endswith(".bin")]
    assert flags and all("rr" in f for f in flags)


def _vm_flags(under: str) -> list[tuple[str, list[str]]]:
    """(path, VmFlags) of this process's mappings of files under ``under``."""
    out, path = [], ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                path = head[5] if len(head) > 5 else ""
            elif head and head[0] == "VmFlags:" and path.startswith(under):
                out.append((path, head[1:]))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("read-corpus"))


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
    sizes = sorted((s.stat().st_size for s in (corpus / "shards").glob("*.bin")), reverse=True)
    # a batch touches up to 2 shards, and each reader thread reads one batch at once: room for 3 or 4 of the 5
    opening = dict(cache_dir=str(cache), storage_options=moto_server.options(),
                   cache_size=3 * biggest if threads == 1 else sum(sizes[:4]), shuffle="none", reader_threads=threads)
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
    local_b = shutil.copytree(corpus, tmp_path / "b")  # the corpus again, at another place (one place twice is refused)

    def make(remote=True):
        data = fastio.Mixture({"a": corpus, "b": url if remote else local_b}, weights=schedule,
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
