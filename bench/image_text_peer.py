"""The image-text section's DataLoader peer (``bench/image_text.py``): ``torch.utils.data.DataLoader`` over
``webdataset.WebDataset`` reading fastio's image-text shards, each shard's samples (in windows of :data:`WINDOW`, as
fastio's blocks) packed by :func:`best_fit` (fastio's rule, in plain Python), each row laid out by :class:`Assemble`
(image tokens expanded, never trained; positions and segments per sample; padding) with its images decoded and
augmented by PIL (``bench.loader.PeerTransform``, or an ImageEval-like center crop), batched by :func:`collate` into
the dict ``fastio.ImageText`` delivers. The Energon peer (``bench/image_text_energon.py``) shares its pieces."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastio.tokens.image_text import PAD_ID

__all__ = ["WINDOW", "Assemble", "Packing", "best_fit", "collate", "image_fields", "image_token_id", "peer_loader"]

WORKERS = 2
WINDOW = 4096
"""Samples packed together (``fastio.ImageText``'s ``window``: its blocks of a shard)."""


@dataclass(frozen=True)
class Packing:
    """What both sides pack with: rows of ``seq_len + 1`` tokens, ``image_seq_len`` tokens an image, at most
    ``max_images`` images a row, ``batch_size`` rows a batch, images ``size`` x ``size``; ``train``: ImageTrain's
    augmentation (else ImageEval's center crop)."""

    seq_len: int = 4096
    image_seq_len: int = 576
    max_images: int = 8
    batch_size: int = 4
    size: int = 336
    train: bool = True


def best_fit(lengths: list[int], images: list[int], cap: int, max_images: int) -> list[list[int]]:
    """Best-fit decreasing in plain Python: each sample, longest first (ties: the earlier), into the fullest row
    it fits (``cap`` tokens, ``max_images`` images; ties: the earlier row; a row whose images are spent still takes
    image-less samples), else a new row; the rows' samples in placement order."""
    rows: list[list[int]] = []
    room: list[int] = []
    left: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best = -1
        for r in range(len(rows)):
            if lengths[i] <= room[r] and images[i] <= left[r] and (best < 0 or room[r] < room[best]):
                best = r
        if best < 0:
            rows.append([])
            room.append(cap)
            left.append(max_images)
        rows[best].append(i)
        room[best] -= lengths[i]
        left[best] -= images[i]
    return rows


def image_fields(sample: dict) -> list[str]:
    """A sample's image fields (``N.EXT``), by N."""
    from fastio.formats.image_text import image_number

    return sorted((f for f in sample if image_number(f) is not None), key=image_number)


class _Rows:
    """The peer's packing stage: the samples of each shard in windows of :data:`WINDOW` (as fastio's blocks),
    each packed by :func:`best_fit`, as rows."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, samples):
        window: list[dict] = []
        for sample in samples:
            if window and (sample["__url__"] != window[-1]["__url__"] or len(window) == WINDOW):
                yield from self._rows(window)
                window = []
            window.append(sample)
        if window:
            yield from self._rows(window)

    def _rows(self, window: list[dict]):
        from fastio.formats.image_text import TOKENS_FIELD

        p = self.packing
        images = [len(image_fields(s)) for s in window]
        lengths = [len(s[TOKENS_FIELD]) // 4 + k * (p.image_seq_len - 1) for s, k in zip(window, images)]
        for row in best_fit(lengths, images, p.seq_len + 1, p.max_images):
            yield [window[i] for i in row]


class Assemble:
    """One packed row as arrays: image tokens expanded to ``image_seq_len`` copies (never trained, nor a sample's
    first token), positions and segments per sample, padding after (position ramp, segment 0, untrained); its images
    decoded by PIL."""

    def __init__(self, packing: Packing, image_id: int):
        from bench.loader import PeerTransform

        self.packing, self.image_id = packing, image_id
        self.transform = PeerTransform(packing.size) if packing.train else _EvalTransform(packing.size)

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD, decode_sample

        width = self.packing.seq_len + 1
        tokens = np.full(width, PAD_ID, np.int64)
        mask, segments = np.zeros(width, bool), np.zeros(width, np.int32)
        positions = np.zeros(width, np.int64)
        images, starts, at = [], [], 0
        for k, sample in enumerate(samples, 1):
            ids, bits = decode_sample(sample[TOKENS_FIELD], sample[MASK_FIELD])
            image = ids == self.image_id
            reps = np.where(image, self.packing.image_seq_len, 1)
            n = int(reps.sum())
            tokens[at:at + n] = np.repeat(ids, reps)
            mask[at:at + n] = np.repeat(bits & ~image, reps)
            mask[at] = False  # a sample's first token is no target: the token before it is another sample's
            segments[at:at + n], positions[at:at + n] = k, np.arange(n)
            starts += (at + (np.cumsum(reps) - reps)[image]).tolist()
            images += [self._image(sample[f]) for f in image_fields(sample)]
            at += n
        positions[at:] = np.arange(width - at)
        return {"tokens": tokens, "loss_mask": mask, "position_ids": positions, "segment_ids": segments,
                "images": images, "image_starts": starts}

    def _image(self, data: bytes):
        from PIL import Image

        return self.transform((Image.open(io.BytesIO(data)).convert("RGB"), 0))[0]


class _EvalTransform:
    """ImageEval's image with PIL: the shorter side resized to ``size / 0.875``, the center square of ``size``,
    normalised, float32 CHW."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, sample):
        import torch
        from PIL import Image

        from bench.loader import MEAN, STD

        img, label = sample
        w, h = img.size
        short = round(self.size / 0.875)
        w, h = (short, max(1, round(h * short / w))) if w <= h else (max(1, round(w * short / h)), short)
        img = img.resize((w, h), Image.BILINEAR)
        x, y = (w - self.size) // 2, (h - self.size) // 2
        img = img.crop((x, y, x + self.size, y + self.size))
        arr = (np.asarray(img, np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), label


def collate(rows: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """The batch dict fastio's ImageText delivers, of the peer's rows: ``cu_seqlens`` cut where a row starts or its
    segment changes in the inputs ``tokens[:, :-1]``, ``max_seqlen`` the longest piece."""
    import torch

    batch = {k: torch.from_numpy(np.stack([r[k] for r in rows]))
             for k in ("tokens", "loss_mask", "position_ids", "segment_ids")}
    inputs = batch["segment_ids"][:, :-1].numpy()
    change = np.ones(inputs.shape, bool)
    change[:, 1:] = inputs[:, 1:] != inputs[:, :-1]
    cu = np.r_[np.flatnonzero(change.reshape(-1)), inputs.size].astype(np.int32)
    images = [im for r in rows for im in r["images"]]
    batch.update(cu_seqlens=torch.from_numpy(cu), max_seqlen=int(np.diff(cu).max()),
                 images=torch.stack(images) if images else torch.zeros((0, 3, size, size)),
                 image_rows=torch.tensor([i for i, r in enumerate(rows) for _ in r["images"]], dtype=torch.int64),
                 image_starts=torch.tensor([s for r in rows for s in r["image_starts"]], dtype=torch.int64),
                 index=torch.tensor([r["index"] for r in rows], dtype=torch.int64),
                 padded=torch.zeros(len(rows), dtype=torch.bool))  # the last batch is short, never padded
    return batch


def _numbered(rows):
    """Each row with ``index``: worker w's k-th row is ``k * workers + w`` (distinct across the workers)."""
    import torch

    info = torch.utils.data.get_worker_info()
    w, n = (info.id, info.num_workers) if info else (0, 1)
    for k, row in enumerate(rows):
        yield {**row, "index": k * n + w}


def image_token_id(dest: Path) -> int:
    """The image token's id that image-text dataset ``dest`` records."""
    from fastio.dataset.manifest import load_manifest

    return int(load_manifest(dest).convert_options["image_text"]["image_token_id"])


def peer_loader(dest: Path, packing: Packing, workers: int = WORKERS):
    """The peer: ``DataLoader(workers)`` over ``webdataset.WebDataset`` of ``dest``'s shards (each worker its own
    shards), packed per shard by :func:`best_fit`, images by PIL, batches as :func:`collate` makes them."""
    import torch
    import webdataset as wds

    from fastio.dataset.manifest import load_manifest

    image_id = image_token_id(dest)
    urls = [str(dest / "shards" / s.name) for s in load_manifest(dest).shards]
    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker,
                         empty_check=False)
          .compose(_Rows(packing)).map(Assemble(packing, image_id)).compose(_numbered)
          .batched(packing.batch_size, collation_fn=lambda rows: collate(rows, packing.size), partial=True))
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
