"""The commit marker ``fastio-commit.json`` as a typed record: parsed and checked here, serialised here.

A marker says that a step directory is a checkpoint (see :mod:`fastio.checkpoint.scan`). It holds the step, the
commit time, the engine that wrote the files, the codec of a compressed checkpoint, the class of each optimizer
saved (``optimizers``: Adam and AdamW hold the same state, so a restore checks it; absent from older markers),
the size and checksum of every file, and the save's progress (:class:`Progress`: epoch, metrics, elapsed time,
hparams, world size): the one progress record of a checkpoint, written once by rank 0 and read back on every rank by
a restore.

Versions read: 1 (files carry ``sha256``, no ``checksum`` or ``engine`` field: torchsnapshot), 2 (``xxh3_128``),
3 (as 2, plus ``compression``; the files listed as stored). A field that an older marker lacks takes the value that
version meant. Checkpoints written before this record was the only one also hold a per-rank progress record (the
``_fastio_progress`` app key of the engine's files); a restore ignores it: the marker's progress wins.
Torch-free (``fastio ckpt``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastio.checkpoint.engines import DEFAULT_ENGINE
from fastio.checks import checked, is_type, read_checked
from fastio.errors import CheckpointError
from fastio.words import count

__all__ = ["CHECKSUM", "COMMIT_FORMAT", "COMMIT_VERSION", "COMPRESSED_VERSION", "READ_VERSIONS", "CommitInfo",
           "CommitRecord", "Progress", "parse_commit"]

COMMIT_FORMAT = "fastio-checkpoint"
COMMIT_VERSION = 2
"""Version of new uncompressed commit markers. 2: files carry ``xxh3_128``; 1 (still read): ``sha256``."""
COMPRESSED_VERSION = 3
"""Version of the markers of compressed checkpoints: as 2, plus ``"compression"`` (stored files listed)."""
READ_VERSIONS = (1, 2, 3)
CHECKSUM = "xxh3_128"
"""The checksum new commits record per file (see :mod:`fastio.storage.checksum`)."""


def _numbers(values: Mapping[str, Any]) -> str | None:
    """The problem with a dict of metrics: a value that is no number (never a bool)."""
    bad = next((k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float))), None)
    return None if bad is None else f"expected a number for {bad!r}"


@dataclass(frozen=True)
class Progress:
    """A save's progress, as rank 0 saw it: what ``restore_latest`` hands back in its ``TrainState``."""

    epoch: int = checked(is_type(int), default=-1)
    """The epoch given to (or found by) ``maybe_save``; -1 when unknown."""
    metrics: Mapping[str, float] = checked(lambda v: is_type(dict)(v) or _numbers(v), default_factory=dict)
    """Name -> number (a save refuses any other metric)."""
    elapsed: float = checked(is_type(int, float), default=0.0)
    """Seconds of training (summed over restarts) up to the save."""
    hparams: Mapping[str, Any] = checked(is_type(dict), default_factory=dict)
    world_size: int = checked(is_type(int), default=0)
    """The number of ranks that saved; 0 when unknown (the engine's files then say)."""


@dataclass(frozen=True)
class CommitInfo:
    """What the writer knows of a step before its files are checksummed: the rest of its marker."""

    engine: str
    progress: Progress
    compression: str | None = None
    """The codec of a compressed checkpoint (a version 3 marker), None when its files are plain."""
    optimizers: Mapping[str, str] = field(default_factory=dict)
    """App key -> the class of each optimizer saved (``torch.optim.adamw.AdamW``)."""


@dataclass(frozen=True)
class CommitRecord:
    """One parsed commit marker (:func:`parse_commit`), or a new one (:meth:`new`, :meth:`encode`)."""

    version: int
    step: int
    files: Mapping[str, Mapping[str, Any]]
    """Relative path -> ``{"bytes": size, CHECKSUM: digest}`` (``sha256`` in version 1)."""
    time: float = checked(is_type(int, float), default=0.0)
    """Unix time of the commit."""
    time_utc: str | None = checked(is_type(str), default=None)
    checksum: str = checked(is_type(str), default="sha256")
    bytes: int | None = checked(is_type(int), default=None)
    """The listed files' bytes, as stored."""
    engine: str = checked(is_type(str), default=DEFAULT_ENGINE)
    compression: str | None = checked(is_type(str), default=None)
    progress: Progress = field(default_factory=Progress)
    optimizers: Mapping[str, str] = checked(is_type(dict), default_factory=dict)
    """App key -> the class of each optimizer saved, a dotted name (``torch.optim.adamw.AdamW``); empty in markers
    of older fastio (nothing then to check a restore's optimizers against)."""

    @classmethod
    def new(cls, files: Mapping[str, Mapping[str, Any]], *, step: int, info: CommitInfo) -> CommitRecord:
        """The marker of ``step`` listing ``files``, committed now; version 3 when ``info`` names a codec."""
        now = time.time()
        return cls(version=COMPRESSED_VERSION if info.compression else COMMIT_VERSION, step=step, files=dict(files),
                   time=now, time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), checksum=CHECKSUM,
                   bytes=sum(f["bytes"] for f in files.values()), engine=info.engine, compression=info.compression,
                   progress=info.progress, optimizers=dict(info.optimizers))

    def to_json(self) -> dict[str, Any]:
        """The marker as JSON values (the progress fields at the top level, as every version wrote them)."""
        p = self.progress
        data = {"format": COMMIT_FORMAT, "version": self.version, "step": self.step, "time": self.time,
                "time_utc": self.time_utc, "checksum": self.checksum, "bytes": self.bytes, "epoch": p.epoch,
                "metrics": dict(p.metrics), "world_size": p.world_size, "elapsed": p.elapsed,
                "hparams": dict(p.hparams), "engine": self.engine, "files": {k: dict(v) for k, v in self.files.items()}}
        if self.compression:
            data["compression"] = self.compression
        if self.optimizers:
            data["optimizers"] = dict(self.optimizers)
        return data

    def encode(self) -> bytes:
        """The marker's bytes, as written to ``fastio-commit.json``."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode()


def _read(cls: type, data: dict, where: str) -> dict[str, Any]:
    """``cls``'s checked fields in marker ``data`` (:func:`fastio.checks.read_checked`: an absent one takes its
    default, a number is never a bool); CheckpointError naming ``where``, the field and its value."""
    return read_checked(cls, data, complain=lambda key, value, problem: CheckpointError(
        f"{where}: commit marker field {key!r} is {value!r}, {problem}"),
        lacks=lambda keys: CheckpointError(f"{where}: commit marker lacks {', '.join(map(repr, keys))}"))


def _progress(data: dict, where: str) -> Progress:
    values = _read(Progress, data, where)
    if "elapsed" in values:
        values["elapsed"] = float(values["elapsed"])
    return Progress(**values)


def _files(data: dict, where: str) -> dict[str, dict[str, Any]]:
    files = data.get("files")
    if not isinstance(files, dict) or not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
        raise CheckpointError(f"{where}: commit marker lacks 'files' or 'step'")
    for rel, rec in files.items():
        if not _inside(rel):
            raise CheckpointError(f"{where}: commit marker lists {rel!r}, not a relative path inside the step")
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: commit marker entry for {rel!r} is {rec!r}, expected a dict")
    return files


def _check_total(files: Mapping[str, Mapping[str, Any]], total: int | None, where: str) -> None:
    """CheckpointError when the listed files' sizes do not add up to the marker's total (``bytes``, written with
    them): a marker that lost a file's entry, whose file a restore would read unchecked. Nothing to compare in a
    marker without a total (version 1) or with a size that is no integer (named by the file's check)."""
    sizes = [rec.get("bytes") for rec in files.values()]
    if total is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        return
    if sum(sizes) != total:
        raise CheckpointError(f"{where}: commit marker lists {count(len(sizes), 'file')} of {sum(sizes)} bytes, its "
                              f"total says {total} (a file's entry lost?)")


def _inside(rel: str) -> bool:
    """A listed file's path as the writer lists them: relative, ``/``-separated, no empty, ``.`` or ``..`` part (a
    marker listing another is edited or untrusted: its files would be read, and a compressed step's written, outside
    the step)."""
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def parse_commit(text: bytes, where: str) -> CommitRecord:
    """A commit marker's bytes (any version in :data:`READ_VERSIONS`), parsed and checked; CheckpointError
    naming ``where`` (and the field) when they are bad. The codec and engine are not judged here: a restore
    names an unknown one and skips the step."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where}: unreadable commit marker: {err}") from None
    if not isinstance(data, dict) or data.get("format") != COMMIT_FORMAT:
        raise CheckpointError(f"{where}: not a fastio commit marker")
    if data.get("version") not in READ_VERSIONS or isinstance(data.get("version"), bool):
        raise CheckpointError(f"{where}: commit marker version {data.get('version')!r}, this fastio reads "
                              f"{', '.join(map(str, READ_VERSIONS))}")
    files = _files(data, where)
    values = _read(CommitRecord, data, where)
    if "time" in values:
        values["time"] = float(values["time"])
    if not values.get("compression"):
        values.pop("compression", None)
    _check_total(files, values.get("bytes"), where)
    return CommitRecord(version=data["version"], step=data["step"], files=files, progress=_progress(data, where),
                        **values)
