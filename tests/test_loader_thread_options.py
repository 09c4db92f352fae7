"""A Loader's thread and depth options are checked when the config is made: ``num_threads=0`` or
``reader_threads=0`` is a ValueError naming the option and the value (it used to be taken silently as "not given",
every CPU), as a negative one is; None still means the default."""

from __future__ import annotations

import pytest

import fastio


@pytest.mark.parametrize("option, value", [("num_threads", 0), ("reader_threads", 0), ("num_threads", -2),
                                           ("reader_threads", -1), ("read_ahead", -1)])
def test_a_thread_count_below_one_is_refused_naming_it(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be >= {0 if option == 'read_ahead' else 1}, got {value}"):
        fastio.LoaderConfig(batch_size=4, **{option: value})


def test_none_still_takes_the_default():
    performance = fastio.LoaderConfig(batch_size=4, num_threads=None, reader_threads=None).options.performance
    assert performance.num_threads >= 1 and 1 <= performance.reader_threads <= 4
    assert performance.read_ahead == performance.prefetch + 1
