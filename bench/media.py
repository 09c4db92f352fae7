"""Media benchmark: video and audio clips/s, fastio (``VideoClips`` / ``AudioClips``, DALI's CPU decoders) against
``torch.utils.data.DataLoader`` (workers = CPUs) decoding the same files with PyAV, with the same clip starts
(``fastio.pipelines.augment.clip_starts``), the same center crop and resize (video) and the same resampling and mixdown
(audio).

Rows: ``video`` (VP9, DALI's CPU decoder), ``h264`` (the same videos as H.264 ``.mp4``, x264's defaults: a keyframe
every 250 frames, B-frames; converted with ``--video-decoder nvdec`` and read on the CPU with
``VideoClips(cpu_fallback="pyav")``: PyAV decodes each clip from the keyframe before it, DALI crops and resizes;
the peer as for VP9), ``audio``.

Media: ``videos`` VP9 ``.webm`` of 10 s at 30 fps (300 frames, a Kinetics clip's length and rate), 320x240, a
keyframe every 128 frames (libvpx's default: what ffmpeg and ``fastio convert --transcode vp9`` make), with moving
noisy texture (so frames cost what real ones cost to decode), and ``audios`` FLAC files of 10 s at 44.1 kHz stereo.
Clips: 16 frames, stride 2, 112 x 112, uint8; audio 1 s at 16 kHz mono. The video peer seeks to the keyframe
before its clip (as torchvision's ``read_video`` and torchcodec do) and decodes from there. fastio's side is one
Loader for all rounds (round r: its epoch r; the peer's round r draws epoch r's clips), as training iterates one
Loader over its epochs; the peer's DataLoader ends each epoch (its workers' CPU counts when they end). Rounds are
interleaved; each figure is the median over rounds of fastio's clips/s over the peer's (targets >= 1.5), with CPU
ms per clip of both sides (this process and its finished children). soundfile and torchaudio are not installed
here: the audio peer decodes and resamples with PyAV.

``python bench/media.py [--repeats N] [--videos N] [--audios N] [--kinds video,h264,audio]`` writes ``bench/out/media.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, machine_info, section_parser, write_results
from bench.quiet import before_section

__all__ = ["Epochs", "cpu_seconds", "make_media", "run"]

BATCH = 8
FRAMES, STRIDE, SIZE = 16, 2, 112
RATE, SECONDS = 16000, 1.0
SEED = 0
KINDS = ("video", "h264", "audio")


VIDEO_FRAMES, VIDEO_FPS, VIDEO_SIZE = 300, 30, (320, 240)
"""The bench's videos: 10 s at 30 fps (a Kinetics clip's length and rate), 320 x 240 (about Kinetics' common
340 x 256 after its usual resize), VP9 with libvpx's default keyframe interval (every 128 frames: what ffmpeg and
``fastio convert --transcode vp9`` make)."""


def _video(path: Path, seed: int, frames: int = VIDEO_FRAMES, size: tuple[int, int] = VIDEO_SIZE) -> None:
    """The same frames for a seed, VP9 ``.webm`` or H.264 ``.mp4`` (x264's defaults but speed: keyframes every 250
    frames, up to 3 B-frames), by ``path``'s suffix."""
    import av

    width, height = size
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(height // 8, width // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    h264 = path.suffix == ".mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if h264 else "libvpx-vp9", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"} if h264 else \
            {"crf": "32", "b:v": "0", "deadline": "realtime", "cpu-used": "8"}  # keyframes: default
        for k in range(frames):
            frame = np.roll(base, (k * 3, k * 5), axis=(0, 1))
            frame = np.clip(frame.astype(np.int16) + rng.integers(-8, 9, frame.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def make_media(workdir: Path, videos: int, audios: int, kinds: tuple[str, ...] = KINDS) -> dict[str, Path]:
    """Per kind, a folder of class folders of its files under ``workdir`` (``videos/``: VP9, ``h264/``: the same
    videos as H.264, ``audio/``), reused when there."""
    from fastio.convert.synthetic import make_audio

    root = Path(workdir) / f"media-{videos}-{audios}-{VIDEO_FRAMES}f"
    dirs = {"video": root / "videos", "h264": root / "h264", "audio": root / "audio"}
    for kind, suffix in (("video", "webm"), ("h264", "mp4")):
        for i in range(videos if kind in kinds else 0):
            path = dirs[kind] / f"c{i % 4}" / f"v{i:05d}.{suffix}"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                _video(path, i)
    for i in range(audios if "audio" in kinds else 0):
        path = dirs["audio"] / f"c{i % 4}" / f"a{i:05d}.flac"
        if not path.exists():
            make_audio(path, seconds=10.0, rate=44100, pitch=220.0 + 20 * (i % 40), channels=2)
    return {k: dirs[k] for k in kinds}


def _converted(src: Path, video_decoder: str = "cpu") -> Path:
    from fastio.convert.run import ConvertConfig, convert

    dest = src.with_name(src.name + "-ds")
    if not (dest / "manifest.json").is_file():
        convert(ConvertConfig(source=src, dest=dest, progress=False, video_decoder=video_decoder))
    return dest


class _Peer:
    """A map-style dataset: sample i decoded with PyAV as fastio would deliver it (same start, crop, size)."""

    def __init__(self, dest: Path, video: bool, field: str):
        from fastio import Loader, Raw

        self.video, self.files, self.probes, self.epoch = video, [], [], 0
        with Loader(dest, pipeline=Raw(fields=[field, "probe.json"]), batch_size=1, device="cpu",
                    shuffle="none", world_size=1, rank=0) as loader:
            for b in loader:  # sample i's bytes and probe, as fastio's index i
                self.files.append(b[field][0])
                self.probes.append(json.loads(b["probe.json"][0]))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i: int):
        from fastio.pipelines.augment import clip_starts

        p = self.probes[i]
        if self.video:
            start = int(clip_starts(SEED, self.epoch, np.array([i]), np.array([p["frames"]]),
                                    (FRAMES - 1) * STRIDE + 1)[0, 0])
            return _peer_video(self.files[i], start, p["fps"])
        length = int(RATE * SECONDS)
        n = p["samples"] * RATE // p["rate"]
        start = int(clip_starts(SEED, self.epoch, np.array([i]), np.array([n]), length)[0, 0])
        return _peer_audio(self.files[i], start, length)


def _peer_video(data: bytes, start: int, fps: float):
    """The clip of 16 frames from frame ``start`` (stride 2), decoded from the keyframe before it (a seek, as
    torchvision's ``read_video`` and torchcodec do; not from the file's start), its center square resized."""
    import av
    import torch

    wanted = set(range(start, start + (FRAMES - 1) * STRIDE + 1, STRIDE))
    out = []
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        c.seek(round(start / fps / stream.time_base), stream=stream, backward=True, any_frame=False)
        for frame in c.decode(stream):
            k = round(frame.pts * stream.time_base * fps)
            if k in wanted:
                img = frame.to_ndarray(format="rgb24")
                h, w = img.shape[:2]
                side = min(h, w)
                y, x = (h - side) // 2, (w - side) // 2
                t = torch.from_numpy(img[y:y + side, x:x + side]).permute(2, 0, 1)[None].float()
                out.append(torch.nn.functional.interpolate(t, size=(SIZE, SIZE), mode="bilinear",
                                                           antialias=True)[0].round().to(torch.uint8))
            if k >= max(wanted):
                break
    while len(out) < FRAMES:
        out.append(out[-1])
    return torch.stack(out)


def _peer_audio(data: bytes, start: int, length: int):
    import av
    import torch

    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    chunks = []
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(audio=0):
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    wave = np.concatenate(chunks)[start:start + length]
    return torch.from_numpy(np.pad(wave, (0, length - len(wave))))


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _epoch(make) -> tuple[int, float, float]:
    """Clips, wall seconds and CPU seconds of one epoch of the loader ``make()`` returns; one that ends with
    the epoch (the peer's DataLoader: its workers end with it, so their CPU counts) is closed inside the timing."""
    start, cpu, n = time.perf_counter(), cpu_seconds(), 0
    loader = make()
    for batch in loader:
        n += len(batch["video"] if isinstance(batch, dict) and "video" in batch else
                 batch["audio"] if isinstance(batch, dict) else batch)
    if isinstance(loader, Epochs):
        loader.settle()
    del loader
    return n, time.perf_counter() - start, cpu_seconds() - cpu


class Epochs:
    """fastio's side: one Loader for all rounds (made in the first round's timing), as training iterates one over
    its epochs; round ``r`` is its epoch ``r``. (A Loader closed after each epoch would count the next epoch's
    first batches, which it decodes ahead, in every round: 1-2 of the 8 batches of 64 videos.) Each round ends
    when those batches are decoded (:meth:`settle`), inside its timing, so in steady state a round pays for one
    epoch of work, its CPU is not counted in the peer's round, and the first round also pays for the Loader."""

    def __init__(self, make):
        self.make, self.loader = make, None

    @staticmethod
    def settle(poll: float = 0.05) -> None:
        """Wait until this process is idle (DALI's threads done with the batches they decode ahead): under 5 % of
        a core over one ``poll``."""
        while True:
            before = cpu_seconds()
            time.sleep(poll)
            if cpu_seconds() - before < 0.05 * poll:
                return

    def __iter__(self):
        self.loader = self.loader or self.make()
        return iter(self.loader)

    def close(self):
        if self.loader is not None:
            self.loader.close()


def _contenders(datasets: dict[str, Path], workers: int) -> dict:
    """Per kind: fastio's loader (:class:`Epochs`), the peer's DataLoader of round ``r`` (epoch ``r``'s clips)."""
    from torch.utils.data import DataLoader

    import fastio

    opts = dict(batch_size=BATCH, device="cpu", seed=SEED, shuffle="none", world_size=1, rank=0,
                num_threads=workers)
    video = fastio.VideoClips(frames=FRAMES, stride=STRIDE, size=SIZE, crop="center", dtype="uint8", layout="FCHW")
    pipes = {"video": video, "audio": fastio.AudioClips(sample_rate=RATE, seconds=SECONDS),
             "h264": dataclasses.replace(video, cpu_fallback="pyav", fallback_threads=workers)}
    fields = {"video": "webm", "h264": "mp4", "audio": "flac"}

    def peer(dataset):
        def make(epoch):
            dataset.epoch = epoch
            return DataLoader(dataset, batch_size=BATCH, num_workers=workers)
        return make

    return {kind: (Epochs(lambda d=dest, p=pipes[kind]: fastio.Loader(d, pipeline=p, **opts)),
                   peer(_Peer(dest, kind != "audio", fields[kind]))) for kind, dest in datasets.items()}


def run(workdir: Path, repeats: int = 3, videos: int = 128, audios: int = 256,
        results_dir: Path | None = RESULTS_DIR, kinds: tuple[str, ...] = KINDS) -> dict:
    sources = make_media(workdir, videos, audios, kinds)
    datasets = {k: _converted(src, "nvdec" if k == "h264" else "cpu") for k, src in sources.items()}
    workers = machine_info()["cpus"]
    result: dict = {"videos": videos, "audios": audios, "workers": workers, "batch_size": BATCH, "ratios": [],
                    "machine": machine_info()}
    for kind, (ours, peer) in _contenders(datasets, workers).items():
        rounds = []
        for r in range(repeats):
            row = {}
            makers = (("fastio", lambda o=ours: o), ("peer", lambda m=peer, e=r: m(e)))
            for name, make in makers[:: 1 if r % 2 == 0 else -1]:
                n, s, cpu = _epoch(make)
                row[name], row[f"{name}_cpu_ms_per_clip"] = n / s, 1000 * cpu / n
            rounds.append(row)
            print(f"{kind} round {r}: fastio {row['fastio']:.1f} clips/s ({row['fastio_cpu_ms_per_clip']:.1f} CPU "
                  f"ms/clip), peer {row['peer']:.1f} clips/s ({row['peer_cpu_ms_per_clip']:.1f} CPU ms/clip)",
                  flush=True)
        ours.close()
        result[kind] = {"rounds": rounds, **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]}}
        what = "h264 (PyAV fallback) clips/s" if kind == "h264" else f"{kind} clips/s"
        result["ratios"].append({"name": f"{what} vs DataLoader({workers} workers) + PyAV",
                                 "better": "higher", "target": 1.5,
                                 "value": statistics.median(r["fastio"] / r["peer"] for r in rounds)})
    if results_dir is not None:
        write_results("media", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.media``."""
    p = section_parser(__doc__)
    p.add_argument("--videos", type=int, default=128)
    p.add_argument("--audios", type=int, default=256)
    p.add_argument("--kinds", default=",".join(KINDS), help="rows to run, of " + ", ".join(KINDS))
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    if set(kinds) - set(KINDS):
        p.error(f"--kinds {args.kinds}: the kinds are {', '.join(KINDS)}")
    before_section(args.quiet_wait)
    run(Path(__file__).resolve().parent / "work" / "media", repeats=args.repeats, videos=args.videos,
        audios=args.audios, results_dir=args.out, kinds=kinds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
