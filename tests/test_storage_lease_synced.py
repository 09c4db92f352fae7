"""A local ``.fastio-lock`` copied to S3 (``aws s3 sync`` of a converted folder) is not a live lease: writers on the
prefix go ahead at once; a real lease still refuses them (fastio.storage.lease against a real moto server)."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import run_cli

from fastio.storage import open_storage
from fastio.storage.lease import Lease
from fastio.storage.lock import LOCK_NAME


def sync_up(folder: Path, storage) -> None:
    """Upload every file of ``folder`` under the prefix, as ``aws s3 sync`` does (the lock file included)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        storage.put_bytes(path.relative_to(folder).as_posix(), path.read_bytes())


def test_a_synced_local_lock_does_not_block_writers_and_a_live_lease_still_does(aws_env, s3_bucket, image_folder,
                                                                                tmp_path, capsys):
    local = tmp_path / "local"
    code, _, err = run_cli(["convert", str(image_folder), str(local), "-q"], capsys)
    assert code == 0, err
    assert (local / LOCK_NAME).is_file()  # a local writer leaves its lock file behind (DirLock)
    url = f"s3://{s3_bucket}/ds"
    storage = open_storage(url)
    sync_up(local, storage)
    assert storage.get(LOCK_NAME) == (local / LOCK_NAME).read_bytes()  # this process's pid, this host, just now
    code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--overwrite"], capsys)
    assert code == 0, err
    assert LOCK_NAME not in [o.key for o in storage.list()]
    storage.put_bytes(LOCK_NAME, (local / LOCK_NAME).read_bytes())  # and a bare Lease takes it over at once too
    with Lease(storage, purpose="fastio convert"):
        code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--overwrite"], capsys)
        assert code == 2 and err.startswith(f"fastio: error: {url}: in use by fastio convert pid {os.getpid()} on ")
    assert storage.head(LOCK_NAME) is None
