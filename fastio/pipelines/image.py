"""The image kinds: :class:`ImageTrain` (random resized crop + flip) and :class:`ImageEval` (resize + center
crop), decoded by DALI on CPU operators or with ``mixed`` (nvJPEG / hardware decoder) on the GPU.

A sample's image is the first image field it has (a dataset may mix formats; DALI decodes by content, and GIF,
which DALI lacks, becomes a BMP in the reader thread: :func:`decodable`). The global index of every sample goes
through the graph and comes out beside its image, so the Loader can check that outputs line up with what it fed.
Crop and flip parameters are a pure function of ``(seed, epoch, draw key)``: the global index, or a mixture's key for
a repeat within an epoch (:mod:`fastio.pipelines.augment`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fastio.errors import DatasetError
from fastio.formats.image_text import is_image_text
from fastio.formats.media import is_audio_field, is_video_field
from fastio.pipelines.augment import random_resized_crop
from fastio.pipelines.base import (
    Delivery,
    GraphDef,
    Pipeline,
    Placement,
    ReadFields,
    Source,
    check_fields,
    declared,
    refuse_tokens,
)
from fastio.pipelines.text import TextReader, Tokenize, check_text, mask_name

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import SamplerSpec
    from fastio.read.protocol import ReadSet
    from fastio.read.reader import ReadBatch

__all__ = ["DTYPES", "IMAGENET_MEAN", "IMAGENET_STD", "MAX_SIDE", "ImageEval", "ImageKind", "ImageTrain",
           "check_mean_std", "check_side", "decodable", "finite_number", "headers_read", "image_problem",
           "image_read_fields"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DTYPES = ("float32", "float16", "uint8")
LAYOUTS = ("CHW", "HWC")
MAX_SIDE = 8192
"""The largest output side (pixels) of a kind's images or frames: an 8192 x 8192 float32 RGB image is 768 MiB
already; a larger side runs DALI out of memory at the first batch (std::bad_alloc), not at the option."""
MAX_RESIZED = 2 * MAX_SIDE
"""The largest side an image is resized to before a crop (:class:`ImageEval`'s ``size / crop_ratio``)."""


def check_image_options(size: Any, mean: Any, std: Any, dtype: Any, layout: Any, name: str = "size") -> None:
    """ValueError naming the first bad image option (``name``: how the caller spells ``size``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be CHW or HWC, got {layout!r}")
    check_side(size, name)
    check_mean_std(mean, std)


def check_mean_std(mean: Any, std: Any) -> None:
    """ValueError naming ``mean`` and ``std`` unless each is 3 finite numbers (not bools), ``std`` > 0: NaN or inf
    makes every pixel of a channel NaN."""
    if len(mean) != 3 or len(std) != 3 or not all(map(finite_number, (*mean, *std))) or min(std) <= 0:
        raise ValueError(f"mean and std need 3 values, std > 0, each a finite number; got {mean}, {std}")


def check_side(size: Any, name: str = "size") -> None:
    """ValueError naming ``size`` (an output side in pixels, as the caller spells it: ``name``) unless it is an
    integer in 1..:data:`MAX_SIDE`."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    if size > MAX_SIDE:
        raise ValueError(f"{name} must be at most {MAX_SIDE} pixels, got {size!r}: an output side beyond that makes "
                         f"each image gigabytes ({MAX_SIDE} x {MAX_SIDE} float32 RGB is 768 MiB already), which runs "
                         "DALI out of memory at the first batch")


def finite_number(value: Any) -> bool:
    """A real number (not a bool), finite: NaN or inf in mean or std makes every pixel NaN."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def check_hw_decoder_load(load: Any) -> None:
    """ValueError naming ``load`` unless it is None or a number in [0, 1]."""
    if load is None:
        return
    if isinstance(load, bool) or not isinstance(load, numbers.Real) or not 0 <= load <= 1:
        raise ValueError(f"hw_decoder_load must be None or a number in [0, 1], got {load!r}")


def check_crop_ratio(ratio: Any, name: str = "crop_ratio", size: int | None = None) -> None:
    """ValueError naming ``ratio`` unless it is in (0, 1] and, with ``size``, resizes the shorter side to
    ``size / ratio`` <= :data:`MAX_RESIZED` pixels."""
    if not finite_number(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {ratio!r}")
    if size is not None and size / ratio > MAX_RESIZED:
        raise ValueError(f"size / {name} (the shorter side resized before the center crop) must be at most "
                         f"{MAX_RESIZED} pixels, got {size} / {ratio!r} = {size / ratio:.0f}: a larger image runs "
                         "DALI out of memory at the first batch")


def refuse_image_text(ds: Dataset, kind: str) -> None:
    """DatasetError naming ``ds`` and the kind ``kind`` when ``ds`` is an image-text dataset (``fastio convert
    --image-field``: its samples' images belong to their token runs, which only ``fastio.ImageText`` reads)."""
    if is_image_text(ds.manifest.convert_options):
        raise DatasetError(f"{ds.root}: an image-text dataset (fastio convert --image-field: images with their "
                           f"token runs), and pipeline {kind!r} does not read it: read it with "
                           "fastio.ImageText(image=..., seq_len=..., image_seq_len=...) (docs/image-text.md)")


def _no_image_way_out(fields: Sequence[str]) -> str:
    """What to read a dataset without an image field with: the clip kind of its first video or audio field, else
    ``Raw``."""
    video = [f for f in fields if is_video_field(f)]
    audio = [f for f in fields if is_audio_field(f)]
    if video or audio:
        kind = "VideoClips" if video else "AudioClips"
        return f"it holds {(video or audio)[0]}: read it with fastio.{kind} (docs/media.md)"
    return "use pipeline=fastio.Raw()"


def image_read_fields(ds: Dataset, fields: Sequence[str], kind: str, sizes: bool) -> ReadFields:
    """What a kind of ``kind`` decoding each sample's image reads of ``ds`` to deliver ``fields`` beside it (with each
    image's (width, height) where ``sizes``); DatasetError naming what ``ds`` lacks."""
    refuse_tokens(ds, kind)
    refuse_image_text(ds, kind)
    if ds.image_field is None:
        raise DatasetError(f"{ds.root}: dataset has no image field; {_no_image_way_out(ds.fields)}")
    # A sample's image is the first of the image fields it has (Manifest.image_order); each is optional in a
    # sample for that reason, and a sample with none of them is refused when read (verify --decode names it)
    # An image field asked for among ``fields`` is delivered too, as its stored bytes (as any field, and as Raw and
    # the clip kinds deliver theirs): the graph decodes the reader's own copy, which decodable() may transcode
    image = ds.manifest.image_order
    ds.require_fields(list(fields), in_every_sample=True)
    return ReadFields(tuple(fields), image, sizes, image, decodable)


def image_problem(batch: ReadBatch, j: int) -> str | None:
    """Why image ``j`` of ``batch`` cannot be decoded, or None: whatever PIL raises opening ``batch.image[j]``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(batch.image[j].tobytes())) as img:
            img.load()
    except Exception as bad:  # whatever PIL raises, the image is undecodable
        return f"{type(bad).__name__}: {str(bad)[:80]}"
    return None


def headers_read(encoded: Any) -> Any:
    """``encoded`` (a DALI node of encoded images) passed on to a decoder only once DALI's image parser
    (``fn.peek_image_shape``) has read every image's header, so that an image whose header no parser reads fails
    the batch there, never in the decoder. DALI 2.4's image decoders (``fn.decoders.image``, ``image_slice``; CPU
    and ``mixed``) read the headers of a batch of 32 images or more in two threads or more; where the calling
    thread's image is unreadable, its exception leaves the decoder while the others still read through the
    decoder's unwound stack: the process died (SIGSEGV, in ``ImageDecoder::RunImplImpl``'s ``setup_block``) on
    about one such batch in ten, instead of raising the DatasetError naming the image. ``fn.peek_image_shape``
    waits for all its threads before it raises. No bytes are copied: ``fn.reshape`` passes them on as they are,
    its ``shape`` (each image's own, plus 0 times its peeked sizes) is what makes the decoder wait for the peek;
    the cost is a second read of each header (microseconds, in DALI's threads)."""
    from nvidia.dali import fn, types

    peeked = fn.peek_image_shape(encoded)
    return fn.reshape(encoded, shape=encoded.shape(dtype=types.INT64) + fn.reductions.sum(peeked) * 0)


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


class ImageKind(Pipeline):
    """The base of the kinds that decode each sample's image in a DALI graph (:class:`ImageTrain`,
    :class:`ImageEval`, :class:`fastio.Graph`): the image fields read (a token dataset or one without an image field
    refused, naming the kind to read it with), the encoded images and indices fed, each image's header read by DALI's
    parser before :meth:`_graph` decodes it (:func:`headers_read`), PIL naming an undecodable image."""

    needs_image_size: ClassVar[bool] = False
    """Whether :meth:`inputs` needs each image's (width, height) (``ReadBatch.sizes``)."""
    input_dtypes: ClassVar[dict[str, str]] = {"encoded": "uint8", "index": "int64"}
    """The dtype of each graph input (:meth:`input_names`)."""
    output_names: ClassVar[tuple[str, ...] | None] = ("image", "index")
    """The graph's outputs (None: named by the graph itself)."""
    traced: ClassVar[bool] = True
    """Whether DALI records each operator's Python stack while the graph is built (:attr:`GraphDef.traced`): a
    graph a user writes (:class:`fastio.Graph`, a kind of their own); fastio's :class:`ImageTrain` and
    :class:`ImageEval` build theirs without it."""

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        return image_read_fields(ds, fields, self.kind, self.needs_image_size)

    def graph(self) -> GraphDef:
        return GraphDef(declared(self.input_names(), self.input_dtypes), self.inputs, self._headers_read_graph,
                        self.output_names, image_problem, traced=self.traced)

    def _headers_read_graph(self, inp: dict[str, Any], decoder_device: str) -> Any:
        """:meth:`_graph` on ``encoded`` passed on once every image's header is read (:func:`headers_read`)."""
        if "encoded" in inp:
            inp["encoded"] = headers_read(inp["encoded"])
        return self._graph(inp, decoder_device)

    def input_names(self) -> tuple[str, ...]:
        """What :meth:`inputs` returns for one batch, in order."""
        return ("encoded", "index")

    def inputs(self, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
        """The graph's inputs of one read batch, in :meth:`input_names` order: the encoded images as a list (one
        array per sample; DALI decodes by content), the rest whole-batch arrays."""
        return batch.image, np.ascontiguousarray(batch.indices, dtype=np.int64)

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class _Image(ImageKind):
    """Options both image kinds share."""

    traced: ClassVar[bool] = False  # fastio's own graphs: the Loader names their failures itself

    size: int = 224
    """Output side S: images are S x S (at most :data:`MAX_SIDE`, 8192)."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel mean on the 0..1 scale, subtracted before dividing by ``std`` (not with ``uint8``)."""
    std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel standard deviation on the 0..1 scale."""
    dtype: str = "float32"
    """Image dtype: float32, float16 (normalised) or uint8 (not normalised)."""
    layout: str = "CHW"
    """Image layout: CHW or HWC."""
    fields: tuple[str, ...] | None = None
    """Fields delivered besides the image (default: the label field, as ``batch["label"]``); every sample must
    have them. Numeric text fields come as int64 or float64 tensors, others as lists of bytes: the image field
    itself (``fields=("jpg", "cls")``) comes as each sample's stored, encoded bytes beside the decoded image."""
    text: dict[str, Tokenize] | tuple[tuple[str, Tokenize], ...] | None = None
    """Text fields delivered tokenized (``{"txt": fastio.Tokenize("tokenizer.json", max_len=77)}``), off the
    training thread: ``batch["txt"]`` int64 [B, max_len] and ``batch["txt_mask"]`` bool [B, max_len]; every sample
    must have them. Kept as sorted (field, Tokenize) pairs."""
    hw_decoder_load: float | None = None
    """With ``device="cuda"``: the share of the images DALI's ``mixed`` decoder gives the GPU's hardware JPEG decoder
    (A100, H100 and later; the rest go to nvJPEG's CUDA decoder), in [0, 1]. None: DALI's default (0.65). Unused
    on the CPU. ``bench/gpu.py`` measures the choices on the GPU at hand."""

    def __post_init__(self):
        object.__setattr__(self, "text", check_text(self.text))
        check_hw_decoder_load(self.hw_decoder_load)
        object.__setattr__(self, "mean", tuple(self.mean))
        object.__setattr__(self, "std", tuple(self.std))
        object.__setattr__(self, "fields", check_fields(self.fields))
        check_image_options(self.size, self.mean, self.std, self.dtype, self.layout)

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        """The image kinds' fields, and the ``text`` fields (every sample must have them)."""
        text = [f for f, _ in self.text or () if f not in fields]
        return super().read_fields(ds, [*fields, *text])

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The read set's samples; with ``text``, read through a :class:`TextReader` that tokenizes them."""
        source = super().source(read_set, sampling, place)
        if not self.text:
            return source
        return dataclasses.replace(source, reader=TextReader(source.reader, self.text, read_set.where,
                                                             read_set.reader_threads))

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        if not self.text:
            return super().assemble(outputs, delivery)
        import torch

        fields = dict(self.text)
        batch = super().assemble(outputs, dataclasses.replace(
            delivery, columns=tuple(f for f in delivery.columns if f not in fields)))
        for field, (ids, mask) in delivery.read.text.items():
            batch[field], batch[mask_name(field)] = torch.from_numpy(ids), torch.from_numpy(mask)
        return batch

    def _normalize(self) -> dict[str, Any]:
        """``crop_mirror_normalize``'s dtype, mean, std and layout (on the 0..255 scale)."""
        from nvidia.dali import types

        scale = 255.0 if self.dtype != "uint8" else 1.0
        mean = [m * scale for m in self.mean] if self.dtype != "uint8" else [0.0, 0.0, 0.0]
        std = [s * scale for s in self.std] if self.dtype != "uint8" else [1.0, 1.0, 1.0]
        dtypes = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}
        return {"mean": mean, "std": std, "dtype": dtypes[self.dtype], "output_layout": self.layout}

    def _decoder(self, decoder_device: str) -> dict[str, Any]:
        """The image decoder's arguments but its inputs: RGB, no EXIF turn, ``hw_decoder_load`` on the GPU."""
        from nvidia.dali import types

        args: dict[str, Any] = {"device": decoder_device, "output_type": types.RGB, "adjust_orientation": False}
        if decoder_device == "mixed" and self.hw_decoder_load is not None:
            args["hw_decoder_load"] = float(self.hw_decoder_load)
        return args


@dataclass(frozen=True)
class ImageTrain(_Image):
    """Training images: a random resized crop of each image (scale 0.08..1, ratio 3/4..4/3, decoded as that
    window only), resized to ``size`` x ``size``, flipped at random, normalised. The crop and the flip are a
    pure function of ``(seed, epoch, global sample index)``: the same on every rank, run and world size (a sample
    a mixture repeats within an epoch is cropped anew each time: ``ReadBatch.draw_keys``).

    ``fastio.ImageTrain(size=224)``; ``Loader(dest, pipeline=fastio.ImageTrain(size=160, dtype="float16"))``.
    """

    kind: ClassVar[str] = "image-train"
    needs_image_size: ClassVar[bool] = True
    input_dtypes: ClassVar[dict[str, str]] = {**ImageKind.input_dtypes, "anchor": "float32", "shape": "float32",
                                              "flip": "int32"}

    def evaluation(self) -> ImageEval:
        """:class:`ImageEval` with this object's size, normalisation, dtype, layout and fields."""
        return ImageEval(size=self.size, mean=self.mean, std=self.std, dtype=self.dtype, layout=self.layout,
                         fields=self.fields, text=self.text, hw_decoder_load=self.hw_decoder_load)

    def input_names(self) -> tuple[str, ...]:
        return ("encoded", "index", "anchor", "shape", "flip")

    def inputs(self, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
        index = np.ascontiguousarray(batch.indices, dtype=np.int64)
        crop = random_resized_crop(seed, epoch, batch.draw_keys, batch.sizes[:, 0], batch.sizes[:, 1])
        return batch.image, index, crop.anchor, crop.shape, crop.flip

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> tuple:
        from nvidia.dali import fn

        img = fn.decoders.image_slice(inp["encoded"], inp["anchor"], inp["shape"], normalized_anchor=False,
                                      normalized_shape=False, axis_names="WH", **self._decoder(decoder_device))
        img = fn.resize(img, resize_x=self.size, resize_y=self.size, antialias=True)
        img = fn.crop_mirror_normalize(img, mirror=inp["flip"], **self._normalize())
        return img, inp["index"]


@dataclass(frozen=True)
class ImageEval(_Image):
    """Evaluation images: the shorter side resized to ``size / crop_ratio``, then the center ``size`` x ``size``
    crop, normalised; no randomness. The longer side is resized to :data:`MAX_RESIZED` at most (an image over 64:1
    at ``size`` 224, a strip: its crop padded with zeros where the resized image is narrower than it).

    ``fastio.ImageEval(size=224, crop_ratio=0.875)``.
    """

    kind: ClassVar[str] = "image-eval"
    crop_ratio: float = 0.875
    """The center crop's share of the resized shorter side, in (0, 1] (``size / crop_ratio`` at most
    :data:`MAX_RESIZED`, 16384)."""

    def __post_init__(self):
        super().__post_init__()
        check_crop_ratio(self.crop_ratio, size=self.size)

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> tuple:
        from nvidia.dali import fn

        img = fn.decoders.image(inp["encoded"], **self._decoder(decoder_device))
        # max_size: a strip (1 x 3000) resized by its shorter side would be 256 x 768000 (590 MB, seconds); capped,
        # its center crop is padded where the strip is narrower than it (only images over 64:1 at 224)
        img = fn.resize(img, resize_shorter=self.size / self.crop_ratio, max_size=MAX_RESIZED, antialias=True)
        img = fn.crop_mirror_normalize(img, crop=(self.size, self.size), out_of_bounds_policy="pad",
                                       **self._normalize())
        return img, inp["index"]
