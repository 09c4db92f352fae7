"""examples/sft_train.py: supervised fine-tuning on conversations, trained only on the assistant's tokens, resuming
exactly.

    fastio convert chats.jsonl chat --tokenizer tokenizer.json --chat-template tokenizer_config.json \\
        --max-tokens 257 --overlong truncate
    python examples/sft_train.py chat ckpt [--steps 200] [--seq-len 256] [--batch-size 8] [--remainder pad|partial]

Whole conversations are packed into sequences of ``seq_len + 1`` tokens (``fastio.Tokens(packing="best-fit")``);
the tiny causal transformer of ``examples/gpt_train.py`` reads inputs ``tokens[:, :-1]`` with ``position_ids``
restarting at each conversation and a block-causal attention mask from ``segment_ids`` (no token sees another
conversation), and the loss counts a target ``tokens[:, 1:]`` only where ``loss_mask[:, 1:]`` is True: the tokens
of the chat template's ``{% generation %}`` blocks (the replies), never the prompts, template text or padding.
The Checkpointer saves the model, the optimizer and the Loader's position every 5 steps; run the same command after
a kill (SIGKILL included) and it continues from the last committed step with the same sequences and the same
per-step losses as a run that was never stopped. tests/test_chat_loader.py kills it and compares. A size flag that
is not a positive integer, or a CKPT_DIR that cannot be made, is refused in one line naming it (exit 2).
``--remainder partial`` takes a ``--batch-size`` larger than the dataset's packed sequences (one batch of them).
"""

from __future__ import annotations

import argparse

import torch
from gpt_train import TinyGPT, add_remainder, positive_int, train_loop
from torch import nn

import fastio


def masked_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the trained targets of ``batch`` (``loss_mask[:, 1:]``)."""
    inputs = batch["tokens"][:, :-1]
    return trained_loss(model(inputs, batch["position_ids"][:, :-1], batch["segment_ids"][:, :-1]), batch)


def trained_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [B, L, vocab] (of the inputs ``tokens[:, :-1]``) against the targets
    ``tokens[:, 1:]``, counting only the trained ones (``loss_mask[:, 1:]``; none of a row ``padded`` flags: a
    repeat that fills an epoch's last batch)."""
    targets = batch["tokens"][:, 1:]
    each = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    trained = (batch["loss_mask"][:, 1:] & ~batch["padded"][:, None]).flatten()
    return (each * trained).sum() / trained.sum().clamp(min=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a chat dataset (fastio convert --tokenizer ... --chat-template ...)")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    add_remainder(parser)
    args = parser.parse_args(argv)
    train_loop(args.ckpt_dir, args.steps,
               lambda: fastio.Loader(args.data, pipeline=fastio.Tokens(seq_len=args.seq_len, packing="best-fit"),
                                     batch_size=args.batch_size, device="cpu", seed=0, remainder=args.remainder),
               lambda train: TinyGPT(train.dataset.manifest.tokens.embedding_size, args.seq_len + 1), masked_loss,
               note=lambda batch: f" trained {int(batch['loss_mask'][:, 1:].sum())}")


if __name__ == "__main__":
    main()
