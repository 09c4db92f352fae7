"""Conversion in parts: which samples part K of N converts, where it writes them, and its completion record.

``fastio convert SOURCE DEST --part K/N`` converts the K-th of N contiguous ranges of the same global order
that a single ``fastio convert`` writes (the scan's deterministic order, then ``split`` and ``shuffle``, both
pure functions of the seed). Each part writes into its own directory, ``DEST/.parts/part-K-of-N/`` (one
sub-directory per split with ``split``), so parts can run at the same time on different nodes, in any order,
and a failed part can be rerun alone. ``part.json`` is written last: its presence marks the part complete.
:func:`fastio.convert.merge.merge` then publishes one dataset from the N parts.

How parts agree on the listing: every part scans the source itself (the scan is deterministic: sorted
directory walks, table rows in file order) and records :func:`listing_digest` of what it saw; the merge
refuses parts whose digests differ (e.g. a file was added between two parts' scans).

Part ranges fall where a single conversion cuts a shard, as far as that can be known before loading: every
part predicts the single run's cuts (:func:`predicted_shard_starts`) from the sizes of the files the samples
name (one ``stat`` each) and the bytes the scan holds, with the writer's own cut rule, and takes the K-th of N
runs of whole predicted shards (:func:`part_range`). The prediction is exact unless a sample is skipped while
loading (a corrupt image) or re-encoded (``max_side``); then the merge re-packs the shards whose cuts moved
(see :mod:`fastio.convert.merge`), and the output is still the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastio.converters.base import Entry, FileRef, ScanResult, UrlRef
from fastio.dataset.manifest import PARTS_DIR
from fastio.dataset.shards import sample_span, starts_new_shard
from fastio.errors import ConvertError
from fastio.progress import count
from fastio.storage.atomic import atomic_write_bytes
from fastio.storage.lock import LOCK_NAME, current_holder

__all__ = [
    "PARTS_DIR",
    "PART_RECORD",
    "PartRecord",
    "clear_part_dir",
    "listing_digest",
    "parse_part",
    "part_dir",
    "part_name",
    "part_range",
    "predicted_shard_starts",
    "read_part_record",
    "write_part_record",
]

PART_RECORD = "part.json"
PART_FORMAT = "fastio-part"
PART_FORMAT_VERSION = 1
ARRAY_TASK_VARIABLE = "SLURM_ARRAY_TASK_ID"
_PART = re.compile(r"^\s*(\d+|auto)\s*/\s*(\d+)\s*$")
_PART_DIR = re.compile(r"^part-(\d+)-of-(\d+)$")


def parse_part(text: str | tuple[int, int], environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``"K/N"`` (0-based K) or ``"auto/N"`` (K from ``SLURM_ARRAY_TASK_ID``) -> ``(K, N)``.

    ValueError messages name the parameter, ``part``."""
    environ = os.environ if environ is None else environ
    if isinstance(text, tuple):
        k, n = text
    else:
        m = _PART.match(str(text))
        if not m:
            raise ValueError(f"part: cannot read {text!r} as K/N (e.g. 0/8, or auto/8 in a Slurm array job)")
        n = int(m[2])
        if m[1] == "auto":
            task = environ.get(ARRAY_TASK_VARIABLE)
            if task is None or not task.isdigit():
                raise ValueError(f"part: {text!r} takes K from {ARRAY_TASK_VARIABLE}, which is "
                                 f"{'not set (not a Slurm array task?)' if task is None else repr(task)}")
            k = int(task)
        else:
            k = int(m[1])
    if n < 1:
        raise ValueError(f"part: the number of parts must be at least 1, got {n}")
    if not 0 <= k < n:
        raise ValueError(f"part: K must be in 0..{n - 1} for {count(n, 'part')}, got {k}")
    return k, n


def part_name(k: int, n: int) -> str:
    return f"part-{k}-of-{n}"


def part_dir(dest: Path, k: int, n: int) -> Path:
    """Where part K of N writes: ``DEST/.parts/part-K-of-N``."""
    return Path(dest) / PARTS_DIR / part_name(k, n)


def parse_part_dir(name: str) -> tuple[int, int] | None:
    m = _PART_DIR.match(name)
    return (int(m[1]), int(m[2])) if m else None


def start_part_dir(dest: str | Path, k: int, n: int, directory: Path) -> None:
    """Refuse part ``k/n`` while a whole conversion or merge holds DEST (it may be resetting DEST: a part is not
    started under it), then empty the part's directory (:func:`clear_part_dir`). The caller holds the part's lock."""
    holder = current_holder(dest)
    if holder is not None:
        raise ConvertError(f"{dest}: in use by {holder}; part {k}/{n} was not started (run it again once that "
                           "process has ended)")
    clear_part_dir(directory)


def clear_part_dir(directory: Path) -> None:
    """Empty a part's directory but for its lock (the writer holds it); the completion record goes first."""
    (directory / PART_RECORD).unlink(missing_ok=True)
    for child in directory.iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def part_range(count: int, k: int, n: int, starts: Sequence[int] | None = None) -> tuple[int, int]:
    """Positions ``[start, end)`` of ``count`` ordered samples that part K of N converts.

    Contiguous, in order, covering ``0..count`` once over K = 0..N-1. ``starts`` (ascending, from 0) are where
    shards begin: part K gets the K-th of N runs of whole shards (a part is empty when there are fewer shards
    than parts); None: every sample may start a shard."""
    if starts is None:
        return k * count // n, (k + 1) * count // n
    shards = len(starts)
    first, last = k * shards // n, (k + 1) * shards // n
    return (starts[first] if first < shards else count), (starts[last] if last < shards else count)


def predicted_shard_starts(entries: Sequence[Entry], max_bytes: int, max_samples: int | None) -> list[int]:
    """Where a single conversion of ``entries`` (in writing order) starts each shard, if every sample is
    written as it is: fields named by :class:`FileRef` count with their file's size (one ``stat``), by
    :class:`UrlRef` with the size the scan asked, bytes with their length; the cut rule is the writer's own. A
    file that cannot be stat-ed counts as empty (its sample will be skipped, and the merge re-cuts)."""
    starts: list[int] = []
    members_end = begun = 0
    for i, entry in enumerate(entries):
        sizes = []
        for _, value in entry.fields:
            if isinstance(value, FileRef):
                try:
                    sizes.append(os.stat(value.path).st_size)
                except OSError:
                    sizes.append(0)
            elif isinstance(value, UrlRef):
                sizes.append(value.size)
            else:
                sizes.append(len(value))
        span = sample_span(sizes)
        if i == 0 or starts_new_shard(members_end, i - begun, span, max_bytes, max_samples):
            starts.append(i)
            begun, members_end = i, 0
        members_end += span
    return starts


def listing_digest(scan: ScanResult) -> str:
    """sha256 of everything a scan decided: entries (key, fields, origin) in order, skipped inputs, source
    description, labels. Two parts with equal digests converted ranges of the same listing."""
    h = hashlib.sha256()

    def put(*items: Any) -> None:
        for item in items:
            data = item if isinstance(item, bytes) else _utf8(str(item))
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)

    put(json.dumps([scan.description, scan.label_map, scan.image_field, scan.label_field], sort_keys=True))
    put(len(scan.entries))
    for entry in scan.entries:
        put(entry.key, entry.origin, len(entry.fields))
        for name, value in entry.fields:
            put(name, _listed(value))
    put(json.dumps([s.as_dict() for s in scan.skipped]))
    return h.hexdigest()


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8, a file name's bytes that are not UTF-8 (held as lone surrogates, os.fsdecode's) as they were."""
    return text.encode("utf-8", "surrogateescape")


def _listed(value: Any) -> bytes:
    """A field's value as the listing digest takes it: a file's path, an object's URL and size, or the bytes."""
    if isinstance(value, FileRef):
        return _utf8("ref:" + value.path)
    if isinstance(value, UrlRef):
        return _utf8(f"url:{value.size}:{value.url}")
    return b"bytes:" + value


@dataclass
class PartRecord:
    """``part.json``: what part K of N was made from and what it holds (written last: the part is complete)."""

    part: int
    """K, 0-based."""
    of: int
    """N, the number of parts."""
    plan: dict[str, Any]
    """What every part of one conversion must share: source description, format, options (``convert_options``),
    shard name, listing digest and size, labels, the scan's skipped inputs. The merge compares it across parts."""
    datasets: dict[str, dict[str, Any]]
    """Per output dataset (``""`` without split, else the split name): ``{"range": [start, end]}``, the positions
    of the group's order this part converted (its shards and manifest are in the sub-directory of that name)."""

    def as_dict(self) -> dict[str, Any]:
        return {"format": PART_FORMAT, "format_version": PART_FORMAT_VERSION, "part": self.part, "of": self.of,
                "plan": self.plan, "datasets": self.datasets}


def write_part_record(directory: Path, record: PartRecord) -> None:
    atomic_write_bytes(Path(directory) / PART_RECORD,
                       json.dumps(record.as_dict(), indent=2, sort_keys=True).encode() + b"\n")


def read_part_record(directory: Path) -> PartRecord | None:
    """The record of a complete part, None when there is none yet; ConvertError naming a damaged one."""
    path = Path(directory) / PART_RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConvertError(f"{path}: unreadable part record ({err})") from None
    if not isinstance(data, dict) or data.get("format") != PART_FORMAT:
        raise ConvertError(f"{path}: not a fastio part record (format is not {PART_FORMAT!r})")
    if data.get("format_version") != PART_FORMAT_VERSION:
        raise ConvertError(f"{path}: part record version {data.get('format_version')!r}, "
                           f"this fastio reads {PART_FORMAT_VERSION}")
    try:
        record = PartRecord(part=data["part"], of=data["of"], plan=data["plan"], datasets=data["datasets"])
    except KeyError as err:
        raise ConvertError(f"{path}: part record lacks {err.args[0]!r}") from None
    if not (isinstance(record.plan, dict) and isinstance(record.datasets, dict)
            and all(isinstance(d, dict) and isinstance(d.get("range"), list) for d in record.datasets.values())):
        raise ConvertError(f"{path}: part record has a malformed plan or datasets")
    return record
