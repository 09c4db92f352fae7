"""A killed run never blocks the next: SIGKILL or SIGTERM of `fastio convert`, `convert --part` and `fastio merge`
(real CLI processes) at several moments leaves no fastio process behind within seconds, the caller's stdout pipe
reaches EOF (a `| tail` ends), and the same command run again succeeds. Ctrl-C (SIGINT to the foreground group) ends a
convert and its workers with one line; a killed s3:// convert's staging copy is found by a rerun that spells DEST
otherwise."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ctrl_c_default

from fastio.convert.dest import staging_path
from fastio.convert.merge import merge
from fastio.convert.parts import PARTS_DIR
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME
from fastio.storage.lock import LOCK_NAME

OPTIONS = ["--max-samples-per-shard", "2", "--max-side", "40", "--quality", "80"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("kill") / "src", classes=2, per_class=40, min_side=64,
                            max_side=96)


def children(pid: int) -> set[int]:
    """Live descendants of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (a zombie holds no descriptor)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_at(cmd: list[str], moment, sig: int, env=None) -> None:
    """Run ``cmd``; when ``moment()`` holds, freeze it, signal it, and check that it and its children are gone
    within 5 s, that its stdout pipe reached EOF (no child kept it open) and that no worker wrote a traceback."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    while not moment() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, f"finished before the moment: {proc.stderr.read().decode()}"
    kids = children(proc.pid)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=30) == -sig
    gone_by = time.monotonic() + 5
    while any(alive(k) for k in kids) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [k for k in kids if alive(k)], "processes outlived the killed run"
    ready, _, _ = select.select([proc.stdout], [], [], max(0.1, gone_by - time.monotonic()))
    assert ready and proc.stdout.read() == b"", "stdout is still held open: a `| tail` would wait forever"
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Process " not in err, err  # a worker that lost its parent goes quietly


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastio.cli", *args]


def exists(path: Path):
    return path.exists


def workers_started(me: int):
    """Whether the workers of the run that ``me`` started have: processes two levels below ``me`` (the command
    forks its workers: it runs nothing else)."""
    return lambda: any(children(c) for c in children(me))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
@pytest.mark.parametrize("moment", ["workers started", "shards written"])
def test_killed_convert_leaves_nothing_and_the_rerun_succeeds(tmp_path, source, sig, moment):
    dest = tmp_path / "d"
    me = os.getpid()
    when = {"workers started": workers_started(me),
            "shards written": exists(dest / "shards" / "shard-000003.tar")}[moment]
    kill_at(cli("convert", str(source), str(dest), "--workers", "2", *OPTIONS), when, sig)
    assert not (dest / MANIFEST_NAME).exists()
    convert(ConvertConfig(source=source, dest=dest, workers=2, max_samples_per_shard=2, max_side=40, quality=80))
    assert len(Dataset(dest)) == 80


@pytest.mark.parametrize("sig, moment", [(signal.SIGKILL, "workers started"), (signal.SIGTERM, "shards written")],
                         ids=["KILL-workers", "TERM-shards"])
def test_killed_part_leaves_nothing_and_the_rerun_succeeds(tmp_path, source, sig, moment):
    dest = tmp_path / "d"
    part = dest / PARTS_DIR / "part-1-of-2"
    me = os.getpid()
    when = {"workers started": workers_started(me),
            "shards written": exists(part / "shards" / "shard-000004.tar")}[moment]
    kill_at(cli("convert", str(source), str(dest), "--workers", "2", "--part", "1/2", *OPTIONS), when, sig)
    for k in (0, 1):
        convert(ConvertConfig(source=source, dest=dest, workers=2, max_samples_per_shard=2, max_side=40,
                              quality=80, part=(k, 2)))
    assert merge(dest).samples == 80


@pytest.mark.parametrize("sig, moment", [(signal.SIGKILL, "locked"), (signal.SIGTERM, "publishing")],
                         ids=["KILL-locked", "TERM-publishing"])
def test_killed_merge_leaves_nothing_and_the_rerun_succeeds(tmp_path, source, sig, moment):
    dest = tmp_path / "d"
    for k in (0, 1):
        convert(ConvertConfig(source=source, dest=dest, workers=1, max_samples_per_shard=2, part=(k, 2)))
    when = {"locked": exists(dest / LOCK_NAME),  # DEST and the parts locked
            "publishing": exists(dest / "shards" / "shard-000005.idx")}[moment]  # shards being linked into DEST
    kill_at(cli("merge", str(dest)), when, sig)
    assert not (dest / MANIFEST_NAME).exists()
    assert merge(dest).samples == 80


def test_killed_convert_to_s3_leaves_its_staging_copy_for_the_rerun_only(aws_env, s3_bucket, source, tmp_path):
    """The local copy is named after DEST: the rerun reuses and replaces it, then removes it."""
    url, stage = f"s3://{s3_bucket}/ds", tmp_path / "stage"
    staging = staging_path(url, stage)
    kill_at(cli("convert", str(source), url, "--workers", "2", "--staging-dir", str(stage), *OPTIONS),
            exists(staging / "dest" / "shards" / "shard-000003.tar"), signal.SIGKILL)
    assert [p.name for p in stage.iterdir()] == [staging.name]  # what the kill left: this DEST's copy only
    result = convert(ConvertConfig(source=source, dest=url, workers=2, max_samples_per_shard=2, max_side=40,
                                   quality=80, staging_dir=stage))
    assert result.samples == 80 and list(stage.iterdir()) == []
    assert len(Dataset(url, cache_dir=tmp_path / "cache")) == 80


def test_ctrl_c_stops_convert_and_its_workers_with_one_line(tmp_path):
    source = make_imagefolder(tmp_path / "src", classes=2, per_class=30, min_side=64, max_side=96)
    dest = tmp_path / "d"
    cmd = cli("convert", str(source), str(dest), "--workers", "2", *OPTIONS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=ctrl_c_default)
    deadline = time.monotonic() + 60
    while not (dest / "shards" / "shard-000003.tar").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    kids = children(proc.pid)
    assert proc.poll() is None and kids, "finished before the moment"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert proc.wait(timeout=30) == 130
    err = proc.stderr.read().decode()
    assert err.strip() in ("fastio: aborted", "fastio: interrupted"), err
    gone_by = time.monotonic() + 5
    while any(alive(k) for k in kids) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [k for k in kids if alive(k)]
    assert not dest.exists()  # the run made DEST: Ctrl-C takes it back (docs/convert.md), as any failure does
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert len(Dataset(dest)) == 60


def test_a_killed_s3_convert_leaves_no_copy_when_rerun_with_another_spelling_of_dest(aws_env, s3_bucket, tmp_path):
    """Issue 19.8: the staging copy is named after DEST; `s3://b/ds/` and `s3://b/ds` are the same DEST, so the
    rerun must find (and remove) the copy the killed run left, not leave it behind for good."""
    source = make_imagefolder(tmp_path / "src", classes=2, per_class=8, seed=2)
    stage = tmp_path / "stage"
    assert staging_path(f"s3://{s3_bucket}/ds/", stage) == staging_path(f"s3://{s3_bucket}//ds", stage) \
        == staging_path(f"s3://{s3_bucket}/ds", stage)
    kill_at(cli("convert", str(source), f"s3://{s3_bucket}/ds/", "--workers", "1", "--staging-dir", str(stage),
                *OPTIONS), lambda: any(stage.glob("*/dest/shards/shard-000002.tar")), signal.SIGKILL)
    assert len(list(stage.iterdir())) == 1
    result = convert(ConvertConfig(source=source, dest=f"s3://{s3_bucket}/ds", workers=1, max_samples_per_shard=2,
                                   staging_dir=stage))
    assert result.samples == 16 and list(stage.iterdir()) == []
