"""CSV / TSV / JSONL tables: a path column (relative to the root: the table's folder unless given) plus any
other columns.

The file named by the path column becomes a field named by its type (``jpg``, ``png``, or its
suffix); the label column becomes ``cls`` (an ASCII integer, by the label rule of :mod:`fastio.formats.labels`:
the value itself when every label is integral (``2``, ``2.0``, ``" 2"``), else its index among the sorted
class names, recorded as the label map; a mix is an error unless ``ScanOptions.labels="names"``); every
other column becomes a field named after the column holding the value as UTF-8 text (JSON for non-strings).

Rows are rejected (skipped and listed, or fatal with ``on_error="fail"``) when their path cell is empty or not
text, when their path resolves outside the root (``ScanOptions.root``, default the table's folder; symlinks
followed, so ``../x``, ``/etc/passwd`` and a link pointing out are all refused), when it names no file (a missing
one, a folder, a FIFO), when their label cell is empty while the table has a label column, or when an integer
label is negative or does not fit int64 (:mod:`fastio.formats.labels`).
"""

from __future__ import annotations

import csv
import json
import os
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
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
from fastio.words import count

__all__ = ["NAMES", "SUFFIXES", "detect", "file_path_column", "read_rows", "rows_to_result", "scan"]

NAMES = ("csv", "jsonl")
SUFFIXES = {".csv": "csv", ".tsv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
PATH_COLUMNS = ("path", "file", "filename", "file_name", "filepath", "image_path", "image", "img")
LABEL_COLUMNS = ("label", "class", "cls")
KEY_COLUMNS = ("__key__", "key")
PATHS_PROBED = 100
"""How many of a Parquet's path-like values :func:`file_path_column` looks at for one naming a file."""

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
    except UnicodeDecodeError:
        raise ConvertError(_not_utf8(source)) from None
    except OSError as err:
        raise ConvertError(f"{source}: unreadable table ({err.strerror or err})") from None


def _not_utf8(source: Path) -> str:
    """The message of a table that is not UTF-8, naming the line and the file offset of its first bad byte (the
    text reader's error counts from the chunk it was decoding, not from the file's start)."""
    data = source.read_bytes()
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        data[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = bom + err.start
        line = data.count(b"\n", 0, at) + 1
        return f"{source}:{line}: unreadable table (not UTF-8: {err.reason} at byte {at})"
    return f"{source}: unreadable table (not UTF-8)"


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
                    f"{source}:{reader.line_num}: unreadable table (expected {count(len(header), 'column')}, "
                    f"found {len(values)})"
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
        except RecursionError:
            raise ConvertError(f"{source}:{lineno}: unreadable table (JSON nested too deeply to read)") from None
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


def file_path_column(rows: list[tuple[int, Row]], columns: list[str], source: Path, options: ScanOptions
                     ) -> str | None:
    """The path column of a table that need not have one (a Parquet without a bytes column): the one ``path_column``
    names, else the first column named as a path column (:data:`PATH_COLUMNS`) where one of its first
    :data:`PATHS_PROBED` values names a file (inside the root or not: a row whose path resolves outside, or names no
    file, is rejected, named); None where none does (such a column holds text: a code dataset's repository paths)."""
    name = _pick(source, columns, options.path_column, PATH_COLUMNS, "path")
    if options.path_column is not None or name is None:
        return name
    root = Path(options.root) if options.root is not None else source.parent
    values = (row.get(name) for _, row in rows)
    probed = islice((v for v in values if isinstance(v, str) and v), PATHS_PROBED)
    return name if any(_names_a_file(root, v) for v in probed) else None


def _names_a_file(root: Path, value: str) -> bool:
    try:
        return (Path(value) if os.path.isabs(value) else root / value).is_file()
    except (ValueError, OSError):  # a NUL in the name
        return False


def _text(value: Any, where: str, col: str) -> bytes:
    """A text column's cell as stored: the text, else its JSON (a timestamp's or decimal's text inside it); a
    ConvertError naming the row and column for bytes inside a list or struct, which JSON cannot hold."""
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, (dict, list, tuple, int, float, bytes, bytearray, memoryview)):  # a timestamp, a decimal
        return str(value).encode()
    try:
        return json.dumps(value, sort_keys=True, default=_json_text).encode()
    except _BytesInside:
        raise ConvertError(f"{where}: column {col!r} holds bytes inside a list or struct (a list of images?), which "
                           "is stored only as a column of bytes of its own; give each image a column") from None


class _BytesInside(Exception):
    pass


def _json_text(value: Any) -> str:
    """What JSON holds of a value it has no type for: a timestamp's or decimal's text; bytes: :class:`_BytesInside`."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise _BytesInside
    return str(value)


@dataclass(frozen=True)
class _Layout:
    """How a table's rows become samples: its special columns, the root of its paths and its label rule."""

    source: Path
    root: Path
    path_col: str | None
    label_col: str | None
    key_col: str | None
    bytes_columns: dict[str, str]
    typed: frozenset[str]
    text_cols: dict[str, str]
    labels: bool
    rule: str | None
    label_map: dict[str, int] | None
    left_out: list[str]
    """Columns named as WebDataset names a sample's own keys (``__url__`` of a table read from shards): not stored."""


def _layout(rows: list[tuple[int, Row]], columns: list[str], source: Path, options: ScanOptions, require_path: bool,
            bytes_columns: dict[str, str], typed: frozenset[str]) -> _Layout:
    root = Path(options.root) if options.root is not None else source.parent
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
    left_out = [c for c in columns if c not in special and _webdatasets(safe_field_name(c))]
    text_cols = {c: safe_field_name(c) for c in columns if c not in special and c not in left_out}
    label_map = rule = None
    if labels:
        try:
            rule = choose_label_rule(labels, options.labels)
        except ValueError as err:
            raise ConvertError(f"{source}: column {label_col!r}: {err}") from None
        if rule == "names":
            label_map = {name: i for i, name in enumerate(sorted({label_name(v) for _, v in labels}))}
    return _Layout(source, root, path_col, label_col, key_col, bytes_columns, typed, text_cols, bool(labels), rule,
                   label_map, left_out)


def _webdatasets(field: str) -> bool:
    """Whether ``field`` is a name WebDataset gives a sample's own keys (``__key__``, ``__url__``, ``__local_path__``,
    ...): stored, it would be refused by WebDataset's reader as a field twice."""
    return len(field) > 4 and field.startswith("__") and field.endswith("__")


def _row_label(t: _Layout, row: Row, where: str) -> bytes | Skip:
    """A row's ``cls`` bytes, or the Skip of a row with an empty or bad label."""
    cell = row.get(t.label_col)
    if is_empty_label(cell):
        return Skip(where, f"empty label in column {t.label_col!r}", error=True)
    if t.label_map is not None:
        return str(t.label_map[label_name(cell)]).encode()
    try:
        return str(check_label(integral_text(cell))).encode()
    except ValueError as err:
        return Skip(where, f"column {t.label_col!r}: {err}", error=True)


def _row_file(t: _Layout, row: Row, where: str) -> tuple[str, FileRef, str] | Skip:
    """``(field, FileRef, path value)`` of the file a row's path column names, or the Skip (a rejected row) of an
    empty cell, a path outside the root or one naming no file (missing, a folder, a FIFO)."""
    value = row.get(t.path_col)
    if value in (None, "") or not isinstance(value, str):
        return Skip(where, f"path column {t.path_col!r} is empty or not text ({value!r})", error=True)
    path = Path(value) if os.path.isabs(value) else t.root / value
    outside = resolve_inside(path, t.root)
    if outside is not None:
        return Skip(where, f"path column {t.path_col!r}: {value} {outside}", error=True)
    if not path.is_file():
        return Skip(where, f"path column {t.path_col!r} {_no_file(path)}: {value}{_other_form(path, value, t.root)}",
                    error=True)
    field = (image_field_for_suffix(path.suffix) or media_field_for_suffix(path.suffix)
             or (_sniffed(path) if not path.suffix else None) or safe_field_name(path.suffix.lstrip(".") or "file"))
    return field, FileRef(str(path)), value


def _sniffed(path: Path) -> str | None:
    """The field of a file named without a suffix (``imgs/0001``, a hash) by its first bytes' magic number (``jpg``,
    ``png``, ``webm``, ...; :func:`sniff_field`), so an image is stored, and checked, as one; None if of no known type."""
    try:
        with open(path, "rb") as f:
            return sniff_field(f.read(64))
    except OSError:
        return None  # unreadable: the worker that loads it names it


def _no_file(path: Path) -> str:
    """What a table's path names where it names no regular file."""
    if path.is_dir():
        return "names a folder, not a file"
    return "names no regular file (a FIFO, socket or device)" if path.exists() else "names a missing file"


def _other_form(path: Path, value: str, root: Path) -> str:
    """A hint where a file whose name differs from ``path``'s (``value`` in the table, from ``root``) only in blanks
    around it (``a.jpg `` in a hand-written CSV) or in Unicode normalization (``café`` typed as one code point, written
    by a Mac as ``e`` and a combining accent) is there: the two look the same in a message."""
    bare = value.strip()
    if bare and bare != value and (Path(bare) if os.path.isabs(bare) else root / bare).is_file():
        return f" (the cell's name has blanks around it, {value!r}, and a file named without them is there: {bare!r})"
    for form in ("NFC", "NFD"):
        other = path.with_name(unicodedata.normalize(form, path.name))
        if other.name != path.name and other.is_file():
            return (f" (a file whose name differs only in Unicode normalization is there: {ascii(other.name)};"
                    " rename one)")
    return ""


def _row_sample(t: _Layout, row: Row, where: str) -> tuple[dict[str, FieldValue], str, str | None] | Skip:
    """``(fields, origin, key seed from its path)`` of one row, or the Skip of a rejected row."""
    fields: dict[str, FieldValue] = {}
    origin, stem = where, None
    if t.label_col is not None:
        cls = _row_label(t, row, where)
        if isinstance(cls, Skip):
            return cls
        fields["cls"] = cls
    if t.path_col is not None:
        got = _row_file(t, row, where)
        if isinstance(got, Skip):
            return got
        field, ref, origin = got
        fields[field], stem = ref, _key_text(origin)
    for col, field in t.bytes_columns.items():
        value = row.get(col)
        if value is None and col in t.typed:  # an image (video, audio) missing: a sample the Loader would refuse
            return Skip(where, f"column {col!r}: no value (null), where other rows hold an encoded file ({field})",
                        error=True)
        if value is not None:
            _put(fields, (col in t.typed and sniff_field(value)) or field, bytes(value), where)
    for col, field in t.text_cols.items():
        value = row.get(col)
        if value is not None:
            _put(fields, field, _text(value, where, col), where)
    if not fields:
        raise ConvertError(f"{where}: row has no values")
    return fields, origin, stem


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
    t = _layout(rows, columns, source, options, require_path, bytes_columns or {}, frozenset(typed))
    entries: list[Entry] = []
    skipped: list[Skip] = []
    keys = Keys()
    rows_of: dict[str, str] = {}  # a labelled table's files: the row that named each first
    for index, (lineno, row) in enumerate(rows):
        where = f"{source.name}:{lineno}"
        got = _row_sample(t, row, where)
        if not isinstance(got, Skip) and t.labels and t.path_col is not None:
            got = _named_once(t, got, where, rows_of)
        if isinstance(got, Skip):
            skipped.append(got)
            continue
        fields, origin, stem = got
        if t.key_col is not None and row.get(t.key_col) not in (None, ""):
            key = keys.key(str(row[t.key_col]), origin)
        else:
            key = keys.key(stem if stem is not None else f"{index:08d}", origin)
        entries.append(Entry(key=key, fields=tuple(sorted(fields.items())), origin=origin))
    options_desc = {k: v for k, v in (("path_column", t.path_col), ("label_column", t.label_col),
                                       ("key_column", t.key_col)) if v is not None}
    if t.left_out:
        options_desc["left_out_columns"] = t.left_out
    if options.labels != "auto":
        options_desc["labels"] = options.labels
    if options.root is not None:
        options_desc["root"] = str(Path(options.root).resolve())
    return ScanResult(entries=entries, skipped=skipped, image_field=main_image_field(entries),
                      description={"format": fmt, "path": str(source.resolve()), "options": options_desc},
                      label_map=t.label_map, label_field="cls" if t.labels else None, label_rule=t.rule,
                      renamed=keys.renamed)


def _named_once(t: _Layout, got: tuple, where: str, rows_of: dict[str, str]) -> tuple | Skip:
    """A labelled table's row ``got`` (:func:`_row_sample`), or the Skip of a row naming a file an earlier row named
    (by its real path: ``./a.jpg``, ``a.jpg`` and a link to it are one file). A sample has one label: a file named
    twice is a copied row, or a multi-label table written one row per label, which would pack the image twice."""
    fields, origin, _ = got
    ref = next(v for v in fields.values() if isinstance(v, FileRef))
    real = os.path.realpath(ref.path)
    if real in rows_of:
        return Skip(where, f"path column {t.path_col!r}: {origin} is the file of {rows_of[real]} too: a labelled "
                           "table names each file once (one sample, one label)", error=True)
    rows_of[real] = where
    return got


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

