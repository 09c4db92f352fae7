"""Image bytes: name their type, check that they decode (a JPEG at 1/8 scale), downscale and re-encode, probe
their size.

PIL is imported on first use so that importing this module costs nothing.

Pixel limit: :func:`check_pixels` reads an image's size from its header (:func:`image_size`: JPEG, PNG,
GIF, BMP, WebP and TIFF headers are parsed here, anything else through PIL's lazy open) and refuses one
with more than ``max_pixels`` pixels before a single pixel is decoded, so a 140 KB PNG of 12000x12000
costs nothing. fastio applies its own limit (:data:`DEFAULT_MAX_PIXELS`), so PIL's
``DecompressionBombWarning`` is silenced inside this module; PIL's hard limit (twice its warning limit,
about 179 M pixels) still refuses larger images with an :class:`ImageCheckError`.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
import zlib
from contextlib import contextmanager

from fastio.words import count

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE_FIELDS",
    "ImageCheckError",
    "check_image",
    "check_pixels",
    "downscale",
    "image_field_for_suffix",
    "image_size",
    "is_image_field",
    "loader_decodes",
    "sniff_image_field",
]

# File suffix (lower case, with dot) -> the field name a sample stores that image under.
_SUFFIX_FIELD = {
    ".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
    ".gif": "gif", ".tif": "tiff", ".tiff": "tiff",
}
IMAGE_FIELDS = frozenset(_SUFFIX_FIELD.values())
# Images with more pixels are refused at conversion (10000 x 10000; about 300 MB once decoded as RGB).
DEFAULT_MAX_PIXELS = 100_000_000
# Field name -> PIL format used when re-encoding a downscaled image of that type.
_PIL_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF", "tiff": "TIFF"}


class ImageCheckError(ValueError):
    """Image bytes that do not decode; the message says why (without naming the file)."""


def is_image_field(name: str) -> bool:
    """Whether a field holds an image, judged by its last extension (``jpg``, ``jpeg``, ``tif``, ``left.png``,
    ``JPEG``): the extensions of :func:`image_field_for_suffix`, as WebDataset's image decoder takes them."""
    return image_field_for_suffix("." + name.rsplit(".", 1)[-1]) is not None


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


_DECODED_ELSE = (b"II+\x00", b"MM\x00+", b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")
"""Magic numbers of what DALI's image decoder also reads by content: BigTIFF, JPEG 2000 (a file, a codestream)."""


def loader_decodes(data) -> bool:
    """Whether the Loader's image decoder reads the encoded ``data``, judged by its magic number: the types of
    :func:`sniff_image_field` (GIF transcoded in the reader thread), BigTIFF, PNM and JPEG 2000, which DALI decodes by
    content. PIL reads more (TGA, ICO, PCX, SGI, QOI, ...), which DALI refuses."""
    head = bytes(data[:12])
    pnm = head[:1] == b"P" and head[1:2] in (b"1", b"2", b"3", b"4", b"5", b"6") and head[2:3].isspace()
    return sniff_image_field(head) is not None or head.startswith(_DECODED_ELSE) or pnm


def _refuse_empty(data) -> None:
    """ImageCheckError for an empty file (PIL's word for it is UnidentifiedImageError)."""
    if not len(data):
        raise ImageCheckError("an empty file (0 bytes), not an image")


_TIFF_MISREAD = {"LA": "its alpha read as colour): store it as PNG",
                 "I": "32-bit integer pixels refused): store it with 8 or 16 bits a pixel"}
"""TIFF modes (PIL's) that DALI's TIFF decoder misreads, how, and what to do: grey with alpha comes out as (grey,
alpha, grey) where a PNG's comes out grey; 32-bit integer pixels fail its decode."""


def _refuse_undecoded(data, img) -> None:
    """ImageCheckError for an image (``img``: PIL's open of ``data``) that :func:`loader_decodes` says no to, a PNG it
    refuses though PIL decodes it (:func:`_refuse_damaged_png`), or a TIFF of a mode the Loader's decoder misreads
    (:data:`_TIFF_MISREAD`)."""
    if not loader_decodes(data):
        raise ImageCheckError(f"a {img.format or 'unknown'} image: not a type the Loader decodes (JPEG, PNG, WebP, "
                              "BMP, GIF or TIFF)")
    if img.format == "PNG":
        _refuse_damaged_png(data)
    if img.format == "TIFF" and img.mode in _TIFF_MISREAD:
        raise ImageCheckError(f"a TIFF image of mode {img.mode}, which the Loader's decoder misreads "
                              f"({_TIFF_MISREAD[img.mode]}")


_PNG_CRITICAL = (b"IHDR", b"PLTE", b"IDAT")
"""The PNG chunks whose CRC libpng (DALI's PNG decoder) checks, failing the decode; it takes a damaged ancillary
chunk's and IEND's."""


def _refuse_damaged_png(data) -> None:
    """ImageCheckError for a PNG (PIL decodes it) that the Loader's decoder refuses: a critical chunk (an IDAT) whose
    CRC does not match (PIL does not check IDAT's), or one that ends before its IEND chunk (nvImageCodec's parser
    needs it)."""
    view, at = memoryview(data), 8
    while at + 8 <= len(view):
        length, kind = int.from_bytes(view[at:at + 4], "big"), bytes(view[at + 4:at + 8])
        if kind == b"IEND":
            return
        end = at + 8 + length
        if end + 4 > len(view):
            break
        if kind in _PNG_CRITICAL and zlib.crc32(view[at + 4:end]) != int.from_bytes(view[end:end + 4], "big"):
            raise ImageCheckError(f"a PNG whose {kind.decode()} chunk at byte {at} fails its CRC (damaged), which the "
                                  "Loader's decoder refuses")
        at = end + 4
    raise ImageCheckError("a PNG that ends before its IEND chunk (truncated), which the Loader's decoder refuses")


@contextmanager
def _pil():
    """PIL's Image module with its DecompressionBombWarning silenced (fastio applies its own limit)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield Image


def _open(data: bytes):
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
    except Exception as err:  # noqa: BLE001  (PIL raises UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ImageCheckError(f"not a readable image ({_reason(err)})") from None
    return img


def check_pixels(data, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) from the header of ``data``; :class:`ImageCheckError` if it is unreadable or has
    more than ``max_pixels`` pixels (None: no limit). Decodes nothing."""
    try:
        w, h = image_size(data)
    except ValueError as err:
        raise ImageCheckError(f"not a readable image ({err})") from None
    if max_pixels is not None and w * h > max_pixels:
        raise ImageCheckError(f"image of {w}x{h} = {count(w * h, 'pixel')} is over the limit of {max_pixels} (max_pixels)")
    return w, h


def check_image(data: bytes, max_pixels: int | None = None) -> tuple[int, int]:
    """Decode ``data`` (after :func:`check_pixels` with ``max_pixels``); return its (width, height) or raise
    :class:`ImageCheckError` (also for an image PIL reads but the Loader's decoder does not: :func:`loader_decodes`;
    an empty file is called one).

    A JPEG is decoded at 1/8 scale (libjpeg's DCT scaling, PIL's ``draft``): it still reads every entropy-coded
    byte and refuses what a full decode refuses (``tests/test_images.py`` compares the two on a corpus of
    damaged JPEGs: truncated, bits flipped and bytes garbled in the entropy data, damaged headers), at about
    half the cost. Other formats are decoded fully."""
    _refuse_empty(data)
    if max_pixels is not None:
        check_pixels(data, max_pixels)
    with _pil():
        img = _open(data)
        _refuse_undecoded(data, img)
        size = img.size
        try:
            if img.format == "JPEG":
                img.draft(img.mode, (1, 1))  # the smallest DCT scale (1/8); the mode stays as stored
            img.load()
        except Exception as err:  # noqa: BLE001  (any decoder failure means a bad image)
            raise ImageCheckError(f"image does not decode ({_reason(err)})") from None
        return size


def downscale(data: bytes, field: str, max_side: int, quality: int,
              max_pixels: int | None = None) -> tuple[bytes, tuple[int, int]]:
    """Decode ``data`` (checking it, and its size against ``max_pixels`` first) and, if its longer side
    exceeds ``max_side``, shrink it to that side and re-encode in the same format (``quality`` for
    JPEG/WebP). Returns (bytes, (w, h)) with the original bytes when no resize was needed."""
    _refuse_empty(data)
    if max_pixels is not None:
        check_pixels(data, max_pixels)
    with _pil():
        return _downscale(data, field, max_side, quality)


def _downscale(data: bytes, field: str, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]]:
    img = _open(data)
    _refuse_undecoded(data, img)
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
        out = _resize(img, size)
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


def _resize(img, size: tuple[int, int]):
    """``img`` resized to ``size`` (bicubic). PIL resizes RGBA and LA premultiplied by alpha (right for the pixels
    that show), which leaves a fully transparent pixel black: those take the colour of a resize of the colours
    alone, so a transparent region keeps the colour it was stored with (what a reader ignoring alpha sees)."""
    import numpy as np
    from PIL import Image

    out = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    if img.mode not in ("RGBA", "LA"):
        return out
    colours = np.asarray(img.convert(img.mode[:-1]).resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0))
    pixels = np.array(out)
    clear = pixels[..., -1] == 0
    pixels[..., :-1][clear] = colours.reshape(*colours.shape[:2], -1)[clear]
    return Image.fromarray(pixels, img.mode)


def image_size(data) -> tuple[int, int]:
    """``(width, height)`` from the header of a JPEG, PNG, GIF, BMP, WebP or TIFF image (other formats, or a
    header these parsers cannot follow: PIL's lazy open), without decoding pixels. ``data`` is bytes, a
    memoryview or a uint8 array. Raises ValueError for bytes that are no image."""
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    kind = sniff_image_field(mv[:12])
    parse = _HEADER_PARSERS.get(kind)
    if parse is not None:
        try:
            w, h = parse(mv)
            if w > 0 and h > 0:
                return int(w), int(h)
        except (ValueError, IndexError, struct.error):
            pass
    try:
        with _pil() as Image, Image.open(io.BytesIO(bytes(data))) as img:
            return img.size
    except Exception as err:  # PIL raises many kinds for bytes that are not an image
        detail = f": {_reason(err)}" if type(err).__name__ == "DecompressionBombError" else ""
        raise ValueError(f"not a decodable image ({type(err).__name__}{detail})") from None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(mv: memoryview) -> tuple[int, int]:
    """The frame size from the first SOF marker."""
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


def _png_size(mv: memoryview) -> tuple[int, int]:
    if bytes(mv[12:16]) != b"IHDR":
        raise ValueError("PNG without IHDR")
    return struct.unpack(">II", mv[16:24])


def _gif_size(mv: memoryview) -> tuple[int, int]:
    return struct.unpack("<HH", mv[6:10])


def _bmp_size(mv: memoryview) -> tuple[int, int]:
    (header,) = struct.unpack("<I", mv[14:18])
    if header == 12:  # BITMAPCOREHEADER
        return struct.unpack("<HH", mv[18:22])
    w, h = struct.unpack("<ii", mv[18:26])
    return w, abs(h)  # a negative height means top-down rows


def _webp_size(mv: memoryview) -> tuple[int, int]:
    chunk = bytes(mv[12:16])
    if chunk == b"VP8X":
        w = int.from_bytes(mv[24:27], "little") + 1
        h = int.from_bytes(mv[27:30], "little") + 1
        return w, h
    if chunk == b"VP8 ":
        if bytes(mv[23:26]) != b"\x9d\x01\x2a":
            raise ValueError("VP8 without start code")
        w, h = struct.unpack("<HH", mv[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":
        if mv[20] != 0x2F:
            raise ValueError("VP8L without signature")
        (bits,) = struct.unpack("<I", mv[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    raise ValueError(f"unknown WebP chunk {chunk!r}")


def _tiff_size(mv: memoryview) -> tuple[int, int]:
    order = "<" if bytes(mv[:2]) == b"II" else ">"
    (ifd,) = struct.unpack(order + "I", mv[4:8])
    (count,) = struct.unpack(order + "H", mv[ifd:ifd + 2])
    size: dict[int, int] = {}
    for i in range(count):
        at = ifd + 2 + 12 * i
        tag, kind = struct.unpack(order + "HH", mv[at:at + 4])
        if tag in (256, 257):
            if kind == 3:  # SHORT
                (size[tag],) = struct.unpack(order + "H", mv[at + 8:at + 10])
            elif kind == 4:  # LONG
                (size[tag],) = struct.unpack(order + "I", mv[at + 8:at + 12])
    return size[256], size[257]


_HEADER_PARSERS = {"jpg": _jpeg_size, "png": _png_size, "gif": _gif_size, "bmp": _bmp_size,
                   "webp": _webp_size, "tiff": _tiff_size}


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return _OBJECT_REPR.sub("data", text)[:200]  # PIL names the buffer by address: not reproducible


_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")
