"""The dataset format's one schema: ``DEST/manifest.json`` (written last; its presence makes DEST a
dataset), its shard record, and ``DEST/splits.json`` (written last by a ``--split`` conversion).

Every field is validated with its type when read, so a damaged or hand-edited manifest gives one
:class:`~fastio.errors.DatasetError` naming the file and the field, never a ``TypeError`` later on.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from fastio import __version__
from fastio.checks import checked, count, read_checked, rule
from fastio.errors import DatasetError
from fastio.formats.image_text import options_tokenizer_sha256
from fastio.formats.images import is_image_field
from fastio.formats.labels import LABEL_RULES
from fastio.formats.media import is_audio_field, is_video_field
from fastio.formats.token_mask import MASK_FORMAT
from fastio.formats.wds import is_field_name, is_plain_name
from fastio.storage.atomic import atomic_write_bytes
from fastio.words import agree

__all__ = [
    "split_unfinished",
    "unfinished_marked",
    "shard_pattern",
    "pairs_not_dataset",
    "holds_pairs",
    "LOOK_AT",
    "tars_not_dataset",
    "tar_not_dataset",
    "holds_of",
    "file_not_dataset",
    "file_of_dataset",
    "holds_datasets",
    "images_not_dataset",
    "media_not_dataset",
    "media_of",
    "missing_split",
    "no_dataset",
    "no_such_dataset",
    "empty_not_dataset",
    "FORMAT",
    "fastio_json",
    "ChatInfo",
    "ImageTextInfo",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "format_version",
    "IndexRecord",
    "KINDS",
    "MANIFEST_NAME",
    "PARTS_DIR",
    "Manifest",
    "rebuild_hint",
    "reindex_command",
    "unfinished_run",
    "unfinished_split",
    "MARKER_NAME",
    "SHARDS_DIR",
    "SPLITS_FORMAT",
    "SPLITS_NAME",
    "ShardRecord",
    "TokenInfo",
    "embedding_size",
    "fingerprint",
    "masks_fingerprint",
    "is_location",
    "is_shard_name",
    "load_manifest",
    "make_manifest",
    "shard_records",
    "split_names",
    "write_manifest",
    "write_splits",
]

MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
SPLITS_NAME = "splits.json"
PARTS_DIR = ".parts"
"""The folder of a ``--part K/N`` conversion's or index's parts in DEST (:mod:`fastio.convert.parts`)."""
# Written first by a conversion: marks DEST as fastio's own output even before the manifest exists,
# so that an interrupted run can be redone in place without --overwrite.
MARKER_NAME = ".fastio-output"
FORMAT = "fastio-webdataset"
FORMAT_VERSION = 3
"""The newest manifest format this fastio writes and reads. 2: shard records may say where the shard is
(``location``/``idx_location``: shards indexed where they are by ``fastio index``). 3: ``kind: "tokens"``, a token
dataset (Megatron ``.bin``/``.idx`` shards, :class:`TokenInfo`). A manifest that needs nothing of 2 or 3 is written
as 1 (:func:`format_version`), so an older fastio still reads converted datasets and refuses an indexed or token
one by its version instead of reporting its shards missing. An optional entry that an older fastio ignores (an
image-text dataset's ``image_text``, :class:`ImageTextInfo`; the tokenizer's ``tokenizer_sha256`` inside it or inside
``tokens``: a record's reader skips keys it does not declare) needs no new version: a manifest without it reads as
"not known"."""
READ_VERSIONS = (1, 2, 3)
KINDS = {"samples": ".tar", "tokens": ".bin"}
"""What a dataset holds (the manifest's ``kind``, ``samples`` when absent) and its shards' file suffix: WebDataset
samples in ``.tar`` shards, or token documents in Megatron ``.bin`` shards (each with its ``.idx``)."""
SPLITS_FORMAT = "fastio-splits"

_SHARD_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_\-.]*\.(?:tar|bin)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_XXH3 = re.compile(r"[0-9a-f]{32}")
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_INDEX_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_\-.]*")
_TOKEN_LIMITS = {"uint16": 2**16 - 1, "int32": 2**31 - 1}


def _matches(pattern: re.Pattern, what: str):
    """A check (:mod:`fastio.checks`): a str that ``pattern`` matches in full, else ``is not WHAT``."""
    return rule(lambda v: isinstance(v, str) and pattern.fullmatch(v) is not None, f"is not {what}")


_shard_name = rule(lambda v: is_shard_name(v), "is not a shard file name (NAME.tar or NAME.bin, no directory part)")
_location = rule(lambda v: is_location(v), "is not a path relative to DEST (no '..'), an absolute path or an s3:// URL")


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """One shard as the manifest lists it: ``DEST/shards/NAME`` and its index ``NAME`` with ``.idx`` (or, for
    shards indexed where they are by ``fastio index``, ``location`` and ``idx_location``)."""

    name: str = checked(_shard_name)
    """File name of the tar (a token dataset: the ``.bin``) inside ``DEST/shards/`` (no directory part)."""
    samples: int = checked(count)
    """Samples the shard holds (a token dataset: documents)."""
    bytes: int = checked(count)
    """Size of the tar (``.bin``) file."""
    sha256: str = checked(_matches(_SHA256, "a hex sha256"))
    """Hex sha256 of the tar (``.bin``) file."""
    idx_sha256: str = checked(_matches(_SHA256, "a hex sha256"))
    """Hex sha256 of the ``.idx`` file."""
    xxh3_128: str | None = checked(_matches(_XXH3, "a hex xxh3-128"), default=None)
    """Hex xxh3-128 of the tar file (optional: written since fastio records it; older manifests lack it).
    What an object-store cache checks its fills against: it runs at memory speed where sha256 takes a core
    per ~1 GB/s; ``fastio verify`` checks both."""
    location: str | None = checked(_location, default=None)
    """Where the tar is when not at ``shards/NAME`` (``fastio index``): relative to DEST (``/``-separated, no
    ``..``), an absolute path, or an ``s3://`` URL. ``name`` still names the shard (unique); ``fastio verify`` names
    the file by its location."""
    idx_location: str | None = checked(_location, default=None)
    """Where its ``.idx`` is when not at ``shards/NAME.idx``, in the same terms as ``location``."""
    tokens: int | None = checked(count, default=None)
    """Tokens the shard holds (a token dataset's shards only)."""
    mask_sha256: str | None = checked(_matches(_SHA256, "a hex sha256"), default=None)
    """Hex sha256 of the shard's loss mask ``NAME.mask`` beside its ``.bin`` (a chat dataset's shards only:
    :mod:`fastio.formats.token_mask`)."""

    @property
    def idx_name(self) -> str:
        """File name of the shard's index next to it: DALI's for a tar, Megatron's for a ``.bin``."""
        return self.name[: -len(".tar")] + ".idx"  # both suffixes have four characters

    @property
    def mask_name(self) -> str:
        """File name of a chat shard's loss mask next to its ``.bin`` (:mod:`fastio.formats.token_mask`)."""
        return self.name[: -len(".bin")] + ".mask"

    @property
    def tar_key(self) -> str:
        """Where the tar is: relative to DEST (``shards/NAME`` unless ``location`` says), absolute, or a URL."""
        return self.location if self.location is not None else f"{SHARDS_DIR}/{self.name}"

    @property
    def idx_key(self) -> str:
        """Where the ``.idx`` is, in the terms of :attr:`tar_key`."""
        return self.idx_location if self.idx_location is not None else f"{SHARDS_DIR}/{self.idx_name}"

    def as_dict(self) -> dict[str, Any]:
        """The manifest entry (only the record's own fields, also for a subclass that locates it)."""
        out = {k: getattr(self, k) for k in _RECORD_KEYS}
        out.update({k: getattr(self, k) for k in _OPTIONAL_RECORD_KEYS if getattr(self, k) is not None})
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ShardRecord:
        """A record from its manifest entry; DatasetError naming ``where`` (e.g. ``FILE: shards[3]``) and the field."""
        return cls(**_read(cls, data, where))


def is_shard_name(name: object) -> bool:
    """Whether ``name`` may be a shard record's ``name``: ``NAME.tar`` or ``NAME.bin`` of letters, digits, ``_``,
    ``-`` and ``.``, no directory part."""
    return isinstance(name, str) and _SHARD_NAME.fullmatch(name) is not None


def is_location(value: object) -> bool:
    """Whether ``value`` may be a record's ``location``/``idx_location``: a path relative to DEST without ``..`` or
    empty parts, an absolute path, or an ``s3://bucket/key`` URL. Spaces are allowed (the shard is opened by its
    path: no text format holds locations); control characters (newline, tab, NUL) are not."""
    if not isinstance(value, str) or not value or any(ord(c) < 32 or c == "\x7f" for c in value):
        return False
    if value.startswith("s3://"):
        return len(value.split("/", 3)) == 4 and all(value.split("/", 3)[2:])
    parts = value[1:].split("/") if value.startswith("/") else value.split("/")
    return all(p and p not in (".", "..") for p in parts)


# keys a manifest shard entry may have
_OPTIONAL_RECORD_KEYS = ("xxh3_128", "location", "idx_location", "tokens", "mask_sha256")
_RECORD_KEYS = tuple(f.name for f in dataclasses.fields(ShardRecord)
                     if f.name not in _OPTIONAL_RECORD_KEYS)  # keys it must have
_RECORD_KEYSET = frozenset(_RECORD_KEYS)
_SHARD_NAMES = re.compile(f"(?:{_SHARD_NAME.pattern}\n)*")  # many names, each followed by a newline
_SHA256S = re.compile(f"(?:{_SHA256.pattern}\n)*")
_XXH3S = re.compile(f"(?:{_XXH3.pattern}\n)*")


@dataclasses.dataclass(frozen=True)
class IndexRecord:
    """The manifest's ``index`` entry: the consolidated sample index ``DEST/NAME`` (see :mod:`fastio.dataset.sample_table`).

    Optional in the manifest (format_version 1 stays readable both ways): a dataset without it is opened
    from its per-shard ``.idx`` files.
    """

    name: str = checked(_matches(_INDEX_NAME, "an index file name (no directory part)"))
    """File name inside DEST (no directory part)."""
    bytes: int = checked(count)
    """Size of the file."""
    sha256: str = checked(_matches(_SHA256, "a hex sha256"))
    """Hex sha256 of the file."""
    xxh3_128: str | None = checked(_matches(_XXH3, "a hex xxh3-128"), default=None)
    """Hex xxh3-128 of the file, checked on every open (optional: manifests written before it lack it)."""

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.xxh3_128 is None:
            del out["xxh3_128"]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> IndexRecord:
        """A record from the manifest's ``index`` entry; DatasetError naming ``where`` and the field."""
        return cls(**_read(cls, data, where))


@dataclasses.dataclass(frozen=True)
class TokenInfo:
    """The manifest's ``tokens`` entry of a token dataset (``kind: "tokens"``)."""

    dtype: str = checked(rule(lambda v: v in _TOKEN_LIMITS, f"is not one of {', '.join(_TOKEN_LIMITS)}"))
    """Token type of every ``.bin``: ``uint16`` or ``int32``."""
    eos_id: int = checked(count)
    """The end-of-document token id that ends every document."""
    total_tokens: int = checked(count)
    """Tokens in all shards (the sum of the shard records' ``tokens``)."""
    vocab_size: int | None = checked(count, default=None)
    """Ids of the tokenizer (None: not known, e.g. shards indexed by ``fastio index`` without ``vocab_size``)."""
    one_sequence_per_document: bool = checked(rule(lambda v: isinstance(v, bool), "is not true or false"), default=False)
    """Every ``.idx`` has one sequence per document (``doc_index`` is 0, 1, ..., N: what ``fastio convert``
    writes, and what ``fastio index`` found), so a reader finds a document without ``doc_index``; written
    only when true."""
    starts: IndexRecord | None = None
    """The document-starts table (``doc-starts.fxs``, :mod:`fastio.tokens.starts`; None: none was written)."""
    max_id: int | None = checked(count, default=None)
    """The largest id in the shards, read by ``fastio index`` (None: not recorded: a conversion, which records
    ``vocab_size``, or an index by a fastio before it read the ids)."""
    chat: ChatInfo | None = None
    """A chat dataset's conversations (``fastio convert --chat-template``): each document is one conversation,
    each shard has a loss mask; None: plain documents, every token trained."""
    tokenizer_sha256: str | None = checked(_matches(_SHA256, "a hex sha256"), default=None)
    """Hex sha256 of the bytes of the tokenizer file the documents were tokenized with, as ``fastio convert
    --tokenizer`` was given it (:func:`fastio.convert.token_convert.tokenizer_sha256`), so that datasets of one
    tokenizer file are known to mean the same tokens by the same ids (:class:`fastio.Mixture` compares them); None:
    not known (shards indexed by ``fastio index``, or converted before fastio recorded it)."""

    @property
    def embedding_size(self) -> int | None:
        """Rows a model's token embedding needs (:func:`embedding_size`)."""
        return embedding_size(self.vocab_size, self.max_id)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("vocab_size", "max_id", "chat", "tokenizer_sha256"):
            if out[key] is None:
                del out[key]
        if not self.one_sequence_per_document:
            del out["one_sequence_per_document"]
        if self.starts is None:
            del out["starts"]
        else:
            out["starts"] = self.starts.as_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TokenInfo:
        """The ``tokens`` entry; DatasetError naming ``where`` and the field (its own, then the rules between them:
        ``eos_id`` and ``max_id`` fit ``dtype``, the vocabulary holds both, ``max_id`` is at least ``eos_id``)."""
        values = _read(cls, data, where)
        limit, eos, vocab = _TOKEN_LIMITS[values["dtype"]], values["eos_id"], values.get("vocab_size")
        if eos > limit:
            raise DatasetError(f"{where}.eos_id: {eos} does not fit {values['dtype']}")
        if vocab is not None and vocab <= eos:
            raise DatasetError(f"{where}.vocab_size: {vocab} does not include eos_id {eos}")
        _check_max_id(values.get("max_id"), values["dtype"], eos, vocab, f"{where}.max_id")
        starts, chat = data.get("starts"), data.get("chat")
        return cls(**values, starts=None if starts is None else IndexRecord.from_dict(starts, f"{where}.starts"),
                   chat=None if chat is None else ChatInfo.from_dict(chat, f"{where}.chat"))


@dataclasses.dataclass(frozen=True)
class ChatInfo:
    """The manifest's ``tokens.chat`` entry: how a chat dataset's conversations were rendered and masked."""

    template_sha256: str = checked(_matches(_SHA256, "a hex sha256"))
    """Hex sha256 of the chat template's text."""
    train_on: str = checked(rule(lambda v: v in ("generation", "all"), "is not 'generation' or 'all'"))
    """``generation`` (the tokens of the template's ``{% generation %}`` blocks) or ``all``."""
    trained_tokens: int = checked(count)
    """Tokens whose loss mask is set, in all shards."""
    longest: int = checked(count)
    """Tokens of the longest conversation (a Loader refuses a ``seq_len`` it does not fit: never cut)."""
    mask: str = MASK_FORMAT
    """The loss mask files' format (:data:`fastio.formats.token_mask.MASK_FORMAT`, the one this fastio reads)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ChatInfo:
        """The ``chat`` entry; DatasetError naming ``where`` and the field (``mask``: required, this fastio's)."""
        values = _read(cls, data, where)
        if "mask" not in data:
            raise DatasetError(f"{where} lacks mask")
        if data["mask"] != MASK_FORMAT:
            raise DatasetError(f"{where}.mask: {data['mask']!r}: this fastio reads loss masks {MASK_FORMAT!r}")
        return cls(**values, mask=data["mask"])


@dataclasses.dataclass(frozen=True)
class ImageTextInfo:
    """The manifest's ``image_text`` entry of an image-text dataset (``fastio convert --image-field``,
    :mod:`fastio.convert.image_text`): its vocabulary, so that a model sizes its token embedding from the dataset
    (:attr:`embedding_size`), and its tokens, all and trained. Optional: a dataset converted before fastio recorded
    it has none (:attr:`Manifest.image_text` None: not known)."""

    vocab_size: int | None = checked(count, default=None)
    """Ids of the tokenizer it was converted with: its largest id + 1, added tokens (the image token) included
    (None: not known)."""
    max_id: int | None = checked(count, default=None)
    """The largest id of the samples' ``tokens.i32`` (None: not known, or no sample holds a token)."""
    tokenizer_sha256: str | None = checked(_matches(_SHA256, "a hex sha256"), default=None)
    """Hex sha256 of the bytes of the tokenizer file the conversations were tokenized with, by the rule of
    :attr:`TokenInfo.tokenizer_sha256` (None: not known: converted before fastio recorded it)."""
    total_tokens: int | None = checked(count, default=None)
    """Tokens of all the samples' ``tokens.i32`` (None: not known: converted before fastio counted them)."""
    trained_tokens: int | None = checked(count, default=None)
    """Tokens whose loss mask (``mask.bits``) is set, in all the samples, as :attr:`ChatInfo.trained_tokens` counts
    a chat dataset's (None: not known: converted before fastio counted them)."""

    @property
    def embedding_size(self) -> int | None:
        """Rows a model's token embedding needs (:func:`embedding_size`)."""
        return embedding_size(self.vocab_size, self.max_id)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def joined(self, other: ImageTextInfo) -> ImageTextInfo:
        """The record of a dataset of this one's samples and ``other``'s (parts merged): the same vocabulary, the
        larger of the largest ids, the tokenizer's checksum where both record it and the sums of their token counts
        where both count them (None where one does not: not known for all the samples); ValueError naming both
        vocabulary sizes, or both checksums, where they differ."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"image_text.vocab_size: {other.vocab_size} where another part records "
                             f"{self.vocab_size} (the parts were converted with other tokenizers)")
        mine, theirs = self.tokenizer_sha256, other.tokenizer_sha256
        if None not in (mine, theirs) and mine != theirs:
            raise ValueError(f"image_text.tokenizer_sha256: {theirs} where another part records {mine} (the parts "
                             "were converted with other tokenizers)")
        ids = [i for i in (self.max_id, other.max_id) if i is not None]
        return ImageTextInfo(self.vocab_size, max(ids, default=None), mine if mine == theirs else None,
                             _sum_known(self.total_tokens, other.total_tokens),
                             _sum_known(self.trained_tokens, other.trained_tokens))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ImageTextInfo:
        """The ``image_text`` entry; DatasetError naming ``where`` and the field (a ``max_id`` outside the
        vocabulary among them)."""
        values = _read(cls, data, where)
        _check_in_vocabulary(values.get("max_id"), values.get("vocab_size"), f"{where}.max_id")
        return cls(**values)


def _sum_known(a: int | None, b: int | None) -> int | None:
    """Two parts' counts added; None where either is not known."""
    return None if a is None or b is None else a + b


def _check_max_id(value: int | None, dtype: str, eos: int, vocab: int | None, where: str) -> None:
    """The ``tokens`` entry's largest id (None: absent) fits the token type, is at least ``eos`` (every document ends
    with it) and inside the vocabulary; DatasetError naming ``where``."""
    if value is None:
        return
    if value > _TOKEN_LIMITS[dtype]:
        raise DatasetError(f"{where}: {value} does not fit {dtype}")
    if value < eos:
        raise DatasetError(f"{where}: {value} is below eos_id {eos}, which ends every document")
    _check_in_vocabulary(value, vocab, where)


def _check_in_vocabulary(value: int | None, vocab: int | None, where: str) -> None:
    """A largest id (None: not known) inside a vocabulary of ``vocab`` ids (None: not known); DatasetError naming
    ``where``."""
    if value is not None and vocab is not None and value >= vocab:
        raise DatasetError(f"{where}: {value} is outside the vocabulary of {vocab} {agree(vocab, 'id')}")


def embedding_size(vocab_size: int | None, max_id: int | None) -> int | None:
    """Rows a model's token embedding needs: ``vocab_size`` where known, else the largest id + 1 (None: neither is
    known)."""
    return vocab_size if vocab_size is not None else None if max_id is None else max_id + 1


def _read(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``cls``'s checked fields of manifest entry ``data`` (:func:`fastio.checks.read_checked`); DatasetError naming
    ``where`` and the field: ``FILE: shards[3].samples: -1 is negative``, ``FILE: index lacks sha256``."""
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: is {_kind(data)}, not an object")
    return read_checked(cls, data, complain=lambda key, value, problem: DatasetError(f"{where}.{key}: {value!r} "
                                                                                    f"{problem}"),
                        lacks=lambda keys: DatasetError(f"{where} lacks {', '.join(keys)}"))


_OPTIONAL_KEYS = ("kind", "tokens", "image_text", "index", "probes", "image_field", "image_fields", "field_counts",
                  "label_field", "label_map", "label_rule", "skipped", "source", "convert_options", "split", "video_codecs")
"""The manifest's optional keys: written when set (or named in :attr:`Manifest.nulls`), absent otherwise."""

_ATTRIBUTES = {"source": "converted_from"}
"""JSON keys whose :class:`Manifest` field has another name (``source`` is a mixture's member in fastio's
Python; the manifest's key keeps its spelling, so old manifests stay readable and new ones byte-identical)."""


def _attribute(key: str) -> str:
    """The :class:`Manifest` field of JSON key ``key``."""
    return _ATTRIBUTES.get(key, key)


def _json_key(attribute: str) -> str:
    """The JSON key of :class:`Manifest` field ``attribute``."""
    return next((k for k, a in _ATTRIBUTES.items() if a == attribute), attribute)


@dataclasses.dataclass(frozen=True, eq=True)
class Manifest:
    """A dataset's manifest: what :func:`make_manifest` builds and :func:`load_manifest` returns, written by
    :func:`write_manifest` (:meth:`to_json` is its one serialisation). Read through its fields, never by the JSON
    object's string keys, so the schema has one home. Optional fields are None when the manifest lacks them."""

    name: str | None
    """The dataset's name (shards are ``NAME-NNNNNN.tar``, or ``.bin`` for tokens)."""
    shards: list[ShardRecord]
    """The shard records, in order."""
    fields: list[str]
    """Every field some sample has (sorted)."""
    total_samples: int
    """Samples in all shards."""
    total_bytes: int
    """Bytes of all shards (a manifest without the key: their sum)."""
    format_version: int = 1
    """The format version it was written with (:func:`format_version`)."""
    fastio_version: str | None = None
    """The fastio that wrote it."""
    kind: str = "samples"
    """What the dataset holds: ``samples`` (WebDataset tars) or ``tokens`` (Megatron ``.bin``/``.idx``)."""
    tokens: TokenInfo | None = None
    """A token dataset's token type, end-of-document id and counts (None: a dataset of samples)."""
    image_text: ImageTextInfo | None = None
    """An image-text dataset's vocabulary (None: another kind of dataset, or one converted before it was recorded)."""
    index: IndexRecord | None = None
    """The consolidated sample index (None: a dataset opened from its ``.idx`` files)."""
    probes: IndexRecord | None = None
    """The probe table of the samples' video and audio files (:data:`fastio.formats.media.PROBES_NAME`, written by
    ``fastio index``; None: none, a converted dataset's probes are its ``probe.json`` fields)."""
    image_field: str | None = None
    """The main image field (None: no images, or unknown)."""
    image_fields: list[str] | None = None
    """Every image field, the main one first (None or empty: not recorded; tell them by suffix)."""
    field_counts: dict[str, int] | None = None
    """Samples having each field (recorded by ``fastio index``; None: not recorded)."""
    label_field: str | None = None
    """The field holding each sample's integer label (ASCII decimal), if any."""
    label_map: dict[str, int] | None = None
    """Class name to label, for a source that named its classes."""
    label_rule: str | None = None
    """How a table's labels were read (:data:`fastio.formats.labels.LABEL_RULES`)."""
    skipped: list[dict[str, str]] | None = None
    """What the writer left out, each ``{path, reason}`` (None: the writer keeps no such list)."""
    converted_from: dict[str, Any] | None = None
    """What the dataset was made from (format, path, ...): JSON key ``source``."""
    convert_options: dict[str, Any] | None = None
    """The options of the conversion that wrote it."""
    split: dict[str, Any] | None = None
    """``{name, of}`` for one split of a ``split`` DEST."""
    video_codecs: dict[str, dict[str, int]] | None = None
    """Per codec of the samples' videos (``h264``, ``vp9``, as probed): ``{"count": samples, "first": the first
    one's sample index}``, so a Loader tells without reading a probe whether its decoder reads them all (written by
    convert and index when a sample has a video; None: no video, or written before it was recorded)."""
    nulls: frozenset[str] = frozenset()
    """Optional keys written as JSON ``null`` (a writer naming a key it has no value for, e.g. convert's
    ``label_map`` for a source without class names): kept, so that a manifest's bytes say what they said."""

    def __repr__(self) -> str:
        return f"Manifest(name={self.name!r}, samples={self.total_samples}, shards={len(self.shards)})"

    @property
    def image_order(self) -> tuple[str, ...]:
        """The image fields a sample's image is read from by the image pipelines (the first it has): the main one,
        then the others (a dataset may mix formats; DALI decodes by content); empty without an image field."""
        if self.image_field is None:
            return ()
        others = self.image_fields or [f for f in self.fields if is_image_field(f)]
        return (self.image_field, *[f for f in others if f != self.image_field])

    @cached_property
    def fingerprint(self) -> str:
        """See :func:`fingerprint`."""
        return fingerprint(self.shards)

    @cached_property
    def masks_fingerprint(self) -> str:
        """See :func:`masks_fingerprint`."""
        return masks_fingerprint(self.shards)

    @property
    def tokenizer_sha256(self) -> str | None:
        """The checksum of the tokenizer file a token or image-text dataset was tokenized with
        (:attr:`TokenInfo.tokenizer_sha256`, :attr:`ImageTextInfo.tokenizer_sha256`; an image-text dataset converted
        before that recorded it: its ``convert_options``'
        :func:`~fastio.formats.image_text.options_tokenizer_sha256`; None: not recorded, or a dataset of samples)."""
        info = self.tokens or self.image_text
        recorded = None if info is None else info.tokenizer_sha256
        return recorded if recorded is not None else options_tokenizer_sha256(self.convert_options)

    @property
    def vocab_size(self) -> int | None:
        """The ids of the tokenizer a token or image-text dataset was tokenized with (:attr:`TokenInfo.vocab_size`,
        :attr:`ImageTextInfo.vocab_size`; None: not recorded, or a dataset of samples)."""
        info = self.tokens or self.image_text
        return None if info is None else info.vocab_size

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of ``manifest.json``."""
        out: dict[str, Any] = {
            "format": FORMAT, "format_version": self.format_version, "fastio_version": self.fastio_version,
            "name": self.name, "shards": [s.as_dict() for s in self.shards], "total_samples": self.total_samples,
            "total_bytes": self.total_bytes, "fields": list(self.fields)}
        for key in _OPTIONAL_KEYS:
            value = getattr(self, _attribute(key))
            if key == "kind" and value == "samples":
                value = None
            if value is not None:
                out[key] = value.as_dict() if isinstance(value, (TokenInfo, ImageTextInfo, IndexRecord)) else value
            elif key in self.nulls:
                out[key] = None
        return out

    def to_json(self) -> bytes:
        """The bytes of ``manifest.json`` (the one serialisation: sorted keys, two-space indent, a final newline)."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """The manifest of a JSON object that :func:`_validate` has passed."""
        optional = {_attribute(k): data.get(k) for k in _OPTIONAL_KEYS
                    if k not in ("kind", "tokens", "image_text", "index", "probes")}
        tokens, image_text = data.get("tokens"), data.get("image_text")
        index, probes = data.get("index"), data.get("probes")
        shards = shard_records(data)
        return cls(name=data.get("name"), shards=shards, fields=list(data["fields"]),
                   total_samples=data["total_samples"],
                   total_bytes=data.get("total_bytes", sum(s.bytes for s in shards)),
                   format_version=data["format_version"], fastio_version=data.get("fastio_version"),
                   kind=data.get("kind", "samples"),
                   tokens=None if tokens is None else TokenInfo.from_dict(tokens, "tokens"),
                   image_text=None if image_text is None else ImageTextInfo.from_dict(image_text, "image_text"),
                   index=None if index is None else IndexRecord.from_dict(index, "index"),
                   probes=None if probes is None else IndexRecord.from_dict(probes, "probes"),
                   nulls=frozenset(k for k in _OPTIONAL_KEYS if k in data and data[k] is None), **optional)


def format_version(shards: list[ShardRecord], kind: str = "samples") -> int:
    """The manifest format version a dataset needs: 3 for tokens, 2 when a shard lives outside
    ``DEST/shards/``, else 1."""
    if kind == "tokens":
        return 3
    return 2 if any(s.location is not None or s.idx_location is not None for s in shards) else 1


def make_manifest(*, name: str, shards: list[ShardRecord], fields: list[str], index: IndexRecord | None = None,
                  **optional: Any) -> Manifest:
    """A manifest for ``shards`` (in order) whose samples have ``fields``, with the consolidated ``index``
    if one was written; ``optional`` sets :class:`Manifest`'s optional fields (``image_field``, ``label_field``,
    ``label_map``, ``converted_from``, ``skipped``, ...; a token dataset: ``kind="tokens"`` and ``tokens=TokenInfo(...)``;
    an image-text dataset: ``image_text=ImageTextInfo(...)``).
    One given as None is written as ``null``. A ``ValueError`` names a key the manifest does not have."""
    unknown = sorted(set(optional) - {_attribute(k) for k in _OPTIONAL_KEYS})
    if unknown:
        raise ValueError(f"make_manifest: {', '.join(unknown)} is not a manifest field")
    nulls = frozenset(_json_key(k) for k, v in optional.items() if v is None)
    if optional.get("kind") is None:
        optional.pop("kind", None)
    return Manifest(name=name, shards=list(shards), fields=sorted(fields), index=index,
                    total_samples=sum(s.samples for s in shards), total_bytes=sum(s.bytes for s in shards),
                    format_version=format_version(shards, optional.get("kind", "samples")),
                    fastio_version=__version__, nulls=nulls, **optional)


def write_manifest(dest: Path, manifest: Manifest) -> None:
    """Validate ``manifest`` as a reader would, then publish ``DEST/manifest.json`` atomically."""
    path = Path(dest) / MANIFEST_NAME
    try:
        _validate(manifest.as_dict(), str(path))
    except DatasetError as err:  # a writer's bug or bad fields: a ValueError for the caller
        raise ValueError(str(err)) from None
    atomic_write_bytes(path, manifest.to_json())


LOOK_AT = 2000
"""Entries of a folder (or objects below a prefix) looked at to tell what it holds."""


def not_a_dataset(dest: Path) -> DatasetError:
    """The error for a local DEST without a manifest: a file, an unfinished conversion (its marker: run it again), a
    folder of tar shards, of Megatron pairs (a pair's file or data prefix too) or of images, a brace pattern or glob
    of tars (naming the command that makes it a dataset), a missing folder, or else an interrupted conversion."""
    if dest.is_file():
        owner = _dataset_of_file(dest)
        if owner is not None:
            return file_of_dataset(dest, owner)
        if dest.suffix.lower() == ".tar":
            return tar_not_dataset(dest, dest.parent)
    if dest.name == SHARDS_DIR and dest.is_dir() and (dest.parent / MANIFEST_NAME).is_file():
        return file_of_dataset(dest, dest.parent, "folder")  # not `fastio index`: it refuses that folder
    pairs = _megatron_folder(dest)
    if pairs is not None and not (dest / MARKER_NAME).is_file():
        what = "a folder of Megatron .bin/.idx pairs" if pairs == dest else (
            "a file of a Megatron .bin/.idx pair" if dest.is_file() else "a Megatron data prefix")
        return pairs_not_dataset(dest, pairs, what)
    if dest.is_file():
        return file_not_dataset(dest)
    if not dest.is_dir():
        return shard_pattern(str(dest), lambda folder: (Path(folder) / MANIFEST_NAME).is_file()) or \
            _missing_split(dest) or no_such_dataset(dest, _folders(dest.parent))
    unfinished = unfinished_run(dest)
    if unfinished is not None:  # not fastio index's advice: the shards written so far are part of the source
        return unfinished
    datasets = [n for n in _folders(dest)[:64] if _is_dataset(dest / n)]
    if datasets:  # before the tars: a dataset indexed in place holds its tars
        return holds_datasets(dest, "dataset", datasets)
    names = _names(dest)
    holds = holds_of(names)
    if "tar" in holds:
        return tars_not_dataset(dest)
    if "image" in holds:
        return images_not_dataset(dest)
    media = media_not_dataset(dest, names)
    if media is not None:
        return media
    if not any(os.scandir(dest)):
        return empty_not_dataset(dest)
    return no_dataset(dest)


def _missing_split(dest: Path) -> DatasetError | None:
    """The error for a missing folder ``dest`` whose parent is a DEST converted with ``split``: the split is not one
    its ``splits.json`` lists (naming those), or is and its folder was removed. None for any other folder."""
    try:
        names = split_names(dest.parent)
    except DatasetError:  # a splits.json that is not fastio's: the folder is just missing
        return None
    return missing_split(dest, dest.parent, dest.name, names)


def missing_split(dest: str | Path, parent: str | Path, name: str, names: Sequence[str] | None) -> DatasetError | None:
    """The error for a missing folder (or an empty ``s3://`` prefix) ``dest``, named ``name`` in ``parent``, a DEST
    converted with ``split`` whose ``splits.json`` lists ``names`` (None: ``parent`` is no such DEST, and this is
    None too): the split is not one it lists (naming those), or is and its folder was removed."""
    if names is None:
        return None
    if name in names:
        return DatasetError(f"{dest}: a split {str(parent).rstrip('/')}/{SPLITS_NAME} lists, but its folder is "
                            "missing (removed or moved?): convert the source again")
    return DatasetError(f"{dest}: no split {name!r} in {parent} (its {SPLITS_NAME} lists {', '.join(names)})")


def no_dataset(dest: str | Path) -> DatasetError:
    """The error for a folder (or prefix) without a manifest that holds nothing fastio names."""
    return DatasetError(f"{dest}: not a fastio dataset (no {MANIFEST_NAME}; an interrupted conversion?)")


def empty_not_dataset(dest: str | Path) -> DatasetError:
    """The error for an empty folder (or an empty bucket) given as a dataset."""
    return DatasetError(f"{dest}: an empty folder, not a dataset: give the folder `fastio convert` or "
                        "`fastio index` made")


def no_such_dataset(dest: str | Path, beside: Sequence[str]) -> DatasetError:
    """The error for a missing dataset folder, or an ``s3://`` prefix with no object below it (``beside``: the
    folders of its parent), naming the one whose name is nearest (a typo's), if any."""
    parent, _, name = str(dest).rstrip("/").rpartition("/")
    name = dest.name if isinstance(dest, Path) else name
    near = difflib.get_close_matches(name, [n for n in beside if not n.startswith(".")][:LOOK_AT], n=1)
    if not near:
        return DatasetError(f"{dest}: no such dataset directory")
    return DatasetError(f"{dest}: no such dataset directory (did you mean "
                        f"{Path(dest).parent / near[0] if isinstance(dest, Path) else f'{parent}/{near[0]}'}?)")


def images_not_dataset(dest: str | Path) -> DatasetError:
    """The error for a folder (or an ``s3://`` prefix) of images given as a dataset: the command that converts it
    (from a local copy of a prefix: ``fastio convert`` reads an image folder from disk)."""
    if isinstance(dest, Path):
        return DatasetError(f"{dest}: a folder of images, not a dataset: convert it with "
                            f"`fastio convert {shlex.quote(str(dest))} DEST`, then give DEST")
    return DatasetError(f"{dest}: a folder of images, not a dataset: copy it to a local folder and convert that with "
                        "`fastio convert FOLDER DEST`, then give DEST")


def media_not_dataset(dest: str | Path, names: Sequence[str]) -> DatasetError | None:
    """The error for a folder (or an ``s3://`` prefix) of videos or audio files (files of these ``names``) given as
    a dataset: what was found, the command that converts it and the pipeline that reads the result; None when it
    holds neither."""
    media = media_of(names)
    if media is None:
        return None
    what, found, pipeline = media
    convert = (f"convert it with `fastio convert {shlex.quote(str(dest))} DEST`" if isinstance(dest, Path)
               else "copy it to a local folder and convert that with `fastio convert FOLDER DEST`")
    return DatasetError(f"{dest}: a folder of {what} ({found} files), not a dataset: {convert}, then read DEST with "
                        f"fastio.{pipeline} (docs/media.md)")


def media_of(names: Sequence[str]) -> tuple[str, str, str] | None:
    """What files of these ``names`` (the first :data:`LOOK_AT`) are when videos or audio: ``("videos",
    ".mp4/.webm", "VideoClips")`` (the suffixes found, the pipeline that reads them), or ``("audio", ...,
    "AudioClips")``; None for neither."""
    for what, pipeline, holds in (("videos", "VideoClips", is_video_field), ("audio", "AudioClips", is_audio_field)):
        found = sorted({"." + n.rsplit(".", 1)[-1].lower() for n in names[:LOOK_AT] if "." in n and holds(n)})
        if found:
            return what, "/".join(found), pipeline
    return None


def holds_datasets(dest: str | Path, what: str, names: Sequence[str]) -> DatasetError:
    """The error for a folder (or prefix) ``dest`` that holds datasets, not one: ``what`` ``names`` (the ``split``s
    its ``splits.json`` lists, or the ``dataset``s of its sub-folders), the first 8 of them offered to open."""
    shown, more = list(names[:8]), len(names) - len(names[:8])
    children = " or ".join(str(dest / n if isinstance(dest, Path) else f"{str(dest).rstrip('/')}/{n}") for n in shown)
    listed = ", ".join(shown) + (f" and {more} more" if more else "")
    return DatasetError(f"{dest}: holds the {agree(len(names), what)} {listed}, not one dataset: open {children}"
                        + (" or another" if more else ""))


def file_of_dataset(given: str | Path, owner: str | Path, what: str | None = None) -> DatasetError:
    """The error for a file of a dataset (its manifest, a shard; or ``what`` else: its ``shards/`` folder) given
    where the dataset is wanted: names it."""
    what = what or ("shard" if str(given).lower().endswith((".tar", ".bin", ".idx")) else "file")
    return DatasetError(f"{given}: a {what} of the dataset {owner}: give the dataset folder")


def tar_not_dataset(given: str | Path, folder: str | Path) -> DatasetError:
    """The error for one tar shard (of no dataset) given as a dataset: the command that makes its folder one."""
    return DatasetError(f"{given}: a tar shard, not a dataset: a dataset is a folder; make the folder of shards one "
                        f"with `fastio index {shlex.quote(str(folder))}`, then give that folder")


def file_not_dataset(given: str | Path) -> DatasetError:
    """The error for a file (of no dataset, not a tar) given as a dataset."""
    return DatasetError(f"{given}: a file, not a dataset: a dataset is a folder made by `fastio convert` or "
                        "`fastio index`")


def pairs_not_dataset(dest: str | Path, pairs: str | Path, what: str) -> DatasetError:
    """The error for Megatron ``.bin``/``.idx`` pairs without a manifest (``what`` ``dest`` is: their folder, a
    pair's file, a data prefix): the command that makes their folder ``pairs`` a token dataset."""
    return DatasetError(f"{dest}: {what} without a {MANIFEST_NAME}, not yet a dataset: make "
                        f"{'it' if pairs == dest else 'its folder'} one with "
                        f"`fastio index {shlex.quote(str(pairs))} --eos-id N` "
                        "(N: the id that ends every document), then give that folder")


def holds_pairs(names: Collection[str]) -> bool:
    """Whether a folder of these (not hidden) names holds a Megatron pair: ``X.bin`` beside ``X.idx``."""
    return any(n.endswith(".bin") and f"{n[:-4]}.idx" in names for n in names)


def tars_not_dataset(dest: str | Path) -> DatasetError:
    """The error for a folder (or prefix) of tar shards without a manifest: the command that makes it a dataset."""
    return DatasetError(f"{dest}: tar shards without a {MANIFEST_NAME}, not yet a dataset: make it one with "
                        f"`fastio index {shlex.quote(str(dest))}`")


def unfinished_run(dest: Path) -> DatasetError | None:
    """The error for a folder without a manifest that an unfinished run wrote (its shards are part of the source only):
    DEST holding parts not merged yet (a killed merge's marker beside them, or none), or the run's marker, or a split
    folder of an unfinished conversion (:func:`unfinished_split`); None for any other folder."""
    parts = (dest / PARTS_DIR).is_dir()
    if (dest / MARKER_NAME).is_file() and parts:  # a merge's: the parts are complete, and stay until it is
        return DatasetError(f"{dest}: an unfinished fastio merge (killed or stopped: {MARKER_NAME} without "
                            f"{MANIFEST_NAME}), not a dataset; run `fastio merge {dest}` again to finish it")
    if parts:
        return DatasetError(f"{dest}: parts of a --part K/N run ({PARTS_DIR}/), not merged yet, not a dataset; "
                            f"merge them with `fastio merge {dest}`")
    if (dest / MARKER_NAME).is_file():
        return unfinished_marked(dest, _read_head(dest / MARKER_NAME))
    return unfinished_split(dest)


def unfinished_marked(dest: str | Path, marker: bytes) -> DatasetError:
    """The error for a folder (or prefix) holding a run's marker (``marker``: its first bytes, which name the
    command) and no manifest: the run to finish."""
    what = "fastio index" if marker.startswith(b"fastio index") else "fastio convert"
    return DatasetError(f"{dest}: an unfinished {what} (killed or stopped: {MARKER_NAME} without {MANIFEST_NAME}), "
                        f"not a dataset; run the same {what} again to finish it")


def unfinished_split(dest: Path) -> DatasetError | None:
    """The error for a split folder (``DEST/train``) of an unfinished ``fastio convert``: its DEST holds the run's
    marker and neither a manifest nor a split list yet. None for any other folder."""
    run = dest.parent
    if ((run / MARKER_NAME).is_file() and _read_head(run / MARKER_NAME).startswith(b"fastio convert")
            and not (run / MANIFEST_NAME).exists() and not (run / SPLITS_NAME).exists()):
        return split_unfinished(dest, run)
    return None


def split_unfinished(dest: str | Path, run: str | Path) -> DatasetError:
    """The error for a split folder (or prefix) ``dest`` of the unfinished ``fastio convert`` into ``run``."""
    return DatasetError(f"{dest}: a split of {run}: an unfinished fastio convert (killed or stopped: {MARKER_NAME} "
                        f"without {SPLITS_NAME}), not a dataset; run the same fastio convert again to finish it")


def _folders(folder: Path) -> list[str]:
    """The names of the folders in ``folder`` but hidden ones, sorted ([] if it cannot be read)."""
    try:
        return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def _is_dataset(folder: Path) -> bool:
    """Whether ``folder`` holds a dataset's manifest or a ``split`` DEST's ``splits.json``."""
    return (folder / MANIFEST_NAME).is_file() or (folder / SPLITS_NAME).is_file()


def _dataset_of_file(file: Path) -> Path | None:
    """The dataset (or --split DEST) a file belongs to: the folder holding it beside a manifest (shards indexed in
    place, the manifest itself) or, for a file of a ``shards/`` folder, that folder's parent with a manifest."""
    for folder in (file.parent, file.parent.parent) if file.parent.name == SHARDS_DIR else (file.parent,):
        if _is_dataset(folder):
            return folder
    return None


def shard_pattern(dest: str, is_dataset: Callable[[str], bool]) -> DatasetError | None:
    """The error for a WebDataset shard spec (``wds/shard-{000..009}.tar``, what other loaders take) or a glob of
    tars given as a dataset (a path or URL), naming the ``fastio index`` command that makes their folder one (or
    the folder, where ``is_dataset(folder)``: it holds a manifest); else None."""
    text = dest
    at = min((text.index(c) for c in "{*?[" if c in text), default=-1)
    if at < 0 or not text.lower().endswith(".tar"):
        return None
    folder = text[:at].rsplit("/", 1)[0] if "/" in text[:at] else "."
    if is_dataset(folder):
        return DatasetError(f"{dest}: a pattern of tar shards, not a dataset: their folder {folder} is one; give it")
    # fastio expands no globs: a glob names the folder, a brace pattern itself (quoted for the shell)
    command = f"fastio index {shlex.quote(text)}" if "{" in text else f"fastio index {shlex.quote(folder)}"
    return DatasetError(f"{dest}: a pattern of tar shards, not a dataset: a dataset is a folder; make its shards one "
                        f"with `{command}`, then give {folder}")


def _megatron_folder(dest: Path) -> Path | None:
    """The folder ``fastio index`` takes where ``dest`` is a folder holding Megatron ``.bin``/``.idx`` pairs
    directly, one file of such a pair, or a Megatron data prefix (what Megatron's ``--data-path`` names:
    ``data/web_text_document``); else None."""
    if dest.is_dir():
        try:
            names = {n for n in os.listdir(dest)[:LOOK_AT] if not n.startswith(".")}
        except OSError:
            return None
        return dest if holds_pairs(names) else None
    stem = dest.with_suffix("") if dest.suffix in (".bin", ".idx") else dest
    return dest.parent if Path(f"{stem}.bin").is_file() and Path(f"{stem}.idx").is_file() else None


def _read_head(path: Path) -> bytes:
    """The first bytes of ``path`` (b"" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(64)
    except OSError:
        return b""


def _names(folder: Path) -> list[str]:
    """The names of the files in a folder and its sub-folders, for :func:`holds_of` (a bounded look; an unreadable
    folder holds nothing)."""
    names: list[str] = []
    try:
        subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        for sub in [folder, *subs][:64]:
            names += os.listdir(sub)[:LOOK_AT]
    except OSError:
        pass
    return names


def holds_of(names: list[str]) -> set[str]:
    """What files of these names are, by suffix: ``tar``, ``image`` (the first :data:`LOOK_AT` names looked at)."""
    found: set[str] = set()
    for name in names[:LOOK_AT]:
        if name.lower().endswith(".tar"):
            found.add("tar")
        elif "." in name and is_image_field(name):
            found.add("image")
    return found


def load_manifest(dest: Path) -> Manifest:
    """Read and validate ``DEST/manifest.json``; raise :class:`DatasetError` naming what is wrong."""
    path = Path(dest) / MANIFEST_NAME
    if not path.is_file():
        raise not_a_dataset(Path(dest))
    unfinished = unfinished_split(Path(dest))  # a split written before its run was killed: the run is not done
    if unfinished is not None:
        raise unfinished
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path}: unreadable manifest ({err})") from None
    _validate(manifest, str(path))
    return Manifest.from_dict(manifest)


def shard_records(data: Mapping[str, Any]) -> list[ShardRecord]:
    """The shard records of a manifest's JSON object that :func:`load_manifest` has validated (not checked again:
    at 10^5 shards every rank would pay for it twice)."""
    return [ShardRecord(*(s[k] for k in _RECORD_KEYS), xxh3_128=s.get("xxh3_128"), location=s.get("location"),
                        idx_location=s.get("idx_location"), tokens=s.get("tokens"), mask_sha256=s.get("mask_sha256"))
            for s in data["shards"]]


def fingerprint(shards: Sequence[ShardRecord]) -> str:
    """Identity of a dataset's content: shard names, counts and checksums, in order (16 hex digits)."""
    h = hashlib.sha256()
    for shard in shards:
        h.update(f"{shard.name}:{shard.samples}:{shard.sha256}\n".encode())
    return h.hexdigest()[:16]


def masks_fingerprint(shards: Sequence[ShardRecord]) -> str:
    """Identity of a chat dataset's loss masks: shard names and ``.mask`` checksums, in order (16 hex digits; what
    :func:`fingerprint` leaves out, :mod:`fastio.read.loss_masks`)."""
    h = hashlib.sha256()
    for shard in shards:
        h.update(f"{shard.name}:{shard.mask_sha256}\n".encode())
    return h.hexdigest()[:16]


# -- splits.json --------------------------------------------------------------------------------------

def write_splits(dest: Path, manifests: Mapping[str, Manifest]) -> None:
    """Publish ``DEST/splits.json`` listing each split's sample count and fingerprint (after their manifests)."""
    splits = {"format": SPLITS_FORMAT,
              "splits": {n: {"samples": m.total_samples, "fingerprint": m.fingerprint} for n, m in manifests.items()}}
    atomic_write_bytes(Path(dest) / SPLITS_NAME, json.dumps(splits, indent=2, sort_keys=True).encode() + b"\n")


def split_names(dest: Path) -> list[str] | None:
    """Split names of a DEST written with ``split`` (sorted), or None for a plain dataset directory."""
    dest = Path(dest)
    path = dest / SPLITS_NAME
    if (dest / MANIFEST_NAME).is_file() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path}: unreadable split list ({err})") from None
    if not isinstance(data, dict) or data.get("format") != SPLITS_FORMAT:
        raise DatasetError(f"{path}: not a fastio split list (format is not {SPLITS_FORMAT!r})")
    splits = data.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise DatasetError(f"{path}: splits: is {_kind(splits)}, not an object naming at least one split")
    for name, info in splits.items():
        if not is_plain_name(name):
            raise DatasetError(f"{path}: splits: {name!r} is not a split name (letters, digits, '_', '-')")
        if not isinstance(info, dict):
            raise DatasetError(f"{path}: splits.{name}: is {_kind(info)}, not an object")
        _count(info.get("samples"), f"{path}: splits.{name}.samples")
        if not isinstance(info.get("fingerprint"), str) or not _FINGERPRINT.fullmatch(info["fingerprint"]):
            raise DatasetError(f"{path}: splits.{name}.fingerprint: {info.get('fingerprint')!r} is not 16 hex digits")
    return sorted(splits)


# -- validation ---------------------------------------------------------------------------------------

def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _count(value: Any, where: str) -> int:
    problem = count(value)
    if problem is not None:
        raise DatasetError(f"{where}: {value!r} {problem}")
    return value


def _optional(manifest: dict[str, Any], key: str, path: str, check, what: str) -> None:
    if key in manifest and manifest[key] is not None and not check(manifest[key]):
        raise DatasetError(f"{path}: {key}: {manifest[key]!r} is not {what}"[:300])


def _str_list(value: Any, item=lambda s: isinstance(s, str)) -> bool:
    return isinstance(value, list) and all(item(v) for v in value)


def _records_valid(shards: list) -> bool:
    """Whether every entry passes :meth:`ShardRecord.from_dict`, checked column by column (a manifest of
    10^5 shards is read by every rank at start-up: this takes a tenth of the time of one entry at a time)."""
    if not all(type(s) is dict and s.keys() >= _RECORD_KEYSET for s in shards):
        return False
    column = {k: [s[k] for s in shards] for k in _RECORD_KEYS}
    for key in ("samples", "bytes"):
        if not {type(v) for v in column[key]} <= {int} or (shards and min(column[key]) < 0):
            return False
    for key, pattern in (("name", _SHARD_NAMES), ("sha256", _SHA256S), ("idx_sha256", _SHA256S)):
        if not all(isinstance(v, str) for v in column[key]) or not pattern.fullmatch("".join(
                v + "\n" for v in column[key])):
            return False
    xxh3 = [s["xxh3_128"] for s in shards if s.get("xxh3_128") is not None]
    if not (all(isinstance(v, str) for v in xxh3) and _XXH3S.fullmatch("".join(v + "\n" for v in xxh3))):
        return False
    tokens = [s["tokens"] for s in shards if s.get("tokens") is not None]
    if not {type(v) for v in tokens} <= {int} or (tokens and min(tokens) < 0):
        return False
    masks = [s["mask_sha256"] for s in shards if s.get("mask_sha256") is not None]
    if not (all(isinstance(v, str) for v in masks) and _SHA256S.fullmatch("".join(v + "\n" for v in masks))):
        return False
    return all(is_location(s[k]) for s in shards for k in ("location", "idx_location") if s.get(k) is not None)


def fastio_json(data: bytes) -> dict | None:
    """``data`` (a ``manifest.json`` or ``splits.json`` file's bytes) parsed, where it is fastio's: a JSON object whose
    format is :data:`FORMAT` or :data:`SPLITS_FORMAT`; else None. Not a check of the rest: what may be replaced as
    fastio's own output."""
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) and found.get("format") in (FORMAT, SPLITS_FORMAT) else None


def _validate(manifest: Any, path: str) -> None:
    """DatasetError naming ``path`` and the first field of ``manifest`` that breaks the schema."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{path}: not a fastio manifest (format is not {FORMAT!r})")
    version = manifest.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise DatasetError(f"{path}: manifest format_version {version!r}, this fastio reads "
                           f"{', '.join(map(str, READ_VERSIONS))}")
    for key in ("shards", "total_samples", "fields"):
        if key not in manifest:
            raise DatasetError(f"{path}: manifest lacks field {key!r}")
    shards = manifest["shards"]
    if not isinstance(shards, list):
        raise DatasetError(f"{path}: shards: is {_kind(shards)}, not a list")
    if not _records_valid(shards):  # the slow way, to name the first bad entry and field
        for i, s in enumerate(shards):
            ShardRecord.from_dict(s, f"{path}: shards[{i}]")
    names = [s["name"] for s in shards]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = next(n for n in names if n in seen or seen.add(n))
        raise DatasetError(f"{path}: shards: {dup} is listed twice")
    total = _count(manifest["total_samples"], f"{path}: total_samples")
    if sum(s["samples"] for s in shards) != total:
        raise DatasetError(f"{path}: total_samples does not equal the sum of shard sample counts")
    if "total_bytes" in manifest:
        _count(manifest["total_bytes"], f"{path}: total_bytes")
    fields = manifest["fields"]
    if not _str_list(fields, is_field_name):
        raise DatasetError(f"{path}: fields: {_kind(fields)} is not a list of field names")
    for key in ("name", "fastio_version", "image_field", "label_field"):
        _optional(manifest, key, path, lambda v: isinstance(v, str), "text")
    _optional(manifest, "image_fields", path, _str_list, "a list of field names")
    _optional(manifest, "field_counts", path, lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and type(i) is int and i >= 0 for k, i in v.items()), "an object of field to sample count")
    _optional(manifest, "label_map", path, lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(i, int) and not isinstance(i, bool) for k, i in v.items()),
        "an object of class name to integer label")
    _optional(manifest, "label_rule", path, lambda v: v in LABEL_RULES, f"one of {', '.join(LABEL_RULES)}")
    _optional(manifest, "skipped", path, lambda v: isinstance(v, list) and all(
        isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("reason"), str) for s in v),
        "a list of {path, reason}")
    for key in ("source", "convert_options", "split"):
        _optional(manifest, key, path, lambda v: isinstance(v, dict), "an object")
    _optional(manifest, "video_codecs", path, lambda v: _codec_counts(v, total), "an object of codec to {count, "
              "first} within the samples")
    for key in ("index", "probes"):
        if manifest.get(key) is not None:
            IndexRecord.from_dict(manifest[key], f"{path}: {key}")
    _validate_kind(manifest, path)


def _codec_counts(value: Any, total: int) -> bool:
    """Whether ``value`` is a ``video_codecs`` entry: codec -> ``{count, first}``, within ``total`` samples."""
    return isinstance(value, dict) and all(
        isinstance(c, str) and isinstance(r, dict) and r.keys() == {"count", "first"} and type(r["count"]) is int
        and type(r["first"]) is int and 0 < r["count"] <= total and 0 <= r["first"] < total for c, r in value.items())


def _validate_kind(manifest: dict[str, Any], path: str) -> None:
    """The kind's rules: shard suffixes; for tokens, the ``tokens`` entry and per-shard token counts."""
    kind = manifest.get("kind", "samples")
    if kind not in KINDS:
        raise DatasetError(f"{path}: kind: {kind!r} is not one of {', '.join(KINDS)}")
    suffix = KINDS[kind]
    wrong = next((s["name"] for s in manifest["shards"] if not s["name"].endswith(suffix)), None)
    if wrong is not None:
        raise DatasetError(f"{path}: shards: {wrong} is not a {suffix} shard, as a dataset of {kind} has")
    if kind != "tokens":
        if manifest.get("tokens") is not None:
            raise DatasetError(f"{path}: tokens: only a dataset of kind 'tokens' has it")
        if manifest.get("image_text") is not None:
            ImageTextInfo.from_dict(manifest["image_text"], f"{path}: image_text")
        return
    if manifest.get("image_text") is not None:
        raise DatasetError(f"{path}: image_text: a dataset of kind 'tokens' has no image-text samples")
    if manifest.get("format_version", 0) < 3:
        raise DatasetError(f"{path}: kind 'tokens' needs format_version 3, the manifest says "
                           f"{manifest.get('format_version')}")
    info = TokenInfo.from_dict(manifest.get("tokens"), f"{path}: tokens")
    counts = [s.get("tokens") for s in manifest["shards"]]
    if None in counts:
        raise DatasetError(f"{path}: shards[{counts.index(None)}] lacks tokens (a token dataset's shards count them)")
    if sum(counts) != info.total_tokens:
        raise DatasetError(f"{path}: tokens.total_tokens does not equal the sum of shard token counts")


def rebuild_hint(manifest: Manifest, root: str | Path) -> str:
    """What makes the dataset at ``root`` again after its shards changed: for shards indexed by ``fastio index``, the
    exact command that replaces the index (the ``.idx`` files fastio wrote too); for a conversion, running it again."""
    source = manifest.converted_from or {}
    path = source.get("path")
    if source.get("format") == "megatron":
        return "re-run `fastio index` of its .bin/.idx pairs with --eos-id and --overwrite"
    if source.get("format") != "webdataset" or not isinstance(path, str):
        return "convert the source again (fastio convert with --overwrite)"
    root = root if isinstance(root, str) and "://" in root else os.path.abspath(root)
    return f"re-run `{reindex_command(path, root, in_place=bool(source.get('indexed_in_place')))}`"


def reindex_command(path: str, root: str, *, in_place: bool) -> str:
    """``fastio index SOURCE [--dest ROOT] --overwrite`` for an index of ``path`` (as given then) into ``root``. In
    place, a relative SOURCE is spelt from ``root`` (SOURCE's folder): the folder itself, or its tar or brace pattern
    of tars; with ``--dest``, fastio records SOURCE absolute (a relative one, recorded by a fastio before that,
    cannot be found again and is shown as given)."""
    absolute = "://" in path or os.path.isabs(path)
    if in_place and not absolute:
        plain = os.path.normpath(path)
        cut = plain[:plain.index("{")] if "{" in plain else plain
        tail = plain[cut.rfind("/") + 1:]
        folder = tail in (".", "..") or tail == os.path.basename(root)
        path = root if folder else f"{root}/{tail}"
    return f"fastio index {shlex.quote(path)}" + ("" if in_place else f" --dest {shlex.quote(root)}") + " --overwrite"
