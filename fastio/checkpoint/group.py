"""The ranks of one Checkpointer: every agreement, gather and broadcast it makes, on one named gloo group.

Saves and restores are collectives: if one rank returns or raises early, the others wait forever in the
next collective. So every unit of local work that can fail on one rank (a *phase*: ``"write"``,
``"commit"``, ``"check"``...) runs through :meth:`RankGroup.run`, which always reaches the agreement that
follows it and raises the same :class:`~fastio.errors.CheckpointError` on every rank when any rank failed,
naming the phase and the first failing rank.

A rank that dies (its process ended, its host went down) makes gloo raise ``RuntimeError: Connection closed
by peer`` in the survivors' next collective; :class:`RankGroup` turns that into a CheckpointError naming the
phase and the rank that went away. A rank finds it by process id among the ranks of its own host, and notes
what it found in the default group's store: first note wins, and every survivor names the rank that note names.
So a survivor that already raised and ended its own process is not mistaken for the rank that went away, and a
rank on another host is named by the survivors of that host. Without a note, a rank on another host is named
when it is the only candidate.

Before an operation's first collective, the ranks *enter* it together (:meth:`RankGroup.enter`): one all-reduce on
a gloo group of its own compares a digest of what each rank is about to do (the operation, the directory, the
engine: every rank raises the same CheckpointError naming the first difference) and waits at most
``agree_timeout`` seconds for every rank to arrive. A rank that waits longer than ``ARRIVED_AFTER_S`` notes its
arrival in the default group's store, so the ranks that arrived can name the ones that did not: one warning after
``ABSENT_WARN_S`` (a rank stopped, or busy in a collective of the training's own), then at the deadline one
CheckpointError on every rank that arrived, and the same on a rank that arrives after it (the first verdict
noted in the store stands: the deadline's, or "ok" from a rank that saw everyone arrive).

A rank that did not arrive is told too, although it runs no fastio code then (it may be in a collective of the
training's own, which fails with gloo's ``Connection closed by peer`` once the ranks that gave up stop): each rank
of a group with ``agree_timeout`` watches the group's ``gave-up`` key on a thread of its own, through a connection of
its own to the store (``Store.clone``; the store's wait: no polling). The ranks that give up note their verdict
there; the watcher logs it as one error line, saying that this rank was not in the operation, and keeps it
(:attr:`RankGroup.gave_up`) for this rank's next call, which raises it also when the ranks that gave up have gone.
The ranks that gave up wait up to ``GONE_WAIT_S`` for the absent ranks' watchers to have seen it before they raise.
:meth:`RankGroup.close` (and the end of the process) ends every rank's watch.

Inside an operation the same holds for every gather, broadcast, all-reduce and barrier of the group (not the
engines' own collectives): a rank that has waited ``ARRIVED_AFTER_S`` in one notes its arrival, and after
``ABSENT_WARN_S`` names once, in a warning, the ranks that have neither arrived nor shown that they are busy. A
rank busy in a phase's local work (:meth:`RankGroup.run`, :meth:`RankGroup.collect`) for longer than
``ARRIVED_AFTER_S`` counts a beat in the store every ``ARRIVED_AFTER_S``: a rank whose count stands still over two
looks ``LOOKS_APART_S`` apart is stopped (SIGSTOP, a debugger) or busy outside the Checkpointer, and is named.

``fault_hook`` (module attribute) is a test hook: a callable ``fault_hook(group_name, phase)`` run on this rank at
the end of each phase's local work (it raises to inject a failure of this rank in that phase, or ends the
process to make the rank go away). Production code never sets it.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fastio.checkpoint import agree
from fastio.checkpoint.engines.base import first_line
from fastio.dist import default_store, process_gone
from fastio.errors import CheckpointError, FastioError
from fastio.words import count

__all__ = ["RankGroup"]

log = logging.getLogger(__name__)

T = TypeVar("T")

GONE_WAIT_S = 2.0
"""After a peer closed its connection, how long to wait for a process of this host to be seen as ended, or for
another rank's note of who went away."""

ARRIVED_AFTER_S = 0.5
"""A rank that has waited this long to enter an operation notes its arrival in the store."""

ABSENT_WARN_S = 5.0
"""A rank that has waited this long to enter an operation, or in one of its collectives, names, once, the ranks
that have not arrived."""

LOOKS_APART_S = 1.5
"""Inside an operation, the waiting ranks look at an absent rank's beats (one each ``ARRIVED_AFTER_S`` while it is
busy) this far apart: a count that stood still is a rank that does not run the Checkpointer's work."""

GAVE_UP_CLOSED = "closed"
"""The ``gave-up`` key's value once a rank closed its group: the watchers end."""

ENTRY_FLAGS = 4
"""Flags an entry can OR over the ranks (a fixed number: every rank's all-reduce has the same size)."""

_created = 0
"""Rank groups this process created with more than one rank. Rank 0's count names one group in the store's keys, on
every rank: another rank's count may differ (ranks that made groups before without it, as the saving ranks of an
elastic resume in the same processes)."""

fault_hook: Callable[[str, str], None] | None = None
"""Test hook, see the module docstring."""


class RankGroup:
    """``world`` ranks on a gloo process group of their own, called ``name`` in messages.

    Creating one is a collective over the default group (``dist.new_group``), as is every method except
    :meth:`gone`. With one rank nothing is communicated.
    """

    def __init__(self, name: str, rank: int, world: int, *, agree_timeout: float | None = None):
        self.name, self.rank, self.world = name, rank, world
        self.agree_timeout = agree_timeout
        """Seconds :meth:`enter` waits for every rank (None: this group has no :meth:`enter`)."""
        self.pg = dist.new_group(backend="gloo") if world > 1 else None
        """The process group (None with one rank); engines run their own collectives on it."""
        self._entry_pg = None
        if world > 1 and agree_timeout is not None:  # gloo gives up a little after the deadline: no op lingers
            self._entry_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=agree_timeout + 10))
        self._entries = 0
        self._waits = 0
        """Watched collectives so far: the same count on every rank (each is a collective), naming one in the store."""
        self._noted_entries: list[int] = []
        self._peers: list[tuple[str, int]] = [(socket.gethostname(), os.getpid())]
        self._key = self._gone_key = ""
        if world > 1:
            global _created
            _created += 1
            every = self._collective("start", lambda: self._all_gather((socket.gethostname(), os.getpid(), _created)))
            self._peers = [(host, pid) for host, pid, _ in every]
            host0, pid0, made0 = every[0]
            self._key = f"fastio/rank-group/{host0}/{pid0}/{made0}"
            self._gone_key = f"{self._key}/gone"
        self.gave_up: str | None = None
        """The verdict of ranks that gave up waiting for this one to enter an operation (module docstring)."""
        self._entering = False
        self._gave_up_here = False  # this rank gave up itself: its watch says nothing of the verdict it raised
        self._store = None
        if world > 1 and agree_timeout is not None:
            self._watch_give_ups()

    # ------------------------------------------------------------ the helpers callers use
    def run(self, phase: str, fn: Callable[[], T], *, fail: type[BaseException] | None = None) -> T:
        """Run ``fn`` on this rank, then agree: when ``fn`` raised on any rank, every rank raises the same
        CheckpointError (the first failing rank's one-line reason, naming ``phase`` and that rank). An error
        marked ``elsewhere`` (an engine's agreement: another rank failed) is left to the rank that failed."""
        result: Any = None
        mine: str | None = None
        cause: BaseException | None = None
        try:
            with self._busy():
                result = fn()
                if fault_hook is not None:
                    fault_hook(self.name, phase)
        except Exception as err:  # noqa: BLE001 - reported to every rank below, re-raised with its cause
            cause = err
            if not getattr(err, "elsewhere", False):  # else another rank's failure, which that rank reports
                mine = str(err) if isinstance(err, FastioError) else first_line(err)
        self.check(phase, mine, cause=cause)
        return result

    def collect(self, phase: str, fn: Callable[[], list[str]]) -> list[str]:
        """Every rank's problems (one line each, rank order) from running ``fn`` here; an exception of ``fn``
        is this rank's problem. Nothing is raised: the caller decides (e.g. fall back to an older step)."""
        try:
            with self._busy():
                mine = list(fn())
                if fault_hook is not None:
                    fault_hook(self.name, phase)
        except Exception as err:  # noqa: BLE001 - one line per rank, gathered
            mine = [str(err) if isinstance(err, FastioError) else f"rank {self.rank}: {first_line(err)}"]
        if not self.any(phase, bool(mine))[0]:  # the usual case: one all-reduce, no gather
            return []
        return [p for part in self.gather(phase, mine) for p in part]

    def check(self, phase: str, problem: str | None, *, cause: BaseException | None = None, blame: bool = True) -> None:
        """Agree on this rank's ``problem`` (None: none): every rank raises the first rank's, or none does.
        ``blame=False`` leaves out which rank failed (for problems that already name what is wrong). Without a
        problem on any rank this is one all-reduce; the problems are gathered only when there is one."""
        if not self.any(phase, bool(problem))[0]:
            return
        every = self.gather(phase, problem)
        failed = [(r, p) for r, p in enumerate(every) if p]
        if failed:
            rank, text = failed[0]
            more = f", and {count(len(failed) - 1, 'other rank')}" if len(failed) > 1 else ""
            where = f" ({phase} failed on rank {rank}{more})" if self.world > 1 and blame else ""
            raise CheckpointError(f"{text}{where}") from cause

    def gather(self, phase: str, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (also a barrier)."""
        if self.world == 1:
            return [obj]
        return self._collective(phase, lambda: self._all_gather(obj))

    def broadcast(self, phase: str, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self._collective(phase, lambda: dist.broadcast_object_list(box, src=src, group=self.pg))
        return box[0]

    def any(self, phase: str, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over the ranks."""
        if self.world == 1:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
        self._collective(phase, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg))
        return tuple(bool(v) for v in t.tolist())

    def barrier(self, phase: str) -> None:
        if self.world > 1:
            self._collective(phase, lambda: dist.barrier(group=self.pg))

    # ------------------------------------------------------------ entering an operation together
    def enter(self, operation: str, terms: dict[str, Any] | None = None, flags: tuple[bool, ...] = (), *,
              label: str | None = None) -> tuple[bool, ...]:
        """Every rank starts ``operation`` with the same ``terms`` (``{"engine": "dcp"}``), or every rank raises
        one CheckpointError naming the first difference; ``flags`` OR-ed over the ranks. See the module docstring
        for the deadline (``agree_timeout``) and the warning about ranks that do not arrive; ``label`` names the
        operation in them (``"save at step 300"``; default ``operation``)."""
        terms = {"operation": operation, **(terms or {})}
        if self.world == 1:
            return tuple(bool(f) for f in flags)
        if self._entry_pg is None or len(flags) > ENTRY_FLAGS:
            raise ValueError(f"RankGroup.enter: {self.name} group has no agree_timeout, or flags {flags!r} > "
                             f"{ENTRY_FLAGS}")
        self._entries += 1
        n, code, started = self._entries, agree.terms_code(terms), time.monotonic()
        ms = int(time.time() * 1000)
        padded = [int(bool(f)) for f in flags] + [0] * (ENTRY_FLAGS - len(flags))
        t = torch.tensor([code, -code, ms, -ms, *padded], dtype=torch.int64)
        work = self._collective(operation, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._entry_pg,
                                                                   async_op=True), watch=False)
        self._entering = True
        try:
            waited = self._await_entry(work, n, label or operation, started)
        finally:
            self._entering = False
        spread_s = (int(t[2]) + int(t[3])) / 1000
        if waited or spread_s >= ARRIVED_AFTER_S / 2:  # someone may have given up: the verdict that stands
            self._noted_entries.append(n)
            verdict = self._store_compare_set(f"{self._key}/entry/{n}/verdict", "ok")
            if verdict != "ok":
                raise CheckpointError(verdict)
        self._forget_entries(n)
        self.gave_up = None  # every rank entered this one: an earlier verdict explains no later failure
        if int(t[0]) != -int(t[1]):  # some rank brought other terms: all exchange them to name the difference
            why = agree.first_disagreement(self.gather(operation, terms))
            raise CheckpointError(f"Checkpointer: {why} (every rank must make the same Checkpointer "
                                  "calls, in the same order, with the same directory, engine and compression)")
        return tuple(bool(v) for v in t[4:4 + len(flags)].tolist())

    def _await_entry(self, work: Any, n: int, operation: str, started: float) -> bool:
        """Wait for entry ``n``'s all-reduce; True when this rank had to wait (and noted its arrival). Raises the
        standing verdict at the deadline, or when gloo gave up first."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _f: done.set())
        timeout = float(self.agree_timeout or 0)
        waited = not done.wait(min(ARRIVED_AFTER_S, timeout / 4))
        if waited:
            key = f"{self._key}/entry/{n}"
            self._store_set(f"{key}/{self.rank}", operation)
            warned, before = False, None
            while not done.wait(0.5):
                waited_s = time.monotonic() - started
                if self.gave_up:  # another rank gave up on this entry (this rank's watch heard it): it stands
                    raise CheckpointError(self.gave_up)
                if waited_s >= timeout:
                    self._give_up(key, operation, timeout)
                    done.wait()  # a rank saw everyone arrive: this rank's all-reduce is completing too
                    break
                if not warned and waited_s >= ABSENT_WARN_S:  # absent in two looks 0.5 s apart: not just late
                    absent = self._absent(key)
                    late = [r for r in absent if before is not None and r in before]
                    if late:
                        log.warning("fastio: checkpoint %s: waiting %.0f s for %s (stopped? agree_timeout=%g s)",
                                    operation, waited_s, self._ranks_text(late), timeout)
                    warned, before = before is not None, absent
        try:
            work.wait()
        except RuntimeError as err:  # gloo's own timeout, or a peer went away (after giving up on this rank?)
            verdict = self._store_get(f"{self._key}/entry/{n}/verdict") or self.gave_up
            if verdict and verdict != "ok":
                raise CheckpointError(verdict) from err
            raise CheckpointError(f"checkpoint {operation}: {self.gone()} ({self.name} group, rank {self.rank} of "
                                  f"{self.world}: {first_line(err)})") from err
        return waited

    def _give_up(self, key: str, operation: str, timeout: float) -> None:
        """At the deadline: raise the verdict that stands (this rank's, unless a rank noted one first), after the
        other ranks' watchers have seen it (at most ``GONE_WAIT_S``: the absent ones, and those that wait too but
        would read the verdict after this rank, their store's host, stopped); returns when a rank saw everyone
        arrive."""
        absent = self._absent(key)
        text = (f"checkpoint {operation} gave up on agreement: {self._ranks_text(absent) or 'a rank'} did not "
                f"arrive within agree_timeout={timeout:g} s ({self.name} group, rank {self.rank} of {self.world} "
                "waited; is it stopped, in another collective, or making other Checkpointer calls?)")
        verdict = self._store_compare_set(f"{key}/verdict", text)
        if verdict == "ok":
            return
        self._gave_up_here = True  # before the key is set: this rank's own watch wakes on it
        if self._store_compare_set(f"{self._key}/gave-up", verdict) == verdict:
            deadline = time.monotonic() + GONE_WAIT_S
            seen = [f"{self._key}/gave-up/seen/{r}" for r in range(self.world) if r != self.rank]
            while seen and not self._store_has_all(seen) and time.monotonic() < deadline:
                time.sleep(0.05)
        raise CheckpointError(verdict)

    def _absent(self, key: str) -> list[int]:
        """The other ranks that have not noted their arrival under ``key`` (one store request each)."""
        return [r for r in range(self.world) if r != self.rank and not self._store_has(f"{key}/{r}")]

    def _forget_entries(self, n: int) -> None:
        """Delete the store keys of entries two or more behind ``n`` (every rank is past them)."""
        while self._noted_entries and self._noted_entries[0] <= n - 2:
            old = self._noted_entries.pop(0)
            for key in (f"{self._key}/entry/{old}/{self.rank}", f"{self._key}/entry/{old}/verdict"):
                try:
                    default_store().delete_key(key)
                except Exception:  # noqa: BLE001 - a key left behind costs a few bytes
                    pass

    def _ranks_text(self, ranks: list[int]) -> str:
        """``rank 1 (pid 4711 on node-a), rank 3 (...)``."""
        return ", ".join(f"rank {r} (pid {self._peers[r][1]} on {self._peers[r][0]})" for r in ranks)

    def _store_set(self, key: str, value: str) -> None:
        store = default_store()
        if store is not None:
            store.set(key, value)

    def _store_has(self, key: str) -> bool:
        store = default_store()
        return store is not None and store.check([key])

    def _store_has_all(self, keys: list[str]) -> bool:
        try:
            store = default_store()
            return store is None or store.check(keys)
        except Exception:  # noqa: BLE001 - the store went with its host: nobody is left to tell
            return True

    def _store_get(self, key: str) -> str | None:
        try:
            return default_store().get(key).decode() if self._store_has(key) else None
        except Exception:  # noqa: BLE001 - the store went with its host
            return None

    def _store_compare_set(self, key: str, value: str) -> str:
        """The value of ``key`` that stands: ``value`` when this rank set it first."""
        store = default_store()
        return value if store is None else store.compare_set(key, "", value).decode()

    # ------------------------------------------------------------ telling a rank the others gave up on
    def _watch_give_ups(self) -> None:
        """Start this rank's watch of the group's ``gave-up`` key (module docstring); none where the store cannot
        give the thread a connection of its own."""
        self._store = default_store()
        try:
            own = self._store.clone() if self._store is not None else None
        except Exception:  # noqa: BLE001 - a store without clone: the next Checkpointer call still raises it
            own = None
        if own is None:
            return
        atexit.register(self.close)
        threading.Thread(target=self._watch_gave_up, args=(own,), daemon=True, name="fastio-gave-up").start()

    def _watch_gave_up(self, store: Any) -> None:
        """The watching thread: wait for the ``gave-up`` key; a verdict is kept, logged (unless this rank is
        entering the operation itself: it raises it) and acknowledged."""
        key = f"{self._key}/gave-up"
        try:
            while True:
                try:
                    store.wait([key], timedelta(days=20))
                    break
                except dist.DistNetworkError:  # the store went with its host
                    return
                except dist.DistStoreError:  # the wait timed out: wait on
                    continue
            verdict = store.get(key).decode()
            if verdict == GAVE_UP_CLOSED:
                return
            self.gave_up = verdict
            if not self._entering and not self._gave_up_here:  # (its watch may wake after it left the entry)
                log.error("fastio: %s; rank %d (this process) was not in that operation: a collective of its own "
                          "that those ranks do not join fails once they stop (gloo: Connection closed by peer)",
                          verdict, self.rank)
            store.set(f"{key}/seen/{self.rank}", "1")
        except Exception:  # noqa: BLE001, S110 - the store went with its host: nothing to tell
            pass

    def close(self) -> None:
        """End the watch of every rank of this group (module docstring): a group a rank closed makes no more
        operations."""
        store, self._store = self._store, None
        if store is None:
            return
        atexit.unregister(self.close)
        try:
            store.compare_set(f"{self._key}/gave-up", "", GAVE_UP_CLOSED)
        except Exception:  # noqa: BLE001, S110 - the store went with its host: the watchers ended with it
            pass

    # ------------------------------------------------------------ peers going away
    def gone(self) -> str:
        """Who went away, as far as the ranks can tell: the first note of a rank that found ranks of its host
        ended (see the module docstring), else what this rank finds: ranks of this host whose process ended,
        else the only other rank it could be, else the ranks on other hosts."""
        host = socket.gethostname()
        local = [r for r, (h, _) in enumerate(self._peers) if r != self.rank and h == host]
        # A peer's sockets close while its process is still exiting: give it a moment to be seen as ended.
        deadline = time.monotonic() + GONE_WAIT_S
        while True:
            noted = self._noted()
            dead = [r for r in local if process_gone(self._peers[r][1])]
            if noted or dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if noted:
            return noted
        if dead:
            return self._note(", ".join(f"rank {r} (pid {self._peers[r][1]} on {host})" for r in dead) + " went away")
        unknown = [r for r, (h, _) in enumerate(self._peers) if r != self.rank and h != host]
        if len(unknown) == 1:
            return f"rank {unknown[0]} ({self._peers[unknown[0]][0]}) went away"
        if unknown:
            return f"one of ranks {', '.join(map(str, unknown))} (on other hosts) went away or stopped answering"
        return "a peer rank closed its connection"

    def _noted(self) -> str | None:
        """Another rank's note of who went away, if the store has one (and can still be reached)."""
        store = default_store()
        try:
            if store is not None and store.check([self._gone_key]):
                return store.get(self._gone_key).decode()
        except Exception:  # noqa: BLE001 - the store went with its host: this rank's own finding stands
            pass
        return None

    def _note(self, found: str) -> str:
        """Note ``found`` unless a rank noted first; the note that stands."""
        store = default_store()
        try:
            if store is not None:
                return store.compare_set(self._gone_key, "", found).decode()
        except Exception:  # noqa: BLE001 - see _noted
            pass
        return found

    def _collective(self, phase: str, call: Callable[[], T], *, watch: bool = True) -> T:
        done = self._watch(phase) if watch and self.world > 1 and self._key else None
        try:
            return call()
        except RuntimeError as err:  # gloo: a peer's process ended (connection closed or reset) or timed out
            raise CheckpointError(f"checkpoint {phase}: {self.gone()} ({self.name} group, rank {self.rank} of "
                                  f"{self.world}: {first_line(err)})") from err
        finally:
            if done is not None:
                done.set()

    # ------------------------------------------------------------ naming a rank stopped inside an operation
    def _watch(self, phase: str) -> threading.Event:
        """Watch this rank's wait in the group's next collective (see the module docstring) on a thread of its
        own, until the returned event is set."""
        self._waits += 1
        done = threading.Event()
        threading.Thread(target=self._watch_wait, args=(self._waits, phase, done), daemon=True,
                         name=f"fastio-watch-{self._waits}").start()
        return done

    def _watch_wait(self, n: int, phase: str, done: threading.Event) -> None:
        """The watching thread: note this rank's arrival after ``ARRIVED_AFTER_S``; then looks at the absent ranks'
        beats ``LOOKS_APART_S`` apart, the second at ``ABSENT_WARN_S``; one warning naming those whose beat stood
        still between two looks."""
        started = time.monotonic()
        if done.wait(ARRIVED_AFTER_S):
            return
        key = f"{self._key}/wait/{n}"
        try:
            self._store_set(f"{key}/{self.rank}", phase)
            before: dict[int, int] | None = None
            first = max(ARRIVED_AFTER_S, ABSENT_WARN_S - LOOKS_APART_S)
            while not done.wait(LOOKS_APART_S if before is not None else first - (time.monotonic() - started)):
                beats = {r: self._beats(r) for r in self._absent(key)}
                late = [r for r, b in beats.items() if before is not None and before.get(r) == b]
                if late:
                    log.warning("fastio: checkpoint %s: waiting %.0f s for %s (stopped, or busy outside the "
                                "Checkpointer? %s group)", phase, time.monotonic() - started, self._ranks_text(late),
                                self.name)
                    break
                before = beats
            done.wait()
            default_store().delete_key(f"{key}/{self.rank}")
        except Exception:  # noqa: BLE001, S110 - the store went with its host: the collective's own error tells
            pass

    def _beats(self, rank: int) -> int:
        """How many beats ``rank`` has counted while busy in a phase (see :meth:`_busy`)."""
        return int(default_store().add(f"{self._key}/beat/{rank}", 0))

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """This rank's local work of a phase: after ``ARRIVED_AFTER_S``, a beat in the store every
        ``ARRIVED_AFTER_S`` (on a thread of its own) until it ends, so that the waiting ranks do not name it."""
        if self.world == 1 or not self._key or default_store() is None:
            yield
            return
        done = threading.Event()

        def beat() -> None:
            try:
                while not done.wait(ARRIVED_AFTER_S):
                    default_store().add(f"{self._key}/beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001, S110 - the store went with its host: nothing to tell
                pass

        threading.Thread(target=beat, daemon=True, name="fastio-busy").start()
        try:
            yield
        finally:
            done.set()

    def _all_gather(self, obj: Any) -> list[Any]:
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, obj, group=self.pg)
        return every
