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


_M = 0xFFFFFFFFFFFFFFFF
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_STEP = 0xD1B54A32D192ED03  # between one draw's counter and the next
_STEPS: dict[int, np.ndarray] = {}  # draws -> the counters' offsets, uint64 [1, draws]


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied elementwise to a uint64 array (wrapping arithmetic)."""
    return _mix(np.add(np.asarray(x, dtype=np.uint64), np.uint64(_GOLDEN)))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 of ``z - golden`` (``z``: uint64, overwritten, returned): in place, one temporary (numpy's array
    arithmetic wraps without a warning)."""
    t = np.right_shift(z, np.uint64(30))
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, np.uint64(_MIX1), out=z)
    np.right_shift(z, np.uint64(27), out=t)
    np.bitwise_xor(z, t, out=z)
    np.multiply(z, np.uint64(_MIX2), out=z)
    np.right_shift(z, np.uint64(31), out=t)
    return np.bitwise_xor(z, t, out=z)


def _mix_int(x: int) -> int:
    """splitmix64 of one value, in Python integers (what :func:`splitmix64` gives for a one-element array)."""
    z = (x + _GOLDEN) & _M
    z = ((z ^ (z >> 30)) * _MIX1) & _M
    z = ((z ^ (z >> 27)) * _MIX2) & _M
    return z ^ (z >> 31)


def uniforms(seed: int, epoch: int, indices: np.ndarray, draws: int) -> np.ndarray:
    """``[len(indices), draws]`` float64 uniforms in [0, 1), one independent stream per sample (per draw key:
    ``indices`` are the samples' draw keys)."""
    base = _mix_int((seed * 0x1000003 + epoch) & _M)
    stream = splitmix64(np.bitwise_xor(np.asarray(indices, dtype=np.uint64), np.uint64(base)))
    steps = _STEPS.get(draws)
    if steps is None:
        steps = _STEPS[draws] = np.array([[k * _STEP & _M for k in range(draws)]], np.uint64)
    counters = _mix(np.add(stream[:, None], steps + np.uint64(_GOLDEN)))
    np.right_shift(counters, np.uint64(11), out=counters)
    return np.multiply(counters, 1.0 / (1 << 53))


class CropParams:
    """Crop windows in pixels (``anchor`` = (x, y), ``shape`` = (w, h), float32 [N, 2]) and ``flip`` (int32 [N])."""

    def __init__(self, anchor: np.ndarray, shape: np.ndarray, flip: np.ndarray):
        self.anchor, self.shape, self.flip = anchor, shape, flip


def random_resized_crop(seed: int, epoch: int, indices: np.ndarray, widths: np.ndarray, heights: np.ndarray,
                        scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                        flip_p: float = 0.5) -> CropParams:
    """torchvision ``RandomResizedCrop`` + ``RandomHorizontalFlip`` parameters for each sample, vectorised (with few
    numpy calls: each costs microseconds beside the decoders, issue 45; the same windows as attempt by attempt)."""
    width = np.asarray(widths, dtype=np.float64)[:, None]
    height = np.asarray(heights, dtype=np.float64)[:, None]
    u = uniforms(seed, epoch, indices, _DRAWS)
    att = u[:, : 4 * ATTEMPTS].reshape(-1, ATTEMPTS, 4)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = (width * height) * (scale[0] + (scale[1] - scale[0]) * att[..., 0])
    aspect = np.exp(log_lo + (log_hi - log_lo) * att[..., 1])
    w = np.round(np.sqrt(target * aspect))
    h = np.round(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    rows, first = np.arange(len(u)), np.argmax(ok, axis=1)
    cw, ch = w[rows, first], h[rows, first]  # the first attempt that fits
    cy = np.floor(att[rows, first, 2] * (height[:, 0] - ch + 1))
    cx = np.floor(att[rows, first, 3] * (width[:, 0] - cw + 1))
    found = ok[rows, first]
    if not found.all():
        cx, cy, cw, ch = _center_fallback(found, width[:, 0], height[:, 0], ratio, (cx, cy, cw, ch))
    anchor, shape = np.empty((len(u), 2), np.float32), np.empty((len(u), 2), np.float32)
    anchor[:, 0], anchor[:, 1], shape[:, 0], shape[:, 1] = cx, cy, cw, ch
    return CropParams(anchor, shape, (u[:, -1] < flip_p).astype(np.int32))


def _center_fallback(found: np.ndarray, width: np.ndarray, height: np.ndarray, ratio: tuple[float, float],
                     window: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``window`` (x, y, w, h) where ``found``, elsewhere torchvision's fallback: the center crop, its aspect ratio
    clamped into ``ratio``."""
    wf, hf = width.copy(), height.copy()
    in_ratio = wf / hf
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    hf[narrow] = np.round(wf[narrow] / min(ratio))
    wf[wide] = np.round(hf[wide] * max(ratio))
    tf = np.floor((height - hf) / 2)
    lf = np.floor((width - wf) / 2)
    return tuple(np.where(found, got, fallback) for got, fallback in zip(window, (lf, tf, wf, hf)))


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
