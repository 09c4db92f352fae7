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

from fastio.pipelines.base import (
    K_IMAGE_TEXT,
    PACKED_UNIT,
    Delivery,
    GraphDef,
    Pipeline,
    Placement,
    ReadFields,
    Source,
    evaluation_of,
)
from fastio.pipelines.image import ImageEval, ImageTrain, decodable, image_problem
from fastio.pipelines.tokens import K_PACKING_VERSION, check_entry
from fastio.read.reader import ReadBatch
from fastio.tokens.packing import PACKING_VERSION

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import SamplerSpec
    from fastio.read.protocol import ReadSet
    from fastio.tokens.image_text import ImageTextBatch
    from fastio.tokens.packing import BestFitPacking

__all__ = ["ImageText"]

STATE_VERSION = 1
"""The version of that entry (its draw keys; the packing's rules are its ``packing_version``,
:data:`fastio.tokens.packing.PACKING_VERSION`): a state of another version is refused."""
_ARRAYS = ("tokens", "loss_mask", "position_ids", "cu_seqlens", "segment_ids", "image_rows", "image_starts")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ImageText(Pipeline):
    """Packed image-text sequences (docs/image-text.md): ``batch["tokens"]`` int64 [B, seq_len + 1] (each image token
    repeated ``image_seq_len`` times: the image's run), ``batch["loss_mask"]`` bool like it (the trained tokens of the
    conversation: never an image token, a sample's first token or padding), ``position_ids``, ``cu_seqlens``,
    ``segment_ids`` and ``max_seqlen`` as :class:`fastio.Tokens` gives them (a segment per sample, padding one),
    ``batch["images"]`` [M, 3, size, size] (or [M, size, size, 3]: the ``image`` object's dtype, layout and
    normalisation; on the Loader's device) in the order of their runs, ``batch["image_rows"]`` and
    ``batch["image_starts"]`` int64 [M] (the row of each image's run and the position of its first token there),
    ``batch["index"]`` the sequence ids.

    Samples are packed whole by best-fit (the order, blocks and resume of ``fastio.Tokens(packing="best-fit")``),
    each counting ``len(tokens) - images + images * image_seq_len`` tokens; padding holds id 0. Each image is
    decoded and augmented by the ``image`` object's graph with random parameters drawn from (seed, epoch, draw key),
    an image's draw key being ``(sample << 16) | image number`` (the sample's global index in its dataset).

    ``fastio.Loader(DEST, pipeline=fastio.ImageText(image=fastio.ImageTrain(size=336), seq_len=4096,
    image_seq_len=576), batch_size=4)``, or a ``fastio.Mixture`` of image-text datasets with chat and plain token
    datasets in place of DEST (each source packed on its own; a token row holds no image; in a mixture the draw
    key counts the sample among all image-text sources' samples, in source order).
    """

    kind: ClassVar[str] = "image-text"
    default_fields: ClassVar[str] = "none"
    shuffles: ClassVar[tuple[str, ...]] = ("global", "none")
    unit: ClassVar[str] = PACKED_UNIT
    whole_batch: ClassVar[tuple[str, ...]] = ("cu_seqlens", "image_rows", "image_starts", "images")
    image: ImageTrain | ImageEval = ImageTrain(size=336)
    """What decodes and augments each image (:class:`fastio.ImageTrain` or :class:`fastio.ImageEval`, any size,
    dtype, layout, mean and std; one given ``fields`` or ``text`` is refused: they are not used)."""
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
        for name in ("fields", "text"):
            if getattr(self.image, name) is not None:
                raise ValueError(f"image: fastio.ImageText decodes each image of a sample alone, so the image object's "
                                 f"{name}={getattr(self.image, name)!r} is not used: leave it out")
        for name in ("seq_len", "image_seq_len", "window"):
            _positive(name, getattr(self, name))
        if self.packing != "best-fit":
            raise ValueError(f"packing must be 'best-fit' (an image-text sample is never cut), got {self.packing!r}")
        if self.max_images is not None:
            _positive("max_images", self.max_images)

    @property
    def images_per_sequence(self) -> int:
        """The most images a sequence can hold: as many image runs as fit in ``seq_len + 1`` (an image costs at least
        ``image_seq_len`` tokens), or ``max_images`` where that is fewer."""
        fit = max(1, (self.seq_len + 1) // self.image_seq_len)
        return fit if self.max_images is None else min(self.max_images, fit)

    def evaluation(self) -> ImageText:
        """This object with the ``image`` object's evaluation (no random augmentation)."""
        return dataclasses.replace(self, image=evaluation_of(self.image))

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields | None:
        """Each sample's ``tokens.i32``, ``mask.bits`` and images (optional fields: a sample has 0..n), as many
        samples a sequence as it can hold (``per_unit``: :func:`~fastio.tokens.image_text.samples_per_sequence`);
        None for a token dataset (a mixture's source: its shards are read by a token reader; alone, :meth:`source`
        refuses it); DatasetError naming ``ds`` for any other dataset."""
        from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD
        from fastio.tokens.image_text import image_members, image_token_id, samples_per_sequence

        if ds.manifest.tokens is not None:
            return None
        image_token_id(ds)
        images = image_members(ds)
        per_sequence = samples_per_sequence(ds, self.seq_len, self.image_seq_len, self.window)
        return ReadFields((TOKENS_FIELD, MASK_FIELD, *images), optional=images, per_unit=per_sequence)

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The dataset's samples packed, the order of the sequences on ``place``'s rank and an
        :class:`~fastio.tokens.image_text.ImageTextReader` reading them through the read set's stored-sample reader."""
        from fastio.tokens.image_text import ImageTextReader, ImageTextSource
        from fastio.tokens.loading import TokenUnits

        if read_set.mixture is not None:
            return self._mixed(read_set, sampling, place)
        ds, reader = read_set.target, read_set.sources[0].reader
        packing = self._packing(ds, sampling)
        units = TokenUnits.of(packing, sampling, place.world_size, place.rank)
        return Source(units, ImageTextReader(ImageTextSource(ds, packing, reader), self.image_seq_len, decodable),
                      self, self.unit)

    def _packing(self, ds: Dataset, spec: SamplerSpec) -> BestFitPacking:
        """The packing of image-text dataset ``ds``'s samples (DatasetError naming it for another dataset)."""
        from fastio.tokens.image_text import image_text_packing

        return image_text_packing(ds, self.seq_len, self.image_seq_len, self.max_images, self.window, spec)

    def _pack(self, ds: Dataset, spec: SamplerSpec) -> BestFitPacking | None:
        """A mixture source's packing: an image-text dataset's; None for a token dataset (packed as fastio.Tokens
        packs it)."""
        return None if ds.manifest.tokens is not None else self._packing(ds, spec)

    def _mixed(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """A mixture of image-text and token datasets: each source packed by best-fit on its own (a token
        dataset's as ``fastio.Tokens(packing="best-fit")`` packs it: a chat dataset's conversations whole, a plain
        one's documents, every token trained), the mixture's order over their sequences, a
        :class:`~fastio.tokens.image_text.MixedReader` of them."""
        from fastio.tokens.image_text import ImageTextReader, ImageTextSource, MixedReader
        from fastio.tokens.loading import TokenReader, TokenSource, mixture_units

        sampler, packings = mixture_units(read_set, self.seq_len, "best-fit", self.window, sampling,
                                          place.world_size, place.rank, self._pack)
        readers, tokens, key_base = {}, [], 0
        for s, (src, packing) in enumerate(zip(read_set.sources, packings)):
            if src.reader is None:
                tokens.append(TokenSource(src.dataset, packing, src.files))
                continue
            readers[s] = ImageTextReader(ImageTextSource(src.dataset, packing, src.reader), self.image_seq_len,
                                         decodable, key_base)
            key_base += len(src.dataset)
        token_reader = TokenReader(tokens, read_set.reader_threads) if tokens else None
        return Source(sampler, MixedReader(readers, token_reader, [p.sequences for p in packings]), self, self.unit)

    def graph(self) -> GraphDef:
        """The ``image`` object's graph, fed each batch's images (one placeholder image where a batch has none:
        DALI takes no empty batch), built for ``batch_size * images_per_sequence`` images."""
        return dataclasses.replace(self.image.graph(), feed=self._feed, problem=_problem, where=_where,
                                   per_unit=self.images_per_sequence, fed_index=_fed_index)

    def _feed(self, batch: ImageTextBatch, *, seed: int, epoch: int) -> tuple:
        """The ``image`` object's inputs of the batch's images, each drawn in its own sequence's epoch (a mixture's
        source epoch: a sequence a mixture repeats within its epoch is cropped anew)."""
        epochs = np.unique(batch.epochs).tolist()
        if len(epochs) <= 1:
            return self.image.inputs(_image_batch(batch), seed=seed, epoch=epochs[0] if epochs else epoch)
        groups = [np.flatnonzero(batch.epochs == e) for e in epochs]
        parts = [self.image.inputs(_image_batch(batch, at), seed=seed, epoch=e) for e, at in zip(epochs, groups)]
        return _in_order(parts, np.argsort(np.concatenate(groups), kind="stable"))

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:

        read = delivery.read
        batch = {name: _tensor(read.arrays[name]) for name in _ARRAYS}
        batch["max_seqlen"] = int(read.arrays["max_seqlen"])
        batch["images"] = outputs["image"][:read.image_count]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {K_IMAGE_TEXT: {"version": STATE_VERSION, "seq_len": self.seq_len, "image_seq_len": self.image_seq_len,
                               "packing": self.packing, "max_images": self.max_images, "window": self.window,
                               K_PACKING_VERSION: PACKING_VERSION}}

    def check_state(self, state: dict[str, Any]) -> None:
        check_entry(state, K_IMAGE_TEXT, self.state_dict()[K_IMAGE_TEXT], "packed image-text sequences", "ImageText")


def _tensor(a: np.ndarray):
    """``a`` as a torch tensor; an empty one (a batch without images) fresh: numpy gives it stride 0, which torch
    would keep (and ``view`` refuses)."""
    import torch

    t = torch.from_numpy(a)
    return t if a.size else torch.empty(a.shape, dtype=t.dtype)


_PLACEHOLDER: list[np.ndarray] = []


def _placeholder() -> np.ndarray:
    """A 1 x 1 black PNG: what a batch without images feeds the graph (its output is dropped)."""
    if not _PLACEHOLDER:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (1, 1)).save(buf, "PNG")
        _PLACEHOLDER.append(np.frombuffer(buf.getvalue(), np.uint8))
    return _PLACEHOLDER[0]


def _image_batch(batch: ImageTextBatch, at: np.ndarray | None = None) -> ReadBatch:
    """The batch's images (those at ``at``; None: all) as the image kinds' feed reads them (``image``, ``sizes``,
    draw keys as ``indices``); the placeholder alone, index -1, for a batch without images."""
    if not batch.image_count:
        return ReadBatch(np.array([-1], np.int64), {}, np.ones((1, 2), np.int64), [_placeholder()])
    if at is None:
        return ReadBatch(batch.keys, {}, batch.sizes, list(batch.images))
    return ReadBatch(batch.keys[at], {}, batch.sizes[at], [batch.images[m] for m in at.tolist()])


def _in_order(parts: list[tuple], back: np.ndarray) -> tuple:
    """The feeds ``parts`` (of groups of images) as one, its images put back in order ``back`` (a position in the
    groups' concatenation for each image): lists (the encoded images) and arrays alike."""
    out = []
    for i in range(len(parts[0])):
        if isinstance(parts[0][i], list):
            flat = [v for p in parts for v in p[i]]
            out.append([flat[j] for j in back.tolist()])
        else:
            out.append(np.ascontiguousarray(np.concatenate([p[i] for p in parts])[back]))
    return tuple(out)


def _fed_index(batch: ImageTextBatch) -> np.ndarray:
    """What the graph's ``index`` output holds for ``batch``: its images' draw keys (-1: the placeholder)."""
    return batch.keys if batch.image_count else np.array([-1], np.int64)


def _problem(batch: ImageTextBatch, j: int) -> str | None:
    """Why image ``j`` (in run order) of ``batch`` cannot be decoded (PIL's word), or None."""
    return image_problem(_image_batch(batch), j)


def _where(batch: ImageTextBatch) -> list[str]:
    """What names each image of ``batch`` (its dataset, shard, key and field), in run order."""
    return batch.where()
