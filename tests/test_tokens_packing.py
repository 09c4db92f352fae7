"""packing="concat": coverage, position_ids/cu_seqlens against EOS tokens, exact and elastic resume, purity."""

from __future__ import annotations

import numpy as np
import pytest

from fastio.tokens.packing import ConcatPacking, cu_seqlens, position_ids

EOS = 0


class Table:
    """Documents of one shard, as a DocumentTable over a token array (the test's stand-in for a MegatronIndex)."""

    def __init__(self, docs):
        self.docs = docs
        self.documents = len(docs)
        self.offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
        self.data = np.concatenate(docs) if docs else np.zeros(0, np.int64)

    @property
    def tokens(self):
        return int(self.offsets[-1])

    def starts(self, docs):
        return self.offsets[np.asarray(docs)]


def corpus(shards=3, docs=17, seed=0):
    """Tokens unique across the corpus (ids from 1 up), each document ending with EOS; lengths 1..40."""
    rng = np.random.default_rng(seed)
    tables, next_id = [], 1
    for _ in range(shards):
        ds = []
        for _ in range(docs):
            n = int(rng.integers(0, 40))
            ds.append(np.r_[np.arange(next_id, next_id + n), EOS].astype(np.int64))
            next_id += n
        tables.append(Table(ds))
    return tables


def read(tables, pieces):
    return np.concatenate([tables[p.shard].data[p.start:p.start + p.count] for p in pieces])


def epoch_sequences(packing, tables, epoch):
    return [read(tables, packing.pieces(epoch, s)) for s in range(packing.sequences)]


@pytest.mark.parametrize("shuffle,block_docs", [("global", 5), ("global", 4096), ("none", 3)])
def test_concat_covers_every_token_once_but_the_tail(shuffle, block_docs):
    tables = corpus()
    seq_len = 16
    p = ConcatPacking(tables, seq_len, seed=3, shuffle=shuffle, fingerprint="abc", block_docs=block_docs)
    total = sum(t.tokens for t in tables)
    assert p.sequences == (total - 1) // seq_len
    seqs = epoch_sequences(p, tables, epoch=1)
    assert all(s.shape == (seq_len + 1,) for s in seqs)
    for a, b in zip(seqs, seqs[1:]):
        assert a[-1] == b[0]  # one token of overlap, as Megatron
    inputs = np.concatenate([s[:-1] for s in seqs])
    words = inputs[inputs != EOS]
    assert len(set(words.tolist())) == words.size  # no token twice in an epoch
    every = np.concatenate([t.data for t in tables])
    assert np.count_nonzero(every != EOS) - words.size < seq_len + 1  # at most one sequence's tail left out
    assert np.count_nonzero(inputs == EOS) <= np.count_nonzero(every == EOS)


def test_documents_stay_whole_and_in_shuffled_order():
    tables = corpus()
    p = ConcatPacking(tables, 8, seed=1, fingerprint="f", block_docs=4)
    stream = np.concatenate([s[:-1] for s in epoch_sequences(p, tables, 0)])
    docs = [d for t in tables for d in t.docs]
    cuts = np.r_[0, np.flatnonzero(stream == EOS) + 1]
    pieces = [stream[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    by_first = {d[0]: d for d in docs if d.size > 1}
    for piece in pieces[:-1]:  # every complete document of the stream is a corpus document, whole
        assert piece.tolist() in ([EOS],) or by_first[piece[0]].tolist() == piece.tolist()
    firsts = [pc[0] for pc in pieces if pc.size > 1]
    assert firsts != sorted(firsts)  # shuffled
    p0 = ConcatPacking(tables, 8, seed=1, shuffle="none", fingerprint="f", block_docs=4)
    stream0 = np.concatenate([s[:-1] for s in epoch_sequences(p0, tables, 0)])
    every = np.concatenate([t.data for t in tables])
    assert stream0.tolist() == every[:stream0.size].tolist()  # "none": the stored order


def test_order_is_pure_and_changes_with_seed_and_epoch():
    tables = corpus()
    a = ConcatPacking(tables, 16, seed=7, fingerprint="x", block_docs=5)
    b = ConcatPacking(corpus(), 16, seed=7, fingerprint="x", block_docs=5)
    for s in (0, 5, a.sequences - 1):  # any position alone, in any order of asking, gives the same tokens
        assert read(tables, a.pieces(2, s)).tolist() == read(tables, b.pieces(2, s)).tolist()
    e2 = [x.tolist() for x in epoch_sequences(a, tables, 2)]
    assert e2 == [x.tolist() for x in epoch_sequences(b, tables, 2)]
    assert e2 != [x.tolist() for x in epoch_sequences(a, tables, 3)]
    c = ConcatPacking(tables, 16, seed=8, fingerprint="x", block_docs=5)
    assert e2 != [x.tolist() for x in epoch_sequences(c, tables, 2)]


def test_position_ids_and_cu_seqlens_follow_eos():
    tokens = np.array([[5, 6, EOS, 7, 8, EOS, 9], [EOS, 1, 2, 3, 4, 5, 6]])
    assert position_ids(tokens, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]
    # inputs are tokens[:, :-1] (6 each), flattened: documents start at 0, 3, 6 (row 2 starts), 7 (after EOS)
    assert cu_seqlens(tokens, EOS).tolist() == [0, 3, 6, 7, 12]
    assert cu_seqlens(tokens, EOS).dtype == np.int32


def test_fields_consistent_on_packed_sequences():
    tables = corpus(seed=4)
    p = ConcatPacking(tables, 32, seed=0, fingerprint="f", block_docs=6)
    batch = np.stack(epoch_sequences(p, tables, 0)[:8])
    pos = position_ids(batch, EOS)
    assert (pos[:, 0] == 0).all()
    after_eos = np.zeros(batch.shape, bool)
    after_eos[:, 1:] = batch[:, :-1] == EOS
    assert (pos[after_eos] == 0).all()
    assert (pos[:, 1:][~after_eos[:, 1:]] == pos[:, :-1][~after_eos[:, 1:]] + 1).all()
    cu = cu_seqlens(batch, EOS)
    flat_pos = pos[:, :-1].reshape(-1)
    assert cu[:-1].tolist() == np.flatnonzero(flat_pos == 0).tolist()  # boundaries where positions restart
    assert cu[-1] == 8 * 32


def _delivered(packing, world, consumed_before, batch_size, epoch, steps=None):
    """Sequence ids each rank gets from ``consumed_before`` on (``steps`` batches, or to the epoch's end)."""
    out = []
    for r in range(world):
        plan = packing.sampler(batch_size=batch_size, world_size=world, rank=r, drop_last=True).plan(
            epoch, consumed_before)
        n = len(plan) if steps is None else steps
        out.append([plan.batch(g)[0].tolist() for g in range(n)])
    return out, plan.consumed_after(n - 1) if n else consumed_before


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2), (2, 2)])
def test_resume_exact_and_elastic(before, after):
    tables = corpus(shards=4, docs=30)
    p = ConcatPacking(tables, 8, seed=5, fingerprint="f", block_docs=7)
    bs = 3
    first, consumed = _delivered(p, before, 0, bs, epoch=1, steps=4)
    rest, _ = _delivered(p, after, consumed, bs, epoch=1)
    ids = [s for rank in first + rest for batch in rank for s in batch]
    assert len(ids) == len(set(ids))  # each sequence once
    assert len(ids) >= p.sequences - after * bs  # all but the dropped last partial global batch
    if before == after:  # the same world size continues bitwise: the uninterrupted run's batches
        whole, _ = _delivered(p, before, 0, bs, epoch=1)
        assert [r[:4] + rr for r, rr in zip(first, rest)] == whole
        p2 = ConcatPacking(corpus(shards=4, docs=30), 8, seed=5, fingerprint="f", block_docs=7)
        s = rest[0][0][0]
        assert read(tables, p.pieces(1, s)).tolist() == read(tables, p2.pieces(1, s)).tolist()


def test_arguments_are_checked():
    tables = corpus()
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        ConcatPacking(tables, 0)
    with pytest.raises(ValueError, match="shuffle for packed tokens .* got 'block'"):
        ConcatPacking(tables, 8, shuffle="block")
    with pytest.raises(ValueError, match="seq_len 100000 needs more than 100000 tokens; the corpus holds"):
        ConcatPacking(tables, 100_000)
    with pytest.raises(IndexError, match="sequence"):
        ConcatPacking(tables, 8).pieces(0, 10**9)


def test_memory_stays_per_block():
    """A large corpus (10^6 documents) opens without touching every document: only block edges are read."""
    class Big:
        documents = 10**6

        @property
        def tokens(self):
            return 10**6 * 100

        def starts(self, docs):
            docs = np.asarray(docs)
            assert docs.size <= 10**6 // 4096 + 2 or docs.size <= 4097  # block edges, or one block and its end
            return docs * 100

    p = ConcatPacking([Big(), Big()], 2048, fingerprint="f")
    assert p.sequences == (2 * 10**8 - 1) // 2048
    pieces = p.pieces(0, p.sequences - 1)
    assert sum(x.count for x in pieces) == 2049 and all(x.count <= 100 for x in pieces)


# -- best-fit ------------------------------------------------------------------------------------------

def best_fit_corpus():
    """Unique token ids; documents of 1..60 tokens with a few longer than a sequence."""
    rng = np.random.default_rng(9)
    tables, next_id = [], 1
    for _ in range(3):
        ds = []
        for k in range(23):
            n = int(rng.integers(0, 60)) if k % 7 else 90  # every 7th document longer than seq_len + 1
            ds.append(np.r_[np.arange(next_id, next_id + n), EOS].astype(np.int64))
            next_id += n
        tables.append(Table(ds))
    return tables


@pytest.mark.parametrize("fit", ["best", "first"])
def test_best_fit_keeps_short_documents_whole_and_every_token_once(fit):
    from fastio.tokens.packing import BestFitPacking

    tables, seq_len = best_fit_corpus(), 32
    p = BestFitPacking(tables, seq_len, seed=2, fingerprint="f", block_docs=10, fit=fit)
    seqs = epoch_sequences(p, tables, epoch=1)
    assert all(s.size <= seq_len + 1 for s in seqs)
    every = np.concatenate([t.data for t in tables])
    got = np.concatenate(seqs)
    assert sorted(got[got != EOS].tolist()) == sorted(every[every != EOS].tolist())  # every token once, no tail lost
    assert np.count_nonzero(got == EOS) == np.count_nonzero(every == EOS)
    rows = {tuple(s.tolist()) for s in seqs}
    for t in tables:
        for d in t.docs:
            if d.size <= seq_len + 1:  # never cut: the document lies whole inside one sequence
                assert any(_contains(r, d.tolist()) for r in rows), d
    padding = sum(seq_len + 1 - s.size for s in seqs) / (len(seqs) * (seq_len + 1))
    assert p.padding_fraction == pytest.approx(padding) and 0 <= padding < 0.5


def _contains(row, doc):
    n = len(doc)
    return any(list(row[i:i + n]) == doc for i in range(len(row) - n + 1))


def test_best_fit_pads_no_more_than_first_fit_here_and_is_pure():
    from fastio.tokens.packing import BestFitPacking

    tables = best_fit_corpus()
    best = BestFitPacking(tables, 32, seed=2, fingerprint="f", block_docs=30)
    first = BestFitPacking(tables, 32, seed=2, fingerprint="f", block_docs=30, fit="first")
    assert best.padding_fraction <= first.padding_fraction + 1e-9
    again = BestFitPacking(best_fit_corpus(), 32, seed=2, fingerprint="f", block_docs=30)
    assert [x.tolist() for x in epoch_sequences(best, tables, 3)] == \
        [x.tolist() for x in epoch_sequences(again, tables, 3)]
    assert best.fingerprint != first.fingerprint
    with pytest.raises(ValueError, match="fit must be one of best, first, got 'worst'"):
        BestFitPacking(tables, 32, fit="worst")


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_best_fit_elastic_resume(before, after):
    from fastio.tokens.packing import BestFitPacking

    p = BestFitPacking(best_fit_corpus(), 16, seed=5, fingerprint="f", block_docs=7)
    first, consumed = _delivered(p, before, 0, 2, epoch=0, steps=3)
    rest, _ = _delivered(p, after, consumed, 2, epoch=0)
    ids = [s for rank in first + rest for batch in rank for s in batch]
    assert len(ids) == len(set(ids)) and len(ids) >= p.sequences - after * 2


def test_masked_fields_treat_padding_as_one_segment():
    tokens = np.array([[5, EOS, 6, 7, EOS, EOS, EOS]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0]], bool)
    assert position_ids(tokens, EOS, mask).tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    assert cu_seqlens(tokens, EOS, mask).tolist() == [0, 2, 5, 6]


@pytest.mark.parametrize("shuffle", ["global", "none"])
def test_shards_of_is_the_shard_each_sequence_starts_in(shuffle):
    from fastio.tokens.packing import BestFitPacking

    tables = best_fit_corpus()
    for p in (ConcatPacking(tables, 16, seed=1, shuffle=shuffle, fingerprint="f", block_docs=4),
              BestFitPacking(tables, 32, seed=1, shuffle=shuffle, fingerprint="f", block_docs=4)):
        for epoch in (0, 3):
            seqs = np.arange(p.sequences)
            want = [p.pieces(epoch, int(s))[0].shard for s in seqs]
            assert p.shards_of(epoch, seqs[::-1]).tolist() == want[::-1]


@pytest.mark.parametrize("fit", ["best", "first"])
def test_a_budget_packs_whole_documents_by_the_same_rule_and_keeps_each_sequence_within_it(fit):
    from fastio.tokens.packing import BestFitPacking, _best_fit, _first_fit, _fit_within

    rng = np.random.default_rng(4)
    items = sorted(((int(rng.integers(1, 33)), s) for s in range(0, 4000, 40)), key=lambda it: (-it[0], it[1]))
    plain = (_best_fit if fit == "best" else _first_fit)(items, 33)
    assert _fit_within([(n, s, 0) for n, s in items], 33, 1, fit) == plain  # no weight: the same sequences
    weights = {s: int(rng.integers(0, 3)) for _, s in items}
    capped = _fit_within([(n, s, weights[s]) for n, s in items], 33, 2, fit)
    assert sorted(x for b in capped for x in b) == sorted(items)  # every document once, whole
    assert all(sum(weights[s] for _, s in b) <= 2 and sum(n for n, _ in b) <= 33 for b in capped)
    assert max(sum(weights[s] for _, s in b) for b in plain) > 2 and len(capped) > len(plain)

    class Weighted(Table):
        def weights(self, docs):
            return np.array([len(self.docs[d]) % 3 for d in np.asarray(docs).tolist()], np.int64)

    tables = [Weighted([d for d in t.docs if d.size <= 17]) for t in best_fit_corpus()]
    p = BestFitPacking(tables, 16, seed=2, fingerprint="f", block_docs=10, fit=fit, budget=2)
    spent = [sum(len(tables[x.shard].docs[int(np.searchsorted(tables[x.shard].offsets, x.start))]) % 3
                 for x in p.pieces(1, s)) for s in range(p.sequences)]
    assert max(spent) == 2 and p.total_tokens == sum(t.tokens for t in tables)
    with pytest.raises(ValueError, match="budget must be a positive integer or None, got 0"):
        BestFitPacking(tables, 16, budget=0)


@pytest.mark.parametrize("fit", ["best", "first"])
def test_a_sequence_whose_budget_is_spent_still_takes_documents_of_no_weight(fit):
    from fastio.tokens.packing import _fit_within

    items = [(20, 0, 1), (20, 100, 1), (10, 200, 0), (10, 300, 0)]  # two samples of one image, two text-only
    assert _fit_within(items, 33, 1, fit) == [[(20, 0), (10, 200)], [(20, 100), (10, 300)]]
    rng = np.random.default_rng(7)
    items = sorted(((int(rng.integers(1, 600)), s, int(rng.random() < 0.8)) for s in range(0, 40000, 40)),
                   key=lambda it: (-it[0], it[1]))
    packed = _fit_within(items, 4097, 1, fit)
    weight = {s: w for _, s, w in items}
    assert all(sum(weight[s] for _, s in b) <= 1 and sum(n for n, _ in b) <= 4097 for b in packed)
    assert len(packed) == sum(w for _, _, w in items)  # as few as the budget allows: one a weighted document
