"""Per-sample augmentation parameters: torchvision semantics, purity, independence of batching."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from fastio.formats.images import image_size
from fastio.pipelines import augment
from fastio.pipelines.augment import random_resized_crop, uniforms


def _torchvision_reference(u, width, height, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, with its random draws replaced by ``u`` (4 per attempt)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for a in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[4 * a])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[4 * a + 1])
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = int(u[4 * a + 2] * (height - h + 1))
            j = int(u[4 * a + 3] * (width - w + 1))
            return j, i, w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def test_crop_matches_torchvision_semantics():
    rng = np.random.default_rng(0)
    idx = np.arange(500)
    widths = rng.integers(20, 700, 500)
    heights = np.where(idx % 7 == 0, widths * 5, rng.integers(20, 700, 500))  # some very tall: fallback path
    p = random_resized_crop(3, 1, idx, widths, heights)
    u = uniforms(3, 1, idx, 41)
    for k in range(500):
        want = _torchvision_reference(u[k], int(widths[k]), int(heights[k]))
        assert tuple(p.anchor[k]) + tuple(p.shape[k]) == want
        assert p.anchor[k][0] + p.shape[k][0] <= widths[k] and p.anchor[k][1] + p.shape[k][1] <= heights[k]
    assert 0.4 < p.flip.mean() < 0.6


def test_params_depend_only_on_seed_epoch_index():
    idx = np.array([5, 17, 3, 40])
    w, h = np.array([64, 80, 90, 50]), np.array([48, 60, 70, 90])
    whole = random_resized_crop(1, 2, idx, w, h)
    for k in range(4):  # one at a time, as another rank or thread would compute it
        one = random_resized_crop(1, 2, idx[k:k + 1], w[k:k + 1], h[k:k + 1])
        assert np.array_equal(one.anchor[0], whole.anchor[k]) and one.flip[0] == whole.flip[k]
    other_epoch = random_resized_crop(1, 3, idx, w, h)
    assert not np.array_equal(other_epoch.anchor, whole.anchor)


def test_uniforms_are_uniform_and_independent_per_sample():
    u = uniforms(0, 0, np.arange(2000), 8)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.05


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_image_size_from_header(fmt):
    buf = io.BytesIO()
    Image.new("RGB", (123, 45)).save(buf, fmt)
    assert image_size(buf.getvalue()) == (123, 45)
    assert image_size(np.frombuffer(buf.getvalue(), np.uint8)) == (123, 45)


def test_image_size_rejects_garbage():
    with pytest.raises(ValueError):
        image_size(b"definitely not an image")
    with pytest.raises(ValueError):
        image_size(b"\xff\xd8\xff\xe0\x00")


def test_crop_and_draws_are_those_of_earlier_releases():
    """The draws are a pure function of (seed, epoch, key) across releases too: a run resumed on a newer fastio crops
    as it did. Values from fastio f05b189 (before the crop took fewer numpy calls), the third window the center
    fallback (a 3000 x 90 panorama)."""
    keys = np.array([0, 7, 123456789, 2**40 + 3])
    p = random_resized_crop(11, 3, keys, np.array([500, 64, 3000, 40]), np.array([375, 48, 90, 41]))
    assert p.anchor.tolist() == [[175.0, 111.0], [10.0, 8.0], [1440.0, 0.0], [5.0, 12.0]]
    assert p.shape.tolist() == [[182.0, 186.0], [32.0, 39.0], [120.0, 90.0], [31.0, 29.0]]
    assert p.flip.tolist() == [0, 0, 1, 1] and p.anchor.dtype == p.shape.dtype == np.float32
    assert uniforms(11, 3, keys, 3).tolist() == [
        [0.10938537418770511, 0.45607776747226725, 0.5872861310135555],
        [0.3532830124180658, 0.12943925001104717, 0.8236228626603502],
        [0.3323488827907256, 0.3572227507208705, 0.5889361085394998],
        [0.5033244198728457, 0.6149652809457872, 0.9593684915846986]]


def test_the_center_fallback_is_worked_out_only_for_a_batch_that_needs_it(monkeypatch):
    """The fallback costs a dozen numpy calls, each a few microseconds beside the decoders (issue 45): a batch whose
    samples all found a window in their 10 attempts skips it; one with a panorama takes it, for that sample."""
    calls = []
    real = augment._center_fallback
    monkeypatch.setattr(augment, "_center_fallback", lambda *a: calls.append(a[0].copy()) or real(*a))
    keys = np.arange(64)
    random_resized_crop(0, 0, keys, np.full(64, 500), np.full(64, 400))
    assert calls == []
    p = random_resized_crop(0, 0, keys, np.r_[np.full(63, 500), 3000], np.r_[np.full(63, 400), 90])
    assert len(calls) == 1 and calls[0].tolist() == [True] * 63 + [False]
    assert p.shape[-1].tolist() == [120.0, 90.0] and p.anchor[-1].tolist() == [1440.0, 0.0]
