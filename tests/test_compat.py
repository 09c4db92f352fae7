"""Shards written by `fastio convert` read back sample for sample with webdataset, DALI and tar."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastio.convert.run import ConvertConfig, convert
from fastio.dataset.dataset import Dataset

BIN = Path(sys.executable).parent


@pytest.fixture
def converted(tmp_path, image_folder) -> tuple[Path, Path]:
    """The 48-image folder converted with 3 text-and-label-bearing shards (16 samples each)."""
    dest = tmp_path / "out"
    convert(ConvertConfig(source=image_folder, dest=dest, max_samples_per_shard=16, workers=1))
    return image_folder, dest


def expected_samples(src: Path) -> list[tuple[str, bytes, bytes]]:
    """(key, jpg bytes, cls bytes) in the order an unshuffled imagefolder conversion writes them."""
    classes = sorted(p.name for p in src.iterdir())
    return [(f"{p.parent.name}/{p.stem}", p.read_bytes(), str(classes.index(p.parent.name)).encode())
            for c in classes for p in sorted((src / c).iterdir())]


def test_webdataset_reads_every_sample(converted):
    import webdataset as wds

    src, dest = converted
    ds = Dataset(dest)
    urls = [str(s.path) for s in ds.shards]
    got = [(s["__key__"], s["jpg"], s["cls"]) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert got == expected_samples(src)


def test_dali_reader_with_our_index_files(converted):
    pytest.importorskip("nvidia.dali", reason="DALI is installed with the cuda13/cuda12 extra")
    from nvidia.dali import fn, pipeline_def

    src, dest = converted
    ds = Dataset(dest)
    want = expected_samples(src)

    @pipeline_def(batch_size=8, num_threads=1, device_id=None)
    def pipe():
        jpg, cls = fn.readers.webdataset(
            paths=[str(s.path) for s in ds.shards], index_paths=[str(s.idx_path) for s in ds.shards],
            ext=["jpg", "cls"], missing_component_behavior="error", random_shuffle=False, name="Reader",
        )
        return jpg, cls

    p = pipe()
    p.build()
    assert p.epoch_size("Reader") == len(want)
    got = []
    for _ in range(len(want) // 8):
        jpg, cls = p.run()
        got += [(bytes(jpg.at(i)), bytes(cls.at(i))) for i in range(len(jpg))]
    assert got == [(j, c) for _, j, c in want]


def test_tar_lists_members_in_sample_order(converted):
    src, dest = converted
    names = []
    for shard in Dataset(dest).shards:
        out = subprocess.run(["tar", "-tvf", str(shard.path)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            perms, owner, *_rest, name = line.split()
            assert perms == "-r--r--r--" and owner == "0/0", line
            names.append(name)
    assert names == [f"{k}.{ext}" for k, _, _ in expected_samples(src) for ext in ("cls", "jpg")]


@pytest.mark.skipif(not (BIN / "wds2idx").exists(), reason="wds2idx not installed with DALI")
def test_idx_files_equal_wds2idx_output(converted, tmp_path):
    _, dest = converted
    for shard in Dataset(dest).shards:
        theirs = tmp_path / f"{shard.name}.wds2idx"
        subprocess.run([str(BIN / "wds2idx"), str(shard.path), str(theirs)], check=True, capture_output=True)
        assert shard.idx_path.read_bytes() == theirs.read_bytes(), shard.name


def test_table_fields_read_back_with_webdataset(tmp_path, image_folder):
    """Text columns and labels from a CSV arrive in webdataset as the exact UTF-8 bytes."""
    import webdataset as wds

    files = sorted(image_folder.rglob("*.jpg"))[:6]
    table = image_folder.parent / "table.csv"
    lines = ["path,label,caption"] + [f"src/{p.parent.name}/{p.name},{p.parent.name},\"cap, {i} é\""
                                      for i, p in enumerate(files)]
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    dest = tmp_path / "tab"
    convert(ConvertConfig(source=table, dest=dest, workers=1))
    got = list(wds.WebDataset([str(s.path) for s in Dataset(dest).shards], shardshuffle=False))
    assert [s["caption"].decode() for s in got] == [f"cap, {i} é" for i in range(6)]
    assert [s["jpg"] for s in got] == [p.read_bytes() for p in files]
    shutil.rmtree(dest)


def test_loose_files_round_trip_through_webdataset(tmp_path, image_folder):
    """`files` format: what WebDataset reads back is exactly the files, grouped by basename."""
    import webdataset as wds

    src = tmp_path / "loose"
    (src / "part").mkdir(parents=True)
    jpgs = sorted(image_folder.rglob("*.jpg"))[:3]
    for i, jpg in enumerate(jpgs):
        folder = src / "part" if i == 2 else src
        (folder / f"s{i}.jpg").write_bytes(jpg.read_bytes())
        (folder / f"s{i}.json").write_text(f'{{"i": {i}}}')
        (folder / f"s{i}.cls").write_text(str(i))
    dest = tmp_path / "out"
    convert(ConvertConfig(source=src, dest=dest, workers=2))
    got = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
           for s in wds.WebDataset([str(s.path) for s in Dataset(dest).shards], shardshuffle=False)}
    assert sorted(got) == ["part/s2", "s0", "s1"]
    for i, jpg in enumerate(jpgs):
        key = "part/s2" if i == 2 else f"s{i}"
        assert got[key] == {"jpg": jpg.read_bytes(), "json": f'{{"i": {i}}}'.encode(), "cls": str(i).encode()}
