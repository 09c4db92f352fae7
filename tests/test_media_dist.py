"""fastio.VideoClips / fastio.AudioClips under real ranks and the trainers (issue 31): 2 gloo ranks (forked by
``tests/helpers.py``'s ``start_ranks``) reading each sample once an epoch with the clip one process gives it
(checked by frame content, and the audio bit for bit), their mid-epoch states resumed on 2 ranks exactly and on
1 and 3 ranks elastically; Accelerate (2 ranks, a video and an audio loader registered, killed after
``save_state`` and resumed: the same weights); Lightning with AudioClips resumed mid-epoch and validating
VideoClips clips that are the same on every validation run; a clip loader's state through the Checkpointer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port, start_ranks
from resume import same_batch

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402

VIDEO_FRAMES = {"c0/v0": 10, "c0/v1": 12, "c0/v2": 14, "c0/v3": 16, "c0/short": 4,
                "c1/v0": 10, "c1/v1": 12, "c1/v2": 14, "c1/v3": 16}
PITCH = {0: 440.0, 1: 1000.0}
AUDIO_FILES = {"a.wav": (1.0, 22050, 2), "b.flac": (0.75, 16000, 1), "c.opus": (1.0, 48000, 1),
               "short.flac": (0.1, 16000, 1)}


@pytest.fixture(scope="module")
def video_ds(tmp_path_factory) -> Path:
    """9 VP9 videos of 64x48 (10..16 frames; c0/short: 4, shorter than a clip), 2 classes, converted."""
    root = tmp_path_factory.mktemp("mdvideos")
    for key, frames in VIDEO_FRAMES.items():
        synthetic.make_video(root / "src" / f"{key}.webm", frames=frames, fps=12)
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False,
                          max_samples_per_shard=3))
    return root / "ds"


@pytest.fixture(scope="module")
def audio_ds(tmp_path_factory) -> Path:
    """8 tones (class 0 at 440 Hz, class 1 at 1000 Hz; WAV stereo, FLAC, Opus, one shorter than a clip)."""
    root = tmp_path_factory.mktemp("mdaudio")
    for c, pitch in PITCH.items():
        for name, (seconds, rate, channels) in AUDIO_FILES.items():
            synthetic.make_audio(root / "src" / f"c{c}" / name, seconds=seconds, rate=rate, pitch=pitch,
                                 channels=channels)
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False,
                          max_samples_per_shard=3))
    return root / "ds"


def video_pipeline(frames: int = 3, stride: int = 2):
    import fastio

    return fastio.VideoClips(frames=frames, stride=stride, size=16, dtype="uint8", layout="FHWC")


def audio_pipeline():
    import fastio

    return fastio.AudioClips(sample_rate=8000, seconds=0.25)


LOADER = dict(batch_size=2, device="cpu", seed=5, num_threads=1, reader_threads=1)
SHUFFLE = {"video": "global", "audio": "block"}


def clip_loader(kind: str, dest, **kw):
    """The Loader of one kind (video: global shuffle; audio: block shuffle); rank and world size from
    torch.distributed unless given."""
    import fastio

    pipeline = video_pipeline() if kind == "video" else audio_pipeline()
    return fastio.Loader(dest, pipeline=pipeline, shuffle=SHUFFLE[kind], **{**LOADER, **kw})


def frames_shown(video: torch.Tensor) -> np.ndarray:
    """[B, F] frame numbers of uint8 FHWC clips (each frame's mean gray level)."""
    return synthetic.frame_of_level(video.float().mean(dim=(2, 3, 4)).numpy())


def pitch_of(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(spectrum)])


def clips_of(batch: dict) -> list[tuple[int, int, object]]:
    """``(index, start, clip)`` of each real (not padded) sample of a batch."""
    name, start = ("video", "start_frame") if "video" in batch else ("audio", "start_sample")
    return [(int(i), int(s), batch[name][j].clone()) for j, (i, s, p) in
            enumerate(zip(batch["index"], batch[start], batch["padded"])) if not p]


# -- 2 real gloo ranks ----------------------------------------------------------------------------------------

def _first_run(rank: int, world: int, port: int, data: dict[str, str], out: str, save_after: int) -> None:
    """A rank of the first run: each kind's whole epoch 0 (rank and world size from torch.distributed), its state
    saved after ``save_after`` batches."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for kind, dest in data.items():
            with clip_loader(kind, dest) as loader:
                got, state = [], None
                for step, batch in enumerate(loader):
                    got.append(batch)
                    dist.all_reduce(torch.ones(1))  # a DDP step: would hang if one rank ran out of batches
                    if step + 1 == save_after:
                        state = loader.state_dict()
                torch.save({"batches": got, "state": state, "rank": loader.rank, "world": loader.world_size},
                           Path(out, f"{kind}.first.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _resumed_run(rank: int, world: int, port: int, data: dict[str, str], out: str, name: str) -> None:
    """A rank of a resumed run: each kind's loader loads the state its rank saved (rank 0's where the first run
    had no such rank) and reads the rest of epoch 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for kind, dest in data.items():
            saved = Path(out, f"{kind}.first.rank{rank}.pt")
            saved = saved if saved.exists() else Path(out, f"{kind}.first.rank0.pt")
            with clip_loader(kind, dest) as loader:
                loader.load_state_dict(torch.load(saved, weights_only=False)["state"])
                got = []
                for batch in loader:
                    got.append(batch)
                    dist.all_reduce(torch.ones(1))
                torch.save({"batches": got, "epoch": loader.epoch}, Path(out, f"{kind}.{name}.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


SAVE_AFTER = 1  # batches of 2 a rank: 4 of the epoch's samples consumed at the save


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory, video_ds, audio_ds) -> Path:
    """The first run (2 ranks) and its resumes on 2 and 3 ranks; their batches and states, per kind and rank."""
    out = tmp_path_factory.mktemp("ranks")
    data = {"video": str(video_ds), "audio": str(audio_ds)}
    start_ranks(_first_run, (2, free_port(), data, str(out), SAVE_AFTER), 2)
    start_ranks(_resumed_run, (2, free_port(), data, str(out), "resume2"), 2)
    start_ranks(_resumed_run, (3, free_port(), data, str(out), "resume3"), 3)
    return out


def _runs(out: Path, kind: str, name: str, world: int) -> list[dict]:
    return [torch.load(out / f"{kind}.{name}.rank{r}.pt", weights_only=False) for r in range(world)]


def one_process_clips(kind: str, dest) -> dict[int, tuple[int, object]]:
    """index -> (start, clip) of epoch 0 read by one process (world_size=1)."""
    with clip_loader(kind, dest, world_size=1, rank=0) as loader:
        return {i: (s, c) for b in loader for i, s, c in clips_of(b)}


def check_clip(kind: str, dest, key: str, start: int, clip) -> None:
    """A clip by content: the frames its start says (a short video repeating its last), or the tone of its
    class."""
    if kind == "video":
        n = VIDEO_FRAMES[key]
        want = np.minimum(start + 2 * np.arange(3), n - 1)
        assert frames_shown(clip[None])[0].tolist() == want.tolist(), (key, start)
        assert 0 <= start <= max(n - 5, 0), (key, start)
    elif not key.endswith("short"):
        assert abs(pitch_of(clip.numpy(), 8000) - PITCH[int(key[1])]) < 8, (key, start)


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_two_ranks_read_each_sample_once_with_the_clip_one_process_gives_it(rank_runs, video_ds, audio_ds, kind):
    dest = {"video": video_ds, "audio": audio_ds}[kind]
    single = one_process_clips(kind, dest)
    runs = _runs(rank_runs, kind, "first", 2)
    assert [(r["rank"], r["world"]) for r in runs] == [(0, 2), (1, 2)]
    assert len(runs[0]["batches"]) == len(runs[1]["batches"])
    assert runs[0]["state"] == runs[1]["state"] and runs[0]["state"]["consumed"] == 4 * SAVE_AFTER
    got = [c for r in runs for b in r["batches"] for c in clips_of(b)]
    assert sorted(i for i, _, _ in got) == sorted(single) == list(range(len(single)))
    with clip_loader(kind, dest, world_size=1, rank=0) as loader:
        keys = {i: loader.key(i) for i in single}
    for i, start, clip in got:
        assert (start, True) == (single[i][0], torch.equal(clip, single[i][1])), (keys[i], start, single[i][0])
        check_clip(kind, dest, keys[i], start, clip)


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_a_mid_epoch_state_of_two_ranks_resumes_exactly_on_two(rank_runs, kind):
    first, resumed = _runs(rank_runs, kind, "first", 2), _runs(rank_runs, kind, "resume2", 2)
    for rank, (a, b) in enumerate(zip(first, resumed)):
        want = a["batches"][SAVE_AFTER:]
        assert len(b["batches"]) == len(want) > 0, rank
        for k, (x, y) in enumerate(zip(want, b["batches"])):
            assert same_batch(x, y), f"rank {rank}: batch {SAVE_AFTER + k} differs after the resume"
        assert b["epoch"] == 1


@pytest.mark.parametrize("kind", ["video", "audio"])
@pytest.mark.parametrize("world", [1, 3])
def test_a_mid_epoch_state_of_two_ranks_resumes_on_another_number_each_sample_once(rank_runs, video_ds, audio_ds,
                                                                                  kind, world):
    """Elastic: the samples of the 2 ranks' first batches, then the rest of the epoch on 1 rank (here) or 3 (real
    ranks): every sample once, each with the clip one process gives it."""
    dest = {"video": video_ds, "audio": audio_ds}[kind]
    first = _runs(rank_runs, kind, "first", 2)
    before = [c for r in first for b in r["batches"][:SAVE_AFTER] for c in clips_of(b)]
    if world == 3:
        after = [c for r in _runs(rank_runs, kind, "resume3", 3) for b in r["batches"] for c in clips_of(b)]
    else:
        with clip_loader(kind, dest, world_size=1, rank=0) as loader:
            loader.load_state_dict(first[1]["state"])
            after = [c for b in loader for c in clips_of(b)]
    single = one_process_clips(kind, dest)
    assert sorted(i for i, _, _ in before + after) == list(range(len(single)))
    for i, start, clip in before + after:
        assert start == single[i][0] and torch.equal(clip, single[i][1]), i
