"""``SOURCE/<class>/<file>`` (ImageNet layout): label = index of the class in sorted class names.

Keys are ``<class>/<path below the class folder, without suffix>``; images are fields named by type
(``jpg``, ``png``, ...), the label is ``cls`` (ASCII integer).
"""

from __future__ import annotations

from pathlib import Path

from fastio.converters.base import (
    Entry,
    FileRef,
    ScanOptions,
    ScanResult,
    Skip,
    image_field_for_suffix,
    main_image_field,
    rel,
    unique_key,
)

__all__ = ["NAME", "detect", "scan"]

NAME = "imagefolder"


def _visible_dirs(source: Path) -> list[Path]:
    return sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))


def detect(source: Path) -> bool:
    """A directory with class folders holding images and no image files of its own."""
    if not source.is_dir():
        return False
    top = [p for p in source.iterdir() if not p.name.startswith(".")]
    if any(p.is_file() and image_field_for_suffix(p.suffix) for p in top):
        return False
    for folder in (p for p in top if p.is_dir()):
        for path in folder.rglob("*"):
            if path.is_file() and image_field_for_suffix(path.suffix):
                return True
    return False


def scan(source: Path, options: ScanOptions) -> ScanResult:
    source = Path(source)
    classes = [d.name for d in _visible_dirs(source)]
    label_map = {name: i for i, name in enumerate(classes)}
    entries: list[Entry] = []
    skipped: list[Skip] = []
    taken: set[str] = set()
    for path in sorted(p for p in source.iterdir() if not p.is_dir()):
        skipped.append(Skip(rel(path, source), "not inside a class folder"))
    for name in classes:
        for path in sorted(p for p in (source / name).rglob("*") if p.is_file()):
            relpath = rel(path, source)
            field = image_field_for_suffix(path.suffix)
            if field is None:
                skipped.append(Skip(relpath, f"not an image file (suffix {path.suffix or 'none'!r})"))
                continue
            key = unique_key(relpath[: len(relpath) - len(path.suffix)], taken)
            entries.append(Entry(
                key=key,
                fields=((field, FileRef(str(path))), ("cls", str(label_map[name]).encode())),
                origin=relpath,
            ))
    return ScanResult(
        entries=entries,
        description={"format": NAME, "path": str(source.resolve()), "options": {}},
        label_map=label_map,
        skipped=skipped,
        image_field=main_image_field(entries),
        label_field="cls",
    )

