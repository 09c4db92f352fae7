"""Small, deterministic synthetic images and datasets that fastio generates itself: the one generator
the demo, the tests and the benchmarks share (same arguments and seed, same bytes)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["CLASS_NAMES", "FORMATS", "MAX_CLASSES", "MIXED_FORMATS", "class_name", "make_imagefolder",
           "make_mixed_imagefolder", "photo_jpeg", "synthetic_image"]

CLASS_NAMES = ("circle", "hstripes", "square", "vstripes")
MAX_CLASSES = 100
"""make_imagefolder's class count bound: class k >= 4 repeats shape k % 4 under its own name (``circle2``, ...)."""
# PIL format -> file suffix, for every image type fastio packs.
FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif", "TIFF": "tiff"}
MIXED_FORMATS = tuple(FORMATS)


def synthetic_image(label: int, rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An HWC uint8 image whose class can be told from its shape: a disc, stripes or a square on noise."""
    img = rng.integers(0, 96, size=(height, width, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:height, 0:width]
    color = rng.integers(128, 256, size=3, dtype=np.uint8)
    cy, cx = rng.uniform(0.35, 0.65) * height, rng.uniform(0.35, 0.65) * width
    r = rng.uniform(0.2, 0.3) * min(width, height)
    period = max(4, int(min(width, height) * rng.uniform(0.12, 0.2)))
    kind = CLASS_NAMES[label % len(CLASS_NAMES)]
    if kind == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
    elif kind == "square":
        mask = (abs(yy - cy) < r) & (abs(xx - cx) < r)
    elif kind == "hstripes":
        mask = (yy // (period // 2)) % 2 == 0
    else:
        mask = (xx // (period // 2)) % 2 == 0
    img[mask] = color
    return img


def photo_jpeg(rng: np.random.Generator, width: int, height: int, quality: int = 90) -> bytes:
    """A photo-like JPEG (smooth colour fields, a few shapes, sensor noise): decodes like a real photo
    of that size, which the shape images of :func:`synthetic_image` do not (benchmarks use this)."""
    from PIL import ImageDraw

    coarse = rng.integers(0, 256, size=(max(2, height // 48), max(2, width // 48), 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        x1, y1 = x0 + int(rng.integers(8, width // 2)), y0 + int(rng.integers(8, height // 2))
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    pixels = np.asarray(img, dtype=np.int16) + rng.integers(-10, 11, size=(height, width, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def class_name(label: int) -> str:
    """The folder name of class ``label``: a shape name, numbered from the second round of shapes on."""
    shape = CLASS_NAMES[label % len(CLASS_NAMES)]
    return shape if label < len(CLASS_NAMES) else f"{shape}{label // len(CLASS_NAMES) + 1}"


def make_imagefolder(dest: str | Path, *, classes: int = 4, per_class: int = 32, min_side: int = 48,
                     max_side: int = 96, seed: int = 0, quality: int = 90,
                     fmt: str | tuple[str, ...] = "JPEG") -> Path:
    """Write ``dest/<class>/<class>_NNNN.<ext>``: the same bytes for the same arguments on every run.

    ``fmt`` is a PIL format of :data:`FORMATS` or a tuple of them, used in turn image after image (within
    each class, so every class mixes them)."""
    if not 1 <= classes <= MAX_CLASSES:
        raise ValueError(f"classes must be in 1..{MAX_CLASSES}, got {classes}")
    formats = (fmt,) if isinstance(fmt, str) else tuple(fmt)
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise ValueError(f"fmt must be one or more of {', '.join(FORMATS)}, got {fmt!r}")
    dest = Path(dest)
    rng = np.random.default_rng(seed)
    for label in range(classes):
        name = class_name(label)
        folder = dest / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
            kind = formats[i % len(formats)]
            buf = io.BytesIO()
            Image.fromarray(synthetic_image(label, rng, w, h)).save(
                buf, kind, **({"quality": quality} if kind in ("JPEG", "WEBP") else {}))
            (folder / f"{name}_{i:04d}.{FORMATS[kind]}").write_bytes(buf.getvalue())
    return dest


def make_mixed_imagefolder(dest: str | Path, **kwargs) -> Path:
    """:func:`make_imagefolder` with every format of :data:`MIXED_FORMATS` (jpg, png, webp, bmp, gif, tiff)
    in turn within each class: a dataset whose samples carry different image fields."""
    return make_imagefolder(dest, fmt=MIXED_FORMATS, **kwargs)
