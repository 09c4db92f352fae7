"""A fastio.Mixture of an indexed dataset (``fastio index`` over shards written by ``webdataset.ShardWriter``
and by GNU tar, nested keys, scrambled member order, a long name) and a converted one (``fastio convert``): every
sample once per source cycle with its own bytes and label, exact and elastic resume, and the mixture loader's
state through ``fastio.Checkpointer`` and back, bitwise."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from resume import batches, check_resume, same_batch

from fastio import ImageEval, Loader, Mixture, Raw
from fastio.convert.synthetic import make_imagefolder

LONG = "very-long-folder-name-" * 5  # > 100 bytes with the rest: a GNU long name


def _wds_shards(root: Path, images: list[bytes]) -> dict[str, tuple[bytes, int]]:
    """Two shards by webdataset.ShardWriter (nested keys) and one by GNU tar (members scrambled, a long name,
    a sample lacking its ``txt``); returns key -> (jpg bytes, label)."""
    import webdataset as wds

    root.mkdir(parents=True)
    want = {}
    with wds.ShardWriter(str(root / "wds-%06d.tar"), maxcount=5, verbose=0) as sink:
        for i in range(8):
            key = f"grp{i % 2}/sub/k{i:02d}"
            sink.write({"__key__": key, "jpg": images[i], "cls": str(i % 3).encode(), "txt": b"t%d" % i})
            want[key] = (images[i], i % 3)
    tree = root / "tree"
    names = []
    for i in range(8, 12):
        key = f"{LONG}/x{i}" if i == 9 else f"gnu/x{i}"
        (tree / key).parent.mkdir(parents=True, exist_ok=True)
        (tree / f"{key}.jpg").write_bytes(images[i])
        (tree / f"{key}.cls").write_text(str(i % 3))
        members = [f"{key}.cls", f"{key}.jpg"]
        if i != 10:
            (tree / f"{key}.txt").write_bytes(b"t%d" % i)
            members.insert(1, f"{key}.txt")  # cls, txt, jpg: not the alphabetical order
        names += members[::-1] if i % 2 else members
        want[key] = (images[i], i % 3)
    subprocess.run(["tar", "--format=gnu", "-cf", str(root / "gnu-000000.tar"), "-C", str(tree), *names], check=True)
    shutil.rmtree(tree)
    return want


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interplay")
    folder = make_imagefolder(tmp / "images", classes=3, per_class=3, seed=11)
    images = [p.read_bytes() for p in sorted(folder.rglob("*.jpg"))]
    more = make_imagefolder(tmp / "more", classes=3, per_class=1, seed=12)
    images += [p.read_bytes() for p in sorted(more.rglob("*.jpg"))]
    want = _wds_shards(tmp / "wds", images)
    from fastio.cli import main

    for args in (["index", str(tmp / "wds")], ["convert", str(folder), str(tmp / "conv"), "--workers", "1"]):
        try:
            code = main(args)
        except SystemExit as exit_:
            code = exit_.code
        assert code in (0, None), args
    conv = {f"{p.parent.name}/{p.stem}": (p.read_bytes(), sorted(q.name for q in folder.iterdir()).index(p.parent.name))
            for p in folder.rglob("*.jpg")}
    return {"wds": (tmp / "wds", want), "conv": (tmp / "conv", conv)}


def _loader(sources, world=1, rank=0, **kw):
    mix = Mixture({name: path for name, (path, _) in sources.items()}, weights={"wds": 2, "conv": 1},
                  samples_per_epoch=30)
    opts = dict(batch_size=3, pipeline=Raw(fields=("jpg", "cls")), device="cpu", seed=3, world_size=world,
                rank=rank, num_threads=1, prefetch=2)
    opts.update(kw)
    return Loader(mix, **opts)


@pytest.mark.parametrize("shuffle", ["global", "block", "none"])
def test_each_source_cycles_through_its_own_samples_with_their_bytes_and_labels(sources, shuffle):
    loader = _loader(sources, shuffle=shuffle, block_shards=2)
    names = loader.mixture.names
    seen = {n: [] for n in names}
    for b in islice(batches(loader), 20):  # two mixture epochs: wds (12) cycles 3+ times, conv (9) 2+ times
        for s, i, jpg, y, pad in zip(b["source"].tolist(), b["index"].tolist(), b["jpg"], b["label"].tolist(),
                                     b["padded"].tolist()):
            assert not pad
            name = names[s]
            key = loader.key(s, i)
            assert (jpg, y) == sources[name][1][key], f"{name} {key}: not its own bytes and label"
            seen[name].append(key)
    loader.close()
    for name, keys in seen.items():
        n = len(sources[name][1])
        full = len(keys) // n * n
        assert full >= 2 * n
        for start in range(0, full, n):  # every cycle of a source: each of its samples exactly once
            assert Counter(keys[start:start + n]) == Counter(list(sources[name][1])), (name, start)


@pytest.mark.parametrize("pipeline", [None, ImageEval(size=32)])
def test_exact_resume_of_the_mixture(sources, pipeline):
    kw = {} if pipeline is None else dict(pipeline=pipeline)
    check_resume(lambda: _loader(sources, **kw), n=7, k=6)  # 10 batches an epoch: across the boundary


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
def test_elastic_resume_of_the_mixture(sources, old, new):
    def run(world, state=None, n=None):
        loaders = [_loader(sources, world, r) for r in range(world)]
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        got, its = [], [iter(ld) for ld in loaders]
        while n is None or len(got) < n * world:
            step = [next(it, None) for it in its]
            if all(b is None for b in step):
                break
            got += [(s, i) for b in step for s, i, p in zip(b["source"].tolist(), b["index"].tolist(),
                                                           b["padded"].tolist()) if not p]
        states = [ld.state_dict() for ld in loaders]
        for ld in loaders:
            ld.close()
        return got, states

    before, states = run(old, n=2)
    after, _ = run(new, state=states[0])
    whole, _ = run(1)
    assert len(whole) == 30 and Counter(before + after) == Counter(whole)


@pytest.mark.parametrize("engine", ["torchsnapshot", "dcp"])
def test_the_mixture_loader_state_goes_through_the_checkpointer_bitwise(sources, tmp_path, engine):
    from fastio import Checkpointer

    loader = _loader(sources)
    stream = batches(loader)
    list(islice(stream, 4))
    saved_state = loader.state_dict()
    with Checkpointer(tmp_path / "ck", engine=engine) as ckpt:
        ckpt.save(4, {"data": loader}, blocking=True)
    want = list(islice(stream, 8))
    loader.close()
    fresh = _loader(sources)
    with Checkpointer(tmp_path / "ck", engine=engine) as ckpt:
        state = ckpt.restore_latest({"data": fresh})
    assert state.step == 4 and state.epoch == saved_state["epoch"]
    again = list(islice(batches(fresh), 8))
    fresh.close()
    assert fresh.state_dict()["mixture"] == saved_state["mixture"]
    for j, (a, b) in enumerate(zip(want, again)):
        assert same_batch(a, b), f"batch {j} after the restore"

