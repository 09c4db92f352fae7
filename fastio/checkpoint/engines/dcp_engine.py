"""The DCP engine: the only module that imports ``torch.distributed.checkpoint`` (its public API, and the one
private helper :class:`_SafeLoadPlanner` uses, ``_traverse.set_element``, with a fallback when torch moves it).
It also reads ``torch.save`` bytes in place (:func:`_stored_tensor`: torch's zip reader ``torch._C.PyTorchFileReader``
for a record's offset, the pickle read by an allow-list of torch's storage types and its tensor rebuild function),
falling back to ``torch.load``.

For DTensor state (FSDP2 ``fully_shard``, tensor parallel) and for resharding: a checkpoint written by N
ranks restores on M ranks, sharded or not.

What goes where in a step directory:

- *global* state, written once across ranks through ``dcp.save`` (``.metadata`` and ``__R_0.distcp``):
  every ``nn.Module`` of the app (``get_model_state_dict``: parameter names, DTensor shards or, for plain
  and DDP modules, tensors identical on every rank), and every optimizer whose parameters all belong to
  one app module (``get_optimizer_state_dict``: state keyed by parameter name, so it reshards too; an LBFGS
  there is refused at save, naming its app key: it keeps state for its first parameter only);
- *per-rank* state (the loader position, RNG streams, any other object and an
  optimizer of no app module), one ``torch.save`` file per app key and rank, ``rank-R/<key>.pt``;
- ``fastio-dcp.json``: world size and which keys are global, per rank (written by rank 0).

The Checkpointer stages a private copy before ``save`` is called on its writer thread; ``dcp.save``
writes from that copy (DCP's own ``async_save`` is not used, so both engines keep one staging rule), through
:class:`_HashingFileSystem`: each file's xxh3-128 is taken from the bytes written, so the commit does not read
the files back.

Loading never runs code from the checkpoint: per-rank files and DCP's items are read with
``torch.load(weights_only=True)`` (a plain tensor's layout by a narrower allow-list: :func:`_stored_tensor`; an item
torch.load refuses is a CheckpointError naming its data file); DCP's ``.metadata`` (a pickle, which DCP's own reader
reads with ``pickle.load``) is unpickled here with an allow-list of DCP's metadata classes and refused otherwise, and
``dcp.load`` is handed that object (:class:`_HeldReader`), never the file.

A restore loads a rank's own data files without a copy of its own: the Checkpointer's check hashes the files
:meth:`DcpEngine.reads` foresees for a rank (:func:`fastio.storage.checksum.open_hashed`) and, once every rank has
agreed that every file of the step is intact, ``dcp.load`` reads those files' items through the check's
:class:`~fastio.storage.checksum.CheckedFile` (``pread``; never a mapping of the file, whose truncation by another
process would be a SIGBUS: a file cut short is a CheckpointError naming it, the offset and the size): a plain tensor
stored as the app's tensor lies is read straight into it (:func:`_load_held`), anything else read into memory first
and loaded from there (a tensor's stored bytes viewed in place and copied into the app's tensor, as bytes where they
lie at an address its dtype's kernels may not read: :func:`_copy_stored`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pickle
import re
import shutil
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from os import PathLike
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fastio.checkpoint.agree import terms_code
from fastio.checkpoint.engines.base import WRITE_CHECKSUM, SavedCheckpoint, Stateful, first_line, written_record
from fastio.checkpoint.engines.strict import Mismatch, group_sizes, other_dtypes, quantized_keys, shape_of
from fastio.errors import CheckpointError, os_error_text
from fastio.progress import human_bytes
from fastio.storage.atomic import start_writeback
from fastio.storage.checksum import CheckedFile, ShortRead

__all__ = ["DcpCheckpoint", "DcpEngine", "SIDECAR"]

SIDECAR = "fastio-dcp.json"
SIDECAR_FORMAT, SIDECAR_VERSION = "fastio-dcp", 1
_METADATA = ".metadata"
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")
"""DCP's data files (one writer per file, ``single_file_per_rank``): ``__R_N.distcp`` written by rank R."""

try:  # how DCP's default planner puts a non-tensor item into the state dict; re-serialised for it otherwise
    from torch.distributed.checkpoint._traverse import set_element as _set_element
except ImportError:  # pragma: no cover - a torch that moved it
    _set_element = None


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed(pg: Any, fn: Any, same: Any = None, what: str = "") -> Any:
    """``fn()`` on this rank, then every rank's outcome (and its ``same``, ``what`` it saw) agreed over ``pg``,
    so that no rank enters the next collective alone: a rank where ``fn`` raised, or whose ``same`` is not rank
    0's, raises its error; the others raise a CheckpointError marked ``elsewhere`` (the first failing rank's,
    naming it), which :meth:`fastio.checkpoint.group.RankGroup.run` leaves to that rank to report. One all-reduce
    when every rank succeeded with the same ``same``; the outcomes themselves are gathered only otherwise."""
    mine: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - agreed, then raised
        mine = err
    if _rank()[1] > 1 and _differs(pg, mine is not None, same):
        _raise_first_failure(pg, mine, same, what)
    if mine is not None:
        raise mine
    return result


def _differs(pg: Any, failed: bool, same: Any) -> bool:
    """Collective: True when some rank's ``failed`` is set or its ``same`` differs from another rank's (one
    all-reduce of the flag and of a digest of ``same``, as its maximum and minus its minimum)."""
    code = terms_code({"same": same})
    t = torch.tensor([int(failed), code, -code], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return bool(t[0]) or int(t[1]) != -int(t[2])


def _raise_first_failure(pg: Any, mine: BaseException | None, same: Any, what: str) -> None:
    """Collective: every rank's outcome gathered; a rank that succeeded raises the first failing rank's error
    (marked ``elsewhere`` unless it is this rank's: a ``same`` other than rank 0's)."""
    every: list[Any] = [None] * _rank()[1]
    text = None if mine is None else str(mine) if isinstance(mine, CheckpointError) else first_line(mine)
    dist.all_gather_object(every, (text, same), group=pg)
    failed = [(r, t) for r, (t, _) in enumerate(every) if t]
    failed = failed or [(r, f"ranks see different {what}: rank 0 {every[0][1]}, rank {r} {seen} (a node that "
                            "sees other files?)") for r, (_, seen) in enumerate(every) if seen != every[0][1]][:1]
    if failed and mine is None:
        first, why = failed[0]
        other = CheckpointError(why if first == _rank()[0] else f"{why} (on rank {first})")
        other.elsewhere = first != _rank()[0]
        raise other


def _rank_file(path: Path, rank: int, key: str) -> Path:
    return Path(path) / f"rank-{rank}" / f"{quote(key, safe='')}.pt"


# ---------------------------------------------------------------- app objects as DCP sees them
class ModuleState:
    """An ``nn.Module`` through ``get_model_state_dict``/``set_model_state_dict`` (FQN keys, DTensors kept)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state_dict)


class OptimizerState:
    """An optimizer through ``get_optimizer_state_dict``/``set_optimizer_state_dict`` of its module
    (state keyed by parameter name rather than by position, so it reshards)."""

    def __init__(self, module: nn.Module, optim: torch.optim.Optimizer):
        self.module, self.optim = module, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optim, state_dict)


def _has_dtensor(params) -> bool:
    return any(isinstance(p, DTensor) for p in params)


# ---------------------------------------------------------------- loading without running code
_METADATA_EXTRA = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch.serialization", "_get_layout"),
                   ("collections", "OrderedDict"), ("torch", "Size")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only DCP's metadata classes and torch's dtype/Size/layout."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _METADATA_EXTRA:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
                return super().find_class(module, name)
            if module.startswith("torch.distributed.checkpoint."):
                obj = super().find_class(module, name)
                if isinstance(obj, type):
                    return obj
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not DCP metadata")


def check_metadata(path: Path) -> Any:
    """Refuse a ``.metadata`` that would run code when DCP unpickles it (one line naming the file); else the
    metadata, unpickled by the checked rule."""
    meta = Path(path) / _METADATA
    try:
        with open(meta, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{meta}: missing (DCP metadata)") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means: do not hand it to pickle.load
        raise CheckpointError(f"{meta}: refused to load: {first_line(err)}") from None


def _top(fqn: str, paths: dict) -> str:
    """The app key of a state dict's flattened key ``fqn``, by DCP's ``paths`` (its planner's mappings or the
    checkpoint's planner data), else its first part."""
    path = paths.get(fqn)
    return str(path[0]) if path else fqn.split(".", 1)[0]


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor items with ``torch.load(weights_only=True)``, and applying
    the strict rule (:mod:`fastio.checkpoint.engines.strict`) to the checkpoint's keys against the app's: DCP
    itself loads only the keys it is asked for, so a checkpoint of a larger model would load silently."""

    def __init__(self, where: Path, *, strict: bool = True, skipped: list[str] | None = None, cast: bool = False):
        super().__init__(allow_partial_load=not strict)
        self.where, self.strict, self.cast = where, strict, cast
        self.skipped = skipped if skipped is not None else []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        saved_paths = metadata.planner_data or {}
        self._planned = self._group_settings(metadata, saved_paths)
        found = self._mismatches(metadata, saved_paths)
        if not found:
            return
        if self.strict:
            raise CheckpointError(f"{self.where}: checkpoint does not match the app: "
                                  f"{'; '.join(line for m in found for line in m.lines())} "
                                  "(restore_latest(..., strict=False) loads what matches and lists the rest)")
        for m in found:
            groups = m.groups_line()
            if groups:  # the checkpoint's groups over the app's would name other parameters: the app's stay
                self.skipped.append(f"{groups} (the app's groups kept, each parameter's state loaded by name)")
                m.keep_groups()
            self.skipped.extend(m.lines())
            for sub_key in m.skipped_keys:  # left as the app has them
                self.state_dict.pop(f"{m.key}.{sub_key}", None)
        self._planned = True

    def _mismatches(self, metadata, saved_paths: dict) -> list[Mismatch]:
        """Per app key of the state dict, what differs between the checkpoint's metadata and the app's state: keys,
        shapes, dtypes (unless ``cast``), and tensors quantized in the checkpoint, not in the app."""
        keys = {_top(fqn, self.mappings) for fqn in self.state_dict}
        saved = {fqn: m for fqn, m in metadata.state_dict_metadata.items() if _top(fqn, saved_paths) in keys}
        found = []
        for key in sorted(keys):
            sub = len(key) + 1  # state keys named inside their app key
            mine = {fqn: m for fqn, m in saved.items() if _top(fqn, saved_paths) == key}
            theirs = {fqn[sub:]: tuple(m.size) if getattr(m, "size", None) is not None else None
                      for fqn, m in mine.items()}
            ours = {fqn[sub:]: v for fqn, v in self.state_dict.items() if _top(fqn, self.mappings) == key}
            dtypes = {fqn[sub:]: m.properties.dtype for fqn, m in mine.items() if hasattr(m, "properties")}
            mismatch = Mismatch(key, theirs, {k: shape_of(v) for k, v in ours.items()}, quantized_keys(dtypes, ours),
                                other_dtypes(dtypes, ours, cast=self.cast))
            if mismatch:
                found.append(mismatch)
        return found

    def _group_settings(self, metadata, saved_paths: dict) -> bool:
        """A parameter group's setting on one side only (``initial_lr``, written by an lr scheduler built before
        the save or the restore, not both), as torch's ``Optimizer.load_state_dict`` takes it: the checkpoint's is
        loaded into the app's group, the app's own stays; True when there was one. A group on one side only is
        the groups' rule."""
        def groups(paths) -> set[tuple]:
            return {tuple(p[:3]) for p in paths if len(p) == 4 and p[1] == "param_groups"}

        def setting(path: tuple, where: set[tuple]) -> bool:
            return len(path) == 4 and path[:3] in where and path[3] != "params"

        own, theirs, changed = groups(self.mappings.values()), groups(saved_paths.values()), False
        for fqn, md in metadata.state_dict_metadata.items():
            path = tuple(saved_paths.get(fqn) or ())
            if fqn not in self.state_dict and isinstance(md, BytesStorageMetadata) and setting(path, own):
                self.state_dict[fqn], self.mappings[fqn], changed = None, path, True
        for fqn in [f for f in self.state_dict if f not in metadata.state_dict_metadata]:
            if setting(tuple(self.mappings.get(fqn) or ()), theirs):
                del self.state_dict[fqn]
                changed = True
        return changed

    def create_local_plan(self):
        if getattr(self, "_planned", False):  # keys were left out on purpose: not a DCP 2.3 checkpoint's names
            return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(f"{self.where}: item {read_item.dest_index.fqn}: refused to load: not plain "
                                  "tensors and containers (torch.load weights_only)") from None
        fqn = read_item.dest_index.fqn
        if _set_element is None:
            safe = io.BytesIO()
            torch.save(obj, safe)  # the vetted value, re-serialised: what the default planner then loads
            safe.seek(0)
            super().load_bytes(read_item, safe)
        elif self.flatten_state_dict:  # the vetted value, put where the default planner puts what it loads
            _set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ---------------------------------------------------------------- reading what the restore's check holds
class _Window(io.RawIOBase):
    """A read-only file of ``size`` bytes whose ``readinto`` has ``fill(dest, pos)`` copy them, for torch's zip reader
    (which reads a ``torch.save`` item's records through ``readinto``): no copy of the whole."""

    def __init__(self, size: int, fill: Any):
        super().__init__()
        self.size, self.fill, self.pos = size, fill, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + pos
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(memoryview(b).nbytes, self.size - self.pos))
        self.fill(memoryview(b).cast("B")[:n], self.pos)
        self.pos += n
        return n


def _blob_file(view: memoryview) -> _Window:
    """The bytes ``view`` as a file."""
    def fill(dest: memoryview, pos: int) -> None:
        dest[:] = view[pos:pos + dest.nbytes]
    return _Window(len(view), fill)


def _held_file(held: CheckedFile, offset: int, length: int) -> _Window:
    """Bytes ``offset`` to ``offset + length`` of the checked file ``held`` as a file, read by ``pread`` as asked."""
    return _Window(length, lambda dest, pos: held.readinto(dest, offset + pos))


class _Layout(pickle.Unpickler):
    """Unpickles a ``torch.save`` pickle of one plain tensor to its layout only, allowing nothing but torch's
    storage types (each read as its dtype) and its tensor rebuild function (returning ``(dtype, key, numel,
    storage offset, size, stride)``); anything else (a parameter, a sparse or quantized tensor, a container) is
    refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if (module, name) == ("collections", "OrderedDict"):  # the tensor's (empty) backward hooks
            return dict
        dtype = _storage_dtypes().get(name) if module == "torch" else None
        if dtype is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return dtype

    def persistent_load(self, pid: Any) -> Any:
        _, dtype, key, _, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        return dtype, str(key), int(numel)


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """torch's storage type names in a ``torch.save`` pickle (``FloatStorage``, ...) -> their dtypes."""
    names = getattr(torch.storage, "_storage_type_to_dtype_map", dict)()
    return {**names, "UntypedStorage": torch.uint8}


def _rebuilt(storage: Any, offset: int, size: Any, stride: Any, _grad: Any = False, _hooks: Any = None,
             metadata: Any = None) -> tuple:
    if metadata:  # a conj or neg bit, which a view of the bytes would leave out: torch.load's rebuild
        raise pickle.UnpicklingError(f"tensor metadata {metadata!r}")
    return (*storage, int(offset), tuple(size), tuple(stride))


def _stored_tensor(blob: memoryview) -> torch.Tensor:
    """The tensor of one DCP item's ``torch.save`` bytes ``blob``: for a plain tensor stored in this machine's byte
    order, a view of ``blob`` itself (its layout from the pickle, :class:`_Layout`, its bytes at the storage
    record's offset: no copy); anything else as ``torch.load`` reads it."""
    found = _layout(_blob_file(blob), len(blob))
    if found is None:
        return torch.load(_blob_file(blob), map_location="cpu", weights_only=True)
    dtype, at, nbytes, offset, size, stride = found
    flat = (torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=at) if nbytes
            else torch.empty(0, dtype=torch.uint8))
    return flat.view(dtype).as_strided(size, stride, offset)


def _layout(file: _Window, total: int) -> tuple | None:
    """``(dtype, record offset, bytes, storage offset, size, stride)`` of the one plain tensor the ``torch.save``
    bytes of ``file`` (``total`` bytes) hold in this machine's byte order, read through torch's zip reader (its
    directory, pickle and byte order: not the tensor's bytes); None otherwise."""
    import sys

    reader = torch._C.PyTorchFileReader(file)
    records = reader.get_all_records()
    prefix = next((r[:-len("data.pkl")] for r in records if r.endswith("data.pkl")), None)
    if prefix is None or (f"{prefix}byteorder" in records
                          and bytes(reader.get_record(f"{prefix}byteorder")).decode() != sys.byteorder):
        return None
    try:
        dtype, key, numel, offset, size, stride = _Layout(io.BytesIO(reader.get_record(f"{prefix}data.pkl"))).load()
    except (pickle.UnpicklingError, TypeError, ValueError, AttributeError, EOFError):
        return None
    name = f"{prefix}data/{key}"
    at = reader.get_record_offset(name) if name in records else -1
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if not (0 <= at and 0 <= nbytes and at + nbytes <= total and _within(numel, offset, size, stride)):
        return None  # not what torch.save writes: torch.load decides
    return dtype, at, nbytes, offset, size, stride


def _within(numel: int, offset: int, size: tuple, stride: tuple) -> bool:
    """Whether a view of ``size`` and ``stride`` at ``offset`` stays inside a storage of ``numel`` elements."""
    if offset < 0 or len(size) != len(stride) or any(n < 0 for n in size) or any(st < 0 for st in stride):
        return False
    return 0 in size or offset + sum((n - 1) * st for n, st in zip(size, stride)) < numel


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The part of a stored chunk ``tensor`` a read item asks for."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _copy_stored(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """``target.copy_(tensor)`` for a stored ``tensor`` at any address: a record lies 64-byte aligned within its item,
    the item anywhere in its file, and torch's typed kernels assume an element's alignment (a complex128 copy from
    an address that is not a multiple of 16 dies of SIGSEGV). Such bytes are copied as bytes (the same dtype), or
    first into aligned memory (another dtype, or a conj or neg view as the target)."""
    if tensor.data_ptr() % tensor.element_size() == 0:
        target.copy_(tensor)
        return
    raw = tensor.unsqueeze(-1).view(torch.uint8)  # each element's bytes along a last dimension: no typed read
    if target.dtype == tensor.dtype and not (target.is_conj() or target.is_neg()):
        target.unsqueeze(-1).view(torch.uint8).copy_(raw)
    else:
        target.copy_(raw.clone(memory_format=torch.contiguous_format).view(tensor.dtype).squeeze(-1))


def _load_item(req: Any, blob: memoryview, planner: Any, where: Path) -> None:
    """One read item of ``dcp.load``'s plan from its stored bytes ``blob`` in the data file ``where``, as DCP's file
    reader loads it."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(blob))
        return
    tensor = _narrow(_stored_tensor(blob), req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CheckpointError(f"{where}: item {req.storage_index.fqn}: stored as {tuple(tensor.size())}, the app's "
                              f"is {tuple(target.size())}")
    _copy_stored(target, tensor)
    planner.commit_tensor(req, target)


def _load_held(req: Any, held: CheckedFile, offset: int, length: int, planner: Any, where: Path) -> None:
    """One read item of ``dcp.load``'s plan from bytes ``offset`` to ``offset + length`` of the checked data file
    ``held`` (``where``): a plain tensor read by ``pread`` straight into the app's tensor where their layouts agree
    (the one copy), anything else read into memory first and loaded as :func:`_load_item`. A file cut short
    meanwhile is a CheckpointError naming it, the offset and the size (never a SIGBUS: nothing is mapped)."""
    try:
        if req.type == LoadItemType.BYTE_IO or not _read_in_place(req, held, offset, length, planner):
            _load_item(req, memoryview(held.read(offset, length)), planner, where)
    except ShortRead as err:
        raise CheckpointError(f"{where}: unreadable: {err.strerror}") from None


def _read_in_place(req: Any, held: CheckedFile, offset: int, length: int, planner: Any) -> bool:
    """Whether the item was a plain tensor stored as the app's tensor lies (dtype, shape, contiguous, whole) and was
    read by ``pread`` into it and committed; False leaves the app's tensor as it was."""
    try:
        found = _layout(_held_file(held, offset, length), length)
    except Exception:  # noqa: BLE001 - torch's zip reader over a file cut short (its own error, not ours): the read
        return False  # of the whole item that follows names it
    if found is None:
        return False
    dtype, at, _, start, size, stride = found
    target = planner.resolve_tensor(req).detach()
    lies = torch.empty_strided(size, stride, device="meta").is_contiguous() if size else True
    if not (lies and target.device.type == "cpu" and target.dtype == dtype and tuple(target.size()) == size
            and target.is_contiguous() and not (target.is_conj() or target.is_neg())
            and not any(req.storage_offsets) and tuple(req.lengths) == size):
        return False
    if target.numel():
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        held.readinto(view, offset + at + start * target.element_size())
    planner.commit_tensor(req, target)
    return True


class _HeldReader(FileSystemReader):
    """DCP's file reader, given what the restore has already read and checked: DCP's metadata (unpickled by the
    allow-list, :func:`check_metadata`: DCP does not read the file again), and ``held``, the data files this rank
    checked in memory (path relative to the checkpoint -> bytes), whose items it loads from there; the others
    from their files, as DCP does."""

    def __init__(self, path: Path, metadata: Any, held: Mapping[str, Any]):
        super().__init__(str(path))
        self.where, self.metadata, self.held = Path(path), metadata, held

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None or self.metadata is None:
            return super().read_metadata(*args, **kwargs)
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Each data file's items: through the check's file where held, else as DCP reads them; an item whose pickle
        ``torch.load(weights_only=True)`` refuses is a CheckpointError naming its file."""
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            try:
                self._read_file(rel, reqs, plan, planner)
            except pickle.UnpicklingError as err:
                traceback.clear_frames(err.__traceback__)  # views of the items' bytes: not kept by the error
                refused = rel
                break
            except BaseException as err:
                traceback.clear_frames(err.__traceback__)
                raise
        else:
            return super().read_data(dataclasses.replace(plan, items=[]), planner)
        raise CheckpointError(f"{self.where / refused}: refused to load an item: not a plain tensor "
                              "(torch.load weights_only)")

    def _read_file(self, rel: str, reqs: list[Any], plan: Any, planner: Any) -> None:
        data = self.held.get(rel)
        rest = []
        try:
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if data is None or getattr(info, "transform_descriptors", None):
                    rest.append(req)
                else:
                    _load_held(req, data, info.offset, info.length, planner, self.where / rel)
        finally:
            if data is not None:
                data.close()
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner)


def _unwrap(err: BaseException, path: Path, rank: int | None = None) -> CheckpointError:
    """One CheckpointError for what ``dcp.load``/``dcp.save`` raised (which wraps every rank's failure): rank
    ``rank``'s failure when given, else the first one."""
    if isinstance(err, CheckpointException):
        failures = {rank: err.failures[rank]} if rank in err.failures else err.failures
        for exc, _trace in failures.values():
            if isinstance(exc, CheckpointError):
                return exc
        for exc, _trace in failures.values():
            return CheckpointError(f"{path}: {first_line(exc)}")
    return CheckpointError(f"{path}: {first_line(err)}")


_LOW_SPACE = 64 << 20
"""Below this many free bytes, a failed write's message says how much space is left."""


def _with_free_space(err: CheckpointError, path: Path) -> CheckpointError:
    """``err`` saying how much space the file system holding ``path`` has left when that is little: a DCP failure
    that no file's failed write explains (:class:`_HashedStream` notes those), where a full disk may still be the
    cause (torch's zip-writer error ``unexpected pos`` carries no errno)."""
    try:
        free = shutil.disk_usage(path if Path(path).exists() else Path(path).parent).free
    except OSError:
        return err
    if free >= _LOW_SPACE or "No space left" in str(err):
        return err
    return CheckpointError(f"{err} (the file system holding {path} has {human_bytes(free)} free: full?)")


# ---------------------------------------------------------------- a written checkpoint
class DcpCheckpoint(SavedCheckpoint):
    """A DCP step directory opened for reading (see :class:`~fastio.checkpoint.engines.base.SavedCheckpoint`)."""

    def __init__(self, path: Path, pg: Any = None, held: Mapping[str, Any] | None = None):
        self.path, self.pg, self.held = Path(path), pg, dict(held or {})
        self._metadata: Any = None
        side = self.path / SIDECAR
        try:
            info = json.loads(side.read_text())
            if info.get("format") != SIDECAR_FORMAT or info.get("version") != SIDECAR_VERSION:
                raise ValueError(f"format {info.get('format')!r} version {info.get('version')!r}")
            self.world_size = int(info["world_size"])
            self.global_keys = set(info["global_keys"])
            self.rank_keys = set(info["rank_keys"])
        except FileNotFoundError:
            raise CheckpointError(f"{side}: missing (the DCP engine's record of the checkpoint)") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{side}: unreadable: {first_line(err)}") from None

    def metadata(self) -> Any:
        """DCP's metadata, unpickled by the allow-list (:func:`check_metadata`), once."""
        if self._metadata is None:
            self._metadata = check_metadata(self.path)
        return self._metadata

    def keys(self, rank: int) -> set[str]:
        return self.global_keys | (self.rank_keys if 0 <= rank < self.world_size else set())

    def is_replicated(self, key: str, rank: int) -> bool:
        return key in self.global_keys

    def restore(self, targets: dict[str, Stateful], *, strict: bool = True, cast: bool = False) -> list[str]:
        """Collective: global keys through one ``dcp.load`` into this run's own layout (resharding as
        needed), then this rank's per-rank keys."""
        rank, _ = _rank()
        skipped: list[str] = []
        shared = [k for k in targets if k in self.global_keys]
        # Before dcp.load's collectives: every rank has the same global keys and can read the metadata, or every
        # rank raises.
        template = _agreed(self.pg, lambda: (self.metadata() if shared else None,
                                             {k: targets[k].state_dict() for k in shared})[1],
                           sorted(shared), f"global (DCP) keys in {self.path / SIDECAR}")
        if shared:
            try:
                dcp.load(template, storage_reader=_HeldReader(self.path, self.metadata(), self.held),
                         planner=_SafeLoadPlanner(self.path, strict=strict, skipped=skipped, cast=cast),
                         process_group=self.pg,
                         no_dist=_rank()[1] == 1)
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
                raise _unwrap(err, self.path) from None
            finally:
                self.held.clear()  # the checked files go with the load, whatever an error keeps of the reader
            for k in shared:
                targets[k].load_state_dict(template[k])
        for k in targets:
            if k not in self.global_keys:
                targets[k].load_state_dict(self.read(k, rank))
        return skipped

    def shapes(self, key: str, rank: int) -> dict[str, tuple[int, ...] | None]:
        """A per-rank key's state keys and tensor shapes (its file mapped, no tensor read); a global key's from
        DCP's metadata (named inside the key as the load planner names them)."""
        if key in self.global_keys:
            meta = self.metadata()
            paths = meta.planner_data or {}
            return {fqn[len(key) + 1:]: tuple(m.size) if getattr(m, "size", None) is not None else None
                    for fqn, m in meta.state_dict_metadata.items() if _top(fqn, paths) == key}
        state = self.read(key, rank, mmap=True)
        return {str(k): shape_of(v) for k, v in state.items()} if isinstance(state, dict) else {}

    def dtypes(self, key: str, rank: int) -> dict[str, str]:
        """The dtype (its name) of each tensor of a key's state, as :meth:`shapes` names them."""
        if key in self.global_keys:
            meta = self.metadata()
            paths = meta.planner_data or {}
            return {fqn[len(key) + 1:]: str(m.properties.dtype) for fqn, m in meta.state_dict_metadata.items()
                    if _top(fqn, paths) == key and hasattr(m, "properties")}
        state = self.read(key, rank, mmap=True)
        return ({str(k): str(v.dtype) for k, v in state.items() if shape_of(v) is not None}
                if isinstance(state, dict) else {})

    def param_groups(self, key: str, rank: int) -> list[int] | None:
        """A per-rank optimizer's parameters per group (its file mapped, no tensor read); None for a global key
        (an optimizer of an app module: its state is keyed by parameter name, checked by the load planner)."""
        if key in self.global_keys:
            return None
        state = self.read(key, rank, mmap=True)
        return group_sizes(state.get("param_groups")) if isinstance(state, dict) else None

    def group_settings(self, key: str, rank: int) -> list[set[str]] | None:
        """A per-rank optimizer's groups' setting names (its file mapped, no tensor read); None for a global key."""
        if self.param_groups(key, rank) is None:
            return None
        return [set(map(str, g)) - {"params"} for g in self.read(key, rank, mmap=True)["param_groups"]]

    def state_shapes(self, key: str, rank: int) -> dict[tuple[int, str], tuple[int, ...]]:
        """A per-rank optimizer's state shapes (its file mapped, no tensor read); empty for a global key."""
        if key in self.global_keys:
            return {}
        state = self.read(key, rank, mmap=True)
        per_param = state.get("state") if isinstance(state, dict) else None
        if not isinstance(per_param, dict):
            return {}
        return {(int(i), str(name)): shape for i, st in per_param.items() if isinstance(i, int) and isinstance(st, dict)
                for name, v in st.items() if (shape := shape_of(v)) is not None}

    def read(self, key: str, rank: int, *, mmap: bool = False) -> Any:
        """See :meth:`SavedCheckpoint.read`; ``mmap``: the file mapped, its tensors read only when touched (for the
        checks of shapes and groups, which touch none: a file truncated meanwhile cannot be a SIGBUS there)."""
        if key in self.global_keys:
            raise CheckpointError(f"{self.path}: app key {key} is global (DCP) state: restore it, it is not per rank")
        file = _rank_file(self.path, rank, key)
        if key not in self.rank_keys or not file.is_file():
            raise CheckpointError(f"{self.path}: checkpoint has no state for app key {key} on saving rank {rank}")
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError:
            raise CheckpointError(f"{file}: refused to load: not plain tensors and containers "
                                  "(torch.load weights_only)") from None
        except Exception as err:  # noqa: BLE001 - a truncated or damaged file, named here
            raise CheckpointError(f"{file}: unreadable: {first_line(err)}") from None


# ---------------------------------------------------------------- the engine
def _write_error(path: Path, err: OSError) -> CheckpointError:
    """A file of the step that could not be written (a full disk, a file-size limit), named."""
    return CheckpointError(f"{path}: {os_error_text(err)}")


class _HashedStream:
    """A file DCP writes through: hashes (xxh3-128) and counts every byte on its way to the file, and records
    ``{"bytes", "xxh3_128"}`` under its path in ``records`` when closed, having started its writeback to the disk
    (with ``writeback``: :func:`~fastio.storage.atomic.start_writeback`). A write or close that fails is noted in
    ``fs.failed`` (this file and the OS's error): DCP's writer loses both (a full disk reaches it as torch's
    zip-writer error ``unexpected pos``, or as an ``OSError`` naming no file)."""

    def __init__(self, f: Any, path: Path, fs: _HashingFileSystem):
        from fastio.storage.checksum import DIGESTS

        self.f, self.path, self.fs = f, path, fs
        self.hash, self.size = DIGESTS[WRITE_CHECKSUM](), 0

    def write(self, data: Any) -> int:
        self.hash.update(data)
        self.size += memoryview(data).nbytes
        try:
            return self.f.write(data)
        except OSError as err:
            self.fs.note_failure(self.path, err)
            raise

    def close(self) -> None:
        if self.f.closed:
            return
        try:
            if self.fs.writeback:  # on its way to the disk now, not all at once in the commit's fsyncs
                self.f.flush()
                start_writeback(self.f.fileno())
            self.f.close()
        except OSError as err:
            self.fs.note_failure(self.path, err)
            with suppress(OSError):  # after a failed flush: closes the file all the same, failing again
                self.f.close()
            raise
        self.fs.records[self.path] = written_record(None, self.size, self.hash.hexdigest())

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, closed, ...: the file's
        return getattr(self.f, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording each file it writes (:class:`_HashedStream`) under its final name (its
    metadata is written to a temporary and renamed)."""

    def __init__(self, writeback: bool) -> None:
        super().__init__()
        self.records: dict[Path, dict[str, Any]] = {}
        self.writeback = writeback
        self.failed: CheckpointError | None = None

    def note_failure(self, path: Path, err: OSError) -> None:
        """The first file whose write failed, and why (:func:`_write_error`), for :meth:`DcpEngine.save` to raise."""
        if self.failed is None:
            self.failed = _write_error(path, err)

    @contextmanager
    def create_stream(self, path: str | PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _HashedStream(open(path, mode), Path(path), self)  # noqa: SIM115 - closed below
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path: str | PathLike, new_path: str | PathLike) -> None:
        super().rename(path, new_path)
        if Path(path) in self.records:
            self.records[Path(new_path)] = self.records.pop(Path(path))


def _save_rank_files(path: Path, rank: int, per_rank: dict[str, Any], written: dict[Path, dict[str, Any]]) -> None:
    """This rank's per-rank state, one ``torch.save`` file per app key (small: serialised in memory, so a disk error
    reads as one), each recorded in ``written``."""
    if per_rank:
        _rank_file(path, rank, "x").parent.mkdir(parents=True, exist_ok=True)
    for key, state in per_rank.items():
        buf = io.BytesIO()
        torch.save(state, buf)
        file = _rank_file(path, rank, key)
        try:
            file.write_bytes(buf.getbuffer())
        except OSError as err:
            raise _write_error(file, err) from err
        written[file] = written_record(buf.getbuffer())


def _dcp_save(path: Path, shared: dict[str, Any], pg: Any, world: int, fs: _HashingFileSystem) -> None:
    """Collective ``dcp.save`` of the global state into ``path`` through ``fs`` (which records the files this rank
    wrote)."""
    # sync_files off: the commit fsyncs every file anyway
    writer = FileSystemWriter(str(path), sync_files=False)
    writer.fs = fs
    dcp.save(shared, storage_writer=writer, process_group=pg, no_dist=world == 1)


def _no_owner(key: str, ids: set[int], app: dict[str, Any]) -> str:
    """Why the optimizer of app key ``key`` (over the parameters ``ids``, DTensors among them) cannot be saved: no
    app module holds all its parameters, either none holds any or they span several app keys."""
    spans = [k for k, m in app.items() if isinstance(m, nn.Module) and ids & {id(p) for p in m.parameters()}]
    if len(spans) < 2:
        return (f"app key {key}: an optimizer over DTensor parameters needs its module in the app (DCP names "
                "optimizer state by parameter name)")
    return (f"app key {key}: its parameters span the app modules {', '.join(spans)}, and DCP names optimizer state "
            "by parameter name within one module: put them under one app key (an nn.ModuleDict) or give each "
            "module its own optimizer")


class DcpEngine:
    """Writes and reads checkpoints with ``torch.distributed.checkpoint`` (see
    :class:`~fastio.checkpoint.engines.base.Engine`)."""

    name = "dcp"

    def prepare(self, app: dict[str, Any]) -> tuple[dict[str, Stateful], frozenset[str]]:
        """Modules and their optimizers as global DCP state (see the module docstring); the rest as is."""
        modules = [m for m in app.values() if isinstance(m, nn.Module)]
        out: dict[str, Stateful] = {}
        shared = set()
        for key, obj in app.items():
            if isinstance(obj, nn.Module):
                out[key], _ = ModuleState(obj), shared.add(key)
            elif isinstance(obj, torch.optim.Optimizer):
                ids = {id(p) for g in obj.param_groups for p in g["params"]}
                owner = next((m for m in modules if ids <= {id(p) for p in m.parameters()}), None)
                if owner is not None and isinstance(obj, torch.optim.LBFGS):  # DCP would fail, or write no restore
                    raise CheckpointError(f"app key {key}: LBFGS keeps state for its first parameter only, and DCP "
                                          "needs it per parameter name: save with engine='torchsnapshot'")
                if owner is not None:
                    out[key], _ = OptimizerState(owner, obj), shared.add(key)
                elif _has_dtensor(p for g in obj.param_groups for p in g["params"]):
                    raise CheckpointError(_no_owner(key, ids, app))
                else:
                    out[key] = obj
            else:
                out[key] = obj
        return out, frozenset(shared)

    def refusal(self, tensor: Any) -> str | None:
        """None: DCP writes every dtype and layout a plain tensor has (non-strided ones pickled)."""
        return None

    def placements(self) -> None:
        """None: DCP writes through the page cache (its ``torch.save`` would clone a placed buffer, a view)."""
        return None

    def placeable(self, tensor: Any) -> bool:
        """False: nothing is placed (:meth:`placements`)."""
        return False

    def save(self, path: Path, states: dict[str, dict[str, Any]], *, pg: Any = None,
             replicated: Sequence[str] = (), global_keys: Sequence[str] = (),
             writeback: bool = True, direct: bool = False) -> dict[str, dict[str, Any]]:
        """Per-rank files, then one collective ``dcp.save`` of the global state, then (rank 0) the sidecar; the
        files this rank wrote, each with its size and xxh3-128 taken from the bytes written (DCP's through
        :class:`_HashingFileSystem`). ``replicated`` is not used: global state is written once by DCP's own
        deduplication. ``direct`` is not used either: DCP writes each tensor through ``torch.save`` in pieces of
        ~57 KiB, through the page cache.

        Only this rank's own failure raises here, and only after the collective (the other ranks are in it):
        another rank's failure, which DCP reports on every rank, is left to the caller's agreement, which
        names that rank."""
        rank, world = _rank()
        path = Path(path)
        shared = {k: v for k, v in states.items() if k in global_keys}
        per_rank = {k: v for k, v in states.items() if k not in global_keys}
        written: dict[Path, dict[str, Any]] = {}
        mine: Exception | None = None
        try:
            _save_rank_files(path, rank, per_rank, written)
        except Exception as err:  # noqa: BLE001 - raised after the collective below, which every rank must reach
            mine = err
        if shared:
            fs = _HashingFileSystem(writeback)
            try:
                _dcp_save(path, shared, pg, world, fs)
            except CheckpointException as err:  # a BaseException: make it an ordinary, one-line error
                me = rank if pg is None else dist.get_rank(group=pg)
                if mine is None and (world == 1 or me in err.failures):
                    raise fs.failed or _with_free_space(_unwrap(err, path, me), path) from None
            written.update(fs.records)
        elif pg is not None:
            dist.barrier(group=pg)
        if mine is not None:
            raise mine
        if rank == 0:
            sidecar = json.dumps({"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "world_size": world,
                                  "global_keys": sorted(shared), "rank_keys": sorted(per_rank)}).encode()
            (path / SIDECAR).write_bytes(sidecar)
            written[path / SIDECAR] = written_record(sidecar)
        return {p.relative_to(path).as_posix(): rec for p, rec in written.items()}

    def reads(self, files: Sequence[str], saved_world: int, world: int) -> dict[str, int]:
        """At the world size it was saved at, rank R reads its own shards from the data files it wrote,
        ``__R_N.distcp`` (state stored once for every rank, unsharded, is read by each rank, from rank 0's file:
        from disk, not foreseen); at another, resharded, nothing is foreseen."""
        if not saved_world or saved_world != world:
            return {}
        return {f: int(m.group(1)) for f in files if (m := _DATA_FILE.fullmatch(f))}

    def open(self, path: Path, *, pg: Any = None, held: Mapping[str, Any] | None = None) -> DcpCheckpoint:
        return DcpCheckpoint(path, pg, held)
