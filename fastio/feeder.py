"""The DALI external-source callback: hands the graph the inputs of a plan's next batch, reading ahead of it.

A :class:`Feeder` serves one epoch plan. Each call takes the plan's next batch, waits for its bytes
(read in the reader's threads, ``read_ahead`` batches ahead) and returns :func:`fastio.pipeline.graph_inputs`.
It keeps what it fed, oldest first, until the Loader takes it (:meth:`Feeder.delivered`) to pair it with the
graph's outputs. It gets everything it needs as arguments and knows nothing of the Loader.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from fastio.pipeline import GraphSpec, graph_inputs
from fastio.reader import ReadBatch, Reader
from fastio.sampler import EpochPlan

__all__ = ["Fed", "Feeder"]


@dataclass(frozen=True)
class Fed:
    """One batch handed to the graph: its bytes (and dataset-wide indices) and its padding mask."""

    batch: ReadBatch
    padded: np.ndarray

    @property
    def indices(self) -> np.ndarray:
        return self.batch.indices


class Feeder:
    """The ``source`` of :func:`fastio.pipeline.build_pipeline` for one epoch plan.

    Args:
        reader: reads the bytes of each batch (its thread pool does the reading ahead).
        plan: the batches to feed, in order.
        spec: the graph being fed.
        fields: the dataset fields fed to the graph (see :func:`fastio.pipeline.input_names`).
        seed: seeds the per-sample augmentation parameters (with the plan's epoch and the sample index).
        read_ahead: batches whose reads are started ahead of the one being fed.
    """

    def __init__(self, reader: Reader, plan: EpochPlan, spec: GraphSpec, fields: Sequence[str], *, seed: int,
                 read_ahead: int):
        self.reader, self.plan, self.spec, self.fields = reader, plan, spec, tuple(fields)
        self.seed, self.read_ahead = seed, read_ahead
        self._next = 0
        self._reads: dict[int, tuple[Future, np.ndarray]] = {}
        self._fed: deque[Fed] = deque()

    def __call__(self) -> tuple:
        g = self._next
        if g >= len(self.plan):
            raise StopIteration
        self._next += 1
        self.start(g)
        future, padded = self._reads.pop(g)
        rb = future.result()
        self._fed.append(Fed(rb, padded))
        return graph_inputs(self.spec, self.fields, rb, seed=self.seed, epoch=self.plan.epoch)

    def start(self, g: int = 0) -> None:
        """Make sure the reads of batches ``g .. g + read_ahead`` have started."""
        for h in range(g, min(g + self.read_ahead + 1, len(self.plan))):
            if h not in self._reads:
                indices, padded = self.plan.batch(h)
                self._reads[h] = (self.reader.submit(indices), padded)

    def delivered(self) -> Fed:
        """The oldest batch fed to the graph and not yet taken: the one its next output belongs to."""
        return self._fed.popleft()

    def in_flight(self) -> list[Fed]:
        """Batches fed to the graph and not yet taken, oldest first."""
        return list(self._fed)

    def cancel(self) -> None:
        """Cancel the reads not started yet (running ones finish in the reader's threads)."""
        for future, _ in self._reads.values():
            future.cancel()
        self._reads.clear()
