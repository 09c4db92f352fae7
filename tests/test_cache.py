"""The node-local shard cache and s3:// datasets, against a real S3 server (moto) behind a fault-injecting proxy."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image_dataset
from helpers import spawn_ranks

from fastio import ImageEval, Loader, Raw
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, SHARDS_DIR
from fastio.errors import DatasetError, StorageError
from fastio.storage import open_storage
from fastio.storage.cache import CachedShardFiles, CacheEntry, ShardCache
from fastio.words import count

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_shards(tmp_path, image_folder) -> Path:
    """48 samples in 6 shards of 8."""
    return write_image_dataset(tmp_path / "local", image_folder, max_samples=8)


def upload(local: Path, url: str, options: dict) -> None:
    open_storage(url, options).publish_dir(local, keys_last=(MANIFEST_NAME,))


def shard_sizes(local: Path) -> list[int]:
    return [p.stat().st_size for p in sorted((local / SHARDS_DIR).glob("*.tar"))]


def raw_epoch(loader: Loader) -> dict[int, bytes]:
    out = {}
    for batch in loader:
        for i, data, pad in zip(batch["index"].tolist(), batch["jpg"], batch["padded"].tolist()):
            if not pad:
                assert i not in out, f"sample {i} delivered twice"
                out[i] = data
    return out


def test_epoch_through_a_cache_smaller_than_the_dataset_with_faults(moto_server, s3_bucket, fault_proxy, small_shards,
                                                                     tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    # Half of all requests fault (at most 2 in a row each): with ~10 GETs both kinds occur whatever order
    # the fills happen in (at a quarter, a run without a single cut was 1 in 10).
    fault_proxy.slowdown, fault_proxy.cut, fault_proxy.max_faults = 0.5, 0.5, 2
    sizes = shard_sizes(small_shards)
    bound = sum(sorted(sizes)[-3:])  # room for 3 of the 6 shards
    opts = dict(batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none", shard_read_ahead=1,
                reader_threads=1, cache_dir=str(tmp_path / "cache"), cache_size=bound,  # 2 shards + 1 read ahead
                storage_options=moto_server.options(fault_proxy.endpoint, backoff_s=0.01))
    local = raw_epoch(Loader(small_shards, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none"))
    cache = ShardCache(tmp_path / "cache", bound)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], cache.usage()[0])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with Loader(url, **opts) as loader:
            assert loader.dataset.root == url
            got = raw_epoch(loader)
            stats = loader.stats()["storage"]
    finally:
        stop.set()
        watcher.join()
    assert got == local and len(got) == 48  # every sample exactly once, the stored bytes
    assert 0 < peak[0] <= bound and cache.usage()[0] <= bound
    assert stats["waited_fills"] + stats["ahead_fills"] >= 6 and stats["retries"] > 0
    assert fault_proxy.counts["slowdown"] > 0 and fault_proxy.counts["cut"] > 0


def test_global_shuffle_matches_the_local_dataset_and_second_epoch_is_warm(moto_server, s3_bucket, small_shards,
                                                                          tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    common = dict(batch_size=6, device="cpu", pipeline=ImageEval(size=32), seed=3)
    remote = Loader(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB", storage_options=moto_server.options(),
                    **common)
    local = Loader(small_shards, **common)
    assert remote.dataset.fingerprint == local.dataset.fingerprint
    for _ in range(2):
        for a, b in zip(remote, local, strict=True):
            assert a["index"].tolist() == b["index"].tolist()
            assert bool((a["image"] == b["image"]).all()) and a["label"].tolist() == b["label"].tolist()
    stats = remote.stats()["storage"]
    assert stats["waited_fills"] + stats["ahead_fills"] == 6 and stats["bytes_downloaded"] == sum(shard_sizes(
        small_shards))
    assert stats["hits"] > 0
    remote.close()


def _read_through_cache(url: str, cache: str, options: dict, out: str) -> None:
    """In a process of its own: one epoch of ``url`` through the node cache at ``cache``; into ``out``, the samples
    it read and the shards it downloaded."""
    with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), cache_dir=cache,
                cache_size="1GB", storage_options=options, num_threads=1) as loader:
        n = sum(int((~b["padded"]).sum()) for b in loader)
        s = loader.stats()["storage"]
    Path(out).write_text(json.dumps({"samples": n, "downloads": s["waited_fills"] + s["ahead_fills"]}))


def test_two_processes_sharing_a_cache_download_each_shard_once(moto_server, s3_bucket, fault_proxy, small_shards,
                                                                 tmp_path):
    """Two processes at once (``spawn_ranks``: forked from the forkserver that imported torch once) read the same
    dataset through one cache directory."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    fault_proxy.slowdown, fault_proxy.cut = 0.2, 0.2
    options = moto_server.options(fault_proxy.endpoint, backoff_s=0.01)
    spawn_ranks(_read_through_cache, lambda r: (url, str(tmp_path / "cache"), options, str(tmp_path / f"read{r}.json")),
                2, timeout=240)
    results = [json.loads((tmp_path / f"read{r}.json").read_text()) for r in range(2)]
    assert [r["samples"] for r in results] == [48, 48]
    assert sum(r["downloads"] for r in results) == 6  # each of the 6 shards downloaded once on the node
    assert ShardCache(tmp_path / "cache").usage() == (sum(shard_sizes(small_shards)), 6)


def test_a_corrupted_object_is_detected_and_named(moto_server, s3_bucket, fault_proxy, small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    fault_proxy.slowdown, fault_proxy.cut = 0.2, 0.2
    name = sorted(p.name for p in (small_shards / SHARDS_DIR).glob("*.tar"))[2]
    data = bytearray((small_shards / SHARDS_DIR / name).read_bytes())
    data[700] ^= 0xFF  # same size, other bytes
    open_storage(url, moto_server.options()).put_bytes(f"{SHARDS_DIR}/{name}", bytes(data))  # behind fastio's back
    loader = Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none",
                    cache_dir=str(tmp_path / "cache"),
                    storage_options=moto_server.options(fault_proxy.endpoint, backoff_s=0.01))
    with pytest.raises(StorageError, match=rf"{url}/shards/{name}: shard {name} does not match the manifest after 2 "
                                           r"downloads \(manifest xxh3_128 "):
        raw_epoch(loader)
    loader.close()
    assert fault_proxy.counts["slowdown"] + fault_proxy.counts["cut"] > 0
    objects = tmp_path / "cache" / "objects"
    good = {e.sha256 + ".tar" for e in _entries(small_shards) if e.name != name}
    assert not list(objects.glob("*.tmp")) and {p.name for p in objects.glob("*.tar")} <= good  # never the bad one
    # a shard whose size differs from the manifest is refused when the dataset is opened
    open_storage(url, moto_server.options()).put_bytes(f"{SHARDS_DIR}/{name}", bytes(data[:-1]))
    with pytest.raises(DatasetError, match=rf"{url}/shards/{name}: shard {name} is \d+ bytes, the manifest says"):
        Dataset(url, cache_dir=tmp_path / "cache", storage_options=moto_server.options())


def test_verify_checks_a_cached_copy_damaged_on_the_nodes_disk(moto_server, s3_bucket, small_shards, tmp_path):
    """A cache fill checks what it downloads, but a copy already in the cache was served unchecked also with
    verify=True: damage on the node's disk reached training. verify=True now checks each cached copy at its
    first use, naming the shard and the copy."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())

    def make(verify: bool) -> Loader:
        return Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none", verify=verify,
                      cache_dir=str(tmp_path / "cache"), storage_options=moto_server.options())

    with make(False) as loader:
        want = raw_epoch(loader)  # every shard now in the cache
    entry = _entries(small_shards)[1]
    cached = tmp_path / "cache" / "objects" / f"{entry.sha256}.tar"
    data = bytearray(cached.read_bytes())
    data[700] ^= 0xFF  # same size, other bytes
    os.chmod(cached, 0o644)
    cached.write_bytes(bytes(data))
    with make(True) as loader, pytest.raises(DatasetError, match=rf"shard {entry.name} sha256 mismatch \(cached copy "
                                                                 rf"{cached}\)"):
        raw_epoch(loader)
    assert want  # the same loader without the damage read every sample


def test_a_cached_copy_cut_short_on_the_nodes_disk_is_filled_again(moto_server, s3_bucket, small_shards, tmp_path,
                                                                     caplog):
    """Before: a cached copy cut short on the node's disk (a crash, a full disk, a hand copy) stayed in the cache and
    failed every later run with 'shard shard-000001.tar key ...: field 'jpg' is truncated', words that blame the
    dataset (whose `fastio verify` then passes). The size is checked at open (one fstat): such a copy is dropped,
    named in one warning, and filled again from the store; the epoch is the whole dataset."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())

    def epoch() -> dict[int, bytes]:
        with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none",
                    cache_dir=str(tmp_path / "cache"), storage_options=moto_server.options()) as loader:
            return raw_epoch(loader)

    want = epoch()
    entry = _entries(small_shards)[1]
    cached = tmp_path / "cache" / "objects" / f"{entry.sha256}.tar"
    for size in (entry.size // 2, 0):
        os.chmod(cached, 0o644)
        os.truncate(cached, size)
        caplog.clear()
        assert epoch() == want
        assert cached.read_bytes() == (small_shards / SHARDS_DIR / entry.name).read_bytes()
        said = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
        assert said == [f"{url}/{SHARDS_DIR}/{entry.name}: the cached copy {cached} is {count(size, 'byte')}, the "
                        f"manifest says {entry.size} (cut short on this node's disk): filled again"], said


def test_missing_dataset_and_missing_shard_name_the_url(moto_server, s3_bucket, small_shards, tmp_path):
    opts = dict(cache_dir=tmp_path / "cache", storage_options=moto_server.options())
    with pytest.raises(DatasetError, match=rf"^s3://{s3_bucket}/none: no such dataset directory$"):
        Dataset(f"s3://{s3_bucket}/none", **opts)
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    open_storage(url, moto_server.options()).delete(f"{SHARDS_DIR}/shard-000001.tar")
    with pytest.raises(DatasetError, match=rf"{url}: shard file shard-000001.tar is missing"):
        Dataset(url, **opts)


def _entries(local: Path) -> list[CacheEntry]:
    import hashlib

    out = []
    for p in sorted((local / SHARDS_DIR).glob("*.tar")):
        data = p.read_bytes()
        out.append(CacheEntry(p.name, f"{SHARDS_DIR}/{p.name}", hashlib.sha256(data).hexdigest(), len(data)))
    return out


def test_eviction_is_lru_never_takes_a_shard_in_use_nor_foreign_files(moto_server, s3_bucket, small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)
    cdir = tmp_path / "cache"
    bound = entries[0].size + entries[1].size + max(e.size for e in entries[2:]) - 1  # 2 shards fit, not 3
    cache = ShardCache(cdir, bound, wait_s=30)
    foreign = cdir / "objects" / "my-notes.txt"
    foreign.write_text("not the cache's")
    files = CachedShardFiles(cache, storage, entries, depth=0)
    fd0 = files.acquire(0)
    files.acquire(1)
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"no room for shard shard-000002.tar .* held by this process's own shards "
                                           r"in use \(the reader's working set: raise cache_size"):
        files.acquire(2)  # both cached shards are in use by this process: nothing may be evicted, waiting is vain
    assert time.monotonic() - started < 5  # at once, not after wait_s (issue 20)
    files.release(1)
    files.acquire(2)  # shard 1 (not in use) is evicted, shard 0 (in use) stays
    assert cache.path(entries[0].sha256).exists() and not cache.path(entries[1].sha256).exists()
    assert os.pread(fd0, 512, 0)[:9] == (small_shards / SHARDS_DIR / entries[0].name).read_bytes()[:9]
    files.release(0)
    files.release(2)
    os.utime(cache.path(entries[0].sha256), (1, 1))  # used long ago: the LRU choice
    files.acquire(3)
    files.release(3)
    assert not cache.path(entries[0].sha256).exists() and cache.path(entries[2].sha256).exists()
    assert foreign.read_text() == "not the cache's" and cache.usage()[0] <= bound
    files.close()


def test_a_fill_waits_only_for_room_other_processes_hold_and_says_so(moto_server, s3_bucket, small_shards, tmp_path,
                                                                     caplog):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)
    bound = entries[0].size + entries[1].size + max(e.size for e in entries[2:]) - 1  # 2 shards fit, not 3
    cache = ShardCache(tmp_path / "cache", bound, wait_s=0.5)
    files = CachedShardFiles(cache, storage, entries, depth=0)
    for i in (0, 1):
        files.acquire(i)
        files.release(i)
    files.close()
    paths = [str(cache.path(e.sha256)) for e in entries[:2]]
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fds = [os.open(p, os.O_RDONLY) for p in {paths!r}]
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_SH)
        print("held", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        files = CachedShardFiles(cache, storage, entries, depth=0)
        with pytest.raises(StorageError, match=r"no room for shard shard-000002.tar .* held by other processes' "
                                               r"shards in use for 0s"):
            files.acquire(2)
        assert "held by other processes' shards in use" in caplog.text
    finally:
        holder.stdin.close()
        holder.wait()
    files.acquire(2)  # the other process is gone: its shards are evicted
    files.close()


def test_a_loader_refuses_a_cache_smaller_than_its_working_set_at_once(moto_server, s3_bucket, small_shards, tmp_path):
    """Issue 20: 9 shards, cache_size at 60% of the data, default global shuffle: a StorageError after 240 s.
    Now the Loader refuses at construction, naming cache_size, the bytes needed and the block_shards that fits."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    sizes = shard_sizes(small_shards)
    bound = int(sum(sizes) * 0.6)
    opts = dict(batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), cache_dir=str(tmp_path / "cache"),
                cache_size=bound, storage_options=moto_server.options(), shard_read_ahead=1, reader_threads=1)
    started = time.monotonic()
    assert sum(sorted(sizes)[::-1][:3]) <= bound < sum(sorted(sizes)[::-1][:4])  # 3 of the 6 shards fit, not 4
    with pytest.raises(StorageError, match=rf"{url}: cache_size .* cannot hold what shuffle='global' reads at once: "
                                           r".* \(every shard.*\); use shuffle='block' with block_shards <= 1, "
                                           "or raise cache_size"):
        Loader(url, **opts)
    with pytest.raises(StorageError, match=r"shuffle='block' reads at once: .* \(the largest shards of 1 batch of 8 "
                                           r"samples read at once, each touching up to 6 shards of the windows of 3 it "
                                           r"spans: a batch crossing into the next window holds shards of both\); "
                                           r"use block_shards <= 1, or raise"):
        Loader(url, shuffle="block", block_shards=3, **opts)
    with pytest.raises(StorageError, match=r"up to 4 shards of the windows of 2"):  # one window + read-ahead fit: it
        Loader(url, shuffle="block", block_shards=2, **opts)  # passed, then failed where a batch crossed windows
    assert time.monotonic() - started < 10
    local = raw_epoch(Loader(small_shards, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",))))
    with Loader(url, shuffle="block", block_shards=1, **opts) as loader:
        assert raw_epoch(loader) == local


def test_mixture_sources_sharing_a_cache_are_checked_together(moto_server, s3_bucket, small_shards, tmp_path):
    """Each of two s3:// sources fit the cache alone, so the mixture was made; together they did not, and the
    epoch thrashed the cache (3.3x the bytes downloaded), waiting for room 'held by other processes'."""
    from fastio import Mixture

    urls = {name: f"s3://{s3_bucket}/{name}" for name in ("a", "b")}
    for url in urls.values():
        upload(small_shards, url, moto_server.options())
    total = sum(shard_sizes(small_shards))

    def mixture(cache_size: int) -> Mixture:
        return Mixture(urls, cache_dir=tmp_path / "cache", cache_size=cache_size, storage_options=moto_server.options())

    with pytest.raises(StorageError, match=r"mixture sources 'a', 'b' read through one cache .* at the same time: "
                                           r"cache_size .* cannot hold their working sets together"):
        Loader(mixture(total + total // 2), batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)))
    with Loader(mixture(2 * total), batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",))) as loader:
        seen = [(int(s), int(i)) for b in loader for s, i in zip(b["source"], b["index"])]
        assert len(seen) == len(set(seen)) == len(loader) * 8 - int(loader.stats().get("padded", 0))
        by_source = loader.stats()["storage_by_source"]
    # the sources hold the same shards (the cache keys them by checksum): each downloaded once, no thrashing
    assert by_source["a"]["bytes_downloaded"] + by_source["b"]["bytes_downloaded"] == total


def test_the_cache_size_suggested_is_enough_for_the_mode_it_is_suggested_for():
    """Ten shards of 100 bytes, cache_size 150, 2 shards read ahead: not even block_shards=1 fits (two windows:
    200 bytes; the read-ahead shrinks to the room left). The hint named the cache_size of block_shards=1 as
    the one for shuffle='global', which needs 1000."""
    from fastio.progress import human_bytes
    from fastio.read.working_set import Reading, Shards, check_working_set

    shards = Shards([100] * 10, [10] * 10)  # batches of 10 read one at a time: two windows of block_shards
    for shuffle, block_shards, need in (("global", 4, 1000), ("block", 4, 800)):
        with pytest.raises(StorageError) as err:
            check_working_set(shards, Reading(shuffle, block_shards, 10), 2, 150, "s3://b/ds")
        hint = str(err.value).split("; ", 1)[1]
        assert hint.startswith(f"raise cache_size to at least {human_bytes(need)}, or use "), hint
        assert hint.endswith(f"block_shards=1 with cache_size at least {human_bytes(200)}"), hint
    with pytest.raises(StorageError, match=f"; raise cache_size to at least {human_bytes(200)}$"):
        check_working_set(shards, Reading("block", 1, 10), 2, 150, "s3://b/ds")
    with pytest.raises(StorageError, match="cache_size 499999 bytes cannot hold .* at once: 500000 bytes"):
        check_working_set(Shards([100_000] * 5, [1] * 5), Reading("global", 1, 1), 2, 499_999, "s3://b/ds")


def test_a_non_cache_directory_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.bin").write_bytes(b"x")
    with pytest.raises(StorageError, match=r"data: cache_dir is not empty and is not a fastio cache"):
        ShardCache(tmp_path / "data", "1GB")
    with pytest.raises(ValueError, match="cache_size: cannot read 'lots'"):
        ShardCache(tmp_path / "c", "lots")


_KILLED_FILLER = textwrap.dedent("""
    import fcntl, os, sys, time
    from pathlib import Path
    from fastio.storage.cache import ShardCache
    cache, sha, size = ShardCache(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    lock = os.open(cache.objects / f".{sha}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    tmp = cache.objects / f".{sha}.tar.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT)
    os.ftruncate(fd, size)
    os.pwrite(fd, b"partial", 0)
    print("filling", flush=True)
    time.sleep(600)
""")


def test_a_filler_killed_mid_fill_leaves_no_stale_lock_or_space(moto_server, s3_bucket, small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entry = _entries(small_shards)[0]
    cdir = tmp_path / "cache"
    ShardCache(cdir, "1GB")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_FILLER, str(cdir), entry.sha256, str(entry.size)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert child.stdout.readline().strip() == "filling"
        cache = ShardCache(cdir, "1GB")
        assert cache.usage() == (entry.size, 1)  # the live filler's reservation counts
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    t = time.monotonic()
    assert cache.fill(storage, entry)  # the lock died with its holder: no wait, the shard is downloaded
    assert time.monotonic() - t < 10
    assert cache.path(entry.sha256).read_bytes() == (small_shards / SHARDS_DIR / entry.name).read_bytes()
    assert cache.usage() == (entry.size, 1) and not list(cache.objects.glob("*.tmp"))
    # and a tmp left by a killed filler of a shard nobody asks for again is reclaimed by the next scan
    other = _entries(small_shards)[1]
    child = subprocess.Popen([sys.executable, "-c", _KILLED_FILLER, str(cdir), other.sha256, str(other.size)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert child.stdout.readline().strip() == "filling"
    child.send_signal(signal.SIGKILL)
    child.wait()
    cache.fill(storage, _entries(small_shards)[2])
    assert not list(cache.objects.glob("*.tmp")) and cache.usage()[1] == 2


def test_read_ahead_fetches_in_the_order_the_sampler_wants(moto_server, s3_bucket, small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)
    cache = ShardCache(tmp_path / "cache", "1GB")
    files = CachedShardFiles(cache, storage, entries, depth=2)
    order = [4, 1, 5, 0, 3, 2]
    files.read_ahead(iter(order))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and files.stats.ahead_fills < 2:
        time.sleep(0.02)
    time.sleep(0.3)
    present = [i for i in range(6) if cache.path(entries[i].sha256).exists()]
    assert sorted(present) == sorted(order[:2])  # 2 shards beyond the furthest acquired (none yet)
    files.release(files.acquire(4) and 4)
    files.release(files.acquire(1) and 1)  # furthest acquired is position 1: fill up to position 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and files.stats.ahead_fills < 4:
        time.sleep(0.02)
    time.sleep(0.3)
    assert sorted(i for i in range(6) if cache.path(entries[i].sha256).exists()) == sorted(order[:4])
    assert files.stats.hits == 2 and files.stats.waited_fills == 0
    files.close()
    assert np.all([cache.path(entries[i].sha256).read_bytes() == (small_shards / SHARDS_DIR / entries[i].name)
                   .read_bytes() for i in order[:4]])


def test_many_processes_opening_a_new_cache_at_once(tmp_path):
    code = "import sys; from fastio.storage.cache import ShardCache; ShardCache(sys.argv[1], '1GB')"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "new")], stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO))) for _ in range(6)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-500:]
    assert (tmp_path / "new" / ".fastio-cache").is_file()


def test_a_large_shard_is_filled_with_parallel_ranged_gets(moto_server, s3_bucket, fault_proxy, tmp_path):
    import hashlib

    fault_proxy.slowdown, fault_proxy.cut = 0.3, 0.3
    data = os.urandom(12 << 20)
    store = open_storage(f"s3://{s3_bucket}/big", moto_server.options(fault_proxy.endpoint, part_size=5 << 20,
                                                                      backoff_s=0.01))
    store.put_bytes("shards/big.tar", data)
    entry = CacheEntry("big.tar", "shards/big.tar", hashlib.sha256(data).hexdigest(), len(data))
    cache = ShardCache(tmp_path / "cache", "1GB")
    before = fault_proxy.counts["requests"]
    assert cache.fill(store, entry)
    assert cache.path(entry.sha256).read_bytes() == data
    assert fault_proxy.counts["requests"] - before >= 3  # 3 ranges of 5 MiB (and their retries)
    bad = CacheEntry("big.tar", "shards/big.tar", "0" * 64, len(data))
    with pytest.raises(StorageError, match=r"shard big.tar does not match the manifest after 2 downloads"):
        cache.fill(store, bad)
    assert not list(cache.objects.glob("*.tmp"))


def test_a_released_shard_is_kept_open_briefly_then_evictable_by_another_process(moto_server, s3_bucket,
                                                                                   small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)
    cache = ShardCache(tmp_path / "cache", 10**9)
    files = CachedShardFiles(cache, storage, entries, depth=0, keep_open_s=0.3)
    fd = files.acquire(0)
    files.release(0)
    assert files.acquire(0) == fd and files.stats.hits == 1  # the same descriptor, not reopened
    files.release(0)
    path = cache.path(entries[0].sha256)
    # still held: an evictor (the exclusive flock another process would take) cannot have it yet ...
    probe = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        deadline = time.monotonic() + 5
        while True:  # ... until the timer lets it go
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the idle shard was never released"
                time.sleep(0.05)
    finally:
        os.close(probe)
    files.close()


def test_fills_of_a_manifest_without_xxh3_are_checked_with_sha256(moto_server, s3_bucket, small_shards, tmp_path):
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)  # as a manifest written before fastio recorded xxh3-128: sha256 only
    assert all(e.xxh3_128 is None and e.check == ("sha256", e.sha256) for e in entries)
    cache = ShardCache(tmp_path / "cache", 10**9)
    assert cache.fill(storage, entries[0]) and cache.path(entries[0].sha256).read_bytes() == \
        (small_shards / SHARDS_DIR / entries[0].name).read_bytes()
    wrong = dataclasses.replace(entries[1], sha256="0" * 64)
    with pytest.raises(StorageError, match=r"does not match the manifest after 2 downloads \(manifest sha256 0000"):
        cache.fill(storage, wrong)


def test_two_threads_opening_one_shard_while_the_other_releases_it_leak_no_descriptor(moto_server, s3_bucket,
                                                                                     small_shards, tmp_path):
    """Thread B opens shard 0 while thread A acquires and releases it (A's descriptor kept open idle): B's
    acquire must not leave A's idle descriptor behind (a leaked one keeps its shared lock: the shard could never be
    evicted, and a small cache waits for room until it gives up)."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    storage = open_storage(url, moto_server.options())
    entries = _entries(small_shards)
    cache = ShardCache(tmp_path / "cache", 10**9)
    files = CachedShardFiles(cache, storage, entries, depth=0, keep_open_s=30)
    opening, go = threading.Event(), threading.Event()
    real_open = files._open_entry

    def slow_open(i):  # B's open, held until A has acquired and released the same shard
        fd = real_open(i)
        opening.set()
        go.wait(10)
        return fd

    files._open_entry = slow_open
    b = threading.Thread(target=lambda: files.release(files.acquire(0) and 0))
    b.start()
    assert opening.wait(10)
    files._open_entry = real_open
    files.acquire(0)
    files.release(0)  # A's descriptor is now kept open, idle
    go.set()
    b.join(10)
    files.close()
    path = str(cache.path(entries[0].sha256))
    left = [fd for fd in os.listdir("/proc/self/fd") if _link(fd) == path]
    assert not left, f"descriptors of shard 0 left open after close: {left}"


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _modes_bind() -> list[str]:
    """A command prefix under which a directory's mode bits refuse writes (as root, the override of them
    dropped with ``setpriv``); skips where that cannot be had."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    if not shutil.which("setpriv") or subprocess.run([*prefix, "true"]).returncode != 0:
        pytest.skip("root without setpriv: a read-only directory cannot be made")
    return prefix


@pytest.mark.parametrize("read_only", ["objects", "meta", "meta-folder"])
def test_a_cache_dir_that_cannot_be_written_is_one_line_naming_it(aws_env, s3_bucket, small_shards, tmp_path,
                                                                  read_only):
    """Before: a cache whose shard folder (``objects``) or metadata folder (``meta``, or the dataset's folder in
    it) was read-only made `fastio inspect` and the Loader fail with a raw PermissionError traceback naming a
    temporary or lock file. Now: one line naming cache_dir (and the shard's URL for a fill), exit 2, nothing
    left behind."""
    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, {})
    cache = tmp_path / "cache"
    if read_only == "meta-folder":  # the dataset's metadata already there from an earlier run, then made read-only
        with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none",
                    cache_dir=cache) as loader:
            next(iter(loader))
        folder = next((cache / "meta").iterdir())
        for path in [*folder.rglob("*"), folder]:
            path.chmod(0o555 if path.is_dir() else 0o444)
    else:
        ShardCache(cache)
        (cache / read_only).chmod(0o555)
    before = sorted(p.name for p in (cache / "objects").iterdir())
    try:
        proc = subprocess.run([*_modes_bind(), sys.executable, "-m", "fastio.cli", "inspect", url, "--cache-dir",
                               str(cache)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        for path in cache.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("fastio: error: ") and f"cache_dir {cache}" in proc.stderr
    assert "Permission denied" in proc.stderr
    if read_only == "objects":
        assert f"{url}/shards/shard-000000.tar" in proc.stderr
    assert sorted(p.name for p in (cache / "objects").iterdir()) == before and not list(cache.rglob("*.tmp"))


def test_a_cache_dir_too_full_for_a_shard_is_named_and_keeps_nothing(moto_server, s3_bucket, small_shards, tmp_path):
    """Before: a fill that the disk could not hold (here: the file size limit, a quota-free stand-in for a full
    disk) raised a raw OSError from the Loader. Now a StorageError names the shard's URL and cache_dir, and no
    partial copy is left."""
    import resource

    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    cache = tmp_path / "cache"
    smallest = min(shard_sizes(small_shards))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (smallest // 2, hard))
    try:
        with pytest.raises(StorageError) as info:
            with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none",
                        shard_read_ahead=0, cache_dir=cache, storage_options=moto_server.options()) as loader:
                next(iter(loader))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert f"{url}/shards/shard-000000.tar: " in str(info.value) and f"cache_dir {cache}" in str(info.value)
    assert "File too large" in str(info.value)
    assert not [p for p in (cache / "objects").iterdir() if p.name.endswith((".tar", ".tmp"))]


def test_a_url_given_as_cache_dir_is_refused_not_made_a_local_folder(moto_server, aws_env, s3_bucket, small_shards,
                                                                    tmp_path, monkeypatch, capsys):
    """Before: cache_dir='s3://bucket/cache' (or --cache-dir s3://...) filled a local folder 's3:/bucket/cache' in the
    working directory, and 'file:///abs/path' one named 'file:'. Now an object-store URL is refused naming
    cache_dir, and a file:// URL is its path."""
    from helpers import run_cli

    url = f"s3://{s3_bucket}/ds"
    upload(small_shards, url, moto_server.options())
    monkeypatch.chdir(tmp_path)
    for bad in (f"s3://{s3_bucket}/cache", Path(f"s3://{s3_bucket}/cache"), "gs://bucket/cache"):
        with pytest.raises(StorageError, match=r"^cache_dir .*: must be a local directory \(a path, or "
                                               r"file:///absolute/path\), not a URL$"):
            Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), cache_dir=bad,
                   storage_options=moto_server.options())
    code, _, err = run_cli(["inspect", url, "--cache-dir", f"s3://{s3_bucket}/cache"], capsys)
    assert code == 2 and err.startswith("fastio: error: cache_dir s3:/") and err.count("\n") == 1, err
    with Loader(url, batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), cache_dir=f"file://{tmp_path}/c",
                storage_options=moto_server.options()) as loader:
        assert len(raw_epoch(loader)) == 48
    assert (tmp_path / "c" / ".fastio-cache").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(":")]  # no folder 's3:' or 'file:'
