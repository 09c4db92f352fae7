"""fastio.storage against a real S3 server (moto on loopback), through the real client, with injected faults;
StorageOptions of the wrong type (a number written as text, a bool) named when they are made."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from s3server import fails_at_once

from fastio import Dataset
from fastio.errors import FastioError, StorageError
from fastio.storage import LocalStorage, StorageOptions, open_storage, parse_location


def test_urls_parse_and_unknown_schemes_are_errors(tmp_path):
    loc = parse_location("s3://my-bucket/a/b/")
    assert (loc.scheme, loc.bucket, loc.prefix, loc.url, loc.remote) == ("s3", "my-bucket", "a/b", "s3://my-bucket/a/b",
                                                                         True)
    assert parse_location("s3://my-bucket").prefix == ""
    assert parse_location(str(tmp_path)).path == tmp_path
    assert parse_location(f"file://{tmp_path}").path == tmp_path
    for bad, words in [("gs://b/x", "unsupported URL scheme 'gs'"), ("https://host/x", "unsupported URL scheme"),
                       ("s3://B_ad/x", "not a valid bucket name"), ("s3://bucket/a//b", "empty"),
                       ("s3:/bucket/x", "s3://bucket/prefix")]:
        with pytest.raises(StorageError, match=words) as info:
            parse_location(bad)
        assert bad in str(info.value) and isinstance(info.value, FastioError)


def test_an_s3_url_missing_its_colon_is_refused_not_made_a_local_folder(tmp_path, image_folder, capsys, monkeypatch):
    """Found by the integrations review: `fastio convert images s3//bucket/ds` (the ':' left out) converted the whole
    dataset into a local folder ./s3/bucket/ds and exited 0, where the user meant S3. A path that starts with a
    remote scheme and '//' is refused naming the URL it looks like; ./s3//x is still a local path."""
    from helpers import run_cli

    for typo in ("s3//bucket/ds", "S3//bucket/ds"):
        with pytest.raises(StorageError, match=re.escape(f"{typo}: looks like s3://bucket/ds with its ':' left out")):
            parse_location(typo)
    assert parse_location("./s3//x").path == Path("./s3//x")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["convert", str(image_folder), "s3//bucket/ds", "-q"], capsys)
    assert code == 2 and err.startswith("fastio: error: s3//bucket/ds: looks like s3://bucket/ds"), err
    assert not (tmp_path / "s3").exists()


def test_options_come_from_the_environment_and_profiles_and_overrides_win(tmp_path):
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = DEF\naws_secret_access_key = defsecret\n"
                                     "[other]\naws_access_key_id = OTH\naws_secret_access_key = othsecret\n")
    (aws / "config").write_text("[profile other]\nregion = eu-west-3\nendpoint_url = http://127.0.0.1:1\n")
    env = {"HOME": str(tmp_path)}
    o = StorageOptions.resolve(None, env=env)
    assert (o.access_key_id, o.secret_access_key, o.region, o.endpoint) == ("DEF", "defsecret", None, None)
    o = StorageOptions.resolve(None, env={**env, "AWS_PROFILE": "other"})
    assert (o.access_key_id, o.region, o.endpoint) == ("OTH", "eu-west-3", "http://127.0.0.1:1")
    o = StorageOptions.resolve({"region": "ap-south-1"}, env={**env, "AWS_PROFILE": "other", "AWS_ACCESS_KEY_ID": "E",
                                                               "AWS_SECRET_ACCESS_KEY": "s",
                                                               "AWS_ENDPOINT_URL": "http://127.0.0.1:2"})
    assert (o.access_key_id, o.secret_access_key, o.region, o.endpoint) == ("E", "s", "ap-south-1", "http://127.0.0.1:2")
    with pytest.raises(ValueError, match="profile 'nope'"):
        StorageOptions.resolve({"profile": "nope"}, env=env)
    with pytest.raises(ValueError, match="storage_options has no 'endpoint_url'"):
        StorageOptions.resolve({"endpoint_url": "x"}, env=env)
    with pytest.raises(ValueError, match="part_size"):
        StorageOptions(part_size=1024)


def test_object_operations_round_trip(moto_server, s3_bucket, tmp_path):
    st = open_storage(f"s3://{s3_bucket}/data/", moto_server.options())
    assert st.url == f"s3://{s3_bucket}/data" and st.remote
    assert st.head("a.bin") is None and not st.exists("a.bin")
    big = os.urandom(13 << 20)  # over one 5 MiB part: multipart upload, ranged parallel download
    (tmp_path / "big").write_bytes(big)
    st = open_storage(f"s3://{s3_bucket}/data", moto_server.options(part_size=5 << 20))
    st.put_file("x/big.bin", tmp_path / "big")
    st.put_bytes("a.bin", b"hello world")
    assert st.get("a.bin") == b"hello world"
    assert st.get("a.bin", 6, 11) == b"world" and st.get("a.bin", 6) == b"world"
    assert st.head("x/big.bin") == len(big)
    assert st.get_to_file("x/big.bin", tmp_path / "copy") == len(big)
    assert (tmp_path / "copy").read_bytes() == big
    assert [(o.key, o.size) for o in st.list()] == [("a.bin", 11), ("x/big.bin", len(big))]
    assert [o.key for o in st.list("x/")] == ["x/big.bin"]
    # a sibling prefix that merely starts with the same letters is not listed
    open_storage(f"s3://{s3_bucket}/data2", moto_server.options()).put_bytes("z", b"z")
    assert len(st.list()) == 2
    st.delete("a.bin")
    assert not st.exists("a.bin")


def test_a_limited_listing_is_the_first_objects_by_key(moto_server, s3_bucket, tmp_path):
    """``list(limit=N)`` (what a missing manifest's message looks at: a few objects of a prefix that may hold
    millions) is the first N of the whole listing, across the client's batches of 50, locally too."""
    keys = [f"k{i:03d}" for i in range(60, 0, -1)] + ["sub/a.tar"]
    for st in (open_storage(f"s3://{s3_bucket}/many", moto_server.options()), open_storage(tmp_path / "many")):
        for key in keys:
            st.put_bytes(key, key.encode())
        everything = st.list()
        assert [o.key for o in everything] == sorted(keys)
        for limit in (0, 3, 55, 61, 100):
            assert st.list(limit=limit) == everything[:limit], (st.url, limit)
        assert [o.key for o in st.list("sub/", limit=1)] == ["sub/a.tar"]


def test_folders_are_the_names_directly_below_a_prefix_locally_and_on_s3(moto_server, s3_bucket, tmp_path):
    """``folders()`` (what a missing dataset's message offers for a typo, and where it looks for datasets below a
    prefix): the sorted names one level down, not their objects' keys; none below a prefix with nothing there."""
    for st in (open_storage(f"s3://{s3_bucket}/top", moto_server.options()), open_storage(tmp_path / "top")):
        for key in ("b/manifest.json", "a/shards/0.tar", "a/manifest.json", "c/d/e/f.txt", "loose.txt"):
            st.put_bytes(key, b"x")
        assert st.folders() == ["a", "b", "c"], st.url
        assert st.folders("a") == st.folders("a/") == ["shards"], st.url
        assert st.child("c").folders() == ["d"] and st.folders("nothing") == [], st.url


def test_missing_and_forbidden_fail_at_once_naming_the_url(moto_server, s3_bucket, fault_proxy):
    st = open_storage(f"s3://{s3_bucket}/p", moto_server.options(fault_proxy.endpoint, backoff_s=0.5))
    t = time.monotonic()
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/p/nothing\.bin: GET failed: not found"):
        st.get("nothing.bin")
    st.put_bytes("secret.bin", b"x")
    fault_proxy.forbidden.add("secret.bin")
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/p/secret\.bin: GET failed: .*(denied|403)") as info:
        st.get("secret.bin")
    assert not info.value.transient
    assert time.monotonic() - t < 5 and st.retry_count == 0  # no backoff sleeps: not retried


def test_transient_faults_are_retried_with_backoff(moto_server, s3_bucket, fault_proxy, tmp_path):
    fault_proxy.slowdown, fault_proxy.cut, fault_proxy.max_faults = 0.3, 0.3, 2
    st = open_storage(f"s3://{s3_bucket}/p", moto_server.options(fault_proxy.endpoint, backoff_s=0.01,
                                                                 part_size=5 << 20))
    blobs = {f"o{i}.bin": os.urandom(200_000 + i) for i in range(12)}
    for k, v in blobs.items():
        st.put_bytes(k, v)
    big = os.urandom(11 << 20)
    (tmp_path / "big").write_bytes(big)
    st.put_file("big.bin", tmp_path / "big")  # multipart: a faulted part is retried alone (inside the client)
    put_faults = fault_proxy.counts["slowdown"]
    assert put_faults > 0 and st.retry_count == 0
    for k, v in blobs.items():
        assert st.get(k) == v
        assert st.get(k, 1000, 5000) == v[1000:5000]
    st.get_to_file("big.bin", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == big
    read_faults = fault_proxy.counts["slowdown"] - put_faults + fault_proxy.counts["cut"]
    assert fault_proxy.counts["slowdown"] > put_faults and fault_proxy.counts["cut"] > 0
    # every faulted read was retried by fastio; a pooled connection the proxy had closed may add a retry
    assert read_faults <= st.retry_count <= read_faults + 3


def test_retries_are_bounded_then_a_clear_error(moto_server, s3_bucket, fault_proxy):
    st = open_storage(f"s3://{s3_bucket}/p", moto_server.options(fault_proxy.endpoint, retries=2, backoff_s=0.01))
    st.put_bytes("k.bin", b"payload")
    fault_proxy.slowdown, fault_proxy.max_faults = 1.0, 100
    t = time.monotonic()
    with pytest.raises(StorageError, match=rf"s3://{s3_bucket}/p/k\.bin: GET failed after 3 attempts: .*SlowDown") \
            as info:
        st.get("k.bin")
    assert info.value.transient and info.value.url == f"s3://{s3_bucket}/p/k.bin"
    assert time.monotonic() - t < 5


def test_local_storage_same_interface(tmp_path):
    st = open_storage(tmp_path / "root")
    assert isinstance(st, LocalStorage) and not st.remote
    (tmp_path / "f").write_bytes(b"abc")
    st.put_file("d/f.bin", tmp_path / "f")
    st.put_bytes("g.bin", b"0123456789")
    assert st.get("g.bin", 2, 5) == b"234" and st.head("d/f.bin") == 3
    assert [o.key for o in st.list()] == ["d/f.bin", "g.bin"]
    with pytest.raises(StorageError, match="nope.bin: cannot read"):
        st.get("nope.bin")


@pytest.mark.parametrize("kw,match", [({"deadline_s": "120"}, r"deadline_s must be a number, got '120'"),
                                      ({"retries": 2.5}, r"retries must be None \(until deadline_s\) or an integer >= 0, "
                                                         r"got 2\.5"),
                                      ({"part_size": "16MB"}, r"part_size must be an integer, got '16MB'"),
                                      ({"concurrency": True}, r"concurrency must be an integer, got True")])
def test_a_number_of_the_wrong_type_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        StorageOptions(**kw)
    with pytest.raises(ValueError, match=match):  # as a user passes them
        Dataset("s3://some-bucket/ds", storage_options={"endpoint": "http://127.0.0.1:9", **kw})
    assert StorageOptions(deadline_s=30, retries=3).deadline_s == 30


def test_no_credentials_anywhere_is_named(moto_server, s3_bucket, tmp_path, monkeypatch):
    """Before: with no keys in storage_options, the environment or ~/.aws, the client's last resort (the instance
    metadata service) failing gave 'HEAD failed: Error performing PUT http://169.254.169.254/latest/api/token ...',
    which names neither credentials nor where fastio looked. Now the error says no credentials were found and
    where, and keeps the client's own line."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    # one attempt, bounded well inside the deadline (where the metadata service does not answer at all, its
    # connection error is what the line keeps)
    st = open_storage(f"s3://{s3_bucket}/p", {"endpoint": moto_server.endpoint, "region": "us-east-1", "retries": 0,
                                                "timeout_s": 5, "connect_timeout_s": 2, "deadline_s": 30})
    with pytest.raises(StorageError, match=rf"^s3://{s3_bucket}/p/x\.bin: HEAD failed.*: no credentials: none in "
                                           r"storage_options, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile "
                                           r"in ~/\.aws, and the instance metadata service gave none \(.*169\.254"):
        st.head("x.bin")


def test_an_s3_request_timeout_is_retried_though_it_is_a_400(moto_server, s3_bucket, fault_proxy, tmp_path):
    """Before: S3's 'RequestTimeout' (HTTP 400: a request body that came too slowly, on a loaded link) was taken for a
    bad request and failed a read or an upload (a checkpoint's file) at once. The AWS SDKs retry it; so does fastio,
    as it retries 503 SlowDown."""
    from s3server import REQUEST_TIMEOUT

    fault_proxy.slowdown, fault_proxy.max_faults, fault_proxy.throttle = 1.0, 2, REQUEST_TIMEOUT
    st = open_storage(f"s3://{s3_bucket}/p", moto_server.options(fault_proxy.endpoint, backoff_s=0.01))
    (tmp_path / "f").write_bytes(b"checkpoint bytes")
    st.put_file("f.bin", tmp_path / "f")
    st.put_bytes("g.bin", b"small")
    assert st.get("f.bin") == b"checkpoint bytes" and st.get("g.bin") == b"small"
    assert fault_proxy.counts["slowdown"] >= 6 and st.retry_count > 0


def test_a_redirect_to_another_region_fails_at_once_naming_the_region(moto_server, s3_bucket, fault_proxy):
    """Before: S3's answer to a bucket addressed in the wrong region (301 PermanentRedirect, no Location) was taken
    for a transient fault and retried until deadline_s (120 s by default), then named only as '... Received redirect
    without LOCATION, this normally indicates an incorrectly confi' (cut short). Now it fails at once, naming the
    likely cause."""
    fault_proxy.slowdown, fault_proxy.max_faults = 1.0, 1000
    fault_proxy.throttle = (301, b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code><Message>'
                                 b"The bucket you are attempting to access must be addressed using the specified "
                                 b"endpoint.</Message></Error>")
    st = open_storage(f"s3://{s3_bucket}/p", moto_server.options(fault_proxy.endpoint))
    fails_at_once(lambda: st.get("x.bin"), rf"^s3://{s3_bucket}/p/x\.bin: GET failed: redirected: the bucket is in "
                                          r"another region than the one configured \(region=, AWS_REGION\), or the "
                                          r"endpoint is wrong \(")


def test_a_bucket_that_does_not_exist_is_named_as_such(moto_server):
    """Before: every call on a bucket that does not exist said 'not found (...NoSuchBucket)', the words of a missing
    object: a Checkpointer's lease 's3://nosuchbkt/ck/.fastio-lock: conditional PUT failed: not found'. Now the
    adapter says 'no such bucket' (a missing object still says 'not found')."""
    st = open_storage("s3://no-such-bucket-at-all/p", moto_server.options())
    for call, what in ((lambda: st.get("k"), "GET"), (lambda: st.list(), "LIST"),
                       (lambda: st.put_bytes("k", b"x"), "PUT")):
        with pytest.raises(StorageError, match=rf"^s3://no-such-bucket-at-all/p(/k)?: {what} failed: no such bucket \(.*"
                                               r"NoSuchBucket") as info:
            call()
        assert info.value.missing
