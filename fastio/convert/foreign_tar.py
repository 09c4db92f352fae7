"""One existing WebDataset tar, read once for ``fastio index``: its samples as ``.idx`` entries, its size and
checksums, the fields it holds (with counts) and what it leaves out, or a refusal naming the file and why.

What WebDataset accepts is accepted: members of a sample in any order, keys with folders (``a/b/c.jpg``: key
``a/b/c``), multi-dot names (``x.seg.png``: field ``seg.png``), GNU long names and pax headers (read by
:mod:`tarfile`), samples lacking some fields, empty tars. Entries that are not regular files (folders, links)
and hidden files are passed over as ``wds2idx`` does; links (their samples come without that field) and members
WebDataset cannot name (no extension) are reported.

A member's field is its suffix lowercased, as WebDataset reads it (``a.JPG`` is field ``jpg``); the entries
keep the suffix as written.

Refused (:class:`~fastio.errors.DatasetError`, naming the file): a key that appears twice (both members
named), a field twice in one sample (``a.cls`` and ``a.CLS`` too), compressed tars (their members cannot be
read at offsets), files that are not tars, end before their last member's data or lack the end-of-archive
block after it (cut at a member boundary, which cannot be told from a tar written without those blocks: both
refused), hold data after those blocks (tars joined with ``cat``: readers stop at the first), a damaged header
after the first (:mod:`tarfile` would take it for the end), GNU sparse members (their bytes are not at one
offset), names an ``.idx`` line cannot hold (spaces, non-ASCII).

The entries are those ``wds2idx`` writes (tar order, the data's offset), with one exception: for a member with
a GNU long name, ``wds2idx`` records the offset of the long-name block (``tar --block-num``), not of the data;
fastio records the data's offset.
"""

from __future__ import annotations

import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fastio.errors import DatasetError
from fastio.formats.dali_idx import IndexEntry
from fastio.formats.labels import parse_label
from fastio.formats.wds import field_of, is_field_name, split_member_name
from fastio.storage.checksum import digests_file
from fastio.words import count

__all__ = ["COMPRESSED", "TarContents", "as_fields", "read_tar"]

COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
              b"\x04\x22\x4d\x18": "lz4"}
"""Magic bytes of the compressions a ``.tar.*`` shard may have."""


@dataclass
class TarContents:
    """What :func:`read_tar` found in one tar."""

    entries: list[IndexEntry]
    """Its samples in tar order, as its ``.idx`` lists them (each member's suffix as written; its field is
    :func:`fastio.formats.wds.field_of` it, see :func:`as_fields`)."""
    bytes: int
    """Size of the file."""
    sha256: str
    xxh3_128: str
    fields: Counter = field(default_factory=Counter)
    """Samples having each field (lowercased suffix)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(member name, reason) of each member left out."""
    bad_labels: dict[str, str] = field(default_factory=dict)
    """Label field -> the first of its values that is not a label (:mod:`fastio.formats.labels`), as ``sample 'KEY':
    REASON``; only the fields :func:`read_tar` was asked to check."""


_LABEL_READ = 64  # a longer value is no label: read this much of it, to show it


def _check_head(path: Path, name: str) -> None:
    """DatasetError naming ``name`` unless the file starts like an uncompressed tar (or with zero blocks)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as err:
        raise DatasetError(f"{name}: cannot be read: {err.strerror or err}") from None
    for magic, kind in COMPRESSED.items():
        if head.startswith(magic):
            raise DatasetError(f"{name}: a {kind}-compressed tar: its members cannot be read at offsets; "
                               "`fastio convert` it into a dataset (or decompress it) instead")
    if len(head) < 512:
        raise DatasetError(f"{name}: not a tar ({count(len(head), 'byte')}, shorter than one tar block)")
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except (tarfile.EOFHeaderError, tarfile.EmptyHeaderError):
        pass  # zero blocks: an empty archive (or one that starts with them); read on
    except tarfile.HeaderError as err:
        raise DatasetError(f"{name}: not a tar (no tar header at byte 0: {err})") from None


_LINKS = {tarfile.LNKTYPE: "a hard link to another member (its bytes are not stored under this name; WebDataset "
                          "reads none for it)",
          tarfile.SYMTYPE: "a symbolic link (its bytes are not stored in the tar; WebDataset reads none for it)"}
"""Why a link member (passed over, as ``wds2idx`` and WebDataset do) is named in ``skipped``: the sample comes without
that field (GNU tar stores a file hard-linked to one already archived as such a link)."""


def _hidden(member: str) -> bool:
    base = member[member.rfind("/") + 1:]
    return not base or base.startswith(".")


def _listed_member(info: tarfile.TarInfo, name: str, size: int) -> str | None:
    """The member's name when its ``.idx`` lists it (None: not a regular file, or hidden); DatasetError for a
    member that cannot be read at an offset (sparse, past the end of the file) or listed (spaces, non-ASCII)."""
    if info.issparse():
        raise DatasetError(f"{name}: member {info.name} is a GNU sparse file: its bytes are not stored "
                           "in one piece, so they cannot be read at an offset; write the tar without --sparse")
    if not info.isreg():
        return None
    if info.offset_data + info.size > size:
        raise DatasetError(f"{name}: truncated: member {info.name} needs bytes up to "
                           f"{info.offset_data + info.size}, the file has {size}")
    member = info.name
    if _hidden(member):
        return None  # hidden files, as wds2idx does
    if not member.isascii() or any(c.isspace() for c in member):
        raise DatasetError(f"{name}: member {member!r}: a name with spaces or non-ASCII characters "
                           "cannot be listed in an .idx file")
    return member


def read_tar(path: Path, name: str, label_fields: tuple[str, ...] = ()) -> TarContents:
    """Index the tar at ``path``; ``name`` (its path or URL) is how errors name it. The values of
    ``label_fields`` are read and checked with the label rule (``TarContents.bad_labels``)."""
    path = Path(path)
    _check_head(path, name)
    size, digests = digests_file(path, ("sha256", "xxh3_128"))
    out = TarContents([], size, digests["sha256"], digests["xxh3_128"])
    first_member: dict[str, str] = {}  # key -> the member that started its sample
    key, members, member_names = None, [], []
    try:
        with tarfile.open(path, mode="r:") as tar, open(path, "rb") as data:
            for info in tar:
                member = _listed_member(info, name, size)
                if member is None:
                    if info.type in _LINKS and not _hidden(info.name):
                        out.skipped.append((info.name, _LINKS[info.type]))
                    continue
                k, ext = split_member_name(member)
                if not ext or not is_field_name(ext):
                    out.skipped.append((member, "no field name (extension) WebDataset can read"))
                    continue
                if k != key:
                    if key is not None:
                        out.entries.append(IndexEntry(key, tuple(members)))
                    if k in first_member:
                        raise DatasetError(f"{name}: key {k!r} appears twice: members {first_member[k]} and "
                                           f"{member} are not adjacent (WebDataset would make two samples of it)")
                    first_member[k] = member
                    key, members, member_names = k, [], []
                f = field_of(ext)
                if any(f == field_of(m[0]) for m in members):
                    first = member_names[[field_of(m[0]) for m in members].index(f)]
                    raise DatasetError(f"{name}: sample {k!r} has field {f!r} twice: members {first} and {member}"
                                       " (fields are suffixes lowercased, as WebDataset reads them)")
                members.append((ext, info.offset_data, info.size))
                if f in label_fields and f not in out.bad_labels:
                    _check_label(out, f, k, data, info)
                member_names.append(member)
            _check_end(path, name, tar.offset, size, tar.members[-1].name if tar.members else None)
    except tarfile.ReadError as err:
        what = "truncated" if "unexpected end" in str(err) or "truncated" in str(err) else "not a tar"
        raise DatasetError(f"{name}: {what} ({err})") from None
    except (EOFError, tarfile.TarError, OSError) as err:
        raise DatasetError(f"{name}: not a readable tar ({err})") from None
    if key is not None:
        out.entries.append(IndexEntry(key, tuple(members)))
    for entry in as_fields(out.entries):
        out.fields.update(f for f, _, _ in entry.members)
    return out


def as_fields(entries: list[IndexEntry]) -> list[IndexEntry]:
    """``entries`` of a WebDataset tar's ``.idx`` with each member's suffix replaced by its field (lowercased:
    :func:`fastio.formats.wds.field_of`): what ``samples.fxi`` and the manifest's fields hold, while the ``.idx`` keeps
    the suffixes as written (byte-equal to ``wds2idx``)."""
    return [e if all(x == field_of(x) for x, _, _ in e.members)
            else IndexEntry(e.key, tuple((field_of(x), o, n) for x, o, n in e.members)) for e in entries]


def _check_label(out: TarContents, field: str, key: str, data, info: tarfile.TarInfo) -> None:
    """Record in ``out.bad_labels`` why the value of label field ``field`` (member ``info`` of the open tar
    ``data``) of sample ``key`` is not a label, if it is not."""
    data.seek(info.offset_data)
    reason = _not_a_label(data.read(min(info.size, _LABEL_READ)), info.size)
    if reason:
        out.bad_labels[field] = f"sample {key!r}: {reason}"


def _not_a_label(head: bytes, size: int) -> str | None:
    """Why a label field's value (its first bytes ``head``, ``size`` in all) is not a label, or None."""
    try:
        parse_label(head)
    except ValueError as err:
        return str(err) if size <= _LABEL_READ else f"a {size}-byte value ({head[:32]!r}...) is not a label"
    return None if size <= _LABEL_READ else f"a {size}-byte value is not a label"


def _check_end(path: Path, name: str, offset: int, size: int, last: str | None) -> None:
    """:mod:`tarfile` stops quietly at a damaged header, at the end of the file after a member, or at the
    end-of-archive blocks of the first of two tars joined; what follows the last member must be tar's end-of-archive
    block, then only zeros, else samples would be left out unsaid."""
    after = f"after member {last}" if last else "at the start"
    if offset + 512 > size:
        raise DatasetError(f"{name}: truncated: the file ends at byte {size} {after}, without tar's "
                           "end-of-archive blocks (a tar cut short and one written without them look the same); "
                           "if the shard is whole, write it again with `tar` or webdataset's ShardWriter")
    with open(path, "rb") as f:
        f.seek(offset)
        block = f.read(512)
        if block.count(0) != len(block):
            raise DatasetError(f"{name}: damaged: no valid tar header at byte {offset} ({after}); "
                               "the members after it cannot be found")
        data = _first_data(f, offset + 512)
    if data is not None:
        raise DatasetError(f"{name}: holds data after its end-of-archive blocks (at byte {data}), where tar readers "
                           "(WebDataset, tar without -i) stop: tars joined with `cat`? Its members there would be left "
                           "out unsaid; write the members into one tar (or index the tars apart)")


def _first_data(f, start: int) -> int | None:
    """The offset (of its 512-byte block) of the first byte that is not zero from ``start`` to the end of ``f``, or
    None: after a tar's end-of-archive blocks come only zeros (its padding to a 10 KiB record)."""
    f.seek(start)
    at = start
    while chunk := f.read(1 << 20):
        stripped = chunk.lstrip(b"\0")
        if stripped:
            first = at + len(chunk) - len(stripped)
            return first - (first - start) % 512
        at += len(chunk)
    return None
