"""The reading side of a DEST: open it, validate the manifest, expose shards, counts, labels, fingerprint."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from fastio.errors import DatasetError
from fastio.idx import IndexEntry, parse_index
from fastio.manifest import ShardRecord, fingerprint, shard_records
from fastio.storage.dest import open_source

__all__ = ["Dataset", "Shard", "SampleTable"]


@dataclass(frozen=True)
class Shard(ShardRecord):
    """A manifest's :class:`~fastio.manifest.ShardRecord` located in an opened DEST."""

    path: Path
    """The tar file."""
    idx_path: Path
    """Its ``.idx`` file."""
    first: int
    """Dataset-wide index of the shard's first sample."""


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

    ``dest`` is a directory or an ``s3://bucket/prefix`` URL. A URL's shards are read through a node-local cache
    in ``cache_dir`` bounded by ``cache_size`` (see :mod:`fastio.storage.cache`); ``storage_options`` overrides
    the endpoint, region and credentials found in the environment (:class:`fastio.storage.StorageOptions`).
    """

    def __init__(self, dest: str | Path, *, cache_dir: str | Path | None = None, cache_size: int | str | None = None,
                 storage_options: dict | None = None):
        # Where the files are (a local DEST, or an s3:// DEST read through a node-local cache) is the storage
        # layer's business: the source hands over the manifest, local index files and local shard paths.
        self.source = open_source(dest, cache_dir=cache_dir, cache_size=cache_size, storage_options=storage_options)
        self.root: Path | str = self.source.display
        self.manifest: dict[str, Any] = self.source.load_manifest()
        shards, first = [], 0
        records = shard_records(self.manifest)
        for record in records:
            shards.append(Shard(**record.as_dict(), path=self.source.shard_path(record),
                                idx_path=self.source.idx_path(record), first=first))
            first += record.samples
        self.shards: list[Shard] = shards
        self.source.check(records)

    def __repr__(self) -> str:
        return f"Dataset({str(self.root)!r}, samples={len(self)}, shards={len(self.shards)})"

    def __len__(self) -> int:
        return self.manifest["total_samples"]

    @property
    def fields(self) -> list[str]:
        return list(self.manifest["fields"])

    @property
    def image_field(self) -> str | None:
        return self.manifest.get("image_field")

    @property
    def label_field(self) -> str | None:
        return self.manifest.get("label_field")

    @property
    def label_map(self) -> dict[str, int] | None:
        return self.manifest.get("label_map")

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.manifest)

    def read_index(self, shard: Shard) -> list[IndexEntry]:
        try:
            entries = parse_index(shard.idx_path.read_text(), source=str(shard.idx_path))
        except (OSError, ValueError) as err:
            raise DatasetError(f"{self.root}: shard index {shard.idx_path.name}: {err}") from None
        if len(entries) != shard.samples:
            raise DatasetError(
                f"{self.root}: shard {shard.name} index lists {len(entries)} samples, manifest says {shard.samples}"
            )
        return entries

    @cached_property
    def table(self) -> SampleTable:
        """Parse every ``.idx`` once into flat arrays (the loader's map from index to bytes)."""
        n, fields = len(self), self.fields
        keys: list[str] = []
        shard_of = np.empty(n, np.int32)
        span_offset, span_size = np.empty(n, np.int64), np.empty(n, np.int64)
        offsets = {f: np.full(n, -1, np.int64) for f in fields}
        sizes = {f: np.full(n, -1, np.int64) for f in fields}
        for s_i, shard in enumerate(self.shards):
            for j, entry in enumerate(self.read_index(shard)):
                i = shard.first + j
                keys.append(entry.key)
                shard_of[i] = s_i
                span_offset[i], span_size[i] = entry.span
                for ext, offset, size in entry.members:
                    if ext in offsets:
                        offsets[ext][i], sizes[ext][i] = offset, size
        return SampleTable(keys, shard_of, span_offset, span_size, offsets, sizes)

    def key(self, index: int) -> str:
        return self.table.keys[index]

    def require_fields(self, wanted: list[str]) -> None:
        missing = [f for f in wanted if f not in self.fields]
        if missing:
            raise DatasetError(
                f"{self.root}: dataset has no field {', '.join(map(repr, missing))} (fields: {', '.join(self.fields)})"
            )
