"""bench/gpu.py on the CPU at a tiny size: every section's code runs (no GPU figures here), and each section's result
holds what its docstring says it reports, so a session lent a GPU does not spend its minutes on a broken script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.gpu as gpu

TINY = {"UNIQUE": 48, "COPIES": 3, "VIDEOS": 8, "VIDEO_LENGTH": 40, "MODEL": "tiny conv", "TOKEN_DOCS": 400,
        "SEQ_LEN": 128, "CONVERSATIONS": 16}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny sizes and a work folder; each section makes the data it reads there on first use (as on the GPU
    machine without ``prepare``), so the tests of ``make test`` (images, tokens) make no videos or image-text set."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in TINY.items():
            mp.setattr(gpu, name, value)
        yield tmp_path_factory.mktemp("gpu-bench"), mp


@pytest.fixture(scope="module")
def prepared(work):
    """``work`` after ``gpu.py prepare``: every section's data made, and ``gpu-prepare.json`` written."""
    root, _ = work
    gpu.main(["prepare", "--workdir", str(root), "--out", str(root / "out")])
    return work


def _section(work, name: str) -> dict:
    root, _ = work
    assert gpu.main([name, "--repeats", "1", "--device", "cpu", "--workdir", str(root), "--out", str(root / "out")]) == 0
    return json.loads((root / "out" / f"gpu-{name}.json").read_text())


@pytest.mark.bench
def test_prepare_makes_every_sections_data(prepared):
    root, _ = prepared
    made = json.loads((root / "out" / "gpu-prepare.json").read_text())
    assert set(made) >= {"images", "videos", "tokens", "image_text", "machine"}
    assert all(Path(made[k]["path"], "manifest.json").is_file() for k in ("images", "videos", "tokens", "image_text"))


@pytest.mark.bench
def test_decode_and_loader_sections_report_each_contender(work):
    decode = _section(work, "decode")
    assert set(decode["median"]) == {f"{kind} hw={load}" for kind in ("decode", "crop decode") for load in gpu.LOADS}
    loader = _section(work, "loader")
    assert set(loader["median"]) == {*(f"fastio hw={load}" for load in gpu.LOADS), "dali reader", "dataloader"}
    assert set(loader["ratios_vs"]) == {"dali reader", "dataloader", "fastio hw=0.0", "fastio hw=1.0"}
    assert all(m["per_s"] > 0 and m["cpu_cores_busy"] > 0 for m in loader["median"].values())


@pytest.mark.bench
def test_train_section_reports_a_stall_fraction_for_each_feeder(work):
    train = _section(work, "train")
    assert set(train["stall_fraction"]) == {"fastio hw=0.65", "fastio hw=1.0", "dali reader", "dataloader"}
    assert all(0 <= v < 1 for v in train["stall_fraction"].values())
    assert all(r["steps"] == gpu.UNIQUE * gpu.COPIES // gpu.BATCH - 1 for runs in train["runs"].values() for r in runs)


@pytest.mark.bench
@pytest.mark.parametrize("name, contenders", [("video", {"fastio VideoClips"}),
                                               ("tokens", {"fastio Tokens", "megatron GPTDataset"}),
                                               ("image_text", {"fastio ImageText cpu"})])
def test_the_other_sections_run(work, name, contenders):
    assert set(_section(work, name)["median"]) == contenders


def test_the_dali_reader_contender_is_built_once_as_fastios_loader_is(work, monkeypatch):
    """Each timed run of the loader section is an epoch of a pipeline made before the rounds, for DALI's reader as for
    fastio's Loader: a pipeline built inside each run would time DALI's build and its shuffle buffer's fill too."""
    import bench.loader

    root, _ = work
    built, real = [], bench.loader._dali_pipe
    monkeypatch.setattr(bench.loader, "_dali_pipe", lambda *a: built.append(a) or real(*a))
    run = gpu._loader_contenders(gpu.image_shards(root), "cpu", ("dali reader",))["dali reader"]
    assert [run(), run()] == [gpu.UNIQUE * gpu.COPIES] * 2
    assert len(built) == 1


@pytest.mark.bench
def test_a_section_stopped_at_its_cap_leaves_what_it_measured(work, tmp_path):
    """bench/gpu.sh stops a section with SIGTERM at its cap: the rounds measured by then are written, marked cut off,
    and the exit status is timeout's 124."""
    import os
    import signal
    import subprocess
    import sys

    root, _ = work
    sizes = "; ".join(f"g.{k} = {v!r}" for k, v in TINY.items())
    args = ["loader", "--repeats", "50", "--device", "cpu", "--workdir", str(root), "--out", str(tmp_path)]
    code = f"import sys, bench.gpu as g; {sizes}; sys.exit(g.main({args!r}))"
    repo = Path(gpu.__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if "round 1/50" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    result = json.loads((tmp_path / "gpu-loader.json").read_text())
    assert rc == 124 and "cut_off" in result and result["section"] == "loader"
    timed = [r for runs in result["rounds"].values() for r in runs]
    assert timed and all(r["per_s"] > 0 for r in timed)


def test_a_peer_that_cannot_be_made_is_left_out_and_fastio_still_measured(work, monkeypatch):
    """megatron-core's dataset helpers not built on the GPU machine, say: the tokens section still measures fastio and
    names the peer it left out, with why."""
    import bench.tokens

    def unbuilt(*args, **kwargs):
        raise RuntimeError("helpers_cpp not built")

    monkeypatch.setattr(bench.tokens, "megatron_reader", unbuilt)
    result = _section(work, "tokens")
    assert set(result["median"]) == {"fastio Tokens"} and result["median"]["fastio Tokens"]["per_s"] > 0
    assert result["left_out"] == {"megatron GPTDataset": "RuntimeError: helpers_cpp not built"}


def test_a_section_that_fails_leaves_what_it_measured_and_raises(work, monkeypatch, tmp_path):
    def fails(work_dir, repeats, device):
        gpu._rounds({"fastio": lambda: 5}, 1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(gpu.RUN, "decode", fails)
    root, _ = work
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gpu.main(["decode", "--repeats", "1", "--device", "cpu", "--workdir", str(root), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu-decode.json").read_text())
    assert result["failed"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert [r["items"] for r in result["rounds"]["fastio"]] == [5]


def test_the_loader_section_leaves_out_a_dali_reader_that_cannot_be_made(work, monkeypatch):
    import bench.loader

    def refuses(*args):
        raise RuntimeError("[/opt/dali/dali/operators/reader/loader/webdataset_loader.cc:110] index mismatch")

    root, _ = work
    monkeypatch.setattr(bench.loader, "_dali_pipe", refuses)
    gpu.PARTIAL.clear()
    made = gpu._loader_contenders(gpu.image_shards(root), "cpu")
    assert set(made) == {*(f"fastio hw={load}" for load in gpu.LOADS), "dataloader"}
    assert gpu.PARTIAL["left_out"]["dali reader"].startswith("RuntimeError: [/opt/dali")
