"""What ``fastio index`` SOURCE names, in order: a folder (every ``*.tar`` below it, in sorted order; links to files
followed, links to folders listed in ``skipped``, not followed: :func:`_walk_local`), an ``s3://bucket/prefix/``, or a
brace pattern of shards (``/data/{00000..00999}.tar``, ``s3://b/p/shard-{000..099}.tar``; several local paths become
one: :func:`paths_pattern`), or one local ``.tar`` path. A shard named twice, a compressed tar, a path that is no
regular file: one :class:`~fastio.errors.DatasetError` naming it (:func:`list_shards`)."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import shlex
import stat
import string
from dataclasses import dataclass
from pathlib import Path

from fastio.convert.foreign_tar import COMPRESSED
from fastio.dataset.files import dest_child, dest_split_names, names_object
from fastio.dataset.manifest import (
    FORMAT,
    MANIFEST_NAME,
    MARKER_NAME,
    SHARDS_DIR,
    SPLITS_NAME,
    media_of,
    unfinished_marked,
)
from fastio.errors import DatasetError, StorageError
from fastio.formats.images import is_image_field
from fastio.storage import open_storage
from fastio.storage.base import Storage
from fastio.storage.options import StorageOptions
from fastio.words import agree

__all__ = ["MAX_PATTERN_NAMES", "ListedShard", "display_of", "expand_braces", "list_shards", "owns_shards_dir",
           "paths_pattern"]

_COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.zst", ".tar.zstd", ".tar.bz2", ".tar.xz", ".tar.lz4")
_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
_NAMED = 3  # the datasets below a SOURCE a refusal names


@dataclass
class ListedShard:
    """One source tar: how messages name it, where its bytes are, and where the manifest will say it is."""

    display: str
    storage: Storage
    key: str
    size: int | None = None


MAX_PATTERN_NAMES = 10_000_000
"""The most paths a brace pattern may name: more is a typo (a range with a digit too many), refused before any name
is made (they would fill memory)."""


class _TooMany(Exception):
    """A brace pattern names ``args[0]`` paths, more than :data:`MAX_PATTERN_NAMES`."""


def expand_braces(pattern: str) -> list[str]:
    """The paths a brace pattern names, as WebDataset's ``braceexpand`` (bash's rules) makes them: ``{a,b}``
    alternatives (nested too), ``{000..099}`` ranges zero-padded like their bounds, letter ranges and steps
    (``{a..e..2}``); a group that is neither (``{x}``) stays as written. DatasetError for unbalanced braces and for
    more than :data:`MAX_PATTERN_NAMES` paths (counted before they are made)."""
    try:
        return _expand(pattern)
    except _TooMany as err:
        raise DatasetError(f"{pattern}: names {err.args[0]:,} shards, more than fastio lists "
                           f"({MAX_PATTERN_NAMES:,}): a range with a digit too many?") from None


def _expand(pattern: str) -> list[str]:
    parts: list[list[str]] = []
    start = depth = 0
    for pos, c in enumerate(pattern):
        if c == "{":
            if depth == 0:
                parts.append([pattern[start:pos]])
                start = pos
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                break
            if depth == 0:
                body = pattern[start + 1:pos]
                options = _brace_options(body)
                parts.append(options if options is not None else ["{" + x + "}" for x in _expand(body)])
                start = pos + 1
    if depth:
        raise DatasetError(f"{pattern}: unbalanced braces")
    parts.append([pattern[start:]])
    if (total := math.prod(len(p) for p in parts)) > MAX_PATTERN_NAMES:
        raise _TooMany(total)
    return ["".join(p) for p in itertools.product(*parts)]


def _brace_options(body: str) -> list[str] | None:
    """What one brace group ``{body}`` expands to: a range, or alternatives split at its own commas (each expanded);
    None where it is neither (no comma outside nested groups). _TooMany before a range too long is made."""
    if r := _INT_RANGE.match(body):
        a, b, step = r[1], r[2], int(r[3] or 1) or 1
        width = max(len(a), len(b)) if any(x.startswith(("0", "-0")) for x in (a, b) if x not in ("0", "-0")) else 0
        i, j = int(a), int(b)
        if (n := abs(j - i) // step + 1) > MAX_PATTERN_NAMES:
            raise _TooMany(n)
        return [str(n).zfill(width) if n >= 0 else "-" + str(-n).zfill(width - 1)
                for n in (range(i, j + 1, step) if i < j else range(i, j - 1, -step))]
    if r := _CHAR_RANGE.match(body):
        step = int(r[3] or 1) or 1
        i, j = _LETTERS.index(r[1]), _LETTERS.index(r[2])
        return list(_LETTERS[i:j + 1:step] if i < j else _LETTERS[i:(j - 1 if j else None):-step])
    items, start, depth = [], 0, 0
    for pos, c in enumerate(body):
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(body[start:pos])
            start = pos + 1
    if not items:
        return None
    items.append(body[start:])
    out = [x for item in items for x in _expand(item)]
    if len(out) > MAX_PATTERN_NAMES:
        raise _TooMany(len(out))
    return out


def paths_pattern(paths: list[str]) -> str:
    """The brace pattern naming several local ``.tar`` paths (``fastio index wds/*.tar``, a glob the shell
    expanded): ``COMMON/{a.tar,b/c.tar}``, with COMMON their deepest common folder (the default DEST).
    DatasetError naming a path that is not a local ``.tar`` file or that a brace pattern cannot hold."""
    for path in paths:
        if "://" in path or not path.lower().endswith(".tar"):
            raise DatasetError(f"{path}: not a .tar file: fastio index takes one SOURCE (a folder, prefix or brace "
                               "pattern) or several local .tar files (quote a glob for s3://)")
        if any(c in path for c in "{},"):
            raise DatasetError(f"{path}: a name with a brace or comma cannot be listed with others: give the folder")
    try:
        common = os.path.commonpath([os.path.dirname(p) or "." for p in paths])
    except ValueError:  # absolute and relative paths mixed
        common = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
        paths = [os.path.abspath(p) for p in paths]
    inside = [os.path.relpath(p, common) for p in paths]
    return f"{common}/{{{','.join(inside)}}}"


def list_shards(source: str, options: StorageOptions | dict | None
                ) -> tuple[Storage, list[ListedShard], list[dict[str, str]]]:
    """The storage of SOURCE's folder (the default DEST), the shards SOURCE names, in order, and what a folder's
    listing passed over with reasons (``skipped``). A shard named twice is refused."""
    storage, shards, skipped = (_pattern_listing if _is_pattern(source) else _folder_listing)(source, options)
    _refuse_repeats(shards)
    return storage, shards, skipped


def _is_pattern(source: str) -> bool:
    """Whether SOURCE is a brace pattern: a brace that expands to nothing else (``b{x}``), or an unbalanced one in
    the name of a local file or folder, is part of a name."""
    if "{" not in source:
        return False
    try:
        return expand_braces(source) != [source]
    except DatasetError:
        if "://" not in source and os.path.lexists(source):
            return False
        raise


def _pattern_listing(source: str, options) -> tuple[Storage, list[ListedShard], list[dict[str, str]]]:
    prefix = source[:source.index("{")]
    folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    return _named_listing(folder, [p[len(folder) + 1:] if folder else p for p in expand_braces(source)], source,
                          options)


def _named_listing(folder: str, keys: list[str], source: str, options
                   ) -> tuple[Storage, list[ListedShard], list[dict[str, str]]]:
    """The shards ``keys`` in ``folder`` (SOURCE's folder, the default DEST), which ``source`` names."""
    storage = open_storage(folder or ".", options)
    shards = [ListedShard(display_of(storage, key), storage, key) for key in keys]
    listed = {o.key: o.size for o in storage.list("")} if storage.remote else None
    for s in shards:
        _refuse_compressed(s.key, s.display)
        if listed is None:
            s.size = _local_tar(s.display, f" (named by {source})")
        elif (size := listed.get(s.key)) is not None:
            s.size = size
        else:
            raise DatasetError(f"{s.display}: no such shard (named by {source})")
    return storage, shards, []


def _folder_listing(source: str, options) -> tuple[Storage, list[ListedShard], list[dict[str, str]]]:
    storage = open_storage(source, options)
    glob = (f"{source}: fastio does not expand globs (the shell matched nothing, or the pattern was quoted): give "
            "the folder, or a brace pattern such as '/data/{000..009}.tar'")
    if not storage.remote and not storage.location.path.is_dir():
        if storage.location.path.is_file():
            if source.lower().endswith(".tar"):  # a shell glob that matched one shard: as several paths are
                return _named_listing(os.path.dirname(source), [os.path.basename(source)], source, options)
            raise DatasetError(f"{source}: a file: give the folder holding the shards, or a brace pattern")
        if any(c in source for c in "*?["):
            raise DatasetError(glob.replace(": fastio", ": no such folder; fastio", 1))
        raise DatasetError(f"{source}: no such folder")
    _refuse_split_dest(source, options)
    _refuse_unfinished_run(source, storage)
    own = owns_shards_dir(storage)
    if storage.remote:
        found, nested = _list_remote(storage, own)
        skipped = []
        if not found and any(c in source for c in "*?["):
            raise DatasetError(glob)
        if not found and (source.endswith(".tar") or names_object(source, options)):
            raise DatasetError(f"{source}: an object, not a prefix: give the prefix holding the shards, or a brace "
                               "pattern")
    else:
        found, skipped, nested = _walk_local(storage.location.path, own)
    shards = []
    for key, size in found:
        s = ListedShard(display_of(storage, key), storage, key, size)
        _refuse_compressed(s.key, s.display)
        if key.lower().endswith(".tar"):
            shards.append(s)
    if not shards:
        raise _no_tars(source, [key for key, _ in found], own, nested)
    return storage, shards, skipped


def _list_remote(storage: Storage, own_shards: bool) -> tuple[list[tuple[str, int | None]], list[str]]:
    """(key, size) of the objects below a prefix that a listing looks at (:func:`_listed`, and not in the own
    ``shards/`` of a fastio dataset below it, as :func:`_walk_local` does not enter them), sorted by key; and those
    datasets."""
    listed = storage.list("")
    nested = _datasets_below(storage, [o.key for o in listed])
    return [(o.key, o.size) for o in listed if _listed(o.key, own_shards) and not _in_shards_of(o.key, nested)], nested


def _datasets_below(storage: Storage, keys: list[str]) -> list[str]:
    """The folders below a prefix (``keys``: its listing) that are fastio datasets owning their ``shards/``
    (:func:`owns_shards_dir`), as a local walk finds them (none in a hidden folder): only a folder listed with a
    ``shards/`` and a marker or manifest beside it is asked (a user's folders named ``shards`` cost no request)."""
    listed = set(keys)
    candidates = {"/".join(parts[:i]) for parts in (k.split("/") for k in keys)
                  for i in range(1, len(parts) - 1) if parts[i] == SHARDS_DIR}
    return [folder for folder in sorted(candidates)
            if _listed(folder, False) and {f"{folder}/{MARKER_NAME}", f"{folder}/{MANIFEST_NAME}"} & listed
            and owns_shards_dir(storage.child(folder))]


def _in_shards_of(key: str, datasets: list[str]) -> bool:
    """Whether ``key`` lies in the own ``shards/`` of one of ``datasets`` (folders below the listed prefix)."""
    return any(key.startswith(f"{folder}/{SHARDS_DIR}/") for folder in datasets)


def _refuse_split_dest(source: str, options) -> None:
    """DatasetError for the DEST of ``fastio convert --split`` (its splits are datasets, in sub-folders whose
    ``shards/`` a walk would otherwise enter: one dataset of them all, validation samples among the training ones)."""
    try:
        splits = dest_split_names(source, options)
    except DatasetError:  # a splits.json that is not fastio's (the user's own file beside their tars)
        return
    if splits:
        children = " or ".join(str(dest_child(source, name)) for name in splits)
        raise DatasetError(f"{source}: holds the splits {', '.join(splits)} of a fastio convert, each a dataset "
                           f"already: nothing to index; give {children} to the Loader, verify or inspect")


def _refuse_unfinished_run(source: str, storage: Storage) -> None:
    """DatasetError for a SOURCE holding a run's marker and neither a manifest nor a split list: an unfinished
    conversion (or index), whose shards, in its split folders too, are part of its source only (the same run redoes
    them); indexed, they would be a dataset of part of the data, which the rerun then refuses as one."""
    if storage.exists(MANIFEST_NAME) or storage.exists(SPLITS_NAME):
        return
    try:
        marker = storage.get(MARKER_NAME)[:64]  # a line fastio wrote
    except StorageError:
        return
    raise unfinished_marked(source.rstrip("/") if storage.remote else source, marker)


def _no_tars(source: str, keys: list[str], own_shards: bool, nested: list[str]) -> DatasetError:
    """The refusal of a SOURCE without tars: one of Megatron pairs (directly in it) is named as such, with the
    option that indexes them; a fastio dataset (its own ``shards/`` not looked at) as one already, and a folder of
    them (``nested``: the datasets below SOURCE whose ``shards/`` were not entered) naming them."""
    names = {k for k in keys if "/" not in k}
    pairs = sum(1 for k in names if k.endswith(".bin") and k[:-len(".bin")] + ".idx" in names)
    if pairs:
        return DatasetError(f"{source}: holds Megatron .bin/.idx pairs ({pairs}), not .tar shards: index them as a "
                            "token dataset with eos_id=N, the id that ends every document (docs/tokens.md)")
    if own_shards:
        return DatasetError(f"{source}: a fastio dataset already (its shards/ are its own): nothing to index; give it "
                            "to the Loader, verify or inspect as it is")
    if nested:
        shown = nested if len(nested) <= _NAMED else [*nested[:_NAMED], f"{len(nested) - _NAMED} more"]
        children = " or ".join(str(dest_child(source, name)) for name in nested[:_NAMED])
        return DatasetError(f"{source}: holds no .tar files but the fastio {agree(len(nested), 'dataset')} "
                            f"{', '.join(shown)} ({agree(len(nested), 'its shards/ are its', 'their shards/ are their')}"
                            f" own): nothing to index; give {children} to the Loader, verify or inspect")
    if any(is_image_field(key.rsplit("/", 1)[-1]) for key in keys if "." in key.rsplit("/", 1)[-1]):
        return DatasetError(f"{source}: holds no .tar files but images: a folder of images is converted, not indexed: "
                            f"`fastio convert {shlex.quote(source)} DEST`")
    media = media_of([key.rsplit("/", 1)[-1] for key in keys])
    if media is not None:
        return DatasetError(f"{source}: holds no .tar files but {media[0]} ({media[1]} files): a folder of {media[0]} "
                            f"is converted, not indexed: `fastio convert {shlex.quote(source)} DEST`")
    return DatasetError(f"{source}: holds no .tar files")


def owns_shards_dir(folder: Storage) -> bool:
    """Whether ``folder``'s ``shards/`` is a fastio dataset's own (its shards, or the ``.idx`` files of an index with
    ``--dest``), finished or not: ``folder`` holds fastio's marker, or a fastio manifest that is not of an index in
    place (whose files lie beside the tars, never in ``shards/``). A user's folder named ``shards`` is not."""
    if folder.exists(MARKER_NAME):
        return True
    if not folder.exists(MANIFEST_NAME):
        return False
    try:
        manifest = json.loads(folder.get(MANIFEST_NAME))
    except (OSError, ValueError):
        return False
    source = manifest.get("source") if isinstance(manifest, dict) else None
    return (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and not (isinstance(source, dict) and source.get("indexed_in_place") is True))


def _listed(key: str, own_shards: bool) -> bool:
    """Whether a folder's listing looks at ``key``: not hidden, not in a fastio dataset's own ``shards/``
    (``own_shards``: :func:`owns_shards_dir` of the folder listed)."""
    return not any(p.startswith(".") for p in key.split("/")) and not (own_shards and key.split("/")[0] == SHARDS_DIR)


def _walk_local(root: Path, own_shards: bool
                ) -> tuple[list[tuple[str, int | None]], list[dict[str, str]], list[str]]:
    """(key, size) of the files below ``root`` that a listing looks at (:func:`_listed`), sorted by key, what
    it passed over with reasons, and the fastio datasets below ``root`` whose own ``shards/`` it did not enter.
    A link to a file is followed; each ``*.tar`` must be a regular file once links are followed
    (:func:`_local_tar`: a broken link, a FIFO, a device or a folder is refused); a link to a folder is not
    followed (no loops, nothing reached twice), nor is a broken link of another name: both are listed."""
    found: list[tuple[str, int | None]] = []
    skipped: list[dict[str, str]] = []
    nested: list[str] = []

    def visit(folder: str, prefix: str) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            key, display = prefix + entry.name, os.path.abspath(entry.path)
            if not _listed(key, own_shards):
                continue
            if key.lower().endswith(".tar"):
                found.append((key, _local_tar(display)))
            elif entry.is_dir(follow_symlinks=False):
                if prefix and entry.name == SHARDS_DIR and owns_shards_dir(open_storage(folder)):
                    nested.append(prefix.rstrip("/"))
                    continue  # a fastio dataset below SOURCE: its own shards (SOURCE's own: _listed)
                visit(entry.path, key + "/")
            elif entry.is_symlink() and not os.path.isfile(entry.path):
                what = "a link to a folder" if os.path.isdir(entry.path) else "a broken link"
                skipped.append({"path": display, "reason": f"{what} (-> {os.readlink(entry.path)}): not followed"})
            elif entry.is_file():
                found.append((key, None))  # looked at for its name only (a compressed tar is refused)

    visit(str(root), "")
    return sorted(found), skipped, sorted(nested)


def _local_tar(path: str, named_by: str = "") -> int:
    """The size of the local shard ``path``; DatasetError naming it unless it is a regular file once links are
    followed (a broken link names its target: a mount that is missing must not lose a shard unsaid)."""
    try:
        st = os.stat(path)
    except OSError as err:
        if os.path.islink(path):
            raise DatasetError(f"{path}: a broken link (-> {os.readlink(path)}: {err.strerror}){named_by}") from None
        raise DatasetError(f"{path}: no such shard{named_by}" if err.errno in (errno.ENOENT, errno.ENOTDIR)
                           else f"{path}: {err.strerror}{named_by}") from None
    if not stat.S_ISREG(st.st_mode):
        what = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        if os.path.islink(path):
            what = f"a link (-> {os.readlink(path)}) to {what}"
        raise DatasetError(f"{path}: {what}, not a tar file{named_by}")
    return st.st_size


_FILE_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _refuse_repeats(shards: list[ListedShard]) -> None:
    """DatasetError naming a shard listed twice (the same resolved path, or URL): its samples would come twice an
    epoch."""
    first: dict[str, str] = {}
    for s in shards:
        ident = s.display if s.storage.remote else os.path.realpath(s.display)
        if ident in first:
            also = "" if first[ident] == s.display else f" (the same file as {first[ident]})"
            raise DatasetError(f"{s.display}: named twice{also}: each of its samples would come twice an epoch; "
                               "name each shard once")
        first[ident] = s.display


def display_of(storage: Storage, key: str) -> str:
    """How messages and a manifest with ``--dest`` name a file: its URL, or its absolute path."""
    return storage.url_of(key) if storage.remote else os.path.abspath(storage.location.path / key)


def _refuse_compressed(key: str, display: str) -> None:
    if key.lower().endswith(_COMPRESSED_SUFFIXES):
        kinds = "/".join(sorted(set(COMPRESSED.values())))
        raise DatasetError(f"{display}: a compressed tar ({kinds} tars cannot be read at offsets): "
                           "`fastio convert` it into a dataset (or decompress it) instead")
