"""``VideoClips(cpu_fallback="pyav")``: H.264 videos kept for NVDEC (``convert --video-decoder nvdec``) read on the
CPU, their clips decoded with PyAV, then cropped, flipped, resized and normalised in the same DALI graph as VP9 clips.
Media made here with PyAV: frame numbers in the pixels (B-frames: stored in decode order), and a pattern whose crop
and flip show, encoded both as H.264 and as VP9 to compare the two paths. ``decode_clip`` on an edit list hiding the
first frames, H.264 with B-frames in AVI, AV1 and a frame size change mid-stream; a jump of the Loader cancels the
clips queued for the old position."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.errors import DatasetError  # noqa: E402
from fastio.formats.media import MediaCheckError, check_media  # noqa: E402
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


def test_a_mixture_repeating_h264_videos_decodes_each_delivery_s_own_clip(h264_ds, tmp_path):
    import shutil

    import fastio

    # "h" (5 videos) fills 15 of the 20 positions of each mixture epoch: its repeats draw their own starts ("o": a
    # copy of it, one place twice being refused)
    other = shutil.copytree(h264_ds, tmp_path / "other")
    mix = fastio.Mixture({"h": str(h264_ds), "o": str(other)}, weights={"h": 3, "o": 1}, samples_per_epoch=20)
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

    from fastio.convert.wds_index import IndexConfig, index_shards

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


@pytest.fixture(scope="module")
def ten_h264_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("r7") / "src"
    for i in range(10):
        synthetic.make_video(root / "c0" / f"v{i}.mp4", frames=20 + 2 * i, fps=12, keyframe_every=8, bframes=2)
    dest = root.parent / "ds"
    convert(ConvertConfig(source=root, dest=dest, workers=1, video_decoder="nvdec", progress=False))
    return dest


def queued_clips_loader(dest, threads=1, clips=1, **kw):
    import fastio

    pipeline = fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", cpu_fallback="pyav",
                                 fallback_threads=threads, clips_per_video=clips)
    opts = dict(batch_size=2, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


@pytest.mark.parametrize("jump", ["load_state_dict", "set_epoch"])
def test_a_jump_drops_the_clips_queued_for_the_old_position(ten_h264_ds, monkeypatch, jump):
    """The clips of batches read ahead for the old position were decoded anyway after a jump, one by one, before
    the new position's: with read_ahead=4, 2 clips per video and a slow decode, its first batch waited for ~20
    clips nobody would see. Now they are cancelled; the batch is bitwise a fresh Loader's at that position."""
    from fastio.pipelines import video_fallback

    real, calls = video_fallback.decode_clip, []

    def slow(*args):
        calls.append(time.monotonic())
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(video_fallback, "decode_clip", slow)
    with queued_clips_loader(ten_h264_ds, clips=2, read_ahead=4) as loader:
        next(iter(loader))
        time.sleep(0.3)  # a training step: the batches ahead are read, their clips queued
        state = {**loader.state_dict(), "epoch": 3, "consumed": 4}
        jumped = time.monotonic()
        loader.load_state_dict(state) if jump == "load_state_dict" else loader.set_epoch(3)
        got = next(iter(loader))
        started_after = sum(t >= jumped for t in calls)
    # the new position's graph asks for its first 2 batches (prefetch) of 2 videos x 2 clips (8); one old clip may
    # be being decoded when the jump comes, one of the new stream's reads ahead once they are done
    assert started_after <= 8 + 2, started_after
    with queued_clips_loader(ten_h264_ds, clips=2) as fresh:
        fresh.load_state_dict(state) if jump == "load_state_dict" else fresh.set_epoch(3)
        want = next(iter(fresh))
    assert got["index"].tolist() == want["index"].tolist()
    assert got["video"].equal(want["video"])


def shifted_video(src: Path, dst: Path, frames: int) -> Path:
    """``src`` remuxed with its times moved ``frames`` frames earlier: the mp4 muxer writes an edit list that hides
    those first frames (what ``ffmpeg -ss ... -c copy`` makes); FFmpeg's demuxer flags their packets discard."""
    import av

    with av.open(str(src)) as s, av.open(str(dst), "w") as d:
        stream = d.add_stream_from_template(s.streams.video[0])
        step = int(1 / (s.streams.video[0].average_rate * s.streams.video[0].time_base))
        for packet in [p for p in s.demux(s.streams.video[0]) if p.size]:
            packet.pts, packet.dts, packet.stream = packet.pts - frames * step, packet.dts - frames * step, stream
            d.mux(packet)
    return dst


def test_an_edit_list_hiding_the_first_frames_gives_every_frame_the_probe_counts(tmp_path):
    """The probe counts every packet (30 frames) and draws clip starts over them; FFmpeg's decoder dropped the 3
    frames the edit list hides, so a clip starting there failed ('frame 0 did not come out')."""
    whole = synthetic.make_video(tmp_path / "w.mp4", frames=30, fps=12, keyframe_every=8, bframes=2)
    data = shifted_video(whole, tmp_path / "edit.mp4", 3).read_bytes()
    info = __import__("json").loads(check_media(data, "mp4", "nvdec"))
    assert info["frames"] == 30 and info["keyframes"][0] == 0, info
    for first in range(30):
        clip = decode_clip(data, first, 4, 1)
        want = np.minimum(first + np.arange(4), 29).tolist()
        assert synthetic.frame_of_level(clip.reshape(4, -1).mean(1)).tolist() == want, first


def test_h264_with_b_frames_in_avi_gives_each_clip_s_frames(tmp_path):
    """AVI keeps no presentation times: FFmpeg's demuxer numbers the packets in decode order, so with B-frames the
    clip's frames came out in decode order, silently ([0, 3, 1] for frames 0, 1, 2). The decoder's output order
    tells: frames it gives with falling times are decoded from the start and numbered as they come out."""
    from test_media_nvdec import make_ffv1

    options = {"crf": "4", "preset": "ultrafast", "x264-params": "bframes=2:b-adapt=0:keyint=8"}
    data = make_ffv1(tmp_path / "v.avi", 20, "libx264", options=options).read_bytes()
    assert __import__("json").loads(check_media(data, "avi", "nvdec"))["frames"] == 20
    for stride in (1, 3):
        for first in range(20):
            clip = decode_clip(data, first, 3, stride)
            want = np.minimum(first + stride * np.arange(3), 19).tolist()
            assert synthetic.frame_of_level(clip.reshape(3, -1).mean(1)).tolist() == want, (first, stride)


def test_av1_clips_keep_their_non_reference_frames(tmp_path):
    """FFmpeg's libdav1d wrapper takes skip_frame once, when it opens: the fallback's skipping of non-reference
    frames shown before the clip dropped every non-reference frame of the video, the clip's too ('frame 1 did not
    come out'). Every clip is now those frames of the whole file decoded from its start."""
    import av
    from test_media_nvdec import make_ffv1

    if "libsvtav1" not in av.codecs_available:
        pytest.skip("PyAV's FFmpeg has no AV1 encoder (libsvtav1)")
    path = make_ffv1(tmp_path / "v.mp4", 24, "libsvtav1", options={"preset": "12", "crf": "5", "g": "8"})
    with av.open(str(path)) as c:
        whole = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    data = path.read_bytes()
    for first in range(24):
        clip = decode_clip(data, first, 3, 1)
        assert all(np.array_equal(clip[k], whole[min(first + k, 23)]) for k in range(3)), first


def resized_midway(path: Path) -> Path:
    """An H.264 .mkv of 10 frames of 64 x 48 then 10 of 96 x 64 (two encodes, their headers in the stream)."""
    import io

    import av

    def part(w: int, h: int, k0: int) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mpegts") as out:
            s = out.add_stream("libx264", rate=12)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.options = {"crf": "4", "preset": "ultrafast", "x264-params": "repeat-headers=1:keyint=8"}
            for k in range(k0, k0 + 10):
                rgb = np.full((h, w, 3), synthetic.frame_level(k), np.uint8)
                for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                    out.mux(p)
            for p in s.encode():
                out.mux(p)
        return buf.getvalue()

    with av.open(io.BytesIO(part(64, 48, 0) + part(96, 64, 10)), format="mpegts") as src, \
            av.open(str(path), "w") as dst:
        stream, shift, last = dst.add_stream_from_template(src.streams.video[0]), 0, None
        for q in [q for q in src.demux(src.streams.video[0]) if q.size]:
            if last is not None and q.dts + shift <= last:  # the second encode's times start again
                shift = last + 15000 - q.dts
            q.pts, q.dts, q.stream = q.pts + shift, q.dts + shift, stream
            last = q.dts
            dst.mux(q)
    return path


def test_a_frame_size_change_mid_stream_is_named(tmp_path):
    """A clip across the change failed with numpy's bare 'all input arrays must have the same shape'; one after
    it came out at 96 x 64, cropped and resized by the probe's 64 x 48, silently. Now one line: the change."""
    data = resized_midway(tmp_path / "v.mkv").read_bytes()
    assert decode_clip(data, 0, 4, 1).shape == (4, 48, 64, 3)
    for first in (8, 12):
        with pytest.raises(MediaCheckError, match=rf"its frame size changes mid-stream \(64 x 48, then 96 x 64 at "
                                                  rf"frame {max(first, 10)}\)"):
            decode_clip(data, first, 4, 1)


def test_an_mp4_cut_off_mid_frame_gives_clips_up_to_its_last_whole_frame(tmp_path):
    """A faststart H.264 MP4 cut off (its index lists every frame, its data ends mid-frame): FFmpeg demuxes the
    partial frame flagged corrupt, the probe leaves it out, but decode_clip fed it to the decoder, and every clip
    near the end stopped the Loader ('cannot be decoded by PyAV (Invalid data found ...)'). It reads the frames
    the probe counts now."""
    import av

    full = tmp_path / "full.mp4"
    with av.open(str(full), "w", format="mp4", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("libx264", rate=12)
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        stream.options, stream.codec_context.gop_size = {"crf": "4", "preset": "ultrafast"}, 5
        for k in range(30):
            rgb = np.full((16, 32, 3), synthetic.frame_level(k), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = full.read_bytes()
    cut = data[:int(len(data) * 0.6)]
    frames = json.loads(check_media(cut, "mp4"))["frames"]
    assert 0 < frames < 30
    from fastio.formats.pyav_clips import undecodable_frame

    assert undecodable_frame(cut) is None  # asked of each sample of a batch that failed: not this one's fault
    for first in range(frames):
        clip = decode_clip(cut, first, 4, 1)
        assert synthetic.frame_of_level(clip.mean(axis=(1, 2, 3))).tolist() == \
            [min(first + i, frames - 1) for i in range(4)], first
