"""fastio.Mixture's sources as a user meets them: a source that cannot be opened is named (in code and in a
mixture file), sources whose label fields differ (``fastio index`` finds ``label`` where a converted dataset has
``cls``) each deliver their own, and a source without a label field is refused where the pipeline needs one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import indexed_tar

from fastio import ImageEval, Loader, Mixture, Raw
from fastio.convert.synthetic import photo_jpeg
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError


def _small(dest, n, label_field="cls", image=False):
    rng = np.random.default_rng(0)
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            sample = {"__key__": f"s{i:03d}", "txt": b"x%d" % i}
            if label_field is not None:
                sample[label_field] = b"%d" % (i % 2)
            if image:
                sample["jpg"] = photo_jpeg(rng, 32, 24)
            writer.write(sample)
        writer.close(label_field=label_field, image_field="jpg" if image else None, converted_from={"format": "test"},
                     skipped=[])
    return dest


def test_a_source_that_cannot_be_opened_is_named(tmp_path):
    good = _small(tmp_path / "good", 5)
    with pytest.raises(DatasetError, match=rf"^mixture source 'web': {tmp_path / 'nope'}: no such dataset"):
        Mixture({"good": good, "web": tmp_path / "nope"})
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"sources": {"good": "good", "web": "nope"}}))
    with pytest.raises(DatasetError, match=rf"^{spec}: mixture source 'web': .*nope: no such dataset"):
        Mixture.from_file(spec)


def test_each_source_delivers_its_own_label_field(tmp_path):
    mix = Mixture({"conv": _small(tmp_path / "a", 6, "cls"), "web": _small(tmp_path / "b", 6, "label")})
    loader = Loader(mix, batch_size=4, pipeline=Raw(), device="cpu", seed=1, world_size=1, rank=0)
    batch = next(iter(loader))
    loader.close()
    assert batch["label"].tolist() == [i % 2 for i in batch["index"].tolist()]
    assert batch["txt"] == [b"x%d" % i for i in batch["index"].tolist()]  # fields= semantics kept for the others


def test_the_image_pipelines_deliver_each_sources_label_field(tmp_path):
    mix = Mixture({"conv": _small(tmp_path / "a", 6, "cls", image=True),
                   "web": _small(tmp_path / "b", 6, "label", image=True)})
    with Loader(mix, batch_size=12, pipeline=ImageEval(size=16), device="cpu", num_threads=1, seed=1,
                world_size=1, rank=0) as loader:
        batch = next(iter(loader))
    assert sorted(batch["source"].tolist()) == [0] * 6 + [1] * 6
    assert batch["label"].tolist() == [i % 2 for i in batch["index"].tolist()]
    assert batch["image"].shape == (12, 3, 16, 16)


def test_fields_naming_one_sources_label_field_deliver_every_sources_label(tmp_path):
    mix = Mixture({"conv": _small(tmp_path / "a", 6, "cls"), "web": _small(tmp_path / "b", 6, "label")})
    with Loader(mix, batch_size=4, pipeline=Raw(fields=["label"]), device="cpu", world_size=1, rank=0) as loader:
        batch = next(iter(loader))
    assert batch["label"].tolist() == [i % 2 for i in batch["index"].tolist()]
    assert "txt" not in batch


def _img(i: int) -> bytes:
    return photo_jpeg(np.random.default_rng(i), 32, 24)


def test_a_source_without_a_label_field_is_refused_though_some_samples_have_a_field_of_that_name(tmp_path, capsys):
    """img2dataset-like: ``cls`` in 4 of 5 samples, so ``fastio index`` records no label field. Its ``cls``
    is not a label: the Loader is refused when it is made (it took ``cls`` as labels, then failed mid-epoch)."""
    a = indexed_tar(tmp_path / "a", {f"a{i}": {"jpg": _img(i), "cls": b"%d" % i} for i in range(2)}, capsys)
    b = indexed_tar(tmp_path / "b", {f"p{i}": {"jpg": _img(i), **({"cls": b"5%d" % i} if i < 4 else {})}
                                  for i in range(5)}, capsys)
    assert json.loads((b / "manifest.json").read_text())["label_field"] is None
    for sources in ({"a": a, "b": b}, {"b": b, "a": a}):
        with pytest.raises(DatasetError, match=rf"^mixture source 'b': {b}: dataset has no label field"):
            Loader(Mixture(sources), batch_size=2, pipeline=ImageEval(size=16), device="cpu",
                   world_size=1, rank=0)
        with Loader(Mixture(sources), batch_size=2, pipeline=Raw(), device="cpu", world_size=1, rank=0) as loader:
            batches = list(loader)  # raw without fields=: the label only when every source has one
        assert sum(len(x["index"]) for x in batches) == len(loader) * 2 and "label" not in batches[0]


def test_a_mixture_file_naming_a_key_twice_is_refused_naming_it(tmp_path):
    # Found by review: JSON keeps the last of two equal keys, so a source pasted twice under one name (or a weight
    # given twice) silently dropped the first: the mixture read other data than the file shows.
    _small(tmp_path / "a", 5)
    _small(tmp_path / "b", 5)
    spec = tmp_path / "mix.json"
    spec.write_text('{"sources": {"web": "a", "web": "b"}}')
    with pytest.raises(DatasetError, match=rf"^{spec}: key 'web' appears twice in one object .*: name it once$"):
        Mixture.from_file(spec)
    spec.write_text('{"sources": {"x": "a", "y": "b"}, "weights": [[0, {"x": 1, "y": 1, "x": 3}]]}')
    with pytest.raises(DatasetError, match=rf"^{spec}: key 'x' appears twice"):
        Mixture.from_file(spec)
    spec.write_text('{"sources": {"x": "a", "y": "b"}, "weights": {"x": 3, "y": 1}}')
    assert Mixture.from_file(spec).weights == pytest.approx([0.75, 0.25])
