"""The read set: what a Loader reads, one dataset or a mixture of several, the same kind of object to it.

A read set owns the readers (one :class:`~fastio.read.reader.Reader` per dataset; a mixture's are merged by a
:class:`~fastio.read.mixture.MixReader`), the order of its samples (:class:`~fastio.order.sampler.Sampler` for a dataset,
the mixture's :class:`~fastio.order.mixorder.MixSampler`), the label field of each dataset, the keys, and its share of
the Loader's state (nothing for a dataset, so its states stay as they were; the ``mixture`` entry for a mixture).
Which fields are read is the pipeline object's choice (its ``fields``, else its ``default_fields``:
:meth:`fastio.read.protocol.FieldChoice.of`; what of each dataset: its ``read_fields``), asked through
:class:`fastio.read.protocol.Reads`, so the read set imports no pipeline; each dataset reads its own label field
under its own name.

:func:`open_read_set` makes one from what the Loader was given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fastio.checks import integer
from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError, LoaderStateError
from fastio.order.sampler import Sampler, SamplerSpec
from fastio.read.loss_masks import K_LOSS_MASK, check_dataset_masks, check_mixture_masks, dataset_masks, mixture_masks
from fastio.read.mixture import (
    MixReader,
    Mixture,
    check_mixture_state,
    mixture_state,
    next_epoch_way,
    renewed_mixture_state,
)
from fastio.read.options import Options
from fastio.read.protocol import Delivery, FieldChoice, ReadFields, Reads, read_fields_of
from fastio.read.reader import ReadBatch, Reader, parse_labels, sample_where
from fastio.read.working_set import Reading, Shards, check_shared_working_set, check_working_set
from fastio.words import count

__all__ = ["K_MIXTURE", "DatasetReadSet", "MixtureReadSet", "ReadSet", "open_read_set"]

K_MIXTURE = "mixture"
"""The state entry only a mixture writes (:func:`fastio.read.mixture.mixture_state`)."""


@dataclass(frozen=True)
class _Source:
    """One dataset as the read set reads it (the dataset, or one source of a mixture)."""

    dataset: Dataset
    reader: Reader | None
    """None where the pipeline reads no stored sample (its own reader reads the shards: :class:`fastio.Tokens`)."""
    files: Any
    """The shard source of an ``s3://`` dataset (its cache), else None."""
    label_field: str | None
    """Its label field when labels are delivered, else None."""


class ReadSet:
    """What the Loader reads (see the module docstring). ``target`` is the :class:`Dataset` or :class:`Mixture`;
    ``options``: the Loader's :class:`~fastio.read.options.Options` (reader threads, the shuffle, the shards' cache,
    checks and read-ahead); ``batch_size``: the units of one batch of a rank (a cache's working set counts
    each as the stored samples its kind's ``ReadFields.per_unit`` says it reads)."""

    epoch_noun: ClassVar[str] = "dataset"
    """What an epoch reads, in messages (``batch_size 64 is larger than the dataset``)."""

    def __init__(self, target: Dataset | Mixture, names: Sequence[str], datasets: Sequence[Dataset],
                 pipeline: Reads, options: Options, batch_size: int):
        self.target, self.names, self.pipeline = target, tuple(names), pipeline
        self.mixture: Mixture | None = target if isinstance(target, Mixture) else None
        """The :class:`Mixture` read, else None (for those who want to know; the Loader does not ask)."""
        labels = [ds.label_field for ds in datasets]
        shared = [f for f in datasets[0].fields if all(f in ds.fields for ds in datasets)]
        choice = FieldChoice.of(pipeline.fields, pipeline.default_fields, labels, shared)
        wanted = self._wanted(datasets, choice)
        readings = _readings(self.names, options, batch_size, self.mixture is not None, wanted,
                             "block" in getattr(pipeline, "shuffles", ("block",)),
                             getattr(pipeline, "unit", "sample"), _stored_nouns(self.names, datasets))
        depth = _check_shared_caches(self.names, datasets, options, readings)
        self.reader_threads: int = options.performance.reader_threads
        self.sources = self._open(datasets, choice, options, depth, readings, wanted)
        first = self.sources[0]
        named = {s.label_field for s in self.sources}
        self.label_column: str | None = first.label_field if choice.label and len(named) == 1 else None
        """The field holding every dataset's labels, when all name it alike (delivered as bytes too, by raw)."""
        self.labelled: bool = choice.label
        """Whether ``batch["label"]`` is delivered (each dataset's own label field)."""
        others = [f for f in (first.reader.fields if first.reader else []) if f != first.label_field]
        self.columns: tuple[str, ...] = (*others, self.label_column) if self.label_column else tuple(others)
        """The read fields delivered under their own names, in order."""
        self.reader = self._reader()

    # -- opening --------------------------------------------------------------------------------------

    def _wanted(self, datasets: Sequence[Dataset], choice) -> dict[str, ReadFields | None]:
        """What the pipeline reads of each dataset (by name): ``choice``'s fields and its own label field (None: no
        stored sample; a DatasetError, named by the read set, for a dataset lacking them)."""
        wanted: dict[str, ReadFields | None] = {}
        for name, ds in zip(self.names, datasets):
            try:
                if choice.label and ds.label_field is None:  # another field of the same name is not its label
                    ds.require_fields([*choice.others, choice.asked])  # lacking it altogether: named by field
                    raise DatasetError(f"{ds.root}: dataset has no label field, and the mixture's labels "
                                       f"({choice.asked!r} of the others) are wanted; index it with "
                                       "--label-field, or leave labels out with pipeline=fastio.Raw(fields=...)")
                fields = [*choice.others, ds.label_field] if choice.label else list(choice.others)
                wanted[name] = read_fields_of(self.pipeline, ds, fields)
            except DatasetError as err:
                raise self._named(name, err) from None
        return wanted

    def _open(self, datasets: Sequence[Dataset], choice, options: Options, depth: dict[str, int],
              readings: dict[str, Reading], wanted: dict[str, ReadFields | None]) -> list[_Source]:
        """One source per dataset, reading what ``wanted`` names of it (:meth:`_wanted`); the datasets share
        ``options.performance.reader_threads`` (each reads its part of every batch, in parallel with the others); ``depth``:
        the shard read-ahead that sources sharing a cache have room for, by name; ``readings``: how each is read."""
        threads = _threads_per_source(options, len(datasets))
        sources: list[_Source] = []
        try:
            for name, ds in zip(self.names, datasets):
                try:
                    sources.append(_open_source(ds, wanted[name], threads, options, readings[name],
                                                ds.label_field if choice.label else None, depth.get(name)))
                except DatasetError as err:
                    raise self._named(name, err) from None
        except BaseException:
            for s in sources:
                _close_source(s)
            raise
        return sources

    def _named(self, name: str, err: DatasetError) -> DatasetError:
        """``err`` as the read set says it of its source ``name``."""
        return err

    def _reader(self) -> Any:
        """What reads a batch of the read set's ids (``submit``, ``read_ahead_shards``, ``close``)."""
        return self.sources[0].reader

    # -- what it is -----------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """How messages name it."""
        return str(self.target.root)

    @property
    def fingerprint(self) -> str:
        return self.target.fingerprint

    def __len__(self) -> int:
        """Samples of an epoch."""
        return len(self.target)

    def sampler(self, spec: SamplerSpec, world_size: int, rank: int) -> Any:
        """The order of its samples and rank ``rank``'s batches."""
        raise NotImplementedError

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read-set ids -> ``(source, index within that source)``."""
        ids = np.asarray(ids, np.int64)
        return np.zeros(len(ids), np.int64), ids

    # -- a batch --------------------------------------------------------------------------------------

    def labels(self, read: ReadBatch) -> np.ndarray:
        """The batch's labels (int64), each sample's from its dataset's own label field."""
        source, index = self.split(read.indices)
        if len(self.sources) == 1:
            s = self.sources[0]
            return parse_labels(s.dataset, s.label_field, index, read.fields[s.label_field])
        values = np.empty(len(index), np.int64)
        for k in np.unique(source).tolist():
            sel = np.flatnonzero(source == k)
            s = self.sources[k]
            column = read.fields[s.label_field]
            values[sel] = parse_labels(s.dataset, s.label_field, index[sel], [column[j] for j in sel.tolist()])
        return values

    def delivery(self, read: ReadBatch, labels: Callable[[np.ndarray], Any]) -> Delivery:
        """``read`` as a pipeline assembles it; ``labels`` puts the parsed labels where the batch wants them."""
        return Delivery(read, self.columns, self.label_column,
                        (lambda: labels(self.labels(read))) if self.labelled else None)

    def positions(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch entries that say which samples it holds: ``index`` (and ``source`` for a mixture)."""
        return {"index": torch.from_numpy(np.asarray(ids).copy())}

    def key(self, source: int | str, index: int | None = None) -> str:
        """The ``__key__`` of a sample (see :meth:`fastio.Loader.key`)."""
        raise NotImplementedError

    def key_of(self, i: int) -> str:
        """The ``__key__`` of read-set id ``i``."""
        source, index = self.split(np.array([i]))
        return self.sources[int(source[0])].dataset.key(int(index[0]))

    def where(self, i: int) -> str:
        """Names the sample read-set id ``i`` stands for, for messages."""
        source, index = self.split(np.array([i]))
        return sample_where(self.sources[int(source[0])].dataset, int(index[0]))

    # -- state and stats ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Its entries of the Loader's state."""
        return {}

    def check_state(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        """LoaderStateError unless ``state`` (a whole Loader state) can continue with this read set."""
        raise NotImplementedError

    def renewed_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Its entries of ``state`` (a whole Loader state) naming its datasets as they are now, for a state moved
        to the start of an epoch (see :meth:`fastio.Loader.next_epoch_state`)."""
        return {}

    def count(self, positions: dict[str, torch.Tensor], padded: np.ndarray) -> None:
        """Count a delivered batch's samples (padding repeats left out) for :meth:`stats`."""

    def stats(self) -> dict[str, Any]:
        """Its entries of ``Loader.stats()``."""
        raise NotImplementedError

    def progress_detail(self) -> Callable[[], str] | None:
        """What adds the storage part to a progress line, or None where there is none to show."""
        return None

    def close(self) -> None:
        if all(s.reader is not None for s in self.sources):
            self.reader.close()
        else:  # sources without a reader of stored samples: each source closed here (its reader or shard source)
            for s in self.sources:
                _close_source(s)


class DatasetReadSet(ReadSet):
    """One dataset: ids are its dataset-wide indices; today's :class:`~fastio.order.sampler.Sampler` orders them."""

    def __init__(self, ds: Dataset, pipeline: Reads, options: Options, batch_size: int):
        super().__init__(ds, [str(ds.root)], [ds], pipeline, options, batch_size)

    def sampler(self, spec: SamplerSpec, world_size: int, rank: int) -> Sampler:
        ds = self.target
        return Sampler(spec, [s.samples for s in ds.shards], ds.fingerprint, world_size, rank)

    def key(self, source: int | str, index: int | None = None) -> str:
        if index is not None:
            raise TypeError("a dataset's loader names a sample by key(index)")
        return self.target.key(_whole(source, "sample index"))

    def state(self) -> dict[str, Any]:
        return dataset_masks(self.target)

    def check_state(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        saved = state.get(K_MIXTURE)
        if saved is not None:
            names = ", ".join(map(repr, saved.get("names", []))) if isinstance(saved, dict) else ""
            raise LoaderStateError(f"{self.root}: loader state is of a mixture (sources {names}), this "
                                   "Loader reads one dataset: make it with the same fastio.Mixture to continue the "
                                   f"saved epoch, or start the next epoch on this dataset {next_epoch_way(epoch, consumed)}")
        check_dataset_masks(self.target, state, next_epoch_way(epoch, consumed))

    def renewed_state(self, state: dict[str, Any]) -> dict[str, Any]:
        if state.get(K_MIXTURE) is None:
            return dataset_masks(self.target)
        # a mixture's state (its sources cut down to this dataset): the next epoch is this dataset's, the mixture's
        # entries go (None: what a state without them reads as)
        return {K_MIXTURE: None, K_LOSS_MASK: None, **dataset_masks(self.target)}

    def stats(self) -> dict[str, Any]:
        files = self.sources[0].files
        return {"storage": _storage_stats(files)} if files is not None else {}

    def progress_detail(self) -> Callable[[], str] | None:
        files = self.sources[0].files
        if files is None:
            return None

        def line() -> str:
            s = _storage_stats(files)
            return f"storage wait {s['wait_s']:.1f} s, {count(s['retries'], 'retry', 'retries')}"
        return line


class MixtureReadSet(ReadSet):
    """A :class:`~fastio.Mixture`: ids are mixture ids (source ``s``'s sample ``i`` is ``base[s] + i``), in the
    mixture's order; batches carry ``source`` and ``index``; its state entry names sources, weights, length."""

    epoch_noun: ClassVar[str] = "mixture's epoch"

    def __init__(self, mixture: Mixture, pipeline: Reads, options: Options, batch_size: int):
        super().__init__(mixture, mixture.names, mixture.datasets, pipeline, options, batch_size)
        self.delivered = np.zeros(len(self.sources), np.int64)

    def _named(self, name: str, err: DatasetError) -> DatasetError:
        return DatasetError(f"mixture source {name!r}: {err}")

    def _reader(self) -> MixReader:
        return MixReader(self.target, [s.reader for s in self.sources])

    def sampler(self, spec: SamplerSpec, world_size: int, rank: int) -> Any:
        return self.target.sampler(spec, world_size, rank)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.target.split(ids)

    def in_units(self, sizes: Sequence[int]) -> None:
        """Count the mixture in a kind's own units, ``sizes[s]`` of source ``s`` (packed sequences of a token
        mixture): its ids, weights, schedule, epoch length, state entry and stats are then in those units
        (:meth:`fastio.Mixture.in_units`)."""
        self.target = self.mixture = self.target.in_units(sizes)

    def positions(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        source, index = self.target.split(ids)
        return {"source": torch.from_numpy(source), "index": torch.from_numpy(index)}

    def key(self, source: int | str, index: int | None = None) -> str:
        if index is None:
            raise TypeError("a mixture's loader names a sample by key(source, index)")
        if not isinstance(source, str):
            source = _whole(source, "source", " (or a source's name)")
        return self.target.key(source, _whole(index, "sample index"))

    def where(self, i: int) -> str:
        return self.target.describe(i)

    def state(self) -> dict[str, Any]:
        return {K_MIXTURE: mixture_state(self.target), **mixture_masks(self.names, self.target.datasets)}

    def check_state(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        check_mixture_state(self.target, state.get(K_MIXTURE), epoch, consumed)
        check_mixture_masks(self.root, self.names, self.target.datasets, state, next_epoch_way(epoch, consumed))

    def renewed_state(self, state: dict[str, Any]) -> dict[str, Any]:
        renewed = mixture_masks(self.names, self.target.datasets)
        if state.get(K_MIXTURE) is None:  # one dataset's state (a source added since): this mixture's next epoch
            return {K_LOSS_MASK: None, **renewed, K_MIXTURE: mixture_state(self.target)}
        renewed[K_MIXTURE] = renewed_mixture_state(self.target, state.get(K_MIXTURE))
        return renewed

    def count(self, positions: dict[str, torch.Tensor], padded: np.ndarray) -> None:
        src = positions["source"].numpy()[~padded]
        self.delivered += np.bincount(src, minlength=len(self.delivered))

    def stats(self) -> dict[str, Any]:
        total = int(self.delivered.sum())
        out: dict[str, Any] = {"sources": {name: {"samples": int(n), "share": n / total if total else 0.0}
                                           for name, n in zip(self.names, self.delivered.tolist())}}
        storage = {name: _storage_stats(s.files) for name, s in zip(self.names, self.sources) if s.files is not None}
        if storage:
            out["storage_by_source"] = storage
        return out


def open_read_set(target: str | Any | Dataset | Mixture, pipeline: Reads, options: Options,
                  batch_size: int) -> ReadSet:
    """The read set of a :class:`Mixture`, a :class:`Dataset`, or a DEST (a path or URL, opened with
    ``options.shards``' verify, cache_dir, cache_size and storage_options), read ``batch_size`` samples a batch."""
    if isinstance(target, Mixture):
        return MixtureReadSet(target, pipeline, options, batch_size)
    if not isinstance(target, Dataset):
        shards = options.shards
        target = Dataset(target, verify=shards.verify, cache_dir=shards.cache_dir, cache_size=shards.cache_size,
                         storage_options=shards.storage_options)
    return DatasetReadSet(target, pipeline, options, batch_size)


def _threads_per_source(options: Options, sources: int) -> int:
    """Reader threads of each source (they share ``reader_threads``)."""
    return -(-options.performance.reader_threads // sources)


def _stored_nouns(names: Sequence[str], datasets: Sequence[Dataset]) -> dict[str, str]:
    """What each dataset's shards hold, by name, in a refusal's words: a token dataset's documents, else stored
    samples."""
    return {name: "document" if ds.manifest.tokens is not None else "stored sample"
            for name, ds in zip(names, datasets)}


def _readings(names: Sequence[str], options: Options, batch_size: int, mixture: bool,
              wanted: dict[str, ReadFields | None], block: bool, unit: str, stored: dict[str, str]
              ) -> dict[str, Reading]:
    """How each source is read, for its cache's working set: a batch of ``batch_size`` units (at most: a
    source's part of a mixture's batch), each reading up to its ``wanted`` ``per_unit`` stored samples (a packed
    sequence's conversations), as many batches at once as its reader threads read (at most the feeder's
    ``read_ahead`` batches and the one it waits for); a token reader's threads hold one shard each, of any source;
    ``block``: whether the kind reads ``shuffle='block'`` (a refusal suggests it only then); ``unit``: what the
    kind's ``batch_size`` counts and ``stored``: what each source's shards hold, by name (a refusal's words)."""
    order, threads, batches = options.order, _threads_per_source(options, len(names)), options.performance.read_ahead + 2
    holders = min(options.performance.reader_threads, batches)  # a token reader's threads: one shard each

    def per_unit(name: str) -> int:
        return wanted[name].per_unit if wanted[name] is not None else 1

    return {name: Reading(order.shuffle, order.block_shards, batch_size * per_unit(name), min(threads, batches),
                          runs=2 if mixture else 1, threads_hint=not mixture, holders=holders,
                          per_unit=per_unit(name), block_hint=block,
                          unit=unit, stored=stored[name]) for name in names}


def _open_source(ds: Dataset, wanted: ReadFields | None, threads: int, options: Options, reading: Reading,
                 label_field: str | None, read_ahead: int | None = None) -> _Source:
    """The reader of what ``wanted`` names of ``ds`` (none where the pipeline reads no stored sample: then only
    its shard source), with at most ``read_ahead`` shards read ahead (default
    ``options.shards.shard_read_ahead``; fewer where the cache has no room for them); ``reading``: how its batches
    are read (its cache's working set)."""
    need = None
    shards = options.shards
    depth = shards.shard_read_ahead if read_ahead is None else read_ahead
    if ds.files.cache_size is not None:  # refused now, not after a fill waited for room that never comes
        held = _shards_of(ds)
        depth = check_working_set(held, reading, depth, ds.files.cache_size, str(ds.root))
        need = held.need(reading, depth)
    # None: local files; a cache's files claim their working set beside this process's other Loaders' there
    files = ds.files.shard_files(ds.shards, read_ahead=depth, working_set=need)
    if wanted is None:
        return _Source(ds, None, files, label_field)
    reader = Reader(ds, wanted.fields, threads=threads, verify=shards.verify, image=wanted.image,
                    sizes=wanted.sizes, optional=wanted.optional, transcode=wanted.transcode, files=files)
    return _Source(ds, reader, files, label_field)


def _close_source(s: _Source) -> None:
    if s.reader is not None:
        s.reader.close()
    elif s.files is not None:
        s.files.close()


def _shards_of(ds: Dataset) -> Shards:
    return Shards([s.bytes for s in ds.shards], [s.samples for s in ds.shards])


def _check_shared_caches(names: Sequence[str], datasets: Sequence[Dataset], options: Options,
                         readings: dict[str, Reading]) -> dict[str, int]:
    """Remote datasets reading through one cache read their working sets at once: checked together; returns
    the shard read-ahead that those sharing a cache have room for, by name."""
    shared: dict[Any, dict[str, Shards]] = {}
    for name, ds in zip(names, datasets):
        if ds.files.cache_size is not None:
            shared.setdefault((str(ds.files.cache.dir), ds.files.cache_size), {})[name] = _shards_of(ds)
    depth: dict[str, int] = {}
    for (where, size), sources in shared.items():
        if len(sources) > 1:
            fits = check_shared_working_set(sources, readings, options.shards.shard_read_ahead, size, where)
            depth.update(dict.fromkeys(sources, fits))
    return depth


def _storage_stats(files: Any) -> dict[str, Any]:
    return files.stats.as_dict(getattr(files.storage, "retry_count", 0))


def coming(plans: Callable[[int, int], Any], epoch: int, consumed: int) -> Callable[[], Iterable[np.ndarray]]:
    """The read set's ids from ``(epoch, consumed)`` to the end of the next epoch, a chunk of batches at a time,
    in order (for ``read_ahead_shards``): ``plans`` is the sampler's ``plan``."""
    def chunks() -> Iterable[np.ndarray]:
        for indices, _, _ in plans(epoch, consumed).iter_chunks():
            yield indices
        try:
            after = plans(epoch + 1, 0)
        except ValueError:  # the order ends with this epoch (a mixture's int64 stream): asked for, it is refused
            return
        for indices, _, _ in after.iter_chunks():
            yield indices
    return chunks


def _whole(value: Any, what: str, alternative: str = "") -> int:
    """``value`` (a numpy integer or 0-d torch one too) as an int for :meth:`fastio.Loader.key`, else TypeError
    naming it: ``int()`` would truncate 1.5 to another sample's key."""
    number = integer(value)
    if number is None:
        raise TypeError(f"key: {what} {value!r} is not an integer{alternative}")
    return number
