"""``python -m bench.run --only image_text --tiny``: the sections whose ``run`` takes ``tiny`` run at their smallest
size, end to end (data made, converted, fastio and every installed peer timed), into the results and summary."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("webdataset", reason="the image_text section's peer reads the shards with webdataset")


@pytest.mark.bench
def test_bench_run_tiny_runs_the_image_text_section_at_its_smallest_size(tmp_path, monkeypatch):
    import bench.run
    from bench.image_text import TINY

    monkeypatch.setattr(bench.run, "WORK", tmp_path / "work")
    out = tmp_path / "out"
    assert bench.run.main(["--only", "image_text", "--tiny", "--repeats", "1", "--quiet-wait", "0",
                           "--out", str(out)]) == 0
    result = json.loads((out / "image_text.json").read_text())
    assert result["conversations"] == TINY and (tmp_path / "work" / "image_text" / f"vlm-{TINY}" / "ds").is_dir()
    peers = ["dataloader", *(["energon"] if "energon" not in result["skipped"] else [])]
    assert all(result[f"{side}_samples"] == TINY for side in ["fastio", *peers])  # each side: every sample once
    assert [r["name"].split(" vs ")[1].split(" ")[0] for r in result["ratios"]] == [
        {"dataloader": "DataLoader(2", "energon": "Megatron-Energon"}[p] for p in peers]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sections"]["image_text"]["repeats"] == 1
