"""Loader telemetry: throughput and the data-stall fraction, over the last epoch and overall.

The stall fraction is the time the training loop spent waiting inside ``next(loader)`` divided by
the wall time from the first request to the last delivery (waiting + the loop's own work between
calls). 0 means data was always ready; 1 means the loop did nothing but wait.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastio.words import count

__all__ = ["PROGRESS_EVERY_S", "Stats", "Window"]

PROGRESS_EVERY_S = 5.0
"""With ``progress=True``: seconds between two lines while batches come (and one line at each epoch's end)."""


@dataclass
class Window:
    """Counters over one span of iteration."""

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0  # time between a delivery and the next request (the training loop's work)

    def as_dict(self) -> dict:
        total = self.wait_s + self.busy_s
        return {
            "batches": self.batches,
            "samples": self.samples,
            "seconds": total,
            "samples_per_s": self.samples / total if total > 0 else 0.0,
            "stall_fraction": self.wait_s / total if total > 0 else 0.0,
        }


class Stats:
    """Timing around each ``next()``; ``as_dict()`` gives ``{"last_epoch": ..., "epoch": ..., "overall": ...}``.
    With ``progress`` a line goes to stderr every ``every_s`` seconds and at each epoch's end, ending with
    ``detail()`` if given (the Loader's time spent waiting on storage)."""

    def __init__(self, progress: bool = False, every_s: float = PROGRESS_EVERY_S,
                 detail: Callable[[], str] | None = None):
        self.overall, self.epoch, self.last_epoch = Window(), Window(), Window()
        self.progress, self.every_s, self.detail = progress, every_s, detail
        self._last_return: float | None = None
        self._last_print = time.perf_counter()

    def begin_wait(self) -> float:
        now = time.perf_counter()
        if self._last_return is not None:
            busy = now - self._last_return
            self.overall.busy_s += busy
            self.epoch.busy_s += busy
        return now

    def end_wait(self, started: float, samples: int) -> None:
        now = time.perf_counter()
        wait = now - started
        for w in (self.overall, self.epoch):
            w.wait_s += wait
            w.batches += 1
            w.samples += samples
        self._last_return = now
        if self.progress and now - self._last_print >= self.every_s:
            self._print("")

    def _print(self, what: str) -> None:
        """A progress line to stderr; one that cannot be written (a terminal gone, a closed pipe) is left out: it
        is printed as a batch is delivered, and raised there the batch would be lost."""
        self._last_print = time.perf_counter()
        d = self.epoch.as_dict()
        line = (f"fastio: {what}{count(d['batches'], 'batch', 'batches')}, {d['samples_per_s']:.0f} samples/s, "
                f"stall {100 * d['stall_fraction']:.1f}%{', ' + self.detail() if self.detail else ''}")
        with contextlib.suppress(OSError):
            print(line, file=sys.stderr, flush=True)

    def pause(self) -> None:
        """The loop left the iterator (epoch end, break): time until the next request is not counted."""
        self._last_return = None

    def end_epoch(self) -> None:
        if self.progress and self.epoch.batches:  # at least one line per epoch, however short
            self._print("epoch done: ")
        self.last_epoch, self.epoch = self.epoch, Window()
        self.pause()

    def as_dict(self) -> dict:
        return {"last_epoch": self.last_epoch.as_dict(), "epoch": self.epoch.as_dict(),
                "overall": self.overall.as_dict()}
