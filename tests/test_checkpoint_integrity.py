"""Damaged, unrecognised and untrusted checkpoints; one writer per directory; old sha256 commits."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import StateHolder, reseal
from torch import nn

from fastio.checkpoint import Checkpointer, catalog, checkpointer, naming, record, rollback, scan
from fastio.cli import main as fastio_main
from fastio.errors import CheckpointError
from fastio.storage.checksum import digest_file, sha256_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=("torchsnapshot", "dcp"))
def engine(request, monkeypatch) -> str:
    """Runs a test once per engine: the Checkpointer's engine="auto" picks this one (as engine= would)."""
    chosen = request.param
    monkeypatch.setattr(checkpointer, "choose_engine", lambda name, app: chosen if name == "auto" else name)
    return chosen


def make_app(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def save_steps(root: Path, steps=(1, 2)) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps``, the weights changing between them; returns each step's weights."""
    app = make_app()
    weights = {}
    with Checkpointer(root, signals=()) as ckpt:
        for s in steps:
            with torch.no_grad():
                app["model"][0].weight.add_(1.0)
            weights[s] = {k: v.clone() for k, v in app["model"].state_dict().items()}
            ckpt.save(s, app, blocking=True)
    return weights


def biggest_file(step: Path) -> Path:
    return max((p for p in step.rglob("*") if p.is_file() and p.name != naming.COMMIT_FILE), key=lambda p: p.stat().st_size)


def restore(root: Path, caplog, **kw):
    app = make_app(seed=5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastio"), Checkpointer(root, signals=()) as ckpt:
        state = ckpt.restore_latest(app, **kw)
    return state, app, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def truncate(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


def marker_missing(step: Path) -> None:
    (step / naming.COMMIT_FILE).unlink()


def marker_truncated(step: Path) -> None:
    truncate(step / naming.COMMIT_FILE)


def marker_newer(step: Path) -> None:
    m = step / naming.COMMIT_FILE
    m.write_text(json.dumps({**json.loads(m.read_text()), "version": max(record.READ_VERSIONS) + 1}))


# ---------------------------------------------------------------- damaged newest step: skip, warn, fall back
@pytest.mark.parametrize("damage", [flip, truncate])
def test_damaged_newest_step_is_skipped_and_kept(tmp_path, caplog, engine, damage):
    root = tmp_path / "ck"
    weights = save_steps(root)
    victim = biggest_file(root / "step-2")
    damage(victim)
    state, app, warned = restore(root, caplog)
    assert state.step == 1
    assert all(torch.equal(app["model"].state_dict()[k], v) for k, v in weights[1].items())
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"fastio: skipping checkpoint {root}/step-2: {victim}: ")
    reason = "size" if damage is truncate else "xxh3_128"
    assert f": {reason} " in warned[0] and warned[0].endswith("moved aside to step-2.quarantined")
    moved = root / "step-2.quarantined" / victim.relative_to(root / "step-2")
    assert moved.is_file()  # kept, not deleted
    assert catalog.verify(root) == []  # the quarantined copy is no longer a step directory
    rows = catalog.list_checkpoints(root)  # but `fastio ckpt ls` shows it
    assert [(r["step"], r["committed"], Path(r["path"]).name) for r in rows] == [
        (1, True, "step-1"), (2, False, "step-2.quarantined")]
    assert rows[1]["problem"].startswith("quarantined: moved aside by fastio")


@pytest.mark.parametrize("damage", [marker_missing, marker_truncated, marker_newer])
def test_unrecognised_commit_marker_is_skipped_not_deleted(tmp_path, caplog, damage):
    root = tmp_path / "ck"
    save_steps(root)
    files = sorted(p.relative_to(root / "step-2") for p in (root / "step-2").rglob("*"))
    damage(root / "step-2")
    state, _, warned = restore(root, caplog)
    assert state.step == 1
    assert len(warned) == 1 and warned[0].startswith(f"fastio: skipping checkpoint {root}/step-2: ")
    expect = {marker_missing: "no commit marker", marker_truncated: "unreadable commit marker",
              marker_newer: f"commit marker version {max(record.READ_VERSIONS) + 1}, this fastio reads"}[damage]
    assert expect in warned[0], warned[0]
    kept = sorted(p.relative_to(root / "step-2.quarantined") for p in (root / "step-2.quarantined").rglob("*"))
    assert [f for f in files if f.name != naming.COMMIT_FILE] == [f for f in kept if f.name != naming.COMMIT_FILE]


@pytest.mark.parametrize("name", ["step-02", "step-\u0662"])  # a leading zero; an Arabic-Indic digit two
def test_a_step_directory_renamed_to_another_spelling_of_its_step_is_no_step(tmp_path, caplog, capsys, name):
    """Before: `step-02` (a step directory renamed by hand) was step 2 to `ckpt ls` and `ckpt verify` ("2 committed
    checkpoints verified"), while a restore looked for `step-2`, warned that it had no commit marker and fell back to
    step 1; a step 2 saved later stood beside it as a second step 2, which retention could delete in its place. Now
    only fastio's own spelling, `step-N` in ASCII digits without a leading zero, is a step: the renamed directory
    is nobody's step, listed by none and never deleted."""
    root = tmp_path / "ck"
    save_steps(root)
    (root / "step-2").rename(root / name)
    kept = sorted(p.relative_to(root / name) for p in (root / name).rglob("*"))
    assert fastio_main(["ckpt", "verify", str(root)]) == 0
    assert "1 committed checkpoint verified (step 1)" in capsys.readouterr().out
    state, _, warned = restore(root, caplog)
    assert state.step == 1 and warned == []
    app = make_app()
    with Checkpointer(root, signals=(), keep=1) as ckpt:
        for step in (2, 3):
            ckpt.save(step, app, blocking=True)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted([name, "step-3"])
    assert sorted(p.relative_to(root / name) for p in (root / name).rglob("*")) == kept


@pytest.mark.parametrize("damage", [marker_truncated, marker_newer])
def test_ckpt_ls_says_unrecognised_for_a_step_whose_marker_it_cannot_read_not_incomplete(tmp_path, capsys, damage):
    """Before: `fastio ckpt ls` listed a step whose commit marker it could not read (a newer fastio's version, a
    damaged marker, one edited by hand) as `incomplete`, the word for an interrupted write, with nothing else in the
    table: cleaning up incomplete steps deleted whole checkpoints (a newer fastio's were the only copy). Now such a
    step is `unrecognised` (its problem in --json); a step without a marker is still `incomplete`."""
    root = tmp_path / "ck"
    save_steps(root)
    damage(root / "step-2")
    (root / "step-3.tmp").mkdir()
    assert fastio_main(["ckpt", "ls", "--json", str(root)]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert [rows[s]["state"] for s in (1, 2, 3)] == ["committed", "unrecognised", "incomplete"]
    assert rows[2]["problem"].startswith(f"{root / 'step-2' / naming.COMMIT_FILE}: ")
    assert fastio_main(["ckpt", "ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "unrecognised" in lines[2] and "incomplete" in lines[3]


def test_a_later_save_of_a_skipped_step_does_not_replace_it(tmp_path, caplog):
    """Never delete data newer than the step restored: the damaged step-2 stays, also after step 2 is saved again."""
    root = tmp_path / "ck"
    save_steps(root)
    flip(biggest_file(root / "step-2"))
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(app).step == 1
        ckpt.save(2, app, blocking=True)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [
        "step-1", "step-2", "step-2.quarantined"]
    assert catalog.verify(root) == []


def test_an_explicit_older_step_keeps_newer_steps_when_saving_over_them(tmp_path):
    root = tmp_path / "ck"
    save_steps(root, (1, 2))
    first = (root / "step-2" / naming.COMMIT_FILE).read_text()
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(app, step=1).step == 1
        ckpt.save(2, app, blocking=True)  # the run goes on from step 1 and reaches step 2 again
    # the abandoned step 2: superseded (its marker renamed), then moved aside; every file kept
    assert (root / "step-2.quarantined" / rollback.SUPERSEDED_FILE).read_text() == first


def test_damaged_explicit_step_or_no_intact_step_is_an_error_and_moves_nothing(tmp_path, caplog):
    root = tmp_path / "ck"
    save_steps(root)
    flip(biggest_file(root / "step-1"))
    with pytest.raises(CheckpointError, match=rf"{root}/step-1: damaged checkpoint: {root}/step-1/.*: xxh3_128"):
        restore(root, caplog, step=1)
    flip(biggest_file(root / "step-2"))
    with pytest.raises(CheckpointError, match=rf"{root}: no intact checkpoint: 2 step director\(ies\) damaged or "
                                              rf"unrecognised, newest {root}/step-2: "):
        restore(root, caplog)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == ["step-1", "step-2"]


def test_restore_reads_old_sha256_commits(tmp_path, caplog):
    """Commit markers of version 1 (sha256 per file) still verify and restore; a flipped byte is still caught."""
    root = tmp_path / "ck"
    weights = save_steps(root, (1,))
    marker = root / "step-1" / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    data["version"] = 1
    data.pop("checksum")
    for rel, rec in data["files"].items():
        rec.pop("xxh3_128")
        rec["sha256"] = sha256_file(root / "step-1" / rel)[1]
    marker.write_text(json.dumps(data))
    assert catalog.verify(root) == []
    state, app, warned = restore(root, caplog)
    assert state.step == 1 and warned == []
    assert all(torch.equal(app["model"].state_dict()[k], v) for k, v in weights[1].items())
    victim = biggest_file(root / "step-1")
    flip(victim)
    assert [p.split(": ")[1].split()[0] for p in catalog.verify(root)] == ["sha256"]


# ---------------------------------------------------------------- one writer per directory
HOLDER = """
    import sys, time
    from fastio.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], signals=())
    print("holding", flush=True)
    time.sleep(600)
"""


def test_second_job_is_refused_and_a_dead_jobs_lock_does_not_block(tmp_path):
    root = tmp_path / "ck"
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(HOLDER))
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "777"})
    try:
        assert proc.stdout.readline().strip() == "holding"
        with pytest.raises(CheckpointError) as err:
            Checkpointer(root, signals=())
        msg = str(err.value)
        assert msg.startswith(f"{root}: in use by fastio checkpointer pid {proc.pid} on ") and "Slurm job 777" in msg
        assert "\n" not in msg
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    app = make_app()
    with Checkpointer(root, signals=()) as ckpt:  # the killed job's lock went with it (a Slurm requeue)
        ckpt.save(1, app, blocking=True)
    assert [e.step for e in scan.committed(root)] == [1]


def test_a_second_checkpointer_in_one_process_is_refused_until_the_first_closes(tmp_path):
    root = tmp_path / "ck"
    first = Checkpointer(root, signals=())
    with pytest.raises(CheckpointError, match=rf"{root}: in use by fastio checkpointer pid {os.getpid()}"):
        Checkpointer(root, signals=())
    first.close()
    Checkpointer(root, signals=()).close()


# ---------------------------------------------------------------- untrusted checkpoints
SENTINEL = Path(f"/tmp/fastio-test-pwned-{os.getpid()}")  # one per process: test runs side by side


class Payload:
    """A pickle that would create SENTINEL when unpickled without weights_only."""

    def __reduce__(self):
        return (os.system, (f"touch {SENTINEL}",))






@pytest.mark.parametrize("where", ["torchsnapshot", "dcp-rank-file", "dcp-metadata"])
def test_untrusted_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path, where):
    SENTINEL.unlink(missing_ok=True)
    root = tmp_path / "ck"
    engine = "torchsnapshot" if where == "torchsnapshot" else "dcp"
    with Checkpointer(root, engine=engine, signals=()) as ckpt:
        ckpt.save(1, {"model": nn.Linear(2, 2), "extra": StateHolder({"nothing": None})}, blocking=True)
    step = root / "step-1"
    if where == "torchsnapshot":
        victim = step / "0" / "extra" / "nothing"  # torchsnapshot writes None as a torch.save object file
        torch.save(Payload(), victim)
    elif where == "dcp-rank-file":
        victim = step / "rank-0" / "extra.pt"
        torch.save({"nothing": Payload()}, victim)
    else:
        import pickle

        victim = step / ".metadata"
        victim.write_bytes(pickle.dumps(Payload()))
    assert victim.is_file()
    reseal(step)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(root, signals=()).restore_latest({"model": nn.Linear(2, 2), "extra": StateHolder({})})
    msg = str(err.value)
    assert msg.startswith(f"{victim}: refused to load") and "\n" not in msg, msg
    assert not SENTINEL.exists()


# ---------------------------------------------------------------- CLI
def test_ckpt_verify_on_a_directory_that_is_not_a_checkpoint_directory_is_an_error(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("hello")
    assert fastio_main(["ckpt", "verify", str(tmp_path / "data")]) == 2
    assert f"fastio: error: {tmp_path / 'data'}: not a checkpoint directory" in capsys.readouterr().err
    Checkpointer(tmp_path / "fresh", signals=()).close()  # created by a Checkpointer, nothing saved yet: fine
    assert fastio_main(["ckpt", "verify", str(tmp_path / "fresh")]) == 0
    assert "0 committed checkpoints verified" in capsys.readouterr().out



def test_ckpt_commands_on_a_dataset_directory_say_it_is_a_dataset(image_folder, tmp_path, capsys):
    # Found by review: `fastio ckpt verify ds` (the dataset given for the checkpoint directory) said "0 committed
    # checkpoints verified (none)", exit 0, and `fastio ckpt ls ds` "no checkpoints": the lock file every dataset
    # writer leaves (.fastio-lock) was taken for a Checkpointer's.
    ds = tmp_path / "ds"
    assert fastio_main(["convert", str(image_folder), str(ds), "--split", "val=0.25", "-q"]) == 0
    assert (ds / ".fastio-lock").is_file()  # left by the conversion
    for command, folder, name in [(c, f, n) for c in ("ls", "verify")
                                  for f, n in ((ds, "splits.json"), (ds / "val", "manifest.json"))]:
        assert fastio_main(["ckpt", command, str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"fastio: error: {folder}: is a fastio dataset ({name}), not a checkpoint "
                              "directory"), err
        assert "\n" not in err


def test_ckpt_commands_on_a_file_or_a_step_directory_say_so(tmp_path, capsys):
    """A file given as the directory was 'checkpoint directory does not exist' (it exists); a step directory given
    to ``ls`` was 'no checkpoints' (exit 0), to ``verify`` 'not a checkpoint directory' without the way out."""
    (tmp_path / "afile").write_text("x")
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, {"t": StateHolder({"x": torch.ones(2)})}, blocking=True)
    for command in ("ls", "verify"):
        assert fastio_main(["ckpt", command, str(tmp_path / "afile")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"fastio: error: {tmp_path / 'afile'}: is a file, not a checkpoint directory", err
        assert fastio_main(["ckpt", command, ""]) == 2  # "$CKPT" unset: was the current directory ('.: no checkpoints')
        assert capsys.readouterr().err.strip() == "fastio: error: the checkpoint directory given is empty ('')"
        assert fastio_main(["ckpt", command, str(tmp_path / "ck" / "step-1")]) == 2
        assert capsys.readouterr().err.strip() == (
            f"fastio: error: {tmp_path / 'ck' / 'step-1'}: is one checkpoint (step 1), not a checkpoint directory: "
            f"give the directory holding it, {tmp_path / 'ck'}")


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs (mounting needs root: elsewhere the test says so and skips)."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_a_full_disk_is_named_and_the_previous_checkpoint_restores(small_disk, engine):
    """DCP's writer reported a full disk as torch's zip-writer error (``unexpected pos 704 vs 598``), without the
    errno, then with how little space is left but still naming no file: the message now names the file whose write
    failed and the OS's error, as torchsnapshot's does. Either engine keeps the last intact step."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)  # 4 MiB of weights, 12 MiB with Adam's state: two steps do not fit
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    app = {"model": model, "optim": optim}
    errors = []
    with Checkpointer(small_disk / "ck", keep=1, signals=(), engine=engine) as ckpt:
        for step in range(1, 4):
            with torch.no_grad():
                model.weight.fill_(step)
            try:
                ckpt.save(step, app, blocking=True)
            except CheckpointError as err:
                errors.append(str(err))
    assert errors and all("No space left on device" in e or "free: full?" in e for e in errors), errors
    if engine == "dcp":  # the file DCP could not write, named (was torch's 'unexpected pos 704 vs 598', no file)
        assert all(re.search(rf"checkpoint write failed: {re.escape(str(small_disk))}/ck/step-\d+\.tmp/\S+: No space "
                             r"left on device \(the previous checkpoint is intact\)$", e) for e in errors), errors
    fresh = {"model": nn.Linear(1024, 1024)}
    fresh["optim"] = torch.optim.Adam(fresh["model"].parameters())
    with Checkpointer(small_disk / "ck", signals=()) as ckpt:
        state = ckpt.restore_latest(fresh)
    assert float(fresh["model"].weight[0, 0]) == state.step


def _reads_back(monkeypatch) -> list[str]:
    """The files the commit reads back to checksum them, from now on."""
    from fastio.checkpoint import publish

    read: list[str] = []
    real = publish.digest_fd

    def spy(fd: int, algo: str) -> tuple[int, str]:
        read.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, algo)

    monkeypatch.setattr(publish, "digest_fd", spy)
    return read


def test_the_commit_records_the_checksums_taken_while_writing_and_reads_back_only_what_it_must(tmp_path, engine,
                                                                                                 monkeypatch):
    """Both engines hash each file from the bytes they write (torchsnapshot's storage plugin, DCP's file system, the
    per-rank files and the sidecar), so the commit reads none of them back (it read all of them: a GiB read per GiB
    written, ~0.1 s of CPU per GiB on the writer's core, and the time); the records are the files' own checksums
    all the same, and the checkpoint restores."""
    read = _reads_back(monkeypatch)
    app = make_app()
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
    entry = scan.committed(tmp_path / "ck")[0]
    for rel, rec in entry.commit.files.items():
        assert digest_file(entry.path / rel, "xxh3_128") == (rec["bytes"], rec["xxh3_128"])
    assert read == []
    assert len(entry.commit.files) >= 3  # the engine's data, its metadata, the RNG record
    fresh = make_app(seed=1)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        assert ckpt.restore_latest(fresh).step == 1
    assert all(torch.equal(a, b) for a, b in zip(app["model"].state_dict().values(),
                                                 fresh["model"].state_dict().values()))


def test_a_file_unlike_the_engines_record_of_it_is_read_back(tmp_path, monkeypatch):
    """A record the commit cannot trust (another size than the file's, another checksum) is not used: the file is
    read back and its own checksum recorded."""
    from fastio.checkpoint import publish

    read = _reads_back(monkeypatch)
    tmp, final = publish.start_tmp(tmp_path, 1), tmp_path / "step-1"
    (tmp / "a").write_bytes(b"abc")
    (tmp / "b").write_bytes(b"defg")
    (tmp / "c").write_bytes(b"hij")
    info = record.CommitInfo(engine="torchsnapshot", progress=record.Progress())
    known = {"a": {"bytes": 99, "xxh3_128": "0" * 32}, "b": {"bytes": 4, "sha256": "0" * 64},
             "c": {"bytes": 3, "xxh3_128": digest_file(tmp / "c", "xxh3_128")[1]}}
    done = publish.commit(tmp, final, step=1, info=info, known=known)
    assert sorted(os.path.basename(p) for p in read) == ["a", "b"]
    assert {rel: (r["bytes"], r["xxh3_128"]) for rel, r in done.files.items()} == {
        rel: digest_file(final / rel, "xxh3_128") for rel in ("a", "b", "c")}
