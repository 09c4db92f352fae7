"""Review of the label rule (issue 19.4) with parquet column types a table may hold: a decimal column's
integral cells are integers, a date column's cells are class names; neither may end in a raw TypeError."""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from helpers import run_cli

from fastio import Loader
from fastio.dataset.dataset import Dataset
from fastio.formats.labels import integral_text, is_empty_label


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
    loader = Loader(ds, batch_size=4, pipeline="raw", shuffle="none", device="cpu", world_size=1, rank=0)
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
