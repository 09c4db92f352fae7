"""A GPT-2-style byte-level BPE ``tokenizer.json`` encoding text token for token as ``tokenizers`` encodes it
(``encode(text, add_special_tokens=False)``: the same ids, and the same character offsets for ``char_to_token``),
without its per-character bookkeeping, for the texts whose encoding is provably the same; every other text is
handed to ``tokenizers`` itself.

``tokenizers`` keeps an alignment for every byte of the text through normalizing, pre-tokenizing and the model,
and maps byte offsets to characters through a table of every byte; a chat conversion needs the ids, and the
characters only at a few span edges. Here, for a tokenizer of this shape only (:meth:`ByteLevelBPE.of`; any
other: None, and the caller uses ``tokenizers``):

- no normalizer; the pre-tokenizer is ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2's pattern);
  the model a ``BPE`` without dropout, subword prefix or word suffix; no post-processor, or a ``ByteLevel`` one;
  no truncation or padding; no added token with ``lstrip``, ``rstrip`` or ``single_word``;

a text is split where an added token occurs as ``tokenizers`` splits it (leftmost-longest, the tokens matched
on the raw text first, then those it matches on normalized text), each piece between added tokens is split by
GPT-2's pattern, and each of those words, its bytes written in the byte-level alphabet, is tokenized by the
tokenizer's own model (``Tokenizer.model.tokenize``: what the pipeline calls on each word), its ids kept in a
cache. The pattern's classes are written for ASCII, so a text is done here only when every piece between added
tokens holds printable ASCII, tab, newline or carriage return (where ``\\s``, ``\\p{L}`` and ``\\p{N}`` mean the
same in every regex engine, and each token covers as many characters as its string has); any other text goes to
``tokenizers``' ``encode_batch``. The shape is also checked against ``tokenizers`` once, on a probe text of every
such character, contractions, whitespace runs and the added tokens: ids and offsets must be equal, or
:meth:`ByteLevelBPE.of` says None.

Imports nothing of fastio.
"""

from __future__ import annotations

import json
import re
import string
from bisect import bisect_right
from itertools import chain
from typing import Any

import numpy as np

__all__ = ["ByteLevelBPE", "FastEncoding"]

_GPT2_ASCII = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
"""GPT-2's pre-tokenizer pattern (``ByteLevel(use_regex=True)``) on the characters :data:`_OUTSIDE` admits: there
``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]`` and ``\\s`` is tab, newline, carriage return and space."""
_OUTSIDE = re.compile(r"[^\t\n\r\x20-\x7e]")
"""A character this module leaves to ``tokenizers``."""
_CACHE_WORDS = 1 << 20
"""Words whose ids are kept (the cache starts again when it holds more)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character standing for it (``tokenizers``' ``ByteLevel``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


_ASCII_TO_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items() if b < 128})
_PROBE = ("Hello, world! It's 2024: we'll see; they've 3 cats & 12,345.67 dogs?\n\n  indented\tline\r\n"
          "don't  STOP   me--now... (x+y)*z=[1]{2}<3>|~`^_\\/@#$%\"' end  \n \t" + string.printable[:95])


class FastEncoding:
    """One text's ids and where its tokens end (characters): ``char_to_token`` as ``tokenizers.Encoding``'s."""

    __slots__ = ("ids", "_ends")

    def __init__(self, ids: list[int], ends: np.ndarray):
        self.ids, self._ends = ids, ends

    def char_to_token(self, pos: int) -> int | None:
        """The token whose characters hold ``pos`` (tokens cover the text one after another), None past the end."""
        i = bisect_right(self._ends, pos)
        return i if i < len(self.ids) else None


class ByteLevelBPE:
    """``encode_batch(texts)`` as ``tokenizer.encode_batch(texts, add_special_tokens=False)`` (see the module)."""

    def __init__(self, tokenizer: Any, raw: list[str], normalized: list[str], added: dict[str, int]):
        self.tokenizer, self._added = tokenizer, added
        self._raw, self._normalized = _alternation(raw), _alternation(normalized)
        self._cache: dict[str, list[int]] = {}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._chars = np.zeros(max(vocab.values(), default=0) + 1, np.int64)
        self._chars[list(vocab.values())] = [len(t) for t in vocab]  # an ASCII word's token: a character a byte

    @classmethod
    def of(cls, tokenizer: Any) -> ByteLevelBPE | None:
        """The fast encoder of ``tokenizer`` (a ``tokenizers.Tokenizer``), or None where it is not of the shape the
        module names, or does not encode the probe text as ``tokenizers`` does."""
        spec = json.loads(tokenizer.to_str())
        if getattr(tokenizer, "encode_special_tokens", False) or not _shape_holds(spec):
            return None
        tokens = spec.get("added_tokens") or []
        if any(t["lstrip"] or t["rstrip"] or t["single_word"] for t in tokens):
            return None
        raw = [t["content"] for t in tokens if not t["normalized"]]
        fast = cls(tokenizer, raw, [t["content"] for t in tokens if t["normalized"]],
                   {t["content"]: t["id"] for t in tokens})
        return fast if fast._agrees(_PROBE + "".join(raw[:8])) else None

    def encode_batch(self, texts: list[str]) -> list[Any]:
        """Each text's :class:`FastEncoding`, or its ``tokenizers.Encoding`` where it holds a character left to
        ``tokenizers``; in order."""
        ids = [self._ids(t) for t in texts]
        rest = [i for i, x in enumerate(ids) if x is None]
        done = [x for x in ids if x is not None]
        flat = np.fromiter(chain.from_iterable(done), np.int64, sum(map(len, done)))
        ends = np.cumsum(self._chars[flat])
        out, at = [], 0
        for x in ids:
            out.append(x if x is None else FastEncoding(x, ends[at:at + len(x)] - (ends[at - 1] if at else 0)))
            at += 0 if x is None else len(x)
        for i, e in zip(rest, self.tokenizer.encode_batch([texts[i] for i in rest], add_special_tokens=False)
                        if rest else []):
            out[i] = e
        return out

    def _ids(self, text: str) -> list[int] | None:
        """The ids of ``text``, None where a piece between added tokens holds a character left to ``tokenizers``."""
        ids: list[int] = []
        for k, piece in enumerate(self._pieces(text)):
            if k % 2:
                ids.append(self._added[piece])
            elif piece:
                if _OUTSIDE.search(piece):
                    return None
                ids += self._words(piece)
        return ids

    def _pieces(self, text: str) -> list[str]:
        """``text`` split at added tokens: text, token, text, ... (the raw-text tokens first, then the others in
        each piece between them, as ``tokenizers`` splits)."""
        pieces = self._raw.split(text) if self._raw else [text]
        if not self._normalized:
            return pieces
        return [p for k, piece in enumerate(pieces) for p in ((piece,) if k % 2 else self._normalized.split(piece))]

    def _words(self, piece: str) -> list[int]:
        cache, out = self._cache, []
        for word in _GPT2_ASCII.findall(piece):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_WORDS:
                    cache.clear()
                ids = cache[word] = [t.id for t in self.tokenizer.model.tokenize(word.translate(_ASCII_TO_BYTE_LEVEL))]
            out += ids
        return out

    def _agrees(self, probe: str) -> bool:
        """Whether ``probe`` gets the ids and character offsets ``tokenizers`` gives it."""
        want = self.tokenizer.encode(probe, add_special_tokens=False)
        got = self.encode_batch([probe])[0]
        if not isinstance(got, FastEncoding) or got.ids != want.ids:
            return False
        return all(got.char_to_token(p) == want.char_to_token(p) for p in range(len(probe) + 1))


def _shape_holds(spec: dict) -> bool:
    """Whether a ``tokenizer.json``'s pipeline is the one this module reproduces (see the module)."""
    pre, model, post = spec.get("pre_tokenizer") or {}, spec.get("model") or {}, spec.get("post_processor")
    return (spec.get("normalizer") is None and spec.get("truncation") is None and spec.get("padding") is None
            and pre.get("type") == "ByteLevel" and pre.get("add_prefix_space") is False
            and pre.get("use_regex", True) is True
            and model.get("type") == "BPE" and model.get("dropout") is None
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and (post is None or post.get("type") == "ByteLevel"))


def _alternation(tokens: list[str]) -> re.Pattern | None:
    """A pattern splitting at ``tokens`` (kept, as a group), the longest first: leftmost-longest, as
    ``tokenizers``' Aho-Corasick matches added tokens; None for none."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True)) + ")")
