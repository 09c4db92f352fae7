"""Video and audio: media made here with PyAV (frame numbers in the pixels, tones of known pitch and
envelope), converted with their probes, and read back through fastio.VideoClips / fastio.AudioClips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from fastio import synthetic  # noqa: E402
from fastio.convert import ConvertConfig, convert  # noqa: E402
from fastio.media import MediaCheckError, check_media, probe  # noqa: E402


def tone_pitch(wave: np.ndarray, rate: int) -> float:
    """The strongest frequency of a wave, in Hz."""
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(spectrum)])


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory) -> Path:
    """2 classes x 3 VP9 videos of 12, 16, 20 frames; c0 also has a 4-frame one (too short for most clips)."""
    root = tmp_path_factory.mktemp("videos")
    for c in range(2):
        for i in range(3):
            synthetic.make_video(root / f"c{c}" / f"v{i}.webm", frames=12 + 4 * i, fps=12)
    synthetic.make_video(root / "c0" / "short.webm", frames=4, fps=12)
    return root


@pytest.fixture(scope="module")
def video_ds(tmp_path_factory, video_folder) -> Path:
    dest = tmp_path_factory.mktemp("vds") / "ds"
    convert(ConvertConfig(source=video_folder, dest=dest, workers=1, progress=False))
    return dest


@pytest.fixture(scope="module")
def audio_folder(tmp_path_factory) -> Path:
    """Tones: class 0 at 440 Hz, class 1 at 1000 Hz; WAV, FLAC and Opus, 22.05 kHz stereo or 16 kHz mono."""
    root = tmp_path_factory.mktemp("audio")
    for c, pitch in enumerate((440.0, 1000.0)):
        synthetic.make_audio(root / f"c{c}" / "a.wav", seconds=2.0, rate=22050, pitch=pitch, channels=2)
        synthetic.make_audio(root / f"c{c}" / "b.flac", seconds=1.5, rate=16000, pitch=pitch)
        synthetic.make_audio(root / f"c{c}" / "c.opus", seconds=2.0, rate=48000, pitch=pitch)
        synthetic.make_audio(root / f"c{c}" / "short.flac", seconds=0.5, rate=16000, pitch=pitch)
    return root


@pytest.fixture(scope="module")
def audio_ds(tmp_path_factory, audio_folder) -> Path:
    dest = tmp_path_factory.mktemp("ads") / "ds"
    convert(ConvertConfig(source=audio_folder, dest=dest, workers=1, progress=False))
    return dest


# -- made media and their probes ------------------------------------------------------------------------

def test_synthetic_video_shows_its_frame_numbers(tmp_path):
    import av

    path = synthetic.make_video(tmp_path / "v.webm", frames=56)
    with av.open(str(path)) as c:
        means = [f.to_ndarray(format="rgb24").mean() for f in c.decode(video=0)]
    assert synthetic.frame_of_level(means).tolist() == list(range(56))
    info = probe(path.read_bytes(), "webm")
    assert (info["frames"], info["fps"], info["codec"], info["width"], info["height"]) == (56, 24.0, "vp9", 64, 48)


@pytest.mark.parametrize("ext", ["wav", "flac", "opus"])
def test_synthetic_audio_has_its_pitch_and_envelope(tmp_path, ext):
    import av

    path = synthetic.make_audio(tmp_path / f"a.{ext}", seconds=1.0, rate=16000, pitch=440.0)
    info = probe(path.read_bytes(), ext)
    with av.open(str(path)) as c:
        wave = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    wave = wave / 32768.0 if wave.dtype == np.int16 else wave.astype(np.float64)
    rate = info["rate"]
    assert abs(tone_pitch(wave, rate) - 440.0) < 5
    assert info["samples"] == len(wave) and abs(info["seconds"] - 1.0) < 0.02
    head, tail = np.abs(wave[: rate // 10]).max(), np.abs(wave[-rate // 10:]).max()
    assert 0.05 < head < 0.25 and 0.8 < tail < 0.95  # the envelope rises 0.1 -> 0.9


def test_cpu_refused_codecs_name_codec_and_way_out(tmp_path):
    h264 = synthetic.make_video(tmp_path / "v.mp4", frames=4).read_bytes()
    with pytest.raises(MediaCheckError, match="video codec h264 .* re-encode it as VP9"):
        check_media(h264, "mp4")
    mp3 = synthetic.make_audio(tmp_path / "a.mp3", seconds=0.5).read_bytes()
    with pytest.raises(MediaCheckError, match="audio codec mp3.* re-encode it as FLAC"):
        check_media(mp3, "mp3")
    with pytest.raises(MediaCheckError, match="cannot be probed"):
        check_media(b"not a video at all", "webm")


# -- convert ----------------------------------------------------------------------------------------------

def test_convert_stores_media_with_probes_and_skips_what_cpu_cannot_read(tmp_path, video_folder):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(video_folder, src)
    synthetic.make_video(src / "c1" / "camera.mp4", frames=6)
    (src / "c1" / "broken.webm").write_bytes(b"\x1aE\xdf\xa3 cut short")
    result = convert(ConvertConfig(source=src, dest=tmp_path / "ds", workers=2, progress=False))
    assert result.samples == 7
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert reasons.keys() == {"c1/camera.mp4", "c1/broken.webm"}
    assert "video codec h264" in reasons["c1/camera.mp4"] and "cannot be probed" in reasons["c1/broken.webm"]
    import fastio

    ds = fastio.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "probe.json", "webm"}
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert {s["path"] for s in manifest["skipped"]} == {"c1/camera.mp4", "c1/broken.webm"}
