"""examples/gpt_train.py: a small GPT-style language model trained on a token dataset, resuming exactly.

    fastio convert corpus.jsonl tokens --tokenizer tokenizer.json  # or fastio index DIR --eos-id N [--vocab-size V]
    python examples/gpt_train.py tokens ckpt [--steps 200] [--seq-len 64] [--batch-size 8] [--remainder pad|partial]

A tiny causal transformer on the CPU reads packed sequences (``fastio.Tokens``): inputs ``tokens[:, :-1]``,
targets ``tokens[:, 1:]``, positions from ``position_ids`` (they restart after every end-of-document token). Its
embedding has the manifest's ``tokens.embedding_size`` rows: the tokenizer's vocabulary size (a conversion, or
``fastio index --vocab-size``), else the largest id + 1 that ``fastio index`` read.
The Checkpointer saves the model, the optimizer and the Loader's position every 5 steps; run the same command
after a kill (SIGKILL included) and it continues from the last committed step with the same sequences and the
same per-step losses as a run that was never stopped. tests/test_tokens_loader.py kills it and compares.
``--remainder`` is the Loader's ``remainder`` (this example's and the other token examples'): ``partial`` takes a
``--batch-size`` larger than the dataset's sequences (one batch of them).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from torch import nn

import fastio
from fastio.order.sampler import REMAINDER_MODES


class TinyGPT(nn.Module):
    """Token and position embeddings, a few causal self-attention blocks, a linear head."""

    def __init__(self, vocab: int, seq_len: int, width: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.heads = heads

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits of ``tokens`` [B, L]; with ``segments`` (the batch's ``segment_ids``) a token attends only to
        the tokens before it in its own packed document (block-causal), else to every token before it."""
        return self.decode(self.tok(tokens), positions, segments)

    def decode(self, embedded: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Logits of input embeddings ``embedded`` [B, L, width] (:meth:`forward`'s, or a vision model's
        placed among them), as :meth:`forward` computes them."""
        causal = nn.Transformer.generate_square_subsequent_mask(embedded.shape[1])
        x = embedded + self.pos(positions)
        if segments is None:
            return self.head(self.blocks(x, mask=causal, is_causal=True))
        apart = segments[:, :, None] != segments[:, None, :]
        mask = causal.masked_fill(apart, float("-inf")).repeat_interleave(self.heads, dim=0)
        return self.head(self.blocks(x, mask=mask))


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def next_token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy of every target ``tokens[:, 1:]``."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    logits = model(inputs, batch["position_ids"][:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse's one-line error names the flag otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_remainder(parser: argparse.ArgumentParser) -> None:
    """``--remainder``, the Loader's ``remainder`` (what a token example's Loader takes: ``remainder=args.remainder``)."""
    parser.add_argument("--remainder", choices=REMAINDER_MODES, default="pad",
                        help="the Loader's remainder: 'pad' fills an epoch's last batch by wrapping to its start, "
                        "'partial' keeps it smaller (and takes a --batch-size larger than the dataset)")


def train_loop(ckpt_dir: str, steps: int, make_loader, make_model, loss_of, note=lambda batch: "") -> None:
    """The loop both token examples share: ``make_loader()``, ``make_model(loader)``, AdamW, ``loss_of(model,
    batch)`` a step, a ``step N loss ...`` line each (``note(batch)`` added), the Checkpointer every 5 steps (the
    model, the optimizer and the Loader's position), resumed from the last committed step, preemption obeyed."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same float sums in every run: per-step losses compare bit for bit
    with fastio.exit_cleanly():  # a CKPT_DIR that cannot be made (a file there) is one line too
        ckpt = fastio.Checkpointer(ckpt_dir, every_steps=5, keep=2)
    with fastio.exit_cleanly(ckpt):
        train = make_loader()
        model = make_model(train)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        app = {"model": model, "optim": optimizer, "loader": train}  # the Loader's position is saved too

        start = ckpt.restore_latest(app)
        step = start.step if start else 0
        print(f"resumed at step {step}" if start else "fresh start", flush=True)
        while step < steps:
            for batch in train:  # the rest of the current epoch, then the next one
                loss = loss_of(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                print(f"step {step} loss {loss.item()!r}{note(batch)} sequences {batch['index'].tolist()}", flush=True)
                ckpt.maybe_save(step, app, metrics={"loss": loss.item()})
                if ckpt.preempted or step >= steps:
                    break
            if ckpt.preempted:
                ckpt.close()
                print(f"preempted: saved step {step}; run the same command to resume", flush=True)
                sys.exit(ckpt.exit_code)
        if not start or step > start.step:
            ckpt.save(step, app, blocking=True)
        ckpt.close()
        train.close()
    print(f"done: {step} steps, weights {weights_digest(model)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a token dataset (fastio convert --tokenizer, fastio index --eos-id)")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    add_remainder(parser)
    args = parser.parse_args(argv)

    def make_model(train: fastio.Loader) -> TinyGPT:
        vocab = train.dataset.manifest.tokens.embedding_size
        if vocab is None:  # indexed by a fastio that did not record the largest id
            parser.error(f"{args.data}: the manifest records no vocabulary size: run fastio index again with "
                         "--overwrite (and --vocab-size N)")
        return TinyGPT(vocab, args.seq_len + 1)

    train_loop(args.ckpt_dir, args.steps,
               lambda: fastio.Loader(args.data, pipeline=fastio.Tokens(seq_len=args.seq_len),
                                     batch_size=args.batch_size, device="cpu", seed=0, remainder=args.remainder),
               make_model, next_token_loss)


if __name__ == "__main__":
    main()
