""":class:`ImageText`: packed sequences of image-text conversations (``fastio convert --image-field``) for
vision-language training: the tokens with each image token expanded, their loss mask, and the batch's images
decoded and augmented by the ``image=`` object's DALI graph. Its unit is a packed sequence (as
:class:`fastio.Tokens`'s); its plan and reader are :mod:`fastio.tokens.image_text`'s."""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fastio.errors import DatasetError
from fastio.pipelines.base import Delivery, GraphDef, Pipeline, Placement, ReadFields, Source, evaluation_of
from fastio.pipelines.image import ImageEval, ImageTrain, decodable
from fastio.pipelines.tokens import check_entry
from fastio.read.reader import ReadBatch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import SamplerSpec
    from fastio.read.protocol import ReadSet
    from fastio.tokens.image_text import ImageTextBatch

__all__ = ["ImageText"]

K_IMAGE_TEXT = "image_text"
"""The Loader state's entry of an :class:`ImageText` pipeline."""
STATE_VERSION = 1
"""The version of that entry (the packing's rule and the draw keys): a state of another version is refused."""
_ARRAYS = ("tokens", "loss_mask", "position_ids", "cu_seqlens", "segment_ids", "image_rows", "image_starts")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ImageText(Pipeline):
    """Packed image-text sequences (docs/image-text.md): ``batch["tokens"]`` int64 [B, seq_len + 1] (each image token
    repeated ``image_seq_len`` times: the image's run), ``batch["loss_mask"]`` bool like it (the trained tokens of the
    conversation: never an image token, never padding), ``position_ids``, ``cu_seqlens``, ``segment_ids`` and
    ``max_seqlen`` as :class:`fastio.Tokens` gives them (a segment per sample, padding one), ``batch["images"]``
    [M, 3, size, size] (or [M, size, size, 3]: the ``image`` object's dtype, layout and normalisation; on the
    Loader's device) in the order of their runs, ``batch["image_rows"]`` and ``batch["image_starts"]`` int64 [M] (the
    row of each image's run and the position of its first token there), ``batch["index"]`` the sequence ids.

    Samples are packed whole by best-fit (the order, blocks and resume of ``fastio.Tokens(packing="best-fit")``),
    each counting ``len(tokens) - images + images * image_seq_len`` tokens; padding holds id 0. Each image is
    decoded and augmented by the ``image`` object's graph with random parameters drawn from (seed, epoch, draw key),
    an image's draw key being ``(sample << 16) | image number`` (the sample's global index in its dataset).

    ``fastio.Loader(DEST, pipeline=fastio.ImageText(image=fastio.ImageTrain(size=336), seq_len=4096,
    image_seq_len=576), batch_size=4)``.
    """

    kind: ClassVar[str] = "image-text"
    default_fields: ClassVar[str] = "none"
    image: ImageTrain | ImageEval = ImageTrain(size=336)
    """What decodes and augments each image (:class:`fastio.ImageTrain` or :class:`fastio.ImageEval`, any size,
    dtype, layout, mean and std; its ``fields`` and ``text`` are not used)."""
    seq_len: int = 4096
    """Tokens of input per sequence (each holds ``seq_len + 1``); a sample longer than ``seq_len + 1`` with its images
    expanded is refused when the Loader is made."""
    image_seq_len: int = 576
    """Tokens an image stands for (its image token is repeated this many times): the vision encoder's output length."""
    packing: str = "best-fit"
    """``best-fit`` (the only packing: a sample is never cut)."""
    max_images: int | None = None
    """Images a sequence holds at most (the packer closes a sequence for images as for tokens), so that ``M`` is at
    most ``batch_size * max_images``; a sample with more is refused. None: as many as fit, at most
    ``(seq_len + 1) // image_seq_len`` a sequence."""
    window: int = 4096
    """Samples per block of the packing (the order shuffles blocks of this many consecutive samples of a shard;
    best-fit packs each block on its own)."""

    def __post_init__(self):
        if not isinstance(self.image, (ImageTrain, ImageEval)):
            raise ValueError(f"image must be a fastio.ImageTrain or fastio.ImageEval, got {self.image!r}")
        for name in ("seq_len", "image_seq_len", "window"):
            _positive(name, getattr(self, name))
        if self.packing != "best-fit":
            raise ValueError(f"packing must be 'best-fit' (an image-text sample is never cut), got {self.packing!r}")
        if self.max_images is not None:
            _positive("max_images", self.max_images)

    @property
    def images_per_sequence(self) -> int:
        """The most images a sequence holds: ``max_images``, else as many image runs as fit in ``seq_len + 1``."""
        return self.max_images or max(1, (self.seq_len + 1) // self.image_seq_len)

    def evaluation(self) -> ImageText:
        """This object with the ``image`` object's evaluation (no random augmentation)."""
        return dataclasses.replace(self, image=evaluation_of(self.image))

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        """Each sample's ``tokens.i32``, ``mask.bits`` and images (optional fields: a sample has 0..n); DatasetError
        naming ``ds`` when it is not an image-text dataset."""
        from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD
        from fastio.tokens.image_text import image_members, image_token_id

        image_token_id(ds)
        images = image_members(ds)
        return ReadFields((TOKENS_FIELD, MASK_FIELD, *images), optional=images)

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The dataset's samples packed, the order of the sequences on ``place``'s rank and an
        :class:`~fastio.tokens.image_text.ImageTextReader` reading them through the read set's stored-sample reader."""
        from fastio.tokens.image_text import ImageTextReader, ImageTextSource, image_text_packing
        from fastio.tokens.loading import TokenUnits

        if read_set.mixture is not None:
            raise DatasetError(f"{read_set.root}: fastio.ImageText reads one image-text dataset; a fastio.Mixture "
                               "of image-text and token datasets is not supported yet")
        ds, reader = read_set.target, read_set.sources[0].reader
        packing = image_text_packing(ds, self.seq_len, self.image_seq_len, self.max_images, self.window, sampling)
        units = TokenUnits.of(packing, sampling, place.world_size, place.rank)
        return Source(units, ImageTextReader(ImageTextSource(ds, packing, reader), self.image_seq_len, decodable),
                      self)

    def graph(self) -> GraphDef:
        """The ``image`` object's graph, fed each batch's images (one placeholder image where a batch has none:
        DALI takes no empty batch), built for ``batch_size * images_per_sequence`` images."""
        return dataclasses.replace(self.image.graph(), feed=self._feed, problem=_no_problem,
                                   per_unit=self.images_per_sequence, fed_index=_fed_index)

    def _feed(self, batch: ImageTextBatch, *, seed: int, epoch: int) -> tuple:
        return self.image.inputs(_image_batch(batch), seed=seed, epoch=epoch)

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        import torch

        read = delivery.read
        batch = {name: torch.from_numpy(read.arrays[name]) for name in _ARRAYS}
        batch["max_seqlen"] = int(read.arrays["max_seqlen"])
        batch["images"] = outputs["image"][:read.image_count]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {K_IMAGE_TEXT: {"version": STATE_VERSION, "seq_len": self.seq_len, "image_seq_len": self.image_seq_len,
                               "packing": self.packing, "max_images": self.max_images, "window": self.window}}

    def check_state(self, state: dict[str, Any]) -> None:
        check_entry(state, K_IMAGE_TEXT, self.state_dict()[K_IMAGE_TEXT], "packed image-text sequences", "ImageText")


_PLACEHOLDER: list[np.ndarray] = []


def _placeholder() -> np.ndarray:
    """A 1 x 1 black PNG: what a batch without images feeds the graph (its output is dropped)."""
    if not _PLACEHOLDER:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (1, 1)).save(buf, "PNG")
        _PLACEHOLDER.append(np.frombuffer(buf.getvalue(), np.uint8))
    return _PLACEHOLDER[0]


def _image_batch(batch: ImageTextBatch) -> ReadBatch:
    """The batch's images as the image kinds' feed reads them (``image``, ``sizes``, draw keys as ``indices``);
    the placeholder alone, index -1, for a batch without images."""
    if not batch.image_count:
        return ReadBatch(np.array([-1], np.int64), {}, np.ones((1, 2), np.int64), [_placeholder()])
    return ReadBatch(batch.keys, {}, batch.sizes, list(batch.images))


def _fed_index(batch: ImageTextBatch) -> np.ndarray:
    """What the graph's ``index`` output holds for ``batch``: its images' draw keys (-1: the placeholder)."""
    return batch.keys if batch.image_count else np.array([-1], np.int64)


def _no_problem(batch: Any, j: int) -> None:
    """No stored sample's image field to name (the batch's keys name its sequences)."""
    return None
