"""Packed token sequences as the Loader's units: their order (:class:`TokenUnits`) and what reads them
(:class:`TokenReader`), for :class:`fastio.Tokens`.

A sequence's tokens depend on the epoch (the document order is drawn per epoch), so a unit's id, as the plan
hands it to the reader, is ``epoch * sequences + sequence``; the reader answers with the sequence ids alone
(``batch["index"]``). The order, each rank's slice of every global batch and the resume arithmetic are the
packing's :class:`~fastio.order.sampler.Sampler` over the sequences; nothing here holds a packing buffer.

A :class:`~fastio.Mixture` of token datasets (:func:`mixture_units`) mixes packed sequences: each source's size
is its number of sequences, and the mixture's order (:class:`TokenMixSampler`, the mixture's
:class:`~fastio.order.mixorder.MixSampler`) hands out ``source_epoch * total + base[s] + sequence`` (``total``: all
sources' sequences; ``base[s] + sequence`` is the mixture id, ``source_epoch`` the source's own epoch, which
draws its document order). A single dataset is the one-source case (``base`` 0, ``total`` its sequences).

The shards are read in place (a local dataset) or through the node-local cache (an ``s3://`` dataset: the read
set's shard source, filled ahead in the order the coming sequences want them). A read is numpy work on whole
batches: the batches submitted while the reader was busy are read together (:meth:`TokenReader.read_batches`),
their pieces found at once (:meth:`~fastio.tokens.packing.ConcatPacking.spans`) and gathered with one fancy index
per shard from its ``.bin`` mapped read-only (a local shard's mapping kept for the reader's life, its size checked
against the manifest's when mapped and against the offsets read on every read; a cached shard's mapped while the
cache holds it for the read, its size checked each time). A file cut short during a read still kills the process
with SIGBUS (docs/tokens.md).

A chat dataset (``tokens.chat``: conversations with a loss mask per shard, :mod:`fastio.formats.token_mask`) packs
whole conversations: ``packing="best-fit"`` only, and a ``seq_len`` its longest conversation fits (refused
otherwise, never cut). Its tokens' mask bits are gathered with the tokens (``loss_mask``: the stored bit and not
padding, and not a conversation's first token: packed after another conversation, its target slot would be
predicted from that one's last token, a target transformers never trains, its labels shifting within one
conversation; a plain source of a mixture: every token but padding), and where a reader has a chat source a batch's
document boundaries are its pieces' starts (each piece one whole conversation or plain document), not the
end-of-document ids (a template may write that token inside a conversation). Every batch also has
``segment_ids`` (int32 like ``tokens``: 1, 2, ... for each row's documents, 0 on padding, Grain's convention) and
``max_seqlen`` (the longest segment ``cu_seqlens`` holds).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastio.checks import two_differing
from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError, os_error_text
from fastio.formats.megatron import MegatronIndex
from fastio.formats.token_mask import MaskFile
from fastio.order.mixorder import MixSampler, source_seed
from fastio.order.sampler import EpochPlan, Sampler, SamplerSpec
from fastio.storage.checksum import sha256_file
from fastio.tokens.packing import (
    BestFitPacking,
    ConcatPacking,
    Spans,
    document_starts,
    piece_bounds,
    piece_starts,
    positions_from,
    ramp_to,
    segment_ids,
)
from fastio.tokens.starts import read_starts
from fastio.words import count

__all__ = ["GROUP", "ORDER_CHUNK", "TokenBatch", "TokenMixSampler", "TokenReader", "TokenSource", "TokenUnits",
           "check_chat_packing", "mixture_units", "open_tables", "packing_of", "source_packings"]

GROUP = 4
"""Most batches a reader thread reads together (those submitted while it was busy; more costs fresh memory, whose
page faults cost more than the calls saved, here)."""
_INT64_IDS = 2**63
"""Unit ids (``epoch * sequences + sequence``) are int64: below this."""
ORDER_CHUNK = 256
"""Batches of a plan looked up at once for the feeder (the order's fixed cost per lookup is most of its cost: 256
batches of 8 cost about 2 us a batch where 32 cost 33)."""


def open_tables(ds: Dataset) -> list[MegatronIndex]:
    """Each shard's ``.idx`` of token dataset ``ds`` (local, or fetched and checked into the cache's metadata),
    its documents and ``.bin`` bytes checked against the manifest (a chat dataset's shard refused where the
    manifest lists no loss mask checksum for it); with ``ds.verify`` a local ``.idx``'s sha256
    too (a fetched one always is). Where the manifest records a document-starts table (:mod:`fastio.tokens.starts`),
    each index takes its block edges from it (checked: its xxh3-128, counts, first and last entries)."""
    info = ds.manifest.tokens
    tables = []
    for shard in ds.shards:
        if info.chat is not None and shard.mask_sha256 is None:
            raise DatasetError(f"{ds.root}: shard {shard.name}: the manifest lists no loss mask ({shard.mask_name}) for "
                               "this chat shard (a damaged manifest); run fastio verify")
        if ds.verify and ds.files.cache_size is None:
            _check_sha256(ds, shard.idx_path, shard.idx_sha256)
        index = MegatronIndex(shard.idx_path, info.dtype, one_per_document=info.one_sequence_per_document)
        if (index.documents, index.bin_bytes) != (shard.samples, shard.bytes):
            raise DatasetError(f"{ds.root}: shard {shard.name}: its .idx indexes {count(index.documents, 'document')} in "
                               f"{count(index.bin_bytes, 'byte')}, the manifest says {shard.samples} in {shard.bytes}")
        tables.append(index)
    if info.starts is not None:
        every, values = read_starts(ds.files.index_path(info.starts, "document starts table"), info.starts,
                                    [t.documents for t in tables])
        for index, own in zip(tables, values):
            index.use_starts(every, own)
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
    """The packing of ``ds``'s documents that ``spec``'s seed and shuffle draw (``window``: documents per block); a
    chat dataset's refused unless whole conversations fit (:func:`check_chat_packing`, then :func:`_check_longest`:
    none longer than its manifest says)."""
    check_chat_packing(ds, seq_len, packing)
    common = {"seed": spec.seed, "shuffle": spec.shuffle, "fingerprint": ds.fingerprint, "block_docs": window}
    try:
        if packing == "concat":
            return ConcatPacking(tables, seq_len, **common)
        packed = BestFitPacking(tables, seq_len, **common)
    except ValueError as err:
        raise DatasetError(f"{ds.root}: {err}") from None
    _check_longest(ds, packed)
    return packed


def _check_longest(ds: Dataset, packed: BestFitPacking) -> None:
    """DatasetError naming the shard where a chat dataset's conversation is longer than its manifest's
    ``tokens.chat.longest`` (a damaged or hand-edited manifest: :func:`check_chat_packing` trusts it, and best-fit
    would cut that conversation); the lengths are those the packing read to count its sequences."""
    chat = ds.manifest.tokens.chat
    if chat is None:
        return
    for shard, longest in zip(ds.shards, packed.longest.tolist()):
        if longest > chat.longest:
            raise DatasetError(f"{ds.root}: shard {shard.name}: holds a conversation of {count(longest, 'token')}, "
                               f"more than the manifest's tokens.chat.longest ({chat.longest}): a damaged or "
                               "hand-edited manifest (a seq_len it admits would cut that conversation); restore the "
                               "manifest or convert again (fastio verify names every such shard)")


def check_chat_packing(ds: Dataset, seq_len: int, packing: str) -> None:
    """DatasetError naming ``ds`` when it is a chat dataset and ``packing``/``seq_len`` would cut a conversation."""
    chat = ds.manifest.tokens.chat
    if chat is None:
        return
    if packing != "best-fit":
        raise DatasetError(f"{ds.root}: a chat dataset (conversations with a loss mask) is packed whole: "
                           f"fastio.Tokens(packing='best-fit'), not {packing!r}")
    if chat.longest > seq_len + 1:
        raise DatasetError(f"{ds.root}: its longest conversation has {count(chat.longest, 'token')}, more than "
                           f"seq_len + 1 = {seq_len + 1}: a conversation is never cut; raise seq_len to at least "
                           f"{chat.longest - 1}, or convert again with --max-tokens {seq_len + 1} (--overlong drop "
                           f"or --overlong truncate; in Python TokenConvertConfig(max_tokens={seq_len + 1}, "
                           "overlong='drop') or overlong='truncate')")


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

    def iter_batches(self, first: int = 0, chunk: int = ORDER_CHUNK) -> Iterator[tuple[np.ndarray, np.ndarray]]:
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

    @classmethod
    def of(cls, packing: ConcatPacking | BestFitPacking, spec: SamplerSpec, world_size: int, rank: int) -> TokenUnits:
        """The plan of ``packing``'s sequences on rank ``rank`` of ``world_size`` (``spec``: the batch size, drop_last
        and remainder)."""
        return cls(packing, packing.sampler(batch_size=spec.batch_size, world_size=world_size, rank=rank,
                                            drop_last=spec.drop_last, remainder=spec.remainder))

    @property
    def samples(self) -> int:
        return self.sampler.samples

    def __len__(self) -> int:
        return len(self.sampler)

    def plan(self, epoch: int, start: int = 0) -> _EpochUnits:
        """The plan of ``epoch`` from global position ``start``; ValueError naming the epoch where its unit ids
        (``epoch * sequences + sequence``) would leave int64 (a hand-edited state, a ``set_epoch`` far off)."""
        sequences = self.packing.sequences
        if (epoch + 1) * sequences > _INT64_IDS:
            raise ValueError(f"epoch {epoch} is past the sequence ids' reach (epoch * {sequences} + sequence must fit "
                             f"int64: the last epoch is {_INT64_IDS // sequences - 1})")
        return _EpochUnits(self.sampler.plan(epoch, start), sequences)


@dataclass(frozen=True)
class TokenMixSampler(MixSampler):
    """A mixture's order over packed sequences: the :class:`~fastio.order.mixorder.MixSampler` of sources sized in
    sequences, whose ids carry each sequence's source epoch (``source_epoch * total + base[s] + sequence``)."""

    @property
    def total(self) -> int:
        """All sources' sequences: the ids' period."""
        return sum(self.sizes)

    def check_epoch(self, epoch: int) -> None:
        """The mixture's limit (:meth:`MixSampler.check_epoch`), then ValueError naming ``epoch`` and the source
        where a source's own epoch by the end of it puts the ids past int64 (a source drawn more often than its
        size's share runs through its own epochs faster than the mixture: its ids wrapped, naming other
        sequences)."""
        super().check_epoch(epoch)
        end = min((epoch + 1) * self.schedule.samples_per_epoch, _INT64_IDS - 1)
        for name, got, size in zip(self.schedule.names, self.schedule.delivered(end).tolist(), self.sizes):
            last = (got - 1) // size if got else 0
            if (last + 1) * self.total > _INT64_IDS:
                raise ValueError(f"epoch {epoch} is past the sequence ids' reach: source {name!r} is in its own epoch "
                                 f"{last} by its end, and source epoch * {self.total} + sequence must fit int64")

    def unit_ids(self, src: np.ndarray, epochs: np.ndarray, local: np.ndarray) -> np.ndarray:
        return np.asarray(epochs, np.int64) * self.total + self.base_array[src] + local


def mixture_units(read_set: Any, seq_len: int, packing: str, window: int, spec: SamplerSpec, world_size: int,
                  rank: int, pack: Callable[[Dataset, SamplerSpec], BestFitPacking | None] | None = None
                  ) -> tuple[TokenMixSampler, list[ConcatPacking | BestFitPacking]]:
    """A token mixture's unit plan and each source's packing (:func:`source_packings`, ``pack`` there): the read
    set's mixture sized in sequences (:meth:`fastio.Mixture.in_units`: weights, a schedule's positions and
    ``samples_per_epoch`` count sequences), its order over them."""
    packings = source_packings(read_set.mixture, seq_len, packing, window, spec, pack)
    read_set.in_units([p.sequences for p in packings])
    sampler = TokenMixSampler.make(spec, read_set.mixture.schedule(spec.seed), [(p.sequences,) for p in packings],
                                   world_size, rank)
    return sampler, packings


def source_packings(mixture: Any, seq_len: int, packing: str, window: int, spec: SamplerSpec,
                    pack: Callable[[Dataset, SamplerSpec], BestFitPacking | None] | None = None
                    ) -> list[ConcatPacking | BestFitPacking]:
    """Each source of ``mixture`` packed on its own, with its own seed (drawn from ``spec``'s and its name): by
    ``pack(dataset, its spec)`` where that gives a packing (an image-text source's), else as a token dataset;
    DatasetError naming two token sources that end documents with different ids, or the source a packing
    refuses."""
    differing = two_differing({name: ds.manifest.tokens.eos_id for name, ds in zip(mixture.names, mixture.datasets)
                               if ds.manifest.tokens is not None})
    if differing is not None:
        (a, x), (b, y) = differing
        raise DatasetError(f"{mixture.root}: sources {a!r} (end-of-document id {x}) and {b!r} ({y}) end documents "
                           "with different ids; a batch's position_ids and cu_seqlens need one: mix token datasets "
                           "of one tokenizer")
    packings = []
    for name, ds in zip(mixture.names, mixture.datasets):
        own = SamplerSpec(seed=source_seed(spec.seed, name), shuffle=spec.shuffle)
        try:
            packed = None if pack is None else pack(ds, own)
            packings.append(packed if packed is not None else packing_of(ds, open_tables(ds), seq_len, packing,
                                                                         window, own))
        except DatasetError as err:
            raise DatasetError(f"mixture source {name!r}: {err}") from None
    return packings


def _settle(group: list[tuple[np.ndarray, Future]], read: Callable[[list[np.ndarray]], list[TokenBatch]]) -> None:
    """Each future of ``group`` with its batch, read together; where that fails, each batch read alone, so
    that each future gets its own batch or its own error."""
    try:
        batches = read([ids for ids, _ in group]) if len(group) > 1 else None
    except Exception:
        batches = None
    if batches is not None:
        for (_, future), batch in zip(group, batches):
            future.set_result(batch)
        return
    for ids, future in group:
        try:
            future.set_result(read([ids])[0])
        except BaseException as err:
            future.set_exception(err)


def _cu_per_batch(starts: np.ndarray, ends: np.ndarray, width: int) -> list[np.ndarray]:
    """Each batch's ``cu_seqlens`` (int32): the document ``starts`` (sorted indices into the flattened rows of
    ``width`` tokens of batches ending at rows ``ends``) within that batch's flattened inputs (each row but its
    last token), then their end."""
    row, col = np.divmod(starts, width)
    inputs = col < width - 1
    row, col = row[inputs], col[inputs]
    cut = np.searchsorted(row, ends).tolist()  # where each batch's starts end
    first = np.concatenate([[0], ends[:-1]])
    if len(cut) > 1:
        row -= np.repeat(first, np.diff(np.concatenate([[0], cut])))
    local = (row * (width - 1) + col).astype(np.int32)
    stops = ((ends - first) * (width - 1)).astype(np.int32)
    return [np.concatenate([local[lo:hi], stops[j:j + 1]]) for j, (lo, hi) in enumerate(zip([0] + cut[:-1], cut))]


def _groups(src: np.ndarray, epochs: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (source, epoch) pairs of a batch's units, in order of first appearance."""
    pairs = list(zip(src.tolist(), epochs.tolist()))
    return list(dict.fromkeys(pairs))


def _mapped_tokens(fd: int, dtype: np.dtype) -> np.ndarray:
    """The ``.bin`` open at ``fd`` mapped read-only as tokens of ``dtype`` (the mapping lives as long as the array;
    an empty file maps to no tokens), advised random: a sequence is a few pages anywhere in the file, and the
    kernel's read-around of 32 pages at each first touch cost 5x the batch's CPU on a corpus the page cache does
    not hold (10^7 documents: 20 -> 4 ms a batch); pages already cached are mapped around the touched one anyway."""
    size = os.fstat(fd).st_size // dtype.itemsize * dtype.itemsize
    if not size:
        return np.zeros(0, dtype)
    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype)


@dataclass(frozen=True)
class TokenBatch:
    """One batch of packed sequences as numpy arrays (``arrays``: ``tokens``, ``loss_mask``, ``position_ids``,
    ``cu_seqlens``, ``segment_ids``, ``max_seqlen`` (0-d)); ``indices``: the sequence ids."""

    indices: np.ndarray
    arrays: dict[str, np.ndarray]


@dataclass(frozen=True)
class TokenSource:
    """One token dataset as :class:`TokenReader` reads it: the dataset, its packing, its shard source (an
    ``s3://`` dataset's cache, else None: files read in place)."""

    ds: Dataset
    packing: ConcatPacking | BestFitPacking
    files: Any


class TokenReader:
    """Reads batches of units (``submit(ids) -> Future[TokenBatch]``) from the ``.bin`` files of ``sources`` (one
    dataset, or a mixture's token datasets in the mixture's order; all of one end-of-document id), reading the
    batches submitted meanwhile together (:meth:`submit`): with up to ``threads`` threads where a source is read
    through the cache (a read may wait for a fill), else with one (a local read is numpy work under the
    interpreter lock: a second thread only contends for it). A unit id is ``epoch * total + base[s] +
    sequence`` (``total``: all sources' sequences, ``base[s]``: source ``s``'s first; one dataset: ``epoch *
    sequences + sequence``); the batch's ``indices`` are ``base[s] + sequence``."""

    def __init__(self, sources: list[TokenSource], threads: int):
        self.sources = sources
        self.eos_id = sources[0].ds.manifest.tokens.eos_id
        sizes = [src.packing.sequences for src in sources]
        self.total = sum(sizes)
        self.base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._fds: dict[tuple[int, int], int] = {}
        self._maps: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastio-tokens")
        cached = any(src.files is not None for src in sources)
        self._threads, self._draining = (threads if cached else 1), 0  # local reads hold the interpreter lock
        self._pending: list[tuple[np.ndarray, Future]] = []
        self._chat = [src.ds.manifest.tokens.chat is not None for src in sources]
        self._masks: dict[tuple[int, int], MaskFile] = {}

    @property
    def width(self) -> int:
        return self.sources[0].packing.seq_len + 1

    def submit(self, ids: np.ndarray) -> Future:
        """Start reading a batch; the future's result is a :class:`TokenBatch`. Batches submitted while the
        threads are busy are read together, up to :data:`GROUP` at a time (:meth:`read_batches`: the fixed cost
        of a read, under the interpreter lock, shared)."""
        future: Future = Future()
        with self._lock:
            self._pending.append((np.asarray(ids, np.int64), future))
            start = self._draining < self._threads
            self._draining += start
        if start:
            self._pool.submit(self._drain)
        return future

    def _drain(self) -> None:
        """Read the pending batches, a group at a time, until none is left."""
        while True:
            with self._lock:
                if not self._pending:
                    self._draining -= 1
                    return
                group, self._pending = self._pending[:GROUP], self._pending[GROUP:]
            group = [(ids, f) for ids, f in group if f.set_running_or_notify_cancel()]
            if group:
                _settle(group, self.read_batches)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unit ids -> ``(source, epoch, sequence)``."""
        epochs, local = np.divmod(np.asarray(ids, np.int64), self.total)
        src = np.searchsorted(self.base, local, "right") - 1
        return src, epochs, local - self.base[src]

    def read_batch(self, ids: np.ndarray) -> TokenBatch:
        """The sequences ``ids`` name (see :meth:`read_batches`)."""
        return self.read_batches([np.asarray(ids, np.int64)])[0]

    def read_batches(self, batches: list[np.ndarray]) -> list[TokenBatch]:
        """The sequences each of ``batches`` names, padded with the end-of-document id, read together: each
        source's (and epoch's) pieces found at once (:meth:`~fastio.tokens.packing.ConcatPacking.spans`), their
        tokens gathered with one fancy index per shard from its mapped ``.bin``."""
        ids = np.concatenate(batches)
        src, epochs, seqs = self.split(ids)
        size, chat = ids.size * self.width, any(self._chat)
        flat, lengths, pieces = None, np.zeros(ids.size, np.int64), []
        bits = np.ones(size, bool) if chat else None  # the stored mask bits (a plain source's: all set)
        for s, e in _groups(src, epochs):
            rows = np.flatnonzero((src == s) & (epochs == e))
            spans = self.sources[s].packing.spans(e, seqs[rows])
            flat = self._gather(s, rows[spans.row], spans, flat, size, bits)
            lengths[rows] = np.bincount(spans.row, spans.count, rows.size).astype(np.int64)
            if chat:
                pieces.append(piece_starts(rows[spans.row], spans.count, self.width))
        tokens = flat.reshape(ids.size, self.width)
        full = bool((lengths == self.width).all())  # concat: no padding, no mask to apply
        mask = np.ones(tokens.shape, bool) if full else np.arange(self.width) < lengths[:, None]
        starts = piece_bounds(pieces, lengths, self.width) if chat else \
            document_starts(tokens, self.eos_id, None if full else mask)
        pos = positions_from(starts, tokens.size).reshape(tokens.shape)
        segments = segment_ids(starts, mask, full)
        loss = mask if bits is None else mask & bits.reshape(tokens.shape)
        indices, ends = self.base[src] + seqs, np.cumsum([b.size for b in batches])
        cus = _cu_per_batch(starts, ends, self.width)
        out, r0 = [], 0
        for r1, cu in zip(ends.tolist(), cus):
            arrays = {"tokens": tokens[r0:r1], "loss_mask": loss[r0:r1], "position_ids": pos[r0:r1], "cu_seqlens": cu,
                      "segment_ids": segments[r0:r1], "max_seqlen": np.asarray(int(np.diff(cu).max()))}
            out.append(TokenBatch(indices[r0:r1], arrays))
            r0 = r1
        return out

    def _gather(self, s: int, rows: np.ndarray, spans: Spans, flat: np.ndarray | None, size: int,
                bits: np.ndarray | None = None) -> np.ndarray:
        """``flat`` (the batch's rows of ``width`` tokens end to end, ``size`` tokens; None: not made yet, filled
        with the end-of-document id where needed) with the pieces ``spans`` of source ``s`` written into rows
        ``rows`` (each row's pieces one after the other from its start); a chat source's mask bits into ``bits``
        at the same places."""
        count, start = spans.count, spans.start
        ends = np.cumsum(count)
        before = ends - count  # the pieces' offsets in their concatenation
        k = ramp_to(int(ends[-1]))
        at = np.repeat(start - before, count)
        at += k  # token offset in its shard of each token (in place: fresh memory costs page faults)
        one = bool((spans.shard == spans.shard[0]).all())
        stops = start + count
        masked = bits is not None and self._chat[s]
        if one and flat is None and at.size == size:  # the pieces fill every row in order (concat): no scatter
            if masked:
                bits[:] = self._mask(s, int(spans.shard[0])).bits(at)
                bits[piece_starts(rows, count, self.width)] = False  # a conversation's first token: no target
            return self._tokens(s, int(spans.shard[0]), at, int(stops.max())).astype(np.int64)
        if flat is None:
            flat = np.full(size, self.eos_id, np.int64)
        heads = piece_starts(rows, count, self.width)
        to = np.repeat(heads - before, count)
        to += k  # its place in flat
        each = None if one else np.repeat(spans.shard, count)
        for shard in np.unique(spans.shard).tolist():
            here = slice(None) if each is None else each == shard
            end = int(stops.max() if one else stops[spans.shard == shard].max())
            flat[to[here]] = self._tokens(s, shard, at[here], end)
            if masked:
                bits[to[here]] = self._mask(s, shard).bits(at[here])
        if masked:
            bits[heads] = False
        return flat

    def _mask(self, s: int, k: int) -> MaskFile:
        """The loss mask of shard ``k`` of chat source ``s``, mapped once (a remote dataset's fetched into the
        cache's metadata and checked; a local one's sha256 checked before its first use with ``verify``)."""
        got = self._masks.get((s, k))
        if got is None:
            ds = self.sources[s].ds
            shard = ds.shards[k]
            path = ds.files.mask_path(shard)
            if ds.verify and ds.files.cache_size is None:
                _check_sha256(ds, path, shard.mask_sha256)
            got = MaskFile(path, shard.tokens)
            with self._lock:
                got = self._masks.setdefault((s, k), got)
        return got

    def _tokens(self, s: int, k: int, at: np.ndarray, end: int) -> np.ndarray:
        """The tokens at offsets ``at`` (all below ``end``) of shard ``k`` of source ``s``: its ``.bin`` mapped for
        the reader's life (a local dataset), or mapped while the cache holds it (``s3://``: acquired, read,
        released)."""
        source = self.sources[s]
        if source.files is None:
            fd, tokens = self._mapped(s, k)
            return np.take(self._checked(s, k, fd, tokens, end), at)
        fd = source.files.acquire(k)
        try:  # the mapping (and its copy of fd) goes with the array, before the shard is released
            self._check_size(s, k, fd)
            return np.take(self._checked(s, k, fd, _mapped_tokens(fd, self._dtype(s)), end), at)
        finally:
            source.files.release(k)

    def _dtype(self, s: int) -> np.dtype:
        return np.dtype(self.sources[s].ds.manifest.tokens.dtype).newbyteorder("<")

    def _check_size(self, s: int, k: int, fd: int) -> None:
        """DatasetError naming shard ``k`` of source ``s`` and both sizes unless its open ``.bin`` (``fd``) has the
        manifest's size: checked when it is mapped, so that a file cut short (or grown, or replaced in place) before
        that is refused, not read (a read past a mapped file's end kills the process with SIGBUS)."""
        source = self.sources[s]
        shard = source.ds.shards[k]
        size = os.fstat(fd).st_size
        if size != shard.bytes:
            raise DatasetError(f"{source.ds.root}: shard {shard.name}: {count(size, 'byte')}, the manifest says "
                               f"{shard.bytes}: {'truncated' if size < shard.bytes else 'grown'} or rewritten since it "
                               "was written (replace a shard by a rename, never in place); run fastio verify")

    def _checked(self, s: int, k: int, fd: int, tokens: np.ndarray, end: int) -> np.ndarray:
        """``tokens`` (shard ``k``'s mapping), once the file still holds the offsets below ``end`` (a file cut
        short under a mapping would kill the process on reading): DatasetError naming the shard if not. A file
        cut short during the gather itself, after this check, still kills the process with SIGBUS (a shard is
        replaced by a rename, which the open mapping does not see, never rewritten in place)."""
        source = self.sources[s]
        shard = source.ds.shards[k]
        itemsize = tokens.dtype.itemsize
        need = end * itemsize
        size = os.fstat(fd).st_size
        if need > min(size, tokens.size * itemsize):
            raise DatasetError(f"{source.ds.root}: shard {shard.name}: {count(size, 'byte')}, the .idx says {shard.bytes} "
                               f"(a sequence reads up to byte {need}): truncated")
        return tokens

    def _mapped(self, s: int, k: int) -> tuple[int, np.ndarray]:
        """Shard ``k`` of local source ``s``: its open ``.bin`` and its tokens, mapped (once, on first use)."""
        got = self._maps.get((s, k))
        if got is not None:
            return got
        fd = self._hold(s, k)
        self._check_size(s, k, fd)
        with self._lock:
            if (s, k) not in self._maps:
                try:
                    self._maps[(s, k)] = (fd, _mapped_tokens(fd, self._dtype(s)))
                except OSError as err:
                    raise DatasetError(f"{self.sources[s].ds.shards[k].path}: cannot be mapped "
                                       f"({os_error_text(err)})") from None
            return self._maps[(s, k)]

    def _hold(self, s: int, k: int) -> int:
        """The open ``.bin`` of shard ``k`` of local source ``s`` (its sha256 checked before its first use with
        ``verify``)."""
        fd = self._fds.get((s, k))
        if fd is None:
            ds = self.sources[s].ds
            shard = ds.shards[k]
            if ds.verify:  # a cache's fills are always checked; a local shard before its first use
                _check_sha256(ds, shard.path, shard.sha256)
            try:
                fd = os.open(shard.path, os.O_RDONLY)
            except OSError as err:
                raise DatasetError(f"{shard.path}: {os_error_text(err)}") from None
            with self._lock:
                if (s, k) in self._fds:  # another thread opened it meanwhile
                    os.close(fd)
                    return self._fds[(s, k)]
                self._fds[(s, k)] = fd
        return fd

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """Fill each cached source's shards in the order the coming units read them first (a no-op for local
        datasets)."""
        for s, source in enumerate(self.sources):
            if source.files is not None:
                source.files.read_ahead(self._first_uses(s, batches))

    def _first_uses(self, s: int, batches: Callable[[], Iterable[np.ndarray]]) -> Iterator[int]:
        """The shards of source ``s`` the coming sequences start in, in the order they first want them (one
        vectorised lookup per chunk of ids: this runs in a read-ahead thread beside the training loop)."""
        seen: set[int] = set()
        source = self.sources[s]
        for ids in batches():
            src, epochs, seqs = self.split(ids)
            epochs, seqs = epochs[src == s], seqs[src == s]
            shards = np.empty(seqs.size, np.int64)
            for e in np.unique(epochs).tolist():
                at = epochs == e
                shards[at] = source.packing.shards_of(e, seqs[at])
            for k in shards.tolist():
                if k not in seen:
                    seen.add(k)
                    yield k
            if len(seen) == len(source.ds.shards):
                return

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for _, future in pending:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._maps = {}  # the mappings go with their arrays
        masks, self._masks = self._masks, {}
        for m in masks.values():
            m.close()
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
