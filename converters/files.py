"""Loose files grouped into samples by basename, as WebDataset groups tar members.

``dir/a.jpg``, ``dir/a.json``, ``dir/a.cls`` -> sample ``dir/a`` with fields ``jpg``, ``json``,
``cls``: the key is the path up to the first dot of the file name, the field is the rest.
"""

from __future__ import annotations

from pathlib import Path

from converters.base import Entry, FileRef, ScanOptions, ScanResult, Skip, rel, unique_key
from fastio.idx import split_member_name
from fastio.images import IMAGE_FIELDS

__all__ = ["NAME", "detect", "scan"]

NAME = "files"
_FIELD_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def detect(source: Path) -> bool:
    """A directory holding at least one visible file at its top level."""
    return source.is_dir() and any(p.is_file() and not p.name.startswith(".") for p in source.iterdir())


def scan(source: Path, options: ScanOptions) -> ScanResult:
    source = Path(source)
    groups: dict[str, dict[str, Path]] = {}
    skipped: list[Skip] = []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relpath = rel(path, source)
        if any(part.startswith(".") for part in Path(relpath).parts):
            skipped.append(Skip(relpath, "hidden file"))
            continue
        stem, ext = split_member_name(relpath)
        if not ext or not set(ext) <= _FIELD_CHARS:
            skipped.append(Skip(relpath, f"no usable extension to name a field ({ext!r})"))
            continue
        group = groups.setdefault(stem, {})
        if ext in group:  # impossible from one stem/ext pair; kept for clarity of the invariant
            skipped.append(Skip(relpath, f"duplicate field {ext!r}"))
            continue
        group[ext] = path
    entries: list[Entry] = []
    taken: set[str] = set()
    image_counts: dict[str, int] = {}
    has_cls = False
    for stem in sorted(groups):
        fields = groups[stem]
        for ext in fields:
            if ext.lower() in IMAGE_FIELDS:
                image_counts[ext] = image_counts.get(ext, 0) + 1
        has_cls = has_cls or "cls" in fields
        entries.append(Entry(
            key=unique_key(stem, taken),
            fields=tuple((ext, FileRef(str(fields[ext]))) for ext in sorted(fields)),
            origin=stem,
        ))
    return ScanResult(
        entries=entries,
        description={"format": NAME, "path": str(source.resolve()), "options": {}},
        skipped=skipped,
        image_field=max(sorted(image_counts), key=lambda f: image_counts[f]) if image_counts else None,
        label_field="cls" if has_cls else None,
    )
