"""An ordered process pool that can always be stopped: ``OrderedPool.map`` yields results in input order.

``multiprocessing.Pool`` shares one lock-guarded task queue among its workers, and an idle worker holds
that lock while it waits for a task; ``Pool.terminate()`` must take the same lock, so stopping a pool
early (a conversion that fails on a bad sample) can hang forever. Here every worker has a pipe of its
own and shares no lock with anyone: chunk k goes to worker ``k % N`` and results are read back in the
same order, a feeder thread sends while the caller reads (so neither side can block the other), and
:meth:`OrderedPool.close` simply kills the workers.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

__all__ = ["OrderedPool"]


def _serve(conn, fn: Callable, initializer: Callable | None, initargs: tuple) -> None:
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        try:
            conn.send(("ok", [fn(x) for x in chunk]))
        except BaseException as err:  # hand the error to the caller, as Pool.imap does
            conn.send(("error", err))


class OrderedPool:
    """``workers`` processes running ``fn`` (after ``initializer(*initargs)``), fork where available.

    Args:
        fn: a picklable function of one item.
        workers: number of processes (>= 1).
        initializer, initargs: run once in each worker before its first item.
        chunksize: items per message.
        window: chunks in flight per worker (bounds memory and how far the workers run ahead).
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, *, initializer: Callable | None = None,
                 initargs: tuple = (), chunksize: int = 1, window: int = 4):
        if workers < 1 or chunksize < 1 or window < 1:
            raise ValueError(f"workers, chunksize and window must be >= 1, got {workers}, {chunksize}, {window}")
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.chunksize, self.window = chunksize, window
        self._conns, self._procs = [], []
        self._closed = False
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, fn, initializer, initargs), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

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
                    self._conns[w].send(chunk)
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
            try:
                kind, payload = self._conns[w].recv()
            except (EOFError, OSError):
                code = self._procs[w].exitcode
                raise RuntimeError(f"a worker process died (exit code {code})") from None
            slots.release()
            if kind == "error":
                raise payload
            yield from payload
        feeder.join()
        if failure and not self._closed:
            raise failure[0]

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
