"""The order of packed token sequences, ``packing="concat"`` (:class:`ConcatPacking`) and ``packing="best-fit"``
(:class:`BestFitPacking`): a pure function of (seed, epoch, fingerprint, shuffle, seq_len, block_docs) and the
documents' lengths. Nothing here reads a byte, opens a file or makes a tensor.

An epoch's documents, in an order drawn from (seed, epoch), are concatenated (each already ends with its
end-of-document token) into one stream of T tokens, cut into ``(T - 1) // seq_len`` sequences of ``seq_len + 1``
tokens with one token of overlap, as Megatron does: sequence ``s`` is stream tokens ``[s * seq_len,
(s + 1) * seq_len]``, so its inputs ``tokens[:-1]`` cover every stream token once per epoch but the tail
(fewer than ``seq_len + 1`` tokens).

The document order is lazy: documents are grouped in blocks of at most ``block_docs`` consecutive documents of a
shard; the blocks are shuffled with the sampler's keyed Feistel permutation (:mod:`fastio.order.sampler`), and the
documents within each block too. The token offset where each shuffled block starts (one prefix sum over the
blocks: O(blocks) memory per epoch) locates a stream position's block; a prefix sum over that block's shuffled
document lengths (O(block_docs), a few blocks kept) locates the document. So any sequence is found without a
sample index, whatever the corpus size.

The order of the sequences themselves, each rank's slice and the resume arithmetic are the sampler's:
:meth:`ConcatPacking.sampler` is a :class:`~fastio.order.sampler.Sampler` over the epoch's sequences (one "shard" of
``sequences`` units), so a plan started at ``consumed`` continues bitwise at the same world size and delivers
each remaining sequence exactly once at another.

``pieces(epoch, s)`` gives one sequence's token ranges (the reference); ``spans(epoch, seqs)`` gives a whole
batch's at once as arrays (:class:`Spans`, what the reader uses; the tests hold the two equal): concat searches a
table of the epoch's stream (every document's shard offset and stream position, 24 bytes a document, built once per
epoch up to :data:`STREAM_TABLE_DOCS` documents; above, one of the blocks the batch touches), best-fit one of
every block's packed sequences as arrays (made once: the packing is the same every epoch; above that size, the
touched blocks'). :func:`boundaries` gives ``position_ids`` and ``cu_seqlens`` from one
search for the documents' starts.

At scale (above :data:`STREAM_TABLE_DOCS` documents) a batch's sequences hit about nine random blocks; a block's
table (its documents' order: the Feistel rounds looked up in tables; their offsets: one lookup of the block's
contiguous range in the ``.idx``; prefix sums, int32 within the block) costs about 0.25 ms to build and is kept
in a cache of :data:`BLOCK_CACHE_BYTES` (concat: 32 KB a block of 4,096 documents; best-fit: the block's packed
sequences as arrays, packed on its first touch, about 14 ms), so an epoch of up to about 8 million documents'
blocks stays built after its first touches (best-fit: about 3 million). Measured on 2 busy cores, batches of
8 x 2,048 tokens, concat: at 10^6 documents :meth:`ConcatPacking.spans` costs 0.45 ms a batch (4 ms with the
16-block cache before: 5% hits), at 10^7 0.7 ms (84% hits; 4.1 ms before); best-fit at 10^6 0.45 ms (219 ms
before: every block repacked).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fastio.order.feistel import GOLDEN, domain_bits, permute, round_keys
from fastio.order.sampler import Sampler, SamplerSpec
from fastio.words import count

__all__ = ["FITS", "PACKING_ALGORITHM", "PACKINGS", "PACKING_VERSION", "BestFitPacking", "ConcatPacking",
           "DocumentTable", "Piece", "Spans", "boundaries", "cu_from", "cu_seqlens", "document_starts", "piece_bounds",
           "piece_starts", "position_ids", "positions_from", "ramp", "ramp_to", "segment_ids"]

PACKING_ALGORITHM = "concat-blocks-v1"
"""Names the document order :class:`ConcatPacking` computes (part of its fingerprint)."""
PACKINGS = ("concat", "best-fit")
PACKING_VERSION = 2
"""The version of the rules by which the packings here make sequences (which documents, split where, in which
sequence): the Tokens and ImageText loader states record it (``packing_version``), and a state of another version
is refused (its position would name other sequences). Bump it with any change to the sequences a packing makes.

1. The packings of ``fastio.Tokens`` (concat, best-fit) and ImageText's best-fit as first written (183718b);
   with a budget (ImageText's ``max_images``) a sequence whose images were spent took no more samples.
2. a242d84: such a sequence still takes image-less samples while it has room; nothing else changed.

States saved before the field (none records it) are taken as version 2, today's: every Tokens state (its
packings make the same sequences from c651ae8, the first Tokens state, to version 2: both packings compared
over two epochs), every ImageText state without ``max_images`` (the change needs a budget), and every ImageText
state with it since a242d84; only those saved in ImageText's first hour (183718b..a242d84) with ``max_images``
were version 1, and cannot be told from the rest."""
STREAM_TABLE_DOCS = 1 << 19
"""Up to this many documents, :meth:`ConcatPacking.spans` searches a table of the whole epoch's stream (24 bytes a
document, built once per epoch, two epochs kept) and :meth:`BestFitPacking.spans` one of every block's packed
sequences (made once); above it, tables of the blocks a batch touches."""
BLOCK_CACHE_BYTES = 64 << 20
"""Memory the per-block tables of a packing above :data:`STREAM_TABLE_DOCS` are kept in, at most (least recently
used dropped first): a concat block of 4,096 documents takes 32 KB (its documents' offsets and prefix sums, int32
within the block), so the blocks of an epoch of 8 million documents stay built after their first touch; a
best-fit block about 80 KB (the pieces of its sequences), 3 million documents."""
_LENGTH_RUN = 1 << 21
"""Documents whose lengths :class:`BestFitPacking` reads at once (whole blocks) to count its sequences."""
_LOCKSTEP_BLOCKS: int | None = None
"""None: first-fit's counts place each block's ``j``-th piece of a run's blocks at once in numpy where that should
take less time than block by block (:func:`_lockstep_pays`); a number: from that many blocks in a run (tests)."""
_PIECE_BYTES = 160  # a Piece of a cached best-fit block, counted as this many bytes (object, ints, list slot)
_SHUFFLES = ("global", "none")


class DocumentTable(Protocol):
    """What the packing needs of a shard: its document count, token count, and where documents start
    (:class:`fastio.formats.megatron.MegatronIndex` is one); a best-fit packing with a ``budget`` also asks each
    document's weight, ``weights(docs)`` (:class:`fastio.tokens.image_text.SampleCosts`: a sample's images)."""

    documents: int

    @property
    def tokens(self) -> int: ...

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """Token offset of each document in ``docs`` within the shard; ``documents`` gives the shard's end."""


@dataclass(frozen=True)
class Piece:
    """``count`` tokens of shard ``shard`` from its token offset ``start``: part of one sequence."""

    shard: int
    start: int
    count: int


@dataclass(frozen=True)
class Spans:
    """The pieces of several sequences as arrays, in order (each sequence's pieces together, in the order of the
    sequences asked for, each sequence's in its own order): piece ``j`` is ``count[j]`` tokens of shard
    ``shard[j]`` from its token offset ``start[j]``, part of the ``row[j]``-th sequence asked for."""

    row: np.ndarray
    shard: np.ndarray
    start: np.ndarray
    count: np.ndarray


def ramp(counts: np.ndarray) -> np.ndarray:
    """``0..counts[i] - 1`` for each ``i``, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


class _BlockPacking:
    """What both packings share: arguments, documents in blocks of ``block_docs`` of a shard, the sampler over
    the sequences, the blocks' order per epoch and a small cache of per-block tables."""

    kind = ""

    def __init__(self, tables: Sequence[DocumentTable], seq_len: int, *, seed: int, shuffle: str, fingerprint: str,
                 block_docs: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if isinstance(block_docs, bool) or not isinstance(block_docs, int) or block_docs < 1:
            raise ValueError(f"block_docs must be a positive integer, got {block_docs!r}")
        if shuffle not in _SHUFFLES:
            raise ValueError(f"shuffle for packed tokens must be one of {', '.join(_SHUFFLES)}, got {shuffle!r}")
        self.spec = SamplerSpec(seed=seed, shuffle=shuffle)
        self.seq_len, self.block_docs, self.tables = seq_len, block_docs, list(tables)
        self._blocks(block_docs)
        self.total_tokens = int(self._blk_tokens.sum())
        self.fingerprint = hashlib.sha256(
            f"{PACKING_ALGORITHM}:{self.kind}:{fingerprint}:{seq_len}:{block_docs}".encode()).hexdigest()[:16]
        """Identifies the sequences (corpus, packing, seq_len, blocks, algorithm): the sampler's fingerprint."""
        self.sequences = 0
        """Sequences in every epoch."""
        self._lock = threading.Lock()
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cache: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key: (value, bytes)
        self._cache_bytes = 0
        self._round: dict[tuple[int, str], tuple] = {}

    def _blocks(self, block_docs: int) -> None:
        shard, first, count, tokens = [], [], [], []
        for k, table in enumerate(self.tables):
            d = int(table.documents)
            if d == 0:
                continue
            lo = np.arange(0, d, block_docs, dtype=np.int64)
            hi = np.minimum(lo + block_docs, d)
            edges = table.starts(np.r_[lo, d])
            shard.append(np.full(lo.size, k, np.int64))
            first.append(lo)
            count.append(hi - lo)
            tokens.append(np.diff(edges))
        self._blk_shard, self._blk_first, self._blk_n, self._blk_tokens = (
            np.concatenate(parts) if parts else np.zeros(0, np.int64) for parts in (shard, first, count, tokens))

    def sampler(self, *, batch_size: int = 1, world_size: int = 1, rank: int = 0, drop_last: bool = False,
                remainder: str = "pad") -> Sampler:
        """The order of the sequences, rank ``rank``'s slices of each global batch and the resume arithmetic:
        ``sampler.plan(epoch, consumed)`` yields sequence ids for :meth:`pieces`."""
        spec = SamplerSpec(seed=self.spec.seed, shuffle=self.spec.shuffle, batch_size=batch_size,
                           drop_last=drop_last, remainder=remainder)
        return Sampler(spec, (self.sequences,), self.fingerprint, world_size=world_size, rank=rank)

    def _keys(self, epoch: int, purpose: str):
        keys = self._round.get((epoch, purpose))
        if keys is None:
            keys = round_keys(self.spec.seed, self.spec.shuffle, epoch, self.fingerprint, purpose)
            with self._lock:
                if len(self._round) > 8:
                    self._round.clear()
                self._round[epoch, purpose] = keys
        return keys

    def _slots(self, epoch: int, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block in each slot, where each slot starts in units of ``sizes`` + the end) of ``epoch``."""
        with self._lock:
            if epoch in self._epochs:
                return self._epochs[epoch]
        b = self._blk_n.size
        perm = np.arange(b, dtype=np.int64)
        if self.spec.shuffle == "global" and b > 1:
            perm = permute(perm, b, domain_bits(b), self._keys(epoch, "token-blocks"), 0)
        slot_start = np.concatenate([[0], np.cumsum(sizes[perm])]).astype(np.int64)
        with self._lock:
            self._epochs[epoch] = (perm, slot_start)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return perm, slot_start

    def _cached(self, key: tuple, compute):
        """``compute()``, kept under ``key`` in a cache of at most :data:`BLOCK_CACHE_BYTES` (least recently used
        dropped first)."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        value = compute()
        size = _nbytes(value)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (value, size)
                self._cache_bytes += size
            while self._cache_bytes > BLOCK_CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1][1]
        return value

    def shards_of(self, epoch: int, sequences: np.ndarray) -> np.ndarray:
        """The shard each of ``sequences`` of ``epoch`` starts in (its first piece's; vectorised, for reading
        shards ahead in the order the sequences want them)."""
        sizes, units = self._units(np.asarray(sequences, np.int64))
        perm, slot_start = self._slots(epoch, sizes)
        return self._blk_shard[perm[np.searchsorted(slot_start, units, "right") - 1]]

    def _units(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(what each block holds, where each of ``sequences`` starts) in the same units."""
        raise NotImplementedError

    def _edges(self, b: int) -> np.ndarray:
        """Token offset in its shard of each document of block ``b`` and of the block's end (one lookup of a
        contiguous range)."""
        first = int(self._blk_first[b])
        return self.tables[int(self._blk_shard[b])].starts(np.arange(first, first + int(self._blk_n[b]) + 1))

    def _documents(self, b: int, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token offset in its shard, length) of block ``b``'s documents at local positions ``order``."""
        edges = self._edges(b)
        return edges[order], np.diff(edges)[order]


class ConcatPacking(_BlockPacking):
    """``packing="concat"`` over documents ``tables`` (one per shard, in order): see the module docstring.

    ``fingerprint`` identifies the corpus (the manifest's); ``shuffle`` is ``global`` (documents and sequences
    shuffled) or ``none`` (stored order). Memory is O(blocks) plus a few blocks' document tables."""

    kind = "concat"

    def __init__(self, tables: Sequence[DocumentTable], seq_len: int, *, seed: int = 0, shuffle: str = "global",
                 fingerprint: str = "", block_docs: int = 4096):
        super().__init__(tables, seq_len, seed=seed, shuffle=shuffle, fingerprint=fingerprint, block_docs=block_docs)
        if self.total_tokens <= seq_len:
            raise ValueError(f"seq_len {seq_len} needs more than {count(seq_len, 'token')}; the corpus holds "
                             f"{self.total_tokens}")
        self.sequences = (self.total_tokens - 1) // seq_len
        self.documents = int(self._blk_n.sum())
        self._stream: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _units(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._blk_tokens, sequences * self.seq_len  # stream tokens

    def _block(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_block_table`, cached (in :data:`BLOCK_CACHE_BYTES`)."""
        return self._cached((epoch, b), lambda: self._block_table(epoch, b))

    def _block_table(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token offset in its shard of each document of block ``b`` in ``epoch``'s shuffled order, less the
        block's first, prefix sums of their lengths, the block's first offset [1]): int32 where the block's tokens
        fit (32 KB for 4,096 documents), else int64."""
        n = int(self._blk_n[b])
        local = np.arange(n, dtype=np.int64)
        if self.spec.shuffle == "global" and n > 1:
            local = permute(local, n, domain_bits(n), self._keys(epoch, "token-docs"),
                             np.uint64(b * int(GOLDEN) % (1 << 64)))
        edges = self._edges(b)
        rel = edges - edges[0]
        if int(rel[-1]) < 1 << 31:
            rel = rel.astype(np.int32)
        cum = np.zeros(n + 1, rel.dtype)
        np.cumsum(np.diff(rel)[local], out=cum[1:])
        return rel[local], cum, edges[:1].copy()  # a copy: a view would keep all the edges

    def pieces(self, epoch: int, sequence: int) -> list[Piece]:
        """The token ranges that make sequence ``sequence`` (``seq_len + 1`` tokens, in order) of ``epoch``."""
        if not 0 <= sequence < self.sequences:
            raise IndexError(f"sequence {sequence} out of range 0..{self.sequences - 1}")
        perm, slot_start = self._slots(epoch, self._blk_tokens)
        t = sequence * self.seq_len
        slot = int(np.searchsorted(slot_start, t, "right")) - 1
        off, need, out = t - int(slot_start[slot]), self.seq_len + 1, []
        while need:
            b = int(perm[slot])
            starts, cum, base = self._block(epoch, b)
            i = int(np.searchsorted(cum, off, "right")) - 1
            while need and i < starts.size:
                take = min(need, int(cum[i + 1]) - off)
                if take > 0:
                    out.append(Piece(int(self._blk_shard[b]), int(base[0]) + int(starts[i]) + off - int(cum[i]),
                                     take))
                    need -= take
                    off += take
                i += 1
            slot, off = slot + 1, 0
        return out

    def spans(self, epoch: int, sequences: np.ndarray) -> Spans:
        """The pieces of ``sequences`` of ``epoch`` at once, as :meth:`pieces` gives them one sequence at a time
        (vectorised: one search for every sequence's documents in the stream table of :meth:`_stream_table`)."""
        seqs = _checked(np.asarray(sequences, np.int64).reshape(-1), self.sequences)
        t0 = seqs * self.seq_len
        t1 = t0 + self.seq_len + 1
        starts, cum, shard = self._stream_table(epoch, t0, t1)
        first = np.searchsorted(cum, t0, "right") - 1
        docs = np.searchsorted(cum, t1 - 1, "right") - first
        doc = np.repeat(first, docs) + ramp(docs)
        at = cum[doc]
        begin = np.maximum(np.repeat(t0, docs), at)
        count = np.minimum(np.repeat(t1, docs), cum[doc + 1]) - begin
        row, start = np.repeat(np.arange(seqs.size, dtype=np.int64), docs), starts[doc] + begin - at
        keep = count > 0  # documents of no tokens
        if not keep.all():
            row, doc, start, count = row[keep], doc[keep], start[keep], count[keep]
        return Spans(row, shard[doc], start, count)

    def _stream_table(self, epoch: int, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token offset in its shard, stream position, shard) of each document of ``epoch``'s stream, and the
        end of the last: a sorted table in which each stream range ``[t0, t1)`` finds its documents. The whole
        epoch's (built once per epoch) where the corpus has at most :data:`STREAM_TABLE_DOCS` documents, else
        the blocks the ranges touch, end to end at their stream positions (a document before a gap between two
        of them seems to run to the next one: no range reaches into the gap)."""
        perm, slot_start = self._slots(epoch, self._blk_tokens)
        if self.documents <= STREAM_TABLE_DOCS:
            with self._lock:
                table = self._stream.get(epoch)
            if table is None:
                table = self._table(epoch, np.arange(perm.size), perm, slot_start)
                with self._lock:
                    self._stream[epoch] = table
                    while len(self._stream) > 2:
                        self._stream.popitem(last=False)
            return table
        lo = np.searchsorted(slot_start, t0, "right") - 1
        per = np.searchsorted(slot_start, t1 - 1, "right") - lo  # slots each range spans
        slots = np.unique(np.repeat(lo, per) + ramp(per))
        return self._table(epoch, slots, perm, slot_start, cached=True)

    def _table(self, epoch: int, slots: np.ndarray, perm: np.ndarray, slot_start: np.ndarray, cached: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stream table of :meth:`_stream_table` over ``slots`` (ascending; ``cached``: their blocks' tables
        through the block cache)."""
        blocks = perm[slots]
        get = self._block if cached else self._block_table
        tables = [get(epoch, b) for b in blocks.tolist()]
        starts = np.concatenate([t[0] + t[2] for t in tables])  # int64 (the base's type)
        cum = np.concatenate([np.add(t[1][:-1], off, dtype=np.int64) for t, off in zip(tables, slot_start[slots])]
                             + [slot_start[slots[-1:] + 1]])
        return starts, cum, np.repeat(self._blk_shard[blocks], self._blk_n[blocks])


FITS = ("best", "first")


class BestFitPacking(_BlockPacking):
    """``packing="best-fit"``: whole documents fill sequences of ``seq_len + 1`` tokens without being cut, the rest
    padding (see :meth:`pieces`). Documents longer than ``seq_len + 1`` tokens are split into pieces of that size
    (the last one shorter, packed like a document).

    Each block of ``block_docs`` documents is a window packed on its own by best-fit decreasing (``fit="best"``:
    each piece, longest first, into the fullest sequence it fits) or first-fit decreasing (``fit="first"``: into the
    first sequence it fits). A block's packing does not depend on the document order, so the number of
    sequences of every block is computed once, at construction, from the documents' lengths alone (read in runs of
    whole blocks; no block is packed: a full piece is a sequence, a rest over ``(seq_len + 1) / 2`` opens one, the
    shorter rests are placed on plain integer rooms; first-fit's of many blocks at once in numpy where that pays),
    O(blocks) memory kept; a block is packed in full (its pieces' offsets) only when a batch touches it. An epoch
    shuffles the blocks and the sampler shuffles the sequences. Construction's CPU time on 2 busy cores, seq_len
    2,048, documents of 1..1,999 tokens: 10^6 in 10 shards 0.40 s best-fit, 0.74 s first-fit (3.5 s and 11.7 s
    when every block was packed in full), 10^7 in 8 shards 4.1 s and 7.0 s (35 s and 128 s); 10^6 documents of
    1..299 tokens 0.23 s and 1.0 s (2.7 s and 7.5 s). Most of it is the placing of the short rests, one step a
    sequence a run of equal rests fills.

    With ``budget`` (an image-text packing's ``max_images``), each document also has a weight (``table.weights``)
    and a sequence holds at most ``budget`` of them: documents (none longer than ``seq_len + 1``: the caller refuses
    them) are placed by the same rule among the sequences with room for both (:func:`_fit_within`), and each
    block's sequences are counted by packing it at construction."""

    kind = "best-fit"

    def __init__(self, tables: Sequence[DocumentTable], seq_len: int, *, seed: int = 0, shuffle: str = "global",
                 fingerprint: str = "", block_docs: int = 4096, fit: str = "best", budget: int | None = None):
        if fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive integer or None, got {budget!r}")
        self.kind = f"{fit}-fit"
        super().__init__(tables, seq_len, seed=seed, shuffle=shuffle, fingerprint=fingerprint, block_docs=block_docs)
        self.fit, self.budget = fit, budget
        self.longest = np.zeros(len(self.tables), np.int64)
        """The longest document of each table (read by :meth:`_counts`; zeros with a ``budget``)."""
        self._bins = self._counts() if budget is None else np.array(
            [len(self._packed(b)) for b in range(self._blk_n.size)], np.int64)
        self.sequences = int(self._bins.sum())
        if not self.sequences:
            raise ValueError("the corpus holds no tokens to pack")
        self.documents = int(self._blk_n.sum())
        self._whole: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _counts(self) -> np.ndarray:
        """The number of sequences of every block, in block order, from the documents' lengths alone (read in
        contiguous runs of whole blocks of a shard, :data:`_LENGTH_RUN` documents at most a lookup; the runs of
        small shards counted together, that many documents at most); each table's longest document on the way
        (:attr:`longest`)."""
        count = _count_best if self.fit == "best" else _count_first
        step = self.block_docs * max(1, _LENGTH_RUN // self.block_docs)
        out, lengths, heads, held = [np.zeros(0, np.int64)], [], [], 0
        for k, table in enumerate(self.tables):
            d = int(table.documents)
            for lo in range(0, d, step):
                hi = min(d, lo + step)
                if held + hi - lo > step:
                    out.append(_run_counts(np.concatenate(lengths), np.concatenate(heads), self.seq_len + 1, count))
                    lengths, heads, held = [], [], 0
                lengths.append(np.diff(table.starts(np.arange(lo, hi + 1, dtype=np.int64))))
                self.longest[k] = max(int(self.longest[k]), int(lengths[-1].max(initial=0)))
                heads.append(held + np.arange(0, hi - lo, self.block_docs))
                held += hi - lo
        if held:
            out.append(_run_counts(np.concatenate(lengths), np.concatenate(heads), self.seq_len + 1, count))
        return np.concatenate(out)

    @property
    def padding_fraction(self) -> float:
        """Padding tokens over all tokens of an epoch's sequences."""
        return 1.0 - self.total_tokens / (self.sequences * (self.seq_len + 1))

    def _units(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._bins, sequences  # sequences

    def _packed(self, b: int) -> list[list[tuple[int, int]]]:
        """Block ``b``'s sequences: the (size, token offset) of each one's pieces, in placement order."""
        n = int(self._blk_n[b])
        local = np.arange(n, dtype=np.int64)
        starts, lengths = self._documents(b, local)
        cap = self.seq_len + 1
        if self.budget is not None:
            return self._packed_within(b, local, starts, lengths)
        items = [(min(cap, n_ - off), s + off) for s, n_ in zip(starts.tolist(), lengths.tolist())
                 for off in range(0, n_, cap)]
        items.sort(key=lambda it: (-it[0], it[1]))
        return _best_fit(items, cap) if self.fit == "best" else _first_fit(items, cap)

    def _packed_within(self, b: int, local: np.ndarray, starts: np.ndarray, lengths: np.ndarray
                       ) -> list[list[tuple[int, int]]]:
        """:meth:`_packed` with a ``budget``: whole documents (each at most ``seq_len + 1`` long: the caller
        refuses longer ones) by the same rule, a sequence also holding at most ``budget`` of the documents'
        weights (``table.weights``: a sample's images); a sequence whose weight is spent still takes documents of
        weight 0. A document
        of no tokens is left out, as without a budget (a piece of size 0 would name the next document)."""
        first = int(self._blk_first[b])
        weights = self.tables[int(self._blk_shard[b])].weights(local + first)
        items = sorted(((n, s, w) for n, s, w in zip(lengths.tolist(), starts.tolist(), weights.tolist()) if n),
                       key=lambda it: (-it[0], it[1]))
        return _fit_within(items, self.seq_len + 1, self.budget, self.fit)

    def _pack(self, b: int) -> list[list[Piece]]:
        """:meth:`_packed` of block ``b`` as :class:`Piece` lists (cached)."""
        def compute():
            shard = int(self._blk_shard[b])
            return [[Piece(shard, start, size) for size, start in pieces] for pieces in self._packed(b)]
        return self._cached(("bins", b), compute)

    def pieces(self, epoch: int, sequence: int) -> list[Piece]:
        """The documents (or parts of a long one) of sequence ``sequence`` of ``epoch``, whole and in order: their
        tokens, then padding up to ``seq_len + 1`` (``loss_mask`` 0)."""
        if not 0 <= sequence < self.sequences:
            raise IndexError(f"sequence {sequence} out of range 0..{self.sequences - 1}")
        perm, slot_start = self._slots(epoch, self._bins)
        slot = int(np.searchsorted(slot_start, sequence, "right")) - 1
        return list(self._pack(int(perm[slot]))[sequence - int(slot_start[slot])])

    def _pack_arrays(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_pack_table` of block ``b``, cached (a few blocks)."""
        return self._cached(("bin-arrays", b), lambda: self._pack_table(b))

    def _pack_table(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ``b``'s sequences as arrays: (where each sequence's pieces begin + the end, their token
        offsets, their counts), from :meth:`_pack`."""
        bins = self._packed(b)
        ptr = np.zeros(len(bins) + 1, np.int64)
        np.cumsum([len(pieces) for pieces in bins], out=ptr[1:])
        flat = np.array([item for pieces in bins for item in pieces], np.int64).reshape(-1, 2)
        return ptr, np.ascontiguousarray(flat[:, 1]), np.ascontiguousarray(flat[:, 0])

    def spans(self, epoch: int, sequences: np.ndarray) -> Spans:
        """The pieces of ``sequences`` of ``epoch`` at once, as :meth:`pieces` gives them one sequence at a time
        (vectorised: the packed sequences of the blocks, as arrays end to end, looked up at once)."""
        seqs = _checked(np.asarray(sequences, np.int64).reshape(-1), self.sequences)
        perm, slot_start = self._slots(epoch, self._bins)
        slot = np.searchsorted(slot_start, seqs, "right") - 1
        blocks = perm[slot]
        base, ptr, start, count = self._bin_table(blocks)
        first = ptr[base + seqs - slot_start[slot]]  # each sequence's first piece in the table
        per = ptr[base + seqs - slot_start[slot] + 1] - first
        row = np.repeat(np.arange(seqs.size, dtype=np.int64), per)
        piece = np.repeat(first, per) + ramp(per)
        return Spans(row, np.repeat(self._blk_shard[blocks], per), start[piece], count[piece])

    def _bin_table(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(where the sequences of each of ``blocks`` begin in the table, where each sequence's pieces begin +
        the end, the pieces' token offsets, their counts): every block's packed sequences end to end (made once,
        the packing being the same every epoch) where the corpus has at most :data:`STREAM_TABLE_DOCS`
        documents, else the given blocks'."""
        if self.documents <= STREAM_TABLE_DOCS:
            with self._lock:
                table = self._whole
            if table is None:
                table = self._bin_arrays(np.arange(self._blk_n.size))
                with self._lock:
                    self._whole = table
            base, *rest = table
            return (base[blocks], *rest)
        touched, which = np.unique(blocks, return_inverse=True)
        base, *rest = self._bin_arrays(touched, cached=True)
        return (base[which], *rest)

    def _bin_arrays(self, blocks: np.ndarray, cached: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_bin_table` over ``blocks`` (``cached``: their arrays through the block cache), ``base`` by
        position in ``blocks``."""
        tables = [self._pack_arrays(b) if cached else self._pack_table(b) for b in blocks.tolist()]
        pieces = np.cumsum([0] + [t[0][-1] for t in tables])
        ptr = np.concatenate([t[0][:-1] + off for t, off in zip(tables, pieces.tolist())] + [pieces[-1:]])
        base = np.cumsum([0] + [t[0].size - 1 for t in tables])[:-1]
        start = np.concatenate([t[1] for t in tables])
        return base.astype(np.int64), ptr.astype(np.int64), start, np.concatenate([t[2] for t in tables])


def _nbytes(value) -> int:
    """The memory a cached block table holds: its arrays' bytes (a tuple of arrays), or :data:`_PIECE_BYTES` a
    piece (a best-fit block's sequences as lists of pieces)."""
    if isinstance(value, tuple):
        return sum(a.nbytes for a in value)
    return _PIECE_BYTES * sum(len(pieces) for pieces in value)


def _checked(sequences: np.ndarray, n: int) -> np.ndarray:
    """``sequences``, once each is in ``0..n - 1`` (IndexError naming the first that is not)."""
    bad = (sequences < 0) | (sequences >= n)
    if bad.any():
        raise IndexError(f"sequence {int(sequences[bad][0])} out of range 0..{n - 1}")
    return sequences


def _best_fit(items: list[tuple[int, int]], cap: int) -> list[list[tuple[int, int]]]:
    """Each (size, start), in the given order, into the bin with the least room that holds it (ties: the
    oldest), else a new bin."""
    bins: list[list[tuple[int, int]]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted
    for size, start in items:
        i = bisect.bisect_left(room, (size, -1))
        if i < len(room):
            left, k = room.pop(i)
        else:
            left, k = cap, len(bins)
            bins.append([])
        bins[k].append((size, start))
        bisect.insort(room, (left - size, k))
    return bins


def _fit_within(items: list[tuple[int, int, int]], cap: int, budget: int, fit: str) -> list[list[tuple[int, int]]]:
    """Each (size, start, weight), in the given order, into a sequence with room for its size and its weight
    (at most ``budget`` a sequence): the one with the least room that holds it (``fit="best"``; ties: the oldest)
    or the first opened (``"first"``), else a new one. A sequence whose weight is spent still takes documents of
    weight 0 while it has room. With weights 0 it places as :func:`_best_fit` and :func:`_first_fit` do (the
    tests hold them equal)."""
    bins: list[list[tuple[int, int]]] = []
    open_: dict[int, list[tuple[int, int]]] = {}  # budget left -> its sequences with room, by the fit's order
    best = fit == "best"
    for size, start, weight in items:
        found = _candidate(open_, size, weight, best)
        if found is None:
            k, room, left = len(bins), cap, budget
            bins.append([])
        else:
            left, at = found
            x, y = open_[left].pop(at)
            k, room = (y, x) if best else (x, y)
        bins[k].append((size, start))
        room, left = room - size, left - weight
        if room > 0:
            bisect.insort(open_.setdefault(left, []), (room, k) if best else (k, room))
    return bins


def _candidate(open_: dict[int, list[tuple[int, int]]], size: int, weight: int, best: bool
               ) -> tuple[int, int] | None:
    """``(budget left, position in its list)`` of the sequence of :func:`_fit_within`'s ``open_`` that takes an
    item of ``size`` tokens and ``weight``: the least room that holds it, ties the oldest (best), or the oldest
    with room (first); None: a new one."""
    pick: tuple[tuple[int, int], int, int] | None = None
    for left, seqs in open_.items():
        if left < weight:
            continue
        if best:
            i = bisect.bisect_left(seqs, (size, -1))
            if i < len(seqs) and (pick is None or seqs[i] < pick[0]):
                pick = (seqs[i], left, i)
            continue
        i = next((j for j, (_, room) in enumerate(seqs) if room >= size), None)
        if i is not None and (pick is None or seqs[i] < pick[0]):
            pick = (seqs[i], left, i)
    return None if pick is None else (pick[1], pick[2])


def _first_fit(items: list[tuple[int, int]], cap: int) -> list[list[tuple[int, int]]]:
    """Each (size, start), in the given order, into the first bin that holds it, else a new bin: the first found
    by a walk down a tree of the largest room over the bins (those not yet opened have room ``cap``, after the
    open ones), O(log items) an item."""
    leaves = 1 << max(0, (len(items) - 1).bit_length())
    tree = [cap] * (2 * leaves)
    bins: list[list[tuple[int, int]]] = []
    for size, start in items:
        i = _tree_first(tree, leaves, size)
        if i - leaves == len(bins):
            bins.append([])
        bins[i - leaves].append((size, start))
        tree[i] -= size
        _tree_repair(tree, i)
    return bins


def _tree_first(tree: list[int], leaves: int, size: int) -> int:
    """The first leaf (as its node number) with room for ``size`` in ``tree``, a max tree over ``leaves`` leaves
    (node ``i``'s children are ``2i`` and ``2i + 1``; the root, 1, has room for it)."""
    i = 1
    while i < leaves:
        i = 2 * i if tree[2 * i] >= size else 2 * i + 1
    return i


def _tree_repair(tree: list[int], i: int) -> None:
    """The maxima above leaf node ``i`` of ``tree`` once its room went down (up to the first one unchanged)."""
    i >>= 1
    while i:
        top = max(tree[2 * i], tree[2 * i + 1])
        if tree[i] == top:
            break
        tree[i] = top
        i >>= 1


def _run_counts(lengths: np.ndarray, heads: np.ndarray, cap: int, count) -> np.ndarray:
    """The number of sequences of each block of the documents ``lengths`` (blocks beginning at ``heads``) as
    :meth:`BestFitPacking._packed` makes them, from the pieces' sizes alone: a document is ``length // cap`` full
    pieces (a sequence each) and a rest; a rest over ``cap / 2`` opens a sequence of its own (every earlier piece
    is at least as long, so no sequence has room for it); ``count`` places the others."""
    n = lengths.size
    block = np.repeat(np.arange(heads.size, dtype=np.int64), np.diff(np.r_[heads, n]))
    full = np.add.reduceat(lengths // cap, heads)
    rest = lengths % cap
    rest = (cap - 1) - np.sort(block * cap + (cap - 1 - rest)) % cap  # each block's rests, longest first
    big = np.add.reduceat((2 * rest > cap).astype(np.int64), heads)
    small = np.add.reduceat(((2 * rest <= cap) & (rest > 0)).astype(np.int64), heads)
    out = full + big
    edge = np.r_[True, rest[1:] != rest[:-1]]
    edge[heads] = True
    first = np.flatnonzero(edge)  # where each run of equal rests begins
    values, runs = rest[first], np.diff(np.r_[first, n])
    lo, hi = np.searchsorted(first, heads + big), np.searchsorted(first, heads + big + small)
    if count is _count_first and _lockstep_pays(heads.size, int(small.max(initial=0)), int((hi - lo).sum())):
        return out + _count_first_lockstep(rest, heads, big, small, cap)
    for b, (at, nb, r0, r1) in enumerate(zip(heads.tolist(), big.tolist(), lo.tolist(), hi.tolist())):
        if r1 > r0:
            out[b] += count((cap - rest[at:at + nb]).tolist(), values[r0:r1].tolist(), runs[r0:r1].tolist(), cap)
    return out


def _lockstep_pays(blocks: int, width: int, runs: int) -> bool:
    """Whether :func:`_count_first_lockstep` over ``blocks`` blocks of at most ``width`` pieces to place should
    take less time than :func:`_count_first` block by block over ``runs`` runs of equal pieces in all (times
    measured on 2 busy cores: a lockstep step about 60 us + 1.4 us a block, a run about 7 us; both count the
    same). ``_LOCKSTEP_BLOCKS`` blocks or more, or fewer, decides where it is set (the tests take both ways)."""
    if _LOCKSTEP_BLOCKS is not None:
        return blocks >= _LOCKSTEP_BLOCKS
    return width * (60 + 1.4 * blocks) < 7 * runs


def _count_first_lockstep(rest: np.ndarray, heads: np.ndarray, big: np.ndarray, small: np.ndarray, cap: int
                          ) -> np.ndarray:
    """:func:`_count_first` of many blocks at once (each block's rests in ``rest`` from ``heads``: ``big`` open
    sequences, then ``small`` pieces to place): the blocks' trees side by side, the ``j``-th piece of every block
    placed by one walk down and up them in numpy (blocks out of pieces place nothing)."""
    g, width = heads.size, int(small.max())
    if width == 0:
        return np.zeros(g, np.int64)
    leaves = 1 << max(0, int((big + small).max() - 1).bit_length())
    depth = leaves.bit_length() - 1
    col = np.arange(max(width, leaves))
    last = rest.size - 1
    sizes = np.where(col[:width] < small[:, None],
                     rest[np.minimum((heads + big)[:, None] + col[:width], last)], 0)
    tree = np.zeros((g, 2 * leaves), np.int32)  # rooms are at most cap
    tree[:, leaves:] = np.where(col[:leaves] < big[:, None],
                                cap - rest[np.minimum(heads[:, None] + col[:leaves], last)], cap)
    at = leaves
    while at > 1:
        half = at // 2
        tree[:, half:at] = np.maximum(tree[:, at:2 * at:2], tree[:, at + 1:2 * at:2])
        at = half
    flat, base = tree.reshape(-1), np.arange(g, dtype=np.int64) * (2 * leaves)
    used = big.copy()
    for piece in sizes.T:
        i = np.ones(g, np.int64)
        for _ in range(depth):
            i = 2 * i + (flat[base + 2 * i] < piece)
        used = np.maximum(used, np.where(piece > 0, i - leaves + 1, 0))
        flat[base + i] -= piece
        for _ in range(depth):
            i >>= 1
            flat[base + i] = np.maximum(flat[base + 2 * i], flat[base + 2 * i + 1])
    return used - big


def _count_best(rooms: list[int], values: list[int], runs: list[int], cap: int) -> int:
    """The sequences :func:`_best_fit` adds to open ones with room ``rooms`` (ascending) placing ``runs[k]`` pieces
    of size ``values[k]`` (decreasing): only the rooms matter, kept sorted as plain ints. The sequence with the
    least room that holds a piece also takes the equal pieces that follow while it holds them (what is left of its
    room is then the least that holds one), so a run of equal pieces costs one step a sequence it fills."""
    opened = 0
    for piece, left in zip(values, runs):
        while left:
            i = bisect.bisect_left(rooms, piece)
            if i < len(rooms):
                room = rooms.pop(i) - piece
            else:
                room, opened = cap - piece, opened + 1
            left -= 1
            if left and room >= piece:
                take = min(left, room // piece)
                room, left = room - take * piece, left - take
            if room:
                bisect.insort(rooms, room)
    return opened


def _count_first(rooms: list[int], values: list[int], runs: list[int], cap: int) -> int:
    """The sequences :func:`_first_fit` adds to open ones with room ``rooms`` (in the order they were opened)
    placing ``runs[k]`` pieces of size ``values[k]`` (decreasing): a tree of the largest room over the sequences
    (those not yet opened have room ``cap``, after the open ones) finds the first that holds a piece in O(log
    pieces), and that sequence takes as many of the equal pieces that follow as it has room for."""
    size = 1 << max(0, (len(rooms) + sum(runs) - 1).bit_length())
    tree = [0] * size + rooms + [cap] * (size - len(rooms))
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    used = len(rooms)
    for piece, left in zip(values, runs):
        while left:
            i = _tree_first(tree, size, piece)
            if i - size >= used:
                used = i - size + 1
            tree[i] -= piece
            left -= 1
            if left and tree[i] >= piece:
                take = min(left, tree[i] // piece)
                tree[i], left = tree[i] - take * piece, left - take
            _tree_repair(tree, i)
    return used - len(rooms)


def document_starts(tokens: np.ndarray, eos_id: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Where a document begins in ``tokens`` [B, L], as sorted indices into the flattened rows: each row's start,
    right after an ``eos_id``, and (with ``mask``, 0 on padding) where padding begins; padding is one segment."""
    tokens = np.asarray(tokens)
    n, width = tokens.reshape(-1, tokens.shape[-1]).shape
    flat = tokens.reshape(-1)
    at = np.flatnonzero(flat[:-1] == eos_id) + 1
    if mask is not None:
        real = np.asarray(mask, bool).reshape(-1)
        at = np.concatenate([at[real[at]], np.flatnonzero(real[:-1] & ~real[1:]) + 1])
    at = at[at % width != 0]  # a row's start is one anyway
    return np.sort(np.concatenate([np.arange(0, n * width, width, dtype=np.int64), at]))


def piece_starts(rows: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """Where each piece (``count[j]`` tokens in row ``rows[j]``, each row's pieces together and in order) begins
    in the flattened rows of ``width`` tokens: its row's start + the pieces before it in the row."""
    ends = np.cumsum(count)
    before = ends - count
    first = np.ones(rows.size, bool)
    first[1:] = rows[1:] != rows[:-1]
    return rows * width + before - np.maximum.accumulate(np.where(first, before, 0))


def piece_bounds(pieces: list[np.ndarray], lengths: np.ndarray, width: int) -> np.ndarray:
    """A batch's document starts from its pieces' starts (each piece one document, or part of a long one starting
    its row): each row's start, each piece's, and where a row's padding begins (one segment)."""
    short = np.flatnonzero(lengths < width)
    rows = np.arange(0, lengths.size * width, width, dtype=np.int64)
    return np.unique(np.concatenate([rows, *pieces, short * width + lengths[short]]))


def segment_ids(starts: np.ndarray, mask: np.ndarray, full: bool) -> np.ndarray:
    """int32 like ``mask`` [B, L]: 1, 2, ... for each row's documents (``starts``: sorted flat indices, each row's
    start among them), 0 on padding (Grain's ``segment_ids``)."""
    marks = np.zeros(mask.size, np.int32)
    marks[starts] = 1
    segments = marks.reshape(mask.shape).cumsum(axis=1, dtype=np.int32)
    if not full:
        segments[~mask] = 0
    return segments


def positions_from(starts: np.ndarray, size: int) -> np.ndarray:
    """int64 [size]: each index's distance to the last of ``starts`` (sorted, the first 0) at or before it."""
    out = np.repeat(starts, np.diff(np.append(starts, size)))
    return np.subtract(ramp_to(size), out, out=out)  # one new array: fresh memory costs page faults


_RAMP = np.zeros(0, np.int64)


def ramp_to(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64), read-only, a view of one array kept and grown as needed (no new memory)."""
    global _RAMP
    ramp = _RAMP
    if ramp.size < n:
        ramp = np.arange(max(n, 2 * ramp.size), dtype=np.int64)
        ramp.setflags(write=False)
        _RAMP = ramp
    return ramp[:n]


def cu_from(starts: np.ndarray, rows: int, width: int) -> np.ndarray:
    """int32 ``[n + 1]``: ``starts`` (of :func:`document_starts`, in ``rows`` rows of ``width``) within the
    flattened inputs (each row but its last token), and their end."""
    row, col = np.divmod(starts, width)
    inputs = col < width - 1
    return np.append(row[inputs] * (width - 1) + col[inputs], rows * (width - 1)).astype(np.int32)


def boundaries(tokens: np.ndarray, eos_id: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(position_ids(tokens, eos_id, mask), cu_seqlens(tokens, eos_id, mask))`` from one search for the
    documents' starts."""
    tokens = np.asarray(tokens)
    rows, width = tokens.reshape(-1, tokens.shape[-1]).shape
    starts = document_starts(tokens, eos_id, mask)
    return positions_from(starts, rows * width).reshape(tokens.shape), cu_from(starts, rows, width)


def position_ids(tokens: np.ndarray, eos_id: int, mask: np.ndarray | None = None) -> np.ndarray:
    """int64 like ``tokens`` ([B, L] or [L]): 0 at each sequence's start and right after every ``eos_id``,
    else one more than the token before (with ``mask``: padding, where it is 0, counts as one segment)."""
    return boundaries(tokens, eos_id, mask)[0]


def cu_seqlens(tokens: np.ndarray, eos_id: int, mask: np.ndarray | None = None) -> np.ndarray:
    """int32 ``[n + 1]``: where each document of the flattened inputs ``tokens[:, :-1]`` begins, and their end
    (for variable-length attention): a boundary at every sequence start and after every ``eos_id`` (with ``mask``:
    padding is one segment)."""
    return boundaries(tokens, eos_id, mask)[1]
