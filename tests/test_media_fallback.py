"""``VideoClips(cpu_fallback="pyav")``: H.264 videos kept for NVDEC (``convert --video-decoder nvdec``) read on the
CPU, their clips decoded with PyAV, then cropped, flipped, resized and normalised in the same DALI graph as VP9
clips. Media made here with PyAV: frame numbers in the pixels (B-frames: stored in decode order), and a pattern
whose crop and flip show, encoded both as H.264 and as VP9 to compare the two paths."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.errors import DatasetError  # noqa: E402
from fastio.formats.media import MediaCheckError  # noqa: E402
from fastio.formats.pyav_clips import decode_clip  # noqa: E402

FRAMES = {"a": 20, "b": 44, "short": 4, "c": 16, "d": 36}


@pytest.fixture(scope="module")
def h264_ds(tmp_path_factory) -> Path:
    """H.264 .mp4 with B-frames and a keyframe every 8 frames (one of 4 frames, shorter than a clip) and a VP9 .webm,
    converted for NVDEC (kept as they are)."""
    root = tmp_path_factory.mktemp("fb") / "src"
    for name in ("a", "b", "short"):
        synthetic.make_video(root / "c0" / f"{name}.mp4", frames=FRAMES[name], fps=12, keyframe_every=8, bframes=2)
    synthetic.make_video(root / "c0" / "c.webm", frames=FRAMES["c"], fps=12)
    synthetic.make_video(root / "c1" / "d.mp4", frames=FRAMES["d"], fps=12, keyframe_every=8, bframes=2)
    dest = root.parent / "ds"
    convert(ConvertConfig(source=root, dest=dest, workers=1, video_decoder="nvdec", progress=False))
    return dest


def clips_loader(dest, pipeline=None, **kw):
    import fastio

    pipeline = pipeline or fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC",
                                             cpu_fallback="pyav", fallback_threads=2)
    opts = dict(batch_size=2, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


def frames_shown(video) -> np.ndarray:
    """[..., F] frame numbers of uint8 ...FHWC clips (each frame's mean gray level)."""
    return synthetic.frame_of_level(video.float().mean(dim=(-3, -2, -1)).numpy())


def wanted(start: int, n: int) -> list[int]:
    return np.minimum(start + 2 * np.arange(4), n - 1).tolist()


def test_decode_clip_gives_every_clip_of_a_b_frame_video_in_display_order(tmp_path):
    data = synthetic.make_video(tmp_path / "v.mp4", frames=30, fps=12, keyframe_every=8, bframes=3).read_bytes()
    for stride in (1, 2, 3):
        for first in range(30):
            clip = decode_clip(data, first, 5, stride)
            assert clip.shape == (5, 48, 64, 3) and clip.dtype == np.uint8
            want = np.minimum(first + stride * np.arange(5), 29)  # past the end: the last frame again
            assert synthetic.frame_of_level(clip.reshape(5, -1).mean(1)).tolist() == want.tolist(), (first, stride)


@pytest.mark.parametrize("encoder,options", [
    ("libx265", {"crf": "4", "preset": "ultrafast",  # open GOPs: B-frames shown before a keyframe follow it
                 "x265-params": "keyint=8:min-keyint=8:bframes=2:b-adapt=0:open-gop=1:log-level=error"}),
    ("mpeg4", {"qscale": "1", "bf": "2", "g": "8"}),
])
def test_decode_clip_reads_hevc_and_mpeg4_with_b_frames(tmp_path, encoder, options):
    """Every clip is, bit for bit, those frames of the whole file decoded from its start in display order."""
    import av
    from test_media_nvdec import make_ffv1

    data = make_ffv1(tmp_path / "v.mp4", 20, encoder, options=options).read_bytes()
    with av.open(str(tmp_path / "v.mp4")) as c:
        shown = sorted(((f.pts, f.to_ndarray(format="rgb24")) for f in c.decode(video=0)), key=lambda t: t[0])
    assert len(shown) == 20
    for first in range(20):
        want = np.minimum(first + 2 * np.arange(4), 19)
        assert np.array_equal(decode_clip(data, first, 4, 2), np.stack([shown[f][1] for f in want])), first


def test_decode_clip_skips_only_frames_nothing_needs(tmp_path):
    """A textured, moving H.264 video with B-frames (x264's B-pyramid: some B-frames are references): frames
    shown before the clip that nothing refers to are not decoded, and every clip is still, bit for bit, those
    frames of the whole file decoded from its start (skipping a reference frame would change the texture)."""
    import av

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    path = tmp_path / "t.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=12)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"crf": "20", "preset": "veryfast", "x264-params": "keyint=12:bframes=3:b-pyramid=normal"}
        for k in range(36):
            rgb = np.roll(base, (k, 2 * k), axis=(0, 1))
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with av.open(str(path)) as c:
        shown = [f.to_ndarray(format="rgb24") for f in sorted(c.decode(video=0), key=lambda f: f.pts)]
    data = path.read_bytes()
    for first in range(36):
        want = np.minimum(first + 2 * np.arange(4), 35)
        assert np.array_equal(decode_clip(data, first, 4, 2), np.stack([shown[f] for f in want])), first


def test_decode_clip_names_what_pyav_cannot_decode(tmp_path):
    with pytest.raises(MediaCheckError, match=r"^cannot be decoded by PyAV \("):
        decode_clip(b"\x00\x00\x00\x18ftypmp42 not a video", 0, 4, 1)
    with pytest.raises(MediaCheckError, match="cannot be decoded by PyAV"):
        decode_clip(garbage_h264(tmp_path), 0, 4, 1)


def test_h264_clips_on_the_cpu_hold_the_frames_their_start_says(h264_ds):
    seen: dict[str, list[int]] = {}
    with clips_loader(h264_ds) as loader:
        for _epoch in range(4):
            for b in loader:
                assert b["video"].shape == (2, 4, 24, 24, 3)
                for j, i in enumerate(b["index"].tolist()):
                    key, start = loader.key(i), int(b["start_frame"][j])
                    n = FRAMES[key.split("/")[1]]
                    assert frames_shown(b["video"])[j].tolist() == wanted(start, n), (key, start)
                    assert 0 <= start <= max(n - 7, 0) and int(b["label"][j]) == int(key[1])
                    seen.setdefault(key, []).append(start)
    assert seen["c0/short"] == [0] * len(seen["c0/short"])  # padded with its last frame
    assert max(seen["c0/b"] + seen["c1/d"]) >= 16, "no clip started after the second keyframe"


def test_two_clips_per_video_and_a_vp9_video_in_the_same_batch(h264_ds):
    import fastio

    pipe = fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", clips_per_video=2,
                             cpu_fallback="pyav")
    with clips_loader(h264_ds, pipe, batch_size=5, shuffle="none") as loader:
        b = next(iter(loader))
        assert b["video"].shape == (5, 2, 4, 24, 24, 3) and b["start_frame"].shape == (5, 2)
        keys = [loader.key(i) for i in b["index"].tolist()]
        assert "c0/c" in keys and len(set(keys)) == 5  # VP9 (DALI's decoder) beside H.264 (PyAV)
        for j, key in enumerate(keys):
            for c in range(2):
                start = int(b["start_frame"][j, c])
                assert frames_shown(b["video"][j, c]).tolist() == wanted(start, FRAMES[key.split("/")[1]]), key


def test_a_mixture_of_h264_vp9_and_images_is_one_batch(h264_ds, tmp_path):
    import fastio

    synthetic.make_imagefolder(tmp_path / "img", classes=2, per_class=3)
    convert(ConvertConfig(source=tmp_path / "img", dest=tmp_path / "ids", workers=1, progress=False))
    mix = fastio.Mixture({"videos": str(h264_ds), "images": str(tmp_path / "ids")}, weights={"videos": 5, "images": 3})
    with clips_loader(mix, batch_size=8) as loader:
        b = next(iter(loader))
    assert b["video"].shape == (8, 4, 24, 24, 3) and sorted(b["source"].tolist()) == [0] * 5 + [1] * 3
    for j, (s, i) in enumerate(zip(b["source"].tolist(), b["index"].tolist())):
        if s == 1:  # a still clip: one picture over the frames
            assert (b["video"][j] == b["video"][j, :1]).all() and int(b["start_frame"][j]) == 0
        else:
            key = loader.key(s, i)
            want = wanted(int(b["start_frame"][j]), FRAMES[key.split("/")[1]])
            assert frames_shown(b["video"])[j].tolist() == want, key


def test_h264_clips_resume_exactly(h264_ds):
    from resume import check_resume

    check_resume(lambda: clips_loader(h264_ds), n=2, k=3)


def test_h264_clips_elastic_resume_keeps_each_sample_once_and_its_clip(h264_ds):
    from resume import run_ranks

    def shown(batches):
        return {(int(i), int(s)): frames_shown(b["video"][j]).tolist() for b in batches
                for j, (i, s, p) in enumerate(zip(b["index"], b["start_frame"], b["padded"])) if not p}

    with clips_loader(h264_ds, batch_size=1) as loader:
        single = shown(loader)
    before, states = run_ranks([clips_loader(h264_ds, batch_size=1, world_size=2, rank=r) for r in range(2)], n=1)
    after, _ = run_ranks([clips_loader(h264_ds, batch_size=1, world_size=3, rank=r, drop_last=False)
                          for r in range(3)], state=states[0])
    got = shown(b for step in before + after for b in step)
    assert sorted(i for i, _ in got) == list(range(5))
    assert all(single[k] == frames for k, frames in got.items())


def test_a_mixture_repeating_h264_videos_decodes_each_delivery_s_own_clip(h264_ds):
    import fastio

    # "h" (5 videos) fills 15 of the 20 positions of each mixture epoch: its repeats draw their own starts
    mix = fastio.Mixture({"h": str(h264_ds), "o": str(h264_ds)}, weights={"h": 3, "o": 1}, samples_per_epoch=20)
    starts: dict[int, set[int]] = {}
    with clips_loader(mix, batch_size=4) as loader:
        for b in loader:
            for j, (s, i) in enumerate(zip(b["source"].tolist(), b["index"].tolist())):
                key, start = loader.key(s, i), int(b["start_frame"][j])
                assert frames_shown(b["video"])[j].tolist() == wanted(start, FRAMES[key.split("/")[1]]), key
                if s == 0:
                    starts.setdefault(i, set()).add(start)
    assert any(len(v) > 1 for v in starts.values()), "no repeat drew a start of its own"


def test_without_the_option_a_cpu_loader_refuses_h264_and_names_it(h264_ds):
    import fastio

    with pytest.raises(DatasetError, match=r"codec h264.*cpu_fallback='pyav'"):
        clips_loader(h264_ds, fastio.VideoClips(frames=4, size=24, cpu_fallback=None))


def test_the_option_is_checked_where_it_enters():
    import fastio

    with pytest.raises(ValueError, match="cpu_fallback must be None or one of auto, pyav, got 'ffmpeg'"):
        fastio.VideoClips(cpu_fallback="ffmpeg")
    with pytest.raises(ValueError, match="fallback_threads must be an integer >= 1, got 0"):
        fastio.VideoClips(cpu_fallback="pyav", fallback_threads=0)
    with pytest.raises(ValueError, match="device='cuda' decodes H.264.* with NVDEC; leave cpu_fallback out"):
        fastio.VideoClips(cpu_fallback="pyav").check_device(None, "cuda")


def test_decoding_runs_in_the_bounded_pool_and_close_stops_it_with_clips_in_flight(h264_ds, monkeypatch):
    from fastio.pipelines import video_fallback

    threads: set[str] = set()
    real = video_fallback.decode_clip

    def watched(*args):
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # keep clips in flight when close() comes
        return real(*args)

    monkeypatch.setattr(video_fallback, "decode_clip", watched)
    before = set(threading.enumerate())
    loader = clips_loader(h264_ds, read_ahead=4)
    next(iter(loader))
    assert any(t.name.startswith("fastio-pyav") for t in threading.enumerate())
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 5
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("fastio-pyav")]
    assert threads and len(threads) <= 2 and all(t.startswith("fastio-pyav") for t in threads), threads


def garbage_h264(tmp_path: Path) -> bytes:
    """An H.264 .mp4 whose packets are random bytes (with the real stream's timing and keyframe flags): PyAV
    demuxes and probes it, and cannot decode it."""
    import av

    good = synthetic.make_video(tmp_path / "good.mp4", frames=12, fps=12, keyframe_every=8)
    rng = np.random.default_rng(0)
    out = tmp_path / "bad.mp4"
    with av.open(str(good)) as src, av.open(str(out), "w") as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.size:
                bad = av.Packet(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
                bad.pts, bad.dts, bad.time_base, bad.is_keyframe = packet.pts, packet.dts, packet.time_base, \
                    packet.is_keyframe
                bad.stream = stream
                dst.mux(bad)
    return out.read_bytes()


def test_a_video_pyav_cannot_decode_is_named_by_shard_and_key(tmp_path):
    (tmp_path / "src" / "c0").mkdir(parents=True)
    (tmp_path / "src" / "c0" / "bad.mp4").write_bytes(garbage_h264(tmp_path))
    synthetic.make_video(tmp_path / "src" / "c0" / "fine.mp4", frames=12, fps=12)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                          progress=False))
    with clips_loader(tmp_path / "ds") as loader, pytest.raises(DatasetError) as got:
        list(loader)
    message = str(got.value)
    assert "\n" not in message and "shard " in message and "key 'c0/bad'" in message, message
    assert "field 'mp4' cannot be decoded by PyAV" in message, message


def make_pattern(path: Path, frames: int = 12, size: tuple[int, int] = (64, 48)) -> Path:
    """Frames whose red rises left to right, green top to bottom and blue with the frame number: a crop and a
    flip show. H.264 (B-frames) for .mp4, VP9 for .webm; near-lossless."""
    import av

    h264 = path.suffix == ".mp4"
    y, x = np.mgrid[0:size[1], 0:size[0]]
    x, y = x * 64 // size[0], y * 48 // size[1]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if h264 else "libvpx-vp9", rate=12)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.options = {"crf": "4", "preset": "ultrafast", "x264-params": "bframes=2:b-adapt=0"} if h264 else \
            {"crf": "4", "b:v": "0", "deadline": "realtime", "cpu-used": "8"}
        for k in range(frames):
            rgb = np.stack([x * 4, y * 5, np.full_like(x, 20 + 15 * k)], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def test_crop_flip_and_start_are_those_of_a_vp9_copy_on_the_gpu_path(tmp_path):
    import fastio

    datasets = {}
    for suffix in ("mp4", "webm"):
        src = tmp_path / suffix
        for c in range(2):
            for i in range(3):
                (src / f"c{c}").mkdir(parents=True, exist_ok=True)
                make_pattern(src / f"c{c}" / f"p{i}.{suffix}")
        datasets[suffix] = tmp_path / f"ds-{suffix}"
        convert(ConvertConfig(source=src, dest=datasets[suffix], workers=1, video_decoder="nvdec",
                              progress=False))
    pipe = fastio.VideoClips(frames=4, stride=2, size=32, dtype="uint8", layout="FHWC", scale=(0.2, 0.6),
                             cpu_fallback="pyav")
    batches = {}
    for suffix, dest in datasets.items():
        with clips_loader(dest, pipe, batch_size=6, shuffle="none") as loader:  # the order: the same keys
            batches[suffix] = [next(iter(loader)) for _ in range(2)]
    flipped = 0
    for h264, vp9 in zip(batches["mp4"], batches["webm"]):
        assert h264["index"].tolist() == vp9["index"].tolist()
        assert h264["start_frame"].tolist() == vp9["start_frame"].tolist()
        a, b = h264["video"].float(), vp9["video"].float()
        for j in range(len(a)):
            assert (a[j] - b[j]).abs().mean() < 4, j  # the same crop, flip and frames, two codecs' losses apart
            red = a[j][..., 0].mean(dim=(0, 1))  # along the width: it rises, unless the clip is flipped
            flipped += int(red[-1] < red[0])
    assert 0 < flipped < 12, "every clip, or none, was flipped"


def test_indexed_shards_read_through_the_probe_table(tmp_path):
    from test_media import write_wds_tar

    from fastio.convert.index_command import IndexConfig, index_shards

    members = {}
    for k, (frames, suffix) in enumerate(((20, "mp4"), (16, "webm"), (28, "mp4"))):
        path = synthetic.make_video(tmp_path / f"v{k}.{suffix}", frames=frames, fps=12, keyframe_every=8,
                                    **({"bframes": 2} if suffix == "mp4" else {}))
        members[f"k{k}.{suffix}"], members[f"k{k}.cls"] = path.read_bytes(), b"0"
    write_wds_tar(tmp_path / "wds" / "v-000000.tar", members)
    index_shards(IndexConfig(source=tmp_path / "wds", dest=tmp_path / "ds", video_decoder="nvdec"))
    with clips_loader(tmp_path / "ds", batch_size=3) as loader:
        b = next(iter(loader))
    for j, i in enumerate(b["index"].tolist()):
        n = (20, 16, 28)[int(loader.key(i)[1])]
        assert frames_shown(b["video"])[j].tolist() == wanted(int(b["start_frame"][j]), n), loader.key(i)


@pytest.mark.gpu
def test_the_cpu_fallback_gives_the_clips_nvdec_gives(tmp_path):
    """The same H.264 dataset (B-frames; 160 x 144, above NVDEC's minimum sizes) on a GPU with NVDEC and on the CPU
    with the fallback: the same starts, crops and flips; the pixels two decoders' colour conversions apart."""
    import torch

    import fastio

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for c in range(2):
        for i in range(3):
            (tmp_path / "src" / f"c{c}").mkdir(parents=True, exist_ok=True)
            make_pattern(tmp_path / "src" / f"c{c}" / f"p{i}.mp4", frames=20, size=(160, 144))
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                          progress=False))
    pipe = fastio.VideoClips(frames=4, stride=2, size=32, dtype="uint8", layout="FHWC", scale=(0.2, 0.6))
    with clips_loader(tmp_path / "ds", pipe, batch_size=6, device="cuda") as loader:
        gpu = next(iter(loader))
    with clips_loader(tmp_path / "ds", dataclasses.replace(pipe, cpu_fallback="pyav"), batch_size=6) as loader:
        cpu = next(iter(loader))
    assert gpu["index"].tolist() == cpu["index"].tolist()
    assert gpu["start_frame"].cpu().tolist() == cpu["start_frame"].tolist()
    assert (gpu["video"].cpu().float() - cpu["video"].float()).abs().mean(dim=(1, 2, 3, 4)).max() < 6
