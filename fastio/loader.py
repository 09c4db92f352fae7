"""The Loader users iterate: this rank's slice of the global order, read ahead, decoded by DALI, as torch.

Iterating a Loader yields the rest of the current epoch and then moves to the next epoch by itself; after a failed
``next()`` the next one on the same iterator asks for the batch that failed again.
``state_dict()`` records the position (global samples consumed by the training loop, not prefetched);
``load_state_dict()`` continues from there, at the same or at a different world size.

The Loader wires the parts together: :mod:`fastio.read.readset` (the dataset or mixture it reads: readers, order,
labels, keys, its share of the state), :mod:`fastio.pipelines` (the pipeline object: fields, DALI graph, batch),
:mod:`fastio.read.feeder` (the DALI callback), :mod:`fastio.read.stats`. It knows no kind's options and no mixture.
One feeder and one DALI pipeline serve the Loader's life (the feeder runs on into the next epoch by itself);
they are made again only when the position jumps. ``close()`` releases them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastio.checks import integer, next_epoch_start
from fastio.dataset.dataset import Dataset
from fastio.dist import agree_with_rank_zero, alone_on_node, initialized_rank_and_world, rank_and_world, usable_cpus
from fastio.errors import (
    DatasetError,
    FastioError,
    LoaderArgumentError,
    LoaderClosedError,
    LoaderStateError,
    PipelineMemoryError,
)
from fastio.order.replicas import Share, step_position
from fastio.order.sampler import SamplerSpec
from fastio.pipelines import BuiltPipeline, GraphDef, ImageTrain, Pipeline, Placement, build_graph
from fastio.pipelines.base import (
    checked_batch,
    checked_graph,
    checked_source,
    checked_state_entries,
    dali_inputs,
    dali_out_of_memory,
    dali_reason,
)
from fastio.read.feeder import Fed, Feeder
from fastio.read.mixture import Mixture, next_epoch_way
from fastio.read.options import Options, OrderOptions, PerformanceOptions, RankOptions, ShardOptions
from fastio.read.readset import ReadSet, coming, open_read_set
from fastio.read.stats import Stats
from fastio.words import count

__all__ = ["STATE_VERSION", "Loader", "LoaderConfig", "OrderOptions", "PerformanceOptions", "RankOptions",
           "ShardOptions"]

# 2: the lazy keyed order of fastio.order.sampler (fastio.order.feistel.ORDER_ALGORITHM). A version 1 state
# was written for the materialised numpy permutation, which is gone: it cannot continue its epoch (the position
# would mean other samples), but it starts the next one (Loader.next_epoch_state: it has version 2's entries).
STATE_VERSION = 2
K_VERSION, K_SEED, K_EPOCH, K_CONSUMED = "version", "seed", "epoch", "consumed"
K_WORLD_SIZE, K_BATCH_SIZE, K_FINGERPRINT, K_SHUFFLE, K_BLOCK_SHARDS = (
    "world_size", "batch_size", "fingerprint", "shuffle", "block_shards")
K_STEP = "step"  # with replicas=: the torchft Manager's step the position is
_ORDER_KEYS = (K_SEED, K_SHUFFLE, K_BLOCK_SHARDS)  # a different value would change the sample order
_SAME = {K_SEED: "seed (ranks take other samples of one order already: a per-rank seed=base+rank is not needed)",
         K_FINGERPRINT: "dataset (the same conversion of it)"}
"""How a refusal of ranks whose Loaders differ names what to give them alike, where the state's key would not say."""
_INT_KEYS = (K_VERSION, K_SEED, K_EPOCH, K_CONSUMED, K_WORLD_SIZE, K_BATCH_SIZE, K_BLOCK_SHARDS, K_STEP)
_STR_KEYS = (K_FINGERPRINT, K_SHUFFLE)


def _as_int(key: str, value: Any) -> int:
    """A state integer, also when a checkpoint round trip made it a numpy or 0-d torch integer."""
    number = integer(value)  # a hand-edited "consumed": true is not 1 sample
    if number is None:
        raise LoaderStateError(f"loader state has {key}={value!r}, not an integer")
    return number


# Arguments of torch's DataLoader (and similar loaders) that fastio does not take, with what to use instead.
_HABITS = {
    "num_workers": "fastio has no worker processes: DALI decodes on num_threads= threads, shard bytes are read "
                   "on reader_threads=",
    "pin_memory": "not needed: with device='cuda' batches are decoded straight into GPU memory",
    "sampler": "the order is built in (shuffle=, seed=; rank and world size from torch.distributed)",
    "collate_fn": "batches come as a dict of tensors; for other outputs pass pipeline=fastio.Graph(fn), a DALI graph "
                  "function",
}


def _check_habits(arguments: dict[str, Any]) -> None:
    """Refuse an argument of another loader with one line naming fastio's equivalent."""
    for name, hint in _HABITS.items():
        if name in arguments:
            raise LoaderArgumentError(f"Loader got {name}={arguments[name]!r}: {hint}")
    if isinstance(arguments.get("shuffle"), bool):
        use = "'global' (or 'block')" if arguments["shuffle"] else "'none'"
        raise LoaderArgumentError(f"Loader got shuffle={arguments['shuffle']}: fastio's shuffle is a mode, "
                                  f"use shuffle={use}")


# The Loader's old spellings (before 0.1), each refused with the pipeline object to give instead.
_OLD_KINDS = {"image-train": "ImageTrain", "image-eval": "ImageEval", "raw": "Raw"}
_OLD_OPTIONS = {"image_size": "size", "mean": "mean", "std": "std", "dtype": "dtype", "layout": "layout",
                "eval_crop_ratio": "crop_ratio", "fields": "fields"}
"""An old flat option and its name as an option of the pipeline object (``ImageTrain(size=)``,
``ImageEval(crop_ratio=)``)."""


def _refuse_unknown(arguments: dict[str, Any], options: set[str]) -> None:
    """Refuse an option LoaderConfig has not (a typo: ``batchsize=``) naming the nearest one, where one is near,
    rather than the dataclass's ``LoaderConfig.__init__() got an unexpected keyword argument``."""
    for name in sorted(set(arguments) - options):
        near = difflib.get_close_matches(name, sorted(options), n=1)
        hint = f": did you mean {near[0]}?" if near else ""
        raise LoaderArgumentError(f"Loader got an unknown option {name}={arguments[name]!r}{hint} (the options: "
                                  "LoaderConfig's fields)")


def _refuse_old_spellings(arguments: dict[str, Any]) -> None:
    """Refuse the old spellings among a config's arguments (``image_size=32``, ``eval_crop_ratio=``,
    ``fields=``, ..., ``graph=``, ``pipeline="image-train"`` or a graph function) in one line naming the pipeline
    object to give (``pipeline=fastio.ImageTrain(size=32)``)."""
    old = [name for name in (*_OLD_OPTIONS, "graph") if name in arguments]
    pipeline = arguments.get("graph", arguments.get("pipeline"))
    if not old and not (isinstance(pipeline, str) and pipeline in _OLD_KINDS) and not _graph_function(pipeline):
        return
    given = ", ".join(f"{name}={arguments[name]!r}" for name in (*old, "pipeline") if name in arguments)
    raise LoaderArgumentError(f"{given}: the old spelling; give the pipeline object: "
                              f"pipeline={_object_for(pipeline, arguments)}")


def _graph_function(pipeline: Any) -> bool:
    """Whether ``pipeline`` is a bare DALI graph function (the old spelling of ``fastio.Graph(fn)``)."""
    return callable(pipeline) and not isinstance(pipeline, Pipeline) and not isinstance(pipeline, type)


def _object_for(pipeline: Any, arguments: dict[str, Any]) -> str:
    """The pipeline object an old spelling describes, as code (``fastio.ImageEval(size=160, crop_ratio=0.5)``;
    beside an object, that object with those of the old options it has, the others named as not its own)."""
    if _graph_function(pipeline):
        return f"fastio.Graph({getattr(pipeline, '__name__', 'fn')})"
    given = [(old, new) for old, new in _OLD_OPTIONS.items() if old in arguments]
    if isinstance(pipeline, Pipeline):
        own = {f.name for f in dataclasses.fields(pipeline) if f.init} if dataclasses.is_dataclass(pipeline) else set()
        options = ", ".join(["...", *(f"{new}={arguments[old]!r}" for old, new in given if new in own)])
        foreign = [old for old, new in given if new not in own]
        unused = f" ({', '.join(foreign)}: not options of {type(pipeline).__name__})" if foreign else ""
        return f"fastio.{type(pipeline).__name__}({options}){unused}"
    kind = _OLD_KINDS.get(pipeline, "ImageEval" if "eval_crop_ratio" in arguments else "ImageTrain") \
        if isinstance(pipeline, str) or pipeline is None else "ImageTrain"
    return f"fastio.{kind}({', '.join(f'{new}={arguments[old]!r}' for old, new in given)})"


@dataclass(frozen=True)
class LoaderConfig:
    """What every kind of data shares in a :class:`Loader` (batch, order, ranks, device, prefetch, storage, cache)
    and the pipeline object that owns the rest; checked when made, then read-only.

    ``dataclasses.replace(config, **changes)`` (or ``Loader(dest, config, **changes)``) makes a changed copy.
    The flat options are grouped once, typed, in :attr:`options` (:mod:`fastio.read.options`: order, performance,
    shards, ranks), which the Loader's parts take; :meth:`grouped` makes a config from such groups.
    The old spellings (the flat image options ``image_size=``, ``mean=``, ``std=``, ``dtype=``, ``layout=``,
    ``eval_crop_ratio=``, ``fields=``; ``graph=``; ``pipeline=`` a kind's name or a graph function) are refused in
    one line naming the pipeline object to give (``pipeline=fastio.ImageTrain(size=32)``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> LoaderConfig:
        _refuse_old_spellings(kwargs)  # before the dataclass's __init__, which would name none of the objects
        _refuse_unknown(kwargs, {f.name for f in dataclasses.fields(cls) if f.init})
        return super().__new__(cls)

    batch_size: int = 64
    """Samples per batch on each rank (the global batch is ``batch_size * world_size``)."""
    pipeline: Pipeline = ImageTrain()
    """What a batch is: a pipeline object (:class:`fastio.ImageTrain`, :class:`fastio.ImageEval`,
    :class:`fastio.Raw`, :class:`fastio.Graph` (a DALI graph function ``f(image, device)`` on the decoded image),
    :class:`fastio.Tokens`, :class:`fastio.VideoClips`, :class:`fastio.AudioClips`, or a kind of your own)."""
    device: str = "auto"
    """``cuda`` (mixed decode into the memory of torch's current GPU: call ``torch.cuda.set_device`` first; the
    batch's host tensors follow through pinned memory, ``index``/``source``/``padded`` stay on the host), ``cpu``
    (DALI CPU operators) or ``auto`` (cuda when available)."""
    seed: int = 0
    """Seeds the order of every epoch and every sample's augmentation (any integer; a :class:`fastio.Graph`'s DALI
    random operators are seeded with it modulo 2**63, the range DALI takes)."""
    shuffle: str = "global"
    """``global`` (full permutation), ``block`` (shuffled shards, samples shuffled in windows) or ``none``."""
    block_shards: int = 4
    """Shards per window in ``block`` mode."""
    drop_last: bool = False
    """Drop the last incomplete global batch of each epoch."""
    remainder: str = "pad"
    """Without drop_last: ``pad`` fills the last global batch by wrapping to the start of the epoch order;
    ``partial`` splits what is left evenly over the ranks (smaller batches; a rank left with nothing gets
    one repeat), and takes a ``batch_size`` larger than the dataset (one batch of its samples; ``pad`` and
    drop_last refuse it). Repeats are flagged True in ``batch["padded"]``; every rank gets the same number of batches."""
    num_threads: int | None = None
    """DALI worker threads (default: the CPUs this process may run on)."""
    pin_threads: bool | None = None
    """Pin DALI's worker threads one to a CPU, in turn over those this process may run on (default None: when it
    is its job's only process on the node; True for a process bound to its own CPUs; False: never)."""
    prefetch: int = 2
    """DALI prefetch queue depth (batches decoded ahead of the training loop)."""
    read_ahead: int | None = None
    """Batches whose bytes are read ahead of the DALI feed (default: ``prefetch + 1``); until the first batch of a
    start or a resume comes out, only the ``prefetch`` batches the pipeline's first run asks for."""
    reader_threads: int | None = None
    """Threads reading shard bytes (default: min(4, the CPUs this process may run on))."""
    verify: bool = False
    """Check each shard's sha256 against the manifest before its first use, and the sample index's when the
    Loader opens the dataset (an ``s3://`` dataset's shards are always checked, when the cache fills them)."""
    rank: int | None = None
    """This rank (default: :func:`fastio.dist.rank_and_world`: torch.distributed, else env RANK, else 0; with
    ``replicas=``, the Manager's rank in its replica group); checked against the world size when the Loader is made."""
    world_size: int | None = None
    """Number of ranks (default: torch.distributed, else env WORLD_SIZE, else 1; with ``replicas=``, the ranks of the
    Manager's replica group)."""
    progress: bool = False
    """Print a throughput/stall line to stderr every 5 seconds while batches come (``stats.PROGRESS_EVERY_S``),
    and one at the end of every epoch."""
    cache_dir: str | None = None
    """For an ``s3://`` dataset: the node-local cache directory its shards are read through (shared by every
    process on the node; default ``$FASTIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastio``, else ``~/.cache/fastio``).
    Ignored for a local dataset."""
    cache_size: int | str | None = None
    """Bound of the cache's shard bytes, e.g. ``"500GB"`` (default: half the free space of its file system). It
    must hold this Loader's working set beside those of the other live Loaders of this process on the same
    ``cache_dir`` (docs/storage.md, Cache sizing)."""
    storage_options: dict | None = field(default=None, compare=False)
    """Object-store settings over those found in the environment: ``endpoint``, ``region``, ``access_key_id``,
    ``secret_access_key``, ``profile``, ``retries``, ``deadline_s``, ... (see :class:`fastio.storage.StorageOptions`)."""
    shard_read_ahead: int = 2
    """For an ``s3://`` dataset: shards fetched into the cache ahead of the furthest shard being read, in the
    order the sampler will want them (0: fetch on demand only); fewer, with one warning line, where the cache
    has no room for them on top of what the batches read at once."""
    options: Options = field(init=False, repr=False, compare=False)
    """The options above but ``batch_size``, ``pipeline`` and ``device`` in their typed groups (built and checked
    once, here; the defaults filled in)."""
    sampling: SamplerSpec = field(init=False, repr=False, compare=False)
    """The order and batching these options describe (built and checked once, here)."""

    def __post_init__(self):
        def put(name: str, value: Any) -> None:  # frozen: __post_init__ fills in defaults this way
            object.__setattr__(self, name, value)

        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        options = Options.from_flat({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init})
        checked = options.flat()
        for name in ("num_threads", "prefetch", "read_ahead", "reader_threads", "progress", "drop_last", "verify",
                     "shard_read_ahead", "rank", "world_size"):  # as checked: defaults filled in, numpy ints as int
            put(name, checked[name])
        put("options", options)
        order = options.order
        put("sampling", SamplerSpec(seed=order.seed, shuffle=order.shuffle, block_shards=order.block_shards,
                                    batch_size=self.batch_size, drop_last=order.drop_last, remainder=order.remainder))
        for name in ("batch_size", "seed", "block_shards"):  # as ints: they go into the Loader's state
            put(name, getattr(self.sampling, name))
        if not isinstance(self.pipeline, Pipeline):
            raise ValueError(f"pipeline must be a pipeline object (fastio.ImageTrain(), fastio.ImageEval(), "
                             f"fastio.Raw(), fastio.Graph(fn), fastio.Tokens(...), ...), got {self.pipeline!r}")
        params = getattr(self.pipeline, "__dataclass_params__", None)
        if params is not None and not params.frozen:
            raise ValueError(f"pipeline {self.pipeline!r:.80} is a dataclass that is not frozen: make it "
                             "@dataclass(frozen=True) (its options must not change under a running Loader; "
                             "docs/adding-a-kind.md)")

    @classmethod
    def grouped(cls, *, order: OrderOptions | None = None, performance: PerformanceOptions | None = None,
                shards: ShardOptions | None = None, ranks: RankOptions | None = None, **shared: Any) -> LoaderConfig:
        """A config from typed groups (each left out: its defaults) and ``shared`` (``batch_size``, ``pipeline``,
        ``device``): ``LoaderConfig.grouped(batch_size=8, order=OrderOptions(seed=1, shuffle="block"))``."""
        groups = Options(order or OrderOptions(), performance or PerformanceOptions(), shards or ShardOptions(),
                         ranks or RankOptions())
        return cls(**groups.flat(), **shared)


_DATALOADER_ONLY = ("sampler", "batch_sampler")
"""torch DataLoader attributes a Loader does not have, named with the way out when asked for."""


class Loader:
    """Iterate a fastio dataset (or a :class:`~fastio.Mixture`) as batches ``{"image", "label", "index", "padded",
    ...}`` of torch tensors (what a batch holds is the pipeline object's choice).

    ``image`` (and ``label``) are on the loader's device; ``index`` (int64 dataset-wide indices, see
    :meth:`key`; for a mixture also ``source``) and ``padded`` (bool) stay on the CPU. ``len(loader)`` is the
    number of batches of a full epoch on every rank. Iterating yields the rest of the current epoch, then the
    epoch advances. A ``next()`` that raises (a storage error, a damaged shard, a refused torchft step) does not end
    the iterator: its next ``next()`` asks again for the batch at the Loader's position (with ``replicas=``, that
    of the Manager's step then).

    ``replicas=`` a ``torchft.Manager`` (fault-tolerant training, docs/trainers.md): ``batch_size`` is then the global
    batch of one step, and each batch is this rank's share of global batch ``manager.current_step()`` (the samples a
    one-process Loader gives at that batch), split over the replica groups of the step's quorum and the group's ranks;
    iterating runs on through the epochs; the Loader's state travels in the Manager's state dict until
    :meth:`close`.
    """

    def __init__(self, dest: str | Path | Dataset | Mixture, config: LoaderConfig | None = None, *,
                 replicas: Any = None, **overrides: Any):
        _check_habits(overrides)
        if config is not None and not isinstance(config, LoaderConfig):
            raise LoaderArgumentError(f"Loader's config must be a fastio.LoaderConfig, got {type(config).__name__} "
                                      f"{config!r:.60}: pass options as keywords, Loader(dest, **options)")
        if config is None:
            config = LoaderConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = cfg = config
        self.pipeline: Pipeline = cfg.pipeline
        self._replicas = None if replicas is None else _replicas_of(replicas)
        self.read_set: ReadSet = open_read_set(dest, self.pipeline, cfg.options, cfg.batch_size)
        try:
            self._place()
        except BaseException:
            self.read_set.close()
            raise
        self.dataset: Dataset | Mixture = self.read_set.target
        """What the Loader reads: the :class:`Dataset`, or the :class:`Mixture` (counted in the pipeline's units:
        a token mixture's sizes are sequences)."""
        self.mixture: Mixture | None = self.read_set.mixture
        """The :class:`Mixture` read, else None."""
        self.epoch, self.consumed = 0, 0
        self._closed = False
        self._stats = Stats(progress=cfg.progress, detail=self.read_set.progress_detail())
        self._active: Iterator | None = None
        # One feeder and (for decoding graphs) one DALI pipeline for the Loader's life: the stream runs on
        # into the next epoch by itself; they are made again only when the position jumps (set_epoch,
        # load_state_dict) or after a failure.
        self._feeder: Feeder | None = None
        self._built: BuiltPipeline | None = None
        self._ahead_fed = False  # whether the pipeline's next batch was fed ahead (Loader._feed_ahead)
        self._ahead: Exception | None = None  # what feeding it ahead raised, for the next batch to raise
        self._share: Share | None = None  # with replicas=: the share the feeder's plans are cut to
        self._empty: dict[str, Any] | None = None  # with replicas=: a batch of no samples (a group not taking part)
        self._step_epoch = 0  # with replicas=: the epoch of the last step's batch (for the stats' epochs)
        if self._replicas is not None:
            self._replicas.register(self.state_dict, self.load_state_dict)

    def _place(self) -> None:
        """Rank and world size, the device, then the pipeline's source there (this rank's order of units and
        their reader) and its graph; checked against the read set's size."""
        cfg, rs = self.config, self.read_set
        rank, world = cfg.rank, cfg.world_size
        if self._replicas is not None:  # batch_size is the global batch, split at each step (fastio.order.replicas)
            rank, world = self._replicas.ranks(rank, world)
        elif rank is None or world is None:
            found_rank, found_world = rank_and_world()
            rank = found_rank if rank is None else rank
            world = found_world if world is None else world
        self._place_device()
        plan_world, plan_rank = (world, rank) if self._replicas is None else (1, 0)
        source = checked_source(self.pipeline.source(rs, cfg.sampling, Placement(plan_rank, plan_world, self.device)),
                                self.pipeline)
        self._sampler, self._reader, self.pipeline = source.plan, source.reader, source.pipeline
        self._graph: GraphDef | None = checked_graph(self.pipeline.graph(), self.pipeline)
        self.rank, self.world_size = rank, world
        self._ranks_found = self._replicas is None and cfg.rank is None and cfg.world_size is None
        self._ranks_differ: str | None = None  # what the first iter() found other ranks' Loaders differ in ("": none)
        pin = cfg.options.performance.pin_threads
        self._pins = alone_on_node(world) if pin is None else pin
        self._pin_to: list[int] | None = None  # the CPUs to pin a new pipeline's workers to (_pin_workers)
        self._pinned: list[int] = []  # the thread ids of its workers pinned so far
        self._came_out = False  # whether a batch of the pipeline has come out
        n = self._sampler.samples  # units of an epoch: stored samples, or a kind's own (packed sequences)
        units = count(n, source.unit)
        if cfg.batch_size > n and not (cfg.sampling.partial_batches and n):  # partial: one batch of those there are
            way = "" if not n else " and drop_last leaves no batch" if cfg.drop_last else \
                ": give a smaller batch_size, or remainder='partial' for one batch of them"
            raise DatasetError(f"{rs.root}: batch_size {cfg.batch_size} is larger than the {rs.epoch_noun} "
                               f"({units}){way}")
        if cfg.drop_last and cfg.batch_size * plan_world > n:
            raise DatasetError(f"{rs.root}: global batch {cfg.batch_size * plan_world} is larger than the "
                               f"{rs.epoch_noun} ({units}) and drop_last leaves no batch")
        self._most_per_batch = min(cfg.batch_size, n)
        """Units a batch holds at most, DALI's batch size: ``batch_size``, or the epoch's units where the partial
        remainder takes a larger ``batch_size`` (DALI sizes its buffers by it, and refuses one past 2**31)."""

    def _place_device(self) -> None:
        """The device the Loader decodes on (and torch's device of its batches)."""
        cfg = self.config
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device")
        # The GPU is torch's current device when the Loader is made (call torch.cuda.set_device first).
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" \
            else torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        # Only for names normal lookup did not find: what code written for a torch DataLoader reaches for
        # (accelerate's skip_first_batches takes .sampler / .batch_sampler) is named with the way out.
        if name in _DATALOADER_ONLY:
            raise AttributeError(f"fastio.Loader has no {name!r}: it is not a torch DataLoader and needs no "
                                 "sampler; after accelerator.load_state or load_state_dict it continues from its "
                                 "saved position itself, so accelerator.skip_first_batches is not needed "
                                 "(iterate the Loader)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- order and position -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sampler)

    def batches_left(self) -> int:
        """Batches this rank has left in the current epoch from the current position (``len(loader)`` at an
        epoch's start). After ``load_state_dict`` of a mid-epoch state saved at another world size this is not
        ``len(loader)`` minus the batches counted before the save: a trainer's batch counter is reconciled
        with it (:mod:`fastio.integrations.lightning`)."""
        return len(self._sampler.plan(self.epoch, self.consumed))

    def key(self, source: int | str, index: int | None = None) -> str:
        """The ``__key__`` of a sample: ``key(index)`` (dataset-wide index) for a dataset, ``key(source, index)``
        (``batch["source"]`` or the source's name, and ``batch["index"]``) for a mixture."""
        return self.read_set.key(source, index)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``. The current epoch is left where it is, so calling
        ``set_epoch(e)`` after restoring a mid-epoch state of epoch ``e`` does not lose the position."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        epoch = int(epoch)
        self._refuse_closed("set_epoch")
        if self._replicas is not None:
            raise LoaderArgumentError("set_epoch with replicas=: the position is the torchft Manager's step, and "
                                      "the batches run on through the epochs by themselves; do not call set_epoch")
        self._sampler.plan(epoch)  # ValueError where the order cannot reach it (a mixture's: int64 stream positions)
        if epoch != self.epoch:
            self._close_active()
            self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed to the training loop (prefetched batches do not count); after
        :meth:`close` still the last one (a trainer may close the Loader, then save)."""
        cfg = self.config
        if self._replicas is not None:  # the position of the Manager's step (a retried step is not counted)
            step = self._replicas.step()
            self.epoch, self.consumed = step_position(step, len(self._sampler), cfg.batch_size)
        state = {K_VERSION: STATE_VERSION, K_SEED: cfg.seed, K_EPOCH: self.epoch, K_CONSUMED: self.consumed,
                 K_WORLD_SIZE: self.world_size, K_BATCH_SIZE: cfg.batch_size,
                 K_FINGERPRINT: self.read_set.fingerprint, K_SHUFFLE: cfg.shuffle, K_BLOCK_SHARDS: cfg.block_shards}
        state.update(self.read_set.state())
        state.update(checked_state_entries(self.pipeline.state_dict(), self.pipeline, (*state, K_STEP)))
        if self._replicas is not None:
            state[K_STEP] = step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. With another world size the rest of that epoch is re-split into
        global batches of the new size (each remaining sample once); later epochs are fresh runs."""
        state = self._checked(state, "load_state_dict")
        if self._replicas is not None:  # the position is the Manager's step; the stream follows it by itself
            self._replicas.check_step(state, K_STEP)
            return
        self._close_active()
        # kept where nothing of that epoch is left at this world size (drop_last): iterating it moves on to the next
        # one, and set_epoch(epoch) before keeps the position, as for any restored epoch (it went back to its start)
        self.epoch, self.consumed = state[K_EPOCH], state[K_CONSUMED]

    def check_restored_with(self, app: dict[str, Any], state: Any) -> None:
        """LoaderStateError unless a checkpoint restore of ``app`` (app key -> object) with this Loader's ``state``
        restores what the position lies in besides the Loader's state: with ``replicas=`` and a state saved with
        them, the torchft Manager (its step is the position). :class:`fastio.Checkpointer` asks before anything
        loads."""
        if self._replicas is not None:
            self._replicas.check_restored_with(app, state, K_STEP)

    def check_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """LoaderStateError unless :meth:`load_state_dict` can continue from ``state``; changes nothing (a
        checkpoint restore checks first, then loads). Returns the state with its integers as ``int``.
        :class:`~fastio.errors.LoaderClosedError` after :meth:`close`, as :meth:`load_state_dict`."""
        return self._checked(state, "check_state_dict")

    def _checked(self, state: dict[str, Any], called: str) -> dict[str, Any]:
        """:meth:`check_state_dict`, refused on a closed Loader naming ``called`` (the method the caller called)."""
        self._refuse_closed(called)
        state = _checked_state(state)
        rs = self.read_set
        self.pipeline.check_state(state)  # first: the pipeline's units (a token mixture's sizes follow from them)
        rs.check_state(state, state[K_EPOCH], state[K_CONSUMED])
        if state[K_FINGERPRINT] != rs.fingerprint:
            raise LoaderStateError(f"{rs.root}: loader state is for dataset fingerprint {state[K_FINGERPRINT]}, "
                                   f"this dataset is {rs.fingerprint} (another dataset, or this one converted "
                                   "again): the saved position names samples of that one; start the next epoch "
                                   f"{next_epoch_way(state[K_EPOCH], state[K_CONSUMED])}")
        mine = self.state_dict()
        for k in _ORDER_KEYS:
            if k == K_BLOCK_SHARDS and state[K_SHUFFLE] != "block":
                continue  # only block windows use it: the order of 'global' and 'none' is the same with any
            if state[k] != mine[k]:
                raise LoaderStateError(f"loader state has {k}={state[k]!r}, this loader {k}={mine[k]!r} "
                                       f"(the sample order would differ)")
        epoch, consumed = state[K_EPOCH], state[K_CONSUMED]
        if not (epoch >= 0 and 0 <= consumed <= self._sampler.samples):
            raise LoaderStateError(f"loader state has epoch={epoch!r} consumed={consumed!r} "
                                   f"(dataset has {count(self._sampler.samples, 'sample')})")
        try:
            self._sampler.plan(epoch)  # as set_epoch
        except ValueError as err:
            raise LoaderStateError(f"loader state has epoch={epoch}: {err}") from None
        if self._replicas is not None:
            self._replicas.check_state(state, self.config.batch_size, K_STEP, len(self._sampler))
        return state

    def next_epoch_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state that starts the next epoch not begun with this Loader's data: ``state``'s own epoch where
        nothing of it was delivered (``consumed`` 0: saved at an epoch boundary, ``(1, 0)`` after epoch 0's last
        batch), else the one after it (:func:`~fastio.checks.next_epoch_start`); what
        ``Checkpointer.restore_latest(..., loader_policy="next-epoch")`` loads (``load_state_dict`` takes it too).
        Nothing of that epoch has been delivered, so its order is drawn from the data as it is now: a dataset (or a
        mixture's source) converted again since the save, with more or other samples, is taken, and so is a mixture
        whose sources changed (one added, removed, renamed or moved; one dataset's state in a mixture's Loader, or
        the reverse) or whose weights or schedule changed, its past too: the epoch is then the new data's and
        schedule's, as ``set_epoch`` draws it. The rest is checked as :meth:`check_state_dict` checks it (version,
        seed, shuffle, the pipeline's entry); changes nothing. Refused with ``replicas=`` (the position is the
        torchft Manager's step)."""
        state = _checked_state(state, next_epoch=True)
        start = next_epoch_start(state[K_EPOCH], state[K_CONSUMED])
        if self._replicas is not None:  # the position is the Manager's step
            self._replicas.refuse_next_epoch(start, len(self._sampler))
        rs = self.read_set
        moved = {**state, K_VERSION: STATE_VERSION, K_EPOCH: start, K_CONSUMED: 0,
                 K_FINGERPRINT: rs.fingerprint, **rs.renewed_state(state)}
        return self.check_state_dict(moved)

    # -- iteration ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        """``{"last_epoch", "epoch", "overall"}``, each ``{"batches", "samples", "seconds", "samples_per_s",
        "stall_fraction"}`` (padding repeats are not counted as samples); for an ``s3://`` dataset also
        ``"storage"``: ``{"hits", "waited_fills", "ahead_fills", "bytes_downloaded", "wait_s", "download_MBps",
        "retries"}`` (``wait_s``: time readers waited for shards not yet in the cache); for a mixture
        ``"sources"`` (samples and share of each) and ``"storage_by_source"`` (its ``s3://`` sources)."""
        return {**self._stats.as_dict(), **self.read_set.stats()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._refuse_closed("iteration")
        self._refuse_other_ranks()
        self._close_active()
        self._active = _Batches(self._iterate if self._replicas is None else self._steps, self._drop_stream)
        return self._active

    def _refuse_other_ranks(self) -> None:
        """FastioError where the rank and world size were found (not given) before torch.distributed was
        initialized, and it now says another: a Loader made at the top of a script that Lightning's DDP runs
        (each process would read another rank's share, or all of it, in a number of batches of its own).
        Then, at the first iteration of a Loader whose ranks are torch.distributed's (found or given), every rank
        checks that the others' Loaders order alike (:meth:`_order_terms`; one exchange through the group's store,
        :func:`fastio.dist.agree_with_rank_zero`, never again in the Loader's life), else refuses naming the
        field and both values."""
        now = initialized_rank_and_world()
        if self._ranks_found and now is not None and now != (self.rank, self.world_size):
            raise FastioError(f"{self.read_set.root}: this Loader was made as rank {self.rank} of {self.world_size}, "
                              f"before torch.distributed was initialized, and this process is rank {now[0]} of "
                              f"{now[1]}: make it after init_process_group (under Lightning: in train_dataloader(), "
                              "as fastio.integrations.lightning.FastioDataModule does), or give rank= and world_size=")
        if self._ranks_differ is None:
            self._ranks_differ = ""
            if now == (self.rank, self.world_size) and self.world_size > 1:
                try:
                    self._ranks_differ = agree_with_rank_zero(
                        self._order_terms(), self._first_term_differing, self.rank, self.world_size,
                        waiting=f"{self.read_set.root}: this Loader's first iteration waits for the other ranks "
                                "to check that their Loaders are alike (a Loader one rank iterates alone: give it "
                                "rank=0, world_size=1)") or ""
                except TimeoutError as err:
                    self._ranks_differ = (f"{self.read_set.root}: this Loader's first iteration waited for the other "
                                          f"ranks to check that their Loaders are alike, and {err}: every rank makes "
                                          "its Loaders alike and iterates them in the same order (a Loader one rank "
                                          "iterates alone: give it rank=0, world_size=1)")
        if self._ranks_differ:
            raise LoaderArgumentError(self._ranks_differ)

    def _order_terms(self) -> dict[str, Any]:
        """What every rank's Loader must hold alike for the ranks' slices to be one global order (the state's
        entries but the position, and the options that cut the batches), and the dataset's root to name it."""
        cfg = self.config
        terms = {K_SEED: cfg.seed, K_SHUFFLE: cfg.shuffle, K_BATCH_SIZE: cfg.batch_size, "drop_last": cfg.drop_last,
                 "remainder": cfg.remainder, K_WORLD_SIZE: self.world_size, K_FINGERPRINT: self.read_set.fingerprint}
        if cfg.shuffle == "block":
            terms[K_BLOCK_SHARDS] = cfg.block_shards
        terms.update(self.read_set.state())
        terms.update(self.pipeline.state_dict())
        return {"root": str(self.read_set.root), "terms": terms}

    def _first_term_differing(self, first: dict[str, Any], mine: dict[str, Any]) -> str | None:
        """One line naming the first of rank 0's order terms (``first``) that this rank's (``mine``) differ in."""
        theirs, ours = first["terms"], mine["terms"]
        for key in [*theirs, *(k for k in ours if k not in theirs)]:
            a, b = theirs.get(key), ours.get(key)
            if a != b:
                return (f"{first['root']}: {key} differs across ranks: rank 0 has {a!r:.120}, rank {self.rank} has "
                        f"{b!r:.120}; a fastio Loader's order is global (each rank takes its slice of one order, "
                        "so ranks of other seeds, datasets or batches would repeat samples and lose others): make "
                        f"every rank's Loader with the same {_SAME.get(key, key)}")
        return None

    def close(self) -> None:
        """Stop the stream and close the reader and read set; with ``replicas=``, first take the Loader's state out
        of the Manager's state dict (:meth:`fastio.read.replicas.TorchftReplicas.unregister`), so the Manager no
        longer calls the closed Loader and a Loader made next with it takes its place. Closing again is harmless.
        Afterwards :meth:`state_dict` still answers the last position; iteration, :meth:`load_state_dict` and
        :meth:`set_epoch` raise :class:`~fastio.errors.LoaderClosedError` (make a new Loader)."""
        if self._closed:
            return
        self._closed = True
        # each step runs even where one before it raised (a Ctrl-C while DALI's threads stop): closing again
        # returns at once, so a step skipped here would leave the reader's threads and open shards for good
        with contextlib.ExitStack() as steps:  # run last-in first: in the order below
            steps.callback(self.read_set.close)
            if self._reader is not self.read_set.reader:
                steps.callback(self._reader.close)
            steps.callback(self._drop_stream)
            steps.callback(self._close_active)
            if self._replicas is not None:
                steps.callback(self._replicas.unregister)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _refuse_closed(self, what: str) -> None:
        if self._closed:
            raise LoaderClosedError(f"{self.read_set.root}: {what} on a closed fastio.Loader: make a new Loader "
                                    "(its load_state_dict takes this one's state_dict(), which still answers)")

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _drop_stream(self) -> None:
        if self._feeder is not None:
            self._feeder.cancel()
        self._feeder = self._built = None  # DALI's threads and buffers go now
        self._ahead_fed, self._ahead = False, None

    def _stream_at(self, epoch: int, consumed: int, share: Share | None = None) -> Feeder:
        """The feeder (and pipeline) whose next batch is the one at ``(epoch, consumed)`` (with replicas=: cut to
        ``share``)."""
        feeder = self._feeder
        if feeder is not None and feeder.next_position() == (epoch, consumed) and self._share == share:
            return feeder
        self._drop_stream()
        cfg = self.config
        graph = self._graph
        self._share = share
        plans = self._sampler.plan if share is None else share.plans(self._sampler.plan, cfg.batch_size)
        self._feeder = feeder = Feeder(self._reader, plans, dali_inputs(graph.feed) if graph else None, seed=cfg.seed,
                                       read_ahead=cfg.read_ahead, epoch=epoch, start=consumed,
                                       first=cfg.prefetch, first_here=graph is not None)
        feeder.start()  # the first batches' reads: read as they are fed (first_here), after the build
        if graph is not None:
            self._built = build_graph(graph, feeder, batch_size=self._most_per_batch * graph.per_unit,
                                      num_threads=cfg.num_threads,
                                      device=self.device, device_id=self.torch_device.index,
                                      prefetch=cfg.prefetch, seed=cfg.seed)
            self._pin_to, self._pinned, self._came_out = (usable_cpus() if self._pins else None), [], False
        return feeder

    def _next_batch(self, feeder: Feeder) -> tuple[dict[str, Any], Fed]:
        if self._built is None:  # no graph (raw): the read bytes are the batch
            fed = feeder.take()
            return self._batch({}, fed), fed
        pipe = self._built.pipe
        try:
            if self._ahead is not None:  # feeding the next batch ahead failed: its error is this call's
                raise self._ahead
            if not self._ahead_fed:  # the first output, or after an epoch's last batch: what run() schedules
                pipe.schedule_run()
            self._ahead_fed = False
            self._pin_workers()
            # on cuda, outputs are made ready on torch's current stream
            outputs = pipe.outputs(torch.cuda.current_stream(self.torch_device)) if self.device == "cuda" \
                else pipe.outputs()
        except FastioError:  # the reader's own errors (a bad shard, a storage fault) pass through
            self._drop_stream()
            raise
        except Exception as err:  # DALI reports a bad image as a bare RuntimeError
            in_flight = feeder.in_flight()
            self._drop_stream()
            raise self._decode_error(in_flight, err) from None
        self._came_out = True
        fed = feeder.delivered()
        self._feed_ahead(pipe, feeder, fed)
        return self._batch(self._to_torch(self._built.outputs, outputs, fed), fed), fed

    def _pin_workers(self) -> None:
        """Pin the pipeline's worker threads (``pin_threads``) once a batch is scheduled, before waiting for it: those
        found named (each names itself as it starts), the rest at the next calls, the last try once a batch has
        come out (by then every worker has started)."""
        if self._pin_to is None:
            return
        self._pinned += self._built.pin_workers(self._pin_to, skip=self._pinned)
        if self._came_out or len(self._pinned) >= self.config.num_threads:
            self._pin_to = None

    def _feed_ahead(self, pipe: Any, feeder: Feeder, fed: Fed) -> None:
        """Feed and start the batch after the next one now, before ``fed``'s batch is made and while the training loop
        uses it, as DALI's own iterator does: DALI's workers then always have ``prefetch`` batches to decode, where
        ``run()`` would start one only when the next batch is asked for. Not after an epoch's last batch (a loop
        that stops there would never get it), nor while its bytes are still being read (the loop would wait for
        them); the next call feeds it then, as ``run()`` does. A failure is raised by the next call, the one that
        would have fed the batch."""
        if fed.last or not feeder.next_is_read():
            return
        try:
            pipe.schedule_run()
        except Exception as err:  # noqa: BLE001 - raised where run() would have raised it
            self._ahead = err
        else:
            self._ahead_fed = True

    def _iterate(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        streaming = self._feeder is not None and self._feeder.next_position() == (epoch, self.consumed)
        if not streaming and not len(self._sampler.plan(epoch, self.consumed)):
            # nothing left in this epoch (e.g. drop_last after the last full batch)
            self.epoch, self.consumed = epoch + 1, 0
            self._stats.end_epoch()
            return
        # Object stores: fetch shards in the order the rest of this epoch and the next one will want them.
        self._reader.read_ahead_shards(coming(self._sampler.plan, epoch, self.consumed))
        try:
            feeder = self._stream_at(epoch, self.consumed)
            while True:
                started = self._stats.begin_wait()
                batch, fed = self._next_batch(feeder)
                if (fed.epoch, fed.start) != (epoch, self.consumed):
                    raise RuntimeError(f"internal error: fed epoch {fed.epoch} from {fed.start}, "
                                       f"the loader is at epoch {epoch} consumed {self.consumed}")
                self._stats.end_wait(started, len(fed.padded) - int(np.count_nonzero(fed.padded)))
                self.read_set.count(batch, fed.padded)
                if fed.last:  # the epoch is over (with drop_last, before its dropped tail)
                    self._stats.end_epoch()  # its line printed before the position moves (a Ctrl-C there)
                self.epoch, self.consumed = (epoch + 1, 0) if fed.last else (epoch, fed.consumed)
                yield batch
                if self.epoch != epoch:
                    return
        finally:
            self._stats.pause()

    def _steps(self) -> Iterator[dict[str, Any]]:
        """With replicas=: batch after batch, each this rank's share of global batch ``manager.current_step()``
        (:mod:`fastio.order.replicas`), through the epochs; a group not taking part in the step gets no samples."""
        try:
            while True:
                step, share = self._replicas.share(self.rank, self.world_size)
                epoch, self.consumed = step_position(step, len(self._sampler), self.config.batch_size)
                if epoch != self._step_epoch:  # not self.epoch: state_dict() moves it to the Manager's step
                    self._stats.end_epoch()
                self.epoch = self._step_epoch = epoch
                if share is None and self._empty is not None:
                    yield dict(self._empty)
                    continue
                started = self._stats.begin_wait()
                # not taking part: one sample, for the structure of an empty batch
                feeder = self._stream_at(self.epoch, self.consumed, share or Share(self.config.batch_size, 0))
                batch, fed = self._next_batch(feeder)
                if (fed.epoch, fed.start) != (self.epoch, self.consumed):
                    raise RuntimeError(f"internal error: fed epoch {fed.epoch} from {fed.start} for step {step}")
                self._empty = _no_samples(batch)
                if share is None:
                    yield dict(self._empty)
                    continue
                self._stats.end_wait(started, len(fed.padded) - int(np.count_nonzero(fed.padded)))
                self.read_set.count(batch, fed.padded)
                yield batch
        finally:
            self._stats.pause()

    def _batch(self, outputs: dict[str, Any], fed: Fed) -> dict[str, Any]:
        """The pipeline's batch of ``fed`` (its host tensors moved onto the GPU on cuda), then ``index``
        (``source``) and ``padded``, which stay on the host."""
        batch = checked_batch(self.pipeline, self.pipeline.assemble(outputs, self.read_set.delivery(
            fed.batch, self._on_device)), len(fed.indices))
        if self.device == "cuda":
            batch = {k: self._on_gpu(v) for k, v in batch.items()}
        batch.update(self.read_set.positions(fed.indices))
        batch["padded"] = torch.from_numpy(fed.padded.copy())
        return batch

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        labels = torch.from_numpy(values)
        return labels if self.device == "cpu" else self._to_device(labels)

    def _on_gpu(self, value: Any) -> Any:
        """A batch entry on the Loader's GPU: a tensor, or each tensor of a list of them (a graph's output of
        samples of different shapes); anything else (bytes, numbers) as it is."""
        if isinstance(value, torch.Tensor):
            return self._to_device(value)
        if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            return [self._to_device(v) for v in value]
        return value

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the Loader's GPU: a host tensor staged in pinned memory and copied without blocking, on torch's
        current stream (the pinned buffer is not reused before the copy ends: torch's host allocator records it)."""
        if t.device.type != "cpu":
            return t
        return t.pin_memory().to(self.torch_device, non_blocking=True)

    def _to_torch(self, names: tuple[str, ...], outputs, fed: Fed) -> dict[str, Any]:
        """The graph's outputs but ``index`` (checked against what was fed) as torch values."""
        out = dict(zip(names, outputs))
        index = out.pop("index").as_array().reshape(-1)
        want = fed.indices if self._graph.fed_index is None else self._graph.fed_index(fed.batch)
        if not np.array_equal(index, want):
            raise LoaderArgumentError(f"{type(self.pipeline).__name__}'s graph output 'index' is not the fed index (it "
                                      f"gave {index[:8]} for a batch fed {want[:8]}): return inp['index'] as it is")
        return {name: self._tensor(value) for name, value in out.items()}

    def _tensor(self, value):
        owned = self._built is not None and self._built.owned_outputs
        return torch_value(value, self.torch_device if self.device == "cuda" else None, owned)

    def _decode_error(self, in_flight: list[Fed], err: Exception) -> FastioError:
        """Map a DALI failure back to the sample: the first one the pipeline's graph finds undecodable too
        (:attr:`fastio.pipelines.GraphDef.problem`), in feed order; else, where DALI ran out of memory, a
        :class:`PipelineMemoryError` (the outputs do not fit; the samples are not blamed)."""
        rs, where = self.read_set, self._graph.where
        for fed in in_flight:
            if where is not None:  # the kind names its graph's samples (fastio.ImageText: each image)
                bad = next(((name, p) for j, name in enumerate(where(fed.batch))
                            if (p := self._graph.problem(fed.batch, j)) is not None), None)
                if bad is not None:
                    return DatasetError(f"{bad[0]} failed to decode ({bad[1]})")
                continue
            for j, (i, name) in enumerate(zip(fed.indices.tolist(), fed.batch.image_field or [])):
                problem = self._graph.problem(fed.batch, j)
                if problem is not None:
                    return DatasetError(f"{rs.where(i)}: field {name!r} failed to decode ({problem})")
        first = dali_reason(err)
        if dali_out_of_memory(err):
            return PipelineMemoryError(f"{rs.root}: DALI ran out of memory making a batch of {self._most_per_batch} "
                                       f"({first}): the pipeline's outputs do not fit, not the data; lower batch_size "
                                       "or the output size")
        if in_flight and where is not None:
            return DatasetError(f"DALI failed on a batch of {'; '.join(where(in_flight[0].batch)[:4])}: {first}")
        if not in_flight:  # the graph failed with no batch of this Loader's in it
            return DatasetError(f"{rs.root}: DALI failed: {first}")
        keys = ", ".join(repr(rs.key_of(i)) for i in in_flight[0].indices[:8])
        return DatasetError(f"{rs.root}: DALI failed on a batch with keys {keys}: {first}")


class _Batches:
    """A Loader's iterator: the batches of ``make()`` (a generator of batches from the Loader's position), made
    again after a failed ``next()``, so that the next call asks for the batch that failed again (a generator that
    raised is finished: the next ``next()`` would end the loop silently, as if the epoch were over). The error
    reaches the caller as it was raised, and nothing more runs then (a Ctrl-C's save is not kept waiting); the next
    call, or :meth:`close`, first calls ``drop()``, which drops the stream the failure may have left half-made (the
    next call makes it again at the position). The end of the epoch (StopIteration) and :meth:`close` end it for
    good."""

    __slots__ = ("_make", "_drop", "_batches", "_failed")

    def __init__(self, make: Callable[[], Iterator[dict[str, Any]]], drop: Callable[[], None]):
        self._make, self._drop = make, drop
        self._batches: Iterator[dict[str, Any]] | None = make()
        self._failed = False

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._failed:  # the generator is finished (its finally paused the stats): another, on a new stream
            self._drop()  # a Ctrl-C in here leaves it failed: the next call drops again
            self._batches = self._make()
            self._failed = False
        batches = self._batches
        if batches is None:
            raise StopIteration
        try:
            return next(batches)
        except StopIteration:
            self._batches = None
            raise
        except BaseException as err:
            self._failed = True
            _let_go(err)
            raise

    def close(self) -> None:
        """End the iteration (the generator's ``finally`` runs now; a stream a failure left goes too)."""
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()
        if self._failed:
            self._drop()
            self._failed = False


def _let_go(err: BaseException) -> None:
    """Clear the locals of fastio's and DALI's finished frames that ``err``'s traceback (and those of the errors it
    was raised from) holds: they hold the failed stream's pipeline (DALI's threads and buffers, GPU memory on cuda),
    which would live on while the loop keeps the error (the ``except`` block that asks again), next to the one the
    next batch builds. The loop's own frames keep theirs."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            _clear_frames(tb.tb_frame)
            tb = tb.tb_next
        err = err.__cause__ or err.__context__


def _clear_frames(frame: Any) -> None:
    """Clear ``frame`` and the frames that called it, up to the first that is not fastio's or DALI's (an error
    raised while feeding ahead was caught in a call before this one: that call's frames hang on its traceback's)."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("fastio.", "nvidia.dali")):
        with contextlib.suppress(RuntimeError):  # a frame still running (this call's) keeps its locals
            frame.clear()
        frame = frame.f_back


def torch_value(value: Any, device: torch.device | None, owned: bool) -> Any:
    """A DALI graph output as torch: a ``TensorListGPU`` copied into a tensor on ``device`` on torch's current stream
    there (the stream its outputs were made ready on: ``pipe.outputs(stream)``); a ``TensorListCPU`` as a host
    tensor (sharing DALI's buffer where the outputs are ``owned``, DALI's dynamic executor), which the Loader moves
    to the GPU on cuda like the batch's other host tensors. Samples of different shapes: a list of tensors.

    A graph on cuda may output CPU nodes (a user's :class:`fastio.Graph` returning a node of CPU operators): DALI's
    ``feed_ndarray`` would copy those with a host ``memcpy`` into the GPU tensor's address."""
    from nvidia.dali.tensors import TensorListGPU

    if isinstance(value, TensorListGPU):
        if not value.is_dense_tensor():
            return [_gpu_tensor(value[j], device) for j in range(len(value))]
        return _gpu_tensor(value.as_tensor(), device)
    if value.is_dense_tensor():
        if owned:
            return torch.from_dlpack(value.as_tensor())  # the batch keeps DALI's buffer: no copy
        return torch.from_numpy(value.as_array())
    return [torch.from_numpy(np.array(value.at(j))) for j in range(len(value))]


def _gpu_tensor(t: Any, device: torch.device) -> torch.Tensor:
    """DALI's ``TensorGPU`` ``t`` copied into a new tensor on ``device``, on torch's current stream there."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    dst = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=device)
    feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream(device))
    return dst


def _no_samples(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with none of its samples: every tensor, array and list cut to length 0 (the same keys, dtypes and
    trailing dimensions), other values as they are."""
    return {k: v[:0] if isinstance(v, (torch.Tensor, np.ndarray, list)) else v for k, v in batch.items()}


def _replicas_of(manager: Any) -> Any:
    """What the Loader asks a ``replicas=`` torchft Manager (:mod:`fastio.read.replicas`, imported only then)."""
    from fastio.read.replicas import TorchftReplicas

    return TorchftReplicas(manager)


def _checked_state(state: Any, *, next_epoch: bool = False) -> dict[str, Any]:
    """``state`` with its integers as ints, once its version and keys are those of this fastio's states (its
    ``world_size``, ``batch_size`` and ``block_shards`` positive). A version 1 state (the same entries, positions
    in an order this fastio no longer draws) only where it is to start its ``next_epoch``."""
    if not isinstance(state, dict) or K_VERSION not in state:
        raise LoaderStateError(f"loader state has no {K_VERSION!r} (not a fastio Loader state_dict)")
    version = _as_int(K_VERSION, state[K_VERSION])  # first: a newer version's other entries may be of other types
    if version > STATE_VERSION:
        raise LoaderStateError(f"loader state version {version} is from a newer fastio (this one reads version "
                               f"{STATE_VERSION}): upgrade fastio to continue it")
    if version not in (1, STATE_VERSION):
        raise LoaderStateError(f"loader state version {version} is not one a fastio writes (this one reads version "
                               f"{STATE_VERSION}): a damaged or hand-edited state")
    state = {k: _as_int(k, v) if k in _INT_KEYS else v for k, v in state.items()}
    missing = [k for k in (K_SEED, K_EPOCH, K_CONSUMED, K_WORLD_SIZE, K_FINGERPRINT, K_SHUFFLE, K_BLOCK_SHARDS)
               if k not in state]
    if missing:
        raise LoaderStateError(f"loader state lacks {', '.join(missing)}")
    for key in _STR_KEYS:  # compared with this Loader's: an array there made numpy's ambiguous truth value
        if not isinstance(state[key], str):
            raise LoaderStateError(f"loader state has {key}={state[key]!r:.80}, not a string (a damaged or "
                                   "hand-edited state)")
    for key in (K_WORLD_SIZE, K_BATCH_SIZE, K_BLOCK_SHARDS):  # a state's are >= 1 (the first two: the save's)
        if key in state and state[key] < 1:
            raise LoaderStateError(f"loader state has {key}={state[key]!r}, not a positive integer (a damaged or "
                                   "hand-edited state)")
    if version == 1 and not next_epoch:
        raise LoaderStateError(f"loader state version 1 is from a fastio whose sample order differs (a materialised "
                               f"numpy permutation); this fastio reads version {STATE_VERSION} and cannot continue "
                               f"that epoch: start the next epoch {next_epoch_way(state[K_EPOCH], state[K_CONSUMED])}")
    return state
