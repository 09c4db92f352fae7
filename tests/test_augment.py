"""Per-sample augmentation parameters: torchvision semantics, purity, independence of batching."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from fastio.formats.images import image_size
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
