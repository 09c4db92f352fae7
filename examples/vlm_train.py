"""examples/vlm_train.py: a tiny vision-language model trained on image-text conversations, on the assistant's tokens
only, resuming exactly.

    fastio convert vlm.jsonl vlm --tokenizer tokenizer.json --chat-template tokenizer_config.json \\
        --image-field images --image-token "<image>"
    python examples/vlm_train.py vlm ckpt [--tokenizer tokenizer.json] [--steps 200] [--seq-len 256] \\
        [--image-seq-len 16] [--image-size 32] [--batch-size 4] [--remainder pad|partial]

``fastio.ImageText`` packs whole conversations into sequences of ``seq_len + 1`` tokens, each image token repeated
``image_seq_len`` times (its run), and decodes and augments the batch's images with DALI (``ImageTrain``, random
resized crop and flip, ``image_size`` px). The vision encoder (a patch embedding: one convolution whose stride is
its kernel, cutting each image into ``image_seq_len`` patches, and a linear projector) turns each image into
``image_seq_len`` embeddings, placed over its run: row ``image_rows[i]`` from ``image_starts[i]``. The tiny causal
transformer of ``examples/gpt_train.py`` reads them with the other tokens' embeddings (``position_ids`` restarting
and a block-causal mask from ``segment_ids`` at each conversation), and the loss counts a target ``tokens[:, 1:]``
only where ``loss_mask[:, 1:]`` is True: the replies, never an image, the prompts or padding. The token embedding
has the manifest's ``image_text.embedding_size`` rows (the vocabulary of the tokenizer the dataset was converted
with); ``--tokenizer``, where given, must have as many ids. ``--remainder`` is the Loader's ``remainder``:
``partial`` takes a ``--batch-size`` larger than the dataset's packed sequences (one batch of them). A size flag
that is not a positive integer, a dataset that is not image-text or a CKPT_DIR that cannot be made is refused in one
line naming it (exit 2). The Checkpointer saves the model, the optimizer, the RNG states and the Loader's position
every 5 steps; run the same command after a kill (SIGKILL included) and it continues from the last committed step
with the same sequences, the same per-step losses and the same weights as a run that was never stopped.
tests/test_vlm_example.py kills it and compares.
"""

from __future__ import annotations

import argparse
import math

import torch
from gpt_train import TinyGPT, add_remainder, positive_int, train_loop
from sft_train import trained_loss
from torch import nn

import fastio


class TinyVLM(nn.Module):
    """A patch-embedding vision encoder and projector (each image: ``image_seq_len`` embeddings) in front of
    :class:`TinyGPT`."""

    def __init__(self, vocab: int, seq_len: int, image_size: int, image_seq_len: int, width: int = 32):
        super().__init__()
        patch = patch_side(image_size, image_seq_len)
        self.vision = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.project = nn.Linear(width, width)
        self.lm = TinyGPT(vocab, seq_len, width)

    def forward(self, batch: dict) -> torch.Tensor:
        """Logits of the inputs ``tokens[:, :-1]``, each image's embeddings over its run."""
        embedded = self.lm.tok(batch["tokens"])
        images = batch["images"]
        if len(images):
            patches = self.project(self.vision(images).flatten(2).transpose(1, 2))  # [M, image_seq_len, width]
            run = torch.arange(patches.shape[1])
            rows = batch["image_rows"][:, None].expand(-1, run.numel())
            embedded = embedded.index_put((rows, batch["image_starts"][:, None] + run), patches)
        return self.lm.decode(embedded[:, :-1], batch["position_ids"][:, :-1], batch["segment_ids"][:, :-1])


def patch_side(image_size: int, image_seq_len: int) -> int:
    """The side of the square patches that cut an image of ``image_size`` px into ``image_seq_len`` of them
    (ValueError naming both where none does)."""
    side = math.isqrt(image_seq_len)
    if side * side != image_seq_len or image_size % side:
        raise ValueError(f"--image-seq-len {image_seq_len} must be a square whose side divides --image-size "
                         f"{image_size}: an image's patches are its embeddings")
    return image_size // side


def vlm_loss(model: TinyVLM, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the trained targets of ``batch`` (``loss_mask[:, 1:]``)."""
    return trained_loss(model(batch), batch)


def embedding_size(data: str, tokenizer: str | None) -> int:
    """The rows of the token embedding: the dataset's ``manifest.image_text.embedding_size`` (the vocabulary of the
    tokenizer it was converted with), or ``tokenizer``'s ids (a ``tokenizer.json``), which must be the vocabulary
    the dataset records and hold its largest id. ValueError naming what disagrees or lacks (a DatasetError naming a
    dataset that is not image-text)."""
    from fastio.convert.token_convert import load_tokenizer, vocab_size
    from fastio.dataset.manifest import ImageTextInfo
    from fastio.tokens.image_text import image_token_id

    dataset = fastio.Dataset(data)
    image_token_id(dataset)  # a DatasetError naming a dataset that is not image-text
    info = dataset.manifest.image_text or ImageTextInfo()
    if tokenizer is None:
        if info.embedding_size is None:
            raise ValueError(f"{data}: the manifest records no vocabulary size (converted before fastio recorded "
                             "it): give --tokenizer, or convert it again")
        return info.embedding_size
    ids = vocab_size(load_tokenizer(tokenizer))
    if info.vocab_size not in (None, ids) or (info.max_id is not None and info.max_id >= ids):
        recorded = f"a vocabulary of {info.vocab_size}" if info.vocab_size is not None else f"id {info.max_id}"
        raise ValueError(f"--tokenizer {tokenizer} has {ids} ids, but {data} holds {recorded} (manifest.image_text): "
                         "give the tokenizer it was converted with, or leave --tokenizer out")
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="an image-text dataset (fastio convert --image-field ...)")
    parser.add_argument("ckpt_dir")
    parser.add_argument("--tokenizer", help="the tokenizer.json it was converted with, checked against the "
                        "vocabulary its manifest records (default: the embedding is sized by the manifest's)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--image-seq-len", type=positive_int, default=16)
    parser.add_argument("--image-size", type=positive_int, default=32)
    parser.add_argument("--batch-size", type=positive_int, default=4)
    add_remainder(parser)
    args = parser.parse_args(argv)
    try:
        patch_side(args.image_size, args.image_seq_len)
        vocab = embedding_size(args.data, args.tokenizer)
    except (ValueError, fastio.FastioError) as err:
        parser.error(str(err))
    print(f"embedding: {vocab} rows", flush=True)
    pipe = fastio.ImageText(image=fastio.ImageTrain(size=args.image_size), seq_len=args.seq_len,
                            image_seq_len=args.image_seq_len, packing="best-fit")
    train_loop(args.ckpt_dir, args.steps,
               lambda: fastio.Loader(args.data, pipeline=pipe, batch_size=args.batch_size, device="cpu", seed=0,
                                         remainder=args.remainder),
               lambda train: TinyVLM(vocab, args.seq_len + 1, args.image_size, args.image_seq_len),
               vlm_loss,
               note=lambda batch: f" trained {int(batch['loss_mask'][:, 1:].sum())} images {len(batch['images'])}")


if __name__ == "__main__":
    main()
