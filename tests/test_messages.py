"""What a newcomer reads: hints for other loaders' arguments, progress lines, `fastio --help`, `inspect`,
`make demo`'s last words, and `bench.run --only`."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import write_image_dataset

from fastio import FastioError, Loader, LoaderArgumentError, Raw
from fastio.cli import main
from fastio.progress import count

ROOT = Path(__file__).resolve().parent.parent


def cli(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("arguments,names", [
    ({"num_workers": 4}, ["num_workers=4", "num_threads=", "reader_threads="]),
    ({"pin_memory": True}, ["pin_memory=True", "device='cuda'"]),
    ({"shuffle": True}, ["shuffle=True", "shuffle='global'"]),
    ({"shuffle": False}, ["shuffle=False", "shuffle='none'"]),
])
def test_other_loaders_arguments_get_a_one_line_hint(image_dataset, arguments, names):
    with pytest.raises(LoaderArgumentError) as err:
        Loader(image_dataset, batch_size=4, device="cpu", **arguments)
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in names), message
    assert isinstance(err.value, FastioError) and isinstance(err.value, TypeError)


def test_progress_prints_at_least_once_per_epoch(image_dataset, capsys):
    """48 samples, batch 16: an epoch takes far less than the 5 s interval, yet each epoch prints a line."""
    with Loader(image_dataset, batch_size=16, device="cpu", pipeline=Raw(), progress=True) as loader:
        for _ in range(2):
            assert len(list(loader)) == 3
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fastio: epoch done")]
    assert len(lines) == 2, lines
    assert all(re.fullmatch(r"fastio: epoch done: 3 batches, \d+ samples/s, stall [\d.]+%", line) for line in lines)


def test_help_lists_whole_command_descriptions(capsys):
    """Each command's first sentence appears whole (wrapped), never cut with '...'."""
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    listed = out.split("Commands:", 1)[1]
    assert "..." not in listed
    flat = " ".join(listed.split())
    from fastio.cli.group import cli as group

    for name, command in group.commands.items():
        first = " ".join(command.get_short_help_str(limit=10_000).split())
        assert f"{name} {first}" in flat, (name, first, flat)
    assert cli(["ckpt", "--help"]) == 0
    assert "..." not in capsys.readouterr().out.split("Commands:", 1)[1]


def test_count_pluralises():
    assert [count(1, "shard"), count(2, "shard"), count(0, "sample"), count(1, "class", "classes")] == \
        ["1 shard", "2 shards", "0 samples", "1 class"]


def test_inspect_names_shard_bytes_and_image_bytes_apart(tmp_path, image_folder, capsys):
    dest = write_image_dataset(tmp_path / "one", image_folder, max_samples=1000)  # 48 samples, one shard
    assert cli(["inspect", str(dest)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^samples:  48 samples in 1 shard, [\d.]+ kB of shard files", out, re.MULTILINE), out
    assert re.search(r"^  bytes per image    min \d+", out, re.MULTILINE), out
    assert "1 shards" not in out


def test_demo_ends_with_the_next_command(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from demo import next_steps
    finally:
        sys.path.remove(str(ROOT / "examples"))
    text = next_steps(Path("demo-out/data"), Path("demo-out"))
    assert "fastio inspect demo-out/data/train" in text
    assert "python examples/quickstart.py demo-out/data" in text
    assert (ROOT / "examples" / "quickstart.py").is_file()
    # examples/train.py's usage names the folder the demo writes (demo-out/data/train), not one that never exists.
    usage = (ROOT / "examples" / "train.py").read_text().split('"""')[1]
    assert "--data demo-out/data/train" in usage


def _demo(cwd: Path, *args: str):
    import subprocess

    return subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_demo_help_prints_its_usage_and_makes_nothing(tmp_path):
    """Found by the integrations review: `python examples/demo.py --help` took --help for OUT and generated
    256 JPEGs under ./--help/raw, then failed in `fastio convert --help/raw ...`."""
    for flag in ("--help", "-h"):
        done = _demo(tmp_path, flag)
        assert done.returncode == 0, done.stderr
        assert "python examples/demo.py OUT" in done.stdout and not done.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_an_out_folder_it_did_not_make_and_keeps_its_files(tmp_path):
    """Found by the integrations review: `python examples/demo.py OUT` removed OUT whatever it held
    (`shutil.rmtree`), so `python examples/demo.py .` or a typo for a data folder deleted the user's files.
    It starts over only in a folder an earlier demo made (or an empty one); any other is refused in one line."""
    mine = tmp_path / "work"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "only-copy.txt").write_text("precious")
    done = _demo(tmp_path, "work")
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip() == (f"demo: work: exists and was not made by the demo (no {DEMO_MARK} in it); give "
                                   "a new folder, or an empty one"), done.stderr
    assert (mine / "data" / "only-copy.txt").read_text() == "precious"
    assert sorted(p.name for p in mine.iterdir()) == ["data"]
    assert _demo(tmp_path, "--out-of-nowhere").returncode == 2  # an unknown flag is not a folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_demo_starts_over_in_a_folder_it_made(tmp_path, monkeypatch):
    """The folder of an earlier demo (its DEMO_MARK file) is replaced: `make demo` again starts over."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from demo import DEMO_MARK as mark
        from demo import fresh_out
    finally:
        sys.path.remove(str(ROOT / "examples"))
    out = tmp_path / "demo-out"
    fresh_out(out)
    assert sorted(p.name for p in out.iterdir()) == [mark]
    (out / "raw").mkdir()
    fresh_out(out)
    assert sorted(p.name for p in out.iterdir()) == [mark]
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh_out(empty)
    assert sorted(p.name for p in empty.iterdir()) == [mark]


def old_demo_out(out: Path) -> Path:
    """``out`` as a demo made it before DEMO_MARK existed (examples/demo.py from 24ab31f to 40a488d): ``raw/`` (4
    class folders of 64 JPEGs), ``data/`` (their conversion with a train/val split) and ``ckpt/`` (train.py's
    two runs' checkpoints), and ``quickstart-ckpt/``, which the demo's closing hint makes."""
    import torch

    from fastio import Checkpointer
    from fastio.convert.run import ConvertConfig, convert
    from fastio.convert.synthetic import make_imagefolder

    make_imagefolder(out / "raw", classes=4, per_class=64, min_side=64, max_side=160, seed=0)
    convert(ConvertConfig(source=out / "raw", dest=out / "data", split="val=0.1", shuffle=True, seed=0,
                          max_samples_per_shard=64, workers=1, progress=False))
    for ckpt in ("ckpt/uninterrupted", "ckpt/interrupted", "quickstart-ckpt"):
        with Checkpointer(out / ckpt, every_steps=5, keep=2) as saver:
            saver.save(5, {"model": torch.nn.Linear(2, 2)}, blocking=True)
    return out


def test_demo_replaces_the_output_of_a_demo_older_than_its_mark_and_nothing_else(tmp_path, capsys):
    """Found by the newcomer review: `make demo` in a checkout that ran it before DEMO_MARK existed refused its own
    old demo-out/ ('exists and was not made by the demo'). A folder holding exactly what an older demo wrote is
    replaced; one more file anywhere in it (the user's), and it is refused and kept."""
    from example_scripts import load_example

    demo = load_example("demo")
    reference = old_demo_out(tmp_path / "reference")
    out = shutil.copytree(reference, tmp_path / "demo-out")
    demo.fresh_out(out)
    assert sorted(p.name for p in out.iterdir()) == [demo.DEMO_MARK]
    for extra in ("notes.txt", "raw/circle/mine.jpg", "raw/extra/a.jpg", "data/train/mine.txt", "ckpt/mine.pt",
                  "ckpt/interrupted/mine.pt"):
        out = shutil.copytree(reference, tmp_path / extra.replace("/", "-"))
        (out / extra).parent.mkdir(parents=True, exist_ok=True)
        (out / extra).write_text("precious")
        with pytest.raises(SystemExit) as exit_:
            demo.fresh_out(out)
        assert exit_.value.code == 2
        assert "exists and was not made by the demo" in capsys.readouterr().err
        assert (out / extra).read_text() == "precious" and (out / "raw").is_dir(), extra


DEMO_MARK = ".fastio-demo"


def test_bench_only_names_the_sections(capsys):
    from bench.run import SECTIONS
    from bench.run import main as bench_main

    with pytest.raises(SystemExit) as exit_:
        bench_main(["--only", "loader,nosuch"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section(s): nosuch" in err and all(s in err for s in SECTIONS)
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    out = capsys.readouterr().out
    assert all(s in out for s in SECTIONS), out


def test_bench_writes_untracked_results_and_a_log_chart(tmp_path, monkeypatch):
    """Results go to bench/out/ (ignored by git), not bench/results/ (committed reference results); the chart
    has a log axis with each target marked."""
    import subprocess

    import bench.common
    import bench.run

    assert bench.run.parser().get_default("out") == bench.common.RESULTS_DIR == ROOT / "bench" / "out"
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench/out/summary.json"], cwd=ROOT)
    assert ignored.returncode == 0
    summary = {"host": {"cpus": 2}, "sections": {"scale": {"repeats": 1, "ratios": [
        {"name": "time", "value": 31.3, "target": 10, "better": "higher"},
        {"name": "overhead", "value": 0.16, "target": 0.05, "better": "lower"}]}}}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: shown.update(ax=fig.axes[0]))
    bench.run.plot(summary, tmp_path / "summary.png")
    ax = shown["ax"]
    assert ax.get_xscale() == "log"
    lo, hi = ax.get_xlim()
    assert lo < 0.05 and hi > 31.3
    marks = [line.get_xdata()[0] for line in ax.get_lines() if line.get_color() == "black"]
    assert sorted(marks) == [0.05, 10]
