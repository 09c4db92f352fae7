"""``fastio convert``: scan a source, load and check every sample in worker processes, write shards.

The scan (``fastio.converters``) gives entries in a deterministic order; splitting and shuffling are pure
functions of that order and the seed; worker results are consumed in order. So the same source,
options and seed give byte-identical shards and manifests whatever the number of workers.

DEST life cycle: the marker file is written first, shards are published one by one, the manifest
(or, with ``split``, ``splits.json`` after every split's manifest) is written last. A DEST holding the
marker but no final file is an interrupted run (killed), which the same command redoes from scratch; a run that
fails with an exception or Ctrl-C leaves DEST as it was before it (:class:`fastio.convert.dest.Claim`).

One writer per DEST: a conversion holds DEST's lock from before it checks DEST until its last file is published
(checks, locks, reset, staging and upload: :mod:`fastio.convert.dest`, every writer's); a part started while DEST's
lock is held is refused.

Rejected inputs: the scan's refusals (bad labels, paths outside the root, symlinks against the policy,
see :mod:`fastio.converters`) and samples that fail to load (unreadable, undecodable, over ``max_pixels``,
a label outside ``0 .. 2**63-1``) are skipped and listed in the manifest, or stop the run with
``on_error="fail"``.

With ``part`` (K, N), only the K-th of N contiguous ranges of every output dataset's order is written, into
``DEST/.parts/part-K-of-N/`` with its completion record last (:mod:`fastio.convert.parts`); DEST itself is left as it
is, and ``fastio merge`` (:mod:`fastio.convert.merge`) publishes the dataset once all parts are complete.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastio import converters
from fastio.checks import check_fields, checked, config_error, one_of, positive_integer, rule
from fastio.convert.dest import Claim, check_dest, lock_parts, upload_dataset
from fastio.convert.objects import read_object
from fastio.convert.parts import (
    PARTS_DIR,
    PartRecord,
    listing_digest,
    parse_part,
    part_dir,
    part_range,
    predicted_shard_starts,
    start_part_dir,
    write_part_record,
)
from fastio.convert.split import SPLIT_BY, assign_splits
from fastio.convert.workers import OrderedPool, start_server, workers_field
from fastio.converters.base import ClassList, FileRef, ScanOptions, ScanResult, UrlRef
from fastio.dataset.manifest import Manifest, load_manifest, split_names, write_splits
from fastio.dataset.shards import ShardWriter
from fastio.errors import ConvertError, DatasetError, StorageError
from fastio.formats.images import DEFAULT_MAX_PIXELS, ImageCheckError, check_image, downscale, is_image_field
from fastio.formats.labels import LABEL_CHOICES, LABEL_RULES, label_bytes
from fastio.formats.media import (
    DEFAULT_TRANSCODE,
    DEFAULT_VIDEO_DECODER,
    PROBE_FIELD,
    VIDEO_DECODERS,
    MediaCheckError,
    count_transcoded,
    count_video_codec,
    is_audio_field,
    is_media_field,
    is_video_field,
    parse_transcode,
    prepare_media,
    probe_json,
)
from fastio.formats.wds import is_plain_name
from fastio.progress import Progress, count, parse_size, rate_line, skipped_lines, trained_line
from fastio.storage.lock import LOCK_NAME
from fastio.storage.url import dest_location, local_or_url
from fastio.words import one_line

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ConvertConfig",
    "ConvertResult",
    "convert",
    "load_entry",
    "parse_size",
    "class_list",
    "parse_split",
]

DEFAULT_SHARD_SIZE = 256 * 10**6
Scanner = Callable[[Path], ScanResult]
"""What scans a conversion's source into entries (:func:`fastio.converters.scan` by default)."""


class SampleTally(Protocol):
    """What a conversion built on this one learns from one dataset's written samples
    (:attr:`ConvertConfig.tally`): an image-text conversion's largest token id and trained tokens."""

    def add(self, fields: dict[str, bytes]) -> None:
        """Count a sample written (its fields' bytes)."""

    def manifest_fields(self) -> dict[str, Any]:
        """What the dataset's manifest records of the samples counted (:func:`fastio.dataset.manifest.make_manifest`'s
        optional fields)."""

    def refuse(self, split_name: str) -> None:
        """A ConvertError where the dataset counted (split ``split_name``, "" without ``split``) must not be
        published (an image-text conversion's: no token trained); asked before its manifest, never of a part's
        (the merge asks of the whole)."""


ON_ERROR = ("skip", "fail")


def class_list(dataset: Path) -> ClassList:
    """The class names of ``dataset`` (a converted dataset whose labels are class names), label k the k-th.
    ValueError naming the parameter this reads, ``classes_from``, and the dataset."""
    try:
        splits = split_names(dataset)
        if splits:
            raise ValueError(f"classes_from: {dataset}: holds the splits {', '.join(splits)}: give one of them, "
                             f"{dataset / splits[0]}")
        manifest = load_manifest(dataset)
    except DatasetError as err:
        raise ValueError(f"classes_from: {err}") from None
    names = sorted(manifest.label_map or {}, key=lambda name: manifest.label_map[name])
    if manifest.label_rule != "names" or not names or [manifest.label_map[n] for n in names] != list(range(len(names))):
        raise ValueError(f"classes_from: {dataset}: its labels are not class names numbered 0, 1, ... (label_rule "
                         f"{manifest.label_rule!r}): give a dataset converted from an image folder or a table of "
                         "class names")
    return ClassList(tuple(names), str(dataset))


def parse_split(text: str | dict[str, float] | None) -> dict[str, float] | None:
    """``val=0.05`` or ``val=0.05,test=0.05`` -> ``{"val": 0.05, ...}``; the rest becomes ``train``, which may also
    be given when it is exactly the rest (``train=0.9,val=0.1``).

    ValueError messages name the parameter this reads, ``split``."""
    if text is None or text == "" or text == {}:
        return None
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            name, eq, value = part.partition("=")
            try:
                items.append((name.strip(), float(value)))
            except ValueError:
                raise ValueError(f"split: {part.strip()!r} is not NAME=FRACTION (e.g. val=0.05)") from None
            if not eq:
                raise ValueError(f"split: {part.strip()!r} is not NAME=FRACTION (e.g. val=0.05)")
    split: dict[str, float] = {}
    train = None  # train is the remainder; it may be written out (train=0.9,val=0.1) if it is exactly that
    for name, frac in items:
        if not 0 < frac < 1:
            raise ValueError(f"split: fraction for {name!r} must be between 0 and 1, got {frac}")
        if name == "train" and train is None:
            train = frac
            continue
        if not is_plain_name(name) or name == "train" or name in split:
            raise ValueError(f"split: bad or repeated split name {name!r} (train is the remainder)")
        split[name] = frac
    if not split:
        raise ValueError("split: no split named besides train (e.g. val=0.05, or train=0.95,val=0.05)")
    if sum(split.values()) >= 1:
        raise ValueError(f"split: fractions add up to {sum(split.values())}, leaving nothing for train")
    if train is not None and abs(train + sum(split.values()) - 1) > 1e-9:
        raise ValueError(f"split: train={train} and the other fractions add up to {train + sum(split.values()):g}, "
                         "not 1 (train is the remainder: give it so that all add up to 1, or leave it out)")
    return split


@dataclass
class ConvertConfig:
    """Everything ``fastio convert`` needs; the output depends on all fields but ``workers`` and ``progress``."""

    source: Path | str
    """The raw dataset: a directory (imagefolder, files) or a table file (csv, jsonl, parquet); an image-text
    conversion's JSONL may be an ``s3://`` URL (kept as a str; :mod:`fastio.convert.image_text`)."""
    dest: Path
    """Output directory; gets ``shards/``, ``manifest.json`` (or one sub-dataset per split). Kept with ``..`` folded
    where it follows a folder that does not exist (``x/new/../ds`` is ``x/ds``:
    :func:`fastio.storage.url.dest_location`)."""
    format: str | None = None
    """Source format (one of ``fastio.converters.FORMATS``); None: detected from ``source``."""
    shard_size: int | str = DEFAULT_SHARD_SIZE
    """Largest shard in bytes (or a human size such as ``256MB``); a bigger sample gets its own shard."""
    max_samples_per_shard: int | None = checked(positive_integer, default=None)
    """At most this many samples per shard; None: no limit."""
    workers: int = workers_field()
    """Processes that read, check and re-encode samples (never more than there are samples to load); does not change
    the output."""
    shuffle: bool = False
    """Permute the sample order (with ``seed``) before sharding."""
    seed: int = 0
    """Seed for ``shuffle`` and ``split``."""
    split: dict[str, float] | str | None = None
    """``{"val": 0.05}`` or ``"val=0.05"``: write ``dest/train`` and ``dest/val``, each a complete dataset. Refused
    for an image folder already split (``images/train/<class>/``, ``images/val/<class>/``), whose own splits are
    written so (:func:`fastio.converters.scan`)."""
    split_by: str | None = checked(one_of(SPLIT_BY, " (or None)"), default=None)
    """How ``split`` is drawn (:mod:`fastio.convert.split`): ``label`` (each split takes its fraction of every class)
    or ``random``; None: ``label`` when the source has labels, else ``random``. Recorded as the manifests'
    ``convert_options.split_by``."""
    max_side: int | None = checked(rule(lambda v: v >= 1, "must be positive"), default=None)
    """Downscale images whose longer side exceeds this and re-encode them; None keeps original bytes."""
    quality: int = checked(rule(lambda v: 1 <= v <= 100, "must be in 1..100"), default=90)
    """JPEG/WebP quality for re-encoded images (only with ``max_side``)."""
    max_pixels: int | None = checked(rule(lambda v: v is None or (not isinstance(v, bool) and v >= 1),
                                          "must be positive (or None for no limit)"), default=DEFAULT_MAX_PIXELS)
    """An image with more pixels (read from its header, before decoding) is skipped and listed, or stops
    the run with ``on_error="fail"``; None: no limit of fastio's own (PIL's hard limit, ~179 M, remains)."""
    transcode: str | None = DEFAULT_TRANSCODE
    """``flac`` (the default; None is the same): store audio DALI's audio decoder cannot read (MP3, AAC, ALAC, ...)
    decoded by PyAV as FLAC (field ``flac``); ``vp9``: re-encode video of a codec ``video_decoder`` does not keep
    (FFV1, ProRes, ...; with ``cpu`` also H.264, HEVC, ...) as VP9 WebM with PyAV (field ``webm``), and skip such
    audio; ``vp9,flac``: both; ``none``: such files are skipped and listed (:mod:`fastio.formats.media`). The summary
    counts the files transcoded. Recorded as ``convert_options.transcode`` unless ``flac``."""
    video_decoder: str = checked(one_of(VIDEO_DECODERS), default=DEFAULT_VIDEO_DECODER)
    """Which videos are kept as they are: ``auto`` (every codec a Loader decodes: VP8, VP9, MJPEG, H.264, HEVC,
    MPEG-4, AV1; on a GPU with NVDEC, on a CPU with DALI's CPU decoder or, for the rest, PyAV), ``cpu`` (only those
    DALI's CPU decoder reads: VP8, VP9, MJPEG) or ``nvdec`` (the same as ``auto``). Recorded as
    ``convert_options.video_decoder`` unless ``auto``."""
    on_error: str = checked(one_of(ON_ERROR), default="skip")
    """What a corrupt or unreadable sample does: ``skip`` (listed in the manifest) or ``fail``."""
    overwrite: bool = False
    """Replace a DEST that already holds a dataset or other files."""
    name: str = checked(rule(is_plain_name, "must be letters, digits, '_' or '-'"), default="shard")
    """Shard file name prefix: ``shards/NAME-000000.tar``."""
    path_column: str | None = None
    """Tables: the column with file paths (default: detected)."""
    label_column: str | None = None
    """Tables: the column with labels (default: detected, the first of ``label``, ``class``, ``cls`` the table has).
    The table options (``path_column``, ``label_column``, ``key_column``, ``labels``, ``root``) given for a source
    that is no table (an image folder, loose files; an image-text JSONL takes ``root`` alone) are refused, naming the
    option."""
    key_column: str | None = None
    """Tables: the column with sample keys (default: ``__key__`` or ``key`` when present, else derived from the
    path or the row number)."""
    labels: str = checked(one_of(LABEL_CHOICES), default="auto")
    """Tables: the label rule (:mod:`fastio.formats.labels`): ``auto`` (the values themselves when every label is
    integral, such as ``2``, ``2.0`` or ``" 2"``; sorted class names numbered from 0 when none is; a mix is an
    error naming rows of each kind), ``integers`` or ``names``. The rule applied is in the manifest
    (``label_rule``) and the summary."""
    root: Path | None = None
    """Tables: the folder relative paths start from and every path must resolve into (default: the
    table's folder); rows naming a file elsewhere (``../``, absolute, a symlink out) are rejected. An image-text
    JSONL (a local one): the folder its relative image paths start from, every one resolving into it (default:
    the JSONL's folder; one elsewhere is refused, naming its line)."""
    classes_from: Path | None = None
    """Image folders: a dataset whose class list (its manifest's ``label_map``) labels this source, label k naming
    the same class as there: for a split converted apart from the others (``images/val`` after ``images/train``),
    which by its own class folders would number a class another way when it lacks or adds one. A class folder the
    list does not name is refused; recorded as ``convert_options.classes_from``. None: the sorted class folders."""
    _classes: ClassList | None = field(default=None, init=False, repr=False)
    progress: bool = False
    """Draw a progress bar on stderr."""
    progress_every_s: float | None = checked(rule(lambda v: v > 0, "must be > 0 (or None)"), default=None)
    """Without ``progress``: print a progress line to stderr every this many seconds (for logs, e.g. Slurm's,
    where a bar cannot be drawn; the CLI gives 5 when stderr is not a terminal); None: no lines."""
    staging_dir: Path | None = None
    """For a URL ``dest`` (``s3://bucket/prefix``): where the dataset is written before it is uploaded, in a
    folder named after DEST (:func:`fastio.convert.dest.staging_path`: a killed run's copy is reused and replaced by
    the rerun; removed after the upload; as big as the whole converted dataset). Default: the system's temporary
    directory (``$TMPDIR``, else ``/tmp``)."""
    storage_options: dict | None = None
    """For a URL ``dest``, and an image-text conversion's ``s3://`` JSONL and images: endpoint, region,
    credentials, retries over the environment's (:class:`fastio.storage.StorageOptions`)."""
    part: tuple[int, int] | str | None = None
    """``(K, N)``, ``"K/N"`` or ``"auto/N"`` (K from ``SLURM_ARRAY_TASK_ID``): convert only the K-th of N
    parts into ``DEST/.parts/`` for a later ``fastio merge``; None: the whole dataset."""

    extra_options: dict[str, Any] | None = None
    """Options of a conversion built on this one, recorded in each manifest's ``convert_options`` (an image-text
    conversion's ``image_text``, :mod:`fastio.convert.image_text`)."""
    tally: Callable[[], SampleTally] | None = None
    """Of a conversion built on this one: makes, for each dataset written (a split, a part), what counts its samples
    as they are written and adds what it learnt to the dataset's manifest (an image-text conversion's vocabulary
    record, :class:`fastio.dataset.manifest.ImageTextInfo`); None: nothing more."""

    def __post_init__(self) -> None:
        """ValueError naming the parameter (``max_samples_per_shard must be positive, got 0``): the values converted
        here, then the fields' rules (:func:`fastio.checks.check_fields`)."""
        # DEST is a local folder (``..`` after a missing folder folded) or an object-store URL (kept as str); another
        # scheme is a StorageError.
        self.source, self.dest = local_or_url(self.source), dest_location(self.dest)
        if self.format is not None and self.format not in converters.FORMATS:
            raise ValueError(f"format: unknown format {self.format!r} (choose from {', '.join(converters.FORMATS)})")
        self.shard_size = parse_size(self.shard_size)
        self.split = parse_split(self.split)
        if self.root is not None:
            self.root = Path(self.root)
        self.transcode = parse_transcode(self.transcode)
        if self.part is not None:
            self.part = parse_part(self.part)
        if self.classes_from is not None:
            self.classes_from = Path(self.classes_from)
            self._classes = class_list(self.classes_from)
        check_fields(self, config_error)

    def output_options(self) -> dict[str, Any]:
        """The options that shape the output, as recorded in each manifest."""
        return {"shard_size": self.shard_size, "max_samples_per_shard": self.max_samples_per_shard,
                "shuffle": self.shuffle, "seed": self.seed, "split": self.split, "max_side": self.max_side,
                "quality": self.quality if self.max_side else None, "on_error": self.on_error,
                "max_pixels": self.max_pixels,
                **({"transcode": self.transcode} if self.transcode != DEFAULT_TRANSCODE else {}),
                **({"video_decoder": self.video_decoder} if self.video_decoder != DEFAULT_VIDEO_DECODER else {}),
                **({"classes_from": str(self.classes_from)} if self.classes_from is not None else {}),
                **(self.extra_options or {})}


@dataclass
class ConvertResult:
    """What a conversion wrote: one manifest per dataset (key ``""`` for one dataset, else split names: ``split``'s,
    or those of a source already split)."""

    dest: Path
    format: str
    manifests: dict[str, Manifest]
    skipped: list[dict[str, str]]
    seconds: float
    bytes_in: int
    part: tuple[int, int] | None = None
    """(K, N) when this was one part of a conversion in parts."""
    renamed: list[tuple[str, str, str]] = field(default_factory=list)
    """Inputs whose key an earlier input had (``a/tone.wav`` and ``a/tone.flac``): ``(input, key it got, the
    earlier input)``; see :class:`fastio.converters.base.Keys`."""
    transcoded: dict[str, dict[str, int]] = field(default_factory=dict)
    """Files stored transcoded (``transcode``): per field they went into (``flac``, ``webm``), how many from each
    codec (``{"flac": {"mp3float": 6}}``)."""
    notes: list[str] = field(default_factory=list)
    """What the summary line says of the source besides the counts: a split of a source already split that lacks a
    class of the others (``val has no 'cat'``; :attr:`fastio.converters.ScanResult.notes`)."""

    @property
    def samples(self) -> int:
        return sum(m.total_samples for m in self.manifests.values())

    @property
    def label_rule(self) -> str | None:
        """How labels were made (:data:`fastio.formats.labels.LABEL_RULES`), None without labels."""
        return next((m.label_rule for m in self.manifests.values() if m.label_rule), None)

    @property
    def shards(self) -> int:
        return sum(len(m.shards) for m in self.manifests.values())

    def summary(self, words: Callable[[str], str] = str) -> str:
        """One line (what was written, skipped, renamed, transcoded), then the skipped inputs by reason; ``words``
        puts each reason's options (``(max_pixels)``) as the reader knows them (the command: ``(--max-pixels)``)."""
        parts = ", ".join(f"{n}: {m.total_samples}" for n, m in self.manifests.items() if n)
        split = f" [{parts}]" if parts else ""
        part = f"part {self.part[0]}/{self.part[1]}: " if self.part else ""
        where = f"{self.dest}/{PARTS_DIR}" if self.part else self.dest
        rule = self.label_rule
        if rule == "names":
            classes = len(next(m.label_map for m in self.manifests.values() if m.label_map))
            rule = f"{rule} ({count(classes, 'class', 'classes')}, {LABEL_RULES[rule]})"
        elif rule:
            rule = f"{rule} ({LABEL_RULES[rule]})"
        labels = f"; labels: {rule}" if rule else self._unlabelled()
        labels += "".join(f"; {note}" for note in self.notes)
        more = f"fastio inspect {self.dest} --skipped" + (" after the merge" if self.part else "")
        return (f"{part}converted {rate_line(self.samples, self.bytes_in, self.seconds)} into {count(self.shards, 'shard')}"
                f"{split} at {where}; skipped {len(self.skipped)}{labels}{self._trained()}{renamed_line(self.renamed)}"
                f"{transcoded_line(self.transcoded)}"
                + skipped_lines(self.skipped, more, words=words))

    def _unlabelled(self) -> str:
        """A folder of images (videos, audio) with no class folders (converted as loose files, without ``cls``
        files): the summary's note that it has no labels and how to give them, since a classifier's script fails
        far from the cause; nothing for any other source."""
        first = next(iter(self.manifests.values()), None)
        if self.format != "files" or first is None:
            return ""
        what = "images" if first.image_field else "videos" if any(map(is_video_field, first.fields)) else \
            "audio files" if any(map(is_audio_field, first.fields)) else None
        if what is None:
            return ""
        source = (first.converted_from or {}).get("path", "SOURCE")
        return f"; no labels: {what} directly in {source}; put them in one folder per class to label them"

    def _trained(self) -> str:
        """An image-text conversion's trained tokens (:attr:`ImageTextInfo.trained_tokens` of every dataset written),
        or nothing."""
        infos = [m.image_text for m in self.manifests.values()]
        if not infos or any(i is None or i.trained_tokens is None or i.total_tokens is None for i in infos):
            return ""
        return trained_line(sum(i.trained_tokens for i in infos), sum(i.total_tokens for i in infos))


def renamed_line(renamed: list[tuple[str, str, str]]) -> str:
    """The summary's note of inputs renamed because an earlier one had their key: how many, and the first pair."""
    if not renamed:
        return ""
    origin, key, first = renamed[0]
    return (f"; renamed {count(len(renamed), 'key')} another input had (e.g. {one_line(origin)} is key {key!r}, as "
            f"{one_line(first)} has the key it would have had)")


_TRANSCODED_INTO = {"flac": ("audio file", "DALI's audio decoder does not read into FLAC", "flac"),
                    "webm": ("video", "the video decoder does not keep into VP9 WebM", "vp9")}


def transcoded_line(transcoded: dict[str, dict[str, int]]) -> str:
    """The summary's note of the files stored transcoded: per kind, how many, from which codecs, and the way to skip
    them instead (``--transcode none``; ``vp9`` is only ever asked for)."""
    notes = []
    for into, codecs in sorted(transcoded.items()):
        what, why, name = _TRANSCODED_INTO[into]
        each = ", ".join(f"{codec} {n}" for codec, n in sorted(codecs.items()))
        skip = "; --transcode none skips them" if name == DEFAULT_TRANSCODE else ""
        notes.append(f"; transcoded {count(sum(codecs.values()), what)} {why} with PyAV ({each}{skip})")
    return "".join(notes)


# -- loading, in worker processes -------------------------------------------------------------------

# (max_side, quality, max_pixels, label field, transcode, video decoder, storage options): set in each worker by
# _init_worker.
_LOAD_OPTIONS: tuple = (None, 90, DEFAULT_MAX_PIXELS, None, None, "cpu", None)


_IN_WORKER = False


def _init_worker(options: tuple, in_worker: bool = False) -> None:
    global _LOAD_OPTIONS, _IN_WORKER
    _LOAD_OPTIONS, _IN_WORKER = options, in_worker


def load_entry(entry) -> tuple[dict[str, bytes] | None, str | None, str | None]:
    """Read an entry's file fields (:func:`_field_bytes`), check its label and its images' size
    (``max_pixels``, from the header) and that they decode (and with ``max_side`` re-encode them); probe each
    video or audio field once and add the probe as the ``probe.json`` field
    (:func:`fastio.formats.media.check_media`: a codec the video decoder cannot read is a bad sample).

    Returns (fields, None, None) or, for a bad sample, (None, reason, the offending file or origin).
    """
    max_side, quality, max_pixels, label_field, transcode, video_decoder, _ = _LOAD_OPTIONS
    refs = {name: value for name, value in entry.fields if isinstance(value, FileRef)}
    out: dict[str, bytes] = {}
    probes: dict[str, bytes] = {}  # of each media field (a video and its sound: both)
    for name, value in entry.fields:
        value, reason, where = _field_bytes(value, entry.origin)
        if value is None:
            return None, reason, where
        original = value
        if name == label_field:
            try:
                value = label_bytes(value)  # a label file's " 4\r\n" or BOM: stored as "4", as WebDataset's int() reads
            except ValueError as err:
                return None, f"field {name!r}: {err}", where
        if is_media_field(name):
            try:
                name, value, probes[name] = prepare_media(value, name, transcode, video_decoder)
            except MediaCheckError as err:
                return None, str(err), where
            if name in out:  # transcoded into a field the sample already has: one file would be lost
                what = "video" if name == "webm" else "audio file"  # transcode_vp9's, transcode_flac's
                return None, f"field {name!r} twice: another {what} of the sample was transcoded into it", where
        if is_image_field(name):
            try:
                if max_side is not None:
                    value, _ = downscale(value, name.rsplit(".", 1)[-1].lower(), max_side, quality, max_pixels)
                else:
                    check_image(value, max_pixels)
            except ImageCheckError as err:
                return None, str(err), where
        # In a worker, a file's bytes that stay as they are go back as the FileRef: the writer reads
        # them again from the page cache, which costs less than sending them through the pool's pipe.
        ref = refs.get(name)
        out[name] = ref if _IN_WORKER and ref is not None and value is original else value
    if probes:
        out[PROBE_FIELD] = probe_json(probes)
    return out, None, None


def _field_bytes(value, origin: str) -> tuple[bytes | None, str | None, str]:
    """``(bytes, None, where)`` of a field: a FileRef's file read, a UrlRef's object fetched here (in the worker
    that checks it) with the conversion's storage options; ``(None, reason, where)`` when it cannot be read. ``where``
    names the file, the URL, or else ``origin``."""
    if isinstance(value, FileRef):
        try:
            with open(value.path, "rb") as f:
                return f.read(), None, value.path
        except OSError as err:
            return None, f"unreadable file ({err.strerror or err})", value.path
    if isinstance(value, UrlRef):
        try:
            return read_object(value.url, _LOAD_OPTIONS[6]), None, value.url
        except StorageError as err:
            return None, f"unreadable object ({str(err).removeprefix(value.url + ': ')})", value.url
    return value, None, origin


def resolve_fields(fields: dict) -> dict[str, bytes]:
    """Read the FileRefs a worker handed back in place of unchanged file bytes."""
    out = {}
    for name, value in fields.items():
        if isinstance(value, FileRef):
            with open(value.path, "rb") as f:
                value = f.read()
        out[name] = value
    return out


def _display_path(where: str, source: Path | str) -> str:
    """A skipped input as the manifest lists it: relative to the source folder when inside it (a URL as it is)."""
    if isinstance(source, str):
        return where
    base = source if source.is_dir() else source.parent
    try:
        return Path(where).relative_to(base).as_posix()
    except ValueError:
        return where


# -- orchestration -----------------------------------------------------------------------------------

def _split_by(config: ConvertConfig, scan) -> str | None:
    """How ``split`` is drawn for this scan (:mod:`fastio.convert.split`): as asked, else by label when there are labels."""
    if not config.split:
        return None
    if config.split_by == "label" and not scan.label_field:
        raise ConvertError(f"{config.source}: split_by='label' but the source has no labels")
    return config.split_by or ("label" if scan.label_field else "random")


def _options(config: ConvertConfig, scan) -> dict[str, Any]:
    """The options recorded in each manifest, with how the split was drawn."""
    by = _split_by(config, scan)
    return {**config.output_options(), **({"split_by": by} if by else {})}


def _label_keys(scan) -> list[bytes]:
    """Each entry's stored label bytes (a ``.cls`` file of loose files is read: a few bytes each)."""
    out = []
    for entry in scan.entries:
        value = dict(entry.fields).get(scan.label_field, b"")
        if isinstance(value, FileRef):
            try:
                with open(value.path, "rb") as f:
                    value = f.read(64)
            except OSError as err:
                raise ConvertError(f"{value.path}: unreadable label file ({err.strerror or err})") from None
        out.append(bytes(value).strip())
    return out


def _split_text(split: dict[str, float]) -> str:
    return ",".join(f"{name}={frac:g}" for name, frac in split.items())


def _assign(scan, config: ConvertConfig) -> dict[str, list[int]]:
    """Entry indices per output dataset, in writing order: the source's own splits (an image folder already split),
    ``split``'s, or one dataset (key ``""``)."""
    n = len(scan.entries)
    if scan.splits is not None:
        if config.split:
            raise ConvertError(f"{config.source}: already split into {', '.join(scan.splits)} (each converted into "
                               f"its DEST/<split>): leave out split={_split_text(config.split)!r}")
        groups = {name: list(indices) for name, indices in scan.splits.items()}
    elif not config.split:
        groups = {"": list(range(n))}
    else:
        labels = _label_keys(scan) if _split_by(config, scan) == "label" else None
        try:
            groups = assign_splits(n, config.split, config.seed, labels)
        except ValueError as err:
            raise ConvertError(f"{config.source}: {err}") from None
    if config.shuffle:
        for name, indices in groups.items():
            random.Random(f"{config.seed}:shuffle:{name}").shuffle(indices)
    return groups


def _write_dataset(config: ConvertConfig, out: Path, split_name: str, loaded, progress: Progress,
                   scan_skipped: list[dict[str, str]], transcoded: dict[str, dict[str, int]],
                   allow_empty: bool = False, **manifest_fields: Any):
    """Write one dataset from (entry, load result) pairs in order; return (manifest, skipped, bytes).

    On any error the shard being written stays a hidden temporary and is dropped (the writer aborts). The
    manifest counts the videos of each codec (``video_codecs``) when there are any; ``transcoded`` counts the files
    stored transcoded (:attr:`ConvertResult.transcoded`); ``config.tally`` counts the samples written (and may refuse
    them, but for a part's, ``allow_empty``)."""
    skipped: list[dict[str, str]] = []
    codecs: dict[str, dict[str, int]] = {}
    nbytes, written = 0, 0
    tally = config.tally() if config.tally is not None else None
    with ShardWriter(out, name=config.name, max_bytes=config.shard_size,
                     max_samples=config.max_samples_per_shard) as writer:
        for entry, (fields, reason, where) in loaded:
            if fields is None and entry.sample is not None:
                where = f"{entry.sample} ({_display_path(where, config.source)})"
            if fields is None:
                if config.on_error == "fail":
                    raise ConvertError(f"{where}: {reason} (on_error='fail')")
                skipped.append({"path": _display_path(where, config.source), "reason": reason})
                progress.update(1, 0)
                continue
            fields = _store(writer, entry, fields)
            if PROBE_FIELD in fields:
                count_video_codec(codecs, written, fields[PROBE_FIELD])
                count_transcoded(transcoded, fields[PROBE_FIELD])
            written += 1
            if tally is not None:
                tally.add(fields)
            size = sum(len(v) for v in fields.values())
            nbytes += size
            progress.update(1, size)
        if writer.total_samples == 0 and not allow_empty:
            listed = skipped + scan_skipped  # an image-text line whose image is missing: skipped by the scan
            example = f" (e.g. {listed[0]['path']}: {listed[0]['reason']})" if listed else ""
            of_split = f" of split {split_name}" if split_name else ""
            raise ConvertError(f"{config.source}: every sample{of_split} was skipped{example}")
        if codecs:
            manifest_fields["video_codecs"] = codecs
        if tally is not None:
            if not allow_empty:  # a part's samples are asked of when merged
                tally.refuse(split_name)
            manifest_fields.update(tally.manifest_fields())
        manifest = writer.close(skipped=scan_skipped + skipped,
                                image_fields=sorted(f for f in writer.fields if is_image_field(f)), **manifest_fields)
    return manifest, skipped, nbytes


def _store(writer: ShardWriter, entry, fields: dict) -> dict[str, bytes]:
    """Write a loaded entry's sample (its file fields read again where a worker handed back their FileRef); its
    fields' bytes. ConvertError naming the entry's origin for a file that changed or a field that cannot be stored."""
    try:
        fields = resolve_fields(fields)
    except OSError as err:
        raise ConvertError(f"{entry.origin}: file changed or vanished during conversion ({err})") from None
    try:
        writer.write({"__key__": entry.key, **fields})
    except ValueError as err:  # e.g. a column name too long for a tar member name
        raise ConvertError(f"{entry.origin}: cannot be stored ({err})") from None
    return fields


def convert(config: ConvertConfig, scanner: Scanner | None = None) -> ConvertResult:
    """Convert ``config.source`` into ``config.dest`` (or, with ``config.part``, one part of it into
    ``DEST/.parts/``); see the module docstring for the guarantees. ``scanner``: what scans the source (``source ->
    ScanResult``) in place of :func:`fastio.converters.scan` (an image-text conversion's,
    :mod:`fastio.convert.image_text`).

    A URL ``dest`` is written to a local staging folder first, then uploaded: shards and indexes, then each
    manifest, ``splits.json`` last, so readers never see a partial dataset (see :func:`_convert_to_url`)."""
    if scanner is None and isinstance(config.source, str):
        raise ConvertError(f"{config.source}: only token conversions (--tokenizer) and image-text conversions "
                           "(--image-field) read a SOURCE at a URL; copy it to a local folder first")
    if not isinstance(config.dest, Path):
        if config.part is not None:
            raise ConvertError(f"{config.dest}: part=... needs a DEST on a (shared) file system; convert the parts "
                               "there, merge, then upload")
        return _convert_to_url(config, scanner)
    started = time.perf_counter()
    if config.part is not None:  # parts run side by side: each locks only its own part directory
        check_dest(config.dest, config.source, config.overwrite)
        scan, groups = _scan(config, scanner)
        return _guard_os(config, lambda: _write_part(config, scan, groups, started))
    with Claim(config.dest, "fastio convert") as claim:  # a failed run takes back what it made
        if (config.dest / LOCK_NAME).is_file():  # a DEST that may be in use: ask its lock before judging its files
            claim.take()
        return _convert_locked(config, claim, started, scanner)


def _convert_locked(config: ConvertConfig, claim: Claim, started: float, scanner: Scanner | None) -> ConvertResult:
    check_dest(config.dest, config.source, config.overwrite)
    scan, groups = _scan(config, scanner)
    if not claim.lock.held:
        claim.take()
        check_dest(config.dest, config.source, config.overwrite)  # again: a run that held the lock may have finished
    parts = lock_parts(config.dest)
    try:
        return _guard_os(config, lambda: _write_all(config, scan, groups, started, claim))
    finally:
        for part in parts:
            part.release()


def _scan(config: ConvertConfig, scanner: Scanner | None = None):
    """The source's entries and their assignment to output datasets (splits), in writing order. The workers' fork
    server starts first, to import their modules while the scan runs."""
    if config.workers > 1:
        start_server(load_entry, _init_worker, _WORKER_IMPORTS)
    options = ScanOptions(path_column=config.path_column, label_column=config.label_column,
                          key_column=config.key_column, root=config.root, labels=config.labels,
                          classes=config._classes)
    if scanner is None:
        scan = converters.scan(config.source, config.format, options)
    else:  # an image-text JSONL: its own scan, which takes no table option and no format
        if config.format is not None:
            raise ConvertError(f"format={config.format!r}: an image-text conversion reads its JSONL as it is")
        converters.refuse_table_options("image-text", dataclasses.replace(options, root=None))  # its images' root
        converters.refuse_classes("image-text", options)
        scan = scanner(config.source)
    if config.on_error == "fail":
        bad = next((s for s in scan.skipped if s.error), None)
        if bad is not None:
            raise ConvertError(f"{_display_path(bad.path, config.source)}: {bad.reason} (on_error='fail')")
    return scan, _assign(scan, config)


def _guard_os(config: ConvertConfig, write):
    try:
        return write()
    except OSError as err:  # DEST unwritable, disk full, a source file unreadable mid-run, ...
        raise ConvertError(f"{err.filename or config.dest}: {err.strerror or err}") from None


def _write_all(config: ConvertConfig, scan, groups: dict[str, list[int]], started: float,
               claim: Claim) -> ConvertResult:
    """Reset DEST, then load and write every group (split) of ``scan``'s entries; the manifests go last."""
    claim.reset()
    scan_skipped = [s.as_dict() for s in scan.skipped]
    jobs = []
    for split_name, indices in groups.items():
        extra = {"split": {"name": split_name, "of": sorted(groups)}} if split_name else {}
        jobs.append((split_name, [scan.entries[i] for i in indices],
                     config.dest / split_name if split_name else config.dest,
                     dict(converted_from=scan.description, label_map=scan.label_map, image_field=scan.image_field,
                          label_field=scan.label_field, label_rule=scan.label_rule,
                          convert_options=_options(config, scan),
                          scan_skipped=scan_skipped, **extra)))
    transcoded: dict[str, dict[str, int]] = {}
    manifests, skipped, bytes_in = _write_groups(config, jobs, scan.label_field, transcoded)
    if "" not in manifests:
        write_splits(config.dest, manifests)
    return ConvertResult(dest=config.dest, format=scan.description["format"], manifests=manifests,
                         skipped=scan_skipped + skipped, seconds=time.perf_counter() - started, bytes_in=bytes_in,
                         renamed=scan.renamed, transcoded=transcoded, notes=scan.notes)


def _write_part(config: ConvertConfig, scan, groups: dict[str, list[int]], started: float) -> ConvertResult:
    """Write part K of N of every group into ``DEST/.parts/part-K-of-N/``; its ``part.json`` goes last.

    Only that directory is touched (parts of one conversion run side by side); a second process converting
    the same part is refused. Each group's part manifest lists the samples this part skipped; the scan's
    skipped inputs, labels and options go into the part record, which the merge checks across parts."""
    k, n = config.part
    directory = part_dir(config.dest, k, n)
    with Claim(directory, f"fastio convert --part {k}/{n}") as claim:  # a failed part takes back what it made
        claim.take()
        start_part_dir(config.dest, k, n, directory)
        claim.emptied()
        jobs, ranges = [], {}
        for split_name, indices in groups.items():
            entries = [scan.entries[i] for i in indices]
            starts = predicted_shard_starts(entries, config.shard_size, config.max_samples_per_shard)
            start, end = part_range(len(indices), k, n, starts)
            ranges[split_name] = {"range": [start, end], "count": len(indices)}
            jobs.append((split_name, entries[start:end],
                         directory / split_name if split_name else directory, {"scan_skipped": []}))
        transcoded: dict[str, dict[str, int]] = {}
        manifests, skipped, bytes_in = _write_groups(config, jobs, scan.label_field, transcoded, allow_empty=True)
        plan = {"source": scan.description, "convert_options": _options(config, scan), "name": config.name,
                "listing": {"sha256": listing_digest(scan), "entries": len(scan.entries)},
                "label_map": scan.label_map, "image_field": scan.image_field, "label_field": scan.label_field,
                "label_rule": scan.label_rule,
                "scan_skipped": [s.as_dict() for s in scan.skipped]}
        write_part_record(directory, PartRecord(part=k, of=n, plan=plan, datasets=ranges))
    return ConvertResult(dest=config.dest, format=scan.description["format"], manifests=manifests,
                         skipped=skipped, seconds=time.perf_counter() - started, bytes_in=bytes_in, part=(k, n),
                         renamed=scan.renamed, transcoded=transcoded, notes=scan.notes)


def _write_groups(config: ConvertConfig, jobs, label_field: str | None, transcoded: dict[str, dict[str, int]],
                  allow_empty: bool = False):
    """Load and write each job ``(split name, entries, output dir, manifest fields)`` in order, through one
    worker pool, counting the files stored transcoded in ``transcoded``; return (manifests by split name, samples
    skipped while loading, bytes written)."""
    manifests: dict[str, dict[str, Any]] = {}
    all_skipped: list[dict[str, str]] = []
    bytes_in = 0
    load_options = (config.max_side, config.quality, config.max_pixels, label_field, config.transcode,
                    config.video_decoder, config.storage_options)
    total = sum(len(job[1]) for job in jobs)
    workers = min(config.workers, max(1, total))  # no more processes than entries to load
    pool = _start_pool(workers, load_options)
    try:
        with Progress(total, enabled=config.progress, desc="convert", every_s=config.progress_every_s) as progress:
            for split_name, entries, out, fields in jobs:
                if pool is None:
                    results = map(load_entry, entries)
                else:
                    results = pool.map(entries, chunksize=max(1, min(16, len(entries) // (workers * 8))))
                manifest, skipped, nbytes = _write_dataset(config, out, split_name, zip(entries, results), progress,
                                                           allow_empty=allow_empty, transcoded=transcoded, **fields)
                manifests[split_name] = manifest
                all_skipped.extend(skipped)
                bytes_in += nbytes
    finally:
        if pool is not None:
            pool.close()  # at once, also after an error: the workers share no lock that could hang it
    return manifests, all_skipped, bytes_in


_WORKER_IMPORTS = ("PIL.Image",)  # what the fork server imports once for the workers (with load_entry's module)


def _start_pool(workers: int, load_options: tuple) -> OrderedPool | None:
    """The pool of ``workers`` processes that load entries (None for one: they load in this process). Its
    workers start from fastio's fork server (:mod:`fastio.convert.forkserver`), never as a copy of this process:
    one that read objects by URL (:class:`UrlRef`) holds an object-store client, which does not work in a copy
    (its runtime's threads stay behind), and one that runs a training script holds torch's and DALI's threads
    and garbage (see :mod:`fastio.convert.workers`). The server imports PIL once for all of them."""
    if workers == 1:
        _init_worker(load_options)
        return None
    return OrderedPool(load_entry, workers, initializer=_init_worker, initargs=(load_options, True),
                       preload=_WORKER_IMPORTS)


def _convert_to_url(config: ConvertConfig, scanner: Scanner | None = None) -> ConvertResult:
    """Convert into a local staging folder, then upload it to ``config.dest``
    (:func:`fastio.convert.dest.upload_dataset`)."""
    result = upload_dataset(config.dest, config.storage_options, config.staging_dir, config.overwrite,
                            lambda local: convert(dataclasses.replace(config, dest=local, overwrite=True), scanner))
    result.dest = config.dest
    return result

