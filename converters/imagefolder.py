"""``SOURCE/<class>/<file>`` (ImageNet layout): label = index of the class in sorted class names.

Files are images, videos or audio files (fields named by their suffix: ``webm``, ``flac``, ...;
:mod:`fastio.formats.media`).

Keys are ``<class>/<path below the class folder, without suffix>``; images are fields named by type
(``jpg``, ``png``, ...; a folder may mix them), the label is ``cls`` (ASCII integer). Folders are walked
under the symlink policy of :func:`~fastio.converters.base.walk_files`: a class folder that links back to
SOURCE (or to a folder containing it) is a loop and is skipped, and an image reached twice is packed once.
"""

from __future__ import annotations

from pathlib import Path

from fastio.converters.base import (
    ClassList,
    Entry,
    FileRef,
    Keys,
    ScanOptions,
    ScanResult,
    Skip,
    image_field_for_suffix,
    main_image_field,
    rel,
    walk_files,
)
from fastio.errors import ConvertError
from fastio.formats.media import media_field_for_suffix

__all__ = ["NAME", "SPLIT_NAMES", "detect", "scan", "scan_splits", "split_problems", "splits", "strays"]

NAME = "imagefolder"


def _visible_dirs(source: Path) -> list[Path]:
    return sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))


def _field(suffix: str) -> str | None:
    return image_field_for_suffix(suffix) or media_field_for_suffix(suffix)


def detect(source: Path) -> bool:
    """A directory with class folders holding images (or videos, audio) and none of its own."""
    if not source.is_dir():
        return False
    top = [p for p in source.iterdir() if not p.name.startswith(".")]
    if any(p.is_file() and _field(p.suffix) for p in top):
        return False
    for folder in (p for p in top if p.is_dir()):
        for path in folder.rglob("*"):
            if path.is_file() and _field(path.suffix):
                return True
    return False


SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "dev", "eval"})
"""Folder names of a dataset's splits (lowercased): an image folder whose every class folder is named so, and holds
class folders of its own, is a dataset already split (:func:`splits`)."""


def splits(source: Path) -> list[str]:
    """The folders of ``source`` that are splits of a dataset already split (``images/train/<class>/``,
    ``images/val/<class>/``): every visible folder is named as a split and holds a folder holding an image (video,
    audio), and none an image of its own (:func:`split_problems`); ``[]`` for any other folder."""
    folders = _split_folders(source)
    if not folders or split_problems(source):
        return []
    return [d.name for d in folders]


def _split_folders(source: Path) -> list[Path]:
    """The visible folders of ``source`` when every one is named as a split (:data:`SPLIT_NAMES`), else ``[]``."""
    folders = _visible_dirs(source)
    return [] if any(d.name.lower() not in SPLIT_NAMES for d in folders) else folders


def split_problems(source: Path) -> list[tuple[str, str]]:
    """The split folders of ``source`` (every visible folder named as a split) that are no split of class folders,
    and why: one holding images (videos, audio) outside class folders, as ImageNet's raw ``val/`` holds its images
    (no labels to give them), or one holding no class folder of images (an empty ``test/``). Labelled by its
    folders, such a source would have every label a split's name. ``[]`` for any other folder."""
    problems = []
    for split in _split_folders(source):
        if any(p.is_file() and not p.name.startswith(".") and _field(p.suffix) for p in split.iterdir()):
            problems.append((split.name, "holds images outside class folders"))
        elif not any(p.is_file() and _field(p.suffix) for sub in _visible_dirs(split) for p in sub.rglob("*")):
            problems.append((split.name, "holds no class folder of images"))
    return problems


def strays(source: Path) -> list[str]:
    """The images (videos, audio files) beside class folders of images, none of them grouped with another file of its
    name as loose files are (``a.jpg`` with ``a.json``): what makes ``source`` an image folder with stray files or
    loose files alike (``[]`` when it is neither; :func:`fastio.converters.detect` then refuses to guess)."""
    if not source.is_dir():
        return []
    top = sorted(p for p in source.iterdir() if not p.name.startswith("."))
    files = [p for p in top if p.is_file()]
    media = [p for p in files if _field(p.suffix)]
    stems = [p.name.split(".", 1)[0] for p in files]
    if not media or any(stems.count(p.name.split(".", 1)[0]) > 1 for p in media):
        return []
    if not any(path.is_file() and _field(path.suffix) for d in top if d.is_dir() for path in d.rglob("*")):
        return []
    return [p.name for p in media]


def scan(source: Path, options: ScanOptions) -> ScanResult:
    source = Path(source)
    files, skipped = walk_files(source)
    refused = {s.path for s in skipped}
    label_map = _label_map([d for d in _visible_dirs(source) if d.name not in refused], options.classes)
    entries, renamed = _entries(source, files, label_map, skipped, "")
    return _result(source, entries, label_map, skipped, renamed, {})


def scan_splits(source: Path, names: list[str], options: ScanOptions) -> ScanResult:
    """A dataset already split (:func:`splits`): ``source/<split>/<class>/<file>``, each split's entries keyed as its
    own scan would key them, labelled from ONE class list, the sorted union of every split's class folders, so that
    label k is the same class in every split. :attr:`ScanResult.splits` holds each split's entry indices;
    :attr:`ScanResult.notes` says which split lacks which class (``val has no 'cat'``)."""
    source = Path(source)
    walked, skipped = {}, []
    for name in names:
        files, refused = walk_files(source / name)
        walked[name] = (files, {s.path for s in refused})
        skipped += [Skip(f"{name}/{s.path}", s.reason, s.error) for s in refused]
    held = {name: [d.name for d in _visible_dirs(source / name) if d.name not in walked[name][1]] for name in names}
    label_map = _label_map([source / name / c for name in names for c in held[name]], options.classes)
    entries, splits, renamed, notes = [], {}, [], []
    for name in names:
        found, more = _entries(source / name, walked[name][0], {c: label_map[c] for c in held[name]}, skipped,
                               f"{name}/")
        splits[name] = list(range(len(entries), len(entries) + len(found)))
        entries += found
        renamed += more
        notes += [f"{name} has no {c!r}" for c in label_map if c not in held[name]]
    skipped += [Skip(p.name, "not inside a split folder") for p in sorted(source.iterdir())
                if p.is_file() and not p.name.startswith(".")]
    result = _result(source, entries, label_map, skipped, renamed, {"splits": list(names)})
    result.splits, result.notes = splits, notes
    return result


def _label_map(folders: list[Path], classes: ClassList | None) -> dict[str, int]:
    """Label by class name: the sorted names of ``folders`` (class folders), or ``classes``' list, which must name
    every one of them (else a ConvertError naming the first it does not)."""
    if classes is None:
        return {name: i for i, name in enumerate(sorted({d.name for d in folders}))}
    for folder in folders:
        if folder.name not in classes.names:
            n = len(classes.names)
            shown = ", ".join(classes.names[:8]) + (", ..." if n > 8 else "")
            raise ConvertError(f"{folder}: a class folder not in the class list of classes_from={classes.origin!r} "
                               f"({n} classes: {shown})")
    return {name: i for i, name in enumerate(classes.names)}


def _entries(root: Path, files: list[Path], label_map: dict[str, int], skipped: list[Skip], prefix: str
             ) -> tuple[list[Entry], list[tuple[str, str, str]]]:
    """The entries of the class folders ``label_map`` names below ``root`` (their keys unique among themselves),
    and the inputs renamed; adds what is no sample to ``skipped``, its path led by ``prefix`` (a split's
    ``val/``), as are the entries' origins."""
    entries: list[Entry] = []
    keys = Keys()
    for path in files:
        relpath = rel(path, root)
        name = relpath.split("/", 1)[0]
        if name not in label_map:
            skipped.append(Skip(prefix + relpath, "not inside a class folder"))
            continue
        field = _field(path.suffix)
        if field is None:
            skipped.append(Skip(prefix + relpath,
                                f"not an image, video or audio file (suffix {path.suffix or 'none'!r})"))
            continue
        key = keys.key(relpath[: len(relpath) - len(path.suffix)], prefix + relpath)
        entries.append(Entry(
            key=key,
            fields=((field, FileRef(str(path))), ("cls", str(label_map[name]).encode())),
            origin=prefix + relpath,
        ))
    held = {e.origin[len(prefix):].split("/", 1)[0] for e in entries}
    skipped += [Skip(prefix + name, f"a class folder with no image, video or audio file: label {label} has no samples")
                for name, label in label_map.items() if name not in held]
    return entries, keys.renamed


def _result(source: Path, entries: list[Entry], label_map: dict[str, int], skipped: list[Skip],
            renamed: list[tuple[str, str, str]], options: dict) -> ScanResult:
    skipped.sort(key=lambda s: s.path)
    return ScanResult(
        entries=entries,
        description={"format": NAME, "path": str(source.resolve()), "options": options},
        label_map=label_map,
        skipped=skipped,
        image_field=main_image_field(entries),
        label_field="cls",
        label_rule="names",
        renamed=renamed,
    )
