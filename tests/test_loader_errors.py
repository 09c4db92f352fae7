"""Bad input: each a clear FastioError naming the dataset, shard, key or field; never a silent skip."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

import fastio
from fastio import ImageEval, ImageTrain, Raw
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError, FastioError, LoaderStateError
from fastio.loader import Loader


def _loader(dest, **kw):
    opts = dict(batch_size=8, pipeline=ImageTrain(size=32), device="cpu", world_size=1, rank=0, num_threads=1)
    opts.update(kw)
    return Loader(dest, **opts)


def test_dest_without_manifest(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "samples.fxi").write_bytes(b"")  # a folder with files but no manifest (an empty one is named)
    with pytest.raises(DatasetError, match=r"half: not a fastio dataset \(no manifest.json"):
        _loader(tmp_path / "half")


def test_the_parent_of_splits_names_them(tmp_path, image_folder):
    """Loader("ds") on a DEST written with --split said "not a fastio dataset"; it names the splits instead."""
    from fastio.convert.run import ConvertConfig, convert
    from fastio.dataset.dataset import Dataset

    convert(ConvertConfig(source=image_folder, dest=tmp_path / "ds", split="val=0.25"))
    needle = (rf"{tmp_path / 'ds'}: holds the splits train, val, not one dataset: open {tmp_path / 'ds' / 'train'} "
              rf"or {tmp_path / 'ds' / 'val'}$")
    with pytest.raises(DatasetError, match=needle):
        _loader(tmp_path / "ds")
    with pytest.raises(DatasetError, match=needle):
        Dataset(tmp_path / "ds")
    assert len(Dataset(tmp_path / "ds" / "val")) == 12


def test_missing_shard_names_the_shard(image_dataset):
    (image_dataset / "shards" / "shard-000001.tar").unlink()
    with pytest.raises(DatasetError, match="shard file shard-000001.tar is missing"):
        _loader(image_dataset)


def test_sha256_mismatch_is_caught_with_verify(image_dataset):
    shard = image_dataset / "shards" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the zero trailer: readers do not notice, the checksum does
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    assert len(list(_loader(image_dataset, pipeline=Raw()))) == 6
    with pytest.raises(DatasetError, match=r"shard shard-000002.tar sha256 mismatch"):
        list(_loader(image_dataset, pipeline=Raw(), verify=True))


def test_missing_field(image_dataset):
    with pytest.raises(DatasetError, match=r"ds: dataset has no field 'json'"):
        _loader(image_dataset, pipeline=ImageTrain(size=32, fields=("cls", "json")))


def test_batch_larger_than_dataset(image_dataset):
    """The default remainder='pad' (and drop_last) still refuse a batch larger than the dataset, in one line naming
    the dataset, its samples and batch_size, and the way out (remainder='partial' gives one batch of them)."""
    with pytest.raises(DatasetError, match=r"ds: batch_size 64 is larger than the dataset \(48 samples\): give a "
                                           r"smaller batch_size, or remainder='partial' for one batch of them$"):
        _loader(image_dataset, batch_size=64)
    for remainder in ("pad", "partial"):
        with pytest.raises(DatasetError, match=r"ds: batch_size 64 is larger than the dataset \(48 samples\) and "
                                               r"drop_last leaves no batch$"):
            _loader(image_dataset, batch_size=64, drop_last=True, remainder=remainder)


def _bad_image_dataset(tmp_path, image_folder, bad: dict[int, bytes]):
    writer = ShardWriter(tmp_path / "bad", max_samples=8)
    for k, path in enumerate(sorted(image_folder.rglob("*.jpg"))[:16]):
        writer.write({"__key__": f"img{k:02d}", "jpg": bad.get(k, path.read_bytes()), "cls": b"0"})
    writer.close(image_field="jpg", label_field="cls")
    return tmp_path / "bad"


@pytest.mark.parametrize("pipeline", [ImageTrain(size=32), ImageEval(size=32)])
def test_undecodable_image_names_key_and_shard(tmp_path, image_folder, pipeline):
    good = sorted(image_folder.rglob("*.jpg"))[11].read_bytes()
    # Sample 11 has a valid JPEG header but a truncated body: only the decoder can tell.
    dest = _bad_image_dataset(tmp_path, image_folder, {11: good[: len(good) // 3]})
    loader = _loader(dest, pipeline=pipeline, shuffle="none", batch_size=4)
    with pytest.raises(DatasetError, match=r"shard shard-000001.tar key 'img11': field 'jpg' failed to decode"):
        list(loader)


def test_not_an_image_at_all(tmp_path, image_folder):
    dest = _bad_image_dataset(tmp_path, image_folder, {3: b"this is not an image"})
    with pytest.raises(DatasetError, match=r"shard shard-000000.tar key 'img03': field 'jpg' failed to decode"):
        list(_loader(dest, batch_size=4))


_UNREADABLE_IN_A_BIG_BATCH = """
import sys

import fastio
from fastio import ImageEval, ImageTrain

for seed in range(int(sys.argv[2])):
    pipeline = (ImageTrain(size=32), ImageEval(size=32))[seed % 2]
    with fastio.Loader(sys.argv[1], batch_size=48, pipeline=pipeline, device="cpu", world_size=1, rank=0,
                       num_threads=1, seed=seed) as loader:
        try:
            next(iter(loader))
        except fastio.DatasetError as err:
            print(err)
"""


def test_an_unreadable_image_in_a_batch_of_48_is_named_not_a_segfault(tmp_path, image_folder, warm):
    """DALI 2.4's image decoder reads the headers of a batch of 32 images or more in two threads; where the
    unreadable one fell to the calling thread, the other thread read on through the decoder's unwound stack and
    the process died (SIGSEGV in ``ImageDecoder::RunImplImpl``) about once in ten such batches, seen as a flaky
    test (found looping tests/test_pipeline_protocol.py's case under load): a training job would die where it
    should get the DatasetError naming the shard and key. Each seed puts the image elsewhere in the batch; in a
    process of its own (``warm``), so that a segfault fails this test only."""
    images = sorted(image_folder.rglob("*.jpg"))
    with ShardWriter(tmp_path / "bad", max_samples=16) as writer:
        for k, path in enumerate(images):
            writer.write({"__key__": f"img{k:02d}", "jpg": b"\xff\xd8\xff" + b"garbage" * 8 if k == 29 else
                          path.read_bytes(), "cls": b"0"})
        writer.close(image_field="jpg", label_field="cls")
    script = tmp_path / "big_batch.py"
    script.write_text(_UNREADABLE_IN_A_BIG_BATCH)
    rc, out, err = warm.run(script, tmp_path, str(tmp_path / "bad"), "12", timeout=300)
    assert rc == 0, (rc, out, err[-3000:])
    lines = out.splitlines()
    assert len(lines) == 12 and all(re.search(r"shard shard-000001\.tar key 'img29': field 'jpg' failed to decode",
                                              line) for line in lines), out


def test_state_mismatches(image_dataset, tmp_path, image_folder):
    loader = _loader(image_dataset)
    state = loader.state_dict()
    with pytest.raises(LoaderStateError, match="shuffle='block'"):
        _loader(image_dataset, shuffle="block").load_state_dict(state)
    with pytest.raises(LoaderStateError, match="version 99"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(LoaderStateError, match="consumed=1000"):
        loader.load_state_dict({**state, "consumed": 1000})
    other = _bad_image_dataset(tmp_path, image_folder, {})
    with pytest.raises(LoaderStateError, match=f"fingerprint {state['fingerprint']}"):
        _loader(other).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="not a fastio Loader state_dict"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(LoaderStateError, match="consumed='12', not an integer"):
        loader.load_state_dict({**state, "consumed": "12"})
    # Integers that a checkpoint round trip turned into numpy / torch scalars are accepted.
    loader.load_state_dict({**state, "consumed": np.int64(16), "epoch": torch.tensor(2)})
    assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (2, 16)


@pytest.mark.parametrize("key, value", [("world_size", 0), ("world_size", -2), ("batch_size", 0), ("batch_size", -8),
                                        ("block_shards", 0), ("block_shards", -1)])
def test_a_state_whose_world_or_batch_size_is_not_positive_is_refused_naming_it(image_dataset, key, value):
    """Found by hostile review of hand-edited states: a saved world_size or batch_size of 0 (or below) loaded
    without a word (the format says both are the save's, positive integers); refused naming the field and value,
    by the check a checkpoint restore asks before anything loads too. So is a block_shards of 0 or below in a
    state of shuffle='global' (which does not compare it: only block windows read it)."""
    loader = _loader(image_dataset)
    state = loader.state_dict()
    for call in (loader.check_state_dict, loader.load_state_dict):
        with pytest.raises(LoaderStateError, match=rf"loader state has {key}={value}, not a positive integer"):
            call({**state, key: value})
    loader.load_state_dict({**state, "world_size": 3, "batch_size": 2})  # another run's sizes: a resume re-splits


def test_bad_label_text(tmp_path, image_folder):
    writer = ShardWriter(tmp_path / "lbl")
    for k, path in enumerate(sorted(image_folder.rglob("*.jpg"))[:8]):
        writer.write({"__key__": f"k{k}", "jpg": path.read_bytes(), "cls": b"cat" if k == 5 else b"1"})
    writer.close(image_field="jpg", label_field="cls")
    with pytest.raises(DatasetError, match=r"key 'k5': field 'cls' is not an integer label: b'cat'"):
        list(_loader(tmp_path / "lbl", batch_size=4, shuffle="none"))


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "batch_size"), (dict(pipeline="video"), "pipeline"), (dict(device="tpu"), "device"),
    (dict(shuffle="random"), "shuffle"), (dict(remainder="keep"), "remainder"),
    (dict(rank=2, world_size=2), "rank"), (dict(prefetch=0), "prefetch"), (dict(world_size=0), "world_size"),
    (dict(block_shards=0), "block_shards"),
])
def test_bad_arguments(image_dataset, kw, match):
    with pytest.raises(ValueError, match=match):
        _loader(image_dataset, **kw)


@pytest.mark.parametrize("options,match", [(dict(dtype="int8"), "dtype"), (dict(layout="NCHW"), "layout"),
                                           (dict(size=0), "size")])
def test_bad_image_options(image_dataset, options, match):
    with pytest.raises(ValueError, match=match):
        _loader(image_dataset, pipeline=ImageTrain(**options))


_OUT_OF_MEMORY = """
import re, sys
import fastio
from fastio.errors import DatasetError, FastioError


def huge(image, device):
    from nvidia.dali import fn

    return fn.resize(image, resize_x=1_000_000, resize_y=1_000_000)


loader = fastio.Loader(sys.argv[1], batch_size=int(sys.argv[2]), device="cpu", seed=0, pipeline=fastio.Graph(huge),
                       remainder="partial")
try:
    next(iter(loader))
except fastio.errors.PipelineMemoryError as err:
    assert not isinstance(err, DatasetError) and isinstance(err, (FastioError, MemoryError))
    print(err)
"""


@pytest.mark.parametrize("batch_size,made", [(2, 2), (64, 48)])
def test_dali_out_of_memory_is_not_blamed_on_the_data(image_dataset, batch_size, made):
    """A graph that runs DALI out of memory (an output of 10^6 x 10^6 pixels: DALI's std::bad_alloc) says so and
    what to lower; it was a DatasetError blaming the batch's keys, whose images are fine. In a process of its own:
    DALI's executor after a bad_alloc once crashed the test process (a segfault in its thread pool) 13 s later, in
    another test. The batch it names is the one DALI made: remainder='partial' at batch_size 64 over 48 samples
    makes one of 48 (it said 64)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY, str(image_dataset), str(batch_size)],
                          capture_output=True, text=True, timeout=300)
    text = done.stdout.strip()
    assert re.fullmatch(rf".*ds: DALI ran out of memory making a batch of {made} \(fn\.resize: std::bad_alloc\): the "
                        r"pipeline's outputs do not fit, not the data; lower batch_size or the output size", text), \
        (text, done.stderr[-2000:])
    assert "key" not in text


def test_errors_are_fastio_errors():
    assert issubclass(DatasetError, FastioError) and issubclass(LoaderStateError, FastioError)


@pytest.mark.parametrize("kw,match", [(dict(seed=1.5), r"seed must be an integer, got 1\.5"),
                                      (dict(seed=True), r"seed must be an integer, got True"),
                                      (dict(seed="7"), r"seed must be an integer, got '7'"),
                                      (dict(block_shards=2.5), r"block_shards must be an integer >= 1, got 2\.5")])
def test_order_parameters_that_a_resume_cannot_read_are_refused_at_once(image_dataset, kw, match):
    with pytest.raises(ValueError, match=match):
        Loader(image_dataset, batch_size=4, pipeline=Raw(), device="cpu", **kw)


@pytest.mark.parametrize("epoch", [1.5, True, "1", -1])
def test_set_epoch_takes_only_a_non_negative_integer(image_dataset, epoch):
    """A float or bool epoch was accepted and stored in the state (another order); a string failed with a bare
    TypeError."""
    with Loader(image_dataset, batch_size=4, pipeline=Raw(), device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(ValueError, match=rf"epoch must be an integer >= 0, got {epoch!r}"):
            loader.set_epoch(epoch)
        loader.set_epoch(np.int64(2))
        assert loader.state_dict()["epoch"] == 2 and type(loader.state_dict()["epoch"]) is int


def test_a_mixture_state_into_a_one_dataset_loader_says_so(image_dataset):
    from fastio import Mixture
    from fastio.errors import LoaderStateError

    def make(data):
        return Loader(data, batch_size=4, pipeline=Raw(), device="cpu", world_size=1, rank=0)

    with make(Mixture({"a": image_dataset})) as mixed:
        next(iter(mixed))
        state = mixed.state_dict()
    with make(image_dataset) as plain, pytest.raises(LoaderStateError, match=r"loader state is of a mixture "
                                                                             r"\(sources 'a'\)"):
        plain.load_state_dict(state)


def test_an_image_pipeline_on_a_video_dataset_points_to_the_clip_kinds(tmp_path):
    """An image pipeline on a video dataset said 'dataset has no image field; use pipeline='raw'', a way out that
    delivers bytes, not frames: it names the media field and the clip kind that reads it."""
    pytest.importorskip("av")
    from fastio.convert.run import ConvertConfig, convert
    from fastio.convert.synthetic import make_audio, make_video

    for i in range(2):
        make_video(tmp_path / "v" / "c0" / f"v{i}.webm", frames=4, fps=12)
        make_audio(tmp_path / "a" / "c0" / f"a{i}.flac", seconds=0.2, rate=16000, pitch=440.0)
    for kind, clips in (("v", r"webm: read it with fastio\.VideoClips"), ("a", r"flac: read it with fastio\.AudioClips")):
        convert(ConvertConfig(source=tmp_path / kind, dest=tmp_path / f"{kind}ds", workers=1, progress=False))
        with pytest.raises(fastio.DatasetError, match=rf"{kind}ds: dataset has no image field; it holds {clips}"):
            fastio.Loader(tmp_path / f"{kind}ds", pipeline=fastio.ImageTrain(size=8), batch_size=2, device="cpu")


def test_a_shard_rewritten_before_its_first_read_stops_the_loop_where_it_did_before_the_feed_ahead(image_dataset):
    """The Loader feeds a batch ahead while the loop uses the one before (issue 45); a read failing there is raised
    by the call that asks for the next batch, the one ``run()`` would have raised it in: with ``shuffle="none"``,
    batches 0-2 come, then the error naming the shard (batch 4 is its first; the call for batch 3 would feed it)."""
    shard = image_dataset / "shards" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[:4] = b"xxxx"  # the first member's name in its tar header: the same size, another key
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    loader = _loader(image_dataset, shuffle="none")
    got = []
    with pytest.raises(DatasetError, match="shard-000002.tar.*rewritten after it was indexed"):
        for batch in loader:
            time.sleep(0.05)  # the training step: the next reads end meanwhile, so batches are fed ahead
            got.append(batch["index"].tolist())
    assert got == [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    loader.close()


@pytest.mark.parametrize("config", [{"batch_size": 4}, 4])
def test_a_config_that_is_not_a_loader_config_is_named(image_dataset, config):
    """A dict of options (read from a YAML file) given as the config failed with a bare "AttributeError: 'dict'
    object has no attribute 'pipeline'"."""
    with pytest.raises(fastio.LoaderArgumentError, match=rf"^Loader's config must be a fastio.LoaderConfig, got "
                                                         rf"{type(config).__name__} .*: pass options as keywords, "
                                                         r"Loader\(dest, \*\*options\)$"):
        Loader(image_dataset, config)


def test_a_mistyped_option_names_the_nearest_one(image_dataset):
    # Found by the newcomer review (round 4): Loader(ds, batchsize=16) said "LoaderConfig.__init__() got an unexpected
    # keyword argument 'batchsize'": a class the user never named, and no option to give instead.
    with pytest.raises(fastio.LoaderArgumentError, match=r"^Loader got an unknown option batchsize=16: did you mean "
                                                         r"batch_size\? \(the options: LoaderConfig's fields\)$"):
        fastio.Loader(image_dataset, batchsize=16, device="cpu")
    with pytest.raises(TypeError, match=r"^Loader got an unknown option zzz=1 \(the options: LoaderConfig's fields\)$"):
        fastio.LoaderConfig(zzz=1)


def test_a_failure_reads_the_same_from_a_graph_built_with_or_without_dalis_stack_record():
    """fastio's own image kinds build their graphs without DALI's record of each operator's Python stack
    (``GraphDef.traced``, :mod:`fastio.pipelines.untraced`: ~1.6 ms of Python off the way to the first batch). DALI's
    message then has ``encountered:`` at the end of the operator's line instead of on a line of its own after the
    stack; the one line the Loader names a failed batch with (``dali_reason``) is the same either way. The graph
    built after the untraced one records its stacks again (DALI's switch put back)."""
    from nvidia.dali import fn

    from fastio.errors import dali_reason
    from fastio.pipelines.base import GraphDef, build_graph

    bad = np.frombuffer(b"not an image at all", np.uint8)
    for traced in (False, True):
        graph = GraphDef(inputs=(("encoded", "uint8"), ("index", "int64")), feed=None,
                         body=lambda inp, device: (fn.peek_image_shape(inp["encoded"]), inp["index"]),
                         outputs=("shape", "index"), problem=None, traced=traced)
        built = build_graph(graph, lambda: ([bad, bad], np.arange(2, dtype=np.int64)), batch_size=2, num_threads=1,
                            device="cpu", device_id=None, prefetch=1)
        with pytest.raises(RuntimeError) as err:
            built.pipe.run()
        said = str(err.value)
        assert ("used in the pipeline definition with the following traceback" in said) == traced, said
        assert re.fullmatch(r"fn\.peek_image_shape: nvImageCodec failure.*", dali_reason(err.value)), said
    assert ImageTrain().graph().traced is False and ImageEval().graph().traced is False
    assert fastio.Graph(lambda image, device: image).graph().traced is True  # a user's graph names its lines
