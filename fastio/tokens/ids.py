"""What a pass over a shard's token ids can tell cheaply (``fastio index`` and ``fastio verify`` each read every id
once): the largest, the first one outside ``[0, vocab_size)``, and the tell of int32 tokens read through an ``.idx``
that says uint16.

Such an ``.idx`` (made by hand, or by a tool told the wrong type) counts each int32 token as two uint16 ones, so its
sizes agree with the ``.bin``; read that way, every token at an odd offset is the high half of an id below 65,536:
0. Real uint16 data has no such run: :meth:`IdScan.problems` names it where every odd-offset token is 0 and some
document is longer than two tokens (data of one-token documents and their end-of-document id 0 is taken as it is).
Not caught: the reverse (uint16 tokens under an ``.idx`` that says int32: ids of two tokens each, most of them
above any vocabulary), unless ``vocab_size`` is known or the documents' ends betray it; ids of another tokenizer
inside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fastio.formats.megatron import MegatronIndex

__all__ = ["IdScan", "document_at"]


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
        self._odd_nonzero, self._uint16 = False, False

    def see(self, first: int, tokens: np.ndarray) -> None:
        """Take ``tokens``, the ids from token offset ``first`` on."""
        if not tokens.size:
            return
        self.seen, self._uint16 = self.seen + tokens.size, tokens.dtype == np.uint16
        low, high = int(tokens.min()), int(tokens.max())
        self.high = high if self.high is None else max(self.high, high)
        top = self.vocab_size if self.vocab_size is not None else high + 1
        if self.bad is None and (low < 0 or high >= top):
            at = int(np.argmax((tokens < 0) | (tokens >= top)))
            self.bad = (first + at, int(tokens[at]))
        self._odd_nonzero = self._odd_nonzero or bool(tokens[(first + 1) % 2::2].any())

    def problems(self, index: MegatronIndex) -> Iterator[str]:
        """What is wrong with the ids seen (the whole shard's, indexed by ``index``; read only to name the document
        of a bad id), one line each."""
        if self.bad is not None:
            at, value = self.bad
            why = (": token ids are never negative (a damaged .bin)" if value < 0
                   else f", outside the vocabulary of {self.vocab_size} ids")
            yield f"document {document_at(index, at)} holds token id {value}{why}"
        if self._uint16 and self.seen > 2 * index.documents and not self._odd_nonzero:
            yield ("every second token is 0 (each one at an odd offset): int32 tokens under an .idx that says uint16? "
                   "(it counts each int32 token as two)")
