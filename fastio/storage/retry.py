"""Retrying transient faults: exponential backoff with full jitter, bounded in attempts; then a StorageError."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from fastio.errors import StorageError

__all__ = ["Permanent", "Transient", "retrying"]

T = TypeVar("T")


class Transient(Exception):
    """A fault that retrying may cure (5xx, 503 SlowDown, timeout, connection cut); the adapter raises it."""


class Permanent(Exception):
    """A fault retrying cannot cure (403, 404, bad request); ``missing`` is True for 404, ``precondition``
    for a refused conditional write (412)."""

    def __init__(self, message: str, missing: bool = False, precondition: bool = False):
        super().__init__(message)
        self.missing, self.precondition = missing, precondition


def retrying(fn: Callable[[], T], *, url: str, what: str, retries: int, backoff_s: float, backoff_max_s: float,
             rng: random.Random | None = None, on_retry: Callable[[int, Exception], None] | None = None) -> T:
    """``fn()``, retried after a :class:`Transient` up to ``retries`` times, sleeping a random time in
    ``[0, min(backoff_max_s, backoff_s * 2**attempt)]`` between tries ("full jitter").

    Raises StorageError naming ``url`` on a :class:`Permanent` fault (at once) or when the retries are spent.
    """
    rng = rng or random.Random()
    attempt = 0
    while True:
        try:
            return fn()
        except Permanent as err:
            raise StorageError(f"{url}: {what} failed: {err}", url=url, missing=err.missing,
                               precondition=err.precondition) from None
        except Transient as err:
            if attempt >= retries:
                raise StorageError(f"{url}: {what} failed after {attempt + 1} attempts: {err}", url=url,
                                   transient=True) from None
            if on_retry is not None:
                on_retry(attempt, err)
            time.sleep(rng.uniform(0, min(backoff_max_s, backoff_s * (2 ** attempt))))
            attempt += 1
