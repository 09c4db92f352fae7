"""bench/quiet.py, the one helper that waits for a quiet machine before each timed section and says when it went
on while busy: synthetic /proc/stat samples, and a real child process burning a core."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.quiet import Quiet, Sample, during, others_cores, parse_proc_stat, read_sample, tree_ticks, wait_quiet

PROC_STAT = """cpu  1000 10 500 8000 200 5 7 3 0 0
cpu0 500 5 250 4000 100 3 4 2 0 0
cpu1 500 5 250 4000 100 2 3 1 0 0
intr 12345
ctxt 999
"""


def test_proc_stat_gives_busy_and_total_ticks_and_the_cores():
    busy, total, cores = parse_proc_stat(PROC_STAT)
    assert (busy, total, cores) == (1000 + 10 + 500 + 5 + 7 + 3, 1000 + 10 + 500 + 8000 + 200 + 5 + 7 + 3, 2)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_proc_stat("intr 1\n")


def test_the_benchs_own_tree_does_not_count_as_other_processes():
    a = Sample(0.0, busy=1000, total=4000, own=300, cores=2)
    b = Sample(1.0, busy=1150, total=4200, own=450, cores=2)  # every busy tick of the second was the bench's
    assert others_cores(a, b) == 0.0
    c = Sample(1.0, busy=1150, total=4200, own=350, cores=2)  # 100 of 200 ticks by others: one core of two
    assert others_cores(a, c) == pytest.approx(1.0)


class Machine:
    """Samples of a 2-core machine, one every ``step`` seconds, the other processes using ``others(t)`` cores."""

    def __init__(self, others, step: float = 0.5, hz: int = 100):
        self.others, self.step, self.hz, self.t, self.busy, self.total = others, step, hz, 0.0, 0, 0

    def sample(self) -> Sample:
        s = Sample(self.t, self.busy, self.total, 0, 2)
        self.busy += round(self.others(self.t) * self.hz * self.step)
        self.total += round(2 * self.hz * self.step)
        self.t += self.step
        return s


def wait(machine: Machine, **kwargs) -> Quiet:
    return wait_quiet(sample=machine.sample, sleep=lambda s: None, load=lambda: 0.5, **kwargs)


def test_waits_until_the_others_were_quiet_for_the_whole_window():
    got = wait(Machine(lambda t: 1.5 if t < 4 else 0.05), quiet_for=3, max_wait=60)
    assert not got.busy and got.note() == ""
    assert 7 <= got.waited_s <= 7.5 and got.others == pytest.approx(0.05, abs=0.02)


def test_a_short_spike_restarts_the_quiet_window():
    got = wait(Machine(lambda t: 0.9 if 2 <= t < 2.5 else 0.0), quiet_for=3, max_wait=60)
    assert not got.busy and got.waited_s == pytest.approx(5.5)


def test_gives_up_after_max_wait_and_says_it_went_on_while_busy():
    got = wait(Machine(lambda t: 1.2), quiet_for=3, max_wait=10)
    assert got.busy and got.waited_s == pytest.approx(10)
    assert got.others == pytest.approx(1.2, abs=0.05)
    assert got.note() == "machine busy: other processes used 1.20 of 2 cores, load 0.5, went on after waiting 10 s"


def test_no_wait_measures_one_interval_and_goes_on():
    assert wait(Machine(lambda t: 0.0), max_wait=0).busy is False
    assert wait(Machine(lambda t: 1.0), max_wait=0).busy is True


def test_a_span_is_judged_by_what_the_others_used_in_it():
    m = Machine(lambda t: 0.6)
    start, _, end = m.sample(), m.sample(), m.sample()
    got = during(start, end, load=lambda: 3.0)
    assert got.busy and got.others == pytest.approx(0.6) and "load 3.0" in got.note()


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_child_burning_a_core_is_busy_for_another_tree_and_the_benchs_own_for_this_one():
    """Real processes: a burner child of this test counts as the other processes' for a sampler whose tree is an
    idle sibling, and as this process's own (not the others') for a sampler rooted here."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        # the burner's own ticks are read inside both trees' windows, so its share of each is all of them
        start_mine, start_idle, burned = read_sample(), read_sample(idle.pid), cpu_ticks(burner.pid)
        got = wait_quiet(quiet_for=0.5, max_wait=0.6, interval=0.2, sample=lambda: read_sample(idle.pid))
        burned = cpu_ticks(burner.pid) - burned
        end_mine, end_idle = read_sample(), read_sample(idle.pid)
        assert got.busy and got.others >= 0.25 and "other processes used" in got.note()
        assert burned > 0
        mine, theirs = end_mine.own - start_mine.own, end_idle.own - start_idle.own
        assert mine >= burned and theirs < burned  # the burner is in this process's tree, not in the idle one's
        assert tree_ticks(os.getpid()) >= cpu_ticks(burner.pid)
    finally:
        for proc in (burner, idle):
            proc.kill()
            proc.wait()
