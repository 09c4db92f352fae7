"""The Reader: stored bytes by dataset-wide index, shard descriptors opened (and verified) once, none leaked."""

from __future__ import annotations

import gc
import os
from concurrent.futures import wait

import numpy as np
import pytest

from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError
from fastio.read.reader import Reader


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_the_stored_bytes(image_dataset, image_folder):
    ds = Dataset(image_dataset)
    with Reader(ds, ["jpg", "cls"], threads=2, image=("jpg",), sizes=True) as reader:
        rb = reader.submit(np.array([47, 0, 20])).result()
    assert rb.indices.tolist() == [47, 0, 20]
    for j, i in enumerate(rb.indices.tolist()):
        assert rb.fields["jpg"][j].tobytes() == rb.image[j].tobytes() == \
            (image_folder / f"{ds.key(i)}.jpg").read_bytes()
        assert rb.fields["cls"][j].tobytes() == str(i // 12).encode()
    assert rb.image_field == ["jpg"] * 3
    assert rb.sizes.shape == (3, 2) and (rb.sizes >= 48).all() and (rb.sizes <= 96).all()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_concurrent_first_opens_keep_one_descriptor_per_shard_and_close_all(image_dataset):
    """Many threads open (and hash) the same shards at once: one descriptor each, every one closed."""
    ds = Dataset(image_dataset)
    gc.collect()  # objects of earlier tests (a Dataset holds its index map's descriptor) close theirs now
    before = _open_fds()
    reader = Reader(ds, ["jpg"], threads=8, verify=True)
    every = np.arange(len(ds))
    futures = [reader.submit(np.roll(every, 16 * (k % 3))) for k in range(24)]  # all threads start on a shard
    wait(futures)
    assert all(f.result().fields["jpg"][0].size > 0 for f in futures)
    assert _open_fds() - before == len(ds.shards)  # 3 shards: no duplicate left open by a lost race
    reader.close()
    assert _open_fds() == before
    with pytest.raises(RuntimeError, match="reader is closed"):
        reader.read(np.array([0]))
    assert _open_fds() == before


def test_a_shard_failing_verification_leaves_no_descriptor_open(image_dataset):
    shard = image_dataset / "shards" / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    ds = Dataset(image_dataset)  # holds one descriptor: its memory-mapped sample index
    gc.collect()
    before = _open_fds()
    with Reader(ds, ["cls"], verify=True) as reader:
        assert reader.read(np.array([0]))["cls"][0].size > 0  # shard 0 is fine
        for _ in range(2):  # a failed open is not cached: it fails again, naming the shard
            with pytest.raises(DatasetError, match="shard shard-000001.tar sha256 mismatch"):
                reader.read(np.array([16]))
        assert _open_fds() == before + 1
    assert _open_fds() == before


def test_first_uses_lists_each_shard_once_in_order_of_first_use_and_stops_when_all_seen():
    from fastio.read.reader import _first_uses

    def shard_of(idx):
        return np.asarray(idx) // 10

    batches = [np.array([35, 3, 31]), np.array([12, 0]), np.array([44]), np.array([1, 2])]
    assert list(_first_uses(shard_of, batches, shards=5)) == [3, 0, 1, 4]
    assert list(_first_uses(shard_of, [np.concatenate(batches)], shards=5)) == [3, 0, 1, 4]

    def endless():
        while True:
            yield np.array([7, 15])

    assert list(_first_uses(shard_of, endless(), shards=2)) == [0, 1]  # stops once every shard was seen
