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

    kind: ClassVar[str] = "graph"
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
        from nvidia.dali.data_node import DataNode

        img = fn.decoders.image(inp["encoded"], device=decoder_device, output_type=types.RGB, adjust_orientation=False)
        result = self.fn(img, decoder_device)
        outputs = result if isinstance(result, dict) else {"image": result}
        if not all(isinstance(k, str) and isinstance(v, DataNode) for k, v in outputs.items()):
            raise ValueError(f"fastio.Graph({self._name()}): the graph function returned {_short(result)}, not a DALI "
                             "node or a dict of them by name")
        added = ("index", "source", "padded", "label", *(self.fields or ()))
        clash = next((name for name in outputs if name in added), None)
        if clash is not None:  # the Loader's entry would replace it (index: the one it checks) without a word
            raise ValueError(f"fastio.Graph({self._name()}): the graph's output {clash!r} is an "
                             f"entry the Loader adds to the batch ({', '.join(added)}): name it otherwise")
        return {"index": inp["index"], **outputs}

    def _name(self) -> str:
        return getattr(self.fn, "__name__", "fn")


def _short(value: Any) -> str:
    """``value`` for a message, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
