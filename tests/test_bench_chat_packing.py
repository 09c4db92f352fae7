"""bench/chat.py's packing rows: the padding fraction of each packer (fastio's best-fit as the Loader packs, TRL's
``bfd`` where TRL is installed, ``make bench`` installs it) over documents of given lengths, and the log-normal
conversation lengths it draws (none over the sequence, the rest counted)."""

from __future__ import annotations

import numpy as np

from bench.chat import lognormal_lengths, padding_fractions


def test_padding_fractions_of_lengths_whose_best_packing_is_known():
    """Sequences of 10 tokens: 6+4, 5+5, 3+3+3 fill 3 sequences, 29 tokens of 30; first-fit decreasing and
    best-fit decreasing both find it, and so does TRL's best-fit decreasing."""
    lengths = np.array([3, 6, 5, 3, 4, 5, 3])
    got = padding_fractions(lengths, seq_len=9)
    assert set(got) == {"fastio_best_fit_window", "fastio_best_fit_whole", "fastio_first_fit_decreasing_whole",
                        "trl_bfd_sfttrainer", "trl_bfd_whole", "lower_bound"}
    for name, value in got.items():
        if isinstance(value, str):  # TRL not installed here: the row says why instead of a number
            assert name.startswith("trl_") and value.startswith("TRL is not importable"), (name, value)
        else:
            assert abs(value - 1 / 30) < 1e-12, (name, value)


def test_the_window_costs_padding_that_the_whole_epoch_does_not():
    """Windows of 4,096 pack worse than the whole epoch at once (or as well), never better than the bound."""
    lengths, _ = lognormal_lengths(10_000, 300, 0.9, 1025)
    got = padding_fractions(lengths, seq_len=1024)
    assert got["lower_bound"] <= got["fastio_best_fit_whole"] <= got["fastio_best_fit_window"] < 0.05
    if not isinstance(got["trl_bfd_whole"], str):
        assert got["trl_bfd_whole"] == got["fastio_best_fit_whole"]  # the same rule on the same lengths
        assert got["trl_bfd_sfttrainer"] >= got["fastio_best_fit_window"]  # 1,000 at a time, not 4,096


def test_lognormal_lengths_leave_out_what_exceeds_the_sequence():
    kept, left_out = lognormal_lengths(10_000, 1250, 0.6, 2049)
    assert kept.max() <= 2049 and kept.min() >= 16 and left_out > 0
    assert len(kept) + left_out == 10_000
    assert 1100 < np.median(np.r_[kept, np.full(left_out, 10**6)]) < 1400  # the median drawn: about 1,250
