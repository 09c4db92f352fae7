"""A token dataset opened for reading: its manifest, its Megatron shards mapped, and packed sequences read from them.

``TokenDataset(dest)`` checks the manifest (``kind: "tokens"``) and every shard pair (present, sizes against the
manifest and against each other); :meth:`TokenDataset.packing` gives the pure order of packed sequences
(:class:`~fastio.tokens.packing.ConcatPacking`) over its documents, and :meth:`TokenDataset.batch` reads the
sequences a plan names, with their ``position_ids`` and ``cu_seqlens``. Local datasets only this release.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastio.errors import DatasetError
from fastio.manifest import Manifest
from fastio.source import LocalSource
from fastio.tokens.megatron import MegatronShard
from fastio.tokens.packing import ConcatPacking, Piece, cu_seqlens, position_ids

__all__ = ["TokenDataset"]


class TokenDataset:
    """The token dataset in ``dest`` (see the module docstring)."""

    def __init__(self, dest: str | Path):
        self.source = LocalSource(Path(dest))
        self.root = self.source.root
        self.manifest: Manifest = self.source.load_manifest()
        info = self.manifest.tokens
        if info is None:
            raise DatasetError(f"{self.root}: not a token dataset (kind {self.manifest.kind!r}); open it with "
                               "fastio.Dataset")
        self.info = info
        self.source.check(self.manifest.shards)
        self.shards: list[MegatronShard] = []
        for record in self.manifest.shards:
            pair = MegatronShard(self.source.shard_path(record), info.dtype)
            if (pair.documents, pair.index.bin_bytes) != (record.samples, record.bytes):
                raise DatasetError(f"{pair.bin_path}: {pair.documents} documents in {pair.index.bin_bytes} bytes, the "
                                   f"manifest says {record.samples} in {record.bytes}")
            self.shards.append(pair)

    @property
    def eos_id(self) -> int:
        return self.info.eos_id

    @property
    def documents(self) -> int:
        return self.manifest.total_samples

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def packing(self, seq_len: int, *, seed: int = 0, shuffle: str = "global", block_docs: int = 4096
                ) -> ConcatPacking:
        """``packing="concat"`` over this dataset's documents (a pure order: see :mod:`fastio.tokens.packing`)."""
        return ConcatPacking([s.index for s in self.shards], seq_len, seed=seed, shuffle=shuffle,
                             fingerprint=self.fingerprint, block_docs=block_docs)

    def read(self, pieces: list[Piece]) -> np.ndarray:
        """The tokens ``pieces`` name, concatenated (int64)."""
        return np.concatenate([self.shards[p.shard].tokens(p.start, p.count) for p in pieces]).astype(np.int64)

    def batch(self, packing: ConcatPacking, epoch: int, sequences: np.ndarray) -> dict[str, np.ndarray]:
        """``tokens`` int64 [B, seq_len + 1], ``position_ids`` (same shape) and ``cu_seqlens`` int32 [n + 1] of
        sequences ``sequences`` of ``epoch``."""
        tokens = np.stack([self.read(packing.pieces(epoch, int(s))) for s in np.asarray(sequences).reshape(-1)])
        return {"tokens": tokens, "position_ids": position_ids(tokens, self.eos_id),
                "cu_seqlens": cu_seqlens(tokens, self.eos_id)}
