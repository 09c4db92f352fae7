"""Bench verdicts on a shared machine: the loader's rounds are paired and labelled, its ratios are medians of paired
rounds, and a ratio measured while other processes kept the cores busy gets no "met" or "MISSED", only that note
(bench/loader.py, bench/run.py); `python -m bench.run --out DIR` writes there, saying how quiet the machine was."""

from __future__ import annotations

import functools
import json

import pytest

import bench.index
import bench.run
from bench.common import verdict
from bench.loader import FIRSTS, _result, _round_line, _round_order, table
from bench.quiet import Quiet

QUIET = Quiet(False, 0.02, 2, 0.4)
BUSY = Quiet(True, 1.2, 2, 5.1)


def turns(per_round: list[float]) -> list[float]:
    """FIRSTS first batches a round, each the round's figure (round r's are at r * FIRSTS.., not at r)."""
    return [x for x in per_round for _ in range(FIRSTS)]


def rounds(quiet: list[Quiet]) -> dict:
    """Three loader rounds in which round 1 alone went badly for fastio (the issue's 549 against 1035)."""
    return {
        "runs": {"fastio": [549.0, 900.0, 1000.0], "dali": [1035.0, 800.0, 950.0],
                 "dataloader": [300.0, 450.0, 480.0], "ceiling": [2000.0, 2000.0, 2000.0]},
        "cpu": {k: [3.0, 3.0, 3.0] for k in ("fastio", "dali", "dataloader", "ceiling")},
        "by_thread": {"fastio": {"python": [0.1, 0.1, 0.1]}, "dali": {}},
        # FIRSTS first batches a round, each turn paired
        "first": {"fastio": turns([0.1, 0.2, 0.3]), "fastio_resumed": turns([0.1, 0.2, 0.3]),
                  "dali": turns([0.3, 0.1, 0.2])},
        "quiet": quiet,
    }


def test_each_peer_runs_next_to_fastio_on_alternating_sides():
    for r in range(4):
        order = _round_order(r)
        assert sorted(order) == ["ceiling", "dali", "dataloader", "fastio"] and order[1] == "fastio"
    assert _round_order(0)[0] == _round_order(1)[2] == "dali"
    assert _round_order(0)[2] == _round_order(1)[0] == "dataloader"


def test_the_ratios_are_medians_of_paired_rounds():
    result = _result(rounds([QUIET] * 3), "cpu", 2, 64, 3)
    by_name = {r["name"]: r["value"] for r in result["ratios"]}
    assert by_name["loader cpu samples/s vs DALI webdataset reader"] == pytest.approx(1000 / 950)  # not 900 / 950
    assert by_name["loader cpu samples/s vs DataLoader+WebDataset"] == pytest.approx(900 / 450)
    assert by_name["loader cpu first batch vs DALI's"] == pytest.approx(1.5)  # rounds 1/3, 2, 1.5; medians: 1.0
    assert result["quiet"]["busy"] is False and len(result["quiet_rounds"]) == 3


def test_a_round_line_names_its_round_and_what_the_others_used():
    line = _round_line(rounds([QUIET, BUSY, QUIET]), 1, 3)
    assert line.startswith("  round 2/3  ")
    assert "fastio / DALI 1.125" in line and "other processes used 1.20 of 2 cores" in line
    assert "first batch fastio 0.200s fastio_resumed 0.200s dali 0.100s" in line  # the medians of round 2's turns


def test_a_busy_round_withholds_the_verdicts_and_says_why():
    quiet = table({**_result(rounds([QUIET] * 3), "cpu", 2, 64, 3), "steady_rss_mib": {}})
    busy = table({**_result(rounds([QUIET, BUSY, QUIET]), "cpu", 2, 64, 3), "steady_rss_mib": {}})
    assert "(target >= 1.02: met)" in quiet and "(target >= 1.3: met)" in quiet
    assert "(target >= 1.02: met)" not in busy and "(target <= 1.0: MISSED)" not in busy
    assert busy.count("(target >= 1.02: not judged, machine busy: other processes used 1.20 of 2 cores, load 5.1; "
                      "as measured: met)") == 1


def test_verdict_reads_a_stored_condition_and_judges_when_quiet():
    ratio = {"name": "x", "value": 0.9, "target": 1.0, "better": "higher"}
    assert verdict(ratio) == verdict(ratio, QUIET.as_dict(), None) == "MISSED"
    assert verdict(ratio, QUIET, BUSY.as_dict()).startswith("not judged, machine busy: other processes used 1.20")


def test_bench_run_out_dir_gets_the_results_and_how_quiet_the_machine_was(tmp_path, monkeypatch, capsys):
    """`python -m bench.run --only index --out DIR` (the issue's command: `--out` was refused): the section's JSON,
    summary.json and the chart go to DIR, with what other processes used of the cores before and during it; the
    index section runs at its smallest here (2 shards of 5 samples)."""
    monkeypatch.setattr(bench.run, "WORK", tmp_path / "work")
    monkeypatch.setattr(bench.index, "run", functools.partial(bench.index.run, shards=2, per_shard=5))
    out = tmp_path / "out"
    assert bench.run.main(["--only", "index", "--out", str(out), "--repeats", "1", "--quiet-wait", "0"]) == 0
    assert {p.name for p in out.iterdir()} == {"index.json", "summary.json", "summary.png"}
    section = json.loads((out / "summary.json").read_text())["sections"]["index"]
    assert set(section["machine_quiet"]) == {"before", "during"}
    assert section["machine_quiet"]["during"]["cores"] >= 1
    printed = capsys.readouterr().out
    assert "quiet machine: " in printed and "index shards/s: fastio index / wds2idx" in printed
    assert f"wrote {out / 'summary.json'}" in printed


def test_the_chart_draws_a_busy_sections_ratios_gray(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratio = {"name": "x", "value": 2.0, "target": 1.0, "better": "higher"}
    def section(during: Quiet) -> dict:
        return {"repeats": 1, "ratios": [ratio], "machine_quiet": {"before": QUIET.as_dict(), "during": during.as_dict()}}

    summary = {"host": {"cpus": 2}, "sections": {"index": section(BUSY), "convert": section(QUIET)}}
    shown = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: shown.update(ax=fig.axes[0]))
    bench.run.plot(summary, tmp_path / "summary.png")
    colors = [matplotlib.colors.to_hex(bar.get_facecolor()) for bar in shown["ax"].patches]
    assert colors == [matplotlib.colors.to_hex("tab:gray"), matplotlib.colors.to_hex("tab:green")]
