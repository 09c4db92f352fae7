"""Writing a file past the page cache (Linux ``O_DIRECT``), through one aligned buffer per thread, reused.

A buffered write of a checkpoint fills fresh page-cache pages with a copy of every byte; on a small or virtualised
host the kernel's work for those pages (allocating them, copying, writing them back) is most of the write's CPU, and
it runs beside the training thread. ``O_DIRECT`` hands the device the bytes from the caller's buffer instead, and no
page of the file is cached. ``O_DIRECT`` needs the buffer's address, the file offset and the length aligned to
:data:`ALIGN`: bytes whose address lies as far past a page boundary as their file offset does (``placed``) are written
from where they are, but for their unaligned head and tail; others are copied into aligned buffers of
:data:`CHUNK_BYTES` (copied by numpy, which releases the GIL for it: a ``memoryview`` copy holds it, and the training
thread waited) and written from there. Each write returns once the device has it (the next bytes are copied
meanwhile); the caller still fsyncs (the device's cache, the file's size and metadata). :attr:`DirectFile.misplaced`
says where bytes of :data:`PLACE_BYTES` or more were copied for want of a placement, so that the buffers they came
from can be placed for the next write (:class:`fastio.checkpoint.staging.Stager`).

Where the file system refuses ``O_DIRECT`` (tmpfs, some FUSE file systems), :func:`open_direct` returns None and the
caller writes as before.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

__all__ = ["ALIGN", "CHUNK_BYTES", "PLACE_BYTES", "DirectFile", "open_direct"]

ALIGN = 4096
"""The alignment of every ``O_DIRECT`` write's buffer, offset and length: a page, at least any device's logical
block."""

CHUNK_BYTES = 8 << 20
"""Bytes per ``O_DIRECT`` write, and the size of each of a writing thread's two aligned buffers (allocated at its first
direct write, kept for the thread's life)."""

PLACE_BYTES = 64 << 10
"""Bytes given at once from which a wrong placement is reported (:attr:`DirectFile.misplaced`): fewer are copied for
less than the page or two a placed buffer costs."""

_buffers = threading.local()


def _buffers_of_thread() -> tuple[mmap.mmap, mmap.mmap]:
    """This thread's two aligned buffers (anonymous mappings: page-aligned), made at its first direct write."""
    bufs = getattr(_buffers, "pair", None)
    if bufs is None:
        bufs = _buffers.pair = (mmap.mmap(-1, CHUNK_BYTES), mmap.mmap(-1, CHUNK_BYTES))
    return bufs


def open_direct(path: str) -> int | None:
    """A new (or truncated) file at ``path`` opened for ``O_DIRECT`` writes; None where the platform or the file
    system refuses ``O_DIRECT`` (the caller then writes through the page cache). Other errors raise."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o644)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class DirectFile:
    """Appends bytes to an ``O_DIRECT`` file descriptor: placed bytes (address and file offset alike modulo
    :data:`ALIGN`) from where they are, the rest through aligned chunks of :data:`CHUNK_BYTES`, two buffers in turn.
    Each write runs on a thread of the file's own (blocked in the device's write, no CPU, the GIL released) while the
    caller copies into the other buffer, one write in flight. :meth:`finish` writes the last partial chunk (padded to
    :data:`ALIGN`) and cuts the file to the bytes given; :meth:`close` (always) waits for the write in flight. The
    descriptor stays the caller's; the bytes given must not change until :meth:`finish` returns.

    ``copied``: the bytes that went through the buffers. ``misplaced``: ``(address, nbytes, phase)`` of each run of at
    least :data:`PLACE_BYTES` given at once and copied whole because its address was not ``phase`` past a page
    boundary, as its file offset is; ``placed``: the same of each such run written from where it is."""

    def __init__(self, fd: int):
        self.fd = fd
        bufs = _buffers_of_thread()
        self.views = [memoryview(buf) for buf in bufs]
        self.arrays = [np.frombuffer(buf, dtype=np.uint8) for buf in bufs]  # copies into them release the GIL
        self.current, self.fill, self.size, self.copied = 0, 0, 0, 0
        self.misplaced: list[tuple[int, int, int]] = []
        self.placed: list[tuple[int, int, int]] = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fastio-direct-write")
        self.pending: Future | None = None

    def write(self, data: memoryview) -> None:
        """Append ``data`` (a flat byte view)."""
        n = data.nbytes
        if not n:
            return
        src = np.frombuffer(data, dtype=np.uint8)
        address, head = src.ctypes.data, -self.size % ALIGN
        if (address - self.size) % ALIGN or n - head < ALIGN:
            if n >= PLACE_BYTES:
                self.misplaced.append((address, n, self.size % ALIGN))
            self._copy(src)
        else:  # placed: the head completes the buffer's last block, the aligned body is written from where it is
            if n >= PLACE_BYTES:
                self.placed.append((address, n, self.size % ALIGN))
            body = (n - head) // ALIGN * ALIGN
            self._copy(src[:head])
            if self.fill:
                self._hand_off(self.fill)
            self._wait()
            self.pending = self.pool.submit(_write_all, self.fd, data[head:head + body])
            self.size += body
            self._copy(src[head + body:])

    def finish(self) -> int:
        """Write what is left, wait for it, and cut the file to its size; the number of bytes written."""
        if self.fill:
            padded = -(-self.fill // ALIGN) * ALIGN
            self.arrays[self.current][self.fill:padded] = 0
            self._hand_off(padded)
        self._wait()
        if self.size % ALIGN:
            os.ftruncate(self.fd, self.size)
        return self.size

    def close(self) -> None:
        """Wait for the write in flight (its error, if :meth:`finish` did not raise it, is dropped: the caller is
        raising already) and let the buffers go back to the thread."""
        try:
            if self.pending is not None:
                self.pending.exception()
        finally:
            self.pool.shutdown(wait=True)
            self.arrays = []
            for view in self.views:
                view.release()

    def _copy(self, src: np.ndarray) -> None:
        """Append ``src`` through the buffers, each written as it fills."""
        pos, n = 0, src.size
        while pos < n:
            take = min(CHUNK_BYTES - self.fill, n - pos)
            self.arrays[self.current][self.fill:self.fill + take] = src[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == CHUNK_BYTES:
                self._hand_off(CHUNK_BYTES)
        self.size += n
        self.copied += n

    def _hand_off(self, nbytes: int) -> None:
        """Start writing the current buffer's first ``nbytes`` (whole blocks) and turn to the other buffer, once the
        write before is done."""
        self._wait()
        self.pending = self.pool.submit(_write_all, self.fd, self.views[self.current][:nbytes])
        self.current, self.fill = 1 - self.current, 0

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:  # a short O_DIRECT write returns whole blocks: the rest stays aligned
        done += os.write(fd, view[done:])
