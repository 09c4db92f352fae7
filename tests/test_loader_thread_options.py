"""A Loader's thread and depth options are checked when the config is made: ``num_threads=0`` or
``reader_threads=0`` is a ValueError naming the option and the value (it used to be taken silently as "not given",
every CPU), as a negative one is; None still means the default."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("option", ["num_threads", "prefetch", "read_ahead", "reader_threads", "shard_read_ahead"])
@pytest.mark.parametrize("value", ["2", 1.5, True])
def test_a_count_that_is_not_an_integer_is_refused_naming_it(option, value):
    """A string failed with a bare ``'<' not supported between instances of 'str' and 'int'``; a float passed the
    check and reached DALI (a bare TypeError from its constructor when the pipeline was built); a bool was taken as
    a count of 1."""
    least = 1 if option in ("num_threads", "prefetch", "reader_threads") else 0
    with pytest.raises(ValueError, match=rf"^{option} must be an integer >= {least}, got {value!r}$"):
        fastio.LoaderConfig(batch_size=4, **{option: value})


def test_numpy_integer_counts_are_taken_as_ints(image_dataset):
    """A config read with numpy: a numpy integer batch_size was refused ("must be a positive int, got
    np.int64(4)") and a numpy prefetch reached DALI, which refused it with a bare TypeError."""
    config = fastio.LoaderConfig(batch_size=np.int64(4), num_threads=np.int32(1), prefetch=np.int64(2),
                                 read_ahead=np.int64(2), reader_threads=np.int64(1), shard_read_ahead=np.int64(1),
                                 pipeline=fastio.ImageTrain(size=16), device="cpu", world_size=1, rank=0)
    for name in ("batch_size", "num_threads", "prefetch", "read_ahead", "reader_threads", "shard_read_ahead"):
        assert type(getattr(config, name)) is int, name
    with fastio.Loader(image_dataset, config) as loader:
        batch = next(iter(loader))
        assert batch["image"].shape[0] == 4 and loader.state_dict()["batch_size"] == 4


@pytest.mark.parametrize("value", [True, 2.0, "4"])
def test_a_batch_size_that_is_not_an_integer_is_refused(value):
    """``batch_size=True`` was taken as batches of one sample."""
    with pytest.raises(ValueError, match=rf"^batch_size must be a positive int, got {value!r}$"):
        fastio.LoaderConfig(batch_size=value)


@pytest.mark.parametrize("option", ["drop_last", "verify", "progress"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_switch_that_is_not_a_bool_is_refused_naming_it(option, value):
    """Any value was taken by its truth: ``drop_last="no"`` dropped the epoch's last batch."""
    with pytest.raises(ValueError, match=rf"^{option} must be True or False, got {value!r}$"):
        fastio.LoaderConfig(batch_size=4, **{option: value})
    assert getattr(fastio.LoaderConfig(batch_size=4, **{option: np.bool_(True)}), option) is True
