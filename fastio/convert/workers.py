"""An ordered process pool that can always be stopped: ``OrderedPool.map`` yields results in input order.

``multiprocessing.Pool`` shares one lock-guarded task queue among its workers, and an idle worker holds
that lock while it waits for a task; ``Pool.terminate()`` must take the same lock, so stopping a pool
early (a conversion that fails on a bad sample) can hang forever. Here every worker has a pipe of its
own and shares no lock with anyone: chunk k goes to worker ``k % N`` and results are read back in the
same order, a feeder thread sends while the caller reads (so neither side can block the other), and
:meth:`OrderedPool.close` simply kills the workers.

Workers are forked from the caller where it is a process nothing else runs in (Linux, a single thread, neither
torch nor DALI imported: the ``fastio convert`` command; its objects frozen meanwhile, ``gc.freeze``, so a
worker's collector never frees the caller's garbage). Elsewhere they start from fastio's fork server
(:mod:`fastio.convert.forkserver`, where the platform has one; spawned elsewhere): a fresh interpreter that
imported the workers' modules once and forks each worker, which so is never a copy of the caller. The server
stays, idle, for the next pool until the caller ends; a worker takes the caller's environment as it is when the
pool starts (the server's is the caller's of earlier). A copy of the caller, which may be a training script or a
notebook with torch, DALI and their threads, would hold the caller's state as it was at that instant: locks that
other threads held (never to be released: a worker that takes one hangs) and the caller's garbage (objects in
reference cycles not yet freed), which the worker's collector frees by running their finalizers there: a torch
gloo process group joins threads the copy does not have (the worker crashed, SIGSEGV or SIGABRT), a
``TemporaryDirectory`` deletes the caller's directory.

Workers never outlive their parent, however it ends (exit, exception, SIGTERM, SIGKILL): each one asks
the kernel for SIGKILL when the process that forked it dies (``PR_SET_PDEATHSIG`` on Linux; the fork server
ends when the caller does), closes every descriptor it inherited but its own pipe end (so it holds no lock of
its parent's, such as DEST's ``.fastio-lock``, no other worker's pipe and not the caller's stdout: a ``| tail``
sees EOF once the caller and its fork server have ended), and returns at EOF on its pipe, or quietly, printing no
traceback, when its pipe is broken or reset (a killed caller's pipe ends close before the kernel's SIGKILL reaches
its workers).
:func:`detach_child` is that set-up, for any process fastio forks.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

from fastio.checks import checked, positive_integer
from fastio.dist import process_gone, usable_cpus

__all__ = ["OrderedPool", "default_workers", "detach_child", "start_server", "workers_field"]

_PR_SET_PDEATHSIG = 1
_METHODS = ("forkserver", "spawn", "fork")


def default_workers() -> int:
    """How many worker processes a conversion starts by default: the CPUs this process may run on."""
    return len(usable_cpus())


def workers_field() -> Any:
    """The ``workers`` field of every conversion's config (images, tables, image-text, tokens, chat): default
    :func:`default_workers`, and one rule with one message for a count below one or not an integer, ``workers must
    be a positive integer, got 0`` (``--workers ...`` from the command)."""
    return checked(positive_integer, default_factory=default_workers)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that forked it ends (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _alive(pid: int) -> bool:
    """Whether the process ``pid`` that started this one (itself, or through a fork server) still runs."""
    return os.getppid() == pid or not process_gone(pid)


def detach_child(parent_pid: int, keep: tuple[int, ...] = (), forked: bool = True) -> None:
    """Run first in a child process: die with the parent, and (``forked``) hold none of its descriptors.

    SIGKILL when the process that forked it dies, and exit at once if ``parent_pid`` (the parent, or the caller of a
    fork server, which ends when its caller does) has already: the start raced its death. Linux sends it when the
    *thread* that forked the child ends, so fork children from a thread that outlives them. After a fork, stdin and
    stdout become ``/dev/null`` (stderr stays, for a crash's last words) and every other inherited descriptor but
    ``keep`` is closed: the parent's locks, other children's pipe ends, sockets and files. A spawned child inherits
    none of those (Python's descriptors are not inheritable). SIGINT is ignored: a Ctrl-C reaches every process of
    the terminal's group, and the parent, which stops its children, is the one to report it (not each child with
    a traceback)."""
    _die_with_parent()
    if not _alive(parent_pid):
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops its children
    if not forked:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        if fd not in keep:
            os.dup2(null, fd)
    lowest = 3
    for fd in sorted({*keep, null}):
        if fd >= lowest:
            os.closerange(lowest, fd)
            lowest = fd + 1
    os.closerange(lowest, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    if null > 2 and null not in keep:
        os.close(null)


_THREADED = ("torch", "nvidia.dali")
"""Modules whose import starts threads of their own (thread pools, a process group's), some holding locks."""


def _default_method() -> str:
    """``fork`` where this process is one that nothing else runs in (Linux, a single thread: no other of Python's,
    no library's, such as an object-store client's runtime or a BLAS pool; none of :data:`_THREADED` imported: the
    ``fastio convert`` command), so that workers start at once with its imports; else fastio's fork server (a
    training script, a notebook), else spawn."""
    if sys.platform.startswith("linux") and _threads() == 1 and not any(m in sys.modules for m in _THREADED):
        return "fork"
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _threads() -> int:
    """The threads of this process, Python's and native ones (Linux)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count() + 1  # unknown: not one


def _start(procs: list[mp.Process], method: str) -> None:
    """Start ``procs``; forked ones with the caller's objects frozen (``gc.freeze``), so that a worker's collector
    never frees the caller's garbage (objects in reference cycles not freed yet) and runs its finalizers there."""
    if method == "fork":
        gc.freeze()
    try:
        for proc in procs:
            proc.start()
    finally:
        if method == "fork":
            gc.unfreeze()


def _modules(fn: Callable, initializer: Callable | None, preload: tuple[str, ...]) -> list[str]:
    """What a fork server imports ahead for a pool of ``fn``: ``preload``, this module, ``fn``'s and
    ``initializer``'s."""
    return [*preload, __name__, *(f.__module__ for f in (fn, initializer) if f is not None)]


def start_server(fn: Callable, initializer: Callable | None = None, preload: tuple[str, ...] = ()) -> None:
    """Start the fork server that an ``OrderedPool(fn, initializer=initializer, preload=preload)`` would start
    from (where it is the default), so that it imports those modules while the caller does something else."""
    if _default_method() == "forkserver":
        from fastio.convert.forkserver import start

        start(_modules(fn, initializer, preload))


def _process(method: str, preload: list[str], **kwargs: Any) -> mp.Process:
    """A worker process (not started) of start ``method``; a fork server's imports ``preload`` at its start."""
    if method == "forkserver":
        from fastio.convert.forkserver import server_process

        return server_process(preload, **kwargs)
    return mp.get_context(method).Process(**kwargs)


def _serve(conn, fn: Callable, initializer: Callable | None, initargs: tuple, parent_pid: int,
           forked: bool, environ: dict[str, str]) -> None:
    detach_child(parent_pid, keep=(conn.fileno(),), forked=forked)
    os.environ.clear()  # the caller's environment now, not the fork server's from its start (credentials, endpoints)
    os.environ.update(environ)
    if initializer is not None:
        initializer(*initargs)
    while (chunk := _next_chunk(conn)) is not None:
        try:
            reply = ("ok", [fn(x) for x in chunk])
        except BaseException as err:  # hand the error to the caller, as Pool.imap does
            reply = ("error", err)
        if not _reply(conn, reply):
            return


def _next_chunk(conn) -> list[Any] | None:
    """The worker's next chunk; None at the end: the pool's None, or its caller gone (EOF, or a reset where results
    it never read were waiting: a killed caller's pipe ends close before its death signal reaches the worker)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _reply(conn, reply: tuple[str, Any]) -> bool:
    """Send ``reply`` to the caller; False when it is gone (a broken pipe or a reset: the worker ends quietly, with
    no traceback of multiprocessing's). A result or error that cannot be pickled is sent as a RuntimeError saying
    so."""
    try:
        conn.send(reply)
    except OSError:
        return False
    except Exception as err:  # noqa: BLE001 - pickling fails before anything is written; a str always pickles
        return _reply(conn, ("error", RuntimeError(f"a worker's {reply[0]} reply cannot be sent to the caller: "
                                                   f"{type(err).__name__}: {err}")))
    return True


class OrderedPool:
    """``workers`` processes running ``fn`` (after ``initializer(*initargs)``), from fastio's fork server.

    Args:
        fn: a function of one item, importable (not defined in ``__main__``), as ``initializer`` is.
        workers: number of processes (>= 1).
        initializer, initargs: run once in each worker before its first item.
        chunksize: items per message.
        window: chunks in flight per worker (bounds memory and how far the workers run ahead).
        preload: modules the fork server imports when it starts (with the modules of ``fn`` and ``initializer``),
            so that each worker starts with them imported.
        method: ``"forkserver"`` (:mod:`fastio.convert.forkserver`), ``"spawn"`` (a fresh interpreter a worker)
            or ``"fork"`` (a copy of this process, its objects frozen: only where it holds no other thread, see the
            module's docstring); None: fork where this process is one nothing else runs in, else forkserver where
            available, else spawn.
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, *, initializer: Callable | None = None,
                 initargs: tuple = (), chunksize: int = 1, window: int = 4, preload: tuple[str, ...] = (),
                 method: str | None = None):
        if workers < 1 or chunksize < 1 or window < 1:
            raise ValueError(f"workers, chunksize and window must be >= 1, got {workers}, {chunksize}, {window}")
        if method not in (None, *_METHODS):
            raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))} or None, got {method!r}")
        method = method or _default_method()
        modules = _modules(fn, initializer, preload)
        if method == "forkserver" and "__main__" in modules:
            raise ValueError(f"{fn.__qualname__}, {getattr(initializer, '__qualname__', None)}: a worker of the fork "
                             "server cannot import a function defined in __main__; define it in a module")
        self.chunksize, self.window = chunksize, window
        self._conns, self._procs = [], []
        self._closed = False
        children = []
        for _ in range(workers):
            parent, child = mp.Pipe()
            self._procs.append(_process(method, modules, target=_serve, daemon=True,
                                        args=(child, fn, initializer, initargs, os.getpid(), method != "spawn",
                                              dict(os.environ))))
            self._conns.append(parent)
            children.append(child)
        _start(self._procs, method)
        for child in children:
            child.close()

    def map(self, items: Iterable[Any], chunksize: int | None = None) -> Iterator[Any]:
        """Results of ``fn`` for ``items``, in order (``chunksize`` items per message, default the pool's).
        Run one ``map`` at a time; abandoning one mid-way leaves the pool unusable for another (close it)."""
        n, size = len(self._conns), chunksize or self.chunksize
        slots = threading.Semaphore(self.window * n)
        order: deque[int] = deque()  # the worker of each chunk sent, in send order
        sent = threading.Condition()
        done = [False]
        failure: list[BaseException] = []

        def feed() -> None:
            try:
                source, k = iter(items), 0
                while not self._closed:
                    chunk = list(islice(source, size))
                    if not chunk:
                        break
                    slots.acquire()
                    if self._closed:
                        break
                    w = k % n
                    self._send(w, chunk)
                    with sent:
                        order.append(w)
                        sent.notify()
                    k += 1
            except BaseException as err:  # the items' iterator failed, or the pool was closed under us
                failure.append(err)
            finally:
                with sent:
                    done[0] = True
                    sent.notify()

        feeder = threading.Thread(target=feed, name="fastio-pool-feed", daemon=True)
        feeder.start()
        while True:
            with sent:
                while not order and not done[0]:
                    sent.wait()
                if not order:
                    break
                w = order.popleft()
            payload = self._receive(w)
            slots.release()
            yield from payload
        feeder.join()
        if failure and not self._closed:
            raise failure[0]

    def _receive(self, w: int) -> list[Any]:
        """The results of worker ``w``'s next chunk; its error raised, or RuntimeError when it died."""
        try:
            kind, payload = self._conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w) from None
        if kind == "error":
            raise payload
        return payload

    def _send(self, w: int, chunk: list[Any]) -> None:
        """Send ``chunk`` to worker ``w``; RuntimeError naming its death when its end is closed."""
        try:
            self._conns[w].send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(w) from None

    def _died(self, w: int) -> RuntimeError:
        """The error of worker ``w`` found dead (reaped first, so that its exit code, the signal that ended it, is
        known)."""
        self._procs[w].join(5)
        return RuntimeError(f"a worker process died (exit code {self._procs[w].exitcode})")

    def close(self) -> None:
        """Stop every worker at once (SIGKILL: no lock is shared, so none can be left held) and reap it."""
        self._closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
