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
