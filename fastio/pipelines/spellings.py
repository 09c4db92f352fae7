"""The one place where the Loader's old flat options (``pipeline="image-train", image_size=224, mean=...,
eval_crop_ratio=..., fields=...``) become a pipeline object, before a :class:`~fastio.LoaderConfig` is made (it
holds only what every kind shares, and the object); they give the same batches, bit for bit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastio.pipelines.base import Pipeline
from fastio.pipelines.graph import Graph
from fastio.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, ImageEval, ImageTrain, check_crop_ratio, check_image_options
from fastio.pipelines.raw import Raw

__all__ = ["IMAGE_OPTIONS", "KINDS", "OBJECT_NAMES", "OLD_OPTIONS", "as_pipeline", "old_options", "spell"]

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
            raise _beside(pipeline, *next(iter(extra.items())))
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


def _beside(pipeline: Pipeline, name: str, value: Any) -> ValueError:
    """The refusal of the old option ``name=value`` beside the pipeline object ``pipeline``: naming the object's
    own option it became (:data:`OBJECT_NAMES`) where the object has it, else the options the object has."""
    kind = type(pipeline).__name__
    own = [f.name for f in dataclasses.fields(pipeline) if f.init] if dataclasses.is_dataclass(pipeline) else []
    option = OBJECT_NAMES.get(name, name)
    if option in own:
        return ValueError(f"{name}={value!r} is an option of the pipeline object now: give it there "
                          f"(pipeline={kind}(..., {option}={value!r})), not beside pipeline={pipeline!r}")
    has = f"its options: {', '.join(own)}" if own else "it has no options of the old flat spelling"
    return ValueError(f"{name}={value!r} is not an option of {kind} ({has}): leave it out beside "
                      f"pipeline={pipeline!r}")


OBJECT_NAMES = {"image_size": "size", "eval_crop_ratio": "crop_ratio"}
"""An old option's name as a pipeline object's option (``ImageTrain(size=)``, ``ImageEval(crop_ratio=)``); the others
keep their names."""

OLD_OPTIONS = (*IMAGE_OPTIONS, "fields")
"""Every old flat option of the Loader: none is a :class:`~fastio.LoaderConfig` field; :func:`spell` maps them."""


def old_options(options: dict[str, Any]) -> dict[str, Any]:
    """The old flat options among ``options`` (a Loader's keyword arguments), e.g. for a second Loader of the
    same images with another kind (``FastioDataModule``'s validation Loader)."""
    return {k: v for k, v in options.items() if k in OLD_OPTIONS}


def spell(options: dict[str, Any], base: Pipeline | None = None) -> dict[str, Any]:
    """``options`` (a Loader's keyword arguments) as :class:`~fastio.LoaderConfig` fields: ``pipeline=`` a kind's
    old name or a graph function, with the old flat options (:data:`OLD_OPTIONS`), becomes one pipeline object
    (:func:`as_pipeline`); the other options are returned as they are. Old options without ``pipeline=`` change
    ``base`` (the pipeline object of the config they change) where it is of an old kind (``ImageTrain``,
    ``ImageEval``, ``Raw``, ``Graph``; another kind refuses them), else they apply to ``"image-train"``."""
    old = old_options(options)
    out = {k: v for k, v in options.items() if k not in old}
    if old and "pipeline" not in out and base is not None:
        out["pipeline"] = _respelled(base, old)
    elif old or "pipeline" in out:
        out["pipeline"] = as_pipeline(out.get("pipeline", "image-train"), **old)
    return out


def _respelled(base: Pipeline, old: dict[str, Any]) -> Pipeline:
    """``base`` (a config's pipeline object) changed by the old options ``old``: an object of an old kind is
    spelled the old way, ``old`` over its options, and made again (checked as the old spelling is); another kind
    has no old options (refused, naming the first)."""
    if isinstance(base, (ImageTrain, ImageEval)):
        spelled = {"image_size": base.size, "mean": base.mean, "std": base.std, "dtype": base.dtype,
                   "layout": base.layout, "fields": base.fields}
        if isinstance(base, ImageEval):
            spelled["eval_crop_ratio"] = base.crop_ratio
        return dataclasses.replace(as_pipeline(base.kind, **{**spelled, **old}), text=base.text)
    if isinstance(base, (Raw, Graph)):
        return as_pipeline(base.kind if isinstance(base, Raw) else base.fn, **{"fields": base.fields, **old})
    return as_pipeline(base, **old)
