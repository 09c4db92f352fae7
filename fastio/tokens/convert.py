"""``fastio convert SOURCE DEST --tokenizer tokenizer.json``: text documents into a token dataset.

Documents (:mod:`fastio.converters.documents`: JSONL, Parquet, plain text) are tokenized in batches with the
``tokenizers`` library (the file's own tokenizer, no special tokens added), in worker processes
(:class:`~fastio.convert.workers.OrderedPool`: results in input order), and each non-empty one is written with the
end-of-document token appended, in input order, into ``DEST/shards/NAME-NNNNNN.bin`` + ``.idx`` (Megatron's format,
:mod:`fastio.tokens.megatron`). A shard is cut when the next document would take its ``.bin`` past ``shard_size``
bytes or it holds ``max_samples_per_shard`` documents. Empty documents are skipped and counted. The manifest
(``kind: "tokens"``, checksums of every file, token type, end-of-document id, vocabulary size, per-shard document
and token counts) is published last; DEST's life cycle and its one-writer lock are those of
:func:`fastio.convert.run.convert` (marker first, lock held throughout, a rerun redoes an interrupted DEST).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from fastio.convert.run import DEFAULT_SHARD_SIZE, _default_workers, check_dest, reset_dest
from fastio.convert.workers import OrderedPool
from fastio.converters.documents import document_files, iter_documents
from fastio.dataset.manifest import SHARDS_DIR, Manifest, ShardRecord, TokenInfo, make_manifest, write_manifest
from fastio.errors import ConvertError
from fastio.formats.wds import is_plain_name
from fastio.progress import count, human_bytes, parse_size
from fastio.storage import is_remote
from fastio.storage.lock import DirLock, LockedError
from fastio.tokens.megatron import MegatronWriter, WrittenShard, token_dtype

__all__ = ["EOS_NAMES", "TokenConvertConfig", "TokenConvertResult", "convert_tokens", "eos_token_id",
           "load_tokenizer"]

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
"""Special tokens taken as the end-of-document token when ``eos`` is not given, in this order of preference."""


@dataclass(frozen=True)
class TokenConvertConfig:
    """A token conversion's options, checked at construction (a ``ValueError`` names the parameter)."""

    source: Path
    """A document file or a folder of them."""
    dest: Path
    """The dataset folder to write."""
    tokenizer: Path
    """A Hugging Face ``tokenizer.json``."""
    text_field: str = "text"
    """JSONL field / Parquet column holding each document's text."""
    eos: str | None = None
    """End-of-document token (default: the tokenizer's end-of-text token, :data:`EOS_NAMES`)."""
    workers: int = field(default_factory=_default_workers)
    """Tokenizing processes (1: in this process)."""
    shard_size: int | str = DEFAULT_SHARD_SIZE
    """Largest ``.bin`` in bytes (or human units: ``256MB``)."""
    max_samples_per_shard: int | None = None
    """At most this many documents per shard."""
    name: str = "shard"
    """Shard file prefix: ``shards/NAME-000000.bin``."""
    overwrite: bool = False
    """Replace a dataset or other files in DEST."""
    batch_size: int = 256
    """Documents per ``encode_batch`` call (and per message to a worker)."""

    def __post_init__(self) -> None:
        if is_remote(str(self.dest)):
            raise ValueError(f"dest: {self.dest} is a URL; a token conversion writes a local folder (upload it "
                             "afterwards)")
        for key in ("source", "dest", "tokenizer"):
            object.__setattr__(self, key, Path(getattr(self, key)))
        object.__setattr__(self, "shard_size", parse_size(self.shard_size, "shard_size"))
        for key in ("workers", "batch_size"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        limit = self.max_samples_per_shard
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_samples_per_shard must be a positive integer, got {limit!r}")
        if not is_plain_name(self.name):
            raise ValueError(f"name must be letters, digits, '_' or '-', got {self.name!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field must be a field name, got {self.text_field!r}")


@dataclass(frozen=True)
class TokenConvertResult:
    """What :func:`convert_tokens` wrote."""

    dest: Path
    shards: int
    documents: int
    tokens: int
    empty: int
    """Empty documents skipped."""
    bytes: int
    seconds: float
    dtype: str
    eos_id: int

    def summary(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        return (f"{self.dest}: {count(self.documents, 'document')}, {self.tokens} {self.dtype} tokens "
                f"({human_bytes(self.bytes)}) in {count(self.shards, 'shard')}; {count(self.empty, 'empty document')}"
                f" skipped; end of document: id {self.eos_id}; {self.seconds:.1f}s ({rate:.0f} tokens/s)")


# -- the tokenizer ------------------------------------------------------------------------------------

def load_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` (ConvertError naming the file otherwise)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConvertError("tokenizers is not installed: pip install 'fastio[tokens]'") from None
    if not Path(path).is_file():
        raise ConvertError(f"{path}: no such tokenizer file (a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the Rust side raises a bare Exception)
        raise ConvertError(f"{path}: not a tokenizer.json ({str(err).splitlines()[0][:200]})") from None


def eos_token_id(tokenizer, eos: str | None, path: Path) -> int:
    """The id of ``eos``, or of the tokenizer's end-of-text token (:data:`EOS_NAMES`) when ``eos`` is None."""
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise ConvertError(f"{path}: has no token {eos!r} (eos={eos!r})")
        return token_id
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    found = next((specials[n] for n in EOS_NAMES if n in specials), None)
    if found is None:
        have = ", ".join(sorted(specials)) or "none"
        raise ConvertError(f"{path}: no end-of-text token among its special tokens ({have}); name the "
                           "end-of-document token with eos=TOKEN")
    return found


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Path, eos_id: int, dtype: str) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer), eos_id=eos_id, dtype=np.dtype(dtype))


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens per document, all tokens): each non-empty document's ids + the end-of-document id; an empty
    document has length 0."""
    encodings = _WORKER["tokenizer"].encode_batch(texts, add_special_tokens=False)
    eos, dtype = _WORKER["eos_id"], _WORKER["dtype"]
    docs = [e.ids + [eos] if e.ids else [] for e in encodings]
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    return lengths, np.fromiter(chain.from_iterable(docs), dtype, int(lengths.sum()))


# -- writing ------------------------------------------------------------------------------------------

class _ShardSeries:
    """Shards ``NAME-NNNNNN.bin`` one after another, cut by size and document count."""

    def __init__(self, config: TokenConvertConfig, dtype: str):
        self.config, self.dtype, self.itemsize = config, dtype, np.dtype(dtype).itemsize
        self.written: list[WrittenShard] = []
        self.writer: MegatronWriter | None = None

    def add(self, tokens: np.ndarray) -> None:
        w, limit = self.writer, self.config.max_samples_per_shard
        if w is not None and (limit is not None and w.documents >= limit
                              or w.bytes + tokens.size * self.itemsize > self.config.shard_size):
            self.written.append(w.close())
            w = None
        if w is None:
            name = f"{self.config.name}-{len(self.written):06d}.bin"
            w = self.writer = MegatronWriter(self.config.dest / SHARDS_DIR / name, self.dtype)
        w.add(tokens)

    def close(self) -> list[WrittenShard]:
        if self.writer is not None:
            self.written.append(self.writer.close())
            self.writer = None
        return self.written

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def _batches(config: TokenConvertConfig) -> Iterator[list[str]]:
    docs = (text for _, text in iter_documents(config.source, config.text_field))
    while batch := list(islice(docs, config.batch_size)):
        yield batch


def _encoded(config: TokenConvertConfig, eos_id: int, dtype: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    args = (config.tokenizer, eos_id, dtype)
    if config.workers == 1:
        _init_worker(*args)
        yield from map(_encode, _batches(config))
        return
    with OrderedPool(_encode, config.workers, initializer=_init_worker, initargs=args) as pool:
        yield from pool.map(_batches(config))


def _write(config: TokenConvertConfig, eos_id: int, dtype: str) -> tuple[list[WrittenShard], int]:
    """Every document into shards, in input order; (the shards, empty documents skipped)."""
    series, empty = _ShardSeries(config, dtype), 0
    (config.dest / SHARDS_DIR).mkdir()
    try:
        for lengths, flat in _encoded(config, eos_id, dtype):
            ends = np.cumsum(lengths)
            for end, n in zip(ends.tolist(), lengths.tolist()):
                if n == 0:
                    empty += 1
                else:
                    series.add(flat[end - n:end])
        return series.close(), empty
    except BaseException:
        series.abort()
        raise


def _manifest(config: TokenConvertConfig, shards: list[WrittenShard], empty: int, info: TokenInfo,
              files: int) -> Manifest:
    records = [ShardRecord(name=s.bin_path.name, samples=s.documents, bytes=s.bin_bytes, sha256=s.bin_sha256,
                           idx_sha256=s.idx_sha256, xxh3_128=s.bin_xxh3_128, tokens=s.tokens) for s in shards]
    return make_manifest(
        name=config.name, shards=records, fields=[], kind="tokens", tokens=info,
        converted_from={"format": "documents", "path": str(config.source), "files": files, "empty_documents": empty},
        convert_options={"tokenizer": str(config.tokenizer), "text_field": config.text_field, "eos": config.eos,
                         "shard_size": config.shard_size, "max_samples_per_shard": config.max_samples_per_shard})


def convert_tokens(config: TokenConvertConfig) -> TokenConvertResult:
    """Tokenize ``config.source`` into a token dataset in ``config.dest`` (see the module docstring)."""
    started = time.perf_counter()
    tokenizer = load_tokenizer(config.tokenizer)
    eos_id = eos_token_id(tokenizer, config.eos, config.tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    files = document_files(config.source)  # refusals before DEST is touched
    check_dest(config.dest, config.source, config.overwrite)
    lock = DirLock(config.dest, purpose="fastio convert")
    try:
        lock.acquire()
    except LockedError as err:
        raise ConvertError(str(err)) from None
    except OSError as err:
        raise ConvertError(f"{err.filename or config.dest}: {err.strerror or err}") from None
    try:
        check_dest(config.dest, config.source, config.overwrite)  # again, under the lock
        reset_dest(config.dest)
        shards, empty = _write(config, eos_id, dtype)
        if not shards:
            raise ConvertError(f"{config.source}: holds no document with text ({count(empty, 'empty document')})")
        info = TokenInfo(dtype=dtype, eos_id=eos_id, total_tokens=sum(s.tokens for s in shards), vocab_size=vocab_size)
        write_manifest(config.dest, _manifest(config, shards, empty, info, len(files)))
    except OSError as err:  # DEST unwritable, disk full, a source file unreadable mid-run
        raise ConvertError(f"{err.filename or config.dest}: {err.strerror or err}") from None
    finally:
        lock.release()
    return TokenConvertResult(dest=config.dest, shards=len(shards), documents=sum(s.documents for s in shards),
                              tokens=info.total_tokens, empty=empty, bytes=sum(s.bin_bytes for s in shards),
                              seconds=time.perf_counter() - started, dtype=dtype, eos_id=eos_id)

