"""One writer per object-store prefix: a lease object kept by conditional writes.

A local directory has :class:`fastio.storage.lock.DirLock` (the kernel drops an ``flock`` when its holder dies); an
object store has no such thing, so a writer holds ``PREFIX/.fastio-lock`` as a *lease*:

- **Acquire**: create the object only if there is none (``If-None-Match: *``). Its JSON body names the holder
  (purpose, host, pid, Slurm job and restart count, since) and when the lease expires by the holder's clock.
- **Hold**: a daemon thread renews it every ``ttl_s / 3`` by rewriting it only if its entity tag is still the
  one this holder wrote (``If-Match``). :meth:`Lease.check` raises :class:`LeaseLostError` once a renewal was
  refused (someone else wrote the object: it was taken over) or when no renewal has succeeded for ``ttl_s``
  (another writer may judge it expired); :meth:`Lease.confirm` renews at once and raises the same way. A
  writer confirms before each step that must be its own (an upload, a deletion, the final marker).
- **Take over** a lease found in place only when it is stale: its holder recorded an expiry more than
  ``skew_s`` ago *and* the server last saw it renewed more than ``ttl_s + skew_s`` ago (so a clock that runs
  ahead on one host alone cannot steal a live lease); or it was written on this host by a process that is gone;
  or by an earlier run of this Slurm job (same ``SLURM_JOB_ID``, lower ``SLURM_RESTART_COUNT``: a requeue; two
  steps of one allocation running at once are still refused); or it is not a lease at all: a body without the
  holder's token and expiry that every lease carries (a local directory's lock file, which
  :class:`~fastio.storage.lock.DirLock` leaves behind, uploaded by ``aws s3 sync`` of a converted folder). The
  take-over is itself conditional (``If-Match`` on the entity tag that was judged), so of two contenders one
  wins. Otherwise
  :class:`~fastio.storage.lock.LockedError` names the URL and the holder.
- **Release**: renew once more (which proves the lease is still ours and pushes its expiry ahead), then delete.
  A lease that was lost is never deleted.

A retried conditional write can be refused by an earlier attempt of the same write whose response was lost;
every refusal is therefore checked against what is stored (the bodies are unique per write).

Stores that ignore conditional writes (old MinIO, some Ceph RGW releases) would let two writers in silently:
right after acquiring, the lease writes twice more with conditions that must fail (create again; match a
made-up entity tag). If either succeeds the lease is removed and a StorageError says so; such stores need
``lease_ttl_s=0`` (no lease: one writer per prefix is then the caller's business).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

from fastio.dist import process_gone
from fastio.errors import FastioError, StorageError
from fastio.storage.base import S3Storage, Versioned
from fastio.storage.lock import LOCK_NAME, LockedError, describe_holder, holder_record

__all__ = ["Lease", "LeaseLostError", "writer_lease"]

log = logging.getLogger(__name__)

_NO_SUCH_ETAG = '"fastio-lease-probe-00000000000000000000"'

_left_here: dict[str, str] = {}
"""Lease URL -> the token of a lease this process held and could not release (its delete failed): this process may
take it back at once (:meth:`Lease._stale`)."""


class LeaseLostError(FastioError):
    """A lease this process held was taken over by another writer, or could not be renewed in time."""


def _restart_count() -> int:
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def _pid_gone(pid: object) -> bool:
    """True when ``pid`` (a lease's, read from a store) names no live process on this host (a zombie counts as
    gone); a value that is no pid never does."""
    return isinstance(pid, int) and pid > 0 and process_gone(pid)


def _parse(data: bytes) -> dict | None:
    try:
        info = json.loads(data)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _is_lease(info: dict | None) -> bool:
    """Whether a lease object's parsed body is one this protocol wrote (:meth:`Lease._body`: a holder's token and
    expiry); a DirLock's file (:func:`~fastio.storage.lock.holder_record` alone) or anything else is not."""
    return isinstance(info, dict) and isinstance(info.get("token"), str) and bool(info["token"]) \
        and "expires" in info


class Lease:
    """Exclusive use of an object-store prefix by one process; ``acquire``/``release`` or a context manager.

    Args:
        storage: the prefix (an :class:`~fastio.storage.base.S3Storage`).
        key: the lease object's key under the prefix (default ``.fastio-lock``, the name DirLock uses).
        purpose: what the holder does, shown to a refused writer (``"fastio convert"``).
        ttl_s, skew_s: default the storage options' ``lease_ttl_s`` and ``lease_skew_s``.
    """

    def __init__(self, storage: S3Storage, *, key: str = LOCK_NAME, purpose: str = "fastio",
                 ttl_s: float | None = None, skew_s: float | None = None):
        if not isinstance(storage, S3Storage):
            raise TypeError("Lease guards object-store prefixes; local directories use fastio.storage.lock.DirLock")
        self.storage, self.key, self.purpose = storage, key, purpose
        self.ttl_s = float(storage.options.lease_ttl_s if ttl_s is None else ttl_s)
        self.skew_s = float(storage.options.lease_skew_s if skew_s is None else skew_s)
        if self.ttl_s < 1 or self.skew_s < 0:
            raise ValueError(f"Lease needs ttl_s >= 1 and skew_s >= 0, got {self.ttl_s}, {self.skew_s}")
        self.url = storage.url_of(key)
        self._etag: str | None = None
        self._lost: str | None = None
        self._renewed_at = 0.0  # monotonic time at which the last successful write was sent
        self._since = 0.0
        self._token = ""
        self._mutex = threading.Lock()  # one write at a time: the heartbeat's and release's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._etag is not None

    @property
    def lost(self) -> str | None:
        """Why the lease was found lost (taken over, deleted by someone else); None while it is not known lost
        (a lease not renewed during an outage is not known lost: :meth:`confirm` finds out)."""
        return self._lost

    # ------------------------------------------------------------------ acquire
    def acquire(self) -> Lease:
        """Take the lease, or take over a stale one, or raise :class:`~fastio.storage.lock.LockedError` at once."""
        if self._etag is not None:
            return self
        self._token, self._since, self._lost = uuid.uuid4().hex, time.time(), None
        for _ in range(5):  # each round ends in a win or a refusal unless the object changed under us
            sent, body = time.monotonic(), self._body()
            try:
                etag = self.storage.put_if(self.key, body, if_absent=True)
            except StorageError as err:
                if not err.precondition:
                    raise
                found = self.storage.get_versioned(self.key)
                if found is None:
                    continue  # released in between: create again
                if found.data == body:  # our own create landed; its response did not
                    etag = found.e_tag
                else:
                    etag = self._take_over(found, body)
                    if etag is None:
                        continue
            self._etag, self._renewed_at = etag, sent
            _left_here.pop(self.url, None)
            self._probe(body)
            self._stop.clear()
            self._thread = threading.Thread(target=self._heartbeat, name="fastio-lease", daemon=True)
            self._thread.start()
            return self
        raise LockedError(f"{self.storage.url}: the lease {self.key} keeps changing under this writer "
                          f"(several writers contend); now held by {self._holder(self.storage.get_versioned(self.key))}")

    def _take_over(self, found: Versioned, body: bytes) -> str | None:
        """Replace a stale ``found`` with ``body`` (its new entity tag); None if it changed meanwhile."""
        info = _parse(found.data)
        why = self._stale(info, found)
        if why is None:
            raise LockedError(f"{self.storage.url}: in use by {describe_holder(info)} (one writer per prefix; its "
                              f"lease {self.key} expires {self._ttl_of(info):g} s after its holder stops renewing "
                              "it)")
        try:
            etag = self.storage.put_if(self.key, body, if_match=found.e_tag)
        except StorageError as err:
            if not err.precondition:
                raise
            again = self.storage.get_versioned(self.key)
            if again is None or again.data != body:
                return None
            etag = again.e_tag
        log.warning("fastio: %s: took over the lease of %s (%s)", self.storage.url, describe_holder(info), why)
        return etag

    def _ttl_of(self, info: dict | None) -> float:
        try:
            return float((info or {}).get("ttl_s", self.ttl_s))
        except (TypeError, ValueError):
            return self.ttl_s

    def _stale(self, info: dict | None, found: Versioned) -> str | None:
        """Why the lease ``found`` may be taken over, or None while its holder may still be writing."""
        if not _is_lease(info):
            return ("it is not a lease (no holder's token and expiry: a local directory's lock file copied here, e.g. "
                    "by aws s3 sync)")
        me = holder_record(self.purpose)
        job, host, pid = info.get("slurm_job"), info.get("host"), info.get("pid")
        try:
            restart = int(info.get("restart", 0))
        except (TypeError, ValueError):
            restart = 0
        if job and job == me["slurm_job"] and restart < _restart_count():
            return f"Slurm job {job} was requeued (restart {_restart_count()}, the holder ran as restart {restart})"
        if host == me["host"] and _pid_gone(pid):
            return f"pid {pid} on {host} has exited"
        if host == me["host"] and pid == os.getpid() and _left_here.get(self.url) == info["token"]:
            return "this process's own, left by a release that failed"
        now, ttl = time.time(), self._ttl_of(info)
        try:
            expires = float(info.get("expires", 0))
        except (TypeError, ValueError):
            expires = 0.0
        renewed = found.last_modified.timestamp()
        if now > expires + self.skew_s and now > renewed + ttl + self.skew_s:
            return f"expired {now - max(expires, renewed + ttl):.0f} s ago without renewal"
        return None

    def _probe(self, body: bytes) -> None:
        """Refuse stores that ignore conditional writes (both writes below must be refused)."""
        for what, kwargs in (("If-None-Match", {"if_absent": True}), ("If-Match", {"if_match": _NO_SUCH_ETAG})):
            try:
                self._etag = self.storage.put_if(self.key, body, **kwargs)
            except StorageError as err:
                if err.precondition:
                    continue
                self._abandon()
                raise
            self._abandon()
            raise StorageError(f"{self.storage.url}: the store ignores conditional writes ({what}), so fastio cannot "
                               "keep one writer per prefix there; pass storage_options lease_ttl_s=0 to write without "
                               "a lease and make sure no two jobs write this prefix at once", url=self.url)

    def _abandon(self) -> None:
        try:
            self.storage.delete(self.key)
        except StorageError:
            pass
        self._etag = None

    def _holder(self, found: Versioned | None) -> str:
        return "nobody" if found is None else describe_holder(_parse(found.data))

    # ------------------------------------------------------------------ hold
    def _body(self) -> bytes:
        now = time.time()
        info = holder_record(self.purpose)
        info.update(since=self._since, restart=_restart_count(), ttl_s=self.ttl_s, renewed=now,
                    expires=now + self.ttl_s, token=self._token)
        return json.dumps(info, sort_keys=True).encode()

    def _renew(self) -> None:
        """Rewrite the lease if it is still ours (caller holds ``_mutex``); LeaseLostError if it is not."""
        if self._etag is None or self._lost:
            return
        sent, body = time.monotonic(), self._body()
        try:
            etag = self.storage.put_if(self.key, body, if_match=self._etag)
        except StorageError as err:
            if not err.precondition:
                raise
            found = self.storage.get_versioned(self.key)
            if found is not None and found.e_tag == self._etag:  # unchanged: refused for a concurrent write (409)
                raise StorageError(f"{self.url}: renewal refused while the lease is unchanged ({err})", url=self.url,
                                   transient=True) from None
            if found is None or found.data != body:
                self._lost = "deleted by someone else" if found is None else \
                    f"taken over by {self._holder(found)}"
                raise LeaseLostError(f"{self.storage.url}: lease lost: {self._lost}") from None
            etag = found.e_tag
        self._etag, self._renewed_at = etag, sent

    def _heartbeat(self) -> None:
        interval = self.ttl_s / 3
        wait = interval
        while not self._stop.wait(wait):
            try:
                with self._mutex:
                    if self._stop.is_set():
                        return
                    self._renew()
                wait = interval
            except LeaseLostError as err:
                log.error("fastio: %s", err)
                return
            except Exception as err:  # noqa: BLE001 - a store fault: try again soon; check() tells the writer
                log.warning("fastio: %s: lease renewal failed (%s); retrying", self.url, err)
                wait = max(0.2, interval / 4)

    def confirm(self) -> None:
        """Renew now: :class:`LeaseLostError` if the lease was lost or is found taken over (a StorageError
        if the store cannot be reached within the retries)."""
        self._check_held()
        with self._mutex:
            self._renew()
        self.check()

    def _check_held(self) -> None:
        if self._lost:
            raise LeaseLostError(f"{self.storage.url}: lease lost: {self._lost}")
        if self._etag is None:
            raise LeaseLostError(f"{self.storage.url}: the lease {self.key} is not held")

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the lease is held and was renewed within ``ttl_s`` (no request)."""
        self._check_held()
        age = time.monotonic() - self._renewed_at
        if age > self.ttl_s:
            raise LeaseLostError(f"{self.storage.url}: lease not renewed for {age:.0f} s (ttl {self.ttl_s:g} s): "
                                 "another writer may have taken over")

    # ------------------------------------------------------------------ release
    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours (never raises: a lease that cannot be
        deleted expires by itself)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._mutex:
            if self._etag is None:
                return
            try:
                if not self._lost:
                    self._renew()  # still ours, and fresh: nobody can judge it stale before the delete
                    self.storage.delete(self.key)
            except LeaseLostError as err:
                log.warning("fastio: %s: lease not released (%s)", self.url, err)
            except StorageError as err:  # still ours on the store: this process may take it back (_stale)
                _left_here[self.url] = self._token
                log.warning("fastio: %s: lease not released (%s); it expires by itself, and a new writer in this "
                            "process takes it back at once", self.url, err)
            finally:
                self._etag = None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_lease(storage: S3Storage, purpose: str) -> Lease | None:
    """The lease guarding ``storage``'s prefix for one writer (not yet acquired); None when the storage options
    turn leases off (``lease_ttl_s=0``)."""
    return None if storage.options.lease_ttl_s == 0 else Lease(storage, purpose=purpose)
