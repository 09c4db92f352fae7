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


def word_corpus(root: Path) -> Path:
    """A converted token dataset of 120 documents of 1..29 random words (seeded), 25 documents per shard, with
    its tokenizer, under ``root``; returns the dataset's folder."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    tok = train_tokenizer(root / "tokenizer.json")
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 30)))) for _ in range(120)]
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    convert_tokens(TokenConvertConfig(root / "c.jsonl", root / "ds", tok, workers=1, max_samples_per_shard=25))
    return root / "ds"
