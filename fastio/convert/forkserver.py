"""fastio's fork server: the processes of :class:`~fastio.convert.workers.OrderedPool` start here, never as a copy of
their caller (the adapter of ``multiprocessing``'s fork server: its internals are used here only).

A fresh interpreter, started once per process at the first worker, imports the modules it is asked to ahead (the
workers' functions, PIL) and forks each worker. It is fastio's own, apart from the process-wide server of
``multiprocessing``'s ``forkserver`` start method, whose list of modules to import is others' to set (a test's torch
ranks). It ends when its caller does (EOF on a pipe only the caller holds).

A worker does not run the caller's main module. ``multiprocessing``'s forkserver and spawn start methods run the
caller's script again in every child, as ``__mp_main__``: ``python train.py`` without an
``if __name__ == "__main__":`` guard would train, and convert, again in each worker. A worker here runs fastio's
functions only, so its ``target`` and the functions it is given must be importable (not defined in ``__main__``).
Available where ``multiprocessing`` has the forkserver start method (Linux, macOS).
"""

from __future__ import annotations

import io
import os
from multiprocessing import context, popen_forkserver, reduction, spawn, util
from multiprocessing.forkserver import ForkServer, read_signed
from typing import Any

__all__ = ["server_process", "start"]

_SERVER = ForkServer()  # started at the first worker's start


def _without_main(prep: dict[str, Any]) -> dict[str, Any]:
    """A child's preparation data less the caller's main module (the child does not import it again)."""
    return {k: v for k, v in prep.items() if k not in ("init_main_from_path", "init_main_from_name")}


class _Popen(popen_forkserver.Popen):
    """``popen_forkserver.Popen``, from fastio's server and without the caller's main module."""

    def _launch(self, process_obj) -> None:  # popen_forkserver.Popen._launch but for those two
        prep = _without_main(spawn.get_preparation_data(process_obj._name))
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = _SERVER.connect_to_new_process(self._fds)
        self.finalizer = util.Finalize(self, util.close_fds, (os.dup(w), self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = read_signed(self.sentinel)


class ServerProcess(context.ForkServerProcess):
    """A process forked by fastio's fork server."""

    @staticmethod
    def _Popen(process_obj) -> _Popen:
        return _Popen(process_obj)


def start(preload: list[str]) -> None:
    """Start the server now (if it is not running), to import ``preload`` while this process does something else
    (a conversion's scan); its first worker waits for those imports otherwise."""
    _SERVER.set_forkserver_preload(sorted(set(preload)))
    _SERVER.ensure_running()


def server_process(preload: list[str], **kwargs: Any) -> ServerProcess:
    """A process (``multiprocessing.Process``'s arguments, not started) forked by fastio's fork server, which
    imports ``preload`` (module names) if it starts now; a worker imports what its server has not."""
    _SERVER.set_forkserver_preload(sorted(set(preload)))
    return ServerProcess(**kwargs)
