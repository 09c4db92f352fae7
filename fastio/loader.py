"""The Loader users iterate: this rank's slice of the global order, read ahead, decoded by DALI, as torch.

Iterating a Loader yields the rest of the current epoch and then moves to the next epoch by itself.
``state_dict()`` records the position (global samples consumed by the training loop, not prefetched);
``load_state_dict()`` continues from there, at the same or at a different world size.

The Loader wires the parts together: :mod:`fastio.sampler` (order and this rank's batches), :mod:`fastio.reader`
(bytes), :mod:`fastio.feeder` (the DALI callback), :mod:`fastio.pipeline` (the graph), :mod:`fastio.stats`.
One feeder and one DALI pipeline serve the Loader's life (the feeder runs on into the next epoch by itself);
they are made again only when the position jumps. ``close()`` releases them.
"""

from __future__ import annotations

import dataclasses
import io
import operator
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastio.dataset import Dataset
from fastio.dist import rank_and_world
from fastio.errors import DatasetError, FastioError, LoaderArgumentError, LoaderStateError
from fastio.feeder import Fed, Feeder
from fastio.images import is_image_field
from fastio.mixture import MixReader, Mixture, check_mixture_state, mixture_state
from fastio.pipeline import IMAGENET_MEAN, IMAGENET_STD, BuiltPipeline, GraphSpec, build_pipeline, decodable
from fastio.reader import Reader, parse_labels, sample_where
from fastio.sampler import Sampler, SamplerSpec
from fastio.stats import Stats
from fastio.working_set import check_shared_working_set, check_working_set

__all__ = ["STATE_VERSION", "Loader", "LoaderConfig"]

# 2: the lazy keyed order of fastio.sampler (ORDER_ALGORITHM). A version 1 state was written for the
# materialised numpy permutation, which is gone: it is refused (the position would mean other samples).
STATE_VERSION = 2
K_VERSION, K_SEED, K_EPOCH, K_CONSUMED = "version", "seed", "epoch", "consumed"
K_WORLD_SIZE, K_BATCH_SIZE, K_FINGERPRINT, K_SHUFFLE, K_BLOCK_SHARDS = (
    "world_size", "batch_size", "fingerprint", "shuffle", "block_shards")
K_MIXTURE = "mixture"
_ORDER_KEYS = (K_SEED, K_SHUFFLE, K_BLOCK_SHARDS)  # a different value would change the sample order
_INT_KEYS = (K_VERSION, K_SEED, K_EPOCH, K_CONSUMED, K_WORLD_SIZE, K_BATCH_SIZE, K_BLOCK_SHARDS)


def _as_int(key: str, value: Any) -> int:
    """A state integer, also when a checkpoint round trip made it a numpy or 0-d torch integer."""
    try:
        return operator.index(value)
    except TypeError:
        raise LoaderStateError(f"loader state has {key}={value!r}, not an integer") from None


# Arguments of torch's DataLoader (and similar loaders) that fastio does not take, with what to use instead.
_HABITS = {
    "num_workers": "fastio has no worker processes: DALI decodes on num_threads= threads, shard bytes are read "
                   "on reader_threads=",
    "pin_memory": "not needed: with device='cuda' batches are decoded straight into GPU memory",
    "sampler": "the order is built in (shuffle=, seed=; rank and world size from torch.distributed)",
    "collate_fn": "batches come as a dict of tensors; for other outputs pass pipeline= a DALI graph function",
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


@dataclass(frozen=True)
class LoaderConfig:
    """Everything that shapes what a :class:`Loader` delivers; checked when made, then read-only.

    ``dataclasses.replace(config, **changes)`` (or ``Loader(dest, config, **changes)``) makes a changed copy.
    """

    batch_size: int = 64
    """Samples per batch on each rank (the global batch is ``batch_size * world_size``)."""
    pipeline: str | Callable = "image-train"
    """``image-train``, ``image-eval``, ``raw``, or ``f(image, device) -> DataNode | dict[str, DataNode]``
    that builds a DALI graph from the decoded HWC RGB uint8 image (``device`` is ``"cpu"`` or ``"mixed"``)."""
    device: str = "auto"
    """``cuda`` (mixed decode into the memory of torch's current GPU: call ``torch.cuda.set_device`` first),
    ``cpu`` (DALI CPU operators) or ``auto`` (cuda when available)."""
    image_size: int = 224
    """Output side S: images are S x S."""
    seed: int = 0
    """Seeds the order of every epoch and every sample's augmentation."""
    shuffle: str = "global"
    """``global`` (full permutation), ``block`` (shuffled shards, samples shuffled in windows) or ``none``."""
    block_shards: int = 4
    """Shards per window in ``block`` mode."""
    drop_last: bool = False
    """Drop the last incomplete global batch of each epoch."""
    remainder: str = "pad"
    """Without drop_last: ``pad`` fills the last global batch by wrapping to the start of the epoch order;
    ``partial`` splits what is left evenly over the ranks (smaller batches; a rank left with nothing gets
    one repeat). Repeats are flagged True in ``batch["padded"]``; every rank gets the same number of batches."""
    fields: tuple[str, ...] | None = None
    """Fields delivered besides the image; default: the label field (``image-*``), every field (``raw``).
    With ``raw`` every field but the label field is optional: a sample that lacks one gets empty bytes, and
    ``batch["has"][field]`` (a bool tensor [B]) says which samples have it."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel mean on the 0..1 scale, subtracted before dividing by ``std``."""
    std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel standard deviation on the 0..1 scale."""
    dtype: str = "float32"
    """Image dtype: float32, float16 (normalised) or uint8 (not normalised)."""
    layout: str = "CHW"
    """Image layout: CHW or HWC."""
    eval_crop_ratio: float = 0.875
    """``image-eval`` resizes the shorter side to ``image_size / eval_crop_ratio`` then center-crops."""
    num_threads: int | None = None
    """DALI worker threads (default: the core count)."""
    prefetch: int = 2
    """DALI prefetch queue depth (batches decoded ahead of the training loop)."""
    read_ahead: int | None = None
    """Batches whose bytes are read ahead of the DALI feed (default: ``prefetch + 1``)."""
    reader_threads: int | None = None
    """Threads reading shard bytes (default: min(4, cores))."""
    verify: bool = False
    """Check each shard's sha256 against the manifest before its first use, and the sample index's when the
    Loader opens the dataset (an ``s3://`` dataset's shards are always checked, when the cache fills them)."""
    rank: int | None = None
    """This rank (default: :func:`fastio.dist.rank_and_world`: torch.distributed, else env RANK, else 0);
    checked against the world size when the Loader is made."""
    world_size: int | None = None
    """Number of ranks (default: torch.distributed, else env WORLD_SIZE, else 1)."""
    progress: bool = False
    """Print a throughput/stall line to stderr every 5 seconds while batches come (``stats.PROGRESS_EVERY_S``),
    and one at the end of every epoch."""
    cache_dir: str | None = None
    """For an ``s3://`` dataset: the node-local cache directory its shards are read through (shared by every
    process on the node; default ``$FASTIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastio``, else ``~/.cache/fastio``).
    Ignored for a local dataset."""
    cache_size: int | str | None = None
    """Bound of the cache's shard bytes, e.g. ``"500GB"`` (default: half the free space of its file system)."""
    storage_options: dict | None = field(default=None, compare=False)
    """Object-store settings over those found in the environment: ``endpoint``, ``region``, ``access_key_id``,
    ``secret_access_key``, ``profile``, ``retries``, ``deadline_s``, ... (see :class:`fastio.storage.StorageOptions`)."""
    shard_read_ahead: int = 2
    """For an ``s3://`` dataset: shards fetched into the cache ahead of the furthest shard being read, in the
    order the sampler will want them (0: fetch on demand only); fewer, with one warning line, where the cache
    has no room for them on top of what the batches read at once."""
    graph: GraphSpec = field(init=False, repr=False, compare=False)
    """The DALI graph these options describe (built and checked once, here)."""
    sampling: SamplerSpec = field(init=False, repr=False, compare=False)
    """The order and batching these options describe (built and checked once, here)."""

    def __post_init__(self):
        def put(name: str, value: Any) -> None:  # frozen: __post_init__ fills in defaults this way
            object.__setattr__(self, name, value)

        cores = os.cpu_count() or 1
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        put("num_threads", self.num_threads or cores)
        put("read_ahead", self.prefetch + 1 if self.read_ahead is None else self.read_ahead)
        put("reader_threads", self.reader_threads or min(4, cores))
        if self.shard_read_ahead < 0:
            raise ValueError(f"shard_read_ahead must be >= 0, got {self.shard_read_ahead}")
        if self.num_threads < 1 or self.read_ahead < 0 or self.reader_threads < 1:
            raise ValueError("num_threads and reader_threads must be >= 1 and read_ahead >= 0")
        if self.fields is not None:
            put("fields", tuple(self.fields))
        put("mean", tuple(self.mean))
        put("std", tuple(self.std))
        put("sampling", SamplerSpec(seed=self.seed, shuffle=self.shuffle, block_shards=self.block_shards,
                                    batch_size=self.batch_size, drop_last=self.drop_last, remainder=self.remainder))
        put("graph", GraphSpec(kind=self.pipeline, image_size=self.image_size, mean=self.mean, std=self.std,
                               dtype=self.dtype, layout=self.layout, eval_crop_ratio=self.eval_crop_ratio))


class Loader:
    """Iterate a fastio dataset as batches ``{"image", "label", "index", "padded", ...}`` of torch tensors.

    ``image`` (and ``label``) are on the loader's device; ``index`` (int64 dataset-wide indices, see
    :meth:`key`) and ``padded`` (bool) stay on the CPU. ``len(loader)`` is the number of batches of a
    full epoch on every rank. Iterating yields the rest of the current epoch, then the epoch advances.
    """

    def __init__(self, dest: str | Path | Dataset | Mixture, config: LoaderConfig | None = None, **overrides: Any):
        _check_habits(overrides)
        if config is None:
            config = LoaderConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = cfg = config
        # A Mixture stands where a Dataset does (len, root, fingerprint); its sources are read one Reader each.
        self.mixture: Mixture | None = dest if isinstance(dest, Mixture) else None
        self.dataset = ds = dest if isinstance(dest, (Dataset, Mixture)) else Dataset(
            dest, verify=cfg.verify, cache_dir=cfg.cache_dir, cache_size=cfg.cache_size,
            storage_options=cfg.storage_options)
        rank, world = cfg.rank, cfg.world_size
        if rank is None or world is None:
            found_rank, found_world = rank_and_world()
            rank = found_rank if rank is None else rank
            world = found_world if world is None else world
        if self.mixture is not None:
            self._sampler = self.mixture.sampler(cfg.sampling, world, rank)
        else:
            self._sampler = Sampler(cfg.sampling, [s.samples for s in ds.shards], ds.fingerprint, world, rank)
        self.rank, self.world_size = rank, world
        n = len(ds)
        if cfg.batch_size > n:
            raise DatasetError(f"{ds.root}: batch_size {cfg.batch_size} is larger than the dataset ({n} samples)")
        if cfg.drop_last and cfg.batch_size * self.world_size > n:
            raise DatasetError(f"{ds.root}: global batch {cfg.batch_size * self.world_size} is larger than the "
                               f"dataset ({n} samples) and drop_last leaves no batch")
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device")
        # The GPU is torch's current device when the Loader is made (call torch.cuda.set_device first).
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" \
            else torch.device("cpu")
        if self.mixture is None:
            self._part = _open_part(ds, cfg, cfg.fields)
            self._reader = self._part.reader
            self._files = self._part.files
        else:
            self._parts = _open_mixture(self.mixture, cfg)
            self._part = self._parts[0]
            self._reader = MixReader(self.mixture, [p.reader for p in self._parts],
                                     [p.label_field if p.label_field in p.extra else None for p in self._parts])
            self._files = None
            self._source_samples = np.zeros(len(self._parts), np.int64)
        self._extra, self._image_field = self._part.extra, self._part.image_field
        # The field delivered as batch["label"]: for a mixture, only when every source reads its own label field
        # (a field of the same name in a source without a label field is delivered as it is, not as labels).
        parts = self._parts if self.mixture is not None else [self._part]
        self._label_field = self._part.label_field if all(
            p.label_field is not None and p.label_field in p.extra for p in parts) else None
        self.epoch, self.consumed = 0, 0
        self._stats = Stats(progress=cfg.progress, detail=self._storage_line if self._files is not None else None)
        self._active: Iterator | None = None
        # One feeder and (for decoding graphs) one DALI pipeline for the Loader's life: the stream runs on
        # into the next epoch by itself; they are made again only when the position jumps (set_epoch,
        # load_state_dict) or after a failure.
        self._feeder: Feeder | None = None
        self._built: BuiltPipeline | None = None

    # -- order and position -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sampler)

    def key(self, source: int | str, index: int | None = None) -> str:
        """The ``__key__`` of a sample: ``key(index)`` (dataset-wide index) for a dataset, ``key(source, index)``
        (``batch["source"]`` or the source's name, and ``batch["index"]``) for a mixture."""
        if self.mixture is not None:
            if index is None:
                raise TypeError("a mixture's loader names a sample by key(source, index)")
            return self.mixture.key(source, index)
        if index is not None:
            raise TypeError("a dataset's loader names a sample by key(index)")
        return self.dataset.key(int(source))

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``. The current epoch is left where it is, so calling
        ``set_epoch(e)`` after restoring a mid-epoch state of epoch ``e`` does not lose the position."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        epoch = int(epoch)
        if epoch != self.epoch:
            self._close_active()
            self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed to the training loop (prefetched batches do not count)."""
        cfg = self.config
        state = {K_VERSION: STATE_VERSION, K_SEED: cfg.seed, K_EPOCH: self.epoch, K_CONSUMED: self.consumed,
                 K_WORLD_SIZE: self.world_size, K_BATCH_SIZE: cfg.batch_size,
                 K_FINGERPRINT: self.dataset.fingerprint, K_SHUFFLE: cfg.shuffle, K_BLOCK_SHARDS: cfg.block_shards}
        if self.mixture is not None:
            state[K_MIXTURE] = mixture_state(self.mixture)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. With another world size the rest of that epoch is re-split into
        global batches of the new size (each remaining sample once); later epochs are fresh runs."""
        if not isinstance(state, dict) or K_VERSION not in state:
            raise LoaderStateError(f"loader state has no {K_VERSION!r} (not a fastio Loader state_dict)")
        state = {k: _as_int(k, v) if k in _INT_KEYS else v for k, v in state.items()}
        if state[K_VERSION] == 1:
            raise LoaderStateError("loader state version 1 is from a fastio whose sample order differs (a "
                                   "materialised numpy permutation); this fastio reads version 2 and cannot "
                                   "continue that epoch: start without the loader state, or at the next epoch "
                                   "with set_epoch(epoch + 1)")
        if state[K_VERSION] != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state[K_VERSION]!r}, this fastio reads {STATE_VERSION}")
        missing = [k for k in (K_SEED, K_EPOCH, K_CONSUMED, K_WORLD_SIZE, K_FINGERPRINT, K_SHUFFLE, K_BLOCK_SHARDS)
                   if k not in state]
        if missing:
            raise LoaderStateError(f"loader state lacks {', '.join(missing)}")
        if self.mixture is not None:
            check_mixture_state(self.mixture, state.get(K_MIXTURE), state[K_EPOCH], state[K_CONSUMED])
        elif state.get(K_MIXTURE) is not None:
            names = ", ".join(map(repr, state[K_MIXTURE].get("names", []))) if isinstance(state[K_MIXTURE], dict) else ""
            raise LoaderStateError(f"{self.dataset.root}: loader state is of a mixture (sources {names}), this "
                                   "Loader reads one dataset: make it with the same fastio.Mixture")
        if state[K_FINGERPRINT] != self.dataset.fingerprint:
            raise LoaderStateError(f"{self.dataset.root}: loader state is for dataset fingerprint "
                                   f"{state[K_FINGERPRINT]}, this dataset is {self.dataset.fingerprint}")
        mine = self.state_dict()
        for k in _ORDER_KEYS:
            if state[k] != mine[k]:
                raise LoaderStateError(f"loader state has {k}={state[k]!r}, this loader {k}={mine[k]!r} "
                                       f"(the sample order would differ)")
        epoch, consumed = state[K_EPOCH], state[K_CONSUMED]
        if not (epoch >= 0 and 0 <= consumed <= len(self.dataset)):
            raise LoaderStateError(f"loader state has epoch={epoch!r} consumed={consumed!r} "
                                   f"(dataset has {len(self.dataset)} samples)")
        self._close_active()
        self.epoch, self.consumed = epoch, consumed
        if not len(self._sampler.plan(epoch, consumed)):  # nothing left of that epoch at this world size
            self.epoch, self.consumed = epoch + 1, 0

    # -- iteration ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        """``{"last_epoch", "epoch", "overall"}``, each ``{"batches", "samples", "seconds", "samples_per_s",
        "stall_fraction"}`` (padding repeats are not counted as samples); for an ``s3://`` dataset also
        ``"storage"``: ``{"hits", "waited_fills", "ahead_fills", "bytes_downloaded", "wait_s", "download_MBps",
        "retries"}`` (``wait_s``: time readers waited for shards not yet in the cache)."""
        out = self._stats.as_dict()
        if self.mixture is not None:
            total = int(self._source_samples.sum())
            out["sources"] = {name: {"samples": int(n), "share": n / total if total else 0.0}
                              for name, n in zip(self.mixture.names, self._source_samples.tolist())}
            storage = {name: p.files.stats.as_dict(getattr(p.files.storage, "retry_count", 0))
                       for name, p in zip(self.mixture.names, self._parts) if p.files is not None}
            if storage:
                out["storage_by_source"] = storage
        if self._files is not None:
            out["storage"] = self._files.stats.as_dict(getattr(self._files.storage, "retry_count", 0))
        return out

    def _storage_line(self) -> str:
        s = self.stats()["storage"]
        return f"storage wait {s['wait_s']:.1f} s, {s['retries']} retries"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._close_active()
        self._active = self._iterate()
        return self._active

    def close(self) -> None:
        self._close_active()
        self._drop_stream()
        self._reader.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _drop_stream(self) -> None:
        if self._feeder is not None:
            self._feeder.cancel()
        self._feeder = self._built = None  # DALI's threads and buffers go now

    def _stream_at(self, epoch: int, consumed: int) -> Feeder:
        """The feeder (and pipeline) whose next batch is the one at ``(epoch, consumed)``."""
        feeder = self._feeder
        if feeder is not None and feeder.next_position() == (epoch, consumed):
            return feeder
        self._drop_stream()
        cfg = self.config
        self._feeder = feeder = Feeder(self._reader, self._sampler.plan, cfg.graph, seed=cfg.seed,
                                       read_ahead=cfg.read_ahead, epoch=epoch, start=consumed)
        if cfg.graph.decodes:
            feeder.start()  # the first reads overlap the pipeline build
            self._built = build_pipeline(cfg.graph, feeder, batch_size=cfg.batch_size,
                                         num_threads=cfg.num_threads, device=self.device,
                                         device_id=self.torch_device.index, prefetch=cfg.prefetch, seed=cfg.seed)
        return feeder

    def _next_batch(self, feeder: Feeder) -> tuple[dict[str, Any], Fed]:
        if self._built is None:  # raw: the read bytes are the batch
            fed = feeder.take()
            return self._raw_batch(fed), fed
        pipe = self._built.pipe
        try:  # on cuda, outputs are made ready on torch's current stream
            outputs = pipe.run(torch.cuda.current_stream(self.torch_device)) if self.device == "cuda" else pipe.run()
        except FastioError:  # the reader's own errors (a bad shard, a storage fault) pass through
            self._drop_stream()
            raise
        except Exception as err:  # DALI reports a bad image as a bare RuntimeError
            in_flight = feeder.in_flight()
            self._drop_stream()
            raise self._decode_error(in_flight, err) from None
        fed = feeder.delivered()
        return self._to_torch(self._built.outputs, outputs, fed), fed

    def _iterate(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch
        streaming = self._feeder is not None and self._feeder.next_position() == (epoch, self.consumed)
        if not streaming and not len(self._sampler.plan(epoch, self.consumed)):
            # nothing left in this epoch (e.g. drop_last after the last full batch)
            self.epoch, self.consumed = epoch + 1, 0
            self._stats.end_epoch()
            return
        # Object stores: fetch shards in the order the rest of this epoch and the next one will want them.
        if self.mixture is not None:
            self._reader.read_ahead_shards(lambda c=self.consumed: self._coming_batches(epoch, c))
        else:
            self._reader.read_ahead_shards(self._coming_batches(epoch, self.consumed))
        try:
            feeder = self._stream_at(epoch, self.consumed)
            while True:
                started = self._stats.begin_wait()
                batch, fed = self._next_batch(feeder)
                if (fed.epoch, fed.start) != (epoch, self.consumed):
                    raise RuntimeError(f"internal error: fed epoch {fed.epoch} from {fed.start}, "
                                       f"the loader is at epoch {epoch} consumed {self.consumed}")
                self._stats.end_wait(started, len(fed.padded) - int(np.count_nonzero(fed.padded)))
                if self.mixture is not None:
                    src = batch["source"].numpy()[~fed.padded]
                    self._source_samples += np.bincount(src, minlength=len(self._source_samples))
                self.consumed = fed.consumed
                if fed.last:  # the epoch is over (with drop_last, before its dropped tail)
                    self.epoch, self.consumed = epoch + 1, 0
                    self._stats.end_epoch()
                yield batch
                if self.epoch != epoch:
                    return
        finally:
            self._stats.pause()

    def _coming_batches(self, epoch: int, consumed: int) -> Iterator[np.ndarray]:
        """This rank's samples (dataset-wide indices, a chunk of batches at a time, in order) from
        ``(epoch, consumed)`` to the end of the next epoch."""
        for plan in (self._sampler.plan(epoch, consumed), self._sampler.plan(epoch + 1, 0)):
            for indices, _, _ in plan.iter_chunks():
                yield indices

    def _raw_batch(self, fed: Fed) -> dict[str, Any]:
        batch: dict[str, Any] = {f: [b.tobytes() for b in fed.batch.fields[f]] for f in self._extra}
        if self._label_field is not None:
            batch["label"] = self._labels(fed)
        batch["has"] = {f: torch.from_numpy(fed.batch.present[f].copy()) for f in self._extra}
        self._positions(batch, fed)
        return batch

    def _positions(self, batch: dict[str, Any], fed: Fed) -> None:
        """``index`` (and, for a mixture, ``source``) and ``padded`` of a batch."""
        if self.mixture is not None:
            source, index = self.mixture.split(fed.indices)
            batch["source"] = torch.from_numpy(source)
            batch["index"] = torch.from_numpy(index)
        else:
            batch["index"] = torch.from_numpy(fed.indices.copy())
        batch["padded"] = torch.from_numpy(fed.padded.copy())

    def _labels(self, fed: Fed) -> torch.Tensor:
        f = self._label_field
        if self.mixture is None:
            values = parse_labels(self.dataset, f, fed.indices, fed.batch.fields[f])
        else:
            values = np.empty(len(fed.indices), np.int64)
            source, index = self.mixture.split(fed.indices)
            column = fed.batch.fields[f]
            for s in np.unique(source).tolist():
                sel = np.flatnonzero(source == s)
                part = self._parts[s]  # its label field, read under the first source's name (MixReader)
                values[sel] = parse_labels(part.dataset, part.label_field, index[sel], [column[j] for j in sel.tolist()])
        labels = torch.from_numpy(values)
        return labels if self.device == "cpu" else labels.to(self.torch_device)

    def _to_torch(self, names: tuple[str, ...], outputs, fed: Fed) -> dict[str, Any]:
        out = dict(zip(names, outputs))
        index = out.pop("index").as_array().reshape(-1)
        if not np.array_equal(index, fed.indices):
            raise RuntimeError(f"internal error: DALI returned indices {index[:8]} for a batch fed {fed.indices[:8]}")
        batch: dict[str, Any] = {name: self._tensor(value) for name, value in out.items()}
        for f in self._extra:
            if f == self._label_field:
                batch["label"] = self._labels(fed)
            else:
                batch[f] = _field_value([b.tobytes() for b in fed.batch.fields[f]])
        self._positions(batch, fed)
        return batch

    def _tensor(self, value):
        if self.device == "cuda":
            if not value.is_dense_tensor():
                return [self._tensor_one(value[j]) for j in range(len(value))]
            return self._tensor_one(value.as_tensor())
        if value.is_dense_tensor():
            if self._built is not None and self._built.owned_outputs:
                return torch.from_dlpack(value.as_tensor())  # the batch keeps DALI's buffer: no copy
            return torch.from_numpy(value.as_array())
        return [torch.from_numpy(np.array(value.at(j))) for j in range(len(value))]

    def _tensor_one(self, t):
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        dst = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=self.torch_device)
        feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream(self.torch_device))
        return dst

    def _decode_error(self, in_flight: list[Fed], err: Exception) -> DatasetError:
        """Map a DALI failure back to the sample: the first image PIL cannot decode either, in feed order."""
        from PIL import Image

        for fed in in_flight:
            for i, data, name in zip(fed.indices.tolist(), fed.batch.image or [], fed.batch.image_field or []):
                try:
                    with Image.open(io.BytesIO(data.tobytes())) as img:
                        img.load()
                except Exception as bad:  # whatever PIL raises, the image is undecodable
                    return DatasetError(f"{self._where(i)}: field {name!r} failed to decode "
                                        f"({type(bad).__name__}: {str(bad)[:80]})")
        first = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
        keys = ", ".join(repr(self._key_of(i)) for i in in_flight[0].indices[:8]) if in_flight else "?"
        return DatasetError(f"{self.dataset.root}: DALI failed on a batch with keys {keys}: {first}")


    def _where(self, i: int) -> str:
        """Names the sample a reader index ``i`` (a mixture id for a mixture) stands for."""
        return self.mixture.describe(i) if self.mixture is not None else sample_where(self.dataset, i)

    def _key_of(self, i: int) -> str:
        if self.mixture is None:
            return self.dataset.key(int(i))
        source, index = self.mixture.split(np.array([i]))
        return self.mixture.key(int(source[0]), int(index[0]))


@dataclass(frozen=True)
class _Part:
    """One dataset as the Loader reads it (the dataset, or one source of a mixture)."""

    dataset: Dataset
    reader: Reader
    files: Any
    """The shard source of an ``s3://`` dataset (its cache), else None."""
    extra: list[str]
    """Fields delivered besides the image."""
    image_field: str | None
    label_field: str | None


def _open_part(ds: Dataset, cfg: LoaderConfig, fields: list[str] | tuple[str, ...] | None,
               threads: int | None = None, read_ahead: int | None = None) -> _Part:
    """The reader of ``ds`` for the graph of ``cfg`` delivering ``fields`` (default: the label, or all for raw),
    with ``threads`` reader threads (default ``cfg.reader_threads``) and at most ``read_ahead`` shards read ahead
    (default ``cfg.shard_read_ahead``; fewer where the cache has no room for them)."""
    graph = cfg.graph
    # A sample's image is the first of the image fields it has: the main one, then the others (a dataset
    # may mix formats; DALI decodes by content). Image fields are optional in a sample for that reason.
    image_fields: tuple[str, ...] = ()
    if ds.image_field is not None:
        others = ds.manifest.image_fields or [f for f in ds.fields if is_image_field(f)]
        image_fields = (ds.image_field, *[f for f in others if f != ds.image_field])
    if graph.decodes and not image_fields:
        raise DatasetError(f"{ds.root}: dataset has no image field; use pipeline='raw'")
    image_field = ds.image_field if graph.decodes else None
    if fields is not None:
        extra = list(fields)
    elif not graph.decodes:
        extra = ds.fields
    else:
        extra = [ds.label_field] if ds.label_field else []
    ds.require_fields(extra, in_every_sample=graph.decodes)
    extra = [f for f in extra if f != image_field]
    depth = cfg.shard_read_ahead if read_ahead is None else read_ahead
    if ds.source.cache_size is not None:  # refused now, not after a fill waited for room that never comes
        depth = check_working_set([s.bytes for s in ds.shards], cfg.shuffle, cfg.block_shards, depth,
                                  ds.source.cache_size, str(ds.root))
    files = ds.source.shard_files(ds.shards, read_ahead=depth)  # None: local files
    reader = Reader(ds, extra, threads=threads or cfg.reader_threads, verify=cfg.verify,
                    image=image_fields if graph.decodes else (), sizes=graph.needs_image_size,
                    optional=image_fields if graph.decodes else [f for f in extra if f != ds.label_field],
                    transcode=decodable if graph.decodes else None, files=files)
    return _Part(ds, reader, files, extra, image_field, ds.label_field)


def _open_mixture(mixture: Mixture, cfg: LoaderConfig) -> list[_Part]:
    """One part per source. Each source delivers its own label field (the sources' label fields may be named
    differently: ``cls`` here, ``label`` there) and the same other fields: ``cfg.fields``, else none (decoding
    graphs) or the fields every source has (raw). The label is wanted when ``fields`` names a source's label
    field, else by decoding graphs, and by raw when every source has one. A source lacking a wanted field
    (the label included) is refused by name. The sources share ``cfg.reader_threads`` (each reads its part of
    every batch, in parallel with the others)."""
    labels = [ds.label_field for ds in mixture.datasets]
    named = [f for f in cfg.fields or () if f in labels]
    if cfg.fields is not None:
        wanted, others = bool(named), cfg.fields
    elif cfg.graph.decodes:
        wanted, others = any(labels), []
    else:
        wanted = all(labels)
        others = [f for f in mixture.datasets[0].fields if all(f in ds.fields for ds in mixture.datasets)]
    if wanted:  # the label fields are each source's own
        others = [f for f in others if f not in labels]
    asked = named[0] if named else next((f for f in labels if f), None)  # what a source without one lacks
    shared: dict[Any, dict[str, list[int]]] = {}  # remote sources by the cache they share
    for name, ds in zip(mixture.names, mixture.datasets):
        if ds.source.cache_size is not None:
            shared.setdefault((str(ds.source.cache.dir), ds.source.cache_size), {})[name] = [s.bytes for s in ds.shards]
    depth: dict[str, int] = {}  # the read-ahead that sources sharing a cache have room for
    for (where, size), sources in shared.items():
        if len(sources) > 1:
            fits = check_shared_working_set(sources, cfg.shuffle, cfg.block_shards, cfg.shard_read_ahead, size, where)
            depth.update(dict.fromkeys(sources, fits))
    parts: list[_Part] = []
    try:
        for name, ds in zip(mixture.names, mixture.datasets):
            try:
                if wanted and ds.label_field is None:  # another field of the same name is not its label
                    ds.require_fields([*others, asked])  # a source lacking it altogether: named by the field
                    raise DatasetError(f"{ds.root}: dataset has no label field, and the mixture's labels ({asked!r} "
                                       "of the others) are wanted; index it with --label-field, or leave labels "
                                       "out with pipeline='raw' and fields=")
                parts.append(_open_part(ds, cfg, [*others, ds.label_field] if wanted else others,
                                        threads=-(-cfg.reader_threads // len(mixture.names)),
                                        read_ahead=depth.get(name)))
            except DatasetError as err:
                raise DatasetError(f"mixture source {name!r}: {err}") from None
    except BaseException:
        for p in parts:
            p.reader.close()
        raise
    return parts


def _field_value(values: list[bytes]):
    """Numeric text fields become an int64 or float64 tensor; anything else stays a list of bytes."""
    try:
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    except ValueError:
        pass
    try:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    except ValueError:
        return values
