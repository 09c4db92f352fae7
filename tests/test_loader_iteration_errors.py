"""A failed ``next()`` on a Loader's iterator: the error reaches the loop as it was raised, and the next ``next()`` on
the same iterator asks for the batch that failed again. The iterator was a generator, which a raised error finishes:
a loop that caught the error and went on ended silently, as if the epoch were over, its samples lost. (With
``replicas=``, a refused batch of a torchft step: tests/test_torchft_loader.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fastio import ImageEval
from fastio.errors import DatasetError
from fastio.loader import Loader
from fastio.read.feeder import Feeder
from fastio.read.stats import Stats

BATCHES = 6  # 48 samples, batches of 8; without shuffling batches 4 and 5 are those of shard-000002.tar


def _loader(dest: Path, pipeline=None, **options) -> Loader:
    return Loader(dest, batch_size=8, pipeline=pipeline or ImageEval(size=32), device="cpu", world_size=1, rank=0,
                  num_threads=1, shuffle="none", **options)


def _epoch(dest: Path) -> list[dict]:
    """An uninterrupted epoch of the same Loader: its batches' indices and images."""
    with _loader(dest) as loader:
        return [_kept(batch) for batch in loader]


def _kept(batch: dict) -> dict:
    return {"index": batch["index"].tolist(), "image": batch["image"].clone()}


def _damage(shard: Path) -> bytes:
    """Rewrite the name in the first tar header of ``shard`` (the same size, another key: its reads fail, naming
    the shard); returns its bytes, to :func:`_restore`."""
    data = shard.read_bytes()
    shard.chmod(0o644)
    _restore(shard, b"xxxx" + data[4:])
    return data


def _restore(shard: Path, data: bytes) -> None:
    """Write ``data`` into ``shard`` in place, its mtime kept: the file the reader opened, unchanged as far as it
    can tell (a changed size or mtime is refused as a shard replaced while being read)."""
    before = shard.stat()
    shard.write_bytes(data)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


def _same(got: list[dict], want: list[dict]) -> bool:
    return [b["index"] for b in got] == [b["index"] for b in want] and \
        all(torch.equal(g["image"], w["image"]) for g, w in zip(got, want))


def test_next_after_a_failed_next_delivers_the_batch_that_failed_and_the_epoch_loses_and_repeats_nothing(
        image_dataset):
    want = _epoch(image_dataset)
    shard = image_dataset / "shards" / "shard-000002.tar"
    intact = _damage(shard)
    loader = _loader(image_dataset)
    it = iter(loader)
    got, failed_at = [], []
    while len(got) < BATCHES:
        try:
            batch = next(it)
        except DatasetError as err:
            assert "shard-000002.tar" in str(err) and "rewritten after it was indexed" in str(err), err
            failed_at.append(len(got))
            _restore(shard, intact)  # the storage is back: the loop goes on with the same iterator
            batch = next(it, None)
            assert batch is not None, f"the iterator ended after the error at batch {len(got)} of {BATCHES}"
        got.append(_kept(batch))
    assert len(failed_at) == 1 and 3 <= failed_at[0] <= 4, failed_at  # the batch that feeds, or reads, shard 2
    assert _same(got, want)
    with pytest.raises(StopIteration):  # the end of the epoch stays the end of this iterator
        next(it)
    assert (loader.epoch, loader.consumed) == (1, 0)
    assert loader.stats()["last_epoch"]["batches"] == BATCHES
    assert [b["index"].tolist() for b in loader] == [b["index"] for b in want]  # the next epoch (no shuffle)
    loader.close()


def test_a_for_loop_entered_again_over_the_same_iterator_goes_on_from_the_batch_that_failed(image_dataset):
    want = _epoch(image_dataset)
    shard = image_dataset / "shards" / "shard-000002.tar"
    intact = _damage(shard)
    got, errors = [], []
    with _loader(image_dataset) as loader:
        it = iter(loader)
        for _ in range(3):
            try:
                for batch in it:
                    got.append(_kept(batch))
                break
            except DatasetError as err:
                errors.append(str(err))
                _restore(shard, intact)
    assert len(errors) == 1 and "shard-000002.tar" in errors[0], errors
    assert _same(got, want), [b["index"] for b in got]


def test_an_error_in_the_loop_body_or_at_the_first_batch_keeps_the_position(image_dataset):
    """The first batch failing (nothing delivered yet) is asked again; so is nothing after an error raised by the
    loop's own body, which is not the iterator's (the next batch is the one after the last delivered)."""
    want = _epoch(image_dataset)
    shard = image_dataset / "shards" / "shard-000000.tar"
    intact = _damage(shard)
    with _loader(image_dataset) as loader:
        it = iter(loader)
        with pytest.raises(DatasetError, match="shard-000000.tar"):
            next(it)
        _restore(shard, intact)
        got = [_kept(next(it))]
        with pytest.raises(ArithmeticError, match="the training step fails"):
            for batch in it:
                got.append(_kept(batch))
                raise ArithmeticError("the training step fails")
        got += [_kept(batch) for batch in it]
    assert _same(got, want), [b["index"] for b in got]


def test_iterating_the_loader_again_after_a_failed_next_starts_at_the_batch_that_failed(image_dataset):
    """The other way a loop goes on after an error: ``for batch in loader`` again (a new iterator; the failed one is
    closed, and with it the stream the failure left) gives the batch that failed and the rest of the epoch."""
    want = _epoch(image_dataset)
    shard = image_dataset / "shards" / "shard-000001.tar"
    with _loader(image_dataset) as loader:
        got = []
        intact = _damage(shard)
        with pytest.raises(DatasetError, match="shard-000001.tar"):
            for batch in loader:
                got.append(_kept(batch))
        _restore(shard, intact)
        got += [_kept(batch) for batch in loader]
    assert len(got) == len(want) and _same(got, want), [b["index"] for b in got]


@dataclass(frozen=True)
class _BuildFailsOnce(ImageEval):
    """``ImageEval`` whose graph's first build fails (a transient error in DALI's build, e.g. out of memory)."""

    def graph(self):
        real, builds = super().graph(), []

        def body(inputs, device):
            builds.append(device)
            if len(builds) == 1:
                raise RuntimeError("the graph's first build fails")
            return real.body(inputs, device)

        return dataclasses.replace(real, body=body)


def _failed_build(loader: Loader):
    """An iterator of ``loader`` (of ``_BuildFailsOnce``) whose first ``next()`` failed."""
    it = iter(loader)
    with pytest.raises(RuntimeError, match="the graph's first build fails"):
        next(it)
    return it


@pytest.mark.parametrize("again", ["the same iterator", "a new iterator"])
def test_a_graph_whose_build_failed_is_built_again_before_the_next_batch(image_dataset, again):
    """The stream a failed build left (its reads started, no graph) is not used: the next ``next()``, on the same
    iterator or on a new one (``for batch in loader`` again), builds the graph again and delivers decoded batches,
    not the read bytes."""
    want = _epoch(image_dataset)
    with _loader(image_dataset, _BuildFailsOnce(size=32)) as loader:
        it = _failed_build(loader)
        got = [_kept(batch) for batch in (it if again == "the same iterator" else loader)]
    assert _same(got, want), [b["index"] for b in got]


def _interrupted_at(call, code) -> bool:
    """``call()``, with a KeyboardInterrupt raised as ``code`` is first called (a Ctrl-C arriving just then):
    whether it was called."""
    hits, traced = [], sys.gettrace()

    def trace(frame, event, arg):
        if event == "call" and frame.f_code is code and not hits:
            hits.append(frame)
            raise KeyboardInterrupt  # the trace is unset as it raises
        return None

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        sys.settrace(traced)
    return bool(hits)


def test_a_ctrl_c_while_the_failed_stream_is_dropped_leaves_the_batch_to_the_next_next(image_dataset):
    """The next ``next()`` after a failure first drops the stream the failure left (DALI's threads and buffers:
    it takes a while); a Ctrl-C then reaches the loop, and the ``next()`` after it still asks for the batch that
    failed, not an end of the epoch."""
    want = _epoch(image_dataset)
    with _loader(image_dataset, _BuildFailsOnce(size=32)) as loader:
        it = _failed_build(loader)
        assert loader._feeder is not None  # the reads the failed build left, dropped by the next call
        hits = _interrupted_at(lambda: next(it), Feeder.cancel.__code__)
        assert hits, "the stream was not dropped"
        got = [_kept(batch) for batch in it]
    assert _same(got, want), [b["index"] for b in got]


def test_a_ctrl_c_while_the_loader_closes_still_closes_its_reader(image_dataset, tmp_path):
    """``close()`` stops DALI's threads, then the reader's: a Ctrl-C in the first step left the reader's threads and
    its open shards for good (``close()`` again returns at once, the Loader being closed). Every step runs now."""
    dest = tmp_path / "own"  # shards no other Loader of this process has open
    shutil.copytree(image_dataset, dest)

    def open_shards() -> list[str]:
        fds = Path("/proc/self/fd")
        return [t for t in (os.readlink(fd) for fd in fds.iterdir() if fd.name.isdigit() and fd.exists())
                if t.startswith(str(dest / "shards"))]

    loader = _loader(dest)
    next(iter(loader))
    assert open_shards()  # the reader keeps its shards open
    assert _interrupted_at(loader.close, Feeder.cancel.__code__)
    assert not open_shards()
    loader.close()  # harmless


def test_a_progress_line_that_cannot_be_written_loses_no_batch_and_keeps_the_epoch(image_dataset, monkeypatch):
    """``progress=True`` writes a line at each epoch's end, after the Loader's position has moved past the last
    batch: a stderr that cannot be written (a terminal gone, a closed pipe) raised there, and the ``next()`` after
    the error, which asks for the batch at the position, went on into the next epoch: the last batch was lost. A
    progress line that cannot be written is left out."""
    want = _epoch(image_dataset)
    read, write = os.pipe()
    os.close(read)
    broken = open(write, "w")  # noqa: SIM115 - closed below, its unwritten line dropped
    got, errors = [], []
    with _loader(image_dataset, progress=True) as loader:
        monkeypatch.setattr(sys, "stderr", broken)
        it = iter(loader)
        while len(got) <= BATCHES and len(errors) < 2:
            try:
                got.append(_kept(next(it)))
            except StopIteration:
                break
            except OSError as err:
                errors.append(err)
        monkeypatch.undo()
    with contextlib.suppress(OSError):
        broken.close()
    assert not errors and _same(got, want), (errors, [b["index"] for b in got])
    assert (loader.epoch, loader.consumed) == (1, 0)


def test_a_ctrl_c_in_the_epochs_progress_line_leaves_the_position_before_the_last_batch(image_dataset):
    """A Ctrl-C while the epoch's progress line is printed (the last batch made, not yet delivered): the position
    a save then takes, and the next ``next()``, are at that batch, not past it in the next epoch."""
    want = _epoch(image_dataset)
    with _loader(image_dataset, progress=True) as loader:
        it = iter(loader)
        got = [_kept(next(it)) for _ in range(BATCHES - 1)]
        hits = _interrupted_at(lambda: next(it), Stats._print.__code__)
        assert hits and (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (0, 40)
        got += [_kept(batch) for batch in it]
        assert (loader.epoch, loader.consumed) == (1, 0)
    assert _same(got, want), [b["index"] for b in got]


def test_an_error_kept_after_a_failed_next_does_not_keep_the_dropped_pipeline(image_dataset):
    """The stream a failure dropped goes with its DALI pipeline (threads, buffers: GPU memory on cuda), also while
    the loop still holds the error (the ``except`` block that asks again, a list of errors): the pipeline is not
    kept by the error's traceback once the batch is asked again."""
    shard = image_dataset / "shards" / "shard-000002.tar"
    intact = _damage(shard)
    with _loader(image_dataset) as loader:
        it = iter(loader)
        next(it)
        pipeline = weakref.ref(loader._built.pipe)
        with pytest.raises(DatasetError, match="shard-000002.tar") as failure:
            for _ in range(BATCHES):
                next(it)
        _restore(shard, intact)
        assert next(it)["index"].tolist()[0] == loader.consumed - 8
        gc.collect()
        held = [getattr(r, "f_code", type(r)) for r in gc.get_referrers(pipeline())] if pipeline() else []
        assert pipeline() is None, held
    assert failure.value is not None


def test_a_lightning_loaders_iterator_goes_on_after_a_failed_next(image_dataset):
    """``LightningLoader`` (what ``FastioDataModule`` hands Lightning) iterated directly: a failed ``next()`` leaves
    its iterator going, as the Loader's (it was a generator, ended by the error: the rest of the epoch was lost)."""
    pytest.importorskip("lightning.pytorch")
    from fastio.integrations.lightning import LightningLoader

    want = _epoch(image_dataset)
    shard = image_dataset / "shards" / "shard-000001.tar"
    intact = _damage(shard)
    with _loader(image_dataset) as loader:
        it, got = iter(LightningLoader(loader)), []
        with pytest.raises(DatasetError, match="shard-000001.tar"):
            while True:
                got.append(_kept(next(it)))
        _restore(shard, intact)
        got += [_kept(batch) for batch in it]
    assert _same(got, want), [b["index"] for b in got]
