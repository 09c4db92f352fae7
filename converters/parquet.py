"""Parquet tables (pyarrow): columns holding bytes become fields, other columns as in CSV/JSONL.

A bytes column (``binary``, ``large_binary``, or a struct with a ``bytes`` member as Hugging Face
stores images) holding an encoded image, video or audio file holds a field named by each row's type
(``jpg``, ``png``, ..., ``webm``, ``mp4``, ``flac``, ...: by magic number), probed as a file of that type: a
column of WAV, FLAC, Opus and MP3 rows gives each its own field; a value of no known type takes the first known
one's (so it is probed, and skipped, named, when it is not one), wherever it is in the column; a null in it
(an image missing) is a rejected row.
Any other bytes column keeps its (sanitised) name. A path column is optional: one named by ``path_column``, or,
in a table without a column of encoded files, a column named as CSV's path column is (``path``, ``file``, ...)
where one of its first paths names a file (:func:`~fastio.converters.table.file_path_column`; a column of
repository paths naming no file stays text).
Keys come from a ``key`` column, else from the ``path`` of such a struct, else from the row number.
The bytes are read into memory at scan time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from fastio.converters.base import ScanOptions, ScanResult, Skip, main_image_field, safe_field_name, sniff_field
from fastio.converters.table import file_path_column, rows_to_result
from fastio.errors import ConvertError

__all__ = ["NAME", "detect", "scan"]

NAME = "parquet"


def detect(source: Path) -> bool:
    return source.is_file() and source.suffix.lower() in (".parquet", ".pq")


def _bytes_of(value: Any) -> bytes | None:
    if isinstance(value, dict):
        value = value.get("bytes")
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def _by_path(col: str, value: Any) -> str | None:
    """Why a cell of a bytes column is refused when it is an image struct with a path and no bytes (a Hugging Face
    ``Image`` stored by path, as ``to_parquet`` of images loaded from files writes it); None for any other cell."""
    if not (isinstance(value, dict) and value.get("bytes") is None and isinstance(value.get("path"), str)):
        return None
    return (f"column {col!r}: an image by path only ({value['path']!r}), its bytes not in the table: fastio reads the "
            "images a Parquet holds, not files it names; embed them, or convert a CSV of the paths")


def _struct_paths(data: list[dict[str, Any]], bytes_columns: dict[str, str]) -> list[str] | None:
    """Keys from the ``path`` member of the first struct bytes column (file name without suffix),
    when every row has one; None otherwise."""
    for col in bytes_columns:
        names = [r[col].get("path") if isinstance(r[col], dict) else None for r in data]
        if all(isinstance(n, str) and n for n in names):
            return [n.rsplit(".", 1)[0] if "." in n.rsplit("/", 1)[-1] else n for n in names]
    return None


def scan(source: Path, options: ScanOptions) -> ScanResult:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = Path(source)
    try:
        table = pq.read_table(source)
    except (OSError, pa.ArrowException) as err:
        raise ConvertError(f"{source}: unreadable table ({str(err).splitlines()[0]})") from None
    columns = list(table.column_names)
    if not columns or table.num_rows == 0:
        raise ConvertError(f"{source}: unreadable table (no rows)")
    data = table.to_pylist()

    def is_bytes(col: str) -> bool:
        t = table.schema.field(col).type
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return True
        return pa.types.is_struct(t) and any(t.field(i).name == "bytes" for i in range(t.num_fields))

    bytes_columns: dict[str, str] = {}
    typed: dict[str, list[str]] = {}  # a column of encoded files -> the types its rows hold
    for col in columns:
        if not is_bytes(col):
            continue
        values = [b for b in (_bytes_of(r[col]) for r in data) if b is not None]
        field = next((f for f in map(sniff_field, values) if f is not None), None)  # the first of a known type
        if field is not None:
            typed[col] = sorted({sniff_field(b) or field for b in values})
        name = field or safe_field_name(col)
        if name in bytes_columns.values():
            name = safe_field_name(col)
        if name in bytes_columns.values():
            raise ConvertError(f"{source}: bytes columns collide on field name {name!r}")
        bytes_columns[col] = name
    by_path = [Skip(f"{source.name}:{i}", _by_path(col, row[col]), error=True) for i, row in enumerate(data, start=1)
               for col in bytes_columns if _by_path(col, row[col])]
    rows = [(i, {c: (_bytes_of(v) if c in bytes_columns else v) for c, v in row.items()})
            for i, row in enumerate(data, start=1)]
    named = _struct_paths(data, bytes_columns)
    if named is not None and options.key_column is None and "__key__" not in columns and "key" not in columns:
        for (_, row), name in zip(rows, named):
            row["__key__"] = name
        columns = [*columns, "__key__"]
    if not typed:  # no column of encoded files: a table of paths, whose files are read as a CSV's are
        options = replace(options, path_column=file_path_column(rows, columns, source, options))
    result = rows_to_result(rows, columns, source=source, fmt=NAME, options=options, require_path=False,
                            bytes_columns=bytes_columns, typed=typed)
    refused = {skip.path for skip in by_path}  # rows kept their numbers (keys): their entries and skips go now
    result.entries = [e for e in result.entries if e.origin not in refused]
    result.image_field = main_image_field(result.entries)
    result.skipped = sorted(by_path + [s for s in result.skipped if s.path not in refused],
                            key=lambda skip: int(skip.path.rsplit(":", 1)[1]))
    # the field of each bytes column; of one holding several types, their list
    result.description["options"]["bytes_columns"] = {
        col: typed[col] if len(typed.get(col, ())) > 1 else name for col, name in sorted(bytes_columns.items())}
    return result
