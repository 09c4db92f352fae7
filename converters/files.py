"""Loose files grouped into samples by basename, as WebDataset groups tar members.

``dir/a.jpg``, ``dir/a.json``, ``dir/a.cls`` -> sample ``dir/a`` with fields ``jpg``, ``json``,
``cls``: the key is the path up to the first dot of the file name, the field is the rest, lowercased as WebDataset
reads it (``a.JPG`` is field ``jpg``; a second file of the same field, ``a.jpg`` beside it, is refused). When some samples
have a ``cls`` label, a sample without one is skipped and listed. Folders are walked under the symlink
policy of :func:`~fastio.converters.base.walk_files`.
"""

from __future__ import annotations

from pathlib import Path

from fastio.converters.base import (
    Entry,
    FileRef,
    Keys,
    ScanOptions,
    ScanResult,
    Skip,
    main_image_field,
    rel,
    walk_files,
)
from fastio.formats.wds import field_of, is_field_name, split_member_name

__all__ = ["NAME", "detect", "scan"]

NAME = "files"


def detect(source: Path) -> bool:
    """A directory holding at least one visible file at its top level."""
    return source.is_dir() and any(p.is_file() and not p.name.startswith(".") for p in source.iterdir())


def scan(source: Path, options: ScanOptions) -> ScanResult:
    source = Path(source)
    groups: dict[str, dict[str, Path]] = {}
    files, skipped = walk_files(source)
    for path in files:
        relpath = rel(path, source)
        stem, ext = split_member_name(relpath)
        if not is_field_name(ext):
            skipped.append(Skip(relpath, f"no usable extension to name a field ({ext!r})"))
            continue
        fields = groups.setdefault(stem, {})
        field = field_of(ext)
        if field in fields:  # a.JPG and a.jpg: webdataset refuses a sample holding a field twice
            skipped.append(Skip(relpath, f"field {field!r} twice: {rel(fields[field], source)} is that field of "
                                f"sample {stem!r} (fields are suffixes lowercased, as WebDataset reads them)",
                                error=True))
            continue
        fields[field] = path
    entries: list[Entry] = []
    keys = Keys()
    has_cls = any("cls" in fields for fields in groups.values())
    for stem in sorted(groups):
        fields = groups[stem]
        if has_cls and "cls" not in fields:
            skipped.append(Skip(stem, "no label (other samples have a .cls file, this one has none)", error=True))
            continue
        entries.append(Entry(
            key=keys.key(stem, stem),
            fields=tuple((ext, FileRef(str(fields[ext]))) for ext in sorted(fields)),
            origin=stem,
        ))
    return ScanResult(
        entries=entries,
        description={"format": NAME, "path": str(source.resolve()), "options": {}},
        skipped=skipped,
        image_field=main_image_field(entries),
        label_field="cls" if has_cls else None,
        label_rule="integers" if has_cls else None,
        renamed=keys.renamed,
    )
