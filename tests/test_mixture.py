"""fastio.Mixture: the pure schedule (proportions in every window, per-source order without repeats, purity)
and the Loader on a mixture (batches, exact and elastic resume, weight changes, fields, an S3 source)."""

from __future__ import annotations

import json
import re
import tracemalloc
from collections import Counter
from functools import partial
from itertools import islice

import numpy as np
import pytest
from conftest import write_image_dataset
from resume import batches, check_resume, run_ranks, same_batch

from fastio import ImageEval, ImageTrain, Loader, Mixture, Raw
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError, LoaderStateError
from fastio.order.mixorder import MixSampler, MixSchedule, window_spread
from fastio.order.sampler import SamplerSpec
from fastio.read.readset import coming

# -- the pure order --------------------------------------------------------------------------------


def _schedule(weights, samples=2000, seed=0):
    names = tuple("abcdefgh"[:len(weights)])
    return MixSchedule(names, tuple(weights), tuple(f"fp-{n}" for n in names), samples, seed)


@pytest.mark.parametrize("weights", [(3, 1), (1, 1), (0.7, 0.3), (1, 9), (1, 1, 1), (5, 3, 2), (4, 2, 1),
                                     (6, 3, 2, 1), (1, 2, 3, 4, 5)])
@pytest.mark.parametrize("batch", [8, 10, 64])
def test_every_batch_holds_the_weights_within_one(weights, batch):
    sched = _schedule(weights)
    share = np.asarray(weights, float) / sum(weights)
    for epoch in (0, 1, 5):
        src, _ = sched.sources(epoch, np.arange(2000))
        counts = np.stack([np.bincount(b, minlength=len(weights)) for b in src[: 2000 // batch * batch].reshape(-1, batch)])
        assert np.abs(counts - share * batch).max() <= 1, f"a batch of {batch} strays more than 1 from {weights}"
        spread = window_spread(src, weights, len(weights))  # every window of every length
        assert spread.max() <= (1 if len(weights) == 2 or weights in ((1, 1, 1), (5, 3, 2), (4, 2, 1), (6, 3, 2, 1))
                                else 2), spread


@pytest.mark.parametrize("weights", [(1, 1, 10), (13, 11, 7, 5, 3), (0.123, 0.456, 0.421), (1, 100, 1000)])
def test_any_weights_stay_within_quota(weights):
    sched = _schedule(weights, samples=5000, seed=3)
    src, _ = sched.sources(2, np.arange(5000))
    assert window_spread(src, weights, len(weights)).max() < 2  # any window of any length: less than 2 off


@pytest.mark.parametrize("seed", [0, 2])  # the schedule starts at offsets 0 and 2 of its period
def test_the_last_epoch_of_the_stream_keeps_each_sources_count(seed):
    """The periodic schedule's offset was added to the stream position in int64: in the last epoch a mixture
    counts (its stream ends at 2**63 - 1) the last positions wrapped, and their sources' counts came out negative
    (another sample, or the wrong source, delivered)."""
    n = 2**20  # 2**63 is a multiple: the last epoch ends at stream position 2**63 - 1 exactly
    sched = _schedule((1, 2), samples=n, seed=seed)
    assert sched.phase == seed
    last = 2**63 // n - 1
    sampler = MixSampler.make(SamplerSpec(), sched, [[7], [13]])
    sampler.check_epoch(last)  # taken: so it must be ordered right
    pos = np.arange(n - 6, n)
    src, k = sched.sources(last, pos)
    assert k.tolist() == [int(sched.delivered(last * n + p)[s]) for p, s in zip(pos.tolist(), src.tolist())]
    steps = [sched.delivered(last * n + p + 1) - sched.delivered(last * n + p) for p in pos[:-1].tolist()]
    assert [int(np.flatnonzero(d)[0]) for d in steps] == src[:-1].tolist()  # the source each position counts
    ids = sampler.order(last)[pos]
    assert ((ids >= 0) & (ids < 20)).all() and (np.asarray(sampler.base)[src] <= ids).all()


def _stream(sampler, source, epochs):
    """Source ``source``'s own indices in delivery order over mixture epochs ``0 .. epochs-1``."""
    out = []
    for e in range(epochs):
        order = sampler.order(e)
        ids = order[np.arange(len(order))]
        src = order.sources(np.arange(len(order)))
        out.extend((ids[src == source] - sampler.base[source]).tolist())
    return out


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_a_source_repeats_nothing_until_used_up_and_cycles(shuffle):
    # a tiny source (7 samples) with a large weight cycles many times; a large one (300) is partly covered
    sched = MixSchedule(("tiny", "big"), (5.0, 1.0), ("t", "b"), 60, seed=4)
    sampler = MixSampler.make(SamplerSpec(seed=4, shuffle=shuffle, block_shards=2), sched, [[3, 4], [100] * 3])
    tiny, big = _stream(sampler, 0, 6), _stream(sampler, 1, 6)
    assert len(tiny) == 300 and len(big) == 60
    for start in range(0, len(tiny) - 6, 7):  # each cycle of the tiny source is a permutation of it
        assert sorted(tiny[start:start + 7]) == list(range(7))
    assert len(set(big)) == len(big)  # the big one: no repeat across mixture epochs before it is used up
    if shuffle != "none":
        assert tiny[:7] != tiny[7:14], "each cycle of a source is its own next epoch"


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_a_source_follows_its_own_epoch_orders(shuffle):
    # the k-th sample of a source is position k % size of that source's own epoch k // size
    sched = MixSchedule(("tiny", "big"), (1.0, 1.0), ("t", "b"), 4000, seed=2)
    sampler = MixSampler.make(SamplerSpec(seed=2, shuffle=shuffle, block_shards=2), sched, [[5, 5], [100] * 30])
    pos = np.arange(1000, 1600)  # the tiny source goes through ~60 of its epochs here
    got = sampler.order(1)[pos]
    src, k = sched.sources(1, pos)
    want = [sampler.base[s] + sampler.source_order(s, kk // sampler.sizes[s])[kk % sampler.sizes[s]]
            for s, kk in zip(src.tolist(), k.tolist())]
    assert got.tolist() == want



@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_a_mixture_of_many_sources_follows_each_sources_own_epoch_orders(shuffle):
    """A lookup groups its positions by source and source epoch with one sort and, for ``global``, permutes them
    all in one evaluation (it scanned the positions once per source and permuted per source: 0.27 s per 4,096
    positions of 1,000 sources); every id is still the source's own order's, tiny sources cycling included."""
    rng = np.random.default_rng(3)
    m = 120
    sizes = [[int(x) for x in rng.integers(1, 40, int(rng.integers(1, 4)))] for _ in range(m)]
    sizes[5], sizes[77] = [1], [2]  # cycle through many of their epochs in one lookup
    names = tuple(f"src{i}" for i in range(m))
    weights = tuple(float(w) for w in rng.uniform(0.2, 3.0, m))
    sched = MixSchedule(names, weights, tuple(f"fp{i}" for i in range(m)), 50_000, seed=9)
    sampler = MixSampler.make(SamplerSpec(seed=9, shuffle=shuffle, block_shards=2), sched, sizes)
    pos = np.concatenate([np.arange(3000), rng.integers(0, 50_000, 500), [49_999, 0, 0]])
    for epoch in (0, 7):
        got = sampler.order(epoch)[pos]
        src, k = sched.sources(epoch, pos)
        want = [sampler.base[s] + sampler.source_order(s, kk // sampler.sizes[s])[kk % sampler.sizes[s]]
                for s, kk in zip(src.tolist(), k.tolist())]
        assert got.tolist() == want
        assert len(np.unique(src[:3000])) > 100 and sampler.order(epoch)[np.array([], np.int64)].shape == (0,)


def test_a_lookup_keeps_the_own_orders_of_a_hundred_sources():
    """``block`` keeps each source's own epoch order between lookups: it kept 64 whatever the sources, so with
    more sources every lookup rebuilt them all (0.4 s per 4,096 positions of 1,000 sources)."""
    m = 100
    sched = MixSchedule(tuple(f"s{i}" for i in range(m)), (1.0,) * m, tuple(f"f{i}" for i in range(m)), 10_000)
    sampler = MixSampler.make(SamplerSpec(seed=1, shuffle="block", block_shards=2), sched, [[30, 30, 40]] * m)
    first = sampler.order(0)[:1000]
    kept = dict(sampler._orders)
    assert len(kept) == m  # every source's order of its epoch 0
    assert sampler.order(0)[:1000].tolist() == first.tolist()
    assert all(sampler._orders[key] is order for key, order in kept.items()), "a source's order was rebuilt"

def test_the_order_is_pure():
    def order(seed=1, weights=(2.0, 1.0), fps=("x", "y")):
        sched = MixSchedule(("a", "b"), weights, fps, 90, seed)
        sampler = MixSampler.make(SamplerSpec(seed=seed), sched, [[10, 10], [25]])
        return [sampler.order(e)[:].tolist() for e in range(3)]

    assert order() == order()
    assert order() != order(seed=2)
    assert order() != order(weights=(1.0, 1.0))
    assert order() != order(fps=("x", "z"))
    epochs = order()
    assert epochs[0] != epochs[1]


# -- the Loader on a mixture ---------------------------------------------------------------------------


def _small(dest, n, label, extra=b"x", with_label=True):
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            sample = {"__key__": f"s{i:03d}", "txt": extra + str(i).encode()}
            if with_label:
                sample["cls"] = str(label).encode()
            writer.write(sample)
        writer.close(label_field="cls" if with_label else None, converted_from={"format": "test"}, skipped=[])
    return dest


@pytest.fixture
def raw_sources(tmp_path):
    return {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1), "c": _small(tmp_path / "c", 13, 2)}


def _raw_loader(sources, weights, **kw):
    opts = dict(batch_size=6, pipeline=Raw(), device="cpu", seed=5, world_size=1, rank=0, num_threads=1, prefetch=2)
    opts.update(kw)
    return Loader(Mixture(sources, weights=weights), **opts)


def test_a_batch_larger_than_the_mixtures_epoch_names_the_mixture_not_a_dataset(raw_sources):
    with pytest.raises(DatasetError, match=r"batch_size 60 is larger than the mixture's epoch \(50 samples\): give a "
                                           r"smaller batch_size, or remainder='partial' for one batch of them$"):
        _raw_loader(raw_sources, {"a": 1, "b": 1, "c": 1}, batch_size=60)


def test_partial_remainder_gives_a_mixture_epoch_smaller_than_a_batch_as_one_batch(raw_sources):
    """remainder='partial' takes a batch larger than the mixture's epoch: one batch of its 50 draws, the batch that
    batch_size 50 gives."""
    weights = {"a": 1, "b": 1, "c": 1}
    with _raw_loader(raw_sources, weights, batch_size=60, remainder="partial") as loader, \
            _raw_loader(raw_sources, weights, batch_size=50) as whole:
        assert len(loader) == 1
        got, want = next(iter(loader)), next(iter(whole))
    assert len(got["index"]) == 50 and same_batch(got, want)


def test_loader_batches_carry_source_and_index_in_the_mixture_order(raw_sources):
    loader = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    assert len(loader.dataset) == 50 and len(loader) == 9
    got = list(islice(batches(loader), 12))  # into epoch 1
    order = loader._sampler.order(0)
    ids = order[np.arange(50)]
    src, idx = loader.mixture.split(ids)
    first = got[0]
    assert first["source"].dtype == first["index"].dtype == first["label"].dtype
    assert first["source"].tolist() == src[:6].tolist() and first["index"].tolist() == idx[:6].tolist()
    for b in got[:8]:  # a batch of 6 with weights 3:2:1 is exactly 3, 2, 1
        assert sorted(Counter(b["source"].tolist()).values()) == [1, 2, 3]
        assert b["label"].tolist() == b["source"].tolist()  # source s was written with label s
        for s, i, txt in zip(b["source"].tolist(), b["index"].tolist(), b["txt"]):
            assert txt == b"x" + str(i).encode() and loader.key(s, i) == f"s{i:03d}"
    assert loader.key("b", 3) == "s003"
    stats = loader.stats()["sources"]
    assert sum(v["samples"] for v in stats.values()) == 12 * 6 - 4  # the padded tail of epoch 0 not counted
    assert stats["a"]["share"] == pytest.approx(0.5, abs=0.05)
    loader.close()


@pytest.mark.parametrize("pipeline,shuffle", [(Raw(), "global"), (Raw(), "none"), (ImageTrain(size=32), "block"),
                                              (ImageEval(size=32), "global")])
def test_exact_resume_is_bitwise(tmp_path, image_folder, pipeline, shuffle):
    tiny_folder = make_imagefolder(tmp_path / "tiny-src", classes=2, per_class=3, seed=9)
    sources = {"big": write_image_dataset(tmp_path / "big", image_folder, max_samples=16),
               "tiny": write_image_dataset(tmp_path / "tiny", tiny_folder, max_samples=4)}  # 6 samples

    def make():
        mix = Mixture(sources, weights={"big": 1, "tiny": 1}, samples_per_epoch=40)
        return Loader(mix, batch_size=4, device="cpu", seed=7, world_size=1, rank=0, num_threads=1,
                      prefetch=2, block_shards=2, pipeline=pipeline, shuffle=shuffle)

    state = check_resume(make, n=7, k=8)  # 10 batches per epoch: across the boundary
    assert state["mixture"]["names"] == ["big", "tiny"] and state["consumed"] == 28


def _ranks(sources, world, weights, n=None, state=None, **kw):
    return run_ranks([_raw_loader(sources, weights, world_size=world, rank=r, batch_size=3, **kw)
                      for r in range(world)], n, state)


def _pairs(steps):
    return [(s, i) for step in steps for b in step
            for s, i, p in zip(b["source"].tolist(), b["index"].tolist(), b["padded"].tolist()) if not p]


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
def test_elastic_resume_delivers_each_remaining_position_once(raw_sources, old, new):
    weights = {"a": 1, "b": 1, "c": 2}
    before, states = _ranks(raw_sources, old, weights, n=2)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    after, _ = _ranks(raw_sources, new, weights, state=states[0])
    whole, _ = _ranks(raw_sources, 1, weights)  # the epoch at world size 1
    assert Counter(_pairs(before) + _pairs(after)) == Counter(_pairs(whole))
    assert len(_pairs(whole)) == 50


def test_weights_change_only_at_an_epoch_boundary(raw_sources):
    old = _raw_loader(raw_sources, {"a": 1, "b": 1, "c": 1})
    list(islice(iter(old), 2))
    mid = old.state_dict()
    new = _raw_loader(raw_sources, {"a": 1, "b": 1, "c": 2})
    with pytest.raises(LoaderStateError, match=r"weights can change only from the next epoch.*set_epoch\(1\)"):
        new.load_state_dict(mid)
    new.set_epoch(1)  # what the message says: the new weights from the next epoch
    b = next(iter(new))
    assert new.state_dict()["epoch"] == 1 and abs(b["source"].tolist().count(2) - 3) <= 1
    list(old)  # to the end of epoch 0: the state is at a boundary
    boundary = old.state_dict()
    assert (boundary["epoch"], boundary["consumed"]) == (1, 0)
    again = _raw_loader(raw_sources, {"a": 1, "b": 1, "c": 2})
    again.load_state_dict(boundary)
    assert same_batch(next(iter(again)), b)
    other = Mixture({"a": raw_sources["a"], "b": raw_sources["c"], "c": raw_sources["b"]})
    with pytest.raises(LoaderStateError, match="source 'b' is dataset fingerprint"):
        Loader(other, batch_size=6, pipeline=Raw(), device="cpu", seed=5).load_state_dict(mid)
    for ld in (old, new, again):
        ld.close()



@pytest.mark.parametrize("entry,value", [("names", 5), ("names", None), ("names", "ab"), ("fingerprints", 5),
                                         ("fingerprints", ["x"]), ("samples_per_epoch", "x"),
                                         ("samples_per_epoch", None), ("samples_per_epoch", 50.5),
                                         ("samples_per_epoch", True), ("samples_per_epoch", -50),
                                         ("weights", [float("nan"), 2, 1]), ("weights", [3, 0, 1]),
                                         ("weights", [3, -2, 1]), ("weights", [3, 2, float("inf")]),
                                         ("schedule", [[0, [3, 2, 1]], [0, [1, 1, 1]]]),
                                         ("schedule", [[0, [3, 2, 1]], [-5, [1, 1, 1]]]),
                                         ("schedule", [[0, [3, 2, 1]], [900, [1, float("nan"), 1]]]),
                                         # read loosely before: int() truncated 36.9, float() took "3"
                                         ("schedule", [[0, [3, 2, 1]], [36.9, [1, 1, 1]]]),
                                         ("schedule", [[0, [3, 2, 1]], ["36", [1, 1, 1]]]),
                                         ("schedule", [[0.0, [3, 2, 1]], [36, [1, 1, 1]]]),
                                         ("schedule", [[0, [3, "2", 1]], [36, [1, 1, 1]]]),
                                         ("schedule", [[0, [3, 2, 1]], [True, [1, 1, 1]]]),
                                         ("weights", ["3", 2, 1]), ("weights", [3, True, 1])])
def test_a_hand_edited_mixture_entry_is_refused_naming_it(raw_sources, entry, value):
    """A state's ``mixture`` entry with names or fingerprints that are not lists failed with a bare
    "TypeError: 'int' object is not iterable"; a samples_per_epoch that is not an integer with a bare ValueError
    or TypeError from int(), or was truncated (50.5 read as 50); names "ab" was read as ['a', 'b']. Weights that
    are no positive numbers (NaN, 0, -2, inf) were taken for another mixture's, and the refusal suggested a
    schedule holding them, which Mixture refuses; a schedule with such weights in its future, or positions that
    do not increase, was taken without a word. A position that is no integer (36.9, "36") or a weight that is no
    number ("2") was read with int() / float(): truncated or parsed; now refused naming the entry and the value."""
    loader = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    next(iter(loader))
    state = loader.state_dict()
    bad = {**state, "mixture": {**state["mixture"], entry: value}}
    with pytest.raises(LoaderStateError, match=rf"^mixture\(a, b, c\): loader state's mixture entry has {entry}="):
        loader.load_state_dict(bad)
    loader.close()


def test_a_schedule_from_a_checkpoint_round_trip_is_read(raw_sources):
    """Positions and weights a checkpoint round trip made numpy or 0-d torch numbers are numbers: read as such."""
    import torch

    loader = _scheduled_loader(raw_sources, _SCHEDULE)
    list(islice(batches(loader), 2))
    state = loader.state_dict()
    schedule = [[torch.tensor(pos), [np.float64(w) for w in shares[:2]] + [torch.tensor(shares[2], dtype=torch.float64)]]
                for pos, shares in state["mixture"]["schedule"]]
    loader.load_state_dict({**state, "mixture": {**state["mixture"], "schedule": schedule}})
    loader.close()


def test_an_epoch_past_the_mixture_streams_range_is_refused_naming_it(raw_sources):
    """A mixture's order counts stream positions (epoch * samples_per_epoch + position) in int64: set_epoch(2**58)
    (or a state of that epoch) on a mixture of 50 samples per epoch was taken, and the first batch failed with a
    bare "OverflowError: Python int too large to convert to C long"."""
    last = 2**63 // 50 - 1  # its stream ends at position 2**63 - 1 at most
    loader = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    state = loader.state_dict()
    with pytest.raises(ValueError, match=rf"^epoch {last + 1} of a mixture of 50 samples per epoch ends at stream "
                                         rf"position {(last + 2) * 50 - 1}, past 2\*\*63 - 1"):
        loader.set_epoch(last + 1)
    with pytest.raises(LoaderStateError, match=rf"^loader state has epoch={last + 1}: epoch {last + 1} of a mixture"):
        loader.load_state_dict({**state, "epoch": last + 1, "consumed": 6})
    loader.set_epoch(last)
    got = next(iter(loader))
    assert len(got["index"]) == 6 and loader.state_dict()["epoch"] == last
    loader.close()


def test_the_last_epoch_a_mixture_orders_is_delivered_whole_and_the_next_refused(raw_sources):
    """The feeder walked on into the epoch after the one being delivered: in the last epoch a mixture's int64
    stream reaches, planning the next one raised ValueError before the last epoch's first batch came out."""
    last = 2**63 // 50 - 1
    loader = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    loader.set_epoch(last)
    got = list(loader)
    assert len(got) == 9 and sum(int((~b["padded"]).sum()) for b in got) == 50
    with pytest.raises(ValueError, match=rf"^epoch {last + 1} of a mixture of 50 samples per epoch ends"):
        next(iter(loader))
    loader.close()
    sampler = MixSampler.make(SamplerSpec(batch_size=6), _schedule((3, 2, 1), samples=50), [[30], [7], [13]])
    ahead = list(coming(sampler.plan, last, 12)())  # the shard read-ahead's ids: the rest of this epoch, then none
    assert sum(len(ids) for ids in ahead) == 6 * 7


@pytest.mark.parametrize("samples", [2**62 + 1, 2**63, 2**64])
def test_a_samples_per_epoch_past_the_orders_range_is_refused(raw_sources, samples):
    """samples_per_epoch=2**63 was taken and the first batch failed with a bare "OverflowError: cannot fit 'int'
    into an index-sized integer"; 2**64 with a message naming "its last epoch" as -1."""
    with pytest.raises(ValueError, match=rf"^samples_per_epoch must be a positive integer of at most 2\*\*62 \(a "
                                         rf"mixture's order counts positions in int64\), got {samples}$"):
        Mixture(raw_sources, samples_per_epoch=samples)
    big = Mixture(raw_sources, samples_per_epoch=2**62)  # the bound itself is taken
    with Loader(big, batch_size=2, pipeline=Raw(), device="cpu", world_size=1, rank=0, num_threads=1) as loader:
        assert len(loader) == 2**61 and len(next(iter(loader))["index"]) == 2

def test_a_source_lacking_a_field_is_named(raw_sources, tmp_path):
    sources = {**raw_sources, "nolabel": _small(tmp_path / "n", 5, 0, with_label=False)}
    with pytest.raises(DatasetError, match=r"mixture source 'nolabel': .*no field 'cls'"):
        _raw_loader(sources, None, pipeline=Raw(fields=("txt", "cls")))
    loader = _raw_loader(sources, None)  # raw without fields=: the fields every source has
    assert set(next(iter(loader))) == {"txt", "has", "source", "index", "padded"}
    loader.close()


@pytest.mark.parametrize("weights,match", [({"a": 1, "b": -1, "c": 1}, r"weights\['b'\] must be a positive"),
                                           ({"a": 1, "b": 1}, r"missing \['c'\]"),
                                           ({"a": 1, "b": 1, "c": 1, "d": 1}, r"unknown \['d'\]"),
                                           ({"a": 1, "b": float("nan"), "c": 1}, r"weights\['b'\]")])
def test_bad_weights_are_named(raw_sources, weights, match):
    with pytest.raises(ValueError, match=match):
        Mixture(raw_sources, weights=weights)
    with pytest.raises(ValueError, match="samples_per_epoch must be a positive integer, got 0"):
        Mixture(raw_sources, samples_per_epoch=0)



def test_the_same_dataset_under_two_names_is_mixed_with_a_warning_naming_both(raw_sources, tmp_path, caplog):
    """A dataset listed twice was accepted without a word: each of its samples comes twice a mixture epoch (and a
    source's no-repeat promise does not hold for the dataset). However it is spelled (another path to it, an opened
    Dataset), and for a copy at another place (a local copy beside its bucket's), a warning names both sources; the
    mixture is the one asked for (a user may name a dataset twice on purpose)."""
    import shutil

    from fastio import Dataset

    a = raw_sources["a"]
    (tmp_path / "link").symlink_to(a)
    alone = len(Mixture({"a": a, "b": raw_sources["b"]}))
    for twin in (a, str(a) + "/", tmp_path / "link", Dataset(a)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fastio"):
            assert len(Mixture({"a": a, "b": raw_sources["b"], "again": twin})) == alone + len(Dataset(a))
        assert f"mixture sources 'a' and 'again' are the same dataset ({a}): each of its samples comes twice a " \
               "mixture epoch" in caplog.text, caplog.text
    copy = shutil.copytree(a, tmp_path / "copy")
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastio"):
        assert len(Mixture({"a": a, "again": copy})) == 60
    assert re.search(rf"mixture sources 'a' \({a}\) and 'again' \({copy}\) hold the same shards \(fingerprint "
                     r"[0-9a-f]{16}\): each sample comes once from each, twice a mixture epoch", caplog.text), caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastio"):
        assert len(Mixture({"a": a, "b": raw_sources["b"]})) == alone
    assert "same" not in caplog.text, caplog.text


def test_a_weight_too_large_for_a_float_is_named(raw_sources, tmp_path):
    """An integer weight past a float's range failed with a bare OverflowError (also out of Mixture.from_file,
    which names the file only for ValueError and DatasetError)."""
    with pytest.raises(ValueError, match=r"^weights\['a'\] must be a positive number, got 1000.*0 \(too large "):
        Mixture(raw_sources, weights={"a": 10**400, "b": 1, "c": 1})
    path = tmp_path / "mix.json"
    path.write_text('{"sources": {"a": "%s", "b": "%s", "c": "%s"}, "weights": {"a": 1, "b": 1, "c": %d}}'
                    % (*(str(raw_sources[k]) for k in "abc"), 10**400))
    with pytest.raises(DatasetError, match=rf"^{path}: weights\['c'\] must be a positive number, got"):
        Mixture.from_file(path)


def test_verify_is_a_switch_not_a_truth_value(raw_sources):
    """``verify="no"`` was read by its truth (a non-empty string: every index and shard checked), as the Loader's own
    switches were before they were checked; a Dataset and a Mixture now refuse it, naming the option."""
    from fastio import Dataset

    for make in (lambda v: Dataset(raw_sources["a"], verify=v), lambda v: Mixture(raw_sources, verify=v)):
        for bad in ("no", 0, None):
            with pytest.raises(ValueError, match=rf"^verify must be True or False, got {bad!r}$"):
                make(bad)
    assert Dataset(raw_sources["a"], verify=np.bool_(True)).verify is True  # a numpy bool is a switch
    assert Mixture(raw_sources, verify=True).names == ("a", "b", "c")


def test_weights_whose_sum_is_past_a_float_keep_their_proportions(raw_sources):
    """Each weight finite, their sum not: the shares were all 0, refused as "weight of 'a' must be a positive number,
    got 0.0", a weight that was not given."""
    big = _raw_loader(raw_sources, {"a": 1.5e308, "b": 1e308, "c": 0.5e308})
    small = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    assert big.dataset.weights == pytest.approx(small.dataset.weights)
    for x, y in zip(big, small):
        assert x["source"].tolist() == y["source"].tolist() and x["index"].tolist() == y["index"].tolist()
    big.close()
    small.close()

def test_an_s3_source_in_a_mixture(moto_server, s3_bucket, raw_sources, tmp_path):
    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/b"
    open_storage(url, moto_server.options()).publish_dir(raw_sources["b"], keys_last=(MANIFEST_NAME,))
    remote = {**raw_sources, "b": url}
    opening = dict(cache_dir=str(tmp_path / "cache"), cache_size="1GB", storage_options=moto_server.options())
    mixed = Loader(Mixture(remote, weights={"a": 3, "b": 2, "c": 1}, **opening), batch_size=6, pipeline=Raw(),
                   device="cpu", seed=5, world_size=1, rank=0)
    local = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    for _ in range(2):  # two epochs: the second from the warm cache
        for x, y in zip(mixed, local, strict=True):
            assert same_batch(x, y)
    storage = mixed.stats()["storage_by_source"]
    assert list(storage) == ["b"] and storage["b"]["waited_fills"] + storage["b"]["ahead_fills"] == 2
    mixed.close()
    local.close()


def test_inspect_order_on_a_mixture_file(raw_sources, tmp_path, capsys):
    from helpers import run_cli

    spec = {"sources": {"a": "a", "b": "b", "c": str(raw_sources["c"])}, "weights": {"a": 3, "b": 2, "c": 1},
            "samples_per_epoch": 60}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))  # "a", "b": relative to the file
    code, out, err = run_cli(["inspect", str(path), "--order", "--batch-size", "12", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert [s["per_epoch"] for s in info["sources"]] == [30, 20, 10] and info["batches"] == 10
    assert info["per_batch"]["a"] == {"expected": 6, "min": 6, "max": 6, "max_deviation": 0}
    b = info["repeat_distance"]["b"]  # 7 samples, 20 per epoch: cycles, each cycle a permutation
    assert b["repeats"] == 40 - 7 and b["min"] >= 2
    assert info["repeat_distance"]["a"]["repeats"] == 60 - 30  # 30 samples, 30 per epoch: once per epoch
    code, out, _ = run_cli(["inspect", str(path)], capsys)
    assert code == 0 and "per batch" in out and "share 0.5000" in out
    path.write_text(json.dumps({**spec, "weights": {"a": 1, "b": 0, "c": 1}}))
    code, _, err = run_cli(["inspect", str(path)], capsys)
    assert code == 2 and f"{path}: weights['b'] must be a positive number, got 0" in err


def test_inspect_counts_a_mixture_epoch_of_one_sample_in_the_singular(raw_sources, tmp_path, capsys):
    from helpers import run_cli

    path = tmp_path / "mix.json"
    for n, line in ((1, "1 sample per epoch"), (2, "2 samples per epoch")):
        path.write_text(json.dumps({"sources": {"a": str(raw_sources["a"])}, "samples_per_epoch": n}))
        code, out, err = run_cli(["inspect", str(path)], capsys)
        assert code == 0 and f"1 source, {line}" in out, (out, err)
        code, out, _ = run_cli(["inspect", str(path), "--json"], capsys)  # "unit" stays; "unit_singular" is added
        info = json.loads(out)
        assert (info["samples_per_epoch"], info["unit"], info["unit_singular"]) == (n, "samples", "sample")


@pytest.mark.parametrize("kw", [dict(drop_last=True), dict(remainder="partial"), dict(remainder="pad")])
def test_resume_on_a_rank_with_drop_last_and_remainders(raw_sources, kw):
    # 50 samples, global batch 2 x 4 = 8: a dropped, a partial or a padded last batch; resume across it
    def make():
        return _raw_loader(raw_sources, {"a": 2, "b": 1, "c": 1}, batch_size=4, world_size=2, rank=1, **kw)

    loader = make()
    epoch = list(loader)
    sizes = [len(b["index"]) for b in epoch]
    padded = sum(int(b["padded"].sum()) for b in epoch)
    if kw.get("drop_last"):
        assert len(epoch) == 6 and set(sizes) == {4} and not padded
    elif kw["remainder"] == "partial":
        assert len(epoch) == 7 and sizes[-1] == 1 and not padded  # 2 left: one each
    else:
        assert len(epoch) == 7 and sizes[-1] == 4 and padded == 4  # rank 1's part of the last batch: all padding
    loader.close()
    check_resume(make, n=5, k=4)


# -- a schedule: weights that change at stream positions ------------------------------------------------------


def _scheduled(weights, changes, samples=2000, seed=0):
    names = tuple("abcdefgh"[:len(weights)])
    return MixSchedule(names, tuple(weights), tuple(f"fp-{n}" for n in names), samples, seed,
                       changes=tuple((p, tuple(w)) for p, w in changes))


@pytest.mark.parametrize("batch", [8, 10])
def test_every_batch_of_each_phase_holds_its_weights_within_one(batch):
    # epochs of 1000; changes mid-epoch 0 (at 333, not a batch edge), at the epoch boundary 1000, mid-epoch 1
    sched = _scheduled((3, 1, 1), [(333, (1, 1, 2)), (1000, (1, 4, 1)), (1555, (5, 3, 2))], samples=1000)
    src = np.concatenate([sched.sources(e, np.arange(1000))[0] for e in range(3)])
    edges = [0, 333, 1000, 1555, 3000]
    for (lo, hi), weights in zip(zip(edges, edges[1:]), [(3, 1, 1), (1, 1, 2), (1, 4, 1), (5, 3, 2)]):
        share = np.asarray(weights, float) / sum(weights)
        first = -(-lo // batch) * batch  # global batches wholly inside the phase
        part = src[first:first + (hi - first) // batch * batch].reshape(-1, batch)
        counts = np.stack([np.bincount(b, minlength=3) for b in part])
        assert np.abs(counts - share * batch).max() <= 1, f"phase from {lo}: a batch strays from {weights}"
    plain = _schedule((3, 1, 1), samples=1000)
    assert (src[:333] == plain.sources(0, np.arange(333))[0]).all(), "before the first change: the plain order"


def test_each_source_counts_on_across_a_change():
    # a source's k-th delivery is its k-th sample, whatever phase it comes in: no restart, no gap, no repeat
    sched = _scheduled((1, 3), [(50, (4, 1)), (130, (1, 1))], samples=70)
    src, k = (np.concatenate(x) for x in zip(*(sched.sources(e, np.arange(70)) for e in range(4))))
    for s in range(2):
        assert k[src == s].tolist() == list(range(int((src == s).sum())))
    for e in range(4):
        assert sched.per_epoch(e).tolist() == np.bincount(src[e * 70:(e + 1) * 70], minlength=2).tolist()
    pos = np.array([0, 49, 50, 51, 129, 130, 131, 279])  # any position alone gives what the stream gave
    got = [sched.sources(int(p) // 70, np.array([int(p) % 70])) for p in pos]
    assert [(int(s[0]), int(kk[0])) for s, kk in got] == list(zip(src[pos].tolist(), k[pos].tolist()))


def test_a_schedule_is_checked_where_it_enters(raw_sources):
    def mix(weights):
        return Mixture(raw_sources, weights=weights)

    w = {"a": 1, "b": 1, "c": 1}
    for weights, match in [([(5, w)], r"weights\[0\]: a schedule starts at position 0, got 5"),
                           ([(0, w), (40, w), (40, w)], r"weights\[2\]: position 40 is not after the previous "
                                                        r"entry's 40"),
                           ([(0, w), (10, w), (3, w)], r"weights\[2\]: position 3 is not after"),
                           ([(0, w), (2.5, w)], r"weights\[1\]: the position must be an integer >= 0 .*got 2\.5"),
                           ([(0, w), (True, w)], r"weights\[1\]: the position must be an integer"),
                           # was taken, and the first batch failed with a bare OverflowError
                           ([(0, w), (2**63, w)], r"^weights\[1\]: position 9223372036854775808 is past 2\*\*63 - 1, "
                                                  r"the last stream position a mixture's order counts$"),
                           ([(0, w), (9, {"a": 1, "b": 0, "c": 1})], r"weights\[1\]\['b'\] must be a positive "
                                                                     r"number, got 0"),
                           ([(0, w), (9, {"a": 1, "b": 1})], r"weights\[1\] must name every source once: unknown "
                                                             r"\[\], missing \['c'\]"),
                           ([(0, w), (9, {"a": 1e6, "b": 1, "c": 1})], r"weight 1 of mixture source 'b' is a share "
                                                                       r".*\(weights\[1\], from position 9\)$"),
                           ([(0, w), 9], r"weights\[1\] must be a \(position, \{name: weight\}\) pair, got 9"),
                           ([], r"weights must be a mapping of source name -> weight, or a schedule")]:
        with pytest.raises(ValueError, match=match):
            mix(weights)
    m = mix([(0, w), (40, {"a": 2, "b": 1, "c": 1})])
    assert m.weights == pytest.approx((1 / 3,) * 3) and [p for p, _ in m.phases] == [0, 40]
    assert "from 40: a=0.5" in repr(m)


def _scheduled_loader(sources, schedule, **kw):
    return _raw_loader(sources, [(p, dict(zip("abc", w))) for p, w in schedule], **kw)


_SCHEDULE = [(0, (3, 2, 1)), (36, (1, 1, 4))]  # 50 samples an epoch, batches of 6: the change at batch 6


@pytest.mark.parametrize("n", [5, 6, 7, 8])  # mid-phase, exactly at the change, just after it, into epoch 1
def test_resume_across_a_change_is_bitwise(raw_sources, n):
    state = check_resume(lambda: _scheduled_loader(raw_sources, _SCHEDULE), n=n, k=6)
    assert state["mixture"]["schedule"] == [[0, pytest.approx([0.5, 1 / 3, 1 / 6])],
                                            [36, pytest.approx([1 / 6, 1 / 6, 2 / 3])]]
    assert "weights" not in state["mixture"]  # which a fastio from before schedules requires: it refuses the state
    loader = _scheduled_loader(raw_sources, _SCHEDULE)
    got = list(islice(batches(loader), 6))
    assert [sorted(Counter(b["source"].tolist()).items()) for b in got] == \
        [[(0, 3), (1, 2), (2, 1)]] * 6  # batches 0..5: 3:2:1
    after = Counter(s for b in islice(batches(loader), 2) for s in b["source"].tolist())
    assert after == {0: 2, 1: 2, 2: 8}  # batches 6, 7: 1:1:4
    stats = loader.stats()["sources"]
    assert [stats[k]["samples"] for k in "abc"] == [18 + 2, 12 + 2, 6 + 8]
    loader.close()


@pytest.mark.parametrize("old,new,n", [(2, 3, 5), (3, 2, 4), (2, 3, 6)])
def test_elastic_resume_across_a_change_delivers_each_remaining_position_once(raw_sources, old, new, n):
    # world 2 x batch 3 = global batch 6 (the change at global batch 6); world 3 x 3 = 9 (at 4 batches)
    weights = [(p, dict(zip("abc", w))) for p, w in _SCHEDULE]
    before, states = _ranks(raw_sources, old, weights, n=n)
    after, _ = _ranks(raw_sources, new, weights, state=states[0])
    whole, _ = _ranks(raw_sources, 1, weights)
    assert Counter(_pairs(before) + _pairs(after)) == Counter(_pairs(whole)) and len(_pairs(whole)) == 50


def _state_at(sources, schedule, n):
    loader = _scheduled_loader(sources, schedule)
    list(islice(batches(loader), n))
    state = loader.state_dict()
    loader.close()
    return state


def test_a_resume_may_change_the_future_of_a_schedule_not_its_past(raw_sources):
    state = _state_at(raw_sources, _SCHEDULE, 4)  # stream position 24
    for changed, entry in [([(0, (1, 1, 1)), (36, (1, 1, 4))], r"entry 0 was \(0, \{a: 0.5"),
                           ([(0, (3, 2, 1)), (20, (1, 1, 4))], r"entry 1 was no entry and is \(20, "),
                           ([(0, (3, 2, 1)), (12, (3, 2, 1)), (36, (1, 1, 4))], r"entry 1 was no entry")]:
        with pytest.raises(LoaderStateError, match=rf"stream position 24 \(mixture epoch 0, 24 samples in\).*"
                                                   rf"{entry}.*entries before position 24 must stay as saved"):
            _scheduled_loader(raw_sources, changed).load_state_dict(state)
    ref = _scheduled_loader(raw_sources, _SCHEDULE)
    want = list(islice(batches(ref), 12))[4:]
    ref.close()
    # the future changed: a later change, a dropped one, one exactly at the saved position; all load
    for future, same in [([(0, (3, 2, 1)), (36, (1, 1, 4)), (60, (1, 1, 1))], 6),
                         ([(0, (3, 2, 1)), (48, (1, 1, 4))], 2), ([(0, (3, 2, 1))], 2),
                         ([(0, (3, 2, 1)), (24, (1, 4, 1))], 0)]:
        loader = _scheduled_loader(raw_sources, future)
        loader.load_state_dict(state)
        got = list(islice(batches(loader), 8))
        loader.close()
        assert all(same_batch(a, b) for a, b in zip(want[:same], got[:same])), future
        assert not same_batch(want[same], got[same]), future
    assert Counter(got[0]["source"].tolist()) == {0: 1, 1: 4, 2: 1}  # from 24: 1:4:1
    with pytest.raises(LoaderStateError, match="samples_per_epoch 50, this mixture 60: a schedule's positions"):
        loader = Loader(Mixture(raw_sources, weights=[(0, {"a": 3, "b": 2, "c": 1}), (36, {"a": 1, "b": 1, "c": 4})],
                                samples_per_epoch=60), batch_size=6, pipeline=Raw(), device="cpu", seed=5)
        loader.load_state_dict(state)


def test_a_state_with_plain_weights_continues_into_a_schedule(raw_sources):
    plain = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    stream = batches(plain)
    list(islice(stream, 4))
    state = plain.state_dict()
    assert "schedule" not in state["mixture"]  # a plain mixture's state is as it was
    want = list(islice(stream, 2))
    plain.close()
    later = _scheduled_loader(raw_sources, _SCHEDULE)  # the saved weights up to 36, then new ones
    later.load_state_dict(state)
    got = list(islice(batches(later), 3))
    later.close()
    assert same_batch(want[0], got[0]) and same_batch(want[1], got[1])
    assert Counter(got[2]["source"].tolist()) == {0: 1, 1: 1, 2: 4}
    mid = _raw_loader(raw_sources, {"a": 1, "b": 1, "c": 4})  # the message says how to change them mid-epoch
    with pytest.raises(LoaderStateError, match=r"or from stream position 24 with a schedule .*weights=\[\(0, "
                                               r"\{'a': 0.5, 'b': 0.3333, 'c': 0.1667\}\), \(24, \{'a': 0.1667"):
        mid.load_state_dict(state)
    mid.close()


def test_inspect_a_mixture_file_with_a_schedule(raw_sources, tmp_path, capsys):
    from helpers import run_cli

    spec = {"sources": {k: str(v) for k, v in raw_sources.items()},
            "weights": [[0, {"a": 3, "b": 2, "c": 1}], [66, {"a": 1, "b": 1, "c": 4}]], "samples_per_epoch": 60}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(spec))
    assert Mixture.from_file(path).phases[1][0] == 66
    code, out, err = run_cli(["inspect", str(path), "--order", "--batch-size", "12", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert [p["position"] for p in info["phases"]] == [0, 66] and [p["batches"] for p in info["phases"]] == [5, 4]
    first, second = (p["per_batch"] for p in info["phases"])
    assert first["a"] == {"expected": 6, "min": 6, "max": 6, "max_deviation": 0}
    assert second["c"] == {"expected": 8, "min": 8, "max": 8, "max_deviation": 0}
    assert info["per_batch"]["c"]["expected"] is None and info["per_batch"]["c"]["max_deviation"] <= 1
    assert [s["per_epoch"] for s in info["sources"]] == [30, 20, 10]
    code, out, _ = run_cli(["inspect", str(path), "--epoch", "1", "--batch-size", "12"], capsys)
    assert code == 0 and "phase:    from position 66: a 0.1667, b 0.1667, c 0.6667; 9 batches" in out
    assert "  c            per batch 8..8 (expected 8, max deviation 0)" in out
    path.write_text(json.dumps({**spec, "weights": [[0, {"a": 1, "b": 1, "c": 1}], [0, {"a": 1, "b": 1, "c": 1}]]}))
    code, _, err = run_cli(["inspect", str(path)], capsys)
    assert code == 2 and f"{path}: weights[1]: position 0 is not after the previous entry's 0" in err


@pytest.mark.parametrize("epoch, named", [(2**62, 2**62), (2**63 // 60 - 1, 2**63 // 60)])
def test_inspect_of_a_mixture_epoch_past_the_orders_reach_is_one_line(raw_sources, tmp_path, capsys, epoch, named):
    """Found by hostile review of fastio inspect: ``--epoch`` past the int64 stream positions of a mixture's order
    (the report's first epoch) was a raw OverflowError traceback from numpy, and past it by the report's second
    epoch only, a report of wrapped positions (exit 0); both are the order's own refusal (as set_epoch's), naming
    the epoch and the last one there is, exit 2."""
    from helpers import run_cli

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {k: str(v) for k, v in raw_sources.items()}, "samples_per_epoch": 60}))
    code, out, err = run_cli(["inspect", str(path), "--epoch", str(epoch)], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"fastio: error: the report's epochs {epoch}..{epoch + 1}: epoch {named} of a mixture of "
                          "60 samples per epoch ends at stream position"), err
    assert f"its last epoch is {2**63 // 60 - 1}" in err
    code, _, err = run_cli(["inspect", str(path), "--epoch", str(2**63 // 60 - 2)], capsys)  # its last two: reported
    assert code == 0, err


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_a_scheduled_state_goes_through_the_checkpointer(raw_sources, tmp_path, engine):
    from fastio import Checkpointer

    loader = _scheduled_loader(raw_sources, _SCHEDULE)
    stream = batches(loader)
    list(islice(stream, 5))
    with Checkpointer(tmp_path / "ck", engine=engine) as ckpt:
        ckpt.save(5, {"data": loader}, blocking=True)
    want = list(islice(stream, 3))  # across the change at 36
    saved = loader.state_dict()["mixture"]
    loader.close()
    fresh = _scheduled_loader(raw_sources, _SCHEDULE)
    with Checkpointer(tmp_path / "ck", engine=engine) as ckpt:
        assert ckpt.restore_latest({"data": fresh}).step == 5
    assert fresh.state_dict()["mixture"] == saved
    got = list(islice(batches(fresh), 3))
    fresh.close()
    assert all(same_batch(a, b) for a, b in zip(want, got))


def _peak(call):
    """``call()`` and the peak bytes Python allocated while it ran (tracemalloc: numpy's buffers included)."""
    tracemalloc.start()
    try:
        out = call()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_a_billion_positions_on_rank_999_of_1000_cost_what_a_batch_costs(raw_sources, shuffle):
    """Scale, lazily: a Loader over an epoch of 10^9 positions (a mixture's samples_per_epoch) on rank 999 of 1000;
    its making, ``state_dict``, ``load_state_dict`` of an elastic state (saved at world 999, 7 positions before the
    epoch's end) and the last batch each allocate kilobytes, as at 10^6 (an O(N) step would take gigabytes)."""
    def loader(n):
        return Loader(Mixture(raw_sources, weights={"a": 0.123, "b": 0.456, "c": 0.421}, samples_per_epoch=n),
                      batch_size=3, pipeline=Raw(), device="cpu", world_size=1000, rank=999, num_threads=1,
                      prefetch=2, shuffle=shuffle, remainder="partial")

    for n in (10**6, 10**9):
        ld, made = _peak(partial(loader, n))
        state, saved = _peak(ld.state_dict)
        _, loaded = _peak(partial(ld.load_state_dict, {**state, "epoch": 5, "consumed": n - 7, "world_size": 999}))
        batch, first = _peak(partial(next, iter(ld)))
        ld.close()
        assert max(made, saved, loaded, first) < 4 << 20, (n, made, saved, loaded, first)
        assert batch["padded"].tolist() == [True]  # 7 left for 1000 ranks: rank 999 gets one padded repeat
        assert (ld.state_dict()["epoch"], ld.state_dict()["consumed"]) == (6, 0)


@pytest.mark.parametrize("entry,value,named", [("schedule", [[0, [3, 2, 1]], [36.9, [1, 1, 1]]],
                                                "entry 1: position 36.9 is not an integer"),
                                               ("schedule", [[0, [3, 2, 1]], ["36", [1, 1, 1]]],
                                                "entry 1: position '36' is not an integer"),
                                               ("schedule", [[0, [3, "2", 1]], [36, [1, 1, 1]]],
                                                "entry 0: weight '2' is not a number"),
                                               ("weights", ["3", 2, 1], "weight '3' is not a number")])
def test_a_loosely_written_schedule_names_the_entry_and_the_value(raw_sources, entry, value, named):
    loader = _raw_loader(raw_sources, {"a": 3, "b": 2, "c": 1})
    state = loader.state_dict()
    with pytest.raises(LoaderStateError, match=re.escape(named) + "$"):
        loader.load_state_dict({**state, "mixture": {**state["mixture"], entry: value}})
    loader.close()
