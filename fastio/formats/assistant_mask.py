"""The rule that turns a rendered conversation's generation spans (characters, :mod:`fastio.formats.chat_template`)
into the tokens trained on: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` rule,
token for token.

For each span ``[start, end)`` in order: the token holding character ``start`` and the token holding character
``end - 1`` (the tokenizer's own character -> token map, ``Encoding.char_to_token``), and every token between,
are trained. So a token that straddles a span's edge (part template text, part generated text) is trained: a span
edge inside a token takes the whole token. Where no token holds the span's first character (a span at the very
end, or beginning on text the tokenizer drops) this and every later span train nothing; where no token holds its
last character (or that token is the first of the text), the span trains every token to the end of the
conversation. An empty span (``start == end``) trains nothing unless its neighbours say so by these rules.
These are transformers' rules, quirks included, so that the two masks are equal (``tests/test_chat_mask.py``).
One case transformers cannot answer: an empty span at the very start (``(0, 0)``: an empty assistant message
rendered first, bare), for which it asks ``char_to_token(-1)`` and fails (OverflowError); it has no character, so
it trains nothing (taking its last character as absent trained the whole conversation, prompts included).

Imports nothing of fastio.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["assistant_mask"]


def assistant_mask(encoding: Any, spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """bool [n]: the tokens of ``encoding`` (a ``tokenizers.Encoding`` of the rendered text, ``n`` tokens) that
    the generation ``spans`` train (see the module docstring)."""
    mask = np.zeros(n, bool)
    for start, end in spans:
        if end == 0:  # empty, at the very start: nothing to train (transformers fails on it)
            continue
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1)
        if first is None:
            break
        mask[first:last + 1 if last else n] = True
    return mask
