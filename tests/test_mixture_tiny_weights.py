"""Mixture weights at the edge of what a schedule can represent: a share below 1/65536 is refused naming the
source and the least weight that works, that least weight is accepted, and the smallest share is exact."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fastio import Mixture
from fastio.dataset.shards import ShardWriter
from fastio.order.mixorder import MAX_PERIOD, MixSchedule


def _small(dest, n):
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:03d}", "txt": b"x%d" % i, "cls": b"%d" % (i % 2)})
        writer.close(label_field="cls", converted_from={"format": "test"}, skipped=[])
    return dest


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


@pytest.mark.parametrize("big", [1e6, 3e7, 86415.0, 1e12])
def test_the_smallest_weight_a_refusal_suggests_is_accepted(big):
    """Point 6: the refusal of ``1e6:1`` said "give it a weight of at least 15.259", the exact minimum (15.2590219)
    rounded down to 6 digits: 15.259 was refused in turn."""
    with pytest.raises(ValueError, match="give it a weight of at least") as err:
        MixSchedule(("a", "b"), (big, 1.0), ("fa", "fb"), 10)
    least = float(re.search(r"at least (\S+) \(with", str(err.value)).group(1))
    MixSchedule(("a", "b"), (big, least), ("fa", "fb"), 10)  # accepted
    assert least <= (big / (65536 - 1)) * (1 + 1e-5)  # and still about the smallest
