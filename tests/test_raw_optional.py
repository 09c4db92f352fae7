"""fastio.Raw() on a dataset whose non-image fields are optional (loose files, half of them with a .json):
absent fields come as empty bytes and batch["has"][field] says which samples have them; a
pipeline that needs a field some samples lack is refused when the Loader is made."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import indexed_tar
from test_mixture_sources import _img

from fastio import ImageEval, Loader, Raw
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder
from fastio.errors import DatasetError


@pytest.fixture
def half_with_json(tmp_path):
    images = make_imagefolder(tmp_path / "images", classes=1, per_class=10)
    src = tmp_path / "loose"
    src.mkdir()
    for i, path in enumerate(sorted(images.rglob("*.jpg"))):
        (src / f"s{i:02d}.jpg").write_bytes(path.read_bytes())
        (src / f"s{i:02d}.cls").write_text(str(i % 3))
        if i % 2 == 0:
            (src / f"s{i:02d}.json").write_text(json.dumps({"i": i}))
    (src / "s03.txt").write_text("")  # present, but empty: not the same as absent
    dest = tmp_path / "ds"
    convert(ConvertConfig(source=src, dest=dest, workers=1))
    return dest


def test_raw_delivers_absent_fields_as_empty_with_a_presence_mask(half_with_json):
    with Loader(half_with_json, batch_size=4, device="cpu", pipeline=Raw(), shuffle="none") as loader:
        batches = list(loader)
    seen = {}
    for b in batches:
        assert set(b["has"]) == {"jpg", "json", "txt", "cls"}
        for j, i in enumerate(b["index"].tolist()):
            key = loader.key(i)
            seen[key] = (b["json"][j], bool(b["has"]["json"][j]), b["txt"][j], bool(b["has"]["txt"][j]),
                         int(b["label"][j]), bool(b["has"]["jpg"][j]))
            assert b["has"]["json"].dtype == b["has"]["jpg"].dtype == torch.bool
    assert len(seen) == 10
    for key, (data, has, txt, has_txt, label, has_jpg) in seen.items():
        i = int(key[1:])
        assert has == (i % 2 == 0) and has_jpg and label == i % 3
        assert data == (json.dumps({"i": i}).encode() if has else b"")
        assert txt == b"" and has_txt == (i == 3)


def test_a_field_some_samples_lack_is_refused_at_open_where_every_sample_needs_it(tmp_path, capsys):
    b = indexed_tar(tmp_path / "b", {f"p{i}": {"jpg": _img(i), **({"txt": b"t%d" % i} if i < 4 else {})}
                                  for i in range(5)}, capsys)
    with pytest.raises(DatasetError, match=rf"^{b}: field 'txt' is in 4 of 5 samples, and this pipeline needs it"):
        Loader(b, batch_size=2, pipeline=ImageEval(size=16, fields=["txt"]), device="cpu",
               world_size=1, rank=0)
    with Loader(b, batch_size=5, pipeline=Raw(fields=["txt"]), device="cpu", world_size=1, rank=0) as loader:
        batch = next(iter(loader))
    assert sorted(batch["has"]["txt"].tolist()) == [False, True, True, True, True]
