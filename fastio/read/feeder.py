"""The DALI external-source callback: hands the graph the inputs of the next batch, reading ahead of it.

A :class:`Feeder` is a stream of batches that starts at a position ``(epoch, start)`` and runs on
through the following epochs by itself (the plan of epoch ``e + 1`` follows the last batch of epoch
``e``), so that one DALI pipeline serves the Loader's whole life and the first batches of the next
epoch are read and decoded while the training loop finishes the current one. Each call takes the
stream's next batch, waits for its bytes (read in the reader's threads, ``read_ahead`` batches ahead)
and returns the graph's inputs (the ``feed`` of the kind's graph, :class:`fastio.pipelines.GraphDef`; the Loader gives
DALI's tensors of them, :func:`fastio.pipelines.base.dali_inputs`). It keeps what it fed, with the inputs it handed
over (the graph reads them in place, without a copy; the feeder's is the last reference, so DALI's threads never take
the interpreter lock to let go of them), oldest first, until the Loader takes it
(:meth:`Feeder.delivered`) to pair it with the graph's outputs. It gets everything it needs as
arguments and knows nothing of the Loader.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastio.order.sampler import EpochPlan
from fastio.read.reader import ReadBatch, Reader

__all__ = ["Fed", "Feeder"]


@dataclass(frozen=True)
class Fed:
    """One batch of the stream: its bytes (and dataset-wide indices), its padding mask and its position."""

    batch: ReadBatch
    padded: np.ndarray
    epoch: int
    """The epoch it belongs to."""
    start: int
    """Global samples of that epoch consumed before it (the Loader's ``consumed`` when it is next)."""
    consumed: int
    """Global samples of that epoch consumed once it is delivered."""
    last: bool
    """Whether it is the last batch of its epoch."""

    @property
    def indices(self) -> np.ndarray:
        return self.batch.indices


@dataclass(frozen=True)
class _Slot:
    plan: EpochPlan
    g: int
    read: Future
    padded: np.ndarray


@dataclass(frozen=True)
class _InGraph:
    """A batch handed to the graph, with the very arrays handed over: DALI reads them in place
    (``no_copy``), so they are kept until the batch's outputs come back."""

    fed: Fed
    inputs: tuple


class Feeder:
    """The ``source`` of a pipeline's DALI graph (:func:`fastio.pipelines.build_graph`): the batches from
    ``(epoch, start)`` on.

    Args:
        reader: reads the bytes of each batch (``submit(ids) -> Future[ReadBatch]``: a :class:`Reader`, a mixture's
            ``MixReader`` or a pipeline's own reader of its units; its threads do the reading ahead). A reader with
            ``prepare(read, seed=, epoch=, draws=) -> Future[ReadBatch]`` gets each read future as it is started, with
            its batch's epoch and draw keys (``ReadBatch.draws``), and the batch fed is the one it gives
            (``VideoClips(cpu_fallback=...)``'s decoding).
        plans: ``plans(epoch, start)`` gives the plan of an epoch from a position (``Sampler.plan``); its
            batches are looked up a chunk at a time (``EpochPlan.iter_batches``).
        feed: ``feed(read_batch, seed=, epoch=)`` gives the graph's inputs of one batch (a kind's
            ``GraphDef.feed``); None for a kind without a graph (its batches are taken with :meth:`take`).
        seed: seeds the per-sample augmentation parameters (with the epoch and the sample's draw key: its index,
            or for a sample a mixture delivers again in one epoch the plan's ``draw_keys``).
        read_ahead: batches whose reads are started ahead of the one being fed.
        epoch, start: where the stream starts.
        first: batches read until the graph's first output is taken (:meth:`delivered`): the graph's prefetch
            depth, what its first run asks for, so that reads further ahead do not take the cores and the
            interpreter from the first batch's build, read and decode; then ``read_ahead`` ahead at once.
            None: ``read_ahead`` ahead from the start. :meth:`take` called directly (no graph) lifts it.
        first_here: those ``first`` batches are read by the thread that feeds them, as it feeds each (a reader
            with ``deferred(ids) -> Future``, :meth:`Reader.deferred`, and no ``prepare``; others read them in
            their threads): the pipeline's build and its first feeds then run without a reader thread taking
            the interpreter lock from them and back at each ``pread``, and the second batch is read while DALI
            decodes the first (issue 45: the first batch 0.94-1.00 of before over four paired runs, median 0.98).

    The read-ahead stops at the end of the epoch the consumer is in: a batch of a following epoch is read when it
    is asked for (the graph's prefetch runs on into the next epoch) or once the consumer has taken a batch of that
    epoch, so that a loop that stops after an epoch has not read batches it never gets.
    """

    def __init__(self, reader: Reader | Any, plans: Callable[[int, int], EpochPlan], feed: Callable[..., tuple] | None,
                 *, seed: int, read_ahead: int, epoch: int = 0, start: int = 0, first: int | None = None,
                 first_here: bool = False):
        self.reader, self.plans, self.feed = reader, plans, feed
        self.seed, self.read_ahead = seed, read_ahead
        self._cap = first  # reads started before the first output is taken (None: no cap)
        prepare = getattr(reader, "prepare", None)
        self._here = getattr(reader, "deferred", None) if first_here and prepare is None else None
        self._started = 0
        self._epoch = epoch  # the consumer's epoch: reads of later ones start only when asked for
        self._positions = self._walk(epoch, start)
        self._next: tuple[EpochPlan, int, np.ndarray, np.ndarray] | None = None  # taken from _positions, not started
        self._slots: deque[_Slot] = deque()
        self._fed: deque[_InGraph] = deque()

    def _walk(self, epoch: int, start: int) -> Iterator[tuple[EpochPlan, int, np.ndarray, np.ndarray]]:
        empty_epochs, first = 0, True
        while True:
            try:
                plan = self.plans(epoch, start)
            except ValueError:
                if first:
                    raise
                return  # the order ends before this epoch (a mixture's int64 stream): asked for, it is refused
            first = False
            yield from ((plan, g, *batch) for g, batch in enumerate(plan.iter_batches()))
            empty_epochs = 0 if len(plan) else empty_epochs + 1
            if empty_epochs > 1:  # two epochs in a row without a batch: a whole epoch has none
                return
            epoch, start = epoch + 1, 0

    def start(self) -> None:
        """Make sure the reads of the next ``read_ahead + 1`` batches have started (until the first output is
        taken: of the first ``first`` only; of a later epoch than the consumer's: only the one asked for next)."""
        while len(self._slots) <= self.read_ahead and (self._cap is None or self._started < self._cap):
            if self._next is None:
                self._next = next(self._positions, None)
            if self._next is None or (self._slots and self._next[0].epoch > self._epoch):
                return
            (plan, g, indices, padded), self._next = self._next, None
            here = self._here is not None and self._cap is not None  # the first batches (first_here)
            read = self._here(indices) if here else self.reader.submit(indices)
            prepare = getattr(self.reader, "prepare", None)
            if prepare is not None:  # work on the read batch that needs its epoch and draws, done before it is fed
                draws = _draws(plan, g, indices)
                read = prepare(read, seed=self.seed, epoch=plan.epoch, draws=draws)
            self._slots.append(_Slot(plan, g, read, padded))
            self._started += 1

    def take(self) -> Fed:
        """The stream's next batch, once its bytes are read (not recorded as fed: see ``__call__``)."""
        self._cap = None
        return self._reached(self._take())

    def _reached(self, fed: Fed) -> Fed:
        """``fed``, taken by the consumer: in a later epoch, the read-ahead goes on into it."""
        if fed.epoch > self._epoch:
            self._epoch = fed.epoch
            self.start()
        return fed

    def _ready(self) -> bool:
        """Whether the stream has a next batch, its read started (asked for more than ``first`` before the first
        output, the cap goes)."""
        self.start()
        if not self._slots and self._cap is not None:
            self._cap = None
            self.start()
        return bool(self._slots)

    def _take(self) -> Fed:
        if not self._ready():
            raise StopIteration
        slot = self._slots.popleft()
        self.start()  # keep read_ahead batches being read while this one is waited for and used
        plan, g = slot.plan, slot.g
        start = plan.start if g == 0 else plan.consumed_after(g - 1)
        batch = slot.read.result()
        if isinstance(batch, ReadBatch):
            batch.draws = _draws(plan, g, batch.indices)
        return Fed(batch, slot.padded, plan.epoch, start, plan.consumed_after(g), g == len(plan) - 1)

    def __call__(self) -> tuple:
        fed = self._take()
        inputs = self.feed(fed.batch, seed=self.seed, epoch=fed.epoch)
        self._fed.append(_InGraph(fed, inputs))
        return inputs

    def next_position(self) -> tuple[int, int] | None:
        """``(epoch, start)`` of the batch the consumer gets next: the oldest fed one, else the next to
        feed; None when the stream has ended."""
        if self._fed:
            return self._fed[0].fed.epoch, self._fed[0].fed.start
        if not self._ready():
            return None
        plan, g = self._slots[0].plan, self._slots[0].g
        return plan.epoch, plan.start if g == 0 else plan.consumed_after(g - 1)

    def next_is_read(self) -> bool:
        """Whether the next batch to feed has its bytes (a call now would wait for no read)."""
        return self._ready() and self._slots[0].read.done()

    def delivered(self) -> Fed:
        """The oldest batch fed to the graph and not yet taken: the one its next output belongs to (its
        inputs are let go: the graph is done with them once it returned that output); from then on
        ``read_ahead`` batches are read ahead (started now, while the training loop uses this one)."""
        if self._cap is not None:
            self._cap = None
            self.start()
        return self._reached(self._fed.popleft().fed)

    def in_flight(self) -> list[Fed]:
        """Batches fed to the graph and not yet taken, oldest first."""
        return [f.fed for f in self._fed]

    def cancel(self) -> None:
        """Cancel the reads not started yet (running ones finish in the reader's threads)."""
        for slot in self._slots:
            slot.read.cancel()
        self._slots.clear()


def _draws(plan: EpochPlan | Any, g: int, indices: np.ndarray) -> np.ndarray | None:
    """The draw keys of batch ``g`` of ``plan`` (delivered as ``indices``): its ``draw_keys``, None for a plan without
    them (packed sequences draw nothing)."""
    draw_keys = getattr(plan, "draw_keys", None)
    return None if draw_keys is None else draw_keys(g, indices)
