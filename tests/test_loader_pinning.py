"""DALI's worker threads pinned one to a CPU (``pin_threads``): by default when the process is its job's only one on
the node, never with ``pin_threads=False``, and when asked in a process among others. The threads are found the way
the Loader finds them: started by its pipeline, named by DALI."""

from __future__ import annotations

import os

import pytest
import torch

from fastio import ImageTrain, Loader, LoaderConfig
from fastio.dist import alone_on_node, usable_cpus
from fastio.pipelines.base import DALI_WORKER

CPUS = usable_cpus()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs to choose from")


def _threads() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            continue
    return out


def _worker_affinities(dest, **options) -> tuple[list[set[int]], dict]:
    """The CPU sets of the worker threads a Loader's pipeline started (by DALI's order), after two batches; and
    its first batch."""
    before = set(_threads())
    with Loader(dest, batch_size=4, pipeline=ImageTrain(size=16), device="cpu", rank=0, **options) as loader:
        it = iter(loader)
        first = next(it)
        next(it)
        workers = sorted((name, tid) for tid, name in _threads().items()
                         if tid not in before and name.startswith(DALI_WORKER))
        return [os.sched_getaffinity(tid) for _, tid in workers], first


@needs_two_cpus
def test_a_loader_alone_on_its_node_pins_each_worker_to_one_cpu_in_turn(image_dataset, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sets, _ = _worker_affinities(image_dataset, world_size=1, num_threads=3)
    assert sets == [{CPUS[0]}, {CPUS[1]}, {CPUS[2 % len(CPUS)]}]


@needs_two_cpus
def test_pin_threads_false_leaves_every_worker_to_the_scheduler_and_the_batches_are_the_same(image_dataset):
    unpinned, a = _worker_affinities(image_dataset, world_size=1, num_threads=2, pin_threads=False)
    pinned, b = _worker_affinities(image_dataset, world_size=1, num_threads=2, pin_threads=True)
    assert unpinned == [set(CPUS)] * 2 and pinned == [{CPUS[0]}, {CPUS[1]}]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])


@needs_two_cpus
def test_a_process_among_others_on_its_node_pins_only_when_asked(image_dataset, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _worker_affinities(image_dataset, world_size=2, num_threads=2)[0] == [set(CPUS)] * 2
    assert _worker_affinities(image_dataset, world_size=2, num_threads=2, pin_threads=True)[0] == [{CPUS[0]}, {CPUS[1]}]


def test_the_node_is_the_process_own_when_the_launcher_or_the_world_says_so(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert alone_on_node(1) and not alone_on_node(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process per node, eight nodes
    assert alone_on_node(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not alone_on_node(1)
    assert usable_cpus() == sorted(os.sched_getaffinity(0))


def test_a_pin_threads_that_is_not_a_bool_is_refused_naming_it():
    with pytest.raises(ValueError, match="pin_threads must be True, False or None, got 'yes'"):
        LoaderConfig(batch_size=4, pin_threads="yes")
