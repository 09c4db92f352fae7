"""A kind of one's own written from docs/adding-a-kind.md, and the mistakes a newcomer makes writing one: each is
refused in one line naming the kind, the hook and the input, output or entry, never DALI's, numpy's or Python's
bare error, nor a batch silently missing what the kind gave (found writing kinds from the page, as a newcomer)."""

from __future__ import annotations

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
from fastio.errors import LoaderArgumentError
from fastio.pipelines import ImageKind, ReadFields


@dataclass(frozen=True)
class Gain(ImageKind):
    """The page's second example: an image kind with one more input, ``gain`` (float32), fed per sample."""

    kind: ClassVar[str] = "gain"
    input_dtypes: ClassVar[dict[str, str]] = {**ImageKind.input_dtypes, "gain": "float32"}
    output_names: ClassVar[tuple[str, ...]] = ("image", "index")

    def input_names(self):
        return ("encoded", "index", "gain")

    def inputs(self, batch, *, seed, epoch):
        return (*super().inputs(batch, seed=seed, epoch=epoch), np.full(len(batch.indices), 1.5, np.float32))

    def _graph(self, inp, decoder_device):
        from nvidia.dali import fn, types

        img = fn.resize(fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.GRAY),
                        resize_x=8, resize_y=8)
        return fn.cast(fn.cast(img, dtype=types.FLOAT) * inp["gain"], dtype=types.UINT8), inp["index"]


def first_batch(dest, pipeline, batch_size=4):
    with fastio.Loader(dest, batch_size=batch_size, pipeline=pipeline, device="cpu", world_size=1, rank=0,
                       num_threads=1, shuffle="none") as loader:
        return next(iter(loader))


def test_the_pages_kind_with_an_input_of_its_own_runs(image_dataset):
    batch = first_batch(image_dataset, Gain())
    assert batch["image"].shape == (4, 8, 8, 1) and batch["label"].shape == (4,)


@dataclass(frozen=True)
class NotFed(Gain):
    def inputs(self, batch, *, seed, epoch):
        return ImageKind.inputs(self, batch, seed=seed, epoch=epoch)


@dataclass(frozen=True)
class FedMore(Gain):
    def inputs(self, batch, *, seed, epoch):
        return (*super().inputs(batch, seed=seed, epoch=epoch), np.zeros(len(batch.indices), np.int32))


@dataclass(frozen=True)
class OtherDtype(Gain):
    def inputs(self, batch, *, seed, epoch):
        *rest, gain = super().inputs(batch, seed=seed, epoch=epoch)
        return (*rest, gain.astype(np.float64))


@dataclass(frozen=True)
class Short(Gain):
    def inputs(self, batch, *, seed, epoch):
        *rest, gain = super().inputs(batch, seed=seed, epoch=epoch)
        return (*rest, gain[:-1])


@dataclass(frozen=True)
class PlainList(Gain):
    def inputs(self, batch, *, seed, epoch):
        *rest, gain = super().inputs(batch, seed=seed, epoch=epoch)
        return (*rest, gain.tolist())


@pytest.mark.parametrize("kind,said", [
    (PlainList(), r"PlainList's graph feed gave input 'gain' as a list of float, declared float32"),
    (NotFed(), r"NotFed's graph feed gave 2 inputs, its graph declares 3 \(encoded, index, gain\)"),
    (FedMore(), r"FedMore's graph feed gave 4 inputs, its graph declares 3 \(encoded, index, gain\)"),
    (OtherDtype(), r"OtherDtype's graph feed gave input 'gain' as float64, declared float32"),
    (Short(), r"Short's graph feed gave input 'gain' for 3 samples, input 'encoded' for 4"),
])
def test_a_feed_that_breaks_its_declared_inputs_is_named(image_dataset, kind, said):
    """An input declared and not fed failed as DALI's "tuple index out of range", blamed on the batch's keys as a
    DatasetError; another dtype or batch length as DALI's "ExternalSource expected data of type float" or "Batch size
    clash! ... __ExternalSource_2", naming no input; an input fed and not declared was dropped without a word."""
    with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
        first_batch(image_dataset, kind)


@dataclass(frozen=True)
class Undeclared(Gain):
    input_dtypes: ClassVar[dict[str, str]] = dict(ImageKind.input_dtypes)


@dataclass(frozen=True)
class Float64(Gain):
    input_dtypes: ClassVar[dict[str, str]] = {**ImageKind.input_dtypes, "gain": "float64"}


@pytest.mark.parametrize("kind,said", [
    (Undeclared(), r"Undeclared's graph input 'gain' has no dtype: declare it in its input_dtypes"),
    (Float64(), r"Float64's graph input 'gain' is declared 'float64': a graph input's dtype is one of uint8, int32, "
                r"int64, float32, bool"),
])
def test_an_input_without_a_dtype_fastio_feeds_is_named(image_dataset, kind, said):
    """Both were a bare KeyError ('gain', 'float64') from deep in the graph's build."""
    with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
        first_batch(image_dataset, kind)


@dataclass(frozen=True)
class LabelOut(Gain):
    output_names: ClassVar[tuple[str, ...]] = ("image", "label", "index")

    def _graph(self, inp, decoder_device):
        image, index = super()._graph(inp, decoder_device)
        return image, inp["gain"], index


@dataclass(frozen=True)
class NoIndex(Gain):
    output_names: ClassVar[tuple[str, ...]] = ("image",)

    def _graph(self, inp, decoder_device):
        return super()._graph(inp, decoder_device)[0]


@dataclass(frozen=True)
class OtherIndex(Gain):
    def _graph(self, inp, decoder_device):
        return super()._graph(inp, decoder_device)[0], inp["gain"]


@dataclass(frozen=True)
class MoreNodes(Gain):
    def _graph(self, inp, decoder_device):
        return (*super()._graph(inp, decoder_device), inp["gain"])


@dataclass(frozen=True)
class Typo(Gain):
    def _graph(self, inp, decoder_device):
        image, index = super()._graph(inp, decoder_device)
        return image * inp["gian"], index


@pytest.mark.parametrize("kind,said", [
    (Typo(), r"Typo's graph body asked for input 'gian': its inputs are encoded, index, gain"),
    (LabelOut(), r"LabelOut's graph output 'label' is an entry the Loader adds to the batch \(label, source, "
                 r"padded\): name it otherwise"),
    (NoIndex(), r"NoIndex's graph outputs \('image'\) lack 'index': return the fed inp\['index'\] as one"),
    (OtherIndex(), r"OtherIndex's graph output 'index' is not the fed index \(it gave \[1\.5 1\.5 1\.5 1\.5\] for a "
                   r"batch fed \[0 1 2 3\]\): return inp\['index'\] as it is"),
    (MoreNodes(), r"MoreNodes's graph gave 3 outputs, its output names are 2 \(image, index\)"),
])
def test_a_graph_whose_outputs_are_not_its_declared_ones_is_named(image_dataset, kind, said):
    """A graph output ``label`` was replaced by the batch's labels (the kind's values lost without a word); an
    ``index`` output missing was a bare KeyError('index'), one holding something else an "internal error" blaming
    fastio; a node beyond the output names was dropped without a word."""
    with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
        first_batch(image_dataset, kind)


@dataclass(frozen=True)
class Returns(Gain):
    returned: str = "list"

    def assemble(self, outputs, delivery):
        image = outputs["image"]
        return {"list": [image], "none": None, "numpy": {"image": image.numpy()}, "short": {"image": image[:-1]},
                "index": {"image": image, "index": torch.zeros(4)}, "key": {1: image}}[self.returned]


@pytest.mark.parametrize("returned,said", [
    ("list", r"Returns.assemble returned a list, not a dict of the batch's entries by name"),
    ("none", r"Returns.assemble returned a NoneType, not a dict of the batch's entries by name"),
    ("key", r"Returns.assemble returned a batch entry named 1, not by a string"),
    ("numpy", r"Returns.assemble returned batch\['image'\] as a numpy array: give a torch tensor "
              r"\(torch.from_numpy\)"),
    ("short", r"Returns.assemble returned batch\['image'\] of 3 rows for a batch of 4: one row per unit"),
    ("index", r"Returns.assemble returned batch\['index'\], an entry the Loader adds \(index, source, padded\): "
              r"name it otherwise"),
])
def test_an_assemble_that_returns_no_batch_is_named(image_dataset, returned, said):
    """A list or None was a bare AttributeError ("'list' object has no attribute 'update'") from the Loader; a
    numpy array stayed numpy (and on the host with device='cuda'), a short batch went out with 3 images and 4
    labels, an ``index`` entry was replaced by the Loader's: all without a word."""
    with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
        first_batch(image_dataset, Returns(returned=returned))


@dataclass(frozen=True)
class ReadsNothing(fastio.Pipeline):
    """Reads no stored sample (read_fields None) but keeps the default source, which reads stored samples."""

    def read_fields(self, ds, fields):
        return None


@dataclass(frozen=True)
class Reads(fastio.Pipeline):
    returned: str = "tuple"

    def read_fields(self, ds, fields):
        return {"tuple": ("jpg",), "none image": ReadFields(tuple(fields), image=(None,)),
                "no unit": ReadFields(tuple(fields), per_unit=0)}[self.returned]


@pytest.mark.parametrize("mixed", [False, True])
def test_a_kind_that_reads_no_stored_sample_keeps_no_default_source(image_dataset, tmp_path, mixed):
    """Its first batch was a bare AttributeError ("'NoneType' object has no attribute 'read_ahead_shards'")."""
    target = fastio.Mixture({"a": image_dataset, "b": image_dataset}) if mixed else image_dataset
    with pytest.raises(LoaderArgumentError, match=r"^ReadsNothing.read_fields returned None \(it reads no stored "
                                                  r"sample\), and its source is the default one, which reads stored "
                                                  r"samples: define source\(read_set, sampling, place\)"):
        first_batch(target, ReadsNothing())


@pytest.mark.parametrize("returned,said", [
    ("tuple", r"Reads.read_fields returned a tuple \('jpg',\), not a ReadFields or None"),
    ("none image", r"Reads.read_fields returned a ReadFields whose image holds None, not a field name: "
                   r"\(None,\)"),
    ("no unit", r"Reads.read_fields returned a ReadFields whose per_unit is 0, not a whole number >= 1"),
])
def test_read_fields_that_name_no_fields_are_named(image_dataset, returned, said):
    """A tuple was a bare AttributeError ("'tuple' object has no attribute 'fields'") from the read set; the page's
    ``image=(ds.image_field,)`` on a dataset without one said "dataset has no field None", naming no kind."""
    with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
        first_batch(image_dataset, Reads(returned=returned))


def test_a_kind_that_is_not_frozen_is_refused_naming_it():
    """A dataclass kind without frozen=True ran, its options changeable under a running Loader (and its LoaderConfig
    unhashable: "unhashable type: 'Loose'")."""
    @dataclass
    class Loose(fastio.Pipeline):
        size: int = 8

        def read_fields(self, ds, fields):
            return ReadFields(tuple(fields))

    with pytest.raises(ValueError, match=r"^pipeline .*Loose\(size=8\) is a dataclass that is not frozen: make it "
                                         r"@dataclass\(frozen=True\)"):
        fastio.LoaderConfig(pipeline=Loose())


@pytest.mark.parametrize("name,hook", [("assembel", "assemble"), ("read_field", "read_fields"),
                                       ("stat_dict", "state_dict"), ("check_states", "check_state")])
def test_a_misspelled_hook_is_named_in_a_warning_when_its_class_is_made(name, hook):
    """A hook misspelled was never called: the base's ran instead (an empty state, a default batch) silently. A
    warning names it (a helper of that name may be meant: named ``_...`` it is not warned about)."""
    import warnings

    with pytest.warns(UserWarning, match=rf"^Odd.{name}: not a hook of the pipeline protocol; did you mean {hook}\?"):
        type("Odd", (fastio.Pipeline,), {name: lambda self, *args: None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        type("Odd", (fastio.Pipeline,), {f"_{name}": lambda self, *args: None})


@dataclass(frozen=True)
class Scaled(fastio.Pipeline):
    """A kind with an option of its own in the Loader's state, and the base's check_state."""

    scale: int = 2
    shape: tuple[int, ...] = (1, 2)

    def read_fields(self, ds, fields):
        return ReadFields(tuple(fields), image=ds.manifest.image_order, sizes=True)

    def assemble(self, outputs, delivery):
        return {"size": torch.from_numpy(delivery.read.sizes.copy()) * self.scale, "label": delivery.labels()}

    def state_dict(self):
        return {"scaled": {"scale": self.scale, "shape": self.shape}}


def test_a_kinds_state_entries_are_checked_by_the_base_on_resume(image_dataset, tmp_path):
    """A kind recording its options in state_dict() and keeping the base's check_state resumed a state saved with
    other options without a word (its batches no longer those the state was saved with); its entries are compared
    now, through a checkpoint too (where a tuple may come back a list)."""
    opts = dict(batch_size=4, device="cpu", world_size=1, rank=0, shuffle="none")
    with fastio.Loader(image_dataset, pipeline=Scaled(), **opts) as loader:
        it = iter(loader)
        next(it), next(it)
        with fastio.Checkpointer(tmp_path / "ckpt") as ckpt:
            ckpt.save(2, {"loader": loader}, blocking=True)
        state = loader.state_dict()
    with fastio.Loader(image_dataset, pipeline=Scaled(), **opts) as again:
        with fastio.Checkpointer(tmp_path / "ckpt") as ckpt:
            ckpt.restore_latest({"loader": again})
        assert again.consumed == 8
    with fastio.Loader(image_dataset, pipeline=Scaled(scale=3), **opts) as other:
        with pytest.raises(fastio.LoaderStateError, match=r"^loader state has scaled=\{'scale': 2, 'shape': \(1, 2\)\}, "
                                                          r"this Scaled gives \{'scale': 3, 'shape': \(1, 2\)\}"):
            other.load_state_dict(state)
        with pytest.raises(fastio.LoaderStateError, match=r"^loader state has no 'scaled' entry, this Scaled gives "):
            other.load_state_dict({k: v for k, v in state.items() if k != "scaled"})


def test_a_kind_that_sets_no_kind_is_named_by_its_class(image_dataset):
    """A kind without ``kind`` took the base's, "graph": messages named a user's kind 'graph' (fastio.Graph's name)."""
    @dataclass(frozen=True)
    class Thumbs(ImageKind):
        def _graph(self, inp, decoder_device):
            from nvidia.dali import fn

            return fn.resize(fn.decoders.image(inp["encoded"], device=decoder_device), resize_x=8, resize_y=8), \
                inp["index"]

    @dataclass(frozen=True)
    class Smaller(Thumbs):
        pass

    assert (Thumbs.kind, Smaller.kind, fastio.Graph.kind, fastio.ImageTrain.kind) == \
           ("Thumbs", "Smaller", "graph", "image-train")
    with fastio.Loader(image_dataset, batch_size=4, pipeline=Smaller(), device="cpu", world_size=1, rank=0) as loader:
        state = {**loader.state_dict(), "tokens": {"seq_len": 8}}
        with pytest.raises(fastio.LoaderStateError, match=r"fastio.Tokens, and pipeline 'Smaller' counts samples"):
            loader.load_state_dict(state)


@pytest.mark.parametrize("hook,defined,said", [
    ("assemble", lambda self, outputs: {}, r"Odd.assemble\(self, outputs\): the Loader calls it as "
                                           r"assemble\(self, outputs, delivery\)"),
    ("graph", lambda self, device: None, r"Odd.graph\(self, device\): the Loader calls it as graph\(self\)"),
    ("read_fields", lambda ds, fields: None, r"Odd.read_fields\(ds, fields\): the Loader calls it as "
                                             r"read_fields\(self, ds, fields\)"),
])
def test_a_hook_that_takes_other_arguments_is_refused_when_its_class_is_made(hook, defined, said):
    """It failed only when the Loader called it, with Python's bare "takes 2 positional arguments but 3 were
    given" from inside the Loader."""
    with pytest.raises(TypeError, match=rf"^{said}"):
        type("Odd", (fastio.Pipeline,), {hook: defined})
    type("Fine", (fastio.Pipeline,), {hook: lambda self, *args, **kwargs: None})  # anything it can take is taken


@dataclass(frozen=True)
class NoProblem(Gain):
    """A graph declared without a ``problem`` (None): nothing names an undecodable sample but DALI."""

    def graph(self):
        return dataclasses.replace(super().graph(), problem=None)


_NO_PROBLEM = f"""
import sys

sys.path.insert(0, {str(Path(__file__).parent)!r})
import fastio
from test_pipeline_protocol import NoProblem, first_batch

try:
    first_batch(sys.argv[1], NoProblem(), batch_size=48)
    print("no error")
except fastio.DatasetError as err:
    print(f"DatasetError: {{err}}")
"""


def test_a_graph_without_a_problem_hook_still_names_the_batch_dali_failed_on(image_folder, tmp_path, warm):
    """With ``problem=None`` a failing batch raised TypeError("'NoneType' object is not callable") from the Loader's
    decode-error path, hiding what DALI said. In a process of its own (``warm``), once: a batch of 48 (DALI's image
    decoder reads the headers of 32 or more in two threads) whose unreadable image fell to the decoder's calling
    thread segfaulted the process about once in ten runs (the other thread read on through the decoder's unwound
    stack); the image kinds now have DALI's parser read every header first (``fastio.pipelines.image.headers_read``),
    which names the batch and what DALI said instead."""
    next(image_folder.rglob("*.jpg")).write_bytes(b"not an image at all")
    dest = write_image_dataset(tmp_path / "bad", image_folder)
    script = tmp_path / "no_problem.py"
    script.write_text(_NO_PROBLEM)
    rc, out, err = warm.run(script, tmp_path, str(dest), timeout=300)
    assert rc == 0, (rc, out, err[-3000:])
    assert re.search(r"^DatasetError: .*DALI failed on a batch with keys .*: fn\.peek_image_shape: nvImageCodec "
                     r"failure", out, re.M), out


@dataclass(frozen=True)
class PairSource(fastio.Pipeline):
    """Returns the plan and the reader as a tuple, not a Source."""

    def read_fields(self, ds, fields):
        return ReadFields(tuple(fields), image=ds.manifest.image_order, sizes=True)

    def source(self, read_set, sampling, place):
        return read_set.sampler(sampling, place.world_size, place.rank), read_set.reader


def test_a_source_that_is_not_a_source_is_named(image_dataset):
    """It was a bare AttributeError ("'tuple' object has no attribute 'plan'") from the Loader's constructor."""
    with pytest.raises(LoaderArgumentError, match=r"^PairSource.source returned a tuple, not a "
                                                  r"fastio.pipelines.Source\(plan, reader, pipeline\)"):
        first_batch(image_dataset, PairSource())


@dataclass(frozen=True)
class Clashing(Scaled):
    entry: str = "seed"

    def state_dict(self):
        return {self.entry: 5} if self.entry else ["not", "a", "dict"]


@pytest.mark.parametrize("entry", ["seed", "consumed", "mixture", ""])
def test_a_kinds_state_entry_named_as_the_loaders_is_refused(image_dataset, entry):
    """A kind's entry named ``seed`` or ``consumed`` replaced the Loader's own in ``state_dict()`` without a word (a
    resume then at another position or order); ``mixture``, a mixture's; a list was a bare ValueError from
    dict.update."""
    target = fastio.Mixture({"a": image_dataset, "b": image_dataset})
    with fastio.Loader(target, batch_size=4, pipeline=Clashing(entry=entry), device="cpu", world_size=1,
                       rank=0) as loader:
        said = rf"Clashing.state_dict gives {entry!r}, an entry of the Loader's own state" if entry else \
            r"Clashing.state_dict returned a list, not a dict of the kind's entries"
        with pytest.raises(LoaderArgumentError, match=rf"^{said}"):
            loader.state_dict()
