"""Which rank this process is and how many there are: one rule for the Loader and the Checkpointer.

``torch.distributed`` when a process group is initialised; otherwise the launcher's ``RANK`` and
``WORLD_SIZE`` (torchrun, or ``srun`` with them exported); otherwise a single process (0, 1).

Also the one place that reaches into ``torch.distributed``'s internals (:func:`default_store`), and the rule for
the CPUs a process may use (:func:`usable_cpus`), when it has its node to itself (:func:`alone_on_node`) and
whether a process of this host has ended (:func:`process_gone`; :func:`process_start` tells a reused pid apart).
"""

from __future__ import annotations

import os

__all__ = ["alone_on_node", "default_store", "initialized_rank_and_world", "process_gone", "process_start",
           "rank_and_world", "usable_cpus"]


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
