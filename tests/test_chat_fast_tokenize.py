"""A byte-level BPE's conversations tokenized without tokenizers' per-byte bookkeeping
(fastio/formats/byte_level_bpe.py): the same ids and character offsets as tokenizers' own encode on text that
tries the pattern's edges, the same ids and mask as transformers' apply_chat_template, and every tokenizer of
another shape left to tokenizers, still equal to transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokens_helpers import CHATML, GLUED, chat_config, chat_tokenizer, hf_ids_and_mask, hf_tokenizer

from fastio.convert.chat_encode import ChatEncoder
from fastio.convert.token_convert import load_tokenizer
from fastio.formats.byte_level_bpe import ByteLevelBPE, FastEncoding
from fastio.formats.chat_template import load_chat_template

PIECES = ["x  y", "a\n\n\nb", "it's  'tis 'S", "they'll've'd", "123456 7.5", " \t \r\n", "end   ", "!!!  ???",
          "(x+y)*z=[1]", "<|im_end|>x", "  <|im_start|>", "alpha<|endoftext|>beta", "héllo wörld", "日本語",
          "a\x0bb", "a\x1cb", "\u00a0nbsp", "emoji 😀 ok", "gamma  delta\t\tzeta", "IT'S WE'LL", "?!\n\n",
          "1234567", " \n\n x", "x \r\n\r\n  y"]
"""Text at the pattern's edges: whitespace runs before words and at the end, contractions, digits, punctuation,
added tokens inside text, and characters left to tokenizers (non-ASCII, vertical tab, a separator control)."""


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fastchat")
    return chat_tokenizer(root / "tokenizer.json"), root


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(PIECES, int(rng.integers(1, 6)))) for _ in range(n)]


def _assert_encodes_as_tokenizers(tok, texts):
    fast = ByteLevelBPE.of(tok)
    assert fast is not None
    got = fast.encode_batch(texts)
    for text, g, want in zip(texts, got, tok.encode_batch(texts, add_special_tokens=False)):
        assert g.ids == want.ids, text
        assert [g.char_to_token(p) for p in range(len(text) + 1)] == [
            want.char_to_token(p) for p in range(len(text) + 1)], text
    return got


def test_ids_and_offsets_equal_tokenizers_at_the_patterns_edges(chat_files):
    tok = load_tokenizer(chat_files[0])
    texts = _texts(300)
    got = _assert_encodes_as_tokenizers(tok, texts)
    _assert_each_way_taken(texts, got)


def _assert_each_way_taken(texts, got):
    """Texts done here whole, texts with pieces tokenizers encoded (their offsets taken in), and texts mostly left
    to tokenizers, encoded by it whole."""
    fast = [isinstance(g, FastEncoding) for g in got]
    assert any(f and t.isascii() for t, f in zip(texts, fast))
    assert any(f and not t.isascii() for t, f in zip(texts, fast))
    assert not all(fast)


def test_added_tokens_split_raw_first_then_normalized(chat_files):
    """A normalized added token starting before a raw one it overlaps: tokenizers splits the raw one out first."""
    from tokenizers import AddedToken

    tok = load_tokenizer(chat_files[0])
    tok.add_tokens([AddedToken("a<|im", normalized=True), AddedToken("beta gam", normalized=True)])
    got = _assert_encodes_as_tokenizers(tok, ["a<|im_end|>", "xa<|imy", "alpha beta gamma", *_texts(50, 1)])
    assert isinstance(got[0], FastEncoding) and tok.token_to_id("<|im_end|>") in got[0].ids


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""Llama 3's pre-tokenizer pattern (Qwen 2's differs only in ``\\p{N}`` one at a time)."""


def split_shaped(path, texts):
    """A byte-level BPE shaped as Llama 3's and Qwen 2's ``tokenizer.json`` (an NFC normalizer, a Split regex then
    ``ByteLevel(use_regex=False)``, ``ignore_merges``, a ``ByteLevel`` then ``TemplateProcessing`` post-processor
    adding a begin token), with the chat specials, trained here on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)])])
    tok.save(str(path))
    return path


def test_a_split_pattern_tokenizer_encodes_as_tokenizers(tmp_path):
    """Llama 3's and Qwen 2's shape: the Split pattern is translated for ASCII, and equal to tokenizers' onig."""
    tok = load_tokenizer(split_shaped(tmp_path / "tokenizer.json", _texts(200, 5)))
    texts = _texts(300, 6)
    _assert_each_way_taken(texts, _assert_encodes_as_tokenizers(tok, texts))


def _reshaped(path, change) -> object:
    spec = json.loads(path.read_text())
    change(spec)
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(spec))


OTHER_SHAPES = {
    "normalizer": lambda s: s.update(normalizer={"type": "Lowercase"}),
    "prefix space": lambda s: s["pre_tokenizer"].update(add_prefix_space=True),
    "trimmed offsets": lambda s: s.update(post_processor={"type": "ByteLevel", "add_prefix_space": False,
                                                          "trim_offsets": True, "use_regex": True}),
    "lstrip": lambda s: s["added_tokens"][-1].update(lstrip=True),
    "a normalized non-ASCII added token under NFKC": lambda s: (
        s.update(normalizer={"type": "NFKC"}),
        s["added_tokens"].append({"id": max(t["id"] for t in s["added_tokens"]) + 1000, "content": "\ufb01x",
                                  "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
                                  "special": False})),
    "another property": lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{Lu}+|[^\p{Lu}]+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}),
}


@pytest.mark.parametrize("shape", sorted(OTHER_SHAPES))
def test_other_shapes_are_left_to_tokenizers(chat_files, shape):
    tok = _reshaped(chat_files[0], OTHER_SHAPES[shape])
    assert ByteLevelBPE.of(tok) is None


def _encoder(tok, config):
    return ChatEncoder(tok, load_chat_template(config), "generation", "messages", np.dtype("uint16"))


def _conversations(n: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    return [[{"role": "user", "content": "".join(rng.choice(PIECES, 3))},
             {"role": "assistant", "content": "".join(rng.choice(PIECES, 4))}] * int(rng.integers(1, 3))
            for _ in range(n)]


def _assert_equal_transformers(encoder, hf, template, chats):
    lengths, ids, mask, _ = encoder.encode([f"c.jsonl:{i + 1}" for i in range(len(chats))], chats)
    ends = np.cumsum(lengths)
    for i, (chat, e, n) in enumerate(zip(chats, ends, lengths)):
        want_ids, want_mask = hf_ids_and_mask(hf, template, chat)
        assert ids[e - n:e].tolist() == want_ids, f"conversation {i}: ids differ"
        assert mask[e - n:e].astype(int).tolist() == want_mask, f"conversation {i}: mask differs"


@pytest.mark.parametrize("template", [CHATML, GLUED], ids=["chatml", "glued"])
def test_conversations_equal_transformers_on_the_fast_path(chat_files, template):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    tok, root = chat_files
    config = chat_config(root / f"fast_{len(template)}.json", template)
    encoder = _encoder(load_tokenizer(tok), config)
    assert encoder.fast is not None
    _assert_equal_transformers(encoder, hf_tokenizer(tok, config), template, _conversations(60, len(template)))


def test_conversations_of_a_split_pattern_tokenizer_equal_transformers(tmp_path):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    tok = split_shaped(tmp_path / "tokenizer.json", _texts(200, 7))
    config = chat_config(tmp_path / "config.json", GLUED)
    encoder = _encoder(load_tokenizer(tok), config)
    assert encoder.fast is not None
    _assert_equal_transformers(encoder, hf_tokenizer(tok, config), GLUED, _conversations(40, 8))


@pytest.mark.parametrize("shape", ["normalizer", "trimmed offsets"])
def test_conversations_equal_transformers_on_tokenizers_path(chat_files, tmp_path, shape):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    tok_path, root = chat_files
    tok = _reshaped(tok_path, OTHER_SHAPES[shape])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = chat_config(tmp_path / "config.json", GLUED)
    encoder = _encoder(load_tokenizer(tmp_path / "tokenizer.json"), config)
    assert encoder.fast is None
    _assert_equal_transformers(encoder, hf_tokenizer(tmp_path / "tokenizer.json", config), GLUED,
                               _conversations(20, 3))


FULL_WIDTH = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>")
"""DeepSeek's special tokens: not ASCII (full-width bars, U+2581), split out of the text as any added token."""
THINKING = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
            "{% else %}{{ '<｜Assistant｜>' }}{% generation %}{% if m.reasoning_content is defined %}"
            "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
            "{{ m.content + '<｜end▁of▁sentence｜>' }}{% endgeneration %}{% endif %}{% endfor %}")
"""A DeepSeek-R1-like template: non-ASCII special tokens around the turns, the reasoning inside the reply's span."""


def test_non_ascii_special_tokens_and_reasoning_equal_transformers_on_the_fast_path(tmp_path):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    from tokens_helpers import CHAT_WORDS, CORPUS, train_tokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [*CORPUS, *(" ".join(CHAT_WORDS[i:] + CHAT_WORDS[:i]) for i in range(len(CHAT_WORDS)))] * 2
    tok = train_tokenizer(tmp_path / "tokenizer.json", eos=None, vocab_size=400, specials=FULL_WIDTH, texts=texts)
    (tmp_path / "config.json").write_text(json.dumps({"chat_template": THINKING, "bos_token": FULL_WIDTH[0],
                                                      "eos_token": FULL_WIDTH[3]}))
    encoder = _encoder(load_tokenizer(tok), tmp_path / "config.json")
    assert encoder.fast is not None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok), bos_token=FULL_WIDTH[0], eos_token=FULL_WIDTH[3])
    chats = _conversations(30, 9)
    for i, chat in enumerate(chats):  # reasoning (under any of its names) on some replies: transformers aliases it
        for m in chat[1::2][: i % 3]:
            m[("reasoning_content", "thinking", "reasoning")[i % 3]] = "".join(PIECES[i % len(PIECES)])
    _assert_equal_transformers(encoder, hf, THINKING, chats)
