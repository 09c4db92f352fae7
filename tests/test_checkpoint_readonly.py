"""A restore-only process (evaluation beside training): ``Checkpointer(dir, read_only=True)`` restores while a
training Checkpointer in another process holds the directory's lock (on s3://, the prefix's lease), takes neither,
changes nothing in the directory, and refuses to save; the refusal a second writer gets names it."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import StateHolder, restore_dir_of

from fastio.checkpoint import Checkpointer, naming, scan
from fastio.errors import CheckpointError
from fastio.storage import open_storage

REPO = Path(__file__).resolve().parents[1]

TRAINER = """
    import json, os, sys, time
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    from fastio.checkpoint import Checkpointer

    where, options, staging, done = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    kw = {"storage_options": options, "staging_dir": staging} if options else {}
    with Checkpointer(where, signals=(), **kw) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": StateHolder({"w": torch.full((4,), float(step))})}, blocking=True)
        print("ready", flush=True)
        while not os.path.exists(done):  # holds the lock (and lease) until the test is done
            time.sleep(0.05)
"""


def repo_env(**more: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **more}


class Trainer:
    """A training Checkpointer in a real process (started by the warm interpreter: torch is imported already),
    holding DIR's lock after saving steps 1 and 2, until the test is done."""

    def __init__(self, warm, where: str, tmp_path: Path, options: dict | None = None):
        import json

        script, self.done = tmp_path / "trainer.py", tmp_path / "trainer.done"
        script.write_text(textwrap.dedent(TRAINER))
        self.run = warm.start(script, REPO, where, json.dumps(options or {}), str(tmp_path / "trainer-staging"),
                              str(self.done), env=repo_env())

    def __enter__(self):
        line = next(self.run.lines(), "")
        if line.strip() != "ready":
            self.done.touch()
            raise AssertionError(line + "".join(self.run.wait()[1:]))
        return self

    def __exit__(self, *exc):
        self.done.touch()
        rc, out, err = self.run.wait()
        assert rc == 0, out + err


def app() -> dict:
    return {"model": StateHolder({"w": torch.zeros(4)})}


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def test_a_read_only_restore_runs_beside_a_training_job_and_changes_nothing(tmp_path, caplog, warm):
    """Before: a second Checkpointer on the directory was refused by the writer's lock, so evaluation beside
    training could not restore. Now read_only=True restores (falling back past a damaged step without moving it),
    leaves fastio's own leftovers alone, and refuses to save; the writer's refusal names read_only=True."""
    root = tmp_path / "ck"
    with Trainer(warm, str(root), tmp_path):
        with pytest.raises(CheckpointError, match=r"in use by .*read_only=True"):
            Checkpointer(root, signals=())
        abandoned = root / "step-3.tmp"
        abandoned.mkdir()
        (abandoned / naming.WRITING_FILE).write_text("{}")  # the writer's own temporary: the writer's to clean
        before = tree(root)
        reader = Checkpointer(root, read_only=True, signals=())
        restored = app()
        assert reader.restore_latest(restored).step == 2 and float(restored["model"].state["w"][0]) == 2.0
        assert tree(root) == before
        with pytest.raises(CheckpointError, match="read-only"):
            reader.save(3, restored)
        with pytest.raises(CheckpointError, match="read-only"):
            reader.maybe_save(3, restored, force=True)
        victim = root / "step-2" / sorted(scan.read_commit(root / "step-2").files)[0]
        victim.write_bytes(victim.read_bytes()[:-1])  # damaged: skipped, left where it is
        before = tree(root)
        assert reader.restore_latest(restored).step == 1 and float(restored["model"].state["w"][0]) == 1.0
        reader.close()
        assert tree(root) == before and "left in place (read_only)" in caplog.text
        victim.unlink()  # the training job can still commit (its lock was never disturbed)


def test_a_read_only_restore_on_s3_takes_no_lease_and_no_staging_dir(moto_server, s3_bucket, tmp_path, warm):
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    with Trainer(warm, url, tmp_path, options):
        with pytest.raises(CheckpointError, match=r"read_only=True"):
            Checkpointer(url, storage_options=options, staging_dir=tmp_path / "second", signals=())
        lease = open_storage(url, options).get(".fastio-lock")
        reader = Checkpointer(url, storage_options=options, read_only=True, signals=())
        private = reader.dir
        restored = app()
        assert reader.restore_latest(restored).step == 2 and float(restored["model"].state["w"][0]) == 2.0
        with pytest.raises(CheckpointError, match="read-only"):
            reader.save(3, restored)
        reader.close()
        assert not private.exists() and open_storage(url, options).get(".fastio-lock") == lease


def test_a_read_only_restore_of_a_directory_that_does_not_exist_is_an_error(tmp_path):
    """A restore-only process (evaluation, export) given a mistyped directory got None, the answer for a fresh
    start, and went on with the app's untrained weights. Now it is a CheckpointError naming the directory; an existing
    directory without steps is still None (training has not saved yet), and nothing is created."""
    holder = StateHolder({"w": torch.zeros(2)})
    with Checkpointer(tmp_path / "no" / "such", signals=(), read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'no' / 'such'}: checkpoint directory does not exist "
                                                  r"\(read_only=True: nothing to restore\)$"):
            ckpt.restore_latest({"model": holder})
    assert not (tmp_path / "no").exists()
    (tmp_path / "empty").mkdir()
    with Checkpointer(tmp_path / "empty", signals=(), read_only=True) as ckpt:
        assert ckpt.restore_latest({"model": holder}) is None


def test_a_read_only_restore_of_an_s3_prefix_without_checkpoints_is_an_error(moto_server, s3_bucket, tmp_path):
    """Before: a restore-only Checkpointer given a mistyped s3:// prefix (no object under it), or a dataset's prefix,
    got None, the answer for a fresh start, and an evaluation went on with untrained weights, where a local
    directory that does not exist was a CheckpointError. Now a prefix holding no step-N/ and no writer's lease is
    refused as `fastio ckpt verify` refuses it; one where training holds the lease but has not saved yet is still
    None, and nothing is written to the store."""
    options = moto_server.options()
    holder = StateHolder({"w": torch.zeros(2)})
    store = open_storage(f"s3://{s3_bucket}", options)
    store.put_bytes("ds/manifest.json", b"{}")
    for prefix in ("no/such", "ds"):
        url = f"s3://{s3_bucket}/{prefix}"
        with Checkpointer(url, storage_options=options, signals=(), read_only=True) as ckpt:
            with pytest.raises(CheckpointError, match=rf"^{url}: not a checkpoint prefix \(no step-N/, no "
                                                      r"\.fastio-lock\) \(read_only=True: nothing to restore\)$"):
                ckpt.restore_latest({"model": holder})
    assert [o.key for o in store.list()] == ["ds/manifest.json"]
    url = f"s3://{s3_bucket}/run"
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "train", signals=()):  # holds the lease
        with Checkpointer(url, storage_options=options, signals=(), read_only=True) as ckpt:
            assert ckpt.restore_latest({"model": holder}) is None


READER = """
    import json, os, signal, sys, time
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    from fastio.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], storage_options=json.loads(sys.argv[2]), read_only=True, signals=())
    ckpt.restore_latest({"model": StateHolder({"w": torch.zeros(4)})})
    print(ckpt.dir, flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(sys.argv[4]):  # alive until the test is done
        time.sleep(0.05)
"""


def test_a_killed_read_only_restore_on_s3_leaves_no_private_copy_behind(moto_server, s3_bucket, tmp_path,
                                                                         monkeypatch, warm):
    """Before: a read-only restore of an s3:// dir without staging_dir downloads into a private temporary directory
    that only close() removed: a killed evaluation job left a whole checkpoint's copy in /tmp each time. Now the next
    one removes the copies of processes that are gone (by pid and start time), never a live process's."""
    import json
    import tempfile

    url, options = f"s3://{s3_bucket}/ckpt", moto_server.options()
    with Trainer(warm, url, tmp_path, options):
        pass  # steps 1 and 2 on the store
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(READER))

    done = tmp_path / "reader.done"

    def reader(how: str):  # started by the warm interpreter (one at a time)
        return warm.start(script, REPO, url, json.dumps(options), how, str(done), env=repo_env(TMPDIR=str(tmp)))

    killed = reader("kill")
    killed_dir = Path(next(killed.lines(), "").strip())
    rc, _, err = killed.wait()
    assert rc == -9, err
    assert killed_dir.parent == tmp and (killed_dir / "step-2" / naming.COMMIT_FILE).is_file()  # left by the kill
    live = reader("live")
    try:
        live_dir = Path(next(live.lines(), "").strip())
        assert live_dir.parent == tmp and live_dir.is_dir(), live_dir
        mine = Checkpointer(url, storage_options=options, read_only=True, signals=())
        assert mine.restore_latest(app()).step == 2
        with Checkpointer(url, storage_options=options, read_only=True, signals=()) as again:
            assert again.restore_latest(app()).step == 2
        assert not killed_dir.exists()  # its process is gone
        assert live_dir.is_dir() and mine.dir.is_dir()  # live processes' (another's, this one's) are kept
        mine.close()
        assert not mine.dir.exists()
    finally:
        done.touch()
        live.wait()


KILLED_IN_DECOMPRESS = """
    import os, signal, sys
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    from fastio.checkpoint import Checkpointer, compress

    def killed(*args):  # the process dies as the first file is decompressed into its working copy
        os.kill(os.getpid(), signal.SIGKILL)

    compress.restore_file = killed
    Checkpointer(sys.argv[1], read_only=True, signals=()).restore_latest({"model": StateHolder({"w": torch.zeros(4)})})
"""


def test_a_killed_read_only_restore_of_a_compressed_checkpoint_is_cleaned_by_the_next_one(tmp_path, warm):
    """Before: a read-only restore of a compressed local checkpoint decompresses into `.step-N.restore-PID` in DIR;
    killed, it left that copy there, and only a writer's restore ever removed it (an evaluation beside training
    left one more copy per kill). Now the next restore, read-only too, removes the copies of ended processes (by pid
    and start time), never a live one's, and leaves everything else in DIR as it was."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=(), compression="zstd") as ckpt:
        ckpt.save(1, {"model": StateHolder({"w": torch.full((4,), 1.0)})}, blocking=True)
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_IN_DECOMPRESS))
    before = tree(root)
    rc, _, err = warm.run(script, REPO, str(root), env=repo_env(), timeout=120)
    assert rc == -9, err
    left = sorted(p.name for p in root.iterdir() if p.name.startswith(".step-1.restore-"))
    assert len(left) == 1, sorted(p.name for p in root.iterdir())  # the kill left its working copy
    live = subprocess.Popen(["sleep", "60"])  # a live process of this host, as another reader
    try:
        theirs = restore_dir_of(root, 1, live.pid)
        (theirs / "model.bin").write_bytes(b"being read")
        with Checkpointer(root, read_only=True, signals=()) as reader:
            restored = app()
            assert reader.restore_latest(restored).step == 1 and float(restored["model"].state["w"][0]) == 1.0
        assert not (root / left[0]).exists()
        assert (theirs / "model.bin").read_bytes() == b"being read"
    finally:
        live.kill()
        live.wait()
    shutil.rmtree(theirs)
    assert tree(root) == before


@pytest.mark.parametrize("other_step", [1, 2])
def test_two_read_only_restores_of_compressed_steps_in_one_process_keep_their_copies(tmp_path, monkeypatch,
                                                                                     other_step):
    """Before: every restore of one process decompressed step N into the same `.step-N.restore-PID`, and counted
    any such directory of its own pid as a leftover: a second read-only Checkpointer of the process (another thread:
    an evaluation of several checkpoints at once) restoring while the first was reading deleted the first's copy
    under it. Now each restore's copy is its own, and only ended restores' copies are leftovers."""
    import threading

    from fastio.checkpoint import compress

    root = tmp_path / "ck"
    with Checkpointer(root, signals=(), compression="zstd") as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": StateHolder({"w": torch.full((4,), float(step))})}, blocking=True)
    real, started, go = compress.restore_file, threading.Event(), threading.Event()

    def held(src, dst, codec):  # the first restore stops after decompressing its first file
        real(src, dst, codec)
        if threading.current_thread().name == "first":
            started.set()
            go.wait(60)

    monkeypatch.setattr(compress, "restore_file", held)
    got: dict[str, object] = {}

    def first():
        try:
            with Checkpointer(root, read_only=True, signals=()) as reader:
                restored = app()
                got["first"] = (reader.restore_latest(restored, step=1).step, float(restored["model"].state["w"][0]))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            got["first"] = err

    thread = threading.Thread(target=first, name="first")
    thread.start()
    assert started.wait(60)
    with Checkpointer(root, read_only=True, signals=()) as reader:
        restored = app()
        assert reader.restore_latest(restored, step=other_step).step == other_step
    go.set()
    thread.join(60)
    assert got["first"] == (1, 1.0)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".step-")]


def test_a_read_only_restore_listing_while_retention_renames_the_only_step_finds_the_next(tmp_path, monkeypatch):
    """Before: beside a training job with keep=1, a read-only restore that listed DIR just before the job committed
    step 2 and renamed step 1 away (retention) found step 1 gone when it read its marker, and so no step at all:
    restore_latest returned None, a fresh start's answer (an evaluation went on with untrained weights; 132 of 200
    restores in a stress run). Now a listing that lost a step while it was read is taken again."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=(), keep=0) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": StateHolder({"w": torch.full((4,), float(step))})}, blocking=True)
    later = tmp_path / "later"
    (root / "step-2").rename(later)
    real, moved = scan.read_commit, []

    def training_moves_on(path):  # the job commits step 2 and retention renames step 1 away, after the listing
        if Path(path).name == "step-1" and not moved:
            moved.append(later.rename(root / "step-2"))
            (root / "step-1").rename(root / naming.deleting_name("step-1"))
        return real(path)

    monkeypatch.setattr(scan, "read_commit", training_moves_on)
    with Checkpointer(root, read_only=True, signals=()) as reader:
        restored = app()
        state = reader.restore_latest(restored)
    assert moved and state is not None and state.step == 2 and float(restored["model"].state["w"][0]) == 2.0


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_a_step_deleted_while_it_is_restored_is_named_so(tmp_path, monkeypatch, engine):
    """Before: a step that the training job's retention (keep=1) deleted after the restore had checked it and before
    the engine read it failed with what the engine then missed, with DCP `checkpoint has no state for app key
    _fastio_rng on saving rank 0`, as if it were another app's checkpoint. Now the error says the step was deleted
    while it was being restored, and what to do."""
    from fastio.checkpoint.restore import Restorer

    root = tmp_path / "ck"
    with Checkpointer(root, signals=(), engine=engine) as ckpt:
        ckpt.save(1, {"model": StateHolder({"w": torch.full((4,), 1.0)})}, blocking=True)
    real = Restorer._open

    def retention_meanwhile(self, path, *args, **kwargs):  # the job's retention renames it away, then deletes it
        shutil.rmtree(Path(path).rename(root / naming.deleting_name("step-1")))
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Restorer, "_open", retention_meanwhile)
    with Checkpointer(root, read_only=True, signals=()) as reader:
        with pytest.raises(CheckpointError, match=rf"^{root / 'step-1'}: deleted while it was being restored "
                                                  r"\(by the retention of the job writing the directory\? keep it at "
                                                  r"keep=2 or more beside a read-only restore\): "):
            reader.restore_latest(app())


def test_a_read_only_restore_of_a_compressed_step_on_a_read_only_mount_decompresses_elsewhere(tmp_path,
                                                                                             monkeypatch):
    """Before: a read-only restore (evaluation) of a compressed checkpoint on a read-only mount failed with
    `.step-1.restore-PID: cannot create: Read-only file system`: its working copy could only be in DIR. Now a
    read-only restore of one rank that cannot write DIR decompresses into a private temporary directory (marked,
    removed when the restore ends; a killed one's by the next), and DIR is left as it was."""
    import subprocess
    import tempfile

    where = tmp_path / "mnt"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        root = where / "ck"
        with Checkpointer(root, signals=(), compression="zstd") as ckpt:
            ckpt.save(1, {"model": StateHolder({"w": torch.full((4,), 1.0)})}, blocking=True)
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        before = tree(root)
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with Checkpointer(root, read_only=True, signals=()) as reader:
            restored = app()
            assert reader.restore_latest(restored).step == 1 and float(restored["model"].state["w"][0]) == 1.0
        assert tree(root) == before and list(tmp.iterdir()) == []
    finally:
        subprocess.run(["umount", str(where)], check=True)
