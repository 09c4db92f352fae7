"""The clip kinds: :class:`VideoClips` (``fn.decoders.video``) and :class:`AudioClips` (``fn.decoders.audio``).

The unit stays a stored sample: a video or audio field and its ``probe.json`` (written by ``fastio convert``,
:mod:`fastio.formats.media`), read together, so planning a clip never opens a file. Where a clip starts, and a video
clip's crop and flip, are a pure function of ``(seed, epoch, draw key)`` (:mod:`fastio.pipelines.augment`),
drawn in :meth:`inputs` and fed to the graph as per-sample arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fastio.dist import usable_cpus
from fastio.errors import DatasetError, install_hint
from fastio.formats.dali_audio import dali_audio_problem, decoded_layouts
from fastio.formats.images import is_image_field
from fastio.formats.media import (
    CPU_VIDEO_CODECS,
    PROBE_FIELD,
    avi_without_index,
    is_audio_field,
    is_avi,
    is_media_field,
    is_video_field,
    parse_probe,
    probe,
    trim_video,
)
from fastio.formats.pyav_clips import CPU_FALLBACKS, undecodable_frame
from fastio.pipelines.augment import clip_starts, random_resized_crop
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
from fastio.pipelines.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    check_mean_std,
    check_side,
    finite_number,
    headers_read,
    image_problem,
    image_read_fields,
)
from fastio.pipelines.video_fallback import FallbackReader, decode_jobs
from fastio.words import agree, count

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset
    from fastio.formats.media import ProbeTable
    from fastio.order.sampler import SamplerSpec
    from fastio.read.protocol import ReadSet
    from fastio.read.reader import ReadBatch

__all__ = ["AudioClips", "VideoClips"]

VIDEO_LAYOUTS = ("FCHW", "FHWC", "CFHW")
CROPS = ("random", "center")
MAX_CLIP_FRAMES = 4096
"""The most frames a :class:`VideoClips` decodes per video (``frames * clips_per_video``): each is decoded at the
video's own size before it is resized (4096 frames of 640 x 360 are 2.8 GB); more ran the machine out of memory at
the first batch (``frames=2**31``: the process killed)."""
MAX_FFT = 2**16
"""The largest ``AudioClips(n_fft=...)`` (4 s at 16 kHz; speech and music use 256..4096): its mel bands are checked
over its ``n_fft / 2 + 1`` bins when it is made (``n_fft=2**31`` allocated gigabytes there)."""
MAX_CLIP_SAMPLES = 2**28
"""The most samples of an :class:`AudioClips` clip (1 GiB of float32; 4.6 hours at 16 kHz): a longer one ran DALI
out of memory, or past its int32 shapes (a bare ``shape value out of range`` blaming the batch's keys)."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def probe_source(ds: Dataset) -> ProbeTable | None:
    """Where the probes of ``ds``'s samples come from, the one place that decides: its probe table when it has
    one (``fastio index`` writes it, :attr:`fastio.Dataset.probes`), else None: each sample's ``probe.json``
    field (``fastio convert`` stores it beside the file)."""
    return ds.probes


def _media_fields(ds: Dataset, test, what: str) -> tuple[str, ...]:
    """The dataset's fields of one kind (video or audio), the most common first; DatasetError naming what it
    lacks (those fields, or their probes: the ``probe.json`` fields of convert or the probe table of index)."""
    counts = ds.manifest.field_counts or {}
    found = sorted((f for f in ds.fields if test(f)), key=lambda f: (-counts.get(f, 0), f))
    if not found:
        raise DatasetError(f"{ds.root}: dataset has no {what} field (its fields: {', '.join(ds.fields)})")
    table = probe_source(ds)
    if table is None and PROBE_FIELD not in ds.fields:
        raise DatasetError(f"{ds.root}: dataset has no {PROBE_FIELD} field (the probe fastio convert writes "
                           f"beside each {what} file); convert the {what} files with fastio convert")
    _refuse_samples_without(ds, found, test, what)
    for f in found if table is not None else ():
        if f in table.unprobed:
            n, (i, why) = table.unprobed[f]["count"], table.unprobed[f]["first"]
            whose = count(n, "sample's", "samples'")
            raise DatasetError(f"{ds.root}: {whose} {f} could not be probed when indexed "
                               f"(the first: shard {ds.shard_of(i).name} key {ds.key(i)!r}: {why}); remove "
                               f"{agree(n, 'it', 'them')} from the shards and index again, or convert the files "
                               "with fastio convert (which keeps or transcodes what a Loader decodes, and skips "
                               "what it cannot)")
    return tuple(found)


def _refuse_samples_without(ds: Dataset, found: Sequence[str], test, what: str, chunk: int = 1 << 20) -> None:
    """DatasetError naming how many samples have none of the ``found`` fields and the first (shard and key),
    when the dataset may have such samples: it holds fields of another kind (a table naming images, video and
    audio), or its ``field_counts`` say so; found by reading the sample table's sizes, a chunk at a time."""
    counts = ds.manifest.field_counts
    other = any(is_image_field(f) or (is_media_field(f) and not test(f)) for f in ds.fields)
    if not other and (counts is None or sum(counts.get(f, 0) for f in found) >= len(ds)):
        return
    lacking, first = 0, None
    for a in range(0, len(ds), chunk):
        sizes = ds.index.locate(np.arange(a, min(a + chunk, len(ds)))).sizes
        without = np.flatnonzero(~np.any([sizes[f] >= 0 for f in found], axis=0))
        lacking += len(without)
        first = a + int(without[0]) if first is None and len(without) else first
    if lacking:
        raise DatasetError(f"{ds.root}: {lacking} of {count(len(ds), 'sample')} {agree(lacking, 'has', 'have')} "
                           f"no {what} field (the first: "
                           f"shard {ds.shard_of(first).name} key {ds.key(first)!r}; fields: {', '.join(ds.fields)}); "
                           f"{'an' if what == 'audio' else 'a'} {what} clip pipeline needs one in every sample: "
                           f"convert the {what} files into a dataset of their own (and mix it with others with "
                           "fastio.Mixture)")


class _BatchReader:
    """Reads batches with ``inner`` (the read set's reader) and passes each through :meth:`_filled` in the thread
    that finished the read (what it raises is the batch's error); ``where(i)`` names read-set id ``i``."""

    def __init__(self, inner: Any, where):
        self.inner, self.where = inner, where

    def _filled(self, batch: ReadBatch) -> ReadBatch:
        raise NotImplementedError

    def submit(self, ids: np.ndarray) -> Future:
        out: Future = Future()

        def fill(read: Future) -> None:
            if not out.set_running_or_notify_cancel():
                return
            try:
                out.set_result(self._filled(read.result()))
            except BaseException as err:  # a read error passes through, a missing probe is named
                out.set_exception(err)

        self.inner.submit(ids).add_done_callback(fill)
        return out

    def read_ahead_shards(self, batches) -> None:
        self.inner.read_ahead_shards(batches)

    def close(self) -> None:
        """Nothing of its own (the inner reader is the read set's, closed with it)."""


class _ProbeReader(_BatchReader):
    """Puts each sample's probe from its dataset's probe table (``tables[source]``, None for a dataset whose samples
    hold a ``probe.json`` field) into the batch's ``probe.json`` column."""

    def __init__(self, inner: Any, tables: list[ProbeTable | None], split, where):
        super().__init__(inner, where)
        self.tables, self.split = tables, split

    def _filled(self, batch: ReadBatch) -> ReadBatch:
        n = len(batch.indices)
        column = batch.fields.setdefault(PROBE_FIELD, [np.empty(0, np.uint8)] * n)
        present = batch.present.setdefault(PROBE_FIELD, np.zeros(n, bool))
        source, index = self.split(batch.indices)
        for j, (s, i, field) in enumerate(zip(source.tolist(), index.tolist(), batch.image_field)):
            if self.tables[s] is not None and is_media_field(field):
                try:
                    column[j] = np.frombuffer(self.tables[s].probe(i, field), np.uint8)
                except ValueError as err:
                    raise DatasetError(f"{self.where(int(batch.indices[j]))}: {err}") from None
                present[j] = True
        return batch


class _UnindexedAviRefusal(_BatchReader):
    """Where PyAV is not installed: refuses a batch holding an AVI without an index (:func:`avi_without_index`: a
    dataset converted before convert wrote such files again with their index, or a user's shards fastio index
    read), naming its shard, key and field. Without PyAV nothing remuxes it (:func:`trim_video`), and DALI's CPU
    decoder, handed it as it is, crashed the process (a segfault)."""

    def _filled(self, batch: ReadBatch) -> ReadBatch:
        for j, field in enumerate(batch.image_field):
            if is_video_field(field) and avi_without_index(batch.image[j]):
                raise DatasetError(f"{self.where(int(batch.indices[j]))}: field {field!r} is an AVI without an index "
                                   "(written to a pipe, or cut off), which DALI's video decoder crashes on unless "
                                   f"PyAV remuxes it, and PyAV is not installed: {install_hint('media')}, or convert "
                                   "the file again (fastio convert stores such an AVI with its index)")
        return batch


@dataclass(frozen=True)
class _Clips(Pipeline):
    """What both clip kinds share: the media field read with its probe, the probes parsed per batch."""

    media: ClassVar[str] = "video"
    fields: tuple[str, ...] | None = None
    """Fields delivered besides the clip (default: the label field, as ``batch["label"]``)."""

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        refuse_tokens(ds, self.kind)
        test = is_video_field if self.media == "video" else is_audio_field
        media = _media_fields(ds, test, self.media)
        probes = [PROBE_FIELD] if probe_source(ds) is None else []  # else the probe table's, filled in by source()
        ds.require_fields([*probes, *fields], in_every_sample=True)
        # A sample's clip comes from the first media field it has (a dataset may mix formats), read as the
        # reader's "image" (no header parsed, nothing transcoded).
        return ReadFields(tuple(dict.fromkeys([*probes, *fields])), image=media)

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The read set's samples; with the probes of datasets that have a probe table put in (:func:`probe_source`)."""
        source = super().source(read_set, sampling, place)
        tables = [probe_source(s.dataset) for s in read_set.sources]
        if all(t is None for t in tables):
            return source
        return dataclasses.replace(source, reader=_ProbeReader(source.reader, tables, read_set.split, read_set.where))

    def _probes(self, batch: ReadBatch) -> list[dict[str, Any] | None]:
        """Each sample's probe, None for a sample whose clip is a still image (:class:`VideoClips` of an image
        dataset); DatasetError naming the sample's read-set id (``batch["index"]`` of a dataset) when one is not
        a probe."""
        stored = batch.fields.get(PROBE_FIELD)
        try:
            return [parse_probe(stored[j].tobytes(), f"sample {i}", field) if is_media_field(field) else None
                    for j, (i, field) in enumerate(zip(batch.indices.tolist(), batch.image_field))]
        except ValueError as err:  # the reader checked the shard's bytes: the dataset was written so
            raise DatasetError(f"{err}; re-convert the dataset with fastio convert") from None

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        """The clip outputs, then the asked fields (the probes are read, not delivered, unless ``fields`` names
        them) and ``batch["label"]``."""
        asked = set(self.fields or ())
        columns = tuple(c for c in delivery.columns if c in asked or c != PROBE_FIELD)
        return super().assemble(outputs, dataclasses.replace(delivery, columns=columns))

    def decode_problem(self, batch: ReadBatch, j: int) -> str | None:
        """Why sample ``j``'s media cannot be decoded: its ``probe.json`` is not one, PyAV cannot probe it, or it
        is not what its ``probe.json`` says (frames or samples: a file changed after convert, cut short, ...); a
        still image's: as an image's."""
        if not is_media_field(batch.image_field[j]):
            return image_problem(batch, j)
        try:
            stored = parse_probe(batch.fields[PROBE_FIELD][j].tobytes(), PROBE_FIELD, batch.image_field[j])
            found = probe(batch.image[j].tobytes(), batch.image_field[j])
        except ValueError as err:  # MediaCheckError too
            return str(err)
        unit, noun = ("frames", "frame") if self.media == "video" else ("samples", "sample")
        if found[unit] != stored[unit]:
            return f"it has {count(found[unit], noun)}, its {PROBE_FIELD} says {stored[unit]}"
        if self.media == "video":  # the probe demuxes: a damaged frame shows only when decoded
            bad = undecodable_frame(batch.image[j].tobytes())
            return None if bad is None else f"cannot be decoded by PyAV ({bad})"
        return dali_audio_problem(batch.image[j], stored)

    conditionals: ClassVar[bool] = False
    """Whether the graph branches per sample (DALI's conditionals: :class:`VideoClips`' still images)."""

    input_dtypes: ClassVar[dict[str, str]] = {}
    """The dtype of each graph input (:meth:`input_names`; a numbered one by its stem)."""

    def graph(self) -> GraphDef:
        return GraphDef(declared(self.input_names(), self.input_dtypes), self.inputs, self._graph, self.output_names(),
                        self.decode_problem, self.conditionals)

    def output_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> tuple:
        raise NotImplementedError


def _have_pyav() -> bool:
    import importlib.util

    return importlib.util.find_spec("av") is not None


def _not_cpu_codecs(read_set: Any) -> list[tuple[Dataset, str, dict[str, int]]]:
    """``(dataset, codec, {count, first})`` of each codec DALI's CPU decoder does not read that a dataset of
    ``read_set`` counts in its manifest (one written before the count holds none)."""
    return [(source.dataset, codec, seen) for source in read_set.sources
            for codec, seen in sorted((source.dataset.manifest.video_codecs or {}).items())
            if codec not in CPU_VIDEO_CODECS]


_SAID: set[tuple[str, str]] = set()
"""(dataset, codec) pairs :func:`_say_fallback` has said in this process."""


def _say_fallback(found: list[tuple[Dataset, str, dict[str, int]]]) -> None:
    """One log line (logger ``fastio``, a warning) per dataset whose videos ``found`` a CPU Loader decodes with
    PyAV, once per process."""
    by_root: dict[str, list[tuple[str, int]]] = {}
    for ds, codec, seen in found:
        if (str(ds.root), codec) not in _SAID:
            _SAID.add((str(ds.root), codec))
            by_root.setdefault(str(ds.root), []).append((codec, seen["count"]))
    for root, codecs in by_root.items():
        videos = sum(n for _, n in codecs)
        logging.getLogger("fastio").warning(
            f"{root}: {', '.join(count(n, 'video') + f' in codec {c}' for c, n in codecs)} "
            f"{agree(videos, 'is', 'are')} decoded on the CPU with PyAV (DALI's CPU decoder does not read "
            f"{', '.join(c for c, _ in codecs)}; a Loader on a GPU decodes {agree(videos, 'it', 'them')} with NVDEC)")


@dataclass(frozen=True)
class VideoClips(_Clips):
    """Clips of ``frames`` frames, ``stride`` apart, from each sample's video (VP9, VP8 or MJPEG on the CPU),
    resized to ``size`` x ``size``: ``batch["video"]`` [B, frames, 3, size, size] (``layout="FCHW"``; with
    ``clips_per_video=K`` [B, K, frames, ...]), ``batch["start_frame"]`` int64 [B] (or [B, K]): each clip's first
    frame in its video, ``batch["label"]``.

    A clip's start is drawn uniformly over the frames where it fits (``0 .. frames_in_video - span``, span =
    ``(frames - 1) * stride + 1``), a pure function of ``(seed, epoch, draw key)`` (the global sample index; a
    mixture's own key for a sample it repeats within an epoch). A video shorter
    than the span starts at frame 0 and is padded by repeating its last frame. ``crop="random"``: a random
    resized crop (``scale``, ratio 3/4..4/3, as ``ImageTrain``) and, with ``flip``, a horizontal flip, the same on
    every frame of a video's clips; ``crop="center"``: the shorter side resized to ``size``, the center cropped.
    A video whose display matrix turns it (its probe's ``rotation``: a phone's 90°) is turned first, on every decode
    path, as players show it; the crop is drawn on the frame as shown.

    On a CPU Loader, a video DALI's CPU decoder does not read (H.264, HEVC, MPEG-4, AV1) has its clips decoded with
    PyAV (``cpu_fallback="auto"``, the default: where a dataset's manifest counts such videos, said once in a log
    line; ``"pyav"``: always) (from the keyframe before the clip, in
    display order, in ``fallback_threads`` threads as soon as the batch is read), then cropped, flipped, resized
    and normalised in the graph as the others: each sample gets the clip it gets on a GPU with NVDEC.

    An image dataset (alone, or in a :class:`fastio.Mixture` beside videos) gives **still clips**: each image
    decoded, cropped, flipped and resized by the same rules (its own crop from its width and height), repeated
    over the ``frames``; ``start_frame`` 0.

    ``Loader(dest, pipeline=fastio.VideoClips(frames=16, stride=2, size=112), batch_size=8)``.
    """

    kind: ClassVar[str] = "video-clips"
    media: ClassVar[str] = "video"
    conditionals: ClassVar[bool] = True
    input_dtypes: ClassVar[dict[str, str]] = {
        "encoded": "uint8", "index": "int64", "still": "bool", "start": "int32", "decode": "int32",
        "roi_start": "float32", "roi_end": "float32", "flip": "int32", "turned": "bool", "transpose": "bool",
        "turn_h": "int32", "turn_v": "int32", "fallback": "bool", "frames": "uint8"}
    frames: int = 16
    """Frames per clip (``frames * clips_per_video`` at most 4096: :data:`MAX_CLIP_FRAMES`)."""
    stride: int = 1
    """Distance between a clip's frames, in frames of the video."""
    size: int = 112
    """Output side S: frames are S x S (at most 8192: ``fastio.pipelines.image.MAX_SIDE``)."""
    clips_per_video: int = 1
    """Clips K drawn from each video (each its own start; one crop and flip for all K)."""
    crop: str = "random"
    """``random`` (random resized crop) or ``center`` (shorter side to ``size``, center crop)."""
    scale: tuple[float, float] = (0.08, 1.0)
    """The random crop's share of the frame's area (``crop="random"``)."""
    flip: bool = True
    """Flip each video's clips horizontally with probability 1/2 (``crop="random"``)."""
    dtype: str = "float32"
    """``float32`` (normalised by ``mean`` and ``std``) or ``uint8`` (the decoded pixels, resized)."""
    layout: str = "FCHW"
    """Layout of one clip: ``FCHW``, ``FHWC`` or ``CFHW``."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel mean on the 0..1 scale (float32 only)."""
    std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel standard deviation on the 0..1 scale (float32 only)."""
    cpu_fallback: str | None = "auto"
    """``"auto"``: a CPU Loader decodes videos DALI's CPU decoder does not read (H.264 ...) with PyAV when a dataset
    holds some (said once), a CUDA Loader with NVDEC; ``"pyav"``: with PyAV on a CPU Loader (a CUDA Loader refuses
    it: NVDEC reads them); None: a CPU Loader refuses such a dataset when it is made."""
    fallback_threads: int | None = None
    """Threads decoding with ``cpu_fallback`` (default: twice the CPUs this process may run on: a thread also waits,
    holding the GIL between frames, and DALI's threads crop and resize beside them)."""

    def __post_init__(self):
        object.__setattr__(self, "fields", check_fields(self.fields))
        self._check_fallback()
        object.__setattr__(self, "mean", tuple(self.mean))
        object.__setattr__(self, "std", tuple(self.std))
        object.__setattr__(self, "scale", tuple(self.scale))
        for name in ("frames", "stride", "clips_per_video"):
            _positive_int(name, getattr(self, name))
        if self.frames * self.clips_per_video > MAX_CLIP_FRAMES:
            raise ValueError(f"frames * clips_per_video (the frames decoded per video) must be at most "
                             f"{MAX_CLIP_FRAMES}, got {self.frames} * {self.clips_per_video}: each is decoded at the "
                             "video's own size first (4096 frames of 640 x 360 are 2.8 GB)")
        check_side(self.size)
        if not isinstance(self.flip, (bool, np.bool_)):
            raise ValueError(f"flip must be True or False, got {self.flip!r}")
        if self.crop not in CROPS:
            raise ValueError(f"crop must be random or center, got {self.crop!r}")
        if self.dtype not in ("float32", "uint8"):
            raise ValueError(f"dtype must be float32 or uint8, got {self.dtype!r}")
        if self.layout not in VIDEO_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(VIDEO_LAYOUTS)}, got {self.layout!r}")
        if len(self.scale) != 2 or not all(map(finite_number, self.scale)) \
                or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi <= 1, got {self.scale!r}")
        check_mean_std(self.mean, self.std)

    def _check_fallback(self) -> None:
        if self.cpu_fallback is not None and self.cpu_fallback not in CPU_FALLBACKS:
            raise ValueError(f"cpu_fallback must be None or one of {', '.join(CPU_FALLBACKS)}, got {self.cpu_fallback!r}")
        if self.fallback_threads is not None:
            _positive_int("fallback_threads", self.fallback_threads)
        if self.cpu_fallback == "pyav":
            if not _have_pyav():
                raise ValueError(f"cpu_fallback='pyav' needs PyAV: {install_hint('media')}")

    def evaluation(self) -> VideoClips:
        """The same clips with ``crop="center"`` (no random crop, no flip)."""
        return dataclasses.replace(self, crop="center")

    @property
    def span(self) -> int:
        """Frames of the video one clip covers: ``(frames - 1) * stride + 1``."""
        return (self.frames - 1) * self.stride + 1

    def input_names(self) -> tuple[str, ...]:
        starts = tuple(f"start{c}" for c in range(self.clips_per_video))
        decode = tuple(f"decode{c}" for c in range(self.clips_per_video))
        streams = tuple(f"encoded{c}" for c in range(1, self.clips_per_video))
        decoded = ("fallback", *(f"frames{c}" for c in range(self.clips_per_video))) if self.cpu_fallback else ()
        return ("encoded", *streams, "index", "still", *starts, *decode, "roi_start", "roi_end", "flip", *TURN_INPUTS,
                *decoded)

    def output_names(self) -> tuple[str, ...]:
        return ("video", "start_frame", "index")

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields:
        """A video dataset's video field with its probe; an image dataset's images (with their sizes), whose
        clips are stills."""
        if ds.manifest.tokens is None and ds.image_field is not None and not any(map(is_video_field, ds.fields)):
            return image_read_fields(ds, fields, self.kind, sizes=True)
        return super().read_fields(ds, fields)

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The clip kinds' source, of these clips as ``place.device`` decodes them (:meth:`for_device`: the
        ``Source``'s pipeline); with ``cpu_fallback``, a :class:`FallbackReader` around its reader, whose threads
        decode the clips of the videos DALI's CPU decoder does not read; without PyAV, an
        :class:`_UnindexedAviRefusal` around it."""
        clips = self.for_device(read_set, place.device)
        source = _Clips.source(clips, read_set, sampling, place)
        if not _have_pyav():
            return dataclasses.replace(source, reader=_UnindexedAviRefusal(source.reader, read_set.where))
        if clips.cpu_fallback is None:
            return source
        return dataclasses.replace(source, reader=FallbackReader(
            source.reader, clips._fallback_jobs, clips.frames, clips.stride, read_set.where,
            clips.fallback_threads or 2 * len(usable_cpus())))

    def _fallback(self, probes: list) -> np.ndarray:
        """bool [B]: the samples whose clips ``cpu_fallback`` decodes (videos DALI's CPU decoder does not read)."""
        return np.array([self.cpu_fallback is not None and p is not None and p.get("codec") not in CPU_VIDEO_CODECS
                         for p in probes], bool)

    def _clip_starts(self, batch: ReadBatch, probes: list, seed: int, epoch: int) -> np.ndarray:
        lengths = np.array([1 if p is None else p["frames"] for p in probes], np.int64)  # a still: start 0
        return clip_starts(seed, epoch, batch.draw_keys, lengths, self.span, self.clips_per_video).astype(np.int32)

    def _fallback_jobs(self, batch: ReadBatch, seed: int, epoch: int) -> list:
        probes = self._probes(batch)
        return decode_jobs(batch, self._fallback(probes), self._clip_starts(batch, probes, seed, epoch))

    def inputs(self, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
        probes = self._probes(batch)
        still = np.array([p is None for p in probes], bool)
        sizes = batch.sizes if batch.sizes is not None else np.zeros((len(probes), 2), np.int64)
        w = np.array([s[0] if p is None else p["width"] for p, s in zip(probes, sizes.tolist())], np.float64)
        h = np.array([s[1] if p is None else p["height"] for p, s in zip(probes, sizes.tolist())], np.float64)
        turns = quarter_turns(probes)
        w, h = np.where(turns % 2, h, w), np.where(turns % 2, w, h)  # the frame as shown: the crop is drawn on it
        starts = self._clip_starts(batch, probes, seed, epoch)
        if self.crop == "random":
            crop = random_resized_crop(seed, epoch, batch.draw_keys, w, h, scale=self.scale,
                                       flip_p=0.5 if self.flip else 0.0)
            (x, y), (cw, ch), flip = crop.anchor.T, crop.shape.T, crop.flip
        else:  # the center square of the shorter side
            side = np.minimum(w, h)
            x, y, cw, ch = np.floor((w - side) / 2), np.floor((h - side) / 2), side, side
            flip = np.zeros(len(w), np.int32)
        roi_start = np.ascontiguousarray(np.stack([y, x], 1), np.float32)
        roi_end = np.ascontiguousarray(np.stack([y + ch, x + cw], 1), np.float32)
        index = np.ascontiguousarray(batch.indices, dtype=np.int64)
        encoded, decode = self._trimmed(batch.image, probes, starts)
        clips = range(self.clips_per_video)
        return (*encoded, index, still, *(np.ascontiguousarray(starts[:, c]) for c in clips),
                *(np.ascontiguousarray(decode[:, c]) for c in clips), roi_start, roi_end,
                np.ascontiguousarray(flip, np.int32), *turn_inputs(turns), *self._decoded(batch, probes))

    def _decoded(self, batch: ReadBatch, probes: list) -> tuple:
        """With ``cpu_fallback``: the ``fallback`` flags and, per clip, each flagged sample's decoded frames
        (``ReadBatch.frames``, decoded by the :class:`FallbackReader`; a 1-pixel stand-in for the others, which
        the graph's fallback branch never sees)."""
        if self.cpu_fallback is None:
            return ()
        fallback = self._fallback(probes)
        missing = [j for j in np.flatnonzero(fallback).tolist() if (j, 0) not in batch.frames]
        if missing:  # a batch not read through the FallbackReader
            raise RuntimeError(f"internal error: samples {missing} of the batch were not decoded ahead")
        blank = np.zeros((1, 1, 1, 3), np.uint8)
        return (fallback, *([batch.frames.get((j, c), blank) for j in range(len(probes))]
                            for c in range(self.clips_per_video)))

    def for_device(self, read_set: ReadSet, device: str) -> VideoClips:
        """These clips as a Loader on ``device`` decodes them (asked by :meth:`source`): ``cpu_fallback="auto"``
        made ``"pyav"`` on a CPU where a dataset counts videos DALI's CPU decoder does not read (said once per
        dataset, :func:`_say_fallback`) and PyAV is installed, else None; then :meth:`check_device`."""
        if self.cpu_fallback == "auto":
            found = [] if device == "cuda" else _not_cpu_codecs(read_set)
            pyav = "pyav" if found and _have_pyav() else None
            if pyav:
                _say_fallback(found)
            return dataclasses.replace(self, cpu_fallback=pyav).for_device(read_set, device)
        self.check_device(read_set, device)
        return self

    def check_device(self, read_set: Any, device: str) -> None:
        """On the CPU without ``cpu_fallback``, DatasetError naming the first dataset whose manifest counts videos of
        a codec DALI's CPU decoder does not read (convert keeps them by default): the codec, how many,
        the first (shard, key) and the ways out. A manifest without the count (written before it) holds none.
        ``cpu_fallback`` on CUDA: ValueError (NVDEC reads those codecs)."""
        if device == "cuda":
            if self.cpu_fallback == "pyav":
                raise ValueError(f"cpu_fallback={self.cpu_fallback!r} decodes on the CPU: a Loader on device='cuda' "
                                 "decodes H.264/HEVC/MPEG-4/AV1 with NVDEC; leave cpu_fallback out")
            return
        if self.cpu_fallback is not None:
            return
        for ds, codec, seen in _not_cpu_codecs(read_set)[:1]:
            i, add = seen["first"], "" if _have_pyav() else f" ({install_hint('media')})"
            raise DatasetError(
                f"{ds.root}: holds {count(seen['count'], 'video')} in codec {codec}, which DALI's CPU decoder "
                f"does not read (the first: shard {ds.shard_of(i).name} key {ds.key(i)!r}): decode them on a "
                "GPU with device='cuda' (NVDEC), decode them on the CPU with PyAV with "
                f"VideoClips(cpu_fallback='pyav'){add}, or "
                "convert the files with --transcode vp9 (transcode='vp9')")

    def _trimmed(self, encoded: list[np.ndarray], probes: list, starts: np.ndarray) -> tuple[list, np.ndarray]:
        """Per clip ``c``: each video cut to start at the last keyframe before that clip (:func:`trim_video`; a
        still's image as it is), and the clip's start in its cut stream. DALI's CPU decoder decodes from its
        input's first frame whatever the start (docs/media.md), so a clip late in a long video would cost every
        frame before it. Only codecs the CPU decoder reads are cut (VP8, VP9, MJPEG: packets in display order):
        H.264's or HEVC's B-frames are stored in decode order, so the packets up to the clip's last frame are not
        its frames (and an open GOP's keyframe needs frames before it); those go whole to NVDEC (``device="cuda"``),
        which finds the clip's frames in the file as DALI indexes it. A clip that runs past its video's end is
        remuxed even from frame 0, so the decoder pads it with the last frame (``trim_video(remux=True)``), and so
        is every clip of an AVI: DALI's CPU decoder crashed the process (a segfault) on an AVI without an index
        whose header says 2**30 frames (written to a pipe, a capture cut off), and counts an AVI's frames by its
        time slots."""
        out, decode = [list(encoded) for _ in range(self.clips_per_video)], starts.copy()
        for j, p in enumerate(probes):
            cut = p is not None and p.get("codec") in CPU_VIDEO_CODECS
            avi = cut and is_avi(encoded[j])
            for c in range(self.clips_per_video) if cut else ():
                past_end = int(starts[j, c]) + self.span > p["frames"]  # padded: a stream of its packets (trim_video)
                last = min(int(starts[j, c]) + self.span - 1, p["frames"] - 1)
                remux = past_end or avi
                data, k = trim_video(encoded[j], int(starts[j, c]), last, p.get("keyframes"), remux=remux)
                if k or remux:
                    out[c][j], decode[j, c] = np.frombuffer(data, np.uint8), starts[j, c] - k
        return out, decode

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> tuple:
        from nvidia.dali import fn, types

        # DALI's conditionals: each branch runs on its samples only, the outputs merge back in batch order
        if inp["still"]:
            video = self._still_clips(fn, types, inp, decoder_device)
        elif self.cpu_fallback is not None and inp["fallback"]:  # on the CPU only (check_device)
            video = self._decoded_clips(fn, types, inp)
        else:
            video = self._video_clips(fn, inp, decoder_device)
        starts = [inp[f"start{c}"] for c in range(self.clips_per_video)]
        start = fn.cast(starts[0] if self.clips_per_video == 1 else fn.stack(*starts), dtype=types.INT64)
        return video, start.gpu() if decoder_device == "mixed" else start, inp["index"]

    def _video_clips(self, fn, inp: dict[str, Any], decoder_device: str):
        from nvidia.dali import types

        clips = []
        for c in range(self.clips_per_video):
            stream = inp["encoded" if c == 0 else f"encoded{c}"]
            clip = fn.decoders.video(stream, device=decoder_device, start_frame=inp[f"decode{c}"],
                                     sequence_length=self.frames, stride=self.stride, pad_mode="edge")
            clips.append(self._normalize(fn, types, self._resize(fn, _turned(fn, clip, inp), inp), inp["flip"]))
        return clips[0] if self.clips_per_video == 1 else fn.stack(*clips)

    def _decoded_clips(self, fn, types, inp: dict[str, Any]):
        """The clips the :class:`FallbackReader` decoded (``frames{c}``: uint8 FHWC), resized and normalised as
        :meth:`_video_clips` does DALI's."""
        clips = [self._normalize(fn, types, self._resize(fn, _turned(fn, fn.reshape(inp[f"frames{c}"], layout="FHWC"),
                                                                     inp), inp), inp["flip"])
                 for c in range(self.clips_per_video)]
        return clips[0] if self.clips_per_video == 1 else fn.stack(*clips)

    def _still_clips(self, fn, types, inp: dict[str, Any], decoder_device: str):
        """An image as a clip: decoded, its crop resized, repeated over ``frames`` (and ``clips_per_video``)."""
        frame = fn.decoders.image(headers_read(inp["encoded"]), device=decoder_device, output_type=types.RGB,
                                  adjust_orientation=False)
        frame = self._resize(fn, frame, inp)
        clip = self._normalize(fn, types, fn.stack(*[frame] * self.frames, axis_name="F"), inp["flip"])
        return clip if self.clips_per_video == 1 else fn.stack(*[clip] * self.clips_per_video)

    def _resize(self, fn, frames, inp: dict[str, Any]):
        return fn.resize(frames, roi_start=inp["roi_start"], roi_end=inp["roi_end"], roi_relative=False,
                         size=[self.size, self.size], antialias=True)

    def _normalize(self, fn, types, clip, flip):
        uint8 = self.dtype == "uint8"
        mean = [0.0] * 3 if uint8 else [m * 255 for m in self.mean]
        std = [1.0] * 3 if uint8 else [s * 255 for s in self.std]
        return fn.crop_mirror_normalize(clip, mirror=flip, mean=mean, std=std, output_layout=self.layout,
                                        dtype=types.UINT8 if uint8 else types.FLOAT)


TURN_INPUTS = ("turned", "transpose", "turn_h", "turn_v")
"""The graph's inputs that turn a video's frames as players show them (:func:`turn_inputs`, :func:`_turned`)."""


def quarter_turns(probes: list) -> np.ndarray:
    """int64 [B]: counterclockwise quarter turns players give each sample's frames (its probe's ``rotation``, the
    display matrix's; 0 for a still or a probe without one)."""
    return np.array([(int(p.get("rotation", 0)) // 90) % 4 if p is not None else 0 for p in probes], np.int64)


def turn_inputs(turns: np.ndarray) -> tuple[np.ndarray, ...]:
    """:data:`TURN_INPUTS` for ``turns`` quarter turns: whether a sample is turned, then (FHWC) a transpose of H
    and W for an odd number, then a horizontal and a vertical flip (1 turn: transpose, vertical flip; 2: both
    flips; 3: transpose, horizontal flip; as ``np.rot90``)."""
    return (turns > 0, turns % 2 == 1, np.isin(turns, (2, 3)).astype(np.int32),
            np.isin(turns, (1, 2)).astype(np.int32))


def _turned(fn, clip, inp: dict[str, Any]):
    """``clip`` (FHWC) turned as players show it (:func:`turn_inputs`), before it is cropped and resized; a sample
    without a rotation is left as it is (DALI's conditionals: the branch runs on the turned samples only)."""
    if inp["turned"]:
        if inp["transpose"]:
            clip = fn.transpose(clip, perm=[0, 2, 1, 3], transpose_layout=False)
        clip = fn.flip(clip, horizontal=inp["turn_h"], vertical=inp["turn_v"])
    return clip


@dataclass(frozen=True)
class AudioClips(_Clips):
    """Clips of ``seconds`` seconds of each sample's audio (WAV, FLAC, Ogg Vorbis, Ogg Opus; MP3 and others stored
    as FLAC by ``convert --transcode flac``), decoded, resampled to
    ``sample_rate`` and mixed down to mono: ``batch["audio"]`` float32 [B, round(sample_rate * seconds)], or with
    ``n_mels`` the clip's log-mel spectrogram [B, n_mels, T] in dB (``fn.spectrogram`` with ``n_fft`` and ``hop``,
    ``fn.mel_filter_bank``, ``fn.to_decibels``); ``batch["start_sample"]`` int64 [B]: the clip's first sample at
    ``sample_rate``; ``batch["label"]``.

    A clip's start is drawn uniformly over the samples where it fits, a pure function of ``(seed, epoch, draw
    key)`` (as for :class:`VideoClips`). A file shorter than the clip starts at 0 and is padded with zeros (silence)
    at the end. Each file is decoded at its own rate and mixed down, and only the clip's window (with a margin) is
    resampled (:func:`resample_windows`), not the whole file. A sound starts where PyAV's decode puts it: the samples
    DALI's decoder delivers before it (an Ogg Opus pre-skip) are dropped (:func:`decoded_layouts`), and the starts
    are drawn over the sound it delivers (not the Opus file's last pre-skip samples, which it does not).

    ``Loader(dest, pipeline=fastio.AudioClips(sample_rate=16000, seconds=1.0), batch_size=8)``.
    """

    kind: ClassVar[str] = "audio-clips"
    media: ClassVar[str] = "audio"
    input_dtypes: ClassVar[dict[str, str]] = {
        "encoded": "uint8", "index": "int64", "start": "int32", "window_start": "int32", "window_length": "int32",
        "offset": "int32", "rate": "float32"}
    sample_rate: int = 16000
    """Output rate in Hz: every file is resampled to it."""
    seconds: float = 1.0
    """Clip length in seconds (``seconds * sample_rate`` at most 2**28 samples: :data:`MAX_CLIP_SAMPLES`)."""
    n_mels: int | None = None
    """Mel bands of a log-mel output; None delivers the waveform. ValueError when a band would hold no FFT bin
    of ``n_fft`` (:func:`empty_mel_bands`)."""
    n_fft: int = 400
    """FFT size and window length of the spectrogram (``n_mels`` only; at most 65536: :data:`MAX_FFT`)."""
    hop: int = 160
    """Samples between spectrogram windows (``n_mels`` only; at most 2**28: :data:`MAX_CLIP_SAMPLES`)."""

    def __post_init__(self):
        object.__setattr__(self, "fields", check_fields(self.fields))
        _positive_int("sample_rate", self.sample_rate)
        for name in ("n_fft", "hop") + (("n_mels",) if self.n_mels is not None else ()):
            _positive_int(name, getattr(self, name))
        if self.n_fft > MAX_FFT:
            raise ValueError(f"n_fft must be at most {MAX_FFT} (4 s at 16 kHz), got {self.n_fft!r}")
        if self.hop > MAX_CLIP_SAMPLES:  # DALI's window step is an int32: 2**31 wrapped to a negative one
            raise ValueError(f"hop must be at most {MAX_CLIP_SAMPLES} samples (a clip's largest length), got {self.hop!r}")
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, numbers.Real) \
                or not math.isfinite(self.seconds):
            raise ValueError(f"seconds must be a finite number giving at least one sample, got {self.seconds!r}")
        if self.sample_rate * float(self.seconds) > MAX_CLIP_SAMPLES:  # before length: a product past a float's range
            raise ValueError(f"seconds * sample_rate must be at most {MAX_CLIP_SAMPLES} samples (a clip of 1 GiB of "
                             f"float32), got {self.seconds!r} * {self.sample_rate} = {self.sample_rate * self.seconds:.0f}")
        if self.length < 1:
            raise ValueError(f"seconds must be a finite number giving at least one sample, got {self.seconds!r}")
        empty = [] if self.n_mels is None else empty_mel_bands(self.sample_rate, self.n_fft, self.n_mels)
        if empty:
            raise ValueError(f"n_mels={self.n_mels} is too many for n_fft={self.n_fft} at sample_rate="
                             f"{self.sample_rate}: {count(len(empty), 'mel band')} (the first: {empty[0]}) "
                             f"{agree(len(empty), 'holds', 'hold')} no FFT bin, so {agree(len(empty), 'it', 'they')} "
                             "would always be silent; use fewer mels or a larger n_fft")

    @property
    def length(self) -> int:
        """Samples per clip at ``sample_rate``."""
        return int(round(self.sample_rate * self.seconds))

    def input_names(self) -> tuple[str, ...]:
        return ("encoded", "index", "start", "window_start", "window_length", "offset", "rate")

    def output_names(self) -> tuple[str, ...]:
        return ("audio", "start_sample", "index")

    def inputs(self, batch: ReadBatch, *, seed: int, epoch: int) -> tuple:
        rates, samples, leads = decoded_layouts(batch.image, self._probes(batch))
        # Samples of sound DALI delivers (an Opus pre-skip's lead is not sound, and as many at the end are not
        # delivered) at the output rate (the resampler's count, rounded down: a start never runs past the end).
        sound = (samples - leads) * self.sample_rate // rates
        starts = clip_starts(seed, epoch, batch.draw_keys, sound, self.length)[:, 0]
        window_start, window_length, offset = resample_windows(starts, self.length, rates, samples - leads,
                                                               self.sample_rate)
        window_start += leads.astype(np.int32)  # the decoder's samples before the sound (an Opus pre-skip)
        return (batch.image, np.ascontiguousarray(batch.indices, dtype=np.int64), starts.astype(np.int32),
                window_start, window_length, offset, rates.astype(np.float32))

    def _graph(self, inp: dict[str, Any], decoder_device: str) -> tuple:
        from nvidia.dali import fn, types

        # Decoded at the file's rate and mixed down; only the clip's window (resample_windows) is resampled.
        audio, _rate = fn.decoders.audio(inp["encoded"], downmix=True, dtype=types.FLOAT)
        window = fn.slice(audio, start=inp["window_start"], shape=inp["window_length"], axes=[0])
        window = fn.audio_resample(window, in_rate=inp["rate"], out_rate=self.sample_rate, dtype=types.FLOAT)
        clip = fn.slice(window, start=inp["offset"], shape=[self.length], axes=[0], out_of_bounds_policy="pad",
                        fill_values=0.0)
        if self.n_mels is not None:
            spec = fn.spectrogram(clip, nfft=self.n_fft, window_length=self.n_fft, window_step=self.hop)
            clip = fn.to_decibels(fn.mel_filter_bank(spec, sample_rate=self.sample_rate, nfilter=self.n_mels))
        start = fn.cast(inp["start"], dtype=types.INT64)
        if decoder_device == "mixed":  # decoded on the CPU, delivered on the GPU
            clip, start = clip.gpu(), start.gpu()
        return clip, start, inp["index"]


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (``fn.mel_filter_bank``'s default): linear below 1 kHz, logarithmic above."""
    return np.where(hz < 1000, 3 * hz / 200, 15 + 27 * np.log(np.maximum(hz, 1e-9) / 1000) / np.log(6.4))


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return np.where(mel < 15, 200 * mel / 3, 1000 * np.exp((mel - 15) * np.log(6.4) / 27))


def empty_mel_bands(sample_rate: int, n_fft: int, n_mels: int) -> list[int]:
    """The mel bands of ``fn.mel_filter_bank`` (``n_mels`` triangles, Slaney's scale, 0 Hz to ``sample_rate / 2``)
    over a spectrogram of ``n_fft`` that hold no FFT bin (none strictly inside a triangle): always zero, -200 dB
    after ``fn.to_decibels``, whatever the sound (librosa warns of "empty filters" in the same case)."""
    edges = _mel_to_hz(np.linspace(0.0, float(_hz_to_mel(np.float64(sample_rate / 2))), n_mels + 2))
    bins = np.arange(n_fft // 2 + 1) * sample_rate / n_fft
    inside = (bins[None, :] > edges[:-2, None]) & (bins[None, :] < edges[2:, None])
    return np.flatnonzero(~inside.any(axis=1)).tolist()


RESAMPLE_MARGIN = 64
"""Output samples resampled at least on each side of an audio clip (more than the filter's reach: 16 lobes at DALI's
default quality, at most 16 output samples when downsampling, 16 input samples when upsampling), so the clip's own
samples see the file as they would if the whole file were resampled."""
RESAMPLE_MARGIN_IN = 32
"""Input samples the margin covers at least: upsampling more than 4 times, 64 output samples are fewer input samples
than the filter's reach (8 kHz to 44.1 kHz: 11.6 of 16), and the clip's first and last samples were off by 2e-3."""


def resample_windows(starts: np.ndarray, length: int, rates: np.ndarray, samples: np.ndarray,
                     out_rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(window_start, window_length, offset)`` (int32 [B]) of the audio clips starting at ``starts`` (at
    ``out_rate``): the window of each file (``samples`` at ``rates``) that is resampled, and where the clip starts
    in the resampled window. The window starts a margin (:data:`RESAMPLE_MARGIN` output samples, at least
    :data:`RESAMPLE_MARGIN_IN` input samples) before the clip or at the
    file's start, at a sample where the input and output grids meet (a multiple of ``rate / gcd(rate, out_rate)``),
    so its output samples fall where the whole file's would; it ends the margin after the clip, or at the file's
    end (past it the clip is padded with zeros, as before)."""
    g = np.gcd(rates, out_rate)
    period_out, period_in = out_rate // g, rates // g
    margin = np.maximum(RESAMPLE_MARGIN, -(-RESAMPLE_MARGIN_IN * out_rate // rates))  # output samples
    first = np.maximum(starts - margin, 0) // period_out  # grid points before the window
    window_start = first * period_in
    end = np.minimum(-(-(starts + length + margin) * rates // out_rate), samples)
    return (window_start.astype(np.int32), np.maximum(end - window_start, 1).astype(np.int32),
            (starts - first * period_out).astype(np.int32))
