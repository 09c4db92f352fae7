"""The label rule of table sources (fastio.formats.labels): integral values are integers whatever their spelling, a mix
of integral and other values is refused naming rows of each kind (unless labels="names"), and the rule applied
is in the manifest and the convert summary; decimal and date columns of a parquet table too."""

from __future__ import annotations

import datetime
import decimal
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from fastio import Loader, Raw, converters
from fastio.cli import main
from fastio.convert.run import ConvertConfig, convert
from fastio.converters.base import ScanOptions
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, load_manifest
from fastio.errors import ConvertError, DatasetError
from fastio.formats.labels import choose_label_rule, integral_text, is_empty_label, label_name


def labels_of(result) -> list[int]:
    return [int(dict(e.fields)["cls"]) for e in result.entries]


def table(folder: Path, name: str, labels: list, image_folder: Path) -> Path:
    files = sorted(image_folder.rglob("*.jpg"))[: len(labels)]
    path = folder / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps({"path": str(f), "label": v}) + "\n" for f, v in zip(files, labels)))
    else:
        path.write_text("path,label\n" + "".join(f"{f},{v}\n" for f, v in zip(files, labels)))
    return path


def test_integral_values_in_any_spelling_are_integers():
    assert [integral_text(v) for v in (2, 2.0, " 2", "2.0", "2.00", "+2", "-1")] == ["2"] * 5 + ["2", "-1"]
    assert [integral_text(v) for v in (True, "true", [3], 2.5, "1e3", "two", math.inf)] == [None] * 7
    assert choose_label_rule([("a:2", "cat"), ("a:3", "dog")]) == "names"
    assert choose_label_rule([("a:2", 1)], "names") == "names"
    with pytest.raises(ValueError, match=r"labels must be one of auto, integers, names, got 'x'"):
        choose_label_rule([], "x")
    with pytest.raises(ValueError, match=r"not integral: a:3 \('dog'\)"):
        choose_label_rule([("a:2", "1"), ("a:3", "dog")], "integers")


def test_csv_float_spelled_labels_keep_their_values(tmp_path, image_folder):
    """1.0, 2.0, 10.0 were class names sorted as text: delivered as 0, 2, 1."""
    result = converters.scan(table(tmp_path, "t.csv", ["1.0", "2.0", "10.0", " 3"], image_folder))
    assert labels_of(result) == [1, 2, 10, 3] and result.label_map is None and result.label_rule == "integers"


@pytest.mark.parametrize("odd", [True, [3], "x"])
def test_jsonl_mix_is_refused_naming_rows_of_each_kind(tmp_path, image_folder, odd):
    """One `true` or `[3]` among integers used to make every label a class name (the row labelled 1 became 0)."""
    path = table(tmp_path, "t.jsonl", [1, 2, odd, 0, 5], image_folder)
    with pytest.raises(ConvertError) as err:
        converters.scan(path)
    message = str(err.value)
    assert message.startswith(f"{path}: column 'label': labels mix integral values (t.jsonl:1 (1), t.jsonl:2 (2),")
    assert f"others (t.jsonl:3 ({odd!r}))" in message and "labels='names'" in message
    names = converters.scan(path, options=ScanOptions(labels="names"))
    assert names.label_rule == "names"
    expected = sorted({"1", "2", label_name(odd), "0", "5"})
    assert names.label_map == {n: i for i, n in enumerate(expected)}


def test_parquet_float_column_with_a_missing_value(tmp_path, image_folder):
    """A pandas float column (a NaN made it float) holds 0.0, 2.0, 10.0: the labels are 0, 2, 10; NaN is empty."""
    files = sorted(image_folder.rglob("*.jpg"))[:4]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"path": [str(f) for f in files],
                             "label": pa.array([0.0, 2.0, math.nan, 10.0], pa.float64())}), path)
    result = converters.scan(path)
    assert labels_of(result) == [0, 2, 10] and result.label_rule == "integers"
    assert [s.reason for s in result.skipped] == ["empty label in column 'label'"]


def test_rule_in_manifest_and_summary(tmp_path, image_folder, capsys):
    path = table(tmp_path, "t.csv", ["1.0", "2", "10.0"], image_folder)
    assert main(["convert", str(path), str(tmp_path / "a"), "--workers", "1"]) == 0
    assert "; labels: integers (each label is its integral value)" in capsys.readouterr().out
    assert load_manifest(tmp_path / "a").label_rule == "integers"
    assert main(["convert", str(path), str(tmp_path / "b"), "--workers", "1", "--labels", "names"]) == 0
    assert "; labels: names (3 classes, labels are class names" in capsys.readouterr().out
    assert Dataset(tmp_path / "b").manifest.label_map == {"1.0": 0, "10.0": 1, "2": 2}
    mixed = table(tmp_path, "m.csv", ["1", "cat"], image_folder)
    assert main(["convert", str(mixed), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "labels mix integral values (m.csv:2 ('1')) and others (m.csv:3 ('cat'))" in err
    assert "--labels names" in err
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "f", workers=1))
    assert result.label_rule == "names" and "labels: names (4 classes" in result.summary()
    with pytest.raises(ValueError, match="labels must be one of auto, integers, names, got 'int'"):
        ConvertConfig(source=path, dest=tmp_path / "x", labels="int")


def test_manifest_label_rule_is_validated(tmp_path, image_folder):
    convert(ConvertConfig(source=image_folder, dest=tmp_path / "d", workers=1))
    manifest = json.loads((tmp_path / "d" / MANIFEST_NAME).read_text())
    manifest["label_rule"] = "sorted"
    (tmp_path / "d" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="label_rule: 'sorted' is not one of integers, names"):
        load_manifest(tmp_path / "d")


def _parquet(tmp_path, image_folder, labels: pa.Array):
    files = sorted(image_folder.rglob("*.jpg"))[: len(labels)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"path": [str(f) for f in files], "label": labels}), path)
    return path


def test_a_decimal_label_column_gives_its_integral_values(tmp_path, image_folder, capsys):
    cells = [decimal.Decimal(v) for v in ("1.00", "10", "2.0", "0")] + [None]
    path = _parquet(tmp_path, image_folder, pa.array(cells, pa.decimal128(6, 2)))
    code, out, err = run_cli(["convert", str(path), str(tmp_path / "ds"), "--workers", "1"], capsys)
    assert code == 0, err
    ds = Dataset(tmp_path / "ds")
    assert ds.manifest.label_rule == "integers" and ds.label_map is None
    loader = Loader(ds, batch_size=4, pipeline=Raw(), shuffle="none", device="cpu", world_size=1, rank=0)
    assert next(iter(loader))["label"].tolist() == [1, 10, 2, 0]  # path order = row order
    loader.close()
    assert "skipped 1" in out  # the null cell


def test_a_date_label_column_is_class_names(tmp_path, image_folder, capsys):
    days = [datetime.date(2024, 1, d) for d in (3, 1, 2, 1)]
    path = _parquet(tmp_path, image_folder, pa.array(days, pa.date32()))
    code, out, err = run_cli(["convert", str(path), str(tmp_path / "ds"), "--workers", "1"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert Dataset(tmp_path / "ds").label_map == {'"2024-01-01"': 0, '"2024-01-02"': 1, '"2024-01-03"': 2}


def test_numpy_and_decimal_cells():
    assert [integral_text(v) for v in (np.int64(3), np.uint8(4), np.float32(2.0), decimal.Decimal("2.00"))] == \
        ["3", "4", "2", "2"]
    assert [integral_text(v) for v in (np.bool_(True), decimal.Decimal("2.5"), decimal.Decimal("Infinity"))] == \
        [None] * 3
    assert is_empty_label(decimal.Decimal("NaN")) and is_empty_label(np.float32("nan")) and not is_empty_label(0)
