"""The Reader: stored bytes by dataset-wide index, shard descriptors opened (and verified) once, none leaked."""

from __future__ import annotations

import gc
import io
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
def _shard_fds(root) -> list[str]:
    """The shard files of dataset ``root`` this process holds open, one entry per descriptor (descriptors of other
    files, which other threads of an xdist worker may open or close meanwhile, are not counted)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith(f"{root}/") and target.endswith(".tar"):
            held.append(target)
    return sorted(held)


def test_concurrent_first_opens_keep_one_descriptor_per_shard_and_close_all(image_dataset):
    """Many threads open (and hash) the same shards at once: one descriptor each, every one closed."""
    ds = Dataset(image_dataset)
    gc.collect()  # objects of earlier tests (a Dataset holds its index map's descriptor) close theirs now
    root = os.path.realpath(image_dataset)
    assert _shard_fds(root) == []
    reader = Reader(ds, ["jpg"], threads=8, verify=True)
    every = np.arange(len(ds))
    futures = [reader.submit(np.roll(every, 16 * (k % 3))) for k in range(24)]  # all threads start on a shard
    wait(futures)
    assert all(f.result().fields["jpg"][0].size > 0 for f in futures)
    held = _shard_fds(root)  # 3 shards: one descriptor each, no duplicate left open by a lost race
    assert len(held) == len(ds.shards) and len(set(held)) == len(held), held
    reader.close()
    assert _shard_fds(root) == []
    with pytest.raises(RuntimeError, match="reader is closed"):
        reader.read(np.array([0]))
    assert _shard_fds(root) == []


def test_threads_reading_the_same_shards_at_once_parse_each_index_once(image_dataset, monkeypatch):
    """The key CRCs of a shard (its ``.idx`` parsed for the tar-header check) are read by one thread; another that wants
    the same shard meanwhile waits for them instead of parsing the file again (a fresh reader's first batches)."""
    import threading
    import time

    parsed, lock = [], threading.Lock()
    slow = Dataset.key_crcs

    def key_crcs(self, shard):
        with lock:
            parsed.append(shard.name)
        time.sleep(0.05)  # long enough for every thread to want the shard while the first parses it
        return slow(self, shard)

    monkeypatch.setattr(Dataset, "key_crcs", key_crcs)
    ds = Dataset(image_dataset)
    with Reader(ds, ["cls"], threads=8) as reader:
        futures = [reader.submit(np.arange(len(ds))) for _ in range(8)]
        wait(futures)
        assert all(f.result().fields["cls"][0].size > 0 for f in futures)
    assert sorted(parsed) == sorted(s.name for s in ds.shards), parsed


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


def _swap_two_samples_in_place(folder) -> None:
    """Rewrite ``folder/0.tar`` (samples s00..s07 of equal sizes) with s02 and s03 swapped: same size, same
    offsets, each member under the other's name."""
    import io
    import tarfile

    path = folder / "0.tar"
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    swap = {"s02": "s03", "s03": "s02"}
    order = sorted(members, key=lambda m: (swap.get(m[0].split(".")[0], m[0].split(".")[0]), m[0]))
    size = path.stat().st_size
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in order:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert path.stat().st_size == size


def test_a_first_read_takes_only_the_keys_of_each_idx_not_a_whole_parse(tmp_path, capsys, monkeypatch):
    """The tar-header check wants each shard's keys: a fresh reader (the first batch after a restart) reads
    them from each ``.idx`` it touches (its sha256 checked) without parsing and checking every entry's ranges
    (issue 32: that whole parse was most of a fresh reader's extra time on the first batch). The check still
    catches a shard rewritten after indexing (the refusal's message then parses the .idx, once)."""
    import tarfile

    from helpers import run_cli

    import fastio.formats.dali_idx

    folder = tmp_path / "web"
    folder.mkdir()
    with tarfile.open(folder / "0.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(8):
            for field, data in (("cls", b"%d" % (i % 2)), ("txt", b"text of sample %02d" % i)):
                info = tarfile.TarInfo(f"s{i:02d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    code, _, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err

    def whole(*args, **kwargs):
        raise AssertionError("a whole .idx was parsed")

    monkeypatch.setattr(fastio.formats.dali_idx, "parse_index", whole)
    with Reader(Dataset(folder), ["txt"], threads=1) as reader:
        assert [b.tobytes() for b in reader.read(np.arange(8))["txt"]] == [b"text of sample %02d" % i
                                                                          for i in range(8)]
    _swap_two_samples_in_place(folder)
    with Reader(Dataset(folder), ["txt"], threads=1) as reader:
        assert reader.read(np.arange(2))["txt"][1].tobytes() == b"text of sample 01"
        monkeypatch.undo()  # the refusal names the key the index holds (Dataset.key: the whole .idx, once)
        with pytest.raises(DatasetError, match=r"key 's02': field 'txt': .* holds member 's03\.txt' of 17 bytes"):
            reader.read(np.arange(8))


def test_key_crcs_are_those_of_the_whole_parse_and_refusals_name_the_file_and_line(image_dataset):
    import hashlib
    import zlib

    from fastio.formats.dali_idx import key_crcs

    ds = Dataset(image_dataset)
    shard = ds.shards[1]
    data = shard.idx_path.read_bytes()
    got = key_crcs(data, samples=shard.samples, sha256=shard.idx_sha256, source="x.idx")
    assert got.dtype == np.uint32 and got.tolist() == [zlib.crc32(e.key.encode()) for e in ds.read_index(shard)]
    with pytest.raises(ValueError, match=r"^x\.idx: sha256 does not match the manifest"):
        key_crcs(data + b"\n", samples=shard.samples, sha256=shard.idx_sha256, source="x.idx")
    bad = data.replace(b".cls", b".txt", 1)  # the first member of the first line
    with pytest.raises(ValueError, match=r"^x\.idx:2: malformed index line \(member b'.*\.txt'\)"):
        key_crcs(bad, samples=shard.samples, sha256=hashlib.sha256(bad).hexdigest(), source="x.idx")
    with pytest.raises(ValueError, match=r"^x\.idx: header b'v1\.2 16' is not 'v1\.2 17'"):
        key_crcs(data, samples=17, sha256=shard.idx_sha256, source="x.idx")


def test_a_batch_of_repeats_mixed_image_fields_and_absent_optional_fields_reads_every_range(tmp_path):
    """Each (sample, field) range of a batch is its own stored bytes, in the batch's order: samples repeated (a padded
    batch), neighbours coalesced into one read and samples of other shards between them, each sample's image from
    the field it has, an optional field a sample lacks read as an empty array (``present`` False)."""
    from fastio.convert.synthetic import photo_jpeg
    from fastio.dataset.shards import ShardWriter

    rng, stored = np.random.default_rng(5), {}
    with ShardWriter(tmp_path / "ds", max_samples=5) as writer:
        for i in range(12):
            field = "png" if i % 3 == 1 else "jpg"
            sample = {field: photo_jpeg(rng, 40 + i, 30 + i) if field == "jpg" else _png(30 + i, 20 + i),
                      "cls": str(i % 4).encode()}
            if i % 2:
                sample["txt"] = f"caption {i}".encode()
            writer.write({"__key__": f"k{i:02d}", **sample})
            stored[i] = (field, sample)
        writer.close(image_field="jpg", label_field="cls", image_fields=["jpg", "png"])
    batch = np.array([3, 4, 5, 11, 0, 4, 4, 10, 1, 2, 9, 3])
    with Reader(Dataset(tmp_path / "ds"), ["cls", "txt"], threads=1, image=("jpg", "png"), sizes=True,
                optional=["txt"]) as reader:
        rb = reader.read_batch(batch)
    assert isinstance(rb.image, list) and all(isinstance(rb.fields[f], list) for f in ("cls", "txt"))
    for j, i in enumerate(batch.tolist()):
        field, sample = stored[i]
        assert rb.image_field[j] == field and rb.image[j].tobytes() == sample[field]
        assert rb.fields["cls"][j].tobytes() == sample["cls"]
        assert rb.fields["txt"][j].tobytes() == sample.get("txt", b"") and rb.present["txt"][j] == ("txt" in sample)
        assert rb.sizes[j].tolist() == ([40 + i, 30 + i] if field == "jpg" else [30 + i, 20 + i])
        assert not rb.image[j].flags.writeable  # as read: one consumer cannot change what another reads


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (w, h), (w, h, 7)).save(out, "PNG")
    return out.getvalue()


def test_a_pool_threads_start_up_wait_ends_when_a_thread_never_comes(monkeypatch):
    """``Reader.deferred`` starts the pool's threads, each waiting for the others; a pool that never makes the last
    one must not keep the others waiting (the interpreter's exit joins them): each wait ends after ``_START_WAIT``."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from fastio.read import reader as reader_module

    monkeypatch.setattr(reader_module, "_START_WAIT", 0.3)
    barrier = threading.Barrier(3)
    pool = ThreadPoolExecutor(2)  # three parties, two threads: the third never comes
    try:
        start = time.monotonic()
        waits = [pool.submit(reader_module._started, barrier) for _ in range(3)]
        for wait in waits:
            wait.result(timeout=10)
        assert barrier.broken and time.monotonic() - start < 5
    finally:
        barrier.abort()  # without the timeout: let the waiting threads go, so the test fails instead of hanging
        pool.shutdown(wait=False)
