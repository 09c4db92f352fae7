"""A consistent copy of a state_dict taken before a background write, into buffers reused across saves.

torchsnapshot's ``async_take`` serialises CPU tensors straight from the caller's memory in its
background thread, so a training step after it returns can change what lands on disk. The stager
copies every tensor into a preallocated CPU buffer (pinned when the source is on a GPU) and copies
everything else; the write then reads only from the stager's buffers, which are not touched again
until that write has finished (the Checkpointer keeps one save in flight). CPU tensors are copied
before ``stage`` returns; GPU tensors are queued as stream-ordered copies that the writer waits for.

For an engine that writes past the page cache (``O_DIRECT``, :mod:`fastio.storage.direct`), buffers are *placed*:
a buffer of :data:`~fastio.storage.direct.PLACE_BYTES` or more that the engine writes from its own bytes
(``Engine.placeable``) starts at a page boundary, or as far past one as the
engine asked (its bytes' offset in their file, modulo :data:`~fastio.storage.direct.ALIGN`, which the engine learns
at a write: a tensor in a slab file), so that the write hands the device the buffer itself, copying only the unaligned
head and tail. A placed buffer is a view into an allocation :data:`~fastio.storage.direct.ALIGN` bytes larger; a
pinned one (the source on a GPU) is placed only at a page boundary, by its exact size: torch's CUDA host allocator
rounds each block up to a power of two and starts it at a page, so a page more could double the page-locked memory
(a 64 MiB weight's buffer would take 128 MiB); one a slab's offset would place elsewhere is copied instead. Pinned
placement is not run here (no GPU on the development machine).

A ``DTensor`` (FSDP2, tensor parallel) is staged by its local shard: the buffer is a CPU DTensor with the
original's mesh, placements and global shape, whose local tensor is refilled on every save, so the engine
(DCP) writes the same shard of the same global tensor. (Its buffer is not pinned: torch has no public way
to build a DTensor over a pinned local tensor of another device than its mesh's.)
"""

from __future__ import annotations

import bisect
import copy
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastio.errors import CheckpointError
from fastio.storage.direct import ALIGN, PLACE_BYTES

__all__ = ["Frozen", "Stager"]

_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None where torch.distributed is not built in."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _refuse_subclass(t: torch.Tensor, path: str) -> None:
    """A CheckpointError naming the key path and the type of a tensor subclass (other than a parameter's, which is
    saved by its data, as ``torch.save`` pickles a parameter without attributes): neither engine can restore one.
    DCP's ``torch.load(weights_only=True)`` refuses its pickle, torchsnapshot stores its bytes only (its class and
    attributes lost; a wrapper subclass fails to write)."""
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return
    raise CheckpointError(
        f"state key {path!r}: cannot checkpoint a tensor subclass {type(t).__module__}.{type(t).__qualname__} "
        "(no engine restores it as its class; save its plain data, t.as_subclass(torch.Tensor), or its parts)")


def _placed(t: torch.Tensor, pin: bool, phase: int) -> torch.Tensor | None:
    """An empty CPU tensor like ``t`` whose data starts ``phase`` bytes past a page boundary: a view into a byte
    allocation :data:`~fastio.storage.direct.ALIGN` larger; None where ``phase`` is no multiple of its element
    size."""
    size = t.element_size()
    if phase % size:
        return None
    if pin:  # torch's CUDA host allocator rounds a block up to a power of two: ALIGN more could double it
        return _pinned_at_a_page(t) if phase == 0 else None
    raw = torch.empty(t.nelement() * size + ALIGN, dtype=torch.uint8, device="cpu")  # not pinned: returned above
    skip = (phase - raw.data_ptr()) % ALIGN
    if skip % size:
        return None
    return raw[skip:skip + t.nelement() * size].view(t.dtype).view(t.shape)


def _pinned_at_a_page(t: torch.Tensor) -> torch.Tensor | None:
    """A pinned empty CPU tensor like ``t`` of its exact size when it starts at a page boundary (the host
    allocator's blocks are whole page-locked allocations, so they do), else None (a plain pinned buffer, copied)."""
    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return buf if buf.data_ptr() % ALIGN == 0 else None


class Frozen:
    """A torchsnapshot Stateful whose state_dict is a fixed, already staged dict."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _no_data(t: torch.Tensor) -> str | None:
    """Why no engine can checkpoint ``t`` (a meta tensor, a nested one), None when one may."""
    if t.is_meta:
        return "a meta tensor has no data to checkpoint (materialise it first: to_empty() and init, or load weights)"
    if t.is_nested:
        return "cannot checkpoint a nested tensor (neither engine writes one: save its parts, t.unbind())"
    return None


class Stager:
    """Copies state_dicts into buffers keyed by their path; a buffer is reallocated only when its shape changes."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._phases: dict[str, int | None] = {}  # path -> the phase asked of its buffer (None: not placed)
        self._placements: Mapping[int, int] | None = None
        self._placeable: Callable[[torch.Tensor], bool] | None = None
        self._events: list = []
        self._refusal: Callable[[torch.Tensor], str | None] | None = None
        self._paths: set[str] = set()

    def release(self) -> None:
        self._buffers.clear()
        self._phases.clear()

    def stage(self, states: dict[str, Any], refusal: Callable[[torch.Tensor], str | None] | None = None,
              placements: Mapping[int, int] | None = None,
              placeable: Callable[[torch.Tensor], bool] | None = None) -> dict[str, Any]:
        """Return a copy of ``states`` (a dict of state_dicts) that later changes to the originals cannot reach.
        ``refusal``: why the engine cannot write a tensor (None when it can): a CheckpointError naming its key path,
        before anything is copied. ``placements``: None for buffers as torch allocates them; else buffers of
        :data:`~fastio.storage.direct.PLACE_BYTES` or more are placed (see the module docstring), a page boundary
        but where the mapping (an address in a buffer of the last save -> how far past a page boundary it should
        have been) asks otherwise; a buffer placed otherwise than asked is made anew. ``placeable``: whether a
        tensor's buffer may be placed (None: all may): not one the engine writes with its whole storage."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[str] = set()
        self._refusal = refusal
        self._placements = None if placements is None else self._wanted(placements)
        self._placeable = placeable
        self._paths: set[str] = set()
        out = {key: self._walk(value, key, pairs, seen) for key, value in states.items()}
        for path in set(self._buffers) - seen:
            del self._buffers[path]
            self._phases.pop(path, None)
        devices = set()
        with torch.no_grad():
            for dst, src in pairs:
                if src.is_cuda:
                    devices.add(src.device)
                dst.copy_(src, non_blocking=src.is_cuda)
        # Device-to-host copies are queued on each device's current stream: kernels queued after them
        # (the next optimizer step) run after them, so the caller need not wait; the writer does.
        self._events = []
        for device in devices:
            event = torch.cuda.Event(blocking=True)  # the writer's wait sleeps; a plain event's spins a CPU
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        return out

    def wait_copies(self) -> None:
        """Block until the device-to-host copies of the last :meth:`stage` have landed (no-op for CPU state)."""
        for event in self._events:
            event.synchronize()
        self._events = []

    def _wanted(self, placements: Mapping[int, int]) -> dict[str, int]:
        """``placements`` (addresses in this stager's buffers -> their wanted phase) as path -> the phase its buffer's
        start should have; addresses in no buffer are ignored; of several phases asked of a buffer (its bytes written as
        several files: a chunked tensor), the one most asked, where it is now on a tie (else it would move at every
        save, to where one misplaced piece wants it and away from where the others are placed)."""
        starts = sorted((buf.data_ptr(), buf.data_ptr() + buf.nbytes, path) for path, buf in self._buffers.items()
                        if type(buf) is torch.Tensor)  # a DTensor's buffer is never placed
        keys = [start for start, _, _ in starts]
        votes: dict[str, Counter[int]] = {}
        for address, phase in placements.items():
            i = bisect.bisect_right(keys, address) - 1
            if i >= 0 and address < starts[i][1]:
                votes.setdefault(starts[i][2], Counter())[(phase - (address - starts[i][0])) % ALIGN] += 1
        return {path: max(asked, key=lambda phase: (asked[phase], phase == self._phases.get(path)))
                for path, asked in votes.items()}

    def _buffer(self, path: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        phase = None  # the phase asked of the buffer (kept when it cannot be had: not asked again at every save)
        if self._placements is not None and t.nelement() * t.element_size() >= PLACE_BYTES \
                and (self._placeable is None or self._placeable(t)):
            before = self._phases.get(path)
            phase = self._placements.get(path, 0 if before is None else before)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or self._phases.get(path) != phase:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = _placed(t, pin, phase) if phase is not None else None
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path], self._phases[path] = buf, phase
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
        if path in self._paths:  # one buffer, one path in either engine's files: one entry would be lost
            raise CheckpointError(f"state key {path!r}: two entries of the state have this key path (a key holding "
                                  "'/' beside nested dicts, or keys 1 and '1'): rename one")
        self._paths.add(path)
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            why = self._refusal(obj) if self._refusal is not None else None
            if why:
                raise CheckpointError(f"state key {path!r}: {why}")
            seen.add(path)
            buf = self._dtensor_buffer(path, obj)
            pairs.append((buf.to_local(), obj.to_local().detach()))
            return buf
        if isinstance(obj, torch.Tensor):
            _refuse_subclass(obj, path)
            why = _no_data(obj) or (self._refusal(obj) if self._refusal is not None else None)
            if why:
                raise CheckpointError(f"state key {path!r}: {why}")
            if obj.layout != torch.strided or obj.is_quantized or type(obj) is not torch.Tensor \
                    and not isinstance(obj, torch.nn.Parameter):
                return obj.detach().to("cpu", copy=True)
            seen.add(path)
            buf = self._buffer(path, obj)
            pairs.append((buf, obj.detach()))
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
            "(state_dicts may hold tensors, DTensors, numbers, strings, bytes, None, torch dtypes, devices and sizes, "
            "and dicts/lists/tuples of them)"
        )
