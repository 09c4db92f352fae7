"""Which rank this process is and how many there are: one rule for the Loader and the Checkpointer.

``torch.distributed`` when a process group is initialised; otherwise the launcher's ``RANK`` and
``WORLD_SIZE`` (torchrun, or ``srun`` with them exported); otherwise a single process (0, 1).

Also the one place that reaches into ``torch.distributed``'s internals (:func:`default_store`), the exchange through
its store by which ranks check that they hold something alike (:func:`agree_with_rank_zero`), and the rule for
the CPUs a process may use (:func:`usable_cpus`), when it has its node to itself (:func:`alone_on_node`) and
whether a process of this host has ended (:func:`process_gone`; :func:`process_start` tells a reused pid apart).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import pickle
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["agree_with_rank_zero", "alone_on_node", "default_store", "initialized_rank_and_world", "process_gone",
           "process_start", "rank_and_world", "usable_cpus"]


def initialized_rank_and_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of torch.distributed's default group where it is initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # torch is a dependency, but keep this usable from light tools
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; see the module docstring for where they come from."""
    found = initialized_rank_and_world()
    if found is not None:
        return found
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}"
                         " are not integers") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world


def default_store():
    """The key-value store of the default process group (torchrun's agent store, or rank 0's TCPStore with a
    ``tcp://`` init), or None when there is none. Private to torch: this is the only caller."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no group, or a torch without it: callers do without a store
        return None


_agreements: tuple[weakref.ref, itertools.count] | None = None
"""The default group's exchanges of :func:`agree_with_rank_zero` so far, on this rank (the n-th of every rank meets
the others' n-th): counted anew for each group (a rank that was not in an earlier group counted none of its)."""


def _next_agreement() -> int:
    global _agreements
    import torch.distributed as dist

    group = dist.group.WORLD
    if _agreements is None or _agreements[0]() is not group:
        _agreements = (weakref.ref(group), itertools.count())
    return next(_agreements[1])


NOTICE_AFTER_S = 60.0
"""How long :func:`agree_with_rank_zero` waits for the other ranks before it logs that it waits (once; it goes on
waiting for the store's timeout)."""


def agree_with_rank_zero(terms: Any, differ: Callable[[Any, Any], str | None], rank: int, world: int,
                         waiting: str = "") -> str | None:
    """Whether the ``world`` ranks of the default group hold ``terms`` alike: rank 0 posts its ``terms`` (small,
    picklable) in the group's store, every other rank compares its own with them (``differ(rank0_terms, mine)``:
    None, or one line naming what differs) and the first line posted is every rank's answer (None: all alike).

    One exchange: a rank sets or gets the terms, counts itself in, and waits for the last rank's word, a few
    requests whatever the world size. A collective: every rank of the group makes the same calls in the same order
    (the n-th call of each rank in this group meets the others' n-th). None where there is no store (no group).
    TimeoutError saying how many ranks came where the others did not within the store's timeout; after
    :data:`NOTICE_AFTER_S` of waiting, one warning on the ``fastio`` logger: how many ranks came, then ``waiting``
    (what the caller waits at, and why that may never end)."""
    store = default_store()
    if store is None:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an agent's store outlives a restarted worker
    key = f"fastio/agree/{attempt}/{_next_agreement()}"
    try:
        if rank == 0:
            problem = None
            store.set(f"{key}/terms", pickle.dumps(terms))
        else:
            problem = differ(pickle.loads(store.get(f"{key}/terms")), terms)
        if problem is not None:
            store.compare_set(f"{key}/problem", "", problem)  # the first rank's line stays
        if store.add(f"{key}/came", 1) == world:
            store.set(f"{key}/done", b"1")
        _wait_noting(store, f"{key}/done", lambda: f"{store.add(f'{key}/came', 0)} of {world} ranks", waiting)
    except RuntimeError as err:  # torch's DistStoreError: the store's timeout passed (or the store went)
        try:
            came = f"{store.add(f'{key}/came', 0)} of {world} ranks"
        except RuntimeError:
            came = "not all ranks"
        said = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise TimeoutError(f"{came} came within the store's timeout ({said})") from None
    problem = store.get(f"{key}/problem").decode() if store.check([f"{key}/problem"]) else None
    if store.add(f"{key}/left", 1) == world:  # every rank has its answer: the keys go, so a group made again on the
        for part in ("terms", "problem", "came", "done", "left"):  # same store (torchrun's agent store) starts clean
            with contextlib.suppress(RuntimeError, NotImplementedError):  # a store that cannot delete keeps them
                store.delete_key(f"{key}/{part}")
    return problem


def _wait_noting(store: Any, key: str, came: Callable[[], str], waiting: str) -> None:
    """``store.wait`` for ``key``: first for :data:`NOTICE_AFTER_S`, then, having logged who came, for the store's
    own timeout (RuntimeError, torch's DistStoreError, where it passes)."""
    try:
        store.wait([key], datetime.timedelta(seconds=NOTICE_AFTER_S))
        return
    except RuntimeError:
        logging.getLogger("fastio").warning("fastio: %s came after %.0f s; %s", came(), NOTICE_AFTER_S, waiting)
    store.wait([key])


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: what Slurm's CPU binding, ``taskset`` or a cgroup's cpuset
    leave it), ascending; where the platform cannot say, every CPU of the machine."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return list(range(os.cpu_count() or 1))


def alone_on_node(world_size: int) -> bool:
    """Whether this process is its job's only one on this node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) is
    1, or, where no launcher says, the job has one process (``world_size``)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdecimal():  # what int() reads ("²" is a digit, not a number)
        return int(local) == 1
    return world_size == 1


def process_start(pid: int) -> int | None:
    """When process ``pid`` of this host started (clock ticks after boot, ``/proc/PID/stat``), which tells it from a
    later process given the same pid; None when that cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_ended(pid: int, start: int | None) -> bool:
    """Whether the process ``pid`` of this host that started at ``start`` (:func:`process_start`; None: not known)
    has ended: its pid gone (:func:`process_gone`), or now a later process's (another start time)."""
    if process_gone(pid):
        return True
    now = process_start(pid)
    return start is not None and now is not None and now != start


def process_gone(pid: int) -> bool:
    """True when process ``pid`` of this host has ended: it does not exist, or it is a zombie; another user's live
    process has not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
