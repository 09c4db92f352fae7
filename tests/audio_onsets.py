"""Sounds with a known onset, for the onset tests (tests/test_audio_onsets.py, tests/test_audio_transcode.py): a
tone that starts at ``ONSET_S``, made with PyAV (``synthetic.encode_audio``), where PyAV's decode puts it, and where
``AudioClips``' clip of it does."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np

from fastio.convert import synthetic
from fastio.convert.run import ConvertConfig, convert

OUT_RATE = 16000
ONSET_S = 0.5


def onset_wave(rate: int, seconds: float = 1.0) -> np.ndarray:
    """[1, n] float32: silence, then a 1 kHz cosine of amplitude 0.5 from ``ONSET_S`` (a step: its half-height
    crossing is the onset, after any resampling)."""
    t = np.arange(int(round(seconds * rate))) / rate
    return np.where(t >= ONSET_S, 0.5 * np.cos(2 * np.pi * 1000 * (t - ONSET_S)), 0.0).astype(np.float32)[None]


def encode(path: Path, container: str, codec: str, sample_fmt: str, rate: int) -> Path:
    wave = onset_wave(rate)
    if sample_fmt == "s16":
        wave = np.clip(wave * 32767, -32768, 32767).astype(np.int16)
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        synthetic.encode_audio(out, stream, wave, sample_fmt, rate, "mono")
    return path


def half_height(wave: np.ndarray) -> float:
    """The onset: where the wave first reaches half the tone's amplitude (0.25), interpolated between samples."""
    k = int(np.argmax(np.abs(wave) >= 0.25))
    a, b = abs(float(wave[k - 1])), abs(float(wave[k]))
    return k - 1 + (0.25 - a) / (b - a)


def pyav_decode(data: bytes) -> np.ndarray:
    """PyAV's decode of ``data``, mono float32 at ``OUT_RATE`` (FFmpeg's resampler)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=OUT_RATE)
    with av.open(io.BytesIO(data)) as container:
        frames = [f for frame in container.decode(audio=0) for f in resampler.resample(frame)]
    frames += resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


def pyav_onset(data: bytes) -> float:
    """The onset of PyAV's decode of ``data``, in samples at ``OUT_RATE``."""
    return half_height(pyav_decode(data))


def clip_onsets(source: Path, dest: Path, **options) -> dict[str, float]:
    """Each file's onset in the clip ``AudioClips`` gives of it (1 s at ``OUT_RATE``: the whole file), by name, after
    ``convert`` (with ``options``)."""
    import fastio

    result = convert(ConvertConfig(source=source, dest=dest, workers=1, progress=False, **options))
    assert not result.skipped, result.skipped
    got = {}
    with fastio.Loader(dest, pipeline=fastio.AudioClips(sample_rate=OUT_RATE, seconds=1.0), batch_size=result.samples,
                       device="cpu", seed=0, shuffle="none", world_size=1, rank=0) as loader:
        batch = next(iter(loader))
        for j, i in enumerate(batch["index"].tolist()):
            assert int(batch["start_sample"][j]) == 0  # the clip is the whole file
            got[loader.key(i).split("/")[-1]] = half_height(batch["audio"][j].numpy())
    return got


def check_onsets(got: dict[str, float], folder: Path) -> None:
    """Each onset within 1 sample of PyAV's decode of the file of that name in ``folder``."""
    for name, onset in got.items():
        want = pyav_onset(next(folder.glob(f"{name}.*")).read_bytes())
        assert abs(want - ONSET_S * OUT_RATE) < 2, (name, want)  # PyAV's decode: the tone where it was made
        assert abs(onset - want) <= 1, (name, onset, want)
