"""An object store that stops answering: retrying starts with one warning (URL, attempt count), a deadline per read
bounds the time before a StorageError (a silent socket; the real S3 server paused with SIGSTOP), and the Loader's
stats() and progress line show the time spent waiting on storage; an outage mid-epoch longer than any retry budget
would last costs time, not the run (retries=None, until deadline_s, is the default)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time

import pytest
from conftest import write_image_dataset
from s3server import fails_at_once

from fastio import Loader, Raw
from fastio.dataset.manifest import MANIFEST_NAME
from fastio.errors import StorageError
from fastio.storage import StorageOptions, open_storage


@pytest.fixture
def silent_endpoint():
    """A loopback socket that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def options(endpoint: str, **extra) -> dict:
    return {"endpoint": endpoint, "region": "us-east-1", "access_key_id": "k", "secret_access_key": "s", **extra}


def test_one_warning_when_retrying_starts_debug_for_each_further_retry(silent_endpoint, caplog):
    st = open_storage("s3://bucket/p", options(silent_endpoint, timeout_s=0.5, retries=2, backoff_s=0.01))
    with caplog.at_level(logging.DEBUG, logger="fastio.storage"):
        with pytest.raises(StorageError, match=r"s3://bucket/p/k\.bin: GET failed after 3 attempts: "):
            st.get("k.bin")
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fastio.storage"]
    assert [level for level, _ in logged] == [logging.WARNING, logging.DEBUG], logged
    for attempt, (_, line) in enumerate(logged, start=1):
        assert line.startswith(f"fastio: s3://bucket/p/k.bin: GET failed (attempt {attempt} of 3, ")
        assert "retrying in" in line
    assert "each request until 2 retries or deadline_s=120 (further retries on s3://bucket" in logged[0][1]


def test_a_deadline_bounds_a_read_however_long_the_request_timeout(silent_endpoint):
    """Before: 7 attempts x 60 s timeout in silence; now deadline_s (default 120 s) ends it."""
    assert StorageOptions().deadline_s == 120
    st = open_storage("s3://bucket/p", options(silent_endpoint, deadline_s=1.5))  # timeout_s stays 60
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://bucket/p/k\.bin: GET failed after 1 attempt in 1\.\d s "
                                           r"\(deadline_s=1\.5\): no answer before the deadline") as info:
        st.get("k.bin")
    assert 1.4 < time.monotonic() - started < 3 and info.value.transient
    with pytest.raises(ValueError, match="deadline_s must be > 0, got 0"):
        StorageOptions(deadline_s=0)


def test_loader_on_a_paused_server_fails_in_time_and_reports_its_wait(moto_server, s3_bucket, image_folder, tmp_path,
                                                                     capsys, caplog):
    url = f"s3://{s3_bucket}/ds"
    local = write_image_dataset(tmp_path / "local", image_folder, max_samples=8)
    open_storage(url, moto_server.options()).publish_dir(local, keys_last=(MANIFEST_NAME,))
    opts = dict(batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none", progress=True,
                cache_dir=str(tmp_path / "cache"), cache_size="1GB", shard_read_ahead=0)
    loader = Loader(url, storage_options=moto_server.options(timeout_s=1, deadline_s=2.5, backoff_s=0.05), **opts)
    loader._stats.every_s = 0  # a progress line after every batch
    os.kill(moto_server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/ds/shards/.*\(deadline_s=2\.5\)"):
            next(iter(loader))
        assert time.monotonic() - started < 6
    finally:
        os.kill(moto_server.proc.pid, signal.SIGCONT)
    loader.close()
    assert any("GET failed (attempt 1, " in r.getMessage() and "until deadline_s=2.5" in r.getMessage()
               for r in caplog.records)
    with Loader(url, storage_options=moto_server.options(), **opts) as again:
        again._stats.every_s = 0
        assert sum(len(b["jpg"]) for b in again) == 48
        waited = again.stats()["storage"]["wait_s"]
    assert waited > 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastio: ") and "batches" in ln]
    assert lines and all(", storage wait " in ln and " retries" in ln for ln in lines)


def test_an_outage_mid_epoch_costs_time_not_the_run(moto_server, s3_bucket, image_folder, tmp_path, caplog):
    """The real S3 server paused (SIGSTOP) for 4 s after the first batch: every sample of the epoch still comes,
    with one warning when retrying starts and one when the store answers again. Before: "GET failed after 7
    attempts" (the retry budget was 6 retries, not the deadline): 7 attempts of 0.25 s and 6 waits of at most
    0.1 s here, under 2.4 s of the 4."""
    assert StorageOptions().deadline_s >= 120 and StorageOptions().retries is None  # the default: a deadline
    url = f"s3://{s3_bucket}/ds"
    local = write_image_dataset(tmp_path / "local", image_folder, max_samples=4)  # 12 shards of 4
    open_storage(url, moto_server.options()).publish_dir(local, keys_last=(MANIFEST_NAME,))
    options = moto_server.options(timeout_s=0.25, deadline_s=60, backoff_s=0.05, backoff_max_s=0.1)  # quick tries
    loader = Loader(url, batch_size=4, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none",
                    cache_dir=str(tmp_path / "cache"), cache_size="1GB", shard_read_ahead=0, storage_options=options)
    pid = moto_server.proc.pid
    with caplog.at_level(logging.DEBUG, logger="fastio.storage"):
        batches = iter(loader)
        seen = next(batches)["index"].tolist()
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(4, os.kill, (pid, signal.SIGCONT))
        started = time.monotonic()
        resume.start()
        try:
            for batch in batches:
                seen += batch["index"].tolist()
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        took = time.monotonic() - started
    retries = loader.stats()["storage"]["retries"]
    loader.close()
    assert sorted(seen) == list(range(48)) and took > 3.5 and retries > 3
    warned = [r.getMessage() for r in caplog.records if r.name == "fastio.storage" and r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned
    assert warned[0].startswith(f"fastio: s3://{s3_bucket}/ds/shards/") and "(attempt 1, " in warned[0]
    assert "each request until deadline_s=60" in warned[0]
    assert re.fullmatch(rf"fastio: s3://{s3_bucket} answers again after \d+\.\d s \(\d+ retries\)", warned[1])
    debug = [r for r in caplog.records if r.name == "fastio.storage" and r.levelno == logging.DEBUG]
    assert len(debug) + 1 >= retries


def test_retries_none_is_the_default_and_is_checked():
    assert StorageOptions().upload_retries == 6 and StorageOptions(retries=2).upload_retries == 2
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=rf"^retries must be None \(until deadline_s\) or an integer >= 0, "
                                             rf"got {re.escape(repr(bad))}$"):
            StorageOptions(retries=bad)


def test_a_request_that_gets_no_answer_says_why(silent_endpoint):
    """Before: a refused connection, an endpoint host that does not resolve and a request timeout were all
    'HTTP error: error sending request', in the warning and in the error after deadline_s: nothing said which.
    Now the cause the client reports is named."""
    from s3server import free_port

    cases = [(f"http://127.0.0.1:{free_port()}", {}, r"error sending request \(connect: Connection refused\)"),
             ("http://no-such-host.invalid:9000", {}, r"error sending request \(connect: dns error: failed to lookup"),
             (silent_endpoint, {"timeout_s": 0.3}, r"error sending request \(timed out\)")]
    for endpoint, extra, cause in cases:
        st = open_storage("s3://bucket/p", options(endpoint, retries=1, backoff_s=0.01, deadline_s=30, **extra))
        with pytest.raises(StorageError, match=r"s3://bucket/p/k\.bin: GET failed after 2 attempts: .*" + cause):
            st.get("k.bin")


def test_an_https_endpoint_that_speaks_plain_http_fails_at_once_naming_tls(moto_server):
    """Before: endpoint https://host:port on a plain-HTTP server (MinIO without TLS, a test server) failed every
    TLS handshake, each taken for a transient fault: retried until deadline_s (120 s by default), then named
    '... error sending request (connect)'. A handshake the server answers with something else than TLS, or a
    certificate the client refuses, cannot be cured by retrying: it fails at once, naming TLS."""
    endpoint = moto_server.endpoint.replace("http://", "https://")
    st = open_storage("s3://bucket/p", options(endpoint))
    fails_at_once(lambda: st.get("k.bin"), r"^s3://bucket/p/k\.bin: GET failed: TLS handshake failed \(the endpoint "
                                          r"is https:// but the server does not speak TLS, or its certificate is not "
                                          r"trusted\): .*InvalidContentType")
