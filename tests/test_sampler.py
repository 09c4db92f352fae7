"""The global order: a pure function, the shape of each shuffle mode, rank slices, argument checks."""

from __future__ import annotations

import numpy as np
import pytest

from fastio.order.sampler import Sampler, SamplerSpec, epoch_order

SIZES = [16, 16, 16, 10]


def _plans(batch_size, world, start=0, drop_last=False, remainder="pad"):
    """Every rank's plan of epoch 0 of SIZES with seed 0 (the order ``epoch_order(SIZES, 0, 0, "fp")``)."""
    spec = SamplerSpec(seed=0, batch_size=batch_size, drop_last=drop_last, remainder=remainder)
    return [Sampler(spec, SIZES, "fp", world, r).plan(0, start) for r in range(world)]


def test_order_is_a_pure_function_of_seed_epoch_fingerprint_mode():
    a = epoch_order(SIZES, 1, 3, "fp", "global")
    assert np.array_equal(a, epoch_order(SIZES, 1, 3, "fp", "global"))
    assert sorted(a.tolist()) == list(range(58))
    for other in [epoch_order(SIZES, 2, 3, "fp", "global"), epoch_order(SIZES, 1, 4, "fp", "global"),
                  epoch_order(SIZES, 1, 3, "fp2", "global"), epoch_order(SIZES, 1, 3, "fp", "block")]:
        assert not np.array_equal(a, other)
    assert np.array_equal(epoch_order(SIZES, 1, 3, "fp", "none"), np.arange(58))


def test_block_mode_keeps_samples_inside_windows_of_shards():
    sizes = [16, 16, 16, 16]
    order = epoch_order(sizes, 0, 0, "fp", "block", block_shards=2)
    assert sorted(order.tolist()) == list(range(64))
    shard = order[:] // 16  # a slice of the lazy order is an ndarray
    first_window = set(shard[:32].tolist())
    assert len(first_window) == 2 and not first_window & set(shard[32:].tolist())
    assert not np.array_equal(order[:32], np.sort(order[:32]))


def test_rank_slices_tile_global_batches_and_pad_the_end():
    plans = _plans(4, 3)
    assert np.array_equal(plans[0].order, epoch_order(SIZES, 0, 0, "fp"))
    assert {len(p) for p in plans} == {5}  # ceil(58 / 12)
    seen, pads = [], 0
    for g in range(5):
        for p in plans:
            idx, padded = p.batch(g)
            assert len(idx) == 4
            seen.extend(idx[~padded].tolist())
            pads += int(padded.sum())
    assert sorted(seen) == list(range(58)) and pads == 60 - 58
    assert plans[0].consumed_after(4) == 58
    assert len(_plans(4, 3, drop_last=True)[0]) == 4
    assert len(Sampler(SamplerSpec(batch_size=4), SIZES, "fp", 3, 0)) == 5


def test_plan_from_a_resume_point_covers_the_rest_exactly_once():
    order = epoch_order(SIZES, 0, 0, "fp")
    plans = _plans(5, 2, start=20)
    got = [i for g in range(len(plans[0])) for p in plans for i, pad in zip(*p.batch(g)) if not pad]
    assert sorted(got) == sorted(order[20:].tolist())


@pytest.mark.parametrize("kw,match", [
    (dict(shuffle="random"), "shuffle must be one of global, block, none, got 'random'"),
    (dict(block_shards=0), "block_shards must be >= 1, got 0"), (dict(batch_size=0), "batch_size"),
    (dict(batch_size=2.0), "batch_size must be a positive int"), (dict(remainder="keep"), "remainder"),
])
def test_bad_spec_raises_valueerror_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplerSpec(**kw)


def test_bad_rank_start_and_order_arguments_raise_valueerror():
    with pytest.raises(ValueError, match="shuffle"):
        epoch_order(SIZES, 0, 0, "fp", "random")
    with pytest.raises(ValueError, match="block_shards"):
        epoch_order(SIZES, 0, 0, "fp", "block", block_shards=0)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 2"):
        Sampler(SamplerSpec(), SIZES, "fp", world_size=2, rank=2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        Sampler(SamplerSpec(), SIZES, "fp", world_size=0, rank=0)
    sampler = Sampler(SamplerSpec(batch_size=4), SIZES, "fp")
    with pytest.raises(ValueError, match=r"start must be in 0\.\.58, got 59"):
        sampler.plan(0, 59)
    with pytest.raises(IndexError, match="batch 15 out of range"):
        sampler.plan(0, 0).batch(15)


def test_sampler_order_is_epoch_order_and_plans_carry_their_epoch():
    sampler = Sampler(SamplerSpec(seed=3, shuffle="block", block_shards=2, batch_size=4), SIZES, "fp", 2, 1)
    for epoch in (0, 5):
        assert np.array_equal(sampler.order(epoch), epoch_order(SIZES, 3, epoch, "fp", "block", 2))
        assert sampler.plan(epoch, 8).epoch == epoch


def test_partial_remainder_splits_the_last_batch_evenly():
    order = epoch_order(SIZES, 0, 0, "fp")  # 58 samples; global batch 4 x 4 = 16 -> remainder 10
    plans = _plans(4, 4, remainder="partial")
    assert {len(p) for p in plans} == {4}
    last = [p.batch(3) for p in plans]
    assert [len(i) for i, _ in last] == [3, 3, 2, 2] and not any(m.any() for _, m in last)
    got = [i for g in range(4) for p in plans for i in p.batch(g)[0].tolist()]
    assert got == order.tolist()
    # Fewer samples left than ranks: a rank with none gets one padded repeat and still takes a step.
    tiny = _plans(4, 3, start=56, remainder="partial")
    sizes = [(len(i), int(m.sum())) for i, m in (p.batch(0) for p in tiny)]
    assert sizes == [(1, 0), (1, 0), (1, 1)]


@pytest.mark.parametrize("world", [1, 3])
def test_a_partial_epoch_far_smaller_than_its_batch_costs_its_samples_not_its_batch_size(world):
    """batch_size 2**40 over 58 samples with remainder='partial' is one batch of the 58: ``batches`` (what the
    Loader's feeder and read-ahead look up) made the positions of one full batch, np.arange(batch_size), before it
    knew there was none (a MemoryError of 8 TiB here; 23 GB for a Loader at batch_size 3 * 10**9)."""
    order = epoch_order(SIZES, 0, 0, "fp")
    plans = _plans(2**40, world, remainder="partial")
    assert {len(p) for p in plans} == {1}
    got = [p.batches() for p in plans]
    assert [i for ids, _ in got for i in ids.tolist()] == order.tolist() and not any(m.any() for _, m in got)
    assert all(np.array_equal(p.batches()[0], p.batch(0)[0]) for p in plans)
    assert [len(ids) for p in plans for ids, _ in p.iter_batches()] == [58 // world + (r < 58 % world)
                                                                       for r in range(world)]


@pytest.mark.parametrize("remainder,drop_last", [("pad", False), ("partial", False), ("pad", True)])
@pytest.mark.parametrize("world,start", [(1, 0), (3, 0), (3, 7), (5, 40)])
@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_iter_batches_gives_batch_g_for_every_g(remainder, drop_last, world, start, chunk):
    for plan in _plans(4, world, start, drop_last, remainder):
        for first in (0, len(plan) // 2):
            got = list(plan.iter_batches(first, chunk))
            assert len(got) == len(plan) - first
            for g, (indices, padded) in enumerate(got, first):
                want_i, want_p = plan.batch(g)
                assert np.array_equal(indices, want_i) and np.array_equal(padded, want_p)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        next(_plans(4, 1)[0].iter_batches(0, 0))


def test_iter_batches_chunks_are_shared_by_plans_of_one_sampler_and_read_only():
    spec = SamplerSpec(seed=0, batch_size=4)
    sampler = Sampler(spec, SIZES, "fp", 2, 1)
    a = list(sampler.plan(1, 8).iter_batches())
    b = list(sampler.plan(1, 8).iter_batches())  # another plan of the same position: the cached chunks
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert np.shares_memory(a[0][0], b[0][0]) and not a[0][0].flags.writeable
    fresh = Sampler(spec, SIZES, "fp", 2, 1).plan(1, 8)
    assert all(np.array_equal(x[0], fresh.batch(g)[0]) for g, x in enumerate(a))


@pytest.mark.parametrize("world, batch", [(2**63, 1), (2**61, 4)])
def test_a_global_batch_past_int64_positions_is_refused_naming_it(world, batch):
    """world_size=2**63 (an integer: accepted) failed the first batch with a bare "OverflowError: Python int too
    large to convert to C long": a plan's positions are int64."""
    with pytest.raises(ValueError, match=rf"^global batch {batch} x world_size {world} = {batch * world} is past "
                                         r"2\*\*62, the largest a plan's int64 positions hold$"):
        Sampler(SamplerSpec(batch_size=batch), SIZES, "fp", world_size=world, rank=0)
    assert len(Sampler(SamplerSpec(batch_size=1), SIZES, "fp", world_size=2**62, rank=2**62 - 1)) == 1


def _steps(spec, sizes, world, epoch, start, count=None):
    """Every rank's (indices, padded) of each global batch of ``epoch`` from ``start`` (``count`` of them, or all),
    checking that the ranks agree on the count and that chunked look-ups give ``batch(g)``; and the state's
    ``consumed`` after them."""
    plans = [Sampler(spec, sizes, "fp", world, r).plan(epoch, start) for r in range(world)]
    assert len({len(p) for p in plans}) == 1, "ranks got different numbers of batches"
    n = len(plans[0]) if count is None else count
    steps = [[p.batch(g) for p in plans] for g in range(n)]
    for p in plans:
        for g, (ids, pad) in enumerate(p.iter_batches(0, chunk=3)):
            assert np.array_equal(ids, p.batch(g)[0]) and np.array_equal(pad, p.batch(g)[1])
    return steps, plans[0].consumed_after(n - 1) if n else start


@pytest.mark.parametrize("case", range(300))
def test_a_resume_at_any_world_and_batch_size_delivers_the_epoch_once(case):
    """Property: save after k global batches (0, mid-epoch, the last batch: an epoch boundary) at world size w1 and
    batch b1, resume at w2 and b2: the samples delivered (padding repeats left out) are the epoch's, each once (with
    drop_last: none twice); each batch follows the padding rule; at the same world and batch size the continuation
    is the uninterrupted run's, bitwise."""
    rng = np.random.default_rng(case)
    sizes = rng.integers(0, 8, rng.integers(1, 6)).tolist()
    if not sum(sizes):
        sizes[0] = 1  # tiny datasets: N=1, N < world size, N < batch size
    n = sum(sizes)
    common = dict(seed=[0, 2**63 - 1, 5][case % 3], shuffle=["global", "block", "none"][case // 3 % 3],
                  block_shards=int(rng.integers(1, 4)), drop_last=bool(case % 5 == 0),
                  remainder=["pad", "partial"][case // 9 % 2])
    (w1, w2), (b1, b2) = rng.integers(1, 10, 2).tolist(), rng.integers(1, 6, 2).tolist()
    old, new = SamplerSpec(batch_size=b1, **common), SamplerSpec(batch_size=b2, **common)
    epoch = [0, 7, 2**63 - 1][case % 3]
    total = len(Sampler(old, sizes, "fp", w1, 0))
    k = int(rng.choice([0, total // 2, max(total - 1, 0), total]))
    first, consumed = _steps(old, sizes, w1, epoch, 0, k)
    rest, _ = _steps(new, sizes, w2, epoch, consumed)
    got = [i for step in first + rest for ids, pad in step for i in ids[~pad].tolist()]
    counts = np.bincount(got, minlength=n)
    assert counts.max(initial=0) <= 1 and (common["drop_last"] or (counts == 1).all()), (sizes, w1, b1, k, w2, b2)
    for (w, b), steps in (((w1, b1), first), ((w2, b2), rest)):
        for step in steps:
            lengths = [len(ids) for ids, _ in step]
            if common["remainder"] == "pad" or sum(int((~pad).sum()) for _, pad in step) == w * b:
                assert lengths == [b] * w  # a full batch, or one padded by wrapping to the epoch's start
            else:  # partial: the rest split evenly; a rank left with none gets one padded repeat
                real = [int((~pad).sum()) for _, pad in step]
                assert max(real) - min(real) <= 1 and all(x == max(r, 1) for x, r in zip(lengths, real))
    if consumed < n:
        again, _ = _steps(old, sizes, w1, epoch, consumed)
        whole, _ = _steps(old, sizes, w1, epoch, 0)
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                   for x, y in zip(again, whole[k:]) for a, b in zip(x, y)) and len(again) == len(whole) - k
