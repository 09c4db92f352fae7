"""Video and audio: media made here with PyAV (frame numbers in the pixels, tones of known pitch and
envelope), converted with their probes, and read back through fastio.VideoClips / fastio.AudioClips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

import fastio
from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.formats.media import PROBE_FIELD, MediaCheckError, check_media, probe  # noqa: E402


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
    with pytest.raises(MediaCheckError, match="video codec h264 .*: convert with --transcode vp9"):
        check_media(h264, "mp4", "cpu")
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
    result = convert(ConvertConfig(source=src, dest=tmp_path / "ds", workers=2, progress=False, video_decoder="cpu"))
    assert result.samples == 7
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert reasons.keys() == {"c1/camera.mp4", "c1/broken.webm"}
    assert "video codec h264" in reasons["c1/camera.mp4"] and "cannot be probed" in reasons["c1/broken.webm"]
    import fastio

    ds = fastio.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "probe.json", "webm"}
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert {s["path"] for s in manifest["skipped"]} == {"c1/camera.mp4", "c1/broken.webm"}


# -- VideoClips ---------------------------------------------------------------------------------------------

VIDEO_FRAMES = {"v0": 12, "v1": 16, "v2": 20, "short": 4}


def frames_shown(video) -> np.ndarray:
    """[B, F] frame numbers of uint8 FHWC clips (each frame's mean gray level)."""
    return synthetic.frame_of_level(video.float().mean(dim=(2, 3, 4)).numpy())


def video_loader(dest, pipeline=None, **kw):
    import fastio

    pipeline = pipeline or fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC")
    opts = dict(batch_size=3, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


def test_video_clips_hold_the_frames_their_start_says(video_ds):
    seen = {}
    with video_loader(video_ds) as loader:
        for _epoch in range(2):
            for b in loader:
                assert b["video"].shape == (3, 4, 24, 24, 3) and b["video"].dtype == torch_uint8()
                assert b["start_frame"].dtype == torch_int64() and set(b) >= {"label", "index", "padded"}
                for j, i in enumerate(b["index"].tolist()):
                    key = loader.key(i)
                    n, start = VIDEO_FRAMES[key.split("/")[1]], int(b["start_frame"][j])
                    want = np.minimum(start + 2 * np.arange(4), n - 1)  # a short video repeats its last frame
                    assert frames_shown(b["video"])[j].tolist() == want.tolist(), key
                    assert 0 <= start <= max(n - 7, 0), (key, start)
                    assert int(b["label"][j]) == int(key[1])
                    if not b["padded"][j]:
                        seen.setdefault(key, []).append(start)
    assert len(seen) == 7 and all(len(v) == 2 for v in seen.values())
    assert any(a != b for a, b in seen.values()), "every clip started where it did the epoch before"
    assert seen["c0/short"] == [0, 0]


def test_video_clip_starts_are_pure_in_seed_epoch_and_sample(video_ds):
    def starts(**kw):
        with video_loader(video_ds, **kw) as loader:
            return {int(i): int(s) for b in loader for i, s in zip(b["index"], b["start_frame"])}

    one = starts()
    assert starts(batch_size=2) == one  # not a function of the batch
    assert starts(seed=4) != one
    ranks = {}
    for rank in range(2):
        ranks.update(starts(world_size=2, rank=rank, batch_size=2, drop_last=False))
    assert {i: one[i] for i in ranks} == ranks  # nor of the rank


def test_video_clips_float_layouts_and_several_clips(video_ds):
    import fastio

    pipe = fastio.VideoClips(frames=3, stride=1, size=16, clips_per_video=2, crop="center")
    with video_loader(video_ds, pipe) as loader:
        b = next(iter(loader))
    assert b["video"].shape == (3, 2, 3, 3, 16, 16) and b["video"].dtype == torch_float32()
    assert b["start_frame"].shape == (3, 2)
    # normalised: gray level g -> (g / 255 - mean) / std per channel; the frame number comes back from channel 0
    red = b["video"][:, :, :, 0].mean(dim=(3, 4)).numpy() * 0.229 + 0.485
    shown = synthetic.frame_of_level(red * 255)
    for j, i in enumerate(b["index"].tolist()):
        n = VIDEO_FRAMES[loader.key(i).split("/")[1]]
        for c in range(2):
            start = int(b["start_frame"][j, c])
            assert shown[j, c].tolist() == np.minimum(start + np.arange(3), n - 1).tolist()
    pipe = fastio.VideoClips(frames=2, size=8, layout="CFHW", dtype="uint8")
    with video_loader(video_ds, pipe) as loader:
        assert next(iter(loader))["video"].shape == (3, 3, 2, 8, 8)


@pytest.mark.parametrize("bad,match", [
    (dict(frames=0), "frames must be an integer >= 1, got 0"),
    (dict(size=100000), "^size must be at most 8192 pixels, got 100000: "),
    # NaN made a third of every clip's values NaN, without a word; a string failed building the graph with
    # "could not convert string to float: 'aaaa...'" (ImageTrain refused both already)
    (dict(mean=(float("nan"), 0.5, 0.5)), r"^mean and std need 3 values, std > 0, each a finite number; got "
                                          r"\(nan, 0.5, 0.5\), \(0.229, 0.224, 0.225\)$"),
    (dict(std=(float("inf"), 0.2, 0.2)), r"^mean and std need 3 values, .*\(inf, 0.2, 0.2\)$"),
    (dict(mean="abc"), r"^mean and std need 3 values, .*got \('a', 'b', 'c'\)"),
    # a string or None in scale raised a bare TypeError ("'<' not supported between instances of 'int' and 'str'");
    # True passed as 1
    (dict(scale="ab"), r"^scale must be \(lo, hi\) with 0 < lo <= hi <= 1, got \('a', 'b'\)$"),
    (dict(scale=(None, 1)), r"^scale must be \(lo, hi\) .*got \(None, 1\)$"),
    (dict(scale=(True, True)), r"^scale must be \(lo, hi\) .*got \(True, True\)$"),
    (dict(layout="NCHW"), "layout must be one of FCHW, FHWC, CFHW, got 'NCHW'"),
    (dict(crop="left"), "crop must be random or center, got 'left'"),
    (dict(scale=(0.5, 0.2)), r"scale must be \(lo, hi\)"),
    (dict(dtype="float16"), "dtype must be float32 or uint8, got 'float16'"),
])
def test_video_clips_options_are_checked(bad, match):
    import fastio

    with pytest.raises(ValueError, match=match):
        fastio.VideoClips(**bad)


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_video_clips_resume_exactly(video_ds, shuffle):
    from resume import check_resume

    check_resume(lambda: video_loader(video_ds, batch_size=2, shuffle=shuffle), n=2, k=4)


def test_video_clips_partial_remainder_gives_a_dataset_smaller_than_a_batch_as_one_batch(video_ds):
    """remainder='partial' takes a batch larger than the dataset (7 videos at batch_size 16): one batch of each video
    once, each with the clip the same video has at batch_size 7."""
    import torch

    with video_loader(video_ds, batch_size=16, remainder="partial") as loader, \
            video_loader(video_ds, batch_size=7, remainder="partial") as whole:
        (got,), (want,) = list(loader), list(whole)
    assert sorted(got["index"].tolist()) == list(range(7)) and not got["padded"].any()
    assert got["index"].tolist() == want["index"].tolist() and torch.equal(got["video"], want["video"])


def test_video_clips_elastic_resume_keeps_each_sample_once_and_its_clip(video_ds):
    from resume import run_ranks

    single = {int(i): int(s) for b in video_loader(video_ds, batch_size=1) for i, s in zip(b["index"], b["start_frame"])}
    before, states = run_ranks([video_loader(video_ds, batch_size=1, world_size=2, rank=r) for r in range(2)], n=1)
    after, _ = run_ranks([video_loader(video_ds, batch_size=1, world_size=3, rank=r, drop_last=False)
                          for r in range(3)], state=states[0])
    got = [(int(i), int(s)) for step in before + after for b in step
           for i, s, p in zip(b["index"], b["start_frame"], b["padded"]) if not p]
    assert sorted(i for i, _ in got) == list(range(7))
    assert all(single[i] == s for i, s in got)


PHOTO_COLORS = [(200, 10, 50), (30, 180, 90), (250, 250, 0), (5, 60, 220), (120, 0, 140)]


@pytest.fixture(scope="module")
def photo_ds(tmp_path_factory) -> Path:
    """5 solid-colour PNGs of different sizes and aspect ratios (class = key's folder), converted."""
    from PIL import Image

    root = tmp_path_factory.mktemp("photos")
    for k, color in enumerate(PHOTO_COLORS):
        (root / f"c{k % 2}").mkdir(exist_ok=True)
        Image.new("RGB", (40 + 13 * k, 30 + 7 * k), color).save(root / f"c{k % 2}" / f"p{k}.png")
    dest = root.parent / "photo_ds"
    convert(ConvertConfig(source=root, dest=dest, workers=1, progress=False))
    return dest


def check_still_clip(clip, color) -> None:
    """A still clip (uint8 FHWC): every pixel of every frame is the image's colour."""
    assert (clip.numpy() == np.array(color, np.uint8)).all()


def test_a_mixture_of_video_and_images_gives_still_clips(video_ds, photo_ds):
    import fastio

    mix = fastio.Mixture({"clips": str(video_ds), "photos": str(photo_ds)}, weights={"clips": 1, "photos": 1})
    pipe = fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", crop="center")
    with video_loader(mix, pipe, batch_size=4) as loader:
        batches = [b for _ in range(2) for b in loader]
    for b in batches:
        assert b["video"].shape == (4, 4, 24, 24, 3)
        assert sorted(b["source"].tolist()) == [0, 0, 1, 1]  # the weights' shares, batch by batch
        for j, (s, i) in enumerate(zip(b["source"].tolist(), b["index"].tolist())):
            key = loader.key(s, i)
            assert int(b["label"][j]) == int(key[1])
            if s == 1:
                assert int(b["start_frame"][j]) == 0
                check_still_clip(b["video"][j], PHOTO_COLORS[int(key.split("/p")[1])])
            else:
                n, start = VIDEO_FRAMES[key.split("/")[1]], int(b["start_frame"][j])
                want = np.minimum(start + 2 * np.arange(4), n - 1)
                assert frames_shown(b["video"][j:j + 1])[0].tolist() == want.tolist(), key


def test_still_clips_take_the_image_crop_and_flip_on_every_frame(photo_ds):
    """An image dataset alone: random crops and flips (float, normalised, two clips per sample): every frame of a
    sample's clips is the same picture, and different samples got different crops of their frame size."""
    import fastio

    pipe = fastio.VideoClips(frames=3, size=16, clips_per_video=2)
    with video_loader(photo_ds, pipe, batch_size=5, shuffle="none") as loader:
        b = next(iter(loader))
    video = b["video"]
    assert video.shape == (5, 2, 3, 3, 16, 16) and (b["start_frame"] == 0).all()
    assert (video == video[:, :1, :1]).all()  # every frame of both clips equals the first frame
    mean = np.array(fastio.pipelines.image.IMAGENET_MEAN)[:, None, None]
    std = np.array(fastio.pipelines.image.IMAGENET_STD)[:, None, None]
    for j, i in enumerate(b["index"].tolist()):
        pixels = np.rint((video[j, 0, 0].numpy() * std + mean) * 255)
        color = PHOTO_COLORS[int(loader.key(i).split("/p")[1])]
        assert (pixels == np.array(color)[:, None, None]).all()


def test_a_mixture_of_video_and_images_resumes_exactly(video_ds, photo_ds):
    from resume import check_resume

    import fastio

    mix = fastio.Mixture({"clips": str(video_ds), "photos": str(photo_ds)}, weights={"clips": 2, "photos": 1})
    check_resume(lambda: video_loader(mix, batch_size=3), n=2, k=3)


def test_a_mixture_of_audio_and_images_is_refused_by_name(audio_ds, photo_ds):
    import fastio
    from fastio.errors import DatasetError

    mix = fastio.Mixture({"speech": str(audio_ds), "photos": str(photo_ds)})
    with pytest.raises(DatasetError, match=r"photo_ds: dataset has no audio field \(its fields: cls, png\)"):
        audio_loader(mix)


def test_a_mixture_of_video_datasets(video_ds, tmp_path):
    import shutil

    import fastio

    copy = shutil.copytree(video_ds, tmp_path / "copy")  # one place twice is refused; a copy mixes
    mix = fastio.Mixture({"a": str(video_ds), "b": str(copy)}, weights={"a": 1, "b": 1})
    with video_loader(mix, batch_size=2) as loader:
        b = next(iter(loader))
    assert b["video"].shape == (2, 4, 24, 24, 3) and "source" in b


def test_video_clips_from_s3_through_the_cache(moto_server, s3_bucket, video_ds, tmp_path):
    from resume import same_batch

    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/videos"
    open_storage(url, moto_server.options()).publish_dir(video_ds, keys_last=(MANIFEST_NAME,))
    remote = video_loader(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB",
                          storage_options=moto_server.options())
    with remote, video_loader(video_ds) as local:
        for x, y in zip(remote, local, strict=True):
            assert same_batch(x, y)


# -- AudioClips ---------------------------------------------------------------------------------------------

AUDIO_SECONDS = {"a": 2.0, "b": 1.5, "c": 2.0, "short": 0.5}


def audio_loader(dest, pipeline=None, **kw):
    import fastio

    opts = dict(batch_size=4, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline or fastio.AudioClips(sample_rate=16000, seconds=0.25),
                         **{**opts, **kw})


def test_audio_clips_have_their_pitch_and_the_envelope_at_their_start(audio_ds):
    with audio_loader(audio_ds) as loader:
        batches = [b for _ in range(2) for b in loader]
    starts = {}
    for b in batches:
        assert b["audio"].shape == (4, 4000) and b["audio"].dtype == torch_float32()
        for j, i in enumerate(b["index"].tolist()):
            name, wave, start = loader.key(i).split("/")[1], b["audio"][j].numpy(), int(b["start_sample"][j])
            seconds = AUDIO_SECONDS[name]
            assert abs(tone_pitch(wave[:2000], 16000) - (440.0, 1000.0)[int(b["label"][j])]) < 20
            assert 0 <= start <= max(0, int(seconds * 16000) - 4000)
            at = start / 16000
            want = 0.1 + 0.8 * at / seconds  # the tone's amplitude where the clip starts
            assert abs(np.abs(wave[:400]).max() - want) < 0.05, (name, start)
            if not b["padded"][j]:
                starts.setdefault(i, []).append(start)
    assert len(starts) == 8 and any(a != b for a, b in starts.values())


def test_audio_shorter_than_the_clip_is_padded_with_silence(audio_ds):
    import fastio

    with audio_loader(audio_ds, fastio.AudioClips(sample_rate=8000, seconds=1.0)) as loader:
        for b in loader:
            for j, i in enumerate(b["index"].tolist()):
                if loader.key(i).endswith("short"):
                    wave = b["audio"][j].numpy()
                    assert int(b["start_sample"][j]) == 0
                    assert np.abs(wave[: 3900]).max() > 0.1 and not wave[4100:].any()  # 0.5 s of 1 s at 8 kHz


def test_audio_clips_log_mel(audio_ds):
    import fastio

    with audio_loader(audio_ds, fastio.AudioClips(seconds=0.5, n_mels=32, n_fft=400, hop=160)) as loader:
        b = next(iter(loader))
    assert b["audio"].shape[:2] == (4, 32) and b["audio"].shape[2] == 8000 // 160 + 1
    # The loudest band is higher for the 1000 Hz tone than for the 440 Hz one.
    peak = b["audio"].mean(dim=2).argmax(dim=1)
    labels = b["label"].tolist()
    if 0 in labels and 1 in labels:
        assert max(peak[j] for j in range(4) if labels[j] == 0) < min(peak[j] for j in range(4) if labels[j] == 1)


def whole_file_clips(encoded: list[bytes], starts: list[int], rate: int, length: int):
    """Clips as resampling the whole file with DALI's audio decoder gives them (zeros past its end; an Ogg Opus
    file's pre-skip samples DALI delivers dropped: fastio.formats.ogg), and how many of each clip's samples lie inside
    the file."""
    from nvidia.dali import fn, pipeline_def, types

    from fastio.formats.ogg import dali_opus_layout

    @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None)
    def whole():
        data = fn.external_source(source=lambda: [np.frombuffer(e, np.uint8) for e in encoded], batch=True,
                                  dtype=types.UINT8)
        audio, _ = fn.decoders.audio(data, sample_rate=rate, downmix=True, dtype=types.FLOAT)
        return audio

    pipe = whole()
    pipe.build()
    clips, inside = [], []
    for wave, start, data in zip(pipe.run()[0], starts, encoded):
        decoded_at, lead = dali_opus_layout(data) or (rate, 0)
        lead = round(lead * rate / decoded_at)
        wave = np.array(wave)[lead + start:lead + start + length]
        clips.append(np.pad(wave, (0, length - len(wave))))
        inside.append(len(wave))
    return np.stack(clips), inside


def test_audio_clips_resample_only_their_window_as_the_whole_file_would(audio_ds):
    """Only the clip's window is resampled, not the whole file: the same samples as resampling the whole file,
    within DALI's own resampler noise (it places samples by float32 positions), and zeros past the file's end."""
    import fastio

    with audio_loader(audio_ds, fastio.AudioClips(sample_rate=16000, seconds=0.75), batch_size=8,
                      shuffle="none") as loader:
        b = next(iter(loader))
        read = loader.read_set.reader.read_batch(b["index"].numpy())
    want, inside = whole_file_clips([x.tobytes() for x in read.image], b["start_sample"].tolist(), 16000, 12000)
    got = b["audio"].numpy()
    assert np.abs(got - want).max() < 1e-3
    assert min(inside) < 12000  # a file shorter than the clip: silence after it, as before
    for j, n in enumerate(inside):
        assert not got[j, n:].any() and np.abs(got[j, max(n - 100, 0):n]).max() > 0.05


def test_audio_clips_resume_exactly(audio_ds):
    from resume import check_resume

    check_resume(lambda: audio_loader(audio_ds, batch_size=3), n=1, k=4)


def torch_uint8():
    import torch

    return torch.uint8


def torch_int64():
    import torch

    return torch.int64


def torch_float32():
    import torch

    return torch.float32


@pytest.fixture(scope="module")
def nvdec_video_ds(tmp_path_factory) -> Path:
    """VP9 videos at 160 x 144: NVDEC takes VP9 from 128 x 128 up (``video_ds``' 64 x 48 is below it)."""
    root = tmp_path_factory.mktemp("nvdec-videos")
    for c in range(2):
        for i in range(3):
            synthetic.make_video(root / f"c{c}" / f"v{i}.webm", frames=12 + 4 * i, fps=12, width=160, height=144)
    dest = tmp_path_factory.mktemp("nvdec-vds") / "ds"
    convert(ConvertConfig(source=root, dest=dest, workers=1, progress=False))
    return dest


@pytest.mark.gpu
def test_video_clips_decode_with_nvdec_on_cuda(nvdec_video_ds):
    video_ds = nvdec_video_ds
    """device='cuda': fn.decoders.video on the mixed backend (NVDEC); the same frames as the CPU path shows."""
    cpu = video_loader(video_ds)
    gpu = video_loader(video_ds, device="cuda")
    with cpu, gpu:
        for x, y in zip(cpu, gpu, strict=True):
            assert y["video"].is_cuda and y["start_frame"].tolist() == x["start_frame"].tolist()
            assert frames_shown(y["video"].cpu()).tolist() == frames_shown(x["video"]).tolist()


@pytest.mark.gpu
def test_still_clips_and_audio_on_cuda_match_the_cpu(nvdec_video_ds, photo_ds, audio_ds):
    """device='cuda': a video + image mixture (NVDEC for the videos, nvJPEG's mixed decoder for the images) shows
    the CPU path's frames and colours; audio decoded on the CPU arrives on the GPU with the CPU path's samples."""
    import fastio

    mix = fastio.Mixture({"clips": str(nvdec_video_ds), "photos": str(photo_ds)}, weights={"clips": 1, "photos": 1})
    pipe = fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", crop="center")
    with video_loader(mix, pipe, batch_size=4) as cpu, video_loader(mix, pipe, batch_size=4, device="cuda") as gpu:
        for x, y in zip(cpu, gpu, strict=True):
            assert y["video"].is_cuda and y["source"].tolist() == x["source"].tolist()
            assert frames_shown(y["video"].cpu()).tolist() == frames_shown(x["video"]).tolist()
    with audio_loader(audio_ds) as cpu, audio_loader(audio_ds, device="cuda") as gpu:
        for x, y in zip(cpu, gpu, strict=True):
            assert y["audio"].is_cuda and (y["audio"].cpu() == x["audio"]).all()


def _write_videos(dest, videos: dict[str, bytes], probes: dict[str, bytes] | None = None):
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(dest) as writer:
        for key, data in videos.items():
            fields = {"webm": data, "cls": b"0"}
            if probes is not None:
                fields["probe.json"] = probes[key]
            writer.write({"__key__": key, **fields})
        writer.close(label_field="cls", label_map={"c": 0}, converted_from={"format": "test"}, skipped=[])
    return dest


def test_a_video_dali_cannot_decode_is_named(tmp_path, video_folder):
    import fastio
    from fastio.errors import DatasetError

    good = (video_folder / "c0" / "v2.webm").read_bytes()
    info = check_media(good, "webm")
    videos = {f"k{i}": good for i in range(4)}
    videos["k2"] = good[: len(good) // 3]  # cut: the probe stored says 20 frames, the stream ends early
    dest = _write_videos(tmp_path / "ds", videos, {k: info for k in videos})
    pipe = fastio.VideoClips(frames=4, stride=4, size=16)
    with pytest.raises(DatasetError, match=r"key 'k2': field 'webm' failed to decode"):
        with video_loader(dest, pipe, batch_size=4, shuffle="none", seed=1) as loader:
            next(iter(loader))


def test_a_video_with_a_damaged_frame_is_named(tmp_path):
    """A VP9 video whose 11th packet's payload is damaged (the file demuxes to its 40 frames, as its probe says;
    PyAV and DALI fail at that frame): the Loader said "DALI failed on a batch with keys 'k0', 'k1', 'k2'", naming
    no file, because the check asked of each sample after a failure only demuxed it. It is decoded now."""
    import io

    import av

    from fastio.errors import DatasetError

    good = synthetic.make_video(tmp_path / "v.webm", frames=40, fps=10, keyframe_every=10).read_bytes()
    with av.open(io.BytesIO(good)) as container:
        payload = [bytes(p) for p in container.demux(video=0) if p.size][10]
    at = good.find(payload)
    bad = good[:at + 1] + bytes(b ^ 0xA5 for b in payload[1:]) + good[at + len(payload):]
    info = check_media(good, "webm")
    assert check_media(bad, "webm") == info  # demuxed, the same frames
    videos = {"k0": good, "k1": bad, "k2": good}
    dest = _write_videos(tmp_path / "ds", videos, {k: info for k in videos})
    pipe = fastio.VideoClips(frames=8, stride=4, size=16)
    with pytest.raises(DatasetError, match=r"^.*ds: shard shard-000000.tar key 'k1': field 'webm' failed to decode "
                                           r"\(cannot be decoded by PyAV \(frame 10: .*\)\)$"):
        with video_loader(dest, pipe, batch_size=3, shuffle="none", seed=1) as loader:
            for _ in loader:
                pass


def test_videos_without_probes_are_refused_by_name(tmp_path, video_folder):
    from fastio.errors import DatasetError

    dest = _write_videos(tmp_path / "ds", {"k0": (video_folder / "c0" / "v0.webm").read_bytes()})
    with pytest.raises(DatasetError, match=r"ds: dataset has no probe.json field .* convert the video files"):
        video_loader(dest, batch_size=1)


def test_a_table_naming_videos_and_audio_converts_with_probes(tmp_path):
    import fastio

    synthetic.make_video(tmp_path / "files" / "a.webm", frames=6)
    synthetic.make_audio(tmp_path / "files" / "b.flac", seconds=0.5)
    synthetic.make_audio(tmp_path / "files" / "c.mp3", seconds=0.5)
    table = tmp_path / "files.csv"
    table.write_text("path,label\nfiles/a.webm,0\nfiles/b.flac,1\nfiles/c.mp3,1\n")
    result = convert(ConvertConfig(source=table, dest=tmp_path / "ds", workers=1, progress=False))
    # the MP3 is stored as FLAC (transcode="flac", the default)
    assert result.samples == 3 and result.skipped == [] and result.transcoded == {"flac": {"mp3float": 1}}
    ds = fastio.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "flac", "probe.json", "webm"}
    with fastio.Loader(tmp_path / "ds", pipeline=fastio.Raw(fields=["probe.json"]), batch_size=3, device="cpu",
                       shuffle="none") as loader:
        probes = [json.loads(p) for p in next(iter(loader))["probe.json"]]
    assert sorted((p["kind"], p["frames" if p["kind"] == "video" else "samples"], p.get("transcoded_from", ""))
                  for p in probes) == [("audio", 8000, ""), ("audio", 8000, "mp3float"), ("video", 6, "")]


def test_transcode_vp9_turns_h264_into_clips_with_the_same_frames(tmp_path, capsys):
    from helpers import run_cli

    synthetic.make_video(tmp_path / "src" / "c0" / "camera.mp4", frames=14, fps=12)
    synthetic.make_video(tmp_path / "src" / "c0" / "phone.webm", frames=10, fps=12)
    code, out, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--transcode", "vp9",
                              "--video-decoder", "cpu", "-q"], capsys)  # cpu: H.264 is re-encoded too
    assert code == 0, err
    import fastio

    ds = fastio.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "probe.json", "webm"} and ds.manifest.convert_options["transcode"] == "vp9"
    pipe = fastio.VideoClips(frames=14, stride=1, size=16, dtype="uint8", layout="FHWC")
    with video_loader(tmp_path / "ds", pipe, batch_size=2, shuffle="none") as loader:
        b = next(iter(loader))
    keys = [loader.key(int(i)) for i in b["index"]]
    camera = keys.index("c0/camera")
    assert frames_shown(b["video"])[camera].tolist() == list(range(14))
    code, out, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "ds2"), "--transcode", "av1"], capsys)
    assert code == 2 and "fastio: error:" in err and "av1" in err


def test_a_bad_probe_is_named_by_sample(tmp_path, video_folder):
    from fastio.errors import DatasetError

    good = (video_folder / "c0" / "v0.webm").read_bytes()
    info = check_media(good, "webm")
    dest = _write_videos(tmp_path / "ds", {"k0": good, "k1": good}, {"k0": info, "k1": b'{"kind": "video"}'})
    with pytest.raises(DatasetError, match=r"^sample 1: bad probe.json \('frames'\); re-convert the dataset"):
        with video_loader(dest, batch_size=2, shuffle="none") as loader:
            next(iter(loader))


def test_video_clips_train_under_lightning(video_ds, tmp_path):
    """The trainers take a clip pipeline like any other: a Lightning fit over VideoClips batches."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    import fastio
    from fastio.integrations.lightning import FastioDataModule

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 2)
            self.starts = []

        def training_step(self, batch, _):
            self.starts += batch["start_frame"].tolist()
            assert batch["video"].shape == (2, 4, 3, 16, 16)
            return torch.nn.functional.cross_entropy(self.head(batch["video"].mean(dim=(1, 3, 4))), batch["label"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = FastioDataModule(str(video_ds), pipeline=fastio.VideoClips(frames=4, stride=2, size=16), batch_size=2,
                            device="cpu", seed=3, num_threads=1)
    model = Model()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    assert len(model.starts) == 8  # 7 videos in 4 batches of 2 (one repeat, flagged padded)


# -- fastio index of existing media shards ------------------------------------------------------------------

def write_wds_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A WebDataset tar as a user's tool writes it (tarfile), members in the given order."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_index_of_video_shards_probes_them_into_a_table_and_clips_load(tmp_path, video_folder, capsys):
    import hashlib

    from helpers import run_cli

    import fastio

    members = {}
    for c in range(2):
        for i in range(3):
            members[f"c{c}/v{i}.webm"] = (video_folder / f"c{c}" / f"v{i}.webm").read_bytes()
            members[f"c{c}/v{i}.cls"] = str(c).encode()
    tar = write_wds_tar(tmp_path / "wds" / "videos-000000.tar", members)
    before = hashlib.sha256(tar.read_bytes()).hexdigest()
    code, _, err = run_cli(["index", str(tmp_path / "wds"), "-q"], capsys)
    assert code == 0, err
    assert hashlib.sha256(tar.read_bytes()).hexdigest() == before  # the user's shard is not rewritten
    ds = fastio.Dataset(tmp_path / "wds")
    assert PROBE_FIELD not in ds.fields and ds.manifest.probes.name == "probes.fxp"
    seen = set()
    with video_loader(tmp_path / "wds") as loader:
        for b in loader:
            for j, i in enumerate(b["index"].tolist()):
                key = loader.key(i)
                n, start = VIDEO_FRAMES[key.split("/")[1]], int(b["start_frame"][j])
                assert 0 <= start <= n - 7 and int(b["label"][j]) == int(key[1])
                assert frames_shown(b["video"])[j].tolist() == (start + 2 * np.arange(4)).tolist(), key
                seen.add(key)
    assert len(seen) == 6
    code, out, err = run_cli(["verify", str(tmp_path / "wds")], capsys)
    assert code == 0, out + err
    table = tmp_path / "wds" / "probes.fxp"
    table.write_bytes(table.read_bytes()[:-1] + b"!")  # changed after indexing
    code, out, err = run_cli(["verify", str(tmp_path / "wds")], capsys)
    assert code != 0 and "probes.fxp" in out + err and "sha256 does not match" in out + err
    with pytest.raises(fastio.DatasetError, match=r"probes.fxp: does not match the manifest"):
        video_loader(tmp_path / "wds")


def test_index_of_audio_shards_names_what_it_cannot_probe(tmp_path, audio_folder):
    import fastio
    from fastio.convert.wds_index import IndexConfig, index_shards

    members = {}
    for c in range(2):
        members[f"k{c}a.flac"] = (audio_folder / f"c{c}" / "b.flac").read_bytes()
        members[f"k{c}a.cls"] = str(c).encode()
        members[f"k{c}b.opus"] = (audio_folder / f"c{c}" / "c.opus").read_bytes()
        members[f"k{c}b.cls"] = str(c).encode()
    write_wds_tar(tmp_path / "good" / "a-000000.tar", members)
    result = index_shards(IndexConfig(source=tmp_path / "good"))
    assert result.skipped == []
    with audio_loader(tmp_path / "good") as loader:
        for b in loader:
            for j in range(len(b["index"])):
                pitch = (440.0, 1000.0)[int(b["label"][j])]
                assert abs(tone_pitch(b["audio"][j].numpy()[:2000], 16000) - pitch) < 20
    mp3 = synthetic.make_audio(tmp_path / "x.mp3", seconds=0.5).read_bytes()
    write_wds_tar(tmp_path / "bad" / "a-000000.tar", {**members, "k9.mp3": mp3, "k9.cls": b"1"})
    result = index_shards(IndexConfig(source=tmp_path / "bad"))
    assert [s["path"].rsplit("/", 1)[1] for s in result.skipped] == ["a-000000.tar:k9.mp3"]
    assert result.skipped[0]["reason"].startswith("not probed (kept in the shard): audio codec mp3")
    with pytest.raises(fastio.DatasetError, match=r"1 sample's mp3 could not be probed when indexed \(the first: "
                                                  r"shard a-000000.tar key 'k9': audio codec mp3") as got:
        audio_loader(tmp_path / "bad")
    # convert stores an MP3 as FLAC by default: the message said convert "skips them"
    assert str(got.value).endswith("or convert the files with fastio convert (which keeps or transcodes what a "
                                   "Loader decodes, and skips what it cannot)"), str(got.value)


def test_index_in_parts_then_merge_gives_the_same_probe_table(tmp_path, video_folder, capsys):
    from helpers import run_cli

    for s in range(2):
        members = {}
        for i in range(3):
            members[f"s{s}v{i}.webm"] = (video_folder / f"c{s}" / f"v{i}.webm").read_bytes()
            members[f"s{s}v{i}.cls"] = str(s).encode()
        write_wds_tar(tmp_path / "wds" / f"v-00000{s}.tar", members)
    assert run_cli(["index", str(tmp_path / "wds"), "--dest", str(tmp_path / "one"), "-q"], capsys)[0] == 0
    for k in range(2):
        assert run_cli(["index", str(tmp_path / "wds"), "--dest", str(tmp_path / "parted"), "--part", f"{k}/2", "-q"],
                       capsys)[0] == 0
    assert run_cli(["merge", str(tmp_path / "parted"), "-q"], capsys)[0] == 0
    assert (tmp_path / "parted" / "probes.fxp").read_bytes() == (tmp_path / "one" / "probes.fxp").read_bytes()
    with video_loader(tmp_path / "parted", batch_size=6, shuffle="none") as loader:
        assert next(iter(loader))["video"].shape == (6, 4, 24, 24, 3)


def test_index_of_media_shards_on_s3_and_clips_through_the_cache(aws_env, s3_bucket, video_folder, tmp_path, capsys):
    """Shards on an object store indexed in place: the probe table goes beside them, is fetched (checked) into the
    cache's meta/ by the Loader, and the clips are those of the same shards read locally; verify passes."""
    from helpers import run_cli
    from resume import same_batch

    from fastio.storage import open_storage

    members = {}
    for c in range(2):
        for i in range(3):
            members[f"c{c}/v{i}.webm"] = (video_folder / f"c{c}" / f"v{i}.webm").read_bytes()
            members[f"c{c}/v{i}.cls"] = str(c).encode()
    tar = write_wds_tar(tmp_path / "wds" / "videos-000000.tar", members)
    open_storage(f"s3://{s3_bucket}/wds").put_file("videos-000000.tar", tar)
    assert run_cli(["index", f"s3://{s3_bucket}/wds", "-q"], capsys)[0] == 0
    assert run_cli(["index", str(tmp_path / "wds"), "-q"], capsys)[0] == 0
    assert run_cli(["verify", f"s3://{s3_bucket}/wds"], capsys)[0] == 0
    remote = video_loader(f"s3://{s3_bucket}/wds", cache_dir=str(tmp_path / "cache"), cache_size="1GB")
    with remote, video_loader(tmp_path / "wds") as local:
        for x, y in zip(remote, local, strict=True):
            assert same_batch(x, y)
    assert any((tmp_path / "cache").rglob("probes.fxp"))  # fetched into the cache, checked by its sha256


def test_probe_table_is_mapped_and_a_damaged_one_is_refused_in_one_line(tmp_path):
    import mmap

    from fastio.formats.media import ProbeTable, write_probe_table

    video = {"kind": "video", "frames": 30, "fps": 12.0, "width": 64, "height": 48, "codec": "vp9", "seconds": 2.5}
    rows = [{"webm": json.dumps({**video, "frames": 30 + i}).encode()} for i in range(5)] + [{}]
    path = tmp_path / "probes.fxp"
    write_probe_table(path, rows)
    table = ProbeTable.open(path, str(path), 6)
    assert isinstance(table.data, mmap.mmap)  # mapped, not read whole: a rank reads only the entries it plans
    assert json.loads(table.probe(3, "webm"))["frames"] == 33
    table.check()
    whole = path.read_bytes()
    for name, damaged, match in (
            ("cut.fxp", whole[:-7], "offsets do not fit the file"),  # truncated
            ("long.fxp", whole + b"{}", "offsets do not fit the file"),  # extended
            ("empty.fxp", b"", "not a probe table"),
            ("head.fxp", whole[:20], "")):
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(ValueError, match=rf"^{tmp_path / name}: {match}") as err:
            ProbeTable.open(tmp_path / name, str(tmp_path / name), 6)
        assert "\n" not in str(err.value)
    # Two entries' bytes swapped with the same total length: the offsets still fit, the entry read is refused.
    start = whole.index(b'{"webm"')
    (tmp_path / "entry.fxp").write_bytes(whole[:start] + b"]" + whole[start + 1:])
    bad = ProbeTable.open(tmp_path / "entry.fxp", "entry.fxp", 6)
    with pytest.raises(ValueError, match=r"^entry.fxp: sample 0: damaged probe entry"):
        bad.probe(0, "webm")
    # Offsets running backwards (the last still at the end): check() names the table.
    offsets_at = len(whole) - sum(len(json.dumps(json.loads(r["webm"]), sort_keys=True, separators=(",", ":"))
                                      .join(['{"webm":', "}"])) for r in rows if r) - 8 * 7
    back = bytearray(whole)
    back[offsets_at + 8:offsets_at + 16] = (10 ** 6).to_bytes(8, "little")
    (tmp_path / "back.fxp").write_bytes(bytes(back))
    with pytest.raises(ValueError, match=r"^back.fxp: offsets do not fit the file \(they run backwards"):
        ProbeTable.open(tmp_path / "back.fxp", "back.fxp", 6).check()


def test_a_clip_late_in_a_video_is_decoded_from_the_keyframe_before_it(tmp_path):
    """DALI's CPU decoder decodes from its input's first frame whatever the start, so VideoClips hands it each
    video cut at the last keyframe before its clips (trim_video): the frames must stay the ones the start says."""
    import av

    import fastio
    from fastio.formats.media import trim_video

    for i in range(4):
        synthetic.make_video(tmp_path / "src" / f"c{i % 2}" / f"v{i}.webm", frames=40 + 4 * i, fps=12,
                             keyframe_every=8)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", progress=False))
    data = (tmp_path / "src" / "c0" / "v0.webm").read_bytes()
    info = probe(data, "webm")
    assert info["keyframes"] == list(range(0, 40, 8))
    for keyframes in (info["keyframes"], None):  # from the probe, or found by reading the packets
        cut, k = trim_video(data, 20, 30, keyframes)
        with av.open(__import__("io").BytesIO(cut)) as c:
            levels = [f.to_ndarray(format="rgb24").mean() for f in c.decode(video=0)]
        assert k == 16 and len(cut) < len(data)
        assert synthetic.frame_of_level(np.array(levels)).tolist() == list(range(16, 31))
        assert trim_video(data, 7, 30, keyframes) == (data, 0)  # before the second keyframe: the file as it is
    late = 0
    clips = fastio.VideoClips(frames=4, stride=3, size=16, dtype="uint8", layout="FHWC", clips_per_video=2)
    with video_loader(tmp_path / "ds", clips, batch_size=2) as loader:
        for _ in range(3):
            for b in loader:
                starts = b["start_frame"].numpy()
                for j in range(len(starts)):
                    for c in range(2):
                        assert frames_shown(b["video"][j])[c].tolist() == (starts[j, c] + 3 * np.arange(4)).tolist()
                late += int((starts >= 8).sum())
    assert late > 4  # clips that start after the first keyframe were asked for, and held the right frames


def test_a_video_loader_names_a_sample_without_a_video_as_lacking_its_video(tmp_path):
    """A tar holding one video sample and one image sample, indexed: VideoClips named the image sample as having
    'no image field (webm)'; what it lacks is its video."""
    pytest.importorskip("av")
    import io
    import tarfile

    from PIL import Image

    from fastio.convert.synthetic import make_video
    from fastio.convert.wds_index import IndexConfig, index_shards

    make_video(tmp_path / "v.webm", frames=6, fps=12)
    png = io.BytesIO()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(png, "PNG")
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "s-000000.tar", "w") as tar:
        for name, data in (("k0.webm", (tmp_path / "v.webm").read_bytes()), ("k0.cls", b"0"),
                           ("k1.png", png.getvalue()), ("k1.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index_shards(IndexConfig(tmp_path / "wds"))
    clips = fastio.VideoClips(frames=2, size=8, dtype="uint8", crop="center")
    # refused when the Loader is made (since the media review), naming the sample and what it lacks
    with pytest.raises(fastio.DatasetError, match=r"1 of 2 samples has no video field \(the first: shard "
                                                  r"s-000000.tar key 'k1'; fields: cls, png, webm\)"):
        fastio.Loader(tmp_path / "wds", pipeline=clips, batch_size=2, device="cpu", shuffle="none",
                      num_threads=1, world_size=1, rank=0)
