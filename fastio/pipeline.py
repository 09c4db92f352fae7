"""The old import path of the pipelines, kept for code written against it: the pipeline objects live in
:mod:`fastio.pipelines` (``ImageTrain``, ``ImageEval``, ``Raw``, ``Graph``), which is where new code looks.

``GraphSpec(kind, image_size=..., ...)`` returns the pipeline object those old options describe
(:func:`fastio.pipelines.as_pipeline`); the functions below call that object's methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastio.pipelines import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    KINDS,
    BuiltPipeline,
    Pipeline,
    as_pipeline,
    build_graph,
    decodable,
)

if TYPE_CHECKING:
    from fastio.read.reader import ReadBatch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "PIPELINES", "BuiltPipeline", "GraphSpec", "build_pipeline",
           "decodable", "graph_inputs", "input_names"]

PIPELINES = KINDS


def GraphSpec(kind: str | Callable, image_size: int = 224, mean: tuple[float, ...] = IMAGENET_MEAN,  # noqa: N802
              std: tuple[float, ...] = IMAGENET_STD, dtype: str = "float32", layout: str = "CHW",
              eval_crop_ratio: float = 0.875) -> Pipeline:
    """The pipeline object of the old options (``GraphSpec("image-eval", image_size=160)`` is
    ``ImageEval(size=160)``)."""
    return as_pipeline(kind, image_size=image_size, mean=mean, std=std, dtype=dtype, layout=layout,
                       eval_crop_ratio=eval_crop_ratio)


def input_names(spec: Pipeline) -> tuple[str, ...]:
    """What the external source callback returns for a decoding pipeline, in order."""
    graph = spec.graph()
    if graph is None:
        raise ValueError("the raw pipeline has no DALI graph: the Loader hands the read bytes through")
    return graph.names


def graph_inputs(spec: Pipeline, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
    """The external source's return value for one read batch (the ``feed`` of :meth:`Pipeline.graph`)."""
    return spec.graph().feed(batch, seed=seed, epoch=epoch)


def build_pipeline(spec: Pipeline, source: Callable, **options: Any) -> BuiltPipeline | None:
    """``spec``'s graph built (:func:`fastio.pipelines.build_graph`: ``batch_size=, num_threads=, device=,
    device_id=, prefetch=, seed=``) fed by ``source``; None for a kind without a graph."""
    graph = spec.graph()
    return None if graph is None else build_graph(graph, source, **options)
