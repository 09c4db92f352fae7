"""The torchsnapshot engine: the only module that imports ``torchsnapshot`` (pinned to 0.1.0).

torchsnapshot 0.1.0 is unmaintained, and this adapter leans on parts of it that are not public API:
the ``Snapshot._metadata`` cache (swapped for a one-key view on restore), its batching (``batch_write_requests`` as
``torchsnapshot.snapshot`` calls it, replaced while writing by :func:`_gather_writes`; ``is_batchable``; the slab
read's ``BatchedBufferConsumer.consume_buffer``, replaced: see :func:`_consume_slab`; ``batch_read_requests`` and
``get_process_memory_budget_bytes`` as ``torchsnapshot.snapshot`` calls them, replaced: see :func:`_batch_reads`,
:func:`_memory_budget`), manifest entry types and
paths (``RANK/key/sub/path``, replicated entries listed under rank 0), its escaping of keys in those
paths (``flatten._encode``), its inverse of flattening (``flatten.inflate``), its logger's name, the
``knobs`` environment switch for batching, the write concurrency globals of ``scheduler``, its bfloat16 byte view
(``serialization._tensor_as_memoryview_via_untyped_storage``, replaced while writing: see :func:`_storage_bytes`),
its byte view of a tensor and its inverse as ``io_preparers.tensor`` calls them (wrapped for tensors with no
elements: see :func:`_empty_as_bytes`), its read of a tensor entry (``TensorIOPreparer.prepare_read``, wrapped for a
quantized tensor the app has no tensor for: see :func:`_read_quantized`), and the steps of ``Snapshot.take``
(:func:`_take` runs them with a storage plugin of its own, see there). Those internals are the contract, hence the
exact pin in ``pyproject.toml``; a new torchsnapshot release means re-checking this module, and nothing else.

Files in a step directory: ``.snapshot_metadata`` (YAML manifest, written last by rank 0), then
``RANK/...`` for per-rank state and ``replicated/...`` for state written once; in each, the tensors below
:data:`SLAB_BYTES` share slab files ``_fastio_slabs/NAME`` (:data:`SLAB_DIR`, :func:`_gather_writes`; torchsnapshot's
batching, not its copy).

A restore reads a rank's own files through the check: the Checkpointer's check hashes the files
:meth:`TorchSnapshotEngine.reads` foresees for a rank (:func:`fastio.storage.checksum.open_hashed`) and, once every
rank has agreed that every file of the step is intact, torchsnapshot's reads of those files are served by ``pread``
through the check's :class:`~fastio.storage.checksum.CheckedFile` (:class:`_HeldReads`: never a mapping of the file,
whose truncation by another process would be a SIGBUS; a file cut short, or replaced, since the check is named).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import mmap
import os
import pickle
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchsnapshot import Snapshot
from torchsnapshot import batcher as _batcher
from torchsnapshot import scheduler as _scheduler
from torchsnapshot import serialization as _serialization
from torchsnapshot import snapshot as _snapshot
from torchsnapshot.flatten import _decode, _encode, inflate
from torchsnapshot.io_preparers import tensor as _tensor_io
from torchsnapshot.io_types import BufferStager, Future, ReadIO, ReadReq, WriteIO, WriteReq
from torchsnapshot.knobs import _DISABLE_BATCHING_ENV_VAR
from torchsnapshot.manifest import (
    ChunkedTensorEntry,
    ObjectEntry,
    PrimitiveEntry,
    ShardedTensorEntry,
    TensorEntry,
    is_container_entry,
    is_replicated,
)
from torchsnapshot.pg_wrapper import PGWrapper
from torchsnapshot.serialization import Serializer
from torchsnapshot.storage_plugins.fs import FSStoragePlugin

from fastio.checkpoint.engines.base import (
    RESERVED_PREFIX,
    WRITE_CHECKSUM,
    SavedCheckpoint,
    Stateful,
    first_line,
    written_record,
)
from fastio.checkpoint.engines.strict import (
    CheckedModule,
    Mismatch,
    module_shapes,
    other_dtypes,
    quantized_dtype,
    quantized_keys,
)
from fastio.checkpoint.staging import Frozen
from fastio.errors import CheckpointError
from fastio.storage.atomic import start_writeback
from fastio.storage.checksum import DIGESTS
from fastio.storage.direct import DirectFile, open_direct
from fastio.words import count

__all__ = ["TorchSnapshotEngine", "TorchSnapshotCheckpoint"]

_LOGGER = "torchsnapshot.snapshot"


# ---------------------------------------------------------------- write settings (process-wide)
WRITE_STREAMS = 1
"""Files torchsnapshot writes at once during a save (its default is 16, through 6 executor threads): one
stream keeps the writer on one core, so a training thread beside it keeps its own (see the checkpoint
section of docs/performance.md: with 16, the training thread kept 26-38% of its CPU share during a write,
with one 74-92%). Restores keep torchsnapshot's defaults (one that overlaps a save in the same process reads with one
stream too: the settings are process-wide)."""

SLAB_BYTES = 128 << 20
"""Host tensors below this size are written into shared slab files of at most this size (torchsnapshot's own
batching threshold, without its copy: :func:`_gather_writes`); larger ones, and every tensor when it is 0, one file
each. 528 MiB of model and Adam state: 5 files instead of 97 (see the checkpoint section of docs/performance.md)."""

SLAB_DIR = f"{RESERVED_PREFIX}_slabs"
"""The directory of a rank's (or the replicated state's) slab files, ``R/_fastio_slabs/NAME``: torchsnapshot names
every file of an app key ``KEY`` ``R/KEY`` or ``R/KEY/...`` (``replicated/`` for replicated state, the key escaped
by ``flatten._encode``, which leaves a leading ``_fastio`` as it is), and the Checkpointer refuses app keys starting
with :data:`~fastio.checkpoint.engines.base.RESERVED_PREFIX`, so no state's file can be a slab's or its directory.
Steps written before name it ``batched`` (``R/batched/NAME``, torchsnapshot's own name): an app key ``batched`` whose
state was one tensor made ``R/batched`` a file (every save failed), one holding a tensor under a slab's name wrote
the same file as that slab. Those steps read as before: the manifest gives each tensor's file."""

_settings_lock = threading.Lock()
_settings_users = 0
_settings_previous: tuple[Any, ...] | None = None


def _storage_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous tensor (torchsnapshot's view of a bfloat16 tensor, which numpy cannot hold), all of
    them: torchsnapshot 0.1.0's own views the storage as float32, dropping the last 2 bytes of a bfloat16 tensor with
    an odd number of elements (its file then one element short, and the restore refused)."""
    import torch

    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(_serialization.contiguous_view_as_untyped_storage(tensor))
    return memoryview(whole.numpy()).cast("b")


@contextmanager
def _write_settings() -> Iterator[None]:
    """For the duration of a write: torchsnapshot's batching on, as :func:`_gather_writes` (an environment switch it
    reads on every take, and the name ``torchsnapshot.snapshot`` calls), its write concurrency at
    :data:`WRITE_STREAMS` (two module globals of ``torchsnapshot.scheduler`` it reads when it schedules) and its
    bfloat16 bytes whole (:func:`_storage_bytes`); the previous values come back afterwards, also when the write
    raises.

    Counted, so that writes of several Checkpointers in one process overlapping in any order leave
    the settings as they were before the first of them.
    """
    global _settings_users, _settings_previous
    with _settings_lock:
        if _settings_users == 0:
            _settings_previous = (os.environ.get(_DISABLE_BATCHING_ENV_VAR), _scheduler._MAX_PER_RANK_IO_CONCURRENCY,
                                  _scheduler._MAX_PER_RANK_CPU_CONCURRENCY,
                                  _serialization._tensor_as_memoryview_via_untyped_storage,
                                  _snapshot.batch_write_requests)
            os.environ[_DISABLE_BATCHING_ENV_VAR] = "False"
            _snapshot.batch_write_requests = _gather_writes
            _serialization._tensor_as_memoryview_via_untyped_storage = _storage_bytes
            _scheduler._MAX_PER_RANK_IO_CONCURRENCY = WRITE_STREAMS
            _scheduler._MAX_PER_RANK_CPU_CONCURRENCY = WRITE_STREAMS
        _settings_users += 1
    try:
        yield
    finally:
        with _settings_lock:
            _settings_users -= 1
            if _settings_users == 0:
                batching, io, cpu, as_bytes, batch = _settings_previous
                _serialization._tensor_as_memoryview_via_untyped_storage = as_bytes
                _snapshot.batch_write_requests = batch
                if batching is None:
                    os.environ.pop(_DISABLE_BATCHING_ENV_VAR, None)
                else:
                    os.environ[_DISABLE_BATCHING_ENV_VAR] = batching
                _scheduler._MAX_PER_RANK_IO_CONCURRENCY, _scheduler._MAX_PER_RANK_CPU_CONCURRENCY = io, cpu


# ---------------------------------------------------------------- slabs: small tensors in one file, never copied
class _Pieces:
    """A slab's bytes as the staged tensors' own byte views, in file order: what a slab's write request stages
    (:class:`_GatheredStager`) and :class:`_LaterErrors` writes, one view after the other, into one file.
    ``len()`` is the number of bytes (what torchsnapshot's scheduler asks of a staged buffer)."""

    def __init__(self, views: list[memoryview]):
        self.views = views
        self.nbytes = sum(view.nbytes for view in views)

    def __len__(self) -> int:
        return self.nbytes


class _GatheredStager(BufferStager):
    """torchsnapshot's slab of small tensors (``batcher.BatchedBufferStager``) without its copy: the tensors'
    stagers give views of the staged tensors, which the file is written from; no slab is allocated or filled."""

    def __init__(self, parts: list[tuple[int, BufferStager]]):
        self.parts = parts  # (size, stager), in file order

    async def stage_buffer(self, executor: Any = None) -> _Pieces:
        views = []
        for size, stager in self.parts:
            view = memoryview(await stager.stage_buffer(executor))
            if view.nbytes != size:
                raise AssertionError(f"a slab's tensor staged {count(view.nbytes, 'byte')}, not {size}")
            views.append(view)
        return _Pieces(views)

    def get_staging_cost_bytes(self) -> int:
        return sum(stager.get_staging_cost_bytes() for _, stager in self.parts)


def _tensor_entries(entries: list[Any]) -> dict[str, Any]:
    """Location -> tensor entry, also those inside chunked and sharded entries."""
    out: dict[str, Any] = {}
    for entry in entries:
        if isinstance(entry, TensorEntry):
            out[entry.location] = entry
        elif isinstance(entry, ChunkedTensorEntry):
            out.update((chunk.tensor.location, chunk.tensor) for chunk in entry.chunks)
        elif isinstance(entry, ShardedTensorEntry):
            out.update((shard.tensor.location, shard.tensor) for shard in entry.shards)
    return out


def _slab_name(paths: list[str]) -> str:
    """A slab file's name: the first 16 hex digits of the xxh3-128 of its tensors' paths, one per line."""
    digest = DIGESTS[WRITE_CHECKSUM]()
    digest.update("\n".join(paths).encode())
    return digest.hexdigest()[:16]


def _gather_writes(entries: list[Any], write_reqs: list[WriteReq]) -> tuple[list[Any], list[WriteReq]]:
    """torchsnapshot's ``batch_write_requests`` as fastio writes: each host tensor below :data:`SLAB_BYTES` goes into a
    slab file with others of its directory (``R/`` of rank R, or ``replicated/``), at ``DIR/_fastio_slabs/NAME``
    (:data:`SLAB_DIR`: no app key's file or directory) with its byte range in the manifest, as torchsnapshot's own
    batching writes them, but written from the staged tensors themselves (:class:`_GatheredStager`): 528 MiB of model
    and Adam state is 5 files instead of 97. ``NAME`` comes from the slab's tensor paths (:func:`_slab_name`;
    torchsnapshot's is random): the same state gives the same files, and the replicated slabs of different ranks
    different ones. Each entry is relocated in place; the other write requests are kept as they are."""
    slabs: dict[str, list[list[tuple[WriteReq, int]]]] = {}  # directory -> its slabs: (request, size) in file order
    filled: dict[str, int] = {}  # directory -> bytes in its last slab
    kept: list[WriteReq] = []
    for req in write_reqs:
        tensor = getattr(req.buffer_stager, "tensor", None)
        size = 0 if tensor is None else tensor.nelement() * tensor.element_size()
        if tensor is None or tensor.is_cuda or not _batcher.is_batchable(req.buffer_stager) or not 0 < size < SLAB_BYTES:
            kept.append(req)
            continue
        top = req.path.split("/", 1)[0]
        group = slabs.setdefault(top, [[]])
        if filled.get(top, 0) + size > SLAB_BYTES:
            group.append([])
            filled[top] = 0
        group[-1].append((req, size))
        filled[top] = filled.get(top, 0) + size
    located = _tensor_entries(entries)
    for top, members in ((top, slab) for top, group in slabs.items() for slab in group):
        location = f"{top}/{SLAB_DIR}/{_slab_name([req.path for req, _ in members])}"
        start = 0
        for req, size in members:
            located[req.path].location, located[req.path].byte_range = location, [start, start + size]
            start += size
        kept.append(WriteReq(path=location, buffer_stager=_GatheredStager([(n, r.buffer_stager) for r, n in members])))
    return entries, kept


_as_bytes, _from_bytes = _tensor_io.tensor_as_memoryview, _tensor_io.tensor_from_memoryview


def _empty_as_bytes(tensor: Any) -> memoryview:
    """torchsnapshot's byte view of a tensor, also of one with no elements (its own raises for those: ``cannot cast
    view with zeros in shape``, failing every save of a state holding one)."""
    return memoryview(b"") if tensor.numel() == 0 else _as_bytes(tensor)


def _empty_from_bytes(mv: memoryview, dtype: Any, shape: list[int]) -> Any:
    """torchsnapshot's tensor viewing a file's bytes, also for a tensor with no elements (an empty file, which
    ``torch.frombuffer`` refuses)."""
    import torch

    if len(mv) == 0 and 0 in shape:
        return torch.empty(shape, dtype=dtype)
    return _from_bytes(mv, dtype, shape)


_prepare_read = _tensor_io.TensorIOPreparer.prepare_read


class _StoredQuantized(_tensor_io.TensorBufferConsumer):
    """Reads a quantized tensor's ``torch.save`` bytes into a future as the tensor they hold."""

    def __init__(self, entry: Any, future: Future):
        super().__init__(tensor=None, entry=entry)
        self.future = future

    async def consume_buffer(self, buf: bytes, executor: Any = None) -> None:
        self.future.obj = self.deserialize_tensor(buf=buf, entry=self.entry)


def _read_quantized(cls: Any, entry: Any, tensor_out: Any = None, buffer_size_limit_bytes: int | None = None) -> Any:
    """torchsnapshot's read of a tensor entry; a quantized one the app has no quantized tensor of that dtype and
    shape for is read as the tensor stored (torchsnapshot 0.1.0 made an empty quantized tensor to copy it into, which
    has no quantizer: ``cannot call qscheme on UnknownQuantizer``)."""
    if entry.serializer != Serializer.TORCH_SAVE.value or not quantized_dtype(entry.dtype) \
            or cls.can_load_inplace(entry=entry, obj=tensor_out):
        return _prepare_read.__func__(cls, entry, tensor_out, buffer_size_limit_bytes)
    future: Future = Future()
    read = ReadReq(path=entry.location, byte_range=entry.byte_range_tuple,
                   buffer_consumer=_StoredQuantized(entry, future))
    return [read], future


async def _consume_slab(self: Any, buf: Any, executor: Any = None) -> None:
    """torchsnapshot's read of a slab's byte range (``batcher.BatchedBufferConsumer.consume_buffer``): each tensor
    from its part of the buffer, raising the first error. 0.1.0's own awaited them with ``asyncio.wait``, which leaves
    the errors in the tasks: a tensor that could not be read was left as it was, without a word. A buffer shorter
    than the parts is refused."""
    parts = self.byte_range_to_buffer_consumer
    end = max((hi for _, hi in parts), default=0)
    if len(buf) < end:
        raise ValueError(f"{count(len(buf), 'byte')} read where the slab's tensors need {end}")
    await asyncio.gather(*(consumer.consume_buffer(buf[lo:hi], executor=executor)
                           for (lo, hi), consumer in parts.items()))


_READ_BYTES = 16 << 20
"""A restore reads a slab in pieces of at most this many bytes (:func:`_batch_reads`; a tensor larger than that is
one piece by itself), so that reading and copying into the app's tensors overlap within :data:`_READ_BUDGET`."""

_READ_BUDGET = 64 << 20
"""torchsnapshot's memory budget for a restore's reads (:func:`_memory_budget`; its own is a share of the host's
available memory): how far a restore reads ahead of its copies into the app's tensors, as torchsnapshot counts it (a
read's buffer plus its tensors, which a restore into the app's own tensors does not allocate: about half of it is read
buffers). A read is started when none is in flight, however large. 64 MiB rather than the 256 of the release before:
each read buffer is fresh memory the kernel faults in, and fewer of them in flight are reused more (528 MiB of model
and Adam state, alternating restores: 0.24 s against 0.31 s from the page cache, 0.44 s against 0.51 s after dropping
it, 17 % less CPU; see the checkpoint section of docs/performance.md)."""

_restoring = threading.local()  # .active: this thread is in :func:`_restore`


def _memory_budget(pg: Any) -> int:
    """torchsnapshot's ``get_process_memory_budget_bytes`` (``torchsnapshot.snapshot`` asks it on every take and
    restore), at most :data:`_READ_BUDGET` in a thread in :func:`_restore`: 0.1.0 read a small-tensor state's slabs
    far ahead of their copies, holding all of the state once more."""
    budget = _process_budget(pg=pg)
    return min(budget, _READ_BUDGET) if getattr(_restoring, "active", False) else budget


_process_budget = _snapshot.get_process_memory_budget_bytes


def _batch_reads(read_reqs: list[ReadReq]) -> list[ReadReq]:
    """torchsnapshot's ``batch_read_requests`` (``torchsnapshot.snapshot`` calls it on every restore and
    ``read_object``): the byte ranges of one file read together, in pieces of at most :data:`_READ_BYTES`. 0.1.0 made
    each file one read (a slab's 128 MiB held whole until all its tensors were copied) and gave it the size of its
    last range instead of its own (the memory budget never saw it).
    Reads of whole files are kept as they are."""
    out: list[ReadReq] = []
    ranged: dict[str, list[ReadReq]] = {}
    for req in read_reqs:
        (out if req.byte_range is None else ranged.setdefault(req.path, [])).append(req)
    for path, reqs in ranged.items():
        piece: list[ReadReq] = []
        for req in sorted(reqs, key=lambda req: tuple(req.byte_range)):
            if piece and req.byte_range[1] - piece[0].byte_range[0] > _READ_BYTES:
                out.append(_merged_read(path, piece))
                piece = []
            piece.append(req)
        out.append(_merged_read(path, piece))
    return out


def _merged_read(path: str, reqs: list[ReadReq]) -> ReadReq:
    """One read of ``path`` covering the byte ranges of ``reqs`` (sorted), each consumer given its part
    (``batcher.BatchedBufferConsumer``, read by :func:`_consume_slab`)."""
    low, high = reqs[0].byte_range[0], max(req.byte_range[1] for req in reqs)
    parts = {(req.byte_range[0] - low, req.byte_range[1] - low): req.buffer_consumer for req in reqs}
    return ReadReq(path=path, byte_range=(low, high),
                   buffer_consumer=_batcher.BatchedBufferConsumer(parts, buf_sz_bytes=high - low))


# Process-wide and for good: each only replaces what raised, or failed to raise, before, or read more at once.
_tensor_io.tensor_as_memoryview, _tensor_io.tensor_from_memoryview = _empty_as_bytes, _empty_from_bytes
_tensor_io.TensorIOPreparer.prepare_read = classmethod(_read_quantized)
_batcher.BatchedBufferConsumer.consume_buffer = _consume_slab
_snapshot.batch_read_requests = _batch_reads
_snapshot.get_process_memory_budget_bytes = _memory_budget


class _LaterErrors(FSStoragePlugin):
    """torchsnapshot's file system plugin, writing each file with one task on the event loop's executor (torchsnapshot's
    own writes through ``aiofiles``, a thread hop per open, write and close), a slab (:class:`_Pieces`) from its
    tensors' views one after the other; keeping the first write error (an ``OSError`` naming the file) for later
    instead of raising it; recording each file it wrote (``written``: path -> ``{"bytes": size, "xxh3_128": digest}``,
    hashed from the bytes written, which are the Checkpointer's staged copy); and starting each file's writeback to
    the disk as it is written (``writeback``, :func:`~fastio.storage.atomic.start_writeback`, every
    :data:`_WRITEBACK_BYTES`: the commit's fsyncs then find the bytes written or on their way, instead of writing all
    of them at once); or, with ``direct``, writing each file past the page cache (:mod:`fastio.storage.direct`: the
    bytes on the device as the write returns, no writeback to start; ``direct_bytes``: the bytes so written,
    ``copied``: those of them that went through its aligned buffers, ``misplaced``: address -> phase of the staged
    bytes copied for want of a placement, for the Stager to place at the next save, ``placed``: the same of those
    written from where they were), through the page cache where the file system refuses ``O_DIRECT``.

    A write that raises on one rank makes ``Snapshot.take`` leave on that rank while the others wait in its
    next collective: both hang (gloo's timeout is 30 minutes). Kept here, the error leaves the take after every
    collective of it, and the Checkpointer's agreement on the ``write`` phase then fails every rank with it."""

    def __init__(self, root: str, writeback: bool = True, direct: bool = False):
        super().__init__(root=root)
        self.writeback, self.direct = writeback, direct
        self.error: Exception | None = None
        self.written: dict[str, dict[str, Any]] = {}
        self.direct_bytes = self.copied = 0
        self.misplaced: dict[int, int] = {}
        self.placed: dict[int, int] = {}

    async def write(self, write_io: WriteIO) -> None:
        if self.error is not None:
            return  # this step is lost already: write nothing more
        try:
            self.written[write_io.path] = await asyncio.get_running_loop().run_in_executor(
                None, self._write_file, write_io.path, write_io.buf)
        except OSError as err:  # a failed os.write names no file: this one
            named = err.filename or err.errno is None
            self.error = err if named else OSError(err.errno, err.strerror, os.path.join(self.root, write_io.path))
        except Exception as err:  # noqa: BLE001 - raised by _take once the collectives are done
            self.error = err

    def _write_file(self, path: str, buf: Any) -> dict[str, Any]:
        """Write ``buf`` (bytes, or a slab's :class:`_Pieces`) to the file at ``path`` under the root, hashing it as it
        goes and starting its writeback every :data:`_WRITEBACK_BYTES`; its written record."""
        full = os.path.join(self.root, path)
        parent = os.path.dirname(full)
        if parent not in self._dir_cache:
            os.makedirs(parent, exist_ok=True)
            self._dir_cache.add(parent)
        views = buf.views if isinstance(buf, _Pieces) else [memoryview(buf)]
        digest, size, started = DIGESTS[WRITE_CHECKSUM](), 0, 0
        fd = open_direct(full) if self.direct else None
        if fd is not None:
            try:
                return self._write_direct(fd, views, digest)
            except OSError as err:  # a file system that takes the flag but not the writes: this file again, buffered
                if err.errno != errno.EINVAL:
                    raise
                self.direct, digest = False, DIGESTS[WRITE_CHECKSUM]()
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for view in views:
                view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                digest.update(view)
                done = 0
                while done < view.nbytes:
                    done += os.write(fd, view[done:])
                size += done
                whole = size - size % mmap.PAGESIZE  # pages this file's next bytes will not touch
                if self.writeback and whole - started >= _WRITEBACK_BYTES:
                    start_writeback(fd, started, whole - started)
                    started = whole
            if self.writeback and size > started:
                start_writeback(fd, started)
        finally:
            os.close(fd)
        return written_record(None, size, digest.hexdigest())

    def _write_direct(self, fd: int, views: list[memoryview], digest: Any) -> dict[str, Any]:
        """:meth:`_write_file` past the page cache (:class:`~fastio.storage.direct.DirectFile`: the staged bytes
        themselves where they are placed as their offsets in the file are): no writeback to start, the bytes are on
        the device as each write returns. Runs on one thread at a time (:data:`WRITE_STREAMS`)."""
        try:
            out = DirectFile(fd)
            try:
                for view in views:
                    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                    digest.update(view)
                    out.write(view)
                size = out.finish()
                self.direct_bytes, self.copied = self.direct_bytes + size, self.copied + out.copied
                self.misplaced.update((address, phase) for address, _, phase in out.misplaced)
                self.placed.update((address, phase) for address, _, phase in out.placed)
            finally:
                out.close()
        finally:
            os.close(fd)
        return written_record(None, size, digest.hexdigest())


_WRITEBACK_BYTES = 8 << 20
"""A file's writeback is started after every 8 MiB written into it (:func:`~fastio.storage.atomic.start_writeback`),
so a slab's first tensors go to the disk while its last are written."""


def _take(path: str, app: dict[str, Any], pg: Any, replicated: list[str],
          writeback: bool = True, direct: bool = False) -> _LaterErrors:
    """``Snapshot.take(path, app, pg=pg, replicated=replicated)``, step for step as torchsnapshot 0.1.0 does it,
    but through :class:`_LaterErrors`: a write error on this rank is raised after the take's last collective
    (then rank 0 writes no ``.snapshot_metadata`` of its own failure; the step is never committed anyway).
    Returns the storage plugin, which holds the files this rank wrote (:attr:`_LaterErrors.written`)."""
    event_loop = asyncio.new_event_loop()
    try:
        ranks = PGWrapper(pg=pg)
        path, coalesced = Snapshot._coalesce_path_and_replicated(path=path, pg_wrapper=ranks, app_state=app,
                                                                 replicated=replicated)
        storage = _LaterErrors(path, writeback, direct)
        pending, metadata = Snapshot._take_impl(path=path, app_state=app, replicated=coalesced,
                                                pg_wrapper=PGWrapper(pg), storage=storage, event_loop=event_loop,
                                                is_async_snapshot=False)
        pending.sync_complete(event_loop=event_loop)
        ranks.barrier()  # every rank's files are written before rank 0 writes the metadata
        if ranks.get_rank() == 0 and storage.error is None:
            Snapshot._write_snapshot_metadata(snapshot_metadata=metadata, storage=storage, event_loop=event_loop)
        storage.sync_close(event_loop=event_loop)
    finally:
        event_loop.close()
    if storage.error is not None:
        raise storage.error
    return storage


class _HeldView:
    """``ReadIO.buf`` for a read served from a held file: ``getvalue()`` (all torchsnapshot asks of it) is a view of the
    read's bytes, not copied again."""

    def __init__(self, view: memoryview):
        self.view = view

    def getvalue(self) -> memoryview:
        return self.view


class _HeldReads(FSStoragePlugin):
    """torchsnapshot's file system plugin, reading the files in ``held`` (path relative to the step -> its
    ``CheckedFile``, checked by the restore) through them: ``read_io.buf.getvalue()`` is a view of the bytes read (the
    read's byte range), the file closed again after each read (no descriptor held per file).

    torchsnapshot 0.1.0's consumers never keep that buffer: a tensor's bytes are viewed (``torch.frombuffer``) or
    unpickled from a ``BytesIO`` copy and copied into the target tensor, or into one it makes when the target has
    none that fits (``empty_tensor_from_entry``: a fresh optimizer's moments); an object is unpickled from a
    ``BytesIO`` copy. So nothing restored refers to the read's buffer once the read is consumed."""

    def __init__(self, root: str, held: Mapping[str, Any]):
        super().__init__(root=root)
        self.held = held

    async def read(self, read_io: ReadIO) -> None:
        data = self.held.get(read_io.path)
        if data is None:
            return await super().read(read_io)
        start, end = read_io.byte_range if read_io.byte_range is not None else (0, data.size)
        try:  # ShortRead (an OSError) names the file
            read_io.buf = _HeldView(memoryview(data.read(start, end - start)))
        finally:
            data.close()  # reopened for another range of it: no descriptor held per file


def _restore(snap: Snapshot, app: dict[str, Any], held: Mapping[str, Any]) -> None:
    """``snap.restore(app)``, step for step as torchsnapshot 0.1.0 does it, but reading through :class:`_HeldReads`."""
    event_loop = asyncio.new_event_loop()
    _restoring.active = True
    try:
        ranks = PGWrapper(snap.pg)
        storage = _HeldReads(snap.path, held)
        snap._validate_app_state(app)
        app = dict(app)
        rng = snap._pop_rng_state(app_state=app)
        for key in snap._gather_keys(keys=list(app), pg_wrapper=ranks):
            snap._load_stateful(stateful_key=key, stateful=app.get(key), storage=storage, pg=ranks,
                                event_loop=event_loop)
            ranks.barrier()
        if rng is not None:  # the RNG state last, as torchsnapshot restores it
            snap._load_stateful(stateful_key=rng[0], stateful=rng[1], storage=storage, pg=ranks,
                                event_loop=event_loop)
        storage.sync_close(event_loop=event_loop)
    except BaseException as err:
        _settle(event_loop, err)
        raise
    finally:
        _restoring.active = False
        event_loop.close()


def _settle(event_loop: asyncio.AbstractEventLoop, err: BaseException) -> None:
    """After an error inside :func:`_restore`: the reads and copies torchsnapshot left running (its executor's copies
    from views of the read buffers, reads already under way) finish, the error's frames are cleared and the cycles
    they leave are collected, so that nothing refers to those buffers once the restore has failed."""
    pending = asyncio.all_tasks(event_loop)
    if pending:
        event_loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    traceback.clear_frames(err.__traceback__)
    gc.collect()


class _LaterLoadError:
    """An app object for ``Snapshot.restore`` whose ``state_dict``/``load_state_dict`` keep their first error for
    later instead of raising it: raised inside the restore on one rank, it would leave that rank's restore while
    the others wait in its next collective (see :class:`_LaterErrors`)."""

    def __init__(self, obj: Stateful):
        self.obj, self.error = obj, None

    def state_dict(self) -> dict[str, Any]:
        if self.error is None:
            try:
                return self.obj.state_dict()
            except Exception as err:  # noqa: BLE001 - raised by restore() once the collectives are done
                self.error = err
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.error is None:
            try:
                self.obj.load_state_dict(state)
            except Exception as err:  # noqa: BLE001 - see state_dict
                self.error = err


class _QuietObjOut(logging.Filter):
    """Drops torchsnapshot's per-leaf warning that a leaf read without ``obj_out`` is not loaded in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


# ---------------------------------------------------------------- manifest views
def _top(path: str) -> str:
    """The escaped app key of an unranked manifest path ``key/sub/path``."""
    return path.split("/", 1)[0]


def _rank_view(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """The entries saving rank ``rank`` can read, by unranked path: its own plus the replicated ones
    (listed under rank 0 only)."""
    view = {path.split("/", 1)[1]: entry for path, entry in manifest.items()
            if path.startswith("0/") and is_replicated(entry)}
    view.update((path.split("/", 1)[1], entry) for path, entry in manifest.items() if path.startswith(f"{rank}/"))
    return view


def _locations(entry: Any) -> list[str]:
    """The files (relative to the step) a manifest entry is read from."""
    if isinstance(entry, ShardedTensorEntry):
        return [shard.tensor.location for shard in entry.shards]
    chunks = getattr(entry, "chunks", None)
    if chunks is not None:
        return [chunk.tensor.location for chunk in chunks]
    location = getattr(entry, "location", None)
    return [location] if location else []


class TorchSnapshotCheckpoint(SavedCheckpoint):
    """A torchsnapshot step directory opened for reading (see :class:`~fastio.checkpoint.engines.base.SavedCheckpoint`)."""

    def __init__(self, path: Path, pg: Any = None, held: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.held: Mapping[str, Any] = {} if held is None else held
        """Files of the step this rank checked in memory (see :meth:`TorchSnapshotEngine.open`): :meth:`restore`
        reads them from there."""
        self._snap = Snapshot(str(path), pg=pg)
        try:
            self._manifest = self._snap.get_manifest()
            self.world_size = int(self._snap.metadata.world_size)
        except Exception as err:  # noqa: BLE001 - a missing or corrupt .snapshot_metadata, named here
            raise CheckpointError(f"{path}: unreadable snapshot metadata: {first_line(err)}") from None
        self._views: dict[int, dict[str, Any]] = {}

    def _view(self, rank: int) -> dict[str, Any]:
        if rank not in self._views:
            self._views[rank] = _rank_view(self._manifest, rank)
        return self._views[rank]

    def _entries(self, key: str, rank: int) -> dict[str, Any]:
        escaped = _encode(key)
        return {path: entry for path, entry in self._view(rank).items() if _top(path) == escaped}

    def keys(self, rank: int) -> set[str]:
        return {_decode(_top(path)) for path in self._view(rank)}

    def is_replicated(self, key: str, rank: int) -> bool:
        return all(is_container_entry(e) or is_replicated(e) for e in self._entries(key, rank).values())

    def restore(self, targets: dict[str, Stateful], *, strict: bool = True, cast: bool = False) -> list[str]:
        """``Snapshot.restore(targets)``, one key at a time, each from a manifest holding only that key;
        modules through :class:`~fastio.checkpoint.engines.strict.CheckedModule` (the strict rule; ``cast``: a
        tensor of another dtype is cast, not a difference).

        torchsnapshot 0.1.0's ``restore`` walks the whole manifest for every app key (``_load_stateful``),
        so restoring model, optimizer, loader and RNG would read every tensor once per key; with a
        view per key each byte is read once. The restored state is the same. Files in :attr:`held` are read
        from there (:func:`_restore`), the others from disk.
        """
        from torch import nn

        snap = self._snap
        full = snap.metadata
        skipped: list[str] = []
        self._check_modules(targets, strict, cast)  # all or nothing: before any key is loaded, on every rank
        error: Exception | None = None  # the first load error of this rank, raised once every key's restore is done
        try:
            for key, obj in targets.items():
                if isinstance(obj, nn.Module):
                    obj = CheckedModule(key, obj, strict=strict, where=str(self.path), skipped=skipped, cast=cast)
                escaped = _encode(key)
                view = {path: entry for path, entry in full.manifest.items() if path.split("/")[1:2] == [escaped]}
                snap._metadata = replace(full, manifest=view)
                later = _LaterLoadError(obj)
                try:
                    _restore(snap, {key: later}, self.held)
                except pickle.UnpicklingError:  # torch.load refused (weights_only, torch >= 2.6): name the file
                    error = error or self._refused(view)
                    PGWrapper(snap.pg).barrier()  # the key's last collective, which the raise skipped
                except Exception as err:  # noqa: BLE001 - a read error of this rank's (its view of a file)
                    error = error or self._unreadable(key, view, err)
                    PGWrapper(snap.pg).barrier()
                error = error or later.error
        finally:
            snap._metadata = full
        if error is not None:  # only now: the other ranks went through every key's collectives too
            raise error
        return skipped

    def _check_modules(self, targets: dict[str, Stateful], strict: bool, cast: bool) -> None:
        """Strict: every module target against this rank's manifest (state keys, tensor shapes and dtypes), agreed over the
        ranks before any key is loaded (keys load one by one, in place: a module refused only when its turn came
        left the keys before it loaded). The rank that found a difference raises it; the others raise a
        CheckpointError marked ``elsewhere``, which :meth:`fastio.checkpoint.group.RankGroup.run` leaves to it."""
        from torch import nn

        if not strict:
            return
        pg = PGWrapper(self._snap.pg)
        rank, world = pg.get_rank(), pg.get_world_size()
        mine = None
        for key, obj in targets.items():
            if isinstance(obj, nn.Module):
                own, dtypes = obj.state_dict(), self.dtypes(key, rank)
                found = Mismatch(key, self.shapes(key, rank), module_shapes(obj), quantized_keys(dtypes, own),
                                 other_dtypes(dtypes, own, cast=cast))
                if found:
                    mine = str(found.refusal(str(self.path)))
                    break
        every = [mine]
        if world > 1:
            every = [None] * world
            pg.all_gather_object(every, mine)
        failed = [(r, text) for r, text in enumerate(every) if text]
        if failed:
            first, text = failed[0] if mine is None else (rank, mine)
            err = CheckpointError(text if first == rank else f"{text} (on rank {first})")
            err.elsewhere = first != rank
            raise err

    def shapes(self, key: str, rank: int) -> dict[str, tuple[int, ...] | None]:
        """The state keys saving rank ``rank`` wrote for app key ``key`` (a flat state dict, a module's), with the
        shape of each plain tensor (None for anything else), from the manifest."""
        out: dict[str, tuple[int, ...] | None] = {}
        for path, entry in self._entries(key, rank).items():
            parts = path.split("/")
            if len(parts) < 2:  # the key's own container
                continue
            shape = None if len(parts) > 2 or isinstance(entry, ShardedTensorEntry) else getattr(entry, "shape", None)
            out.setdefault(_decode(parts[1]), tuple(int(n) for n in shape) if shape is not None else None)
        return out

    def dtypes(self, key: str, rank: int) -> dict[str, str]:
        """The dtype (its name) of each tensor the manifest holds directly under a state key of ``key`` (a module's)."""
        return {_decode(parts[1]): entry.dtype for path, entry in self._entries(key, rank).items()
                if len(parts := path.split("/")) == 2 and isinstance(getattr(entry, "dtype", None), str)}

    def param_groups(self, key: str, rank: int) -> list[int] | None:
        """Parameters per group from the manifest's ``KEY/param_groups/G/params/P`` entries (small ints live in
        the manifest itself); None when the manifest does not show the groups as a list of groups, each with its
        ``params`` list (groups pickled whole: torch's own check applies)."""
        paths = [path.split("/")[1:] for path in self._entries(key, rank)]
        groups = {int(p[1]) for p in paths if len(p) == 2 and p[0] == "param_groups" and p[1].isdigit()}
        if not groups or any(["param_groups", str(g), "params"] not in paths for g in groups):
            return None
        sizes = dict.fromkeys(sorted(groups), 0)
        for p in paths:
            if len(p) == 4 and p[0] == "param_groups" and p[2] == "params" and p[1].isdigit() and int(p[1]) in sizes:
                sizes[int(p[1])] += 1
        return list(sizes.values())

    def group_settings(self, key: str, rank: int) -> list[set[str]] | None:
        """From the manifest's ``KEY/param_groups/G/NAME`` entries; None when it does not show the groups."""
        if self.param_groups(key, rank) is None:
            return None
        groups: dict[int, set[str]] = {}
        for path in self._entries(key, rank):
            p = path.split("/")[1:]
            if len(p) >= 3 and p[0] == "param_groups" and p[1].isdigit():
                groups.setdefault(int(p[1]), set()).add(_decode(p[2]))
        return [groups[g] - {"params"} for g in sorted(groups)]

    def state_shapes(self, key: str, rank: int) -> dict[tuple[int, str], tuple[int, ...]]:
        """From the manifest's ``KEY/state/P/NAME`` tensor entries."""
        out: dict[tuple[int, str], tuple[int, ...]] = {}
        for path, entry in self._entries(key, rank).items():
            p = path.split("/")[1:]
            shape = None if isinstance(entry, ShardedTensorEntry) else getattr(entry, "shape", None)
            if len(p) == 3 and p[0] == "state" and p[1].isdigit() and shape is not None:
                out[(int(p[1]), _decode(p[2]))] = tuple(int(n) for n in shape)
        return out

    def _unreadable(self, key: str, view: dict[str, Any], err: Exception) -> CheckpointError:
        """The one-line error for a read that failed inside ``Snapshot.restore``: the file the error names, else
        the key's files (a short read fails later, in deserialising). Raised only after the key's collectives, so
        the other ranks are not left waiting inside them."""
        file = getattr(err, "filename", None)
        if file:
            return CheckpointError(f"{file}: unreadable: {getattr(err, 'strerror', None) or first_line(err)}")
        rank = PGWrapper(self._snap.pg).get_rank()
        mine = [e for path, e in view.items() if path.startswith(f"{rank}/") or is_replicated(e)]
        files = sorted({loc for entry in mine for loc in _locations(entry)})
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return CheckpointError(f"{self.path}: app key {key}: cannot read its state from {shown or 'its files'}: "
                               f"{first_line(err)}")

    def _refused(self, view: dict[str, Any]) -> CheckpointError:
        """The one-line error for an object file ``torch.load(weights_only=True)`` refuses to unpickle."""
        import torch

        for entry in view.values():
            if isinstance(entry, ObjectEntry):
                file = self.path / entry.location
                try:
                    torch.load(file, weights_only=True)
                except pickle.UnpicklingError:
                    return CheckpointError(f"{file}: refused to load: not plain tensors and containers "
                                           "(torch.load weights_only)")
                except Exception:  # noqa: BLE001, S112 - another problem of another file: keep looking
                    continue
        return CheckpointError(f"{self.path}: refused to load an object that is not plain tensors and containers "
                               "(torch.load weights_only)")

    def read(self, key: str, rank: int) -> Any:
        entries = self._entries(key, rank)
        where = str(self.path)
        if not entries:
            raise CheckpointError(f"{where}: checkpoint has no state for app key {key} on saving rank {rank}")
        containers = {p: e for p, e in entries.items() if is_container_entry(e)}
        leaves: dict[str, Any] = {}
        quiet, ts_log = _QuietObjOut(), logging.getLogger(_LOGGER)
        ts_log.addFilter(quiet)
        try:
            for path, entry in entries.items():
                if path in containers:
                    continue
                if isinstance(entry, ShardedTensorEntry):
                    raise CheckpointError(f"{where}: {rank}/{path} is a ShardedTensor: elastic restore of sharded "
                                          "state is not supported; restore at the saved world size")
                if isinstance(entry, PrimitiveEntry):
                    leaves[path] = entry.get_value()
                else:
                    try:
                        leaves[path] = self._snap.read_object(f"{rank}/{path}")
                    except pickle.UnpicklingError:
                        raise self._refused({path: entry}) from None
            return inflate(containers, leaves, prefix=key)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - an unreadable leaf or a structure inflate cannot rebuild
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"{where}: cannot rebuild the state of app key {key} saved by rank {rank}: "
                                  f"{type(err).__name__}: {first}") from err
        finally:
            ts_log.removeFilter(quiet)


def _is_dtensor(tensor: Any) -> bool:
    import torch

    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class TorchSnapshotEngine:
    """Writes and reads checkpoints with torchsnapshot 0.1.0 (see :class:`~fastio.checkpoint.engines.base.Engine`)."""

    name = "torchsnapshot"

    def __init__(self) -> None:
        self.direct_bytes = self.direct_copied = 0
        """Bytes the last save wrote past the page cache, and those of them that went through the aligned buffers
        (only each file's unaligned pieces once every staged buffer is placed as its file offset)."""
        self._misplaced: dict[int, int] = {}
        self._placed: dict[int, int] = {}

    def placements(self) -> dict[int, int]:
        """Where the last save's direct writes found staged bytes placed otherwise than their file offsets (a tensor
        in a slab file: its offset there), address -> its wanted phase (see ``Engine.placements``); where some were,
        also the bytes that were placed right (a buffer written as several files, a chunked tensor's, may want several
        phases: the Stager weighs them)."""
        return {**self._placed, **self._misplaced} if self._misplaced else {}

    def placeable(self, tensor: Any) -> bool:
        """Whether torchsnapshot writes ``tensor`` from its bytes (a dtype numpy has, or bfloat16): one it has not
        (complex) it writes with ``torch.save``, the whole storage, a page more than a placed buffer's bytes."""
        return tensor.dtype in _serialization.BUFFER_PROTOCOL_SUPPORTED_DTYPES

    def prepare(self, app: dict[str, Any]) -> tuple[dict[str, Stateful], frozenset[str]]:
        """The app as it is: torchsnapshot calls ``state_dict``/``load_state_dict`` itself; nothing is global
        (replication is said by the ``replicated`` globs instead)."""
        return dict(app), frozenset()

    def refusal(self, tensor: Any) -> str | None:
        """torchsnapshot's serialisation has no format for a dtype outside its list (``torch.uint16``, the float8s)
        nor for a sparse layout, nor for a DTensor (FSDP2, tensor parallel): without this the save failed in the
        background write, without the key."""
        import torch

        if _is_dtensor(tensor):
            return ("torchsnapshot cannot checkpoint a DTensor (FSDP2, tensor parallel): save with engine='dcp' or "
                    "engine='auto', which chooses DCP for DTensor state")
        if tensor.layout != torch.strided:
            what = f"a {str(tensor.layout).removeprefix('torch.')} tensor"
        elif tensor.dtype not in _serialization.ALL_SUPPORTED_DTYPES:
            what = f"a {tensor.dtype} tensor"
        else:
            return None
        return (f"torchsnapshot cannot checkpoint {what} (save with engine='dcp', or store it as another dtype or "
                f"layout: t.to_dense(), t.view(torch.int16))")

    def save(self, path: Path, states: dict[str, dict[str, Any]], *, pg: Any = None,
             replicated: Sequence[str] = (), global_keys: Sequence[str] = (),
             writeback: bool = True, direct: bool = False) -> dict[str, dict[str, Any]]:
        """``Snapshot.take`` of the staged ``states`` (:func:`_take`: a write error raises on its rank only
        after the take's collectives), tensors below 128 MiB batched into slab files (:func:`_gather_writes`); the
        files this rank wrote, each with its size and xxh3-128 taken from the bytes written.

        The staged buffers are a private copy already: each slab file is written straight from them, not from a
        slab torchsnapshot would allocate and fill.
        """
        app = {key: Frozen(state) for key, state in states.items()}
        with _write_settings():
            storage = _take(str(path), app, pg, list(replicated), writeback, direct)
        self.direct_bytes, self.direct_copied = storage.direct_bytes, storage.copied
        self._misplaced, self._placed = storage.misplaced, storage.placed
        return storage.written

    def reads(self, files: Sequence[str], saved_world: int, world: int) -> dict[str, int]:
        """At the world size it was saved at, rank R reads its own state from the files under ``R/``; the files
        under ``replicated/`` every rank reads: foreseen for rank 0 (the others read them from disk). At another,
        elastic (``restore_elastic`` reads what it needs key by key), nothing is foreseen."""
        if not saved_world or saved_world != world:
            return {}
        out: dict[str, int] = {}
        for f in files:
            top = f.split("/", 1)[0]
            if top == "replicated":
                out[f] = 0
            elif top.isdigit() and int(top) < saved_world:
                out[f] = int(top)
        return out

    def open(self, path: Path, *, pg: Any = None, held: Mapping[str, Any] | None = None) -> TorchSnapshotCheckpoint:
        """``held``: files of ``path`` this rank checked in memory, which :meth:`TorchSnapshotCheckpoint.restore`
        reads from there."""
        return TorchSnapshotCheckpoint(path, pg, held)
