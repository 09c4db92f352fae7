"""Convert's decode check (fastio.formats.images.check_image): a JPEG decoded at 1/8 scale refuses exactly the damaged
images a full decode refuses, on a corpus of damaged JPEGs (issue 32.7)."""

from __future__ import annotations

import io
import random
import warnings

import numpy as np
import pytest
from PIL import Image

from fastio.convert.synthetic import photo_jpeg
from fastio.formats.images import ImageCheckError, check_image, check_pixels


def _jpeg(array: np.ndarray, mode: str | None = None, **save) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(array)
    (img.convert(mode) if mode else img).save(buf, "JPEG", **save)
    return buf.getvalue()


def _originals() -> list[bytes]:
    """Photo-like JPEGs of several sizes and qualities, and the encodings that take other decoder paths:
    progressive, grayscale, CMYK, 4:4:4, restart intervals."""
    rng = np.random.default_rng(0)
    out = [photo_jpeg(rng, int(rng.integers(40, 300)), int(rng.integers(40, 300)), quality=int(q))
           for q in (55, 70, 85, 95, 75, 90)]
    noise = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
    out += [_jpeg(noise, progressive=True), _jpeg(noise[..., 0]), _jpeg(noise, "CMYK"), _jpeg(noise, subsampling=0),
            _jpeg(noise, restart_marker_blocks=4)]
    return out


def _scan_start(data: bytes) -> int:
    """Offset of the first entropy-coded byte (after the first SOS header)."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")


def _damaged(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    start, end = _scan_start(data), len(data) - 2  # the entropy-coded data: [start, end), then EOI
    cases = [("truncated", data[:start + int((end - start) * f)]) for f in (0.05, 0.3, 0.6, 0.9, 0.99)]
    cases += [("truncated header", data[:start // 2]), ("no EOI", data[:-2]), ("empty scan", data[:start])]
    for _ in range(12):
        b = bytearray(data)
        b[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
        cases.append(("bit flipped in the entropy data", bytes(b)))
    for _ in range(5):
        b, at = bytearray(data), rng.randrange(start, end - 16)
        b[at:at + 16] = rng.randbytes(16)
        cases.append(("entropy data garbled", bytes(b)))
    for _ in range(8):
        b = bytearray(data)
        b[rng.randrange(2, start)] = rng.randrange(256)
        cases.append(("header byte changed", bytes(b)))
    at = rng.randrange(start, end)
    cases.append(("marker inserted in the entropy data", data[:at] + b"\xff\xd3" + data[at:]))
    return cases


def _full_decode_refuses(data: bytes) -> bool:
    """The reference: PIL opens and decodes every pixel at full size."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            Image.open(io.BytesIO(data)).load()
        except Exception:  # noqa: BLE001  (any failure is a refusal)
            return True
    return False


def _refuses(check, data: bytes) -> bool:
    try:
        check(data)
    except ImageCheckError:
        return True
    return False


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, bytes, bool]]:
    """(kind of damage, bytes, whether a full decode refuses them)."""
    rng = random.Random(7)
    return [(kind, data, _full_decode_refuses(data)) for original in _originals()
            for kind, data in _damaged(original, rng)]


def test_the_reduced_decode_refuses_what_the_full_decode_refuses(corpus):
    missed = [kind for kind, data, refused in corpus if refused and not _refuses(check_image, data)]
    extra = [kind for kind, data, refused in corpus if not refused and _refuses(check_image, data)]
    assert not missed, f"{len(missed)} damaged JPEGs the full decode refuses pass the check: {sorted(set(missed))}"
    assert not extra, f"{len(extra)} JPEGs the full decode accepts are refused: {sorted(set(extra))}"


def test_the_corpus_holds_damage_only_a_decode_notices(corpus):
    """The comparison above means something: the full decode refuses damage of every kind but the ones a
    decoder tolerates, and part of it has an intact header (a header-only check passes it)."""
    refused = {kind for kind, _, r in corpus if r}
    assert {"truncated", "truncated header", "empty scan", "header byte changed"} <= refused, refused
    header_ok = [kind for kind, data, r in corpus if r and not _refuses(lambda d: check_pixels(d, None), data)]
    assert len(header_ok) >= 20 and "truncated" in header_ok, header_ok


def test_the_check_returns_the_stored_size_not_the_reduced_one():
    data = photo_jpeg(np.random.default_rng(1), 203, 97)
    assert check_image(data) == (203, 97)
    with pytest.raises(ImageCheckError, match="image does not decode .*truncated"):
        check_image(data[:len(data) // 2])


def _png_chunks(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, type) of each chunk of a PNG."""
    out, at = [], 8
    while at + 8 <= len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        out.append((at, data[at + 4:at + 8]))
        at += 12 + length
    return out


def test_a_png_the_loaders_decoder_refuses_is_refused():
    """A PNG whose IDAT fails its CRC, or that ends before its IEND chunk, passed PIL's decode, so convert (and `fastio
    verify --decode`) kept it, and DALI's decoder (libpng: `IDAT: CRC error`; nvImageCodec) failed the Loader's batch
    on it. A damaged CRC of an ancillary chunk or of IEND, and bytes after IEND, both decoders take."""
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(1).randint(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    chunks = _png_chunks(png)
    iend = next(at for at, kind in chunks if kind == b"IEND")
    assert chunks[-2][1] == b"IDAT"
    flipped = bytearray(png)
    flipped[iend - 4] ^= 1  # the last IDAT's CRC: its data (the zlib stream PIL checks) intact
    with pytest.raises(ImageCheckError, match=r"^a PNG whose IDAT chunk at byte \d+ fails its CRC \(damaged\), which "
                                              "the Loader's decoder refuses$"):
        check_image(bytes(flipped))
    with pytest.raises(ImageCheckError, match=r"^a PNG that ends before its IEND chunk \(truncated\), which the "
                                              "Loader's decoder refuses$"):
        check_image(png[:iend])
    bad_iend_crc = png[:-1] + bytes([png[-1] ^ 1])
    assert check_image(bad_iend_crc) == check_image(png + b"after the end") == (64, 64)
