"""What a pass over a shard's token ids can tell cheaply (``fastio index`` and ``fastio verify`` each read every id
once): the largest, the first one outside ``[0, vocab_size)``, and the tell of int32 tokens read through an ``.idx``
that says uint16. The rule of an id (not negative, inside the vocabulary, not above the largest the manifest records:
:func:`first_outside`) and the words that name a bad one (:func:`id_problem`) are also ``fastio verify``'s for an
image-text sample's ``tokens.i32``.

Such an ``.idx`` (made by hand, or by a tool told the wrong type) counts each int32 token as two uint16 ones, so its
sizes agree with the ``.bin``; read that way, every token at an odd offset is the high half of an id: 0 below
65,536, at most 15 below 2**20, while the low halves at even offsets spread up to 65,535. Real uint16 data has no
such run: :meth:`IdScan.problems` names it where every odd-offset token is 0, or at most 15 while the even-offset ones
reach 256, and some document is longer than two tokens (data of one-token documents and their end-of-document id 0
is taken as it is).
A vocabulary of more ids than the token type holds (``vocab_size`` above 65,536 for uint16 tokens) is named too: such a
tokenizer's large ids cannot be in the ``.bin`` as they are. Not caught: the reverse (uint16 tokens under an ``.idx``
that says int32: ids of two tokens each, most of them above any vocabulary), unless ``vocab_size`` is known or the
documents' ends betray it; ids of another tokenizer inside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fastio.formats.megatron import MegatronIndex
from fastio.words import count

__all__ = ["HIGH_HALF", "LOW_SPREAD", "IdScan", "document_at", "first_outside", "id_problem"]

HIGH_HALF = 15
"""The largest high half of an int32 id below 2**20 (every vocabulary in use): 15."""
LOW_SPREAD = 256
"""Low halves reaching this while every high half is at most :data:`HIGH_HALF`: no real uint16 data (a vocabulary
of 16 ids or fewer keeps every token small, and is taken as it is)."""


def first_outside(tokens: np.ndarray, top: int | None, low: int, high: int) -> int | None:
    """The offset of the first of ``tokens`` (their smallest ``low`` and largest ``high``, at hand) that is negative or
    not below ``top`` (None: no upper bound); None where every one is inside."""
    if low >= 0 and (top is None or high < top):
        return None
    return int(np.argmax((tokens < 0) | (tokens >= top) if top is not None else tokens < 0))


def id_problem(value: int, vocab_size: int | None, max_id: int | None = None, damaged: str = "shard") -> str:
    """``holds token id VALUE`` and why that is wrong: negative (a ``damaged`` file), outside the vocabulary of
    ``vocab_size`` ids, else above ``max_id``, the largest the manifest records."""
    if value < 0:
        return f"holds token id {value}: token ids are never negative (a damaged {damaged})"
    if vocab_size is not None and value >= vocab_size:
        return f"holds token id {value}, outside the vocabulary of {count(vocab_size, 'id')}"
    return f"holds token id {value}, above the largest the manifest records ({max_id})"


def document_at(index: MegatronIndex, token: int) -> int:
    """The document that holds token offset ``token`` of the ``.bin`` (documents read a chunk at a time)."""
    for lo, edges in index.edge_chunks():
        if edges[-1] > token:
            return lo + int(np.searchsorted(edges, token, "right")) - 1
    raise ValueError(f"token offset {token} is past the end of {index.name}")


class IdScan:
    """The ids of one shard as they go by (:meth:`see` each run of tokens with its offset, in order).
    ``high``: the largest id (None: no tokens); ``bad``: the (token offset, id) of the first id seen that is
    negative or not below ``vocab_size`` (None: none)."""

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size
        self.high: int | None = None
        self.bad: tuple[int, int] | None = None
        self.seen = 0
        """Tokens seen."""
        self._odd_high, self._even_high, self._uint16 = 0, 0, False  # the largest id at odd and even offsets

    def see(self, first: int, tokens: np.ndarray) -> None:
        """Take ``tokens``, the ids from token offset ``first`` on."""
        if not tokens.size:
            return
        self.seen, self._uint16 = self.seen + tokens.size, tokens.dtype == np.uint16
        low, high = int(tokens.min()), int(tokens.max())
        self.high = high if self.high is None else max(self.high, high)
        at = first_outside(tokens, self.vocab_size, low, high) if self.bad is None else None
        if at is not None:
            self.bad = (first + at, int(tokens[at]))
        odd, even = tokens[(first + 1) % 2::2], tokens[first % 2::2]
        self._odd_high = max(self._odd_high, int(odd.max()) if odd.size else 0)
        self._even_high = max(self._even_high, int(even.max()) if even.size else 0)

    def problems(self, index: MegatronIndex) -> Iterator[str]:
        """What is wrong with the ids seen (the whole shard's, indexed by ``index``; read only to name the document
        of a bad id), one line each."""
        if self.bad is not None:
            at, value = self.bad
            yield f"document {document_at(index, at)} {id_problem(value, self.vocab_size, damaged='.bin')}"
        if self._uint16 and self.seen > 2 * index.documents and self._high_halves():
            small = "0" if self._odd_high == 0 else f"at most {self._odd_high}"
            yield (f"every second token is {small} (each one at an odd offset): int32 tokens under an .idx that says "
                   "uint16? (it counts each int32 token as two)")
        top = int(np.iinfo(index.dtype).max)
        if self.vocab_size is not None and self.vocab_size - 1 > top:
            yield (f"{index.dtype} tokens cannot hold the ids of a vocabulary of {count(self.vocab_size, 'id')} (at "
                   f"most {top}): a tool that wrote that tokenizer's ids as {index.dtype} cut each one above {top} to "
                   "another token's id, which no check can see; Megatron writes such a vocabulary as int32: make the "
                   "pairs again so (or, if the tokenizer has fewer ids, give its own size)")

    def _high_halves(self) -> bool:
        """Whether the tokens at odd offsets look like int32 ids' high halves: all 0, or all at most
        :data:`HIGH_HALF` (ids below 2**20) while those at even offsets, the low halves, reach :data:`LOW_SPREAD`."""
        return self._odd_high == 0 or self._odd_high <= HIGH_HALF and self._even_high >= LOW_SPREAD
