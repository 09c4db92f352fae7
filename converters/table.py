"""CSV / TSV / JSONL tables: a path column (relative to the root: the table's folder unless given) plus any
other columns.

The file named by the path column becomes a field named by its type (``jpg``, ``png``, or its
suffix); the label column becomes ``cls`` (an ASCII integer, by the label rule of :mod:`fastio.formats.labels`:
the value itself when every label is integral (``2``, ``2.0``, ``" 2"``), else its index among the sorted
class names, recorded as the label map; a mix is an error unless ``ScanOptions.labels="names"``); every
other column becomes a field named after the column holding the value as UTF-8 text (JSON for non-strings).

Rows are rejected (skipped and listed, or fatal with ``on_error="fail"``) when their path resolves
outside the root (``ScanOptions.root``, default the table's folder; symlinks followed, so ``../x``,
``/etc/passwd`` and a link pointing out are all refused), when their label cell is empty while the
table has a label column, or when an integer label is negative or does not fit int64
(:mod:`fastio.formats.labels`).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastio.converters.base import (
    Entry,
    FieldValue,
    FileRef,
    Keys,
    ScanOptions,
    ScanResult,
    Skip,
    image_field_for_suffix,
    main_image_field,
    resolve_inside,
    safe_field_name,
    sniff_field,
)
from fastio.errors import ConvertError
from fastio.formats.labels import check_label, choose_label_rule, integral_text, is_empty_label, label_name
from fastio.formats.media import media_field_for_suffix

__all__ = ["NAMES", "SUFFIXES", "detect", "read_rows", "rows_to_result", "scan"]

NAMES = ("csv", "jsonl")
SUFFIXES = {".csv": "csv", ".tsv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
PATH_COLUMNS = ("path", "file", "filename", "file_name", "filepath", "image_path", "image", "img")
LABEL_COLUMNS = ("label", "class", "cls")
KEY_COLUMNS = ("__key__", "key")

Row = dict[str, Any]


def detect(source: Path) -> str | None:
    """``csv`` or ``jsonl`` for a file with a table suffix, else None."""
    return SUFFIXES.get(source.suffix.lower()) if source.is_file() else None


def scan(source: Path, options: ScanOptions, fmt: str) -> ScanResult:
    source = Path(source)
    columns, rows = read_rows(source, fmt)
    return rows_to_result(
        rows, columns, source=source, fmt=fmt, options=options, require_path=True,
    )


def read_rows(source: Path, fmt: str) -> tuple[list[str], list[tuple[int, Row]]]:
    """(columns, [(line number, row), ...]) of a CSV/TSV or JSONL file; ConvertError if unreadable."""
    try:
        with open(source, encoding="utf-8-sig", newline="") as f:
            return _read_csv(f, source) if fmt == "csv" else _read_jsonl(f, source)
    except UnicodeDecodeError as err:
        raise ConvertError(f"{source}: unreadable table (not UTF-8: {err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConvertError(f"{source}: unreadable table ({err.strerror or err})") from None


def _read_csv(f, source: Path) -> tuple[list[str], list[tuple[int, Row]]]:
    reader = csv.reader(f, delimiter="\t" if source.suffix.lower() == ".tsv" else ",")
    try:
        header = next(reader, None)
        if not header or not any(h.strip() for h in header):
            raise ConvertError(f"{source}: unreadable table (no header row)")
        header = [h.strip() for h in header]
        dupes = sorted({h for h in header if header.count(h) > 1})
        if dupes:
            raise ConvertError(f"{source}: unreadable table (duplicate column {dupes[0]!r})")
        rows = []
        for values in reader:
            if not values:
                continue
            if len(values) != len(header):
                raise ConvertError(
                    f"{source}:{reader.line_num}: unreadable table (expected {len(header)} columns, found {len(values)})"
                )
            rows.append((reader.line_num, dict(zip(header, values))))
    except csv.Error as err:
        raise ConvertError(f"{source}:{reader.line_num}: unreadable table ({err})") from None
    return header, rows


def _read_jsonl(f, source: Path) -> tuple[list[str], list[tuple[int, Row]]]:
    columns: dict[str, None] = {}
    rows = []
    for lineno, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ConvertError(f"{source}:{lineno}: unreadable table (invalid JSON: {err})") from None
        if not isinstance(row, dict):
            raise ConvertError(f"{source}:{lineno}: unreadable table (a line is a {type(row).__name__}, not an object)")
        columns.update(dict.fromkeys(row))
        rows.append((lineno, row))
    if not rows:
        raise ConvertError(f"{source}: unreadable table (no rows)")
    return list(columns), rows


def _pick(source: Path, columns: list[str], given: str | None, candidates: Iterable[str], what: str) -> str | None:
    if given is not None:
        if given not in columns:
            raise ConvertError(f"{source}: no {what} column {given!r} (columns: {', '.join(columns)})")
        return given
    lower = {c.lower(): c for c in columns}
    for name in candidates:
        if name in lower:
            return lower[name]
    return None


def _text(value: Any) -> bytes:
    return (value if isinstance(value, str) else json.dumps(value, sort_keys=True)).encode()


def rows_to_result(
    rows: list[tuple[int, Row]],
    columns: list[str],
    *,
    source: Path,
    fmt: str,
    options: ScanOptions,
    require_path: bool,
    bytes_columns: dict[str, str] | None = None,
    typed: Iterable[str] = (),
) -> ScanResult:
    """Turn table rows into entries. ``bytes_columns`` maps a column holding bytes to its field name; in a
    ``typed`` one (of encoded files) each row's field is its own value's type (:func:`sniff_field`), the column's
    name for a value of no known type."""
    bytes_columns, typed = bytes_columns or {}, frozenset(typed)
    base = source.parent
    root = Path(options.root) if options.root is not None else base
    path_col = _pick(source, columns, options.path_column, PATH_COLUMNS if require_path else (), "path")
    if require_path and path_col is None:
        raise ConvertError(
            f"{source}: no path column (looked for {', '.join(PATH_COLUMNS)}; columns: {', '.join(columns)};"
            " name it with path_column=NAME)"
        )
    label_col = _pick(source, columns, options.label_column, LABEL_COLUMNS, "label")
    key_col = _pick(source, columns, options.key_column, KEY_COLUMNS, "key")
    if path_col is not None and path_col in bytes_columns:
        path_col = None
    labels = [(f"{source.name}:{lineno}", row[label_col]) for lineno, row in rows
              if label_col and not is_empty_label(row.get(label_col))]
    if label_col is not None and not labels and options.label_column is None:
        label_col = None  # a column named like a label column but empty throughout: an ordinary text column
    special = {path_col, label_col, key_col, *bytes_columns}
    text_cols = {c: safe_field_name(c) for c in columns if c not in special}

    label_map = rule = None
    if labels:
        try:
            rule = choose_label_rule(labels, options.labels)
        except ValueError as err:
            raise ConvertError(f"{source}: column {label_col!r}: {err}") from None
        if rule == "names":
            label_map = {name: i for i, name in enumerate(sorted({label_name(v) for _, v in labels}))}

    entries: list[Entry] = []
    skipped: list[Skip] = []
    keys = Keys()
    for index, (lineno, row) in enumerate(rows):
        where = f"{source.name}:{lineno}"
        fields: dict[str, FieldValue] = {}
        origin = where
        stem = None
        if label_col is not None:
            cell = row.get(label_col)
            if is_empty_label(cell):
                skipped.append(Skip(where, f"empty label in column {label_col!r}", error=True))
                continue
            if label_map is None:
                try:
                    cls = check_label(integral_text(cell))
                except ValueError as err:
                    skipped.append(Skip(where, f"column {label_col!r}: {err}", error=True))
                    continue
            else:
                cls = label_map[label_name(cell)]
            fields["cls"] = str(cls).encode()
        if path_col is not None:
            value = row.get(path_col)
            if value in (None, "") or not isinstance(value, str):
                raise ConvertError(f"{where}: path column {path_col!r} is empty or not text ({value!r})")
            path = Path(value) if os.path.isabs(value) else root / value
            outside = resolve_inside(path, root)
            if outside is not None:
                skipped.append(Skip(where, f"path column {path_col!r}: {value} {outside}", error=True))
                continue
            if not path.is_file():
                raise ConvertError(f"{where}: path column {path_col!r} names a missing file: {value}")
            field = (image_field_for_suffix(path.suffix) or media_field_for_suffix(path.suffix)
                     or safe_field_name(path.suffix.lstrip(".") or "file"))
            fields[field] = FileRef(str(path))
            origin = value
            stem = _key_text(value)
        for col, field in bytes_columns.items():
            value = row.get(col)
            if value is not None:
                _put(fields, (col in typed and sniff_field(value)) or field, bytes(value), where)
        for col, field in text_cols.items():
            value = row.get(col)
            if value is not None:
                _put(fields, field, _text(value), where)
        if not fields:
            raise ConvertError(f"{where}: row has no values")
        if key_col is not None and row.get(key_col) not in (None, ""):
            key = keys.key(str(row[key_col]), origin)
        else:
            key = keys.key(stem if stem is not None else f"{index:08d}", origin)
        entries.append(Entry(key=key, fields=tuple(sorted(fields.items())), origin=origin))

    options_desc = {k: v for k, v in (("path_column", path_col), ("label_column", label_col),
                                       ("key_column", key_col)) if v is not None}
    if options.labels != "auto":
        options_desc["labels"] = options.labels
    if options.root is not None:
        options_desc["root"] = str(Path(options.root).resolve())
    return ScanResult(
        entries=entries,
        description={"format": fmt, "path": str(source.resolve()), "options": options_desc},
        label_map=label_map,
        skipped=skipped,
        image_field=main_image_field(entries),
        label_field="cls" if labels else None,
        label_rule=rule,
        renamed=keys.renamed,
    )


def _key_text(value: str) -> str:
    """A key seed from a path value: normalised, without leading ``/`` or ``..`` parts, without suffix."""
    parts = [p for p in Path(os.path.normpath(value)).as_posix().split("/") if p not in ("", ".", "..")]
    text = "/".join(parts) or value
    suffix = Path(text).suffix
    return text[: len(text) - len(suffix)] if suffix else text


def _put(fields: dict[str, FieldValue], name: str, value: bytes, where: str) -> None:
    if name in fields:
        raise ConvertError(f"{where}: two columns both become field {name!r}; rename one")
    fields[name] = value

