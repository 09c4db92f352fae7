"""Checkpointer with an s3:// dir, against a real S3 server (moto) behind a fault-injecting proxy."""

from __future__ import annotations

import dataclasses
import http.client
import json
import urllib.parse
from collections import Counter

import pytest
import torch
from helpers import run_cli
from torch import nn

from fastio.checkpoint import Checkpointer, catalog, naming
from fastio.errors import CheckpointError
from fastio.storage import open_storage
from fastio.storage.options import StorageOptions


def make_app(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=1e-2)}


def train_step(app):
    loss = app["model"](torch.randn(8, 32)).square().mean()
    app["optim"].zero_grad()
    loss.backward()
    app["optim"].step()


def same_state(a, b) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa) and torch.equal(
        a["optim"].state_dict()["state"][0]["exp_avg"], b["optim"].state_dict()["state"][0]["exp_avg"])


def test_checkpoints_round_trip_through_s3_with_faults(moto_server, s3_bucket, fault_proxy, tmp_path):
    # 3 in 10 tries of a request answer 503 SlowDown, and every other try of a file's GET a body cut short, for 2 tries
    # of each request at most: both faults happen however few files a step has (slabs make them few)
    fault_proxy.slowdown, fault_proxy.cut = 0.3, 0.7
    url = f"s3://{s3_bucket}/runs/r1/ckpt"
    options = moto_server.options(fault_proxy.endpoint, backoff_s=0.01)
    app = make_app()
    with Checkpointer(url, every_steps=1, keep=2, storage_options=options, staging_dir=tmp_path / "node1",
                      signals=()) as ckpt:
        assert ckpt.config.url == url and ckpt.dir == tmp_path / "node1"
        for step in range(1, 5):
            train_step(app)
            ckpt.maybe_save(step, app, metrics={"loss": float(step)})
            ckpt.wait()
        assert ckpt.steps() == [3, 4]  # retention on the store: committed older steps deleted
    store = open_storage(url, moto_server.options())
    keys = [o.key for o in store.list()]
    assert {k.split("/")[0] for k in keys} == {"step-3", "step-4"} and "step-4/fastio-commit.json" in keys
    # a fresh node: nothing staged locally, the newest step comes from the store, verified, restored exactly
    fresh = make_app(seed=1)
    assert not same_state(fresh, app)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "node2", signals=()) as ckpt:
        state = ckpt.restore_latest(fresh)
    assert state.step == 4 and state.metrics == {"loss": 4.0} and same_state(fresh, app)
    assert fault_proxy.counts["slowdown"] > 0 and fault_proxy.counts["cut"] > 0


def test_restore_falls_back_when_the_newest_remote_step_does_not_verify(moto_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    app = make_app()
    states = {}
    with Checkpointer(url, every_steps=1, storage_options=options, staging_dir=tmp_path / "a", signals=()) as ckpt:
        for step in (1, 2):
            train_step(app)
            ckpt.maybe_save(step, app)
            ckpt.wait()
            states[step] = {k: v.clone() for k, v in app["model"].state_dict().items()}
    store = open_storage(url, options)
    victim = next(o for o in store.list("step-2/") if not o.key.endswith(naming.COMMIT_FILE) and o.size > 100)
    data = bytearray(store.get(victim.key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(victim.key, bytes(data))
    # an upload cut short (files but no commit marker) is not a checkpoint
    store.put_bytes("step-3/0/model", b"partial")
    fresh = make_app(seed=5)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "b", signals=()) as ckpt:
        assert ckpt.steps() == [1, 2]
        state = ckpt.restore_latest(fresh)
    assert state.step == 1
    assert all(torch.equal(fresh["model"].state_dict()[k], states[1][k]) for k in states[1])
    assert not (tmp_path / "b" / "step-2").exists()


def test_ckpt_ls_and_verify_read_an_s3_prefix_without_changing_it(moto_server, s3_bucket, aws_env, tmp_path,
                                                                  capsys):
    url = f"s3://{s3_bucket}/runs/r2/ckpt"
    app = make_app()
    with Checkpointer(url, every_steps=1, staging_dir=tmp_path / "stage", signals=(), compression="zstd") as ckpt:
        for step in (1, 2):
            train_step(app)
            ckpt.maybe_save(step, app, metrics={"loss": 0.5 * step})
            ckpt.wait()
    store = open_storage(url)
    store.put_bytes("step-3/0/model", b"partial")  # an upload cut short: no commit marker
    before = {o.key: o.size for o in store.list()}
    code, out, err = run_cli(["ckpt", "ls", url], capsys)
    lines = out.splitlines()
    assert code == 0 and err == "" and len(lines) == 4, out
    assert lines[1].split()[:3] == ["1", "committed", "torchsnapshot+zstd"] and "loss=1" in lines[2]
    assert lines[3].split()[:2] == ["3", "incomplete"]
    code, out, _ = run_cli(["ckpt", "ls", url, "--json"], capsys)
    rows = json.loads(out)["checkpoints"]
    assert json.loads(out)["dir"] == url and [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["path"] == f"{url}/step-2" and rows[1]["metrics"] == {"loss": 1.0} and rows[1]["files"] > 3
    code, out, _ = run_cli(["ckpt", "verify", url], capsys)
    assert code == 0 and out == f"{url}: 2 committed checkpoints verified (step 1, step 2)\n"
    code, out, _ = run_cli(["ckpt", "verify", url, "--all"], capsys)
    assert code == 1 and out == f"{url}/step-3: no fastio-commit.json (an upload in progress, or one that failed)\n"
    victim = next(k for k, n in before.items() if k.startswith("step-2/") and n > 100
                  and not k.endswith(naming.COMMIT_FILE))
    data = bytearray(store.get(victim))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(victim, bytes(data))
    code, out, _ = run_cli(["ckpt", "verify", url], capsys)
    assert code == 1 and out.startswith(f"{url}/step-2/{victim.split('/', 1)[1]}") and "step-1" not in out, out
    assert {o.key: o.size for o in store.list()} == before  # verify and ls changed nothing on the store
    code, _, err = run_cli(["ckpt", "verify", f"s3://{s3_bucket}/nothing"], capsys)
    assert code == 2 and err == f"fastio: error: s3://{s3_bucket}/nothing: not a checkpoint prefix (no step-N/, " \
                                "no .fastio-lock)\n"


def test_leftovers_of_a_killed_retention_are_removed_by_the_next_commit(moto_server, s3_bucket, tmp_path):
    """Issue 19.9: retention deletes a step's marker first, then its files; a kill in between leaves
    ``step-N/`` objects (``fastio-writing.json`` among them) that are no checkpoint. The lease holder's next
    commit removes those of steps older than the newest committed one, and nothing else."""
    url = f"s3://{s3_bucket}/ckpt"
    store = open_storage(url, moto_server.options())
    app = make_app()
    with Checkpointer(url, keep=1, storage_options=moto_server.options(), staging_dir=tmp_path / "s",
                      signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
        kept = {o.key: store.get(o.key) for o in store.list() if o.key.startswith("step-1/")}
        ckpt.save(2, app, blocking=True)
    assert "step-1/fastio-writing.json" in kept
    for key, data in kept.items():  # what a kill during the retention of step 1 leaves: all but the marker
        if not key.endswith("fastio-commit.json"):
            store.put_bytes(key, data)
    store.put_bytes("step-7/model.bin", b"an upload of a newer step, not finished")  # newer: not touched
    rows = catalog.list_steps(url, moto_server.options())[1]
    assert [(r["step"], r["committed"]) for r in rows] == [(1, False), (2, True), (7, False)]
    with Checkpointer(url, keep=1, storage_options=moto_server.options(), staging_dir=tmp_path / "s",
                      signals=()) as ckpt:
        ckpt.save(3, app, blocking=True)
        assert ckpt.steps() == [3]
    keys = {o.key.split("/")[0] for o in store.list()}
    assert keys - {".fastio-lock"} == {"step-3", "step-7"}


def test_a_rollback_on_s3_supersedes_the_abandoned_branch_keeping_its_objects(moto_server, s3_bucket, tmp_path):
    """As on disk (test_checkpoint.py): after restore_latest(step=20) with step 30 on the store, the save of
    step 21 supersedes step 30 (its marker becomes fastio-superseded.json, its objects stay, also when the
    new branch passes step 30) instead of retention deleting the new branch; a relaunch restores step 21."""
    url = f"s3://{s3_bucket}/ckpt"
    store = open_storage(url, moto_server.options())

    def checkpointer(keep: int, staging: str) -> Checkpointer:
        return Checkpointer(url, keep=keep, storage_options=moto_server.options(), staging_dir=tmp_path / staging,
                            signals=())

    app = make_app()
    with checkpointer(0, "a") as ckpt:
        ckpt.save(20, app, blocking=True)
        train_step(app)
        ckpt.save(30, app, blocking=True)
    abandoned = {o.key: store.get(o.key) for o in store.list() if o.key.startswith("step-30/")}
    branch = make_app(seed=1)
    with checkpointer(1, "b") as ckpt:  # another node: nothing of the first run staged here
        assert ckpt.restore_latest(branch, step=20).step == 20
        train_step(branch)
        ckpt.save(21, branch, blocking=True)
        assert ckpt.steps() == [21]
        ckpt.save(31, branch, blocking=True)  # past the abandoned step: its objects are still kept
        assert ckpt.steps() == [31]
    rows = {r["step"]: r["state"] for r in catalog.list_steps(url, moto_server.options())[1]}
    assert rows == {30: "superseded", 31: "committed"}
    now = {o.key: store.get(o.key) for o in store.list() if o.key.startswith("step-30/")}
    marker = abandoned.pop("step-30/fastio-commit.json")
    assert now.pop("step-30/fastio-superseded.json") == marker and now == abandoned
    relaunched = make_app(seed=2)
    with checkpointer(1, "c") as ckpt:
        assert ckpt.restore_latest(relaunched).step == 31
    assert same_state(relaunched, branch)


def test_a_damaged_step_on_the_store_costs_no_disk_at_each_restart(moto_server, s3_bucket, tmp_path, caplog):
    """Before: each restore into the same staging dir downloaded the damaged newest step again and moved that download
    aside (step-2.quarantined, -2, -3...): a job requeued N times kept N full copies of a checkpoint on the node's
    disk. A download is not the only copy (the store keeps it, for the rollback of the next commit to move aside):
    it is removed, and the warning names the store's copy."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    app = make_app()
    with Checkpointer(url, every_steps=1, storage_options=options, staging_dir=tmp_path / "a", signals=()) as ckpt:
        for step in (1, 2):
            train_step(app)
            ckpt.maybe_save(step, app)
            ckpt.wait()
    store = open_storage(url, options)
    victim = next(o for o in store.list("step-2/") if not o.key.endswith(naming.COMMIT_FILE) and o.size > 100)
    data = bytearray(store.get(victim.key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(victim.key, bytes(data))
    before = {o.key: o.size for o in store.list()}
    for _ in range(3):
        caplog.clear()
        with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "b", signals=()) as ckpt:
            assert ckpt.restore_latest(make_app(seed=5)).step == 1
        said = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
        assert len(said) == 1 and said[0].endswith(f"; the download of {url}/step-2 removed (the store keeps it)"), said
        assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("step-")) == ["step-1"]
    assert {o.key: o.size for o in store.list() if o.key != ".fastio-lock"} == before
    # a step committed in the staging dir (not a download: perhaps the only copy) is still moved aside, never deleted
    local = tmp_path / "a" / victim.key
    local.write_bytes(local.read_bytes()[:-1])
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "a", signals=()) as ckpt:
        assert ckpt.restore_latest(make_app(seed=5)).step == 1
    assert (tmp_path / "a" / "step-2.quarantined" / victim.key.split("/", 1)[1]).is_file()


def _two_steps(url: str, options: dict, staging) -> tuple[dict, str]:
    """Steps 1 and 2 saved to ``url``; the app, and the key of a file of step 2 (not its marker)."""
    app = make_app()
    with Checkpointer(url, every_steps=1, storage_options=options, staging_dir=staging, signals=()) as ckpt:
        for step in (1, 2):
            train_step(app)
            ckpt.maybe_save(step, app)
            ckpt.wait()
    keys = [o for o in open_storage(url, options).list("step-2/") if not o.key.endswith(naming.COMMIT_FILE)]
    return app, max(keys, key=lambda o: o.size).key


def test_a_store_that_fails_while_the_newest_step_downloads_fails_the_restore(moto_server, s3_bucket, fault_proxy,
                                                                            tmp_path, caplog):
    """Before: an outage (503 past deadline_s) while the newest step downloaded was taken for damage: restore_latest
    fell back to step 1 without a word, and the next commit superseded the intact step 2 (moved aside on the store,
    no checkpoint any more): progress lost to a network blip. Now a step that could not be read fails the restore,
    naming its URL, and nothing is superseded. An object listed and then gone (404: retention racing a read-only
    restore) is damage: that step is skipped, with the one warning every skipped step gets, naming the object."""
    url = f"s3://{s3_bucket}/ckpt"
    app, victim = _two_steps(url, moto_server.options(), tmp_path / "a")
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    fault_proxy.down = {f"/ckpt/{victim}"}
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "b", signals=()) as ckpt:
        with pytest.raises(CheckpointError, match=rf"^{url}/step-2: cannot be downloaded: {url}/{victim}: GET failed "
                                                  r"after \d+ attempts in .*deadline_s=1"):
            ckpt.restore_latest(make_app(seed=5))
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(("step-", ".step-"))]
    assert naming.COMMIT_FILE in {o.key.split("/")[-1] for o in open_storage(url, options).list("step-2/")}
    fault_proxy.down, fault_proxy.gone = set(), {f"/ckpt/{victim}"}
    caplog.clear()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "c", signals=(), read_only=True) as ckpt:
        assert ckpt.restore_latest(make_app(seed=5)).step == 1
    said = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(said) == 1 and f"{url}/{victim}: GET failed: not found" in said[0], said


def test_ckpt_verify_that_cannot_read_a_step_says_so_and_calls_nothing_damaged(moto_server, s3_bucket, aws_env,
                                                                               fault_proxy, tmp_path, capsys,
                                                                               monkeypatch):
    """Before: `fastio ckpt verify s3://...` whose temporary folder could not hold a file of a step (the file size
    limit here, a quota-free stand-in for a full disk) died with a raw OSError traceback from the download; and one
    whose store failed past deadline_s while it downloaded a step reported that step as damaged (exit 1), an
    intact checkpoint someone might then delete. Every download (Storage.get_to_file) now names the object and the
    folder in a StorageError, and a step that could not be read is 'cannot be verified': one line, exit 2."""
    import resource
    import signal

    url = f"s3://{s3_bucket}/ckpt"
    _, victim = _two_steps(url, moto_server.options(), tmp_path / "a")
    size = open_storage(url, moto_server.options()).head(victim)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
    try:
        code, out, err = run_cli(["ckpt", "verify", url], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (out, err)
    assert err.startswith(f"fastio: error: {url}/step-1: cannot be verified: {url}/step-1/") and \
        ": cannot download into " in err and err.endswith(": File too large\n"), err
    resolve = StorageOptions.resolve.__func__  # a 1 s deadline: the same retries and error, 119 s sooner
    monkeypatch.setattr(StorageOptions, "resolve", classmethod(
        lambda cls, overrides=None, env=None: dataclasses.replace(resolve(cls, overrides, env), deadline_s=1.0)))
    fault_proxy.down = {f"/ckpt/{victim}"}
    code, out, err = run_cli(["ckpt", "verify", url, "--endpoint-url", fault_proxy.endpoint], capsys)
    assert code == 2 and err.count("\n") == 1 and "damaged" not in out + err, (out, err)
    assert err.startswith(f"fastio: error: {url}/step-2: cannot be verified: {url}/{victim}: GET failed after "), err


def test_a_url_given_as_staging_dir_is_refused_by_name(moto_server, s3_bucket, tmp_path, monkeypatch):
    """Before: Checkpointer(url, staging_dir='s3://...') was refused as 's3:/bucket/stage: looks like a URL passed as
    a Path (pass URLs as str)', though a str was passed, and staging_dir='file:///abs/path' the same way. Now the
    message names staging_dir and what it takes, and a file:// URL is its path (the rule cache_dir follows)."""
    from fastio.errors import StorageError

    url = f"s3://{s3_bucket}/ckpt"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match=rf"^staging_dir s3://{s3_bucket}/stage: must be a local directory \(a "
                                           r"path, or file:///absolute/path\), not a URL$"):
        Checkpointer(url, storage_options=moto_server.options(), staging_dir=f"s3://{s3_bucket}/stage", signals=())
    with Checkpointer(url, storage_options=moto_server.options(), staging_dir=f"file://{tmp_path}/stage",
                      signals=()) as ckpt:
        assert ckpt.dir == tmp_path / "stage"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(":")]


def test_a_staging_dir_of_another_url_is_refused_not_restored_from(moto_server, s3_bucket, tmp_path):
    """Before: a staging_dir reused for another s3:// prefix handed that run's steps over as this one's:
    Checkpointer('s3://b/runB', staging_dir=S).restore_latest() restored run A's step 2 (steps() said []), and its
    next commit 'rolled back' from it. Now a staging dir records the URL it stages, and another URL is refused
    naming both; the first URL still uses it."""
    from fastio.errors import CheckpointError

    options, stage = moto_server.options(), tmp_path / "stage"
    run_a, run_b = f"s3://{s3_bucket}/runA", f"s3://{s3_bucket}/runB"
    _two_steps(run_a, options, stage)
    refused = (rf"^{run_b}: staging_dir {stage} stages the checkpoints of {run_a}; its steps would be restored and "
               r"uploaded as this prefix's: give another staging_dir$")
    for read_only in (False, True):
        with pytest.raises(CheckpointError, match=refused):
            Checkpointer(run_b, storage_options=options, staging_dir=stage, signals=(), read_only=read_only)
    assert open_storage(run_b, options).list() == []
    with Checkpointer(f"{run_a}/", storage_options=options, staging_dir=stage, signals=()) as ckpt:
        assert ckpt.restore_latest(make_app(seed=3)).step == 2


def test_a_staging_dir_of_an_older_fastio_holding_steps_the_store_lacks_is_refused(moto_server, s3_bucket, tmp_path):
    """Before: a staging dir without its record (written by a fastio from before the record) was adopted for any
    prefix unchecked: Checkpointer('s3://b/runB', staging_dir=S) with S holding run A's committed steps restored run
    A's step 2 as runB's, and its next commit uploaded run A's steps to runB. Now such a dir is checked against the
    store first: committed steps the store lacks are refused, naming them and how to clear them, for a writer and a
    read-only restore alike, and nothing is recorded or uploaded; one whose steps the store holds is adopted."""
    from fastio.checkpoint.remote import STAGING_RECORD

    options, stage = moto_server.options(), tmp_path / "stage"
    run_a, run_b = f"s3://{s3_bucket}/runA", f"s3://{s3_bucket}/runB"
    _two_steps(run_a, options, stage)
    (stage / STAGING_RECORD).unlink()  # as an older fastio left it
    refused = (rf"^{run_b}: staging_dir {stage} records no prefix \(a staging dir of an older fastio\) and holds "
               rf"committed step-1, step-2, which {run_b} lacks: .*move them out of {stage}")
    for read_only in (True, False):
        with pytest.raises(CheckpointError, match=refused):
            Checkpointer(run_b, storage_options=options, staging_dir=stage, signals=(), read_only=read_only)
    assert open_storage(run_b, options).list() == [] and not (stage / STAGING_RECORD).exists()
    with Checkpointer(run_a, storage_options=options, staging_dir=stage, signals=()) as ckpt:  # the store holds them
        assert ckpt.restore_latest(make_app(seed=3)).step == 2
    assert json.loads((stage / STAGING_RECORD).read_text()) == {"url": run_a}


def _three_steps_staged_in_a(s3_bucket, moto_server, tmp_path):
    """(url, options, app): node A, staging dir ``tmp_path/A``, has saved and committed steps 1-3 of the app."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options()
    first = make_app()
    with Checkpointer(url, every_steps=1, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        for step in (1, 2, 3):
            train_step(first)
            ckpt.save(step, first, blocking=True)
    return url, options, first


def test_a_staging_dir_holding_a_step_the_store_replaced_restores_the_stores(moto_server, s3_bucket, tmp_path,
                                                                           caplog):
    """Before: node A staged steps 1-3; the job, requeued on node B, rolled back to step 2 and committed a new step 3
    (the old one superseded and moved aside on the store); requeued on node A again, restore_latest() restored A's
    local copy of the abandoned step 3 - weights of a branch the run had given up - because a step committed in the
    staging dir was used without asking the store. Now a local step whose commit marker is not the store's is moved
    aside (one warning) and the store's downloaded; one the store marks superseded is skipped."""
    url, options, first = _three_steps_staged_in_a(s3_bucket, moto_server, tmp_path)
    branch = make_app(seed=7)
    with Checkpointer(url, every_steps=1, storage_options=options, staging_dir=tmp_path / "B", signals=()) as ckpt:
        assert ckpt.restore_latest(branch, step=2).step == 2
        train_step(branch)
        train_step(branch)  # another branch: not step 3 again (the RNG states restored, one step would be)
        ckpt.maybe_save(3, branch)
        ckpt.wait()
    restored = make_app(seed=9)
    caplog.clear()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        assert ckpt.restore_latest(restored).step == 3
    assert same_state(restored, branch) and not same_state(restored, first)
    said = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"fastio: {url}/step-3: the store's commit marker is not this "
                                                 f"staging dir's ({tmp_path / 'A' / 'step-3'}"), said
    assert (tmp_path / "A" / "step-3.quarantined" / naming.COMMIT_FILE).is_file()  # moved aside, never deleted


def test_a_dataset_prefix_is_refused_as_a_checkpoint_directory(moto_server, s3_bucket, tmp_path, image_dataset):
    """Before: Checkpointer('s3://bucket/imagenet') on a dataset's prefix took its lease there (a later
    `fastio convert --overwrite` of the dataset refused as 'in use') and dropped step-N/ among its shards, where a
    local dataset directory has long been refused. Now the store's manifest.json (or splits.json) refuses it the
    same way, and nothing is written there."""
    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.errors import CheckpointError

    url = f"s3://{s3_bucket}/imagenet"
    store = open_storage(url, moto_server.options())
    store.publish_dir(image_dataset, keys_last=(MANIFEST_NAME,))
    before = [o.key for o in store.list()]
    for read_only in (False, True):
        with pytest.raises(CheckpointError, match=rf"^{url}: is a fastio dataset \(manifest\.json\), not a checkpoint "
                                                  r"directory; give the Checkpointer a directory of its own"):
            Checkpointer(url, storage_options=moto_server.options(), staging_dir=tmp_path / "stage", signals=(),
                         read_only=read_only)
    assert [o.key for o in store.list()] == before


def test_a_save_during_a_store_outage_is_committed_locally_and_uploaded_when_the_store_answers(
        moto_server, s3_bucket, fault_proxy, tmp_path, caplog):
    """Before: a save whose commit met an outage (503 past deadline_s) was lost on the node too: the commit asked the
    store about rollbacks first, failed, and the written step-2.tmp was deleted, although the node had every byte
    (a job preempted then lost that progress). Now, holding the lease, the Checkpointer knows the store's committed
    steps need no superseding: the step is committed in the staging dir (one warning naming it and that it is not on
    the store yet), uploaded at the next save, and close() waits for the upload, else fails naming the local-only
    step and its folder; the next Checkpointer of that staging dir restores and uploads it. An outage longer than
    lease_ttl_s (deadline_s is twice the ttl by default) changes nothing: the step is committed on the node, the
    upload confirms the lease first."""
    import time

    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05, lease_ttl_s=1, lease_skew_s=30)
    store = open_storage(url, moto_server.options())
    stage = tmp_path / "stage"
    app = make_app()
    ckpt = Checkpointer(url, keep=0, storage_options=options, staging_dir=stage, signals=())
    ckpt.save(1, app, blocking=True)
    fault_proxy.down = {f"/{s3_bucket}"}  # every request to the bucket: 503 SlowDown, past deadline_s
    time.sleep(1.5)  # and past lease_ttl_s: the lease is not renewed during the outage
    train_step(app)
    caplog.clear()
    ckpt.save(2, app, blocking=True)  # no error: committed on the node
    assert (stage / "step-2" / naming.COMMIT_FILE).is_file()
    said = [r.getMessage() for r in caplog.records if "not on the store yet" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"fastio: {url}/step-2: committed in {stage / 'step-2'}, not on "
                                                 "the store yet"), said
    assert f"{url}/fastio-rollback.json: HEAD failed" in said[0]  # the outage the rollback met: no second wait for it
    fault_proxy.down = set()
    train_step(app)
    ckpt.save(3, app, blocking=True)  # the store answers: step 2 uploaded with step 3
    assert ckpt.steps() == [1, 2, 3]
    fault_proxy.down = {f"/{s3_bucket}"}
    train_step(app)
    ckpt.save(4, app, blocking=True)
    with pytest.raises(CheckpointError, match=rf"^{url}: step 4 is committed only in {stage / 'step-4'} \(not on the "
                                              rf"store: .*\): the next Checkpointer\({url!r}, staging_dir="):
        ckpt.close()
    fault_proxy.down = set()
    assert "step-4/fastio-commit.json" not in {o.key for o in store.list()}
    restored = make_app(seed=3)
    with Checkpointer(url, keep=0, storage_options=options, staging_dir=stage, signals=()) as again:
        assert again.restore_latest(restored).step == 4
        assert same_state(restored, app)
        train_step(restored)
        again.save(5, restored, blocking=True)
        assert again.steps() == [1, 2, 3, 4, 5]


def _rolled_back_during_an_outage(url, options, stage, fault_proxy, s3_bucket, store):
    """Steps 1, 2 and 5 on the store; restore_latest(step=1), then the store goes out and step 3 is saved: the
    app saved, and the objects of the abandoned steps 2 and 5 as they were."""
    app = make_app()
    ckpt = Checkpointer(url, keep=0, storage_options=options, staging_dir=stage, signals=())
    for step in (1, 2, 5):
        train_step(app)
        ckpt.save(step, app, blocking=True)
    abandoned = {o.key: store.get(o.key) for o in store.list() if o.key.startswith(("step-2/", "step-5/"))}
    assert ckpt.restore_latest(app, step=1).step == 1
    fault_proxy.down = {f"/{s3_bucket}"}
    train_step(app)
    ckpt.save(3, app, blocking=True)  # no error: committed in the staging dir, its rollback with it
    assert (stage / "step-3" / naming.COMMIT_FILE).is_file()
    return ckpt, app, abandoned


def _assert_superseded_keeping_objects(url, options, store, abandoned, committed):
    rows = {r["step"]: r["state"] for r in catalog.list_steps(url, options)[1]}
    assert rows == {2: "superseded", 5: "superseded", **{s: "committed" for s in committed}}, rows
    now = {o.key: store.get(o.key) for o in store.list() if o.key.startswith(("step-2/", "step-5/"))}
    for step in (2, 5):
        marker = abandoned.pop(f"step-{step}/fastio-commit.json")
        assert now.pop(f"step-{step}/fastio-superseded.json") == marker
    assert now == abandoned


def test_the_first_save_after_a_rollback_during_a_store_outage_is_staged_and_supersedes_at_upload(
        moto_server, s3_bucket, fault_proxy, tmp_path, caplog):
    """Before: after restore_latest(step=1) with steps 2 and 5 on the store, a save during a store outage failed (the
    rollback had to supersede 2 and 5 on the store first), although a save without a rollback is committed in the
    staging dir: the job lost its progress until the store answered. Now the rollback is recorded in the staging dir
    with the step: step 3 is committed there, step 4 after it too (5 no longer counts as the store's newest), and
    once the store answers the next save supersedes 2 and 5 on the store exactly as a rollback does (markers kept as
    fastio-superseded.json, every object kept), then uploads 3, 4 and itself; a restore gets the new branch."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    stage = tmp_path / "stage"
    caplog.clear()
    ckpt, app, abandoned = _rolled_back_during_an_outage(url, options, stage, fault_proxy, s3_bucket, store)
    said = [r.getMessage() for r in caplog.records if "not on the store yet" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"fastio: {url}/step-3: committed in {stage / 'step-3'}"), said
    train_step(app)
    ckpt.save(4, app, blocking=True)  # still out: step 5 is of the abandoned branch, no reason to fail
    fault_proxy.down = set()
    train_step(app)
    ckpt.save(6, app, blocking=True)
    assert ckpt.steps() == [1, 3, 4, 6]
    ckpt.close()
    _assert_superseded_keeping_objects(url, options, store, abandoned, (1, 3, 4, 6))
    relaunched = make_app(seed=2)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "other", signals=()) as again:
        assert again.restore_latest(relaunched).step == 6
    assert same_state(relaunched, app)


def test_a_rollback_staged_during_an_outage_survives_close_and_is_applied_by_the_next_checkpointer(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """close() during the outage fails naming staged steps 3 and 4 and the rollback waiting with them (once, though
    both carry it), and what a job resumed elsewhere does; the next Checkpointer of that staging dir restores step 4,
    not the abandoned step 5 the store still calls committed, and its first save supersedes 2 and 5 on the store,
    then uploads 3, 4 and itself."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    stage = tmp_path / "stage"
    ckpt, app, abandoned = _rolled_back_during_an_outage(url, options, stage, fault_proxy, s3_bucket, store)
    train_step(app)
    ckpt.save(4, app, blocking=True)  # carries the rollback too: still named once
    with pytest.raises(CheckpointError, match=rf"^{url}: steps 3, 4 are committed only in {stage} \(step-3, step-4\) "
                                              r"\(not on the store: .*\), after a rollback to step 1 that supersedes "
                                              rf"steps 2, 5 on the store: the next Checkpointer\({url!r}, staging_dir="
                                              r".*; a job resumed with another staging dir restores from the store, "
                                              r"which does not know of the rollback: restore_latest\(\.\.\., step=1\) "
                                              r"there repeats it$"):
        ckpt.close()
    fault_proxy.down = set()
    restored = make_app(seed=3)
    with Checkpointer(url, keep=0, storage_options=options, staging_dir=stage, signals=()) as again:
        assert again.steps() == [1]
        assert again.restore_latest(restored).step == 4
        assert same_state(restored, app)
        train_step(restored)
        again.save(6, restored, blocking=True)
        assert again.steps() == [1, 3, 4, 6]
    _assert_superseded_keeping_objects(url, options, store, abandoned, (1, 3, 4, 6))
    assert not (stage / ".fastio-unsent.json").exists()


def test_a_rollback_staged_during_an_outage_is_not_applied_when_another_writer_continued(
        moto_server, s3_bucket, fault_proxy, tmp_path, caplog):
    """Node A rolled back to step 1 and staged step 3 during an outage; the job, requeued on node B, restored the
    store's newest (step 5: the store never saw the rollback) and saved step 6. Requeued on A, the staged rollback
    is of a branch given up: step 3 is neither restored nor uploaded, and B's steps 5 and 6 are not superseded."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    ckpt, app, _ = _rolled_back_during_an_outage(url, options, tmp_path / "A", fault_proxy, s3_bucket, store)
    with pytest.raises(CheckpointError, match="step 3 is committed only in"):
        ckpt.close()
    fault_proxy.down = set()
    branch = make_app(seed=7)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "B", signals=()) as other:
        assert other.restore_latest(branch).step == 5
        train_step(branch)
        other.save(6, branch, blocking=True)
    restored = make_app(seed=9)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=()) as again:
        assert again.restore_latest(restored).step == 6
        assert same_state(restored, branch)
        again.save(7, restored, blocking=True)
        assert again.steps() == [1, 2, 5, 6, 7]
    assert (tmp_path / "A" / "step-3.quarantined" / naming.COMMIT_FILE).is_file()


def test_a_staged_step_the_store_superseded_is_not_uploaded_again(moto_server, s3_bucket, tmp_path, caplog):
    """Before: node A staged steps 1-3; requeued on node B, the job rolled back to step 2 and committed step 4 (step 3
    superseded on the store); requeued on node A, it restored step 4 and its next save uploaded every staged step the
    store lacked, A's step 3 among them: the superseded step 3 was moved aside on the store and the abandoned
    branch's step 3 committed again (a checkpoint once more, for fallbacks and retention). A staged step whose
    marker the store keeps as superseded is that abandoned step: it is not uploaded (one warning), and moved aside in
    the staging dir, never deleted."""
    url, options, first = _three_steps_staged_in_a(s3_bucket, moto_server, tmp_path)
    branch = make_app(seed=7)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "B", signals=()) as ckpt:
        assert ckpt.restore_latest(branch, step=2).step == 2
        train_step(branch)
        ckpt.save(4, branch, blocking=True)
    caplog.clear()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        assert ckpt.restore_latest(branch).step == 4
        train_step(branch)
        ckpt.save(5, branch, blocking=True)
        assert ckpt.steps() == [1, 2, 4, 5]
    rows = {r["step"]: r["state"] for r in catalog.list_steps(url, options)[1]}
    assert rows == {1: "committed", 2: "committed", 3: "superseded", 4: "committed", 5: "committed"}, rows
    said = [r.getMessage() for r in caplog.records if "superseded on the store" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"fastio: {url}/step-3: not uploaded: "), said
    assert (tmp_path / "A" / "step-3.quarantined" / naming.COMMIT_FILE).is_file()


def test_a_staged_step_another_writer_continued_past_is_neither_restored_nor_uploaded(
        moto_server, s3_bucket, fault_proxy, tmp_path, caplog):
    """Node A committed step 5 in its staging dir during an outage (the store had step 1) and was killed before the
    upload; the job, requeued on node B, restored step 1 (all the store had) and saved step 2. Requeued on node A,
    restore_latest took A's staged step 5 (newest, 'an upload pending') over B's step 2, and its next save uploaded
    it: the run jumped back to a branch another writer had continued past, B's work silently superseded. The
    staging dir now records, for a step committed there and not uploaded, the store's steps it knew then; a step
    the store gained others than those since is of a branch given up (the newest save is the run's state): skipped
    by the restore, moved aside (never deleted), not uploaded."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    app = make_app()
    ckpt = Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=())
    ckpt.save(1, app, blocking=True)
    fault_proxy.down = {f"/{s3_bucket}"}
    train_step(app)
    ckpt.save(5, app, blocking=True)
    with pytest.raises(CheckpointError, match="step 5 is committed only in"):
        ckpt.close()
    fault_proxy.down = set()
    branch = make_app(seed=7)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "B", signals=()) as ckpt:
        assert ckpt.restore_latest(branch).step == 1
        train_step(branch)
        ckpt.save(2, branch, blocking=True)
    restored = make_app(seed=9)
    caplog.clear()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        assert ckpt.restore_latest(restored).step == 2
        assert same_state(restored, branch)
        ckpt.save(6, restored, blocking=True)
        assert ckpt.steps() == [1, 2, 6]
    said = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(said) == 1 and "and step 2 was committed on the store since (another writer" in said[0], said
    assert (tmp_path / "A" / "step-5.quarantined" / naming.COMMIT_FILE).is_file()


def test_steps_staged_during_an_outage_are_all_uploaded_when_the_store_comes_back_in_parts(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """Steps 2 and 3 staged during an outage; the store answers again but for step 3's keys: step 2 is uploaded,
    step 3 and the new step 4 stay staged (this writer's own step 2 on the store is no other writer's continuation,
    which would make step 3 a branch given up); once the store answers for all, everything is uploaded."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    app = make_app()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        ckpt.save(1, app, blocking=True)
        fault_proxy.down = {f"/{s3_bucket}"}
        for step in (2, 3):
            train_step(app)
            ckpt.save(step, app, blocking=True)
        fault_proxy.down = {"/ckpt/step-3/"}
        train_step(app)
        ckpt.save(4, app, blocking=True)
        assert ckpt.steps() == [1, 2]
        fault_proxy.down = set()
        train_step(app)
        ckpt.save(5, app, blocking=True)
        assert ckpt.steps() == [1, 2, 3, 4, 5]
    assert not (tmp_path / "A" / ".fastio-unsent.json").exists()
    assert not [p for p in (tmp_path / "A").iterdir() if p.name.endswith(".quarantined")]


def test_close_after_the_lease_was_taken_during_an_outage_names_the_step_left_staged(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """Step 2 staged during an outage longer than the lease's ttl; meanwhile another writer took the lease (and let
    it go). close() finds the lease lost and uploads nothing, as it must; before, its error said only 'lease lost'
    and not that step 2 exists only in the staging dir. Now it names the step and its folder."""
    import time

    url = f"s3://{s3_bucket}/ckpt"
    ttl = dict(lease_ttl_s=1, lease_skew_s=0)
    app = make_app()
    ckpt = Checkpointer(url, storage_options=moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05,
                                                                 **ttl), staging_dir=tmp_path / "A", signals=())
    ckpt.save(1, app, blocking=True)
    fault_proxy.down = {f"/{s3_bucket}"}  # for this writer only: the other one talks to the store directly
    train_step(app)
    ckpt.save(2, app, blocking=True)
    time.sleep(2.5)  # past the lease's expiry
    with Checkpointer(url, storage_options=moto_server.options(**ttl), staging_dir=tmp_path / "B", signals=()):
        pass
    fault_proxy.down = set()
    with pytest.raises(CheckpointError, match=rf"lease lost: .*; step 2 is committed only in {tmp_path / 'A' / 'step-2'}"
                                              r" \(not uploaded\)"):
        ckpt.close()
    assert (tmp_path / "A" / "step-2" / naming.COMMIT_FILE).is_file()
    assert ckpt.steps() == [1]


def test_a_step_whose_upload_the_store_refuses_is_named_by_close_as_left_in_the_staging_dir(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """Before: credentials that expire as a step's upload starts (403 on its objects) failed that save with 'upload
    failed: ... (the previous checkpoint is intact)', though the step stays committed in the staging dir, and close()
    then returned quietly: nothing said the step was on the node only (the outage case's close() names it). Now a
    refused upload counts as one left to do: close() tries again and, refused still, names the step and its folder;
    the next Checkpointer of that staging dir restores and uploads it."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    stage = tmp_path / "stage"
    app = make_app()
    ckpt = Checkpointer(url, storage_options=options, staging_dir=stage, signals=())
    ckpt.save(1, app, blocking=True)
    fault_proxy.forbidden = {f"/{s3_bucket}/ckpt/step-2/"}
    train_step(app)
    with pytest.raises(CheckpointError, match=rf"^{url}/step-2: checkpoint write failed: {url}: upload failed: "
                                              rf"{url}/step-2/.*access denied"):
        ckpt.save(2, app, blocking=True)
    with pytest.raises(CheckpointError, match=rf"^{url}: upload failed: .*access denied.*; step 2 is committed only in "
                                              rf"{stage / 'step-2'} \(not uploaded\)$"):
        ckpt.close()
    fault_proxy.forbidden = set()
    restored = make_app(seed=3)
    with Checkpointer(url, storage_options=options, staging_dir=stage, signals=()) as again:
        assert again.restore_latest(restored).step == 2
        assert same_state(restored, app)
        again.save(3, restored, blocking=True)
        assert again.steps() == [1, 2, 3]


def test_a_step_staged_after_two_rollbacks_replaces_the_abandoned_step_of_its_number(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """Rollback to 1, step 3 staged during an outage; the store answers for a restore (a rollback to 1 again), then
    is out again: step 2 staged (the store's step 2 is of the abandoned branch). When the store answers, 2 and 5 are
    superseded there, the abandoned step 2 moved aside (never written over) and the new step 2 uploaded; staged
    step 3 (superseded in the staging dir) is not."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    ckpt, app, _ = _rolled_back_during_an_outage(url, options, tmp_path / "A", fault_proxy, s3_bucket, store)
    fault_proxy.down = set()
    assert ckpt.restore_latest(app, step=1).step == 1
    fault_proxy.down = {f"/{s3_bucket}"}
    train_step(app)
    ckpt.save(2, app, blocking=True)
    fault_proxy.down = set()
    train_step(app)
    ckpt.save(4, app, blocking=True)
    assert ckpt.steps() == [1, 2, 4]
    ckpt.close()
    rows = sorted((r["step"], r["state"]) for r in catalog.list_steps(url, options)[1])
    assert rows == [(1, "committed"), (2, "committed"), (2, "quarantined"), (4, "committed"), (5, "superseded")], rows
    assert store.head("step-2.quarantined/fastio-superseded.json") is not None
    assert not [o.key for o in store.list() if o.key.startswith("step-3/")]
    relaunched = make_app(seed=2)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "other", signals=()) as again:
        assert again.restore_latest(relaunched).step == 4
        assert again.restore_latest(relaunched, step=2).step == 2


def test_an_outage_in_the_middle_of_a_staged_rollback_is_finished_by_the_next_upload(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """The store answers again but for step 5's keys: the staged rollback's record is written and step 2 superseded,
    step 5 not (an outage), and nothing of step 3 uploaded. Once the store answers for all, the next upload (here
    close()'s) finishes that rollback (no fastio-rollback.json left on the store) before the staged steps go up."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    ckpt, app, abandoned = _rolled_back_during_an_outage(url, options, tmp_path / "A", fault_proxy, s3_bucket, store)
    fault_proxy.down = {"/ckpt/step-5/"}
    train_step(app)
    ckpt.save(4, app, blocking=True)
    assert store.head("fastio-rollback.json") is not None and store.head("step-5/fastio-commit.json") is not None
    assert store.head("step-3/fastio-commit.json") is None
    fault_proxy.down = set()
    ckpt.close()  # uploads what is staged: the rollback finished first
    assert store.head("fastio-rollback.json") is None
    _assert_superseded_keeping_objects(url, options, store, abandoned, (1, 3, 4))


def test_a_rollback_staged_with_a_step_retention_removes_before_its_upload_is_carried_by_the_next(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """keep=2, steps 1 and 2 on the store; restore_latest(step=1), then during an outage steps 3, 4 and 6 are staged:
    retention in the staging dir removes step 3 (the one the rollback was staged with) before any upload. The
    rollback must not go with it: once the store answers, step 2 is superseded (kept, as a rollback keeps the abandoned
    branch), not taken for the newest checkpoint's predecessor and deleted by retention."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    app = make_app()
    with Checkpointer(url, keep=2, storage_options=options, staging_dir=tmp_path / "A", signals=()) as ckpt:
        for step in (1, 2):
            train_step(app)
            ckpt.save(step, app, blocking=True)
        abandoned = {o.key for o in store.list() if o.key.startswith("step-2/")}
        assert ckpt.restore_latest(app, step=1).step == 1
        fault_proxy.down = {f"/{s3_bucket}"}
        for step in (3, 4, 6):
            train_step(app)
            ckpt.save(step, app, blocking=True)
        fault_proxy.down = set()
        train_step(app)
        ckpt.save(7, app, blocking=True)
        assert ckpt.steps() == [6, 7]
    rows = {r["step"]: r["state"] for r in catalog.list_steps(url, options)[1]}
    assert rows == {2: "superseded", 6: "committed", 7: "committed"}, rows
    assert {o.key for o in store.list() if o.key.startswith("step-2/")} == (
        abandoned - {"step-2/fastio-commit.json"} | {"step-2/fastio-superseded.json"})


def test_a_rollback_that_cannot_be_recorded_in_the_staging_dir_fails_the_save_before_its_commit(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """The first save after restore_latest(step=1) during an outage cannot write its rollback to the staging dir
    (.fastio-unsent.json unwritable): the save fails naming that file, before step 3 is committed (committed without
    its rollback, it would be uploaded beside the abandoned steps 2 and 5, and 5 restored as the newest); the next
    save once the store answers does the rollback."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    stage = tmp_path / "stage"
    app = make_app()
    with Checkpointer(url, keep=0, storage_options=options, staging_dir=stage, signals=()) as ckpt:
        for step in (1, 2, 5):
            train_step(app)
            ckpt.save(step, app, blocking=True)
        assert ckpt.restore_latest(app, step=1).step == 1
        (stage / ".fastio-unsent.json").mkdir()
        fault_proxy.down = {f"/{s3_bucket}"}
        train_step(app)
        with pytest.raises(CheckpointError, match=rf"^{url}/step-3: checkpoint write failed: "
                                                  rf"{stage / '.fastio-unsent.json'}: cannot write: "):
            ckpt.save(3, app, blocking=True)
        assert not [p.name for p in stage.iterdir() if p.name.startswith("step-3")]
        (stage / ".fastio-unsent.json").rmdir()
        fault_proxy.down = set()
        ckpt.save(4, app, blocking=True)
        assert ckpt.steps() == [1, 4]
    rows = {r["step"]: r["state"] for r in catalog.list_steps(url, options)[1]}
    assert rows == {1: "committed", 2: "superseded", 4: "committed", 5: "superseded"}, rows


def test_a_save_to_a_bucket_deleted_under_the_run_fails_naming_it_and_stages_nothing(
        moto_server, s3_bucket, tmp_path):
    """The bucket is deleted while the Checkpointer holds the prefix: the save fails with one line naming the prefix
    and 'no such bucket' (before: 'cannot supersede the steps above 2', as if there were steps to supersede: every
    commit checks for them, and the store's steps could not be listed), nothing of step 2 is left in the staging
    dir, and close() does not raise."""
    url = f"s3://{s3_bucket}/ckpt"
    stage = tmp_path / "stage"
    app = make_app()
    ckpt = Checkpointer(url, storage_options=moto_server.options(deadline_s=1, backoff_s=0.05), staging_dir=stage,
                        signals=())
    ckpt.save(1, app, blocking=True)
    bucket = open_storage(f"s3://{s3_bucket}", moto_server.options())
    for o in bucket.list():
        bucket.delete(o.key)
    conn = http.client.HTTPConnection("127.0.0.1", moto_server.port, timeout=10)
    conn.request("DELETE", f"/{s3_bucket}")
    assert conn.getresponse().status == 204
    conn.close()
    train_step(app)
    with pytest.raises(CheckpointError, match=rf"^{url}/step-2: checkpoint write failed: {url}: cannot check or "
                                              rf"supersede the committed steps above step 2: {url}: LIST failed: no such "
                                              r"bucket [^\n]*$"):
        ckpt.save(2, app, blocking=True)
    assert not [p.name for p in stage.iterdir() if p.name.startswith("step-2")]
    ckpt.close()


def test_credentials_that_expire_before_a_staged_rollback_is_applied_leave_it_staged_and_named(
        moto_server, s3_bucket, fault_proxy, tmp_path):
    """Step 3 staged with its rollback during an outage; the store answers, but refuses the rollback record
    (credentials expired: 403). The next save fails naming the URL, before its commit; nothing is superseded or
    uploaded; close() names staged step 3 and the rollback still waiting; with credentials renewed, the next
    Checkpointer of that staging dir restores step 3 and applies the rollback at its first save."""
    url = f"s3://{s3_bucket}/ckpt"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    store = open_storage(url, moto_server.options())
    stage = tmp_path / "stage"
    ckpt, app, abandoned = _rolled_back_during_an_outage(url, options, stage, fault_proxy, s3_bucket, store)
    fault_proxy.down, fault_proxy.forbidden = set(), {"/ckpt/fastio-rollback.json"}
    train_step(app)
    with pytest.raises(CheckpointError, match=rf"^{url}/step-4: checkpoint write failed: {url}: cannot check or "
                                              r"supersede the committed steps above step 4: .*access denied"):
        ckpt.save(4, app, blocking=True)
    assert not [p.name for p in stage.iterdir() if p.name.startswith("step-4")]
    with pytest.raises(CheckpointError, match=rf"access denied.*; step 3 is committed only in {stage / 'step-3'} "
                                              r"\(not uploaded\), after a rollback to step 1 that supersedes steps 2, 5 "
                                              r"on the store$"):
        ckpt.close()
    assert {r["step"]: r["state"] for r in catalog.list_steps(url, moto_server.options())[1]} == {
        1: "committed", 2: "committed", 5: "committed"}
    fault_proxy.forbidden = set()
    restored = make_app(seed=4)
    with Checkpointer(url, storage_options=options, staging_dir=stage, signals=()) as again:
        assert again.restore_latest(restored).step == 3
        again.save(6, restored, blocking=True)
        assert again.steps() == [1, 3, 6]
    _assert_superseded_keeping_objects(url, options, store, abandoned, (1, 3, 6))


def _requests_by_kind(requests: list[tuple[str, str]], bucket: str) -> Counter:
    """``Counter`` of ``(kind, key or listed prefix)`` (kinds HEAD, GET, LIST, PUT, POST) of proxied S3 requests."""
    out: Counter = Counter()
    for method, path in requests:
        split = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        key = split.path.removeprefix(f"/{bucket}").lstrip("/")  # "" for a bucket's request (POST ?delete)
        if method == "GET" and "list-type" in query:
            out["LIST", query.get("prefix", [""])[0]] += 1
        else:
            out[method, key] += 1
    return out


def test_a_steady_save_a_retention_and_a_restore_cost_few_requests(moto_server, s3_bucket, fault_proxy, tmp_path):
    # each request costs 10-50 ms on S3: the rollback record is read once per save (not by each of the rollback's
    # start, finish and the upload's listing), the store listed once before the upload (not again by the upload),
    # the step's prefix once (whether it is superseded, and make_room), and a retained step's objects deleted as
    # the retention's listing names them (not listed again)
    url = f"s3://{s3_bucket}/ckpt"
    app = make_app()
    with Checkpointer(url, every_steps=1, keep=2, storage_options=moto_server.options(fault_proxy.endpoint),
                      staging_dir=tmp_path / "stage", signals=()) as ckpt:
        seen = {}
        for step in (1, 2, 3):
            fault_proxy.requests.clear()
            ckpt.save(step, app, blocking=True)
            seen[step] = _requests_by_kind(fault_proxy.requests, s3_bucket)
        assert ckpt.steps() == [2, 3]
    for step in (2, 3):
        kinds = Counter(kind for kind, _ in seen[step].elements())
        assert seen[step]["HEAD", "ckpt/fastio-rollback.json"] == 1, seen[step]
        assert seen[step]["LIST", "ckpt/"] == 2 and seen[step]["LIST", f"ckpt/step-{step}/"] == 1, seen[step]
        assert kinds["HEAD"] == 1 and kinds["LIST"] == 3 and kinds["GET"] == 0, seen[step]
        assert seen[step]["PUT", "ckpt/.fastio-lock"] == (2 if step == 2 else 3), seen[step]  # + before retention
    assert seen[2]["POST", ""] == 0 and seen[3]["LIST", "ckpt/step-1/"] == 0
    step_1 = [k for (method, k), n in seen[2].items() if method == "PUT" and k.startswith("ckpt/step-2/")]
    assert seen[3]["POST", ""] == len(step_1), seen[3]  # one delete per object of step 1, marker first
    # a restore on a fresh node reads the rollback record once (not again to drop a rollback's steps) and lists once
    fault_proxy.requests.clear()
    with Checkpointer(url, storage_options=moto_server.options(fault_proxy.endpoint), staging_dir=tmp_path / "fresh",
                      signals=()) as ckpt:
        construct = len(fault_proxy.requests)
        assert ckpt.restore_latest(make_app(seed=1)).step == 3
        restore = _requests_by_kind(fault_proxy.requests[construct:], s3_bucket)
    assert restore["HEAD", "ckpt/fastio-rollback.json"] == 1 and restore["LIST", "ckpt/"] == 1, restore
    assert restore["LIST", "ckpt/step-3/"] == 1 and restore["GET", "ckpt/step-3/fastio-commit.json"] == 1, restore
