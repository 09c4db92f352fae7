"""What every pipeline object is: the interface between the Loader and one kind of data.

A pipeline object (:class:`fastio.ImageTrain`, :class:`fastio.ImageEval`, :class:`fastio.Raw`,
:class:`fastio.Graph`) is a frozen, validated set of options. To the Loader it answers these questions,
and nothing else of a kind's is known to the Loader:

- which fields it reads (:meth:`Pipeline.choose_fields` over the read set's datasets, :meth:`Pipeline.read_fields`
  for one dataset);
- what its DALI graph is (:meth:`Pipeline.build`, None for no graph) and what the graph's external source
  returns for one read batch (:meth:`Pipeline.inputs`);
- how a batch is assembled from the graph's outputs and the read fields (:meth:`Pipeline.assemble`);
- which order of units it reads and what reads them (:meth:`Pipeline.unit_plan`, :meth:`Pipeline.reader`: the
  read set's order and reader of stored samples, unless a kind's unit is something else);
- what it adds to the Loader's state (:meth:`Pipeline.state_dict`, :meth:`Pipeline.check_state`).

``docs/adding-a-kind.md`` describes how a new kind is added.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fastio.errors import DatasetError
from fastio.formats.images import is_image_field
from fastio.formats.media import is_audio_field, is_video_field

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset
    from fastio.read.reader import ReadBatch

__all__ = ["BuiltPipeline", "Delivery", "FieldChoice", "Pipeline", "ReadFields", "check_fields", "dali_reason", "decodable",
           "field_value", "run_graph"]


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


@dataclass(frozen=True)
class FieldChoice:
    """The fields a pipeline delivers from a read set: ``others`` (the same names in every dataset) and, when
    ``label`` is set, each dataset's own label field as ``batch["label"]`` (``asked``: what a dataset without
    one is said to lack)."""

    others: tuple[str, ...]
    label: bool
    asked: str | None = None


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


@dataclass(frozen=True)
class Delivery:
    """One read batch as a pipeline's :meth:`Pipeline.assemble` gets it from the Loader."""

    read: ReadBatch
    columns: tuple[str, ...]
    """The read fields delivered under their own names, in order (the label field among them when every
    dataset of the read set names it alike)."""
    label_column: str | None
    """Which of ``columns`` holds the labels (delivered as ``batch["label"]``), if one does."""
    labels: Callable[[], Any] | None
    """The batch's labels as an int64 tensor on the Loader's device (each dataset's own label field), or None
    when labels are not delivered."""


def check_fields(fields: Any) -> tuple[str, ...] | None:
    """``fields`` as a tuple of field names (None stays None); ValueError naming a bad value."""
    if fields is None:
        return None
    if isinstance(fields, str) or not all(isinstance(f, str) and f for f in fields):
        raise ValueError(f"fields must be a sequence of field names, got {fields!r}")
    return tuple(fields)


def _no_image_way_out(fields: Sequence[str]) -> str:
    """What to read a dataset without an image field with: the clip kind of its first video or audio field, else
    ``Raw``."""
    video = [f for f in fields if is_video_field(f)]
    audio = [f for f in fields if is_audio_field(f)]
    if video or audio:
        kind = "VideoClips" if video else "AudioClips"
        return f"it holds {(video or audio)[0]}: read it with fastio.{kind} (docs/media.md)"
    return "use pipeline='raw'"


class Pipeline:
    """The base of pipeline objects (see the module docstring). Subclasses are frozen dataclasses whose
    fields are their options; each checks them when made (``ValueError`` naming the value)."""

    kind: ClassVar[str] = "graph"
    """How messages name the kind (``image-train``, ``raw``, ...)."""
    decodes: ClassVar[bool] = True
    """Whether it reads an image field of every sample and decodes it in a DALI graph."""
    needs_image_size: ClassVar[bool] = False
    """Whether :meth:`inputs` needs each image's (width, height) (``ReadBatch.sizes``)."""
    fields: tuple[str, ...] | None = None

    def evaluation(self) -> Pipeline:
        """The pipeline that evaluates what this one trains on (``FastioDataModule``'s validation Loader): the same
        options without random augmentation; this object itself where it has none to leave out."""
        return self

    # -- fields -------------------------------------------------------------------------------------

    def choose_fields(self, label_fields: Sequence[str | None], shared: Sequence[str]) -> FieldChoice:
        """Which fields to deliver from datasets whose label fields are ``label_fields`` and which all have
        ``shared``: ``fields`` when given (each dataset's label when it names one of them); else the label."""
        if self.fields is not None:
            named = [f for f in self.fields if f in label_fields]
            others = [f for f in self.fields if not named or f not in label_fields]
            return FieldChoice(tuple(others), bool(named), named[0] if named else None)
        return FieldChoice((), any(label_fields), next((f for f in label_fields if f), None))

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields | None:
        """What to read of ``ds`` to deliver ``fields`` (DatasetError naming what it lacks); None for a kind
        that reads no stored sample (its :meth:`reader` reads the shards)."""
        self.refuse_tokens(ds)
        if ds.image_field is None:
            raise DatasetError(f"{ds.root}: dataset has no image field; {_no_image_way_out(ds.fields)}")
        # A sample's image is the first of the image fields it has: the main one, then the others (a dataset
        # may mix formats; DALI decodes by content). Image fields are optional in a sample for that reason.
        others = ds.manifest.image_fields or [f for f in ds.fields if is_image_field(f)]
        image = (ds.image_field, *[f for f in others if f != ds.image_field])
        ds.require_fields(list(fields), in_every_sample=True)
        return ReadFields(tuple(f for f in fields if f != ds.image_field), image, self.needs_image_size, image,
                          decodable)

    def refuse_tokens(self, ds: Dataset) -> None:
        """DatasetError naming ``ds`` and this kind when ``ds`` is a token dataset (its shards hold no samples)."""
        if ds.manifest.tokens is not None:
            raise DatasetError(f"{ds.root}: a token dataset (Megatron .bin/.idx shards), and pipeline {self.kind!r} "
                               "reads stored samples: read it with fastio.Tokens(seq_len=...) (docs/tokens.md)")

    def for_device(self, read_set: Any, device: str) -> Pipeline:
        """This pipeline as a Loader on ``device`` runs it (a choice it leaves to the device made: ``VideoClips``'
        ``cpu_fallback="auto"``), after :meth:`check_device`."""
        self.check_device(read_set, device)
        return self

    def check_device(self, read_set: Any, device: str) -> None:
        """DatasetError naming a dataset of ``read_set`` that cannot be decoded on ``device`` (``cpu`` or
        ``cuda``), asked when the Loader is made; every kind decodes everything on both, but :class:`VideoClips`."""

    # -- the graph ----------------------------------------------------------------------------------

    def input_names(self) -> tuple[str, ...]:
        """What the external source returns for one batch (:meth:`inputs`), in order."""
        return ("encoded", "index")

    def inputs(self, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
        """The external source's return value for one read batch, in :meth:`input_names` order: the encoded
        images as a list (one array per sample; DALI decodes by content), the rest whole-batch arrays."""
        return batch.image, np.ascontiguousarray(batch.indices, dtype=np.int64)

    def build(self, source: Callable, *, batch_size: int, num_threads: int, device: str, device_id: int | None,
              prefetch: int, seed: int = 0) -> BuiltPipeline | None:
        """The DALI pipeline fed by ``source`` (returning :meth:`inputs`; called across epochs for as long as
        the pipeline runs, and keeping what it returned alive until that batch's outputs come back), or None
        for a kind without a graph. Its outputs include ``"index"``: the fed indices, checked by the Loader."""
        raise NotImplementedError

    # -- the batch ----------------------------------------------------------------------------------

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        """The batch (without ``index``, ``source`` and ``padded``, which the Loader adds) from the graph's
        outputs as torch values (``index`` taken out) and the read fields: numeric text fields become int64
        or float64 tensors, others stay lists of bytes; the label column is ``batch["label"]``."""
        batch = dict(outputs)
        for f in delivery.columns:
            if f == delivery.label_column:
                batch["label"] = delivery.labels()
            else:
                batch[f] = field_value([b.tobytes() for b in delivery.read.fields[f]])
        if delivery.labels is not None and delivery.label_column is None:
            batch["label"] = delivery.labels()
        return batch

    def decode_problem(self, batch: ReadBatch, j: int) -> str | None:
        """Why sample ``j`` of ``batch`` cannot be decoded, or None: asked after the graph failed on a batch,
        to name the sample. Images: whatever PIL raises opening ``batch.image[j]``."""
        from PIL import Image

        try:
            with Image.open(io.BytesIO(batch.image[j].tobytes())) as img:
                img.load()
        except Exception as bad:  # whatever PIL raises, the image is undecodable
            return f"{type(bad).__name__}: {str(bad)[:80]}"
        return None

    # -- order and state ----------------------------------------------------------------------------

    def unit_plan(self, read_set: Any, sampling: Any, world_size: int, rank: int) -> Any:
        """The order of the units this kind delivers, sliced for ``rank`` (an object with ``len()`` and
        ``plan(epoch, start)`` like :class:`fastio.order.sampler.Sampler`): the read set's order of stored samples.
        A kind whose unit is not a stored sample (a packed token sequence) returns its own plan here."""
        return read_set.sampler(sampling, world_size, rank)

    def reader(self, read_set: Any) -> Any:
        """What reads the units of :meth:`unit_plan` (``submit(ids) -> Future[ReadBatch]``,
        ``read_ahead_shards(batches)``, ``close()``): the read set's reader of stored samples. A kind whose unit is
        not a stored sample returns a reader of its units here (it is closed with the read set's)."""
        return read_set.reader

    def state_dict(self) -> dict[str, Any]:
        """Entries this kind adds to the Loader's ``state_dict()`` (none for the built-in kinds)."""
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """LoaderStateError when ``state`` (a whole Loader state) cannot continue with this pipeline."""


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


def run_graph(body: Callable[[dict[str, Any], str], tuple], names: tuple[str, ...], source: Callable, *,
              batch_size: int, num_threads: int, device: str, device_id: int | None, prefetch: int,
              seed: int, conditionals: bool = False) -> Any:
    """A built DALI pipeline: ``names`` from ``source`` through one batch-mode external source (fastio's
    order, not DALI's; each input's dtype by its name, a numbered ``start0``, ``start1`` as ``start``, ``decode0``
    as ``decode``), then ``body(inputs, decoder_device)`` (``"mixed"`` on cuda, else ``"cpu"``); with
    ``conditionals``, ``body`` may branch per sample with ``if`` on a boolean input (DALI's ``enable_conditionals``)."""
    from nvidia.dali import fn, pipeline_def, types

    dtypes = {"encoded": types.UINT8, "index": types.INT64, "anchor": types.FLOAT, "shape": types.FLOAT,
              "flip": types.INT32, "start": types.INT32, "decode": types.INT32, "roi_start": types.FLOAT,
              "roi_end": types.FLOAT, "still": types.BOOL, "fallback": types.BOOL, "window_start": types.INT32,
              "window_length": types.INT32, "offset": types.INT32, "rate": types.FLOAT, "turned": types.BOOL,
              "transpose": types.BOOL, "turn_h": types.INT32, "turn_v": types.INT32}
    decoder_device = "mixed" if device == "cuda" else "cpu"

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  prefetch_queue_depth=prefetch, seed=seed, enable_conditionals=conditionals)
    def graph():
        # no_copy: DALI reads the arrays the source returns in place; the source keeps them until the
        # batch's outputs are returned (fastio.read.feeder.Feeder does), which is what DALI requires.
        nodes = fn.external_source(source=source, num_outputs=len(names), batch=True, no_copy=True,
                                   dtype=[dtypes.get(n.rstrip("0123456789"), types.UINT8) for n in names])
        return body(dict(zip(names, nodes)), decoder_device)

    pipe = graph()
    pipe.build()
    return pipe


_DALI_OPERATOR = re.compile(r"Error in \w+ operator `(?:nvidia\.dali\.)?([\w.]+)`")


def dali_reason(err: BaseException) -> str:
    """One line of what a DALI pipeline error says, for a message naming the batch: the operator and the
    first line after DALI's ``encountered:`` (``fn.decoders.video: Failed to create video decoder ...``; without
    an ``Assert on "..." failed:`` prefix), not its ``Critical error in pipeline:`` header; else the first line."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    lines = [line.strip() for line in text.splitlines()]
    op = _DALI_OPERATOR.search(text)
    after = lines[lines.index("encountered:") + 1:] if "encountered:" in lines else []
    said = next((line for line in after if line and not line.startswith("C++ context")), None)
    if said is None:
        return next(line for line in lines if line)[:160]
    said = re.sub(r'^Assert on ".*?" failed: ', "", re.sub(r"^Error in thread \d+: (\[[^\]]*\] )?", "", said))
    return f"{op.group(1) + ': ' if op else ''}{said}"[:200]


def field_value(values: list[bytes]):
    """Numeric text fields become an int64 or float64 tensor; anything else stays a list of bytes."""
    import torch

    try:
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    except ValueError:
        pass
    try:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    except ValueError:
        return values
