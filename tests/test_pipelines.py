"""Pipeline objects (fastio.ImageTrain, ImageEval, Raw, Graph, a kind of one's own) and the one read set: options
belong to the objects (the old flat spellings are refused naming the object), a mixture's label fields keep
their names, and the Loader holds no kind's options and no mixture branch."""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import write_image_dataset

import fastio
from fastio import Loader, LoaderConfig, Mixture
from fastio.dataset.shards import ShardWriter
from fastio.errors import LoaderStateError
from fastio.pipelines import ReadFields


def test_a_config_keeps_the_shared_options_and_its_pipeline_object():
    cfg = LoaderConfig(batch_size=4, pipeline=fastio.ImageEval(size=40, crop_ratio=0.5), device="cpu")
    assert cfg.pipeline == fastio.ImageEval(size=40, crop_ratio=0.5) and cfg.pipeline.size == 40
    changed = dataclasses.replace(cfg, batch_size=8, seed=3)
    assert changed.pipeline is cfg.pipeline and changed.sampling.batch_size == 8
    assert LoaderConfig().pipeline == fastio.ImageTrain()


@pytest.mark.parametrize("option", [{"image_size": 32}, {"mean": (0.5, 0.5, 0.5)}, {"fields": ["cls"]}])
def test_an_old_option_beside_a_pipeline_object_is_refused_by_name(option):
    name, value = next(iter(option.items()))
    new = {"image_size": "size"}.get(name, name)
    with pytest.raises(fastio.LoaderArgumentError, match=rf"^{name}=.*: the old spelling; give the pipeline object: "
                                                         rf"pipeline=fastio\.ImageTrain\(\.\.\., {new}="):
        LoaderConfig(pipeline=fastio.ImageTrain(size=16), **option)


OLD_VALUES = {"image_size": 32, "mean": (0.5, 0.5, 0.5), "std": (0.2, 0.2, 0.2), "dtype": "uint8", "layout": "HWC",
              "eval_crop_ratio": 0.5, "fields": ["cls"]}
EVERY_KIND = [fastio.ImageTrain(size=16), fastio.ImageEval(size=16), fastio.Raw(), fastio.Graph(lambda image, d: image),
              fastio.VideoClips(), fastio.AudioClips(), fastio.Tokens(seq_len=8)]


@pytest.mark.parametrize("pipeline", EVERY_KIND, ids=lambda p: type(p).__name__)
def test_the_refusal_of_an_old_option_beside_a_pipeline_object_names_only_options_it_has(pipeline):
    """Issue 40, 10: image_size=32 beside fastio.Tokens said 'give it there (pipeline=Tokens(...))', and Tokens
    has no such option. For every old option beside every built-in kind (the old spellings are refused now), the
    option the message tells to give exists on that object (and takes the value, for the image kinds), or the
    message says it is not an option of that kind."""
    kind = type(pipeline).__name__
    own = [f.name for f in dataclasses.fields(pipeline) if f.init]
    for name, value in OLD_VALUES.items():
        with pytest.raises(fastio.LoaderArgumentError) as err:
            LoaderConfig(pipeline=pipeline, **{name: value})
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"{name}={value!r}, pipeline="), text
        given = re.search(rf"give the pipeline object: pipeline=fastio\.{kind}\(\.\.\., (\w+)=", text)
        if given:
            assert given.group(1) in own, (name, text)
            if kind.startswith("Image"):
                dataclasses.replace(pipeline, **{given.group(1): value})  # the spelling the message gives works
        else:
            assert text.endswith(f"pipeline=fastio.{kind}(...) ({name}: not options of {kind})"), text
            assert name not in own and not (name == "image_size" and "size" in own), text
    tokens = LoaderConfig(pipeline=fastio.Tokens(seq_len=8), device="cpu")
    with pytest.raises(fastio.LoaderArgumentError, match=r"pipeline=fastio\.Tokens\(\.\.\.\) \(image_size: not "
                                                         r"options of Tokens\)$"):
        dataclasses.replace(tokens, image_size=32)


@pytest.mark.parametrize("make,match", [
    (lambda: fastio.ImageTrain(size=0), "size must be an integer >= 1, got 0"),
    # an absurd size failed at the first batch as DALI's bad_alloc, blamed on the batch's keys
    (lambda: fastio.ImageTrain(size=100000), r"^size must be at most 8192 pixels, got 100000: an output side beyond "
                                             r"that makes each image gigabytes"),
    (lambda: fastio.ImageEval(size=300, crop_ratio=0.01), r"^size / crop_ratio \(the shorter side resized before the "
                                                          r"center crop\) must be at most 16384 pixels, got 300 / 0.01 "
                                                          r"= 30000: "),
    (lambda: fastio.ImageTrain(dtype="int8"), "dtype must be one of float32, float16, uint8, got 'int8'"),
    (lambda: fastio.ImageEval(layout="NCHW"), "layout must be CHW or HWC, got 'NCHW'"),
    (lambda: fastio.ImageEval(crop_ratio=1.5), r"crop_ratio must be in \(0, 1\], got 1.5"),
    (lambda: fastio.ImageTrain(std=(0.2, 0.2, 0)), "mean and std need 3 values, std > 0"),
    # NaN or inf passed (every pixel of every image NaN); a string passed its length check and failed in the
    # graph with a bare "TypeError: can't multiply sequence by non-int of type 'float'"; True was 1.0
    (lambda: fastio.ImageTrain(std=(float("nan"), 0.2, 0.2)), r"mean and std need 3 values, std > 0, each a finite "
                                                              r"number; got \(0.485, 0.456, 0.406\), \(nan, 0.2, 0.2\)$"),
    (lambda: fastio.ImageEval(mean=(0.5, float("inf"), 0.5)), r"mean and std need 3 values, .*\(0.5, inf, 0.5\)"),
    (lambda: fastio.ImageTrain(mean="abc"), r"mean and std need 3 values, .*got \('a', 'b', 'c'\)"),
    (lambda: fastio.ImageTrain(mean=(True, 0.5, 0.5)), r"mean and std need 3 values, .*got \(True, 0.5, 0.5\)"),
    (lambda: fastio.ImageEval(crop_ratio=True), r"crop_ratio must be in \(0, 1\], got True"),
    (lambda: fastio.Raw(fields="txt"), "fields must be a sequence of field names, got 'txt'"),
    (lambda: fastio.Graph(None), "Graph needs a callable fn"),
])
def test_pipeline_objects_check_their_options(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("text,memory", [
    ("Critical error in pipeline:\nError in thread 0: [/opt/dali/dali/pipeline/...] std::bad_alloc", True),
    ("Error in MIXED operator `nvidia.dali.fn.decoders.image`:\nCUDA allocation failed", True),
    ("CUDA runtime API error cudaErrorMemoryAllocation (2):\nout of memory", True),
    ("nvJPEG error (NVJPEG_STATUS_ALLOCATOR_FAILURE)", True),
    ("OpenCV(4.x) error: (-4:Insufficient memory) Failed to allocate 12345678 bytes in function 'OutOfMemoryError'", True),
    ("Error in CPU operator `nvidia.dali.fn.decoders.image`:\nUnrecognized image format", False),
    ("fn.decoders.audio: Failed to open encoded data: Internal error : SF_INFO struct incomplete.", False),
])
def test_dali_out_of_memory_tells_an_allocation_failure_from_bad_data(text, memory):
    """The Loader blames no sample where DALI says an allocation failed (GPU failures are not reproducible on the
    CPU: DALI's, CUDA's, nvJPEG's and OpenCV's wordings, as their libraries hold them)."""
    from fastio.pipelines.base import dali_out_of_memory

    assert dali_out_of_memory(RuntimeError(text)) is memory


def test_a_graph_object_is_the_graph_function(image_dataset):
    def flip(image, device):
        from nvidia.dali import fn

        return {"image": fn.flip(fn.resize(image, resize_x=16, resize_y=16), horizontal=1)}

    opts = dict(batch_size=8, device="cpu", seed=0, world_size=1, rank=0, num_threads=1, shuffle="none")
    with pytest.raises(fastio.LoaderArgumentError, match=r"^pipeline=<function .*flip.*>: the old spelling; give the "
                                                         r"pipeline object: pipeline=fastio\.Graph\(flip\)$"):
        Loader(image_dataset, pipeline=flip, **opts)  # the bare function: the old spelling
    with Loader(image_dataset, pipeline=fastio.Graph(flip), **opts) as b:
        x = next(iter(b))
    assert x["image"].shape == (8, 16, 16, 3) and x["label"].shape == (8,)



@pytest.mark.parametrize("name", ["index", "source", "padded", "label", "cls"])
def test_a_graph_output_named_as_an_entry_the_loader_adds_is_refused(image_dataset, name):
    """A graph output named ``padded``, ``source`` or ``label`` (or a field of ``fields=``) was silently replaced
    by the Loader's own entry: the user's values were lost; one named ``index`` replaced the indices the Loader
    checks, and the batch failed with DALI's bare "Cannot produce a numpy array: the tensors in the list do not
    all have the same shape"."""
    def graph(image, device):
        from nvidia.dali import fn

        return {"image": fn.resize(image, resize_x=8, resize_y=8), name: fn.resize(image, resize_x=4, resize_y=4)}

    with Loader(image_dataset, pipeline=fastio.Graph(graph, fields=("cls",)), batch_size=4, device="cpu",
                world_size=1, rank=0, num_threads=1) as loader:
        with pytest.raises(ValueError, match=rf"^fastio.Graph\(graph\): the graph's output {name!r} is an entry "
                                             rf"the Loader adds to the batch \(.*\): name it otherwise$"):
            next(iter(loader))


@pytest.mark.parametrize("returned", ["none", "list", "number key"])
def test_a_graph_that_returns_no_nodes_is_named(image_dataset, returned):
    """A graph function returning None (a forgotten return) or a list of nodes failed with DALI's bare TypeError
    ("Illegal output type. The output 1 is a `<class 'NoneType'>`"), naming neither the function nor fastio's
    rule; a dict keyed by a number made a batch entry named 1."""
    def graph(image, device):
        from nvidia.dali import fn

        node = fn.resize(image, resize_x=8, resize_y=8)
        return {"none": None, "list": [node], "number key": {1: node}}[returned]

    with Loader(image_dataset, pipeline=fastio.Graph(graph), batch_size=4, device="cpu", world_size=1, rank=0,
                num_threads=1) as loader:
        with pytest.raises(ValueError, match=r"^fastio.Graph\(graph\): the graph function returned .*, not a DALI "
                                             r"node or a dict of them by name$"):
            next(iter(loader))

def _tagged(dest: Path, n: int, label_field: str) -> Path:
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:03d}", "txt": b"x%d" % i, label_field: b"%d" % (i % 2)})
        writer.close(label_field=label_field, converted_from={"format": "test"}, skipped=[])
    return dest


def test_a_mixtures_label_fields_keep_their_names(tmp_path):
    """Sources labelled ``cls`` and ``label``: each reads its own; raw delivers them as batch["label"] only (the
    label bytes were renamed to the first source's field name, ``cls``, and delivered under it)."""
    mix = Mixture({"conv": _tagged(tmp_path / "a", 6, "cls"), "web": _tagged(tmp_path / "b", 6, "label")})
    with Loader(mix, batch_size=12, pipeline=fastio.Raw(), device="cpu", world_size=1, rank=0) as loader:
        batch = next(iter(loader))
    assert sorted(batch) == ["has", "index", "label", "padded", "source", "txt"]
    assert sorted(batch["has"]) == ["txt"]
    assert batch["label"].tolist() == [i % 2 for i in batch["index"].tolist()]
    assert sorted(batch["source"].tolist()) == [0] * 6 + [1] * 6
    same = Mixture({"a": _tagged(tmp_path / "c", 6, "cls"), "b": _tagged(tmp_path / "d", 6, "cls")})
    with Loader(same, batch_size=12, pipeline=fastio.Raw(), device="cpu", world_size=1, rank=0) as loader:
        batch = next(iter(loader))
    assert batch["cls"] == [b"%d" % (i % 2) for i in batch["index"].tolist()] and "cls" in batch["has"]


@dataclass(frozen=True)
class ImageSizes(fastio.Pipeline):
    """A kind of one's own: each image's (width, height) from its header, no graph; it keeps a state entry."""

    kind: ClassVar[str] = "image-sizes"
    fields: tuple[str, ...] | None = None
    version: int = 1

    def read_fields(self, ds, fields):
        ds.require_fields(list(fields), in_every_sample=True)
        return ReadFields(tuple(fields), image=(ds.image_field,), sizes=True)

    def assemble(self, outputs, delivery):
        return {"size": torch.from_numpy(delivery.read.sizes.copy()), "label": delivery.labels()}

    def state_dict(self):
        return {"image_sizes": self.version}

    def check_state(self, state):
        if state.get("image_sizes") != self.version:
            raise LoaderStateError(f"loader state has image_sizes={state.get('image_sizes')!r}, this pipeline "
                                   f"{self.version}")


def test_a_kind_of_ones_own_plugs_in_with_its_state_on_a_dataset_and_a_mixture(tmp_path, image_folder):
    from PIL import Image

    one = write_image_dataset(tmp_path / "one", image_folder)
    mix = Mixture({"a": one, "b": write_image_dataset(tmp_path / "two", image_folder, max_samples=7)})
    for target in (one, mix):
        with Loader(target, batch_size=8, pipeline=ImageSizes(), device="cpu", world_size=1, rank=0) as loader:
            batch = next(iter(loader))
            state = loader.state_dict()
            keys = [loader.key(*st) for st in zip(batch["source"].tolist(), batch["index"].tolist())] \
                if "source" in batch else [loader.key(i) for i in batch["index"].tolist()]
        folder = {p.parent.name + "/" + p.stem: p for p in image_folder.rglob("*.jpg")}
        assert batch["size"].tolist() == [list(Image.open(folder[k]).size) for k in keys]
        assert state["image_sizes"] == 1
        with Loader(target, batch_size=8, pipeline=ImageSizes(), device="cpu", world_size=1, rank=0) as again:
            again.load_state_dict(state)
            assert again.consumed == 8
        with Loader(target, batch_size=8, pipeline=ImageSizes(version=2), device="cpu", world_size=1,
                    rank=0) as other, pytest.raises(LoaderStateError, match="image_sizes=1, this pipeline 2"):
            other.load_state_dict(state)


def test_the_pipeline_protocol_is_six_hooks_with_nothing_of_a_kind_in_its_base():
    """The base declares six hooks and the Loader calls no other method of a pipeline object; the base imports
    nothing of images or media (the image defaults are ImageKind's), and every kind with a graph declares its
    inputs' dtypes itself (issue 41)."""
    from fastio.pipelines import Pipeline, base

    hooks = sorted(n for n, v in vars(Pipeline).items() if callable(v) and not n.startswith("_"))
    assert hooks == ["assemble", "check_state", "graph", "read_fields", "source", "state_dict"]
    loader = ast.parse((Path(fastio.__file__).parent / "loader.py").read_text())
    called = {n.attr for n in ast.walk(loader) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
              and n.value.attr == "pipeline" and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}
    assert called <= set(hooks), called
    imported = {n.module for n in ast.walk(ast.parse(Path(base.__file__).read_text())) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and (m.startswith("fastio.formats") or m == "PIL")}, imported
    kinds = [fastio.ImageTrain(), fastio.ImageEval(), fastio.Graph(lambda image, device: image), fastio.VideoClips(),
             fastio.VideoClips(cpu_fallback="pyav", clips_per_video=2), fastio.AudioClips()]
    for kind in kinds:
        graph = kind.graph()
        assert graph.names[:1] == ("encoded",) and dict(graph.inputs)["index"] == "int64", kind
        assert {d for _, d in graph.inputs} <= set(base.DTYPES), graph.inputs
    assert fastio.Raw().graph() is None and fastio.Tokens().graph() is None


def test_a_kind_written_for_the_wider_interface_is_told_what_replaces_its_hook(image_dataset):
    """A hook of the earlier interface would be ignored now: the class is refused when made, naming what replaces
    it; a kind that does not say what it reads is named when the Loader asks."""
    with pytest.raises(TypeError, match=r"Old.build: the pipeline protocol has no 'build' hook now; declare the "
                                        r"graph with graph\(\) -> GraphDef"):
        @dataclass(frozen=True)
        class Old(fastio.Pipeline):
            def build(self, source, **options):
                return None

    with pytest.raises(TypeError, match="Odd.default_fields must be one of label, shared, none, got 'all'"):
        class Odd(fastio.Pipeline):
            default_fields = "all"

    @dataclass(frozen=True)
    class Silent(fastio.Pipeline):
        pass

    with pytest.raises(TypeError, match="Silent does not say what it reads: define read_fields"):
        Loader(image_dataset, batch_size=4, pipeline=Silent(), device="cpu", world_size=1, rank=0)


def test_the_loader_holds_no_kinds_options_and_no_mixture_branch():
    source = (Path(fastio.__file__).parent / "loader.py").read_text()
    tree = ast.parse(source)
    branches = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))]
    assert not [b for b in branches if "mixture" in b.lower()], branches
    shared = {f.name for f in dataclasses.fields(LoaderConfig) if f.init}
    old = {"image_size", "mean", "std", "dtype", "layout", "eval_crop_ratio", "fields"}
    assert not old & shared  # the old spellings are refused before the config is made
    loader = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Loader")
    uses = {n.attr for n in ast.walk(loader) if isinstance(n, ast.Attribute)}
    assert not (old - {"dtype"}) & uses, uses  # (a DALI tensor's dtype is read when copying to the GPU)


def test_read_ahead_takes_a_callable_on_a_dataset_and_a_mixture(image_dataset, tmp_path):
    """Reader and MixReader take the same argument: a callable giving the coming batches (called lazily)."""
    from fastio.dataset.dataset import Dataset
    from fastio.read.mixture import MixReader
    from fastio.read.reader import Reader

    calls = []

    def coming():
        calls.append(1)
        yield np.arange(4)

    ds, other = Dataset(image_dataset), Dataset(_tagged(tmp_path / "t", 4, "cls"))  # one dataset twice is refused
    with Reader(ds, ["cls"], threads=1) as reader, Reader(other, ["cls"], threads=1) as second:
        reader.read_ahead_shards(coming)  # local shards: nothing to fetch, and nothing iterated
        mix = MixReader(Mixture({"a": ds, "b": other}), [reader, second])
        mix.read_ahead_shards(coming)
    assert calls == []


def test_an_undecodable_image_in_a_mixture_is_named_by_source_shard_and_key(tmp_path, image_folder, image_dataset):
    paths = sorted(image_folder.rglob("*.jpg"))[:8]
    with ShardWriter(tmp_path / "bad", max_samples=4) as writer:
        for k, path in enumerate(paths):
            writer.write({"__key__": f"img{k:02d}", "jpg": b"not an image" if k == 5 else path.read_bytes(),
                          "cls": b"0"})
        writer.close(image_field="jpg", label_field="cls")
    mix = Mixture({"good": image_dataset, "bad": tmp_path / "bad"})
    with Loader(mix, batch_size=8, pipeline=fastio.ImageEval(size=16), device="cpu", shuffle="none", world_size=1,
                rank=0, num_threads=1) as loader, pytest.raises(
            fastio.DatasetError, match=rf"^mixture source 'bad': {tmp_path / 'bad'}: shard shard-000001.tar "
                                       r"key 'img05': field 'jpg' failed to decode"):
        list(loader)


def test_a_graph_failing_in_dali_is_named_by_its_operator_and_what_dali_said(image_dataset):
    """A DALI error no pipeline object explains is one line with the batch's keys and DALI's own reason (the
    operator and its message), not DALI's first line, ``Critical error in pipeline:``."""
    from nvidia.dali import fn

    from fastio.errors import DatasetError

    def too_big(image, device):
        return fn.crop(image, crop=(4000, 4000), out_of_bounds_policy="error")

    with Loader(image_dataset, pipeline=fastio.Graph(too_big), batch_size=4, device="cpu", world_size=1,
                rank=0, shuffle="none") as loader:
        with pytest.raises(DatasetError) as err:
            next(iter(loader))
    line = str(err.value)
    assert "DALI failed on a batch with keys" in line and "fn.crop: " in line and "\n" not in line
    assert "Critical error" not in line


def test_old_options_over_a_config_are_refused_naming_its_pipeline_object_changed(image_ds):
    """Before 0.1, ``Loader(dest, LoaderConfig(batch_size=4), image_size=16)`` changed the config's image size; the
    old options are refused now, the message naming the config's pipeline object with the options to give it."""
    from fastio.loader import LoaderConfig

    config = LoaderConfig(batch_size=4, device="cpu", num_threads=1, world_size=1, rank=0, shuffle="none")
    with pytest.raises(fastio.LoaderArgumentError, match=r"^image_size=16, dtype='uint8', pipeline=ImageTrain\(.*\): the "
                       r"old spelling; give the pipeline object: pipeline=fastio\.ImageTrain\(\.\.\., size=16, "
                       r"dtype='uint8'\)$"):
        fastio.Loader(image_ds, config, image_size=16, dtype="uint8")
    with fastio.Loader(image_ds, config, pipeline=fastio.ImageTrain(size=16, dtype="uint8")) as loader:
        assert next(iter(loader))["image"].shape == (4, 3, 16, 16)
    evaluating = LoaderConfig(batch_size=4, pipeline=fastio.ImageEval(size=24, layout="HWC"), device="cpu")
    with pytest.raises(fastio.LoaderArgumentError, match=r"pipeline=fastio\.ImageEval\(\.\.\., crop_ratio=0\.5\)$"):
        fastio.Loader(image_ds, evaluating, eval_crop_ratio=0.5)
    tokens = LoaderConfig(pipeline=fastio.Tokens(seq_len=8), device="cpu")
    with pytest.raises(fastio.LoaderArgumentError, match=r"pipeline=fastio\.Tokens\(\.\.\.\) \(image_size: not options "
                                                         r"of Tokens\)$"):
        fastio.Loader(image_ds, tokens, image_size=16)  # a kind without image options: naming none of its own


_STRIP_PEAK = """
import io, resource, sys
from PIL import Image
import fastio
from fastio.dataset.shards import ShardWriter
dest = sys.argv[1]
with ShardWriter(dest, max_samples=8) as w:
    for key, size in (("strip", (3000, 1)), ("photo", (64, 48))):
        buf = io.BytesIO()
        Image.new("RGB", size, (200, 40, 90)).save(buf, "JPEG", quality=95)
        w.write({"__key__": key, "jpg": buf.getvalue(), "cls": b"0"})
    w.close(image_field="jpg", label_field="cls", converted_from={"format": "test"}, skipped=[])
with fastio.Loader(dest, batch_size=2, pipeline=fastio.ImageEval(size=224), device="cpu", shuffle="none") as ld:
    ld.key(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    batch = next(iter(ld))
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
keys = [ld.key(int(i)) for i in batch["index"]]
print(tuple(batch["image"].shape), grew // 1024, keys)
"""


def test_image_eval_of_a_strip_is_bounded_and_its_crop_padded(tmp_path, warm):
    """A 3000 x 1 strip was resized by its shorter side to 768000 x 256 (590 MB and seconds of CPU; a 1 x 10000 one
    at 336 needs 4.4 GB, a GPU out of memory): the longer side is now capped at MAX_RESIZED and the crop padded. The
    peak is a process's of its own (run by the warm interpreter: torch and DALI imported already)."""
    (tmp_path / "strip.py").write_text(_STRIP_PEAK)
    rc, stdout, stderr = warm.run(tmp_path / "strip.py", tmp_path, str(tmp_path / "ds"), timeout=300)
    assert rc == 0, stderr[-2000:]
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("(2, 3, 224, 224) "), line
    assert int(line.split(") ", 1)[1].split(" ")[0]) < 200, line  # MiB the first batch added to the peak
