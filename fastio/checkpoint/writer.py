"""The background writer thread: where a staged save is handed off, and at what priority it runs.

The Checkpointer stages a private copy of the state on the training thread, then calls :func:`start_writer`
with the function that writes and commits; once the save is done, it starts another such thread for retention's
deletion of the expired steps (:meth:`~fastio.checkpoint.commit.Commit.prune`). Measured on a 2-core
machine (training on one torch thread, 512 MiB of state; see the checkpoint section of ``docs/performance.md``):
the training thread did not lose its time to the GIL (the writer's threads held it in ~15% of samples) nor to
memory bandwidth (its CPU time per step did not rise during a write) but to the run queue: the write's threads,
several at once, took its core. So the write runs as one stream (the engines write one file at a time, see
:data:`fastio.checkpoint.engines.torchsnapshot_engine.WRITE_STREAMS`) on a thread whose nice value is at
least ``writer_nice``: when the cores are oversubscribed the training thread wins, and the write takes longer.

Linux applies nice per thread and a new thread inherits its creator's, so the threads the engine starts
from the writer thread (torchsnapshot's event-loop executor, DCP's) run at the writer's nice too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["lower_priority", "start_writer"]


def lower_priority(nice: int) -> int | None:
    """Raise the calling thread's nice value to ``nice`` (never lower it: a writer must not outrank the
    thread that started it); the value it runs at, or None where threads have no nice value of their own."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return None
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # not permitted, or no such thread id (not Linux): the write runs at the caller's priority
        return None


def start_writer(target: Callable[..., Any], args: tuple, *, name: str, nice: int) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread named ``name`` at nice value ``nice`` (0: the caller's)."""

    def run() -> None:
        if nice:
            lower_priority(nice)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
