"""Review of issue 19.1 with the signal a user sends most: Ctrl-C, which the terminal delivers to every process
of the foreground group (the convert and its workers). The convert ends with one line, no worker prints a
traceback, none is left, and the rerun succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from helpers import ctrl_c_default
from test_kill import OPTIONS, alive, children, cli, kill_at

from fastio.convert.dest import staging_path
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset


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
