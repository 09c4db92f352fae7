"""A Loader's options in typed groups, as Grain groups its ``DatasetOptions`` and ``MultiprocessingOptions``: the order
(:class:`OrderOptions`), the performance knobs (:class:`PerformanceOptions`), where and how shards are read
(:class:`ShardOptions`) and the ranks (:class:`RankOptions`), together :class:`Options`.

:class:`fastio.LoaderConfig` keeps its flat keyword arguments (``Loader(dest, batch_size=..., seed=...)``, as
documented) and builds these groups from them once (``config.options``); the read set and the Loader's parts take
the groups they need, never an untyped bag. ``LoaderConfig.grouped(order=OrderOptions(seed=1), ...)`` makes a
config from groups.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastio.checks import switch_option
from fastio.dist import usable_cpus

__all__ = ["OrderOptions", "Options", "PerformanceOptions", "RankOptions", "ShardOptions", "count_option"]


def count_option(name: str, value: Any, least: int) -> int:
    """``value`` as an int of at least ``least`` (a numpy integer too: a config read with numpy), else ValueError
    naming the option: a string, a float or a bool (taken as a count of 1) would otherwise reach a comparison or
    DALI's constructor and fail there without naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {int(value)}")
    return int(value)


def _put(group: Any, name: str, value: Any) -> None:
    object.__setattr__(group, name, value)  # frozen: __post_init__ stores the checked value this way


@dataclass(frozen=True)
class OrderOptions:
    """Which samples come when: the order of every epoch and every sample's augmentation."""

    seed: int = 0
    """Seeds the order of every epoch and every sample's augmentation."""
    shuffle: str = "global"
    """``global`` (full permutation), ``block`` (shuffled shards, samples shuffled in windows) or ``none``."""
    block_shards: int = 4
    """Shards per window in ``block`` mode."""
    drop_last: bool = False
    """Drop the last incomplete global batch of each epoch."""
    remainder: str = "pad"
    """Without drop_last: ``pad`` (wrap to the epoch's start) or ``partial`` (smaller batches)."""

    def __post_init__(self):  # the others are checked by fastio.order.sampler.SamplerSpec, which uses them
        _put(self, "drop_last", switch_option("drop_last", self.drop_last))


@dataclass(frozen=True)
class PerformanceOptions:
    """Threads and depths: how fast, never what. Defaults are filled in when made (checked: ValueError)."""

    num_threads: int | None = None
    """DALI worker threads (default: the CPUs this process may run on, :func:`fastio.dist.usable_cpus`)."""
    pin_threads: bool | None = None
    """Pin DALI's worker threads one to a CPU, in turn over those this process may run on, as soon as its pipeline's
    first batch is scheduled. None (default): pin when this process is its job's only one on the node
    (:func:`fastio.dist.alone_on_node`); a process bound to its own CPUs (Slurm's ``--cpu-bind``, ``taskset``) may
    pass True; False never pins. Unpinned, a 2-CPU VM's scheduler was seen to stack both workers on one CPU while
    the other idled, a tenth of the time (docs/performance.md, Loader, fifth pass)."""
    prefetch: int = 2
    """DALI prefetch queue depth (batches decoded ahead of the training loop)."""
    read_ahead: int | None = None
    """Batches whose bytes are read ahead of the DALI feed (default: ``prefetch + 1``)."""
    reader_threads: int | None = None
    """Threads reading shard bytes (default: min(4, the CPUs this process may run on))."""
    progress: bool = False
    """Print a throughput/stall line to stderr every 5 seconds while batches come."""

    def __post_init__(self):
        cores = len(usable_cpus())
        if self.pin_threads is not None and not isinstance(self.pin_threads, bool):
            raise ValueError(f"pin_threads must be True, False or None, got {self.pin_threads!r}")
        _put(self, "progress", switch_option("progress", self.progress))
        _put(self, "prefetch", count_option("prefetch", self.prefetch, 1))
        defaults = {"num_threads": cores, "read_ahead": self.prefetch + 1, "reader_threads": min(4, cores)}
        for name, default in defaults.items():  # None: the default; 0 is a value, checked as any other
            value = getattr(self, name)
            _put(self, name, default if value is None else count_option(name, value, 0 if name == "read_ahead" else 1))


@dataclass(frozen=True)
class ShardOptions:
    """Where a dataset's shards come from and how they are checked: the node cache of an ``s3://`` dataset, its
    object-store settings, shard read-ahead, sha256 checks."""

    verify: bool = False
    """Check each shard's sha256 against the manifest before its first use (and the sample index's)."""
    cache_dir: str | None = None
    """For an ``s3://`` dataset: the node-local cache directory its shards are read through."""
    cache_size: int | str | None = None
    """Bound of the cache's shard bytes, e.g. ``"500GB"`` (default: half the free space of its file system)."""
    storage_options: dict | None = field(default=None, compare=False)
    """Object-store settings over those found in the environment (:class:`fastio.storage.StorageOptions`)."""
    shard_read_ahead: int = 2
    """For an ``s3://`` dataset: shards fetched into the cache ahead of the furthest shard being read."""

    def __post_init__(self):
        _put(self, "verify", switch_option("verify", self.verify))
        _put(self, "shard_read_ahead", count_option("shard_read_ahead", self.shard_read_ahead, 0))


@dataclass(frozen=True)
class RankOptions:
    """This rank and the number of ranks (None: :func:`fastio.dist.rank_and_world` finds them)."""

    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self):
        for name in ("rank", "world_size"):  # their ranges: fastio.order.sampler.Sampler (rank of world_size)
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name} must be an integer (or None: found from torch.distributed or the "
                                 f"environment), got {value!r}")
            if value is not None:
                _put(self, name, int(value))  # a numpy integer as int: it goes into the Loader's state


GROUPS = {"order": OrderOptions, "performance": PerformanceOptions, "shards": ShardOptions, "ranks": RankOptions}
"""Each group of :class:`Options` by its name."""


@dataclass(frozen=True)
class Options:
    """Every group of a Loader's shared options (:class:`fastio.LoaderConfig` holds them as ``options``)."""

    order: OrderOptions = field(default_factory=OrderOptions)
    performance: PerformanceOptions = field(default_factory=PerformanceOptions)
    shards: ShardOptions = field(default_factory=ShardOptions)
    ranks: RankOptions = field(default_factory=RankOptions)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Options:
        """The groups of the flat options ``flat`` (each group takes its own names; the others are left)."""
        return cls(**{name: group(**{f.name: flat[f.name] for f in dataclasses.fields(group) if f.name in flat})
                      for name, group in GROUPS.items()})

    def flat(self) -> dict[str, Any]:
        """Every group's options as one flat mapping (``LoaderConfig``'s keyword arguments)."""
        return {f.name: getattr(group, f.name) for group in (self.order, self.performance, self.shards, self.ranks)
                for f in dataclasses.fields(group)}
