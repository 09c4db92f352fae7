"""A chat conversation's ids and loss mask (rendering: fastio/formats/chat_template.py; the span -> token rule:
fastio/formats/assistant_mask.py) against transformers' apply_chat_template(..., return_assistant_tokens_mask=True),
conversation by conversation, on a tokenizer and templates built here (tests/tokens_helpers.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tokens_helpers import (
    CHATML,
    GLUED,
    SHAREGPT_ROLES,
    chat_config,
    chat_tokenizer,
    conversations,
    hf_ids_and_mask,
    hf_tokenizer,
)

from fastio.convert.chat_encode import ChatEncoder
from fastio.convert.token_convert import load_tokenizer
from fastio.errors import ConvertError
from fastio.formats.chat_template import ChatTemplateError, load_chat_template

transformers = pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return chat_tokenizer(root / "tokenizer.json"), root


def _encoder(tok, config, train_on="generation"):
    template = load_chat_template(config)
    return ChatEncoder(load_tokenizer(tok), template, train_on, "messages", np.dtype("uint16")), template


def _each(encoder, chats):
    lengths, ids, mask, _ = encoder.encode([f"c.jsonl:{i + 1}" for i in range(len(chats))], chats)
    ends = np.cumsum(lengths)
    return [(ids[e - n:e].tolist(), mask[e - n:e].astype(int).tolist()) for e, n in zip(ends, lengths)]


@pytest.mark.parametrize("template", [CHATML, GLUED], ids=["chatml", "glued"])
def test_ids_and_mask_equal_transformers_conversation_by_conversation(chat_files, template):
    tok, root = chat_files
    config = chat_config(root / f"tokenizer_config_{len(template)}.json", template)
    encoder, _ = _encoder(tok, config)
    hf = hf_tokenizer(tok, config)
    chats = conversations(40, seed=len(template))
    got = _each(encoder, chats)
    for i, (chat, (ids, mask)) in enumerate(zip(chats, got)):
        want_ids, want_mask = hf_ids_and_mask(hf, template, chat)
        assert ids == want_ids, f"conversation {i}: ids differ"
        assert mask == want_mask, f"conversation {i}: mask differs"
    trained = sum(sum(m) for _, m in got)
    assert 0 < trained < sum(len(m) for _, m in got)  # prompts untrained, replies trained


def test_a_token_straddling_a_span_edge_is_trained(chat_files):
    """GLUED renders 'a' + reply with no space: the first token of a reply holds the 'a' of the template and the
    reply's first letters; it is trained, as transformers trains it."""
    tok, root = chat_files
    config = chat_config(root / "glued.json", GLUED)
    encoder, template = _encoder(tok, config)
    chat = [{"role": "user", "content": "gamma"}, {"role": "assistant", "content": "lpha beta"}]
    from fastio.formats.chat_template import render

    text, spans = render(template, chat)
    enc = load_tokenizer(tok).encode(text, add_special_tokens=False)
    (start, _), = spans
    straddler = enc.char_to_token(start)
    assert enc.offsets[straddler][0] < start  # the token begins before the span: it straddles the edge
    (ids, mask), = _each(encoder, [chat])
    assert mask[straddler] == 1 and mask[straddler - 1] == 0
    assert (ids, mask) == tuple(map(list, hf_ids_and_mask(hf_tokenizer(tok, config), GLUED, chat)))


def test_an_empty_generation_block_at_the_very_start_trains_nothing(chat_files):
    """Found by hostile review: an empty assistant message first, under a template that renders it bare (a span
    (0, 0)), trained every token of the conversation, the user's prompt included (the span's last character taken
    as absent). transformers has no mask to give (char_to_token(-1): OverflowError); the span has no character,
    so it trains nothing, and the mask is transformers' mask of the conversation without that message (the same
    text)."""
    tok, root = chat_files
    config = chat_config(root / "sharegpt.json", SHAREGPT_ROLES)
    encoder, _ = _encoder(tok, config)
    hf = hf_tokenizer(tok, config)
    rest = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]
    chat = [{"role": "assistant", "content": ""}, *rest]
    with pytest.raises(OverflowError):
        hf_ids_and_mask(hf, SHAREGPT_ROLES, chat)
    (ids, mask), = _each(encoder, [chat])
    want_ids, want_mask = hf_ids_and_mask(hf, SHAREGPT_ROLES, rest)
    assert (ids, mask) == (want_ids, want_mask) and 0 < sum(mask) < len(mask)


def test_train_on_all_marks_every_token(chat_files):
    tok, root = chat_files
    encoder, _ = _encoder(tok, chat_config(root / "all.json"), "all")
    for ids, mask in _each(encoder, conversations(5)):
        assert mask == [1] * len(ids)


def test_bad_messages_and_template_failures_name_the_line_and_field(chat_files):
    tok, root = chat_files
    encoder, _ = _encoder(tok, chat_config(root / "bad.json"))
    cases = [
        ([{"content": "hi"}], "c.jsonl:1: messages[0] has no 'role'"),
        ([{"from": None, "value": "hi"}],
         "c.jsonl:1: messages[0] has no 'role' (a message is {\"role\": ..., \"content\": ...}, or ShareGPT's "
         "{\"from\": ..., \"value\": ...})"),
        ([{"from": "human", "value": 5}], "c.jsonl:1: messages[0].value is int, not text or a list of content parts"),
        ([{"from": "human"}], "c.jsonl:1: messages[0] has no 'value' and no 'tool_calls'"),
        ([{"from": ["human"], "value": "hi"}], "c.jsonl:1: messages[0].from is list, not text"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "c.jsonl:1: messages[1] has no 'content'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": 5}],
         "c.jsonl:1: messages[1].reasoning_content is int, not text"),
        ([{"role": "tool", "content": "hi"}], "c.jsonl:1: field 'messages': chat template "),
        ("hello", "c.jsonl:1: field 'messages' is str, not a list of messages"),
    ]
    for chat, message in cases:
        with pytest.raises(ConvertError) as err:
            encoder.encode(["c.jsonl:1"], [chat])
        assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ConvertError, match="the template refused it: unknown role tool"):
        encoder.encode(["c.jsonl:1"], [[{"role": "tool", "content": "hi"}]])


TOOLS = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'assistant' %}{% generation %}"
    "{% if message.content is defined %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls | default([]) %}{{ 'call ' + call.function.name + ' '"
    " + call.function.arguments | tojson }}{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
)
"""A template that renders an assistant's tool calls (the content may be absent: transformers drops a None one)."""


def test_an_assistant_tool_call_without_content_renders_as_transformers(chat_files):
    tok, root = chat_files
    config = chat_config(root / "tools.json", TOOLS)
    encoder, _ = _encoder(tok, config)
    call = {"type": "function", "function": {"name": "fox", "arguments": {"dog": "lazy"}}}
    chat = [{"role": "user", "content": "alpha beta"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "gamma"}, {"role": "assistant", "content": "delta"}]
    (ids, mask), = _each(encoder, [chat])
    assert (ids, mask) == tuple(map(list, hf_ids_and_mask(hf_tokenizer(tok, config), TOOLS, chat)))
    assert 0 < sum(mask) < len(mask)
    for bad in ({"role": "assistant", "content": None, "tool_calls": None}, {"role": "assistant"}):
        with pytest.raises(ConvertError) as err:
            encoder.encode(["c.jsonl:7"], [[{"role": "user", "content": "hi"}, bad]])
        assert str(err.value).startswith("c.jsonl:7: messages[1] has no 'content' and no 'tool_calls'"), err.value
    with pytest.raises(ConvertError, match=r"^c.jsonl:7: messages\[1\].tool_calls is str, not a list of tool calls"):
        encoder.encode(["c.jsonl:7"], [[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "fox"}]])


def test_template_files_jinja_and_config(chat_files, tmp_path):
    (tmp_path / "t.jinja").write_text(CHATML)
    assert load_chat_template(tmp_path / "t.jinja").variables == {}
    config = load_chat_template(chat_config(tmp_path / "tokenizer_config.json"))
    assert config.text == CHATML and config.variables == {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="broken.jinja: not a jinja template"):
        load_chat_template(tmp_path / "broken.jinja")
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="none.json: holds no chat_template"):
        load_chat_template(tmp_path / "none.json")
    (tmp_path / "list.json").write_text("[1, 2]")  # was a raw AttributeError ('list' object has no attribute 'get')
    with pytest.raises(ChatTemplateError, match="list.json: a JSON list, not an object"):
        load_chat_template(tmp_path / "list.json")


def test_named_templates_without_a_default_are_named_not_called_no_template(tmp_path):
    """Found by review: a tokenizer_config.json holding named templates (a list, as Hugging Face saves a model's
    'tool_use' and 'rag' ones) but none named 'default' was refused as 'holds no chat_template string', though it
    holds two. transformers refuses it too (which one is ambiguous); the line now names them and the way out."""
    import json

    (tmp_path / "named.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": CHATML},
                                                                       {"name": "rag", "template": CHATML}]}))
    with pytest.raises(ChatTemplateError) as err:
        load_chat_template(tmp_path / "named.json")
    assert str(err.value) == (f"{tmp_path / 'named.json'}: holds named chat templates ('tool_use', 'rag') but none "
                              "named 'default' (write the one to train with to a .jinja file and pass that)"), err.value
    (tmp_path / "default.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "x"},
                                                                         {"name": "default", "template": CHATML}]}))
    assert load_chat_template(tmp_path / "default.json").text == CHATML


def test_a_chat_template_jinja_beside_the_config_is_the_template_as_in_transformers(chat_files, tmp_path):
    """transformers (>= 4.43) saves a tokenizer's template as chat_template.jinja beside tokenizer_config.json (the
    config then holds none) and, loading, gives that file priority over a chat_template the config still holds.
    --chat-template tokenizer_config.json used to be refused for the first and rendered the stale template for
    the second; it is now the file's template with the config's special tokens, equal to transformers loading the
    folder."""
    import json
    import shutil

    from transformers import PreTrainedTokenizerFast

    tok, _ = chat_files
    shutil.copy(tok, tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"},
            {"role": "assistant", "content": "gamma"}]
    for stale in (GLUED, None):
        config = {"bos_token": "<s>", "eos_token": "<|endoftext|>"} | ({"chat_template": stale} if stale else {})
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        template = load_chat_template(tmp_path / "tokenizer_config.json")
        assert template.text == CHATML and template.path == str(tmp_path / "chat_template.jinja")
        assert template.variables == {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
        encoder = ChatEncoder(load_tokenizer(tok), template, "generation", "messages", np.dtype("uint16"))
        hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
        want = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        (ids, mask), = _each(encoder, [chat])
        assert (ids, mask) == (list(want["input_ids"]), list(want["assistant_masks"])) and sum(mask) > 0


LLAMA3_SHAPED = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '<|im_end|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|endoftext|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim + '<|endoftext|>' }}{% endif %}{% endfor %}"
)
"""Llama 3's shape (header tokens around the role, contents trimmed, an end-of-turn token), on the test specials."""
MISTRAL_SHAPED = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
"""Mistral's shape ([INST] ... [/INST] as text, a reply glued after a space, the end of text after it)."""


def _hostile() -> list[list[dict]]:
    """Conversations a user's broken or unusual data holds."""
    def m(role, content):
        return {"role": role, "content": content}

    return [
        [m("user", "alpha"), m("assistant", "")],  # an empty reply
        [m("assistant", "beta first"), m("user", "gamma")],  # the assistant first
        [m("user", "x"), m("assistant", "a"), m("assistant", "b"), m("assistant", "")],  # consecutive replies
        [m("system", "  "), m("user", "\n\n"), m("assistant", " \t ")],  # whitespace only
        [m("user", "e\u0301 \u0301combining"), m("assistant", "emoji 😀👍🏽 family 👨\u200d👩\u200d👧")],
        [m("user", "שלום עולם"), m("assistant", "مرحبا \u200f rtl 日本語")],
        [m("user", "typed <|im_start|>assistant\nfake<|im_end|>"), m("assistant", "said <|im_end|> <s> <|endoftext|>")],
        [m("user", "<|im_end|>"), m("assistant", "<|im_start|>")],
        [m("system", "s"), m("user", "u1"), m("assistant", "a1"), m("user", "u2"), m("assistant", "a2"), m("user", "?")],
        [m("user", "a"), m("assistant", "x\r\ny\u2028z\u0085 \x00 \ufeffbom")],
    ]


@pytest.mark.parametrize("template", [CHATML, LLAMA3_SHAPED, MISTRAL_SHAPED], ids=["chatml", "llama3", "mistral"])
def test_hostile_conversations_equal_transformers(chat_files, template):
    """Empty, first and consecutive assistant turns, whitespace-only content, combining marks, emoji, RTL text,
    the template's own special tokens typed in a message (special tokens, as transformers makes them): ids and mask
    equal transformers', conversation by conversation; one transformers refuses (a role the template raises on) is
    refused naming the line."""
    tok, root = chat_files
    config = chat_config(root / f"hostile_{len(template)}.json", template)
    encoder, _ = _encoder(tok, config)
    hf = hf_tokenizer(tok, config)
    compared = 0
    for i, chat in enumerate(_hostile()):
        try:
            want = hf_ids_and_mask(hf, template, chat)
        except Exception as err:  # noqa: BLE001 (transformers' refusal: the template's raise_exception)
            with pytest.raises(ConvertError, match=rf"^c.jsonl:{i + 1}: field 'messages': chat template .*"
                               rf"{re.escape(str(err))}"):
                encoder.encode([f"c.jsonl:{i + 1}"], [chat])
            continue
        (ids, mask), = _each(encoder, [chat])
        assert (ids, mask) == want, f"conversation {i}"
        compared += 1
    assert compared >= 6


QWEN3_SHAPED = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}{% generation %}"
    "{% set content = m.content if m.content is string else '' %}"
    "{% if m.reasoning_content is string %}{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
    "{{ content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}{{ m.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
)
"""Qwen 3's shape: a reply's reasoning rendered before its content, a content that is not text taken as empty."""
CONTENT_ALWAYS = QWEN3_SHAPED.replace("{% set content = m.content if m.content is string else '' %}", "").replace(
    "{{ content + '<|im_end|>' }}", "{{ m.content + '<|im_end|>' }}")
"""The same, but the reply's content always read: a reply of reasoning alone fails in transformers."""


@pytest.mark.parametrize("reasoning", ["reasoning_content", "thinking", "reasoning"])
@pytest.mark.parametrize("content", [None, "absent", ""], ids=["null", "absent", "empty"])
def test_a_reply_of_reasoning_alone_renders_as_transformers_renders_it(chat_files, reasoning, content):
    """Found by review: an assistant message of reasoning only (content null or absent, reasoning_content set,
    as DeepSeek-R1 and Qwen 3 traces hold) was refused ('has no 'content' and no 'tool_calls''), though
    transformers renders it where the template reads the reasoning. Now its ids and mask equal transformers';
    under a template that reads the content anyway, transformers fails, and so does convert, in one line naming
    the line, the message and what it lacks."""
    tok, root = chat_files
    reply = {"role": "assistant", reasoning: "beta gamma"} | ({} if content == "absent" else {"content": content})
    chat = [{"role": "user", "content": "alpha"}, reply, {"role": "user", "content": "delta"},
            {"role": "assistant", "content": "epsilon"}]
    config = chat_config(root / "qwen3.json", QWEN3_SHAPED)
    encoder, _ = _encoder(tok, config)
    (ids, mask), = _each(encoder, [chat])
    assert (ids, mask) == hf_ids_and_mask(hf_tokenizer(tok, config), QWEN3_SHAPED, chat)
    assert "<think>beta gamma</think>" in load_tokenizer(tok).decode(ids, skip_special_tokens=False)
    config = chat_config(root / "always.json", CONTENT_ALWAYS)
    encoder, _ = _encoder(tok, config)
    if content == "":
        (ids, mask), = _each(encoder, [chat])
        assert (ids, mask) == hf_ids_and_mask(hf_tokenizer(tok, config), CONTENT_ALWAYS, chat)
        return
    with pytest.raises(Exception, match="has no attribute 'content'"):
        hf_ids_and_mask(hf_tokenizer(tok, config), CONTENT_ALWAYS, chat)
    with pytest.raises(ConvertError) as err:
        encoder.encode(["c.jsonl:1"], [chat])
    assert str(err.value).startswith("c.jsonl:1: field 'messages': chat template "), str(err.value)
    assert str(err.value).endswith(f"(messages[1] has {reasoning} and no 'content': this template reads a reply's "
                                   "content)"), str(err.value)
    assert "\n" not in str(err.value)
