"""A checkpoint restored after its data was converted again (issue 40, 8): the loader's saved position names
samples of the old dataset, so the exact restore refuses it, naming the way forward; ``loader_policy="next-epoch"``
restores everything else and starts the new dataset's next epoch (it refused with the same line before), and
``Loader.next_epoch_state`` does the same for a Loader alone. Also for a mixture whose source was converted again."""

from __future__ import annotations

import json
import shutil
from itertools import islice

import numpy as np
import pytest
import torch
from conftest import write_image_dataset
from helpers import StateHolder
from test_mixture import _small
from tokens_helpers import word_corpus
from torch import nn

import fastio
from fastio import Checkpointer, Loader, Mixture, Raw
from fastio.errors import CheckpointError, LoaderStateError

WAY = "restore_latest(..., loader_policy='next-epoch'); a Loader alone: loader.set_epoch(1) instead of load_state_dict"


def _tokens(ds):
    return Loader(ds, pipeline=fastio.Tokens(seq_len=16, window=8), batch_size=4, device="cpu", seed=3,
                  world_size=1, rank=0, reader_threads=1)


def _grow(root, more: int) -> None:
    """Convert ``root``'s corpus again into the same DEST (overwrite) with ``more`` documents appended."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    rng = np.random.default_rng(1)
    words = "alpha beta gamma delta".split()
    with open(root / "c.jsonl", "a") as f:
        f.writelines(json.dumps({"text": " ".join(rng.choice(words, 12))}) + "\n" for _ in range(more))
    convert_tokens(TokenConvertConfig(root / "c.jsonl", root / "ds", root / "tokenizer.json", workers=1,
                                      max_samples_per_shard=25, overwrite=True))


def _zeroed() -> nn.Linear:
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _saved(tmp_path, old: Loader, batches: int, step: int) -> tuple[dict, nn.Linear]:
    """``old`` iterated ``batches`` batches, saved at ``step`` in ``tmp_path / "ck"`` with a fresh model, then closed:
    the Loader's state and that model."""
    list(islice(iter(old), batches))
    state, model = old.state_dict(), nn.Linear(4, 2)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(step, {"model": model, "loader": old}, blocking=True)
    old.close()
    return state, model


def test_a_token_corpus_converted_again_restores_at_its_next_epoch(tmp_path):
    ds = word_corpus(tmp_path)
    old = _tokens(ds)
    saved_state, saved_model = _saved(tmp_path, old, 3, 5)
    _grow(tmp_path, 40)  # the corpus gained documents: another fingerprint, more sequences

    model, new = _zeroed(), _tokens(ds)
    assert new.state_dict()["fingerprint"] != saved_state["fingerprint"]
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "loader": new})
        assert torch.count_nonzero(model.weight) == 0
        text = str(err.value)
        assert "app key 'loader'" in text and "converted again" in text and WAY in text, text
        state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
    assert (state.step, state.epoch) == (5, 1)
    assert torch.equal(model.weight, saved_model.weight)
    assert (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (1, 0)
    fresh = _tokens(ds)
    fresh.set_epoch(1)
    want = next(iter(fresh))
    assert torch.equal(next(iter(new))["tokens"], want["tokens"])  # the new corpus's epoch 1
    new.close()

    with pytest.raises(LoaderStateError, match="converted again") as err:  # a Loader alone
        fresh.load_state_dict(saved_state)
    assert WAY in str(err.value), err.value
    fresh.load_state_dict(fresh.next_epoch_state(saved_state))
    assert torch.equal(next(iter(fresh))["tokens"], want["tokens"])
    with pytest.raises(LoaderStateError, match="seed=4, this loader seed=3"):  # the rest is still checked
        fresh.next_epoch_state({**saved_state, "seed": 4})
    fresh.close()


def test_a_mixture_whose_source_was_converted_again_restores_at_its_next_epoch(tmp_path):
    sources = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1)}

    def loader():
        return Loader(Mixture(sources, weights={"a": 1, "b": 1}), batch_size=6, pipeline=Raw(), device="cpu", seed=5,
                      world_size=1, rank=0, num_threads=1, prefetch=2)

    old = loader()
    list(islice(iter(old), 2))
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(7, {"model": nn.Linear(4, 2), "loader": old}, blocking=True)
    old.close()
    shutil.rmtree(sources["b"])
    _small(sources["b"], 11, 1, extra=b"y")  # source b converted again, with more samples
    new = loader()
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": _zeroed(), "loader": new})
        text = str(err.value)
        assert "source 'b' is dataset fingerprint" in text and "converted again" in text and WAY in text, text
        state = ckpt.restore_latest({"model": _zeroed(), "loader": new}, loader_policy="next-epoch")
    assert state.epoch == 1 and (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (1, 0)
    assert len(next(iter(new))["source"]) == 6
    new.close()


def test_a_version_1_loader_state_restores_at_its_next_epoch(tmp_path, image_dataset):
    """A checkpoint whose loader state is version 1 (an older fastio's order, a materialised numpy permutation): the
    refusal said "start ... at the next epoch with set_epoch(epoch + 1)", but loader_policy='next-epoch' (the only way
    there with a Checkpointer, which restores all or nothing) and Loader.next_epoch_state refused it with the same
    line, so the model and optimizer of such a checkpoint could not be restored with its loader at all."""
    def loader():
        return Loader(image_dataset, batch_size=4, pipeline=Raw(), device="cpu", seed=3, world_size=1, rank=0,
                      num_threads=1)

    with loader() as ld:
        v1 = {**ld.state_dict(), "version": 1, "epoch": 2, "consumed": 16}  # what the older fastio wrote
    saved_model = nn.Linear(4, 2)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(5, {"model": saved_model, "loader": StateHolder(v1)}, blocking=True)
    model, new = _zeroed(), loader()
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "loader": new})
        text = str(err.value)
        assert "app key 'loader'" in text and "version 1" in text and WAY.replace("set_epoch(1)", "set_epoch(3)") in text
        assert torch.count_nonzero(model.weight) == 0
        state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
    assert state.epoch == 3 and torch.equal(model.weight, saved_model.weight)
    restored = new.state_dict()
    assert {k: restored[k] for k in ("version", "epoch", "consumed")} == {"version": 2, "epoch": 3, "consumed": 0}
    with loader() as fresh:
        assert fresh.next_epoch_state(v1) == restored  # a Loader alone
        fresh.set_epoch(3)
        assert next(iter(new))["index"].tolist() == next(iter(fresh))["index"].tolist()
        with pytest.raises(LoaderStateError, match="seed=4, this loader seed=3"):  # the rest is still checked
            fresh.next_epoch_state({**v1, "seed": 4})
        with pytest.raises(LoaderStateError, match=r"loader state version 3 is from a newer fastio \(this one reads "
                                                   r"version 2\): upgrade fastio"):
            fresh.load_state_dict({**v1, "version": 3})
        with pytest.raises(LoaderStateError, match=r"loader state version 3 is from a newer fastio"):
            fresh.next_epoch_state({**v1, "version": 3})  # its next epoch's entries may mean other things too
        with pytest.raises(LoaderStateError, match=r"loader state version 3 is from a newer fastio"):
            fresh.load_state_dict({**v1, "version": 3, "consumed": {"sequences": 16}})  # not 'not an integer'
        with pytest.raises(LoaderStateError, match=r"^loader state version 0 is not one a fastio writes"):
            fresh.load_state_dict({**v1, "version": 0})
    new.close()


@pytest.mark.parametrize("now", [{"a": "a", "b": "b", "c": "c"},  # a source added
                                 {"a": "a"},                       # one removed
                                 {"a": "a", "bee": "b"},           # one renamed
                                 {"b": "b", "a": "a"}])            # reordered (the names number the sources)
def test_a_mixture_whose_sources_changed_restores_at_its_next_epoch(tmp_path, now):
    """A data-schedule change between runs (a source added, removed, renamed): the exact restore refuses it (the
    saved position names samples of the old mixture), but loader_policy='next-epoch' and Loader.next_epoch_state
    refused it too ("loader state is for sources ['a', 'b'], this mixture has ..."), so the model and optimizer
    could not be restored alongside, while set_epoch(1) on a bare Loader worked. Now the next epoch is the new
    mixture's (a pure function of seed and epoch), with a plain weights or a schedule, and the exact refusal names
    the way there."""
    paths = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1), "c": _small(tmp_path / "c", 13, 2)}

    def loader(names, weights=None):
        return Loader(Mixture({k: paths[v] for k, v in names.items()}, weights=weights), batch_size=6, pipeline=Raw(),
                      device="cpu", seed=5, world_size=1, rank=0, num_threads=1, prefetch=2)

    old = loader({"a": "a", "b": "b"}, {"a": 1, "b": 1})
    saved, saved_model = _saved(tmp_path, old, 2, 7)
    for weights in (None, [(0, {k: 1 for k in now}), (60, {k: 1 + i for i, k in enumerate(now)})]):
        model, new = _zeroed(), loader(now, weights)
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            with pytest.raises(CheckpointError) as err:
                ckpt.restore_latest({"model": model, "loader": new})
            text = str(err.value)
            assert "loader state is for sources ['a', 'b'], this mixture has" in text and WAY in text, text
            assert torch.count_nonzero(model.weight) == 0
            state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
        assert state.epoch == 1 and torch.equal(model.weight, saved_model.weight)
        restored = new.state_dict()
        assert (restored["epoch"], restored["consumed"]) == (1, 0)
        fresh = loader(now, weights)
        fresh.set_epoch(1)
        want = list(islice(iter(fresh), 3))
        got = list(islice(iter(new), 3))
        assert all(a["source"].tolist() == b["source"].tolist() and a["index"].tolist() == b["index"].tolist()
                   for a, b in zip(want, got))
        fresh.close()
        alone = loader(now, weights)  # a Loader alone
        with pytest.raises(LoaderStateError, match="this mixture has") as err:
            alone.load_state_dict(saved)
        assert WAY in str(err.value), err.value
        assert alone.next_epoch_state(saved) == restored
        with pytest.raises(LoaderStateError, match="seed=4, this loader seed=5"):  # the rest is still checked
            alone.next_epoch_state({**saved, "seed": 4})
        for ld in (new, alone):
            ld.close()


@pytest.mark.parametrize("was,now", [("one", "mix"), ("mix", "one")])
def test_a_dataset_that_became_a_mixture_or_back_restores_at_its_next_epoch(tmp_path, was, now):
    """A run on one dataset that adds a second source (or a mixture cut down to one dataset): the exact restore
    refused it without a way forward ("loader state is not a mixture's (no complete 'mixture' entry)", "make it
    with the same fastio.Mixture"), and so did the next-epoch restore; set_epoch(1) on a bare Loader worked."""
    a, b = _small(tmp_path / "a", 30, 0), _small(tmp_path / "b", 7, 1)

    def loader(kind):
        target = fastio.Dataset(a) if kind == "one" else Mixture({"a": a, "b": b})
        return Loader(target, batch_size=6, pipeline=Raw(), device="cpu", seed=5, world_size=1, rank=0, num_threads=1)

    old = loader(was)
    saved, saved_model = _saved(tmp_path, old, 2, 7)
    model, new = _zeroed(), loader(now)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "loader": new})
        assert WAY in str(err.value), err.value
        state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
    assert state.epoch == 1 and torch.equal(model.weight, saved_model.weight)
    assert (new.consumed, new.state_dict()["epoch"]) == (0, 1)
    with loader(now) as fresh:
        fresh.set_epoch(1)
        assert next(iter(new))["index"].tolist() == next(iter(fresh))["index"].tolist()
    with loader(now) as alone:
        with pytest.raises(LoaderStateError) as err:
            alone.load_state_dict(saved)
        assert WAY in str(err.value), err.value
        alone.load_state_dict(alone.next_epoch_state(saved))
        assert (alone.state_dict()["epoch"], alone.consumed) == (1, 0)
    new.close()


@pytest.mark.parametrize("now", [[(0, {"a": 2, "b": 1}), (20, {"a": 3, "b": 1})],  # an entry's weights before Q
                                 [(0, {"a": 1, "b": 1}), (5, {"a": 1, "b": 3})],   # an entry moved before Q
                                 {"a": 1, "b": 2}])                                 # plain weights now
def test_a_mixture_whose_schedule_past_changed_restores_at_its_next_epoch(tmp_path, now):
    """Found by the resume review: a user edits the schedule between runs (weights of steps already trained) and
    resumes at the next epoch. set_epoch(1) on a bare Loader took it, but loader_policy='next-epoch' and
    Loader.next_epoch_state refused it ("this mixture's schedule changes what came before it"), since the moved
    state kept the saved schedule: the model and optimizer could not be restored alongside. The next epoch is a pure
    function of (seed, epoch, schedule), as set_epoch draws it: now it is the new schedule's. The exact restore
    still refuses, and names the way there."""
    paths = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1)}

    def loader(weights):
        return Loader(Mixture(paths, weights=weights), batch_size=6, pipeline=Raw(), device="cpu", seed=5,
                      world_size=1, rank=0, num_threads=1, prefetch=2)

    old = loader([(0, {"a": 1, "b": 1}), (20, {"a": 3, "b": 1})])
    saved, saved_model = _saved(tmp_path, old, 2, 7)  # stream position 12
    model, new = _zeroed(), loader(now)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "loader": new})
        assert WAY in str(err.value), err.value
        assert torch.count_nonzero(model.weight) == 0
        state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
    assert state.epoch == 1 and torch.equal(model.weight, saved_model.weight)
    restored = new.state_dict()
    assert (restored["epoch"], restored["consumed"]) == (1, 0)
    fresh = loader(now)
    fresh.set_epoch(1)
    want, got = list(islice(iter(fresh), 4)), list(islice(iter(new), 4))
    assert [(b["source"].tolist(), b["index"].tolist()) for b in got] == \
        [(b["source"].tolist(), b["index"].tolist()) for b in want]
    alone = loader(now)  # a Loader alone
    assert alone.next_epoch_state(saved) == restored
    with pytest.raises(LoaderStateError, match="seed=4, this loader seed=5"):  # the rest is still checked
        alone.next_epoch_state({**saved, "seed": 4})
    damaged = {**saved, "mixture": {**saved["mixture"], "schedule": [[0, [1, 1]], [36.5, [3, 1]]]}}
    with pytest.raises(LoaderStateError, match="position 36.5 is not an integer"):  # a damaged entry still named
        alone.next_epoch_state(damaged)
    for ld in (fresh, new, alone):
        ld.close()


def test_a_mixture_saved_at_an_epoch_boundary_restores_exactly_with_a_schedule_whose_past_changed(tmp_path):
    """Found by the resume review, with the fix above: a loop that ran a whole epoch saves (1, 0), nothing of epoch 1
    delivered. The exact restore into a schedule whose past changed refused it, and its message pointed to the
    next-epoch restore, which starts epoch 2: a whole epoch never trained. Plain weights took such a state directly;
    now a schedule does too (epoch 1 as set_epoch(1) draws it under the new schedule)."""
    paths = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1)}

    def loader(weights):
        return Loader(Mixture(paths, weights=weights), batch_size=6, pipeline=Raw(), device="cpu", seed=5,
                      world_size=1, rank=0, num_threads=1, prefetch=2)

    old = loader([(0, {"a": 1, "b": 1}), (20, {"a": 3, "b": 1})])
    for _ in old:
        pass
    saved = old.state_dict()
    old.close()
    assert (saved["epoch"], saved["consumed"]) == (1, 0)
    now = [(0, {"a": 2, "b": 1}), (50, {"a": 1, "b": 3})]
    new, fresh = loader(now), loader(now)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(3, {"loader": StateHolder(saved)}, blocking=True)
        ckpt.restore_latest({"loader": new})  # exact
    fresh.set_epoch(1)
    want, got = list(islice(iter(fresh), 7)), list(islice(iter(new), 7))
    assert [(b["source"].tolist(), b["index"].tolist()) for b in got] == \
        [(b["source"].tolist(), b["index"].tolist()) for b in want]
    for ld in (new, fresh):
        ld.close()


def _way(epoch: int) -> str:
    return WAY.replace("set_epoch(1)", f"set_epoch({epoch})")


def _images(ds):
    return Loader(ds, batch_size=4, pipeline=Raw(), device="cpu", seed=3, world_size=1, rank=0, num_threads=1)


@pytest.mark.parametrize("more,start", [(0, 1), (1, 2)])  # (1, 0) at the epoch boundary; (1, 4) mid-epoch
def test_an_image_dataset_converted_again_after_a_whole_epoch_restores_the_epoch_it_had_not_begun(
        tmp_path, image_dataset, image_folder, more, start):
    """Found by the resume review: a loop that ran epoch 0 to its end saves (1, 0), nothing of epoch 1 delivered.
    Its dataset converted again, the exact restore refused, naming set_epoch(2), and loader_policy='next-epoch' (and
    Loader.next_epoch_state) started epoch 2: epoch 1 never trained, and TrainState.epoch said 2. A state with
    nothing of its epoch delivered starts that epoch; one mid-epoch (1, 4) still starts epoch 2."""
    with _images(image_dataset) as old:
        for _ in old:  # epoch 0, to its end
            pass
        list(islice(iter(old), more))  # and the first batch of epoch 1
        saved = old.state_dict()
        assert (saved["epoch"], saved["consumed"]) == (1, 4 * more)
        saved_model = nn.Linear(4, 2)
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            ckpt.save(5, {"model": saved_model, "loader": old}, blocking=True)
    first = next(image_folder.rglob("*.jpg"))
    shutil.copy(first, first.with_name("again.jpg"))  # the folder gained an image, converted again into the same DEST
    shutil.rmtree(image_dataset)
    write_image_dataset(image_dataset, image_folder)
    model, new = _zeroed(), _images(image_dataset)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": model, "loader": new})
        text = str(err.value)
        assert "converted again" in text and _way(start) in text, text
        state = ckpt.restore_latest({"model": model, "loader": new}, loader_policy="next-epoch")
    assert (state.step, state.epoch) == (5, start) and torch.equal(model.weight, saved_model.weight)
    assert (new.state_dict()["epoch"], new.state_dict()["consumed"]) == (start, 0)
    with _images(image_dataset) as fresh, _images(image_dataset) as alone:
        fresh.set_epoch(start)
        assert [b["index"].tolist() for b in islice(iter(new), 3)] == \
            [b["index"].tolist() for b in islice(iter(fresh), 3)]
        with pytest.raises(LoaderStateError, match="converted again") as err:  # a Loader alone
            alone.load_state_dict(saved)
        assert _way(start) in str(err.value), err.value
        assert alone.next_epoch_state(saved) == new.state_dict() | {"consumed": 0, "epoch": start}
    new.close()


@pytest.mark.parametrize("change", ["added", "converted"])
def test_a_mixture_whose_sources_changed_after_a_whole_epoch_restores_the_epoch_it_had_not_begun(tmp_path, change):
    """As above for a mixture: saved at (1, 0) after its whole epoch 0, then a source added (or one converted
    again): the next-epoch restore started epoch 2, and the refusal named set_epoch(2)."""
    paths = {"a": _small(tmp_path / "a", 30, 0), "b": _small(tmp_path / "b", 7, 1), "c": _small(tmp_path / "c", 13, 2)}

    def loader(names):
        return Loader(Mixture({k: paths[k] for k in names}, weights={k: 1 for k in names}), batch_size=6,
                      pipeline=Raw(), device="cpu", seed=5, world_size=1, rank=0, num_threads=1, prefetch=2)

    with loader("ab") as old:
        for _ in old:
            pass
        saved = old.state_dict()
        with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
            ckpt.save(7, {"model": nn.Linear(4, 2), "loader": old}, blocking=True)
    assert (saved["epoch"], saved["consumed"]) == (1, 0)
    if change == "converted":
        shutil.rmtree(paths["b"])
        _small(paths["b"], 11, 1, extra=b"y")
    names = "abc" if change == "added" else "ab"
    new = loader(names)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore_latest({"model": _zeroed(), "loader": new})
        assert _way(1) in str(err.value), err.value
        state = ckpt.restore_latest({"model": _zeroed(), "loader": new}, loader_policy="next-epoch")
    assert state.epoch == 1 and (new.state_dict()["epoch"], new.consumed) == (1, 0)
    with loader(names) as fresh, loader(names) as alone:
        fresh.set_epoch(1)
        got, want = list(islice(iter(new), 4)), list(islice(iter(fresh), 4))
        assert [(b["source"].tolist(), b["index"].tolist()) for b in got] == \
            [(b["source"].tolist(), b["index"].tolist()) for b in want]
        with pytest.raises(LoaderStateError) as err:
            alone.load_state_dict(saved)
        assert _way(1) in str(err.value), err.value
        assert (alone.next_epoch_state(saved)["epoch"], alone.next_epoch_state(saved)["consumed"]) == (1, 0)
    new.close()


class _OwnLoader(StateHolder):
    """A loader of the app's own: a position that checks its state, with no next_epoch_state."""

    def check_state_dict(self, state):
        return state


@pytest.mark.parametrize("consumed,start", [(0, 3), (8, 4)])
def test_a_loader_of_the_apps_own_at_an_epoch_boundary_restores_that_epoch(tmp_path, consumed, start):
    """The Checkpointer's own move (an object with check_state_dict and no next_epoch_state) started epoch + 1 from
    (3, 0) too: the same rule as the fastio Loader's."""
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(2, {"loader": StateHolder({"epoch": 3, "consumed": consumed})}, blocking=True)
        own = _OwnLoader(None)
        state = ckpt.restore_latest({"loader": own}, loader_policy="next-epoch")
    assert own.state == {"epoch": start, "consumed": 0} and state.epoch == start
