"""TokenDataset: a converted corpus read as packed sequences, rank by rank, with an elastic resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tokens_helpers import word_corpus

from bench.token_dataset import TokenDataset
from fastio.errors import DatasetError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("corpus"))


def test_epoch_on_two_ranks_reads_every_stream_token_once(corpus):
    ds = TokenDataset(corpus)
    assert len(ds.shards) == 5 and ds.documents == 120
    p = ds.packing(16, seed=1, block_docs=8)
    got = []
    for rank in range(2):
        plan = p.sampler(batch_size=4, world_size=2, rank=rank, drop_last=True).plan(epoch=0)
        for g in range(len(plan)):
            ids, _ = plan.batch(g)
            b = ds.batch(p, 0, ids)
            assert b["tokens"].shape == (4, 17) and b["tokens"].dtype == np.int64
            assert b["position_ids"].shape == (4, 17) and b["cu_seqlens"].dtype == np.int32
            got += ids.tolist()
    assert len(got) == len(set(got)) and len(got) >= p.sequences - 8
    stream = np.concatenate([ds.read(p.pieces(0, s))[:-1] for s in range(p.sequences)])
    docs = np.concatenate([s.document(j) for s in ds.shards for j in range(s.documents)])
    assert np.bincount(stream, minlength=300).sum() == p.sequences * 16
    counts = np.bincount(docs.astype(np.int64), minlength=300) - np.bincount(stream, minlength=300)
    assert counts.min() >= 0 and counts.sum() < 17  # every token once but the tail


def test_resume_3_to_2_on_real_shards(corpus):
    ds = TokenDataset(corpus)
    p = ds.packing(8, seed=4, block_docs=5)
    seen, consumed = [], 0
    for rank in range(3):
        plan = p.sampler(batch_size=2, world_size=3, rank=rank, drop_last=True).plan(epoch=2)
        seen += [s for g in range(3) for s in plan.batch(g)[0].tolist()]
        consumed = plan.consumed_after(2)
    for rank in range(2):
        plan = p.sampler(batch_size=2, world_size=2, rank=rank, drop_last=True).plan(epoch=2, start=consumed)
        seen += [s for g in range(len(plan)) for s in plan.batch(g)[0].tolist()]
    assert len(seen) == len(set(seen)) and len(seen) >= p.sequences - 4


def test_refusals(corpus, image_dataset):
    with pytest.raises(DatasetError, match="not a token dataset"):
        TokenDataset(image_dataset)
    bad = corpus.parent / "broken"
    shutil.copytree(corpus, bad)
    shard = bad / "shards" / "shard-000002.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"shard-000002\.bin: .* bytes, but shard-000002\.idx indexes"):
        TokenDataset(bad)


def test_best_fit_batches_mark_padding(corpus):
    ds = TokenDataset(corpus)
    longest = max(s.document(j).size for s in ds.shards for j in range(s.documents))
    width = longest + 1  # seq_len + 1: every document fits whole
    p = ds.packing(longest, packing="best-fit", seed=0, block_docs=16)
    plan = p.sampler(batch_size=8).plan(epoch=0)
    real = 0
    for g in range(len(plan)):
        ids, padded = plan.batch(g)
        b = ds.batch(p, 0, ids[~padded])
        assert b["tokens"].shape[1] == width and b["loss_mask"].dtype == bool
        assert (b["tokens"][~b["loss_mask"]] == ds.eos_id).all()
        rows_end_eos = [row[mask][-1] == ds.eos_id for row, mask in zip(b["tokens"], b["loss_mask"])]
        assert all(rows_end_eos)  # whole documents: none is cut
        real += int(b["loss_mask"].sum())
    assert real == ds.info.total_tokens  # every token once, none lost to a tail
    assert p.padding_fraction == pytest.approx(1 - real / (p.sequences * width))
    with pytest.raises(ValueError, match="packing must be one of concat, best-fit, got 'bfd'"):
        ds.packing(24, packing="bfd")
