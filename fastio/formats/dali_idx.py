"""DALI's WebDataset index format (``.idx``), byte-equal to what ``wds2idx`` writes.

An index has a header line ``v1.2 N`` and one line per sample listing, for each tar
member of the sample in tar order, ``ext offset size name`` (offset of the member's
data, not its header).

Every index a dataset reads goes through :func:`load_index`, which always checks it, since the
index is tiny next to its shard and a wrong entry delivers one sample's bytes under another's key:

- its sha256 against the manifest's ``idx_sha256`` (hashing costs a few per cent of parsing);
- its structure (:func:`check_index`): the sample count of the manifest; every member name
  ``KEY.EXT`` agreeing with the line's key and extension; no key twice; every member's data
  512-byte aligned after its header, inside the shard's size, and after the previous member's
  data (tar order: no two members share bytes).

The Reader's tar-header check wants only the keys: :func:`key_crcs` checks the sha256 and the line count and
reads each line's key, not its ranges (a fresh reader's first batch, on the path back to training after a
restart, opens every shard it touches).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

import numpy as np

from fastio.formats.wds import member_name, split_member_name
from fastio.words import count

__all__ = ["INDEX_VERSION", "IndexEntry", "check_index", "format_index", "key_crcs", "load_index", "parse_index"]

INDEX_VERSION = "v1.2"
_BLOCK = 512  # tar block: a member's header, and the alignment of its data


@dataclass(frozen=True)
class IndexEntry:
    """One sample of a shard: its key and, per field (extension), the data's byte range."""

    key: str
    members: tuple[tuple[str, int, int], ...]  # (ext, offset, size) in tar order

    @property
    def span(self) -> tuple[int, int]:
        """(offset, size) of the smallest byte range holding every member's data."""
        start = min(offset for _, offset, _ in self.members)
        end = max(offset + size for _, offset, size in self.members)
        return start, end - start


def format_index(entries: list[IndexEntry]) -> str:
    lines = [f"{INDEX_VERSION} {len(entries)}"]
    for entry in entries:
        lines.append(" ".join(f"{ext} {offset} {size} {member_name(entry.key, ext)}" for ext, offset, size in entry.members))
    return "\n".join(lines) + "\n"


def parse_index(text: str, source: str = "<index>") -> list[IndexEntry]:
    """Parse an index; ``source`` names the file in errors."""
    lines = text.splitlines()
    if not lines:
        raise ValueError(f"{source}: empty index file")
    header = lines[0].split()
    if len(header) != 2 or header[0] != INDEX_VERSION or not header[1].isdigit():
        raise ValueError(f"{source}: not a {INDEX_VERSION} WebDataset index (header {lines[0]!r})")
    listed = int(header[1])
    body = lines[1:]
    if len(body) != listed:
        raise ValueError(f"{source}: header says {count(listed, 'sample')}, file lists {len(body)}")
    entries = []
    for lineno, line in enumerate(body, start=2):
        parts = line.split(" ")
        if not parts or len(parts) % 4:
            raise ValueError(f"{source}:{lineno}: malformed index line")
        key, _ = split_member_name(parts[3])
        members = []
        for i in range(0, len(parts), 4):
            ext, offset, size, name = parts[i : i + 4]
            if name != f"{key}.{ext}":
                raise ValueError(f"{source}:{lineno}: member {name!r} does not match key {key!r} and field {ext!r}")
            try:
                member = (ext, int(offset), int(size))
            except ValueError:
                member = (ext, -1, -1)
            if member[1] < 0 or member[2] < 0:
                raise ValueError(f"{source}:{lineno}: member {name!r} has offset {offset[:24]!r} and size "
                                 f"{size[:24]!r}, not two non-negative integers")
            members.append(member)
        entries.append(IndexEntry(key=key, members=tuple(members)))
    return entries


def check_index(entries: list[IndexEntry], *, samples: int, tar_bytes: int, source: str = "<index>") -> None:
    """ValueError naming ``source`` and the first entry that cannot describe a shard of ``tar_bytes``
    bytes holding ``samples`` samples (see the module docstring for the rules)."""
    if len(entries) != samples:
        raise ValueError(f"{source}: index lists {count(len(entries), 'sample')}, manifest says {samples}")
    keys: set[str] = set()
    end = 0  # where the previous member's data ended
    for n, entry in enumerate(entries):
        key, members = entry.key, entry.members
        if key in keys:
            raise ValueError(f"{source}: entry {n}: key {key!r} is listed twice")
        keys.add(key)
        if len(members) > 1 and len({m[0] for m in members}) != len(members):
            raise ValueError(f"{source}: entry {n} (key {key!r}): a field is listed twice")
        for ext, offset, size in members:
            if offset % _BLOCK or offset < end + _BLOCK or offset + size > tar_bytes:
                what = f"{source}: entry {n} (key {key!r}) field {ext!r}: offset {offset} size {size}"
                if offset + size > tar_bytes:
                    raise ValueError(f"{what} reaches past the end of the shard ({count(tar_bytes, 'byte')})")
                raise ValueError(f"{what} is not the start of a member's data after the previous member")
            end = offset + -(-size // _BLOCK) * _BLOCK


def _check_sha256(data: bytes, sha256: str, source: str) -> None:
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{source}: sha256 does not match the manifest (the index was changed or replaced)")


def key_crcs(data: bytes, *, samples: int, sha256: str, source: str = "<index>") -> np.ndarray:
    """The CRC-32 of each sample's key, in shard order (uint32), from an ``.idx`` file's bytes: their sha256
    checked against the manifest's, the header and the line count against ``samples``, each line read as far as
    ``ext offset size KEY.EXT`` in ASCII; ValueError naming ``source`` (and the line) otherwise.

    What the Reader's tar-header check needs, at a small part of :func:`load_index`'s cost (no entries made, no
    ranges parsed). The other rules of :func:`check_index` are not checked here: a key is only compared with
    the tar header the sample index points at, so a wrong one is refused there, never delivered.
    """
    _check_sha256(data, sha256, source)
    lines = data.split(b"\n")
    header = lines[0].split(b" ")
    if len(header) != 2 or header[0] != INDEX_VERSION.encode() or header[1] != str(samples).encode():
        raise ValueError(f"{source}: header {lines[0][:40]!r} is not '{INDEX_VERSION} {samples}'")
    if len(lines) != samples + 2 or lines[-1]:
        raise ValueError(f"{source}: header says {count(samples, 'sample')}, file lists {len(lines) - 2}")
    if not data.isascii():
        raise ValueError(f"{source}: not an index (a non-ASCII byte)")
    out = np.empty(samples, np.uint32)
    for j, line in enumerate(lines[1:-1]):
        parts = line.split(b" ", 4)
        name = parts[3] if len(parts) >= 4 else b""
        dot = name.find(b".", name.rfind(b"/") + 1)
        if dot < 0 or name[dot + 1:] != parts[0]:
            raise ValueError(f"{source}:{j + 2}: malformed index line (member {name[:60]!r})")
        out[j] = zlib.crc32(name[:dot])
    return out


def load_index(data: bytes, *, samples: int, tar_bytes: int, sha256: str, source: str = "<index>") -> list[IndexEntry]:
    """Check ``data`` (an ``.idx`` file's bytes) against the manifest's ``sha256``, parse it and
    :func:`check_index` it; ValueError naming ``source`` and what is wrong."""
    _check_sha256(data, sha256, source)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as err:
        raise ValueError(f"{source}: not an index (non-ASCII byte at {err.start})") from None
    entries = parse_index(text, source)
    check_index(entries, samples=samples, tar_bytes=tar_bytes, source=source)
    return entries
