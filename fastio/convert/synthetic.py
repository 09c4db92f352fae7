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


# -- video and audio (PyAV: the dev extra's ``av``, imported only here) ---------------------------------

VIDEO_CODECS = {"webm": "libvpx-vp9", "mp4": "libx264", "mkv": "libvpx-vp9"}
"""make_video's container suffix -> encoder (PyAV's wheels bundle both)."""
FRAME_STEP = 4
"""Frame k of a synthetic video is gray level ``FRAME_BASE + FRAME_STEP * k`` everywhere (k < 56)."""
FRAME_BASE = 16
AUDIO_CODECS = {"wav": ("wav", "pcm_s16le", "s16"), "flac": ("flac", "flac", "s16"),
                "opus": ("ogg", "libopus", "flt"), "ogg": ("ogg", "libopus", "flt"), "mp3": ("mp3", "libmp3lame", "fltp")}


def frame_level(k: np.ndarray | int):
    """The gray level of frame ``k`` of a synthetic video (see :data:`FRAME_STEP`)."""
    return FRAME_BASE + FRAME_STEP * np.asarray(k)


def frame_of_level(red: np.ndarray) -> np.ndarray:
    """The frame number a mean gray level shows (the inverse of :func:`frame_level`, rounded)."""
    return np.rint((np.asarray(red, dtype=np.float64) - FRAME_BASE) / FRAME_STEP).astype(np.int64)


def make_video(path: str | Path, *, frames: int = 24, fps: int = 24, width: int = 64, height: int = 48,
               keyframe_every: int | None = None, bframes: int = 0) -> Path:
    """A video whose frame k is uniform gray :func:`frame_level` (k). The codec follows the suffix
    (:data:`VIDEO_CODECS`: ``.webm`` VP9, ``.mp4`` H.264); flat gray pictures at a low crf keep the level within
    1, so a decoded frame's mean tells its number (:func:`frame_of_level`), after any crop, resize or flip.
    ``keyframe_every``: the encoder's keyframe interval (default: the encoder's, 128 frames for VP9).
    ``bframes`` (H.264): up to that many B-frames in a row, stored in decode order (not display order)."""
    import av

    path = Path(path)
    if not 1 <= frames <= 56:
        raise ValueError(f"frames must be in 1..56, got {frames}")
    codec = VIDEO_CODECS[path.suffix.lstrip(".")]
    if bframes and codec != "libx264":
        raise ValueError(f"bframes: only for H.264 (.mp4), got {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if keyframe_every is not None:
            stream.codec_context.gop_size = keyframe_every
        stream.options = {"crf": "4", "b:v": "0", "deadline": "realtime", "cpu-used": "8"} \
            if codec == "libvpx-vp9" else {"crf": "4", "preset": "ultrafast",
                                           **({"x264-params": f"bframes={bframes}:b-adapt=0"} if bframes else {})}
        for k in range(frames):
            rgb = np.full((height, width, 3), frame_level(k), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def tone(seconds: float, rate: int, pitch: float, channels: int = 1) -> np.ndarray:
    """``[channels, n]`` float32: a sine of ``pitch`` Hz whose amplitude rises linearly from 0.1 to 0.9 over
    the file (the envelope tells where a clip was cut from)."""
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    wave = (0.1 + 0.8 * t / max(seconds, 1e-9)) * np.sin(2 * np.pi * pitch * t)
    return np.repeat(wave[None, :].astype(np.float32), channels, axis=0)


def make_audio(path: str | Path, *, seconds: float = 2.0, rate: int = 16000, pitch: float = 440.0,
               channels: int = 1) -> Path:
    """An audio file of :func:`tone`; the codec follows the suffix (:data:`AUDIO_CODECS`)."""
    import av

    path = Path(path)
    fmt, codec, sample_fmt = AUDIO_CODECS[path.suffix.lstrip(".")]
    path.parent.mkdir(parents=True, exist_ok=True)
    wave = tone(seconds, rate, pitch, channels)
    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate if codec != "libopus" else 48000, layout=layout)
        data = wave if sample_fmt == "fltp" else wave.T.reshape(1, -1)
        if sample_fmt == "s16":
            data = np.clip(data * 32767, -32768, 32767).astype(np.int16)
        encode_audio(out, stream, data, sample_fmt, rate, layout)
    return path


def encode_audio(out, stream, data: np.ndarray, sample_fmt: str, rate: int, layout: str) -> None:
    """Encode samples ``data`` (PyAV's array for ``sample_fmt``: planar [channels, n], packed [1, n * channels])
    at ``rate`` into ``stream`` of container ``out``, converted to what its codec takes, and flush it."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=sample_fmt, layout=layout)
    frame.sample_rate, frame.pts = rate, None
    resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout,
                                  rate=stream.codec_context.sample_rate,
                                  frame_size=stream.codec_context.frame_size or None)
    for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
        for packet in stream.encode(chunk):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
