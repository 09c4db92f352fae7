"""The reading side of a DEST: open it, validate the manifest, expose shards, counts, labels, fingerprint,
and where every sample lies (:meth:`Dataset.locate`, from the consolidated sample index).

Opening reads ``manifest.json``, lists ``DEST/shards/`` once and memory-maps ``DEST/samples.fxi``
(:mod:`fastio.dataset.sample_table`); no ``.idx`` file is read until a sample's key is asked for. A dataset written
before the consolidated index existed (its manifest has no ``index``) is opened from its ``.idx`` files,
which are parsed into the same in-memory index on first use.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from fastio.checks import switch_option
from fastio.dataset.files import DatasetFiles, open_files
from fastio.dataset.manifest import Manifest, ShardRecord, rebuild_hint
from fastio.dataset.sample_table import IndexBuilder, Rows, SampleIndex, check_once
from fastio.errors import DatasetError
from fastio.formats.dali_idx import IndexEntry, key_crcs, load_index
from fastio.formats.labels import parse_label
from fastio.formats.media import ProbeTable
from fastio.storage.checksum import DIGESTS
from fastio.words import count

__all__ = ["Dataset", "Rows", "Shard", "SampleTable"]

_KEY_SHARDS = 8  # parsed .idx files kept for key lookups


@dataclass(frozen=True)
class Shard(ShardRecord):
    """A manifest's :class:`~fastio.dataset.manifest.ShardRecord` located in an opened DEST."""

    files: DatasetFiles = dataclasses.field(repr=False, compare=False, kw_only=True)
    """Where the DEST lives (a local folder, or an object store read through a node-local cache)."""
    first: int = dataclasses.field(default=0, kw_only=True)
    """Dataset-wide index of the shard's first sample."""

    @property
    def path(self) -> Path:
        """The local tar file (for a remote DEST: its cache entry, maybe not filled yet)."""
        return self.files.shard_path(self)

    @property
    def idx_path(self) -> Path:
        """Its local ``.idx`` file (for a remote DEST: fetched and verified on first use)."""
        return self.files.idx_path(self)


@dataclass(frozen=True)
class SampleTable:
    """Where every sample lives, in manifest order (dataset-wide index i is row i).

    ``offsets[f][i]``/``sizes[f][i]`` locate field ``f`` of sample i inside shard ``shard[i]``
    (size -1 where that sample lacks the field); ``span_*`` cover all of a sample's members.
    """

    keys: list[str]
    shard: np.ndarray  # int32 [N]
    span_offset: np.ndarray  # int64 [N]
    span_size: np.ndarray  # int64 [N]
    offsets: dict[str, np.ndarray]
    sizes: dict[str, np.ndarray]


class Dataset:
    """A converted dataset: ``Dataset(dest)`` validates the manifest and that every shard is present.

    Args:
        dest: the dataset directory, or an ``s3://bucket/prefix`` URL.
        verify: also check the sample index's sha256 against the manifest when it is opened (reads all
            of it; its size and header are always checked).
        cache_dir, cache_size: for a URL, the node-local cache its shards are read through
            (:mod:`fastio.storage.cache`).
        storage_options: override the endpoint, region and credentials found in the environment
            (:class:`fastio.storage.StorageOptions`).
    """

    def __init__(self, dest: str | Path, *, verify: bool = False, cache_dir: str | Path | None = None,
                 cache_size: int | str | None = None, storage_options: dict | None = None):
        if isinstance(dest, (list, tuple)):
            raise _a_list(dest)
        # Where the files are (a local DEST, or an s3:// DEST read through a node-local cache) is the storage
        # layer's business: its files (`DatasetFiles`) hand over the manifest, the local index and local shard paths.
        self.files = open_files(dest, cache_dir=cache_dir, cache_size=cache_size, storage_options=storage_options)
        self.root: Path | str = self.files.display
        self.verify = switch_option("verify", verify)  # not by its truth: verify="no" would check
        self.manifest: Manifest = self.files.load_manifest()
        shards, first = [], 0
        for record in self.manifest.shards:
            shards.append(Shard(**_record_fields(record), files=self.files, first=first))
            first += record.samples
        self.shards: list[Shard] = shards
        self._starts = np.array([s.first for s in shards] + [first], np.int64)
        self._keys: dict[int, list[str]] = {}
        self._keys_lock = threading.Lock()
        self.files.check(shards)
        if self.manifest.index is not None:  # memory-mapped and checked now; .idx files only on demand
            self.index  # noqa: B018

    @property
    def rebuild_hint(self) -> str:
        """What makes this dataset again after its shards changed (:func:`fastio.dataset.manifest.rebuild_hint`):
        ``re-run `fastio index /data/wds --overwrite```, or converting the source again."""
        return rebuild_hint(self.manifest, self.root)

    def __repr__(self) -> str:
        return f"Dataset({str(self.root)!r}, samples={len(self)}, shards={len(self.shards)})"

    def __len__(self) -> int:
        return self.manifest.total_samples

    @property
    def fields(self) -> list[str]:
        return self.manifest.fields

    @property
    def image_field(self) -> str | None:
        return self.manifest.image_field

    @property
    def label_field(self) -> str | None:
        return self.manifest.label_field

    @property
    def label_map(self) -> dict[str, int] | None:
        return self.manifest.label_map

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @cached_property
    def num_classes(self) -> int | None:
        """How many outputs a classifier of this dataset needs: the largest integer label + 1. From the label
        map where the source named its classes (``fastio convert`` of an image folder); otherwise (shards made
        by ``fastio index``, integer labels of a table) read once from the samples' label field on first use:
        one small read per sample. None for a dataset without a label field or without labelled samples;
        DatasetError naming the shard and sample for a value that is not a label."""
        if self.label_map:
            return max(self.label_map.values()) + 1
        if self.label_field is None or self.label_field not in self.fields:
            return None
        largest = max((self._largest_label(shard) for shard in self.shards), default=-1)
        return largest + 1 if largest >= 0 else None

    def classifier_outputs(self) -> int:
        """:attr:`num_classes` for a classifier, which needs labels: DatasetError naming this dataset where it has
        none (a flat image folder converted, shards without a label field), instead of None reaching
        ``nn.Linear``."""
        classes = self.num_classes
        if classes is None:
            raise DatasetError(f"{self.root}: a dataset without labels (converted from a folder with no class "
                               "folders, or shards without a label field): a classifier needs labels: put the "
                               "images in one folder per class and convert again (shards: a .cls member in each "
                               "sample, then fastio index)")
        return classes

    def _largest_label(self, shard: Shard) -> int:
        """The largest label in ``shard``'s label field (-1 when no sample of it has one)."""
        field = self.label_field
        rows = self.locate(np.arange(shard.first, shard.first + shard.samples, dtype=np.int64))
        offsets, sizes = rows.offsets[field].tolist(), rows.sizes[field].tolist()
        largest = -1
        with self.files.local_shard(shard) as path, open(path, "rb") as f:
            for j, (offset, size) in enumerate(zip(offsets, sizes)):
                if size < 0:
                    continue
                data = os.pread(f.fileno(), size, offset)
                try:
                    largest = max(largest, parse_label(data))
                except ValueError as err:
                    raise DatasetError(f"{self.root}: shard {shard.name} key {self.key(shard.first + j)!r}: field "
                                       f"{field!r} is not an integer label: {data[:32]!r} ({err})") from None
        return largest

    def read_index(self, shard: Shard) -> list[IndexEntry]:
        """The shard's index, checked against the manifest (sha256, counts, ranges:
        :func:`fastio.formats.dali_idx.load_index`)."""
        return self._idx(shard, lambda data, source: load_index(
            data, samples=shard.samples, tar_bytes=shard.bytes, sha256=shard.idx_sha256, source=source))

    def key_crcs(self, shard: Shard) -> np.ndarray:
        """The CRC-32 of each key of the shard's index (uint32, in shard order; sha256, line count and keys checked:
        :func:`fastio.formats.dali_idx.key_crcs`), for the Reader's tar-header check."""
        return self._idx(shard, lambda data, source: key_crcs(data, samples=shard.samples, sha256=shard.idx_sha256,
                                                              source=source))

    def _idx(self, shard: Shard, parse):
        """``parse(bytes, source)`` of the shard's ``.idx``; DatasetError naming the file when it cannot."""
        self._refuse_tokens(", not as samples: it has no sample keys")
        try:
            return parse(shard.idx_path.read_bytes(), str(shard.idx_path))
        except OSError as err:
            raise DatasetError(f"{self.root}: shard index {shard.idx_path.name}: {err.strerror or err}") from None
        except ValueError as err:  # names the index file
            raise DatasetError(str(err)) from None

    def _refuse_tokens(self, what: str) -> None:
        """DatasetError naming this dataset when it is a token dataset, which holds documents, not samples (its
        ``.idx`` files are Megatron's; a Tokens Loader's ``batch["index"]`` is a sequence id)."""
        if self.manifest.kind == "tokens":
            raise DatasetError(f"{self.root}: a token dataset (Megatron .bin/.idx shards): its documents are read by "
                               f"fastio.tokens (docs/tokens.md){what}")

    @cached_property
    def index(self) -> SampleIndex:
        """The sample index: ``DEST/samples.fxi`` memory-mapped (pages shared by every process of a node),
        or, for a dataset without one, built in memory from every ``.idx`` (parsed once)."""
        counts, record = [s.samples for s in self.shards], self.manifest.index
        self._refuse_tokens(", not as samples")
        if record is not None:
            return SampleIndex.open(self.files.index_path(record), counts, self.fields, record, verify=self.verify,
                                    shard_bytes=[s.bytes for s in self.shards])
        builder = IndexBuilder()
        for shard in self.shards:
            try:
                builder.add(shard, self.read_index(shard))
            except ValueError as err:
                raise DatasetError(f"{self.root}: {err}") from None
        return SampleIndex.from_bytes(builder.to_bytes(self.fields), f"{self.root} (from its .idx files)", counts,
                                      self.fields)

    @cached_property
    def probes(self) -> ProbeTable | None:
        """The probe table of the samples' video and audio files (``DEST/probes.fxp``, written by ``fastio
        index``), memory-mapped: a rank reads the entries of the samples it plans. Its size is checked against the
        manifest's record, and its xxh3-128 (sha256 too with ``verify``) and offsets once per node and file
        (:func:`~fastio.dataset.sample_table.check_once`); None for a dataset without one (a converted dataset's
        probes are its ``probe.json`` fields)."""
        record = self.manifest.probes
        if record is None:
            return None
        where = f"{self.root}: {record.name}"
        changed = DatasetError(f"{where}: does not match the manifest (size or checksum): the file changed after "
                               f"indexing; {self.rebuild_hint}")
        path = self.files.index_path(record, "probe table")
        try:
            stat = path.stat()
            if stat.st_size != record.bytes:
                raise changed
            table = ProbeTable.open(path, where, len(self))
        except OSError as err:
            raise DatasetError(f"{where}: {err.strerror or err}") from None
        except ValueError as err:
            raise DatasetError(str(err)) from None

        def checks() -> None:
            algos = ("xxh3_128", "sha256") if self.verify else ("xxh3_128",)
            if any(getattr(record, a) and _digest(a, table.data) != getattr(record, a) for a in algos):
                raise changed
            try:
                table.check()
            except ValueError as err:
                raise DatasetError(str(err)) from None

        if self.verify:
            checks()
        else:
            check_once(path, stat, record, checks)
        return table

    def locate(self, indices: np.ndarray) -> Rows:
        """Where samples ``indices`` (dataset-wide) lie: shard, span and each field's offset and size."""
        return self.index.locate(indices)

    def shard_of(self, index: int) -> Shard:
        """The shard holding the sample with dataset-wide index ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range 0..{len(self) - 1}")
        return self.shards[int(np.searchsorted(self._starts, index, "right")) - 1]

    def key(self, index: int) -> str:
        """The ``__key__`` of sample ``index``, read from its shard's ``.idx`` (the last few are kept)."""
        shard = self.shard_of(int(index))
        with self._keys_lock:
            keys = self._keys.get(shard.first)
        if keys is None:
            keys = [e.key for e in self.read_index(shard)]
            with self._keys_lock:
                if len(self._keys) >= _KEY_SHARDS:
                    self._keys.pop(next(iter(self._keys)))
                self._keys[shard.first] = keys
        return keys[int(index) - shard.first]

    def where(self, index: int) -> str:
        """``"DEST: shard NAME key KEY"`` of sample ``index``, for messages."""
        return f"{self.root}: shard {self.shard_of(int(index)).name} key {self.key(int(index))!r}"

    @cached_property
    def table(self) -> SampleTable:
        """Every sample's location and key as flat arrays: O(samples) memory, for tools that scan a whole
        dataset (``inspect``); the loader uses :meth:`locate` a batch at a time instead."""
        rows = self.locate(np.arange(len(self), dtype=np.int64))
        keys = [e.key for shard in self.shards for e in self.read_index(shard)]
        return SampleTable(keys, rows.shard, rows.span_offset, rows.span_size, rows.offsets, rows.sizes)

    def require_fields(self, wanted: list[str], *, in_every_sample: bool = False) -> None:
        """DatasetError naming the fields of ``wanted`` the dataset lacks; with ``in_every_sample``, also those
        some samples lack where the manifest counts them (``field_counts``, written by ``fastio index``), so
        a reader that needs them in every sample is refused now, not mid-epoch."""
        missing = [f for f in wanted if f not in self.fields]
        if missing:
            raise DatasetError(
                f"{self.root}: dataset has no field {', '.join(map(repr, missing))} (fields: {', '.join(self.fields)})"
            )
        counts = self.manifest.field_counts if in_every_sample else None
        short = [f for f in wanted if counts is not None and counts.get(f, 0) < len(self)]
        if short:
            f = short[0]
            raise DatasetError(f"{self.root}: field {f!r} is in {counts.get(f, 0)} of {count(len(self), 'sample')}, "
                               "and this pipeline needs it in every sample (pipeline=fastio.Raw() delivers the samples "
                               "lacking it, with batch['has'])")


def _digest(algo: str, data) -> str:
    h = DIGESTS[algo]()
    h.update(data)
    return h.hexdigest()


def _a_list(dest: list | tuple) -> DatasetError:
    """The error for a list given as a dataset (shard files, as other loaders take them)."""
    folders = {str(Path(p).parent) for p in dest}
    folder = folders.pop() if len(folders) == 1 else "FOLDER"
    shown = f"{[str(p) for p in dest[:2]]}{'...' if len(dest) > 2 else ''}"
    return DatasetError(f"{shown}: a list; a dataset is one folder: make the folder of shards one with `fastio index "
                        f"{folder}`, then give that folder (several datasets: fastio.Mixture)")


def _record_fields(record: ShardRecord) -> dict[str, Any]:
    """A record's own fields, to build the :class:`Shard` that locates it."""
    return {name: getattr(record, name) for name in _RECORD_FIELDS}


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(ShardRecord))  # once, not once a shard
