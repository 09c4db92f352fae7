"""bench/tokens.py's scale row: a synthetic token dataset that is a real one (its manifest passes fastio verify), read
through a real fastio.Loader in a fresh process whose own peak memory is reported, not its parent's."""

from __future__ import annotations

import numpy as np
import pytest

from bench.tokens import bench_first_batch, write_synthetic
from fastio.report.verify import verify


def test_the_synthetic_corpus_is_a_token_dataset_fastio_verify_accepts(tmp_path):
    folder = write_synthetic(tmp_path / "scale", 4_000, shards=4, mean_len=50)
    report = verify(folder)
    assert report.ok, [str(p) for p in report.problems]
    again = write_synthetic(folder, 4_000, shards=4, mean_len=50)  # reused as it is: its manifest is last
    assert again == folder


@pytest.mark.bench
def test_the_first_batch_row_reports_the_childs_own_peak_memory(tmp_path):
    held = np.ones(768 << 20, np.uint8)  # 768 MiB resident here: a child forked from this process started with it
    got = bench_first_batch(tmp_path, 16_000, 64)
    assert held.sum() == held.size
    assert got["documents"] == 16_000 and got["tokens"] > 16_000 * 64
    steps = got["peak_rss_bytes_after"]
    assert list(steps) == ["import_fastio", "import_torch", "loader", "first_batch"] == list(got["seconds_after"])
    assert steps["import_fastio"] <= steps["import_torch"] <= steps["first_batch"] == got["peak_rss_bytes"]
    assert got["peak_rss_bytes"] < 600 << 20  # the Loader and torch; not the 768 MiB held here
    assert 0 < got["seconds_after"]["first_batch"] < got["seconds"]


def test_a_synthetic_folder_made_before_the_starts_table_gets_it(tmp_path):
    from dataclasses import replace

    from fastio.dataset.manifest import load_manifest, write_manifest
    from fastio.tokens.starts import STARTS_NAME

    folder = write_synthetic(tmp_path / "scale", 4_000, shards=4, mean_len=50)
    m = load_manifest(folder)
    write_manifest(folder, replace(m, tokens=replace(m.tokens, one_sequence_per_document=False, starts=None)))
    (folder / STARTS_NAME).unlink()
    write_synthetic(folder, 4_000, shards=4, mean_len=50)
    assert load_manifest(folder) == m and verify(folder).ok
