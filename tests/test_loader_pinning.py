"""DALI's worker threads pinned one to a CPU (``pin_threads``): by default when the process is its job's only one on
the node, never with ``pin_threads=False``, and when asked in a process among others. The threads are found the way
the Loader finds them: started by its pipeline's build, named by DALI as its executor's workers; never another
pipeline's, another thread's, or another of DALI's pools."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest
import torch

from fastio import ImageTrain, Loader, LoaderConfig
from fastio.dist import alone_on_node, usable_cpus
from fastio.pipelines.base import DALI_WORKER, GraphDef, build_graph

CPUS = usable_cpus()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="pinning needs two CPUs to choose from")


def _threads() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", errors="replace") as f:
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


def _named_workers(started: set[int], count: int) -> dict[int, int]:
    """``{thread id: DALI's number}`` of the DALI workers among ``started``, once ``count`` of them have named
    themselves (each does as it starts, which may be after a batch has run)."""
    deadline = time.monotonic() + 30
    while True:
        found = {tid: int(name[len(DALI_WORKER):].split("]")[0]) for tid, name in _threads().items()
                 if tid in started and name.startswith(DALI_WORKER)}
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _started_by(build, count: int) -> tuple[object, dict[int, int]]:
    """What ``build()`` returns, and the ``count`` DALI workers it started, seen from outside (the threads before
    and after)."""
    before = set(_threads())
    built = build()
    return built, _named_workers(set(_threads()) - before, count)


def _index_pipeline(num_threads: int, meanwhile=lambda: None):
    """A real DALI pipeline built as the Loader builds its graph: the fed indices, passed through (``meanwhile()``
    runs while the graph is defined, in the build)."""
    def body(inputs, _):
        meanwhile()
        return (inputs["index"],)

    graph = GraphDef(inputs=(("index", "int64"),), feed=None, body=body, outputs=("index",), problem=lambda *_: None)
    return build_graph(graph, lambda: (np.arange(4, dtype=np.int64),), batch_size=4, num_threads=num_threads,
                       device="cpu", device_id=None, prefetch=1)


def _named(name: bytes, stop: threading.Event, cpus: set[int] | None = None) -> threading.Thread:
    """A thread of this process that names itself ``name`` (any bytes, as C code may), runs on ``cpus`` if given,
    and waits for ``stop``."""
    def run():
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        named.set()
        stop.wait()

    named = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    named.wait()
    return thread


@needs_two_cpus
def test_a_pipeline_pins_only_the_workers_its_own_build_started():
    """Another DALI pipeline built later (a second Loader, a validation Loader) has workers of the same numbers, and
    a thread started later may carry any name: neither is taken for one of this pipeline's workers."""
    a, mine = _started_by(lambda: _index_pipeline(2), 2)
    b, theirs = _started_by(lambda: _index_pipeline(3), 3)
    stop = threading.Event()
    odd = _named(b"\xff[DALI][TP0]", stop)
    try:
        a.pin_workers(CPUS)
        assert sorted(mine.values()) == [0, 1] and sorted(theirs.values()) == [0, 1, 2]
        assert {tid: os.sched_getaffinity(tid) for tid in mine} == {tid: {CPUS[k]} for tid, k in mine.items()}
        assert {tid: os.sched_getaffinity(tid) for tid in theirs} == {tid: set(CPUS) for tid in theirs}
    finally:
        stop.set()
        odd.join()
        del a, b


def test_a_local_world_size_that_is_no_number_leaves_the_rule_to_the_world_size(monkeypatch):
    for garbage in ("²", "two", "", "-1", "1.0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", garbage)
        assert alone_on_node(1) and not alone_on_node(2), garbage


@needs_two_cpus
def test_a_pipeline_built_in_another_thread_during_a_build_keeps_its_workers_unpinned():
    """Two Loaders made at once in two threads: the one built while the other builds (here: while the first
    defines its graph) starts its workers after that build's, not among them."""
    other = []
    built = threading.Event()

    def build_other():
        other.append(_index_pipeline(3))
        built.set()

    def meanwhile():
        threading.Thread(target=build_other, daemon=True).start()
        built.wait(0.5)  # built by now unless builds take turns

    before = set(_threads())
    a = _index_pipeline(2, meanwhile)
    assert built.wait(60)
    workers = _named_workers(set(_threads()) - before, 5)
    a.pin_workers(CPUS)
    assert sorted(workers.values()) == [0, 0, 1, 1, 2]
    pinned = sorted(k for tid, k in workers.items() if len(os.sched_getaffinity(tid)) == 1)
    assert pinned == [0, 1]  # its two, not one of the other's


@needs_two_cpus
def test_a_dali_pool_other_than_the_executor_keeps_the_placement_dali_gave_it():
    """On cuda the image decoder starts a pool of its own, numbered like the executor's (``[DALI][TP0]MixedDecoder``)
    and placed by DALI near the GPU (its ``affine`` default): only the executor's workers are pinned. Here a thread
    that the build starts stands in for that pool's worker 0 (no GPU), on the CPU DALI would have chosen."""
    stop = threading.Event()
    decoder = []
    before = set(_threads())
    built = _index_pipeline(2, lambda: decoder.append(_named(b"[DALI][TP0]MixedDecoder", stop, {CPUS[-1]})))
    try:
        executor = _named_workers(set(_threads()) - before - {decoder[0].native_id}, 2)
        built.pin_workers(CPUS)
        assert os.sched_getaffinity(decoder[0].native_id) == {CPUS[-1]}
        assert {tid: os.sched_getaffinity(tid) for tid in executor} == {tid: {CPUS[k]} for tid, k in executor.items()}
    finally:
        stop.set()
        decoder[0].join()
