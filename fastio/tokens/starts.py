"""The document-starts table of a token dataset, ``DEST/doc-starts.fxs``: where every ``every``-th document of each
shard starts, so that a Loader finds its packing's block edges in one small read instead of one ``pread`` of the
``.idx`` files per block (which at 10^8 documents costs a tenth of a second warm, and much more when the ``.idx``
pages are not in the page cache).

Written by ``fastio convert --tokenizer``, ``fastio merge`` and ``fastio index --eos-id`` before the manifest, which
records it as ``tokens.starts`` (name, size, sha256, xxh3-128); its xxh3-128 is checked at every open, and
``fastio verify`` checks its values against the ``.idx`` files. A dataset without one (written before it existed)
is read as before, from the ``.idx`` files.

Layout, little-endian: ``b"FXSTARTS"``, version u32 (1), ``every`` u32, shard count S u64, then S u64 entry
counts, then each shard's entries as int64: the token offsets in its ``.bin`` of documents 0, every, 2 * every,
..., and its end (``ceil(documents / every) + 1`` entries).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastio.dataset.manifest import IndexRecord
from fastio.errors import DatasetError
from fastio.formats.megatron import MegatronIndex
from fastio.storage.atomic import atomic_write_bytes
from fastio.storage.checksum import DIGESTS
from fastio.words import count

__all__ = ["STARTS_EVERY", "STARTS_NAME", "read_starts", "shard_starts", "starts_bytes", "write_starts"]

STARTS_NAME = "doc-starts.fxs"
STARTS_EVERY = 1024
"""Documents between two entries: block sizes (``fastio.Tokens(window=...)``) that are multiples of it use the
table (the default window, 4,096, is)."""
_MAGIC = b"FXSTARTS"
_VERSION = 1
_HEAD = struct.Struct("<8sIIQ")


def _entries(documents: int, every: int) -> int:
    return -(-documents // every) + 1


def shard_starts(index: MegatronIndex, every: int = STARTS_EVERY) -> np.ndarray:
    """One shard's entries: the token offsets of documents 0, ``every``, ... and the end, from its ``.idx``."""
    return index.starts(np.r_[np.arange(0, index.documents, every), index.documents])


def starts_bytes(values: Sequence[np.ndarray], every: int = STARTS_EVERY) -> bytes:
    """The table's bytes for shards whose entries (:func:`shard_starts`) are ``values``, in the manifest's order."""
    counts = np.array([v.size for v in values], "<u8")
    body = np.concatenate(values).astype("<i8") if values else np.zeros(0, "<i8")
    return _HEAD.pack(_MAGIC, _VERSION, every, len(values)) + counts.tobytes() + body.tobytes()


def write_starts(folder: Path, values: Sequence[np.ndarray], every: int = STARTS_EVERY) -> IndexRecord:
    """Publish ``folder/doc-starts.fxs`` for shards whose entries are ``values`` (atomically) and return the
    manifest's record of it."""
    data = starts_bytes(values, every)
    atomic_write_bytes(Path(folder) / STARTS_NAME, data)
    return IndexRecord(name=STARTS_NAME, bytes=len(data), sha256=DIGESTS["sha256"](data).hexdigest(),
                       xxh3_128=_xxh3(data))


def _xxh3(data: bytes) -> str:
    h = DIGESTS["xxh3_128"]()
    h.update(data)
    return h.hexdigest()


def read_starts(path: Path, record: IndexRecord, documents: Sequence[int]) -> tuple[int, list[np.ndarray]]:
    """(``every``, each shard's entries) of the table at ``path``, checked against the manifest's ``record`` (size,
    xxh3-128 or sha256) and against the shards' document counts ``documents``; DatasetError naming the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DatasetError(f"{path}: document starts table cannot be read: {err.strerror or err}") from None
    digest = _xxh3(data) if record.xxh3_128 else DIGESTS["sha256"](data).hexdigest()
    if len(data) != record.bytes or digest != (record.xxh3_128 or record.sha256):
        raise DatasetError(f"{path}: document starts table does not match the manifest ({count(len(data), 'byte')}, "
                           f"{record.bytes} recorded); run fastio verify")
    magic, version, every, shards = _HEAD.unpack_from(data) if len(data) >= _HEAD.size else (b"", 0, 0, 0)
    if magic != _MAGIC or version != _VERSION or every < 1 or shards != len(documents) or \
            len(data) < _HEAD.size + 8 * shards:
        raise DatasetError(f"{path}: not a version-{_VERSION} document starts table of {count(len(documents), 'shard')}")
    counts = np.frombuffer(data, "<u8", shards, _HEAD.size).astype(np.int64)
    want = np.array([_entries(d, every) for d in documents], np.int64)
    if not np.array_equal(counts, want) or len(data) != _HEAD.size + 8 * shards + 8 * int(want.sum()):
        raise DatasetError(f"{path}: its entry counts do not fit the manifest's shards (every {count(every, 'document')})")
    values = np.frombuffer(data, "<i8", int(want.sum()), _HEAD.size + 8 * shards)
    return every, np.split(values, np.cumsum(want)[:-1])
