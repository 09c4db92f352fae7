"""Per-sample augmentation parameters as a pure function of (seed, epoch, draw key): image crops and flips, and
the starts of video and audio clips (:func:`clip_starts`). A sample's draw key is its global index, except where
a mixture delivers a sample again within one epoch (``ReadBatch.draw_keys``, from
:meth:`fastio.order.mixorder.MixOrder.draw_keys`): each such repeat has a key of its own, so draws anew.

Random numbers come from a counter-based hash (splitmix64) of ``(seed, epoch, key, draw)``, so a
sample's crop and flip do not depend on which rank or thread handles it, nor on batch composition.
The crop follows torchvision's ``RandomResizedCrop.get_params`` (10 attempts, then a center crop).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CropParams", "clip_starts", "random_resized_crop", "splitmix64", "uniforms"]

ATTEMPTS = 10
_DRAWS = 4 * ATTEMPTS + 1  # scale, log-ratio, top, left per attempt, then the flip
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied elementwise to a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices: np.ndarray, draws: int) -> np.ndarray:
    """``[len(indices), draws]`` float64 uniforms in [0, 1), one independent stream per sample (per draw key:
    ``indices`` are the samples' draw keys)."""
    base = splitmix64(np.array([(seed * 0x1000003 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    idx = np.asarray(indices, dtype=np.uint64)
    with np.errstate(over="ignore"):
        stream = splitmix64(idx ^ base)
        counters = stream[:, None] + np.arange(draws, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
    bits = splitmix64(counters) >> np.uint64(11)
    return bits.astype(np.float64) * (1.0 / (1 << 53))


class CropParams:
    """Crop windows in pixels (``anchor`` = (x, y), ``shape`` = (w, h), float32 [N, 2]) and ``flip`` (int32 [N])."""

    def __init__(self, anchor: np.ndarray, shape: np.ndarray, flip: np.ndarray):
        self.anchor, self.shape, self.flip = anchor, shape, flip


def random_resized_crop(seed: int, epoch: int, indices: np.ndarray, widths: np.ndarray, heights: np.ndarray,
                        scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                        flip_p: float = 0.5) -> CropParams:
    """torchvision ``RandomResizedCrop`` + ``RandomHorizontalFlip`` parameters for each sample, vectorised."""
    width = np.asarray(widths, dtype=np.float64)[:, None]
    height = np.asarray(heights, dtype=np.float64)[:, None]
    u = uniforms(seed, epoch, indices, _DRAWS)
    att = u[:, : 4 * ATTEMPTS].reshape(-1, ATTEMPTS, 4)
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = area * (scale[0] + (scale[1] - scale[0]) * att[..., 0])
    aspect = np.exp(log_lo + (log_hi - log_lo) * att[..., 1])
    w = np.round(np.sqrt(target * aspect))
    h = np.round(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    top = np.floor(att[..., 2] * (height - h + 1))
    left = np.floor(att[..., 3] * (width - w + 1))
    first = np.argmax(ok, axis=1)
    rows = np.arange(len(first))
    found = ok[rows, first]
    # Center-crop fallback, with the aspect ratio clamped into `ratio`.
    wf, hf = width[:, 0].copy(), height[:, 0].copy()
    in_ratio = wf / hf
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    hf[narrow] = np.round(wf[narrow] / min(ratio))
    wf[wide] = np.round(hf[wide] * max(ratio))
    tf = np.floor((height[:, 0] - hf) / 2)
    lf = np.floor((width[:, 0] - wf) / 2)
    cw = np.where(found, w[rows, first], wf)
    ch = np.where(found, h[rows, first], hf)
    cy = np.where(found, top[rows, first], tf)
    cx = np.where(found, left[rows, first], lf)
    flip = (u[:, -1] < flip_p).astype(np.int32)
    return CropParams(np.stack([cx, cy], 1).astype(np.float32), np.stack([cw, ch], 1).astype(np.float32), flip)


CLIP_STREAM = 0x434C4950  # "CLIP": clip starts draw from their own streams, apart from the crop's
"""Mixed into the seed for clip starts, so a clip's start and its crop are independent draws."""


def clip_starts(seed: int, epoch: int, indices: np.ndarray, lengths: np.ndarray, span: int,
                clips: int = 1) -> np.ndarray:
    """int64 ``[len(indices), clips]``: each clip's first position, uniform over the positions where a clip of
    ``span`` positions fits in its sample's ``lengths`` (``0 .. length - span``); 0 where it does not fit (the
    clip is then padded past the end). A pure function of ``(seed, epoch, key)`` (``indices``: the draw keys);
    clip ``c`` of a sample is its ``c``-th draw."""
    u = uniforms(seed ^ CLIP_STREAM, epoch, indices, clips)
    room = np.maximum(np.asarray(lengths, dtype=np.int64) - int(span) + 1, 1)[:, None]
    return np.minimum(np.floor(u * room).astype(np.int64), room - 1)
