"""Conversations into token ids and loss masks, a batch at a time (a chat conversion's worker step,
``fastio convert --chat-template``).

Each conversation (a list of ``{"role": ..., "content": ...}`` messages, or ShareGPT's ``{"from": ..., "value":
...}``, entered as the former: :func:`entered`) is checked, rendered with the chat
template (:func:`fastio.formats.chat_template.render`: as transformers renders it), the rendered texts tokenized
together (no special tokens added: the template writes them; a special token's string in a message is that
special token, as in transformers: by :class:`~fastio.formats.byte_level_bpe.ByteLevelBPE` where the tokenizer is
a byte-level BPE of its shape, the same ids and offsets without ``tokenizers``' per-byte bookkeeping, by
``encode_batch`` otherwise), and each one's mask made from its generation spans
(:func:`fastio.formats.assistant_mask.assistant_mask`; ``train_on="all"``: every token). A bad conversation is a
ConvertError naming its file and line (``where``), the field and what is wrong.

A conversation longer than ``max_tokens`` (None: no limit here; the Loader refuses a ``seq_len`` that would cut
one) is never cut mid-turn: ``overlong="refuse"`` is a ConvertError naming it, ``"drop"`` leaves it out (counted),
``"truncate"`` keeps its first turns whole: the longest run of its first messages that ends with a reply and
renders within ``max_tokens`` (rendered again, as a conversation of those messages; counted), or drops it when none
does (counted as dropped). A reply is the model's: a message the template renders inside a ``{% generation %}``
block (the run ending with it has one more block than the run without it) of a role that is not a prompt's (one of
:data:`PROMPT_ROLES`: a template that trains the user's turns too never makes a user message the last one kept),
so ShareGPT's ``gpt`` under a template that trains it is one; under a template without blocks
(``train_on="all"``), one of :data:`REPLY_ROLES`. A role is read whatever its case (:func:`role_of`, the one rule:
``User`` is a prompt, ``Assistant`` a reply); the template renders it as the data spells it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from fastio.errors import ConvertError
from fastio.formats.assistant_mask import assistant_mask
from fastio.formats.byte_level_bpe import ByteLevelBPE
from fastio.formats.chat_template import REASONING_FIELDS, ChatTemplate, ChatTemplateError, render

__all__ = ["OVERLONG", "PROMPT_ROLES", "REPLY_ROLES", "TRAIN_ON", "ChatEncoder", "check_messages", "entered",
           "refuse_unencodable", "role_of"]

TRAIN_ON = ("generation", "all")
"""What a chat conversion trains on: the template's ``{% generation %}`` blocks, or every token."""
OVERLONG = ("refuse", "drop", "truncate")
"""What becomes of a conversation longer than ``max_tokens``."""
REPLY_ROLES = ("assistant", "gpt", "model")
"""The roles of a reply where the template marks no ``{% generation %}`` block (``overlong="truncate"`` cuts after
one): OpenAI's, ShareGPT's and Gemma's."""
PROMPT_ROLES = ("user", "human", "system", "developer", "tool", "ipython", "function", "observation")
"""The roles of what the model is given, never a reply ``overlong="truncate"`` cuts after, even where the template
trains them: OpenAI's, ShareGPT's, Llama's tool output (``ipython``) and LLaMA-Factory's (``observation``)."""


def role_of(message: dict) -> str:
    """The one rule for which role a message is (a prompt's, :data:`PROMPT_ROLES`, or a reply's,
    :data:`REPLY_ROLES`): its ``role`` whatever its case and surrounding spaces (``User``, ``GPT``); the template
    still renders the role as the data spells it."""
    return message["role"].strip().casefold()


def entered(messages: Any, where: str, field: str) -> list[dict]:
    """``messages`` checked (:func:`check_messages`) as the template sees them: a ShareGPT message
    (``{"from": ..., "value": ...}``, no ``role``) as ``{"role": ..., "content": ...}``, its values and any other
    key unchanged; every other message as it is."""
    check_messages(messages, where, field)
    return [_renamed(m) for m in messages]


def _keys(m: dict) -> tuple[str, str]:
    """The keys of a message's role and content as the data spells them: ShareGPT's ``from`` (a message without a
    ``role``) and ``value`` (without a ``content``), else ``role`` and ``content``; a key whose value is null is
    absent (a Parquet row of a column that holds both kinds of message has the other kind's keys, null)."""
    if m.get("role") is not None or m.get("from") is None:
        return "role", "content"
    return "from", "content" if m.get("content") is not None else "value"


def _renamed(m: dict) -> dict:
    """A message with its :func:`_keys` renamed ``role`` and ``content`` (in place of those keys where null), its
    values and other keys unchanged."""
    keys = _keys(m)
    if keys == ("role", "content"):
        return m
    names = dict(zip(keys, ("role", "content")))
    return {names.get(k, k): v for k, v in m.items() if k in names or k not in ("role", "content")}


def check_messages(messages: Any, where: str, field: str) -> None:
    """ConvertError naming ``where`` and ``field[i]`` unless ``messages`` is a non-empty list of messages, each an
    object with a text ``role`` and a ``content`` (text, or a list of content parts), ``tool_calls`` (a list: an
    assistant's calls, its content None or absent; a None value is dropped before rendering, as transformers
    drops it) or reasoning (text under one of :data:`~fastio.formats.chat_template.REASONING_FIELDS`: a reply of
    reasoning alone, its content None or absent, rendered as transformers renders it; a template that reads the
    content anyway fails on it, :meth:`ChatEncoder.rendered` says why)."""
    if not isinstance(messages, list) or not messages:
        what = ("an empty list" if isinstance(messages, list) else "missing or null" if messages is None else
                type(messages).__name__)
        raise ConvertError(f"{where}: field {field!r} is {what}, not a list of messages")
    for i, m in enumerate(messages):
        _check_message(m, f"{where}: {field}[{i}]")


def _check_message(m: Any, at: str) -> None:
    """ConvertError starting with ``at`` unless ``m`` is one message (see :func:`check_messages`), naming its keys
    as the data spells them (:func:`_keys`)."""
    if not isinstance(m, dict):
        raise ConvertError(f"{at} is {type(m).__name__}, not a message object")
    role, text = _keys(m)
    if m.get(role) is None:
        raise ConvertError(f"{at} has no {role!r} (a message is " '{"role": ..., "content": ...}, or ShareGPT\'s '
                           '{"from": ..., "value": ...})')
    if not isinstance(m[role], str):
        raise ConvertError(f"{at}.{role} is {type(m[role]).__name__}, not text")
    content, calls, reasoning = m.get(text), m.get("tool_calls"), _reasoning(m)
    if content is None and calls is None and reasoning is None:
        raise ConvertError(f"{at} has no {text!r} and no 'tool_calls' (a message is "
                           '{"role": ..., "content": ...}, or an assistant\'s {"role": "assistant", "tool_calls": '
                           '[...]} or {"role": "assistant", "reasoning_content": ...})')
    if content is None and calls is None and not isinstance(m[reasoning], str):
        raise ConvertError(f"{at}.{reasoning} is {type(m[reasoning]).__name__}, not text")
    if content is not None and not isinstance(content, (str, list)):
        raise ConvertError(f"{at}.{text} is {type(content).__name__}, not text or a list of content parts")
    if calls is not None and not isinstance(calls, list):
        raise ConvertError(f"{at}.tool_calls is {type(calls).__name__}, not a list of tool calls")


def _reasoning(m: dict) -> str | None:
    """The key of a message's reasoning (the first of :data:`~fastio.formats.chat_template.REASONING_FIELDS` set, as
    transformers takes it), None without."""
    return next((k for k in REASONING_FIELDS if m.get(k) is not None), None)


def _reasoning_alone(messages: list, field: str, error: str) -> str:
    """Where a template failed on ``error`` naming ``content``: `` (field[i] has reasoning_content and no 'content':
    this template reads a reply's content)`` for the first message of reasoning alone; "" otherwise."""
    if "content" not in error:
        return ""
    alone = next(((i, k) for i, m in enumerate(messages) if m.get("content") is None and m.get("tool_calls") is None
                  and (k := _reasoning(m)) is not None), None)
    return "" if alone is None else (f" ({field}[{alone[0]}] has {alone[1]} and no 'content': this template reads "
                                     "a reply's content)")


def refuse_unencodable(wheres: Sequence[str], texts: Sequence[str], field: str) -> None:
    """ConvertError naming ``where`` and ``field`` of the first of ``texts`` that is not text ``tokenizers`` encodes:
    one holding a lone surrogate (``"\\ud800"`` in JSON is valid JSON, half of a UTF-16 pair, no character); None
    when every text encodes (the caller re-raises what ``tokenizers`` raised). Called only after ``tokenizers``
    refused a batch, so a good batch pays nothing."""
    for where, text in zip(wheres, texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ConvertError(f"{where}: field {field!r} holds {text[err.start]!r}, half of a UTF-16 surrogate pair "
                               "(a lone \\u escape in the JSON), not text") from None


class ChatEncoder:
    """Conversations -> ``(lengths, ids, mask)`` with ``tokenizer`` (a ``tokenizers.Tokenizer``) and ``template``."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, train_on: str, field: str, dtype: np.dtype,
                 max_tokens: int | None = None, overlong: str = "refuse"):
        self.tokenizer, self.template, self.train_on, self.field, self.dtype = (tokenizer, template, train_on, field,
                                                                               dtype)
        self.max_tokens, self.overlong = max_tokens, overlong
        self.fast = ByteLevelBPE.of(tokenizer)

    def rendered(self, messages: Any, where: str) -> tuple[str, list[tuple[int, int]]]:
        """One conversation's text and generation spans (ConvertError naming ``where`` and the template)."""
        return self._rendered(entered(messages, where, self.field), where)

    def _rendered(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """:meth:`rendered` of messages already :func:`entered`."""
        try:
            return render(self.template, messages)
        except ChatTemplateError as err:
            raise ConvertError(f"{where}: field {self.field!r}: chat template {self.template.path}: {err}"
                               f"{_reasoning_alone(messages, self.field, str(err))}") from None

    def encode(self, wheres: Sequence[str], conversations: Sequence[Any]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
        """``(tokens per conversation, all ids, all mask bits, {"dropped": n, "truncated": n})`` of a batch, in
        order (a dropped conversation left out)."""
        conversations = [entered(m, w, self.field) for w, m in zip(wheres, conversations)]
        texts, spans = zip(*(self._rendered(m, w) for w, m in zip(wheres, conversations)))
        try:
            encodings = self._tokenized(list(texts))
        except TypeError:  # tokenizers' refusal of a str that is not text
            refuse_unencodable(wheres, texts, self.field)
            raise
        counts = {"dropped": 0, "truncated": 0}
        if self.max_tokens is not None and any(len(e.ids) > self.max_tokens for e in encodings):
            encodings, spans = self._fitted(wheres, conversations, encodings, list(spans), counts)
        id_lists = [e.ids for e in encodings]  # a tokenizers.Encoding makes a new list at each .ids
        lengths = np.fromiter(map(len, id_lists), np.int64, len(id_lists))
        ids = np.fromiter(chain.from_iterable(id_lists), np.int64, int(lengths.sum()))
        if self.train_on == "all":
            mask = np.ones(ids.size, bool)
        else:
            mask = np.concatenate([assistant_mask(e, s, int(n)) for e, s, n in zip(encodings, spans, lengths)] or
                                  [np.zeros(0, bool)])
        return lengths, ids.astype(self.dtype), mask, counts

    def _tokenized(self, texts: list[str]) -> list[Any]:
        """Each text's encoding (ids, ``char_to_token``): :class:`~fastio.formats.byte_level_bpe.ByteLevelBPE`'s
        where the tokenizer is of its shape, ``tokenizers``' ``encode_batch`` otherwise (the same ids and offsets)."""
        if self.fast is not None:
            return self.fast.encode_batch(texts)
        return self.tokenizer.encode_batch(texts, add_special_tokens=False)

    def _fitted(self, wheres, conversations, encodings, spans, counts) -> tuple[list, list]:
        """The batch's encodings and spans with each overlong conversation refused, dropped or truncated."""
        kept_e, kept_s = [], []
        for where, messages, e, s in zip(wheres, conversations, encodings, spans):
            if len(e.ids) > self.max_tokens:
                if self.overlong == "refuse":
                    raise ConvertError(f"{where}: field {self.field!r}: the conversation has {len(e.ids)} tokens, "
                                       f"more than max_tokens={self.max_tokens} (overlong='drop' or overlong='truncate' "
                                       "handles such conversations)")
                e, s = self._truncated(messages, where) if self.overlong == "truncate" else (None, None)
                counts["dropped" if e is None else "truncated"] += 1
            if e is not None:
                kept_e.append(e)
                kept_s.append(s)
        return kept_e, kept_s

    def _truncated(self, messages: list, where: str) -> tuple[Any, list[tuple[int, int]]] | tuple[None, None]:
        """The encoding and spans of the longest run of the first messages ending with a reply
        (:meth:`_ends_with_reply`) that fits ``max_tokens``; (None, None) when none does. A run the template refuses
        (one that ends where the template wants another turn) is no place to cut."""
        renders: dict[int, tuple[str, list[tuple[int, int]]] | None] = {0: ("", [])}

        def prefix(k: int) -> tuple[str, list[tuple[int, int]]] | None:
            if k not in renders:
                try:
                    renders[k] = self._rendered(messages[:k], where)
                except ConvertError:
                    renders[k] = None
            return renders[k]

        for k in range(len(messages) - 1, 0, -1):
            if prefix(k) is None or not self._ends_with_reply(messages[k - 1], prefix(k), prefix(k - 1)):
                continue
            text, spans = prefix(k)
            e = self.tokenizer.encode(text, add_special_tokens=False)
            if len(e.ids) <= self.max_tokens:
                return e, spans
        return None, None

    def _ends_with_reply(self, last: dict, run: tuple[str, list], before: tuple[str, list] | None) -> bool:
        """Whether a run of first messages ending with ``last`` (``run``: its text and generation spans; ``before``:
        those of the run without it, None where the template refused that run) ends with a reply, a place
        ``overlong="truncate"`` may cut after: a message the template renders inside a ``{% generation %}`` block,
        of any role but a prompt's (:data:`PROMPT_ROLES`: ShareGPT's ``gpt`` under a template that trains it is a
        reply, a user's message under a template that trains every turn is not); for a template without such blocks
        (``train_on="all"``), or where the run without it cannot be rendered to compare, a message of a role in
        :data:`REPLY_ROLES`."""
        if self.template.has_generation and before is not None:
            return len(run[1]) > len(before[1]) and role_of(last) not in PROMPT_ROLES
        return role_of(last) in REPLY_ROLES
