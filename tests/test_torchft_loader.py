"""fastio.Loader(..., replicas=manager) with real torchft Managers in this process (a real lighthouse, single-rank
groups): every kind of pipeline across epochs, a retried step, a group healing with an empty batch, the Loader's
state in the Manager's state dict, Checkpointer restores and the refusals. The run across processes with a SIGKILLed
group is tests/test_torchft.py."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import fastio
from fastio.convert import synthetic
from fastio.convert.run import ConvertConfig, convert
from fastio.dataset.shards import ShardWriter
from fastio.errors import CheckpointError, LoaderArgumentError, LoaderStateError
from tests.tokens_helpers import chat_dataset
from tests.torchft_helpers import LOOPBACK, group_store, lighthouse, manager, steps


@pytest.fixture
def house(monkeypatch):
    for key, value in LOOPBACK.items():
        monkeypatch.setenv(key, value)
    server = lighthouse()
    yield server.address()
    server.shutdown()


def _txt(dest: Path, n: int, label: int) -> Path:
    with ShardWriter(dest, max_samples=4) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:03d}", "txt": f"{label}-{i}".encode(), "cls": str(label).encode()})
        writer.close(label_field="cls", converted_from={"format": "test"}, skipped=[])
    return dest


@pytest.fixture(scope="module")
def video_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchft-videos")
    for c in range(2):
        for i in range(2):
            synthetic.make_video(root / "src" / f"c{c}" / f"v{i}.webm", frames=8, fps=8)
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False))
    return root / "ds"


def _kinds(request, tmp_path, image_dataset):
    """(what the Loader reads, its options, the batch keys compared with the one-process run)."""
    kind = request.param
    if kind == "image":
        return image_dataset, {"pipeline": fastio.ImageEval(size=32), "batch_size": 8}, ("index", "image", "label")
    if kind == "tokens":
        return request.getfixturevalue("token_ds"), {"pipeline": fastio.Tokens(seq_len=8), "batch_size": 4}, (
            "index", "tokens", "position_ids")
    if kind == "chat":  # whole conversations packed best-fit, with their loss mask
        (tmp_path / "chat").mkdir()
        return chat_dataset(tmp_path / "chat"), {"pipeline": fastio.Tokens(seq_len=128, packing="best-fit"),
                                                 "batch_size": 3}, ("index", "tokens", "loss_mask", "segment_ids")
    if kind == "mixture":
        sources = {"a": _txt(tmp_path / "a", 10, 0), "b": _txt(tmp_path / "b", 7, 1)}
        mix = fastio.Mixture(sources, weights=[(0, {"a": 3, "b": 1}), (9, {"a": 1, "b": 3})])
        return mix, {"pipeline": fastio.Raw(), "batch_size": 4}, ("index", "source", "label", "txt")
    return request.getfixturevalue("video_ds"), {
        "pipeline": fastio.VideoClips(frames=2, size=16, dtype="uint8", layout="FHWC"), "batch_size": 2}, (
        "index", "video", "label")


@pytest.fixture(params=["image", "tokens", "chat", "mixture", "video"])
def kind(request, tmp_path, image_dataset):
    return _kinds(request, tmp_path, image_dataset)


def _loader(target, options, mgr=None, **more):
    opts = {"seed": 0, "drop_last": True, "device": "cpu", "num_threads": 1, **options, **more}
    if mgr is None:
        return fastio.Loader(target, **{"rank": 0, "world_size": 1, **opts})
    return fastio.Loader(target, replicas=mgr, **opts)


def _one_process(target, options, count: int) -> list[dict]:
    out = []
    with _loader(target, options) as loader:
        while len(out) < count:
            out += list(loader)
    return out[:count]


def _joined(parts: list, like):
    if isinstance(like, torch.Tensor):
        return torch.cat(parts)
    return [x for p in parts for x in p]


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else list(a) == list(b)


def _empty_like(empty: dict, full: dict) -> bool:
    """A batch of no samples with ``full``'s keys, dtypes and trailing dimensions."""
    if empty.keys() != full.keys():
        return False
    return all(len(e) == 0 and (not isinstance(f, torch.Tensor) or (e.dtype, e.shape[1:]) == (f.dtype, f.shape[1:]))
               for e, f in ((empty[k], full[k]) for k in full if isinstance(full[k], (torch.Tensor, list))))


def test_every_pipeline_takes_the_global_batch_of_each_step_across_epochs_and_a_joining_group(house, kind):
    target, options, keys = kind
    want = _one_process(target, options, 9)
    first = group_store(), group_store()
    m0 = manager(first[0].port, house, 0)
    l0 = _loader(target, options, m0)
    before = steps([(m0, l0)], 3)  # group 0 alone: the whole global batch
    m1 = manager(first[1].port, house, 1)
    l1 = _loader(target, options, m1)
    after = steps([(m0, l0), (m1, l1)], 6)
    for s, (b,) in enumerate(before):
        assert b["step"] == s and all(_same(b[k], want[s][k]) for k in keys)
    (full, healing), *shared = after
    assert full["step"] == healing["step"] == 3 and not healing["participating"]
    assert all(_same(full[k], want[3][k]) for k in keys)
    assert _empty_like({k: healing[k] for k in want[3]}, want[3])  # healing: no samples, the batch's structure
    for b0, b1 in shared:  # both take part: halves of the one-process batch, through an epoch boundary
        s = b0["step"]
        assert b1["step"] == s and b0["participating"] and b1["participating"]
        assert all(_same(_joined([b0[k], b1[k]], want[s][k]), want[s][k]) for k in keys), s
        assert abs(len(b0["index"]) - len(b1["index"])) <= 1
    assert [b0["step"] for b0, _ in shared] == [4, 5, 6, 7, 8]
    for m, loader in ((m0, l0), (m1, l1)):
        loader.close()
        m.shutdown(wait=False)


def test_a_step_that_does_not_commit_is_taken_again_with_the_same_samples(house, image_dataset):
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 5)]
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, options, m) as loader:
        failed = []
        got = steps([(m, loader)], 6, commit=lambda s: s != 2 or bool(failed) or failed.append(s))
        assert [b["step"] for (b,) in got] == [0, 1, 2, 2, 3, 4]
        assert [b["index"].tolist() for (b,) in got] == [want[s] for s in (0, 1, 2, 2, 3, 4)]
        state = m._manager_state_dict()["user"]["fastio_loader"]
        assert state == loader.state_dict() and state["step"] == 5 and (state["epoch"], state["consumed"]) == (0, 30)
        assert len(json.dumps(state)) < 400  # what a healing group receives besides the weights
    m.shutdown(wait=False)


def test_a_steady_quorum_keeps_one_stream_through_the_epochs(house, image_dataset):
    """The next steps' shares are read and decoded ahead while a step trains: one feeder and DALI pipeline serve
    every step of an unchanged quorum (8 steps an epoch here), and a retried step starts another."""
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, {"pipeline": fastio.ImageEval(size=16), "batch_size": 6}, m) as loader:
        streams = []
        steps([(m, loader)], 10, commit=lambda s: streams.append(loader._feeder) or s != 9)
        assert len(streams) == 10 and len({id(f) for f in streams}) == 1
        steps([(m, loader)], 1)  # step 9 again
        assert loader._feeder is not streams[0]
    m.shutdown(wait=False)


def test_a_group_whose_loader_differs_from_its_peers_is_refused_as_it_heals(house, image_dataset):
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    stores = group_store(), group_store()
    m0 = manager(stores[0].port, house, 0)
    l0 = _loader(image_dataset, options, m0)
    steps([(m0, l0)], 2)
    m1 = manager(stores[1].port, house, 1)
    l1 = _loader(image_dataset, options, m1, seed=1)
    with pytest.raises(LoaderStateError, match="loader state has seed=0, this loader seed=1"):
        steps([(m0, l0), (m1, l1)], 1)
    for m, loader in ((m0, l0), (m1, l1)):
        loader.close()
        m.shutdown(wait=False)


def test_a_group_with_a_loader_its_peer_lacks_is_refused_as_it_heals_naming_it(house, image_dataset):
    """Before: a healing group with two Loaders registered on its Manager (fastio_loader, fastio_loader_1) whose
    peer had one got a raw `KeyError: 'fastio_loader_1'` from torchft's should_commit, after its first Loader had
    taken the peer's position. Now its batch is refused before torchft applies the peer's state, naming the Loader
    the peer lacks and both groups' Loaders."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    stores = group_store(), group_store()
    m0 = manager(stores[0].port, house, 0)
    l0 = _loader(image_dataset, options, m0)
    steps([(m0, l0)], 2)
    m1 = manager(stores[1].port, house, 1)
    l1, l1b = _loader(image_dataset, options, m1), _loader(image_dataset, options, m1)
    with pytest.raises(LoaderStateError, match=r"^this group's Loader fastio_loader_1 \(registered on its "
                                               r"torchft\.Manager\) is not in the state of the peer it heals "
                                               r"from, whose Loaders are fastio_loader"):
        steps([(m0, l0), (m1, l1)], 1)
    for m, loaders in ((m0, (l0,)), (m1, (l1, l1b))):
        for loader in loaders:
            loader.close()
        m.shutdown(wait=False)


def test_groups_with_a_synchronous_quorum_heal_the_loaders_position_and_share_the_step_at_once(house, image_dataset):
    """``use_async_quorum=False``: a joining group heals inside ``start_quorum`` (the Loader's position applied there,
    before its first batch) and takes part in that very step: the two groups' batches are halves of the one-process
    batch of each step, the joining group's from step 2 on."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 5)]
    stores = group_store(), group_store()
    m0 = manager(stores[0].port, house, 0, use_async_quorum=False)
    l0 = _loader(image_dataset, options, m0)
    before = steps([(m0, l0)], 2)
    m1 = manager(stores[1].port, house, 1, use_async_quorum=False)
    l1 = _loader(image_dataset, options, m1)
    after = steps([(m0, l0), (m1, l1)], 3)
    assert [b["index"].tolist() for (b,) in before] == want[:2]
    for s, (b0, b1) in enumerate(after, start=2):
        assert b0["step"] == b1["step"] == s and b0["participating"] and b1["participating"], s
        assert b0["index"].tolist() + b1["index"].tolist() == want[s], s
    for m, loader in ((m0, l0), (m1, l1)):
        loader.close()
        m.shutdown(wait=False)


@pytest.mark.parametrize("sync", [False, True])
def test_a_group_whose_step_failed_heals_its_running_loader_to_the_peers_step(house, image_dataset, sync):
    """Group 1's step 2 does not commit (group 0's does): at the next quorum it heals from group 0 with its Loader
    running (its next shares read ahead). With ``use_async_quorum=False`` it heals inside ``start_quorum`` and takes
    its half of step 3 at once; otherwise it gets step 3's empty batch and takes part from step 4. No sample of a
    step is lost or taken twice."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 6)]
    stores = group_store(), group_store()
    ms = [manager(stores[g].port, house, g, use_async_quorum=not sync) for g in range(2)]
    ls = [_loader(image_dataset, options, m) for m in ms]
    both = list(zip(ms, ls))
    rows = steps(both, 2)
    calls = []  # steps() asks commit() for group 0, then group 1: the 4th call is group 1's step 2
    rows += steps(both, 1, commit=lambda s: calls.append(s) or len(calls) != 2)
    assert (ms[0].current_step(), ms[1].current_step()) == (3, 2)
    rows += steps(both, 2)
    assert [[b["step"] for b in row] for row in rows] == [[0, 0], [1, 1], [2, 2], [3, 3], [4, 4]]
    assert rows[3][1]["participating"] == sync
    _union_is_the_global_batch(rows, want)
    for m, loader in both:
        loader.close()
        m.shutdown(wait=False)


@pytest.mark.parametrize("peer_loaders", [0, 1])
def test_a_group_with_a_synchronous_quorum_and_a_loader_its_peer_lacks_is_refused_as_it_heals(house, image_dataset,
                                                                                              peer_loaders):
    """``use_async_quorum=False``: the peer's state is applied inside ``start_quorum``, before any batch is asked.
    Before: a peer without Loaders got torchft's raw ``KeyError: 'fastio_loader'`` there, and with one Loader of two
    the peer's model state was applied before the second was found lacking. Now a Loader of this group that the
    peer's state lacks is refused before any of it is applied, naming it and both groups' Loaders."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    stores = group_store(), group_store()
    m0 = manager(stores[0].port, house, 0, use_async_quorum=False)
    m0.register_state_dict_fn("model", lambda state: None, lambda: {"w": 1})
    peer = [_loader(image_dataset, options, m0) for _ in range(peer_loaders)]
    ours = [(m0, peer[0])] if peer else []
    if not peer:  # the peer takes steps without a Loader: its Manager's quorum started by hand
        for _ in range(2):
            m0.start_quorum()
            m0.should_commit()
    else:
        steps(ours, 2)
    m1 = manager(stores[1].port, house, 1, use_async_quorum=False)
    applied = []
    m1.register_state_dict_fn("model", applied.append, lambda: {"w": 1})
    l1, l1b = _loader(image_dataset, options, m1), _loader(image_dataset, options, m1)
    lacking = "Loaders fastio_loader, fastio_loader_1 (registered on its torchft.Manager) are" if not peer else \
        "Loader fastio_loader_1 (registered on its torchft.Manager) is"
    theirs = "none" if not peer else "fastio_loader"
    with pytest.raises(LoaderStateError, match=rf"^this group's {re.escape(lacking)} not in the state of the peer it "
                                               rf"heals from, whose Loaders are {theirs} "):
        if peer:
            steps([(m0, peer[0]), (m1, l1)], 1)
        else:
            _start_both(house, m1, m0)
    assert applied == []  # not the peer's model state either
    for m, loaders in ((m0, peer), (m1, (l1, l1b))):
        for loader in loaders:
            loader.close()
        m.shutdown(wait=False)


def _start_both(house: str, joining, peer) -> None:
    """The quorum of a step started by ``joining`` (asking first, as steps() orders it) and ``peer``, both with
    ``use_async_quorum=False`` (each waits in start_quorum, on a thread of its own); what ``joining``'s raised."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.torchft_helpers import lighthouse_status, wait_asked

    quorum = lighthouse_status(house)[0]
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(joining.start_quorum)
        wait_asked(house, 1, quorum)
        theirs = pool.submit(peer.start_quorum)
        theirs.result(timeout=60)
        mine.result(timeout=60)


def _checkpoint_at(house: str, target, options: dict, ck_dir: Path, count: int, **more) -> None:
    """A one-group torchft run of ``count`` steps, its Loader and Manager (and ``more``) saved at step ``count``."""
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(target, options, m) as loader, fastio.Checkpointer(ck_dir, signals=()) as ck:
        steps([(m, loader)], count)
        ck.save(count, {"loader": loader, "torchft": m, **more}, blocking=True)
    m.shutdown(wait=False)


def test_a_checkpointer_restore_continues_at_the_managers_step(house, image_dataset, tmp_path):
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 5)]
    _checkpoint_at(house, image_dataset, options, tmp_path / "ck", 3)
    second = group_store()
    again = manager(second.port, house, 0)
    with _loader(image_dataset, options, again) as loader, fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        with pytest.raises(CheckpointError, match="app key 'loader': its position is the step of the torchft.Manager "
                           "it was given"):
            ck.restore_latest({"loader": loader}, strict=False)
        ck.restore_latest({"loader": loader, "torchft": again})
        got = steps([(again, loader)], 2)
    assert [b["index"].tolist() for (b,) in got] == want[3:5]
    again.shutdown(wait=False)


def test_misuse_is_refused_in_one_line_naming_the_fix(house, image_dataset):
    store = group_store()
    m = manager(store.port, house, 0)
    with pytest.raises(LoaderArgumentError, match=r"world_size=4 with replicas=: .* one replica group \(1 "):
        fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=m, rank=0, world_size=4)
    with pytest.raises(LoaderArgumentError, match="replicas= takes a torchft.Manager, got dict"):
        fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas={})
    with fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=m) as loader:
        with pytest.raises(LoaderArgumentError, match=r"no torchft quorum yet: start the step \(optimizer.zero_grad"):
            next(iter(loader))
        with pytest.raises(LoaderArgumentError, match="set_epoch with replicas="):
            loader.set_epoch(1)
    m.shutdown(wait=False)


def test_replicas_without_torchft_or_with_the_manager_class_is_refused_in_one_line(image_dataset, monkeypatch):
    """The Manager class instead of a Manager is named as a class; a process where torchft does not import gets a
    LoaderArgumentError naming the package, not torchft's ModuleNotFoundError."""
    from torchft import Manager

    with pytest.raises(LoaderArgumentError, match="replicas= takes a torchft.Manager, got the class Manager: pass"):
        fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=Manager)
    monkeypatch.setitem(sys.modules, "torchft", None)  # what Python does for a package that is not installed
    with pytest.raises(LoaderArgumentError, match=r"replicas= needs torchft, which does not import here .*pip "
                       r"install torchft-nightly"):
        fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=Manager)


def test_a_closed_loader_leaves_the_managers_state_and_the_next_loader_takes_its_place(house, image_dataset):
    """close() takes the Loader's state out of the Manager's state dict (the Manager no longer calls the closed
    Loader, nor keeps it alive); closing twice is harmless; a Loader made after it with the same Manager is the one
    whose state the Manager sends and checkpoints, under the same key as a peer's only Loader."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, {**options, "batch_size": 12}, 4)]
    store = group_store()
    m = manager(store.port, house, 0)
    first = _loader(image_dataset, options, m)
    steps([(m, first)], 2)
    first.close()
    first.close()
    with _loader(image_dataset, {**options, "batch_size": 12}, m) as second:
        first.close()  # a third time, after the next Loader registered: it stays registered
        got = steps([(m, second)], 2)
        assert m._manager_state_dict()["user"] == {"fastio_loader": second.state_dict()}
    assert [b["index"].tolist() for (b,) in got] == want[2:4]
    m.shutdown(wait=False)


def test_a_group_heals_into_the_loader_made_after_it_closed_one(house, image_dataset):
    """A group that closed a Loader (another global batch) and made the next one heals from a peer into the next
    one: the Manager does not hand the peer's position to the closed Loader."""
    options = {"pipeline": fastio.Raw(), "batch_size": 12}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 5)]
    stores = group_store(), group_store()
    m0 = manager(stores[0].port, house, 0)
    l0 = _loader(image_dataset, options, m0)
    steps([(m0, l0)], 2)
    m1 = manager(stores[1].port, house, 1)
    _loader(image_dataset, {**options, "batch_size": 6}, m1).close()
    l1 = _loader(image_dataset, options, m1)
    (_, healing), *shared = steps([(m0, l0), (m1, l1)], 3)
    assert healing["step"] == 2 and not healing["participating"]
    assert [b0["index"].tolist() + b1["index"].tolist() for b0, b1 in shared] == want[3:5]
    assert l1.state_dict() == l0.state_dict()
    for m, loader in ((m0, l0), (m1, l1)):
        loader.close()
        m.shutdown(wait=False)


def test_the_loader_takes_its_rank_and_world_from_the_manager_and_refuses_another(house, image_dataset, monkeypatch):
    """Without rank=/world_size= the Loader is the Manager's rank of its group (not the environment's, which a
    Manager made with rank= and world_size= need not have); a rank that is not the Manager's is refused (two ranks
    of a group would take the same share and none the other)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    store = group_store()
    m0 = manager(store.port, house, 0, rank=0, world=2)
    m1 = manager(store.port, house, 0, rank=1, world=2)
    with fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=m1) as loader:
        assert (loader.rank, loader.world_size) == (1, 2)
    with pytest.raises(LoaderArgumentError, match=r"^Loader got rank=0 with replicas=: this torchft.Manager is rank 1 "
                       r"of its replica group of 2; leave rank= out, or pass 1$"):
        fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=m1, rank=0, world_size=2)
    for m in (m1, m0):
        m.shutdown(wait=False)


def test_a_state_saved_without_replicas_at_another_position_than_the_managers_step_is_refused(house, image_dataset):
    """A plain Loader's state (no torchft step) names its position by epoch and consumed samples: loaded into a
    Loader with replicas= whose Manager is at another step it is refused (it was taken silently, and the run went
    on from the Manager's step); at the Manager's step it loads."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    with _loader(image_dataset, options) as plain:
        it = iter(plain)
        for _ in range(3):
            next(it)
        state = plain.state_dict()
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, options, m) as loader:
        with pytest.raises(LoaderStateError, match=r"^loader state \(saved without replicas=\) is at epoch 0, 18 "
                           r"samples consumed: global batch 3 of 6 samples, the torchft Manager at step 0: .*restore "
                           r"the Manager at step 3"):
            loader.load_state_dict(state)
        m.load_state_dict({"step": 3, "batches_committed": 3})
        loader.load_state_dict(state)
        (b,), = steps([(m, loader)], 1)
        assert b["step"] == 3 and b["index"].tolist() == [x.tolist() for x in _one_process(
            image_dataset, options, 4)[3]["index"]]
    m.shutdown(wait=False)


def test_a_manager_without_the_state_hooks_fastio_uses_is_refused_in_one_line(house, image_dataset):
    """A Manager of another torchft whose state dict hooks are not the ones fastio registers its state with (here:
    one taken away) is refused naming what is missing and the torchft version, not with torchft's AttributeError."""
    store = group_store()
    m = manager(store.port, house, 0)
    hooks = m._user_state_dicts
    del m._user_state_dicts
    try:
        with pytest.raises(LoaderArgumentError, match=r"^replicas=: this torchft.Manager has no _user_state_dicts "
                           r"\(torchft 2026\.10\.26\), which fastio reads \(its rank, step and quorum, and the "
                           "state dict hooks "):
            fastio.Loader(image_dataset, pipeline=fastio.Raw(), batch_size=6, replicas=m)
    finally:
        m._user_state_dicts = hooks
    m.shutdown(wait=False)


def test_a_checkpointer_restore_without_the_manager_is_refused_before_anything_loads(house, image_dataset, tmp_path):
    """The Loader's position is the Manager's step: a restore of an app without the Manager is refused before the
    model loads (the model was loaded first, then the Loader refused: a run half restored)."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    _checkpoint_at(house, image_dataset, options, tmp_path / "ck", 2, model=torch.nn.Linear(2, 2))
    store = group_store()
    again = manager(store.port, house, 0)
    with _loader(image_dataset, options, again) as loader:
        _refused_before_the_model_loads(tmp_path / "ck", loader, r"step-2: app key 'loader': its position is the "
                                        r"step of the torchft.Manager it was given \(replicas=\), which this app "
                                        r"does not restore: put that Manager into the app state with it")
        assert again.current_step() == 0
    again.shutdown(wait=False)


def _refused_before_the_model_loads(ck_dir: Path, loader, match: str) -> torch.nn.Module:
    """A model of the checkpoint's shape, left as it was by a restore of ``{"loader": loader, "model": model}``
    that is refused (``match``)."""
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with fastio.Checkpointer(ck_dir, read_only=True) as ck, pytest.raises(CheckpointError, match=match):
        ck.restore_latest({"loader": loader, "model": model}, strict=False)
    assert torch.equal(model.weight, before)
    return model


def test_a_participating_group_with_an_empty_share_gets_a_flagged_repeat(house, image_dataset):
    """A global batch of one sample over two groups: the second group's share is empty, so it gets the batch's
    sample again flagged ``padded`` (the loss of docs/trainers.md leaves it out), and the first the sample itself."""
    options = {"pipeline": fastio.Raw(), "batch_size": 1}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 2)]
    stores = group_store(), group_store()
    pairs = [(m, _loader(image_dataset, options, m)) for m in (manager(stores[g].port, house, g) for g in range(2))]
    for b0, b1 in steps(pairs, 2):
        assert b0["participating"] and b1["participating"]
        assert (b0["index"].tolist(), b0["padded"].tolist()) == (want[b0["step"]], [False])
        assert (b1["index"].tolist(), b1["padded"].tolist()) == (want[b0["step"]], [True])
    for m, loader in pairs:
        loader.close()
        m.shutdown(wait=False)


def test_a_global_batch_larger_than_the_dataset_with_partial_remainder_is_one_step_an_epoch(house, image_dataset):
    """remainder='partial' takes a global batch larger than the dataset with replicas= as without: each step is one
    epoch's 48 samples, split over the two groups, the samples a one-process Loader gives at that batch."""
    options = {"pipeline": fastio.Raw(), "batch_size": 64, "drop_last": False, "remainder": "partial"}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 3)]
    assert [len(w) for w in want] == [48] * 3 and want[0] != want[1]
    stores = group_store(), group_store()
    pairs = [(m, _loader(image_dataset, options, m)) for m in (manager(stores[g].port, house, g) for g in range(2))]
    for b0, b1 in steps(pairs, 3):
        assert b0["step"] == b1["step"] and not (b0["padded"].any() or b1["padded"].any())
        assert b0["index"].tolist() + b1["index"].tolist() == want[b0["step"]]
    for m, loader in pairs:
        loader.close()
        m.shutdown(wait=False)


def test_failures_in_a_row_and_at_an_epoch_boundary_retake_the_step_bit_for_bit(house, image_dataset):
    """Step 2 fails three times in a row, the last step of epoch 0 (7) and the first of epoch 1 (8) once each: every
    try of a step takes its one-process batch, images included (ImageTrain's crops are drawn per sample, so the
    stream made again for a retry decodes the same pixels)."""
    options = {"pipeline": fastio.ImageTrain(size=16), "batch_size": 6}
    want = _one_process(image_dataset, options, 10)
    fails = {2: 3, 7: 1, 8: 1}

    def commit(step: int) -> bool:
        fails[step] = fails.get(step, 0) - 1
        return fails[step] < 0

    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, options, m) as loader:
        got = steps([(m, loader)], 15, commit=commit)
    m.shutdown(wait=False)
    assert [b["step"] for (b,) in got] == [0, 1, 2, 2, 2, 2, 3, 4, 5, 6, 7, 7, 8, 8, 9]
    for (b,) in got:
        assert all(torch.equal(b[k], want[b["step"]][k]) for k in ("index", "image", "label")), b["step"]


@pytest.mark.parametrize("saved", [3, 8])  # mid-epoch 0; at the boundary (1, 0): nothing of epoch 1 delivered
def test_a_next_epoch_restore_is_refused_naming_the_first_step_of_that_epoch(house, image_dataset, tmp_path, saved):
    """loader_policy="next-epoch" moves a Loader's state to the next epoch, but with replicas= the position is the
    Manager's step: the restore said epoch 1 and the Loader went on at step 3 of epoch 0. It is refused before
    anything loads, naming the step that starts epoch 1 (8 global batches of 6 an epoch). Saved at step 8, the
    epoch boundary, it named step 16 (epoch 2): epoch 1 would never have been trained."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    _checkpoint_at(house, image_dataset, options, tmp_path / "ck", saved)
    second = group_store()
    again = manager(second.port, house, 0)
    with _loader(image_dataset, options, again) as loader, fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        with pytest.raises(CheckpointError, match=r"app key 'loader': loader_policy='next-epoch' with replicas=: the "
                           r"position is the torchft Manager's step, not the Loader's state; .*the Manager at step 8 "
                           r"\(the first of epoch 1\)"):
            ck.restore_latest({"loader": loader, "torchft": again}, loader_policy="next-epoch")
        assert again.current_step() == 0
    again.shutdown(wait=False)


def test_a_batch_asked_before_its_steps_quorum_was_started_is_refused_at_every_step(house, image_dataset):
    """The quorum of step 0 is refused when not started (no quorum yet); so is that of a later step: the batch was
    cut by the last step's quorum, whose groups need not be this step's (a share lost or taken twice). A retry
    (another quorum) is not refused."""
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, {"pipeline": fastio.Raw(), "batch_size": 6}, m) as loader:
        it = iter(loader)
        m.start_quorum()
        first = next(it)["index"].tolist()
        m.report_error(RuntimeError("step 0 fails on purpose"))
        assert not m.should_commit()
        m.start_quorum()  # step 0 again
        assert next(it)["index"].tolist() == first
        assert m.should_commit() and m.current_step() == 1
        with pytest.raises(LoaderArgumentError, match=r"^the batch of torchft step 1 was asked before that step's "
                           r"quorum was started: start it first \(optimizer.zero_grad\(\) of "):
            next(it)
        m.start_quorum()
        assert next(it)["index"].tolist() != first  # the refusal did not end the iterator
    m.shutdown(wait=False)


def test_a_second_batch_asked_in_one_step_is_refused_naming_gradient_accumulation(house, image_dataset):
    """A step has one batch: a loop asking twice in a step (micro-batches of gradient accumulation, or the inner
    steps of torchft's LocalSGD/DiLoCo, whose Manager steps once per sync) got the same samples again, silently."""
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, {"pipeline": fastio.Raw(), "batch_size": 6}, m) as loader:
        it = iter(loader)
        m.start_quorum()
        next(it)
        with pytest.raises(LoaderArgumentError, match=r"^a second batch of torchft step 0 was asked in that step: with "
                           r"replicas= a step has one batch .* for gradient accumulation make batch_size the "
                           r"global batch .*LocalSGD"):
            next(it)
    m.shutdown(wait=False)


def test_a_refused_second_batch_leaves_the_iterator_going_and_the_next_quorum_gets_its_steps_batch(house,
                                                                                                 image_dataset):
    """The refusal is raised inside the Loader's iterator: a loop that catches it and goes on (after the next quorum)
    gets that step's batch from the same iterator, through a failed step too, where the iterator had ended (a
    generator an error finished) and the loop with it, silently, as if the epoch were over."""
    options = {"pipeline": fastio.ImageEval(size=32), "batch_size": 8}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 4)]
    store = group_store()
    m = manager(store.port, house, 0)
    got = []
    with _loader(image_dataset, options, m) as loader:
        it = iter(loader)
        for step in range(4):
            m.start_quorum()
            got.append(next(it, {"index": torch.tensor([-1])})["index"].tolist())
            with pytest.raises(LoaderArgumentError, match=rf"^a second batch of torchft step {step} was asked"):
                next(it)
            if step == 1:  # a failed step: taken again after the next quorum, from the same iterator
                m.report_error(RuntimeError("step 1 fails on purpose"))
                assert not m.should_commit()
                m.start_quorum()
                assert next(it)["index"].tolist() == got[-1]
            assert m.should_commit()
    m.shutdown(wait=False)
    assert got == want


def test_a_checkpoint_of_a_run_without_replicas_restores_into_a_torchft_run_at_the_managers_step(
        house, image_dataset, tmp_path):
    """A run moving to torchft: its checkpoint holds no Manager. With the Manager at a step other than the saved
    position the restore is refused before the model loads; with the Manager at that step (set by the app) the
    Loader goes on from it."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 4)]
    saved = torch.nn.Linear(2, 2)
    with _loader(image_dataset, options) as plain, fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        it = iter(plain)
        for _ in range(3):
            next(it)
        ck.save(3, {"loader": plain, "model": saved}, blocking=True)
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, options, m) as loader, fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        model = _refused_before_the_model_loads(tmp_path / "ck", loader, r"app key 'loader': loader state \(saved "
                                                r"without replicas=\) is at epoch 0, 18 samples consumed: global "
                                                r"batch 3 of 6 samples, the torchft Manager at step 0")
        m.load_state_dict({"step": 3, "batches_committed": 3})
        ck.restore_latest({"loader": loader, "model": model})
        (b,), = steps([(m, loader)], 1)
    assert torch.equal(model.weight, saved.weight) and (b["step"], b["index"].tolist()) == (3, want[3])
    m.shutdown(wait=False)


def _union_is_the_global_batch(rows: list, want: list[list[int]]) -> None:
    """Each step's participating shares, in quorum order, are that step's one-process batch."""
    for row in rows:
        shares = [b["index"].tolist() for b in row if b["participating"]]
        assert [i for share in shares for i in share] == want[row[0]["step"]], row[0]["step"]


def test_a_group_leaving_twice_and_coming_back_loses_and_repeats_no_sample(house, image_dataset):
    """Quorums of 2, 1, 2 (the group back heals with an empty batch, then takes part), 1 group through an epoch
    boundary: every step is its one-process batch, split over the groups of that step's quorum."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 10)]
    stores = [group_store() for _ in range(3)]
    m0 = manager(stores[0].port, house, 0)
    l0 = _loader(image_dataset, options, m0)
    rows = []
    for life in range(2):
        m1 = manager(stores[1 + life].port, house, 1)
        with _loader(image_dataset, options, m1) as l1:
            rows += steps([(m0, l0), (m1, l1)], 3)
        m1.shutdown(wait=False)
        rows += steps([(m0, l0)], 2)
    assert [r[0]["step"] for r in rows] == list(range(10)) and not rows[5][1]["participating"]
    _union_is_the_global_batch(rows, want)
    l0.close()
    m0.shutdown(wait=False)


def test_a_checkpoint_of_two_groups_restores_into_three(house, image_dataset, tmp_path):
    """Saved by one of 2 groups at step 3, restored by 3 new groups: each step from 3 on is split in 3."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 6)]
    stores = [group_store() for _ in range(5)]
    pairs = [(m, _loader(image_dataset, options, m)) for m in (manager(stores[g].port, house, g) for g in range(2))]
    steps(pairs, 3)
    with fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        ck.save(3, {"loader": pairs[0][1], "torchft": pairs[0][0]}, blocking=True)
    for m, loader in pairs:
        loader.close()
        m.shutdown(wait=False)
    pairs = [(m, _loader(image_dataset, options, m)) for m in (manager(stores[g].port, house, g) for g in range(2, 5))]
    for m, loader in pairs:
        with fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
            ck.restore_latest({"loader": loader, "torchft": m})
    rows = steps(pairs, 3)
    assert [row[0]["step"] for row in rows] == [3, 4, 5]
    assert all(b["participating"] and len(b["index"]) == 2 for row in rows for b in row)
    _union_is_the_global_batch(rows, want)
    for m, loader in pairs:
        loader.close()
        m.shutdown(wait=False)


def test_a_group_restarted_from_an_older_checkpoint_heals_to_its_peers_step(house, image_dataset, tmp_path):
    """A group saved at step 3 and started again from that checkpoint while its peer went on to step 6: it heals
    with an empty batch at step 6 and then takes half of each global batch."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 9)]
    stores = [group_store() for _ in range(3)]
    m0, m1 = manager(stores[0].port, house, 0), manager(stores[1].port, house, 1)
    l0, l1 = _loader(image_dataset, options, m0), _loader(image_dataset, options, m1)
    steps([(m0, l0), (m1, l1)], 3)
    with fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        ck.save(3, {"loader": l1, "torchft": m1}, blocking=True)
    l1.close()
    m1.shutdown(wait=False)
    steps([(m0, l0)], 3)
    m1 = manager(stores[2].port, house, 1)
    l1 = _loader(image_dataset, options, m1)
    with fastio.Checkpointer(tmp_path / "ck", signals=()) as ck:
        ck.restore_latest({"loader": l1, "torchft": m1})
    rows = steps([(m0, l0), (m1, l1)], 3)
    assert [b["step"] for row in rows for b in row] == [6, 6, 7, 7, 8, 8]
    assert not rows[0][1]["participating"] and all(b["participating"] for row in rows[1:] for b in row)
    _union_is_the_global_batch(rows, want)
    for m, loader in ((m0, l0), (m1, l1)):
        loader.close()
        m.shutdown(wait=False)


def test_the_stats_of_an_epoch_end_with_it_when_the_state_is_saved_between_steps(house, image_dataset):
    """``stats()["last_epoch"]`` is the epoch before the current one (8 steps of 6 samples), also when the loop
    saves the Loader's state after each step: the save moved the Loader's epoch ahead of its batches, and the
    epoch's end was not counted."""
    store = group_store()
    m = manager(store.port, house, 0)
    with _loader(image_dataset, {"pipeline": fastio.Raw(), "batch_size": 6}, m) as loader:
        for _ in range(10):
            steps([(m, loader)], 1)
            loader.state_dict()
        stats = loader.stats()
    assert (stats["last_epoch"]["batches"], stats["epoch"]["batches"], stats["overall"]["batches"]) == (8, 2, 10)
    m.shutdown(wait=False)


def test_a_state_of_a_group_of_two_ranks_loads_into_a_group_of_one(house, image_dataset):
    """Replica groups restarted with another number of ranks: the state names the group's world size, but the order
    is the global batches', so a one-rank group goes on from the step with the whole global batch."""
    options = {"pipeline": fastio.Raw(), "batch_size": 6}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 1)]
    stores = group_store(), group_store()
    two = manager(stores[0].port, house, 0, rank=0, world=2)
    with _loader(image_dataset, options, two) as loader:
        state = loader.state_dict()
    two.shutdown(wait=False)
    one = manager(stores[1].port, house, 1)
    with _loader(image_dataset, options, one) as loader:
        loader.load_state_dict(state)
        (b,), = steps([(one, loader)], 1)
    assert state["world_size"] == 2 and b["index"].tolist() == want[0]
    one.shutdown(wait=False)


def test_a_state_of_a_multi_rank_run_without_replicas_loads_at_its_global_batch_and_back(house, image_dataset):
    """A torchrun run of 2 ranks of 5 samples moving to torchft with a global batch of 10: its state's batch_size is
    each rank's, so it is the same global batch (refused before: "batch_size=5, this Loader's global batch is 10");
    one of 2 ranks of 4 is another global batch, refused naming both. And back: the torchft Loader's state goes on
    in a plain Loader of 2 ranks of 5 at that step's samples."""
    options = {"pipeline": fastio.Raw(), "batch_size": 10}
    want = [b["index"].tolist() for b in _one_process(image_dataset, options, 4)]
    states = {}
    for per_rank in (5, 4):
        with _loader(image_dataset, {"pipeline": fastio.Raw(), "batch_size": per_rank}, rank=0, world_size=2) as plain:
            it = iter(plain)
            next(it), next(it)
            states[per_rank] = plain.state_dict()
    store = group_store()
    m = manager(store.port, house, 0)
    m.load_state_dict({"step": 2, "batches_committed": 2})
    with _loader(image_dataset, options, m) as loader:
        with pytest.raises(LoaderStateError, match=r"loader state has a global batch of 8 \(saved without replicas=: "
                           r"batch_size=4 on each of 2 ranks\), this Loader's global batch is 10"):
            loader.load_state_dict(states[4])
        loader.load_state_dict(states[5])
        (b,), = steps([(m, loader)], 1)
        back = loader.state_dict()
    m.shutdown(wait=False)
    with _loader(image_dataset, {"pipeline": fastio.Raw(), "batch_size": 5}) as plain:
        plain.load_state_dict(back)
        assert next(iter(plain))["index"].tolist() == want[3][:5]
    assert (b["step"], b["index"].tolist()) == (2, want[2])
