"""Two real gloo ranks (helpers.start_ranks, helpers.join_group) whose fastio Loaders were made differently: a save
refuses their checkpoint, naming the first entry of the loader state that differs, before anything is written.

The Loader's order is global: each rank takes its slice of one permutation of (seed, epoch), so a rank made with
another seed (``seed=base + rank``, an idiom of per-rank augmentation seeds) or another dataset slices another
order, and samples came twice while others never came, silently; and the checkpoint of such a run, which an
elastic restore reads as one global state (rank r takes saved rank r % A's), restored at another world size mixed
those orders again. (The first ``iter()`` of such Loaders refuses too, naming the field: this is the save's own
check, for Loaders saved before they were iterated.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import join_group, start_ranks

from fastio import Checkpointer, Loader, Raw
from fastio.errors import CheckpointError, LoaderArgumentError

CASES = {  # name: (each rank's Loader options, whether the save is refused)
    "same": (lambda rank: {}, None),
    "seed_per_rank": (lambda rank: {"seed": 100 + rank}, "seed=100 on rank 0, seed=101 on rank 1"),
    "batch_per_rank": (lambda rank: {"batch_size": 4 + rank}, "batch_size=4 on rank 0, batch_size=5 on rank 1"),
    "rank_local": (lambda rank: {"seed": rank, "world_size": 1, "rank": 0}, None),  # one Loader a rank: its own
    "state_dict_fails_on_rank_1": (lambda rank: {}, "state_dict() failed: OSError: rank 1's loader is gone"),
}


class _Failing:
    """A loader (it has check_state_dict) whose state_dict fails on rank 1: every rank's save fails, none waits."""

    def __init__(self, loader, rank: int):
        self.loader, self.rank = loader, rank

    def state_dict(self):
        if self.rank == 1:
            raise OSError("rank 1's loader is gone")
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)

    def check_state_dict(self, state):
        return self.loader.check_state_dict(state)


def _worker(rank: int, data: str, base: str) -> None:
    for name, (options, _) in CASES.items():
        out = Path(base, name)
        join_group(rank, 2, out / "group.port")
        try:
            loader = Loader(data, **{"batch_size": 4, "pipeline": Raw(), "device": "cpu", "seed": 3,
                                     "num_threads": 1, **options(rank)})
            try:
                next(iter(loader))
            except LoaderArgumentError:  # ranks whose Loaders differ: the first iter() refuses (test_loader_distributed)
                pass  # and a save of such Loaders (not iterated: a checkpoint before training) still refuses
            ckpt = Checkpointer(out / "ck", signals=())
            try:
                ckpt.save(1, {"loader": _Failing(loader, rank) if name.startswith("state_dict") else loader},
                          blocking=True)
                error = None
            except CheckpointError as err:
                error = str(err)
            steps = ckpt.steps()
            ckpt.close()
            loader.close()
            Path(out, f"rank{rank}.json").write_text(json.dumps({"error": error, "steps": steps}))
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _image_originals) -> Path:
    base = tmp_path_factory.mktemp("loader-agree")
    for name in CASES:
        (base / name).mkdir()
    start_ranks(_worker, (str(_image_originals[1]), str(base)), 2)
    return base


@pytest.mark.parametrize("name", list(CASES))
def test_a_save_refuses_ranks_whose_loaders_differ_naming_the_entry(runs, name):
    refused = CASES[name][1]
    got = [json.loads((runs / name / f"rank{r}.json").read_text()) for r in range(2)]
    if refused is None:
        assert [g["error"] for g in got] == [None, None] and [g["steps"] for g in got] == [[1], [1]]
        return
    for g in got:  # every rank raises the same line, and nothing is committed
        assert g["error"] is not None and g["steps"] == [], g
        if name.startswith("state_dict"):
            assert "rank 1" in g["error"] and f"app key loader: {refused}" in g["error"], g["error"]
            continue
        assert f"ranks' loader states differ (app key 'loader'): {refused}" in g["error"], g["error"]
        assert "every rank's Loader must be made alike" in g["error"], g["error"]
