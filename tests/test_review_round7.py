"""Hostile review of three features merged in one day: ``--video-decoder nvdec``, ``VideoClips(cpu_fallback="pyav")``
and fresh draws for samples a mixture repeats within one epoch. Real files (made with PyAV), real Loaders."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.formats.media import MediaCheckError, check_media  # noqa: E402
from fastio.formats.pyav_clips import decode_clip  # noqa: E402


def cut_video(src: Path, dst: Path, drop: int) -> Path:
    """``src`` remuxed without its first ``drop`` packets (decode order): a stream cut from a longer one (``ffmpeg
    -c copy`` at a point that is not a keyframe), whose first packets refer to frames it no longer has."""
    import av

    with av.open(str(src)) as s, av.open(str(dst), "w") as d:
        stream = d.add_stream_from_template(s.streams.video[0])
        for packet in [p for p in s.demux(s.streams.video[0]) if p.size][drop:]:
            packet.stream = stream
            d.mux(packet)
    return dst


def test_a_video_whose_first_frame_is_not_a_keyframe_is_not_kept(tmp_path):
    """Its frames before the first keyframe cannot be decoded: kept, the fallback failed on every clip starting
    there ('frame 0 did not come out'), mid-training, at random; now convert skips it with the reason."""
    src = tmp_path / "src" / "c0"
    whole = synthetic.make_video(src / "whole.mp4", frames=30, fps=12, keyframe_every=8, bframes=2)
    cut_video(whole, src / "cut.mp4", 3)
    with pytest.raises(MediaCheckError, match="first frame is not a keyframe"):
        check_media((src / "cut.mp4").read_bytes(), "mp4", "nvdec")
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                                   progress=False))
    (skipped,) = result.skipped
    assert skipped["path"].endswith("cut.mp4") and "first frame is not a keyframe" in skipped["reason"], skipped
    assert "\n" not in skipped["reason"] and "transcode" not in skipped["reason"] and result.samples == 1
    converted = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "vp9", workers=1, transcode="vp9",
                                      progress=False))  # H.264 for the CPU decoder: re-encoded from its keyframe
    assert converted.samples == 2 and not converted.skipped, converted.skipped


@pytest.fixture(scope="module")
def h264_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("r7") / "src"
    for i in range(10):
        synthetic.make_video(root / "c0" / f"v{i}.mp4", frames=20 + 2 * i, fps=12, keyframe_every=8, bframes=2)
    dest = root.parent / "ds"
    convert(ConvertConfig(source=root, dest=dest, workers=1, video_decoder="nvdec", progress=False))
    return dest


def clips_loader(dest, threads=1, clips=1, **kw):
    import fastio

    pipeline = fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", cpu_fallback="pyav",
                                 fallback_threads=threads, clips_per_video=clips)
    opts = dict(batch_size=2, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


@pytest.mark.parametrize("jump", ["load_state_dict", "set_epoch"])
def test_a_jump_drops_the_clips_queued_for_the_old_position(h264_ds, monkeypatch, jump):
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
    with clips_loader(h264_ds, clips=2, read_ahead=4) as loader:
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
    with clips_loader(h264_ds, clips=2) as fresh:
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
