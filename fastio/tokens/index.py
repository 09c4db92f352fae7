"""``fastio index DIR --eos-id N``: existing Megatron ``.bin``/``.idx`` pairs become a token dataset, in place.

Every ``*.bin`` and ``*.idx`` directly in DIR (sorted by name) is taken as one shard. Each pair is checked as it is
(:mod:`fastio.tokens.megatron`: header, token type the same for all, sizes, the ``.idx`` structure), every document
must end with ``eos_id`` (Megatron's preprocessing appends its end-of-document token; ``eos_id`` says which id it
is), and both files are checksummed. Nothing is copied or rewritten: the manifest (``kind: "tokens"``) names the
files where they are, relative to DEST (DEST = DIR) or by absolute path (``dest`` elsewhere, for read-only data),
and is published last. Hostile input is refused in one :class:`~fastio.errors.DatasetError` naming the file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastio.dataset.manifest import (
    MANIFEST_NAME,
    MARKER_NAME,
    ShardRecord,
    TokenInfo,
    is_location,
    is_shard_name,
    make_manifest,
    write_manifest,
)
from fastio.errors import DatasetError
from fastio.progress import count
from fastio.storage import is_remote
from fastio.storage.atomic import atomic_write_bytes
from fastio.storage.checksum import digests_file, sha256_file
from fastio.storage.lock import DirLock, LockedError
from fastio.tokens.megatron import MegatronShard, partner_path

__all__ = ["TokenIndexConfig", "TokenIndexResult", "index_tokens"]


@dataclass(frozen=True)
class TokenIndexConfig:
    """Options of :func:`index_tokens`, checked at construction (a ``ValueError`` names the parameter)."""

    source: Path
    """The folder holding the ``.bin``/``.idx`` pairs."""
    eos_id: int
    """The end-of-document id every document ends with."""
    dest: Path | None = None
    """Where the manifest goes (default: ``source``); elsewhere, the manifest names the pairs by absolute path."""
    name: str = "megatron"
    """The dataset's name in the manifest."""
    overwrite: bool = False
    """Index again where a manifest exists."""

    def __post_init__(self) -> None:
        for key in ("source", "dest"):
            value = getattr(self, key)
            if value is not None and is_remote(str(value)):
                raise ValueError(f"{key}: {value} is a URL; token shards are indexed in a local folder this release")
        object.__setattr__(self, "source", Path(self.source))
        object.__setattr__(self, "dest", Path(self.dest) if self.dest is not None else None)
        if isinstance(self.eos_id, bool) or not isinstance(self.eos_id, int) or self.eos_id < 0:
            raise ValueError(f"eos_id must be a token id (an integer >= 0), got {self.eos_id!r}")


@dataclass(frozen=True)
class TokenIndexResult:
    dest: Path
    shards: int
    documents: int
    tokens: int
    dtype: str
    seconds: float

    def summary(self) -> str:
        return (f"{self.dest}: indexed {count(self.shards, 'shard')}, {count(self.documents, 'document')}, "
                f"{self.tokens} {self.dtype} tokens in {self.seconds:.1f}s (nothing copied)")


def _pairs(source: Path) -> list[Path]:
    """The ``.bin`` of every pair directly in ``source``, sorted; a file without its partner is refused."""
    if not source.is_dir():
        raise DatasetError(f"{source}: no such folder")
    names = sorted(e.name for e in os.scandir(source) if e.name.endswith((".bin", ".idx")) and e.is_file())
    for name in names:
        if partner_path(Path(name)).name not in names:
            raise DatasetError(f"{source / name}: has no partner {partner_path(Path(name)).name} (a Megatron shard "
                               "is a .bin and its .idx)")
    bins = [source / n for n in names if n.endswith(".bin")]
    if not bins:
        raise DatasetError(f"{source}: holds no Megatron .bin/.idx pairs")
    bad = next((b for b in bins if not is_shard_name(b.name)), None)
    if bad is not None:
        raise DatasetError(f"{bad}: a shard name fastio cannot record (letters, digits, '_', '-', '.')")
    return bins


def _check_pair(bin_path: Path, dtype: str | None, eos_id: int) -> MegatronShard:
    pair = MegatronShard(bin_path, dtype)
    pair.index.check_structure()
    if eos_id > np.iinfo(pair.dtype).max:
        raise DatasetError(f"{pair.idx_path}: holds {pair.dtype} tokens, which cannot hold eos_id {eos_id}")
    edges = pair.index.starts(np.arange(pair.documents + 1))
    docs = np.flatnonzero(edges[1:] > edges[:-1])
    last = pair.tokens(0, pair.index.tokens)[edges[docs + 1] - 1] if docs.size else docs
    wrong = np.flatnonzero(last != eos_id)
    if wrong.size:
        j = int(docs[wrong[0]])
        raise DatasetError(f"{bin_path}: document {j} ends with token {int(last[wrong[0]])}, not eos_id {eos_id} "
                           "(documents are taken as they are: each must end with its end-of-document token)")
    return pair


def _record(pair: MegatronShard, dest: Path, source: Path) -> ShardRecord:
    size, digests = digests_file(pair.bin_path, ("sha256", "xxh3_128"))
    if dest.resolve() == source.resolve():
        location, idx_location = pair.bin_path.name, pair.idx_path.name
    else:
        location, idx_location = str(pair.bin_path.resolve()), str(pair.idx_path.resolve())
    if not (is_location(location) and is_location(idx_location)):
        raise DatasetError(f"{pair.bin_path}: a path the manifest cannot hold (control characters)")
    return ShardRecord(name=pair.bin_path.name, samples=pair.documents, bytes=size, sha256=digests["sha256"],
                       idx_sha256=sha256_file(pair.idx_path)[1], xxh3_128=digests["xxh3_128"], location=location,
                       idx_location=idx_location, tokens=pair.index.tokens)


def _check_dest(config: TokenIndexConfig, dest: Path) -> None:
    if (dest / MANIFEST_NAME).exists() and not config.overwrite:
        raise DatasetError(f"{dest}: already holds a manifest; pass overwrite=True to index again")
    if config.dest is not None and dest.is_dir() and not (dest / MARKER_NAME).exists() and any(
            p.name != ".fastio-lock" for p in dest.iterdir()):
        raise DatasetError(f"{dest}: dest is not empty and is not fastio's")


def index_tokens(config: TokenIndexConfig) -> TokenIndexResult:
    """Index the pairs of ``config.source`` (see the module docstring)."""
    started = time.perf_counter()
    dest = config.dest or config.source
    bins = _pairs(config.source)
    _check_dest(config, dest)
    lock = DirLock(dest, purpose="fastio index")
    try:
        lock.acquire()
    except LockedError as err:
        raise DatasetError(str(err)) from None
    try:
        _check_dest(config, dest)
        dtype, records, one = None, [], True
        for b in bins:
            try:
                pair = _check_pair(b, dtype, config.eos_id)
                dtype, one = pair.dtype, one and pair.index.is_one_per_document()
                records.append(_record(pair, dest, config.source))
            except OSError as err:
                raise DatasetError(f"{err.filename or b}: {err.strerror or err}") from None
        if config.dest is not None:
            atomic_write_bytes(dest / MARKER_NAME, b"fastio index output; complete once manifest.json exists\n")
        info = TokenInfo(dtype=dtype, eos_id=config.eos_id, total_tokens=sum(r.tokens for r in records),
                         one_sequence_per_document=one)
        write_manifest(dest, make_manifest(name=config.name, shards=records, fields=[], kind="tokens", tokens=info,
                                           converted_from={"format": "megatron", "path": str(config.source.resolve())}))
    finally:
        lock.release()
    return TokenIndexResult(dest=dest, shards=len(records), documents=sum(r.samples for r in records),
                            tokens=info.total_tokens, dtype=dtype, seconds=time.perf_counter() - started)
