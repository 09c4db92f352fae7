"""packing="best-fit" at scale: the sequence count of every block, computed from the documents' lengths alone
at construction, equals the number of sequences the full packing (the algorithm as it was, kept here as the
reference) makes of the block; the lengths are read in a few contiguous lookups and no block is packed."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from fastio.tokens import packing
from fastio.tokens.packing import BestFitPacking


class Lengths:
    """A shard's documents as a DocumentTable over their lengths, counting the lookups."""

    def __init__(self, lengths):
        self.documents = len(lengths)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.lookups = 0

    @property
    def tokens(self):
        return int(self.offsets[-1])

    def starts(self, docs):
        self.lookups += 1
        return self.offsets[np.asarray(docs)]


def reference_best(items, cap):
    bins, room = [], []
    for size, start in items:
        i = bisect.bisect_left(room, (size, -1))
        if i < len(room):
            left, k = room.pop(i)
        else:
            left, k = cap, len(bins)
            bins.append([])
        bins[k].append((size, start))
        bisect.insort(room, (left - size, k))
    return bins


def reference_first(items, cap):
    bins, room = [], np.zeros(0, np.int64)
    for size, start in items:
        fits = np.flatnonzero(room >= size)
        if fits.size:
            k = int(fits[0])
        else:
            k, room = len(bins), np.r_[room, cap]
            bins.append([])
        bins[k].append((size, start))
        room[k] -= size
    return bins


def reference_bins(tables, seq_len, block_docs, fit):
    """Every block's packed sequences, (size, token offset) pieces, as the construction made them before."""
    cap, out = seq_len + 1, []
    for table in tables:
        for lo in range(0, table.documents, block_docs):
            edges = table.offsets[lo:min(table.documents, lo + block_docs) + 1]
            items = [(min(cap, n - off), s + off) for s, n in zip(edges[:-1].tolist(), np.diff(edges).tolist())
                     for off in range(0, n, cap)]
            items.sort(key=lambda it: (-it[0], it[1]))
            out.append((reference_best if fit == "best" else reference_first)(items, cap))
    return out


def lengths(rng, n, seq_len):
    """Document lengths with empty ones, short ones, exactly seq_len + 1 and longer than several sequences."""
    kind = rng.integers(0, 5, n)
    short = rng.integers(1, seq_len // 2 + 2, n)
    long = rng.integers(seq_len // 2, 3 * seq_len + 5, n)
    return np.select([kind == 0, kind == 1, kind == 2], [0, seq_len + 1, long], short).astype(np.int64)


@pytest.mark.parametrize("fit, lockstep", [("best", None), ("first", 10**9), ("first", 1)])
@pytest.mark.parametrize("seq_len, block_docs", [(16, 7), (63, 64), (1, 5), (200, 50)])
def test_counts_equal_the_reference_packing(fit, lockstep, seq_len, block_docs, monkeypatch):
    monkeypatch.setattr(packing, "_LOCKSTEP_BLOCKS", lockstep, raising=False)  # 1: every run's blocks at once,
    # 10**9: block by block
    rng = np.random.default_rng(seq_len * 1000 + block_docs)
    tables = [Lengths(lengths(rng, n, seq_len)) for n in (0, 301, 1, 150, block_docs)]
    p = BestFitPacking(tables, seq_len, fit=fit, block_docs=block_docs, seed=3)
    ref = reference_bins(tables, seq_len, block_docs, fit)
    assert p._bins.tolist() == [len(bins) for bins in ref]
    assert p.sequences == sum(len(bins) for bins in ref)
    for b, bins in enumerate(ref):  # and the blocks a batch touches are packed as before, piece for piece
        shard = int(p._blk_shard[b])
        assert [[(x.count, x.start) for x in seq] for seq in p._pack(b)] == bins
        assert all(x.shard == shard for seq in p._pack(b) for x in seq)


@pytest.mark.parametrize("fit, lockstep", [("best", None), ("first", 10**9), ("first", 1)])
def test_construction_reads_lengths_in_runs_and_packs_no_block(fit, lockstep, monkeypatch):
    monkeypatch.setattr(packing, "_LENGTH_RUN", 20, raising=False)  # runs of 2 blocks of 8: 13 runs over 5 shards
    monkeypatch.setattr(packing, "_LOCKSTEP_BLOCKS", lockstep, raising=False)  # (a small shard's with the next's)
    rng = np.random.default_rng(7)
    tables = [Lengths(lengths(rng, n, 32)) for n in (40, 33, 0, 16, 100)]
    ref = reference_bins(tables, 32, 8, fit)
    for t in tables:
        t.lookups = 0
    p = BestFitPacking(tables, 32, fit=fit, block_docs=8)
    assert p._bins.tolist() == [len(bins) for bins in ref]
    assert [t.lookups for t in tables] == [1 + 3, 1 + 3, 0, 1 + 1, 1 + 7]  # the block edges, then the runs
    assert not p._cache  # no block packed to be counted


def test_a_piece_of_exactly_half_and_one_over_half():
    # rests of cap // 2 pair up in one sequence; over cap / 2 each opens its own: the boundary of the shortcut
    for cap in (9, 10):
        for fit in ("best", "first"):
            docs = [cap // 2, cap // 2, cap // 2 + 1, cap - cap // 2 - 1, cap, 2 * cap + cap // 2, 0]
            p = BestFitPacking([Lengths(np.array(docs))], cap - 1, fit=fit, block_docs=64)
            ref = reference_bins([Lengths(np.array(docs))], cap - 1, 64, fit)
            assert p._bins.tolist() == [len(ref[0])]


def test_the_bench_row_times_both_fits_on_the_synthetic_corpus(tmp_path):
    from bench.token_dataset import TokenDataset
    from bench.tokens import bench_bestfit_construction, write_synthetic

    folder = write_synthetic(tmp_path / "scale", 4_000, shards=2, mean_len=300)
    got = bench_bestfit_construction(folder, 256)
    assert got["documents"] == 4_000
    for fit in ("best", "first"):
        packing = TokenDataset(folder).packing(256, packing="best-fit", fit=fit)
        assert got[fit]["sequences"] == packing.sequences and got[fit]["cpu_s"] > 0
