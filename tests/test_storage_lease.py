"""One writer per S3 prefix: the lease object (fastio.storage.lease) against a real S3 server (moto) on loopback,
and its use by `fastio convert` and the Checkpointer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import run_cli
from test_checkpoint_s3 import make_app, train_step

from fastio.checkpoint import Checkpointer
from fastio.errors import CheckpointError, StorageError
from fastio.storage import open_storage
from fastio.storage.lease import Lease, LeaseLostError
from fastio.storage.lock import LOCK_NAME, LockedError

# A process holding a lease until it is killed. HOST (if given) stands in for another node's host name.
HOLDER = textwrap.dedent("""
    import json, socket, sys, time
    url, options, host = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if host:
        socket.gethostname = lambda: host
    from fastio.storage import open_storage
    from fastio.storage.lease import Lease
    Lease(open_storage(url, options), purpose="holder under test").acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def start_holder(url: str, options: dict, host: str = "", env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, url, json.dumps(options), host], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, **(env or {})))
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()  # reaped: not a zombie any more


def lease_body(storage) -> dict:
    return json.loads(storage.get(LOCK_NAME))


def test_second_writer_is_refused_naming_the_holder_and_release_removes_the_lease(moto_server, s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/data", moto_server.options(lease_ttl_s=1.5))
    first = Lease(storage, purpose="fastio convert").acquire()
    body = lease_body(storage)
    assert body["pid"] == os.getpid() and body["host"] == socket.gethostname() and body["ttl_s"] == 1.5
    assert body["expires"] > time.time()
    with pytest.raises(LockedError) as refused:
        Lease(storage, purpose="second").acquire()
    msg = str(refused.value)
    assert msg.startswith(f"s3://{s3_bucket}/data: in use by fastio convert pid {os.getpid()} on ") and "\n" not in msg
    # the heartbeat renews by If-Match: new entity tag, later expiry; the holder's checks pass
    before = storage.get_versioned(LOCK_NAME)
    time.sleep(1.2)
    after = storage.get_versioned(LOCK_NAME)
    assert after.e_tag != before.e_tag and json.loads(after.data)["expires"] > json.loads(before.data)["expires"]
    first.check()
    first.confirm()
    first.release()
    assert storage.head(LOCK_NAME) is None and not first.held
    with Lease(storage, purpose="second") as second:  # free again
        assert second.held and lease_body(storage)["purpose"] == "second"
    assert storage.head(LOCK_NAME) is None


def test_a_sigkilled_holder_on_another_host_is_taken_over_after_expiry(moto_server, s3_bucket):
    options = moto_server.options(lease_ttl_s=2, lease_skew_s=0.5)
    url = f"s3://{s3_bucket}/ckpt"
    holder = start_holder(url, options, host="node-b")
    storage = open_storage(url, options)
    kill(holder)
    killed = time.time()
    with pytest.raises(LockedError, match=f"holder under test pid {holder.pid} on node-b"):
        Lease(storage).acquire()  # its recorded expiry is still ahead: it may be alive on its node
    lease = Lease(storage, purpose="next")
    while True:
        try:
            lease.acquire()
            break
        except LockedError:
            assert time.time() - killed < 15, "the dead holder's lease never expired"
            time.sleep(0.2)
    waited = time.time() - killed
    # renewed at most ttl/3 before the kill, so it expires >= 1.33 s after it, + 0.5 s skew (server times whole s)
    assert waited >= 0.8
    assert lease_body(storage)["purpose"] == "next"
    lease.release()


def test_a_dead_holder_on_this_host_or_an_earlier_run_of_the_slurm_job_is_taken_over_at_once(
        moto_server, s3_bucket, monkeypatch):
    options = moto_server.options(lease_ttl_s=60)
    url = f"s3://{s3_bucket}/ckpt"
    storage = open_storage(url, options)
    # same host, pid gone: at once, although the lease has ~60 s to run
    kill(start_holder(url, options))
    t0 = time.monotonic()
    with Lease(storage, purpose="rerun on this host"):
        assert time.monotonic() - t0 < 5
    # another host, Slurm job 4242: a concurrent step of that job (same restart count) is refused,
    # its requeue (higher SLURM_RESTART_COUNT) takes over at once
    holder = start_holder(url, options, host="node-c", env={"SLURM_JOB_ID": "4242"})
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with pytest.raises(LockedError, match="Slurm job 4242"):
        Lease(storage).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(LockedError, match="on node-c"):
        Lease(storage).acquire()
    kill(holder)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    t0 = time.monotonic()
    with Lease(storage, purpose="requeued"):
        assert time.monotonic() - t0 < 5 and lease_body(storage)["restart"] == 1
    assert storage.head(LOCK_NAME) is None


def test_a_lease_taken_over_under_a_live_holder_is_lost_and_never_deleted(moto_server, s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/x", moto_server.options(lease_ttl_s=1.5))
    lease = Lease(storage, purpose="victim").acquire()
    thief = b'{"purpose": "thief", "host": "node-z", "pid": 7}'
    storage.put_bytes(LOCK_NAME, thief)  # another writer overwrote it
    with pytest.raises(LeaseLostError, match=f"s3://{s3_bucket}/x: lease lost: taken over by thief pid 7 on node-z"):
        lease.confirm()
    with pytest.raises(LeaseLostError, match="lease lost"):
        lease.check()  # and stays lost
    lease.release()
    assert storage.get(LOCK_NAME) == thief  # the thief's lease is left alone
    # the heartbeat alone notices too
    storage.delete(LOCK_NAME)
    other = Lease(storage, purpose="victim 2").acquire()
    storage.put_bytes(LOCK_NAME, thief)
    deadline = time.monotonic() + 10
    while True:
        try:
            other.check()
        except LeaseLostError:
            break
        assert time.monotonic() < deadline, "the heartbeat never noticed the lost lease"
        time.sleep(0.1)
    other.release()
    assert storage.get(LOCK_NAME) == thief


def test_lease_works_through_faults(moto_server, s3_bucket, fault_proxy):
    # every kind of request answers 503 SlowDown the first time it is seen (then passes): faults for certain
    fault_proxy.slowdown, fault_proxy.max_faults = 1.0, 1
    storage = open_storage(f"s3://{s3_bucket}/f", moto_server.options(fault_proxy.endpoint, lease_ttl_s=1.5,
                                                                        backoff_s=0.01))
    with Lease(storage, purpose="faulted") as lease:
        with pytest.raises(LockedError, match="faulted pid"):
            Lease(storage).acquire()
        time.sleep(1.2)
        lease.confirm()
        lease.check()
    assert storage.head(LOCK_NAME) is None
    assert fault_proxy.counts["slowdown"] > 0


def test_a_store_that_ignores_conditional_writes_is_refused(moto_server, s3_bucket, fault_proxy):
    fault_proxy.drop_headers = {"if-none-match", "if-match"}
    storage = open_storage(f"s3://{s3_bucket}/old", moto_server.options(fault_proxy.endpoint))
    with pytest.raises(StorageError, match=f"s3://{s3_bucket}/old: the store ignores conditional writes "
                                           r"\(If-None-Match\).*lease_ttl_s=0"):
        Lease(storage).acquire()
    assert storage.head(LOCK_NAME) is None  # not left behind
    assert not list(storage.list())


def test_lease_options_are_validated():
    from fastio.storage import StorageOptions

    for bad in ({"lease_ttl_s": 0.5}, {"lease_ttl_s": -1}, {"lease_skew_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StorageOptions(**bad)
    assert StorageOptions(lease_ttl_s=0).lease_ttl_s == 0


# -- users of the lease ------------------------------------------------------------------------------------

def test_a_second_checkpointer_on_the_prefix_is_refused_in_this_process_and_another(moto_server, s3_bucket, tmp_path,
                                                                                   warm):
    url = f"s3://{s3_bucket}/runs/ckpt"
    options = moto_server.options()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "a", signals=()):
        with pytest.raises(CheckpointError, match=f"{url}: in use by fastio checkpointer pid {os.getpid()}"):
            Checkpointer(url, storage_options=options, staging_dir=tmp_path / "b", signals=())
        script = textwrap.dedent("""
            import json, sys
            from fastio.checkpoint import Checkpointer
            from fastio.errors import CheckpointError
            try:
                Checkpointer(sys.argv[1], storage_options=json.loads(sys.argv[2]), staging_dir=sys.argv[3], signals=())
            except CheckpointError as err:
                print(err)
        """)
        (tmp_path / "other.py").write_text(script)  # another process (from the warm interpreter: torch imported)
        _, out, _ = warm.run(tmp_path / "other.py", tmp_path, url, json.dumps(options), str(tmp_path / "c"),
                             timeout=120)
        assert out.startswith(f"{url}: in use by fastio checkpointer pid {os.getpid()} on ")
    assert open_storage(url, options).head(LOCK_NAME) is None  # close released it
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "b", signals=()):
        pass  # free again; the refused one released its staging DirLock too


def test_a_checkpointer_that_lost_its_lease_fails_the_save_without_uploading(moto_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/runs/lost"
    options = moto_server.options(lease_ttl_s=30)
    store = open_storage(url, options)
    app = make_app()
    ckpt = Checkpointer(url, every_steps=1, keep=1, storage_options=options, staging_dir=tmp_path / "s", signals=())
    train_step(app)
    ckpt.maybe_save(1, app)
    ckpt.wait()
    assert ckpt.steps() == [1]
    thief = json.dumps({"purpose": "fastio checkpointer", "host": "node-q", "pid": 11}).encode()
    store.put_bytes(LOCK_NAME, thief)  # another job took the prefix over
    train_step(app)
    ckpt.maybe_save(2, app)  # the write fails in the background ...
    with pytest.raises(CheckpointError, match=r"step-2: checkpoint write failed: .*lease lost: taken over by "
                                              r"fastio checkpointer pid 11 on node-q"):
        ckpt.maybe_save(3, app)  # ... and is raised at the next maybe_save
    # nothing uploaded, no retention on the store: step 1 is still there, step 2 never appeared
    assert ckpt.steps() == [1]
    assert sorted({o.key.split("/")[0] for o in store.list()}) == [LOCK_NAME, "step-1"]
    # close() names where the only copy of step 2 is (the staging dir), uploads nothing and still lets go
    with pytest.raises(CheckpointError, match=r"lease lost: taken over by fastio checkpointer pid 11 on node-q; "
                                              r"nothing more uploaded or deleted; step 2 is committed only in "
                                              r".*/s/step-2 \(not uploaded\)"):
        ckpt.close()
    assert (tmp_path / "s" / "step-2").is_dir()
    assert sorted({o.key.split("/")[0] for o in store.list()}) == [LOCK_NAME, "step-1"]
    assert store.get(LOCK_NAME) == thief
    restored = make_app(seed=3)
    store.delete(LOCK_NAME)
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "fresh", signals=()) as again:
        assert again.restore_latest(restored).step == 1


def test_convert_holds_the_lease_on_its_dest(aws_env, s3_bucket, image_folder, capsys):
    url = f"s3://{s3_bucket}/ds"
    storage = open_storage(url)
    with Lease(storage, purpose="fastio convert"):
        code, _, err = run_cli(["convert", str(image_folder), url, "-q"], capsys)
        assert code == 2 and err.count("\n") == 1
        assert err.startswith(f"fastio: error: {url}: in use by fastio convert pid {os.getpid()} on ")
        code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--overwrite"], capsys)
        assert code == 2 and "in use by" in err
        assert [o.key for o in storage.list()] == [LOCK_NAME]  # the live lease was not deleted
    # a lease left by a dead holder: not "foreign output", taken over, released at the end
    storage.put_bytes(LOCK_NAME, json.dumps({"purpose": "fastio convert", "host": socket.gethostname(),
                                             "pid": 2 ** 22 + 12345, "expires": time.time() + 600}).encode())
    code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--max-samples-per-shard", "16"], capsys)
    assert code == 0, err
    keys = [o.key for o in storage.list()]
    assert "manifest.json" in keys and LOCK_NAME not in keys
    code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--overwrite"], capsys)
    assert code == 0, err
    assert LOCK_NAME not in [o.key for o in storage.list()]


def test_a_lease_not_renewed_for_its_ttl_fails_the_check_until_a_renewal_succeeds(moto_server, s3_bucket,
                                                                                   fault_proxy):
    storage = open_storage(f"s3://{s3_bucket}/cut", moto_server.options(fault_proxy.endpoint, lease_ttl_s=1.5,
                                                                          retries=0))
    lease = Lease(storage, purpose="cut off").acquire()
    fault_proxy.forbidden = {LOCK_NAME}  # every request for the lease object: 403
    time.sleep(1.8)
    with pytest.raises(LeaseLostError, match=r"lease not renewed for \d+ s \(ttl 1.5 s\): another writer may"):
        lease.check()
    with pytest.raises(StorageError, match="access denied"):
        lease.confirm()
    fault_proxy.forbidden = set()
    lease.confirm()  # nobody wrote the object meanwhile (If-Match held): still ours
    lease.check()
    lease.release()
    assert storage.head(LOCK_NAME) is None
