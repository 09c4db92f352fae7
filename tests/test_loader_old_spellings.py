"""The Loader's old spellings (before 0.1: the flat image options, ``graph=``, ``pipeline=`` a kind's name or a bare
graph function, ``fastio.pipeline``) are refused in one line naming the pipeline object to give instead, from the
Loader, a LoaderConfig and a change of one; the object named is the one the old spelling described."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest

import fastio
from fastio import LoaderArgumentError, LoaderConfig


def flip(image, device):
    return image


OLD = [  # (the old arguments, the pipeline object the refusal names)
    ({"image_size": 32}, "fastio.ImageTrain(size=32)"),
    ({"mean": (0.5, 0.5, 0.5)}, "fastio.ImageTrain(mean=(0.5, 0.5, 0.5))"),
    ({"std": (0.2, 0.2, 0.2)}, "fastio.ImageTrain(std=(0.2, 0.2, 0.2))"),
    ({"dtype": "uint8"}, "fastio.ImageTrain(dtype='uint8')"),
    ({"layout": "HWC"}, "fastio.ImageTrain(layout='HWC')"),
    ({"eval_crop_ratio": 0.5}, "fastio.ImageEval(crop_ratio=0.5)"),
    ({"fields": ["cls"]}, "fastio.ImageTrain(fields=['cls'])"),
    ({"pipeline": "image-train"}, "fastio.ImageTrain()"),
    ({"pipeline": "image-eval", "image_size": 160}, "fastio.ImageEval(size=160)"),
    ({"pipeline": "raw", "fields": ["txt"]}, "fastio.Raw(fields=['txt'])"),
    ({"pipeline": flip}, "fastio.Graph(flip)"),
    ({"graph": "image-eval"}, "fastio.ImageEval()"),
    ({"graph": fastio.Raw()}, "fastio.Raw(...)"),
]


def _refusal(make) -> str:
    with pytest.raises(LoaderArgumentError) as err:
        make()
    return str(err.value)


@pytest.mark.parametrize("old,new", OLD, ids=[f"{sorted(old)}->{new}" for old, new in OLD])
def test_each_old_spelling_is_refused_in_one_line_naming_the_pipeline_object(image_dataset, old, new):
    tail = f": the old spelling; give the pipeline object: pipeline={new}"
    for make in (lambda: fastio.Loader(image_dataset, batch_size=4, device="cpu", **old),
                 lambda: LoaderConfig(batch_size=4, **old)):
        text = _refusal(make)
        assert "\n" not in text and text.endswith(tail), text
        given = text.split(": the old spelling")[0]  # names what was given
        assert all(f"{name}={value!r}" in given for name, value in old.items()), text


def test_an_old_option_over_a_config_names_the_configs_object_with_the_option():
    config = LoaderConfig(batch_size=4, pipeline=fastio.ImageEval(size=24), device="cpu")
    text = _refusal(lambda: dataclasses.replace(config, image_size=16))
    assert text.endswith("pipeline=fastio.ImageEval(..., size=16)"), text


def test_the_named_objects_are_the_ones_to_write():
    """What the refusals tell to write is accepted, and a pipeline= of no kind at all is a ValueError naming it."""
    assert LoaderConfig(pipeline=fastio.ImageEval(size=160)).pipeline.size == 160
    assert LoaderConfig(pipeline=fastio.Graph(flip)).pipeline == fastio.Graph(flip)
    with pytest.raises(ValueError, match=r"^pipeline must be a pipeline object .*, got 'video'$"):
        LoaderConfig(pipeline="video")
    assert not hasattr(LoaderConfig(), "graph")  # the old name of the config's pipeline: gone


def test_the_old_import_path_is_refused_naming_the_pipeline_objects():
    sys.modules.pop("fastio.pipeline", None)
    with pytest.raises(ImportError) as err:
        importlib.import_module("fastio.pipeline")
    text = str(err.value)
    assert "\n" not in text and text.startswith("fastio.pipeline is the old spelling"), text
    assert "give the pipeline object: pipeline=fastio.ImageTrain(size=224)" in text, text
    with pytest.raises(ImportError, match="spell"):
        from fastio.pipelines import spell  # noqa: F401  (the old flat options' map: gone)
