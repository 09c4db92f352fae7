"""Token test helpers: a tiny BPE tokenizer trained offline (no downloads), and small corpora."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stream of tokens for language models",
    "héllo wörld — ünïcode text, 日本語 too",
    "packing documents into sequences of fixed length",
    "megatron indexed datasets hold tokens in bin files",
] * 4


def train_tokenizer(path: Path, eos: str | None = "<|endoftext|>", vocab_size: int = 300,
                    specials: tuple[str, ...] = (), texts: list[str] = CORPUS) -> Path:
    """Train a byte-level BPE on ``texts`` and save it as ``tokenizer.json`` at ``path`` (its special tokens:
    ``eos``, then ``specials``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, *specials] if eos else [*specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


def word_corpus(root: Path, tokenizer: Path | None = None) -> Path:
    """A converted token dataset of 120 documents of 1..29 random words (seeded), 25 documents per shard, under
    ``root``, tokenized with ``tokenizer`` (default: its own, trained into ``root``); returns the dataset's folder."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    tok = tokenizer or train_tokenizer(root / "tokenizer.json")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 30)))) for _ in range(120)]
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    convert_tokens(TokenConvertConfig(root / "c.jsonl", root / "ds", tok, workers=1, max_samples_per_shard=25))
    return root / "ds"


# -- chat data ----------------------------------------------------------------------------------------

CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>", "<s>")
"""A chat tokenizer's special tokens besides its end of text: ChatML's turn markers and a beginning of text."""

CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{{ eos_token }}"
)
"""A ChatML template with generation spans around each assistant reply and its end-of-turn token."""

GLUED = (
    "{% for message in messages %}"
    "{% if message.role == 'user' %}{{ 'Q' + message.content + '\\n' }}"
    "{% else %}{{ 'a' }}{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
"""A template whose generation spans begin inside a word ('a' then the reply, no space): tokens that straddle the
span's first edge."""

SHAREGPT_ROLES = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% else %}{{ '[' + m.role + '] ' + m.content + '\\n' }}{% endif %}{% endfor %}")
"""A template that trains what role 'assistant' says and renders any other role as a prompt."""

CHAT_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa quick brown fox jumps lazy dog".split()


def chat_tokenizer(path: Path, specials: tuple[str, ...] = CHAT_SPECIALS) -> Path:
    """A tiny byte-level BPE with ChatML specials (end of text ``<|endoftext|>``; ``specials`` after it, in their
    order), trained offline on chat text."""
    texts = [*CORPUS, *(" ".join(CHAT_WORDS[i:] + CHAT_WORDS[:i]) for i in range(len(CHAT_WORDS)))] * 2
    return train_tokenizer(path, vocab_size=400, specials=specials, texts=texts)


def chat_config(path: Path, template: str = CHATML) -> Path:
    """A ``tokenizer_config.json`` holding ``template`` and its special tokens (as Hugging Face writes one)."""
    path.write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                "eos_token": {"content": "<|endoftext|>", "special": True}}))
    return path


def conversations(n: int, seed: int = 0, turns: tuple[int, int] = (1, 4), words: tuple[int, int] = (1, 12),
                  system: bool = True) -> list[list[dict]]:
    """``n`` conversations of seeded random words: an optional system message, then user/assistant turns."""
    rng = np.random.default_rng(seed)

    def text() -> str:
        return " ".join(rng.choice(CHAT_WORDS, int(rng.integers(*words))))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if system and rng.random() < 0.5 else []
        for _ in range(int(rng.integers(*turns))):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append(messages)
    return out


def write_chats(path: Path, chats: list[list[dict]], field: str = "messages") -> Path:
    """``chats`` as a JSONL file, one conversation a line under ``field``."""
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in chats))
    return path


def hf_tokenizer(tokenizer: Path, config: Path):
    """transformers' fast tokenizer of ``tokenizer`` with ``config``'s special tokens (the tests' reference)."""
    from transformers import PreTrainedTokenizerFast

    data = json.loads(config.read_text())
    eos = data["eos_token"]["content"] if isinstance(data["eos_token"], dict) else data["eos_token"]
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), bos_token=data["bos_token"], eos_token=eos)


def hf_ids_and_mask(hf, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask of one conversation."""
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def chat_dataset(root: Path, n: int = 60, seed: int = 0, template: str = CHATML, **options) -> Path:
    """A converted chat dataset of ``n`` conversations (:func:`conversations`) under ``root`` (``chats.jsonl``,
    ``tokenizer.json``, ``tokenizer_config.json`` beside it; ``options`` for the conversion); returns its folder."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    tok = root / "tokenizer.json"
    if not tok.exists():
        chat_tokenizer(tok)
    config = chat_config(root / "tokenizer_config.json", template)
    write_chats(root / "chats.jsonl", conversations(n, seed))
    options = {"workers": 1, "max_samples_per_shard": 20, **options}
    convert_tokens(TokenConvertConfig(root / "chats.jsonl", root / "chat", tok, chat_template=config, **options))
    return root / "chat"


def stored_conversations(dest: Path) -> list[tuple[list[int], list[int]]]:
    """Each stored conversation's ids and loss mask bits, in order, read from the shards' files directly."""
    from fastio.dataset.manifest import load_manifest
    from fastio.formats.megatron import MegatronShard
    from fastio.formats.token_mask import MaskFile

    manifest = load_manifest(dest)
    out = []
    for record in manifest.shards:
        pair = MegatronShard(dest / "shards" / record.name, manifest.tokens.dtype, one_per_document=True)
        bits = MaskFile(dest / "shards" / record.mask_name, pair.index.tokens).all()
        edges = pair.index.starts(np.arange(pair.documents + 1))
        tokens = pair.tokens(0, pair.index.tokens)
        out += [(tokens[a:b].tolist(), bits[a:b].astype(int).tolist()) for a, b in zip(edges[:-1], edges[1:])]
    return out


# -- image-text data ----------------------------------------------------------------------------------

def image_colour(sample: int, image: int) -> tuple[int, int, int]:
    """The solid colour of image ``image`` of sample ``sample`` in :func:`image_text_source` (each pair its own)."""
    return (sample * 19 % 256, 40 + image * 60, 255 - sample * 7 % 200)


def image_text_source(root: Path, n: int = 12, seed: int = 0, size: tuple[int, int] = (20, 14)) -> dict:
    """An image-text source under ``root``: ``tokenizer.json`` (the chat tokenizer plus an ``<image>`` special
    token), ``tokenizer_config.json`` (:data:`CHATML`), ``vlm.jsonl`` of ``n`` conversations whose first user turn
    holds sample i's ``i % 4`` images, each a solid :func:`image_colour` (PNG, JPEG every third), in ``img/``.
    Returns the paths and each line (``rows``)."""
    from PIL import Image

    texts = [*CORPUS, *(" ".join(CHAT_WORDS[i:] + CHAT_WORDS[:i]) for i in range(len(CHAT_WORDS)))] * 2
    tok = train_tokenizer(root / "tokenizer.json", vocab_size=400, specials=(*CHAT_SPECIALS, "<image>"), texts=texts)
    config = chat_config(root / "tokenizer_config.json")
    (root / "img").mkdir(exist_ok=True)
    rows = []
    for i, messages in enumerate(conversations(n, seed, system=False)):
        images = []
        for k in range(i % 4):
            ext = "jpg" if (i + k) % 3 == 0 else "png"
            Image.new("RGB", size, image_colour(i, k)).save(root / "img" / f"s{i}-{k}.{ext}")
            images.append(f"img/s{i}-{k}.{ext}")
        messages[0] = {**messages[0], "content": "<image>" * len(images) + " " + messages[0]["content"]}
        rows.append({"images": images, "messages": messages})
    (root / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"source": root / "vlm.jsonl", "tokenizer": tok, "config": config, "rows": rows}


def image_text_dataset(root: Path, n: int = 8) -> Path:
    """:func:`image_text_source`'s ``n`` conversations converted (one worker) to ``root / "ds"``; returns it."""
    from fastio.convert.image_text import ImageTextOptions, convert_image_text
    from fastio.convert.run import ConvertConfig

    src = image_text_source(root, n=n)
    convert_image_text(ConvertConfig(src["source"], root / "ds", workers=1),
                       ImageTextOptions(src["tokenizer"], src["config"]))
    return root / "ds"


def stored_image_text(dest: Path) -> list[dict[str, bytes]]:
    """Each stored sample's members (field -> bytes, with ``__key__``), in dataset order, read from the tars."""
    import tarfile

    from fastio.dataset.manifest import load_manifest

    out: list[dict[str, bytes]] = []
    for record in load_manifest(dest).shards:
        with tarfile.open(dest / "shards" / record.name) as tar:
            for member in tar:
                key, field = member.name.split(".", 1)
                if not out or out[-1]["__key__"] != key:
                    out.append({"__key__": key})
                out[-1][field] = tar.extractfile(member).read()
    return out
