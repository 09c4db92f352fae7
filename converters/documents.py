"""Text documents for a token dataset, in input order: JSONL (one document per line, its text in ``text_field``),
Parquet (the ``text_field`` column, one document per row: any Arrow string type, or a dictionary of one) and plain
text (``.txt``: one document per file; a leading UTF-8 byte order mark is no text, as JSON reads it). SOURCE is
one such file or a folder of them (walked in sorted path order under fastio's symlink policy, :func:`walk_files`).

Yields ``(where, text)``: ``where`` names the file (and the line or row) for messages; ``text`` may be empty (the
caller skips and counts empty documents). :func:`file_documents` reads one file under a name of the caller's (a URL
for a downloaded object) and, with ``span``, only the documents whose *position* lies in it: the byte offset of a
JSONL line, the file's start for a ``.txt``, ``size * row // rows`` for a Parquet row (positions grow with the
input order, so a span is a contiguous run of documents: :mod:`fastio.convert.corpus` cuts parts by them).

With ``messages=True`` (a chat conversion) each document is the field's JSON value as it is (a conversation: its
messages are checked by :mod:`fastio.convert.chat_encode`), and a ``.txt`` file is refused (it holds no messages).

A null text (a JSONL ``null``, a Parquet null) is an empty document. Refusals are one
:class:`~fastio.errors.ConvertError` naming the file, line or row and the field: a line that is not a JSON object, a
missing field (named with its option: ``text_field``, or a chat conversion's ``messages_field``, and the line's
fields: :func:`no_field`), a non-text one
(its value named in JSON's words: ``a number``, ``an object``, ...), text that is not UTF-8, a file of another kind
in SOURCE (:func:`not_a_document_file`: a ``.json`` or a compressed file named with the way on). Never tokenizes,
writes shards or knows shard sizes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from fastio.converters.base import walk_files
from fastio.errors import ConvertError

__all__ = ["DOCUMENT_SUFFIXES", "document_files", "file_documents", "iter_documents", "no_field", "not_a_document_file"]

DOCUMENT_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".txt": "text"}
"""The file kinds a token conversion reads, by suffix (lowercased)."""
_PARQUET_BATCH = 4096
_BOM = b"\xef\xbb\xbf"
_COMPRESSED = {".gz", ".zst", ".zstd", ".bz2", ".xz", ".lz4"}


def document_files(source: Path) -> list[Path]:
    """The document files of SOURCE (a file, or a folder's files in sorted path order)."""
    source = Path(source)
    if not source.exists():
        raise ConvertError(f"{source}: no such file or folder")
    if source.is_file():
        files = [source]
    else:
        files, skipped = walk_files(source)
        bad = next((s for s in skipped if s.error), None)
        if bad is not None:
            raise ConvertError(f"{source / bad.path}: {bad.reason}")
    other = next((f for f in files if f.suffix.lower() not in DOCUMENT_SUFFIXES), None)
    if other is not None:
        raise not_a_document_file(str(other))
    if not files:
        raise ConvertError(f"{source}: holds no document files ({', '.join(DOCUMENT_SUFFIXES)})")
    return files


def not_a_document_file(name: str) -> ConvertError:
    """The refusal of a file (or object) ``name`` that is not a document file, with the way on where its name tells
    it: a ``.json`` (one object a line, Megatron's loose JSON, is JSONL), a compressed file."""
    suffix = Path(name).suffix.lower()
    hint = ""
    if suffix == ".json":
        hint = f"; one JSON object a line, as Megatron's loose JSON is, is JSONL: name it {Path(name).stem}.jsonl"
    elif suffix in _COMPRESSED:
        hint = f"; compressed ({suffix}): decompress it first"
    return ConvertError(f"{name}: not a document file (a token conversion reads {', '.join(DOCUMENT_SUFFIXES)}{hint})")


def iter_documents(source: Path, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """``(where, text)`` of every document of SOURCE, in input order (see the module docstring)."""
    for path in document_files(source):
        yield from file_documents(path, text_field)


def file_documents(path: Path, text_field: str = "text", name: str | None = None,
                   span: tuple[int, int | None] = (0, None), messages: bool = False) -> Iterator[tuple[str, str]]:
    """``(where, text)`` of the documents of one file whose position is in ``span`` = ``[start, end)`` (``end``
    None: to the end; see the module docstring); messages name the file ``name`` (default: ``path``). With
    ``messages``, ``(where, value)``: the field's value as it is (a chat conversion's conversations)."""
    name = str(path) if name is None else name
    kind = DOCUMENT_SUFFIXES[Path(name).suffix.lower()]
    if messages and kind == "text":
        raise ConvertError(f"{name}: a .txt file holds no conversations (JSONL or Parquet with field {text_field!r})")
    try:
        if messages:
            yield from (_jsonl if kind == "jsonl" else _parquet)(path, text_field, name, span, messages=True)
        elif kind == "text":
            if span[0] <= 0 and (span[1] is None or span[1] > 0):
                yield name, _text_file(path, name)
        elif kind == "jsonl":
            yield from _jsonl(path, text_field, name, span)
        else:
            yield from _parquet(path, text_field, name, span)
    except OSError as err:
        raise ConvertError(f"{name}: {err.strerror or err}") from None


def _text_file(path: Path, name: str) -> str:
    """A ``.txt`` file's text; a leading UTF-8 byte order mark (a "UTF-8 with BOM" save) is no text, as JSON
    reads it before a JSONL line."""
    data = path.read_bytes()
    mark = len(_BOM) if data.startswith(_BOM) else 0
    try:
        return data[mark:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConvertError(f"{name}: not UTF-8 text (byte {mark + err.start})") from None


def _skip_to(f, start: int) -> int:
    """Move ``f`` to the first line that starts at or after byte ``start``; the number of lines before it."""
    if start <= 0:
        return 0
    lines, left = 0, start - 1
    while left > 0:  # newlines before byte start - 1, counted in large reads (no line-by-line pass)
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            return lines
        lines, left = lines + chunk.count(b"\n"), left - len(chunk)
    return lines + f.readline().count(b"\n")  # the rest of the line that holds byte start - 1


def _jsonl(path: Path, field: str, name: str, span: tuple[int, int | None], messages: bool = False
           ) -> Iterator[tuple[str, str]]:
    end = span[1]
    with open(path, "rb") as f:
        before = _skip_to(f, span[0])
        at = f.tell()
        for n, raw in enumerate(f, before + 1):
            offset, at = at, at + len(raw)
            if end is not None and offset >= end:
                return
            if not raw.strip():
                continue  # a blank line is no document
            where = f"{name}:{n}"
            try:
                row = json.loads(raw)
            except UnicodeDecodeError as err:
                raise ConvertError(f"{where}: not UTF-8 text (byte {err.start})") from None
            except ValueError as err:
                raise ConvertError(f"{where}: not a JSON object ({_json_reason(err)})") from None
            except RecursionError:
                raise ConvertError(f"{where}: JSON nested too deeply to read (over ~{sys.getrecursionlimit()} "
                                   "levels of lists or objects)") from None
            if not isinstance(row, dict):
                raise ConvertError(f"{where}: {_json_kind(row)}, not a JSON object")
            if field not in row:
                raise no_field(where, row, field, _field_option(messages))
            text = row[field]
            if not messages and text is None:
                text = ""  # a null is an empty document, as a Parquet null is
            if not messages and not isinstance(text, str):
                raise ConvertError(f"{where}: field {field!r} is {_json_kind(text)}, not text")
            yield where, text


def no_field(where: str, row: dict, field: str, option: str) -> ConvertError:
    """The refusal of a JSON line ``row`` (at ``where``) without ``field``: naming the option that names the field
    and the fields the line has (a ShareGPT or LLaVA line's ``conversations``; the first 10)."""
    names = ", ".join(map(repr, list(row)[:10])) + (", ..." if len(row) > 10 else "") or "none"
    return ConvertError(f"{where}: has no field {field!r} ({option}={field!r}; the line's fields: {names})")


def _json_reason(err: ValueError) -> str:
    """Why ``json`` refused a line, placed in that line (its own words, ``line 2 column 1 (char 15)``, count the
    line's newline as a second line)."""
    if not isinstance(err, json.JSONDecodeError):
        return str(err)
    end = len(err.doc.rstrip("\r\n"))
    return f"{err.msg} at " + ("the end of the line" if err.pos >= end else f"column {err.pos + 1}")


def _field_option(messages: bool) -> str:
    """The option that names the field read: a chat conversion's ``messages_field``, else ``text_field``."""
    return "messages_field" if messages else "text_field"


def _json_kind(value: object) -> str:
    """What a JSON value that is not an object is, in JSON's words (``a list``, ``null``, ...)."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), "a number")


def _parquet(path: Path, field: str, name: str, span: tuple[int, int | None], messages: bool = False
             ) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ConvertError(f"{name}: not a Parquet file ({err})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConvertError(f"{name}: has no column {field!r} ({_field_option(messages)}={field!r}; columns: "
                           f"{', '.join(names)})")
    kind = pf.schema_arrow.field(field).type
    if not messages and not _is_text(pa, kind):
        raise ConvertError(f"{name}: column {field!r} is {kind}, not text")
    rows, size = pf.metadata.num_rows, path.stat().st_size
    first, stop = _rows_in(span, rows, size)
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=[field]):
        if row + batch.num_rows <= first:
            row += batch.num_rows
            continue
        for text in batch.column(0).to_pylist():
            if first <= row < stop:
                yield f"{name}: row {row}", text if messages else text or ""  # a null is an empty document
            row += 1
        if row >= stop:
            return


def _is_text(pa, kind) -> bool:
    """Whether an Arrow column type holds text: ``string``, ``large_string``, ``string_view`` or a dictionary of
    one of them (a pandas category column, a writer's dictionary encoding); its values read as ``str``."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _rows_in(span: tuple[int, int | None], rows: int, size: int) -> tuple[int, int]:
    """The rows ``[first, stop)`` whose position ``size * row // rows`` is in ``span``."""
    def first_at(position: int) -> int:  # the first row whose position is >= position
        return min(rows, max(0, -(-position * rows // size))) if size else (0 if position <= 0 else rows)

    return first_at(span[0]), rows if span[1] is None else first_at(span[1])
