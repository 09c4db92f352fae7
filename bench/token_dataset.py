"""A token dataset read as packed sequences without the Loader: the reference reader of the token benchmark
(``bench/tokens.py``) and of the token tests, kept out of the package (users read token datasets with
``fastio.Loader(DEST, pipeline=fastio.Tokens(...))``).

``TokenDataset(dest)`` checks the manifest (``kind: "tokens"``) and every shard pair (present, sizes against the
manifest and against each other); :meth:`TokenDataset.packing` gives the pure order of packed sequences
(:class:`~fastio.tokens.packing.ConcatPacking` or :class:`~fastio.tokens.packing.BestFitPacking`) over its
documents, and :meth:`TokenDataset.batch` reads the sequences a plan names, with their ``position_ids``,
``cu_seqlens`` and ``loss_mask``; a chat dataset's ``loss_mask`` is its stored mask
(:mod:`fastio.formats.token_mask`) but on each conversation's first token, and its boundaries are the
conversations' (the pieces'), as the Loader's. Local datasets only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastio.dataset.files import LocalFiles
from fastio.dataset.manifest import Manifest
from fastio.errors import DatasetError
from fastio.formats.megatron import MegatronShard
from fastio.formats.token_mask import MaskFile
from fastio.tokens.packing import (
    BestFitPacking,
    ConcatPacking,
    Piece,
    cu_from,
    cu_seqlens,
    piece_bounds,
    piece_starts,
    position_ids,
    positions_from,
)

__all__ = ["TokenDataset"]


class TokenDataset:
    """The token dataset in ``dest`` (see the module docstring)."""

    def __init__(self, dest: str | Path):
        self.files = LocalFiles(Path(dest))
        self.root = self.files.root
        self.manifest: Manifest = self.files.load_manifest()
        info = self.manifest.tokens
        if info is None:
            raise DatasetError(f"{self.root}: not a token dataset (kind {self.manifest.kind!r}); open it with "
                               "fastio.Dataset")
        self.info = info
        self.files.check(self.manifest.shards)
        self.shards: list[MegatronShard] = []
        for record in self.manifest.shards:
            pair = MegatronShard(self.files.shard_path(record), info.dtype,
                                 one_per_document=info.one_sequence_per_document)
            if (pair.documents, pair.index.bin_bytes) != (record.samples, record.bytes):
                raise DatasetError(f"{pair.bin_path}: {pair.documents} documents in {pair.index.bin_bytes} bytes, the "
                                   f"manifest says {record.samples} in {record.bytes}")
            self.shards.append(pair)
        self.masks = [MaskFile(self.files.mask_path(r), pair.index.tokens) for r, pair in
                      zip(self.manifest.shards, self.shards)] if info.chat is not None else None

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    @property
    def documents(self) -> int:
        return self.manifest.total_samples

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def packing(self, seq_len: int, *, packing: str = "concat", seed: int = 0, shuffle: str = "global",
                block_docs: int = 4096, fit: str = "best") -> ConcatPacking | BestFitPacking:
        """The order of packed sequences over this dataset's documents (pure: see :mod:`fastio.tokens.packing`):
        ``packing="concat"``, or ``"best-fit"`` (with ``fit="best"`` or ``"first"``)."""
        common = {"seed": seed, "shuffle": shuffle, "fingerprint": self.fingerprint, "block_docs": block_docs}
        tables = [s.index for s in self.shards]
        if packing == "concat":
            return ConcatPacking(tables, seq_len, **common)
        if packing == "best-fit":
            return BestFitPacking(tables, seq_len, fit=fit, **common)
        raise ValueError(f"packing must be one of concat, best-fit, got {packing!r}")

    def read(self, pieces: list[Piece]) -> np.ndarray:
        """The tokens ``pieces`` name, concatenated (int64)."""
        return np.concatenate([self.shards[p.shard].tokens(p.start, p.count) for p in pieces]).astype(np.int64)

    def read_mask(self, pieces: list[Piece]) -> np.ndarray:
        """A chat dataset's loss mask bits of the tokens ``pieces`` name, concatenated."""
        return np.concatenate([self.masks[p.shard].bits(np.arange(p.start, p.start + p.count)) for p in pieces])

    def batch(self, packing: ConcatPacking | BestFitPacking, epoch: int, sequences: np.ndarray
              ) -> dict[str, np.ndarray]:
        """``tokens`` int64 [B, seq_len + 1] (padding: the end-of-document id), ``loss_mask`` bool (same shape, False
        on padding, and a chat dataset's stored mask but on each conversation's first token: a target ``tokens[:, 1:]``
        counts where ``loss_mask[:, 1:]``),
        ``position_ids`` (same shape) and ``cu_seqlens`` int32 [n + 1] (padding one segment) of sequences
        ``sequences`` of ``epoch``."""
        width = packing.seq_len + 1
        ids = np.asarray(sequences).reshape(-1)
        tokens = np.full((ids.size, width), self.eos_id, np.int64)
        mask = np.zeros((ids.size, width), bool)
        rows, counts = [], []
        for row, s in enumerate(ids.tolist()):
            pieces = packing.pieces(epoch, s)
            got = self.read(pieces)
            tokens[row, :got.size] = got
            if self.masks is None:
                mask[row, :got.size] = True
            else:  # the stored bits, but each conversation's first token: no target (fastio/tokens/loading.py)
                mask[row, :got.size] = self.read_mask(pieces)
                mask[row, np.cumsum([0] + [p.count for p in pieces[:-1]])] = False
            rows += [row] * len(pieces)
            counts += [p.count for p in pieces]
        if self.masks is None:
            return {"tokens": tokens, "loss_mask": mask, "position_ids": position_ids(tokens, self.eos_id, mask),
                    "cu_seqlens": cu_seqlens(tokens, self.eos_id, mask)}
        lengths = np.bincount(rows, counts, ids.size).astype(np.int64)
        starts = piece_bounds([piece_starts(np.asarray(rows, np.int64), np.asarray(counts, np.int64), width)],
                              lengths, width)
        return {"tokens": tokens, "loss_mask": mask, "position_ids": positions_from(starts, tokens.size).reshape(
            tokens.shape), "cu_seqlens": cu_from(starts, ids.size, width)}
