"""Exact resume at the same world size (every pipeline, every shuffle mode) and elastic resume."""

from __future__ import annotations

import shutil
from collections import Counter
from itertools import islice

import numpy as np
import pytest
from conftest import write_image_dataset
from resume import batches, check_resume, run_ranks, same_batch

from fastio import ImageEval, ImageTrain, Raw
from fastio.loader import Loader


def _factory(dest, **kw):
    opts = dict(batch_size=4, pipeline=ImageTrain(size=32), device="cpu", seed=7, world_size=1, rank=0, num_threads=1,
                prefetch=2, block_shards=2)
    opts.update(kw)
    return lambda: Loader(dest, **opts)


@pytest.mark.parametrize("pipeline", [ImageTrain(size=32), ImageEval(size=32), Raw()])
@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_same_world_size_resume_is_bitwise(image_dataset, pipeline, shuffle):
    # 48 samples / batch 4 = 12 batches per epoch: save mid-epoch, continue across the epoch boundary.
    state = check_resume(_factory(image_dataset, pipeline=pipeline, shuffle=shuffle), n=5, k=9)
    assert state["epoch"] == 0 and state["consumed"] == 20 and state["shuffle"] == shuffle


def test_resume_on_a_rank_of_many_with_padding(image_dataset):
    # world 5 x batch 4 = 20: 3 batches per epoch, the last one padded; save in epoch 1.
    check_resume(_factory(image_dataset, world_size=5, rank=3, drop_last=False), n=4, k=4)


def test_resume_with_drop_last(image_dataset):
    check_resume(_factory(image_dataset, batch_size=5, drop_last=True), n=7, k=6)


@pytest.mark.gpu
def test_same_world_size_resume_is_bitwise_cuda(image_dataset):
    check_resume(_factory(image_dataset, device="cuda", pipeline=ImageTrain(size=32)), n=5, k=9)


def _run_ranks(dest, world, n_batches=None, state=None, epoch=None, **kw):
    """Batches of every rank in lockstep; with n_batches None, to the end of the current epoch."""
    return run_ranks([_factory(dest, world_size=world, rank=r, **kw)() for r in range(world)], n_batches, state, epoch)


def _delivered(steps):
    out = []
    for step in steps:
        for b in step:
            out.extend(b["index"][~b["padded"]].tolist())
    return out


@pytest.mark.parametrize("old,new,n", [(2, 3, 2), (4, 1, 1), (3, 2, 2)])
@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_elastic_resume_delivers_rest_of_epoch_once(image_dataset, old, new, n, shuffle):
    kw = dict(pipeline=ImageTrain(size=32), shuffle=shuffle)
    before, states = _run_ranks(image_dataset, old, n_batches=n, **kw)
    assert len({tuple(sorted(s.items())) for s in states}) == 1, "ranks disagree on the state"
    state = states[0]
    assert state["consumed"] == n * 4 * old and state["world_size"] == old
    after, _ = _run_ranks(image_dataset, new, state=state, **kw)
    first, rest = _delivered(before), _delivered(after)
    loader = _factory(image_dataset)()
    keys = Counter(loader.key(i) for i in first + rest)
    assert keys == Counter(loader.key(i) for i in range(48)), "a sample was lost or delivered twice"
    assert not set(first) & set(rest)
    # A sample's augmentation does not depend on the world size, rank or batch that decodes it.
    single, _ = _run_ranks(image_dataset, 1, batch_size=6, **kw)
    image_of = {int(i): b["image"][j] for step in single for b in step for j, i in enumerate(b["index"])}
    for step in after:
        for b in step:
            for j, i in enumerate(b["index"].tolist()):
                assert np.array_equal(b["image"][j].numpy(), image_of[i].numpy()), f"sample {i} augmented differently"
    # The next epoch equals a fresh run at the new world size.
    nxt, _ = _run_ranks(image_dataset, new, n_batches=None, state={**state, "epoch": 1, "consumed": 0}, **kw)
    fresh, _ = _run_ranks(image_dataset, new, epoch=1, **kw)
    assert len(nxt) == len(fresh) == -(-48 // (4 * new))
    for s1, s2 in zip(nxt, fresh):
        assert all(same_batch(a, b) for a, b in zip(s1, s2))


def test_elastic_then_next_epoch_continues_in_same_loaders(image_dataset):
    _, states = _run_ranks(image_dataset, 2, n_batches=3, pipeline=Raw())
    loaders = [_factory(image_dataset, pipeline=Raw(), world_size=3, rank=r)() for r in range(3)]
    for ld in loaders:
        ld.load_state_dict(states[0])
    streams = [batches(ld) for ld in loaders]
    rest_batches = -(-(48 - 24) // 12)
    for _ in range(rest_batches):
        for s in streams:
            next(s)
    assert all(ld.state_dict()["epoch"] == 1 and ld.state_dict()["consumed"] == 0 for ld in loaders)
    fresh, _ = _run_ranks(image_dataset, 3, n_batches=2, epoch=1, pipeline=Raw())
    for step in fresh:
        got = [next(s) for s in streams]
        assert all(same_batch(a, b) for a, b in zip(step, got))


def test_set_epoch_keeps_restored_position(image_dataset):
    make = _factory(image_dataset, pipeline=Raw())
    a = make()
    list(islice(iter(a), 3))
    state = a.state_dict()
    b = make()
    b.load_state_dict(state)
    b.set_epoch(0)  # same epoch: position kept
    assert b.state_dict()["consumed"] == 12
    assert next(iter(b))["index"].tolist() == next(islice(batches(make()), 3, None))["index"].tolist()
    b.set_epoch(2)  # another epoch: starts at 0
    assert b.state_dict()["epoch"] == 2 and b.state_dict()["consumed"] == 0


def test_drop_last_epoch_ends_at_its_last_full_batch(image_dataset):
    make = _factory(image_dataset, batch_size=5, drop_last=True, pipeline=Raw())  # 9 batches, 3 samples dropped
    loader = make()
    assert len(list(islice(iter(loader), 9))) == 9
    assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (1, 0)
    check_resume(make, n=9, k=3)
    # An elastic restore whose rest of the epoch is smaller than one new global batch: that epoch has no batch
    # left, and iterating it moves on to the next epoch.
    resumed = _factory(image_dataset, batch_size=5, drop_last=True, pipeline=Raw(), world_size=2, rank=0)()
    resumed.load_state_dict({**loader.state_dict(), "epoch": 0, "consumed": 40})
    assert resumed.batches_left() == 0 and list(resumed) == []
    assert (resumed.state_dict()["epoch"], resumed.state_dict()["consumed"]) == (1, 0)


def test_set_epoch_after_a_restore_with_nothing_left_at_the_new_size_repeats_nothing(image_dataset):
    """A mid-epoch state whose rest is smaller than one global batch at the new world size (drop_last): the restore
    moved the Loader to the next epoch by itself, so the loop's set_epoch(0) (the restored epoch: "keeps a restored
    mid-epoch position", loader.md) moved it back to epoch 0's start and the whole epoch was delivered again."""
    kw = dict(batch_size=5, drop_last=True, pipeline=Raw())
    before, states = _run_ranks(image_dataset, 1, n_batches=8, **kw)  # 40 of 48: 8 left, a global batch is 10
    after, _ = _run_ranks(image_dataset, 2, state=states[0], epoch=0, **kw)
    assert after == [], f"{len(after)} steps of epoch 0 delivered again"
    nxt, _ = _run_ranks(image_dataset, 2, state=states[0], epoch=1, **kw)
    fresh, _ = _run_ranks(image_dataset, 2, epoch=1, **kw)
    assert len(nxt) == len(fresh) == 4 and all(same_batch(a, b) for x, y in zip(nxt, fresh) for a, b in zip(x, y))


def test_partial_remainder_resume_and_elastic(image_dataset):
    # world 3 x batch 5 = 15 per step; 48 = 3 x 15 + 3: the last step has one sample on each rank.
    make = _factory(image_dataset, batch_size=5, world_size=3, rank=2, remainder="partial", pipeline=ImageEval(size=32))
    check_resume(make, n=2, k=4)
    steps, _ = _run_ranks(image_dataset, 3, batch_size=5, remainder="partial", pipeline=Raw())
    assert [len(b["index"]) for b in steps[-1]] == [1, 1, 1]
    assert sorted(_delivered(steps)) == list(range(48))


def test_a_numpy_seed_resumes(image_dataset):
    state = check_resume(lambda: Loader(image_dataset, batch_size=4, pipeline=Raw(), device="cpu", seed=np.int64(3),
                                        world_size=1, rank=0, num_threads=1), n=3, k=3)
    assert state["seed"] == 3  # a guard: numpy integers (a config read with numpy) stay accepted


def test_a_config_of_numpy_integers_gives_a_state_a_checkpoint_takes(image_dataset, tmp_path):
    """seed, block_shards, rank and world_size given as numpy integers (a config read with numpy) came back as
    numpy integers in state_dict() (consumed too, computed from them), which the Checkpointer refused: "state key
    'loader/seed': cannot checkpoint a numpy.int64"."""
    from fastio.checkpoint import Checkpointer

    def make(**kw):
        return Loader(image_dataset, batch_size=4, pipeline=Raw(), device="cpu", num_threads=1, shuffle="block",
                      **kw)

    loader = make(seed=np.int64(3), block_shards=np.int32(2), world_size=np.int64(2), rank=np.int64(1))
    list(islice(iter(loader), 2))
    state = loader.state_dict()
    assert all(type(v) is int for k, v in state.items() if k not in ("fingerprint", "shuffle")), state
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"loader": loader}, blocking=True)
        again = make(seed=3, block_shards=2, world_size=2, rank=1)
        ckpt.restore_latest({"loader": again})
    assert again.state_dict() == state and state["consumed"] == 16
    loader.close()
    again.close()


@pytest.mark.parametrize("key", ["epoch", "consumed"])
def test_a_bool_in_a_state_is_not_an_integer(image_dataset, key):
    """A hand-edited state's ``consumed: true`` was read as 1 sample consumed."""
    from fastio.errors import LoaderStateError

    with _factory(image_dataset, pipeline=Raw())() as loader:
        with pytest.raises(LoaderStateError, match=rf"^loader state has {key}=True, not an integer$"):
            loader.load_state_dict({**loader.state_dict(), key: True})


@pytest.mark.parametrize("path,match", [
    (("fingerprint",), r"^loader state has fingerprint=array\(\[1, 2\]\), not a string \(a damaged or hand-edited"),
    (("shuffle",), r"^loader state has shuffle=array\(\[1, 2\]\), not a string \(a damaged or hand-edited"),
    (("tokens", "seq_len"), r"^loader state has tokens seq_len=array\(\[1, 2\]\), this Loader's fastio.Tokens "
                            r"seq_len=16"),
    (("tokens", "window"), r"^loader state has tokens window=tensor\(\[1, 2\]\), this Loader's fastio.Tokens "
                           r"window=8"),
    (("loss_mask", "train_on"), r"/ds: loader state's loss masks have train_on=array\(\[1, 2\]\), not a string "
                                r"\(a damaged or hand-edited state\)$"),
])
def test_an_array_in_a_state_entry_is_named_not_numpys_ambiguous_truth_value(token_ds, path, match):
    """A corrupted state whose entry holds an array of several values (a tensor too) failed its check with numpy's
    (torch's) bare 'The truth value of an array with more than one element is ambiguous', naming nothing."""
    import copy

    import torch

    import fastio
    from fastio.errors import LoaderStateError

    with Loader(token_ds, pipeline=fastio.Tokens(seq_len=16, window=8), batch_size=2, device="cpu",
                world_size=1, rank=0, reader_threads=1) as loader:
        state = copy.deepcopy(loader.state_dict())
        entry = state
        for key in path[:-1]:
            entry = entry[key]
        entry[path[-1]] = torch.tensor([1, 2]) if path[-1] == "window" else np.array([1, 2])
        with pytest.raises(LoaderStateError, match=match):
            loader.load_state_dict(state)


@pytest.mark.parametrize("shuffle", ["global", "none"])
def test_block_shards_matters_to_a_resume_only_in_block_mode(image_dataset, shuffle):
    """A state of shuffle='global' (or 'none') was refused by a Loader with another block_shards, "the sample
    order would differ": only 'block' windows use it."""
    from fastio.errors import LoaderStateError

    state = check_resume(_factory(image_dataset, pipeline=Raw(), shuffle=shuffle, block_shards=2), n=3, k=3)
    make = _factory(image_dataset, pipeline=Raw(), shuffle=shuffle, block_shards=3)
    again, ref = make(), _factory(image_dataset, pipeline=Raw(), shuffle=shuffle, block_shards=2)()
    again.load_state_dict(state)
    ref.load_state_dict(state)
    assert all(same_batch(a, b) for a, b in zip(again, ref))
    again.close()
    ref.close()
    with _factory(image_dataset, pipeline=Raw(), shuffle="block", block_shards=3)() as block:
        with pytest.raises(LoaderStateError, match="block_shards=2, this loader block_shards=3"):
            block.load_state_dict({**state, "shuffle": "block"})


@pytest.fixture(scope="module")
def tiny_datasets(tmp_path_factory, _image_originals) -> dict[int, object]:
    """Datasets of 1, 3 and 7 samples (shards of 1, 2 and 3) made from the session's image folder."""
    folder, _ = _image_originals
    base, out = tmp_path_factory.mktemp("tiny"), {}
    images = sorted(folder.rglob("*.jpg"))
    for n, per in ((1, 1), (3, 2), (7, 3)):
        src = base / f"src{n}"
        for path in images[:n]:
            (src / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, src / path.parent.name / path.name)
        out[n] = write_image_dataset(base / f"ds{n}", src, max_samples=per)
    return out


@pytest.mark.parametrize("case", range(16))
def test_a_loader_resumed_at_any_world_and_batch_size_delivers_the_epoch_once(tiny_datasets, image_dataset, case):
    """Property, through the Loader: save after k steps (0, mid-epoch, the last one) at world w1 and batch b1, load
    at w2 and b2 in fresh Loaders: the samples of the epoch are delivered once (padding repeats flagged), whatever the
    shuffle, remainder, seed or epoch; tiny datasets (N=1, N < world size, N < global batch) included."""
    rng = np.random.default_rng(case)
    n = [1, 3, 7, 48][case % 4]
    dest = image_dataset if n == 48 else tiny_datasets[n]
    common = dict(pipeline=Raw(), seed=[0, 2**63 - 1][case % 2], shuffle=["global", "block", "none"][case % 3],
                  remainder=["pad", "partial"][case // 4 % 2], block_shards=2)
    (w1, w2) = rng.integers(1, 5, 2).tolist()
    top = min(n, 4) + (4 if common["remainder"] == "partial" else 0)  # pad refuses a batch larger than the dataset
    (b1, b2) = rng.integers(1, top + 1, 2).tolist()
    epoch = [0, 5, 2**63 - 1][case % 3]
    total = -(-n // (w1 * b1))
    k = int(rng.choice([0, total // 2, total - 1]))
    before, states = _run_ranks(dest, w1, n_batches=k, epoch=epoch, batch_size=b1, **common)
    assert len({tuple(sorted(s.items())) for s in states}) == 1, "ranks disagree on the state"
    after, _ = _run_ranks(dest, w2, state=states[0], batch_size=b2, **common)
    got = Counter(_delivered(before) + _delivered(after))
    assert got == Counter(range(n)), (n, w1, b1, k, w2, b2, common)
    assert all(len(b["index"]) == b2 for step in after for b in step) or common["remainder"] == "partial"


@pytest.mark.parametrize("pipeline", [Raw(), ImageEval(size=32), ImageTrain(size=32)])
def test_partial_remainder_gives_a_dataset_smaller_than_a_batch_as_one_batch(tiny_datasets, pipeline):
    """As a torch DataLoader with drop_last=False does: 7 samples at batch_size 16 are one batch of the 7 (the
    Loader refused it, "batch_size 16 is larger than the dataset (7 samples)", even with remainder='partial'), the
    same batch, bitwise, as batch_size 7 gives, and each epoch another order of them."""
    make = _factory(tiny_datasets[7], batch_size=16, remainder="partial", pipeline=pipeline)
    whole = _factory(tiny_datasets[7], batch_size=7, remainder="partial", pipeline=pipeline)
    with make() as loader, whole() as ref:
        assert len(loader) == 1
        got, want = list(islice(batches(loader), 2)), list(islice(batches(ref), 2))
    assert [sorted(b["index"].tolist()) for b in got] == [list(range(7))] * 2
    assert not any(b["padded"].any() for b in got)
    assert all(same_batch(a, b) for a, b in zip(got, want))
    assert got[0]["index"].tolist() != got[1]["index"].tolist()  # epoch 1 is another order
    check_resume(make, n=1, k=2)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_partial_remainder_splits_a_dataset_smaller_than_a_batch_over_the_ranks(tiny_datasets, world):
    """3 samples at batch_size 16 over 2, 3 and 5 ranks: the rank shares differ by at most one sample, every sample
    comes once, and a rank left with none (more ranks than samples) gets one repeat flagged padded."""
    steps, _ = _run_ranks(tiny_datasets[3], world, batch_size=16, remainder="partial", pipeline=Raw())
    assert len(steps) == 1
    sizes = [int((~b["padded"]).sum()) for b in steps[0]]
    assert sizes == [3 // world + (r < 3 % world) for r in range(world)]
    assert all(len(b["index"]) == 1 and b["padded"].all() for b in steps[0][3:])
    assert sorted(_delivered(steps)) == [0, 1, 2]


@pytest.mark.parametrize("new", [1, 2, 3])
def test_partial_remainder_resumes_mid_epoch_into_a_batch_larger_than_what_is_left(tiny_datasets, new):
    """Saved after one step of 2 samples of a 7-sample epoch, resumed at batch_size 16 on 1..3 ranks: the 5 samples
    left come once, in one step, then the next epoch is the one a fresh Loader gives."""
    before, states = _run_ranks(tiny_datasets[7], 1, n_batches=1, batch_size=2, remainder="partial", pipeline=Raw())
    assert states[0]["consumed"] == 2
    after, _ = _run_ranks(tiny_datasets[7], new, state=states[0], batch_size=16, remainder="partial", pipeline=Raw())
    assert len(after) == 1 and Counter(_delivered(before) + _delivered(after)) == Counter(range(7))
    nxt, _ = _run_ranks(tiny_datasets[7], new, state=states[0], epoch=1, batch_size=16, remainder="partial",
                        pipeline=Raw())
    fresh, _ = _run_ranks(tiny_datasets[7], new, epoch=1, batch_size=16, remainder="partial", pipeline=Raw())
    assert all(same_batch(a, b) for x, y in zip(nxt, fresh) for a, b in zip(x, y)) and len(nxt) == len(fresh) == 1


def test_a_partial_batch_size_far_larger_than_the_dataset_costs_the_dataset_not_the_batch_size(tiny_datasets):
    """batch_size 2**31 over 7 samples with remainder='partial': one batch of the 7. DALI's pipeline was built with
    the Loader's batch_size as its batch (buffers sized by it: 6.4 GB at 10**8; at 2**31 a raw TypeError from
    DALI's constructor); it is now built for the most a batch holds, the 7."""
    with _factory(tiny_datasets[7], batch_size=2**31, remainder="partial", pipeline=ImageEval(size=32))() as loader:
        (batch,) = list(loader)
    assert sorted(batch["index"].tolist()) == list(range(7)) and batch["image"].shape[0] == 7
