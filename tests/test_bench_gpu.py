"""bench/gpu.py on the CPU at a tiny size: every section's code runs (no GPU figures here), and each section's result
holds what its docstring says it reports, so a session lent a GPU does not spend its minutes on a broken script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.gpu as gpu

TINY = {"UNIQUE": 48, "COPIES": 3, "VIDEOS": 8, "MODEL": "tiny conv", "TOKEN_DOCS": 400, "SEQ_LEN": 128, "CONVERSATIONS": 16}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TINY.items():
            mp.setattr(gpu, name, value)
        root = tmp_path_factory.mktemp("gpu-bench")
        gpu.main(["prepare", "--workdir", str(root), "--out", str(root / "out")])
        yield root, mp


def _section(work, name: str) -> dict:
    root, _ = work
    assert gpu.main([name, "--repeats", "1", "--device", "cpu", "--workdir", str(root), "--out", str(root / "out")]) == 0
    return json.loads((root / "out" / f"gpu-{name}.json").read_text())


def test_prepare_makes_every_sections_data(work):
    root, _ = work
    made = json.loads((root / "out" / "gpu-prepare.json").read_text())
    assert set(made) >= {"images", "videos", "tokens", "image_text", "machine"}
    assert all(Path(made[k]["path"], "manifest.json").is_file() for k in ("images", "videos", "tokens", "image_text"))


def test_decode_and_loader_sections_report_each_contender(work):
    decode = _section(work, "decode")
    assert set(decode["median"]) == {f"decode hw={load}" for load in gpu.LOADS}
    loader = _section(work, "loader")
    assert set(loader["median"]) == {*(f"fastio hw={load}" for load in gpu.LOADS), "dali reader", "dataloader"}
    assert set(loader["ratios_vs"]) == {"dali reader", "dataloader", "fastio hw=0.0", "fastio hw=1.0"}
    assert all(m["per_s"] > 0 and m["cpu_cores_busy"] > 0 for m in loader["median"].values())


def test_train_section_reports_a_stall_fraction_for_each_feeder(work):
    train = _section(work, "train")
    assert set(train["stall_fraction"]) == {"fastio hw=0.65", "fastio hw=1.0", "dali reader", "dataloader"}
    assert all(0 <= v < 1 for v in train["stall_fraction"].values())
    assert all(r["steps"] == gpu.UNIQUE * gpu.COPIES // gpu.BATCH - 1 for runs in train["runs"].values() for r in runs)


@pytest.mark.parametrize("name, contenders", [("video", {"fastio VideoClips"}),
                                               ("tokens", {"fastio Tokens", "megatron GPTDataset"}),
                                               ("image_text", {"fastio ImageText cpu"})])
def test_the_other_sections_run(work, name, contenders):
    assert set(_section(work, name)["median"]) == contenders
