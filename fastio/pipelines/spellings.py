"""The one place where the Loader's old flat options (``pipeline="image-train", image_size=224, mean=...,
eval_crop_ratio=..., fields=...``) become a pipeline object, before a :class:`~fastio.LoaderConfig` is made (it
holds only what every kind shares, and the object); they give the same batches, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastio.pipelines.base import Pipeline
from fastio.pipelines.graph import Graph
from fastio.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, ImageEval, ImageTrain, check_crop_ratio, check_image_options
from fastio.pipelines.raw import Raw

__all__ = ["IMAGE_OPTIONS", "KINDS", "OLD_OPTIONS", "as_pipeline", "old_options", "spell"]

KINDS = ("image-train", "image-eval", "raw")
"""The built-in kinds by their old names."""
IMAGE_OPTIONS = ("image_size", "mean", "std", "dtype", "layout", "eval_crop_ratio")
"""The old options of the image kinds (each a field of :class:`ImageTrain` / :class:`ImageEval` now)."""
_DEFAULTS = {"image_size": 224, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "dtype": "float32", "layout": "CHW",
             "eval_crop_ratio": 0.875}


def as_pipeline(pipeline: str | Callable | Pipeline, fields: Any = None, **old: Any) -> Pipeline:
    """The pipeline object for ``pipeline`` (an object, a kind's old name, or a graph function) with the old
    options ``old`` (:data:`IMAGE_OPTIONS`, None: not given) and ``fields``. The old options are checked for
    every kind, as before (a kind ignores those it has no use for); beside an object they are refused."""
    given = {k: v for k, v in old.items() if v is not None}
    unknown = sorted(set(given) - set(IMAGE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown pipeline options {unknown}")
    if isinstance(pipeline, Pipeline):
        extra = {**given, **({"fields": fields} if fields is not None else {})}
        if extra:
            name, value = next(iter(extra.items()))
            raise ValueError(f"{name}={value!r} is an option of the pipeline object now: give it there "
                             f"(pipeline={type(pipeline).__name__}(...)), not beside pipeline={pipeline!r}")
        return pipeline
    if not callable(pipeline) and pipeline not in KINDS:
        raise ValueError(f"pipeline must be one of {', '.join(KINDS)}, a pipeline object or a callable, "
                         f"got {pipeline!r}")
    o = {**_DEFAULTS, **given}
    o["mean"], o["std"] = tuple(o["mean"]), tuple(o["std"])
    check_image_options(o["image_size"], o["mean"], o["std"], o["dtype"], o["layout"], name="image_size")
    check_crop_ratio(o["eval_crop_ratio"], name="eval_crop_ratio")
    image = {"size": o["image_size"], "mean": o["mean"], "std": o["std"], "dtype": o["dtype"],
             "layout": o["layout"], "fields": fields}
    if callable(pipeline):
        return Graph(pipeline, fields=fields)
    if pipeline == "raw":
        return Raw(fields=fields)
    if pipeline == "image-eval":
        return ImageEval(**image, crop_ratio=o["eval_crop_ratio"])
    return ImageTrain(**image)


OLD_OPTIONS = (*IMAGE_OPTIONS, "fields")
"""Every old flat option of the Loader: none is a :class:`~fastio.LoaderConfig` field; :func:`spell` maps them."""


def old_options(options: dict[str, Any]) -> dict[str, Any]:
    """The old flat options among ``options`` (a Loader's keyword arguments), e.g. for a second Loader of the
    same images with another kind (``FastioDataModule``'s validation Loader)."""
    return {k: v for k, v in options.items() if k in OLD_OPTIONS}


def spell(options: dict[str, Any], base: Pipeline | None = None) -> dict[str, Any]:
    """``options`` (a Loader's keyword arguments) as :class:`~fastio.LoaderConfig` fields: ``pipeline=`` a kind's
    old name or a graph function, with the old flat options (:data:`OLD_OPTIONS`), becomes one pipeline object
    (:func:`as_pipeline`); the other options are returned as they are. Old options without ``pipeline=`` apply to
    ``base`` (the pipeline of the config they change), else to ``"image-train"``."""
    old = old_options(options)
    out = {k: v for k, v in options.items() if k not in old}
    if old or "pipeline" in out:
        pipeline = out.get("pipeline", "image-train" if base is None else base)
        out["pipeline"] = as_pipeline(pipeline, **old)
    return out
