"""The cache room an s3:// Loader needs (fastio/read/working_set.py), against a real S3 server (moto): the shard
read-ahead shrinks to the room the cache has; only a cache that cannot hold a batch's own shards is refused;
two Loaders of one process on one cache are checked together."""

from __future__ import annotations

import gc
import logging
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image_dataset

from fastio import Loader, Mixture, Raw
from fastio.dataset.manifest import MANIFEST_NAME, SHARDS_DIR
from fastio.errors import StorageError
from fastio.progress import human_bytes, parse_size
from fastio.read.working_set import Reading, Shards, check_working_set
from fastio.storage import open_storage

OPTS = dict(batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="block", block_shards=2,
            reader_threads=1)  # one batch read at once: 4 shards (two windows)


@pytest.fixture
def shards(tmp_path, image_folder) -> Path:
    """48 samples in 6 shards of 8."""
    return write_image_dataset(tmp_path / "local", image_folder, max_samples=8)


def _upload(local: Path, url: str, options: dict) -> None:
    open_storage(url, options).publish_dir(local, keys_last=(MANIFEST_NAME,))


def _largest(local: Path, count: int) -> int:
    return sum(sorted((p.stat().st_size for p in (local / SHARDS_DIR).glob("*.tar")), reverse=True)[:count])


def _epoch(loader: Loader) -> dict[int, bytes]:
    return {i: data for b in loader for i, data, pad in zip(b["index"].tolist(), b["jpg"], b["padded"].tolist())
            if not pad}


def _shrunk(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "shard_read_ahead" in r.getMessage()]


def test_a_cache_without_room_for_the_read_ahead_shrinks_it_with_one_warning(moto_server, s3_bucket, shards, tmp_path,
                                                                             caplog):
    """Issue 32.5: a cache that holds two windows of block_shards=2 (4 shards) but not the 2 shards read ahead
    on top was refused ('cannot hold ... (two windows ... + 2 read ahead)'). Now the read-ahead shrinks to the
    one shard that fits, one warning line says so, and the epoch is the local dataset's."""
    url = f"s3://{s3_bucket}/ds"
    _upload(shards, url, moto_server.options())
    local = _epoch(Loader(shards, **OPTS))
    caplog.set_level(logging.WARNING, logger="fastio")
    size = _largest(shards, 5)  # two windows + 1 shard, not + 2
    with Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=size, storage_options=moto_server.options(),
                **OPTS) as loader:
        assert _epoch(loader) == local
    assert _shrunk(caplog) == [f"{url}: shard_read_ahead 2 shrunk to 1: cache_size {human_bytes(size)} holds what "
                               f"shuffle='block' reads at once ({human_bytes(_largest(shards, 4))}) but not 2 more "
                               "shards read ahead (raise cache_size, or set shard_read_ahead=1 to silence this)"]
    with pytest.raises(StorageError, match=rf"{url}: cache_size .* cannot hold what shuffle='block' reads at once: "
                                           r".* \(the largest shards of 1 batch of 8 samples read at once, each "
                                           r"touching up to 4 shards of the windows of 2 it spans: a batch crossing "
                                           r"into the next window holds shards of both\); use block_shards <= 1, or "
                                           r"raise cache_size to at least"):
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=_largest(shards, 4) - 1,
               storage_options=moto_server.options(), **OPTS)


def test_mixture_sources_sharing_a_cache_shrink_their_read_ahead_together(moto_server, s3_bucket, shards, tmp_path,
                                                                           caplog):
    """Two sources through one cache with room for both sources' two windows and no read-ahead: made, with one
    warning for the shared cache (none for each source alone, whose own check then fits), and an epoch of both
    sources, each sample once."""
    urls = {name: f"s3://{s3_bucket}/{name}" for name in ("a", "b")}
    for url in urls.values():
        _upload(shards, url, moto_server.options())
    caplog.set_level(logging.WARNING, logger="fastio")
    mixture = Mixture(urls, cache_dir=tmp_path / "cache", cache_size=2 * _largest(shards, 4),
                      storage_options=moto_server.options())
    # one reader thread each; a source's part of the padded last batch spans two stretches of its order: 2 x 2
    # windows of 1 shard
    with Loader(mixture, **dict(OPTS, block_shards=1, reader_threads=2)) as loader:
        seen = [(int(s), int(i)) for b in loader for s, i, pad in zip(b["source"], b["index"], b["padded"]) if not pad]
    assert len(seen) == len(set(seen)) == loader.mixture.samples_per_epoch
    assert {s for s, _ in seen} == {0, 1}
    assert len(_shrunk(caplog)) == 1 and "shard_read_ahead 2 shrunk to 0" in _shrunk(caplog)[0], caplog.text


def test_the_read_ahead_that_fits_is_returned_and_only_the_batches_own_shards_are_refused(caplog):
    """Ten shards of 100 bytes and 10 samples, batches of 10 read one at a time, block_shards=1 (two windows: 200
    bytes), 2 read ahead (400 bytes in all)."""
    shards = Shards([100] * 10, [10] * 10)
    block, none = Reading("block", 1, 10), Reading("none", 1, 10)
    assert [check_working_set(shards, block, 2, room, "s3://b/ds") for room in (200, 399, 400, 10_000)] == [0, 1, 2, 2]
    assert check_working_set(shards, Reading("global", 1, 10), 7, 1000, "s3://b/ds") == 7  # every shard is held
    with pytest.raises(StorageError, match=r"cache_size 199 B cannot hold .* 200 B .*; raise cache_size to at least 200 B$"):
        check_working_set(shards, block, 2, 199, "s3://b/ds")
    assert check_working_set(shards, none, 10**9, 10**9, "s3://b/ds") == 10**9  # a deep read-ahead: no loop over it


def test_a_refusal_at_a_million_shards_comes_at_once_and_names_the_largest_block_shards_that_fits():
    """The refusal's hint tried every block_shards from 1 to the shard count, sorting all shard sizes for each: at
    the 10^5 shards of docs/scaling.md a rank spent minutes (quadratic) before its one line; at 10^6, hours."""
    code = ("from fastio.read.working_set import check_working_set\n"
            "from fastio.read.working_set import Reading, Shards\n"
            "try:\n    check_working_set(Shards([10**6] * 10**6, [100] * 10**6), Reading('global', 4, 100), 2, 5 * 10**6, "
            "'s3://b/ds')\n"
            "except Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.endswith("cache_size 5.0 MB cannot hold what shuffle='global' reads at once: 1.0 TB (every shard: a "
                        "global shuffle draws each batch from the whole dataset); use shuffle='block' with "
                        "block_shards <= 2, or raise cache_size to at least 1.0 TB\n"), out
    rng = random.Random(0)
    for _ in range(200):  # ragged shards: the largest block_shards whose two largest windows fit, as named
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(2, 12))]
        room = rng.randint(1, sum(sizes) - 1)
        fits = [b for b in range(1, len(sizes) + 1) if sum(sorted(sizes)[::-1][:2 * b]) <= room]
        with pytest.raises(StorageError) as err:
            check_working_set(Shards(sizes, [1000] * len(sizes)), Reading("global", 1, 1000), 0, room, "s3://b/ds")
        named = f"block_shards <= {max(fits)}," if fits else "block_shards <="
        assert (named in str(err.value)) == bool(fits), (sizes, room, str(err.value))


def test_two_loaders_of_one_process_are_checked_together_on_one_cache(moto_server, s3_bucket, image_folder,
                                                                      tmp_path):
    """Each Loader's working set fits the cache alone, not both: the second is refused when it is made, naming
    the first (before: both were made, and their fills waited 2 x 120 s for room 'held by other processes').
    A closed (or dropped) Loader frees its claim."""
    opts = moto_server.options()
    urls = []
    for name in ("a", "b"):
        url = f"s3://{s3_bucket}/{name}"
        local = write_image_dataset(tmp_path / name, image_folder, max_samples=8)  # 6 shards of 8
        open_storage(url, opts).publish_dir(local, keys_last=(MANIFEST_NAME,))
        urls.append(url)
    largest = max(p.stat().st_size for p in (tmp_path / "a" / "shards").glob("*.tar"))
    cache = dict(cache_dir=str(tmp_path / "cache"), cache_size=3 * largest)  # one working set: 2 shards
    kw = dict(batch_size=8, device="cpu", pipeline=Raw(fields=("jpg",)), shuffle="none", shard_read_ahead=0,
              reader_threads=1, storage_options=opts, **cache)
    first = Loader(urls[0], **kw)
    with pytest.raises(StorageError, match=rf"^{urls[1]}: cache_size .* of {tmp_path / 'cache'} cannot hold this "
                                           rf"Loader's working set \(.*\) beside those of the other Loaders in this "
                                           rf"process reading through it \({urls[0]} .*\): close them first"):
        Loader(urls[1], **kw)
    first.close()
    with Loader(urls[1], **kw) as second:
        assert sum(len(b["jpg"]) for b in second) == 48
    dropped = Loader(urls[0], **kw)
    del dropped
    gc.collect()
    with Loader(urls[1], **kw) as second:
        assert sum(len(b["jpg"]) for b in second) == 48
    other = dict(kw, cache_dir=str(tmp_path / "cache2"))
    with Loader(urls[0], **kw) as one, Loader(urls[1], **other) as two:  # separate caches: no claim between them
        assert sum(len(a["jpg"]) + len(b["jpg"]) for a, b in zip(one, two)) == 96


def test_a_cache_the_check_accepts_holds_the_shards_of_the_batches_read_at_once(moto_server, s3_bucket, image_folder,
                                                                               tmp_path):
    """24 shards of 2 samples, batch_size=8, shuffle='none', no shard read-ahead, a cache of the two largest shards:
    accepted by the check (two shards: 'a batch crossing from one into the next'), then the first epoch failed with
    'no room for shard ... held by this process's own shards in use': one batch touches 4 or 5 shards, and the
    reader threads read several batches at once. Now refused when made, naming a size; at that size the epoch runs,
    each sample once."""
    local = write_image_dataset(tmp_path / "local", image_folder, max_samples=2)
    url = f"s3://{s3_bucket}/ds"
    _upload(local, url, moto_server.options())
    opts = dict(OPTS, shuffle="none", shard_read_ahead=0, reader_threads=2, storage_options=moto_server.options())
    with pytest.raises(StorageError, match=rf"^{url}: cache_size .* cannot hold what shuffle='none' reads at once"):
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=_largest(local, 2), **opts)
    sizes = [p.stat().st_size for p in sorted((local / SHARDS_DIR).glob("*.tar"))]
    run = max(sum((sizes * 2)[i:i + 5]) for i in range(len(sizes)))  # a batch of 8 from a shard's last sample on
    need = min(2 * run, _largest(local, 10))  # 2 reader threads: 2 batches at once, 5 shards each
    with pytest.raises(StorageError) as err:
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=need - 1, **opts)
    named = re.search(r"; use reader_threads=1, or raise cache_size to at least (\d+\.\d+ [kM]B)$", str(err.value))
    assert named and need <= parse_size(named[1]) < need + 100, str(err.value)
    assert "(the shards of 2 batches of 8 samples read at once, each touching up to 5 consecutive shards)" in str(err.value)
    for size in (need, parse_size(named[1])):
        for start in (0, 3):  # a resume at an odd position: batches straddle one more shard
            with Loader(url, cache_dir=str(tmp_path / f"cache{size}"), cache_size=size, **opts) as loader:
                if start:
                    state = loader.state_dict()
                    state["consumed"] = start
                    loader.load_state_dict(state)
                got = sorted(i for b in loader for i, pad in zip(b["index"].tolist(), b["padded"].tolist()) if not pad)
            assert got == list(range(start, 48))


def test_a_token_readers_threads_each_hold_a_shard_of_any_source():
    """A token reader's threads (all of reader_threads, shared by a mixture's sources) each hold one shard at a time,
    whatever the batch: a source of a token mixture read with batch_size=1 and 4 threads can have 4 of its shards in
    use at once, where its stored-sample share (1 thread, 1 shard a batch) counted one."""
    shards = Shards([100] * 10, [5] * 10)
    share = Reading("block", 1, 1, batches=1, runs=2)
    assert shards.need(share) == 100
    assert shards.need(Reading("block", 1, 1, batches=1, runs=2, holders=4)) == 400
    assert shards.need(Reading("none", 1, 1, batches=1, holders=4), 1) == 500


def test_the_bound_holds_against_the_epoch_orders_every_batch():
    """Ragged shards (empty ones too), every start (a resume's, a rank's) and the padded wrap of several epochs'
    real orders: no batch touches more shards or bytes than the bound; for shuffle='none' the widest run is exact
    (it counted a shard twice where a batch wrapped around the whole epoch back into its first shard)."""
    from fastio.order.sampler import epoch_order

    rng = random.Random(1)
    for _ in range(150):
        samples = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 9))]
        if not sum(samples):
            continue
        sizes = [rng.randint(1, 100) for _ in samples]
        n, shard_of = sum(samples), np.repeat(np.arange(len(samples)), samples)
        b, bs, shuffle = rng.randint(1, n), rng.randint(1, 4), rng.choice(["none", "block"])
        worst_bytes = worst_count = 0
        for epoch in range(4 if shuffle == "block" else 1):
            order = np.asarray(epoch_order(samples, 0, epoch, "fp", shuffle, bs))
            for start in range(n):
                touched = np.unique(shard_of[order[(start + np.arange(b)) % n]]).tolist()
                worst_bytes = max(worst_bytes, sum(sizes[i] for i in touched))
                worst_count = max(worst_count, len(touched))
        shards, reading = Shards(sizes, samples), Reading(shuffle, bs, b)
        case = (shuffle, samples, sizes, b, bs)
        assert shards.per_batch(reading) >= worst_count and shards.need(reading) >= worst_bytes, case
        if shuffle == "none":
            assert shards.widest_run(b) == worst_bytes, case


def test_block_windows_at_a_padded_last_batch_and_the_next_epoch_fit_the_cache_accepted(moto_server, s3_bucket,
                                                                                       image_folder, tmp_path):
    """shuffle='block', batches of 5 over 48 samples (the last one padded from the epoch's start) and 2 reader
    threads: the padded batch holds the last window and the first, the next epoch's first batch its own first
    window, read at once. The smallest cache accepted runs two epochs, resumed at an odd position too; a byte less
    is refused before anything is read."""
    local = write_image_dataset(tmp_path / "local", image_folder, max_samples=2)
    url = f"s3://{s3_bucket}/ds"
    _upload(local, url, moto_server.options())
    opts = dict(OPTS, batch_size=5, shuffle="block", block_shards=2, shard_read_ahead=1, reader_threads=2,
                storage_options=moto_server.options())
    with pytest.raises(StorageError) as err:
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=1, **opts)
    named = parse_size(re.search(r"; raise cache_size to at least (\S+ [kM]?B)", str(err.value))[1])
    # no smaller block_shards or fewer threads fit 1 byte: the cache for block_shards=1 is named too
    assert re.search(r"B, or use block_shards=1 with cache_size at least \S+ kB$", str(err.value)), str(err.value)
    with pytest.raises(StorageError, match="cannot hold what shuffle='block' reads at once"):
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=named - 100, **opts)
    with Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=named, **opts) as loader:
        for epoch in range(3):
            if epoch == 2:
                state = loader.state_dict()
                state["consumed"] = 7
                loader.load_state_dict(state)
            got = [i for b in loader for i, pad in zip(b["index"].tolist(), b["padded"].tolist()) if not pad]
            assert len(got) == len(set(got)) == (41 if epoch == 2 else 48) and set(got) <= set(range(48)), epoch


def _image_text_on_s3(tmp_path: Path, url: str, options: dict, n: int, seq_len: int):
    """``n`` conversations (tests.tokens_helpers.image_text_source) in shards of 4, converted and uploaded to
    ``url``; returns (the local dataset, an ImageText pipeline of ``seq_len``)."""
    from tokens_helpers import image_text_source

    import fastio
    from fastio.convert.image_text import ImageTextOptions, convert_image_text
    from fastio.convert.run import ConvertConfig

    src = image_text_source(tmp_path, n=n)
    local = tmp_path / "ds"
    convert_image_text(ConvertConfig(src["source"], local, workers=1, max_samples_per_shard=4),
                       ImageTextOptions(src["tokenizer"], src["config"]))
    _upload(local, url, options)
    return local, fastio.ImageText(image=fastio.ImageEval(size=8, dtype="uint8", crop_ratio=1.0), seq_len=seq_len,
                                   image_seq_len=12, window=16)


@pytest.mark.parametrize("n,seq_len,batch_size", [(24, 1023, 4), (80, 255, 2)])
def test_an_image_text_batch_reads_every_conversation_packed_into_its_sequences(moto_server, s3_bucket, tmp_path, n,
                                                                                 seq_len, batch_size):
    """fastio.ImageText packs several conversations (stored samples) into each sequence, so one batch of
    ``batch_size`` sequences reads many more stored samples than ``batch_size``; the working set was counted in
    sequences: a cache of the smallest size the check accepted failed mid-epoch ('no room for shard ...'). Now
    counted in the stored samples a batch can read at most (the pipeline's bound); at the smallest size accepted
    every epoch runs, also resumed mid-epoch, and gives the local batches: where a sequence holds a shard's 4
    conversations (the first case) and where the bound is a part of the dataset (the second)."""
    from resume import same_batch

    import fastio

    url = f"s3://{s3_bucket}/vlm"
    local, pipe = _image_text_on_s3(tmp_path, url, moto_server.options(), n, seq_len)
    opts = dict(batch_size=batch_size, device="cpu", pipeline=pipe, shuffle="none", shard_read_ahead=0,
                reader_threads=1, num_threads=1, seed=3)
    with pytest.raises(StorageError) as err:
        fastio.Loader(url, cache_dir=str(tmp_path / "c0"), cache_size=1, storage_options=moto_server.options(), **opts)
    smallest = parse_size(re.search(r"raise cache_size to at least (\S+ [kM]?B)", str(err.value))[1])
    assert re.search(rf"\(the shards of 1 batch of {batch_size} packed sequences of up to \d+ stored samples read at "
                     r"once, each touching up to \d+ consecutive shards\)", str(err.value)), str(err.value)

    def epochs(where, start: int, **more) -> list[dict]:
        """Two epochs from ``start`` sequences into the first (a resume at a position a batch does not start at)."""
        with fastio.Loader(where, **opts, **more) as loader:
            if start:
                state = loader.state_dict()
                state["consumed"] = start
                loader.load_state_dict(state)
            return [b for _ in range(2) for b in loader]

    for start in (0, 3):
        want = epochs(local, start)
        got = epochs(url, start, cache_dir=str(tmp_path / f"cache{start}"), cache_size=smallest,
                     storage_options=moto_server.options())
        assert len(got) == len(want) > 2
        assert all(same_batch(a, b) for a, b in zip(got, want))
    assert (smallest < _largest(local, n // 4)) == (n == 80)  # the second case's bound: 6 of its 20 shards


def test_a_packed_kind_is_told_shuffle_none_not_block_when_its_cache_is_too_small(moto_server, s3_bucket, tmp_path):
    """fastio.ImageText (and fastio.Tokens) read shuffle 'global' or 'none' only, but a cache too small for
    'global' said "use shuffle='block' with block_shards=1 with cache_size at least ...", which the kind then
    refused ("shuffle for packed tokens must be one of global, none"). Now it names shuffle='none' and the size
    that holds it; at that size the Loader is made and reads its epoch."""
    import fastio

    url = f"s3://{s3_bucket}/vlm"
    local, pipe = _image_text_on_s3(tmp_path, url, moto_server.options(), 80, 255)
    opts = dict(batch_size=2, device="cpu", pipeline=pipe, shard_read_ahead=0, reader_threads=1, num_threads=1,
                storage_options=moto_server.options())
    with pytest.raises(StorageError) as err:
        fastio.Loader(url, cache_dir=str(tmp_path / "c0"), cache_size="50kB", **opts)
    assert "block" not in str(err.value), str(err.value)
    named = re.search(r", or use shuffle='none' with cache_size at least (\S+ [kM]?B)$", str(err.value))
    assert named and parse_size(named[1]) < _largest(local, 20), str(err.value)
    with fastio.Loader(url, cache_dir=str(tmp_path / "c1"), cache_size=named[1], shuffle="none", **opts) as loader:
        got = sorted(i for b in loader for i, pad in zip(b["index"].tolist(), b["padded"].tolist()) if not pad)
    assert got == list(range(len(got))) and len(got) > 20


def test_a_refusal_for_a_batch_larger_than_the_epoch_names_the_batch_the_loader_makes(moto_server, s3_bucket, shards,
                                                                                      tmp_path):
    """batch_size=10**9 with remainder='partial' over 48 samples: the Loader makes batches of the 48 (DALI's batch
    is min(batch_size, the epoch)), and a cache too small for them was refused, rightly, but in words of 'batches
    of 1000000000 samples'. Now the words name the batch of 48 samples it reads."""
    url = f"s3://{s3_bucket}/ds"
    _upload(shards, url, moto_server.options())
    opts = dict(OPTS, batch_size=10**9, remainder="partial", shuffle="none", shard_read_ahead=0,
                storage_options=moto_server.options())
    with pytest.raises(StorageError) as err:
        Loader(url, cache_dir=str(tmp_path / "cache"), cache_size=_largest(shards, 2), **opts)
    said = str(err.value)
    assert "1000000000" not in said and "(the shards of 1 batch of 48 samples read at once, each touching up to 6 " \
        "consecutive shards)" in said, said
    named = re.search(r"raise cache_size to at least (\S+ [kM]?B)$", said)  # the amount was right: every shard
    assert named and parse_size(named[1]) >= _largest(shards, 6), said


@pytest.mark.parametrize(("batch_size", "remainder", "said"), [
    (4, "pad", "(the shards of 1 batch of 4 packed sequences read at once, each touching up to 2 consecutive shards)"),
    (10**9, "partial", "(the shards of 1 batch of packed sequences reading all 120 documents read at once, each "
                       "touching up to 5 consecutive shards)")])
def test_a_token_refusal_names_its_batch_in_packed_sequences_and_documents(moto_server, s3_bucket, tmp_path,
                                                                           batch_size, remainder, said):
    """Found by review: a cache too small for fastio.Tokens was named as 'the shards of 1 batch of 4 samples', though
    its batch_size counts packed sequences and its shards hold documents, and batch_size=10**9 with
    remainder='partial' as 'a batch of 120 samples' (the dataset's documents taken for the batch the Loader
    makes: here 556 sequences). Now the batch is named in the kind's units, and one past the dataset by the
    documents it reads: all of them. The amount was right."""
    from tokens_helpers import word_corpus

    import fastio

    local = word_corpus(tmp_path)  # 120 documents in 5 shards
    url = f"s3://{s3_bucket}/tok"
    _upload(local, url, moto_server.options())
    with pytest.raises(StorageError) as err:
        fastio.Loader(url, pipeline=fastio.Tokens(seq_len=16), batch_size=batch_size, remainder=remainder,
                      device="cpu", shuffle="none", reader_threads=1, cache_dir=str(tmp_path / "c"), cache_size=1,
                      storage_options=moto_server.options())
    assert "samples" not in str(err.value) and said in str(err.value), str(err.value)
    named = re.search(r"raise cache_size to at least (\S+ [kM]?B)$", str(err.value))
    assert named and parse_size(named[1]) >= _largest(local, 2 if batch_size == 4 else 5), str(err.value)


def test_an_image_text_refusal_for_a_batch_past_the_dataset_names_the_samples_it_reads(moto_server, s3_bucket,
                                                                                      tmp_path):
    """Found by review: fastio.ImageText with batch_size=10**9 and remainder='partial' (the Loader makes one batch
    of the epoch's 38 sequences) was refused, rightly, in words of '1 batch of 1000000000 units'. Now it names the
    packed sequences by what they read: all 80 stored samples (the rule the images' refusal follows)."""
    import fastio

    url = f"s3://{s3_bucket}/vlm"
    local, pipe = _image_text_on_s3(tmp_path, url, moto_server.options(), 80, 255)
    with pytest.raises(StorageError) as err:
        fastio.Loader(url, pipeline=pipe, batch_size=10**9, remainder="partial", device="cpu", shuffle="none",
                      reader_threads=1, cache_dir=str(tmp_path / "c"), cache_size=1,
                      storage_options=moto_server.options())
    said = str(err.value)
    assert "1000000000" not in said and "(the shards of 1 batch of packed sequences reading all 80 stored samples " \
        "read at once, each touching up to 20 consecutive shards)" in said, said
    named = re.search(r"raise cache_size to at least (\S+ [kM]?B)$", said)
    assert named and parse_size(named[1]) >= _largest(local, 20), said
