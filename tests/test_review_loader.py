"""Review of the Loader's order parameters where they enter: a loader state stores ``seed`` and
``block_shards`` and a resume reads them back as integers, so a float or bool seed that was accepted at
construction made every later resume fail (``loader state has seed=1.5, not an integer``)."""

from __future__ import annotations

import numpy as np
import pytest
from resume import check_resume

from fastio import Loader


@pytest.mark.parametrize("kw,match", [(dict(seed=1.5), r"seed must be an integer, got 1\.5"),
                                      (dict(seed=True), r"seed must be an integer, got True"),
                                      (dict(seed="7"), r"seed must be an integer, got '7'"),
                                      (dict(block_shards=2.5), r"block_shards must be an integer >= 1, got 2\.5")])
def test_order_parameters_that_a_resume_cannot_read_are_refused_at_once(image_dataset, kw, match):
    with pytest.raises(ValueError, match=match):
        Loader(image_dataset, batch_size=4, pipeline="raw", device="cpu", **kw)


def test_a_numpy_seed_resumes(image_dataset):
    state = check_resume(lambda: Loader(image_dataset, batch_size=4, pipeline="raw", device="cpu", seed=np.int64(3),
                                        world_size=1, rank=0, num_threads=1), n=3, k=3)
    assert state["seed"] == 3  # a guard: numpy integers (a config read with numpy) stay accepted


@pytest.mark.parametrize("epoch", [1.5, True, "1", -1])
def test_set_epoch_takes_only_a_non_negative_integer(image_dataset, epoch):
    """A float or bool epoch was accepted and stored in the state (another order); a string failed with a bare
    TypeError."""
    with Loader(image_dataset, batch_size=4, pipeline="raw", device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(ValueError, match=rf"epoch must be an integer >= 0, got {epoch!r}"):
            loader.set_epoch(epoch)
        loader.set_epoch(np.int64(2))
        assert loader.state_dict()["epoch"] == 2 and type(loader.state_dict()["epoch"]) is int


def test_a_mixture_state_into_a_one_dataset_loader_says_so(image_dataset):
    from fastio import Mixture
    from fastio.errors import LoaderStateError

    def make(data):
        return Loader(data, batch_size=4, pipeline="raw", device="cpu", world_size=1, rank=0)

    with make(Mixture({"a": image_dataset})) as mixed:
        next(iter(mixed))
        state = mixed.state_dict()
    with make(image_dataset) as plain, pytest.raises(LoaderStateError, match=r"loader state is of a mixture "
                                                                             r"\(sources 'a'\)"):
        plain.load_state_dict(state)


def test_inspect_names_a_missing_mixture_file_and_refuses_a_negative_epoch(tmp_path, capsys):
    from helpers import run_cli

    code, _, err = run_cli(["inspect", str(tmp_path / "mix.json")], capsys)
    assert code == 2 and f"{tmp_path / 'mix.json'}: cannot read the mixture file" in err
    code, _, err = run_cli(["inspect", str(tmp_path), "--order", "--epoch", "-1"], capsys)
    assert code == 2 and "--epoch" in err and "-1" in err
