"""A rollback (restore_latest(step=S), then saves from there) supersedes the whole abandoned branch, crash-safely,
on disk and on s3:// (moto): a fallback or a relaunch never resumes an abandoned step.

Each step's state is tagged with its branch and step (``tag``), so a restore shows which checkpoint it loaded.
Kills are real: a child process exits with ``os._exit`` at a chosen point inside the first commit after the
rollback (the function there replaced, in that process only, by one that exits)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import StateHolder, free_port, spawn_ranks

from fastio.checkpoint import Checkpointer, catalog, group, naming, rollback, scan
from fastio.errors import CheckpointError
from fastio.storage import open_storage

REPO = Path(__file__).resolve().parents[1]


def app_at(tag: float) -> dict:
    return {"model": StateHolder({"w": torch.full((4,), float(tag))})}


def tag_of(app: dict) -> float:
    return float(app["model"].state["w"][0])


def save_branch(ckpt: Checkpointer, steps, offset: float = 0.0) -> None:
    for step in steps:
        ckpt.save(step, app_at(offset + step), blocking=True)


def states(where, options=None) -> dict[int, str]:
    """``{step: state}`` of ``fastio ckpt ls`` (a quarantined step beside one of the same number left out)."""
    rows = catalog.list_steps(str(where), options)[1]
    return {r["step"]: r["state"] for r in rows if r["state"] != "quarantined"}


def damage(path: Path) -> None:
    """Flip a byte of the biggest file of a committed step directory."""
    victim = max((p for p in path.rglob("*") if p.is_file() and p.name != naming.COMMIT_FILE),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_a_fallback_after_a_rollback_never_reaches_the_abandoned_branch(tmp_path):
    """Steps 1..6, restore step 2, save 5: old steps 3 and 4 stayed committed, and with the new step 5 damaged
    the restore fell back to the abandoned step 4. Now every step above 2 is superseded by the first commit."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        save_branch(ckpt, range(1, 7))
    with Checkpointer(root, signals=()) as ckpt:
        app = app_at(-1)
        assert ckpt.restore_latest(app, step=2).step == 2 and tag_of(app) == 2
        save_branch(ckpt, [5], offset=100)
        assert ckpt.steps() == [1, 2, 5]
    assert states(root) == {1: "committed", 2: "committed", 3: "superseded", 4: "superseded", 5: "committed",
                            6: "superseded"} and not (root / rollback.ROLLBACK_FILE).exists()
    assert (root / "step-5.quarantined" / rollback.SUPERSEDED_FILE).is_file()  # the old step 5: moved aside, kept
    damage(root / "step-5")
    app = app_at(-1)
    assert Checkpointer(root, signals=()).restore_latest(app).step == 2 and tag_of(app) == 2


KILLED = """
    import json, os, sys
    import torch
    sys.path.insert(0, "tests")
    from helpers import StateHolder
    from fastio.checkpoint import Checkpointer, publish, rollback

    where, at, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    kw = {"storage_options": options, "staging_dir": sys.argv[4]} if options else {}
    app = {"model": StateHolder({"w": torch.zeros(4)})}
    ckpt = Checkpointer(where, signals=(), **kw)
    assert ckpt.restore_latest(app, step=2).step == 2
    real, calls = rollback.supersede, []

    def supersede(path):  # the first one done, then killed: a rollback cut short
        real(path)
        calls.append(path)
        if at == "supersede":
            os._exit(9)

    def commit(*args, **kwargs):  # every abandoned step superseded, the new step not yet published
        os._exit(9)

    rollback.supersede = supersede
    if at == "commit":
        publish.commit = commit
    if at == "local":  # s3://: the store's record written, the local supersede not begun
        rollback.finish_rollback = commit
    app["model"].state = {"w": torch.full((4,), 105.0)}
    ckpt.save(5, app, blocking=True)
    print("not killed")
"""


def kill_in_first_commit(warm, where: str, at: str, tmp_path: Path, options: dict | None = None) -> None:
    """``KILLED`` in another process (from conftest's warm interpreter: torch already imported)."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    rc, out, err = warm.run(script, REPO, where, at, json.dumps(options or {}), str(tmp_path / "staging-killed"),
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rc == 9, out + err


@pytest.mark.parametrize("at", ["supersede", "commit"])
def test_a_kill_inside_the_first_commit_after_a_rollback_resumes_the_rollback_point(tmp_path, at, warm):
    """Killed after the first step of the abandoned branch was superseded, or after all of them but before the
    new step was committed: a relaunch restored the abandoned step 4 (or 6, 5). Now it restores step 2, and
    finishes superseding the branch."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        save_branch(ckpt, range(1, 7))
    kill_in_first_commit(warm, str(root), at, tmp_path)
    assert states(root)[4] == "superseded"
    app = app_at(-1)
    with Checkpointer(root, signals=()) as ckpt:
        assert ckpt.restore_latest(app).step == 2 and tag_of(app) == 2
        assert not (root / rollback.ROLLBACK_FILE).exists()  # the relaunch finished the rollback
        assert all((root / f"step-{s}" / rollback.SUPERSEDED_FILE).is_file() for s in (3, 4, 5, 6))
        save_branch(ckpt, [3], offset=200)
    assert {s: v for s, v in states(root).items() if v == "committed"} == {1: "committed", 2: "committed",
                                                                           3: "committed"}
    assert catalog.verify(root) == []


def test_a_rollback_record_hides_its_steps_from_every_reader(tmp_path):
    """While fastio-rollback.json lists steps (a kill cut the rollback short), no reader counts them: ls shows
    them superseded, verify skips them, a restore picks the rollback point."""
    root = tmp_path / "ck"
    with Checkpointer(root, signals=()) as ckpt:
        save_branch(ckpt, range(1, 4))
    assert rollback.start_rollback(root, 1, [e.step for e in scan.committed(root)]) == [2, 3]
    assert states(root) == {1: "committed", 2: "superseded", 3: "superseded"}
    assert catalog.verify_report(root).steps == [1]
    (root / rollback.ROLLBACK_FILE).write_text("{}")
    with pytest.raises(Exception, match="fastio-rollback.json: not a fastio rollback record"):
        scan.scan(root)


# ---------------------------------------------------------------- s3://
def test_a_rollback_on_s3_supersedes_the_whole_abandoned_branch(moto_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()

    def checkpointer(staging: str) -> Checkpointer:
        return Checkpointer(url, storage_options=options, staging_dir=tmp_path / staging, signals=())

    with checkpointer("a") as ckpt:
        save_branch(ckpt, range(1, 7))
    with checkpointer("b") as ckpt:  # another node: nothing of the first run staged here
        app = app_at(-1)
        assert ckpt.restore_latest(app, step=2).step == 2 and tag_of(app) == 2
        save_branch(ckpt, [5], offset=100)
        assert ckpt.steps() == [1, 2, 5]
    assert states(url, options) == {1: "committed", 2: "committed", 3: "superseded", 4: "superseded",
                                    5: "committed", 6: "superseded"}
    store = open_storage(url, options)
    assert store.head(rollback.ROLLBACK_FILE) is None
    # the old step 5 was moved aside, not written over (its marker stayed beside the new one: verify failed)
    assert store.head(f"step-5.quarantined/{rollback.SUPERSEDED_FILE}") is not None
    assert store.head(f"step-5/{rollback.SUPERSEDED_FILE}") is None
    assert "quarantined" in {r["state"] for r in catalog.list_steps(url, options)[1] if r["step"] == 5}
    assert catalog.verify_steps(url, storage_options=options)[1].problems == []
    key = next(o.key for o in store.list("step-5/") if not o.key.endswith(".json") and o.size > 0)
    data = bytearray(store.get(key))
    data[0] ^= 0xFF
    store.put_bytes(key, bytes(data))  # the new step 5 damaged on the store
    app = app_at(-1)
    with checkpointer("c") as ckpt:
        assert ckpt.restore_latest(app).step == 2 and tag_of(app) == 2
        save_branch(ckpt, [5], offset=300)  # the damaged step 5 superseded, and moved aside beside the first one
    assert store.head(f"step-5.quarantined-2/{rollback.SUPERSEDED_FILE}") is not None
    assert store.head(f"step-5.quarantined/{rollback.SUPERSEDED_FILE}") is not None
    assert catalog.verify_steps(url, storage_options=options)[1].problems == []


@pytest.mark.parametrize("at", ["local", "commit"])
def test_a_kill_inside_the_first_commit_after_a_rollback_on_s3_resumes_the_rollback_point(
        moto_server, s3_bucket, tmp_path, at, warm):
    """Killed with the store's rollback record written and nothing superseded yet, or with everything superseded
    and the new step not committed: a relaunch (on another node, and on the killed one) restores step 2."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "a", signals=()) as ckpt:
        save_branch(ckpt, range(1, 7))
    kill_in_first_commit(warm, url, at, tmp_path, options)
    assert {s: v for s, v in states(url, options).items() if v == "committed"} == {1: "committed", 2: "committed"}
    for staging in ("c", "staging-killed"):
        app = app_at(-1)
        with Checkpointer(url, storage_options=options, staging_dir=tmp_path / staging, signals=()) as ckpt:
            assert ckpt.restore_latest(app).step == 2 and tag_of(app) == 2


def test_a_step_committed_here_whose_upload_failed_stays_on_the_branch_and_reaches_the_store(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """A run restores step 5 and commits step 6 here, but the store refuses the upload: the save fails. Step 6 is
    on the run's own branch, yet the next commit (step 8) took it for the abandoned branch of a rollback to step 5
    and superseded it: the store then held step-5 and step-8 and no step-6, although retention (keep=2) keeps
    steps 6 and 8. Now the first commit after the restore ends the rollback, failed upload or not."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, backoff_s=0.01)

    def checkpointer(staging: str) -> Checkpointer:
        return Checkpointer(url, keep=2, storage_options=options, staging_dir=tmp_path / staging, signals=())

    with checkpointer("a") as ckpt:
        save_branch(ckpt, [4, 5])
    with checkpointer("b") as ckpt:
        app = app_at(-1)
        assert ckpt.restore_latest(app).step == 5 and tag_of(app) == 5
        fault_proxy.forbidden.add("step-6")  # the store refuses step 6's objects
        with pytest.raises(CheckpointError, match="step-6: .*403"):
            save_branch(ckpt, [6])
        fault_proxy.forbidden.clear()
        save_branch(ckpt, [8])
        assert ckpt.steps() == [6, 8]
    assert states(url, options) == {6: "committed", 8: "committed"}
    with checkpointer("c") as ckpt:  # another node: from the store
        app = app_at(-1)
        assert ckpt.restore_latest(app, step=6).step == 6 and tag_of(app) == 6


def _commit_fails_elsewhere(rank: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen = {}
    with Checkpointer(root, keep=2, signals=()) as ckpt:
        save_branch(ckpt, [4, 5])
        seen["restored"] = ckpt.restore_latest(app_at(-1)).step

        def hook(_group: str, phase: str) -> None:
            if phase == "commit" and rank == 1:  # after rank 0 has published step 6
                raise RuntimeError("injected fault in commit")
        group.fault_hook = hook
        try:
            save_branch(ckpt, [6])
        except CheckpointError as err:
            seen["failed"] = str(err)
        group.fault_hook = None
        save_branch(ckpt, [8])
        seen["steps"] = ckpt.steps()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo teardown can abort at interpreter exit; the result is in the file


def test_a_step_published_in_a_commit_another_rank_failed_stays_on_the_branch(tmp_path):
    """The same on disk with 2 ranks: rank 0 publishes step 6 after a restore of step 5, rank 1 fails in that
    commit phase, so the save fails on both; step 8's commit then superseded step 6 (step-5 and step-8 left)."""
    port, root = free_port(), tmp_path / "ck"
    spawn_ranks(_commit_fails_elsewhere, lambda r: (r, port, str(root), str(tmp_path)), 2, timeout=120)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["restored"] == 5 and "injected fault in commit" in seen["failed"]
        assert seen["steps"] == [6, 8], seen
    assert states(root) == {6: "committed", 8: "committed"}



def test_a_lower_step_saved_without_a_restore_is_warned_as_such(tmp_path, caplog):
    """A run started without restore_latest beside an older run's steps supersedes them at its first commit. The
    warning said 'committing step 5 after a rollback to step 5', though nothing was rolled back; it now says that
    this Checkpointer restored nothing, so the forgotten restore is found."""
    app = {"t": StateHolder({"x": torch.ones(2)})}
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt:
        ckpt.save(10, app, blocking=True)
    with Checkpointer(tmp_path / "ck", signals=()) as ckpt, caplog.at_level("WARNING", logger="fastio"):
        ckpt.save(5, app, blocking=True)
        assert ckpt.steps() == [5]
    lines = [r.getMessage() for r in caplog.records if "superseded" in r.getMessage()]
    assert lines == [f"fastio: {tmp_path / 'ck'}: committing step 5 below committed steps this Checkpointer did not "
                     "restore (started without restore_latest?): step 10 superseded (files kept, no longer "
                     "checkpoints)"], lines
    assert (tmp_path / "ck" / "step-10" / rollback.SUPERSEDED_FILE).is_file()  # kept, no longer a checkpoint
