"""What kills and a concurrent retention leave in a checkpoint directory: a temporary holding only a half-written
writer's mark is reclaimed (also once quarantined by an older fastio), never anything that may hold data; ``fastio
ckpt verify`` skips a step that retention deletes while it checks it (on disk and on s3://); a live reader's restore
directory is not a leftover when a writer restores."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import torch
from helpers import StateHolder, restore_dir_of, run_cli
from torch import nn

from fastio.checkpoint import Checkpointer, catalog, naming, removal, scan
from fastio.storage import open_storage
from fastio.storage.mirror import DirMirror

REPO = Path(__file__).resolve().parents[1]

KILLED_IN_START_TMP = """
    import os, sys
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    import fastio.storage.atomic
    from fastio.checkpoint import Checkpointer

    real = fastio.storage.atomic.publish

    def publish(tmp, final, **how):  # the writer's mark written to its temporary name, then killed before the rename
        if final.name == "fastio-writing.json":
            os._exit(9)
        real(tmp, final, **how)

    fastio.storage.atomic.publish = publish
    Checkpointer(sys.argv[1], signals=()).save(30, {"model": StateHolder({"w": torch.ones(4)})}, blocking=True)
"""


def app_at(tag: float) -> dict:
    return {"model": StateHolder({"w": torch.full((4,), float(tag))})}


def test_a_temporary_holding_only_a_half_written_writers_mark_is_reclaimed(tmp_path, warm):
    """A kill inside start_tmp leaves step-30.tmp holding only .fastio-writing.json.tmp: it was left alone, then
    moved aside as step-30.tmp.quarantined by the next save of step 30, and never reclaimed. Now both are deleted
    by the next restore; a quarantined temporary holding anything else, and one without fastio's marks, stay."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        ckpt.save(10, app_at(10), blocking=True)
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_IN_START_TMP))
    rc, out, err = warm.run(script, REPO, str(root), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rc == 9, out + err
    left = root / "step-30.tmp"
    assert [p.name for p in left.iterdir()] == [".fastio-writing.json.tmp"]
    shutil.copytree(left, root / "step-31.tmp")  # what an older fastio's next save of step 31 moved aside
    old = removal.quarantine(root / "step-31.tmp")
    assert old.name == "step-31.tmp.quarantined"
    data = removal.quarantine(Path(shutil.copytree(left, root / "step-32.tmp")))
    (data / "model.bin").write_bytes(b"maybe the only copy")  # not only marks: kept
    foreign = root / "step-33.tmp"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not fastio's")
    app = app_at(-1)
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(app).step == 10
    assert not left.exists() and not old.exists()
    assert (data / "model.bin").is_file() and (foreign / "notes.txt").is_file()


def test_verify_skips_a_step_that_retention_deletes_while_it_is_checked(tmp_path, monkeypatch, capsys):
    """verify listed step-1, then retention renamed it to .step-1.deleting-PID (remove_step's first move) before
    its files were checked: 'step-1/model/...: missing', exit 1, about 1 run in 25. Made deterministic: the
    rename happens at the first file check. Now the step is skipped, 'being deleted'."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        for step in (1, 2):
            ckpt.save(step, app_at(step), blocking=True)
    real, renamed = catalog._check_file, []

    def check_file(path, want):
        if not renamed:  # retention's rename, exactly as removal.remove_step does it, between listing and checking
            step1 = root / "step-1"
            renamed.append(step1.rename(step1.with_name(f".step-1.deleting-{os.getpid()}")))
        return real(path, want)

    monkeypatch.setattr(catalog, "_check_file", check_file)
    code, out, _ = run_cli(["ckpt", "verify", str(root)], capsys)
    assert renamed and code == 0, out
    assert "1 committed checkpoint verified (step 2); skipped step 1: being deleted" in out
    monkeypatch.setattr(catalog, "_check_file", real)  # a missing file in a step that keeps its marker: damage
    victim = root / "step-2" / sorted(scan.read_commit(root / "step-2").files)[0]
    victim.unlink()
    code, out, _ = run_cli(["ckpt", "verify", str(root)], capsys)
    assert code == 1 and f"{victim}: missing" in out


def test_verify_on_s3_skips_a_step_that_retention_deletes_while_it_is_checked(moto_server, s3_bucket, tmp_path,
                                                                              monkeypatch):
    """On the store retention deletes a step's marker first, then its objects: a verify that listed the step
    before found it incomplete or missing files. Now it is skipped; a damaged step that keeps its marker is
    still reported."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "s", signals=()) as ckpt:
        for step in (1, 2):
            ckpt.save(step, app_at(step), blocking=True)
    store = open_storage(url, options)
    real_pull = DirMirror.pull

    def pull(self, name, dest):
        if name == "step-1":  # retention (DirMirror.remove) runs between the listing and the download
            DirMirror(store, naming.COMMIT_FILE).remove(name)
        return real_pull(self, name, dest)

    monkeypatch.setattr(DirMirror, "pull", pull)
    _, report = catalog.verify_steps(url, storage_options=options)
    assert (report.problems, report.steps, report.vanished) == ([], [2], [1])
    key = next(o.key for o in store.list("step-2/") if not o.key.endswith(".json") and o.size > 0)
    store.put_bytes(key, b"damaged")
    _, report = catalog.verify_steps(url, storage_options=options)
    assert report.steps == [2] and len(report.problems) == 1 and key in report.problems[0]


def test_a_restore_of_another_live_process_keeps_its_directory_when_a_writer_restores(tmp_path):
    """Point 14: an evaluation restoring a compressed checkpoint (read-only) decompresses into its
    ``.step-N.restore-PID``; the trainer's own restore (a relaunch) deleted every such directory as abandoned,
    the live reader's too, under its feet. Only a dead process's is abandoned."""
    root = tmp_path / "ck"
    model = nn.Linear(4, 2)
    with Checkpointer(root, signals=(), compression="zstd") as ckpt:
        ckpt.save(1, {"m": model}, blocking=True)
    reader = subprocess.Popen(["sleep", "60"])  # a live process of this host, as the reader
    try:
        live = restore_dir_of(root, 1, reader.pid)
        (live / "m.bin").write_bytes(b"being read")
        dead = removal.start_restore_dir(root, 1).rename(root / ".step-1.restore-999999")
        with Checkpointer(root, signals=()) as ckpt:  # the trainer, relaunched
            assert ckpt.restore_latest({"m": nn.Linear(4, 2)}).step == 1
        assert (live / "m.bin").read_bytes() == b"being read"
        assert not dead.exists()
    finally:
        reader.kill()
        reader.wait()
    with Checkpointer(root, signals=()) as ckpt:  # once it has ended, its directory is a leftover
        ckpt.restore_latest({"m": nn.Linear(4, 2)})
    assert not live.exists()
