"""``fastio convert SOURCE DEST --tokenizer tokenizer.json``: text documents into a token dataset.

Documents (:mod:`fastio.converters.documents`: JSONL, Parquet, plain text; a local file or folder, or an ``s3://``
object or prefix read through :mod:`fastio.convert.corpus`, in sorted key order) are tokenized in batches with the
``tokenizers`` library (the file's own tokenizer, no special tokens added), in worker processes
(:class:`~fastio.convert.workers.OrderedPool`: results in input order), and each non-empty one is written with the
end-of-document token appended, in input order, into ``DEST/shards/NAME-NNNNNN.bin`` + ``.idx`` (Megatron's format,
:mod:`fastio.formats.megatron`). A shard is cut when the next document would take its ``.bin`` past ``shard_size``
bytes or it holds ``max_samples_per_shard`` documents. Empty documents are skipped and counted. Then the
document-starts table (``DEST/doc-starts.fxs``, :mod:`fastio.tokens.starts`); the manifest
(``kind: "tokens"``, checksums of every file, token type, end-of-document id, vocabulary size, per-shard document
and token counts) is published last; DEST's life cycle and its one-writer lock are those of
:func:`fastio.convert.run.convert` (marker first, lock held throughout, a rerun redoes an interrupted DEST); a
refused run (bad input, a full disk) takes back what it made in DEST (:class:`_Claim`).

Special tokens. The end-of-document token must be one of the tokenizer's special tokens, and no document holds a
special token's id: a document whose text holds a special token's string (``<|endoftext|>`` in web text) is
encoded again with ``encode_special_tokens`` (the string as plain text; counted), or refused with
``special_in_text="refuse"`` (naming the document). The token type fits the largest id the tokenizer has (a
vocabulary with a hole up to id 70,000 is ``int32``); the manifest's vocabulary size is that id + 1.

With ``part`` (K, N), only the documents of part K's span of the listing (:func:`fastio.convert.corpus.part_span`)
are tokenized, into ``DEST/.parts/part-K-of-N/`` (its own lock; ``part.json`` last, holding the part's shard
records and the plan every part must share: source listing, options, tokenizer checksum, end-of-document id);
``fastio merge DEST`` (:mod:`fastio.convert.token_merge`) then publishes the dataset a single conversion writes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from fastio.convert.corpus import Corpus, open_corpus, part_span
from fastio.convert.dest import check_dest, lock_dest, lock_parts, reset_dest, upload_dataset
from fastio.convert.parts import (
    PartRecord,
    clear_part_dir,
    parse_part,
    part_dir,
    start_part_dir,
    write_part_record,
)
from fastio.convert.run import DEFAULT_SHARD_SIZE
from fastio.convert.workers import OrderedPool, default_workers
from fastio.dataset.manifest import (
    SHARDS_DIR,
    IndexRecord,
    Manifest,
    ShardRecord,
    TokenInfo,
    make_manifest,
    write_manifest,
)
from fastio.errors import ConvertError
from fastio.formats.megatron import MegatronIndex, MegatronWriter, WrittenShard, token_dtype
from fastio.formats.wds import is_plain_name
from fastio.progress import count, human_bytes, parse_size
from fastio.storage import is_remote
from fastio.storage.checksum import sha256_file
from fastio.storage.lock import LOCK_NAME, DirLock
from fastio.tokens.starts import shard_starts, write_starts

__all__ = ["EOS_NAMES", "SPECIAL_IN_TEXT", "TOKEN_PLAN", "TokenConvertConfig", "TokenConvertResult", "convert_tokens",
           "eos_token_id", "load_tokenizer", "shard_record", "special_tokens", "starts_new_token_shard", "token_manifest",
           "token_shard_cuts"]

TOKEN_PLAN = "tokens"
"""``plan["kind"]`` of a token conversion's part records (:mod:`fastio.convert.token_merge` merges them)."""

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
"""Special tokens taken as the end-of-document token when ``eos`` is not given, in this order of preference."""

SPECIAL_IN_TEXT = ("plain", "refuse")
"""What a special token's string in document text becomes: plain text (the default), or a refusal."""


@dataclass(frozen=True)
class TokenConvertConfig:
    """A token conversion's options, checked at construction (a ``ValueError`` names the parameter)."""

    source: Path | str
    """A document file or a folder of them, or an ``s3://`` object or prefix (kept as a str)."""
    dest: Path | str
    """The dataset folder to write, or an ``s3://`` prefix (kept as a str: written in ``staging_dir``, then
    uploaded, the manifest last, as :func:`fastio.convert.run.convert` does)."""
    tokenizer: Path
    """A Hugging Face ``tokenizer.json``."""
    text_field: str = "text"
    """JSONL field / Parquet column holding each document's text."""
    eos: str | None = None
    """End-of-document token, one of the tokenizer's special tokens (default: its end-of-text token,
    :data:`EOS_NAMES`)."""
    workers: int = field(default_factory=default_workers)
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
    storage_options: dict | None = None
    """For an ``s3://`` source: endpoint, region, credentials over the environment's
    (:class:`fastio.storage.StorageOptions`)."""
    part: tuple[int, int] | str | None = None
    """``(K, N)``, ``"K/N"`` or ``"auto/N"`` (K from ``SLURM_ARRAY_TASK_ID``): tokenize only part K of N into
    ``DEST/.parts/`` for a later ``fastio merge``; None: the whole dataset."""
    staging_dir: Path | None = None
    """For an ``s3://`` DEST: where the dataset is written before its upload (:func:`fastio.convert.dest.staging_path`;
    default: the system's temporary directory)."""
    special_in_text: str = "plain"
    """A special token's string in a document's text (``<|endoftext|>``): ``"plain"`` encodes it as text (the
    documents counted), ``"refuse"`` is a ConvertError naming the document."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        for key in ("source", "dest"):
            if not is_remote(str(getattr(self, key))):
                object.__setattr__(self, key, Path(getattr(self, key)))
        if self.part is not None:
            object.__setattr__(self, "part", parse_part(self.part))
            if isinstance(self.dest, str):
                raise ValueError(f"part: needs a DEST on a (shared) file system, not {self.dest}; convert the "
                                 "parts there, merge, then upload")
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
        if self.special_in_text not in SPECIAL_IN_TEXT:
            raise ValueError(f"special_in_text must be 'plain' or 'refuse', got {self.special_in_text!r}")


@dataclass(frozen=True)
class TokenConvertResult:
    """What :func:`convert_tokens` wrote."""

    dest: Path | str
    shards: int
    documents: int
    tokens: int
    empty: int
    """Empty documents skipped."""
    bytes: int
    seconds: float
    dtype: str
    eos_id: int
    part: tuple[int, int] | None = None
    """(K, N) when this was one part of a conversion in parts."""
    special_text: int = 0
    """Documents whose text held a special token's string, encoded as plain text."""

    def summary(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        where = f"part {self.part[0]}/{self.part[1]} of {self.dest} (merge with fastio merge)" if self.part else self.dest
        special = (f"; {count(self.special_text, 'document')} with special-token text encoded as plain text"
                   if self.special_text else "")
        return (f"{where}: {count(self.documents, 'document')}, {self.tokens} {self.dtype} tokens "
                f"({human_bytes(self.bytes)}) in {count(self.shards, 'shard')}; {count(self.empty, 'empty document')}"
                f" skipped{special}; end of document: id {self.eos_id}; {self.seconds:.1f}s ({rate:.0f} tokens/s)")


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


def special_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens: content -> id."""
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def eos_token_id(tokenizer, eos: str | None, path: Path) -> int:
    """The id of ``eos``, or of the tokenizer's end-of-text token (:data:`EOS_NAMES`) when ``eos`` is None; either
    one of its special tokens (an ordinary word as ``eos`` would end every document that holds it)."""
    specials = special_tokens(tokenizer)
    have = ", ".join(sorted(specials)) or "none"
    if eos is not None:
        if eos not in specials:
            raise ConvertError(f"{path}: {eos!r} is not a special token (eos={eos!r}); its special tokens: {have}")
        return specials[eos]
    found = next((specials[n] for n in EOS_NAMES if n in specials), None)
    if found is None:
        raise ConvertError(f"{path}: no end-of-text token among its special tokens ({have}); name the "
                           "end-of-document token with eos=TOKEN")
    return found


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Path, eos_id: int, dtype: str, special_in_text: str, text_field: str) -> None:
    tok, plain = load_tokenizer(tokenizer), load_tokenizer(tokenizer)
    plain.encode_special_tokens = True  # a special token's string is split as any text (tokenizers >= 0.15.1)
    _WORKER.update(tokenizer=tok, plain=plain, specials=np.array(sorted(special_tokens(tok).values()), np.int64),
                   eos_id=eos_id, dtype=np.dtype(dtype), refuse=special_in_text == "refuse", field=text_field)


def _concat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    return lengths, np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum()))


def _documents_with(lengths: np.ndarray, flat: np.ndarray, ids: np.ndarray) -> list[int]:
    """The documents (positions in ``lengths``) holding one of ``ids``."""
    hits = np.flatnonzero(np.isin(flat, ids, kind="table"))
    return np.unique(np.searchsorted(np.cumsum(lengths), hits, side="right")).tolist()


def _encode(batch: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens per document, all tokens, documents with special-token text) of ``(wheres, texts)``: each non-empty
    document's ids + the end-of-document id (an empty document has length 0). A document whose ids hold a special
    token is refused or encoded again with its special-token strings as plain text (:func:`_as_plain_text`)."""
    wheres, texts = batch
    w = _WORKER
    docs = [e.ids for e in w["tokenizer"].encode_batch(texts, add_special_tokens=False)]
    lengths, flat = _concat(docs)
    held = _documents_with(lengths, flat, w["specials"])
    if held:
        _as_plain_text(docs, held, wheres, texts)
        lengths, flat = _concat(docs)
    ends = np.cumsum(lengths)[lengths > 0]
    flat = np.insert(flat, ends, w["eos_id"])  # after every non-empty document
    return lengths + (lengths > 0), flat.astype(w["dtype"]), len(held)


def _as_plain_text(docs: list[list[int]], held: list[int], wheres: list[str], texts: list[str]) -> None:
    """``docs[i]`` for ``i`` in ``held`` encoded with special-token strings as text; a ConvertError naming the first
    document with ``special_in_text="refuse"``, or if a document still holds the end-of-document id."""
    w = _WORKER
    if w["refuse"]:
        specials = set(w["specials"].tolist())
        token = w["tokenizer"].id_to_token(next(t for t in docs[held[0]] if t in specials))
        raise ConvertError(f"{wheres[held[0]]}: field {w['field']!r} holds the special token {token!r} "
                           "(special_in_text='refuse'; 'plain' encodes it as text)")
    encodings = w["plain"].encode_batch([texts[i] for i in held], add_special_tokens=False)
    for i, e in zip(held, encodings):
        if w["eos_id"] in e.ids:  # the model itself (not the added-token split) makes the id: a broken tokenizer
            raise ConvertError(f"{wheres[i]}: the tokenizer encodes this text with the end-of-document id "
                               f"{w['eos_id']} inside it, as text; choose another eos")
        docs[i] = e.ids


# -- writing ------------------------------------------------------------------------------------------

def starts_new_token_shard(documents: int, nbytes: int, doc_bytes: int, shard_size: int,
                           max_documents: int | None) -> bool:
    """The cut rule: a shard holding ``documents`` (``nbytes`` of ``.bin``) is closed before the next document
    (``doc_bytes``) when it holds ``max_documents`` or the document would take it past ``shard_size``."""
    return documents > 0 and (max_documents is not None and documents >= max_documents
                              or nbytes + doc_bytes > shard_size)


def token_shard_cuts(doc_bytes: np.ndarray, shard_size: int, max_documents: int | None) -> list[tuple[int, int]]:
    """Where :func:`starts_new_token_shard` cuts documents of these ``.bin`` sizes, in order: ``[(start, end), ...]``
    (one binary search per shard on the running byte total, for a merge of 10^8 documents)."""
    cum = np.zeros(len(doc_bytes) + 1, np.int64)
    np.cumsum(doc_bytes, out=cum[1:])
    cuts, start, n = [], 0, len(doc_bytes)
    while start < n:
        end = int(np.searchsorted(cum, cum[start] + shard_size, side="right")) - 1  # the bytes still fit
        end = max(start + 1, min(end, n, start + (max_documents or n)))  # the document limit; at least one
        cuts.append((start, end))
        start = end
    return cuts


class _ShardSeries:
    """Shards ``NAME-NNNNNN.bin`` one after another in ``folder``, cut by :func:`starts_new_token_shard`."""

    def __init__(self, config: TokenConvertConfig, dtype: str, folder: Path):
        self.config, self.dtype, self.itemsize, self.folder = config, dtype, np.dtype(dtype).itemsize, folder
        self.written: list[WrittenShard] = []
        self.writer: MegatronWriter | None = None

    def add(self, tokens: np.ndarray) -> None:
        w = self.writer
        if w is not None and starts_new_token_shard(w.documents, w.bytes, tokens.size * self.itemsize,
                                                    self.config.shard_size, self.config.max_samples_per_shard):
            self.written.append(w.close())
            w = None
        if w is None:
            name = f"{self.config.name}-{len(self.written):06d}.bin"
            w = self.writer = MegatronWriter(self.folder / name, self.dtype)
        w.add(tokens)

    def close(self) -> list[WrittenShard]:
        if self.writer is not None:
            self.written.append(self.writer.close())
            self.writer = None
        return self.written

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


@dataclass(frozen=True)
class _Coder:
    """What the tokenizer decides: the end-of-document id, the vocabulary (its largest id + 1, holes counted) and
    token type, the file's checksum."""

    eos_id: int
    vocab_size: int
    dtype: str
    sha256: str


def _coder(config: TokenConvertConfig) -> _Coder:
    tokenizer = load_tokenizer(config.tokenizer)
    eos_id = eos_token_id(tokenizer, config.eos, config.tokenizer)
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=0) + 1  # ids 0 .. the largest
    return _Coder(eos_id, vocab_size, token_dtype(vocab_size), sha256_file(config.tokenizer))


@dataclass
class _Written:
    """What :func:`_write` wrote: the shards, and the documents skipped (empty) or with special-token text."""

    shards: list[WrittenShard]
    empty: int = 0
    special: int = 0


def _batches(config: TokenConvertConfig, corpus: Corpus, span: tuple[int, int | None]
             ) -> Iterator[tuple[list[str], list[str]]]:
    """``(wheres, texts)`` of ``batch_size`` documents at a time."""
    docs = corpus.documents(config.text_field, span)
    while batch := list(islice(docs, config.batch_size)):
        yield [where for where, _ in batch], [text for _, text in batch]


def _encoded(config: TokenConvertConfig, coder: _Coder, batches: Iterator[tuple[list[str], list[str]]]
             ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    args = (config.tokenizer, coder.eos_id, coder.dtype, config.special_in_text, config.text_field)
    if config.workers == 1:
        _init_worker(*args)
        yield from map(_encode, batches)
        return
    with OrderedPool(_encode, config.workers, initializer=_init_worker, initargs=args) as pool:
        yield from pool.map(batches)


def _write(config: TokenConvertConfig, corpus: Corpus, coder: _Coder, out: Path,
           span: tuple[int, int | None] = (0, None)) -> _Written:
    """The documents of ``span`` into shards in ``out/shards``, in input order."""
    series, written = _ShardSeries(config, coder.dtype, out / SHARDS_DIR), _Written([])
    (out / SHARDS_DIR).mkdir()
    try:
        for lengths, flat, special in _encoded(config, coder, _batches(config, corpus, span)):
            written.special += special
            ends = np.cumsum(lengths)
            for end, n in zip(ends.tolist(), lengths.tolist()):
                if n == 0:
                    written.empty += 1
                else:
                    series.add(flat[end - n:end])
        written.shards = series.close()
        return written
    except BaseException:
        series.abort()
        raise


def shard_record(s: WrittenShard) -> ShardRecord:
    """The manifest's record of a written pair."""
    return ShardRecord(name=s.bin_path.name, samples=s.documents, bytes=s.bin_bytes, sha256=s.bin_sha256,
                       idx_sha256=s.idx_sha256, xxh3_128=s.bin_xxh3_128, tokens=s.tokens)


def token_manifest(name: str, records: list[ShardRecord], info: TokenInfo, source: dict[str, Any],
                   options: dict[str, Any]) -> Manifest:
    """A token dataset's manifest (a conversion's, or a merge's of its parts: the same bytes)."""
    return make_manifest(name=name, shards=records, fields=[], kind="tokens", tokens=info, converted_from=source,
                         convert_options=options)


def _source(config: TokenConvertConfig, corpus: Corpus) -> dict[str, Any]:
    return {"format": "documents", "path": str(config.source), "files": len(corpus.files)}


def _options(config: TokenConvertConfig) -> dict[str, Any]:
    return {"tokenizer": str(config.tokenizer), "text_field": config.text_field, "eos": config.eos,
            "shard_size": config.shard_size, "max_samples_per_shard": config.max_samples_per_shard,
            "special_in_text": config.special_in_text}


def _info(coder: _Coder, records: list[ShardRecord], starts: IndexRecord) -> TokenInfo:
    return TokenInfo(dtype=coder.dtype, eos_id=coder.eos_id, total_tokens=sum(r.tokens or 0 for r in records),
                     vocab_size=coder.vocab_size, one_sequence_per_document=True,  # as MegatronWriter writes
                     starts=starts)


class _Claim:
    """``folder`` (DEST, or a part's directory ``outer`` folders down) locked for a run, and taken back if the run
    fails with an exception (a refusal, a full disk; not an interruption, which a rerun redoes): once the run has
    :attr:`emptied` it, its files (all the run's) go, then the lock file if the run made it, then the folders the
    run made, innermost first (one that holds another process's files stays). A ``with`` block."""

    def __init__(self, folder: Path, purpose: str, *outer: Path):
        self.folder, self.emptied = folder, False
        self.made = [d for d in (*outer, folder) if not d.exists()]
        self.had_lock = (folder / LOCK_NAME).exists()
        self.lock = DirLock(folder, purpose)

    def __enter__(self) -> _Claim:
        lock_dest(self.lock, self.folder)
        return self

    def __exit__(self, kind, err, tb) -> None:
        try:
            if kind is not None and issubclass(kind, Exception):
                self._withdraw()
        finally:
            self.lock.release()

    def _withdraw(self) -> None:
        try:
            if self.emptied:
                clear_part_dir(self.folder)  # everything but the lock (a part's directory or DEST alike)
            if not self.had_lock:
                (self.folder / LOCK_NAME).unlink(missing_ok=True)
            for folder in reversed(self.made):
                folder.rmdir()
        except OSError:  # a folder another run writes in too, or one this one cannot change: left as it is
            pass


def convert_tokens(config: TokenConvertConfig) -> TokenConvertResult:
    """Tokenize ``config.source`` into a token dataset in ``config.dest``, or with ``config.part`` one part of it
    into ``DEST/.parts/`` (see the module docstring)."""
    if isinstance(config.dest, str):  # s3://: written in a local staging folder, then uploaded
        result = upload_dataset(config.dest, config.storage_options, config.staging_dir, config.overwrite,
                                lambda local: convert_tokens(replace(config, dest=local, overwrite=True)))
        return replace(result, dest=config.dest)
    started = time.perf_counter()
    coder = _coder(config)
    corpus = open_corpus(config.source, config.storage_options)  # refusals before DEST is touched
    local_source = config.source if isinstance(config.source, Path) else None
    check_dest(config.dest, local_source, config.overwrite)
    if config.part is not None:
        return _convert_part(config, corpus, coder, started)
    with _Claim(config.dest, "fastio convert") as claim:
        check_dest(config.dest, local_source, config.overwrite)  # again, under the lock
        parts = lock_parts(config.dest)  # a part still being converted: refused, nothing deleted
        try:
            reset_dest(config.dest)
            claim.emptied = True
            written = _write_dataset(config, corpus, coder)
        except OSError as err:  # DEST unwritable, disk full, a source file unreadable mid-run
            raise ConvertError(f"{err.filename or config.dest}: {err.strerror or err}") from None
        finally:
            for part in parts:
                part.release()
    return _result(config, coder, written, started)


def _write_dataset(config: TokenConvertConfig, corpus: Corpus, coder: _Coder) -> _Written:
    """The shards, the document-starts table and the manifest (last) into DEST, emptied and locked."""
    written = _write(config, corpus, coder, config.dest)
    if not written.shards:
        raise ConvertError(f"{config.source}: holds no document with text ({count(written.empty, 'empty document')})")
    records = [shard_record(s) for s in written.shards]
    source = {**_source(config, corpus), "empty_documents": written.empty, "special_text_documents": written.special}
    starts = write_starts(config.dest, [shard_starts(MegatronIndex(s.idx_path)) for s in written.shards])
    write_manifest(config.dest, token_manifest(config.name, records, _info(coder, records, starts), source,
                                               _options(config)))
    return written


def _result(config: TokenConvertConfig, coder: _Coder, written: _Written, started: float) -> TokenConvertResult:
    shards = written.shards
    return TokenConvertResult(dest=config.dest, shards=len(shards), documents=sum(s.documents for s in shards),
                              tokens=sum(s.tokens for s in shards), empty=written.empty,
                              bytes=sum(s.bin_bytes for s in shards), seconds=time.perf_counter() - started,
                              dtype=coder.dtype, eos_id=coder.eos_id, part=config.part, special_text=written.special)


def _convert_part(config: TokenConvertConfig, corpus: Corpus, coder: _Coder, started: float) -> TokenConvertResult:
    """Part K of N into ``DEST/.parts/part-K-of-N/`` (its lock only: parts run side by side); ``part.json`` last."""
    k, n = config.part
    directory = part_dir(config.dest, k, n)
    with _Claim(directory, f"fastio convert --part {k}/{n}", config.dest, directory.parent) as claim:
        try:
            start_part_dir(config.dest, k, n, directory)
            claim.emptied = True
            span = part_span(corpus.total, k, n)
            written = _write(config, corpus, coder, directory, span)
            write_part_record(directory, PartRecord(part=k, of=n, plan=_plan(config, corpus, coder),
                                                    datasets={"": _part_dataset(corpus, span, written)}))
        except OSError as err:
            raise ConvertError(f"{err.filename or directory}: {err.strerror or err}") from None
    return _result(config, coder, written, started)


def _plan(config: TokenConvertConfig, corpus: Corpus, coder: _Coder) -> dict[str, Any]:
    """What every part of a conversion shares (:func:`fastio.convert.token_merge.comparable_plan`: how it is compared)."""
    return {"kind": TOKEN_PLAN, "source": _source(config, corpus), "convert_options": _options(config),
            "name": config.name,
            "listing": {"sha256": corpus.listing_digest(), "files": len(corpus.files), "bytes": corpus.total},
            "tokens": {"tokenizer_sha256": coder.sha256, "eos_id": coder.eos_id, "dtype": coder.dtype,
                       "vocab_size": coder.vocab_size}}


def _part_dataset(corpus: Corpus, span: tuple[int, int | None], written: _Written) -> dict[str, Any]:
    end = corpus.total if span[1] is None else span[1]
    return {"range": [span[0], end], "count": corpus.total, "empty_documents": written.empty,
            "special_text_documents": written.special,
            "shards": [shard_record(s).as_dict() for s in written.shards]}
