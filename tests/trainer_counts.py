"""What the trainer resume tests (tests/test_lightning_resume.py, tests/test_accelerate.py) share: an 80-sample
dataset and the count of the samples each epoch trained, over every rank of every run (issue 28, points 1, 2)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from conftest import write_image_dataset

from fastio.convert.synthetic import make_imagefolder

SAMPLES = 80


def dataset80(tmp_path: Path) -> Path:
    """80 small images (4 classes) in 5 shards of 16."""
    src = make_imagefolder(tmp_path / "src80", classes=4, per_class=20, min_side=16, max_side=24)
    return write_image_dataset(tmp_path / "ds80", src)


def read_logs(where: Path, log: str) -> list[list]:
    """Every rank's ``LOG.rankR`` (a JSON list of ``[epoch, indices]``, one per batch), rank by rank."""
    paths = sorted(where.glob(f"{log}.rank*"), key=lambda p: int(p.name.rsplit("rank", 1)[1]))
    return [json.loads(p.read_text()) for p in paths]


def per_epoch(*runs: list[list]) -> dict[int, Counter]:
    """How often each sample was trained in each epoch, over all ranks of all runs."""
    counts: dict[int, Counter] = {}
    for ranks in runs:
        for batches in ranks:
            for epoch, indices in batches:
                counts.setdefault(epoch, Counter()).update(indices)
    return counts


def assert_exactly_once(counts: Counter, where: str) -> None:
    missing = sorted(set(range(SAMPLES)) - set(counts))
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert not missing and not twice, f"{where}: {len(missing)} samples never trained {missing[:10]}, " \
                                      f"{len(twice)} trained more than once {twice[:10]}"
