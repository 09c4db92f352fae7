"""Shared fixtures: tiny synthetic data built in tmp_path, and the `gpu` marker's skip rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastio.shards import ShardWriter
from fastio.synthetic import CLASS_NAMES, make_imagefolder


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_image_dataset(dest: Path, src: Path, *, max_samples: int = 16) -> Path:
    """Pack an image folder into a fastio dataset with the shard writer (no converter involved)."""
    classes = sorted(p.name for p in src.iterdir())
    with ShardWriter(dest, max_samples=max_samples) as writer:
        for path in sorted(src.rglob("*.jpg")):
            label = classes.index(path.parent.name)
            writer.write({"__key__": f"{path.parent.name}/{path.stem}", "jpg": path.read_bytes(),
                          "cls": str(label).encode()})
        writer.close(image_field="jpg", label_field="cls", label_map={c: i for i, c in enumerate(classes)},
                     source={"format": "imagefolder", "path": str(src)}, skipped=[])
    return dest


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """4 classes x 12 JPEGs of 48..96 px, in ImageNet layout."""
    return make_imagefolder(tmp_path / "src", classes=len(CLASS_NAMES), per_class=12)


@pytest.fixture
def image_dataset(tmp_path, image_folder) -> Path:
    """The image folder above as a fastio dataset: 48 samples in 3 shards of 16."""
    return write_image_dataset(tmp_path / "ds", image_folder)
