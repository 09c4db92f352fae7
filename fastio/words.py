"""Counted nouns: the one plural rule of every message, ``count`` ("1 sample", "2 samples", "1 byte") and
``agree`` (the word alone, or the verb or pronoun that goes with a count: "has"/"have", "it"/"them").

Imports nothing, so that every module may import it: the leaves and ``order/`` too (``docs/architecture.md``);
:mod:`fastio.progress` re-exports :func:`count` with the other summary lines."""

from __future__ import annotations

__all__ = ["agree", "count", "one_line"]


def agree(n: int, one: str, many: str | None = None) -> str:
    """The form of a word that goes with ``n`` things: ``one`` for exactly one, else ``many`` (default ``one``
    + "s"): ``agree(1, "step")`` -> ``step``, ``agree(2, "step")`` -> ``steps``, ``agree(2, "has", "have")`` ->
    ``have``."""
    return one if n == 1 else many or one + "s"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "shard")`` -> ``1 shard``; ``count(3, "shard")`` -> ``3 shards``; ``count(1, "byte")`` ->
    ``1 byte``."""
    return f"{n} {agree(n, noun, plural)}"


_BREAKS = {c: ascii(chr(c))[1:-1] for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029) if c != 0x09}
"""Control characters (but tab) and line separators, each as its Python escape (``\\n``, ``\\x1b``)."""


def one_line(text: str) -> str:
    """``text`` (a name from a source: a file named ``a\\nb.jpg``) with each character that would break its line or
    drive a terminal written as its escape, so that a message about it stays the one line it is."""
    return text.translate(_BREAKS)
