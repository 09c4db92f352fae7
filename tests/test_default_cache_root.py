"""The default cache root is shared by the shard cache and the s3:// Checkpointer's staging area
(``$FASTIO_CACHE_DIR/checkpoints/``): either may come first, the other still works on default settings."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import write_image_dataset
from torch import nn

from fastio import Loader, Raw
from fastio.checkpoint import Checkpointer
from fastio.dataset.manifest import MANIFEST_NAME
from fastio.storage import open_storage


def save_and_restore(url: str) -> None:
    model = nn.Linear(4, 2)
    with Checkpointer(url, every_steps=1, signals=()) as ckpt:  # staging: the default, under the cache root
        assert str(ckpt.dir).startswith(os.environ["FASTIO_CACHE_DIR"])
        ckpt.maybe_save(1, {"model": model})
        ckpt.wait()
    fresh = nn.Linear(4, 2)
    with Checkpointer(url, signals=()) as ckpt:
        assert ckpt.restore_latest({"model": fresh}).step == 1
    assert torch.equal(fresh.weight, model.weight)


def read_all(url: str) -> int:
    with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none") as loader:
        return sum(int((~b["padded"]).sum()) for b in loader)


@pytest.mark.parametrize("first", ["checkpointer", "loader"])
def test_checkpointer_and_loader_share_the_default_cache_root(aws_env, moto_server, s3_bucket, image_folder, tmp_path,
                                                              first):
    data = f"s3://{s3_bucket}/ds"
    local = write_image_dataset(tmp_path / "local", image_folder)
    open_storage(data, moto_server.options()).publish_dir(local, keys_last=(MANIFEST_NAME,))
    if first == "checkpointer":
        save_and_restore(f"s3://{s3_bucket}/ckpt")
        assert read_all(data) == 48  # was: "cache_dir is not empty and is not a fastio cache"
    else:
        assert read_all(data) == 48
        save_and_restore(f"s3://{s3_bucket}/ckpt")
        assert read_all(data) == 48
