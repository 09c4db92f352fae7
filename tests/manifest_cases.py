"""Small datasets of every kind that write a manifest, for the manifest byte test (``test_manifest_bytes.py``)
and its recorder (``fixtures/make_manifest_fixtures.py``): each case's ``manifest.json`` files, with the temp
directory and the fastio version (the only things a manifest varies in between runs) replaced by placeholders."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from fastio import __version__

FIXTURE = Path(__file__).parent / "fixtures" / "manifest_bytes.json"


def normalised(data: bytes, tmp: Path) -> str:
    """A manifest's text with ``tmp`` as ``<TMP>`` and this fastio's version as ``<VERSION>``."""
    text = data.decode().replace(str(tmp), "<TMP>")
    return text.replace(json.dumps(__version__), '"<VERSION>"')


def manifests(root: Path, tmp: Path) -> dict[str, str]:
    """Every ``manifest.json`` (and ``splits.json``) under ``root``, normalised, by relative path."""
    return {p.relative_to(root).as_posix(): normalised(p.read_bytes(), tmp)
            for p in sorted(root.rglob("*.json")) if p.name in ("manifest.json", "splits.json")
            and ".parts" not in p.parts}


def _images(tmp: Path) -> Path:
    from fastio.convert.synthetic import make_imagefolder

    src = make_imagefolder(tmp / "images", classes=3, per_class=6, min_side=16, max_side=24)
    (src / "circle" / "broken.jpg").write_bytes(b"not a jpeg")
    return src


def _table(tmp: Path, images: Path) -> Path:
    rows = [(p.relative_to(tmp).as_posix(), p.parent.name) for p in sorted(images.rglob("*.jpg"))
            if p.name != "broken.jpg"]
    path = tmp / "table.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        writer.writerows(rows)
    return path


def _convert_cases(tmp: Path) -> None:
    from fastio.convert.merge import merge
    from fastio.convert.run import ConvertConfig, convert

    images = _images(tmp)
    common = dict(workers=1, max_samples_per_shard=5)
    convert(ConvertConfig(source=images, dest=tmp / "out" / "folder", shuffle=True, seed=3, **common))
    convert(ConvertConfig(source=images, dest=tmp / "out" / "split", split="val=0.25", **common))
    convert(ConvertConfig(source=_table(tmp, images), dest=tmp / "out" / "table", max_side=20, **common))
    flat = tmp / "flat"
    flat.mkdir()
    for p in sorted((images / "square").glob("*.jpg")):
        (flat / p.name).write_bytes(p.read_bytes())
    convert(ConvertConfig(source=flat, dest=tmp / "out" / "unlabelled", **common))
    for k in range(2):
        convert(ConvertConfig(source=images, dest=tmp / "out" / "parts", part=(k, 2), name="p", **common))
    merge(tmp / "out" / "parts")


def _wds(folder: Path) -> None:
    """Three WebDataset tars (jpg + cls, a json in two of three samples), members dated 0 (the same bytes each run)."""
    from fastio.convert.synthetic import photo_jpeg

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for n in range(3):
        with tarfile.open(folder / f"wds-{n:06d}.tar", "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(4 * n, min(4 * n + 4, 10)):
                sample = {"jpg": photo_jpeg(rng, 24, 20), "cls": str(i % 3).encode()}
                if i % 3:
                    sample["json"] = json.dumps({"i": i}).encode()
                for field, data in sample.items():
                    info = tarfile.TarInfo(f"w{i:04d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _index_cases(tmp: Path) -> None:
    from fastio.convert.wds_index import IndexConfig, index_shards

    _wds(tmp / "out" / "wds")
    index_shards(IndexConfig(source=tmp / "out" / "wds", threads=1))
    _wds(tmp / "wds-src")
    index_shards(IndexConfig(source=tmp / "wds-src", dest=tmp / "out" / "wds-dest", threads=1))


def _token_cases(tmp: Path) -> None:
    from tokens_helpers import CORPUS, train_tokenizer

    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*CORPUS, ""]))
    tokenizer = train_tokenizer(tmp / "tokenizer.json")
    convert_tokens(TokenConvertConfig(source=docs, dest=tmp / "out" / "tokens", tokenizer=tokenizer, workers=1,
                                      max_samples_per_shard=7))
    eos = json.loads((tmp / "out" / "tokens" / "manifest.json").read_text())["tokens"]["eos_id"]
    index_tokens(TokenIndexConfig(source=tmp / "out" / "tokens" / "shards", eos_id=eos,
                                  dest=tmp / "out" / "tokens-indexed"))


def _image_text_case(tmp: Path) -> None:
    """Six image-text conversations (0..3 images each) in two shards: the manifest records the tokenizer's and
    template's checksums (the files are the same bytes each run) and the vocabulary (``image_text``)."""
    from tokens_helpers import image_text_source

    from fastio.convert.image_text import ImageTextOptions, convert_image_text
    from fastio.convert.run import ConvertConfig

    (tmp / "vlm").mkdir()
    src = image_text_source(tmp / "vlm", n=6)
    convert_image_text(ConvertConfig(src["source"], tmp / "out" / "image-text", workers=1, max_samples_per_shard=4),
                       ImageTextOptions(src["tokenizer"], src["config"]))


def build(tmp: Path) -> dict[str, str]:
    """Write every case under ``tmp/out`` and return their normalised manifests."""
    _convert_cases(tmp)
    _index_cases(tmp)
    _token_cases(tmp)
    _image_text_case(tmp)
    return manifests(tmp / "out", tmp)
