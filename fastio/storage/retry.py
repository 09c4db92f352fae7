"""Retrying transient faults: exponential backoff with full jitter, bounded in total time (a deadline per call)
and, if asked, in attempts; then a StorageError.

A store that stalls is never silent, and an outage is not one line per attempt: the first retry while a store
(``s3://BUCKET``) is failing logs one WARNING on logger ``fastio.storage`` naming the URL, the fault and the
deadline; the retries after it, of that call or of others failing at the same time, log at DEBUG; and when
the last of those calls gets its answer, one more WARNING says the store answers again, after how long and
how many retries."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from fastio.errors import StorageError
from fastio.words import count

__all__ = ["Permanent", "Transient", "log", "retrying", "store_of"]

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


def store_of(url: str) -> str:
    """The store a URL is on, as outages are tracked and logged: ``s3://bucket/a/b`` -> ``s3://bucket``."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.split('/', 1)[0]}" if sep else url


class _Outages:
    """The calls now retrying, per store: the first one's retry starts an outage (one warning), the last one's
    answer ends it (one warning)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}  # store -> [calls retrying, started (monotonic), retries]

    def retry(self, store: str, first: bool) -> bool:
        """Count one retry (``first``: the call's first); True when it starts the store's outage."""
        with self._lock:
            state = self._open.get(store)
            if state is None:
                self._open[store] = [1, time.monotonic(), 1]
                return True
            state[0] += first
            state[2] += 1
            return False

    def done(self, store: str, answered: bool) -> None:
        """A call that retried ended (``answered``: it got its answer); the last one's answer is logged."""
        with self._lock:
            state = self._open.get(store)
            if state is None:
                return
            state[0] -= 1
            if state[0] > 0:
                return
            del self._open[store]
        if answered:
            log.warning("fastio: %s answers again after %.1f s (%s)", store, time.monotonic() - state[1],
                        count(state[2], "retry", "retries"))


_outages = _Outages()


def retrying(fn: Callable[[], T], *, url: str, what: str, retries: int | None, backoff_s: float,
             backoff_max_s: float, deadline_s: float | None = None, attempt_s: float | None = None,
             rng: random.Random | None = None, on_retry: Callable[[int, Exception], None] | None = None) -> T:
    """``fn()``, retried after a :class:`Transient` up to ``retries`` times (None: until ``deadline_s``), sleeping
    a random time in ``[0, min(backoff_max_s, backoff_s * 2**attempt)]`` between tries ("full jitter").

    ``deadline_s`` bounds the whole call, attempts and sleeps together: no retry sleeps past it, and an attempt
    that could run past it (``attempt_s``, the longest one attempt can take, is more than the time left; None:
    unknown) is waited for only until then. Raises StorageError naming ``url`` on a :class:`Permanent` fault
    (at once), when the retries are spent, or at the deadline. Logging: see the module docstring.
    """
    if retries is None and deadline_s is None:
        raise ValueError("retrying needs retries or deadline_s, got neither")
    store, retried = store_of(url), []
    try:
        result = _attempts(fn, url, what, retries, backoff_s, backoff_max_s, deadline_s, attempt_s,
                           rng or random.Random(), on_retry, retried)
    except BaseException:
        if retried:
            _outages.done(store, answered=False)
        raise
    if retried:
        _outages.done(store, answered=True)
    return result


def _attempts(fn, url, what, retries, backoff_s, backoff_max_s, deadline_s, attempt_s, rng, on_retry, retried):
    """:func:`retrying`'s loop; appends to ``retried`` at each retry."""
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
                raise StorageError(f"{url}: {what} failed after {count(attempt + 1, 'attempt')} in {elapsed:.1f} s "
                                   f"(deadline_s={deadline_s:g}): {reason}", url=url, transient=True) from None
            if retries is not None and attempt >= retries:
                raise StorageError(f"{url}: {what} failed after {count(attempt + 1, 'attempt')}: {reason}", url=url,
                                   transient=True) from None
            retried.append(attempt)
            _log_retry(url, what, attempt, retries, deadline_s, elapsed, reason, delay)
            if on_retry is not None:
                on_retry(attempt, err)
            time.sleep(delay)
            attempt += 1


def _log_retry(url: str, what: str, attempt: int, retries: int | None, deadline_s: float | None, elapsed: float,
               reason: str, delay: float) -> None:
    """One WARNING for the retry that starts the store's outage, DEBUG for every other."""
    store = store_of(url)
    of = "" if retries is None else f" of {retries + 1}"
    bound = " or ".join([*([count(retries, "retry", "retries")] if retries is not None else []),
                         *([f"deadline_s={deadline_s:g}"] if deadline_s is not None else [])])
    if _outages.retry(store, first=attempt == 0):
        log.warning("fastio: %s: %s failed (attempt %d%s, %.1f s so far): %s; retrying in %.1f s, each request "
                    "until %s (further retries on %s are logged at DEBUG, its recovery here)", url, what,
                    attempt + 1, of, elapsed, reason, delay, bound, store)
    else:
        log.debug("fastio: %s: %s failed (attempt %d%s, %.1f s so far): %s; retrying in %.1f s", url, what,
                  attempt + 1, of, elapsed, reason, delay)
