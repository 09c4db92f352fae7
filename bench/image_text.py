"""Image-text benchmark: packed vision-language batches, samples/s, fastio (``fastio.ImageText``: images decoded and
augmented by DALI, tokens packed best-fit) against ``torch.utils.data.DataLoader`` (2 workers) over
``webdataset.WebDataset`` reading the same shards, with PIL decoding and augmenting the same images (the same crop
size, dtype and layout: ``bench.loader.PeerTransform``), the same tokens and loss masks (the shards' ``tokens.i32``
and ``mask.bits``) and the same best-fit packing done in Python (``bench/image_text_peer.py``), delivering the same
batch dict (:func:`structure` checks it before timing); and against Megatron-Energon 7.4 packing by the same rule
(``bench/image_text_energon.py``; left out, saying why, where it is not installed).

Data (made once under the work folder, offline): ``--conversations`` LLaVA-like conversations (``bench.chat``'s
generator: an optional system message, 1..8 turns, fewer more often), each holding 0, 1 or 2 images (20 %, 60 %,
20 %) as ``<image>`` placeholders in its first user turn; the images are photo-like JPEGs of 300..500 px a side
(``fastio.convert.synthetic.photo_jpeg``); a byte-level BPE of 1,000 ids with ChatML's specials and ``<image>``;
converted with ``fastio convert --image-field images --chat-template`` into 8 shards. Batches: 4 sequences of
``seq_len`` 4,096 (+1), each image 576 tokens (``image_seq_len``, LLaVA-1.5 at 336 px), at most 8 images a
sequence, images 336 x 336 float32 CHW normalised (``ImageTrain``'s random resized crop and flip).

fastio's side is one Loader for all rounds (round r: its epoch r; ``bench.media.Epochs``), each peer's loader
ends each epoch. Rounds are interleaved, each records what the other processes used of the cores; each figure is
the median over the rounds of fastio's samples/s (conversations delivered, the segments of the packed rows) over
a peer's in the same round (target >= 1.5), with CPU ms per sample of each side.

``python -m bench.image_text [--repeats N] [--conversations N]`` writes ``bench/out/image_text.json``;
``--conversations 120`` checks that it runs (``python -m bench.run --only image_text --tiny`` does the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, write_results
from bench.image_text_peer import WINDOW, WORKERS, Packing, peer_loader
from bench.quiet import before_section, during, read_sample

__all__ = ["Packing", "check_structure", "fastio_loader", "make_dataset", "peer_loader", "peers", "run", "samples_in",
           "structure"]

TARGET = 1.5
CONVERSATIONS, TINY = 2000, 120
SHARDS = 8
IMAGE_SIDES = (300, 500)
IMAGES_PER_SAMPLE = ((0, 1, 2), (0.2, 0.6, 0.2))


def make_dataset(workdir: Path, n: int, seed: int = 0) -> Path:
    """The converted image-text dataset of ``n`` conversations under ``workdir`` (made once, reused)."""
    from fastio.convert.image_text import ImageTextOptions, convert_image_text
    from fastio.convert.run import ConvertConfig

    root = Path(workdir) / f"vlm-{n}"
    dest = root / "ds"
    if (dest / "manifest.json").is_file():
        return dest
    source, tok, config = _source(root, n, seed)
    convert_image_text(ConvertConfig(source, dest, progress=False, overwrite=True,
                                     max_samples_per_shard=-(-n // SHARDS)), ImageTextOptions(tok, config))
    return dest


def _source(root: Path, n: int, seed: int) -> tuple[Path, Path, Path]:
    """``vlm.jsonl`` of ``n`` conversations with their JPEGs in ``img/``, the tokenizer and its template."""
    from bench.chat import chat_tokenizer, conversations
    from fastio.convert.synthetic import photo_jpeg

    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    chats, rows = conversations(n, seed), []
    for i, messages in enumerate(chats):
        images = []
        for k in range(int(rng.choice(IMAGES_PER_SAMPLE[0], p=IMAGES_PER_SAMPLE[1]))):
            w, h = (int(v) for v in rng.integers(IMAGE_SIDES[0], IMAGE_SIDES[1] + 1, 2))
            (root / "img" / f"{i}-{k}.jpg").write_bytes(photo_jpeg(rng, w, h))
            images.append(f"img/{i}-{k}.jpg")
        user = next(j for j, m in enumerate(messages) if m["role"] == "user")
        messages[user] = {**messages[user], "content": "<image>\n" * len(images) + messages[user]["content"]}
        rows.append({"images": images, "messages": messages})
    source = root / "vlm.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, config = chat_tokenizer(root, chats, specials=("<image>",))
    return source, tok, config


# -- fastio's side, the check and the rounds ----------------------------------------------------------------------

def fastio_loader(dest: Path, packing: Packing, workers: int = WORKERS, **options):
    """fastio's side: ``Loader(dest, pipeline=ImageText(...))`` on the CPU with ``workers`` threads."""
    import fastio

    image = (fastio.ImageTrain if packing.train else fastio.ImageEval)(size=packing.size)
    pipe = fastio.ImageText(image=image, seq_len=packing.seq_len, image_seq_len=packing.image_seq_len,
                            packing="best-fit", max_images=packing.max_images)
    options = {"batch_size": packing.batch_size, "device": "cpu", "seed": 0, "num_threads": workers, **options}
    return fastio.Loader(dest, pipeline=pipe, **options)


def structure(batch: dict[str, Any]) -> dict[str, tuple]:
    """Each entry of a batch as (type or dtype, shape with the batch's image count M and cu_seqlens' length n as
    letters): what must be the same on both sides."""
    m = len(batch["images"])
    out = {}
    for key, value in batch.items():
        if isinstance(value, int):
            out[key] = ("int",)
            continue
        shape = tuple("M" if key.startswith("image") and i == 0 and d == m else d for i, d in enumerate(value.shape))
        out[key] = (str(value.dtype), ("n+1",) if key == "cu_seqlens" else shape)
    return out


def samples_in(batch: dict[str, Any]) -> int:
    """The conversations a batch holds: its rows' segments (rows that repeat others to fill the last batch left
    out)."""
    return int(batch["segment_ids"].amax(dim=1)[~batch["padded"]].sum())


def _epoch(make) -> tuple[int, float, float]:
    """Samples, wall seconds and CPU seconds of one epoch of the loader ``make()`` returns (see
    ``bench.media.Epochs``: fastio's waits inside its timing for the batches it decodes ahead)."""
    from bench.media import Epochs, cpu_seconds

    start, cpu, n = time.perf_counter(), cpu_seconds(), 0
    loader = make()
    for batch in loader:
        n += samples_in(batch)
    if isinstance(loader, Epochs):
        loader.settle()
    del loader
    return n, time.perf_counter() - start, cpu_seconds() - cpu


def peers(dest: Path, packing: Packing, conversations: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """Each peer's loader of one epoch (name -> make it) and why any peer is left out (Energon not importable)."""
    makers: dict[str, Callable] = {"dataloader": lambda: peer_loader(dest, packing)}
    try:
        from bench.image_text_energon import energon_loader
    except ImportError as err:
        return makers, {"energon": f"Megatron-Energon is not importable ({err}; make bench installs it)"}
    window = min(WINDOW, -(-conversations // SHARDS))  # a shard's samples: fastio's blocks
    makers["energon"] = lambda: energon_loader(dest, packing, WORKERS, window)
    return makers, {}


def _rounds(dest: Path, packing: Packing, repeats: int, makers: dict[str, Callable]) -> list[dict[str, Any]]:
    """``repeats`` rounds of an epoch of fastio's Loader and of each peer, in turn (the order reversed every other
    round): each side's samples/s, CPU ms per sample and samples, and what the other processes used."""
    from bench.media import Epochs

    ours, rounds = Epochs(lambda: fastio_loader(dest, packing)), []
    sides = [("fastio", lambda: ours), *makers.items()]
    try:
        for r in range(repeats):
            row, start = {}, read_sample()
            for name, make in sides[:: 1 if r % 2 == 0 else -1]:
                n, s, cpu = _epoch(make)
                row[name], row[f"{name}_cpu_ms_per_sample"], row[f"{name}_samples"] = n / s, 1000 * cpu / n, n
            row["quiet"] = during(start, read_sample()).as_dict()
            rounds.append(row)
            print(f"round {r + 1}/{repeats}: " + ", ".join(
                f"{name} {row[name]:.1f} samples/s ({row[f'{name}_cpu_ms_per_sample']:.1f} CPU ms/sample)"
                for name, _ in sides), flush=True)
    finally:
        ours.close()
    return rounds


def check_structure(dest: Path, packing: Packing, makers: dict[str, Callable] | None = None) -> dict[str, tuple]:
    """Each peer's first batch has fastio's :func:`structure` (ValueError naming the peer and the entries that
    differ); ``makers``: :func:`peers`' (default: the DataLoader peer, no worker processes)."""
    with fastio_loader(dest, packing) as ld:
        ours = structure(next(iter(ld)))
    for name, make in (makers or {"dataloader": lambda: peer_loader(dest, packing, workers=0)}).items():
        theirs = structure(next(iter(make())))
        if ours != theirs:
            differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise ValueError(f"{name}'s batch differs from fastio's in {differ}: fastio "
                             f"{ {k: ours.get(k) for k in differ} }, {name} { {k: theirs.get(k) for k in differ} }")
    return ours


PEER_NAMES = {"dataloader": f"DataLoader({WORKERS} workers) + WebDataset + PIL + Python best-fit",
              "energon": f"Megatron-Energon 7.4 ({WORKERS} workers) + PIL + the same best-fit"}


def run(workdir: Path, repeats: int = 3, conversations: int = CONVERSATIONS, results_dir: Path | None = RESULTS_DIR,
        tiny: bool = False) -> dict[str, Any]:
    """The section (``tiny``: :data:`TINY` conversations, a check that it runs)."""
    conversations = TINY if tiny else conversations
    dest, packing = make_dataset(Path(workdir), conversations), Packing()
    makers, skipped = peers(dest, packing, conversations)
    shape = check_structure(dest, packing, makers)
    rounds = _rounds(dest, packing, repeats, makers)
    result: dict[str, Any] = {
        "benchmark": "image_text", "conversations": conversations, "workers": WORKERS, "repeats": repeats,
        "packing": packing.__dict__, "structure": {k: list(v) for k, v in shape.items()}, "rounds": rounds,
        **{k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "quiet"}, "skipped": skipped,
        "ratios": [{"name": f"image-text samples/s vs {PEER_NAMES[name]}", "better": "higher", "target": TARGET,
                    "value": statistics.median(r["fastio"] / r[name] for r in rounds)} for name in makers],
        "machine": machine_info()}
    if results_dir is not None:
        write_results("image_text", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.image_text``."""
    p = section_parser(__doc__)
    p.add_argument("--conversations", type=int, default=CONVERSATIONS,
                   help=f"conversations in the dataset (default {CONVERSATIONS}; {TINY}: a check that it runs)")
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "image_text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    result = run(args.workdir, args.repeats, args.conversations, args.out)
    for r in result["ratios"]:
        print(f"{r['name']}: {r['value']:.3g} (target >= {r['target']})")
    for name, why in result["skipped"].items():
        print(f"{name}: left out, {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
