"""Retrying transient faults: exponential backoff with full jitter, bounded in attempts and in total time (a
deadline per call); then a StorageError. Each retry is logged once (logger ``fastio.storage``, WARNING) with
the URL and the attempt count, so a store that stalls is never silent."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from fastio.errors import StorageError

__all__ = ["Permanent", "Transient", "log", "retrying"]

T = TypeVar("T")

log = logging.getLogger("fastio.storage")


class Transient(Exception):
    """A fault that retrying may cure (5xx, 503 SlowDown, timeout, connection cut); the adapter raises it."""


class Permanent(Exception):
    """A fault retrying cannot cure (403, 404, bad request); ``missing`` is True for 404, ``precondition``
    for a refused conditional write (412)."""

    def __init__(self, message: str, missing: bool = False, precondition: bool = False):
        super().__init__(message)
        self.missing, self.precondition = missing, precondition


class _Overdue(Exception):
    """An attempt still running when the deadline came (it is left to end by its own timeout)."""


def _call_within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` in a helper thread, waited for at most ``seconds``; :class:`_Overdue` after that."""
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # handed to the caller
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name="fastio-storage-call", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise _Overdue
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def retrying(fn: Callable[[], T], *, url: str, what: str, retries: int, backoff_s: float, backoff_max_s: float,
             deadline_s: float | None = None, attempt_s: float | None = None, rng: random.Random | None = None,
             on_retry: Callable[[int, Exception], None] | None = None) -> T:
    """``fn()``, retried after a :class:`Transient` up to ``retries`` times, sleeping a random time in
    ``[0, min(backoff_max_s, backoff_s * 2**attempt)]`` between tries ("full jitter").

    ``deadline_s`` bounds the whole call, attempts and sleeps together: no retry sleeps past it, and an attempt
    that could run past it (``attempt_s``, the longest one attempt can take, is more than the time left; None:
    unknown) is waited for only until then. Raises StorageError naming ``url`` on a :class:`Permanent` fault
    (at once), when the retries are spent, or at the deadline. Every retry logs one warning.
    """
    rng = rng or random.Random()
    started = time.monotonic()
    attempt = 0
    while True:
        left = None if deadline_s is None else deadline_s - (time.monotonic() - started)
        try:
            if left is not None and (attempt_s is None or attempt_s > left):
                return _call_within(fn, left)
            return fn()
        except Permanent as err:
            raise StorageError(f"{url}: {what} failed: {err}", url=url, missing=err.missing,
                               precondition=err.precondition) from None
        except (Transient, _Overdue) as err:
            elapsed = time.monotonic() - started
            reason = "no answer before the deadline" if isinstance(err, _Overdue) else str(err)
            delay = rng.uniform(0, min(backoff_max_s, backoff_s * (2 ** attempt)))
            if isinstance(err, _Overdue) or (deadline_s is not None and elapsed + delay >= deadline_s):
                raise StorageError(f"{url}: {what} failed after {attempt + 1} attempts in {elapsed:.1f} s "
                                   f"(deadline_s={deadline_s:g}): {reason}", url=url, transient=True) from None
            if attempt >= retries:
                raise StorageError(f"{url}: {what} failed after {attempt + 1} attempts: {reason}", url=url,
                                   transient=True) from None
            log.warning("fastio: %s: %s failed (attempt %d of %d, %.1f s so far): %s; retrying in %.1f s",
                        url, what, attempt + 1, retries + 1, elapsed, reason, delay)
            if on_retry is not None:
                on_retry(attempt, err)
            time.sleep(delay)
            attempt += 1
