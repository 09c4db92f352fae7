"""A token conversion's SOURCE: its document files, local or on ``s3://``, their order, and its parts.

SOURCE is a document file or a folder of them (:mod:`fastio.converters.documents`), or an ``s3://`` object or
prefix read through :mod:`fastio.storage` (endpoint, region and credentials as for any URL): the objects under the
prefix, in sorted key order (the order a local folder gives: sorted paths), each downloaded into a temporary file
while the one before it is read, and deleted once read. Refusals name the URL in one line: a prefix with no objects, objects
none of which is a document file, an object of another kind, an object that cannot be read.

Positions. The files, in order, are laid end to end: file ``i`` starts at byte ``offsets[i]`` of a
``total``-byte stream, and each document has a position in it (its file's offset plus its position within the
file, :func:`fastio.converters.documents.file_documents`). Part K of N (:func:`part_span`) converts the
documents whose position is in ``[K * total // N, (K + 1) * total // N)`` (the last part: to the end), so the N
parts take contiguous runs of the whole conversion's documents, together each once, from the listing alone
(names and sizes: no part reads a file it has no document of). :func:`listing_digest` lets the merge check that
every part saw the same listing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fastio.converters.documents import DOCUMENT_SUFFIXES, document_files, file_documents, not_a_document_file
from fastio.errors import ConvertError
from fastio.storage import Storage, is_remote, open_storage, parse_location

__all__ = ["Corpus", "DocumentFile", "open_corpus", "part_span"]


@dataclass(frozen=True)
class DocumentFile:
    """One document file of SOURCE."""

    name: str
    """Its path, or its URL: messages name it."""
    key: str
    """Relative to SOURCE (``""`` when SOURCE is the file itself); the listing digest records it."""
    size: int


@dataclass
class Corpus:
    """SOURCE's document files in order (see the module docstring); ``storage`` is None for a local SOURCE."""

    source: str
    files: list[DocumentFile]
    storage: Storage | None = None

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    def listing_digest(self) -> str:
        """sha256 of the listing (keys and sizes, in order): equal for two parts that saw the same SOURCE."""
        text = json.dumps([[f.key, f.size] for f in self.files])
        return hashlib.sha256(text.encode()).hexdigest()

    def documents(self, text_field: str, span: tuple[int, int | None] = (0, None), messages: bool = False
                  ) -> Iterator[tuple[str, str]]:
        """``(where, text)`` of every document whose position is in ``span``, in input order (``messages``: the
        field's value as it is, :func:`~fastio.converters.documents.file_documents`). An object is downloaded
        while the one before it is read (two at most in the temporary folder, each removed once read)."""
        wanted = list(self._files_in(span))
        if self.storage is None:
            for f, inside in wanted:
                yield from file_documents(Path(f.name), text_field, f.name, inside, messages)
            return
        with tempfile.TemporaryDirectory(prefix="fastio-doc-") as tmp, \
                ThreadPoolExecutor(1, thread_name_prefix="fastio-doc") as pool:
            def fetch(i: int) -> Path:
                f = wanted[i][0]
                path = Path(tmp) / f"{i}{Path(f.key or f.name).suffix}"
                self.storage.get_to_file(f.key, path, f.size)  # a StorageError names the URL
                return path

            coming = pool.submit(fetch, 0) if wanted else None
            for i, (f, inside) in enumerate(wanted):
                path = coming.result()
                coming = pool.submit(fetch, i + 1) if i + 1 < len(wanted) else None
                yield from file_documents(path, text_field, f.name, inside, messages)
                path.unlink()

    def _files_in(self, span: tuple[int, int | None]) -> Iterator[tuple[DocumentFile, tuple[int, int | None]]]:
        """The files with a document in ``span``, each with the span in its own positions."""
        start, end = span
        offset = 0
        for f in self.files:
            here, offset = offset, offset + f.size
            text = DOCUMENT_SUFFIXES[Path(f.key or f.name).suffix.lower()] == "text"
            last = here + 1 if text or not f.size else offset  # a .txt's one document, an empty file: at the start
            if (end is None or here < end) and last > start:
                yield f, (start - here, None if end is None else end - here)


def open_corpus(source: str | Path, storage_options: dict | None = None) -> Corpus:
    """SOURCE's document files (see the module docstring); ConvertError naming SOURCE or a file otherwise."""
    if not is_remote(str(source)):
        source = Path(source)
        files = document_files(source)
        keys = [f.relative_to(source).as_posix() if source.is_dir() else "" for f in files]
        return Corpus(str(source), [DocumentFile(str(f), k, f.stat().st_size) for f, k in zip(files, keys)])
    url = parse_location(str(source)).url
    storage = open_storage(url, storage_options)
    objects = _without_folder_markers(storage.list())
    if objects:
        files = [DocumentFile(storage.url_of(o.key), o.key, o.size) for o in objects]
    else:  # not a prefix: one object?
        loc = parse_location(url)
        parent, _, leaf = loc.prefix.rpartition("/")
        if not leaf:
            raise ConvertError(f"{url}: no such object or prefix (the bucket holds no objects)")
        storage = open_storage(f"s3://{loc.bucket}/{parent}", storage_options)
        size = storage.head(leaf)
        if size is None:
            raise ConvertError(f"{url}: no such object or prefix")
        files = [DocumentFile(url, leaf, size)]
    other = next((f for f in files if Path(f.key).suffix.lower() not in DOCUMENT_SUFFIXES), None)
    if other is not None:
        raise not_a_document_file(other.name)
    return Corpus(url, files, storage)


def _without_folder_markers(objects: list) -> list:
    """The objects but the empty ``sub/`` markers some tools write for a folder (listed as ``sub``, size 0,
    with objects under ``sub/``)."""
    keys = sorted(o.key for o in objects)
    def has_children(key: str) -> bool:
        i = bisect.bisect_left(keys, key + "/")
        return i < len(keys) and keys[i].startswith(key + "/")
    return [o for o in objects if o.size or not has_children(o.key)]


def part_span(total: int, k: int, n: int) -> tuple[int, int | None]:
    """The positions ``[start, end)`` of part K of N of a ``total``-byte listing (the last part: to the end)."""
    return k * total // n, None if k == n - 1 else (k + 1) * total // n
