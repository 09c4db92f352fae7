"""What a pipeline object and the read set say to each other, typed: the field choice, what is read of one dataset,
a batch as delivered, where a Loader runs, a kind's source (its unit plan and reader, together), and the read set
as a kind sees it (:class:`ReadSet`).

These types live here, below :mod:`fastio.pipelines`: the pipelines import them, the read set never imports a
pipeline (it asks a kind only what :class:`Reads` names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from fastio.errors import LoaderArgumentError

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import EpochPlan, SamplerSpec
    from fastio.read.mixture import Mixture
    from fastio.read.reader import ReadBatch

__all__ = ["DEFAULT_FIELDS", "DatasetSource", "Delivery", "FieldChoice", "Placement", "ReadFields", "ReadSet", "Reads",
           "Source", "UnitPlan", "UnitReader", "read_fields_of"]

DEFAULT_FIELDS = ("label", "shared", "none")
"""What a kind delivers when its ``fields`` is None: the label, every field the datasets share, or nothing."""


@dataclass(frozen=True)
class FieldChoice:
    """The fields a pipeline delivers from a read set: ``others`` (the same names in every dataset) and, when
    ``label`` is set, each dataset's own label field as ``batch["label"]`` (``asked``: what a dataset without
    one is said to lack)."""

    others: tuple[str, ...]
    label: bool
    asked: str | None = None

    @classmethod
    def of(cls, fields: Sequence[str] | None, default: str, label_fields: Sequence[str | None],
           shared: Sequence[str]) -> FieldChoice:
        """The choice of a kind asking for ``fields`` (None: its ``default``, one of :data:`DEFAULT_FIELDS`) from
        datasets whose label fields are ``label_fields`` and which all have ``shared``: the fields named (each
        dataset's label when one of them is a label field); else the label, every shared field (the label apart
        when every dataset has one), or nothing."""
        first_label = next((f for f in label_fields if f), None)
        if fields is not None:
            named = [f for f in fields if f in label_fields]
            others = [f for f in fields if not named or f not in label_fields]
            return cls(tuple(others), bool(named), named[0] if named else None)
        if default == "shared":
            label = all(label_fields)
            return cls(tuple(f for f in shared if not label or f not in label_fields), label, first_label)
        if default == "none":
            return cls((), False)
        return cls((), any(label_fields), first_label)


@dataclass(frozen=True)
class ReadFields:
    """What to read of one dataset (the arguments of :class:`fastio.read.reader.Reader`)."""

    fields: tuple[str, ...]
    """Fields read besides the image."""
    image: tuple[str, ...] = ()
    """Image fields in order of preference (a sample's image is the first it has); empty: no image read."""
    sizes: bool = False
    """Whether each image's (width, height) is parsed from its header (``ReadBatch.sizes``)."""
    optional: tuple[str, ...] = ()
    """Fields a sample may lack (read as empty bytes)."""
    transcode: Callable[[np.ndarray], np.ndarray] | None = None
    """Applied to each image's bytes in the reader thread."""
    per_unit: int = 1
    """Stored samples one of the kind's units (a row of its batch) reads at most: 1 where the unit is a stored
    sample, the conversations a packed sequence can hold for :class:`fastio.ImageText`. An ``s3://`` dataset's
    cache is sized for ``batch_size * per_unit`` stored samples a batch (:mod:`fastio.read.working_set`)."""


@dataclass(frozen=True)
class Delivery:
    """One read batch as a pipeline's ``assemble`` gets it from the Loader."""

    read: ReadBatch
    columns: tuple[str, ...]
    """The read fields delivered under their own names, in order (the label field among them when every
    dataset of the read set names it alike)."""
    label_column: str | None
    """Which of ``columns`` holds the labels (delivered as ``batch["label"]``), if one does."""
    labels: Callable[[], Any] | None
    """The batch's labels as an int64 tensor on the Loader's device (each dataset's own label field), or None
    when labels are not delivered."""


@dataclass(frozen=True)
class Placement:
    """Where a Loader runs: this rank of ``world_size``, decoding on ``device`` (``cpu`` or ``cuda``)."""

    rank: int
    world_size: int
    device: str


class UnitPlan(Protocol):
    """The order of a kind's units, sliced for one rank (:class:`fastio.order.sampler.Sampler` for stored samples)."""

    samples: int
    """Units of an epoch."""

    def __len__(self) -> int: ...

    def plan(self, epoch: int, start: int = 0) -> EpochPlan: ...


class UnitReader(Protocol):
    """What reads a batch of units by id (:class:`fastio.read.reader.Reader` for stored samples)."""

    def submit(self, ids: np.ndarray) -> Future: ...

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None: ...

    def close(self) -> None: ...


K = TypeVar("K")


@dataclass(frozen=True)
class Source(Generic[K]):
    """A kind's units on one rank: their order (``plan``) and what reads them (``reader``), made together so that
    whatever the plan decided (a token packing) reaches the reader without a side table; ``pipeline``: the
    pipeline object as it runs there (a device may settle one of its options), whose graph and batch the Loader
    uses. A reader that is not the read set's own is closed with the Loader."""

    plan: UnitPlan
    reader: UnitReader
    pipeline: K
    unit: str = "sample"
    """What the Loader's messages call one of the plan's units (a batch's row): ``sample``, or a kind's own
    (``packed sequence``), counted through :func:`fastio.words.count`."""


class DatasetSource(Protocol):
    """One dataset of a read set: its ``reader`` (None where the kind reads no stored sample) and ``files`` (an
    ``s3://`` dataset's shard source, else None: files read in place)."""

    dataset: Dataset
    reader: UnitReader | None
    files: Any


class ReadSet(Protocol):
    """The read set as a kind sees it (:mod:`fastio.read.readset`): one dataset or a mixture, alike."""

    target: Dataset | Mixture
    mixture: Mixture | None
    sources: Sequence[DatasetSource]
    reader: UnitReader
    """Reads stored samples by read-set id (None where the kind reads none)."""
    reader_threads: int

    def sampler(self, spec: SamplerSpec, world_size: int, rank: int) -> UnitPlan: ...

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def where(self, i: int) -> str: ...

    def in_units(self, sizes: Sequence[int]) -> None: ...


class Reads(Protocol):
    """What the read set asks of a kind: the fields it asks for (``fields``, else its ``default_fields``) and what
    to read of each dataset (None: no stored sample; its source reads the shards)."""

    fields: tuple[str, ...] | None
    default_fields: ClassVar[str]
    shuffles: ClassVar[tuple[str, ...]]
    """The ``shuffle`` modes it reads (what a cache refusal may suggest)."""
    unit: ClassVar[str]
    """What its ``batch_size`` counts (how a cache refusal names a batch)."""

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields | None: ...


def read_fields_of(pipeline: Reads, ds: Dataset, fields: Sequence[str]) -> ReadFields | None:
    """``pipeline.read_fields(ds, fields)``, once it is None or a :class:`ReadFields` whose fields are field names
    (LoaderArgumentError naming the kind and what it returned: ``image=(ds.image_field,)`` of a dataset without
    one holds None)."""
    wanted = pipeline.read_fields(ds, fields)
    name = f"{type(pipeline).__name__}.read_fields"
    if wanted is not None and not isinstance(wanted, ReadFields):
        raise LoaderArgumentError(f"{name} returned a {type(wanted).__name__} {wanted!r:.80}, not a ReadFields or "
                                  "None")
    for part in ("fields", "image", "optional"):
        names = getattr(wanted, part, ())
        if isinstance(names, str) or not all(isinstance(f, str) and f for f in names):
            raise LoaderArgumentError(f"{name} returned a ReadFields whose {part} holds "
                                      f"{next((f for f in names if not isinstance(f, str) or not f), names)!r}, not "
                                      f"a field name: {names!r:.80} (for {ds.root})")
    per_unit = getattr(wanted, "per_unit", 1)
    if isinstance(per_unit, bool) or not isinstance(per_unit, int) or per_unit < 1:
        raise LoaderArgumentError(f"{name} returned a ReadFields whose per_unit is {per_unit!r}, not a whole number "
                                  f">= 1 (the stored samples one unit reads at most; for {ds.root})")
    return wanted
