""":class:`Graph`: a user's DALI graph on the decoded image, ``f(image, device) -> DataNode | dict[str, DataNode]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastio.pipelines.base import BuiltPipeline, Pipeline, check_fields, run_graph

__all__ = ["Graph"]


@dataclass(frozen=True)
class Graph(Pipeline):
    """A DALI graph of your own: ``fn(image, device)`` gets each sample's decoded HWC RGB uint8 image (``device``
    is ``"cpu"`` or ``"mixed"``) and returns a node (``batch["image"]``) or a dict of nodes (one batch entry
    each). ``Loader(dest, pipeline=my_graph)`` is the same as ``pipeline=fastio.Graph(my_graph)``.
    """

    fn: Callable[..., Any] = None
    """The graph function."""
    fields: tuple[str, ...] | None = None
    """Fields delivered besides the outputs (default: the label field, as ``batch["label"]``)."""

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"Graph needs a callable fn(image, device), got {self.fn!r}")
        object.__setattr__(self, "fields", check_fields(self.fields))

    def build(self, source, *, batch_size: int, num_threads: int, device: str, device_id: int | None,
              prefetch: int, seed: int = 0) -> BuiltPipeline:
        names: list[str] = []

        def body(inp: dict[str, Any], decoder_device: str) -> tuple:
            from nvidia.dali import fn, types

            img = fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.RGB,
                                    adjust_orientation=False)
            result = self.fn(img, decoder_device)
            if not isinstance(result, dict):
                result = {"image": result}
            names.extend(result)
            return (inp["index"], *result.values())

        pipe = run_graph(body, self.input_names(), source, batch_size=batch_size, num_threads=num_threads,
                         device=device, device_id=device_id, prefetch=prefetch, seed=seed)
        return BuiltPipeline(pipe, ("index", *names))
