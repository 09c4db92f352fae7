"""A quiet machine for the timed sections: wait until other processes leave the cores alone, and say so next to a
verdict when they did not.

What the other processes use is measured, not guessed from the load average (which counts the bench's own
threads too): the cores' busy time from ``/proc/stat`` minus the CPU time of the bench's own process tree (this
process and every descendant, ``/proc/PID/stat``: user + system time, its own and its reaped children's), over a
window, in cores. ``wait_quiet()`` runs before each timed section (``bench/run.py``): it returns once the other
processes used less than ``threshold`` cores over ``quiet_for`` seconds, or after ``max_wait`` seconds, saying it
went on while busy. ``during(start, end)`` judges a span that was measured (a section, a loader round). The
1-minute load average is reported beside the figure, not judged.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MAX_WAIT_S", "QUIET_FOR_S", "THRESHOLD", "Quiet", "Sample", "add_wait_option", "before_section", "during",
           "others_cores", "parse_proc_stat", "read_sample", "readings", "tree_ticks", "wait_quiet"]

THRESHOLD = 0.25   # cores the other processes may use on a quiet machine
QUIET_FOR_S = 3.0  # for this long
MAX_WAIT_S = 60.0  # the longest wait before a section; then it goes on, saying the machine was busy
PROC = Path("/proc")


@dataclass(frozen=True)
class Sample:
    """One reading: ``t`` (monotonic seconds), the ticks every core was ``busy`` and their ``total`` since boot,
    the ticks of the bench's ``own`` process tree, and the number of ``cores``."""

    t: float
    busy: int
    total: int
    own: int
    cores: int


@dataclass(frozen=True)
class Quiet:
    """How busy the other processes kept the machine: ``others`` cores of ``cores`` (over the window judged),
    ``busy`` when that was ``threshold`` or more, the 1-minute ``load`` average, ``waited_s`` before a section."""

    busy: bool
    others: float
    cores: int
    load: float
    waited_s: float = 0.0

    def note(self) -> str:
        """One phrase for beside a figure: empty when quiet."""
        if not self.busy:
            return ""
        waited = f", went on after waiting {self.waited_s:.0f} s" if self.waited_s else ""
        return f"machine busy: other processes used {self.others:.2f} of {self.cores} cores, load {self.load:.1f}{waited}"

    def as_dict(self) -> dict:
        return asdict(self)


def parse_proc_stat(text: str) -> tuple[int, int, int]:
    """``(busy, total, cores)`` from the text of ``/proc/stat``: the aggregate ``cpu`` line's ticks spent busy
    (user, nice, system, irq, softirq, steal: time the cores were not ours to use) and in all, and the number
    of ``cpuN`` lines."""
    lines = text.splitlines()
    head = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if head is None:
        raise ValueError(f"no aggregate 'cpu' line in /proc/stat text {text[:80]!r}")
    ticks = [int(v) for v in head[1:9]] + [0] * (8 - len(head[1:9]))
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    busy = user + nice + system + irq + softirq + steal
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy, busy + idle + iowait, max(cores, 1)


def _stat_fields(text: str) -> list[str]:
    """The fields of a ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    return text.rsplit(")", 1)[1].split()


def tree_ticks(root: int, proc: Path = PROC) -> int:
    """CPU ticks of process ``root`` and all its descendants: user + system, and those of their reaped children
    (a child that ends moves its time into its parent's)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


def read_sample(root: int | None = None) -> Sample:
    """A :class:`Sample` now, with ``root`` (default: this process) and its descendants as the bench's own."""
    busy, total, cores = parse_proc_stat((PROC / "stat").read_text())
    return Sample(time.monotonic(), busy, total, tree_ticks(os.getpid() if root is None else root), cores)


def others_cores(a: Sample, b: Sample) -> float:
    """Cores the processes outside the bench's tree kept busy between samples ``a`` and ``b``."""
    total = b.total - a.total
    if total <= 0:
        return 0.0
    return max(0.0, (b.busy - a.busy - (b.own - a.own)) / total * b.cores)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def during(start: Sample, end: Sample, threshold: float = THRESHOLD, load: Callable[[], float] = _load) -> Quiet:
    """How busy the other processes kept the machine between ``start`` and ``end`` (a measured span)."""
    used = others_cores(start, end)
    return Quiet(used >= threshold, used, end.cores, load())


def wait_quiet(threshold: float = THRESHOLD, quiet_for: float = QUIET_FOR_S, max_wait: float = MAX_WAIT_S,
               interval: float = 0.5, *, sample: Callable[[], Sample] = read_sample,
               sleep: Callable[[float], None] = time.sleep, load: Callable[[], float] = _load) -> Quiet:
    """Wait until the other processes used less than ``threshold`` cores in every ``interval`` of the last
    ``quiet_for`` seconds, for at most ``max_wait`` seconds; a quiet :class:`Quiet`, or a busy one that says
    it went on (the other processes' use over the last ``quiet_for`` seconds). ``max_wait=0`` measures one
    ``interval`` and goes on."""
    first = calm = sample()
    recent = deque([first])
    while True:
        sleep(interval)
        now = sample()
        if others_cores(recent[-1], now) >= threshold:
            calm = now
        recent.append(now)
        while len(recent) > 2 and now.t - recent[1].t >= quiet_for:
            recent.popleft()
        waited = now.t - first.t
        if now.t - calm.t >= quiet_for:
            return Quiet(False, others_cores(calm, now), now.cores, load(), waited)
        if waited >= max_wait:  # busy if any interval was; quiet where max_wait < quiet_for and none was
            return Quiet(calm is not first, others_cores(recent[0], now), now.cores, load(), waited)


def readings(quiet: Any) -> list[dict]:
    """Every :class:`Quiet` (as its dict) in ``quiet``: one such dict, a dict of them (``{"before": ...,
    "during": ...}``), or a list of either (one per round); None gives none."""
    if not quiet:
        return []
    if isinstance(quiet, list):
        return [q for one in quiet for q in readings(one)]
    if "busy" in quiet:
        return [quiet]
    return [q for one in quiet.values() for q in readings(one)]


def add_wait_option(parser: argparse.ArgumentParser) -> None:
    """``--quiet-wait SECONDS`` on a bench command line (``args.quiet_wait``)."""
    parser.add_argument("--quiet-wait", type=float, default=MAX_WAIT_S, metavar="SECONDS",
                        help=f"before timing, wait at most this long for the other processes to use less than "
                             f"{THRESHOLD} cores for {QUIET_FOR_S:.0f} s, then go on, saying so (default "
                             f"{MAX_WAIT_S:.0f}; 0: measure and go on)")


def before_section(max_wait: float = MAX_WAIT_S) -> Quiet:
    """:func:`wait_quiet`, then one line saying how quiet the machine was (or that it went on while busy)."""
    quiet = wait_quiet(max_wait=max_wait)
    said = quiet.note() or f"other processes used {quiet.others:.2f} of {quiet.cores} cores"
    print(f"quiet machine: {said}", flush=True)
    return quiet
