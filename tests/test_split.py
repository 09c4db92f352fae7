"""convert --split: stratified by label by default (every class with >= 1/fraction samples is in each split),
--split-by random as before; train may be named with the remainder (``train=0.9,val=0.1``), another train fraction is
one line; and progress lines on a stderr that is not a terminal (Slurm logs)."""

from __future__ import annotations

import collections
import re

import pytest
from helpers import run_cli

from fastio.cli import main
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.split import assign_splits
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset
from fastio.errors import ConvertError


def test_stratified_split_takes_every_class_and_the_right_size():
    labels = [c for c in range(10) for _ in range(10 + c)]  # 10..19 samples per class, 145 in all
    for seed in range(5):
        groups = assign_splits(len(labels), {"val": 0.1, "test": 0.05}, seed, labels)
        assert [len(groups[s]) for s in ("train", "val", "test")] == [124, 14, 7]
        assert sorted(i for g in groups.values() for i in g) == list(range(len(labels)))
        assert {labels[i] for i in groups["val"]} == set(range(10))  # every class has >= 10 samples
        per_class = collections.Counter(labels[i] for i in groups["val"])
        assert all(int(0.1 * (10 + c)) <= per_class[c] <= int(0.1 * (10 + c)) + 1 for c in range(10))
    assert assign_splits(len(labels), {"val": 0.1}, 3, labels) == assign_splits(len(labels), {"val": 0.1}, 3, labels)
    assert assign_splits(len(labels), {"val": 0.1}, 3, labels) != assign_splits(len(labels), {"val": 0.1}, 4, labels)
    with pytest.raises(ValueError, match=r"split fraction 0.01 for 'val' of 20 samples leaves it empty"):
        assign_splits(20, {"val": 0.01}, 0)


def ten_classes(tmp_path):
    """10 class folders of 10 JPEGs each."""
    pool = sorted(make_imagefolder(tmp_path / "pool", classes=4, per_class=25, min_side=16, max_side=24).rglob("*.jpg"))
    for i, path in enumerate(pool):
        folder = tmp_path / "src" / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:03d}.jpg").write_bytes(path.read_bytes())
    return tmp_path / "src"


def test_convert_split_is_stratified_by_default(tmp_path):
    src = ten_classes(tmp_path)
    assert main(["convert", str(src), str(tmp_path / "d"), "--split", "val=0.1", "--workers", "1", "-q"]) == 0
    val = Dataset(tmp_path / "d" / "val")
    assert sorted(key.split("/")[0] for key in val.table.keys) == [f"class{c}" for c in range(10)]
    assert val.manifest.convert_options["split_by"] == "label"
    result = convert(ConvertConfig(source=src, dest=tmp_path / "r", split="val=0.1", split_by="random", workers=1))
    assert result.manifests["val"].convert_options["split_by"] == "random"
    assert len(Dataset(tmp_path / "r" / "val")) == 10
    with pytest.raises(ValueError, match="split_by must be one of label, random"):
        ConvertConfig(source=src, dest=tmp_path / "x", split="val=0.1", split_by="class")


def test_split_by_label_needs_labels(tmp_path):
    src = tmp_path / "loose"
    src.mkdir()
    for i in range(20):
        (src / f"s{i}.txt").write_text(str(i))
    with pytest.raises(ConvertError, match=r"split_by='label' but the source has no labels"):
        convert(ConvertConfig(source=src, dest=tmp_path / "d", split="val=0.1", split_by="label", workers=1))
    result = convert(ConvertConfig(source=src, dest=tmp_path / "d", split="val=0.1", workers=1))
    assert result.manifests["val"].convert_options["split_by"] == "random"


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=30)
    assert main(["convert", str(src), str(tmp_path / "d"), "--workers", "1", "--max-side", "24",
                 "--progress-every", "0.01"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines and all(re.fullmatch(r"convert: \d+/60 samples \(\d+%\), \d+ samples/s, [\d.]+ MB/s, \d+ s elapsed, "
                                      r"ETA (\d+ s|unknown)", ln) for ln in lines), lines
    assert out.startswith("converted 60 samples")
    assert main(["convert", str(src), str(tmp_path / "q"), "--workers", "1", "--progress-every", "0.01", "-q"]) == 0
    assert capsys.readouterr() == ("", "")


def test_train_may_be_named_with_the_remainder(tmp_path, capsys):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=5, seed=3)
    prints = []
    for name, split in (("a", "train=0.8,val=0.2"), ("b", "val=0.2,train=0.8"), ("c", "val=0.2")):
        code, out, err = run_cli(["convert", str(src), str(tmp_path / name), "--workers", "1", "--split", split], capsys)
        assert code == 0, err
        prints.append([Dataset(tmp_path / name / s).fingerprint for s in ("train", "val")])
        assert len(Dataset(tmp_path / name / "train")) == 8 and len(Dataset(tmp_path / name / "val")) == 2
    assert prints[0] == prints[1] == prints[2]
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "d"), "--split", "train=0.7,val=0.2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--split: train=0.7 and the other fractions add up to 0.9" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
