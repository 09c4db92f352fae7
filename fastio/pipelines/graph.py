""":class:`Graph`: a user's DALI graph on the decoded image, ``f(image, device) -> DataNode | dict[str, DataNode]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fastio.pipelines.base import check_fields
from fastio.pipelines.image import ImageKind

__all__ = ["Graph"]


@dataclass(frozen=True)
class Graph(ImageKind):
    """A DALI graph of your own: ``fn(image, device)`` gets each sample's decoded HWC RGB uint8 image (``device``
    is ``"cpu"`` or ``"mixed"``) and returns a node (``batch["image"]``) or a dict of nodes (one batch entry
    each). ``Loader(dest, pipeline=my_graph)`` is the same as ``pipeline=fastio.Graph(my_graph)``.
    """

    output_names: ClassVar[tuple[str, ...] | None] = None  # the graph function names them
    fn: Callable[..., Any] = None
    """The graph function."""
    fields: tuple[str, ...] | None = None
    """Fields delivered besides the outputs (default: the label field, as ``batch["label"]``)."""

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"Graph needs a callable fn(image, device), got {self.fn!r}")
        object.__setattr__(self, "fields", check_fields(self.fields))

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> dict[str, Any]:
        from nvidia.dali import fn, types

        img = fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.RGB, adjust_orientation=False)
        result = self.fn(img, decoder_device)
        outputs = result if isinstance(result, dict) else {"image": result}
        added = ("index", "source", "padded", "label", *(self.fields or ()))
        clash = next((name for name in outputs if name in added), None)
        if clash is not None:  # the Loader's entry would replace it (index: the one it checks) without a word
            raise ValueError(f"fastio.Graph({getattr(self.fn, '__name__', 'fn')}): the graph's output {clash!r} is an "
                             f"entry the Loader adds to the batch ({', '.join(added)}): name it otherwise")
        return {"index": inp["index"], **outputs}
