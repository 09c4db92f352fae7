"""A real torchft lighthouse and Managers on loopback for the tests (tests/test_torchft*.py).

The lighthouse binds 127.0.0.1; each replica group's TCPStore is on 127.0.0.1 (hosted by the test process); gloo
uses ``lo``; the Managers advertise 127.0.0.1. ``init_sync=False``: torchft would otherwise heal every group but one
at step 0 and zero their gradients (docs/trainers.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
# The Managers that started a quorum in steps(), and each Manager's lighthouse address (from manager()), held
# weakly: not by id(), which a Manager made after an earlier one was freed can reuse. A reused id once made a new
# group look as if it had asked before: it asked after its peer instead of before, the peer got a quorum alone,
# and the new group's quorum never came (torchft's "Timeout expired" after 30 s, in `make test`).
_ASKED: weakref.WeakSet[Manager] = weakref.WeakSet()
_HOUSE: weakref.WeakKeyDictionary[Manager, str] = weakref.WeakKeyDictionary()

# The lighthouse's process: torchft's extension module loaded from its file (not the torchft package, which imports
# torch: ~1 s), a LighthouseServer on 127.0.0.1, its address on stdout, shut down when stdin closes.
_SERVE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("torchft._torchft", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
server = ext.LighthouseServer(bind="127.0.0.1:0", **json.loads(sys.argv[2]))
print(server.address(), flush=True)
sys.stdin.read()
server.shutdown()
"""


class Lighthouse:
    """A real torchft lighthouse (``LighthouseServer``) in a process of its own, with the server's ``address()`` and
    ``shutdown()``. Not in the test's process: its Rust server once segfaulted there (in libc, on its thread
    ``torchft-lighths``), which ended the pytest-xdist worker and left ``make test`` waiting at its end."""

    def __init__(self, **options: int):
        from torchft import _torchft

        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, _torchft.__file__, json.dumps(options)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._address = self._proc.stdout.readline().strip()
        if not self._address:
            self.shutdown()
            raise RuntimeError(f"the lighthouse process ended with {self._proc.returncode} before its address")

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()


def lighthouse(min_replicas: int = 1, join_ms: int = 100) -> Lighthouse:
    return Lighthouse(min_replicas=min_replicas, join_timeout_ms=join_ms, quorum_tick_ms=20, heartbeat_timeout_ms=1000)


def group_store() -> TCPStore:
    """A replica group's store (torchft's Managers find their group's manager server there)."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def manager(store_port: int, lighthouse_addr: str, group: int, rank: int = 0, world: int = 1, timeout_s: float = 10,
            **kw: Any) -> Manager:
    """Rank ``rank`` of replica group ``group``'s Manager, with timeouts of seconds (a dead peer is seen in seconds;
    not 3: a quorum's process-group setup on a loaded machine once took longer to reach its own store); the process's
    environment has ``LOOPBACK``."""
    assert all(os.environ.get(k) == v for k, v in LOOPBACK.items()), "gloo not on loopback"
    made = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)), load_state_dict=None, state_dict=None,
                   min_replica_size=1, store_addr="127.0.0.1", store_port=store_port, rank=rank, world_size=world,
                   lighthouse_addr=lighthouse_addr, replica_id=f"group{group}", hostname="127.0.0.1",
                   timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=30),
                   connect_timeout=timedelta(seconds=10), init_sync=False, **kw)
    _HOUSE[made] = lighthouse_addr
    return made


def lighthouse_status(address: str) -> tuple[int, int, str]:
    """The lighthouse's status page: the id of its last quorum, the groups whose requests it holds for the next,
    and the page."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    page = opener.open(f"{address}/status", timeout=5).read().decode()
    quorum = re.search(r"Current quorum_id: (\d+)", page)
    asked = re.search(r"\[\d+/(\d+) participants healthy\]", page)  # "[healthy/all participants healthy]"
    assert quorum and asked, page
    return int(quorum.group(1)), int(asked.group(1)), page


def wait_asked(address: str, participants: int, quorum: int, timeout_s: float = 30) -> None:
    """Wait until the lighthouse at ``address`` holds the quorum requests of ``participants`` groups, or has made a
    quorum after quorum id ``quorum`` (which took the requests it held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        made, asked, page = lighthouse_status(address)
        if asked >= participants or made > quorum:
            return
        assert time.monotonic() < deadline, f"the lighthouse never had {participants} participants: {page}"
        time.sleep(0.01)


def steps(loaders: list[tuple[Manager, Any]], count: int, commit: Callable[[int], bool] = lambda s: True
          ) -> list[list[dict]]:
    """``count`` steps of single-rank groups in this process: every Manager starts its quorum, then each group takes
    its batch and commits (``commit(step)`` False: an error is reported first, so the step is not committed). The
    group that has not asked before asks first, and the lighthouse is waited for until it holds that request, so
    that the quorum of its first step takes it in (the lighthouse forms a quorum at once when the groups of the last
    one have asked; a fixed 0.3 s wait was not always enough on a loaded machine).

    A Manager made with ``use_async_quorum=False`` waits in ``start_quorum`` for the quorum, and heals in it (the
    peer's state applied there): it starts its quorum on a thread of its own; what one raises is raised here once
    every group's start has ended."""
    out = []
    its = [iter(loader) for _, loader in loaders]
    for _ in range(count):
        quorum = lighthouse_status(_HOUSE[loaders[0][0]])[0] if len(loaders) > 1 else 0
        with ThreadPoolExecutor(len(loaders)) as pool:
            started = []
            for k, (m, _) in enumerate(sorted(loaders, key=lambda ml: ml[0] in _ASKED)):
                started.append(pool.submit(m.start_quorum) if not m._use_async_quorum else None)
                if started[-1] is None:
                    m.start_quorum()
                if m not in _ASKED and len(loaders) > 1:
                    wait_asked(_HOUSE[m], k + 1, quorum)  # its request reaches the lighthouse before the others'
                _ASKED.add(m)
            for future in started:
                if future is not None:
                    future.result(timeout=60)
        out.append([dict(next(it), step=m.current_step(), participating=m.is_participating())
                    for (m, _), it in zip(loaders, its)])
        for m, _ in loaders:
            if not commit(m.current_step()):
                m.report_error(RuntimeError("this step fails on purpose"))
            m.should_commit()
    return out
