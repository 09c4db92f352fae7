"""DALI graphs the Loader runs (``image-train``, ``image-eval`` or a user-supplied graph), and their inputs.

Every graph is fed by one batch-mode ``fn.external_source`` whose callback the Loader owns (the
sample order is fastio's, not DALI's); :func:`graph_inputs` turns the bytes of one read batch into
what that callback returns. ``raw`` has no graph: DALI would only copy the bytes in and out again.
The same graph runs on DALI CPU operators (``device="cpu"``) or decodes with ``mixed`` (nvJPEG /
hardware decoder) and augments on the GPU (``device="cuda"``).
The global index of every sample goes through the graph and comes out next to its image so the
Loader can check that outputs line up with what it fed.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from fastio.augment import random_resized_crop

if TYPE_CHECKING:
    from fastio.reader import ReadBatch

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "PIPELINES", "BuiltPipeline", "GraphSpec", "build_pipeline",
           "decodable", "graph_inputs", "input_names"]

PIPELINES = ("image-train", "image-eval", "raw")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_DTYPES = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}
_INPUT_DTYPES = {"encoded": types.UINT8, "index": types.INT64, "anchor": types.FLOAT, "shape": types.FLOAT,
                 "flip": types.INT32}


@dataclass(frozen=True)
class GraphSpec:
    """What graph to build; see :class:`fastio.loader.LoaderConfig` for the meaning of each field."""

    kind: str | Callable
    image_size: int = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    dtype: str = "float32"
    layout: str = "CHW"
    eval_crop_ratio: float = 0.875

    def __post_init__(self):
        if not callable(self.kind) and self.kind not in PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINES)} or a callable, got {self.kind!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.layout not in ("CHW", "HWC"):
            raise ValueError(f"layout must be CHW or HWC, got {self.layout!r}")
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean and std need 3 values, std > 0; got {self.mean}, {self.std}")
        if not 0 < self.eval_crop_ratio <= 1:
            raise ValueError(f"eval_crop_ratio must be in (0, 1], got {self.eval_crop_ratio}")

    @property
    def decodes(self) -> bool:
        """Whether the graph decodes an image field (every kind but ``raw``)."""
        return self.kind != "raw"

    @property
    def needs_image_size(self) -> bool:
        """Whether :func:`graph_inputs` needs each image's (width, height) (``ReadBatch.sizes``)."""
        return self.kind == "image-train"


@dataclass(frozen=True)
class BuiltPipeline:
    """A built DALI pipeline and the names of its outputs, in the order ``pipe.run()`` returns them."""

    pipe: Any  # nvidia.dali.Pipeline
    outputs: tuple[str, ...]

    @property
    def owned_outputs(self) -> bool:
        """Whether outputs own their memory (DALI's dynamic executor): a later ``run()`` does not reuse it,
        so they can be handed to torch without a copy (``torch.from_dlpack``), as DALI's own PyTorch
        iterator does. Otherwise a buffer is valid only until the next ``run()`` and must be copied."""
        return bool(getattr(self.pipe, "exec_dynamic", False))


def decodable(data: np.ndarray) -> np.ndarray:
    """Encoded image bytes DALI's decoders take (they decode by content: JPEG, PNG, WebP, BMP, TIFF, PNM,
    JPEG 2000). GIF, which they lack, becomes a BMP of its first frame in RGB: lossless, no compression
    to undo. Other bytes are returned as they are (the reader thread calls this for every image)."""
    if bytes(data[:4]) != b"GIF8":
        return data
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data.tobytes())) as img:
            buf = io.BytesIO()
            img.convert("RGB").save(buf, "BMP")
    except (OSError, UnidentifiedImageError, SyntaxError) as err:
        raise ValueError(f"GIF: {err}") from None
    return np.frombuffer(buf.getvalue(), np.uint8)


def input_names(spec: GraphSpec) -> tuple[str, ...]:
    """What the external source callback returns for a decoding graph, in order."""
    if not spec.decodes:
        raise ValueError("the raw pipeline has no DALI graph: the Loader hands the read bytes through")
    if spec.kind == "image-train":
        return ("encoded", "index", "anchor", "shape", "flip")
    return ("encoded", "index")


def graph_inputs(spec: GraphSpec, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
    """The external source's return value for one read batch, in :func:`input_names` order.

    The encoded images are a list (one array per sample, each sample's own image field, DALI decodes by
    content); the other inputs are whole-batch arrays (outermost dimension = sample). ``image-train``
    crop and flip parameters are a pure function of ``(seed, epoch, global index)``.
    """
    index = np.ascontiguousarray(batch.indices, dtype=np.int64)
    if spec.kind != "image-train":
        return batch.image, index
    crop = random_resized_crop(seed, epoch, batch.indices, batch.sizes[:, 0], batch.sizes[:, 1])
    return batch.image, index, crop.anchor, crop.shape, crop.flip


def build_pipeline(spec: GraphSpec, source: Callable, *, batch_size: int, num_threads: int, device: str,
                   device_id: int | None, prefetch: int, seed: int = 0) -> BuiltPipeline:
    """Build the graph, fed by ``source`` (a callable returning :func:`graph_inputs`; it is called for as
    long as the pipeline runs, across epochs). The graph reads what ``source`` returns without copying it:
    the source must keep those arrays alive and unchanged until the outputs of that batch are returned.

    Outputs: ``("image", "index")`` for ``image-*``; ``("index", *names)`` for a callable, with the names
    of the dict it returns (``"image"`` when it returns one node). ``raw`` has no graph.
    """
    names = input_names(spec)
    decoder_device = "mixed" if device == "cuda" else "cpu"
    scale = 255.0 if spec.dtype != "uint8" else 1.0
    mean = [m * scale for m in spec.mean] if spec.dtype != "uint8" else [0.0, 0.0, 0.0]
    std = [s * scale for s in spec.std] if spec.dtype != "uint8" else [1.0, 1.0, 1.0]
    user_outputs: list[str] = []

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  prefetch_queue_depth=prefetch, seed=seed)
    def graph():
        # no_copy: DALI reads the arrays the source returns in place; the source keeps them until the
        # batch's outputs are returned (fastio.feeder.Feeder does), which is what DALI requires.
        nodes = fn.external_source(source=source, num_outputs=len(names), batch=True, no_copy=True,
                                   dtype=[_INPUT_DTYPES.get(n, types.UINT8) for n in names])
        inp = dict(zip(names, nodes))
        index = inp["index"]
        if spec.kind == "image-train":
            img = fn.decoders.image_slice(inp["encoded"], inp["anchor"], inp["shape"], device=decoder_device,
                                          output_type=types.RGB, normalized_anchor=False,
                                          normalized_shape=False, axis_names="WH", adjust_orientation=False)
            img = fn.resize(img, resize_x=spec.image_size, resize_y=spec.image_size, antialias=True)
            img = fn.crop_mirror_normalize(img, mirror=inp["flip"], mean=mean, std=std,
                                           dtype=_DTYPES[spec.dtype], output_layout=spec.layout)
            return img, index
        img = fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.RGB,
                                adjust_orientation=False)
        if spec.kind == "image-eval":
            img = fn.resize(img, resize_shorter=spec.image_size / spec.eval_crop_ratio, antialias=True)
            img = fn.crop_mirror_normalize(img, crop=(spec.image_size, spec.image_size), mean=mean, std=std,
                                           dtype=_DTYPES[spec.dtype], output_layout=spec.layout)
            return img, index
        result = spec.kind(img, decoder_device)
        if not isinstance(result, dict):
            result = {"image": result}
        user_outputs.extend(result)
        return (index, *result.values())

    pipe = graph()
    pipe.build()
    if spec.kind in ("image-train", "image-eval"):
        outputs = ("image", "index")
    else:
        outputs = ("index", *user_outputs)
    return BuiltPipeline(pipe, outputs)
