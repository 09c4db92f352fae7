"""Image bytes: name their type, check that they decode, downscale and re-encode, probe their size.

PIL is imported on first use so that importing this module costs nothing.
"""

from __future__ import annotations

import io
import re
import struct

__all__ = [
    "IMAGE_FIELDS",
    "ImageCheckError",
    "check_image",
    "downscale",
    "image_field_for_suffix",
    "image_size",
    "is_image_field",
    "sniff_image_field",
]

# File suffix (lower case, with dot) -> the field name a sample stores that image under.
_SUFFIX_FIELD = {
    ".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
    ".gif": "gif", ".tif": "tiff", ".tiff": "tiff",
}
IMAGE_FIELDS = frozenset(_SUFFIX_FIELD.values())
# Field name -> PIL format used when re-encoding a downscaled image of that type.
_PIL_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF", "tiff": "TIFF"}


class ImageCheckError(ValueError):
    """Image bytes that do not decode; the message says why (without naming the file)."""


def is_image_field(name: str) -> bool:
    """Whether a field holds an image, judged by its last extension (``jpg``, ``left.png``, ``JPEG``)."""
    return name.rsplit(".", 1)[-1].lower() in IMAGE_FIELDS


def image_field_for_suffix(suffix: str) -> str | None:
    """The image field name for a file suffix such as ``.JPEG`` (``jpg``), or None if not an image."""
    return _SUFFIX_FIELD.get(suffix.lower())


def sniff_image_field(data: bytes) -> str | None:
    """The image field name for encoded bytes judged by their magic number, or None."""
    head = bytes(data[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"BM"):
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    return None


def _open(data: bytes):
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
    except Exception as err:  # noqa: BLE001  (PIL raises UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ImageCheckError(f"not a readable image ({_reason(err)})") from None
    return img


def check_image(data: bytes) -> tuple[int, int]:
    """Fully decode ``data``; return (width, height) or raise :class:`ImageCheckError`."""
    img = _open(data)
    try:
        img.load()
    except Exception as err:  # noqa: BLE001  (any decoder failure means a bad image)
        raise ImageCheckError(f"image does not decode ({_reason(err)})") from None
    return img.size


def downscale(data: bytes, field: str, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]]:
    """Decode ``data`` (checking it) and, if its longer side exceeds ``max_side``, shrink it to that
    side and re-encode in the same format (``quality`` for JPEG/WebP). Returns (bytes, (w, h)) with
    the original bytes when no resize was needed."""
    from PIL import Image

    img = _open(data)
    w, h = img.size
    if max(w, h) <= max_side:
        try:
            img.load()
        except Exception as err:  # noqa: BLE001  (any decoder failure means a bad image)
            raise ImageCheckError(f"image does not decode ({_reason(err)})") from None
        return data, (w, h)
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    try:
        if img.format == "JPEG":
            img.draft(img.mode, size)  # decode at a reduced DCT scale: much faster, still >= size
        img.load()
        out = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    except Exception as err:  # noqa: BLE001  (any decoder failure means a bad image)
        raise ImageCheckError(f"image does not decode ({_reason(err)})") from None
    fmt = _PIL_FORMAT.get(field, img.format or "PNG")
    if fmt == "JPEG" and out.mode not in ("RGB", "L", "CMYK"):
        out = out.convert("RGB")
    buf = io.BytesIO()
    kwargs: dict = {}
    if fmt in ("JPEG", "WEBP"):
        kwargs["quality"] = quality
        # Keep EXIF (orientation) and the colour profile: the pixels stay as stored, as in the original.
        kwargs.update({k: img.info[k] for k in ("exif", "icc_profile") if img.info.get(k)})
    try:
        out.save(buf, fmt, **kwargs)
    except Exception as err:  # noqa: BLE001  (e.g. a CMYK image stored under a .png name)
        raise ImageCheckError(f"cannot re-encode as {fmt} ({_reason(err)})") from None
    return buf.getvalue(), size


def image_size(data) -> tuple[int, int]:
    """``(width, height)`` from a JPEG or PNG header (other formats: PIL's lazy open), without decoding
    pixels. ``data`` is bytes, a memoryview or a uint8 array. Raises ValueError for bytes that are no image."""
    buf = bytes(data[:32]) if not isinstance(data, bytes) else data
    if buf[:8] == b"\x89PNG\r\n\x1a\n":
        w, h = struct.unpack(">II", bytes(data[16:24]))
        return int(w), int(h)
    if buf[:2] == b"\xff\xd8":
        return _jpeg_size(memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data))
    try:
        from PIL import Image

        with Image.open(io.BytesIO(bytes(data))) as img:
            return img.size
    except Exception as err:  # PIL raises many kinds for bytes that are not an image
        raise ValueError(f"not a decodable image ({type(err).__name__})") from None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(mv: memoryview) -> tuple[int, int]:
    i, n = 2, len(mv)
    while i + 4 <= n:
        if mv[i] != 0xFF:
            raise ValueError(f"corrupt JPEG header (no marker at byte {i})")
        marker = mv[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = (mv[i + 2] << 8) | mv[i + 3]
        if marker in _SOF:
            if i + 9 > n:
                break
            h = (mv[i + 5] << 8) | mv[i + 6]
            w = (mv[i + 7] << 8) | mv[i + 8]
            if w == 0 or h == 0:
                raise ValueError(f"JPEG header gives size {w}x{h}")
            return w, h
        i += 2 + length
    raise ValueError("truncated JPEG header (no frame size)")


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return _OBJECT_REPR.sub("data", text)[:200]  # PIL names the buffer by address: not reproducible


_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")
