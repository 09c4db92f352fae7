"""A step's global batch cut over torchft's replica groups (fastio/order/replicas.py): pure arithmetic over the
one-process plan, no processes."""

import numpy as np
import pytest

from fastio.order.mixorder import MixSampler, MixSchedule
from fastio.order.replicas import Share, split, step_position
from fastio.order.sampler import Sampler, SamplerSpec


def _sampler(n=23, batch=6, **spec) -> Sampler:
    return Sampler(SamplerSpec(seed=3, batch_size=batch, **spec), (n - 10, 10), "fp")


@pytest.mark.parametrize("length,parts", [(6, 1), (6, 4), (7, 3), (2, 5), (0, 3)])
def test_split_covers_in_order_with_sizes_differing_by_at_most_one(length, parts):
    spans = [split(length, parts, p) for p in range(parts)]
    sizes = [size for _, size in spans]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == length
    assert [off for off, _ in spans] == list(np.cumsum([0] + sizes[:-1]))


@pytest.mark.parametrize("participants,group", [(1, 1), (3, 1), (2, 2), (4, 2), (5, 1)])
@pytest.mark.parametrize("spec", [{"drop_last": True}, {"remainder": "pad"}, {"remainder": "partial"}])
def test_the_shares_of_every_member_make_the_one_process_batch(participants, group, spec):
    sampler = _sampler(**spec)
    for epoch, start in ((0, 0), (1, 6)):
        whole = sampler.plan(epoch, start)
        cut = {(p, r): Share(participants, p, r, group).plans(sampler.plan, 6)(epoch, start)
               for p in range(participants) for r in range(group)}
        for g in range(len(whole)):
            ids, padded = whole.batch(g)
            parts = [cut[p, r].batch(g) for p in range(participants) for r in range(group)]
            real = [(i[~m], m) for i, m in parts if not (m.all() and len(ids) < participants * group)]
            assert np.array_equal(np.concatenate([i for i, _ in real]), ids[~padded])
            sizes = [len(i) for i, m in parts if not m.all() or not len(ids) < participants * group]
            assert max(sizes) - min(sizes) <= 1


def test_a_member_left_without_samples_gets_one_padded_repeat():
    share = Share(participants=4, participant=3, rank=1, world_size=2)
    where, repeat = share.pick(5)
    assert (where, repeat) == (slice(0, 1), True)
    ids, padded = share.plans(_sampler(batch=5).plan, 5)(0, 0).batch(0)
    assert len(ids) == 1 and padded.tolist() == [True]


def test_chunked_walks_give_the_batches_one_at_a_time():
    sampler = _sampler(n=101, batch=7, remainder="partial")
    plan = Share(3, 1, 1, 2).plans(sampler.plan, 7)(2, 14)
    walked = list(plan.iter_batches(chunk=4))
    assert len(walked) == len(plan) == len(sampler.plan(2, 14))
    for g, (ids, padded) in enumerate(walked):
        want_ids, want_padded = plan.batch(g)
        assert np.array_equal(ids, want_ids) and np.array_equal(padded, want_padded)
    chunks = list(plan.iter_chunks(chunk=4))
    assert np.array_equal(np.concatenate([c[0] for c in chunks]), np.concatenate([w[0] for w in walked]))


def test_draw_keys_of_a_mixture_are_cut_like_its_ids():
    schedule = MixSchedule(("tiny", "big"), (3.0, 1.0), ("t", "b"), 40, seed=0)
    sampler = MixSampler.make(SamplerSpec(seed=1, batch_size=8), schedule, [(5,), (30,)])
    whole = sampler.plan(0, 0)
    plan = Share(3, 2).plans(sampler.plan, 8)(0, 0)
    for g in range(len(whole)):
        ids = whole.batch(g)[0]
        keys = whole.draw_keys(g, ids)
        where = Share(3, 2).pick(len(ids))[0]
        assert np.array_equal(plan.draw_keys(g, plan.batch(g)[0]), keys[where])


def test_a_step_is_its_epoch_and_the_samples_before_it():
    assert step_position(0, 4, 6) == (0, 0)
    assert step_position(9, 4, 6) == (2, 6)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        step_position(-1, 4, 6)
    with pytest.raises(ValueError, match="participant must be in"):
        Share(2, 2)
