"""Packed token sequences as the Loader's units: their order (:class:`TokenUnits`) and what reads them
(:class:`TokenReader`), for :class:`fastio.Tokens`.

A sequence's tokens depend on the epoch (the document order is drawn per epoch), so a unit's id, as the plan
hands it to the reader, is ``epoch * sequences + sequence``; the reader answers with the sequence ids alone
(``batch["index"]``). The order, each rank's slice of every global batch and the resume arithmetic are the
packing's :class:`~fastio.order.sampler.Sampler` over the sequences; nothing here holds a packing buffer.

The shards are read in place (a local dataset) or through the node-local cache (an ``s3://`` dataset: the read
set's shard source, filled ahead in the order the coming sequences want them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError
from fastio.order.sampler import EpochPlan, Sampler, SamplerSpec
from fastio.storage.checksum import sha256_file
from fastio.tokens.megatron import MegatronIndex
from fastio.tokens.packing import BestFitPacking, ConcatPacking, Piece, cu_seqlens, position_ids

__all__ = ["TokenBatch", "TokenReader", "TokenUnits", "open_tables", "packing_of"]


def open_tables(ds: Dataset) -> list[MegatronIndex]:
    """Each shard's ``.idx`` of token dataset ``ds`` (local, or fetched and checked into the cache's metadata),
    its documents and ``.bin`` bytes checked against the manifest; with ``ds.verify`` a local ``.idx``'s sha256
    too (a fetched one always is)."""
    info = ds.manifest.tokens
    tables = []
    for shard in ds.shards:
        if ds.verify and ds.files.cache_size is None:
            _check_sha256(ds, shard.idx_path, shard.idx_sha256)
        index = MegatronIndex(shard.idx_path, info.dtype)
        if (index.documents, index.bin_bytes) != (shard.samples, shard.bytes):
            raise DatasetError(f"{ds.root}: shard {shard.name}: its .idx indexes {index.documents} documents in "
                               f"{index.bin_bytes} bytes, the manifest says {shard.samples} in {shard.bytes}")
        tables.append(index)
    return tables


def _check_sha256(ds: Dataset, path: Path, want: str) -> None:
    """DatasetError naming the shard file unless the file at ``path`` has sha256 ``want``."""
    try:
        _, digest = sha256_file(path)
    except OSError as err:
        raise DatasetError(f"{ds.root}: shard {path.name}: cannot be read: {err.strerror or err}") from None
    if digest != want:
        raise DatasetError(f"{ds.root}: shard {path.name}: sha256 mismatch ({digest[:12]}..., the manifest says "
                           f"{want[:12]}...): the file changed after it was written; run fastio verify")


def packing_of(ds: Dataset, tables: list[MegatronIndex], seq_len: int, packing: str, window: int, spec: SamplerSpec
               ) -> ConcatPacking | BestFitPacking:
    """The packing of ``ds``'s documents that ``spec``'s seed and shuffle draw (``window``: documents per block)."""
    common = {"seed": spec.seed, "shuffle": spec.shuffle, "fingerprint": ds.fingerprint, "block_docs": window}
    try:
        if packing == "concat":
            return ConcatPacking(tables, seq_len, **common)
        return BestFitPacking(tables, seq_len, **common)
    except ValueError as err:
        raise DatasetError(f"{ds.root}: {err}") from None


class _EpochUnits:
    """An :class:`~fastio.order.sampler.EpochPlan` whose ids are ``epoch * sequences + sequence``."""

    def __init__(self, plan: EpochPlan, sequences: int):
        self._plan, self._base = plan, plan.epoch * sequences
        self.epoch, self.start = plan.epoch, plan.start

    def __len__(self) -> int:
        return len(self._plan)

    def consumed_after(self, g: int) -> int:
        return self._plan.consumed_after(g)

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        ids, padded = self._plan.batch(g)
        return ids + self._base, padded

    def iter_batches(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for ids, padded in self._plan.iter_batches(first, chunk):
            yield ids + self._base, padded

    def iter_chunks(self, first: int = 0, chunk: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        for ids, padded, g in self._plan.iter_chunks(first, chunk):
            yield ids + self._base, padded, g


@dataclass
class TokenUnits:
    """The Loader's unit plan for packed sequences: ``len()`` batches per epoch on this rank, ``samples``
    sequences per epoch, ``plan(epoch, start)``."""

    packing: ConcatPacking | BestFitPacking
    sampler: Sampler

    @property
    def samples(self) -> int:
        return self.sampler.samples

    def __len__(self) -> int:
        return len(self.sampler)

    def plan(self, epoch: int, start: int = 0) -> _EpochUnits:
        return _EpochUnits(self.sampler.plan(epoch, start), self.packing.sequences)


@dataclass(frozen=True)
class TokenBatch:
    """One batch of packed sequences as numpy arrays (``arrays``: ``tokens``, ``loss_mask``, ``position_ids``,
    ``cu_seqlens``); ``indices``: the sequence ids."""

    indices: np.ndarray
    arrays: dict[str, np.ndarray]


class TokenReader:
    """Reads batches of units of :class:`TokenUnits` (``submit(ids) -> Future[TokenBatch]``) from ``ds``'s
    ``.bin`` files with ``threads`` threads; ``files``: the read set's shard source (an ``s3://`` dataset's cache),
    else None (files read in place)."""

    def __init__(self, ds: Dataset, packing: ConcatPacking | BestFitPacking, files: Any, threads: int):
        self.ds, self.packing, self._files = ds, packing, files
        self.eos_id = ds.manifest.tokens.eos_id
        self._itemsize = np.dtype(ds.manifest.tokens.dtype).itemsize
        self._dtype = np.dtype(ds.manifest.tokens.dtype).newbyteorder("<")
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastio-tokens")

    def submit(self, ids: np.ndarray) -> Future:
        return self._pool.submit(self.read_batch, np.asarray(ids, np.int64))

    def read_batch(self, ids: np.ndarray) -> TokenBatch:
        """The sequences ``ids`` name (``epoch * sequences + sequence``), padded with the end-of-document id."""
        n, width = self.packing.sequences, self.packing.seq_len + 1
        epochs, seqs = np.divmod(ids, n)
        tokens = np.full((ids.size, width), self.eos_id, np.int64)
        mask = np.zeros((ids.size, width), bool)
        for row, (e, s) in enumerate(zip(epochs.tolist(), seqs.tolist())):
            got = self._read(self.packing.pieces(e, s))
            tokens[row, :got.size], mask[row, :got.size] = got, True
        arrays = {"tokens": tokens, "loss_mask": mask, "position_ids": position_ids(tokens, self.eos_id, mask),
                  "cu_seqlens": cu_seqlens(tokens, self.eos_id, mask)}
        return TokenBatch(seqs, arrays)

    def _read(self, pieces: list[Piece]) -> np.ndarray:
        parts = []
        for p in pieces:
            fd = self._hold(p.shard)
            try:
                data = os.pread(fd, p.count * self._itemsize, p.start * self._itemsize)
            finally:
                if self._files is not None:
                    self._files.release(p.shard)
            if len(data) != p.count * self._itemsize:
                shard = self.ds.shards[p.shard]
                raise DatasetError(f"{self.ds.root}: shard {shard.name}: {len(data)} bytes at byte "
                                   f"{p.start * self._itemsize}, the .idx says {p.count * self._itemsize}: truncated")
            parts.append(np.frombuffer(data, self._dtype))
        return np.concatenate(parts).astype(np.int64)

    def _hold(self, k: int) -> int:
        if self._files is not None:
            return self._files.acquire(k)
        fd = self._fds.get(k)
        if fd is None:
            shard = self.ds.shards[k]
            if self.ds.verify:  # a cache's fills are always checked; a local shard before its first use
                _check_sha256(self.ds, shard.path, shard.sha256)
            try:
                fd = os.open(shard.path, os.O_RDONLY)
            except OSError as err:
                raise DatasetError(f"{shard.path}: {err.strerror or err}") from None
            with self._lock:
                if k in self._fds:  # another thread opened it meanwhile
                    os.close(fd)
                    return self._fds[k]
                self._fds[k] = fd
        return fd

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """Fill the cache with the shards the coming units read, in the order they first need them (a no-op
        for a local dataset)."""
        if self._files is not None:
            self._files.read_ahead(self._first_uses(batches))

    def _first_uses(self, batches: Callable[[], Iterable[np.ndarray]]) -> Iterator[int]:
        """The shards the coming sequences start in, in the order they first want them (one vectorised lookup
        per chunk of ids: this runs in a read-ahead thread beside the training loop)."""
        seen: set[int] = set()
        for ids in batches():
            epochs, seqs = np.divmod(np.asarray(ids, np.int64), self.packing.sequences)
            shards = np.empty(seqs.size, np.int64)
            for e in np.unique(epochs).tolist():
                at = epochs == e
                shards[at] = self.packing.shards_of(e, seqs[at])
            for k in shards.tolist():
                if k not in seen:
                    seen.add(k)
                    yield k
            if len(seen) == len(self.ds.shards):
                return

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
