"""A second Checkpointer on an ``s3://`` prefix that a live one holds (same host, same staging dir) is refused
naming the prefix the user gave, not only the local staging directory whose lock refused it (it said
``/home/u/.cache/fastio/checkpoints/d09a5c...: in use by ...``, which names no URL)."""

from __future__ import annotations

import pytest

from fastio import Checkpointer
from fastio.errors import CheckpointError


def test_a_second_writer_of_an_s3_prefix_is_refused_naming_the_url(moto_server, s3_bucket, tmp_path):
    url, options = f"s3://{s3_bucket}/ck", moto_server.options()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "stage", signals=()):
        with pytest.raises(CheckpointError) as err:
            Checkpointer(url, storage_options=options, staging_dir=tmp_path / "stage", signals=())
    message = str(err.value)
    assert message.startswith(f"{url}: ") and "in use by fastio checkpointer" in message, message
    assert str(tmp_path / "stage") in message and "\n" not in message, message


def test_a_checkpointer_after_a_close_that_could_not_release_the_lease_takes_it_back(moto_server, s3_bucket,
                                                                                    fault_proxy, tmp_path):
    """Before: a close() during a store outage could not delete the lease (logged, left to expire); a new
    Checkpointer of the same prefix in the same process, the store back, was refused as a second writer ('in use by
    fastio checkpointer ... pid <its own pid>') until the lease expired (~70 s). Now the process takes back the
    lease it left (same host and pid, and a token it wrote and could not release); a live Checkpointer's lease in the
    same process is still refused."""
    url = f"s3://{s3_bucket}/ck"
    options = moto_server.options(fault_proxy.endpoint, deadline_s=1, backoff_s=0.05)
    first = Checkpointer(url, storage_options=options, staging_dir=tmp_path / "stage", signals=())
    fault_proxy.down = {f"/{s3_bucket}/ck/.fastio-lock"}
    first.close()  # the release's renewal fails: the lease stays on the store
    fault_proxy.down = set()
    with Checkpointer(url, storage_options=options, staging_dir=tmp_path / "stage", signals=()):
        with pytest.raises(CheckpointError, match="in use by fastio checkpointer"):
            Checkpointer(url, storage_options=options, staging_dir=tmp_path / "other", signals=())
