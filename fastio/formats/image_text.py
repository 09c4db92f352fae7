"""The members of an image-text sample (``fastio convert --image-field``, :mod:`fastio.convert.image_text`).

A sample of an image-text dataset holds, beside its key:

- ``0.jpg``, ``1.png``, ...: its images in the order of their placeholders in the text, each field named
  ``N.EXT`` (N from 0, EXT the image's own type: ``jpg``, ``png``, ``webp``, ...), stored as fastio stores images;
- ``tokens.i32``: the conversation's token ids, raw little-endian int32 (so the member's size / 4 is its token
  count); each image is one placeholder token (the image token's id), not yet expanded;
- ``mask.bits``: the loss mask, one bit a token (``numpy.packbits``, little bit order: token i is bit ``i % 8`` of
  byte ``i // 8``), ``ceil(tokens / 8)`` bytes.

So ``samples.fxi`` (its ``size:FIELD`` columns) already holds what a packer plans with, without reading a shard:
a sample's token count is ``size:tokens.i32 / 4`` and its image count the number of ``N.EXT`` fields it has.

Imports nothing of fastio but :mod:`fastio.formats.images`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from fastio.formats.images import is_image_field
from fastio.words import count

__all__ = ["MASK_FIELD", "OPTIONS_KEY", "TOKENS_FIELD", "decode_sample", "encode_mask", "encode_tokens",
           "expanded_length", "image_field_name", "image_number", "is_image_text", "member_problems",
           "options_image_token_id", "options_tokenizer_sha256"]

TOKENS_FIELD = "tokens.i32"
"""The member holding a sample's token ids (little-endian int32)."""
MASK_FIELD = "mask.bits"
"""The member holding a sample's loss mask (one bit a token, little bit order)."""
OPTIONS_KEY = "image_text"
"""The key of the manifest's ``convert_options`` that an image-text conversion records (its image token id, ...)."""
_IMAGE = re.compile(r"(0|[1-9][0-9]*)\.[A-Za-z0-9]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_image_text(convert_options: dict | None) -> bool:
    """Whether a manifest's ``convert_options`` are an image-text conversion's (they record ``image_token_id``)."""
    options = (convert_options or {}).get(OPTIONS_KEY)
    return isinstance(options, dict) and "image_token_id" in options


def options_image_token_id(convert_options: dict | None) -> int | None:
    """The image token's id that an image-text conversion's ``convert_options`` record (``image_text.image_token_id``);
    None for any other dataset's."""
    return int(convert_options[OPTIONS_KEY]["image_token_id"]) if is_image_text(convert_options) else None


def options_tokenizer_sha256(convert_options: dict | None) -> str | None:
    """The hex sha256 of the tokenizer file that an image-text conversion's ``convert_options`` record
    (``image_text.tokenizer_sha256``: ``[size, hex]``, as every image-text conversion wrote it, also before its
    manifest's ``image_text`` entry recorded the hex); None where they hold no such pair."""
    options = (convert_options or {}).get(OPTIONS_KEY)
    pair = options.get("tokenizer_sha256") if isinstance(options, dict) else None
    if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], str) and _SHA256.fullmatch(pair[1]):
        return pair[1]
    return None


def expanded_length(tokens: Any, images: Any, image_seq_len: int) -> Any:
    """A sample's length in a packed sequence: its ``tokens`` with each of its ``images`` (one image token each)
    expanded to ``image_seq_len`` (ints or numpy arrays of them): what the Loader packs and the conversion's
    ``max_tokens`` counts."""
    return tokens + images * (image_seq_len - 1)


def image_field_name(number: int, ext: str) -> str:
    """The field of a sample's image ``number`` of type ``ext`` (``0.jpg``)."""
    return f"{number}.{ext}"


def image_number(field: str) -> int | None:
    """N of an image field ``N.EXT``; None for any other field."""
    return int(field.split(".", 1)[0]) if _IMAGE.fullmatch(field) and is_image_field(field) else None


def encode_tokens(ids: np.ndarray) -> bytes:
    """``tokens.i32``'s bytes of ``ids`` (ValueError naming an id outside int32)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise ValueError(f"tokens.i32: id {int(ids.max() if ids.max() > 0 else ids.min())} does not fit int32")
    return ids.astype("<i4").tobytes()


def encode_mask(mask: np.ndarray) -> bytes:
    """``mask.bits``'s bytes of bool ``mask``."""
    return np.packbits(np.asarray(mask, bool), bitorder="little").tobytes()


def decode_sample(tokens: bytes, mask: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32, mask bool)`` of a sample's two members (ValueError when their sizes disagree)."""
    problems = list(_size_problems(len(tokens), len(mask)))
    if problems:
        raise ValueError(problems[0])
    ids = np.frombuffer(tokens, "<i4").astype(np.int32)
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:ids.size].astype(bool)
    return ids, bits


def _size_problems(tokens: int, mask: int) -> Iterable[str]:
    if tokens % 4:
        yield f"{TOKENS_FIELD} holds {count(tokens, 'byte')}, not a whole number of int32 ids"
    elif mask != -(-(tokens // 4) // 8):
        yield f"{MASK_FIELD} holds {count(mask, 'byte')}, not one bit for each of the {count(tokens // 4, 'token')}"


def member_problems(sizes: dict[str, int], image_tokens: tuple[int, int] | None = None) -> list[str]:
    """What is wrong with an image-text sample given its members' sizes (field -> bytes): a missing token or mask
    member, sizes that disagree, images not numbered 0, 1, ..., and (``image_tokens``: how many of its
    ``tokens.i32`` ids are the image token, and that id) a number of image tokens unlike its number of images
    (a reader expands each image token into the run of the image of its number); [] for a good one."""
    if TOKENS_FIELD not in sizes or MASK_FIELD not in sizes:
        missing = TOKENS_FIELD if TOKENS_FIELD not in sizes else MASK_FIELD
        return [f"an image-text sample without {missing}"]
    problems = list(_size_problems(sizes[TOKENS_FIELD], sizes[MASK_FIELD]))
    numbers = sorted(n for f in sizes if (n := image_number(f)) is not None)
    if numbers != list(range(len(numbers))):
        problems.append(f"its images are numbered {numbers}, not 0..{len(numbers) - 1} once each")
    if image_tokens is not None and image_tokens[0] != len(numbers):
        problems.append(f"{TOKENS_FIELD} holds {count(image_tokens[0], 'image token')} (id {image_tokens[1]}) but the "
                        f"sample has {count(len(numbers), 'image')}")
    return problems
