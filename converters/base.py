"""What every converter returns: cheap, picklable sample records and a scan result.

A converter turns a source into :class:`Entry` records. A field value is the bytes themselves (table text,
parquet cells), a :class:`FileRef` naming a file, or a :class:`UrlRef` naming an object (an image-text line's
image at an ``s3://`` URL), which the conversion's worker processes read. Converters never read image files (but
the first bytes of a table's file named without a suffix, to name its field), write tars, hash or know shard sizes.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from fastio.formats.images import image_field_for_suffix, is_image_field, sniff_image_field
from fastio.formats.media import sniff_media_field
from fastio.formats.wds import safe_field_name, sanitize_key

__all__ = [
    "ClassList",
    "Entry",
    "Keys",
    "FieldValue",
    "FileRef",
    "ScanOptions",
    "ScanResult",
    "Skip",
    "UrlRef",
    "image_field_for_suffix",
    "main_image_field",
    "rel",
    "safe_field_name",
    "sniff_field",
    "unique_key",
    "walk_files",
]


@dataclass(frozen=True)
class FileRef:
    """A field whose bytes are the content of the file at ``path``."""

    path: str


@dataclass(frozen=True)
class UrlRef:
    """A field whose bytes are the object at ``url`` (``s3://bucket/key``, ``size`` bytes when the scan asked), read
    by the conversion's worker process that checks it (:mod:`fastio.convert.objects`)."""

    url: str
    size: int


FieldValue = Union[bytes, FileRef, UrlRef]  # noqa: UP007 (a runtime alias: `|` needs Python 3.10 classes)


@dataclass(frozen=True)
class Entry:
    """One sample to be: its key, its fields (name -> bytes or FileRef), and where it came from."""

    key: str
    fields: tuple[tuple[str, FieldValue], ...]
    origin: str  # the file or table row named in errors and in the manifest's "skipped"
    sample: str | None = None
    """The sample a refusal of one of its files names too (an image-text line, ``vlm.jsonl:3``); None: the file
    alone."""


@dataclass(frozen=True)
class Skip:
    """An input left out of the dataset, and why.

    ``error`` marks a rejected sample (a bad label, a path outside the root, a symlink that breaks the
    policy): ``on_error="fail"`` stops the conversion on it. Without it the input is simply not a sample
    (a README next to the class folders, a hidden file) and is only listed."""

    path: str
    reason: str
    error: bool = False

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


@dataclass
class ScanResult:
    """A scanned source: entries in a deterministic order plus what the manifest should say about them."""

    entries: list[Entry]
    description: dict[str, Any]  # the manifest's "source" (format, path, options)
    label_map: dict[str, int] | None = None
    skipped: list[Skip] = field(default_factory=list)
    image_field: str | None = None
    label_field: str | None = None
    label_rule: str | None = None
    """How labels were made (a key of :data:`fastio.formats.labels.LABEL_RULES`); None: no labels."""
    renamed: list[tuple[str, str, str]] = field(default_factory=list)
    """Inputs whose key another input had taken first (:class:`Keys`): ``(origin, key given, origin of the first)``."""
    splits: dict[str, list[int]] | None = None
    """The source's own splits (an image folder already split, ``images/train/``, ``images/val/``): each split's
    entry indices, in scan order; None: the source is one dataset."""
    notes: list[str] = field(default_factory=list)
    """What the conversion's summary line says of the source besides its counts (``val has no 'cat'``)."""


@dataclass(frozen=True)
class ClassList:
    """The class names an image folder is labelled by, label k the k-th: another dataset's (``classes_from``), so
    that a split converted apart numbers its classes as that dataset does."""

    names: tuple[str, ...]
    origin: str
    """The dataset they were read from (named in messages)."""


@dataclass(frozen=True)
class ScanOptions:
    """Format options a user may give: the table options; given for a source that is no table, they are refused
    (:func:`fastio.converters.refuse_table_options`)."""

    path_column: str | None = None
    """Table column holding file paths relative to ``root`` (default: detected)."""
    label_column: str | None = None
    """Table column holding the class label (default: the first of ``label``, ``class``, ``cls`` present)."""
    key_column: str | None = None
    """Table column holding the sample key (default: ``__key__`` or ``key`` when present, else derived from the
    path or the row number)."""
    labels: str = "auto"
    """Tables: the label rule (:mod:`fastio.formats.labels`): ``auto`` (integers when every label is integral, names
    when none is, else an error naming rows), ``integers`` or ``names``."""
    root: Path | None = None
    """Tables: the folder relative paths of the path column start from and every path must resolve into
    (symlinks followed); a path resolving elsewhere (``../``, ``/etc/...``) is skipped and listed.
    None: the table's own folder."""
    classes: ClassList | None = None
    """Image folders: the class list to label by (label k the k-th name) in place of the sorted class folders; a
    class folder it does not name is refused. None: the source's own."""


def main_image_field(entries: list[Entry]) -> str | None:
    """The image field most entries have (ties broken by name), or None when no entry has an image."""
    counts: dict[str, int] = {}
    for entry in entries:
        for name, _ in entry.fields:
            if is_image_field(name):
                counts[name] = counts.get(name, 0) + 1
    return max(sorted(counts), key=lambda f: counts[f]) if counts else None


def sniff_field(data: bytes) -> str | None:
    """The field an encoded image, video or audio file's bytes are named by (``jpg``, ``webm``, ``flac``, ...: by
    magic number), or None."""
    return sniff_image_field(data) or sniff_media_field(data)


def unique_key(text: str, taken: set[str]) -> str:
    """``sanitize_key(text)``, made unique against ``taken`` with a hash of ``text``; adds it to ``taken``."""
    key = sanitize_key(text)
    if key in taken:
        key = f"{key[:63]}_{hashlib.sha256(text.encode('utf-8', 'surrogateescape')).hexdigest()[:12]}"
        n = 1
        base = key
        while key in taken:
            n += 1
            key = f"{base}_{n}"
    taken.add(key)
    return key


class Keys:
    """The keys of one scan's inputs (:func:`unique_key`), and the inputs renamed because an earlier one had their
    key (``a/tone.wav`` and ``a/tone.flac`` are ``a/tone`` and ``a/tone_3622fdf0c139``): :attr:`renamed`."""

    def __init__(self):
        self.taken: set[str] = set()
        self._holders: dict[str, str] = {}
        self.renamed: list[tuple[str, str, str]] = []
        """``(origin, key given, origin of the input holding the key it would have had)``, in scan order."""

    def key(self, text: str, origin: str) -> str:
        """The key of the input ``origin`` whose key would be ``sanitize_key(text)``."""
        key, wanted = unique_key(text, self.taken), sanitize_key(text)
        if key != wanted:
            self.renamed.append((origin, key, self._holders[wanted]))
        self._holders[key] = origin
        return key


def rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in POSIX form (for keys and messages)."""
    return path.relative_to(root).as_posix()


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_inside(path: Path, root: Path) -> str | None:
    """Why ``path`` may not be read as part of a source rooted at ``root`` (None when it may): it must be a name a
    file system takes (no NUL, no lone surrogate: a JSON ``\\u0000`` or ``\\ud800`` escape), and its real path
    (symlinks followed) must lie inside ``root``'s real path."""
    try:
        real = os.path.realpath(path)
    except (ValueError, UnicodeEncodeError):  # os refuses the name itself
        return "is not a file name (it holds a NUL or a lone surrogate character)"
    if not _inside(real, os.path.realpath(root)):
        return f"resolves outside {root} (to {real})"
    return None


def walk_files(source: Path) -> tuple[list[Path], list[Skip]]:
    """The regular files below ``source``, sorted by path, under fastio's symlink policy.

    A symlink (to a file or a folder) is followed when its target lies inside ``source``. A dangling
    symlink, one whose target lies outside ``source``, a symlinked folder that contains itself (a loop)
    and anything that is not a regular file (FIFO, socket, device) is skipped and listed as an error. A
    file reached by two paths (through symlinks) is taken once: by the path without symlinks if there
    is one, else by the first path in sorted order; the others are skipped and listed as duplicates.
    Hidden names (``.git``, ``.DS_Store``) are listed, not entered. Paths are returned as found below
    ``source`` (not resolved), so keys and class names follow the folders a user sees.
    """
    source = Path(source)
    root = os.path.realpath(source)
    found: list[tuple[bool, str, Path, str]] = []  # (reached through a symlink, relpath, path, real path)
    skipped: list[Skip] = []

    def visit(folder: Path, real_folder: str, ancestors: frozenset[str], via_link: bool) -> None:
        try:
            children = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            skipped.append(Skip(rel(folder, source), f"unreadable folder ({err.strerror or err})", error=True))
            return
        for child in children:
            path = Path(child.path)
            if child.name.startswith("."):
                skipped.append(Skip(rel(path, source), "hidden"))
                continue
            if child.is_symlink():  # only links cost a realpath; other entries extend their folder's real path
                real = os.path.realpath(path)
                if not os.path.exists(path):
                    why = "symlink loop" if _is_loop(path) else "dangling symlink"
                    skipped.append(Skip(rel(path, source), f"{why} (-> {os.readlink(path)})", error=True))
                    continue
                if not _inside(real, root):
                    skipped.append(Skip(rel(path, source), f"symlink points outside the source (to {real})",
                                        error=True))
                    continue
                is_dir, is_file, link = os.path.isdir(path), os.path.isfile(path), True
            else:
                real = os.path.join(real_folder, child.name)
                is_dir, is_file, link = child.is_dir(follow_symlinks=False), child.is_file(follow_symlinks=False), False
            if is_dir:
                if real in ancestors:
                    skipped.append(Skip(rel(path, source), f"symlink loop (-> {os.readlink(path)}, a folder that "
                                        "contains it)", error=True))
                    continue
                visit(path, real, ancestors | {real}, via_link or link)
            elif is_file:
                found.append((via_link or link, rel(path, source), path, real))
            else:
                skipped.append(Skip(rel(path, source), "not a regular file", error=True))

    visit(source, root, frozenset({root}), False)
    chosen: dict[str, str] = {}
    for _, relpath, _, real in sorted(found):  # paths without symlinks first (False < True), then by path
        chosen.setdefault(real, relpath)
    files = []
    for _, relpath, path, real in sorted(found, key=lambda f: f[1]):
        if chosen[real] == relpath:
            files.append(path)
        else:
            skipped.append(Skip(relpath, f"same file as {chosen[real]} (reached through a symlink)", error=True))
    return files, skipped


def _is_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ELOOP
    return False
