"""Megatron-LM's indexed token format, in one module: ``NAME.bin`` (the tokens of every document, back to back)
and ``NAME.idx`` (where each one is), byte-compatible with ``megatron.core.datasets.indexed_dataset``.

``NAME.idx``, little-endian::

    b"MMIDIDX\\x00\\x00"            9 bytes: the magic
    version                      u64: 1
    dtype code                   u8: the token type (8 = uint16, 4 = int32; Megatron's ``DType`` codes)
    sequence count N             u64
    document count D + 1         u64: the document indices, a leading 0 included
    sequence lengths             N x int32: tokens of each sequence
    sequence pointers            N x int64: byte offset of each sequence in ``.bin`` (running sum of lengths)
    document indices             (D + 1) x int64: 0, then the sequence index after each document's last
    (sequence modes)             N x int8: only in Megatron's multimodal files (accepted, not read)

fastio writes one sequence per document (as Megatron's ``preprocess_data.py`` does without sentence splitting);
a reader takes document ``j`` as sequences ``doc_index[j] .. doc_index[j+1]``, contiguous in ``.bin``.
The token type is uint16 where the vocabulary has fewer than 65,500 ids (Megatron's ``optimal_dtype``), else
int32. Reading maps both files (``numpy.memmap``): a document is found in O(1) and nothing of size N is read
at open. Refusals are one :class:`~fastio.errors.DatasetError` naming the file: bad magic (the older lazy/cached ``TNTIDX``
format named as such) or version, a header cut short, a token type
that is not uint16/int32 (or not the one expected), a size that disagrees with its counts, a ``.bin`` shorter or
longer than its ``.idx`` says (truncated, or indexed with another token type), a missing partner file; and an
``.idx`` cut short after it was opened, on the next lookup of document starts (its size checked before each).
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastio.errors import DatasetError, os_error_text
from fastio.storage.atomic import fsync_dir, tmp_path_for
from fastio.storage.checksum import HashingWriter
from fastio.words import count

__all__ = ["CHECK_CHUNK", "HEADER_BYTES", "MAGIC", "TOKEN_DTYPES", "MegatronIndex", "MegatronShard", "MegatronWriter",
           "WrittenShard", "partner_path", "token_dtype"]

MAGIC = b"MMIDIDX\x00\x00"
_OLD_MAGIC = b"TNTIDX\x00\x00"  # Megatron's (and fairseq's) older lazy/cached IndexedDataset: not read
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
TOKEN_DTYPES = {"uint16": 8, "int32": 4}
"""The token types fastio writes and reads, by name, with Megatron's dtype code."""
_CODE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_UINT16_VOCAB = 65500  # Megatron's DType.optimal_dtype: uint16 below this many ids
_SPARSE = 512  # documents per looked-up one below which starts() reads entries with pread
_SPAN = 16  # entries read per wanted one, at most, for the wanted ones to come in one pread of their span
CHECK_CHUNK = 1 << 20
"""Entries taken at a time by the O(N) passes (:meth:`MegatronIndex.check_structure`, :meth:`~MegatronIndex.edge_chunks`):
their memory is a few times this many entries, whatever the shard's size."""


def token_dtype(vocab_size: int) -> str:
    """The token type for a vocabulary of ``vocab_size`` ids: ``uint16`` below 65,500 (as Megatron), else
    ``int32``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return "uint16" if vocab_size < _UINT16_VOCAB else "int32"


def _madvise(mapping: mmap.mmap | None, name: str) -> None:
    advice = getattr(mmap, name, None)
    if mapping is not None and advice is not None:
        mapping.madvise(advice)


def partner_path(path: Path) -> Path:
    """The other file of a pair: ``NAME.idx`` for ``NAME.bin`` and the reverse."""
    path = Path(path)
    return path.with_suffix(".idx" if path.suffix == ".bin" else ".bin")


# -- reading ------------------------------------------------------------------------------------------

class MegatronIndex:
    """One ``.idx`` file, mapped: ``lengths``, ``pointers``, ``doc_index`` (read-only arrays on the file).

    The header and the file size are checked at open (``name``, where given, is how messages name the file);
    :meth:`check_structure` checks every entry (O(N): what ``fastio verify`` and ``fastio index`` pay, not every
    open; :data:`CHECK_CHUNK` entries at a time, so its memory does not grow with the shard). ``one_per_document``
    (what the manifest's ``tokens.one_sequence_per_document`` says) takes document ``j`` as sequence ``j`` without
    reading ``doc_index``: the counts are checked to agree at open, ``doc_index`` itself by
    :meth:`check_structure`."""

    def __init__(self, path: str | Path, dtype: str | None = None, *, one_per_document: bool = False,
                 name: str | None = None):
        self.path = Path(path)
        self.name = name or str(self.path)
        """How messages name the file (``name``: e.g. the URL of an object downloaded to ``path``)."""
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except FileNotFoundError:
            raise DatasetError(f"{self.name}: no such Megatron .idx file (the partner of "
                               f"{partner_path(self.path).name})") from None
        except OSError as err:
            raise DatasetError(f"{self.name}: cannot read ({os_error_text(err)})") from None
        code, self.sequences, entries = self._header(head)
        if code not in _CODE_NAMES or _CODE_NAMES[code] not in TOKEN_DTYPES:
            raise DatasetError(f"{self.name}: token type {_CODE_NAMES.get(code, f'code {code}')} is not one fastio "
                               f"reads ({', '.join(TOKEN_DTYPES)})")
        self.dtype = _CODE_NAMES[code]
        if dtype is not None and self.dtype != dtype:
            raise DatasetError(f"{self.name}: holds {self.dtype} tokens, expected {dtype}")
        if entries < 1:
            raise DatasetError(f"{self.name}: document count is 0 (a Megatron .idx lists at least the leading 0)")
        n = self.sequences
        plain = HEADER_BYTES + n * 12 + entries * 8
        if size not in (plain, plain + n):  # + n: Megatron's multimodal sequence modes
            raise DatasetError(f"{self.name}: {count(size, 'byte')}, its header ({count(n, 'sequence')}, "
                               f"{count(entries - 1, 'document')}) "
                               f"needs {plain}: truncated or not a Megatron .idx")
        self.documents = entries - 1
        self.one_per_document = one_per_document
        if one_per_document and self.documents != n:
            raise DatasetError(f"{self.name}: {count(n, 'sequence')} for {count(self.documents, 'document')}, and its "
                               "manifest says one sequence per document")
        try:
            mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except OSError as err:
            raise DatasetError(f"{self.name}: cannot be mapped ({os_error_text(err)})") from None
        self._map = getattr(mm, "_mmap", None)
        self._bytes = size
        self._advise("MADV_RANDOM")  # lookups touch one entry a page: no read-around of 32 pages for each
        self.lengths = np.frombuffer(mm, np.int32, n, HEADER_BYTES)
        self.pointers = np.frombuffer(mm, np.int64, n, HEADER_BYTES + 4 * n)
        self.doc_index = np.frombuffer(mm, np.int64, entries, HEADER_BYTES + 12 * n)
        self.itemsize = np.dtype(self.dtype).itemsize
        self._known: tuple[int, np.ndarray] | None = None

    def use_starts(self, every: int, values: np.ndarray) -> None:
        """Take the starts of documents 0, ``every``, 2 * ``every``, ..., and the end from ``values`` (a
        dataset's document-starts table, :mod:`fastio.tokens.starts`) instead of reading the file; DatasetError
        unless they begin at 0 and end at this index's token count."""
        if values.size != -(-self.documents // every) + 1 or values[0] != 0 or values[-1] != self.tokens:
            raise DatasetError(f"{self.name}: the document starts table disagrees with it (run fastio verify)")
        self._known = (every, values)

    def _advise(self, name: str) -> None:
        """``madvise`` the mapping (where the platform has it): random lookups, a sequential pass, or
        ``MADV_DONTNEED`` (the pages a pass has read leave this process's resident set; the page cache keeps them,
        the file is read-only and shared: nothing is lost)."""
        _madvise(self._map, name)

    def _header(self, head: bytes) -> tuple[int, int, int]:
        if head.startswith(_OLD_MAGIC):
            raise DatasetError(f"{self.name}: Megatron's older lazy/cached index format (TNTIDX), not the mmap one "
                               "(MMIDIDX) fastio reads: make the pairs again with Megatron's preprocessing as mmap "
                               "(its default; --dataset-impl mmap where it has the option)")
        if head[:9] != MAGIC:
            raise DatasetError(f"{self.name}: not a Megatron .idx (no MMIDIDX header)")
        if len(head) < HEADER_BYTES:
            raise DatasetError(f"{self.name}: {count(len(head), 'byte')}, cut inside the {HEADER_BYTES}-byte header of "
                               "a Megatron .idx: truncated")
        version, code, sequences, entries = struct.unpack("<QBQQ", head[9:HEADER_BYTES])
        if version != VERSION:
            raise DatasetError(f"{self.name}: Megatron .idx version {version}, fastio reads {VERSION}")
        return code, sequences, entries

    @property
    def bin_bytes(self) -> int:
        """The size the ``.bin`` must have: the end of the last sequence."""
        if not self.sequences:
            return 0
        return int(self.pointers[-1]) + int(self.lengths[-1]) * self.itemsize

    @property
    def tokens(self) -> int:
        """Tokens in all documents."""
        return self.bin_bytes // self.itemsize

    def check_bin(self, size: int, name: str) -> None:
        """DatasetError naming the ``.bin`` (``name``) unless its ``size`` is what this index says."""
        if size != self.bin_bytes:
            raise DatasetError(f"{name}: {count(size, 'byte')}, but {partner_path(Path(name)).name} indexes "
                               f"{self.bin_bytes} ({count(self.tokens, f'{self.dtype} token')}): truncated, or "
                               "indexed with another token type")

    def edge_chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """The token offsets of every document's start and the end, :data:`CHECK_CHUNK` documents at a time, in
        order: ``(lo, edges)`` with ``edges[k]`` the start of document ``lo + k`` and ``edges[-1]`` the start of the
        chunk's next document (the end for the last): a sequential pass in bounded memory (O(N) in all). For an
        index whose structure was checked (:meth:`check_structure`)."""
        step, item = CHECK_CHUNK, self.itemsize
        self._advise("MADV_SEQUENTIAL")
        try:
            for lo in range(0, self.documents, step):
                hi = min(lo + step, self.documents)
                seq = (np.arange(lo, hi + 1, dtype=np.int64) if self.one_per_document
                       else np.asarray(self.doc_index[lo:hi + 1], np.int64))
                edges = np.full(seq.shape, self.tokens, np.int64)
                inside = seq < self.sequences
                edges[inside] = self.pointers[seq[inside]] // item
                self._advise("MADV_DONTNEED")  # resident memory bounded too, not only the arrays
                yield lo, edges
        finally:
            self._advise("MADV_RANDOM")

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """Token offset in ``.bin`` of each document of ``docs`` (int64 array; ``documents`` gives the end).

        Few documents far apart (a packing's block edges) are read with ``pread``: through the mapping, each
        would map a page-cache window around it into this process (the kernel's fault-around), which shows as
        resident memory in the hundreds of MB for 10^8 documents. With ``one_per_document`` the document is
        its sequence: ``doc_index`` is not read (half the reads). Documents that are all in the table given to
        :meth:`use_starts` (block edges) are looked up there: nothing is read; those of
        them among documents read from the file (a block's) are checked against it: DatasetError if the table is
        stale (the pair replaced after it was indexed)."""
        docs = np.asarray(docs, dtype=np.int64)
        if self._known is not None:
            every, values = self._known
            on = (docs % every == 0) | (docs == self.documents)
            known = values[np.where(docs[on] == self.documents, values.size - 1, docs[on] // every)]
            if on.all():
                return known.astype(np.int64)
            out = self._read_starts(docs)
            if not np.array_equal(out[on], known):  # a block's edges: the table's must be the .idx's
                raise DatasetError(f"{self.name}: the document starts table disagrees with it (changed since it was "
                                   "indexed; run fastio verify)")
            return out
        return self._read_starts(docs)

    def _read_starts(self, docs: np.ndarray) -> np.ndarray:
        """:meth:`starts` from the file, once it still has the size it had when opened (:meth:`_check_size`)."""
        self._check_size()
        sparse = docs.size * _SPARSE < self.documents
        if self.one_per_document:
            seq = docs
        else:
            seq = self._entries("doc_index", docs) if sparse else self.doc_index[docs]
        inside = seq < self.sequences
        out = np.full(seq.shape, self.tokens, dtype=np.int64)
        out[inside] = (self._entries("pointers", seq[inside]) if sparse else self.pointers[seq[inside]]) // self.itemsize
        return out

    def _check_size(self) -> None:
        """DatasetError naming the file unless it has the size it had when opened (the mapping's own descriptor
        asked): one cut short under the mapping reads zeros in its last page (other documents' offsets, silently)
        and kills the process with SIGBUS past it; one cut short during a lookup still can."""
        now = self._bytes if self._map is None else self._map.size()
        if now != self._bytes:
            raise DatasetError(f"{self.name}: {count(now, 'byte')}, {self._bytes} when it was opened: cut short or "
                               "changed since (replace a pair by a rename, never in place; run fastio verify)")

    def _entries(self, column: str, at: np.ndarray) -> np.ndarray:
        """``column[at]`` (``pointers`` or ``doc_index``: int64 columns of the file) read with ``pread``: the span
        from the least to the greatest of ``at`` in one read where it is at most ``_SPAN`` entries per wanted one
        (a block's documents), else entry by entry (block edges far apart)."""
        n = self.sequences
        base = HEADER_BYTES + (4 * n if column == "pointers" else 12 * n)
        flat = at.reshape(-1)
        if not flat.size:
            return np.zeros(at.shape, np.int64)
        lo, hi = int(flat.min()), int(flat.max())
        fd, pread = os.open(self.path, os.O_RDONLY), os.pread
        try:
            if hi - lo < _SPAN * flat.size:
                raw = pread(fd, 8 * (hi - lo + 1), base + 8 * lo)
                values = np.frombuffer(raw, "<i8")[flat - lo] if len(raw) == 8 * (hi - lo + 1) else None
            else:  # a list of plain ints: the per-entry cost is the system call's, not numpy scalars'
                raw = b"".join([pread(fd, 8, at) for at in (base + 8 * flat).tolist()])
                values = np.frombuffer(raw, "<i8") if len(raw) == 8 * flat.size else None
        finally:
            os.close(fd)
        if values is None:
            raise DatasetError(f"{self.name}: shorter than its header says (changed since it was opened)")
        return values.reshape(at.shape).astype(np.int64)

    def check_structure(self) -> None:
        """DatasetError naming the file and the first entry that breaks the format (O(N))."""
        self._advise("MADV_SEQUENTIAL")
        try:
            self._check_structure()
        finally:
            self._advise("MADV_RANDOM")

    def _check_structure(self) -> None:
        n, step = self.sequences, CHECK_CHUNK
        for lo in range(0, n, step):  # every negative length first: the first one is named whatever else is wrong
            if self.lengths[lo:lo + step].min() < 0:
                raise DatasetError(f"{self.name}: sequence {lo + int(np.argmax(self.lengths[lo:lo + step] < 0))} has "
                                   "a negative length")
            self._advise("MADV_DONTNEED")
        end = 0  # byte offset just past the sequences before the chunk
        for lo in range(0, n, step):
            ends = end + np.cumsum(self.lengths[lo:lo + step], dtype=np.int64) * self.itemsize
            expected, pointers = np.r_[end, ends[:-1]], self.pointers[lo:lo + step]
            bad = np.flatnonzero(pointers != expected)
            if bad.size:
                raise DatasetError(f"{self.name}: sequence {lo + int(bad[0])}'s pointer {int(pointers[bad[0]])} is "
                                   f"not the end of the sequences before it ({int(expected[bad[0]])})")
            end = int(ends[-1])
            self._advise("MADV_DONTNEED")
        self._check_doc_index()
        if self.one_per_document and not self.is_one_per_document():
            raise DatasetError(f"{self.name}: a document spans several sequences, and its manifest says one sequence "
                               "per document")

    def _check_doc_index(self) -> None:
        docs, n, step, last = self.doc_index, self.sequences, CHECK_CHUNK, 0
        ok = docs[0] == 0 and docs[-1] == n
        for lo in range(0, docs.size, step):
            if not ok:
                break
            chunk = docs[lo:lo + step]
            ok = chunk[0] >= last and not (np.diff(chunk) < 0).any()
            last = int(chunk[-1])
            self._advise("MADV_DONTNEED")
        if not ok:
            raise DatasetError(f"{self.name}: document indices do not run from 0 up to the {count(n, 'sequence')}")

    def is_one_per_document(self) -> bool:
        """Whether document ``j`` is sequence ``j`` for every ``j`` (``doc_index`` is 0, 1, ..., N; O(N), in chunks
        of :data:`CHECK_CHUNK`)."""
        if self.documents != self.sequences:
            return False
        step = CHECK_CHUNK
        for lo in range(0, self.documents + 1, step):
            same = bool((self.doc_index[lo:lo + step] == np.arange(lo, min(lo + step, self.documents + 1))).all())
            self._advise("MADV_DONTNEED")
            if not same:
                return False
        return True


class MegatronShard:
    """A ``.bin``/``.idx`` pair, mapped; ``document(j)`` and ``tokens(start, count)`` are O(1) lookups.

    ``path`` is either file of the pair (or the common prefix); ``dtype`` (optional) is the token type the
    caller expects; ``one_per_document`` as :class:`MegatronIndex`'s. The ``.bin``'s size is checked against the
    ``.idx`` at open."""

    def __init__(self, path: str | Path, dtype: str | None = None, *, one_per_document: bool = False):
        path = Path(path)
        stem = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
        self.bin_path = Path(f"{stem}.bin")
        self.idx_path = partner_path(self.bin_path)
        self.index = MegatronIndex(self.idx_path, dtype, one_per_document=one_per_document)
        try:
            size = self.bin_path.stat().st_size
        except FileNotFoundError:
            raise DatasetError(f"{self.bin_path}: no such Megatron .bin file (the partner of "
                               f"{self.idx_path.name})") from None
        self.index.check_bin(size, str(self.bin_path))
        self._tokens = (np.memmap(self.bin_path, dtype=self.index.dtype, mode="r") if size
                        else np.zeros(0, self.index.dtype))

    @property
    def dtype(self) -> str:
        return self.index.dtype

    @property
    def documents(self) -> int:
        return self.index.documents

    def __len__(self) -> int:
        return self.index.documents

    def document(self, j: int) -> np.ndarray:
        """The tokens of document ``j`` (a read-only view on the file)."""
        if not 0 <= j < self.index.documents:
            raise IndexError(f"{self.bin_path.name}: document {j} out of range 0..{self.index.documents - 1}")
        start, end = self.index.starts(np.array([j, j + 1]))
        return self._tokens[start:end]

    def release_pages(self) -> None:
        """Drop the pages of the ``.bin`` read so far from this process's resident set (``MADV_DONTNEED``; the page
        cache keeps them): a pass over every token in bounded resident memory."""
        _madvise(getattr(self._tokens, "_mmap", None), "MADV_DONTNEED")

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from token offset ``start`` of ``.bin`` (a read-only view)."""
        if start < 0 or count < 0 or start + count > self._tokens.size:
            raise IndexError(f"{self.bin_path.name}: tokens {start}..{start + count} outside 0..{self._tokens.size}")
        return self._tokens[start:start + count]


# -- writing ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WrittenShard:
    """What :meth:`MegatronWriter.close` published: sizes and checksums of both files, counts."""

    bin_path: Path
    idx_path: Path
    documents: int
    tokens: int
    bin_bytes: int
    bin_sha256: str
    bin_xxh3_128: str
    idx_bytes: int
    idx_sha256: str


class MegatronWriter:
    """Write one ``.bin``/``.idx`` pair: :meth:`add` one document at a time, :meth:`close` publishes both
    (each written under its hidden temporary name, fsynced, renamed; ``.idx`` last), :meth:`abort` removes
    them. Checksums are taken while writing."""

    def __init__(self, bin_path: str | Path, dtype: str):
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        self.bin_path = Path(bin_path)
        self.idx_path = partner_path(self.bin_path)
        self.dtype = np.dtype(dtype)
        self._limit = np.iinfo(self.dtype).max
        self._tmp = tmp_path_for(self.bin_path)
        self._file = open(self._tmp, "wb")
        self._out = HashingWriter(self._file)
        self._lengths = array("q")

    @property
    def documents(self) -> int:
        return len(self._lengths)

    @property
    def bytes(self) -> int:
        return self._out.size

    def add(self, tokens: np.ndarray) -> None:
        """Append one document (token ids, which must fit the token type)."""
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() > self._limit):
            bad = int(tokens[(tokens < 0) | (tokens > self._limit)][0])
            raise ValueError(f"token id {bad} does not fit {self.dtype.name} ({self.bin_path.name})")
        if tokens.size > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {tokens.size} tokens does not fit a Megatron .idx (int32 lengths)")
        self._out.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(tokens.size)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents back to back: ``tokens`` holds them all, ``lengths`` their token counts (in order)."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int64)
        if int(lengths.sum()) != tokens.size or (lengths.size and lengths.min() < 0):
            raise ValueError(f"lengths add up to {int(lengths.sum())}, not the {count(tokens.size, 'token')} given")
        if tokens.size and (tokens.min() < 0 or tokens.max() > self._limit):
            bad = int(tokens[(tokens < 0) | (tokens > self._limit)][0])
            raise ValueError(f"token id {bad} does not fit {self.dtype.name} ({self.bin_path.name})")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {lengths.max()} tokens does not fit a Megatron .idx (int32 lengths)")
        self._out.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.frombytes(lengths.astype(np.int64).tobytes())

    def close(self) -> WrittenShard:
        """Publish the pair (``.bin`` first, ``.idx`` last) and say what was written."""
        try:
            self._out.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            index = self._index_bytes()
            idx_tmp = tmp_path_for(self.idx_path)
            with open(idx_tmp, "wb") as f:
                idx_out = HashingWriter(f)
                idx_out.write(index)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp, self.bin_path)
            os.replace(idx_tmp, self.idx_path)
            fsync_dir(self.bin_path.parent)
        except BaseException:
            self.abort()
            raise
        return WrittenShard(self.bin_path, self.idx_path, len(self._lengths), self._out.size // self.dtype.itemsize,
                            self._out.size, self._out.hexdigest(), self._out.xxh3_hexdigest(), idx_out.size,
                            idx_out.hexdigest())

    def abort(self) -> None:
        """Drop what was written (the temporary files; nothing was published)."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        tmp_path_for(self.idx_path).unlink(missing_ok=True)

    def _index_bytes(self) -> bytes:
        n = len(self._lengths)
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
        pointers = np.zeros(n, np.int64)
        if n:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.arange(n + 1, dtype=np.int64)  # one sequence per document
        head = MAGIC + struct.pack("<QBQQ", VERSION, TOKEN_DTYPES[self.dtype.name], n, n + 1)
        return head + lengths.astype("<i4").tobytes() + pointers.astype("<i8").tobytes() + docs.astype("<i8").tobytes()

    def __enter__(self) -> MegatronWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
