"""fastio.convert.workers.OrderedPool: ordered results, errors handed back, a stop that cannot hang, and workers that
are never a copy of their caller (its garbage, its threads, its main module)."""

import gc
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from fastio.convert.workers import OrderedPool

_STATE = {}


def _init(offset):
    _STATE["offset"] = offset


def _add(x):
    if x == "boom":
        raise ValueError("bad item boom")
    time.sleep(0.001 * (x % 3))  # uneven work: results still come back in order
    return x + _STATE["offset"], os.getpid()


def test_results_come_in_order_from_every_worker():
    with OrderedPool(_add, 3, initializer=_init, initargs=(1000,), chunksize=2, window=2) as pool:
        out = list(pool.map(range(100)))
        again = list(pool.map(range(5), chunksize=1))  # the pool serves one map after another
    assert [v for v, _ in out] == list(range(1000, 1100)) and [v for v, _ in again] == list(range(1000, 1005))
    assert len({pid for _, pid in out}) == 3 and os.getpid() not in {pid for _, pid in out}


def test_an_error_in_a_worker_reaches_the_caller_and_close_is_immediate():
    pool = OrderedPool(_add, 2, initializer=_init, initargs=(0,), chunksize=1)
    results = pool.map([1, 2, "boom", *range(10_000)])
    assert [v for v, _ in (next(results), next(results))] == [1, 2]
    with pytest.raises(ValueError, match="bad item boom"):
        next(results)
    started = time.monotonic()
    pool.close()  # workers mid-stream, tasks still queued: a Pool.terminate() here could hang
    assert time.monotonic() - started < 10
    assert all(not p.is_alive() for p in pool._procs)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        OrderedPool(_add, bad)


def _open_files(_):
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def test_workers_hold_no_descriptor_of_their_parent(tmp_path):
    """A worker that kept the parent's lock (or stdout) open would outlive a killed parent holding them."""
    from fastio.storage.lock import LOCK_NAME, DirLock

    with DirLock(tmp_path, "test"), OrderedPool(_open_files, 2) as pool:
        files = list(pool.map([0, 1]))
    for held in files:
        assert str(tmp_path / LOCK_NAME) not in held.values()
        assert held[1] == "/dev/null" and held[0] == "/dev/null"
        assert len([fd for fd in held if fd > 2]) == 1, held  # its own pipe end only


def _seen(_):
    return _STATE.get("parent_only"), os.getpid()


def test_a_pool_inherits_nothing_of_its_parent_but_its_initializer_unless_it_forks():
    _STATE["parent_only"] = "set in the parent"  # a forked worker sees it (as it would an object-store client)
    try:
        with OrderedPool(_seen, 2) as served, OrderedPool(_seen, 2, method="spawn") as spawned, \
                OrderedPool(_seen, 1, method="fork") as forked:
            assert [v for v, _ in served.map(range(4))] == [None] * 4
            assert [v for v, _ in spawned.map(range(4))] == [None] * 4
            assert [v for v, _ in forked.map(range(2))] == ["set in the parent"] * 2
    finally:
        del _STATE["parent_only"]
    with pytest.raises(ValueError, match="method must be one of 'forkserver', 'spawn', 'fork' or None, got 'thread'"):
        OrderedPool(_seen, 1, method="thread")


def test_a_function_of_main_is_refused_in_one_line():
    def main_fn(x):
        return x

    main_fn.__module__ = "__main__"  # as a script's function is
    with pytest.raises(ValueError, match=r"main_fn, None: a worker of the fork server cannot import a function "
                                         r"defined in __main__; define it in a module"):
        OrderedPool(main_fn, 1)


def _abort(_):
    os.abort()


def test_a_worker_that_dies_is_reported_with_the_signal_that_ended_it():
    with OrderedPool(_abort, 1) as pool, pytest.raises(RuntimeError, match=r"a worker process died \(exit code -6\)"):
        list(pool.map([0]))

def test_a_worker_dead_before_its_first_chunk_is_named_not_a_broken_pipe():
    """The send to a worker that already died fails (EPIPE): the error names the worker's death and its signal,
    as a death found while reading does (it was the caller's "Broken pipe")."""
    with OrderedPool(_add, 2, initializer=_init, initargs=(0,)) as pool:
        pool._procs[1].kill()
        pool._procs[1].join()
        with pytest.raises(RuntimeError, match=r"a worker process died \(exit code -9\)"):
            list(pool.map(range(8)))


def test_a_worker_whose_caller_is_gone_exits_quietly(capfd):
    """A caller killed mid-run (SIGKILL) closes its pipe ends before the kernel's death signal reaches the workers: a
    worker that finds its pipe broken (a result it cannot send) or reset (a result never read) exits at once without
    multiprocessing's "Process ForkProcess-N:" and traceback (the terminal shows only the caller's death)."""
    pool = OrderedPool(time.sleep, 2, method="fork")
    try:
        pool._conns[0].send([0.3])  # busy when the caller goes: its result has nowhere to go
        pool._conns[1].send([0])
        assert pool._conns[1].poll(10)  # its result is waiting, unread, when the caller goes
        for conn in pool._conns:
            conn.close()
        for proc in pool._procs:
            proc.join(10)
        assert [proc.exitcode for proc in pool._procs] == [0, 0]
        assert capfd.readouterr().err == ""
    finally:
        pool.close()


def _environ(name):
    return os.environ.get(name)


def test_a_worker_sees_its_callers_environment_of_now_not_the_fork_servers(monkeypatch):
    """The fork server outlives a pool: a later pool's workers get the caller's environment as it is when they
    start (credentials or an endpoint a script sets between two conversions), not the server's from its start."""
    with OrderedPool(_environ, 1) as pool:
        assert list(pool.map(["FASTIO_TEST_LATER"])) == [None]
    monkeypatch.setenv("FASTIO_TEST_LATER", "set since")
    with OrderedPool(_environ, 2) as pool:
        assert list(pool.map(["FASTIO_TEST_LATER"] * 4)) == ["set since"] * 4


def _collect_garbage(_):
    """A full collection in the worker: it frees whatever garbage the worker holds."""
    gc.collect()
    return os.getpid()


def _within(seconds: float, pool: OrderedPool, items) -> list:
    """``list(pool.map(items))``, or a failure after ``seconds`` (a worker hangs: the pool is closed)."""
    out: list = []

    def read() -> None:
        try:
            out.append(list(pool.map(items)))
        except BaseException as err:
            out.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    if reader.is_alive():
        pool.close()
        pytest.fail(f"the workers did not answer in {seconds} s")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]

def _in_a_cycle(obj) -> None:
    """Drop ``obj`` into a reference cycle: only the garbage collector frees it, later."""
    holder = {"obj": obj}
    holder["self"] = holder


def test_a_worker_never_runs_the_finalizers_of_its_callers_garbage(tmp_path):
    """The caller's garbage (objects in reference cycles its collector has not freed yet) is the caller's to free: a
    worker that was a copy of the caller would free its copy and run the finalizers there. A TemporaryDirectory
    freed in a worker deletes the caller's directory."""
    gc.collect()
    folder = tempfile.TemporaryDirectory(dir=tmp_path)
    name = folder.name
    _in_a_cycle(folder)
    del folder
    with OrderedPool(_collect_garbage, 2) as pool:
        assert len(set(_within(30, pool, range(4)))) == 2
    assert os.path.isdir(name), "a worker ran the finalizer of its caller's TemporaryDirectory"
    gc.collect()  # here, in the caller, it is freed
    assert not os.path.isdir(name)


def test_a_forked_worker_never_frees_its_callers_garbage_either(tmp_path):
    """Forked (the CLI's workers), the caller's objects are frozen while the workers start: a worker's collector
    never frees the copy of the caller's garbage, so never runs its finalizers."""
    gc.collect()
    folder = tempfile.TemporaryDirectory(dir=tmp_path)
    name = folder.name
    _in_a_cycle(folder)
    del folder
    with OrderedPool(_collect_garbage, 2, method="fork") as pool:
        assert len(set(_within(30, pool, range(4)))) == 2
    assert os.path.isdir(name), "a forked worker ran the finalizer of its caller's TemporaryDirectory"
    gc.collect()
    assert not os.path.isdir(name)


def test_workers_are_forked_only_from_a_process_nothing_else_runs_in():
    """The command's process (one thread, no torch, no DALI) forks its workers; one with another thread or with
    torch imported (a training script, a notebook) starts them from the fork server."""
    probe = ("import sys, threading, time; import fastio.convert.workers as w; print(w._default_method()); "
             "{}; print(w._default_method())")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # as the command sets it: numpy starts no thread pool
    for then in ("import torch", "threading.Thread(target=time.sleep, args=(2,), daemon=True).start()",
                 "import obstore, obstore.store as s, tempfile; obstore.put(s.LocalStore(tempfile.mkdtemp()), 'a', b'x')"):
        # the last: an object-store client's native runtime (obstore's threads)
        out = subprocess.run([sys.executable, "-c", probe.format(then)], capture_output=True, text=True, check=True,
                             env=env)
        assert out.stdout.split() == ["fork", "forkserver"], (then, out.stdout, out.stderr)


def test_a_worker_outlives_its_callers_garbage_process_group():
    """What failed a conversion run in a process that had run torchft: a torch gloo process group (what a torchft
    Manager holds) left in the caller's garbage joins its threads as it is freed; in a copy of the caller, which
    has none of them, that crashed the worker (SIGSEGV or SIGABRT) or hung it."""
    import torch.distributed as dist

    gc.collect()
    _in_a_cycle(dist.ProcessGroupGloo(dist.HashStore(), 0, 1))
    with OrderedPool(_collect_garbage, 2) as pool:
        assert len(set(_within(30, pool, range(4)))) == 2
    gc.collect()


SCRIPT = """\
from pathlib import Path

import torch

from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder

print("the script ran", flush=True)
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's threads, at work
src = make_imagefolder(Path("src"), classes=2, per_class=4, min_side=32, max_side=48)
print("samples", convert(ConvertConfig(source=src, dest=Path("ds"), workers=2, progress=False)).samples)
"""


def test_a_script_without_a_main_guard_converts_once_with_workers(warm, tmp_path):
    """A training script that converts at its top level, torch imported and at work: the workers run fastio's
    functions only, never the script again (as multiprocessing's forkserver and spawn workers would, converting
    again in each worker)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rc, out, err = warm.run(script, tmp_path, timeout=120)
    assert rc == 0, err
    assert out.splitlines() == ["the script ran", "samples 8"], out
