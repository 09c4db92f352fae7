"""LoaderConfig's flat options travel in typed groups (order, performance, shards, ranks), built once from the
documented keyword arguments; a config made from groups is the same config and gives the same batches."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from fastio import ImageEval, Loader, LoaderConfig
from fastio.loader import OrderOptions, PerformanceOptions, RankOptions, ShardOptions
from fastio.read import readset
from fastio.read.options import Options

FLAT = {"batch_size": 4, "device": "cpu", "seed": 3, "shuffle": "block", "block_shards": 2, "reader_threads": 2,
        "prefetch": 1, "cache_size": "1GB", "rank": 0, "world_size": 1}


def test_the_flat_options_are_grouped_once_with_their_defaults_filled_in():
    cfg = LoaderConfig(**FLAT)
    assert cfg.options.order == OrderOptions(seed=3, shuffle="block", block_shards=2)
    assert cfg.options.performance == PerformanceOptions(num_threads=cfg.num_threads, prefetch=1, read_ahead=2,
                                                         reader_threads=2)
    assert cfg.options.shards == ShardOptions(cache_size="1GB") and cfg.options.ranks == RankOptions(0, 1)
    assert (cfg.read_ahead, cfg.reader_threads) == (2, 2)  # the flat fields keep their filled-in defaults
    changed = dataclasses.replace(cfg, seed=4, shard_read_ahead=0)
    assert changed.options.order.seed == 4 and changed.options.shards.shard_read_ahead == 0
    assert changed.sampling.seed == 4


def test_a_config_made_from_groups_is_the_flat_one_and_gives_the_same_batches(image_dataset):
    grouped = LoaderConfig.grouped(batch_size=4, device="cpu", order=OrderOptions(seed=3, shuffle="block",
                                                                                  block_shards=2),
                                   performance=PerformanceOptions(prefetch=1, reader_threads=2),
                                   shards=ShardOptions(cache_size="1GB"), ranks=RankOptions(0, 1))
    assert grouped == LoaderConfig(**FLAT)
    with Loader(image_dataset, grouped, pipeline=ImageEval(size=16)) as a, \
            Loader(image_dataset, **FLAT, pipeline=ImageEval(size=16)) as b:
        for x, y in zip(a, b):
            assert torch.equal(x["index"], y["index"]) and torch.equal(x["image"], y["image"])


def test_a_bad_group_option_is_refused_naming_it():
    with pytest.raises(ValueError, match="prefetch must be >= 1, got 0"):
        LoaderConfig.grouped(performance=PerformanceOptions(prefetch=0))
    with pytest.raises(ValueError, match="shard_read_ahead must be >= 0, got -1"):
        LoaderConfig(shard_read_ahead=-1)


def test_the_read_set_takes_the_typed_groups():
    for fn in (readset.open_read_set, readset.ReadSet.__init__, readset._open_source, readset._check_shared_caches):
        assert inspect.signature(fn).parameters["options"].annotation == "Options", fn
    assert Options.from_flat(FLAT).flat()["seed"] == 3
