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
