"""``fastio index``: make existing WebDataset shards a fastio dataset without writing a byte of them.

SOURCE is a folder (every ``*.tar`` below it, in sorted order; links to files followed, links to folders
listed in ``skipped``, not followed), an ``s3://bucket/prefix/``, or a brace pattern of shards
(``/data/{00000..00999}.tar``, ``s3://b/p/shard-{000..099}.tar``); a shard named twice is refused (the listing:
:mod:`fastio.convert.listing`).
Each tar is read once (:func:`fastio.convert.foreign_tar.read_tar`; from an object store downloaded by parallel ranged
GETs into a temporary file, removed after; the run's folder for them, ``TMP/fastio-index-<pid>-<start>-*``, is removed by
a later run where a kill left it: :mod:`fastio.convert.scratch`). What is written, all of it metadata:

- by default (DEST = SOURCE's folder) a ``.idx`` beside each tar that has none (one that exists is checked
  against what fastio makes of the tar: one the user brought is never overwritten; one an earlier index wrote,
  :func:`fastios_idx`, is replaced with ``overwrite``), then ``samples.fxi`` and ``manifest.json`` (last)
  beside the shards; the manifest names each shard by its path relative to DEST and lists the ``.idx`` files
  fastio did not write (``source.idx_kept``);
- with ``dest`` elsewhere (a read-only bucket), every ``.idx`` in ``DEST/shards/``, and the manifest names
  the shards by absolute path or URL.

Samples with video or audio members (:mod:`fastio.formats.media`) get their probes in DEST's probe table
(``probes.fxp``, before the manifest): each member probed once with PyAV while its tar is read; one that
cannot be probed or decoded on the CPU is kept (the shard is not rewritten) and named in ``skipped``.

The result is an ordinary dataset (:class:`fastio.Dataset`, the Loader, ``verify``, ``inspect``); its manifest
also records the fields with their sample counts (``field_counts``), the label and image fields, and what was
left out with reasons (``skipped``: empty tars, members without a field name).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.checks import check_fields, checked, one_of, positive_integer, rule
from fastio.convert.dest import (
    check_index_dest,
    mark_index_dest,
    publish_uploads,
    refuse_a_datasets_shards,
    refuse_a_foreign_manifest,
    refuse_a_split_of_an_unfinished_convert,
    writer_lock,
)
from fastio.convert.foreign_tar import TarContents, as_fields, read_tar
from fastio.convert.listing import ListedShard, display_of, list_shards
from fastio.convert.parts import (
    PART_RECORD,
    PARTS_DIR,
    PartRecord,
    parse_part,
    part_dir,
    part_name,
    part_range,
    write_part_record,
)
from fastio.convert.scratch import INDEX_SCRATCH, scratch_dir
from fastio.dataset.files import LocalFiles
from fastio.dataset.manifest import (
    MANIFEST_NAME,
    SHARDS_DIR,
    IndexRecord,
    Manifest,
    ShardRecord,
    is_location,
    make_manifest,
    write_manifest,
)
from fastio.dataset.sample_table import INDEX_NAME, IndexBuilder
from fastio.errors import DatasetError, StorageError, install_hint
from fastio.formats.dali_idx import IndexEntry, format_index, load_index
from fastio.formats.images import is_image_field
from fastio.formats.media import (
    DEFAULT_VIDEO_DECODER,
    PROBES_NAME,
    VIDEO_DECODERS,
    MediaCheckError,
    check_media,
    is_media_field,
    video_codecs_of,
    write_probe_table,
)
from fastio.formats.wds import field_of
from fastio.progress import count, human_bytes, skipped_lines
from fastio.storage import open_storage
from fastio.storage.atomic import atomic_write_bytes
from fastio.storage.base import Storage
from fastio.storage.checksum import digests_file
from fastio.storage.lease import Lease, LeaseLostError
from fastio.storage.lock import LockedError
from fastio.storage.options import StorageOptions
from fastio.storage.url import dest_location, refuse_empty
from fastio.words import agree

__all__ = ["IDX_KEPT", "IDX_LEDGER", "INDEX_PLAN", "IndexConfig", "IndexResult", "fastios_idx", "index_shards",
           "merge_index_parts"]

LABEL_FIELDS = ("cls", "label")
"""Fields taken as the label, in this order, when ``label_field`` is not given and every sample has one."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-.]")
_FIELD_NAME = rule(lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_\-.]+", v) is not None,
                   "must be a field name (letters, digits, '_', '-', '.')")


@dataclass(frozen=True)
class IndexConfig:
    """What ``fastio index`` indexes and where it writes (checked when made: ValueError naming the parameter)."""

    source: str | Path
    """A folder of tars, an ``s3://bucket/prefix/``, a brace pattern of tar paths or URLs, or one local tar path."""
    dest: str | Path | None = None
    """Where the metadata goes; None: SOURCE's folder (the ``.idx`` files beside the tars)."""
    label_field: str | None = checked(_FIELD_NAME, default=None)
    """The field holding integer labels; None: ``cls`` or ``label``, when every sample has it."""
    image_field: str | None = checked(_FIELD_NAME, default=None)
    """The main image field; None: the image field most samples have."""
    name: str = "webdataset"
    """The dataset's name in the manifest."""
    overwrite: bool = False
    """Index again where a manifest exists, replacing the ``.idx`` files an earlier index wrote (shards, and
    ``.idx`` files fastio did not write, are never written: :func:`fastios_idx`)."""
    threads: int = checked(positive_integer, default=4)
    """Shards read at once (each is read sequentially)."""
    part: str | tuple[int, int] | None = None
    """``K/N`` (or ``auto/N``: K from ``SLURM_ARRAY_TASK_ID``): index only the K-th of N runs of the listing
    into ``DEST/.parts/``; ``fastio merge DEST`` then publishes the dataset. Local DEST only."""
    storage_options: StorageOptions | dict | None = None
    """Endpoint, region and credentials for ``s3://`` (see :class:`fastio.storage.StorageOptions`)."""
    video_decoder: str = checked(one_of(VIDEO_DECODERS), default=DEFAULT_VIDEO_DECODER)
    """Which videos are probed (as ``fastio convert``'s): ``auto`` (every codec a Loader decodes, H.264 too), ``cpu``
    (DALI's CPU decoder's) or ``nvdec`` (as ``auto``); a member of another codec is named, not probed."""

    def __post_init__(self):
        refuse_empty(self.source)  # "$SRC" of an unset variable: the one message naming the way out
        if not str(self.source).strip():
            raise ValueError("source: empty")
        if self.part is not None:
            parse_part(self.part)  # ValueError naming part
        check_fields(self, lambda key, value, problem: ValueError(f"{key}: {problem}, got {value!r}"))
        for key in ("label_field", "image_field"):  # a field is a lowercased suffix (fastio.formats.wds.field_of)
            if getattr(self, key) is not None:
                object.__setattr__(self, key, field_of(getattr(self, key)))


@dataclass
class IndexResult:
    """What :func:`index_shards` published."""

    dest: str | Path
    shards: int
    samples: int
    bytes: int
    seconds: float
    written_idx: int
    """``.idx`` files written (the others existed and matched)."""
    skipped: list[dict[str, str]] = field(default_factory=list)
    label_note: str | None = None
    """Why no label field was taken although ``cls`` or ``label`` is in some samples (:func:`_label_note`)."""

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"indexed {count(self.shards, 'shard')}, {count(self.samples, 'sample')} ({human_bytes(self.bytes)}) "
                f"in {self.seconds:.1f}s ({self.shards / s:.1f} shards/s, {self.bytes / s / 1e6:.1f} MB/s) -> "
                f"{self.dest}; {self.written_idx} .idx written, {len(self.skipped)} skipped"
                + (f"\n  {self.label_note}" if self.label_note else "")
                + skipped_lines(self.skipped, f"fastio inspect {self.dest} --skipped"))


def _location(shard: ListedShard, in_place: bool) -> str:
    """Where the manifest says the shard is: relative to DEST in place, else its absolute path or URL."""
    return shard.key if in_place else shard.display


def _check_locations(shards: list[ListedShard], in_place: bool, dest: str) -> None:
    """DatasetError, before anything is written, naming a shard the manifest could not record
    (:func:`fastio.dataset.manifest.is_location`)."""
    for s in shards:
        where = _location(s, in_place)
        if is_location(where):
            continue
        if any(ord(c) < 32 or c == "\x7f" for c in where):
            raise DatasetError(f"{s.display!r}: a control character (newline, tab, ...) in a shard's path; "
                               "rename the shard")
        raise DatasetError(f"{s.display}: cannot be named relative to {dest} ({where!r}); index it with --dest")


@contextmanager
def _local_copy(shard: ListedShard, staging: Path) -> Iterator[Path]:
    """A local file with the shard's bytes: the file itself, or a download removed afterwards."""
    if not shard.storage.remote:
        yield shard.storage.location.path / shard.key
        return
    fd, tmp = tempfile.mkstemp(prefix=".fastio-index-", suffix=".tar", dir=staging)
    os.close(fd)
    try:
        shard.storage.get_to_file(shard.key, Path(tmp), shard.size)
        yield Path(tmp)
    finally:
        os.unlink(tmp)


def _read(shard: ListedShard, staging: Path, label_fields: tuple[str, ...],
          video_decoder: str = DEFAULT_VIDEO_DECODER) -> tuple[TarContents, list[dict[str, Any]]]:
    """The tar's contents and each sample's media members probed (:func:`_probe_members`)."""
    with _local_copy(shard, staging) as path:
        got = read_tar(path, shard.display, label_fields)
        return got, _probe_members(path, got.entries, shard.display, video_decoder)


def _probe_members(path: Path, entries: list[IndexEntry], display: str,
                   video_decoder: str = DEFAULT_VIDEO_DECODER) -> list[dict[str, Any]]:
    """Per sample, each video or audio member's probe (a dict, as convert's ``probe.json``), or the reason it
    could not be probed or ``video_decoder`` cannot read it (:func:`fastio.formats.media.check_media`): read once
    with PyAV while indexing, since the shards are never rewritten (the probes go to DEST's probe table)."""
    rows: list[dict[str, Any]] = [{} for _ in entries]
    media = [(j, field_of(ext), offset, size) for j, e in enumerate(entries) for ext, offset, size in e.members
             if is_media_field(field_of(ext))]
    fd = os.open(path, os.O_RDONLY)
    try:
        for j, name, offset, size in media:
            try:
                rows[j][name] = json.loads(check_media(os.pread(fd, size, offset), name, video_decoder))
            except MediaCheckError as err:
                rows[j][name] = str(err)
    except ImportError:  # PyAV, imported by the probe on use
        raise DatasetError(f"{display}: holds video or audio ({media[0][1]}); probing it needs PyAV: "
                           f"{install_hint('media')}") from None
    finally:
        os.close(fd)
    return rows


def _record_names(shards: list[ListedShard]) -> list[str]:
    """A unique shard name (``NAME.tar``, no folder) for each tar, from its path below SOURCE (``A.TAR``, or a tar a
    brace pattern names ``x.dat``: ``A.tar``, ``x.dat.tar``)."""
    taken: set[str] = set()
    names = []
    for s in shards:
        stem = s.key[:-len(".tar")] if s.key.lower().endswith(".tar") else s.key
        stem = _UNSAFE.sub("_", stem.replace("/", "-"))
        stem = stem if re.match(r"[A-Za-z0-9_\-]", stem) else "_" + stem
        name, i = f"{stem}.tar", 1
        while name in taken:
            name, i = f"{stem}-{i}.tar", i + 1
        taken.add(name)
        names.append(name)
    return names


def _idx_key(key: str) -> str:
    """Where a tar's ``.idx`` goes beside it: ``x.tar`` (any case) -> ``x.idx``, another name ``x.dat`` -> ``x.dat.idx``."""
    return (key[: -len(".tar")] if key.lower().endswith(".tar") else key) + ".idx"


def index_shards(config: IndexConfig, progress: Callable[[int, int], None] | None = None) -> IndexResult:
    """Index the shards ``config.source`` names (see the module docstring); ``progress(done, total)`` is called
    after each shard. Raises :class:`DatasetError` naming the file and the reason a shard is refused.

    With ``config.part`` (``K/N``), index only the K-th of N runs of the listing: its ``.idx`` files are
    published, its records go to ``DEST/.parts/part-K-of-N/part.json``, and :func:`fastio.convert.merge.merge` then
    writes ``samples.fxi`` and the manifest (:func:`merge_index_parts`)."""
    try:
        return _index_shards(config, progress)
    except OSError as err:  # DEST unwritable, a folder unreadable, disk full, ...: one line naming the file
        raise DatasetError(f"{err.filename2 or err.filename or config.dest or config.source}: {err.strerror or err}"
                           f"{_way_out(err, config)}") from None


def _way_out(err: OSError, config: IndexConfig) -> str:
    """``; ... dest=DIR`` (the CLI says ``--dest DIR``) where ``err`` is a write refused in a folder that cannot be
    written (a read-only mount, permissions): the shards' folder, indexed in place by default, or DEST; else ``""``."""
    name = err.filename2 or err.filename
    if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not isinstance(name, (str, Path)):
        return ""
    if os.access(os.path.dirname(os.path.abspath(name)), os.W_OK):  # e.g. a shard that cannot be read
        return ""
    if config.dest is None:
        return "; the shards' folder cannot be written: index them into another folder with dest=DIR"
    return "; DEST cannot be written: index into a folder that can be, dest=DIR"


def _index_shards(config: IndexConfig, progress: Callable[[int, int], None] | None) -> IndexResult:
    started = time.perf_counter()
    src_root, shards, listing_skipped = list_shards(str(config.source), config.storage_options)
    dest_storage, in_place = _index_dest(config, src_root, shards)
    source = _recorded_source(config.source, in_place)
    names = _record_names(shards)
    part = None
    if config.part is not None:
        k, n = parse_part(config.part)
        a, b = part_range(len(shards), k, n)
        part, shards, names = (k, n, a, b, len(shards), _listing_digest(shards)), shards[a:b], names[a:b]
        listing_skipped = listing_skipped if k == 0 else []  # recorded once, first, as one run does
    lock_dir = None if dest_storage.remote else (
        part_dir(dest_storage.location.path, part[0], part[1]) if part else dest_storage.location.path)
    # one writer per DEST: a DirLock on a local one, the lease object on an s3:// prefix
    lock = writer_lock(dest_storage, "fastio index", lock_dir)
    guard = lock.confirm if isinstance(lock, Lease) else (lambda: None)
    try:
        if lock is not None:
            lock.acquire()
        if not in_place:
            mark_index_dest(dest_storage)
        if part is not None:
            (lock_dir / PART_RECORD).unlink(missing_ok=True)
        with scratch_dir(INDEX_SCRATCH) as tmp:
            done = _index_range(config, shards, names, dest_storage, in_place, tmp, progress)
            done.skipped[:0] = listing_skipped
            if part is None:
                _fields_of(source, config.label_field, config.image_field, done)  # refused before any write
            elif config.label_field is not None:  # a part knows its label field only when it is named
                _check_labels(config.label_field, done)
            guard()
            _write_ledger(dest_storage, _ledger_key(part), done.ledger)  # before the first .idx
            publish_uploads(dest_storage, done.uploads)
            if part is not None:
                k, n, a, b, count, digest = part
                plan = _plan(config, source, in_place, count, digest)
                write_part_record(lock_dir, PartRecord(part=k, of=n, plan=plan,
                                                       datasets={"": {"range": [a, b], "count": count, **done.state()}}))
            else:
                guard()
                _finish(config.name, source, config.label_field, config.image_field, in_place, done, dest_storage,
                        tmp)
    except (LockedError, LeaseLostError) as err:
        raise DatasetError(str(err)) from None
    finally:
        if lock is not None:
            lock.release()
    return _result(dest_storage, done, started, _label_note(done) if part is None and config.label_field is None
                   else None)


def _result(dest: Storage, done: _Indexed, started: float, label_note: str | None) -> IndexResult:
    return IndexResult(dest=dest.url if dest.remote else dest.location.path, shards=len(done.records),
                       samples=sum(r.samples for r in done.records), bytes=sum(r.bytes for r in done.records),
                       seconds=time.perf_counter() - started, written_idx=done.written, skipped=done.skipped,
                       label_note=label_note)


def _index_dest(config: IndexConfig, src_root: Storage, shards: list[ListedShard]) -> tuple[Storage, bool]:
    """Where the index goes and whether that is in place; DatasetError for a DEST that cannot take it."""
    dest_storage = src_root if config.dest is None else open_storage(dest_location(config.dest),
                                                                       config.storage_options)
    in_place = _same_place(dest_storage, src_root)
    dest_storage = src_root if in_place else dest_storage  # DEST spelt another way (``wds/``, absolute, a link)
    refuse_a_datasets_shards(dest_storage)
    for folder in (src_root, dest_storage):
        refuse_a_split_of_an_unfinished_convert(folder)
    if not in_place and src_root.remote and not dest_storage.remote:
        raise DatasetError(f"{config.dest}: shards on an object store are indexed into an s3:// DEST (or in place)")
    _check_locations(shards, in_place, dest_storage.url)
    if config.part is not None and dest_storage.remote:
        raise DatasetError(f"{dest_storage.url}: part: indexing in parts writes to a local DEST (merge is local)")
    if not in_place:
        check_index_dest(dest_storage, config.overwrite)
    refuse_a_foreign_manifest(dest_storage)
    if config.part is None and dest_storage.exists(MANIFEST_NAME) and not config.overwrite:
        raise DatasetError(f"{dest_storage.url}: already holds a dataset ({MANIFEST_NAME}); pass overwrite "
                           "(--overwrite) to index again")
    return dest_storage, in_place


def _ledger_key(part: tuple | None) -> str:
    """Where a run records the ``.idx`` files it writes (:data:`IDX_LEDGER`): DEST's, or its part folder's."""
    return IDX_LEDGER if part is None else f"{PARTS_DIR}/{part_name(part[0], part[1])}/{IDX_LEDGER}"


def _recorded_source(source: str | Path, in_place: bool) -> str:
    """SOURCE as the manifest records it (``source.path``, from which the Loader's rebuild command is made,
    :func:`fastio.dataset.manifest.reindex_command`): with ``--dest``, a local path made absolute (as typed, a relative
    one is right only from the folder the index ran in; a brace pattern is not normalised, as ``{a,b}/..`` is no
    folder); in place as given (spelt from DEST, which may move); a URL as given."""
    text = str(source)
    if in_place or "://" in text:
        return text
    if "{" not in text:
        return os.path.abspath(text)
    return re.sub(r"/(\./)+", "/", os.path.join(os.getcwd(), text))  # ./ is no folder in any alternative


def _same_place(a: Storage, b: Storage) -> bool:
    """Whether two storages are one folder or prefix, however spelt (a local one by its resolved path)."""
    if a.remote or b.remote:
        return a.url == b.url
    return os.path.realpath(a.location.path) == os.path.realpath(b.location.path)


INDEX_PLAN = "fastio-index"
"""``plan.kind`` of the parts of an index (``fastio merge`` publishes them with :func:`merge_index_parts`)."""


def _plan(config: IndexConfig, source: str, in_place: bool, count: int, digest: str) -> dict:
    """What every part of one index shares (compared by the merge); ``source`` as the manifest records it."""
    return {"kind": INDEX_PLAN, "source": {"path": source}, "listing": digest, "count": count,
            "options": {"name": config.name, "label_field": config.label_field, "image_field": config.image_field,
                        "in_place": in_place, **({"video_decoder": config.video_decoder}
                                                 if config.video_decoder != DEFAULT_VIDEO_DECODER else {})}}


def _listing_digest(shards: list[ListedShard]) -> str:
    """sha256 of the listing (keys and sizes): parts that disagree saw different sources."""
    return hashlib.sha256("".join(f"{s.key}\t{s.size}\n" for s in shards).encode()).hexdigest()


@dataclass
class _Indexed:
    """What a run of shards gave: records (empty shards left out), their entries, field counts, skips."""

    records: list[ShardRecord] = field(default_factory=list)
    entries: list[list[IndexEntry]] = field(default_factory=list)
    field_counts: Counter = field(default_factory=Counter)
    skipped: list[dict[str, str]] = field(default_factory=list)
    written: int = 0
    uploads: list[tuple[str, Path]] = field(default_factory=list)
    """(key in DEST, staged file) of each ``.idx`` to publish."""
    bad_labels: dict[str, str] = field(default_factory=dict)
    """Candidate label field -> its first value that is not a label, named by shard and key."""
    probes: list[dict[str, Any]] = field(default_factory=list)
    """Per sample (dataset order): each media field's probe, or why it has none (:func:`_probe_members`)."""
    kept: list[str] | None = field(default_factory=list)
    """In place: the keys of the ``.idx`` files that were there and that fastio did not write (None: not known,
    a part record of an older fastio): recorded as ``source.idx_kept`` (:func:`fastios_idx`)."""

    ledger: dict[str, str] = field(default_factory=dict)
    """The ``.idx`` files fastio wrote in DEST that this run leaves there, ``{key: sha256}`` (:data:`IDX_LEDGER`)."""

    def state(self) -> dict:
        """For a part record (entries are in the ``.idx`` files; probes only when a sample has media)."""
        media = {"probes": self.probes} if any(self.probes) else {}
        return {"shards": [r.as_dict() for r in self.records], "field_counts": dict(self.field_counts),
                "skipped": self.skipped, "bad_labels": self.bad_labels, IDX_KEPT: self.kept, **media}

    def add_bad_labels(self, found: dict[str, str]) -> None:
        """Keep the first bad value of each field, in listing order."""
        for f, where in found.items():
            self.bad_labels.setdefault(f, where)


def _index_range(config: IndexConfig, shards: list[ListedShard], names: list[str], dest: Storage, in_place: bool,
                 tmp: Path, progress) -> _Indexed:
    """Read ``shards`` and publish each missing ``.idx`` (in place: beside its tar; else ``DEST/shards/``)."""
    out = _Indexed()
    if not shards:
        return out
    with ThreadPoolExecutor(min(config.threads, len(shards)), thread_name_prefix="fastio-index") as pool:
        contents = []
        labels = (config.label_field,) if config.label_field is not None else LABEL_FIELDS
        for i, got in enumerate(pool.map(lambda s: _read(s, tmp, labels, config.video_decoder), shards)):
            contents.append(got)
            if progress is not None:
                progress(i + 1, len(shards))
    uploads: list[tuple[str, Path]] = []
    ours = fastios_idx(dest, in_place)
    for shard, name, (got, probes) in zip(shards, names, contents):
        out.skipped += [{"path": f"{shard.display}:{member}", "reason": why} for member, why in got.skipped]
        out.skipped += [{"path": f"{shard.display}:{e.key}.{f}", "reason": f"not probed (kept in the shard): {why}"}
                        for e, row in zip(got.entries, probes) for f, why in row.items() if isinstance(why, str)]
        out.add_bad_labels({f: f"{shard.display}: {where}" for f, where in got.bad_labels.items()})
        if not got.entries:
            out.skipped.append({"path": shard.display, "reason": "empty shard (no samples)"})
            continue
        text = format_index(got.entries).encode()
        idx_key = _idx_key(shard.key) if in_place else f"{SHARDS_DIR}/{name[:-len('.tar')]}.idx"
        existing = _existing(dest, idx_key, shard.display) if in_place else None  # DEST/shards/ is fastio's own
        if existing is not None and existing != text:
            _check_replace(dest, idx_key, shard.display, existing, text, ours, config.overwrite)
            existing = None  # an .idx an earlier index wrote, replaced
        if existing is not None and idx_key not in ours:
            out.kept.append(idx_key)
        if existing is None:
            path = tmp / f"idx-{len(out.records)}.idx"
            path.write_bytes(text)
            uploads.append((idx_key, path))
            out.written += 1
        location = _location(shard, in_place)
        out.records.append(ShardRecord(name=name, samples=len(got.entries), bytes=got.bytes, sha256=got.sha256,
                                       idx_sha256=hashlib.sha256(text).hexdigest(), xxh3_128=got.xxh3_128,
                                       location=location, idx_location=idx_key if in_place else None))
        out.entries.append(got.entries)
        out.probes += probes
        out.field_counts.update(got.fields)
    out.uploads = uploads
    out.ledger = _ledger_of(dest, out, {} if config.part is not None else ours)
    return out


def _finish(name: str, source: str, label_field: str | None, image_field: str | None, in_place: bool,
            done: _Indexed, dest: Storage, tmp: Path) -> Manifest:
    """Write ``samples.fxi``, then ``manifest.json`` (last) into DEST, then remove the ``.idx`` files in
    ``DEST/shards/`` that the manifest replaced listed and this one does not (:func:`fastios_idx`); returns the
    manifest."""
    earlier = fastios_idx(dest, in_place)
    fields, label, image, image_fields = _fields_of(source, label_field, image_field, done)
    builder = IndexBuilder()
    for record, es in zip(done.records, done.entries):
        builder.add(record, as_fields(es))  # samples.fxi by field; the .idx keeps the suffixes as written
    staged = tmp / "out"
    staged.mkdir()
    index = builder.publish(staged / INDEX_NAME, fields)
    probes = _probe_table(staged / PROBES_NAME, done.probes)
    codecs = video_codecs_of(done.probes)
    manifest = make_manifest(
        name=name, shards=done.records, fields=fields, index=index, **probes, image_field=image,
        **({"video_codecs": codecs} if codecs else {}),
        image_fields=[image, *[f for f in image_fields if f != image]] if image else image_fields,
        label_field=label, field_counts=dict(sorted(done.field_counts.items())), skipped=done.skipped,
        converted_from={"format": "webdataset", "path": source, "indexed_in_place": in_place,
                        **({IDX_KEPT: sorted(done.kept)} if in_place and done.kept is not None else {})})
    write_manifest(staged, manifest)
    tables = [(PROBES_NAME, staged / PROBES_NAME)] if probes else []
    publish_uploads(dest, [(INDEX_NAME, staged / INDEX_NAME), *tables, (MANIFEST_NAME, staged / MANIFEST_NAME)])
    gone = [] if in_place else [k for k in sorted(set(earlier) - {r.idx_key for r in done.records})
                                if k.startswith(f"{SHARDS_DIR}/") and _unchanged(dest, k, earlier[k])]
    for key in gone:
        dest.delete(key)
    _write_ledger(dest, IDX_LEDGER, _ledger_of(dest, done, {k: v for k, v in earlier.items() if k not in gone}))
    return manifest


def _probe_table(path: Path, probes: list[dict[str, Any]]) -> dict[str, IndexRecord]:
    """``{"probes": record}`` of the probe table written at ``path`` when a sample has media, else ``{}``."""
    if not any(probes):
        return {}
    write_probe_table(path, [{f: got if isinstance(got, str) else json.dumps(got).encode() for f, got in row.items()}
                             for row in probes])
    size, sums = digests_file(path, ("sha256", "xxh3_128"))
    return {"probes": IndexRecord(name=path.name, bytes=size, sha256=sums["sha256"], xxh3_128=sums["xxh3_128"])}


def _fields_of(source: str, label_field: str | None, image_field: str | None, done: _Indexed):
    """(fields, label field, image field, image fields); DatasetError when there are no samples or a field asked
    for is missing."""
    if not done.records:
        raise DatasetError(f"{source}: no samples in any shard (all empty)")
    fields = sorted(done.field_counts)
    total = sum(r.samples for r in done.records)
    label = _label_field(label_field, done.field_counts, total, fields, lambda f: _first_without(done, f))
    if label is not None:
        _check_labels(label, done)
    image_fields = sorted(f for f in fields if is_image_field(f))
    return fields, label, _image_field(image_field, done.field_counts, image_fields, fields), image_fields


def merge_index_parts(dest: Path, records: list[PartRecord], plan: dict, *, overwrite: bool = False) -> Manifest:
    """Publish the parts of an index (``fastio index --part K/N``) as one dataset in DEST: the parts' shard
    records in order, each ``.idx`` read back (checked against its record), ``samples.fxi``, the manifest last."""
    if (Path(dest) / MANIFEST_NAME).exists() and not overwrite:
        raise DatasetError(f"{dest}: already holds a dataset ({MANIFEST_NAME}); pass overwrite (--overwrite) "
                           "to index again")
    done = _Indexed()
    source = LocalFiles(Path(dest))
    for part in records:
        state = part.datasets[""]
        for i, data in enumerate(state["shards"]):
            record = ShardRecord.from_dict(data, f"{part_name(part.part, part.of)}: shards[{i}]")
            try:
                entries = load_index(source.idx_path(record).read_bytes(), samples=record.samples,
                                     tar_bytes=record.bytes, sha256=record.idx_sha256, source=record.idx_key)
            except (OSError, ValueError) as err:
                raise DatasetError(f"{dest}: {record.idx_key}: {getattr(err, 'strerror', None) or err} "
                                   f"(index {part_name(part.part, part.of)} again)") from None
            done.records.append(record)
            done.entries.append(entries)
        done.probes += state.get("probes") or [{} for _ in range(sum(s["samples"] for s in state["shards"]))]
        done.field_counts.update(state["field_counts"])
        done.add_bad_labels(state.get("bad_labels", {}))
        done.skipped += state["skipped"]
        done.kept = None if done.kept is None or IDX_KEPT not in state else done.kept + state[IDX_KEPT]
    options = plan["options"]
    with scratch_dir(INDEX_SCRATCH) as tmp:
        return _finish(options["name"], plan["source"]["path"], options["label_field"], options["image_field"],
                       options["in_place"], done, open_storage(Path(dest)), tmp)


IDX_KEPT = "idx_kept"
"""The manifest's ``source`` key listing the ``.idx`` files an index in place found and did not write."""


IDX_LEDGER = ".fastio-idx.json"
"""In DEST (a part's, in its folder): ``{"format": "fastio-idx", "idx": {key: sha256}}``, every ``.idx`` fastio index
wrote there that is still there, the shard's listed or not. Written before a run's first ``.idx`` (a run killed before
its manifest leaves ``.idx`` files the rerun knows as fastio's) and again after the manifest (an ``.idx`` of a shard
gone from SOURCE, kept in place, stays fastio's: a new tar of that name replaces it)."""


def fastios_idx(dest: Storage, in_place: bool) -> dict[str, str]:
    """The one rule of which ``.idx`` files an index may replace or remove, as ``{key: the sha256 recorded}``: those
    DEST's ledger (:data:`IDX_LEDGER`, DEST's and its parts') or its manifest (an earlier index's) records fastio
    wrote. With ``--dest``, those in ``DEST/shards/`` (fastio's own; removed once the new manifest no longer lists
    them, a shard gone from SOURCE, else ``fastio verify`` would name each as a file the manifest does not list). In
    place, also the ``.idx`` of each shard the manifest lists, less those it records the user brought
    (``source.idx_kept``); none where it does not record them (an index by an older fastio): the user's are never
    written. Only the sha256 recorded lets an ``.idx`` be replaced (:func:`_check_replace`)."""
    ledgers = [IDX_LEDGER] + ([] if dest.remote else [
        f"{PARTS_DIR}/{p.name}/{IDX_LEDGER}" for p in sorted((dest.location.path / PARTS_DIR).glob("part-*"))])
    found = {k: v for key in ledgers for k, v in _read_ledger(dest, key).items()}
    return {**found, **_manifests_idx(dest, in_place)}


def _read_ledger(dest: Storage, key: str) -> dict[str, str]:
    """The ``idx`` of the ledger at ``key`` (:data:`IDX_LEDGER`); empty where there is none or it cannot be read."""
    try:
        if not dest.exists(key):
            return {}
        data = json.loads(dest.get(key))
        got = data["idx"] if data.get("format") == "fastio-idx" else {}
        return {k: v for k, v in got.items() if _LEDGER_KEY.fullmatch(k) and ".." not in k.split("/")
                and isinstance(v, str) and _SHA256.fullmatch(v)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DatasetError):
        return {}


_LEDGER_KEY = re.compile(r"[^/\\\x00-\x1f\x7f][^\\\x00-\x1f\x7f]*\.idx")
"""A key a ledger may hold: a relative path ending in ``.idx`` (a damaged ledger names nothing else to replace or
remove; ``..`` is refused too)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _write_ledger(dest: Storage, key: str, idx: dict[str, str]) -> None:
    """Record ``idx`` at ``key`` (:data:`IDX_LEDGER`), replacing it whole; none is written where none is owed."""
    if not idx and not dest.exists(key):
        return
    data = json.dumps({"format": "fastio-idx", "idx": dict(sorted(idx.items()))}, indent=0).encode()
    if dest.remote:
        dest.put_bytes(key, data)
    else:
        atomic_write_bytes(dest.location.path / key, data)


def _unchanged(dest: Storage, key: str, sha256: str) -> bool:
    """Whether the file at ``key`` is there with the sha256 fastio recorded (one changed since is not fastio's)."""
    try:
        return dest.exists(key) and hashlib.sha256(dest.get(key)).hexdigest() == sha256
    except (OSError, StorageError):  # left for the next run (the ledger keeps it)
        return False


def _ledger_of(dest: Storage, done: _Indexed, earlier: dict[str, str]) -> dict[str, str]:
    """The ledger after a run: the ``.idx`` of each shard it records that the user did not bring (all of them
    where that is unknown, ``done.kept`` None, but those ``earlier`` did not record), and each of ``earlier``'s
    (fastio's) of another shard that is still there."""
    own = {r.idx_key: r.idx_sha256 for r in done.records
           if (r.idx_key not in done.kept if done.kept is not None else r.idx_key in earlier)}
    return {**{k: v for k, v in earlier.items() if k not in {r.idx_key for r in done.records} and dest.exists(k)},
            **own}


def _manifests_idx(dest: Storage, in_place: bool) -> dict[str, str]:
    """The ``.idx`` files DEST's manifest records fastio wrote (see :func:`fastios_idx`); empty without one."""
    if not dest.exists(MANIFEST_NAME):
        return {}
    try:
        data = json.loads(dest.get(MANIFEST_NAME))
        records = [ShardRecord.from_dict(s, MANIFEST_NAME) for s in data["shards"]]
        if not in_place:
            return {r.idx_key: r.idx_sha256 for r in records if r.idx_location is None}
        kept = data["source"][IDX_KEPT]
        if not data["source"].get("indexed_in_place") or not isinstance(kept, list) \
                or not all(isinstance(k, str) for k in kept):
            return {}
        return {r.idx_key: r.idx_sha256 for r in records if r.idx_location is not None and r.idx_key not in kept}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DatasetError):
        return {}


def _check_replace(dest: Storage, key: str, tar: str, existing: bytes, text: bytes, ours: dict[str, str],
                   overwrite: bool) -> None:
    """DatasetError unless the ``.idx`` at ``key``, which differs from the index of ``tar``, may be replaced: one
    an earlier index wrote (:func:`fastios_idx`), unchanged since, with ``overwrite``."""
    where = (f"{display_of(dest, key)}: exists and differs from the index of {tar} "
             f"({_first_difference(existing, text)})")
    if ours.get(key) != hashlib.sha256(existing).hexdigest():
        raise DatasetError(f"{where}; an .idx that DEST's manifest does not record as fastio's (yours, or changed "
                           "since) is never overwritten: remove it, or index with --dest elsewhere")
    if not overwrite:
        raise DatasetError(f"{where}; an earlier fastio index wrote it: pass --overwrite to replace it")


def _existing(storage: Storage, key: str, tar: str) -> bytes | None:
    """The bytes of an ``.idx`` already at ``key``, or None; DatasetError if something else is there."""
    if not storage.remote:
        path = storage.location.path / key
        if not path.exists() and not path.is_symlink():
            return None
        if not path.is_file():
            raise DatasetError(f"{display_of(storage, key)}: the .idx of {tar} goes there, but it exists and is not a "
                               "file; move it away")
        return path.read_bytes()
    return storage.get(key) if storage.exists(key) else None


def _first_difference(old: bytes, new: bytes) -> str:
    a, b = old.decode("latin-1").splitlines(), new.decode("latin-1").splitlines()
    for n, (x, y) in enumerate(zip(a, b), start=1):
        if x != y:
            return f"line {n}"
    return f"{count(len(a), 'line')}, fastio makes {len(b)}"


def _label_field(wanted: str | None, counts: Counter, total: int, fields: list[str],
                 first_without: Callable[[str], str]) -> str | None:
    if wanted is not None:
        if wanted not in counts:
            raise DatasetError(f"label_field: no sample has field {wanted!r} (fields: {', '.join(fields)})")
        if counts[wanted] != total:
            lacking = total - counts[wanted]
            raise DatasetError(f"label_field: {lacking} of {count(total, 'sample')} "
                               f"{agree(lacking, 'lacks', 'lack')} field {wanted!r} (the first: {first_without(wanted)})")
        return wanted
    return next((f for f in LABEL_FIELDS if counts.get(f) == total), None)


def _label_note(done: _Indexed) -> str | None:
    """A line for the summary where no label field was taken but ``cls`` or ``label`` is in some samples (a label
    field is one every sample has): else the Loader gives batches without labels, and nothing says why."""
    total = sum(r.samples for r in done.records)
    counts = done.field_counts
    if total == 0 or any(counts.get(f) == total for f in LABEL_FIELDS):
        return None
    f = next((f for f in LABEL_FIELDS if counts.get(f)), None)
    if f is None:
        return None
    return (f"no label field: {f} is in {counts[f]} of {count(total, 'sample')} (the first without it: "
            f"{_first_without(done, f)}); a label field is one every sample has")


def _first_without(done: _Indexed, field: str) -> str:
    """``shard NAME key 'KEY'`` of the first sample without ``field`` (a shard by where it is: its location)."""
    for record, entries in zip(done.records, done.entries):
        for entry in entries:
            if all(field_of(ext) != field for ext, _, _ in entry.members):
                return f"shard {record.location or record.name} key {entry.key!r}"
    return "none"


def _check_labels(label: str, done: _Indexed) -> None:
    """DatasetError naming the shard, key and value when a value of the label field is not a label."""
    if label in done.bad_labels:
        raise DatasetError(f"{done.bad_labels[label]} (label field {label!r}: labels are integers "
                           "0..2**63-1 in ASCII decimal); fix that sample, or pass label_field (--label-field) naming "
                           "the field that holds the labels")


def _image_field(wanted: str | None, counts: Counter, image_fields: list[str], fields: list[str]) -> str | None:
    if wanted is not None:
        if wanted not in counts:
            raise DatasetError(f"image_field: no sample has field {wanted!r} (fields: {', '.join(fields)})")
        return wanted
    return max(image_fields, key=lambda f: (counts[f], [-ord(c) for c in f])) if image_fields else None

