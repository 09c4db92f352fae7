"""``VideoClips(cpu_fallback="pyav")``'s decoding: the clips of videos DALI's CPU decoder does not read (H.264,
HEVC, ...), decoded on the CPU (:func:`fastio.formats.pyav_clips.decode_clip`) in a bounded pool of threads as
soon as their batch is read, off the thread that feeds the graph; the graph then crops, flips, resizes and
normalises them as it does DALI-decoded clips (:class:`fastio.pipelines.media.VideoClips`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import numpy as np

from fastio.errors import DatasetError
from fastio.formats.media import MediaCheckError
from fastio.formats.pyav_clips import decode_clip

__all__ = ["FallbackReader", "decode_jobs"]

Job = tuple[int, int, np.ndarray, int]
"""One clip to decode: (sample j in the batch, clip c, the video's bytes, its first frame)."""


def decode_jobs(batch: Any, fallback: np.ndarray, starts: np.ndarray) -> list[Job]:
    """The clips of batch ``batch``'s samples flagged in ``fallback``, starting at ``starts[j, c]``."""
    return [(j, c, batch.image[j], int(starts[j, c]))
            for j in np.flatnonzero(fallback).tolist() for c in range(starts.shape[1])]


def run_job(job: Job, frames: int, stride: int, field: str, where: Callable[[], str]) -> np.ndarray:
    """The decoded clip of ``job``; DatasetError naming the sample (``where()``: its shard and key) and its field
    when PyAV cannot decode it."""
    j, c, data, first = job
    try:
        return decode_clip(data.tobytes(), first, frames, stride)
    except MediaCheckError as err:
        raise DatasetError(f"{where()}: field {field!r} {err}") from None


class FallbackReader:
    """Reads batches with ``inner``; :meth:`prepare` (called by the Feeder with each read, its seed, epoch and draws)
    decodes the clips ``plan(batch, seed, epoch)`` names (:func:`decode_jobs`) in its own ``threads`` and puts
    them in ``ReadBatch.frames[(j, c)]``; ``where(i)`` names read-set id ``i``. :meth:`close` cancels what is
    queued and waits for the clips being decoded."""

    def __init__(self, inner: Any, plan: Callable[[Any, int, int], list[Job]], frames: int, stride: int,
                 where: Callable[[int], str], threads: int):
        self.inner, self.plan, self.frames, self.stride, self.where = inner, plan, frames, stride, where
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastio-pyav")

    def submit(self, ids: np.ndarray) -> Future:
        return self.inner.submit(ids)

    def prepare(self, read: Future, *, seed: int, epoch: int, draws: np.ndarray | None = None) -> Future:
        """A future of ``read``'s batch with its clips decoded: started in the thread that finishes the read, its
        ``draws`` (the Feeder's: the keys its clip starts are drawn by, None for its indices) set first. Cancelling
        it (the Feeder's stream dropped: a jump, a close) cancels its clips not yet being decoded."""
        out: Future = Future()  # left pending until settled, so that cancel() works while its clips decode

        def decode(done: Future) -> None:
            if out.cancelled():
                return
            try:
                batch = done.result()
                batch.draws = draws
                jobs = self.plan(batch, seed, epoch)
                futures = [self._pool.submit(run_job, job, self.frames, self.stride, batch.image_field[job[0]],
                                             functools.partial(self.where, int(batch.indices[job[0]])))
                           for job in jobs]
            except BaseException as err:  # a read error passes through; a closed pool too
                _settle(out, error=err)
                return
            out.add_done_callback(lambda f: f.cancelled() and [x.cancel() for x in futures])
            _gather(futures, jobs, batch, out)

        read.add_done_callback(decode)
        return out

    def read_ahead_shards(self, batches) -> None:
        self.inner.read_ahead_shards(batches)

    def close(self) -> None:
        """Its threads (the inner reader is the read set's, closed with it)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _settle(out: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set ``out``'s error or result, unless it was cancelled meanwhile (nobody waits for it then)."""
    try:
        out.set_result(result) if error is None else out.set_exception(error)
    except InvalidStateError:
        pass


def _gather(futures: list[Future], jobs: list[Job], batch: Any, out: Future) -> None:
    """Set ``out`` to ``batch`` with each job's clip in ``batch.frames`` once all are done (the first error,
    in job order, instead); no thread waits for them."""
    if not futures:
        _settle(out, batch)
        return
    left, lock = [len(futures)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for f, (j, c, _data, _first) in zip(futures, jobs):
            if f.cancelled():
                _settle(out, error=CancelledError("the loader was closed"))
                return
            if f.exception() is not None:
                _settle(out, error=f.exception())
                return
            batch.frames[(j, c)] = f.result()
        _settle(out, batch)

    for f in futures:
        f.add_done_callback(one_done)
