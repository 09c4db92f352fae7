"""DALI's WebDataset index format (``.idx``), byte-equal to what ``wds2idx`` writes.

An index has a header line ``v1.2 N`` and one line per sample listing, for each tar
member of the sample in tar order, ``ext offset size name`` (offset of the member's
data, not its header).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastio.wds import member_name, split_member_name

__all__ = ["INDEX_VERSION", "IndexEntry", "format_index", "parse_index"]

INDEX_VERSION = "v1.2"


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
    count = int(header[1])
    body = lines[1:]
    if len(body) != count:
        raise ValueError(f"{source}: header says {count} samples, file lists {len(body)}")
    entries = []
    for lineno, line in enumerate(body, start=2):
        parts = line.split(" ")
        if not parts or len(parts) % 4:
            raise ValueError(f"{source}:{lineno}: malformed index line")
        members, key = [], None
        for i in range(0, len(parts), 4):
            ext, offset, size, name = parts[i : i + 4]
            member_key, _ = split_member_name(name)
            key = member_key if key is None else key
            members.append((ext, int(offset), int(size)))
        entries.append(IndexEntry(key=key, members=tuple(members)))
    return entries
