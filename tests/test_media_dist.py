"""fastio.VideoClips / fastio.AudioClips under real ranks and the trainers (issue 31): 2 gloo ranks (forked by
``tests/helpers.py``'s ``start_ranks``) reading videos, audio and a mixture of videos and photos, each sample once
an epoch with the clip one process gives it (by frame content, photo colour and pitch, and bit for bit), their
mid-epoch states resumed on 2 ranks exactly and on 1 and 3 ranks elastically; Accelerate (2 ranks, a video and an
audio loader registered, killed after ``save_state`` and resumed: the same weights); Lightning with AudioClips
resumed mid-epoch, and validating on clips that are the same on every validation run; a clip loader's state
through the Checkpointer, also into other clip options."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fork_ranks, forked, free_port, join_group, start_ranks
from resume import batches, same_batch

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402

VIDEO_FRAMES = {"c0/v0": 10, "c0/v1": 12, "c0/v2": 14, "c0/v3": 16, "c0/short": 4,
                "c1/v0": 10, "c1/v1": 12, "c1/v2": 14, "c1/v3": 16}
PITCH = {0: 440.0, 1: 1000.0}
PHOTO_COLORS = [(200, 10, 50), (30, 180, 90), (250, 250, 0), (5, 60, 220), (120, 0, 140)]
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
SHUFFLE = {"video": "global", "audio": "block", "mix": "global"}


def clip_loader(kind: str, dest, **kw):
    """The Loader of one kind (video: global shuffle; audio: block shuffle; mix: a Mixture of videos (weight 2)
    and photos (1), ``dest`` their two datasets, read with VideoClips); rank and world size from
    torch.distributed unless given."""
    import fastio

    if kind == "mix":
        dest = fastio.Mixture({"clips": dest[0], "photos": dest[1]}, weights={"clips": 2, "photos": 1})
    options = {"pipeline": audio_pipeline() if kind == "audio" else video_pipeline(), "shuffle": SHUFFLE[kind]}
    return fastio.Loader(dest, **{**options, **LOADER, **kw})


def frames_shown(video: torch.Tensor) -> np.ndarray:
    """[B, F] frame numbers of uint8 FHWC clips (each frame's mean gray level)."""
    return synthetic.frame_of_level(video.float().mean(dim=(2, 3, 4)).numpy())


def pitch_of(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(spectrum)])


def clips_of(batch: dict) -> list[tuple[int | tuple[int, int], int, object]]:
    """``(sample, start, clip)`` of each real (not padded) sample of a batch; the sample is its index, or in a
    mixture ``(source, index)``."""
    name, start = ("video", "start_frame") if "video" in batch else ("audio", "start_sample")
    ids = batch["index"].tolist() if "source" not in batch else list(zip(batch["source"].tolist(),
                                                                         batch["index"].tolist()))
    return [(i, int(s), batch[name][j].clone()) for j, (i, s, p) in
            enumerate(zip(ids, batch[start], batch["padded"])) if not p]


# -- 2 real gloo ranks ----------------------------------------------------------------------------------------

def _first_run(data: dict[str, str], out: str, save_after: int) -> None:
    """A rank of the first run: each kind's whole epoch 0 (rank and world size from torch.distributed), its state
    saved after ``save_after`` batches."""
    import torch.distributed as dist

    rank = dist.get_rank()
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


def _resumed_run(data: dict[str, str], out: str, name: str) -> None:
    """A rank of a resumed run: each kind's loader, new, loads the state its rank saved (rank 0's where the first
    run had no such rank) from its file and reads the rest of epoch 0."""
    import torch.distributed as dist

    rank = dist.get_rank()
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


def _rank_runs(rank: int, data: dict[str, str], out: str) -> None:
    """A process of ``rank_runs``: the first run on 2 ranks, then its resumes on 2 and on 3, each run a gloo group
    of its own (``join_group``); a rank that is not in a run waits until rank 0 marks it done."""
    import torch.distributed as dist

    runs = [("first", 2, lambda: _first_run(data, out, SAVE_AFTER)),
            ("resume2", 2, lambda: _resumed_run(data, out, "resume2")),
            ("resume3", 3, lambda: _resumed_run(data, out, "resume3"))]
    for name, world, run in runs:
        done = Path(out, f"{name}.done")
        if rank >= world:
            while not done.exists():
                time.sleep(0.05)
            continue
        join_group(rank, world, Path(out, f"{name}.port"))
        try:
            run()
            dist.barrier()  # every rank's files written before the next run reads them
        finally:
            dist.destroy_process_group()
        if rank == 0:
            done.touch()


SAVE_AFTER = 1  # batches of 2 a rank: 4 of the epoch's samples consumed at the save


@pytest.fixture(scope="module")
def photo_ds(tmp_path_factory) -> Path:
    """5 solid-colour PNGs of different sizes (c0/p0 .. c0/p4: PHOTO_COLORS[k]), converted."""
    from PIL import Image

    root = tmp_path_factory.mktemp("mdphotos")
    (root / "src" / "c0").mkdir(parents=True)
    for k, color in enumerate(PHOTO_COLORS):
        Image.new("RGB", (40 + 13 * k, 30 + 7 * k), color).save(root / "src" / "c0" / f"p{k}.png")
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False))
    return root / "ds"


@pytest.fixture(scope="module")
def rank_data(video_ds, audio_ds, photo_ds) -> dict:
    """What ``clip_loader`` reads for each kind."""
    return {"video": str(video_ds), "audio": str(audio_ds), "mix": [str(video_ds), str(photo_ds)]}


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory, rank_data) -> Path:
    """The first run (2 ranks) and its resumes on 2 and 3 ranks; their batches and states, per kind and rank. The
    three runs share one set of 3 processes (each starts, imports DALI and builds its first pipeline once, the
    costly part of these runs); every Loader of a run is new, a resumed one restored from the state file the
    first run wrote."""
    out = tmp_path_factory.mktemp("ranks")
    start_ranks(_rank_runs, (rank_data, str(out)), 3)
    return out


def _runs(out: Path, kind: str, name: str, world: int) -> list[dict]:
    return [torch.load(out / f"{kind}.{name}.rank{r}.pt", weights_only=False) for r in range(world)]


def one_process_clips(kind: str, dest) -> tuple[list, dict]:
    """Epoch 0 read by one process (world_size=1): its samples (a mixture's may repeat) and, for each, the
    ``(start, clip, key)`` of each of its deliveries (a repeat within the epoch draws its own clip)."""
    with clip_loader(kind, dest, world_size=1, rank=0) as loader:
        got = [c for b in loader for c in clips_of(b)]
        keys = {i: loader.key(*i) if isinstance(i, tuple) else loader.key(i) for i, _, _ in got}
    clips: dict = {}
    for i, s, c in got:
        clips.setdefault(i, []).append((s, c, keys[i]))
    return sorted(i for i, _, _ in got), clips


def check_clip(kind: str, sample, key: str, start: int, clip) -> None:
    """A clip by content: the frames its start says (a short video repeating its last), a photo's colour on
    every frame of a still clip, or the tone of its class."""
    if kind == "mix" and sample[0] == 1:
        assert start == 0 and (clip.numpy() == np.array(PHOTO_COLORS[int(key[-1])], np.uint8)).all(), key
    elif kind in ("video", "mix"):
        n = VIDEO_FRAMES[key]
        want = np.minimum(start + 2 * np.arange(3), n - 1)
        assert frames_shown(clip[None])[0].tolist() == want.tolist(), (key, start)
        assert 0 <= start <= max(n - 5, 0), (key, start)
    elif not key.endswith("short"):
        assert abs(pitch_of(clip.numpy(), 8000) - PITCH[int(key[1])]) < 8, (key, start)


def check_against_one_process(kind: str, got: list, single: tuple[list, dict]) -> None:
    """``got`` (``clips_of`` over every rank of a run or runs) holds the samples of one process's epoch 0 (each
    once; a mixture's repeats as often), each delivery with the start and clip (bit for bit) of one of that
    sample's deliveries there, checked by content."""
    samples, clips = single
    assert sorted(i for i, _, _ in got) == samples
    left = {i: list(v) for i, v in clips.items()}
    for i, start, clip in got:
        match = [k for k, (s, c, _) in enumerate(left[i]) if s == start and torch.equal(c, clip)]
        assert match, (left[i][0][2] if left[i] else i, start, [s for s, _, _ in left[i]])
        _, _, key = left[i].pop(match[0])
        check_clip(kind, i, key, start, clip)


KINDS = ["video", "audio", "mix"]


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_read_each_sample_once_with_the_clip_one_process_gives_it(rank_runs, rank_data, kind):
    """Video (global shuffle), audio (block shuffle), and a mixture of videos and photos (still clips) on 2
    ranks: together the samples of one process's epoch, each with its clip."""
    single = one_process_clips(kind, rank_data[kind])
    if kind != "mix":
        assert single[0] == list(range(len(single[0])))
    runs = _runs(rank_runs, kind, "first", 2)
    assert [(r["rank"], r["world"]) for r in runs] == [(0, 2), (1, 2)]
    assert len(runs[0]["batches"]) == len(runs[1]["batches"])
    assert runs[0]["state"] == runs[1]["state"] and runs[0]["state"]["consumed"] == 4 * SAVE_AFTER
    check_against_one_process(kind, [c for r in runs for b in r["batches"] for c in clips_of(b)], single)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mid_epoch_state_of_two_ranks_resumes_exactly_on_two(rank_runs, kind):
    first, resumed = _runs(rank_runs, kind, "first", 2), _runs(rank_runs, kind, "resume2", 2)
    for rank, (a, b) in enumerate(zip(first, resumed)):
        want = a["batches"][SAVE_AFTER:]
        assert len(b["batches"]) == len(want) > 0, rank
        for k, (x, y) in enumerate(zip(want, b["batches"])):
            assert same_batch(x, y), f"rank {rank}: batch {SAVE_AFTER + k} differs after the resume"
        assert b["epoch"] == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [1, 3])
def test_a_mid_epoch_state_of_two_ranks_resumes_on_another_number_each_sample_once(rank_runs, rank_data, kind,
                                                                                  world):
    """Elastic: the samples of the 2 ranks' first batches, then the rest of the epoch on 1 rank (here) or 3 (real
    ranks): every sample once, each with the clip one process gives it."""
    first = _runs(rank_runs, kind, "first", 2)
    before = [c for r in first for b in r["batches"][:SAVE_AFTER] for c in clips_of(b)]
    if world == 3:
        after = [c for r in _runs(rank_runs, kind, "resume3", 3) for b in r["batches"] for c in clips_of(b)]
    else:
        with clip_loader(kind, rank_data[kind], world_size=1, rank=0) as loader:
            loader.load_state_dict(first[1]["state"])
            after = [c for b in loader for c in clips_of(b)]
    check_against_one_process(kind, before + after, one_process_clips(kind, rank_data[kind]))


# -- Lightning ------------------------------------------------------------------------------------------------

def _lightning_fit(dest, pipeline, where: Path, *, epochs: int, save_every: int = 0, resume: str | None = None,
                   validate: bool = False, devices: int = 1) -> dict:
    """One Lightning fit (CPU; ``devices`` > 1: this process is a rank of ``strategy="ddp"`` on gloo) of a tiny
    model on a clip dataset through FastioDataModule (the dataset also validated on, with the pipeline's
    evaluation form, where ``validate``): the clips this rank trained and validated on (``(epoch, index, start,
    clip)`` each) and the final weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastio.integrations.lightning import FastioDataModule

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 2)
            self.trained, self.validated = [], []

        def _features(self, batch):
            clip = batch["video"] if "video" in batch else batch["audio"]
            return clip.float().flatten(1).std(dim=1, keepdim=True)

        def training_step(self, batch, _):
            self.trained += [(self.current_epoch, *c) for c in clips_of(batch)]
            return torch.nn.functional.cross_entropy(self.head(self._features(batch)), batch["label"])

        def validation_step(self, batch, _):
            self.validated += [(self.current_epoch, *c) for c in clips_of(batch)]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callbacks = [ModelCheckpoint(dirpath=where, filename="{step}", save_top_k=-1,
                                 every_n_train_steps=save_every)] if save_every else []
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=devices, logger=False, callbacks=callbacks,
                         strategy="ddp" if devices > 1 else "auto",
                         enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=where)
    data = FastioDataModule(str(dest), str(dest) if validate else None, pipeline=pipeline, **LOADER)
    torch.manual_seed(0)
    model = Model()
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    return {"trained": model.trained, "validated": model.validated, "weights": model.head.state_dict()}


def same_clips(a: list[tuple], b: list[tuple]) -> bool:
    """Two lists of ``(epoch, index, start, clip)``, the clips compared bit for bit."""
    return len(a) == len(b) and all(x[:3] == y[:3] and torch.equal(x[3], y[3]) for x, y in zip(a, b))


def test_lightning_audio_clips_resumed_mid_epoch_train_what_the_whole_run_trained(audio_ds, tmp_path, one_thread):
    """8 tones, 2 a batch: 4 steps an epoch, a checkpoint after step 3 (mid-epoch 0) and 6 (mid-epoch 1); resumed
    from step 6: the same clips (bit for bit) in the same order as the run that went on, and the same weights."""
    pytest.importorskip("lightning.pytorch")
    whole = _lightning_fit(audio_ds, audio_pipeline(), tmp_path / "whole", epochs=3, save_every=3)
    assert (tmp_path / "whole" / "step=6.ckpt").exists()
    resumed = _lightning_fit(audio_ds, audio_pipeline(), tmp_path / "resumed", epochs=3,
                             resume=str(tmp_path / "whole" / "step=6.ckpt"))
    assert [t[0] for t in resumed["trained"]][:1] == [1] and len(resumed["trained"]) == 4 + 8
    assert same_clips(resumed["trained"], whole["trained"][-len(resumed["trained"]):])
    for epoch in range(3):
        assert sorted(t[1] for t in whole["trained"] if t[0] == epoch) == list(range(8)), epoch
    assert all(torch.equal(whole["weights"][k], resumed["weights"][k]) for k in whole["weights"])


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_lightning_validation_gives_every_run_the_same_clips(video_ds, audio_ds, tmp_path, kind, one_thread):
    """FastioDataModule's validation Loader (the pipeline's evaluation form: VideoClips center-cropped) gives
    each sample the same clip on every validation run of a fit, and in another fit: validation losses of
    different epochs and runs compare the same inputs."""
    pytest.importorskip("lightning.pytorch")
    dest = {"video": video_ds, "audio": audio_ds}[kind]
    pipeline = video_pipeline() if kind == "video" else audio_pipeline()
    runs = [_lightning_fit(dest, pipeline, tmp_path / f"run{k}", epochs=e, validate=True)
            for k, e in enumerate((2, 1))]
    first = [v for v in runs[0]["validated"] if v[0] == 0]
    second = [v for v in runs[0]["validated"] if v[0] == 1]
    assert sorted(v[1] for v in first) == list(range(len(VIDEO_FRAMES if kind == "video" else AUDIO_FILES) *
                                                      (1 if kind == "video" else 2)))
    assert same_clips([(0, *v[1:]) for v in second], first), "the second validation run saw other clips"
    assert same_clips(runs[1]["validated"], first), "another fit validated on other clips"


# -- Accelerate -------------------------------------------------------------------------------------------------

def _accelerate_runs(rank: int, world: int, data: dict[str, str], out: str, runs: list[dict]) -> None:
    """A rank of Accelerate runs, one after the other in this process, each a fresh process group on its own
    port (``run["port"]``), Accelerate's process-wide state forgotten in between (as ``tests/accelerate_counts.py``
    does)."""
    import torch.distributed
    from accelerate.state import AcceleratorState, GradientState

    for run in runs:
        _accelerate_run(rank, world, data, out, run)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _accelerate_run(rank: int, world: int, data: dict[str, str], out: str, run: dict) -> None:
    """A rank of an Accelerate run started as torchrun starts one (``RANK``, ``WORLD_SIZE``, ``MASTER_*``): a
    tiny model trained on a video and an audio loader (both registered for checkpointing) for ``run["steps"]``
    steps; ``save_at``: ``save_state`` after that step; ``kill_at``: SIGKILLed after that step; ``resume``: the
    state loaded first (the run then starts after step ``resume_step``). Each step's clips (index, start and a
    checksum of each clip) go to ``NAME.rankR.pt``, and rank 0's final weights to ``NAME.weights.pt``."""
    import os
    import signal
    import zlib

    import torch.nn.functional as F
    from accelerate import Accelerator

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run["port"]))
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    loaders = [clip_loader(kind, data[kind], rank=accelerator.process_index, world_size=accelerator.num_processes)
               for kind in ("video", "audio")]
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loaders (docs/trainers.md)
    accelerator.register_for_checkpointing(*loaders)
    step = 0
    if run.get("resume"):
        accelerator.load_state(run["resume"])
        step = run["resume_step"]
    streams, log = [batches(loader) for loader in loaders], []
    while step < run["steps"]:
        video, audio = (next(s) for s in streams)
        features = [torch.stack([video["video"].float().mean(dim=(1, 2, 3, 4)) / 255, torch.zeros(2)], 1),
                    torch.stack([torch.zeros(2), audio["audio"].std(dim=1)], 1)]
        loss = sum(F.cross_entropy(model(f), b["label"]) for f, b in zip(features, (video, audio)))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        log.append([(i, s, zlib.crc32(c.numpy().tobytes())) for b in (video, audio) for i, s, c in clips_of(b)])
        if step == run.get("save_at"):
            accelerator.save_state(str(Path(out, "state")))
        if step == run.get("kill_at"):
            Path(out, f"killed.rank{rank}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save(log, Path(out, f"{run['name']}.rank{rank}.pt"))
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), Path(out, f"{run['name']}.weights.pt"))
    for loader in loaders:
        loader.close()
    accelerator.end_training()


def _accelerate_sets(_: int, world: int, data: dict[str, str], out: str, sets: list[list[dict]],
                     timeout: float) -> None:
    """The process the Accelerate test starts: Accelerate imported once (~2 s of CPU a process: it was imported
    once a rank), then each set of runs in ``world`` new processes forked from it (``_accelerate_runs``), one set
    after the other, each set's ranks waited for to their end (a rank its run SIGKILLs leaves the other to end by
    itself); their exit codes, a list a set, to ``OUT/sets.rc``. Ranks still running ``timeout`` seconds from the
    start are killed (their code: -9)."""
    import json
    import os
    import signal

    import accelerate  # noqa: F401
    from warm_python import ready_to_fork

    ready_to_fork()
    deadline, codes = time.monotonic() + timeout, []
    for runs in sets:
        pids = [forked(_accelerate_runs, rank, world, data, out, runs) for rank in range(world)]
        ended: dict[int, int] = {}
        while len(ended) < len(pids):
            for pid in set(pids) - set(ended):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        codes.append([ended[pid] for pid in pids])
    Path(out, "sets.rc").write_text(json.dumps(codes))


def test_accelerate_video_and_audio_loaders_killed_after_save_state_resume_exactly(video_ds, audio_ds, tmp_path):
    """2 ranks (gloo), 2 a batch: the video loader (9 samples: 3 steps an epoch) and the audio loader (8: 2 steps)
    saved with ``save_state`` after step 5 (both mid-epoch 1), the ranks SIGKILLed after step 6; new ranks
    ``load_state`` and train to step 8: the steps after 5 get the same clips (hash of each) as the run never
    interrupted, and the run ends with its weights bit for bit. The ranks of both sets are forked from one process
    that imported Accelerate (``_accelerate_sets``)."""
    pytest.importorskip("accelerate")
    import json

    data = {"video": str(video_ds), "audio": str(audio_ds)}
    runs = [{"name": "whole", "steps": 8, "port": free_port()},  # then, in the same processes:
            {"name": "killed", "steps": 8, "save_at": 5, "kill_at": 6, "port": free_port()}]
    resumed = {"name": "resumed", "steps": 8, "resume": str(tmp_path / "state"), "resume_step": 5,
               "port": free_port()}  # in new processes
    start_ranks(_accelerate_sets, (2, data, str(tmp_path), [runs, [resumed]], 180), 1)
    codes = json.loads((tmp_path / "sets.rc").read_text())
    assert codes[0] == [-9, -9], codes  # killed by their run (not hung, not failed)
    assert sorted(p.name for p in tmp_path.glob("whole.*")) == ["whole.rank0.pt", "whole.rank1.pt",
                                                                "whole.weights.pt"]
    assert sorted(p.name for p in tmp_path.glob("killed*")) == ["killed.rank0", "killed.rank1"]
    saved = [torch.load(tmp_path / "state" / f"custom_checkpoint_{k}.pkl", weights_only=False) for k in (0, 1)]
    assert [(s["epoch"], s["consumed"]) for s in saved] == [(1, 8), (2, 4)]  # mid-epoch, both
    assert codes[1] == [0, 0], codes
    for rank in range(2):
        whole, again = (torch.load(tmp_path / f"{n}.rank{rank}.pt") for n in ("whole", "resumed"))
        assert len(again) == 3 and again == whole[5:], rank
    whole, again = (torch.load(tmp_path / f"{n}.weights.pt") for n in ("whole", "resumed"))
    assert all(torch.equal(whole[k], again[k]) for k in whole)


# -- the Checkpointer ---------------------------------------------------------------------------------------------

def test_a_clip_loaders_state_through_the_checkpointer_resumes_exactly(video_ds, tmp_path):
    """``app={"loader": loader, "model": ...}`` saved after 3 batches of 2 (mid-epoch 0 of 9 videos), restored
    into a fresh loader: the next 4 batches (into epoch 1) bit for bit."""
    from fastio.checkpoint import Checkpointer

    model = torch.nn.Linear(2, 2)
    with clip_loader("video", video_ds, world_size=1, rank=0) as loader, Checkpointer(tmp_path / "ck") as ckpt:
        stream = batches(loader)
        for _ in range(3):
            next(stream)
        ckpt.save(3, {"loader": loader, "model": model}, blocking=True)
        want = [next(stream) for _ in range(4)]
    with clip_loader("video", video_ds, world_size=1, rank=0) as loader, Checkpointer(tmp_path / "ck") as ckpt:
        state = ckpt.restore_latest({"loader": loader, "model": torch.nn.Linear(2, 2)})
        assert state.step == 3 and (loader.epoch, loader.state_dict()["consumed"]) == (0, 6)
        got = [b for b, _ in zip(batches(loader), range(4))]
    assert len(got) == 4 and all(same_batch(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("changed", [dict(frames=2), dict(stride=1), dict(frames=4, stride=3)])
def test_a_clip_loaders_state_restored_with_other_clip_options_continues_the_order_with_the_new_clips(
        video_ds, tmp_path, changed):
    """The loader's state is a position in the sample order, which the clip options do not change: a state saved
    with ``VideoClips(frames=3, stride=2)`` restores into a loader of other frames or stride (docs/media.md says
    why it is accepted): the same samples follow in the same order as in the run that was not interrupted, each
    with the clip a run of the new options from the start gives it (its frames by content)."""
    import fastio
    from fastio.checkpoint import Checkpointer

    with clip_loader("video", video_ds, world_size=1, rank=0) as loader, Checkpointer(tmp_path / "ck") as ckpt:
        stream = batches(loader)
        for _ in range(2):
            next(stream)
        ckpt.save(2, {"loader": loader}, blocking=True)
        want = [b["index"].tolist() for b in loader]  # the rest of epoch 0
    options = {"frames": 3, "stride": 2, **changed}
    other = fastio.VideoClips(size=16, dtype="uint8", layout="FHWC", **options)
    make = dict(pipeline=other, shuffle=SHUFFLE["video"], world_size=1, rank=0, **LOADER)
    with fastio.Loader(video_ds, **make) as fresh:
        starts = {i: s for b in fresh for i, s, _ in clips_of(b)}  # the new options' clips of epoch 0
    with fastio.Loader(video_ds, **make) as loader, Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.restore_latest({"loader": loader})
        got = list(loader)
        keys = {i: loader.key(i) for i in range(9)}
    assert [b["index"].tolist() for b in got] == want
    for b in got:
        assert b["video"].shape[1] == options["frames"]
        for j, i in enumerate(b["index"].tolist()):
            start, n = int(b["start_frame"][j]), VIDEO_FRAMES[keys[i]]
            assert start == starts[i]
            want_frames = np.minimum(start + options["stride"] * np.arange(options["frames"]), n - 1)
            assert frames_shown(b["video"])[j].tolist() == want_frames.tolist(), (keys[i], start)


def test_a_validation_loop_of_ones_own_gets_the_same_clips_with_set_epoch_0(video_ds):
    """docs/media.md's rule for validation outside Lightning: ``set_epoch(0)`` before each pass gives every pass
    the same clips; without it the second pass draws other ones."""
    pipeline = video_pipeline().evaluation()
    with clip_loader("video", video_ds, pipeline=pipeline, world_size=1, rank=0, shuffle="none") as loader:
        passes = []
        for _ in range(3):
            loader.set_epoch(0)
            passes.append([c for b in loader for c in clips_of(b)])
        drifting = [c for b in loader for c in clips_of(b)]  # epoch 1: no set_epoch(0)
    assert all(same_clips([(0, *c) for c in p], [(0, *c) for c in passes[0]]) for p in passes[1:])
    assert [s for _, s, _ in drifting] != [s for _, s, _ in passes[0]]


# -- s3:// ------------------------------------------------------------------------------------------------------

def _s3_run(rank: int, world: int, port: int, urls: dict[str, str], out: str, cache: dict) -> None:
    """A rank reading each kind's epoch 0 from ``s3://`` through the node's one cache (``cache``: the Loader's
    cache options), its batches to ``KIND.s3.rankR.pt``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for kind, url in urls.items():
            with clip_loader(kind, url, **cache) as loader:
                got = []
                for batch in loader:
                    got.append(batch)
                    dist.all_reduce(torch.ones(1))
            torch.save(got, Path(out, f"{kind}.s3.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_read_clips_from_s3_through_one_small_cache_as_from_disk(moto_server, s3_bucket, rank_runs,
                                                                          rank_data, tmp_path):
    """The video and audio datasets (3 shards each) on a real S3 server (moto), read by 2 ranks sharing one node
    cache that holds 3 of the largest (so it evicts): each rank's batches are those it read from the local
    datasets, bit for bit."""
    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    urls, largest = {}, 0
    for kind in ("video", "audio"):
        urls[kind] = f"s3://{s3_bucket}/{kind}"
        open_storage(urls[kind], moto_server.options()).publish_dir(Path(rank_data[kind]),
                                                                    keys_last=(MANIFEST_NAME,))
        largest = max([largest, *(p.stat().st_size for p in Path(rank_data[kind], "shards").glob("*.tar"))])
    cache = {"cache_dir": str(tmp_path / "cache"), "cache_size": 3 * largest + 4096,
             "storage_options": moto_server.options()}
    start_ranks(_s3_run, (2, free_port(), urls, str(tmp_path), cache), 2)
    for kind in urls:
        for rank, local in enumerate(_runs(rank_runs, kind, "first", 2)):
            remote = torch.load(tmp_path / f"{kind}.s3.rank{rank}.pt", weights_only=False)
            assert len(remote) == len(local["batches"]), (kind, rank)
            for k, (x, y) in enumerate(zip(remote, local["batches"])):
                assert same_batch(x, y), f"{kind}, rank {rank}: batch {k} differs from the local dataset's"


def _lightning_ddp_rank(rank: int, plan: str) -> None:
    """A process of ``_lightning_ddp_runs``: the runs of ``plan`` (``plan_runs.run_plan``) as rank ``rank`` of
    those it is in, started as ``plan_runs.launch`` starts its processes."""
    import os

    import torch.distributed
    from plan_runs import run_plan

    os.environ.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", NODE_RANK="0")
    torch.set_num_threads(1)
    run_plan(plan, _lightning_ddp_run, torch.distributed.destroy_process_group)


def _lightning_ddp_ranks(_: int, plan: str) -> None:
    """The process ``lightning_ddp_runs`` starts: Lightning imported once, then the 3 processes of the plan forked
    from it (as ``plan_runs.launch`` starts a script's ranks)."""
    import lightning.pytorch  # noqa: F401

    import fastio.integrations.lightning  # noqa: F401

    fork_ranks(_lightning_ddp_rank, (plan,), 3)


def _lightning_ddp_run(argv: list[str]) -> None:
    """One run of the plan: ``argv[0]`` its options (JSON); the rank's result to ``OUT/NAME.rankR.pt``."""
    import json
    import os

    run = json.loads(argv[0])
    result = _lightning_fit(run["data"], audio_pipeline(), Path(run["where"]), epochs=run["epochs"],
                            save_every=run.get("save_every", 0), resume=run.get("resume"), validate=True,
                            devices=int(os.environ["WORLD_SIZE"]))
    torch.save(result, Path(run["out"], f"{run['name']}.rank{os.environ['RANK']}.pt"))


@pytest.fixture(scope="module")
def lightning_ddp_runs(tmp_path_factory, audio_ds) -> Path:
    """AudioClips under Lightning DDP (gloo), in one set of 3 processes (forked from one that imported Lightning):
    a whole run of 3 epochs on 2 ranks (2 steps an epoch, a checkpoint every step, validation each epoch), then
    resumes from its step 3 (mid-epoch 1) on 2 ranks and on 3."""
    import json

    out = tmp_path_factory.mktemp("lightning-ddp")
    common = {"data": str(audio_ds), "out": str(out), "epochs": 3}
    resume = {**common, "resume": str(out / "whole" / "step=3.ckpt")}
    runs = [(2, {**common, "name": "whole", "where": str(out / "whole"), "save_every": 1}),
            (2, {**resume, "name": "resume2", "where": str(out / "resume2")}),
            (3, {**resume, "name": "resume3", "where": str(out / "resume3")})]
    plan = out / "plan.json"
    plan.write_text(json.dumps({"done": str(out), "runs": [
        {"devices": n, "argv": [json.dumps(run)]} for n, run in runs]}))
    start_ranks(_lightning_ddp_ranks, (str(plan),), 1)
    return out


def test_lightning_ddp_audio_clips_resume_mid_epoch_on_two_ranks_and_three(lightning_ddp_runs, audio_ds):
    """2 ranks resumed from step 3 train the clips the whole run trained after it (each rank its own, bit for bit)
    and end with its weights; 3 ranks train the rest of epoch 1 and all of epoch 2, each sample once an epoch with
    the clip one process gives it; every validation run of every rank gives each sample the same clip."""
    pytest.importorskip("lightning.pytorch")
    out = lightning_ddp_runs
    whole = [torch.load(out / f"whole.rank{r}.pt", weights_only=False) for r in range(2)]
    again = [torch.load(out / f"resume2.rank{r}.pt", weights_only=False) for r in range(2)]
    three = [torch.load(out / f"resume3.rank{r}.pt", weights_only=False) for r in range(3)]
    for w, a in zip(whole, again):
        assert len(a["trained"]) == 6 and same_clips(a["trained"], w["trained"][6:])  # 3 steps of 2 clips
        assert all(torch.equal(w["weights"][k], a["weights"][k]) for k in w["weights"])
    epochs = {}
    for e in (1, 2):
        with clip_loader("audio", audio_ds, world_size=1, rank=0) as loader:
            loader.set_epoch(e)
            epochs[e] = {i: (s, c) for b in loader for i, s, c in clips_of(b)}
    trained = [t for w in whole for t in w["trained"][:6] if t[0] == 1] + [t for r in three for t in r["trained"]]
    for e in (1, 2):
        mine = [t for t in trained if t[0] == e]
        assert sorted(t[1] for t in mine) == list(range(8)), e
        assert all(t[2] == epochs[e][t[1]][0] and torch.equal(t[3], epochs[e][t[1]][1]) for t in mine), e
    clip_of = {}
    for _, i, s, c in (v for r in whole + again + three for v in r["validated"]):
        assert same_clips([(0, i, s, c)], [(0, i, *clip_of.setdefault(i, (s, c)))]), i
    assert sorted(clip_of) == list(range(8))
