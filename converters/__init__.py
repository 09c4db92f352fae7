"""Source formats fastio converts, one module each, and how a format is chosen or detected.

``scan(source, fmt, options)`` returns a :class:`~fastio.converters.base.ScanResult`: the samples to write,
in a deterministic order, without having read any image.
"""

from __future__ import annotations

from pathlib import Path

from fastio.converters import files, imagefolder, parquet, table
from fastio.converters.base import Entry, FileRef, ScanOptions, ScanResult, Skip, image_field_for_suffix
from fastio.errors import ConvertError
from fastio.formats.media import is_video_field, media_field_for_suffix
from fastio.words import agree, count

__all__ = ["FORMATS", "TABLE_FORMATS", "Entry", "FileRef", "ScanOptions", "ScanResult", "Skip", "detect",
           "refuse_classes", "refuse_table_options", "scan"]

FORMATS = ("imagefolder", "csv", "jsonl", "parquet", "files")
TABLE_FORMATS = ("csv", "jsonl", "parquet")
"""The formats whose rows the table options of :class:`ScanOptions` (columns, label rule, root) apply to."""


def _refuse_unsplit(source: Path) -> None:
    """ConvertError for a folder of splits one of which is no split of class folders
    (:func:`imagefolder.split_problems`: ImageNet's raw ``val/``, its images flat): labelled by its folders, every
    label would be a split's name."""
    problems = imagefolder.split_problems(source)
    if problems:
        names = ", ".join(d.name for d in sorted(source.iterdir()) if d.is_dir() and not d.name.startswith("."))
        why = ", ".join(f"{name} {problem}" for name, problem in problems)
        raise ConvertError(f"{source}: already split ({names}), but {why}: labelled by these folders, every label "
                           "would be a split's name; convert the splits of class folders (the others moved aside), "
                           "those of loose images as loose files (format='files') or from a table naming their "
                           "labels, or give format='imagefolder' to label by the split folders")


def detect(source: Path) -> str:
    """The format of ``source``; ConvertError naming it when it is missing, empty or unrecognised."""
    source = Path(source)
    if not source.exists():
        raise ConvertError(f"{source}: no such file or directory")
    if source.is_dir():
        if not any(not p.name.startswith(".") for p in source.iterdir()):
            raise ConvertError(f"{source}: source directory is empty")
        tables = [p.name for p in sorted(source.iterdir())
                  if not p.name.startswith(".") and (table.detect(p) or parquet.detect(p))]
        if imagefolder.detect(source):
            if tables:
                raise ConvertError(f"{source}: cannot tell the format: class folders of images, and a table beside "
                                   f"them ({', '.join(tables[:3])}): give the table as SOURCE ({source / tables[0]}) "
                                   "to convert its rows, or format='imagefolder' to label images by their folder")
            _refuse_unsplit(source)
            return imagefolder.NAME
        stray = imagefolder.strays(source)
        if stray:
            n = len(stray)
            shown = ", ".join(stray[:3]) + (", ..." if n > 3 else "")
            raise ConvertError(f"{source}: cannot tell the format: class folders of images, and {count(n, 'file')} "
                               f"beside them ({shown}) that {agree(n, 'is', 'are')} an image, video or audio "
                               f"{agree(n, 'file')}; give format='imagefolder' (the files beside the class folders are "
                               "skipped and listed) or format='files'")
        if tables and files.detect(source):
            raise ConvertError(f"{source}: a folder of tables ({', '.join(tables[:3])}{', ...' if len(tables) > 3 else ''}"
                               "): give one as SOURCE (a conversion reads one table), or format='files' to pack the "
                               "files as they are")
        if files.detect(source):
            return files.NAME
        raise ConvertError(f"{source}: cannot tell the format (no images in class folders, no loose files);"
                           " give format=NAME")
    fmt = table.detect(source)
    if fmt:
        return fmt
    if parquet.detect(source):
        return parquet.NAME
    what = _media_file(source)
    if what:
        raise ConvertError(f"{source}: {what[0]}, not a source: give the folder of {what[1]} that holds it "
                           f"({source.parent}), or a table naming the files")
    raise ConvertError(f"{source}: cannot tell the format from suffix {source.suffix!r}; give format=NAME"
                       f" ({', '.join(FORMATS)})")


def _media_file(source: Path) -> tuple[str, str] | None:
    """What a file of an image, video or audio suffix is, and its plural (``("an image file", "images")``), for one
    given where a source is (a folder of them, or a table naming them); None for any other."""
    if image_field_for_suffix(source.suffix):
        return "an image file", "images"
    field = media_field_for_suffix(source.suffix)
    if field is None:
        return None
    return ("a video file", "videos") if is_video_field(field) else ("an audio file", "audio files")


def scan(source: Path, fmt: str | None = None, options: ScanOptions | None = None) -> ScanResult:
    """Scan ``source`` as ``fmt`` (detected when None). Raises ConvertError for bad or empty input.

    A detected image folder already split (``images/train/<class>/``, ``images/val/<class>/``:
    :func:`imagefolder.splits`) is scanned as its splits, labelled from one class list
    (:func:`imagefolder.scan_splits`); given ``fmt='imagefolder'``, as one dataset labelled by its split folders."""
    source = Path(source)
    options = options or ScanOptions()
    if fmt is not None and fmt not in FORMATS:
        raise ConvertError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if not source.exists():
        raise ConvertError(f"{source}: no such file or directory")
    split = [] if fmt or not source.is_dir() else imagefolder.splits(source)  # format given: one dataset
    fmt = fmt or detect(source)
    want_dir = fmt in ("imagefolder", "files")
    if want_dir != source.is_dir():
        raise ConvertError(f"{source}: format {fmt} needs a {'directory' if want_dir else 'file'}")
    refuse_table_options(fmt, options)
    refuse_classes(fmt, options)
    try:
        if fmt == "imagefolder":
            result = imagefolder.scan_splits(source, split, options) if split else imagefolder.scan(source, options)
        elif fmt == "files":
            result = files.scan(source, options)
        elif fmt == "parquet":
            result = parquet.scan(source, options)
        else:
            result = table.scan(source, options, fmt)
    except PermissionError as err:
        raise ConvertError(f"{err.filename or source}: permission denied") from None
    if not result.entries:
        first = result.skipped[0] if result.skipped else None
        why = f" ({count(len(result.skipped), 'file')} left out, e.g. {first.path}: {first.reason})" if first else ""
        raise ConvertError(f"{source}: no samples found as {fmt}{why}")
    return result


def refuse_table_options(kind: str, options: ScanOptions) -> None:
    """ConvertError naming the first table option of ``options`` that was given for a source of ``kind`` that is no
    table (an image folder, loose files, an image-text JSONL, whose scan is given ``root`` but no other): its
    converter would ignore it."""
    if kind in TABLE_FORMATS:
        return
    given = [(name, getattr(options, name)) for name in ("path_column", "label_column", "key_column", "root")
             if getattr(options, name) is not None]
    given += [("labels", options.labels)] if options.labels != ScanOptions.labels else []
    if given:
        name, value = given[0]
        raise ConvertError(f"{name}={str(value)!r}: an option of a table source ({', '.join(TABLE_FORMATS)}), "
                           f"not of {kind}")


def refuse_classes(kind: str, options: ScanOptions) -> None:
    """ConvertError when a class list (``classes_from``) was given for a source of ``kind`` that is no image folder:
    its converter would ignore it."""
    if options.classes is not None and kind != imagefolder.NAME:
        raise ConvertError(f"classes_from={options.classes.origin!r}: an option of an image folder source, not of "
                           f"{kind}")
