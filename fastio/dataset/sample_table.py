"""The consolidated sample index ``DEST/samples.fxi``: where every sample's fields lie, in one compact
columnar file, so that opening a dataset reads the manifest and this file, not every shard's ``.idx``.

Layout (little-endian)::

    b"FASTIOSI"  u32 version  u32 header_len  header (JSON, utf-8)  padding to 64
    column ... each at a 64-byte aligned offset the header names, ``samples`` values of its dtype

The header holds ``samples``, ``shards``, ``fields`` (sorted), ``offsets`` (``derived`` or ``stored``)
and ``columns`` ({name: {dtype, offset}}, offsets counted from the data start, the first 64-aligned byte
after the header). Columns:

- ``span_offset``: offset of the sample's first member data inside its shard (uint32, uint64 for
  shards past 4 GiB);
- ``size:FIELD``: size of each field, the smallest unsigned dtype that holds the largest size; the
  dtype's maximum means "this sample lacks the field";
- ``offset:FIELD`` (int64, -1 where missing), only with ``offsets: stored``. fastio's own shards
  (members in sorted field order, one 512-byte USTAR header each) have ``derived`` offsets: field k+1's
  data starts ``padded(size_k) + 512`` after field k's. Shards laid out otherwise store them.

The shard of a sample is not stored: it follows from the manifest's per-shard counts. Keys are not
stored either: :class:`fastio.dataset.dataset.Dataset` reads one shard's ``.idx`` when a key is asked for
(errors, ``Loader.key``). A dataset of 10^9 two-field (jpg, cls) samples costs 9 bytes a sample.

:func:`build_index` (or :class:`IndexBuilder` shard by shard) makes it from ``(ShardRecord, [IndexEntry])``
pairs, which is all a shard writer or a merge of converted parts has. :class:`SampleIndex` memory-maps
it (pages are shared by every process of a node through the page cache) and :meth:`SampleIndex.locate`
turns dataset-wide indices into byte ranges, for a batch at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from fastio.dataset.manifest import IndexRecord, ShardRecord
from fastio.errors import DatasetError
from fastio.formats.dali_idx import IndexEntry
from fastio.storage.atomic import atomic_write_bytes, publish, tmp_path_for
from fastio.storage.checksum import DIGESTS, HashingWriter, digests_file, sha256_file
from fastio.words import agree, count

__all__ = ["INDEX_NAME", "INDEX_VERSION", "IndexBuilder", "Rows", "SampleIndex", "build_index", "check_index",
           "check_once"]

INDEX_NAME = "samples.fxi"
INDEX_VERSION = 1
_MAGIC = b"FASTIOSI"
_PREAMBLE = struct.Struct("<8sII")
_ALIGN = 64
_BLOCK = 512  # a tar header; member data is padded to a multiple of it
_SIZE_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)
CHECKED_STAMP_MIN_BYTES = 64 << 20
"""From this size on (~7 x 10^6 two-field samples, ~0.5 s of checks), an index whose checks passed on this node is
not checked again while the file is the same (:func:`_checked_stamp`); see ``docs/scaling.md``."""


def _padded(size: np.ndarray) -> np.ndarray:
    return (size + (_BLOCK - 1)) // _BLOCK * _BLOCK


@dataclass(frozen=True)
class Rows:
    """Where some samples lie (row j describes the j-th requested index); all int64 but ``shard`` (int32).

    ``offsets[f][j]``/``sizes[f][j]`` locate field ``f`` inside shard ``shard[j]`` (-1 where the sample
    lacks it); ``span_offset``/``span_size`` cover all of the sample's member data.
    """

    shard: np.ndarray
    span_offset: np.ndarray
    span_size: np.ndarray
    offsets: dict[str, np.ndarray]
    sizes: dict[str, np.ndarray]


class IndexBuilder:
    """Collect shards' parsed ``.idx`` entries (in manifest order), then write the index.

    Per shard only compact arrays are kept (a few bytes a sample), so a writer can feed it as shards
    are published.
    """

    def __init__(self):
        self._shards: list[tuple[str, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        self._derived = True

    def add(self, record: ShardRecord, entries: Sequence[IndexEntry]) -> None:
        """Append shard ``record`` whose ``.idx`` lists ``entries``; ValueError if they disagree."""
        if len(entries) != record.samples:
            raise ValueError(f"shard {record.name}: index lists {count(len(entries), 'sample')}, record says "
                             f"{record.samples}")
        n = len(entries)
        span = np.empty(n, np.int64)
        offsets: dict[str, np.ndarray] = {}
        sizes: dict[str, np.ndarray] = {}
        for j, entry in enumerate(entries):
            if not entry.members:
                raise ValueError(f"shard {record.name}: sample {entry.key!r} has no members")
            span[j] = min(offset for _, offset, _ in entry.members)
            for ext, offset, size in entry.members:
                if ext not in sizes:
                    sizes[ext], offsets[ext] = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
                if offset < 0 or size < 0:
                    raise ValueError(f"shard {record.name}: sample {entry.key!r} field {ext!r} has a negative "
                                     f"offset or size")
                offsets[ext][j], sizes[ext][j] = offset, size
        self.add_columns(record, span, sizes, offsets)

    def add_columns(self, record: ShardRecord, span_offset: np.ndarray, sizes: dict[str, np.ndarray],
                    offsets: dict[str, np.ndarray] | None = None) -> None:
        """Append shard ``record`` given as columns: each sample's first member data offset, and per field
        the sizes (and data offsets; -1 where a sample lacks the field). Without ``offsets`` the shard must
        have fastio's layout (fields in sorted order, each data ``padded(size) + 512`` after the previous).
        """
        n = record.samples
        span = np.asarray(span_offset, np.int64)
        sizes = {f: np.asarray(v, np.int64) for f, v in sizes.items()}
        if len(span) != n or any(len(v) != n for v in sizes.values()):
            raise ValueError(f"shard {record.name}: columns of {count(len(span), 'sample')}, record says {n}")
        if offsets is None:
            self._shards.append((record.name, span, {}, sizes))
            return
        offsets = {f: np.asarray(offsets[f], np.int64) for f in sizes}
        if self._derived:  # does this shard have the layout whose offsets follow from the sizes?
            at = span.copy()
            for f in sorted(sizes):
                have = sizes[f] >= 0
                if not np.array_equal(offsets[f][have], at[have]):
                    self._derived = False
                    break
                at = np.where(have, at + _padded(sizes[f]) + _BLOCK, at)
        self._shards.append((record.name, span, offsets, sizes))

    def write(self, out: BinaryIO, fields: Sequence[str]) -> None:
        """Write the index to ``out`` for a dataset whose manifest lists ``fields``."""
        fields = sorted(fields)
        extra = {f for _, _, _, sizes in self._shards for f in sizes} - set(fields)
        if extra:
            raise ValueError(f"samples have {agree(len(extra), 'field')} {', '.join(sorted(extra))} that fields does "
                             "not list")
        n = sum(len(span) for _, span, _, _ in self._shards)
        span_max = max((int(span.max()) for _, span, _, _ in self._shards if len(span)), default=0)
        columns: list[tuple[str, np.dtype, list[np.ndarray], int]] = [
            ("span_offset", np.dtype("<u4" if span_max < 2**32 else "<u8"), [s for _, s, _, _ in self._shards], 0)]
        for f in fields:
            parts = [sizes.get(f, np.full(len(span), -1, np.int64)) for _, span, _, sizes in self._shards]
            biggest = max((int(p.max()) for p in parts if len(p)), default=0)
            dtype = next(np.dtype(d).newbyteorder("<") for d in _SIZE_DTYPES if biggest < np.iinfo(d).max)
            columns.append((f"size:{f}", dtype, parts, int(np.iinfo(dtype).max)))
        if not self._derived:
            for f in fields:
                parts = [offs.get(f, np.full(len(span), -1, np.int64)) if offs else _derive(span, sizes, fields)[f]
                         for _, span, offs, sizes in self._shards]
                columns.append((f"offset:{f}", np.dtype("<i8"), parts, -1))
        table, at = {}, 0
        for name, dtype, _, _ in columns:  # offsets from the data start (the first 64-aligned byte after the header)
            table[name] = {"dtype": dtype.str, "offset": at}
            at = _aligned(at + n * dtype.itemsize)
        header = {"samples": n, "shards": len(self._shards), "fields": fields,
                  "offsets": "derived" if self._derived else "stored", "columns": table}
        head = json.dumps(header, sort_keys=True).encode()
        out.write(_PREAMBLE.pack(_MAGIC, INDEX_VERSION, len(head)) + head)
        data_start = written = _aligned(_PREAMBLE.size + len(head))
        out.write(bytes(data_start - _PREAMBLE.size - len(head)))
        for name, dtype, parts, missing in columns:
            out.write(bytes(data_start + table[name]["offset"] - written))
            written = data_start + table[name]["offset"]
            for part in parts:
                buf = np.where(part < 0, missing, part).astype(dtype).tobytes()
                out.write(buf)
                written += len(buf)

    def to_bytes(self, fields: Sequence[str]) -> bytes:
        buf = io.BytesIO()
        self.write(buf, fields)
        return buf.getvalue()

    def publish(self, path: Path, fields: Sequence[str]) -> IndexRecord:
        """Write the index to ``path`` under a temporary name, fsync, rename; return its manifest record."""
        path = Path(path)
        tmp = tmp_path_for(path)
        try:
            with open(tmp, "wb") as f:
                out = HashingWriter(f)
                self.write(out, fields)
                f.flush()
                os.fsync(f.fileno())
            publish(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return IndexRecord(name=path.name, bytes=out.size, sha256=out.hexdigest(), xxh3_128=out.xxh3_hexdigest())


def _checked_stamp(path: Path, stat: os.stat_result, record: IndexRecord | None,
                   shard_bytes: Sequence[int] | None) -> Path | None:
    """The node-local file saying that this index file, as it is now, passed :meth:`SampleIndex.open`'s checks
    against this manifest record and these shard sizes: in ``$TMPDIR/fastio-checked-UID/`` (node-local, this
    user's only), named by the file's identity (device, inode, size, mtime, ctime, path), the record and the
    shard sizes. A file changed in place or replaced gets another name, so it is checked again."""
    if record is None:
        return None
    key = hashlib.sha256(repr((os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                               stat.st_ctime_ns, record.as_dict())).encode())
    key.update(np.asarray(shard_bytes if shard_bytes is not None else [], np.int64).tobytes())
    return Path(tempfile.gettempdir()) / f"fastio-checked-{os.getuid()}" / key.hexdigest()


def check_once(path: Path, stat: os.stat_result, record: IndexRecord | None, checks: Callable[[], None],
               shard_bytes: Sequence[int] | None = None) -> None:
    """Run ``checks`` (which raise on a bad file) on the file at ``path`` (``stat``: as opened), unless it is at
    least :data:`CHECKED_STAMP_MIN_BYTES` and passed them on this node already (:func:`_checked_stamp`); after they
    pass on such a file, leave the stamp that says so. The one home of that rule, for ``samples.fxi`` and the probe
    table ``probes.fxp``."""
    stamp = _checked_stamp(path, stat, record, shard_bytes) if stat.st_size >= CHECKED_STAMP_MIN_BYTES else None
    if stamp is not None and _own(stamp):
        return
    checks()
    if stamp is not None:
        try:
            stamp.parent.mkdir(mode=0o700, exist_ok=True)
            if _own(stamp.parent):
                atomic_write_bytes(stamp, f"{path}\n".encode())
        except OSError:
            pass  # only a cost: the next process of this node checks again


def _own(path: Path) -> bool:
    """Whether ``path`` and its folder exist and belong to this user (a stamp another user made means nothing)."""
    try:
        return path.stat().st_uid == os.getuid() == path.parent.stat().st_uid
    except OSError:
        return False


def _derive(span: np.ndarray, sizes: dict[str, np.ndarray], fields: Sequence[str]) -> dict[str, np.ndarray]:
    """Each field's data offset in fastio's layout (fields in sorted order, one 512-byte header each)."""
    at, out = span.copy(), {}
    for f in sorted(fields):
        size = sizes.get(f, np.full(len(span), -1, np.int64))
        have = size >= 0
        out[f] = np.where(have, at, -1)
        at = np.where(have, at + _padded(size) + _BLOCK, at)
    return out


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def build_index(path: Path, shards: Iterable[tuple[ShardRecord, Sequence[IndexEntry]]],
                fields: Sequence[str]) -> IndexRecord:
    """Write the consolidated index of ``shards`` (``(record, parsed .idx entries)`` in manifest order)
    to ``path`` atomically and return the record for the manifest (``make_manifest(index=...)``).

    The one function a writer or a merge of converted parts calls; ValueError if a shard's entries do
    not match its record or name a field ``fields`` lacks.
    """
    builder = IndexBuilder()
    for record, entries in shards:
        builder.add(record, entries)
    return builder.publish(Path(path), fields)


class SampleIndex:
    """An opened index: :meth:`locate` maps dataset-wide indices to byte ranges.

    Built by :meth:`open` (a file, memory-mapped) or :meth:`from_bytes`; either checks the header
    against the manifest's shard counts and fields and raises :class:`DatasetError` naming ``source``.
    """

    def __init__(self, buffer, source: str, shard_samples: Sequence[int], fields: Sequence[str]):
        self.source = source
        counts = np.asarray(shard_samples, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # S + 1
        self.samples = int(self._starts[-1])
        self.fields = sorted(fields)
        if len(buffer) < _PREAMBLE.size:
            raise DatasetError(f"{source}: not a fastio sample index (too short)")
        magic, version, head_len = _PREAMBLE.unpack_from(buffer, 0)
        if magic != _MAGIC:
            raise DatasetError(f"{source}: not a fastio sample index (bad magic)")
        if version != INDEX_VERSION:
            raise DatasetError(f"{source}: sample index version {version}, this fastio reads {INDEX_VERSION}")
        try:
            header = json.loads(bytes(buffer[_PREAMBLE.size:_PREAMBLE.size + head_len]))
            n, shards, stored = header["samples"], header["shards"], header["offsets"]
            columns, idx_fields = header["columns"], header["fields"]
        except (ValueError, KeyError, TypeError) as err:
            raise DatasetError(f"{source}: sample index header does not parse ({err})") from None
        if n != self.samples or shards != len(counts):
            raise DatasetError(f"{source}: sample index lists {count(n, 'sample')} in {count(shards, 'shard')}, the "
                               f"manifest {self.samples} in {len(counts)}")
        if idx_fields != self.fields:
            raise DatasetError(f"{source}: sample index fields {idx_fields} differ from the manifest's {self.fields}")
        if stored not in ("derived", "stored"):
            raise DatasetError(f"{source}: sample index offsets {stored!r} is neither 'derived' nor 'stored'")
        self.derived = stored == "derived"
        data_start = _aligned(_PREAMBLE.size + head_len)
        names = ["span_offset"] + [f"size:{f}" for f in self.fields]
        names += [] if self.derived else [f"offset:{f}" for f in self.fields]
        self._cols: dict[str, np.ndarray] = {}
        for name in names:
            try:
                dtype, offset = np.dtype(columns[name]["dtype"]), data_start + int(columns[name]["offset"])
            except (KeyError, TypeError, ValueError) as err:
                raise DatasetError(f"{source}: sample index column {name!r} is missing or malformed ({err})") from None
            if dtype.kind not in "iu" or offset < data_start or offset + n * dtype.itemsize > len(buffer):
                raise DatasetError(f"{source}: sample index column {name!r} lies outside the file")
            self._cols[name] = np.frombuffer(buffer, dtype, count=n, offset=offset)
        self._missing = {f: np.iinfo(self._cols[f"size:{f}"].dtype).max for f in self.fields}

    @classmethod
    def open(cls, path: Path, shard_samples: Sequence[int], fields: Sequence[str],
             record: IndexRecord | None = None, verify: bool = False, shard_bytes: Sequence[int] | None = None,
             check: bool = True) -> SampleIndex:
        """Memory-map ``path``; its size must be ``record.bytes``, and with ``verify`` its sha256 too.

        With ``check`` (the default) the content is checked too: its xxh3-128 against ``record.xxh3_128``
        (when the manifest has one) and, given ``shard_bytes``, its structure (:meth:`check_structure`), so
        that a swapped or duplicated row is refused before any read trusts it.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                size = stat.st_size
                if record is not None and size != record.bytes:
                    raise DatasetError(f"{path}: sample index is {count(size, 'byte')}, the manifest says {record.bytes}")
                if verify and record is not None and sha256_file(path)[1] != record.sha256:
                    raise DatasetError(f"{path}: sample index sha256 does not match the manifest")
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as err:
            raise DatasetError(f"{path}: sample index cannot be read: {err.strerror}") from None
        index = cls(buffer, str(path), shard_samples, fields)  # the header: what the file claims to be

        def checks() -> None:
            if record is not None and record.xxh3_128 is not None:
                digest = DIGESTS["xxh3_128"]()
                digest.update(memoryview(buffer))
                if digest.hexdigest() != record.xxh3_128:
                    raise DatasetError(f"{path}: sample index xxh3_128 does not match the manifest (changed after "
                                       "it was written: convert or index the dataset again)")
            if shard_bytes is not None:
                index.check_structure(shard_bytes)

        if check:
            check_once(path, stat, record, checks, shard_bytes)
        return index

    def check_structure(self, shard_bytes: Sequence[int], *, chunk: int = 1 << 18) -> None:
        """DatasetError naming the first row whose byte ranges cannot be right: inside a shard every sample
        lies after a tar header and after the previous sample's data (tar order, no two samples sharing
        bytes), and ends inside the shard's size. O(samples), a chunk of rows at a time."""
        sizes = np.asarray(shard_bytes, np.int64)
        if len(sizes) != len(self._starts) - 1:
            raise ValueError(f"{count(len(sizes), 'shard size')} for {count(len(self._starts) - 1, 'shard')}")
        prev_shard, prev_end = -1, 0
        for a in range(0, self.samples, chunk):
            b = min(a + chunk, self.samples)
            first, last = int(self.shard_of(np.array([a]))[0]), int(self.shard_of(np.array([b - 1]))[0])
            bounds = np.clip(self._starts[first:last + 2], a, b)
            rows = self._rows(slice(a, b), np.repeat(np.arange(first, last + 1, dtype=np.int32), np.diff(bounds)))
            end = rows.span_offset + rows.span_size
            shard = rows.shard.astype(np.int64)
            before = np.concatenate([[prev_end], end[:-1]])
            same = shard == np.concatenate([[prev_shard], shard[:-1]])
            floor = np.where(same, before, 0) + _BLOCK  # a member's data follows its header
            bad = (rows.span_offset < floor) | (end > sizes[shard])
            for f in () if self.derived else self.fields:  # derived offsets start at the span by construction
                bad |= (rows.sizes[f] >= 0) & (rows.offsets[f] < rows.span_offset)
            if bad.any():
                j = int(np.argmax(bad))
                s = int(shard[j])
                what = (f"ends at byte {int(end[j])}, past the shard's {count(int(sizes[s]), 'byte')}" if end[j] > sizes[s]
                        else f"starts at byte {int(rows.span_offset[j])}, inside the previous sample or header")
                raise DatasetError(f"{self.source}: sample index row {a + j} (shard #{s}, sample "
                                   f"{a + j - int(self._starts[s])}) {what}: a damaged or tampered index "
                                   "(convert or index the dataset again)")
            prev_shard, prev_end = int(shard[-1]), int(end[-1])

    @classmethod
    def from_bytes(cls, data: bytes, source: str, shard_samples: Sequence[int], fields: Sequence[str]) -> SampleIndex:
        return cls(data, source, shard_samples, fields)

    @property
    def nbytes(self) -> int:
        """Bytes of the columns (what the index costs in memory when all of it is paged in)."""
        return sum(c.nbytes for c in self._cols.values())

    def shard_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard (manifest position) of each dataset-wide index (int32)."""
        return (np.searchsorted(self._starts, indices, "right") - 1).astype(np.int32)

    def shard_start(self, shard: int) -> int:
        """Dataset-wide index of shard ``shard``'s first sample."""
        return int(self._starts[shard])

    def locate(self, indices: np.ndarray) -> Rows:
        """Where the samples ``indices`` (dataset-wide, int) lie; reads only their rows of the index."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.samples):
            raise IndexError(f"sample index out of range 0..{self.samples - 1}")
        return self._rows(idx, self.shard_of(idx))

    def _rows(self, idx: np.ndarray | slice, shard: np.ndarray) -> Rows:
        """:meth:`locate` of the rows ``idx`` (indices, or a slice: no gather) of shards ``shard``."""
        span = self._cols["span_offset"][idx].astype(np.int64)
        sizes, offsets = {}, {}
        for f in self.fields:
            raw = self._cols[f"size:{f}"][idx]
            sizes[f] = np.where(raw == self._missing[f], -1, raw.astype(np.int64))
        if self.derived:
            at, end = span.copy(), span.copy()
            for f in self.fields:
                have = sizes[f] >= 0
                offsets[f] = np.where(have, at, -1)
                end = np.where(have, at + sizes[f], end)
                at = np.where(have, at + _padded(sizes[f]) + _BLOCK, at)
        else:
            end = span.copy()
            for f in self.fields:
                offsets[f] = self._cols[f"offset:{f}"][idx].astype(np.int64)
                end = np.maximum(end, np.where(sizes[f] >= 0, offsets[f] + sizes[f], end))
        return Rows(shard, span, end - span, offsets, sizes)


def check_index(path: Path, record: IndexRecord, shards: Sequence[tuple[ShardRecord, Sequence[IndexEntry]]] | None,
                fields: Sequence[str]) -> list[str]:
    """What is wrong with the index file ``path`` (``fastio verify``): its size and sha256 against the
    manifest's ``record`` and, unless ``shards`` is None (the shards have problems of their own), its
    content against the index rebuilt from ``shards`` (``(record, parsed .idx entries)``)."""
    path = Path(path)
    if not path.is_file():
        return ["is missing"]
    size, digest = sha256_file(path)
    problems = []
    if size != record.bytes:
        problems.append(f"size {count(size, 'byte')}, manifest says {record.bytes}")
    if digest != record.sha256:
        problems.append("sha256 does not match the manifest")
    if record.xxh3_128 is not None and digests_file(path, ("xxh3_128",))[1]["xxh3_128"] != record.xxh3_128:
        problems.append("xxh3_128 does not match the manifest")
    if shards is not None:
        builder = IndexBuilder()
        try:
            for shard, entries in shards:
                builder.add(shard, entries)
            expected = builder.to_bytes(fields)
        except ValueError as err:
            problems.append(f"cannot be rebuilt from the .idx files ({err})")
        else:
            if hashlib.sha256(expected).hexdigest() != digest:
                problems.append("does not match the index rebuilt from the shards' .idx files")
    return problems
