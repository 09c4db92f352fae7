"""Futures combined without a thread of their own: :func:`gathered` (a result made from several futures' results,
in the thread that finishes the last of them). A reader's batch read in parts (a mixture's sources) is merged
this way, off the training thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["gathered"]


def gathered(futures: Sequence[Future], combine: Callable[[list[Any]], Any]) -> Future:
    """A future of ``combine(results)`` once every one of ``futures`` is done (their results in order), computed in
    the thread that finishes the last; an error of one of them, or of ``combine``, is its error. Cancelled before
    that, it computes nothing."""
    out: Future = Future()
    left, lock = [len(futures)], threading.Lock()

    def done(_f: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        if not out.set_running_or_notify_cancel():
            return
        try:
            out.set_result(combine([f.result() for f in futures]))
        except BaseException as err:  # a part's read error (DatasetError, StorageError) passes through
            out.set_exception(err)

    for f in futures:
        f.add_done_callback(done)
    return out
