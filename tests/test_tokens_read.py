"""The vectorised token read path against the reference one: ``spans`` against ``pieces`` (both packings, empty
documents and shards, sequences over many blocks), ``boundaries`` against the per-row rule, the reader's batches
(one dataset, several shards, a mixture) bitwise against the tokens ``pieces`` name, and a ``.bin`` cut short
under a running Loader refused in one line naming the shard."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from test_tokens_packing import Table
from tokens_helpers import word_corpus

import fastio
from fastio.errors import DatasetError
from fastio.tokens import packing as packing_module
from fastio.tokens.dataset import TokenDataset
from fastio.tokens.packing import BestFitPacking, ConcatPacking, boundaries, cu_seqlens, position_ids

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
    for each value (a few values at a time), for every width and some tweaks."""
    from fastio.order.feistel import feistel, round_keys

    keys = round_keys(3, "global", 1, "fingerprint", "token-docs")
    for bits in range(2, 17):
        x = np.arange(1 << bits, dtype=np.uint64)
        for tweak in (0, 12345678901234567, 2**64 - 5):
            whole = feistel(x, np.uint64(bits), keys, np.uint64(tweak))
            alone = np.concatenate([feistel(x[i:i + 2], np.uint64(bits), keys, np.uint64(tweak))
                                    for i in range(0, x.size, 2)])
            assert whole.dtype == np.uint64 and np.array_equal(whole, alone)
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
