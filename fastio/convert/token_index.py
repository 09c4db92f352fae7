"""``fastio index DIR_OR_S3_PREFIX --eos-id N``: existing Megatron ``.bin``/``.idx`` pairs become a token dataset.

Every ``*.bin`` and ``*.idx`` directly in the folder or ``s3://`` prefix (sorted by name; hidden ones left out) is
taken as one shard. Each pair is checked as it is (:mod:`fastio.formats.megatron`: header, token type the same for
all, sizes, the ``.idx`` structure), every document must end with ``eos_id`` (Megatron's preprocessing appends its
end-of-document token; ``eos_id`` says which id it is), no id may be negative or, where ``vocab_size`` is given, at
least ``vocab_size``, the ids must not be int32 tokens read as uint16 (:mod:`fastio.tokens.ids`), and both files are
checksummed. The manifest records the largest id (``tokens.max_id``: what a model's embedding needs where
``vocab_size`` is not given) and ``vocab_size``.
Nothing is copied or rewritten: the document-starts table (:mod:`fastio.tokens.starts`) and then the manifest
(``kind: "tokens"``), which names the files where they are, relative to DEST (DEST = SOURCE) or by absolute path or
URL (``dest`` elsewhere, for read-only data: pairs on ``s3://`` go to an ``s3://`` DEST, local pairs to a local
one), and is published last, under DEST's lock (a local folder) or lease (an ``s3://`` prefix). On ``s3://`` the
listing, the ranged reads and the manifest's upload are :mod:`fastio.storage`'s, as ``fastio index`` of WebDataset
shards does: each ``.idx`` is downloaded into a temporary folder (ranged GETs; removed after), each ``.bin`` is
streamed in ranges (checksums and the end-of-document check on the way; never written to disk). Hostile input is
refused in one :class:`~fastio.errors.DatasetError` naming the file or URL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastio.checks import check_fields, checked, config_error, positive_integer, rule
from fastio.checks import count as count_problem
from fastio.convert.dest import check_index_dest, mark_index_dest, publish_uploads, refuse_a_datasets_shards, writer_lock
from fastio.convert.scratch import INDEX_SCRATCH, scratch_dir
from fastio.dataset.manifest import (
    MANIFEST_NAME,
    ShardRecord,
    TokenInfo,
    is_location,
    is_shard_name,
    make_manifest,
    write_manifest,
)
from fastio.errors import DatasetError, StorageError
from fastio.formats.megatron import MegatronIndex, partner_path
from fastio.progress import count
from fastio.storage import open_storage
from fastio.storage.base import Storage
from fastio.storage.checksum import CHUNK, DIGESTS, sha256_file
from fastio.storage.lease import Lease, LeaseLostError
from fastio.storage.lock import DirLock, LockedError
from fastio.storage.options import StorageOptions
from fastio.storage.url import dest_location, refuse_empty
from fastio.tokens.ids import IdScan
from fastio.tokens.starts import STARTS_NAME, shard_starts, write_starts

__all__ = ["TokenIndexConfig", "TokenIndexResult", "index_tokens"]

_RANGE = 4 * CHUNK
"""Bytes of a ``.bin`` read per ranged request (16 MiB)."""
_AHEAD = 4
"""Ranged requests of a ``.bin`` in flight at once."""


@dataclass(frozen=True)
class TokenIndexConfig:
    """Options of :func:`index_tokens`, checked at construction (a ``ValueError`` names the parameter)."""

    source: str | Path
    """The folder or ``s3://`` prefix holding the ``.bin``/``.idx`` pairs."""
    eos_id: int = checked(rule(lambda v: count_problem(v) is None, "must be a token id (an integer >= 0)"))
    """The end-of-document id every document ends with."""
    dest: str | Path | None = None
    """Where the manifest goes (default: ``source``); elsewhere, the manifest names the pairs by absolute path or
    URL (pairs on ``s3://``: an ``s3://`` DEST; local pairs: a local one; SOURCE's folder however spelled is
    SOURCE)."""
    name: str = "megatron"
    """The dataset's name in the manifest."""
    overwrite: bool = False
    """Index again where a manifest exists."""
    storage_options: StorageOptions | dict | None = None
    """Endpoint, region and credentials for ``s3://`` (see :class:`fastio.storage.StorageOptions`)."""
    vocab_size: int | None = checked(rule(lambda v: positive_integer(v) is None, "must be a number of ids (an integer "
                                          ">= 1)"), default=None)
    """The tokenizer's size (its largest id + 1), where known: recorded in the manifest, and an id at or above it is
    refused (None: not known; the manifest records the largest id seen either way)."""

    def __post_init__(self) -> None:
        refuse_empty(self.source)  # "$SRC" of an unset variable: the one message naming the way out
        if not str(self.source).strip():
            raise ValueError("source: empty")
        check_fields(self, config_error)
        vocab = self.vocab_size
        if vocab is not None and vocab <= self.eos_id:
            raise ValueError(f"vocab_size {vocab} does not include the end-of-document id {self.eos_id} (ids run "
                             f"from 0 to {vocab - 1})")


@dataclass(frozen=True)
class TokenIndexResult:
    dest: str | Path
    shards: int
    documents: int
    tokens: int
    dtype: str
    seconds: float
    max_id: int | None = None
    """The largest id (None: no tokens)."""

    def summary(self) -> str:
        largest = "" if self.max_id is None else f" (largest id {self.max_id})"
        return (f"{self.dest}: indexed {count(self.shards, 'shard')}, {count(self.documents, 'document')}, "
                f"{count(self.tokens, f'{self.dtype} token')}{largest} in {self.seconds:.1f}s (nothing copied)")


@dataclass(frozen=True)
class _Pair:
    """One ``.bin``/``.idx`` pair of the listing: keys in SOURCE's storage and sizes."""

    bin_key: str
    bin_size: int
    idx_key: str
    idx_size: int


def _display(storage: Storage, key: str) -> str:
    """How messages and a manifest elsewhere name a file: its URL, or its absolute path."""
    return storage.url_of(key) if storage.remote else os.path.abspath(storage.location.path / key)


def _listing(storage: Storage, source: str) -> dict[str, int]:
    """Size of every file (object) directly in SOURCE whose name ends with ``.bin`` or ``.idx``, hidden ones left
    out (temporaries, macOS's ``._NAME``), as :mod:`fastio.convert.listing` does."""
    if storage.remote:
        return {o.key: o.size for o in storage.list("") if "/" not in o.key and _pair_file(o.key)}
    root = storage.location.path
    if not root.is_dir():
        raise DatasetError(f"{source}: {_not_a_folder(root)}")
    return {e.name: e.stat().st_size for e in os.scandir(root) if _pair_file(e.name) and e.is_file()}


def _not_a_folder(root: Path) -> str:
    """Why a local SOURCE that is not a folder is refused: a file or Megatron data prefix (``--data-path
    data/web_text_document``) is named with its folder, which is what fastio index takes."""
    stem = root.with_suffix("") if root.suffix in (".bin", ".idx") else root
    if root.is_file() or Path(f"{stem}.bin").is_file() or Path(f"{stem}.idx").is_file():
        kind = "a file" if root.is_file() else "a Megatron data prefix"
        return (f"{kind}, not a folder: fastio index takes the folder holding the .bin/.idx pairs (each pair directly "
                f"in it becomes a shard): give its folder, {root.parent}")
    return "no such folder"


def _pair_file(name: str) -> bool:
    return name.endswith((".bin", ".idx")) and not name.startswith(".")


def _pairs(storage: Storage, source: str) -> list[_Pair]:
    """Every pair directly in SOURCE, sorted; a file without its partner is refused naming it."""
    sizes = _listing(storage, source)
    for name in sorted(sizes):
        if partner_path(Path(name)).name not in sizes:
            raise DatasetError(f"{_display(storage, name)}: has no partner {partner_path(Path(name)).name} (a "
                               "Megatron shard is a .bin and its .idx)")
    bins = sorted(n for n in sizes if n.endswith(".bin"))
    if not bins:
        raise DatasetError(f"{source}: holds no Megatron .bin/.idx pairs")
    bad = next((b for b in bins if not is_shard_name(b)), None)
    if bad is not None:
        raise DatasetError(f"{_display(storage, bad)}: a shard name fastio cannot record (letters, digits, '_', '-', "
                           "'.')")
    return [_Pair(b, sizes[b], partner_path(Path(b)).name, sizes[partner_path(Path(b)).name]) for b in bins]


@contextmanager
def _local_idx(storage: Storage, pair: _Pair, tmp: Path) -> Iterator[Path]:
    """The pair's ``.idx`` as a local file: the file itself, or a download (ranged GETs) removed afterwards."""
    if not storage.remote:
        yield storage.location.path / pair.idx_key
        return
    path = tmp / pair.idx_key
    try:
        storage.get_to_file(pair.idx_key, path, pair.idx_size)
        yield path
    finally:
        path.unlink(missing_ok=True)


class _LastTokens:
    """Each document's last token checked against ``eos_id`` as the ``.bin`` goes by (:meth:`see` its ranges in
    order); the documents' ends come :data:`~fastio.formats.megatron.CHECK_CHUNK` at a time (bounded memory).
    ``wrong``: the first document that ends otherwise and its last token (None: none)."""

    def __init__(self, index: MegatronIndex, eos_id: int):
        self.eos_id, self.item = eos_id, index.itemsize
        self.wrong: tuple[int, int] | None = None
        self._chunks = self._ends(index)
        self._docs = self._at = np.zeros(0, np.int64)  # documents pending, the byte offset of each one's last token

    def _ends(self, index: MegatronIndex) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo, edges in index.edge_chunks():
            docs = np.flatnonzero(edges[1:] > edges[:-1])  # documents that hold tokens
            yield docs + lo, (edges[docs + 1] - 1) * self.item

    def see(self, start: int, tokens: np.ndarray) -> None:
        """Check the documents whose last token is in ``tokens`` (the ``.bin`` from byte ``start``)."""
        stop = start + tokens.size * self.item
        while True:
            if not self._at.size:
                self._docs, self._at = next(self._chunks, (None, None))
                if self._at is None:
                    self._docs = self._at = np.zeros(0, np.int64)
                    return
            k = int(np.searchsorted(self._at, stop))
            last = tokens[(self._at[:k] - start) // self.item]
            bad = np.flatnonzero(last != self.eos_id)
            if bad.size and self.wrong is None:
                self.wrong = (int(self._docs[bad[0]]), int(last[bad[0]]))
            self._docs, self._at = self._docs[k:], self._at[k:]
            if self._at.size:
                return


def _scan_bin(storage: Storage, pair: _Pair, ends: _LastTokens, ids: IdScan, dtype: str) -> dict[str, str]:
    """sha256 and xxh3-128 of the ``.bin``, each range shown to ``ends`` (the end-of-document check) and ``ids``: the
    file read once, in ranges of ``_RANGE`` bytes (``_AHEAD`` in flight), nothing written to disk."""
    item = np.dtype(dtype).itemsize
    hashes = {a: DIGESTS[a]() for a in ("sha256", "xxh3_128")}
    starts = list(range(0, pair.bin_size, _RANGE))

    def fetch(start: int) -> bytes:
        return storage.get(pair.bin_key, start, min(start + _RANGE, pair.bin_size))

    with ThreadPoolExecutor(_AHEAD) as pool:
        pending = [pool.submit(fetch, s) for s in starts[:_AHEAD]]
        for i, start in enumerate(starts):
            data = pending[i].result()
            if i + _AHEAD < len(starts):
                pending.append(pool.submit(fetch, starts[i + _AHEAD]))
            pending[i] = None
            if len(data) != min(_RANGE, pair.bin_size - start):
                raise DatasetError(f"{_display(storage, pair.bin_key)}: shorter than listed "
                                   f"({count(pair.bin_size, 'byte')}): changed while it was indexed")
            for h in hashes.values():
                h.update(data)
            tokens = np.frombuffer(data, dtype)
            ends.see(start, tokens)
            ids.see(start // item, tokens)
    return {a: h.hexdigest() for a, h in hashes.items()}


@dataclass(frozen=True)
class _Checked:
    """What :func:`_check_pair` found of a pair."""

    index: MegatronIndex
    digests: dict[str, str]
    """The ``.bin``'s sha256 and xxh3-128."""
    idx_sha256: str
    one_per_document: bool
    starts: np.ndarray
    """Its entries of the document-starts table."""
    max_id: int | None
    """Its largest id (None: no tokens)."""


def _check_pair(storage: Storage, pair: _Pair, dtype: str | None, config: TokenIndexConfig, tmp: Path) -> _Checked:
    """The pair checked (see the module docstring), and what the manifest and the starts table need of it."""
    eos_id = config.eos_id
    bin_name = _display(storage, pair.bin_key)
    with _local_idx(storage, pair, tmp) as idx_path:
        index = MegatronIndex(idx_path, dtype, name=_display(storage, pair.idx_key))
        index.check_bin(pair.bin_size, bin_name)
        index.check_structure()
        if eos_id > np.iinfo(index.dtype).max:
            raise DatasetError(f"{index.name}: holds {index.dtype} tokens, which cannot hold eos_id {eos_id}")
        one, starts = index.is_one_per_document(), shard_starts(index)
        idx_sha256 = sha256_file(idx_path)[1]
        ends, ids = _LastTokens(index, eos_id), IdScan(config.vocab_size)
        digests = _scan_bin(storage, pair, ends, ids, index.dtype)
        problem = next(ids.problems(index), None)  # an id out of range: an embedding lookup's assert, far away
        if problem is not None:
            raise DatasetError(f"{bin_name}: {problem}")
    if ends.wrong is not None:
        raise DatasetError(f"{bin_name}: document {ends.wrong[0]} ends with token {ends.wrong[1]}, not eos_id {eos_id} "
                           "(documents are taken as they are: each must end with its end-of-document token; Megatron's "
                           "preprocess_data.py appends it only with --append-eod: made without it, make the pairs "
                           "again with it)")
    return _Checked(index, digests, idx_sha256, one, starts, ids.high)


def _record(storage: Storage, pair: _Pair, got: _Checked, in_place: bool) -> ShardRecord:
    if in_place:
        location, idx_location = pair.bin_key, pair.idx_key
    else:
        location, idx_location = _display(storage, pair.bin_key), _display(storage, pair.idx_key)
    if not (is_location(location) and is_location(idx_location)):
        raise DatasetError(f"{_display(storage, pair.bin_key)}: a path the manifest cannot hold (control characters)")
    return ShardRecord(name=pair.bin_key, samples=got.index.documents, bytes=pair.bin_size,
                       sha256=got.digests["sha256"], idx_sha256=got.idx_sha256, xxh3_128=got.digests["xxh3_128"],
                       location=location, idx_location=idx_location, tokens=got.index.tokens)


def _open(config: TokenIndexConfig) -> tuple[Storage, Storage, bool]:
    """SOURCE's storage, DEST's, and whether DEST is SOURCE; DatasetError for a DEST that cannot take the index."""
    source = open_storage(str(config.source), config.storage_options)
    dest = source if config.dest is None else open_storage(dest_location(str(config.dest)), config.storage_options)
    in_place = dest.url == source.url or not (source.remote or dest.remote) and _same_folder(source, dest)
    if not in_place and source.remote and not dest.remote:
        raise DatasetError(f"{config.dest}: pairs on an object store are indexed into an s3:// DEST (or in place)")
    if dest.remote and not source.remote:  # its readers refuse a local path (they read shards from the store)
        raise DatasetError(f"{config.dest}: an s3:// DEST cannot name pairs on this machine's disk (upload them, then "
                           "index the s3:// prefix)")
    return source, dest, in_place


def _same_folder(a: Storage, b: Storage) -> bool:
    """Whether two local storages are one folder however spelled (``data/``, ``./data``, a link to it)."""
    return os.path.realpath(a.location.path) == os.path.realpath(b.location.path)


def _check_dest(config: TokenIndexConfig, dest: Storage, in_place: bool) -> None:
    refuse_a_datasets_shards(dest)
    if not in_place:  # first: a DEST that cannot be a folder is named as such
        check_index_dest(dest, config.overwrite)
    if dest.exists(MANIFEST_NAME) and not config.overwrite:
        raise DatasetError(f"{dest.url}: already holds a manifest; pass overwrite=True to index again")


def index_tokens(config: TokenIndexConfig) -> TokenIndexResult:
    """Index the pairs of ``config.source`` (see the module docstring)."""
    started = time.perf_counter()
    try:
        source, dest, in_place = _open(config)
        pairs = _pairs(source, str(config.source))
        _check_dest(config, dest, in_place)
        lock = writer_lock(dest, "fastio index")
        try:
            if lock is not None:
                lock.acquire()
            _check_dest(config, dest, in_place)
            info, records = _index_pairs(config, source, dest, pairs, in_place, lock)
        except (LockedError, LeaseLostError) as err:
            raise DatasetError(str(err)) from None
        finally:
            if lock is not None:
                lock.release()
    except StorageError as err:
        raise DatasetError(str(err)) from None
    except OSError as err:
        raise DatasetError(f"{err.filename or config.source}: {err.strerror or err}") from None
    return TokenIndexResult(dest=dest.url if dest.remote else dest.location.path, shards=len(records),
                            documents=sum(r.samples for r in records), tokens=info.total_tokens, dtype=info.dtype,
                            seconds=time.perf_counter() - started, max_id=info.max_id)


def _index_pairs(config: TokenIndexConfig, source: Storage, dest: Storage, pairs: list[_Pair], in_place: bool,
                 lock: DirLock | Lease | None) -> tuple[TokenInfo, list[ShardRecord]]:
    """Check and record every pair, then publish the document-starts table and the manifest (last) into DEST."""
    dtype, records, one, starts, highs = None, [], True, [], []
    with scratch_dir(INDEX_SCRATCH) as tmp:
        for pair in pairs:
            got = _check_pair(source, pair, dtype, config, tmp)
            dtype, one = got.index.dtype, one and got.one_per_document
            records.append(_record(source, pair, got, in_place))
            starts.append(got.starts)
            highs += [] if got.max_id is None else [got.max_id]
        staged = tmp / "out"
        staged.mkdir()
        info = TokenInfo(dtype=dtype, eos_id=config.eos_id, total_tokens=sum(r.tokens for r in records),
                         vocab_size=config.vocab_size, one_sequence_per_document=one,
                         starts=write_starts(staged, starts), max_id=max(highs, default=None))
        where = source.url if source.remote else str(source.location.path.resolve())
        write_manifest(staged, make_manifest(name=config.name, shards=records, fields=[], kind="tokens", tokens=info,
                                             converted_from={"format": "megatron", "path": where}))
        confirm = lock.confirm if isinstance(lock, Lease) else (lambda: None)
        if not in_place:
            mark_index_dest(dest, confirm)
        confirm()
        publish_uploads(dest, [(STARTS_NAME, staged / STARTS_NAME), (MANIFEST_NAME, staged / MANIFEST_NAME)])
    return info, records
