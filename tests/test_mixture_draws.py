"""Fresh random draws for the samples a mixture repeats within one epoch: a small source with a large weight
cycles through its own epochs inside one mixture epoch, and each of its deliveries there gets its own crop,
flip or clip (docs/mixtures.md, "Random draws of repeated samples"); deliveries of a source that does not cycle
draw as they did before (tests/test_loader_fixtures.py holds the recorded batches)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from resume import check_resume, run_ranks

import fastio
from fastio.convert import synthetic
from fastio.convert.run import ConvertConfig, convert
from fastio.order.mixorder import MixSampler, MixSchedule
from fastio.order.sampler import Sampler, SamplerSpec

WEIGHTS = {"small": 3, "other": 1}
EPOCH = 40  # samples_per_epoch: the small source (9 samples) fills 30 positions of each mixture epoch


def _convert(src: Path, dest: Path) -> Path:
    convert(ConvertConfig(source=src, dest=dest, workers=1, progress=False))
    return dest


@pytest.fixture(scope="module")
def image_sources(tmp_path_factory) -> dict[str, str]:
    """9 JPEGs (the small source) and 10 PNGs, converted."""
    root = tmp_path_factory.mktemp("mixdraws")
    small = synthetic.make_imagefolder(root / "small-src", classes=3, per_class=3, min_side=40, max_side=64, seed=1)
    other = synthetic.make_imagefolder(root / "other-src", classes=2, per_class=5, min_side=32, max_side=56, seed=2,
                                       fmt="PNG")
    return {"small": str(_convert(small, root / "small")), "other": str(_convert(other, root / "other"))}


def _mixture(sources: dict[str, str]) -> fastio.Mixture:
    return fastio.Mixture(sources, weights=WEIGHTS, samples_per_epoch=EPOCH)


def _image_loader(sources, **kw) -> fastio.Loader:
    opts = dict(batch_size=8, pipeline=fastio.ImageTrain(size=24), device="cpu", seed=5, num_threads=1, world_size=1,
                rank=0, prefetch=2)
    return fastio.Loader(_mixture(sources), **{**opts, **kw})


def _deliveries(steps) -> list[tuple[int, int, bytes]]:
    """``(source, index, image bytes)`` of every delivered (not padded) sample of ``steps`` (batches, or lists of
    every rank's batches)."""
    out = []
    for step in steps:
        for b in step if isinstance(step, list) else [step]:
            for j, (s, i, p) in enumerate(zip(b["source"].tolist(), b["index"].tolist(), b["padded"].tolist())):
                if not p:
                    out.append((s, i, b["image"][j].numpy().tobytes()))
    return out


# -- the keys -------------------------------------------------------------------------------------------


def _mix_sampler(sizes=(9, 10), weights=(3.0, 1.0), samples=EPOCH, seed=5) -> MixSampler:
    schedule = MixSchedule(("small", "other"), weights, ("f0", "f1"), samples, seed)
    return MixSampler.make(SamplerSpec(batch_size=8, seed=seed), schedule, [(n,) for n in sizes])


def test_each_delivery_of_a_cycling_source_has_its_own_draw_key():
    sampler = _mix_sampler()
    for epoch in range(3):
        order = sampler.order(epoch)
        pos = np.arange(EPOCH)
        ids, src = order[pos], order.sources(pos)
        keys = order.draw_keys(pos, ids)
        assert order.repeats and keys is not None
        assert len(set(keys.tolist())) == EPOCH  # every delivery of the epoch draws its own
        assert Counter(ids[src == 0].tolist()).most_common(1)[0][1] >= 3  # the small source's samples repeat
        assert ((keys - ids) % 19 == 0).all()  # id + c * (all sources' samples)
        assert (keys[src == 1] == ids[src == 1]).all()  # the other source (10 of its 10) does not cycle in an epoch
    order = sampler.order(0)
    ids = order[np.arange(EPOCH)]
    first = np.unique(ids, return_index=True)[1]  # each sample's first delivery: in its source's first own epoch
    assert (order.draw_keys(np.arange(EPOCH), ids)[first] == ids[first]).all()  # keeps the draws of before


def test_no_draw_keys_where_nothing_repeats():
    """A dataset, and a mixture whose sources stay within one of their own epochs: the ids are the keys (nothing
    looked up), so their draws are those from before."""
    plan = Sampler(SamplerSpec(batch_size=4, seed=1), (10, 10), "fp").plan(0)
    assert not plan.order.repeats and plan.draw_keys(0, plan.batch(0)[0]) is None
    sampler = _mix_sampler(sizes=(30, 12), samples=12)  # 9 of 30 and 3 of 12 per epoch
    for epoch in range(3):
        plan = sampler.plan(epoch)
        assert not plan.order.repeats and plan.draw_keys(0, plan.batch(0)[0]) is None
    crossing = sampler.plan(3)  # the small source's 28th..36th samples: its own epoch 0 ends in there
    ids = crossing.order[np.arange(12)]
    keys = crossing.order.draw_keys(np.arange(12), ids)
    assert crossing.order.repeats and (keys == ids).sum() == 12 - 6  # 6 of its 9 are of its next own epoch


def test_draw_keys_do_not_depend_on_the_batch_or_rank():
    whole = _mix_sampler().plan(1)
    ids, keys = whole.batches()[0], whole.order.draw_keys(np.arange(EPOCH), whole.batches()[0])
    got = {}
    for rank in range(3):
        spec = SamplerSpec(batch_size=3, seed=5, drop_last=False)
        sampler = MixSampler.make(spec, _mix_sampler().schedule, [(9,), (10,)], world_size=3, rank=rank)
        plan = sampler.plan(1)
        for g in range(len(plan)):
            batch, padded = plan.batch(g)
            for p, i, k in zip(plan._positions(g) % EPOCH, batch, plan.draw_keys(g, batch)):
                got[int(p)] = (int(i), int(k))
    assert got == {p: (int(i), int(k)) for p, (i, k) in enumerate(zip(ids, keys))}


def test_an_epoch_whose_draw_keys_leave_int64_is_refused_naming_the_source(image_sources):
    """Found by hostile review of int64 bounds: a tiny source weighted to nearly every position of a long mixture
    epoch begins so many of its own epochs in it that ``id + c * total`` left int64: numpy wrapped the keys
    silently (repeats drew another sample's crops, or each other's). Refused where the epoch enters (the plan,
    ``set_epoch``, a state's check), naming the epoch and the source; an epoch the keys reach is unchanged."""
    from fastio.errors import LoaderStateError

    n = 2**62  # samples_per_epoch at its bound: the small source (9 samples) fills 0.999 of it
    sampler = _mix_sampler(weights=(0.999, 0.001), samples=n)
    with pytest.raises(ValueError, match=r"epoch 0 is past the draw keys' reach: source 'small' .*int64"):
        sampler.plan(0)
    fits = _mix_sampler(weights=(0.999, 0.001), samples=n // 4)  # c * 19 below 2**63: keys exact, as before
    pos = np.arange(n // 4 - 4, n // 4, dtype=np.int64)
    order = fits.plan(1).order
    ids = order[pos]
    src, k = fits.schedule.sources(1, pos)
    c = k // np.array([9, 10])[src] - order._first_cycle[src]
    assert c.max() > 2**56 and order.draw_keys(pos, ids).tolist() == [int(i) + int(x) * 19 for i, x in zip(ids, c)]
    mixture = fastio.Mixture(image_sources, weights={"small": 0.999, "other": 0.001}, samples_per_epoch=n)
    with fastio.Loader(mixture, batch_size=8, pipeline=fastio.ImageTrain(size=24), device="cpu", seed=5,
                       num_threads=1, world_size=1, rank=0) as ld:
        with pytest.raises(ValueError, match=r"epoch 0 .*source 'small'"):
            ld.set_epoch(0)
        with pytest.raises(LoaderStateError, match=r"epoch=0: .*source 'small'"):
            ld.check_state_dict(ld.state_dict())


# -- images ---------------------------------------------------------------------------------------------


def test_a_repeated_image_gets_a_new_crop_each_time(image_sources):
    """The reproducer: 9 images at weight 3 of a 40-sample epoch come 3 or 4 times each, each time cropped anew."""
    with _image_loader(image_sources) as loader:
        deliveries = _deliveries(list(loader))
    seen = defaultdict(list)
    for s, i, image in deliveries:
        seen[(s, i)].append(image)
    small = {k: v for k, v in seen.items() if k[0] == 0}
    assert len(small) == 9 and sorted({len(v) for v in small.values()}) == [3, 4]
    for key, images in small.items():
        assert len(set(images)) == len(images), f"sample {key} shown with the same crop twice in one epoch"


def test_exact_resume_gives_each_delivery_the_draws_of_the_uninterrupted_run(image_sources):
    check_resume(lambda: _image_loader(image_sources), 3, 4)  # across the epoch's end (5 batches an epoch)


def test_elastic_resume_from_two_ranks_to_three_keeps_every_delivery_and_its_draws(image_sources):
    def ranks(world):
        return [_image_loader(image_sources, world_size=world, rank=r, batch_size=3, drop_last=False)
                for r in range(world)]

    whole, _ = run_ranks(ranks(1))  # epoch 0 in one process
    before, states = run_ranks(ranks(2), n=3)
    after, _ = run_ranks(ranks(3), state=states[0])
    assert Counter(_deliveries(before) + _deliveries(after)) == Counter(_deliveries(whole))
    assert len(_deliveries(whole)) == EPOCH


# -- video ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video_sources(tmp_path_factory, image_sources) -> dict[str, str]:
    """9 VP9 videos of 24 frames (the small source) and the 10 PNGs."""
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("mixclips")
    for v in range(9):
        synthetic.make_video(root / "src" / f"c{v % 3}" / f"v{v}.webm", frames=24, fps=12, width=32, height=24)
    return {"small": str(_convert(root / "src", root / "videos")), "other": image_sources["other"]}


def test_a_repeated_video_gets_new_clips_each_time(video_sources):
    """9 videos at weight 3 against photos: each video's 3 or 4 clips of an epoch start where their frames say,
    not all at one frame."""
    pipe = fastio.VideoClips(frames=4, stride=2, size=16, dtype="uint8", layout="FHWC", crop="center")
    loader = fastio.Loader(_mixture(video_sources), batch_size=8, pipeline=pipe, device="cpu", seed=5, num_threads=1,
                           world_size=1, rank=0)
    starts = defaultdict(list)
    with loader:
        for b in list(loader):
            shown = synthetic.frame_of_level(b["video"].float().mean(dim=(2, 3, 4)).numpy())
            for j, (s, i, p) in enumerate(zip(b["source"].tolist(), b["index"].tolist(), b["padded"].tolist())):
                if s == 0 and not p:
                    assert shown[j].tolist() == (int(b["start_frame"][j]) + 2 * np.arange(4)).tolist()
                    starts[i].append(int(shown[j][0]))  # the start, by content
    assert len(starts) == 9 and sorted({len(v) for v in starts.values()}) == [3, 4]
    for i, got in starts.items():
        assert len(set(got)) > 1, f"video {i} shown {len(got)} times, every time from frame {got[0]}"


# -- audio ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_sources(tmp_path_factory) -> dict[str, str]:
    """9 WAV tones of 2 s (the small source) and 4 more, at 16 kHz; a tone's amplitude rises over time
    (``0.1 + 0.8 * t / seconds``), so a clip's first samples tell where it starts."""
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("mixaudio")
    for name, count in (("small", 9), ("other", 4)):
        for k in range(count):
            synthetic.make_audio(root / f"{name}-src" / f"c{k % 2}" / f"a{k}.wav", seconds=2.0, rate=16000,
                                 pitch=(440.0, 1000.0)[k % 2])
    return {name: str(_convert(root / f"{name}-src", root / name)) for name in ("small", "other")}


def test_a_repeated_audio_file_gets_new_clips_each_time(audio_sources):
    pipe = fastio.AudioClips(sample_rate=16000, seconds=0.25)
    loader = fastio.Loader(_mixture(audio_sources), batch_size=8, pipeline=pipe, device="cpu", seed=5, num_threads=1,
                           world_size=1, rank=0)
    starts = defaultdict(list)
    with loader:
        for b in list(loader):
            for j, (s, i, p) in enumerate(zip(b["source"].tolist(), b["index"].tolist(), b["padded"].tolist())):
                start = int(b["start_sample"][j])
                loud = float(np.abs(b["audio"][j].numpy()[:400]).max())
                assert abs(loud - (0.1 + 0.8 * start / 32000)) < 0.05, (s, i, start)  # the clip is where it says
                if s == 0 and not p:
                    starts[i].append(start)
    assert len(starts) == 9 and sorted({len(v) for v in starts.values()}) == [3, 4]
    for i, got in starts.items():
        assert len(set(got)) == len(got), f"audio file {i} clipped at the same sample twice in one epoch: {got}"
