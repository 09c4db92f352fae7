"""DALI graphs the Loader runs: ``image-train``, ``image-eval``, ``raw`` and a user-supplied graph.

Every graph is fed by one batch-mode ``fn.external_source`` whose callback the Loader owns (the
sample order is fastio's, not DALI's). The same graph runs on DALI CPU operators (``device="cpu"``)
or decodes with ``mixed`` (nvJPEG / hardware decoder) and augments on the GPU (``device="cuda"``).
The global index of every sample goes through the graph and comes out next to its image so the
Loader can check that outputs line up with what it fed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nvidia.dali import fn, pipeline_def, types

__all__ = ["PIPELINES", "GraphSpec", "build_pipeline", "input_names"]

PIPELINES = ("image-train", "image-eval", "raw")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_DTYPES = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}


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
    raw_fields: tuple[str, ...] = ()

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


def input_names(spec: GraphSpec) -> tuple[str, ...]:
    """What the external source callback returns, in order (each a list of per-sample arrays)."""
    if spec.kind == "image-train":
        return ("encoded", "index", "anchor", "shape", "flip")
    if spec.kind == "raw":
        return ("index",) + spec.raw_fields
    return ("encoded", "index")


def build_pipeline(spec: GraphSpec, source: Callable, *, batch_size: int, num_threads: int, device: str,
                   device_id: int | None, prefetch: int, seed: int = 0):
    """A built DALI pipeline whose outputs are ``(image, index)`` (``raw``: ``(index, *raw_fields)``;
    callable: ``(index, *outputs)`` with the names in ``pipe.fastio_outputs``)."""
    names = input_names(spec)
    dtypes = {"encoded": types.UINT8, "index": types.INT64, "anchor": types.FLOAT, "shape": types.FLOAT,
              "flip": types.INT32}
    decoder_device = "mixed" if device == "cuda" else "cpu"
    scale = 255.0 if spec.dtype != "uint8" else 1.0
    mean = [m * scale for m in spec.mean] if spec.dtype != "uint8" else [0.0, 0.0, 0.0]
    std = [s * scale for s in spec.std] if spec.dtype != "uint8" else [1.0, 1.0, 1.0]
    out_names: list[str] = []

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  prefetch_queue_depth=prefetch, seed=seed)
    def graph():
        nodes = fn.external_source(source=source, num_outputs=len(names), batch=True,
                                   dtype=[dtypes.get(n, types.UINT8) for n in names])
        inp = dict(zip(names, nodes))
        index = inp["index"]
        if spec.kind == "raw":
            out_names.extend(spec.raw_fields)
            return (index, *[inp[f] for f in spec.raw_fields])
        if spec.kind == "image-train":
            img = fn.decoders.image_slice(inp["encoded"], inp["anchor"], inp["shape"], device=decoder_device,
                                          output_type=types.RGB, normalized_anchor=False,
                                          normalized_shape=False, axis_names="WH", adjust_orientation=False)
            img = fn.resize(img, resize_x=spec.image_size, resize_y=spec.image_size, antialias=True)
            img = fn.crop_mirror_normalize(img, mirror=inp["flip"], mean=mean, std=std,
                                           dtype=_DTYPES[spec.dtype], output_layout=spec.layout)
            out_names.append("image")
            return img, index
        img = fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.RGB,
                                adjust_orientation=False)
        if spec.kind == "image-eval":
            img = fn.resize(img, resize_shorter=spec.image_size / spec.eval_crop_ratio, antialias=True)
            img = fn.crop_mirror_normalize(img, crop=(spec.image_size, spec.image_size), mean=mean, std=std,
                                           dtype=_DTYPES[spec.dtype], output_layout=spec.layout)
            out_names.append("image")
            return img, index
        result = spec.kind(img, decoder_device)
        if not isinstance(result, dict):
            result = {"image": result}
        out_names.extend(result)
        return (index, *result.values())

    pipe = graph()
    pipe.build()
    pipe.fastio_outputs = (("image", "index") if spec.kind in ("image-train", "image-eval")
                           else ("index", *out_names))
    return pipe
