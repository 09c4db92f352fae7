"""bench/revs.py, two revisions of fastio in paired rounds: its command line, that each child process imports the
revision it was given (and refuses another), a real tiny run of HEAD against the working tree, and its verdicts
when the machine was busy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import revs
from bench.revs import CHILD, REPO, compare, export, parser, summarise, summary_lines, working_tree

QUIET = {"busy": False, "others": 0.01, "cores": 2, "load": 0.1, "waited_s": 0.0}
BUSY = {"busy": True, "others": 1.4, "cores": 2, "load": 3.0, "waited_s": 60.0}


def test_the_command_line_names_old_new_and_the_workloads(capsys):
    args = parser().parse_args(["5b1ea10"])
    assert (args.old, args.new, args.repeats, args.only, args.size) == ("5b1ea10", None, 3, revs.WORKLOADS, "small")
    args = parser().parse_args(["a1", "b2", "--repeats", "5", "--only", "loader,video", "--out", "/tmp/x"])
    assert (args.old, args.new, args.repeats, args.only, args.out) == ("a1", "b2", 5, ("loader", "video"), Path("/tmp/x"))
    with pytest.raises(SystemExit):
        parser().parse_args(["a1", "--only", "loader,bogus"])
    assert "--only 'loader,bogus': choose from loader,tokens,video,convert" in capsys.readouterr().err


def test_an_unknown_revision_is_one_line_naming_it(capsys):
    assert revs.main(["no-such-rev-xyz", "--only", "tokens", "--size", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.revs: error: revision 'no-such-rev-xyz'") and "\n" not in err


def _child_fastio(tree: Path, expect: Path) -> subprocess.CompletedProcess:
    """The child's import check alone: an unknown workload's data is never read before it."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, str(CHILD), "tokens", "/nonexistent", str(expect)],
                          capture_output=True, text=True, env=env, cwd=tree, check=False)


def test_a_child_imports_the_revision_it_was_given_and_refuses_another(tmp_path):
    old = export("HEAD", tmp_path)
    assert old.tree != REPO and (old.tree / "fastio" / "__init__.py").is_file()
    refused = _child_fastio(REPO, old.tree)  # PYTHONPATH the working tree, but the child expects the export
    assert refused.returncode == 3
    assert f"fastio imported from {REPO / 'fastio' / '__init__.py'}, not from the revision's tree" in refused.stderr
    taken = _child_fastio(old.tree, old.tree)  # imported from the export: it goes on (and fails on the data)
    assert "not from the revision's tree" not in taken.stderr and taken.returncode not in (0, 3)


@pytest.mark.bench
def test_head_against_the_working_tree_runs_both_and_pairs_the_ratio(tmp_path, capsys):
    result = compare("HEAD~0", None, repeats=2, only=("tokens",), size="tiny", quiet_wait=0, cache=tmp_path)
    out = capsys.readouterr().out
    assert "round 1/2 tokens: OLD" in out and "round 2/2 tokens: OLD" in out
    assert result["new"]["label"] == "working tree" and result["old"]["commit"] + "+" == working_tree().commit
    first = result["rounds"][0]["runs"]["tokens"]
    assert "/fastio-revs-" in first["HEAD~0"]["fastio"] and "/rev-" in first["HEAD~0"]["fastio"]
    assert first["working tree"]["fastio"] == str(REPO / "fastio" / "__init__.py")
    assert [r["order"][0] for r in result["rounds"]] == ["HEAD~0", "working tree"]  # who goes first alternates
    s = result["summary"]["tokens"]
    ratios = [r["runs"]["tokens"]["working tree"]["items"] / r["runs"]["tokens"]["working tree"]["seconds"]
              / (r["runs"]["tokens"]["HEAD~0"]["items"] / r["runs"]["tokens"]["HEAD~0"]["seconds"])
              for r in result["rounds"]]
    assert s["ratio_new_over_old"] == pytest.approx(sum(ratios) / 2) and s["ratio_new_over_old"] > 0
    assert result["data"]["tokens"].startswith("made by NEW (working tree), read by both")


def _round(old_rate: float, new_rate: float, during: dict, old_cpu: float = 1.0) -> dict:
    run = lambda rate, cpu=1.0: {"items": rate * 2, "seconds": 2.0, "cpu_s": cpu}  # noqa: E731
    return {"order": ["old", "new"], "runs": {"loader": {"old": run(old_rate, old_cpu), "new": run(new_rate)}},
            "quiet_before": QUIET, "quiet_during": during}


def test_a_cpu_time_too_small_to_count_leaves_its_round_out_of_the_cpu_ratio():
    one_zero = summarise([_round(100, 100, QUIET, old_cpu=0.0), _round(100, 100, QUIET, old_cpu=2.0)], "old", "new")
    assert one_zero["loader"]["cpu_ratio_new_over_old"] == pytest.approx(0.5)
    all_zero = summarise([_round(100, 99, QUIET, old_cpu=0.0)], "old", "new")
    assert all_zero["loader"]["cpu_ratio_new_over_old"] is None
    assert "CPU per item NEW/OLD not measurable: met" in summary_lines(all_zero, {"loader": "x"})[0]


def test_the_verdict_is_not_judged_when_a_round_found_the_machine_busy():
    quiet = summarise([_round(100, 99, QUIET), _round(100, 97, QUIET), _round(100, 98, QUIET)], "old", "new")
    assert quiet["loader"]["ratio_new_over_old"] == pytest.approx(0.98) and quiet["loader"]["verdict"] == "met"
    slower = summarise([_round(100, 80, QUIET)], "old", "new")
    assert slower["loader"]["verdict"] == "MISSED"
    busy = summarise([_round(100, 99, QUIET), _round(100, 98, BUSY)], "old", "new")["loader"]["verdict"]
    assert busy.startswith("not judged, machine busy: other processes used 1.40 of 2 cores")
    assert busy.endswith("as measured: met")


class _OldSpellingFastio:
    """A revision whose Loader takes only the flat options (``pipeline="image-train", image_size=224``) and that has
    no ``ImageTrain``: what the child must detect, by trying, not by a version number."""

    class Loader:
        def __init__(self, dest, *, pipeline, batch_size, image_size=None, **common):
            if pipeline != "image-train":
                raise ValueError(f"unknown pipeline {pipeline!r}")
            self.options = dict(pipeline=pipeline, image_size=image_size, batch_size=batch_size, **common)


def test_the_child_uses_the_option_spelling_the_revision_accepts():
    from bench import revs_child

    (loader, spelling), _ = revs_child._image(_OldSpellingFastio, "/data", 0)
    assert spelling == "pipeline='image-train', image_size=224"
    assert loader.options["pipeline"] == "image-train" and loader.options["image_size"] == 224
    with pytest.raises(SystemExit, match="no option spelling works on this revision: pipeline=fastio.VideoClips"):
        revs_child._video(_OldSpellingFastio, "/data", 0)  # neither VideoClips nor pipeline="video-clips" here


def test_an_exported_revision_is_compiled_so_its_processes_do_not_compile_fastio_each_time(tmp_path):
    """With PYTHONDONTWRITEBYTECODE set (as here), no run writes bytecode: an exported tree without it compiled
    fastio in every process it started, which convert's rounds counted against the older revision."""
    rev = export("HEAD", tmp_path)
    assert not list((rev.tree / "fastio").rglob("*.pyc"))
    revs.compiled(rev)
    tag = sys.implementation.cache_tag
    assert (rev.tree / "fastio" / "__pycache__" / f"__init__.{tag}.pyc").is_file()
    assert (rev.tree / "fastio" / "cli" / "__pycache__" / f"commands.{tag}.pyc").is_file()
    assert (rev.tree / "converters" / "__pycache__").is_dir()
