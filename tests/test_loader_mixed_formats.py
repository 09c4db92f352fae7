"""A dataset whose samples carry different image fields (jpg, png, webp, bmp, gif, tiff) loads in every pipeline:
the image of a sample is whichever image field it has, and it decodes to the same pixels as a PNG of them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from nvidia.dali import fn
from PIL import Image

from fastio import Graph, ImageEval, ImageTrain, Raw
from fastio.dataset.shards import ShardWriter
from fastio.loader import Loader

FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF", "tiff": "TIFF"}
PER_FORMAT = 3


def _pixels(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """At most 216 colours (so that GIF stores them exactly), in blocks (so that JPEG has some structure)."""
    levels = rng.integers(0, 6, size=(-(-h // 8), -(-w // 8), 3), dtype=np.uint8) * 51
    return np.kron(levels, np.ones((8, 8, 1), np.uint8))[:h, :w]


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def _decoded(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _write(dest: Path, samples: list[tuple[str, str, bytes, int]]) -> Path:
    with ShardWriter(dest, max_samples=7) as writer:
        for key, field, data, label in samples:
            writer.write({"__key__": key, field: data, "cls": str(label).encode()})
        fields = sorted({field for _, field, _, _ in samples})
        writer.close(image_field="jpg" if "jpg" in fields else fields[0], label_field="cls", image_fields=fields)
    return dest


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(mixed dataset, the same pixels as an all-PNG dataset, key -> image field of the mixed one)."""
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("mixed")
    mixed, reference, field_of = [], [], {}
    for n in range(PER_FORMAT * len(FORMATS)):
        field = list(FORMATS)[n % len(FORMATS)]  # formats interleave, so every batch mixes them
        w, h = (int(v) for v in rng.integers(40, 90, size=2))
        data = _encode(_pixels(rng, w, h), FORMATS[field])
        key = f"s{n:03d}"
        mixed.append((key, field, data, n % 4))
        reference.append((key, "png", _encode(_decoded(data), "PNG"), n % 4))  # what PIL decodes, losslessly
        field_of[key] = field
    return _write(root / "mixed", mixed), _write(root / "png", reference), field_of


def _epoch(dest: Path, **kw) -> list[dict]:
    """One epoch; the order of the two datasets (their fingerprints differ) is compared with shuffle none."""
    kw = {"shuffle": "none", "batch_size": 4, "pipeline": ImageTrain(size=24), **kw}
    with Loader(dest, device="cpu", seed=5, world_size=1, rank=0, **kw) as loader:
        return list(loader)


@pytest.mark.parametrize("kind", [ImageTrain, ImageEval])
def test_image_pipelines_decode_every_format_like_its_png(mixed, kind):
    dest, png, field_of = mixed
    pipeline = kind(size=24, dtype="uint8")
    got, want = _epoch(dest, pipeline=pipeline), _epoch(png, pipeline=pipeline)
    assert len(got) == len(want) == -(-len(field_of) // 4)
    for a, b in zip(got, want):
        assert a["index"].tolist() == b["index"].tolist()
        assert a["label"].tolist() == b["label"].tolist() == [i % 4 for i in a["index"].tolist()]
        assert a["image"].shape == (4, 3, 24, 24)
        assert np.array_equal(a["image"].numpy(), b["image"].numpy())  # crops from the same sizes, same pixels
    seen = {field_of[f"s{i:03d}"] for batch in got for i in batch["index"].tolist()}
    assert seen == set(FORMATS)


def test_raw_hands_each_sample_its_own_image_field(mixed):
    dest, _, field_of = mixed
    batches = _epoch(dest, pipeline=Raw(), shuffle="global")
    seen = set()
    for batch in batches:
        assert set(FORMATS) | {"cls", "label", "index", "padded", "has"} == set(batch)
        for j, i in enumerate(batch["index"].tolist()):
            have = field_of[f"s{i:03d}"]
            for f in FORMATS:  # its own field holds its bytes, the other image fields are empty
                assert (len(batch[f][j]) > 0) == (f == have) == bool(batch["has"][f][j])
            assert _decoded(batch[have][j]).shape[2] == 3
            seen.add(i)
    assert seen == set(range(PER_FORMAT * len(FORMATS)))


def test_user_graph_gets_every_format_decoded(mixed):
    dest, png, _ = mixed

    def graph(image, device):
        return {"image": fn.resize(image, resize_x=10, resize_y=12), "shape": image.shape()}

    got, want = _epoch(dest, pipeline=Graph(graph)), _epoch(png, pipeline=Graph(graph))
    for a, b in zip(got, want):
        assert np.array_equal(a["shape"].numpy(), b["shape"].numpy())
        assert np.array_equal(a["image"].numpy(), b["image"].numpy())


def test_a_sample_without_any_image_field_is_named(tmp_path):
    with ShardWriter(tmp_path / "ds", max_samples=8) as writer:
        writer.write({"__key__": "a", "png": _encode(np.zeros((8, 8, 3), np.uint8), "PNG"), "cls": b"0"})
        writer.write({"__key__": "b", "cls": b"1"})
        writer.close(image_field="png", label_field="cls", image_fields=["png"])
    from fastio.errors import DatasetError

    with pytest.raises(DatasetError, match=r"key 'b': sample has no image field \(png\)"):
        _epoch(tmp_path / "ds", batch_size=2, pipeline=ImageEval(size=24), shuffle="none")
