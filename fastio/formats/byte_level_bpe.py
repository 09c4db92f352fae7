"""A byte-level BPE ``tokenizer.json`` (GPT-2's shape, or Llama 3's and Qwen 2's) encoding text token for token as
``tokenizers`` encodes it (``encode(text, add_special_tokens=False)``: the same ids, and the same character
offsets for ``char_to_token``), without its per-byte bookkeeping, for the texts whose encoding is provably the
same; every other text is handed to ``tokenizers`` itself.

``tokenizers`` keeps an alignment for every byte of the text through normalizing, pre-tokenizing and the model,
and maps byte offsets to characters through a table of every byte; a chat conversion needs the ids, and the
characters only at a few span edges. Here, for a tokenizer of this shape only (:meth:`ByteLevelBPE.of`; any
other: None, and the caller uses ``tokenizers``):

- no normalizer, or one that leaves ASCII as it is (NFC, NFKC, NFD, NFKD);
- the pre-tokenizer ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2's pattern), or a ``Split`` by a
  regex (``Isolated``) then ``ByteLevel(add_prefix_space=False, use_regex=False)`` (Llama 3, Qwen 2), the regex
  one :func:`_ascii_pattern` can translate;
- the model a ``BPE`` without dropout, subword prefix or word suffix; no post-processor, or ``ByteLevel`` and
  ``TemplateProcessing`` ones (they add nothing without special tokens); no truncation or padding; no added
  token with ``lstrip``, ``rstrip`` or ``single_word``;

a text is split where an added token occurs as ``tokenizers`` splits it (leftmost-longest, the tokens matched
on the raw text first, then those it matches on normalized text), each piece between added tokens is cut into
words by the pre-tokenizer's pattern (the matches and the text between them), and each word, its bytes written
in the byte-level alphabet, is tokenized by the tokenizer's own model (``Tokenizer.model.tokenize``: what the
pipeline calls on each word), its ids kept in a cache. The patterns' classes are written for ASCII, so a piece
between added tokens is done here only when it holds printable ASCII, tab, newline or carriage return alone
(where ``\\s``, ``\\p{L}`` and ``\\p{N}`` mean the same in every regex engine, the normalizers change nothing,
and each token covers as many characters as its string has); any other piece is encoded by ``tokenizers``
(``encode_batch``, the batch's such pieces at once: ``tokenizers`` too encodes each piece between added tokens on
its own), its offsets taken as it gives them; a text whose offsets would then not be gap-free and in order (a
normalizer joining characters), or more than half of whose characters are in such pieces (piece by piece would
cost more than whole), is encoded by ``tokenizers`` whole. The shape is also checked against
``tokenizers`` once, on a probe text of every such character, contractions, digit and whitespace runs and the
added tokens, and on one of other characters: ids and offsets must be equal, or :meth:`ByteLevelBPE.of` says
None.

Imports nothing of fastio.
"""

from __future__ import annotations

import json
import re
import string
from bisect import bisect_right
from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np

__all__ = ["ByteLevelBPE", "FastEncoding"]

_GPT2_ASCII = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
"""GPT-2's pre-tokenizer pattern (``ByteLevel(use_regex=True)``) on the characters :data:`_OUTSIDE` admits: there
``\\p{L}`` is ``[A-Za-z]``, ``\\p{N}`` is ``[0-9]`` and ``\\s`` is tab, newline, carriage return and space."""
_OUTSIDE = re.compile(r"[^\t\n\r\x20-\x7e]")
"""A character this module leaves to ``tokenizers``."""
_CACHE_WORDS = 1 << 18
"""Words whose ids are kept (the cache starts again when it holds more)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character standing for it (``tokenizers``' ``ByteLevel``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


_ONIG_TOKEN = re.compile(r"\\p\{[LN]\}|\\[sSdDwWrnt]|\\[^\w\s]|\[\^?\]?|\(\?(?:i:|:|!|=|<=|<!|>)|[^\\[(]|\((?!\?)")
"""One piece of an Oniguruma pattern :func:`_ascii_pattern` takes: ``\\p{L}``, ``\\p{N}``, a class escape that
means the same on ASCII, an escaped punctuation mark, a class's opening, a group that sets no flag but ``i``,
or any other character but a backslash."""
_ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9"}
_SAME_ON_ASCII = (None, "NFC", "NFKC", "NFD", "NFKD")
"""Normalizers that leave ASCII text as it is."""
_POST_PROCESSORS = (None, "ByteLevel", "TemplateProcessing")
"""Post-processors kept (a ``Sequence`` of them too): the probe checks they change nothing without special tokens."""
_ASCII_TO_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items() if b < 128})
_PROBE = ("Hello, world! It's 2024: we'll see; they've 3 cats & 12,345.67 dogs?\n\n  indented\tline\r\n"
          "don't  STOP   me--now... (x+y)*z=[1]{2}<3>|~`^_\\/@#$%\"' end  \n \t" + string.printable[:95])
_MIXED_PROBE = "naïve café ’quoted’ — 日本語 😀 x\u00a0y e\u0301 Ⅻ ﬁ "
"""Pieces ``tokenizers`` encodes for :class:`ByteLevelBPE`: their offsets are taken as it gives them."""


class FastEncoding:
    """One text's ids and where its tokens end (characters): ``char_to_token`` as ``tokenizers.Encoding``'s."""

    __slots__ = ("ids", "_ends")

    def __init__(self, ids: list[int], ends: np.ndarray):
        self.ids, self._ends = ids, ends

    def char_to_token(self, pos: int) -> int | None:
        """The token whose characters hold ``pos``, None past the end: the first token ending after it (the
        offsets are gap-free and in order, so it is ``tokenizers``' first token holding it)."""
        i = bisect_right(self._ends, pos)
        return i if i < len(self.ids) else None


class ByteLevelBPE:
    """``encode_batch(texts)`` as ``tokenizer.encode_batch(texts, add_special_tokens=False)`` (see the module)."""

    def __init__(self, tokenizer: Any, words: re.Pattern, tokens: list[dict]):
        self.tokenizer, self._pattern, self._cache = tokenizer, words, {}
        self._added = {t["content"]: t["id"] for t in tokens}
        self._raw = _alternation([t["content"] for t in tokens if not t["normalized"]])
        self._normalized = _alternation([t["content"] for t in tokens if t["normalized"]])
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        self._chars = np.zeros(max([*vocab.values(), *self._added.values()], default=0) + 1, np.int64)
        self._chars[list(vocab.values())] = [len(t) for t in vocab]  # an ASCII word's token: a character a byte
        self._chars[list(self._added.values())] = [len(t) for t in self._added]  # as id_to_token: the added one

    @classmethod
    def of(cls, tokenizer: Any) -> ByteLevelBPE | None:
        """The fast encoder of ``tokenizer`` (a ``tokenizers.Tokenizer``), or None where it is not of the shape the
        module names, or does not encode the probe text as ``tokenizers`` does."""
        spec = json.loads(tokenizer.to_str())
        words = _word_pattern(spec.get("pre_tokenizer") or {})
        tokens = spec.get("added_tokens") or []
        if (words is None or getattr(tokenizer, "encode_special_tokens", False) or not _pipeline_holds(spec)
                or not all(_added_token_holds(t, spec.get("normalizer")) for t in tokens)):
            return None
        fast = cls(tokenizer, words, tokens)
        specials = "".join(t["content"] for t in tokens[:8])
        return fast if fast._agrees(_PROBE + specials + _PROBE[::-1], _MIXED_PROBE + specials) else None

    def encode_batch(self, texts: list[str]) -> list[Any]:
        """Each text's :class:`FastEncoding` (a ``tokenizers.Encoding`` where its offsets would not be gap-free, or
        where most of it is left to ``tokenizers``), in order; what is left to ``tokenizers`` encoded in one call."""
        parts = [self._parts(t) for t in texts]
        whole = [t for t, ps in zip(texts, parts) if ps is None]
        pieces = [p for ps in parts if ps is not None for p in ps[1::2]]
        encoded = self.tokenizer.encode_batch(whole + pieces, add_special_tokens=False) if whole or pieces else []
        whole_encoded, slow = iter(encoded[:len(whole)]), iter(encoded[len(whole):])
        out = self._ascii_encodings([ps[0] if ps is not None and len(ps) == 1 else None for ps in parts])
        for i, ps in enumerate(parts):
            if ps is None:
                out[i] = next(whole_encoded)
            elif len(ps) > 1:
                out[i] = self._mixed(texts[i], ps, slow)
        return out

    def _ascii_encodings(self, id_lists: list[list[int] | None]) -> list[FastEncoding | None]:
        """A :class:`FastEncoding` of each text done here whole (its ids), None for the others."""
        done = [x for x in id_lists if x is not None]
        ends = np.cumsum(self._chars[np.fromiter(chain.from_iterable(done), np.int64, sum(map(len, done)))])
        out, at = [], 0
        for x in id_lists:
            out.append(None if x is None else FastEncoding(x, ends[at:at + len(x)] - (ends[at - 1] if at else 0)))
            at += 0 if x is None else len(x)
        return out

    def _mixed(self, text: str, parts: list, slow: Iterator[Any]) -> Any:
        """The encoding of a text some of whose pieces ``tokenizers`` encoded (``parts``: ids, piece, ids, ...;
        ``slow``: the pieces' encodings): a :class:`FastEncoding` where the offsets are gap-free and in order (then
        the token holding a character is the first that ends after it), ``tokenizers``' own encoding otherwise."""
        ids: list[int] = []
        starts, ends, at = [], [], 0
        for k, part in enumerate(parts):
            if k % 2:
                e = next(slow)
                ids += e.ids
                offsets = np.array(e.offsets, np.int64).reshape(-1, 2) + at
                at += len(part)
            else:
                ids += part
                stop = at + np.cumsum(self._chars[np.array(part, np.int64)])
                offsets = np.stack([np.concatenate([[at], stop[:-1]])[:len(part)], stop], axis=1)
                at = int(stop[-1]) if len(part) else at
            starts.append(offsets[:, 0])
            ends.append(offsets[:, 1])
        starts, stops = np.concatenate(starts), np.concatenate(ends)
        if len(ids) and starts[0] == 0 and stops[-1] == len(text) and (starts[1:] <= stops[:-1]).all() \
                and (np.diff(stops) >= 0).all():
            return FastEncoding(ids, stops)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _parts(self, text: str) -> list | None:
        """``text`` as ids, piece, ids, piece, ..., ids: the ids of what is done here, and each piece between added
        tokens (as ``tokenizers`` first splits, on the raw text) holding a character left to ``tokenizers``; None
        where such pieces are most of the text (``tokenizers`` encodes it whole: faster than piece by piece)."""
        pieces = self._raw.split(text) if self._raw else [text]
        outside = {k for k in range(0, len(pieces), 2) if _OUTSIDE.search(pieces[k])}
        if 2 * sum(len(pieces[k]) for k in outside) > len(text):
            return None
        parts, ids = [], []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self._added[piece])
            elif k in outside:
                parts += [ids, piece]
                ids = []
            elif piece:
                ids += self._ascii_ids(piece)
        parts.append(ids)
        return parts

    def _ascii_ids(self, piece: str) -> list[int]:
        """The ids of an ASCII piece between raw-text added tokens: split at the others (matched on the normalized
        text, which is this text), then into words."""
        if self._normalized is None:
            return self._words(piece)
        out: list[int] = []
        for k, sub in enumerate(self._normalized.split(piece)):
            if k % 2:
                out.append(self._added[sub])
            elif sub:
                out += self._words(sub)
        return out

    def _words(self, piece: str) -> list[int]:
        cache, out = self._cache, []
        for word in _split(self._pattern, piece):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_WORDS:
                    cache.clear()
                ids = cache[word] = [t.id for t in self.tokenizer.model.tokenize(word.translate(_ASCII_TO_BYTE_LEVEL))]
            out += ids
        return out

    def _agrees(self, ascii_probe: str, mixed_probe: str) -> bool:
        """Whether the probes get the ids and character offsets ``tokenizers`` gives them (the ASCII one done
        here)."""
        got = self.encode_batch([ascii_probe, mixed_probe])
        if not isinstance(got[0], FastEncoding):
            return False
        for probe, g in zip((ascii_probe, mixed_probe), got):
            want = self.tokenizer.encode(probe, add_special_tokens=False)
            if g.ids != want.ids or any(g.char_to_token(p) != want.char_to_token(p) for p in range(len(probe) + 1)):
                return False
        return True


def _split(pattern: re.Pattern, piece: str) -> list[str]:
    """``piece`` cut into its matches of ``pattern`` and the text between them, none empty (``tokenizers``' Split
    with the ``Isolated`` behaviour)."""
    if not pattern.groups:
        words = pattern.findall(piece)
        if sum(map(len, words)) == len(piece):  # the matches cover it: nothing between them
            return words
    out, at = [], 0
    for m in pattern.finditer(piece):
        out += [w for w in (piece[at:m.start()], m.group()) if w]
        at = m.end()
    return out + ([piece[at:]] if at < len(piece) else [])


def _pipeline_holds(spec: dict) -> bool:
    """Whether a ``tokenizer.json``'s normalizer, model, post-processor, truncation and padding are those this
    module reproduces (see the module); the pre-tokenizer: :func:`_word_pattern`."""
    model, post = spec.get("model") or {}, spec.get("post_processor") or {"type": None}
    posts = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    return ((spec.get("normalizer") or {}).get("type") in _SAME_ON_ASCII
            and spec.get("truncation") is None and spec.get("padding") is None
            and model.get("type") == "BPE" and model.get("dropout") is None
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
            and all(p.get("type") in _POST_PROCESSORS for p in posts))


def _added_token_holds(token: dict, normalizer: dict | None) -> bool:
    """Whether an added token is split out as this module splits: no ``lstrip``, ``rstrip`` or ``single_word``,
    and, matched on normalized text under a normalizer, ASCII (which the normalizer leaves as it is: ``tokenizers``
    matches the token's normalized form, and NFKC makes ASCII of some other characters)."""
    if token["lstrip"] or token["rstrip"] or token["single_word"]:
        return False
    return not (token["normalized"] and normalizer is not None and not token["content"].isascii())


def _word_pattern(pre: dict) -> re.Pattern | None:
    """The words a pre-tokenizer cuts ASCII text into, as a pattern: GPT-2's for ``ByteLevel(use_regex=True)``, a
    ``Split`` regex (:func:`_ascii_pattern`) for ``Sequence([Split(Isolated), ByteLevel(use_regex=False)])``;
    None for any other (or a prefix space)."""
    if pre.get("type") == "ByteLevel":
        return _GPT2_ASCII if pre.get("add_prefix_space") is False and pre.get("use_regex", True) else None
    steps = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level != {**byte_level, "type": "ByteLevel", "add_prefix_space": False, "use_regex": False}):
        return None
    onig = (split.get("pattern") or {}).get("Regex")
    return _ascii_pattern(onig) if isinstance(onig, str) else None


def _ascii_pattern(onig: str) -> re.Pattern | None:
    """An Oniguruma pattern (``tokenizers``' ``Regex``) as a Python pattern that matches the same on the characters
    :data:`_OUTSIDE` admits: ``\\p{L}`` as ``A-Za-z``, ``\\p{N}`` as ``0-9``; None where it uses anything else whose
    meaning could differ (another property or escape, an anchor, a nested class, a flag group but ``(?i:``), or can
    match nothing."""
    out, i = [], 0
    in_class = False
    while i < len(onig):
        token = _ONIG_TOKEN.match(onig, i)
        if token is None or token[0] in ("^", "$") and not in_class or token[0] == "[" and in_class:
            return None
        text = token[0]
        out.append(text if text not in _ASCII_CLASSES else
                   _ASCII_CLASSES[text] if in_class else f"[{_ASCII_CLASSES[text]}]")
        in_class = (in_class or text.startswith("[")) and text != "]"
        i = token.end()
    try:
        pattern = re.compile("".join(out))
    except re.error:
        return None
    return None if pattern.search("") else pattern


def _alternation(tokens: list[str]) -> re.Pattern | None:
    """A pattern splitting at ``tokens`` (kept, as a group), the longest first: leftmost-longest, as
    ``tokenizers``' Aho-Corasick matches added tokens; None for none."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True)) + ")")
