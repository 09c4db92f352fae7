"""Token test helpers: a tiny BPE tokenizer trained offline (no downloads), and small corpora."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stream of tokens for language models",
    "héllo wörld — ünïcode text, 日本語 too",
    "packing documents into sequences of fixed length",
    "megatron indexed datasets hold tokens in bin files",
] * 4


def train_tokenizer(path: Path, eos: str | None = "<|endoftext|>", vocab_size: int = 300) -> Path:
    """Train a byte-level BPE on :data:`CORPUS` and save it as ``tokenizer.json`` at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos] if eos else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(path))
    return path
