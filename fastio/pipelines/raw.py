""":class:`Raw`: the read bytes themselves, no DALI graph (DALI would only copy them in and out again)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fastio.pipelines.base import Delivery, Pipeline, ReadFields, check_fields, refuse_tokens

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset

__all__ = ["Raw"]


@dataclass(frozen=True)
class Raw(Pipeline):
    """Each field's bytes as a list per batch (``batch["jpg"][j]``), the label as ``batch["label"]`` (int64)
    where labels are delivered, ``batch["has"][field]`` (a bool tensor [B]: which samples have the field).

    ``fastio.Raw()`` (every field), ``fastio.Raw(fields=["txt"])``.
    """

    kind: ClassVar[str] = "raw"
    default_fields: ClassVar[str] = "shared"
    fields: tuple[str, ...] | None = None
    """Fields delivered (default: every field; of a mixture, those every source has, and the label when every
    source has a label field). Every field but the label field is optional: a sample that lacks one gets
    empty bytes, and ``batch["has"][field]`` says which samples have it."""

    def __post_init__(self):
        object.__setattr__(self, "fields", check_fields(self.fields))

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        refuse_tokens(ds, self.kind)
        ds.require_fields(list(fields))
        return ReadFields(tuple(fields), optional=tuple(f for f in fields if f != ds.label_field))

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        import torch

        read = delivery.read
        batch: dict[str, Any] = {f: [b.tobytes() for b in read.fields[f]] for f in delivery.columns}
        if delivery.labels is not None:
            batch["label"] = delivery.labels()
        batch["has"] = {f: torch.from_numpy(read.present[f].copy()) for f in delivery.columns}
        return batch
