"""What a Loader delivers: tensors, labels, indices, order contracts, pipelines, stats."""

from __future__ import annotations

import dataclasses
import io
import re
import time
from itertools import islice

import numpy as np
import pytest
import torch
from conftest import write_image_dataset
from PIL import Image
from resume import batches, same_batch

import fastio
from fastio import Graph, ImageEval, ImageTrain, Raw
from fastio.dataset.dataset import Dataset
from fastio.loader import Loader, LoaderConfig
from fastio.order.sampler import Sampler, SamplerSpec
from fastio.pipelines import build_graph
from fastio.pipelines.augment import random_resized_crop
from fastio.read.feeder import Feeder
from fastio.read.reader import Reader
from fastio.read.stats import Stats


def _loader(dest, **kw):
    opts = dict(batch_size=8, pipeline=ImageTrain(size=32), device="cpu", seed=0, world_size=1, rank=0, num_threads=1)
    opts.update(kw)
    return Loader(dest, **opts)


def test_image_train_batch_and_labels(image_dataset):
    loader = _loader(image_dataset)
    assert len(loader) == 6
    epoch = list(loader)
    assert len(epoch) == 6
    b = epoch[0]
    assert b["image"].shape == (8, 3, 32, 32) and b["image"].dtype == torch.float32
    assert b["label"].dtype == torch.int64 and b["index"].dtype == torch.int64 and b["padded"].dtype == torch.bool
    label_map = Dataset(image_dataset).label_map
    for batch in epoch:
        for i, y in zip(batch["index"].tolist(), batch["label"].tolist()):
            assert label_map[loader.key(i).split("/")[0]] == y
    seen = torch.cat([e["index"] for e in epoch]).tolist()
    assert sorted(seen) == list(range(48))
    # normalised with ImageNet mean/std: values are centred, not 0..255
    assert -3 < float(b["image"].mean()) < 3 and float(b["image"].std()) > 0.1


def test_train_pixels_match_a_pil_reference_of_the_computed_crop(image_dataset):
    """DALI decodes exactly the window fastio computed: PIL crop + resize + flip + normalize agrees."""
    b = next(iter(_loader(image_dataset, seed=3)))
    raw = next(iter(_loader(image_dataset, seed=3, pipeline=Raw())))
    assert torch.equal(raw["index"], b["index"])
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    for j, i in enumerate(b["index"].tolist()):
        img = Image.open(io.BytesIO(raw["jpg"][j])).convert("RGB")
        p = random_resized_crop(3, 0, np.array([i]), np.array([img.width]), np.array([img.height]))
        (x, y), (w, h) = p.anchor[0].tolist(), p.shape[0].tolist()
        ref = img.resize((32, 32), Image.BILINEAR, box=(x, y, x + w, y + h))
        if p.flip[0]:
            ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
        ref = ((np.asarray(ref, np.float32) / 255 - mean) / std).transpose(2, 0, 1)
        assert float(np.abs(b["image"][j].numpy() - ref).mean()) < 0.03, f"sample {i}: wrong window or flip"


def test_epochs_advance_by_themselves_and_differ(image_dataset):
    loader = _loader(image_dataset)
    e0 = torch.cat([b["index"] for b in loader])
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0
    e1 = torch.cat([b["index"] for b in loader])
    assert sorted(e1.tolist()) == list(range(48)) and not torch.equal(e0, e1)
    assert loader.stats()["last_epoch"]["batches"] == 6


def test_order_and_pixels_do_not_depend_on_threads_or_prefetch(image_dataset):
    slow = list(_loader(image_dataset, num_threads=1, prefetch=1, read_ahead=0, reader_threads=1))
    fast = list(_loader(image_dataset, num_threads=2, prefetch=3, read_ahead=4, reader_threads=3))
    assert all(same_batch(a, b) for a, b in zip(slow, fast)) and len(slow) == len(fast)


def test_rank_slices_concatenate_to_the_single_rank_order(image_dataset):
    one = list(_loader(image_dataset, pipeline=Raw(), batch_size=8))
    two = [list(_loader(image_dataset, pipeline=Raw(), batch_size=4, world_size=2, rank=r)) for r in range(2)]
    assert len(two[0]) == len(two[1]) == len(one)
    for g, b in enumerate(one):
        joined = torch.cat([two[0][g]["index"], two[1][g]["index"]])
        assert torch.equal(joined, b["index"])


def test_eval_is_deterministic_and_train_varies_by_epoch(image_dataset):
    def images(loader, n_epochs):
        out = []
        for _ in range(n_epochs):
            out.append({int(i): b["image"][j] for b in loader for j, i in enumerate(b["index"])})
        return out

    ev = images(_loader(image_dataset, pipeline=ImageEval(size=32)), 2)
    assert all(torch.equal(ev[0][i], ev[1][i]) for i in range(48))
    tr = images(_loader(image_dataset), 2)
    differ = sum(not torch.equal(tr[0][i], tr[1][i]) for i in range(48))
    assert differ > 40


def test_raw_pipeline_returns_the_stored_bytes(image_dataset, image_folder):
    loader = _loader(image_dataset, pipeline=Raw())
    b = next(iter(loader))
    assert set(b) == {"jpg", "cls", "label", "index", "padded", "has"}
    assert set(b["has"]) == {"jpg", "cls"} and all(bool(m.all()) for m in b["has"].values())
    for j, i in enumerate(b["index"].tolist()):
        key = loader.key(i)
        assert b["jpg"][j] == (image_folder / f"{key}.jpg").read_bytes()
        assert int(b["cls"][j]) == int(b["label"][j])


def test_user_pipeline_and_output_options(image_dataset):
    from nvidia.dali import fn

    def graph(image, device):
        return {"small": fn.resize(image, resize_x=16, resize_y=12), "big": fn.resize(image, resize_x=20, resize_y=20)}

    b = next(iter(_loader(image_dataset, pipeline=Graph(graph))))
    assert b["small"].shape == (8, 12, 16, 3) and b["small"].dtype == torch.uint8
    assert b["big"].shape == (8, 20, 20, 3) and "label" in b
    u8 = next(iter(_loader(image_dataset, pipeline=ImageTrain(dtype="uint8", layout="HWC", size=24))))
    assert u8["image"].shape == (8, 24, 24, 3) and u8["image"].dtype == torch.uint8
    h = next(iter(_loader(image_dataset, pipeline=ImageTrain(size=32, dtype="float16"))))
    assert h["image"].dtype == torch.float16



@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 + 5])
def test_any_integer_seed_seeds_dali_reproducibly(image_dataset, seed):
    """DALI's pipeline takes a seed in 0..2**63-1 and draws a random one for a negative seed: seed=2**63 failed with
    a bare TypeError from DALI's constructor (also for ImageTrain, which draws nothing in DALI), and seed=-1 gave a
    user graph's DALI random operators another draw in every run."""
    from nvidia.dali import fn

    def graph(image, device):
        return {"noise": fn.random.uniform(shape=[4])}  # seeded from the pipeline's seed

    runs = [next(iter(_loader(image_dataset, pipeline=Graph(graph), seed=seed)))["noise"] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert next(iter(_loader(image_dataset, seed=seed)))["image"].shape == (8, 3, 32, 32)


def test_key_takes_only_an_integer_index(image_dataset, image_folder, tmp_path):
    """``loader.key(1.5)`` answered sample 1's key (int() truncated it), ``key(True)`` too; ``key("x")`` failed with
    a bare "invalid literal for int()"; the same for a mixture's source position and index."""
    with _loader(image_dataset) as loader:
        assert loader.key(np.int64(3)) == loader.key(torch.tensor(3)) == loader.key(3)
        for bad in (1.5, True, "x"):
            with pytest.raises(TypeError, match=rf"^key: sample index {bad!r} is not an integer$"):
                loader.key(bad)
    resharded = write_image_dataset(tmp_path / "ds8", image_folder, max_samples=8)  # one dataset twice is refused
    with _loader(fastio.Mixture({"a": image_dataset, "b": resharded})) as mixed:
        assert mixed.key(1, np.int64(3)) == mixed.key("b", 3)
        with pytest.raises(TypeError, match=r"^key: source 1.0 is not an integer \(or a source's name\)$"):
            mixed.key(1.0, 3)
        with pytest.raises(TypeError, match=r"^key: sample index 2.5 is not an integer$"):
            mixed.key("a", 2.5)

def test_extra_fields_and_padding(image_dataset):
    loader = _loader(image_dataset, pipeline=ImageEval(fields=("cls",)), batch_size=5)
    assert len(loader) == 10
    epoch = list(loader)
    assert int(epoch[-1]["padded"].sum()) == 2 and not epoch[0]["padded"].any()
    assert epoch[-1]["index"][-2:].tolist() == epoch[0]["index"][:2].tolist()  # wraps to the epoch start
    assert len(_loader(image_dataset, batch_size=5, drop_last=True)) == 9


@pytest.mark.parametrize("pipeline", [ImageTrain(size=32, fields=("jpg", "cls")), ImageEval(size=32, fields=("jpg",))])
def test_the_image_field_asked_as_a_field_is_delivered_as_its_stored_bytes(image_dataset, pipeline):
    """fields=("jpg",) delivers each sample's encoded image beside the decoded one, as Raw and the clip kinds
    deliver a field they are asked for (it was dropped from the batch without a word)."""
    got = next(iter(_loader(image_dataset, pipeline=pipeline, shuffle="none")))
    raw = next(iter(_loader(image_dataset, pipeline=Raw(fields=("jpg",)), shuffle="none")))
    assert torch.equal(got["index"], raw["index"])
    assert got["jpg"] == raw["jpg"] and got["image"].shape == (8, 3, 32, 32)


def test_stats_and_progress_line(image_dataset, capsys):
    loader = _loader(image_dataset)
    for _ in islice(batches(loader), 8):
        pass
    s = loader.stats()
    assert s["overall"]["batches"] == 8 and s["overall"]["samples"] == 64
    assert s["last_epoch"]["samples"] == 48 and s["epoch"]["batches"] == 2
    assert 0 <= s["overall"]["stall_fraction"] <= 1 and s["overall"]["samples_per_s"] > 0
    stats = Stats(progress=True, every_s=0)
    stats.end_wait(stats.begin_wait(), 8)
    assert "samples/s" in capsys.readouterr().err


def test_rank_defaults_from_environment(image_dataset, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = Loader(image_dataset, batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    assert (loader.rank, loader.world_size) == (1, 3) and len(loader) == 4
    assert Loader(image_dataset, batch_size=4, device="cpu", rank=0, world_size=1).world_size == 1


def test_config_object_and_overrides(image_dataset):
    cfg = LoaderConfig(batch_size=4, pipeline=fastio.ImageTrain(size=32), device="cpu", world_size=1, rank=0)
    loader = Loader(image_dataset, cfg, batch_size=6)
    assert loader.config.batch_size == 6 and len(loader) == 8
    assert loader.config.sampling.batch_size == 6 and cfg.sampling.batch_size == 4


def test_config_builds_its_graph_and_sampling_specs_once_and_is_read_only(image_dataset):
    cfg = LoaderConfig(batch_size=4, pipeline=fastio.ImageTrain(size=40), device="cpu", world_size=1, rank=0,
                       shuffle="block", seed=9)
    assert cfg.pipeline == fastio.ImageTrain(size=40)
    assert cfg.sampling == SamplerSpec(seed=9, shuffle="block", batch_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 64  # would leave cfg.sampling describing another batching
    loader = Loader(image_dataset, cfg)
    assert loader.config is cfg and loader.config.pipeline is cfg.pipeline
    assert next(iter(loader))["image"].shape == (4, 3, 40, 40)
    changed = dataclasses.replace(cfg, pipeline=fastio.ImageTrain(size=24))
    assert changed.pipeline.size == 24 and cfg.pipeline.size == 40


def test_rank_is_checked_against_a_world_size_from_the_environment(image_dataset, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 2"):
        Loader(image_dataset, batch_size=4, device="cpu", rank=2)
    assert Loader(image_dataset, batch_size=4, device="cpu", rank=1).world_size == 2



@pytest.mark.parametrize("name,value", [("rank", True), ("rank", "0"), ("rank", 0.0), ("world_size", 1.0),
                                        ("world_size", "2")])
def test_rank_and_world_size_that_are_not_integers_are_refused_naming_the_value(image_dataset, name, value):
    """rank=True was taken as rank 1, world_size=1.0 as 1, and rank="0" came out as a TypeError from a comparison
    (and with replicas= as "got rank=0 ..., pass 0")."""
    with pytest.raises(ValueError, match=rf"^{name} must be an integer \(or None: found from torch.distributed or "
                       rf"the environment\), got {re.escape(repr(value))}$"):
        Loader(image_dataset, batch_size=4, device="cpu", **{"rank": 0, "world_size": 1, name: value})

@pytest.mark.parametrize("kind", [ImageTrain, ImageEval])
def test_feeder_feeds_a_pipeline_the_plan_in_order_across_epochs(image_dataset, kind):
    """The parts the Loader wires together, used on their own: sampler plans -> reader -> feeder -> DALI graph.
    One pipeline runs from a mid-epoch position through the end of that epoch into the next one."""
    ds = Dataset(image_dataset)
    spec = kind(size=16)
    sampler = Sampler(SamplerSpec(seed=2, batch_size=8), [s.samples for s in ds.shards], ds.fingerprint)
    with Reader(ds, [], threads=2, image=("jpg",), sizes=spec.needs_image_size) as reader:
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=1, epoch=1, start=16)
        built = build_graph(spec.graph(), feeder, batch_size=8, num_threads=1, device="cpu", device_id=None, prefetch=2)
        assert built.outputs == ("image", "index")
        want = [(1, sampler.plan(1, 16), g) for g in range(4)] + [(2, sampler.plan(2), g) for g in range(6)]
        for epoch, plan, g in want:
            out = dict(zip(built.outputs, built.pipe.run()))
            fed = feeder.delivered()
            indices, padded = plan.batch(g)
            assert (fed.epoch, fed.consumed, fed.last) == (epoch, plan.consumed_after(g), g == len(plan) - 1)
            assert out["index"].as_array().reshape(-1).tolist() == fed.indices.tolist() == indices.tolist()
            assert fed.padded.tolist() == padded.tolist()
            assert out["image"].as_array().shape == (8, 3, 16, 16)
        # the stream went on into epoch 3 by itself (prefetch 2: one batch fed ahead of the one delivered)
        assert [(f.epoch, f.start) for f in feeder.in_flight()] == [(3, 0)]
        feeder.cancel()
        del built


def test_until_its_first_output_the_feeder_reads_only_what_the_graphs_first_run_asks_for(image_dataset):
    """Before the first output, reads further ahead than the graph's prefetch take the cores and the interpreter
    from the first batch's build, read and decode (issue 32 point 3): ``first=prefetch`` batches are read; the
    rest of the read-ahead starts when the first output is taken, and the batches are those of the plan."""
    ds = Dataset(image_dataset)
    spec = ImageTrain(size=16)
    sampler = Sampler(SamplerSpec(seed=2, batch_size=8), [s.samples for s in ds.shards], ds.fingerprint)

    class Counting(Reader):
        submitted = 0

        def submit(self, indices):
            self.submitted += 1
            return super().submit(indices)

    with Counting(ds, [], threads=2, image=("jpg",), sizes=True) as reader:
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=3, first=2)
        feeder.start()
        assert reader.submitted == 2
        built = build_graph(spec.graph(), feeder, batch_size=8, num_threads=1, device="cpu", device_id=None, prefetch=2)
        outputs = [dict(zip(built.outputs, built.pipe.run()))]
        assert reader.submitted == 2  # the first run fed batches 0 and 1, nothing further was read
        fed = [feeder.delivered()]
        assert reader.submitted == 2 + 4  # then read_ahead + 1 batches being read ahead of the one fed next
        for _ in range(3):
            outputs.append(dict(zip(built.outputs, built.pipe.run())))
            fed.append(feeder.delivered())
        plan = sampler.plan(0)
        for g, (out, f) in enumerate(zip(outputs, fed)):
            assert out["index"].as_array().reshape(-1).tolist() == f.indices.tolist() == plan.batch(g)[0].tolist()
        feeder.cancel()
        del built
    with Reader(ds, [], threads=1, image=("jpg",), sizes=True) as reader:  # more than `first` asked for: read
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=3, first=1)
        assert [feeder().__len__() for _ in range(3)] == [5, 5, 5] and len(feeder.in_flight()) == 3
        feeder.cancel()


def test_with_first_here_the_first_batches_are_read_by_the_thread_feeding_them_as_it_feeds_them(image_dataset):
    """Issue 45: reader threads reading beside the pipeline's build take the interpreter lock from it and back at
    each ``pread``; with ``first_here`` the ``first`` batches are read by the thread that feeds them, when the graph
    asks for each (nothing is read by ``start()``), the rest by the reader's threads (started beforehand), and the
    batches are those of the plan. A deferred read cancelled before it is fed is never read."""
    import threading

    ds = Dataset(image_dataset)
    spec = ImageTrain(size=16)
    sampler = Sampler(SamplerSpec(seed=2, batch_size=8), [s.samples for s in ds.shards], ds.fingerprint)
    here = threading.get_ident()

    class Recording(Reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.read_by: list[tuple[int, bool]] = []  # (first index of the batch, read by this test's thread)

        def read_batch(self, indices):
            self.read_by.append((int(indices[0]), threading.get_ident() == here))
            return super().read_batch(indices)

    before = set(threading.enumerate())
    with Recording(ds, [], threads=2, image=("jpg",), sizes=True) as reader:
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=3, first=2, first_here=True)
        feeder.start()
        assert reader.read_by == [] and not feeder.next_is_read()  # nothing read yet: read when fed
        started = [t for t in set(threading.enumerate()) - before if t.name.startswith("fastio-read")]
        assert len(started) == 2  # the reader's threads, started for the reads after those
        built = build_graph(spec.graph(), feeder, batch_size=8, num_threads=1, device="cpu", device_id=None, prefetch=2)
        outputs = [dict(zip(built.outputs, built.pipe.run()))]
        fed = [feeder.delivered()]
        for _ in range(3):
            outputs.append(dict(zip(built.outputs, built.pipe.run())))
            fed.append(feeder.delivered())
        plan = sampler.plan(0)
        starts = [int(plan.batch(g)[0][0]) for g in range(6)]
        assert reader.read_by[:2] == [(starts[0], True), (starts[1], True)]  # fed by DALI's run() in this thread
        assert {start: mine for start, mine in reader.read_by[2:]} == {start: False for start in starts[2:6]}
        for g, (out, f) in enumerate(zip(outputs, fed)):
            assert out["index"].as_array().reshape(-1).tolist() == f.indices.tolist() == plan.batch(g)[0].tolist()
        feeder.cancel()
        del built
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=3, first=2, first_here=True)
        feeder.start()
        read = len(reader.read_by)
        feeder.cancel()
        assert len(reader.read_by) == read  # never read


@dataclasses.dataclass(frozen=True)
class _CountingFeeds(ImageTrain):
    """ImageTrain that counts the batches fed to its graph (``feed`` runs once per batch fed)."""

    fed: list = dataclasses.field(default_factory=list, compare=False)

    def inputs(self, batch, *, seed, epoch):
        self.fed.append(batch.indices.tolist())
        return super().inputs(batch, seed=seed, epoch=epoch)


def test_while_the_loop_uses_a_batch_prefetch_batches_are_in_the_graph(image_dataset):
    """DALI's ``run()`` feeds a batch only when the next output is asked for, so while the training loop used a batch
    only ``prefetch - 1`` were in DALI's hands (issue 45: its workers waited for the loop's next call). The Loader
    feeds the batch after the next as soon as it has a batch's outputs, as DALI's own iterator does; but not after
    an epoch's last batch (a loop that stops there never gets it), and the batches are the same ones."""
    pipeline = _CountingFeeds(size=16)
    loader = _loader(image_dataset, batch_size=8, prefetch=2, pipeline=pipeline)
    held, got = [], []
    for batch in loader:
        time.sleep(0.05)  # the training step: the read of the batch after the next one ends meanwhile
        held.append(len(pipeline.fed))
        got.append(batch["index"].tolist())
    # batch k held: k + 1 and k + 2 fed (k + 1 alone with run()); with the epoch's last batch, nothing more: one
    # batch of the next epoch fed, as before
    assert held[0] in (2, 3) and held[1:] == [4, 5, 6, 7, 7], held
    assert pipeline.fed[:6] == got and got == [b["index"].tolist() for b in _loader(image_dataset, batch_size=8)]
    loader.close()


@pytest.mark.gpu
def test_cuda_batches_are_on_the_device(image_dataset):
    b = next(iter(_loader(image_dataset, device="cuda")))
    assert b["image"].is_cuda and b["image"].dtype == torch.float32 and b["image"].shape == (8, 3, 32, 32)
    assert b["label"].is_cuda and not b["index"].is_cuda
    cpu = next(iter(_loader(image_dataset, device="cpu")))
    assert torch.equal(cpu["index"], b["index"])
    # Different decoders (nvJPEG vs libjpeg-turbo): close, not bitwise.
    assert float((cpu["image"] - b["image"].cpu()).abs().mean()) < 0.1


def test_one_pipeline_serves_the_loaders_life_until_the_position_jumps(image_dataset):
    """Epochs follow each other in one DALI pipeline (the next epoch's first batches are fed while the
    current one ends); breaking out and iterating again continues it; a jump in position makes a new one."""
    loader = _loader(image_dataset, batch_size=8)
    first = [b["index"].tolist() for b in loader]
    built = loader._built
    assert built is not None and loader.epoch == 1
    it = iter(loader)
    head = [next(it)["index"].tolist() for _ in range(2)]
    it.close()
    rest = [b["index"].tolist() for b in loader]
    assert loader._built is built and loader.epoch == 2 and len(head + rest) == len(first)
    loader.set_epoch(5)
    fifth = [b["index"].tolist() for b in loader]
    assert loader._built is not built
    fresh = _loader(image_dataset, batch_size=8)
    fresh.set_epoch(5)
    assert fifth == [b["index"].tolist() for b in fresh]
    loader.close()
    fresh.close()


def test_batches_kept_across_later_batches_and_epochs_stay_intact(image_dataset):
    """Images are handed over without a copy when DALI's outputs own their memory: a batch the loop keeps
    must not change while the Loader goes on (later runs must not reuse its buffer)."""
    loader = _loader(image_dataset, batch_size=8, prefetch=2)
    kept, snapshots = [], []
    for batch in islice(batches(loader), 3 * len(loader)):
        kept.append(batch["image"])
        snapshots.append(batch["image"].clone())
    assert all(torch.equal(a, b) for a, b in zip(kept, snapshots))
    assert len({t.data_ptr() for t in kept}) == len(kept)  # a buffer of its own for every kept batch
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(kept, snapshots))


def test_the_read_ahead_stops_at_the_end_of_the_consumers_epoch(image_dataset):
    """A loop that stops after an epoch must not have paid for reads it never gets: past the end of the epoch the
    consumer is in, only the batches the graph asks for (its prefetch) are read, with one started ahead of the one
    fed; once the consumer takes a batch of the next epoch, the read-ahead goes on into it."""
    ds = Dataset(image_dataset)
    spec = ImageTrain(size=16)
    sampler = Sampler(SamplerSpec(seed=2, batch_size=8), [s.samples for s in ds.shards], ds.fingerprint)
    batches_of_epoch = len(sampler.plan(0))

    class Counting(Reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epochs: list[int] = []

        def submit(self, indices):
            self.epochs.append(len(self.epochs) // batches_of_epoch)  # the plan's batches, in order
            return super().submit(indices)

    with Counting(ds, [], threads=2, image=("jpg",), sizes=True) as reader:
        feeder = Feeder(reader, sampler.plan, spec.graph().feed, seed=2, read_ahead=3, first=2)
        feeder.start()
        built = build_graph(spec.graph(), feeder, batch_size=8, num_threads=1, device="cpu", device_id=None, prefetch=2)
        for _ in range(batches_of_epoch):
            built.pipe.run()
            assert feeder.delivered().epoch == 0
        # the graph was fed one batch of epoch 1 (its prefetch); one more is being read, not read_ahead + 1
        assert reader.epochs.count(1) == 1 + 1 and reader.epochs.count(0) == batches_of_epoch
        built.pipe.run()
        assert feeder.delivered().epoch == 1
        assert reader.epochs.count(1) == 2 + 3 + 1  # in epoch 1 now: two fed, read_ahead + 1 ahead of them
        feeder.cancel()
        del built
