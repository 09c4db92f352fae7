"""What every converter returns: cheap, picklable sample records and a scan result.

A converter turns a source into :class:`Entry` records. A field value is either the bytes
themselves (table text, parquet cells) or a :class:`FileRef` naming a file that the conversion's
worker processes read. Converters never read image files, write tars, hash or know shard sizes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from fastio.images import image_field_for_suffix, is_image_field
from fastio.wds import safe_field_name, sanitize_key

__all__ = [
    "Entry",
    "FieldValue",
    "FileRef",
    "ScanOptions",
    "ScanResult",
    "Skip",
    "image_field_for_suffix",
    "main_image_field",
    "rel",
    "safe_field_name",
    "unique_key",
]


@dataclass(frozen=True)
class FileRef:
    """A field whose bytes are the content of the file at ``path``."""

    path: str


FieldValue = Union[bytes, FileRef]  # noqa: UP007 (a runtime alias: `|` needs Python 3.10 classes)


@dataclass(frozen=True)
class Entry:
    """One sample to be: its key, its fields (name -> bytes or FileRef), and where it came from."""

    key: str
    fields: tuple[tuple[str, FieldValue], ...]
    origin: str  # the file or table row named in errors and in the manifest's "skipped"


@dataclass(frozen=True)
class Skip:
    """An input left out of the dataset, and why."""

    path: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


@dataclass
class ScanResult:
    """A scanned source: entries in a deterministic order plus what the manifest should say about them."""

    entries: list[Entry]
    description: dict[str, Any]  # the manifest's "source" (format, path, options)
    label_map: dict[str, int] | None = None
    skipped: list[Skip] = field(default_factory=list)
    image_field: str | None = None
    label_field: str | None = None


@dataclass(frozen=True)
class ScanOptions:
    """Format options a user may give; each converter uses the ones that apply to it."""

    path_column: str | None = None
    """Table column holding file paths relative to the table's folder (default: detected)."""
    label_column: str | None = None
    """Table column holding the class label (default: ``label`` when present)."""
    key_column: str | None = None
    """Table column holding the sample key (default: derived from the path or the row number)."""


def main_image_field(entries: list[Entry]) -> str | None:
    """The image field most entries have (ties broken by name), or None when no entry has an image."""
    counts: dict[str, int] = {}
    for entry in entries:
        for name, _ in entry.fields:
            if is_image_field(name):
                counts[name] = counts.get(name, 0) + 1
    return max(sorted(counts), key=lambda f: counts[f]) if counts else None


def unique_key(text: str, taken: set[str]) -> str:
    """``sanitize_key(text)``, made unique against ``taken`` with a hash of ``text``; adds it to ``taken``."""
    key = sanitize_key(text)
    if key in taken:
        key = f"{key[:63]}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        n = 1
        base = key
        while key in taken:
            n += 1
            key = f"{base}_{n}"
    taken.add(key)
    return key


def rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in POSIX form (for keys and messages)."""
    return path.relative_to(root).as_posix()
