"""Review round 4 (issue 28), the data side: tiny mixture weights, an ``--overwrite`` into a conversion in
parts, a shard rewritten in place after ``fastio index``, two Loaders sharing one cache, an S3 outage."""

from __future__ import annotations

import numpy as np
import pytest

from fastio import Mixture
from fastio.mixorder import MAX_PERIOD, MixSchedule
from fastio.shards import ShardWriter


def _small(dest, n):
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:03d}", "txt": b"x%d" % i, "cls": b"%d" % (i % 2)})
        writer.close(label_field="cls", source={"format": "test"}, skipped=[])
    return dest


# -- 6: mixture weights below 1/65536 ---------------------------------------------------------------------

@pytest.mark.parametrize("big", [1e6, 1e12])
def test_a_share_below_the_smallest_representable_one_is_refused(tmp_path, big):
    """Before: 1e6:1 and 1e12:1 both gave source b a share of 1.53e-5 (1/65536) without a word."""
    a, b = _small(tmp_path / "a", 4), _small(tmp_path / "b", 4)
    smallest = rf"1/{MAX_PERIOD} = 1\.53e-05"
    with pytest.raises(ValueError, match=rf"^weight 1 of mixture source 'b' is a share of {1 / (big + 1):.3g}, "
                                         rf"below the smallest share a mixture can represent, {smallest}: give it"):
        Mixture({"a": a, "b": b}, weights={"a": big, "b": 1})
    with pytest.raises(ValueError, match=rf"mixture source 'b' is a share of .*{smallest}"):
        MixSchedule(("a", "b"), (big, 1.0), ("fa", "fb"), 10)


def test_the_smallest_representable_share_is_exact(tmp_path):
    a, b = _small(tmp_path / "a", 4), _small(tmp_path / "b", 4)
    mix = Mixture({"a": a, "b": b}, weights={"a": MAX_PERIOD - 1, "b": 1})
    schedule = mix.schedule(0)
    assert schedule.counts == (MAX_PERIOD - 1, 1)
    src, _ = schedule.sources(0, np.arange(2 * MAX_PERIOD))
    assert int((src == 1).sum()) == 2

