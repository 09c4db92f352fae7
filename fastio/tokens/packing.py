"""The order of packed token sequences, ``packing="concat"``: a pure function of (seed, epoch, fingerprint, shuffle,
seq_len, block_docs) and the documents' lengths. Nothing here reads a byte, opens a file or makes a tensor.

An epoch's documents, in an order drawn from (seed, epoch), are concatenated (each already ends with its
end-of-document token) into one stream of T tokens, cut into ``(T - 1) // seq_len`` sequences of ``seq_len + 1``
tokens with one token of overlap, as Megatron does: sequence ``s`` is stream tokens ``[s * seq_len,
(s + 1) * seq_len]``, so its inputs ``tokens[:-1]`` cover every stream token once per epoch but the tail
(fewer than ``seq_len + 1`` tokens).

The document order is lazy: documents are grouped in blocks of at most ``block_docs`` consecutive documents of a
shard; the blocks are shuffled with the sampler's keyed Feistel permutation (:mod:`fastio.sampler`), and the
documents within each block too. The token offset where each shuffled block starts (one prefix sum over the
blocks: O(blocks) memory per epoch) locates a stream position's block; a prefix sum over that block's shuffled
document lengths (O(block_docs), a few blocks kept) locates the document. So any sequence is found without a
sample index, whatever the corpus size.

The order of the sequences themselves, each rank's slice and the resume arithmetic are the sampler's:
:meth:`ConcatPacking.sampler` is a :class:`~fastio.sampler.Sampler` over the epoch's sequences (one "shard" of
``sequences`` units), so a plan started at ``consumed`` continues bitwise at the same world size and delivers
each remaining sequence exactly once at another.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fastio.sampler import _GOLDEN, Sampler, SamplerSpec, _bits, _permute, _round_keys

__all__ = ["PACKING_ALGORITHM", "PACKINGS", "ConcatPacking", "DocumentTable", "Piece", "cu_seqlens", "position_ids"]

PACKING_ALGORITHM = "concat-blocks-v1"
"""Names the document order :class:`ConcatPacking` computes (part of its fingerprint)."""
PACKINGS = ("concat",)
_SHUFFLES = ("global", "none")


class DocumentTable(Protocol):
    """What the packing needs of a shard: its document count, token count, and where documents start
    (:class:`fastio.tokens.megatron.MegatronIndex` is one)."""

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


class ConcatPacking:
    """``packing="concat"`` over documents ``tables`` (one per shard, in order): see the module docstring.

    ``fingerprint`` identifies the corpus (the manifest's); ``shuffle`` is ``global`` (documents and sequences
    shuffled) or ``none`` (stored order). Memory is O(blocks) plus a few blocks' document tables."""

    def __init__(self, tables: Sequence[DocumentTable], seq_len: int, *, seed: int = 0, shuffle: str = "global",
                 fingerprint: str = "", block_docs: int = 4096):
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
        if self.total_tokens <= seq_len:
            raise ValueError(f"seq_len {seq_len} needs more than {seq_len} tokens; the corpus holds "
                             f"{self.total_tokens}")
        self.sequences = (self.total_tokens - 1) // seq_len
        """Sequences in every epoch."""
        self.fingerprint = hashlib.sha256(
            f"{PACKING_ALGORITHM}:{fingerprint}:{seq_len}:{block_docs}".encode()).hexdigest()[:16]
        """Identifies the sequences (corpus, seq_len, blocks, algorithm): the sampler's fingerprint."""
        self._lock = threading.Lock()
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

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
        return _round_keys(self.spec, epoch, self.fingerprint, purpose)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block in each slot, token offset where each slot starts + the end) of ``epoch``."""
        with self._lock:
            if epoch in self._epochs:
                return self._epochs[epoch]
        b = self._blk_n.size
        perm = np.arange(b, dtype=np.int64)
        if self.spec.shuffle == "global" and b > 1:
            perm = _permute(perm, b, _bits(b), self._keys(epoch, "token-blocks"), 0)
        slot_start = np.concatenate([[0], np.cumsum(self._blk_tokens[perm])]).astype(np.int64)
        with self._lock:
            self._epochs[epoch] = (perm, slot_start)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return perm, slot_start

    def _block(self, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(token offset in its shard of each document of block ``b`` in its shuffled order, prefix sums of
        their lengths) in ``epoch``."""
        key = (epoch, b)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        n = int(self._blk_n[b])
        local = np.arange(n, dtype=np.int64)
        if self.spec.shuffle == "global" and n > 1:
            local = _permute(local, n, _bits(n), self._keys(epoch, "token-docs"),
                             np.uint64(b * int(_GOLDEN) % (1 << 64)))
        docs = self._blk_first[b] + local
        table = self.tables[int(self._blk_shard[b])]
        starts = table.starts(docs)
        cum = np.concatenate([[0], np.cumsum(table.starts(docs + 1) - starts)]).astype(np.int64)
        with self._lock:
            self._cache[key] = (starts, cum)
            while len(self._cache) > 16:
                self._cache.popitem(last=False)
        return starts, cum

    def pieces(self, epoch: int, sequence: int) -> list[Piece]:
        """The token ranges that make sequence ``sequence`` (``seq_len + 1`` tokens, in order) of ``epoch``."""
        if not 0 <= sequence < self.sequences:
            raise IndexError(f"sequence {sequence} out of range 0..{self.sequences - 1}")
        perm, slot_start = self._epoch(epoch)
        t = sequence * self.seq_len
        slot = int(np.searchsorted(slot_start, t, "right")) - 1
        off, need, out = t - int(slot_start[slot]), self.seq_len + 1, []
        while need:
            b = int(perm[slot])
            starts, cum = self._block(epoch, b)
            i = int(np.searchsorted(cum, off, "right")) - 1
            while need and i < starts.size:
                take = min(need, int(cum[i + 1]) - off)
                if take > 0:
                    out.append(Piece(int(self._blk_shard[b]), int(starts[i]) + off - int(cum[i]), take))
                    need -= take
                    off += take
                i += 1
            slot, off = slot + 1, 0
        return out


def position_ids(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """int64 like ``tokens`` ([B, L] or [L]): 0 at each sequence's start and right after every ``eos_id``,
    else one more than the token before."""
    tokens = np.asarray(tokens)
    rows = tokens.reshape(-1, tokens.shape[-1]) if tokens.ndim else tokens.reshape(1, 1)
    length = rows.shape[1]
    j = np.broadcast_to(np.arange(length, dtype=np.int64), rows.shape)
    starts = np.zeros(rows.shape, bool)
    starts[:, 0] = True
    starts[:, 1:] = rows[:, :-1] == eos_id
    last_start = np.maximum.accumulate(np.where(starts, j, 0), axis=1)
    return (j - last_start).reshape(tokens.shape)


def cu_seqlens(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """int32 ``[n + 1]``: where each document of the flattened inputs ``tokens[:, :-1]`` begins, and their end
    (for variable-length attention): a boundary at every sequence start and after every ``eos_id``."""
    tokens = np.asarray(tokens)
    rows = tokens.reshape(-1, tokens.shape[-1])
    inputs = rows[:, :-1]
    b, length = inputs.shape
    starts = np.zeros(inputs.shape, bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return np.concatenate([np.flatnonzero(starts.reshape(-1)), [b * length]]).astype(np.int32)
