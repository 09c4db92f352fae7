"""A consistent copy of a state_dict taken before a background write, into buffers reused across saves.

torchsnapshot's ``async_take`` serialises CPU tensors straight from the caller's memory in its
background thread, so a training step after it returns can change what lands on disk. The stager
copies every tensor into a preallocated CPU buffer (pinned when the source is on a GPU) and copies
everything else; the write then reads only from the stager's buffers, which are not touched again
until that write has finished (the Checkpointer keeps one save in flight).

When the copies happen (what is guaranteed):

- CPU tensors that an optimizer updates (the storages :func:`optimizer_storages` names: the parameters of the
  app's optimizers and their state, e.g. Adam's moments) are copied *after* ``stage`` returns, in chunks, by
  :meth:`Stager.finish_copies` on the writer thread (torch copies release the GIL), so the copy overlaps the
  next step's forward and backward. They change only in an optimizer's ``step``: a global optimizer step
  pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) makes any optimizer's next ``step``
  first copy what is left itself and wait for the chunks in flight. A deferred tensor changed in place
  before its copy was taken some other way (``p.mul_()`` outside an optimizer) is detected by its version
  counter and fails the save (:class:`CheckpointError` naming the key), never a mix of two steps; a change
  through ``.data``, which has a version counter of its own, is not seen: change an optimizer's tensors
  between ``maybe_save`` and the next ``step`` only through that ``step``.
- Every other CPU tensor (module buffers such as BatchNorm's running statistics, which the next forward
  changes; any object's tensors that no optimizer updates) and every non-tensor value is copied before
  ``stage`` returns.
- GPU tensors are queued as stream-ordered copies into pinned memory before ``stage`` returns: kernels queued
  later on the same stream (the next optimizer step) run after them; the writer waits for them.

A ``DTensor`` (FSDP2, tensor parallel) is staged by its local shard: the buffer is a CPU DTensor with the
original's mesh, placements and global shape, whose local tensor is refilled on every save, so the engine
(DCP) writes the same shard of the same global tensor. (Its buffer is not pinned: torch has no public way
to build a DTensor over a pinned local tensor of another device than its mesh's.)
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastio.errors import CheckpointError

__all__ = ["CHUNK_BYTES", "Frozen", "Stager", "optimizer_storages"]

CHUNK_BYTES = 16 << 20
"""A deferred tensor is copied in pieces of this size, so an optimizer step that finds the copy unfinished
copies what is left itself instead of waiting for a whole tensor on a low-priority thread."""

_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None where torch.distributed is not built in."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


class Frozen:
    """A torchsnapshot Stateful whose state_dict is a fixed, already staged dict."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class Stager:
    """Copies state_dicts into buffers keyed by their path; a buffer is reallocated only when its shape changes."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: list = []
        self._deferred: _Deferred | None = None

    def release(self) -> None:
        """Free the buffers (after the write that reads them: the Checkpointer's ``close``)."""
        if self._deferred is not None:
            self._deferred.run()  # an optimizer step must not copy into freed buffers
            self._deferred = None
        self._buffers.clear()

    def stage(self, states: dict[str, Any], deferred: Collection[int] = ()) -> dict[str, Any]:
        """Return a copy of ``states`` (a dict of state_dicts) that later changes to the originals cannot reach.

        CPU tensors whose storage is in ``deferred`` (:func:`optimizer_storages`) are copied later, by
        :meth:`finish_copies` or by the next optimizer step, whichever comes first (see the module docstring);
        everything else before this returns."""
        if self._deferred is not None:  # a save that failed after staging: finish its copies before reusing buffers
            self._deferred.run()
            self._deferred = None
        pairs: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        seen: set[str] = set()
        out = {key: self._walk(value, key, pairs, seen) for key, value in states.items()}
        for path in set(self._buffers) - seen:
            del self._buffers[path]
        devices = set()
        later: list[_Chunk] = []
        with torch.no_grad():
            for dst, src, path in pairs:
                if src.is_cuda:
                    devices.add(src.device)
                    dst.copy_(src, non_blocking=True)
                elif deferred and src.numel() and src.untyped_storage().data_ptr() in deferred:
                    later.extend(_chunks(dst, src, path))
                else:
                    dst.copy_(src)
        # Device-to-host copies are queued on each device's current stream: kernels queued after them
        # (the next optimizer step) run after them, so the caller need not wait; the writer does.
        self._events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        self._deferred = _Deferred(later) if later else None
        return out

    def finish_copies(self) -> None:
        """Complete the last :meth:`stage`: copy the deferred tensors not copied yet, wait for the device-to-host
        copies; CheckpointError naming the key when a deferred tensor changed before its copy was taken."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.run()
            if deferred.changed:
                raise CheckpointError(
                    f"state key {deferred.changed[0]!r} changed in place after maybe_save returned and before it was "
                    "copied (not by an optimizer step, which waits for the copy): the save would mix two steps")
        for event in self._events:
            event.synchronize()
        self._events = []

    def _buffer(self, path: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        return buf

    def _dtensor_buffer(self, path: str, t: Any) -> Any:
        """A CPU DTensor like ``t`` (same mesh, placements, global shape) whose local shard is the buffer.

        Made with DTensor's own ``to("cpu")`` (a GPU shard) or ``clone`` (a CPU one): ``DTensor.from_local``
        would move a CPU buffer back to the mesh's device.
        """
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.placements != t.placements \
                or buf.device_mesh != t.device_mesh or buf.to_local().shape != t.to_local().shape:
            buf = t.detach().to("cpu") if t.device.type != "cpu" else t.detach().clone()
            self._buffers[path] = buf
        return buf

    def _walk(self, obj: Any, path: str, pairs: list, seen: set[str]) -> Any:
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            seen.add(path)
            buf = self._dtensor_buffer(path, obj)
            pairs.append((buf.to_local(), obj.to_local().detach(), path))
            return buf
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized or type(obj) is not torch.Tensor \
                    and not isinstance(obj, torch.nn.Parameter):
                return obj.detach().to("cpu", copy=True)
            seen.add(path)
            buf = self._buffer(path, obj)
            pairs.append((buf, obj.detach(), path))
            return buf
        if isinstance(obj, dict):
            items = ((k, self._walk(v, f"{path}/{k}", pairs, seen)) for k, v in obj.items())
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple)):
            items = [self._walk(v, f"{path}/{i}", pairs, seen) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, _LEAF_TYPES):
            return copy.copy(obj)
        raise CheckpointError(
            f"state key {path!r}: cannot checkpoint a {type(obj).__module__}.{type(obj).__qualname__} "
            "(state_dicts may hold tensors, numbers, strings, bytes, None, and dicts/lists/tuples of them)"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def optimizer_storages(app: dict[str, Any]) -> frozenset[int]:
    """The storages (``untyped_storage().data_ptr()``) of CPU tensors that only an optimizer step of the app's
    optimizers changes: their parameters and their state tensors (a DTensor's by its local shard)."""
    found: set[int] = set()
    for obj in app.values():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        tensors = [p for g in obj.param_groups for p in g["params"]]
        tensors += [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            local = _local(t)
            if local.device.type == "cpu" and local.numel():
                found.add(local.untyped_storage().data_ptr())
    return frozenset(found)


@dataclass
class _Chunk:
    dst: torch.Tensor
    src: torch.Tensor
    whole: torch.Tensor
    """The staged tensor the chunk is part of: its version counter tells whether it changed in place."""
    version: int
    path: str


def _chunks(dst: torch.Tensor, src: torch.Tensor, path: str) -> list[_Chunk]:
    """``src`` -> ``dst`` as copies of at most :data:`CHUNK_BYTES` (one copy when ``src`` is not contiguous)."""
    version = src._version
    if not src.is_contiguous():
        return [_Chunk(dst, src, src, version, path)]
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    step = max(1, CHUNK_BYTES // max(1, src.element_size()))
    return [_Chunk(flat_dst[i:i + step], flat_src[i:i + step], src, version, path)
            for i in range(0, flat_src.numel(), step)]


class _Deferred:
    """One stage's deferred copies, taken by whoever comes first: the writer (:meth:`Stager.finish_copies`) or
    the next optimizer step (the pre-hook). Each chunk is copied once; ``run`` returns when all are done."""

    def __init__(self, chunks: list[_Chunk]):
        self._chunks, self._next, self._done = chunks, 0, 0
        self._cond = threading.Condition()
        self.changed: list[str] = []
        _ACTIVE.add(self)

    def run(self) -> None:
        while True:
            with self._cond:
                if self._next >= len(self._chunks):
                    break
                chunk = self._chunks[self._next]
                self._next += 1
            try:
                with torch.no_grad():
                    chunk.dst.copy_(chunk.src)  # releases the GIL
            finally:
                with self._cond:
                    if chunk.whole._version != chunk.version and chunk.path not in self.changed:
                        self.changed.append(chunk.path)
                    self._done += 1
                    self._cond.notify_all()
        with self._cond:
            self._cond.wait_for(lambda: self._done == len(self._chunks))
        _ACTIVE.discard(self)


class _Active:
    """The unfinished :class:`_Deferred` copies of this process, and the one global optimizer step pre-hook that
    finishes them (registered once, never removed: removing a hook while another thread runs ``step`` would
    change the dict torch iterates)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[_Deferred] = set()
        self._hooked = False

    def add(self, deferred: _Deferred) -> None:
        with self._lock:
            self._pending.add(deferred)
            if not self._hooked:
                register_optimizer_step_pre_hook(self._before_step)
                self._hooked = True

    def discard(self, deferred: _Deferred) -> None:
        with self._lock:
            self._pending.discard(deferred)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            pending = list(self._pending)
        for deferred in pending:
            deferred.run()


_ACTIVE = _Active()
