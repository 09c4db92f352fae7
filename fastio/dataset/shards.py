"""The shard writer: samples in, WebDataset tar shards + DALI ``.idx`` files + the consolidated sample
index (:mod:`fastio.dataset.sample_table`) + manifest out.

Every shard is written under a hidden temporary name, fsynced and renamed; the sample index next, the
manifest (which records the index's size and sha256) last. Used as a context manager, an error inside
the ``with`` block drops the shard being written (:meth:`ShardWriter.abort`), so nothing half-written
becomes visible.

Tars are reproducible: members sorted by field within a sample, mtime 0, uid/gid 0, empty owner
names, mode 0444, USTAR headers only. Members are written straight to the file (headers built byte for
byte as ``tarfile.TarInfo.tobuf`` makes them), which is what webdataset's TarWriter does too, without
importing webdataset (and through it torch) into ``fastio convert``.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.dataset.manifest import SHARDS_DIR, Manifest, ShardRecord, make_manifest, write_manifest
from fastio.dataset.sample_table import INDEX_NAME, IndexBuilder
from fastio.formats.dali_idx import IndexEntry, format_index
from fastio.formats.wds import check_member, is_key, is_plain_name, member_name
from fastio.storage.atomic import atomic_write_bytes, publish, tmp_path_for
from fastio.storage.checksum import HashingWriter

__all__ = ["ShardWriter", "Sample", "BLOCK", "sample_span", "starts_new_shard"]

BLOCK = 512
Sample = dict[str, Any]  # {"__key__": str, field: bytes}


@dataclass
class _OpenShard:
    path: Path
    tmp: Path
    file: Any
    out: HashingWriter
    entries: list[IndexEntry] = field(default_factory=list)
    pos: int = 0  # logical end of the tar so far (header + padded data of each member)


class ShardWriter:
    """Write samples into ``DEST/shards/NAME-NNNNNN.tar`` and publish ``DEST/samples.fxi`` and
    ``DEST/manifest.json`` on close.

    ``with ShardWriter(dest) as writer: ...; writer.close(...)``: leaving the block by an exception
    aborts (drops the shard being written, publishes no manifest); leaving it normally closes the
    writer if :meth:`close` has not been called.

    Args:
        dest: output directory (created if missing).
        name: shard name prefix.
        max_bytes: start a new shard before one would exceed this size (a single larger sample
            still gets a shard of its own).
        max_samples: at most this many samples per shard (None: unlimited).
    """

    def __init__(self, dest: Path, *, name: str = "shard", max_bytes: int = 256 * 10**6,
                 max_samples: int | None = None):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_samples is not None and max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples}")
        if not is_plain_name(name):
            raise ValueError(f"name must be letters, digits, '_' or '-', got {name!r}")
        self.dest = Path(dest)
        self.name, self.max_bytes, self.max_samples = name, max_bytes, max_samples
        self.shards: list[ShardRecord] = []
        self.fields: set[str] = set()
        self.manifest: Manifest | None = None
        self._keys: set[str] = set()
        self._open: _OpenShard | None = None
        self._index = IndexBuilder()
        (self.dest / SHARDS_DIR).mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.manifest is None:
            self.close()

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards) + (len(self._open.entries) if self._open else 0)

    def write(self, sample: Sample) -> None:
        if self.manifest is not None:
            raise ValueError(f"{self.dest}: the shard writer is closed")
        key = sample.get("__key__")
        if not is_key(key):
            raise ValueError(f"sample key {key!r} is not a safe WebDataset key (see fastio.formats.wds.sanitize_key)")
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}")
        members = sorted((k, v) for k, v in sample.items() if k != "__key__")
        if not members:
            raise ValueError(f"sample {key!r} has no fields")
        for ext, value in members:
            check_member(key, ext)
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"sample {key!r}: field {ext!r} is {type(value).__name__}, not bytes")
        size = sample_span(len(v) for _, v in members)
        shard = self._open
        if shard is not None and starts_new_shard(shard.pos, len(shard.entries), size, self.max_bytes,
                                                  self.max_samples):
            self._finish()
        if self._open is None:
            self._start()
        shard = self._open
        offsets = []
        for ext, value in members:
            offsets.append((ext, shard.pos + BLOCK, len(value)))
            shard.pos += BLOCK + _padded(len(value))
        for ext, value in members:
            shard.out.write(_member_header(member_name(key, ext), len(value)))
            shard.out.write(value)
            shard.out.write(bytes(_padded(len(value)) - len(value)))
        shard.entries.append(IndexEntry(key=key, members=tuple(offsets)))
        self._keys.add(key)
        self.fields.update(ext for ext, _ in members)

    def close(self, **manifest_fields: Any) -> Manifest:
        """Publish the last shard, the sample index, then the manifest (with ``manifest_fields`` added); return it."""
        if self.manifest is not None:
            raise ValueError(f"{self.dest}: the shard writer is already closed")
        if self._open is not None:
            self._finish()
        index = self._index.publish(self.dest / INDEX_NAME, sorted(self.fields))
        manifest = make_manifest(name=self.name, shards=self.shards, fields=sorted(self.fields), index=index,
                                 **manifest_fields)
        write_manifest(self.dest, manifest)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Drop the shard being written (its temporary file is removed); shards already published stay."""
        if self._open is not None:
            self._open.file.close()
            self._open.tmp.unlink(missing_ok=True)
            self._open = None

    def _start(self) -> None:
        path = self.dest / SHARDS_DIR / f"{self.name}-{len(self.shards):06d}.tar"
        tmp = tmp_path_for(path)
        f = open(tmp, "wb")  # noqa: SIM115 (closed by _finish or abort)
        self._open = _OpenShard(path=path, tmp=tmp, file=f, out=HashingWriter(f))

    def _finish(self) -> None:
        shard, self._open = self._open, None
        end = _tar_size(shard.pos)
        shard.out.write(bytes(end - shard.pos))  # the two closing zero blocks and the record padding
        assert shard.out.size == end, (shard.path, shard.out.size, end)
        shard.file.flush()
        os.fsync(shard.file.fileno())
        shard.file.close()
        idx_text = format_index(shard.entries).encode()
        publish(shard.tmp, shard.path)
        record = ShardRecord(name=shard.path.name, samples=len(shard.entries), bytes=shard.out.size,
                             sha256=shard.out.hexdigest(), idx_sha256=hashlib.sha256(idx_text).hexdigest(),
                             xxh3_128=shard.out.xxh3_hexdigest())
        atomic_write_bytes(self.dest / SHARDS_DIR / record.idx_name, idx_text)
        self._index.add(record, shard.entries)
        self.shards.append(record)


def sample_span(member_sizes) -> int:
    """Bytes a sample takes in a tar: a header block plus the padded data, per member."""
    return sum(BLOCK + _padded(n) for n in member_sizes)


def starts_new_shard(members_end: int, samples: int, span: int, max_bytes: int, max_samples: int | None) -> bool:
    """The one cut rule: does a sample of ``span`` bytes go into a new shard, after an open shard whose
    ``samples`` members end at ``members_end``? (Used by the writer, and by ``fastio merge`` to find where a
    single conversion would have cut.)"""
    return samples > 0 and (_tar_size(members_end + span) > max_bytes
                            or (max_samples is not None and samples >= max_samples))


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _member_header(name: str, size: int) -> bytes:
    """The USTAR header of a regular member: mode 0444, mtime 0, uid/gid 0, no owner names.

    Byte for byte what ``tarfile.TarInfo.tobuf(USTAR_FORMAT)`` makes, built directly for the usual
    short ASCII name (``TarInfo`` costs more than hashing and writing a typical image).
    """
    raw = name.encode("ascii", "strict")
    if len(raw) > 100 or size >= 8**11:  # prefix/name split or a size in base-256: tarfile's own code
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uname, info.gname = size, 0o444, 0, "", ""
        return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")
    head = raw.ljust(100, b"\0") + b"%011o\0" % size
    chksum = _HEADER_SUM + sum(head)
    return b"".join((raw.ljust(100, b"\0"), _HEADER_MODE_IDS, b"%011o\0" % size, _HEADER_MTIME,
                     b"%06o\0 " % chksum, _HEADER_TAIL))


# The constant parts of _member_header: mode, uid, gid; mtime; type, link name, magic, version, owner
# names, device numbers (empty for a regular file), prefix and padding. _HEADER_SUM is their byte sum
# plus the checksum field's eight spaces (the USTAR rule).
_HEADER_MODE_IDS = b"0000444\0" + b"0000000\0" * 2
_HEADER_MTIME = b"00000000000\0"
_HEADER_TAIL = (tarfile.REGTYPE + b"\0" * 100 + tarfile.POSIX_MAGIC + b"\0" * 64 + b"\0" * 16
                + b"\0" * 155).ljust(BLOCK - 100 - 24 - 12 - 12 - 8, b"\0")
_HEADER_SUM = sum(_HEADER_MODE_IDS) + sum(_HEADER_MTIME) + 8 * ord(" ") + sum(_HEADER_TAIL)


def _tar_size(members_end: int) -> int:
    """Size of a closed tar whose members end at ``members_end``: two zero blocks, padded to a record."""
    record = tarfile.RECORDSIZE
    return (members_end + 2 * BLOCK + record - 1) // record * record
