"""``fastio convert vlm.jsonl DEST --tokenizer tokenizer.json --chat-template T --image-field images``: image-text
conversations (LLaVA-style) into an image dataset whose samples also hold tokens and a loss mask.

Each JSONL line holds ``image_field`` (a list of 0..n images: paths relative to the JSONL's folder or to the
conversion's ``root``, a path resolving outside it refused, or ``s3://`` URLs) and ``messages_field`` (a
conversation, as a chat conversion reads one), whose text holds one ``image_token`` per image, in order. The JSONL
itself may be an ``s3://`` URL (downloaded to be read; its relative paths name objects under its prefix). The scan
(this module, in the converting process) renders and tokenizes every conversation as a chat conversion does
(:class:`fastio.convert.chat_encode.ChatEncoder`: the template, its ``{% generation %}`` spans, transformers' mask
rule) and refuses, in one line naming the sample (``vlm.jsonl:3``), a line whose image-token count differs from its
image count, an object the store does not answer for, or a path that is not an image. A line with a missing image
(a file, or an object: each object's size is asked in the scan, many at once, :mod:`fastio.convert.objects`) is a
rejected sample, a :class:`~fastio.converters.base.Skip` of the scan named ``vlm.jsonl:3 (img/b.png)``: skipped and
listed, or, with ``on_error="fail"``, the run stopped naming it. With ``max_tokens``, a conversation longer than
that with its images expanded to ``image_seq_len`` (the Loader's measure) stops the run naming it
(``overlong="refuse"``) or is a Skip of the scan (``"drop"``: listed, counted). Every other
sample becomes an :class:`~fastio.converters.base.Entry` with its images (``0.jpg``, ``1.png``, ...: a
:class:`~fastio.converters.base.FileRef`, or a :class:`~fastio.converters.base.UrlRef` that the worker checking it
fetches) and its ``tokens.i32`` and ``mask.bits`` members (:mod:`fastio.formats.image_text`), and
:func:`fastio.convert.run.convert` does the rest as for any image dataset: each image's decode check,
``max_side``, ``max_pixels``, ``on_error`` (an undecodable image skips its sample, listed naming the line and the
file or URL, or stops the run naming it), ``split`` and ``shuffle``, shards, ``.idx``, ``samples.fxi``, manifest,
parts and merge. The manifest's ``convert_options.image_text`` records the tokenizer's and template's checksums and
the image token and its id; its ``image_text`` entry (:class:`~fastio.dataset.manifest.ImageTextInfo`) the
tokenizer's vocabulary size and the largest id of the samples written (per split, per part: a merge keeps the
largest), so that a model sizes its token embedding from the dataset (``manifest.image_text.embedding_size``), and
the tokenizer file's checksum (:func:`~fastio.convert.token_convert.tokenizer_sha256`: a plain or chat dataset of
the same file records the same, and a :class:`fastio.Mixture` compares them), and the samples' tokens, all and
trained (their mask set: the summary prints them). A dataset (a split, a merge of parts) in which no token is
trained is refused before its manifest (:func:`refuse_untrained`, by the chat conversion's rule).

The image token must be one token of the tokenizer (one of its added tokens, encoding to itself alone).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from fastio.checks import check_fields, checked, config_error, one_of, positive_integer, rule
from fastio.convert.chat_encode import ChatEncoder
from fastio.convert.objects import downloaded, object_sizes
from fastio.convert.run import ConvertConfig, ConvertResult, convert
from fastio.convert.token_convert import eos_token_id, load_tokenizer, tokenizer_sha256, vocab_size, with_specials
from fastio.convert.token_convert import refuse_untrained as refuse_chat_untrained
from fastio.converters.base import Entry, FileRef, ScanResult, Skip, UrlRef, image_field_for_suffix, resolve_inside
from fastio.converters.documents import no_field
from fastio.converters.table import read_rows
from fastio.dataset.manifest import ImageTextInfo
from fastio.errors import ConvertError, StorageError
from fastio.formats.chat_template import ChatTemplateError, load_chat_template
from fastio.formats.image_text import (
    MASK_FIELD,
    TOKENS_FIELD,
    decode_sample,
    encode_mask,
    encode_tokens,
    expanded_length,
    image_field_name,
    image_number,
)
from fastio.storage import is_remote, local_or_url, parse_location
from fastio.storage.checksum import sha256_file
from fastio.words import agree, count

__all__ = ["OVERLONG", "ImageTextOptions", "convert_image_text", "refuse_untrained", "scan_image_text"]

_ENCODE_BATCH = 1024
"""Conversations the scan tokenizes at once: each one's encoding (ids, offsets, ...: ~170 bytes a token with
``tokenizers``) lives only while its batch is laid out into ``tokens.i32`` and ``mask.bits`` (4 bytes a token and a
bit), so the scan's memory does not grow with the JSONL's tokens times that."""


def _some_text(v: Any) -> bool:
    return isinstance(v, str) and v != ""


OVERLONG = ("refuse", "drop")
"""What becomes of a conversation longer than ``max_tokens`` (a chat conversion's choices but ``truncate``)."""
_FIELD = rule(_some_text, "must be a field name")
_TOKEN = rule(_some_text, "must be a token's text")


@dataclass(frozen=True)
class ImageTextOptions:
    """What turns a JSONL line into an image-text sample (a ``ValueError`` names a bad parameter)."""

    tokenizer: Path
    """A Hugging Face ``tokenizer.json``."""
    chat_template: Path
    """A chat template with ``{% generation %}`` blocks (a ``.jinja`` file or a ``tokenizer_config.json``)."""
    image_field: str = checked(_FIELD, default="images")
    """The JSONL field holding each line's list of image paths."""
    image_token: str = checked(_TOKEN, default="<image>")
    """The placeholder of one image in the messages' text: one of the tokenizer's added tokens."""
    messages_field: str = checked(_FIELD, default="messages")
    """The JSONL field holding each line's conversation."""
    max_tokens: int | None = checked(positive_integer, default=None)
    """The most tokens a conversation may have in a packed sequence (the training ``seq_len + 1``), each of its
    images counted as ``image_seq_len`` tokens (:func:`fastio.formats.image_text.expanded_length`, the Loader's
    rule); a longer one is handled by ``overlong``. None: no limit here (the Loader refuses a ``seq_len`` below
    the longest)."""
    image_seq_len: int | None = checked(positive_integer, default=None)
    """With ``max_tokens`` (needed there, refused without it): the tokens each image becomes in the Loader
    (:class:`fastio.ImageText`'s ``image_seq_len``)."""
    overlong: str = checked(one_of(OVERLONG, " (an image-text conversion never truncates: the images of the turns cut "
                                             "would be lost)"), default="refuse")
    """A conversation over ``max_tokens``: the run stopped naming it (``refuse``), or left out, listed and counted
    as a skipped line (``drop``); ``drop`` without ``max_tokens``: a ValueError."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        object.__setattr__(self, "chat_template", Path(self.chat_template))
        check_fields(self, config_error)
        if self.overlong != "refuse" and self.max_tokens is None:
            raise ValueError(f"overlong={self.overlong!r} needs max_tokens=N (the most tokens a conversation may "
                             "have; without it no conversation is over)")
        if self.max_tokens is not None and self.image_seq_len is None:
            raise ValueError("max_tokens needs image_seq_len=N (the tokens each image becomes in the Loader: "
                             "fastio.ImageText's image_seq_len)")
        if self.image_seq_len is not None and self.max_tokens is None:
            raise ValueError("image_seq_len needs max_tokens=N (it only counts a conversation's length against it)")


def convert_image_text(config: ConvertConfig, options: ImageTextOptions) -> ConvertResult:
    """Convert the JSONL ``config.source`` of image-text conversations into ``config.dest`` (or one part of it), as
    :func:`fastio.convert.run.convert` converts an image table (see the module docstring)."""
    coder = _Coder(options)
    config = replace(config, extra_options={"image_text": coder.recorded()},
                     tally=lambda: _Tally(coder.vocab_size, coder.tokenizer_sha256, config.source,
                                          options.chat_template))
    return convert(config, scanner=lambda source: scan_image_text(source, options, coder, config.storage_options,
                                                                  config.root))


class _Tally:
    """A dataset's ``image_text`` manifest record (:class:`~fastio.dataset.manifest.ImageTextInfo`): the tokenizer's
    vocabulary size and checksum, the largest id of the samples written and their tokens, all and trained (a
    :class:`~fastio.convert.run.SampleTally`, which refuses a dataset that trains none: :func:`refuse_untrained`)."""

    def __init__(self, vocab_size: int, tokenizer: str, source: Path | str, template: Path):
        self.vocab_size, self.tokenizer, self.max_id = vocab_size, tokenizer, None
        self.source, self.template = source, template
        self.samples = self.tokens = self.trained = 0

    def add(self, fields: dict[str, bytes]) -> None:
        ids, mask = decode_sample(fields[TOKENS_FIELD], fields[MASK_FIELD])
        if ids.size:
            self.max_id = int(ids.max()) if self.max_id is None else max(self.max_id, int(ids.max()))
        self.samples, self.tokens, self.trained = self.samples + 1, self.tokens + ids.size, self.trained + int(mask.sum())

    def refuse(self, split_name: str) -> None:
        refuse_untrained(self.source, split_name, self.template, self.trained, self.samples)

    def manifest_fields(self) -> dict[str, ImageTextInfo]:
        return {"image_text": ImageTextInfo(vocab_size=self.vocab_size, max_id=self.max_id,
                                            tokenizer_sha256=self.tokenizer, total_tokens=self.tokens,
                                            trained_tokens=self.trained)}


def refuse_untrained(source: Any, split_name: str, template: Any, trained: int | None, samples: int) -> None:
    """A ConvertError where a dataset of image-text conversations (``source``'s split ``split_name``, "" without
    splits; a conversion's or a merge's) trains no token of its ``samples``
    (:func:`fastio.convert.token_convert.refuse_untrained`, the chat conversion's rule; ``trained`` None: not known,
    never refused)."""
    refuse_chat_untrained(f"{source} (split {split_name})" if split_name else source, template, "generation", trained,
                          samples,
                          way_out="rename that role in the JSONL or in the template (an image-text conversion trains "
                                  "only those blocks)")


class _Coder:
    """The tokenizer, the template (special tokens filled in as a chat conversion fills them) and the image token."""

    def __init__(self, options: ImageTextOptions):
        self.options = options
        self.tokenizer = load_tokenizer(options.tokenizer)
        try:
            template = load_chat_template(options.chat_template)
        except ChatTemplateError as err:
            raise ConvertError(str(err)) from None
        if not template.has_generation:
            raise ConvertError(f"{options.chat_template}: the chat template marks no {{% generation %}} block, so no "
                               "token would be trained (docs/tokens.md)")
        eos = eos_token_id(self.tokenizer, template.variables.get("eos_token"), options.tokenizer,
                           f"the eos_token of {options.chat_template}")
        self.template = with_specials(template, self.tokenizer, eos, options.tokenizer)
        self.image_id = self._image_id()
        self.vocab_size = vocab_size(self.tokenizer)
        self.tokenizer_sha256 = tokenizer_sha256(options.tokenizer)
        self.encoder = ChatEncoder(self.tokenizer, self.template, "generation", options.messages_field, np.int32)

    def _image_id(self) -> int:
        token, path = self.options.image_token, self.options.tokenizer
        image_id = self.tokenizer.token_to_id(token)
        if image_id is None or self.tokenizer.encode(token, add_special_tokens=False).ids != [image_id]:
            raise ConvertError(f"{path}: image token {token!r} is not one token of the tokenizer (add it as a "
                               "special token, or name one it has with --image-token)")
        if image_id not in self.tokenizer.get_added_tokens_decoder():
            raise ConvertError(f"{path}: image token {token!r} is an ordinary token of the tokenizer's vocabulary, not "
                               "one of its added tokens (text merges it with its neighbours, so the placeholders "
                               "counted would not be those written): add it as a special token, or name one it has "
                               "with --image-token")
        return image_id

    def recorded(self) -> dict[str, Any]:
        """What the manifest's ``convert_options.image_text`` records (a part's plan too: parts must agree)."""
        o = self.options
        return {"tokenizer_sha256": sha256_file(o.tokenizer), "template_sha256": self.template.sha256,
                "template_variables": self.template.rendered_variables, "image_token": o.image_token,
                "image_token_id": self.image_id, "image_field": o.image_field,
                "messages_field": o.messages_field, "train_on": "generation", "tokens_field": TOKENS_FIELD,
                "mask_field": MASK_FIELD,
                **({} if o.max_tokens is None else {"max_tokens": o.max_tokens, "image_seq_len": o.image_seq_len,
                                                   "overlong": o.overlong})}


def scan_image_text(source: Path | str, options: ImageTextOptions, coder: _Coder | None = None,
                    storage_options: dict | None = None, root: Path | None = None) -> ScanResult:
    """The entries of every line of ``source`` (a JSONL file, or its ``s3://`` URL; see the module docstring), its
    relative image paths starting at ``root`` (a local JSONL's; None: its folder); ConvertError naming a refused
    line."""
    coder = coder or _Coder(options)
    root = _root(source, root)
    rows = _rows(source, storage_options)
    wheres = [f"{PurePosixPath(str(source)).name}:{lineno}" for lineno, _ in rows]
    lines = []
    for start in range(0, len(rows), _ENCODE_BATCH):
        stop = start + _ENCODE_BATCH
        lines += _encoded(rows[start:stop], wheres[start:stop], root, options, coder)
    _ask_sizes(lines, wheres, options.image_field, storage_options)
    # line N's key is N - 1 (a blank line's left unused), as messages name it (vlm.jsonl:N)
    entries = [Entry(key=f"{lineno - 1:08d}", fields=tuple(sorted(fields.items())), origin=where, sample=where)
               for (lineno, _), fields, where in zip(rows, lines, wheres) if not isinstance(fields, Skip)]
    description = {"format": "image-text", "path": str(source.resolve()) if isinstance(source, Path) else source,
                   "options": {"image_field": options.image_field, "messages_field": options.messages_field,
                               "image_token": options.image_token}}
    if isinstance(root, Path) and root != source.parent:
        description["options"]["root"] = str(root.resolve())
    return ScanResult(entries=entries, description=description, image_field=None,
                      skipped=[line for line in lines if isinstance(line, Skip)])


def _encoded(rows: list[tuple[int, dict]], wheres: list[str], root: Path | str, options: ImageTextOptions,
             coder: _Coder) -> list[dict[str, Any] | Skip]:
    """Each of ``rows``' fields: its images (:func:`_images`), ``tokens.i32`` and ``mask.bits``, the rows encoded
    in one batch, or the Skip of a line whose image file is missing (:class:`_Missing`); ConvertError naming a
    refused line."""
    missing = next(((where, row) for (_, row), where in zip(rows, wheres) if options.messages_field not in row), None)
    if missing is not None:
        raise no_field(*missing, options.messages_field, "messages_field")
    lengths, ids, mask, _ = coder.encoder.encode(wheres, [row[options.messages_field] for _, row in rows])
    ends = np.cumsum(lengths)
    lines = []
    for i, ((_, row), where) in enumerate(zip(rows, wheres)):
        tokens = ids[ends[i] - lengths[i]:ends[i]]
        placeholders = int(np.count_nonzero(tokens == coder.image_id))
        try:
            fields = _images(row, where, root, options, placeholders)
        except _Missing as missing:
            lines.append(missing.skip)
            continue
        over = _overlong(options, where, int(lengths[i]), placeholders)
        if over is not None:
            lines.append(over)
            continue
        fields[TOKENS_FIELD] = encode_tokens(tokens)
        fields[MASK_FIELD] = encode_mask(mask[ends[i] - lengths[i]:ends[i]])
        lines.append(fields)
    return lines


def _overlong(options: ImageTextOptions, where: str, tokens: int, images: int) -> Skip | None:
    """The Skip of a line whose conversation of ``tokens`` tokens and ``images`` images is over ``max_tokens``
    (its images expanded: :func:`~fastio.formats.image_text.expanded_length`) with ``overlong="drop"``; a
    ConvertError naming it with ``"refuse"``; None where it fits (or there is no limit)."""
    if options.max_tokens is None:
        return None
    length = expanded_length(tokens, images, options.image_seq_len)
    if length <= options.max_tokens:
        return None
    counted = f" with its {count(images, 'image')} counted as image_seq_len {options.image_seq_len} each" if images \
        else ""
    if options.overlong == "refuse":
        raise ConvertError(f"{where}: field {options.messages_field!r}: the conversation has {length} tokens{counted}, "
                           f"more than max_tokens={options.max_tokens} (overlong='drop' handles such conversations)")
    return Skip(where, f"longer than max_tokens={options.max_tokens}, each image counted as image_seq_len "
                       f"{options.image_seq_len} tokens (overlong='drop')")  # one reason: the summary counts them once


def _root(source: Path | str, root: Path | None) -> Path | str:
    """Where ``source``'s relative image paths start: ``root`` (a folder; a local JSONL's only), else the JSONL's
    folder, or its URL's prefix; ConvertError naming a bad ``root``."""
    if root is None:
        return source.parent if isinstance(source, Path) else source.rpartition("/")[0]
    if not isinstance(source, Path):
        raise ConvertError(f"root={str(root)!r}: an image-text JSONL at a URL reads its relative image paths under "
                           "its own prefix")
    if not Path(root).is_dir():
        raise ConvertError(f"root={str(root)!r}: {'a file, not a folder' if Path(root).exists() else 'no such folder'}")
    return Path(root)


def _rows(source: Path | str, storage_options: dict | None) -> list[tuple[int, dict]]:
    """``(line number, row)`` of the JSONL ``source``; one at an ``s3://`` URL is downloaded to be read (messages
    name the URL)."""
    if PurePosixPath(str(source)).suffix.lower() not in (".jsonl", ".ndjson") or (
            isinstance(source, Path) and not source.is_file()):
        raise ConvertError(f"{source}: an image-text conversion reads one JSONL file")
    if isinstance(source, Path):
        return read_rows(source, "jsonl")[1]
    with downloaded(source, storage_options) as path:
        try:
            return read_rows(path, "jsonl")[1]
        except ConvertError as err:
            raise ConvertError(str(err).replace(str(path), source, 1)) from None


def _images(row: dict, where: str, root: Path | str, options: ImageTextOptions, placeholders: int
            ) -> dict[str, Any]:
    """``{"0.jpg": FileRef or URL, ...}`` of a line's images (``root``: the JSONL's folder, or its URL's prefix);
    ConvertError naming the line for a bad list, a count that differs from the placeholders', a path outside
    ``root``, a missing file or one that is not an image. An image at a URL is left as its URL (str), its object
    asked for by :func:`_ask_sizes`."""
    paths = _image_paths(row, where, options.image_field)
    if len(paths) != placeholders:
        by_template = _by_template(placeholders - _written(row.get(options.messages_field), options.image_token),
                                   options.chat_template)
        raise ConvertError(f"{where}: {count(len(paths), 'image')} in {options.image_field!r} but {placeholders} "
                           f"{options.image_token!r} {agree(placeholders, 'placeholder')} in {options.messages_field!r}"
                           f"{by_template}")
    fields: dict[str, Any] = {}
    for n, value in enumerate(paths):
        at = f"{where}: {options.image_field}[{n}]"
        image = _image_url(value, root, at) if _is_url(value, at) or isinstance(root, str) else \
            _image_file(value, root, at, where, f"{options.image_field}[{n}]")
        suffix = PurePosixPath(image if isinstance(image, str) else image.path).suffix
        ext = image_field_for_suffix(suffix)
        if ext is None:
            raise ConvertError(f"{at}: {value} is not an image (suffix {suffix!r})")
        fields[image_field_name(n, ext)] = image
    return fields


def _image_paths(row: dict, where: str, field: str) -> list[str]:
    """The list of image paths of a line's ``field`` (absent: none); ConvertError naming the line and saying what
    the field, or which of its items, is instead (a string, as LLaVA's own JSON holds one image, says how to write
    it)."""
    paths = row.get(field, [])
    if not isinstance(paths, list):
        hint = f" (one image is a list of one: [{json.dumps(paths)}])" if isinstance(paths, str) else ""
        raise ConvertError(f"{where}: field {field!r} is {_what(paths)}, not a list of image paths{hint}")
    for n, path in enumerate(paths):
        if not isinstance(path, str) or not path:
            raise ConvertError(f"{where}: {field}[{n}] is {_what(path)}, not an image path")
    return paths


def _by_template(more: int, template: Path) -> str:
    """Why the rendered placeholders outnumber the messages' own by ``more`` (the template wrote them) or fall short
    of them (the template left out a message holding them), in words; "" where they agree."""
    if more > 0:
        return f" ({more} of them written by the chat template {template}, not in the messages' text)"
    if more < 0:
        return f" ({-more} in the messages' text left out by the chat template {template})"
    return ""


def _written(value: Any, token: str) -> int:
    """How often ``token`` occurs in the strings of ``value`` (a line's messages: their text, content parts too)."""
    if isinstance(value, str):
        return value.count(token)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return sum(_written(v, token) for v in items)


def _what(value: Any) -> str:
    """What a JSON value is, in a message: ``null``, ``an empty string`` or its Python type's name."""
    return "null" if value is None else "an empty string" if value == "" else type(value).__name__


def _is_url(value: str, at: str) -> bool:
    try:
        return is_remote(value)
    except StorageError as err:  # another scheme (http://...)
        raise ConvertError(f"{at}: {err}") from None


class _Missing(Exception):
    """A line's image file or object is not there: the line is a rejected sample (``skip``, an error Skip: listed
    and counted, or, with ``on_error="fail"``, the run stopped naming it, by :func:`fastio.convert.run.convert`)."""

    def __init__(self, where: str, value: str, item: str):
        super().__init__(where)
        self.skip = Skip(f"{where} ({value})", f"{item}: no such image", error=True)


def _image_file(value: str, root: Path, at: str, where: str, item: str) -> FileRef:
    """The image file ``value`` (a path, or a ``file://`` URL) names below ``root``; ConvertError for one outside
    it or a folder, :class:`_Missing` (``where``: the line, ``item``: ``images[n]``) for a missing one."""
    path = root / local_or_url(value)
    outside = resolve_inside(path, root)
    if outside is not None:
        raise ConvertError(f"{at}: {value if value.isprintable() else repr(value)} {outside}")
    if path.is_dir():
        raise ConvertError(f"{at}: {value} is a folder, not an image")
    if not path.is_file():
        raise _Missing(where, value, item)
    return FileRef(str(path))


def _image_url(value: str, root: str, at: str) -> str:
    """The URL of the image ``value`` names: a URL as it is (checked), or a path relative to the URL ``root`` (that of
    a JSONL at a URL), which must stay below it."""
    if value.lower().startswith("file:"):
        raise ConvertError(f"{at}: {value}: a JSONL at a URL names its images by s3:// URLs or by paths under its "
                           "prefix")
    if not _is_url(value, at):
        folder = parse_location(root)
        key = posixpath.normpath(posixpath.join(folder.prefix, value))
        if value.startswith("/") or key == ".." or key.startswith("../") or not key.startswith(
                folder.prefix + "/" if folder.prefix else ""):
            raise ConvertError(f"{at}: {value} resolves outside {root}")
        value = f"s3://{folder.bucket}/{key}"
    try:
        if not parse_location(value).prefix:
            raise ConvertError(f"{at}: {value} names a bucket, not an image")
    except StorageError as err:
        raise ConvertError(f"{at}: {err}") from None
    return value


def _ask_sizes(lines: list[dict[str, Any] | Skip], wheres: list[str], field: str, storage_options: dict | None
               ) -> None:
    """Replace each image URL of ``lines`` by its :class:`UrlRef` (its object's size asked once, many at once:
    :func:`fastio.convert.objects.object_sizes`), and a line with a missing object by its Skip (:class:`_Missing`,
    its first missing one); ConvertError naming the line and the URL of an object the store does not answer for."""
    at = [(i, name, value) for i, fields in enumerate(lines) if not isinstance(fields, Skip)
          for name, value in fields.items() if isinstance(value, str)]
    with closing(object_sizes((url for _, _, url in at), storage_options)) as sizes:
        for i, name, url in at:
            item = f"{field}[{image_number(name)}]"
            try:
                _sized(lines[i], name, url, f"{wheres[i]}: {item}", sizes)
            except _Missing:
                lines[i] = lines[i] if isinstance(lines[i], Skip) else _Missing(wheres[i], url, item).skip


def _sized(fields: dict[str, Any] | Skip, name: str, url: str, where: str, sizes: Iterator[int | None]) -> None:
    """``fields[name]``: the UrlRef of ``url``, its size the next of ``sizes`` (asked even of a line already
    skipped, whose sizes come in turn); ConvertError naming ``where``, :class:`_Missing` for no object."""
    try:
        size = next(sizes)
    except StorageError as err:
        raise ConvertError(f"{where}: {err}") from None
    if size is None:
        raise _Missing(where, url, "")
    if not isinstance(fields, Skip):
        fields[name] = UrlRef(url, size)
