"""Every container, codec and audio format docs/media.md lists, checked by content (frame numbers in the pixels,
tones of known pitch and envelope; media made here with PyAV, small): VP9/MJPEG in .mkv .mp4 .mov .avi, VP8, upper
case, a video with sound, odd sizes, one frame; WAV u8/s24/f32, 5.1, FLAC, Vorbis, Opus at 8-48 kHz; what convert
skips and how it says so; tables and Parquet bytes of media; clip starts, crop/flip per clip, layouts, option
values; damage found at load time; elastic resume; index, verify and inspect of media shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.formats.media import PROBE_FIELD, MediaCheckError, check_media  # noqa: E402

# -- making media ---------------------------------------------------------------------------------------------

def make_video(path: Path, codec: str, fmt: str | None, *, frames: int = 8, fps: int = 12, width: int = 64,
               height: int = 48, with_audio: bool = False, picture=None, gop: int | None = None) -> Path:
    """A video in container ``fmt`` with ``codec`` whose frame k shows :func:`synthetic.frame_level` (k) (or
    ``picture(k)``, an HWC uint8 array); ``with_audio`` adds an Opus (AAC in mp4/mov) track beside it; ``gop``:
    a keyframe every ``gop`` frames."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pix = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix
        if gop is not None:
            stream.codec_context.gop_size = gop
        stream.options = {"qmin": "1", "qmax": "2"} if codec == "mjpeg" else \
            {"crf": "4", "b:v": "0", "deadline": "realtime", "cpu-used": "8"}
        sound = out.add_stream("libopus" if fmt in ("matroska", "webm") else "aac", rate=48000, layout="mono") \
            if with_audio else None
        for k in range(frames):
            rgb = picture(k) if picture else np.full((height, width, 3), synthetic.frame_level(k), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _encode_audio(out, sound, synthetic.tone(frames / fps, 48000, 440.0), 48000, "mono")
    return path


def _encode_audio(out, stream, wave: np.ndarray, rate: int, layout: str) -> None:
    synthetic.encode_audio(out, stream, wave.T.reshape(1, -1), "flt", rate, layout)


def make_audio(path: Path, codec: str, fmt: str, *, rate: int, seconds: float = 1.0, channels: int = 1,
               pitch: float = 440.0) -> Path:
    """:func:`synthetic.tone` (pitch, amplitude rising 0.1 -> 0.9 over the file) in ``codec``/``fmt``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = {1: "mono", 2: "stereo", 6: "5.1"}[channels]
    options = {"options": {"strict": "experimental"}} if codec == "vorbis" else {}
    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout, **options)
        _encode_audio(out, stream, synthetic.tone(seconds, rate, pitch, channels), rate, layout)
    return path


def frames_shown(video) -> np.ndarray:
    """[B, F] frame numbers of uint8 FHWC clips (each frame's mean gray level)."""
    return synthetic.frame_of_level(video.float().mean(dim=(2, 3, 4)).numpy())


def tone_pitch(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[np.argmax(spectrum)])


def loader(dest, pipeline, **kw):
    import fastio

    opts = dict(batch_size=4, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


def uint8_clips(**kw):
    import fastio

    return fastio.VideoClips(**{**dict(frames=4, stride=2, size=16, dtype="uint8", layout="FHWC"), **kw})


# -- every container and codec the docs list -----------------------------------------------------------------

# name -> (codec, container, suffix, frames, extra): every suffix of the docs, the CPU codecs in them.
ZOO = {
    "vp9mkv": ("libvpx-vp9", "matroska", ".mkv", 10, {}),
    "vp9mp4": ("libvpx-vp9", "mp4", ".mp4", 9, {}),
    "mjpegavi": ("mjpeg", "avi", ".avi", 8, {}),
    "mjpegmov": ("mjpeg", "mov", ".mov", 11, {}),
    "mjpegmp4": ("mjpeg", "mp4", ".mp4", 7, {}),
    "vp8": ("libvpx", "webm", ".webm", 9, {}),
    "upper": ("libvpx-vp9", "webm", ".WEBM", 8, {}),
    "talking": ("libvpx-vp9", "matroska", ".mkv", 20, {"with_audio": True, "gop": 4}),  # cut at keyframes
    "talkingmp4": ("libvpx-vp9", "mp4", ".mp4", 18, {"with_audio": True, "gop": 5}),
    "odd": ("libvpx-vp9", "webm", ".webm", 8, {"width": 321, "height": 239}),
    "span": ("libvpx-vp9", "webm", ".webm", 7, {}),  # exactly one clip of frames=4, stride=2
    "one": ("libvpx-vp9", "webm", ".webm", 1, {}),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    for name, (codec, fmt, suffix, frames, extra) in ZOO.items():
        make_video(root / "c0" / f"{name}{suffix}", codec, fmt, frames=frames, **extra)
    return root


@pytest.fixture(scope="module")
def zoo_ds(tmp_path_factory, zoo) -> Path:
    dest = tmp_path_factory.mktemp("zoo_ds") / "ds"
    result = convert(ConvertConfig(source=zoo, dest=dest, workers=1, progress=False))
    assert result.samples == len(ZOO) and not result.skipped, result.skipped
    return dest


def test_every_listed_container_keeps_its_cpu_codec_and_its_frames(zoo_ds):
    """VP9 in .mkv/.mp4, MJPEG in .avi/.mov/.mp4, VP8, an upper-case suffix, a video with an audio track, odd
    sizes in one batch, a video exactly one span long and one of one frame: each clip holds the frames its start
    says, the last frame repeated past a short video's end."""
    seen = {}
    with loader(zoo_ds, uint8_clips(crop="center"), batch_size=3) as ld:
        for _epoch in range(3):
            for b in ld:
                assert b["video"].shape == (3, 4, 16, 16, 3)
                for j, i in enumerate(b["index"].tolist()):
                    name = ld.key(i).split("/")[1]
                    n, start = ZOO[name][3], int(b["start_frame"][j])
                    assert 0 <= start <= max(n - 7, 0), (name, start)
                    want = np.minimum(start + 2 * np.arange(4), n - 1)
                    assert frames_shown(b["video"])[j].tolist() == want.tolist(), (name, start)
                    seen.setdefault(name, set()).add(start)
    assert seen.keys() == ZOO.keys()
    assert seen["span"] == {0} and seen["one"] == {0}
    assert len(seen["talking"]) > 1  # 14 possible starts, 3 epochs


def gappy_avi(path: Path, frames: int, gap_after: int) -> Path:
    """An MJPEG AVI of :func:`synthetic.frame_level` frames whose timestamps skip one slot after frame
    ``gap_after`` (a dropped frame, as a webcam's capture writes it): ``frames`` frames in ``frames + 1`` slots."""
    from fractions import Fraction

    enc = av.CodecContext.create("mjpeg", "w")
    enc.width, enc.height, enc.pix_fmt, enc.time_base = 64, 48, "yuvj420p", Fraction(1, 12)
    enc.options = {"qmin": "1", "qmax": "2"}
    packets = []
    for k in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), synthetic.frame_level(k), np.uint8), format="rgb24")
        frame = frame.reformat(format="yuvj420p")
        frame.pts = k
        packets += [bytes(p) for p in enc.encode(frame)]
    packets += [bytes(p) for p in enc.encode(None)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="avi") as out:
        stream = out.add_stream("mjpeg", rate=12)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        for k, data in enumerate(packets):
            packet = av.Packet(data)
            packet.pts = packet.dts = k + (k > gap_after)
            packet.stream, packet.time_base = stream, Fraction(1, 12)
            out.mux(packet)
    return path


def test_a_short_avi_with_a_dropped_frame_repeats_its_last_frame(tmp_path):
    """DALI's decoder counts an AVI's frames by its time slots: asked past the end of one whose timestamps skip a
    slot, it returned black frames and frames from before the clip ([5, 6, 7, 3, 4] for 5 from frame 5 of 8). A
    clip that runs past a video's end is decoded from a stream of its packets, so the last frame repeats."""
    for i in range(3):
        gappy_avi(tmp_path / "src" / "c0" / f"cam{i}.avi", frames=8, gap_after=2 + i)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    with loader(tmp_path / "ds", uint8_clips(frames=6, stride=2, crop="center"), batch_size=3) as ld:
        b = next(iter(ld))
    assert b["start_frame"].tolist() == [0, 0, 0]
    assert frames_shown(b["video"]).tolist() == [[0, 2, 4, 6, 7, 7]] * 3
    with loader(tmp_path / "ds", uint8_clips(frames=4, stride=1, crop="center"), batch_size=3) as ld:
        for _epoch in range(3):
            for b in ld:
                for j, start in enumerate(b["start_frame"].tolist()):
                    assert frames_shown(b["video"])[j].tolist() == list(range(start, start + 4))


def piped_avi(path: Path, codec: str, frames: int = 30) -> Path:
    """An AVI of :func:`synthetic.frame_level` frames written where its writer cannot seek back (FFmpeg to a pipe;
    a capture cut off leaves the same): no index, and its header's frame count FFmpeg's placeholder (2**30). One
    keyframe (VP8, VP9), so a clip is cut from its start."""
    import io

    class Pipe(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += bytes(b)
            return len(b)

    pipe = Pipe()
    with av.open(pipe, "w", format="avi") as out:
        stream = out.add_stream(codec, rate=12)
        stream.width, stream.height = 32, 16
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = frames
        stream.options = {"qmin": "1", "qmax": "2"} if codec == "mjpeg" else \
            {"crf": "4", "b:v": "0", "deadline": "realtime", "cpu-used": "8"}
        for k in range(frames):
            rgb = np.full((16, 32, 3), synthetic.frame_level(k), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(pipe.data))
    return path


_CLIPS_OF_EVERY_START = """
import sys
import fastio
from fastio.convert import synthetic

clips = fastio.VideoClips(frames=4, stride=3, size=8, dtype="uint8", layout="FHWC", crop="center")
with fastio.Loader(sys.argv[1], pipeline=clips, batch_size=1, device="cpu", seed=0, num_threads=1) as loader:
    for epoch in range(4):
        loader.set_epoch(epoch)
        for b in loader:
            start = int(b["start_frame"][0])
            shown = synthetic.frame_of_level(b["video"].float().mean(dim=(2, 3, 4)).numpy())[0].tolist()
            assert shown == [min(start + 3 * k, 29) for k in range(4)], (loader.key(int(b["index"][0])), start, shown)
print("clips ok")
"""


def test_an_avi_written_to_a_pipe_gives_its_clips_not_a_segfault(tmp_path, warm):
    """An AVI without an index whose header says 2**30 frames (written to a pipe, or a capture cut off): DALI's CPU
    decoder, handed the file as it is (a clip from before its second keyframe), crashed the process (a segfault,
    found in review). Every AVI is now handed to it remuxed into a stream of its packets, as a cut clip is. In a
    process of its own (``warm``): the crash took the test process down."""
    for codec, name in (("libvpx-vp9", "vp9"), ("mjpeg", "mjpeg"), ("libvpx", "vp8")):
        piped_avi(tmp_path / "src" / "c0" / f"{name}.avi", codec)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    script = tmp_path / "clips.py"
    script.write_text(_CLIPS_OF_EVERY_START)
    rc, out, err = warm.run(script, tmp_path, str(tmp_path / "ds"), timeout=300)
    assert rc == 0 and "clips ok" in out, (rc, out, err[-3000:])


_WITHOUT_PYAV = """
import sys
sys.modules["av"] = None  # PyAV not installed where the Loader runs: import av raises ImportError
"""


def _stored(dest: Path, field: str) -> dict[str, bytes]:
    """Each key's ``field`` bytes in the shards of dataset ``dest``."""
    import tarfile

    out = {}
    for shard in sorted((dest / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith("." + field):
                    out[m.name[: -len(field) - 1]] = tar.extractfile(m).read()
    return out


def test_an_avi_written_to_a_pipe_is_stored_with_its_index(tmp_path, warm):
    """Without PyAV where the Loader runs, no clip of an AVI is remuxed (trim_video needs PyAV): DALI's CPU decoder
    was handed a pipe-written AVI (no index, 2**30 frames in its header) as convert stored it, and the process
    crashed (a segfault, found in review). Convert now stores such an AVI with its index (its packets copied into
    an AVI PyAV writes with one: no frame decoded or encoded), probe recording ``reindexed``, so a Loader without
    PyAV reads it: every clip start's frames, in a process of its own that hides PyAV."""
    from fastio.formats.media import avi_without_index

    for codec, name in (("libvpx-vp9", "vp9"), ("mjpeg", "mjpeg"), ("libvpx", "vp8")):
        piped = piped_avi(tmp_path / "src" / "c0" / f"{name}.avi", codec)
        assert avi_without_index(piped.read_bytes())
    assert not avi_without_index(make_video(tmp_path / "seekable.avi", "mjpeg", "avi").read_bytes())
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 3 and not result.skipped
    stored, probes = _stored(tmp_path / "ds", "avi"), _stored(tmp_path / "ds", PROBE_FIELD)
    for key, data in stored.items():
        assert not avi_without_index(data), key
        info = json.loads(probes[key])
        assert info["frames"] == 30 and info["reindexed"] is True, (key, info)
    script = tmp_path / "clips.py"
    script.write_text(_WITHOUT_PYAV + _CLIPS_OF_EVERY_START)
    rc, out, err = warm.run(script, tmp_path, str(tmp_path / "ds"), timeout=300)
    assert rc == 0 and "clips ok" in out, (rc, out, err[-3000:])


_FIRST_BATCH_OR_REFUSAL = """
import fastio
clips = fastio.VideoClips(frames=4, stride=3, size=8, dtype="uint8", crop="center")
try:
    with fastio.Loader(sys.argv[1], pipeline=clips, batch_size=2, device="cpu", seed=0, num_threads=1) as loader:
        next(iter(loader))
    print("delivered")
except fastio.DatasetError as err:
    print("refused:", err)
"""


def test_a_loader_without_pyav_refuses_an_avi_without_an_index_by_name(tmp_path, warm):
    """A dataset converted before convert added the index (or indexed from a user's shards, which fastio index
    never rewrites) holds the pipe-written AVI as it was: a Loader without PyAV crashed in DALI's CPU decoder.
    It now refuses the batch in one line naming the shard, key and field, and the ways out."""
    piped = piped_avi(tmp_path / "piped.avi", "libvpx-vp9").read_bytes()
    fine = make_video(tmp_path / "fine.avi", "libvpx-vp9", "avi", frames=30).read_bytes()
    dest = write_media(tmp_path / "ds", "avi", {"k0": fine, "k1": piped},
                       {"k0": check_media(fine, "avi"), "k1": check_media(piped, "avi")})
    script = tmp_path / "refused.py"
    script.write_text(_WITHOUT_PYAV + _FIRST_BATCH_OR_REFUSAL)
    rc, out, err = warm.run(script, tmp_path, str(dest), timeout=300)
    assert rc == 0, (rc, out, err[-3000:])
    assert f"refused: {dest}: shard shard-000000.tar key 'k1': field 'avi' is an AVI without an index" in out, out
    assert "pip install -e '.[media]'" in out and "convert the file again" in out, out
    assert len([line for line in out.splitlines() if line]) == 1, out


def vpx_resized_midway(path: Path, codec: str, at: int = 10) -> Path:
    """A WebM of VP8 or VP9 (``codec``: libvpx, libvpx-vp9): ``at`` frames of 64 x 48, then 10 of 32 x 24 from a
    keyframe on (two encodes' packets in one stream, as a WebRTC recording switches resolution)."""
    from fractions import Fraction

    def part(w: int, h: int, k0: int, n: int) -> list[bytes]:
        enc = av.CodecContext.create(codec, "w")
        enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuv420p", Fraction(1, 12)
        enc.options = {"crf": "4", "b:v": "0", "deadline": "realtime", "cpu-used": "8"}
        packets = []
        for k in range(k0, k0 + n):
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), synthetic.frame_level(k), np.uint8), format="rgb24")
            frame.pts = k - k0
            packets += [(bytes(p), p.is_keyframe) for p in enc.encode(frame.reformat(format="yuv420p"))]
        return packets + [(bytes(p), p.is_keyframe) for p in enc.encode(None)]

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="webm") as out:
        stream = out.add_stream(codec, rate=12)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for k, (data, key) in enumerate(part(64, 48, 0, at) + part(32, 24, at, 10)):
            packet = av.Packet(data)
            packet.pts = packet.dts = k
            packet.is_keyframe = key
            packet.stream, packet.time_base = stream, Fraction(1, 12)
            out.mux(packet)
    return path


def test_a_vp8_or_vp9_video_whose_frame_size_changes_is_skipped_by_name(tmp_path):
    """A VP8 or VP9 video whose frame size changes at a keyframe was stored, and DALI's CPU decoder returned the
    frames after the change wrong (mostly black): docs/media.md said it was not detected. The probe now reads each
    keyframe's size from its header (no frame decoded) and convert skips such a video, naming the change."""
    for codec, name in (("libvpx-vp9", "vp9"), ("libvpx", "vp8")):
        vpx_resized_midway(tmp_path / "src" / "c0" / f"{name}.webm", codec)
    synthetic.make_video(tmp_path / "src" / "c0" / "fine.webm", frames=20, keyframe_every=10)
    for name in ("vp9", "vp8"):
        with pytest.raises(MediaCheckError, match=r"its frame size changes mid-stream \(64 x 48, then 32 x 24 at "
                                                  r"frame 10\): re-encode it at one size"):
            check_media((tmp_path / "src" / "c0" / f"{name}.webm").read_bytes(), "webm")
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert sorted(s["path"] for s in result.skipped) == ["c0/vp8.webm", "c0/vp9.webm"] and result.samples == 1


def mjpeg_resized_midway(path: Path, fmt: str, at: int = 10) -> Path:
    """An MJPEG video in container ``fmt`` (``avi``, ``matroska``): ``at`` frames of 64 x 48, then 10 of 32 x 24
    (each frame a JPEG of its own size, as a webcam switching resolution writes them)."""
    from fractions import Fraction

    def part(w: int, h: int, k0: int, n: int) -> list[bytes]:
        enc = av.CodecContext.create("mjpeg", "w")
        enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuvj420p", Fraction(1, 12)
        enc.options = {"qmin": "1", "qmax": "2"}
        packets = []
        for k in range(k0, k0 + n):
            rgb = np.full((h, w, 3), synthetic.frame_level(k), np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuvj420p")
            frame.pts = k - k0
            packets += [bytes(p) for p in enc.encode(frame)]
        return packets + [bytes(p) for p in enc.encode(None)]

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream("mjpeg", rate=12)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        for k, data in enumerate(part(64, 48, 0, at) + part(32, 24, at, 10)):
            packet = av.Packet(data)
            packet.pts = packet.dts = k
            packet.is_keyframe = True
            packet.stream, packet.time_base = stream, Fraction(1, 12)
            out.mux(packet)
    return path


def test_an_mjpeg_video_whose_frame_size_changes_is_skipped_by_name(tmp_path):
    """An MJPEG video whose frames change size (every MJPEG frame is a JPEG with its own size: a webcam switching
    resolution) was stored, and DALI's CPU decoder then gave clips of wrong frames without an error (frames [6, 9,
    0, 1] for a clip of 6, 9, 12, 15), or failed a batch naming only its keys. The probe now reads each frame's size
    from its JPEG header (no frame decoded), as it reads VP8 and VP9 keyframes', and convert skips such a video,
    naming the change."""
    mjpeg_resized_midway(tmp_path / "src" / "c0" / "cam.avi", "avi")
    mjpeg_resized_midway(tmp_path / "src" / "c0" / "cam2.mkv", "matroska")
    make_video(tmp_path / "src" / "c0" / "fine.avi", "mjpeg", "avi", frames=12)
    for name in ("cam.avi", "cam2.mkv"):
        with pytest.raises(MediaCheckError, match=r"its frame size changes mid-stream \(64 x 48, then 32 x 24 at "
                                                  r"frame 10\): re-encode it at one size"):
            check_media((tmp_path / "src" / "c0" / name).read_bytes(), name.split(".")[1])
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert sorted(s["path"] for s in result.skipped) == ["c0/cam.avi", "c0/cam2.mkv"] and result.samples == 1


def test_verify_decode_names_a_stored_video_whose_frame_size_changes(tmp_path, capsys):
    """A dataset converted before the check holds such a video (its probe.json of the first size), which the Loader
    delivers wrong without an error: verify --decode, which decodes a video's first 16 frames, passed one changing
    at frame 20. It names it now, by shard and key."""
    from helpers import run_cli

    changing = vpx_resized_midway(tmp_path / "v.webm", "libvpx-vp9", at=20).read_bytes()
    fine = synthetic.make_video(tmp_path / "fine.webm", frames=30, keyframe_every=10).read_bytes()
    dest = write_media(tmp_path / "ds", "webm", {"k0": fine, "k1": changing},
                       {"k0": check_media(fine, "webm"), "k1": check_media(fine, "webm")})
    code, out, err = run_cli(["verify", str(dest), "--decode"], capsys)
    assert code == 1, out + err
    assert "shard-000000.tar: k1: field webm: its frame size changes mid-stream (64 x 48, then 32 x 24 at frame " \
           "20): re-encode it at one size" in out, out + err


def test_an_avi_cut_off_mid_frame_is_counted_without_its_partial_frame(tmp_path):
    """An MJPEG AVI whose last frame is cut short (a copy or a capture cut off): FFmpeg demuxes the partial frame as a
    packet (flagged corrupt), the probe counted it, and a clip reaching it got a half-decoded picture (frame 15 read
    as 13 here), silently. The probe now leaves trailing corrupt packets out: the clip ends on the last whole frame."""
    full = make_video(tmp_path / "full.avi", "mjpeg", "avi", frames=16).read_bytes()
    with av.open(io.BytesIO(full)) as container:
        last = [bytes(p) for p in container.demux(video=0) if p.size][-1]
    cut = full[:full.rfind(last) + len(last) // 2]  # the last frame's first half
    assert json.loads(check_media(cut, "avi"))["frames"] == 15
    (tmp_path / "src" / "c0").mkdir(parents=True)
    (tmp_path / "src" / "c0" / "cut.avi").write_bytes(cut)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    with loader(tmp_path / "ds", uint8_clips(frames=4, stride=5, crop="center"), batch_size=1) as ld:
        b = next(iter(ld))
    assert frames_shown(b["video"]).tolist() == [[0, 5, 10, 14]]


def test_probes_record_what_sampling_needs(zoo_ds):
    import fastio

    with fastio.Loader(zoo_ds, pipeline=fastio.Raw(fields=["probe.json"]), batch_size=1, device="cpu",
                       shuffle="none") as ld:
        probes = {ld.key(int(b["index"][0])).split("/")[1]: json.loads(b["probe.json"][0]) for b in ld}
    for name, (codec, _, _, frames, extra) in ZOO.items():
        p = probes[name]
        assert (p["kind"], p["frames"], p["fps"]) == ("video", frames, 12.0), name
        assert (p["width"], p["height"]) == (extra.get("width", 64), extra.get("height", 48)), name
        assert p["codec"] == {"libvpx-vp9": "vp9", "libvpx": "vp8", "mjpeg": "mjpeg"}[codec]
        assert abs(p["seconds"] - frames / 12) < 1e-3
    ds = fastio.Dataset(zoo_ds)
    assert {"mkv", "mp4", "avi", "mov", "webm"} <= set(ds.fields)  # one field per extension, lower case


# -- audio: every format, rate and layout ---------------------------------------------------------------------

VORBIS = Path(__file__).parent / "fixtures" / "tone1000_44k_stereo_vorbis.ogg"
# name -> (codec, container, suffix, rate, channels, seconds, pitch)
SOUNDS = {
    "u8": ("pcm_u8", "wav", ".wav", 8000, 1, 1.0, 440.0),
    "s24": ("pcm_s24le", "wav", ".wav", 48000, 2, 1.0, 1000.0),
    "f32": ("pcm_f32le", "wav", ".wav", 22050, 1, 1.0, 440.0),
    "surround": ("pcm_s16le", "wav", ".wav", 44100, 6, 1.0, 1000.0),
    "flac": ("flac", "flac", ".FLAC", 44100, 2, 1.0, 440.0),
    "vorbis": ("libvorbis", "ogg", ".ogg", 44100, 2, 1.0, 1000.0),  # fixtures/make_vorbis_fixture.py
    "opus": ("libopus", "ogg", ".opus", 48000, 1, 1.0, 440.0),
    "short": ("flac", "flac", ".flac", 22050, 1, 0.2, 1000.0),
}


@pytest.fixture(scope="module")
def sounds_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sounds")
    for name, (codec, fmt, suffix, rate, channels, seconds, pitch) in SOUNDS.items():
        if codec == "libvorbis":
            shutil.copy(VORBIS, root / "src" / "c0" / f"{name}{suffix}")
            continue
        make_audio(root / "src" / "c0" / f"{name}{suffix}", codec, fmt, rate=rate, channels=channels, seconds=seconds,
                   pitch=pitch)
    dest = root / "ds"
    result = convert(ConvertConfig(source=root / "src", dest=dest, workers=1, progress=False))
    assert result.samples == len(SOUNDS) and not result.skipped, result.skipped
    return dest


@pytest.mark.parametrize("out_rate", [16000, 8000])
def test_every_audio_format_gives_its_pitch_and_envelope_at_the_clip_start(sounds_ds, out_rate):
    import fastio

    length = int(0.3 * out_rate)
    with loader(sounds_ds, fastio.AudioClips(sample_rate=out_rate, seconds=0.3), batch_size=3) as ld:
        seen = set()
        for _epoch in range(2):
            for b in ld:
                assert b["audio"].shape == (3, length)
                for j, i in enumerate(b["index"].tolist()):
                    name, wave = ld.key(i).split("/")[1], b["audio"][j].numpy()
                    _, _, _, rate, _, seconds, pitch = SOUNDS[name]
                    start, inside = int(b["start_sample"][j]), min(length, int(seconds * out_rate))
                    assert 0 <= start <= max(int(seconds * out_rate) - length, 0), name
                    assert abs(tone_pitch(wave[:inside], out_rate) - pitch) < 25, name
                    # the amplitude where the clip starts, and 20 ms later
                    lo, hi = (0.1 + 0.8 * (start / out_rate + t) / seconds for t in (0.0, 0.02))
                    assert lo - 0.04 < np.abs(wave[: out_rate // 50]).max() < hi + 0.04, (name, start)
                    if name == "short":  # 0.2 s of a 0.3 s clip: zeros after it
                        assert start == 0 and not wave[inside + out_rate // 100:].any()
                    seen.add(name)
    assert seen == SOUNDS.keys()


@pytest.mark.parametrize("out_rate", [16000, 8000])
def test_audio_clips_at_the_end_of_a_file_hold_its_last_samples(sounds_ds, out_rate):
    """A clip nearly as long as its file, so some start at the last position: no silence at its end where the
    file has sound, and the envelope there is the file's at that time."""
    import fastio

    length = int(0.98 * out_rate)
    with loader(sounds_ds, fastio.AudioClips(sample_rate=out_rate, seconds=0.98), batch_size=4) as ld:
        for _epoch in range(2):
            for b in ld:
                for j, i in enumerate(b["index"].tolist()):
                    name, wave = ld.key(i).split("/")[1], b["audio"][j].numpy()
                    seconds = SOUNDS[name][5]
                    if name == "short":
                        continue
                    end = (int(b["start_sample"][j]) + length) / out_rate
                    tail = np.abs(wave[-out_rate // 50:]).max()  # its last 20 ms
                    want = 0.1 + 0.8 * end / seconds
                    assert want - 0.08 < tail < want + 0.04, (name, int(b["start_sample"][j]), tail, want)


def whole_file_resampled(encoded: bytes, rate: int) -> np.ndarray:
    """The file decoded, mixed down and resampled whole by DALI's audio decoder."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def whole():
        data = fn.external_source(source=lambda: [np.frombuffer(encoded, np.uint8)], batch=True, dtype=types.UINT8)
        return fn.decoders.audio(data, sample_rate=rate, downmix=True, dtype=types.FLOAT)[0]

    pipe = whole()
    pipe.build()
    return np.array(pipe.run()[0][0])


@pytest.mark.parametrize("rate,out_rate", [(8000, 44100), (8000, 48000), (11025, 48000)])
def test_audio_upsampled_several_times_is_the_whole_file_resampled(tmp_path, rate, out_rate):
    """docs/media.md: a clip's samples are those of the whole file resampled (within 1e-3). Upsampling 5.5 or 6
    times, the margin of 64 output samples around the window covered fewer input samples than the resampler's
    reach (16), so the clip's first and last samples were off by up to 2e-3 (and further from the true tone)."""
    import fastio

    make_audio(tmp_path / "src" / "c0" / "a.flac", "flac", "flac", rate=rate, seconds=1.0, channels=2)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    length = int(0.2 * out_rate)
    whole = None
    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=out_rate, seconds=0.2), batch_size=1) as ld:
        for epoch in range(6):
            ld.set_epoch(epoch)
            b = next(iter(ld))
            if whole is None:
                whole = whole_file_resampled(ld.read_set.reader.read_batch(b["index"].numpy()).image[0].tobytes(),
                                             out_rate)
            start = int(b["start_sample"][0])
            assert np.abs(b["audio"][0].numpy() - whole[start:start + length]).max() < 1e-3, (epoch, start)


def test_audio_seconds_not_a_whole_number_of_samples_and_log_mel_values(sounds_ds):
    import fastio

    with loader(sounds_ds, fastio.AudioClips(sample_rate=16000, seconds=0.123456), batch_size=2) as ld:
        b = next(iter(ld))
    assert b["audio"].shape == (2, 1975)  # round(16000 * 0.123456)
    with loader(sounds_ds, fastio.AudioClips(sample_rate=8000, seconds=0.25, n_mels=20, n_fft=256, hop=80),
                batch_size=4) as ld:
        b = next(iter(ld))
    mel = b["audio"].numpy()
    assert mel.shape == (4, 20, 1 + 2000 // 80) and np.isfinite(mel).all() and mel.max() <= 0.0


def test_samples_holding_a_video_and_its_sound_give_both_kinds_of_clip(tmp_path):
    """Loose files grouped by name (``a.webm`` + ``a.wav`` + ``a.cls``, as audio-visual WebDataset sets hold them):
    each media field is probed, so the same dataset gives video clips and audio clips, each of its own file."""
    import fastio

    src = tmp_path / "src"
    for i, (video, audio) in enumerate((("webm", "wav"), ("mkv", "flac"), ("mp4", "opus"))):
        codec, fmt = "libvpx-vp9", {"webm": "webm", "mkv": "matroska", "mp4": "mp4"}[video]
        make_video(src / f"s{i}.{video}", codec, fmt, frames=10 + 2 * i)
        sound = {"wav": ("pcm_s16le", "wav"), "flac": ("flac", "flac"), "opus": ("libopus", "ogg")}[audio]
        make_audio(src / f"s{i}.{audio}", *sound, rate=48000 if audio == "opus" else 16000, pitch=440.0 * (i + 1))
        (src / f"s{i}.cls").write_text(str(i))
    result = convert(ConvertConfig(source=src, dest=tmp_path / "ds", format="files", workers=1, progress=False))
    assert result.samples == 3 and not result.skipped, result.skipped
    assert fastio.Dataset(tmp_path / "ds").manifest.video_codecs == {"vp9": {"count": 3, "first": 0}}
    with loader(tmp_path / "ds", uint8_clips(frames=3, stride=2, crop="center"), batch_size=3) as ld:
        b = next(iter(ld))
    for j, label in enumerate(b["label"].tolist()):
        start = int(b["start_frame"][j])
        assert 0 <= start <= 10 + 2 * label - 5
        assert frames_shown(b["video"])[j].tolist() == [start, start + 2, start + 4]
    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=16000, seconds=0.5), batch_size=3) as ld:
        b = next(iter(ld))
    for j, label in enumerate(b["label"].tolist()):
        assert abs(tone_pitch(b["audio"][j].numpy(), 16000) - 440.0 * (label + 1)) < 25


def test_transcode_into_a_field_the_sample_has_skips_it_instead_of_losing_a_video(tmp_path):
    """``cam.mp4`` (H.264) and ``cam.webm`` grouped as one sample: ``--transcode vp9`` would store the re-encoded
    H.264 in the field ``webm`` the sample already has, one video silently lost; the sample is skipped and named."""
    src = tmp_path / "src"
    synthetic.make_video(src / "cam.mp4", frames=6)
    make_video(src / "cam.webm", "libvpx-vp9", "webm", frames=9)
    (src / "cam.cls").write_text("0")
    make_video(src / "other.webm", "libvpx-vp9", "webm", frames=9)
    (src / "other.cls").write_text("1")
    result = convert(ConvertConfig(source=src, dest=tmp_path / "ds", format="files", workers=1, progress=False,
                                   transcode="vp9", video_decoder="cpu"))  # cpu: the H.264 is re-encoded
    assert result.samples == 1
    (skipped,) = result.skipped
    assert "cam" in skipped["path"] and skipped["reason"].startswith("field 'webm' twice: another video"), skipped


def test_a_probe_of_the_other_kind_is_named_not_a_key_error(tmp_path):
    """A sample of a video and its sound whose one ``probe.json`` is the sound's (as convert wrote them before it
    probed every media field): video clips name the sample and the way out, not a bare KeyError."""
    import fastio
    from fastio.dataset.shards import ShardWriter

    video = make_video(tmp_path / "a.webm", "libvpx-vp9", "webm", frames=8).read_bytes()
    sound = make_audio(tmp_path / "a.flac", "flac", "flac", rate=16000).read_bytes()
    with ShardWriter(tmp_path / "ds") as writer:
        writer.write({"__key__": "a", "webm": video, "flac": sound, "cls": b"0", PROBE_FIELD: check_media(sound, "flac")})
        writer.close(label_field="cls", label_map={"c": 0}, converted_from={"format": "test"}, skipped=[])
    with pytest.raises(fastio.DatasetError, match=r"sample 0: bad probe.json \(it is a probe of audio, "
                                                  r"not of its webm .*re-convert"):
        with loader(tmp_path / "ds", uint8_clips(), batch_size=1) as ld:
            next(iter(ld))


# -- what convert skips, and how it says so -------------------------------------------------------------------

def png_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 12), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    good = make_video(root / "c0" / "good.webm", "libvpx-vp9", "webm", frames=8)
    (root / "c0" / "zero.webm").write_bytes(b"")
    data = make_video(root / "tmp" / "whole.mkv", "libvpx-vp9", "matroska", frames=30).read_bytes()
    (root / "c0" / "cut.mkv").write_bytes(data[: len(data) // 2])
    shutil.rmtree(root / "tmp")
    (root / "c0" / "picture.webm").write_bytes(png_bytes())  # the suffix lies
    (root / "c0" / "silence.flac").write_bytes(good.read_bytes())  # a video named as audio
    synthetic.make_audio(root / "c0" / "song.mp3", seconds=0.3)
    synthetic.make_video(root / "c0" / "camera.mp4", frames=6)  # H.264
    return root


def test_bad_files_are_skipped_and_named_with_their_reason(bad_folder, tmp_path):
    result = convert(ConvertConfig(source=bad_folder, dest=tmp_path / "ds", workers=1, progress=False,
                                   video_decoder="cpu",  # cpu: H.264 is skipped too (the default keeps it)
                                   transcode="none"))  # none: the MP3 is skipped too (the default stores it as FLAC)
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    kept = result.samples
    assert "c0/good.webm" not in reasons
    assert "cannot be probed" in reasons["c0/zero.webm"]
    # a video named as audio said only "no audio stream"; it says what the file is, as the reverse case does
    assert reasons["c0/silence.flac"] == ("no audio stream, only video (vp9 in matroska): its suffix says flac; name "
                                          "it by its container (.webm, .mkv, .mp4, ...) to store it as a video")
    assert "mp3" in reasons["c0/song.mp3"] and "FLAC" in reasons["c0/song.mp3"]
    assert "h264" in reasons["c0/camera.mp4"] and "--transcode vp9" in reasons["c0/camera.mp4"]
    assert "png image" in reasons["c0/picture.webm"] and "not a video" in reasons["c0/picture.webm"]
    # the cut file: either skipped, or kept with only the frames it holds (its probe counts them)
    assert kept in (1, 2) and (kept == 1) == ("c0/cut.mkv" in reasons)


def song_with_cover(path: Path, fmt: str = "mp4") -> Path:
    """AAC with its cover picture (an MJPEG stream flagged attached_pic, as iTunes' .m4a and podcasts carry one), in
    container ``fmt``: no video, though FFmpeg lists the picture as a video stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format=fmt) as out:
        sound = out.add_stream("aac", rate=48000, layout="mono")
        cover = out.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 64, 48, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        for packet in [*cover.encode(av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")),
                       *cover.encode()]:
            out.mux(packet)
        _encode_audio(out, sound, synthetic.tone(1.0, 48000, 440.0), 48000, "mono")
    return path


def test_a_song_with_its_cover_picture_named_as_a_video_is_named_as_audio(tmp_path):
    """An .mp4 holding AAC and its cover picture (an .m4a named .mp4): the probe took the picture (FFmpeg's video
    stream flagged attached_pic) for the video and refused the file, 'cannot be probed (no frames)', where the
    same song without a cover is stored as FLAC by default (a video file holding only audio). The picture is not a
    video: the file is now stored as FLAC by default and, with transcode='none', named as audio."""
    song_with_cover(tmp_path / "src" / "c0" / "song.mp4")
    make_video(tmp_path / "src" / "c0" / "clip.mp4", "libvpx-vp9", "mp4", frames=8)
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 2 and not result.skipped and result.transcoded == {"flac": {"aac": 1}}
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "none", workers=1, progress=False,
                                   transcode="none"))
    [skip] = result.skipped
    assert skip["path"] == "c0/song.mp4" and skip["reason"].startswith("no video stream, only audio (aac in mov"), skip


def test_a_codec_ffmpeg_has_no_decoder_for_is_skipped_by_name_not_a_crash(tmp_path):
    """A WAV whose format tag says IEEE float at 16 bits, an AVI whose fourcc names no codec FFmpeg knows: PyAV opens
    them but gives their stream no codec context (None), and the probe read its name: a bare AttributeError ('NoneType'
    object has no attribute 'name') stopped the whole conversion with a traceback. Such a file is now skipped,
    named, with the reason (and check_media raises MediaCheckError)."""
    src = tmp_path / "src" / "c0"
    wav = bytearray(make_audio(src / "good.wav", "pcm_s16le", "wav", rate=16000).read_bytes())
    at = wav.find(b"fmt ") + 8
    wav[at:at + 2] = (3).to_bytes(2, "little")  # WAVE_FORMAT_IEEE_FLOAT, its bits still 16
    (src / "float16.wav").write_bytes(bytes(wav))
    avi = make_video(src / "good.avi", "mjpeg", "avi").read_bytes()
    (src / "unknown.avi").write_bytes(avi.replace(b"MJPG", b"ZZZZ"))
    for name in ("float16.wav", "unknown.avi"):
        with pytest.raises(MediaCheckError, match=r"^cannot be probed \(its (audio|video) codec has no decoder in "
                                                  r"FFmpeg\)"):
            check_media((src / name).read_bytes(), name.split(".")[1])
    for transcode in ("flac", "none", "vp9,flac"):
        result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / f"ds-{transcode}", workers=1,
                                       progress=False, transcode=transcode))
        assert sorted(s["path"] for s in result.skipped) == ["c0/float16.wav", "c0/unknown.avi"], result.skipped
        assert result.samples == 2


def _with_latin1_artist(wav: bytes) -> bytes:
    """``wav`` with a LIST/INFO chunk naming its artist in Latin-1 (``Beyoncé``), as older taggers and recorders
    write it: FFmpeg reads it into the file's metadata, bytes that are not UTF-8."""
    import struct

    text = "Beyoncé".encode("latin-1") + b"\0"
    info = b"INFO" + b"IART" + struct.pack("<I", len(text)) + text + b"\0" * (len(text) % 2)
    data = wav[:12] + b"LIST" + struct.pack("<I", len(info)) + info + wav[12:]
    return data[:4] + struct.pack("<I", len(data) - 8) + data[8:]


def test_a_file_whose_tags_are_not_utf8_is_read_not_a_crash(tmp_path):
    """A WAV whose INFO tag names its artist in Latin-1 (an older tagger's): PyAV decodes a file's metadata as UTF-8
    when it opens it, strictly, so the probe's av.open raised a bare UnicodeDecodeError and the whole conversion
    stopped with a traceback (and a Loader's PyAV decode, verify, index would too). Media files are now opened with
    undecodable tag bytes replaced (nothing fastio reads is in the tags): it is stored, its clips its tone. An AVI
    with such an INFO tag (its software name) too."""
    import fastio

    src = tmp_path / "src" / "c0"
    wav = make_audio(tmp_path / "a.wav", "pcm_s16le", "wav", rate=16000, pitch=440.0).read_bytes()
    src.mkdir(parents=True)
    (src / "tagged.wav").write_bytes(_with_latin1_artist(wav))
    avi = make_video(tmp_path / "v.avi", "mjpeg", "avi", frames=8).read_bytes()
    assert avi.count(b"Lavf") == 1
    latin = avi.replace(b"Lavf", "Lävf".encode("latin-1"))
    assert json.loads(check_media(latin, "avi"))["frames"] == 8
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 1 and not result.skipped
    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=16000, seconds=0.5), batch_size=1) as ld:
        audio = next(iter(ld))["audio"][0].numpy()
    assert abs(tone_pitch(audio, 16000) - 440.0) < 25


def test_audio_dali_cannot_read_is_skipped_at_convert_with_the_way_out(tmp_path):
    """Audio suffixes holding what PyAV reads but DALI's audio decoder does not (AAC in a .wav, Opus in Matroska
    named .opus, ALAC in MP4 named .flac, AAC in ADTS named .ogg): with ``transcode="none"`` skipped at convert,
    named with the codec and the way out, not stored to fail the Loader's batches later; by default stored as
    FLAC (tests/test_audio_transcode.py)."""
    src = tmp_path / "src" / "c0"
    make_audio(src / "aac.wav", "aac", "wav", rate=48000)
    make_audio(src / "mka.opus", "libopus", "matroska", rate=48000)
    make_audio(src / "alac.flac", "alac", "ipod", rate=16000)
    make_audio(src / "adts.ogg", "aac", "adts", rate=16000)
    make_audio(src / "good.wav", "pcm_s16le", "wav", rate=16000)
    make_audio(src / "alaw.wav", "pcm_alaw", "wav", rate=8000)
    make_audio(src / "ima.wav", "adpcm_ima_wav", "wav", rate=16000)
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False,
                                   transcode="none"))
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert set(reasons) == {"c0/aac.wav", "c0/mka.opus", "c0/alac.flac", "c0/adts.ogg"}, reasons
    assert result.samples == 3
    assert "cannot be probed" in reasons["c0/aac.wav"] or "audio aac in wav" in reasons["c0/aac.wav"]
    for path, what in (("c0/mka.opus", "opus in matroska"), ("c0/alac.flac", "alac in mov"),
                       ("c0/adts.ogg", "aac in aac")):
        assert f"audio {what}" in reasons[path] and "DALI's audio decoder" in reasons[path], reasons[path]
        assert "FLAC" in reasons[path] and "ffmpeg" in reasons[path]
    import fastio

    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=8000, seconds=0.5), batch_size=3) as ld:
        b = next(iter(ld))
    assert all(abs(tone_pitch(w, 8000) - 440.0) < 25 for w in b["audio"].numpy())


def streamed_wav(path: Path, pitch: float = 440.0) -> Path:
    """A 16 kHz WAV whose RIFF and data chunk sizes are 0, as a writer that cannot seek back writes them (Python's
    ``wave`` to a pipe, a recorder killed before it closed the file): FFmpeg reads its samples to the end of the
    file, DALI's audio decoder (libsndfile) reads none."""
    data = bytearray(make_audio(path, "pcm_s16le", "wav", rate=16000, pitch=pitch).read_bytes())
    at = data.find(b"data")
    data[4:8], data[at + 4:at + 8] = bytes(4), bytes(4)
    path.write_bytes(bytes(data))
    return path


def test_a_wav_whose_data_chunk_says_0_bytes_is_stored_as_flac_or_skipped(tmp_path):
    """Such a WAV was stored as it is (PyAV probes its 16000 samples), and every Loader batch holding it then
    failed (DALI's decoder reads 0 of them). By default it is stored as FLAC, as other audio DALI does not read;
    with transcode='none' skipped, naming why; index leaves it unprobed with the reason."""
    src = tmp_path / "src" / "c0"
    streamed_wav(src / "piped.wav")
    make_audio(src / "good.wav", "pcm_s16le", "wav", rate=16000, pitch=1000.0)
    with pytest.raises(MediaCheckError, match=r"its data chunk says 0 bytes .*DALI's audio decoder reads none of "
                                              r"its 16000 samples: convert it with --transcode flac"):
        check_media((src / "piped.wav").read_bytes(), "wav")
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 2 and not result.skipped and result.transcoded == {"flac": {"pcm_s16le": 1}}
    pitches = _first_batch_pitches(tmp_path / "ds")
    assert abs(pitches["c0/piped"] - 440.0) < 25 and abs(pitches["c0/good"] - 1000.0) < 25, pitches
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "none", workers=1, progress=False,
                                   transcode="none"))
    assert [s["path"] for s in result.skipped] == ["c0/piped.wav"] and result.samples == 1
    assert "its data chunk says 0 bytes" in result.skipped[0]["reason"]
    from test_media import write_wds_tar

    from fastio.convert.wds_index import IndexConfig, index_shards

    write_wds_tar(tmp_path / "wds" / "a-000000.tar", {"k0.wav": (src / "piped.wav").read_bytes(), "k0.cls": b"0"})
    result = index_shards(IndexConfig(source=tmp_path / "wds"))
    assert result.skipped[0]["reason"].startswith("not probed (kept in the shard): its data chunk says 0 bytes")


def _first_batch_pitches(dest: Path) -> dict[str, float]:
    """Each key's tone pitch in the first batch of two 0.5 s clips at 16 kHz of the audio dataset ``dest``."""
    import fastio

    with loader(dest, fastio.AudioClips(sample_rate=16000, seconds=0.5), batch_size=2, shuffle="none") as ld:
        b = next(iter(ld))
        keys = [ld.key(int(i)) for i in b["index"]]
    return {k: tone_pitch(w, 16000) for k, w in zip(keys, b["audio"].numpy())}


def streamed_flac(path: Path, pitch: float = 440.0) -> Path:
    """A 16 kHz FLAC whose STREAMINFO says 0 samples (unknown), as FFmpeg writing FLAC to a pipe leaves it: FFmpeg
    reads its samples, DALI's audio decoder (libsndfile) fails on it ("Requested 9223372036854775807 samples but
    got 0"). An ID3v2 tag before it, as taggers put one."""
    data = bytearray(make_audio(path, "flac", "flac", rate=16000, pitch=pitch).read_bytes())
    total = 8 + 13  # STREAMINFO's byte 13: the low 4 of the 36 bits of total samples, then 4 bytes
    data[total] &= 0xF0
    data[total + 1:total + 5] = bytes(4)
    path.write_bytes(b"ID3\x04\x00\x00" + bytes([0, 0, 0, 20]) + bytes(20) + bytes(data))
    return path


def test_a_flac_whose_streaminfo_says_0_samples_is_stored_as_flac_with_its_count(tmp_path):
    """Such a FLAC was stored as it was (PyAV probes its 16000 samples) and every Loader batch holding it failed. By
    default it is re-encoded (stored as FLAC, now counting its samples), as other audio DALI does not read; with
    transcode='none' skipped, naming why."""
    src = tmp_path / "src" / "c0"
    streamed_flac(src / "piped.flac")
    with pytest.raises(MediaCheckError, match=r"its STREAMINFO says 0 samples .*DALI's audio decoder reads none of "
                                              r"its 16000 samples: convert it with --transcode flac"):
        check_media((src / "piped.flac").read_bytes(), "flac")
    make_audio(src / "good.flac", "flac", "flac", rate=16000, pitch=1000.0)
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 2 and not result.skipped and result.transcoded == {"flac": {"flac": 1}}
    pitches = _first_batch_pitches(tmp_path / "ds")
    assert abs(pitches["c0/piped"] - 440.0) < 25 and abs(pitches["c0/good"] - 1000.0) < 25, pitches
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "none", workers=1, progress=False,
                                   transcode="none"))
    assert [s["path"] for s in result.skipped] == ["c0/piped.flac"] and result.samples == 1


def test_flac_files_one_after_another_are_stored_as_one_flac(tmp_path):
    """``cat a.flac b.flac``: FFmpeg decodes both files' frames (the probe counted 24000 samples), DALI's audio
    decoder stops at the first's STREAMINFO count (16000), so a clip past it failed the Loader's batch. Stored as one
    FLAC by default (all 24000 samples); skipped with transcode='none', for the reason check_media gives."""
    import fastio

    src = tmp_path / "src" / "c0"
    first = make_audio(tmp_path / "a.flac", "flac", "flac", rate=16000, seconds=1.0, pitch=440.0).read_bytes()
    second = make_audio(tmp_path / "b.flac", "flac", "flac", rate=16000, seconds=0.5, pitch=1000.0).read_bytes()
    src.mkdir(parents=True)
    (src / "both.flac").write_bytes(first + second)
    with pytest.raises(MediaCheckError, match=r"it is FLAC files one after another .*so DALI's audio decoder reads "
                                              r"only the first file's of its 24000 samples: convert it with"):
        check_media((src / "both.flac").read_bytes(), "flac")
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 1 and result.transcoded == {"flac": {"flac": 1}}
    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=16000, seconds=1.5), batch_size=1) as ld:
        audio = next(iter(ld))["audio"][0].numpy()
    assert abs(tone_pitch(audio[17000:], 16000) - 1000.0) < 25 and abs(tone_pitch(audio[:15000], 16000) - 440) < 25


def test_wav_files_one_after_another_are_skipped_by_name(tmp_path):
    """``cat a.wav b.wav`` (a mono and a stereo one too): FFmpeg reads the first file's samples only (the probe
    counted 16000) and DALI's audio decoder none ("No 'RIFF' chunk marker"), so convert stored it and every Loader
    batch holding it failed, named only then; transcoding it would keep the first file's sound and drop the rest,
    silently. Convert (and index) now skip it, naming the file and why, whatever --transcode says."""
    src = tmp_path / "src" / "c0"
    first = make_audio(tmp_path / "a.wav", "pcm_s16le", "wav", rate=16000, seconds=1.0).read_bytes()
    second = make_audio(tmp_path / "b.wav", "pcm_s16le", "wav", rate=16000, seconds=0.5, pitch=1000.0).read_bytes()
    stereo = make_audio(tmp_path / "s.wav", "pcm_s16le", "wav", rate=16000, channels=2).read_bytes()
    src.mkdir(parents=True)
    (src / "both.wav").write_bytes(first + second)
    (src / "mixed.wav").write_bytes(first + stereo)
    (src / "good.wav").write_bytes(first)
    for name in ("both.wav", "mixed.wav"):
        with pytest.raises(MediaCheckError, match=r"^it is WAV files one after another \(cat a.wav b.wav\): FFmpeg "
                                                  r"reads only the first file's samples and DALI's audio decoder none"):
            check_media((src / name).read_bytes(), "wav")
    assert check_media(first + bytes(1000), "wav")  # trailing bytes that are not a file: read as before
    for transcode in ("flac", "none"):
        result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / f"ds-{transcode}", workers=1,
                                       progress=False, transcode=transcode))
        assert result.samples == 1 and sorted(s["path"] for s in result.skipped) == ["c0/both.wav", "c0/mixed.wav"]
        assert all(s["reason"].startswith("it is WAV files one after another") for s in result.skipped)
    from test_media import write_wds_tar

    from fastio.convert.wds_index import IndexConfig, index_shards

    write_wds_tar(tmp_path / "wds" / "a-000000.tar", {"k0.wav": first + second, "k0.cls": b"0"})
    result = index_shards(IndexConfig(source=tmp_path / "wds"))
    assert result.skipped[0]["reason"].startswith("not probed (kept in the shard): it is WAV files one after another")


def _streaminfo(data: bytes, *, samples: int | None = None, channels: int | None = None,
                rate: int | None = None) -> bytes:
    """FLAC ``data`` (no tag before it) with its STREAMINFO's total samples, channels or rate changed: a damaged
    header (or one a tool rewrote wrong), the frames as they were."""
    b, info = bytearray(data), 8
    if samples is not None:  # 36 bits: the low 4 of byte 13, then 4 bytes
        b[info + 13] = (b[info + 13] & 0xF0) | (samples >> 32 & 0xF)
        b[info + 14:info + 18] = (samples & 0xFFFFFFFF).to_bytes(4, "big")
    if channels is not None:  # 3 bits (channels - 1) after the 20 bits of rate
        b[info + 12] = (b[info + 12] & 0xF1) | (channels - 1) << 1
    if rate is not None:
        bits = int.from_bytes(b[info + 10:info + 13], "big")
        b[info + 10:info + 13] = (rate << 4 | bits & 0xF).to_bytes(3, "big")
    return bytes(b)


def test_a_flac_whose_streaminfo_disagrees_with_its_frames_is_stored_as_flac_or_skipped(tmp_path):
    """A FLAC whose STREAMINFO counts fewer samples than its frames hold (DALI reads only those), more (DALI fails:
    "Requested 32000 samples but got 16000"), other channels, or 0 Hz (DALI fails) was stored as it was: PyAV probes
    it from its frames, and only verify --decode or the Loader's batch named it. By default it is now re-encoded at
    convert (stored as FLAC, its header right), as a FLAC whose STREAMINFO says 0 samples is; with
    transcode='none' skipped, naming what the header says."""
    src = tmp_path / "src" / "c0"
    good = make_audio(tmp_path / "a.flac", "flac", "flac", rate=16000, seconds=1.0).read_bytes()
    damaged = {"fewer": _streaminfo(good, samples=8000), "more": _streaminfo(good, samples=32000),
               "channels": _streaminfo(good, channels=2), "norate": _streaminfo(good, rate=0)}
    src.mkdir(parents=True)
    for name, data in damaged.items():
        (src / f"{name}.flac").write_bytes(data)
    (src / "good.flac").write_bytes(good)
    said = {"fewer": r"8000 samples where its frames hold 16000 \(a damaged header\), so DALI's audio decoder reads "
                     r"only 8000",
            "more": r"32000 samples where its frames hold 16000 \(a damaged header\), so DALI's audio decoder reads "
                    r"none",
            "channels": r"2 channels where its frames have 1 \(a damaged header\), so DALI's audio decoder reads none",
            "norate": r"0 Hz \(a damaged header\), so DALI's audio decoder reads none"}
    for name, data in damaged.items():
        with pytest.raises(MediaCheckError, match=rf"^its STREAMINFO says {said[name]} of its 16000 samples: convert "
                                                  r"it with --transcode flac"):
            check_media(data, "flac")
    assert check_media(good, "flac")
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 5 and not result.skipped and result.transcoded == {"flac": {"flac": 4}}
    import fastio

    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=16000, seconds=1.0), batch_size=5) as ld:
        b = next(iter(ld))
    assert all(abs(tone_pitch(w, 16000) - 440.0) < 25 for w in b["audio"].numpy())
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "none", workers=1, progress=False,
                                   transcode="none"))
    assert sorted(s["path"] for s in result.skipped) == [f"c0/{n}.flac" for n in sorted(damaged)]
    assert result.samples == 1


def test_a_chained_ogg_is_stored_as_flac_or_skipped(tmp_path):
    """Ogg files one after another in one file (a chained Ogg: a recorded radio stream, ``cat a.opus b.opus``): FFmpeg
    reads every stream's samples, DALI's audio decoder the first stream's only. It was stored as it was, and every
    Loader batch holding it failed (or a clip near its end). By default it is stored as FLAC, all of its sound; with
    transcode='none' skipped, naming why."""
    import fastio

    src = tmp_path / "src" / "c0"
    first = make_audio(tmp_path / "a.opus", "libopus", "ogg", rate=48000, seconds=1.0, pitch=440.0).read_bytes()
    second = make_audio(tmp_path / "b.opus", "libopus", "ogg", rate=48000, seconds=1.0, pitch=1000.0).read_bytes()
    src.mkdir(parents=True)
    (src / "radio.opus").write_bytes(first + second)
    (src / "twice.ogg").write_bytes(VORBIS.read_bytes() * 2)
    make_audio(src / "good.flac", "flac", "flac", rate=16000)
    for name in ("radio.opus", "twice.ogg"):
        with pytest.raises(MediaCheckError, match=r"it is a chained Ogg stream .*so DALI's audio decoder reads only "
                                                  r"the first stream's of its \d+ samples: convert it with --transcode"):
            check_media((src / name).read_bytes(), name.split(".")[1])
    assert check_media(first, "opus")  # one stream: kept as it is
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 3 and not result.skipped
    assert result.transcoded == {"flac": {"opus": 1, "vorbis": 1}}
    with loader(tmp_path / "ds", fastio.AudioClips(sample_rate=16000, seconds=1.75), batch_size=3,
                shuffle="none") as ld:
        b = next(iter(ld))
        keys = [ld.key(int(i)) for i in b["index"]]
    radio = b["audio"].numpy()[keys.index("c0/radio")]
    start = int(b["start_sample"][keys.index("c0/radio")])
    assert abs(tone_pitch(radio[16000 - start + 1000:], 16000) - 1000.0) < 25  # the second stream's sound
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "none", workers=1, progress=False,
                                   transcode="none"))
    assert sorted(s["path"] for s in result.skipped) == ["c0/radio.opus", "c0/twice.ogg"] and result.samples == 1


def test_transcode_does_not_turn_a_picture_named_webm_into_a_video(bad_folder, tmp_path):
    result = convert(ConvertConfig(source=bad_folder, dest=tmp_path / "ds", workers=1, progress=False,
                                   transcode="vp9"))
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert "c0/camera.mp4" not in reasons  # H.264 is transcoded
    assert "png image" in reasons["c0/picture.webm"]


def test_cli_on_error_fail_prints_one_line_and_exits_2(bad_folder, tmp_path, capsys):
    from helpers import run_cli

    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    shutil.copy(bad_folder / "c0" / "good.webm", src)
    shutil.copy(bad_folder / "c0" / "zero.webm", src)
    code, out, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--on-error", "fail"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fastio: error:"), err
    assert "zero.webm" in lines[0] and "cannot be probed" in lines[0] and "Traceback" not in out + err
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_cli_names_the_way_out_for_h264_once(bad_folder, tmp_path, capsys):
    from helpers import run_cli

    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    shutil.copy(bad_folder / "c0" / "camera.mp4", src)
    code, out, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--video-decoder", "cpu"],
                             capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "every sample was skipped" in lines[0], err
    assert "video codec h264" in lines[0] and lines[0].count("--transcode vp9") == 1, lines[0]
    assert "leave out --video-decoder cpu" in lines[0]


# -- tables naming media ------------------------------------------------------------------------------------------

def test_tables_name_video_and_audio_by_relative_and_absolute_paths(tmp_path):

    files = tmp_path / "files"
    make_video(files / "a.mkv", "libvpx-vp9", "matroska", frames=9)
    make_video(files / "b.WEBM", "libvpx-vp9", "webm", frames=10)
    make_audio(files / "c.flac", "flac", "flac", rate=16000)
    rows = [("files/a.mkv", 0), (str(files / "b.WEBM"), 1)]
    (tmp_path / "v.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    (tmp_path / "v.jsonl").write_text("".join(json.dumps({"path": p, "label": c}) + "\n" for p, c in rows))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"path": [p for p, _ in rows], "label": [c for _, c in rows]}), tmp_path / "v.parquet")
    for table in ("v.csv", "v.jsonl", "v.parquet"):
        dest = tmp_path / f"ds_{table}"
        result = convert(ConvertConfig(source=tmp_path / table, dest=dest, workers=1, progress=False,
                                       path_column="path" if table.endswith("parquet") else None))
        assert result.samples == 2 and not result.skipped, (table, result.skipped)
        with loader(dest, uint8_clips(frames=3, stride=3, crop="center"), batch_size=2, shuffle="none") as ld:
            b = next(iter(ld))
        for j in range(2):
            start = int(b["start_frame"][j])
            assert frames_shown(b["video"])[j].tolist() == [start, start + 3, start + 6], table
        assert sorted(b["label"].tolist()) == [0, 1]


def test_a_table_with_upper_case_column_and_suffix_fields_loads(tmp_path):
    """Found beside the media suffixes: a CSV column named ``Caption`` (field ``Caption``) and a file ``.TXT``
    (field ``TXT``) were stored, but the reader compared the member's suffix lowered with the field as it is, and
    called every such sample "rewritten after it was indexed"."""
    import fastio

    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.TXT").write_text("alpha")
    (tmp_path / "t.csv").write_text("path,label,Caption\nf/a.TXT,0,hello\n")
    convert(ConvertConfig(source=tmp_path / "t.csv", dest=tmp_path / "ds", workers=1, progress=False))
    fields = [f for f in fastio.Dataset(tmp_path / "ds").fields if f.lower() in ("caption", "txt")]
    with fastio.Loader(tmp_path / "ds", pipeline=fastio.Raw(fields=fields), batch_size=1, device="cpu") as ld:
        b = next(iter(ld))
    assert sorted(bytes(b[f][0]) for f in fields) == [b"alpha", b"hello"]


def test_a_table_mixing_images_video_and_audio_is_refused_when_the_loader_is_made(tmp_path):
    """Each row is kept with its own field; a clip Loader over a dataset whose samples are not all of its kind is
    refused when it is made (not at the first batch that meets such a sample, maybe hours into an epoch), in one
    line naming how many and the first (shard and key)."""
    import fastio

    files = tmp_path / "files"
    make_video(files / "a.webm", "libvpx-vp9", "webm", frames=9)
    make_audio(files / "b.flac", "flac", "flac", rate=16000)
    (files / "c.png").write_bytes(png_bytes())
    (tmp_path / "t.csv").write_text("path,label\nfiles/a.webm,0\nfiles/b.flac,1\nfiles/c.png,0\n")
    result = convert(ConvertConfig(source=tmp_path / "t.csv", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.samples == 3
    for pipe, what, first in ((uint8_clips(), "video", "files/b"), (fastio.AudioClips(seconds=0.1), "audio", "files/a")):
        with pytest.raises(fastio.DatasetError, match=rf"ds: 2 of 3 samples have no {what} field \(the first: "
                                                      rf"shard shard-000000.tar key '{first}'") as got:
            loader(tmp_path / "ds", pipe, batch_size=3, shuffle="none")
        assert "\n" not in str(got.value) and "fastio.Mixture" in str(got.value)


# -- Loader: sampling, crop and flip, layouts --------------------------------------------------------------------

def test_clip_starts_are_uniform_over_where_the_clip_fits():
    """A few hundred draws of a 20-frame video's clip of span 7: the 14 starts equally likely (chi-square), the
    first and the last among them."""
    from fastio.pipelines.augment import clip_starts

    across_samples = clip_starts(7, 2, np.arange(700), np.full(700, 20), 7)[:, 0]
    across_epochs = np.array([clip_starts(7, e, np.array([5]), np.array([20]), 7)[0, 0] for e in range(700)])
    several = clip_starts(7, 2, np.arange(350), np.full(350, 20), 7, clips=2).reshape(-1)
    for starts in (across_samples, across_epochs, several):
        counts = np.bincount(starts, minlength=14)
        assert len(counts) == 14 and counts[0] > 0 and counts[13] > 0
        chi2 = ((counts - 50) ** 2 / 50).sum()
        assert chi2 < 34.5  # 13 degrees of freedom, p = 0.001


def test_clip_starts_reach_the_last_position_through_the_loader(zoo_ds):
    """Over epochs each video's clips start anywhere from 0 to frames - span, the last included."""
    seen = {}
    with loader(zoo_ds, uint8_clips(frames=2, stride=1, crop="center"), batch_size=4) as ld:
        for epoch in range(40):
            ld.set_epoch(epoch)
            for b in ld:
                for i, s in zip(b["index"].tolist(), b["start_frame"].tolist()):
                    seen.setdefault(ld.key(i).split("/")[1], set()).add(s)
    assert seen["mjpegavi"] == set(range(7)) and seen["vp9mp4"] == set(range(8))


def stripes(k: int, width: int = 64, height: int = 48) -> np.ndarray:
    """The same picture in every frame: a bright left third, a dim band, a dark right part."""
    img = np.full((height, width, 3), 30, np.uint8)
    img[:, : width // 3] = 220
    img[:, width // 3: width // 2] = 120
    return img


@pytest.fixture(scope="module")
def stripes_ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stripes")
    for i in range(6):
        make_video(root / "src" / "c0" / f"s{i}.webm", "libvpx-vp9", "webm", frames=10, picture=stripes)
    dest = root / "ds"
    convert(ConvertConfig(source=root / "src", dest=dest, workers=1, progress=False))
    return dest


def test_random_crop_and_flip_are_the_same_on_every_frame_of_a_clip(stripes_ds):
    """Every frame of the video is one picture: a clip whose frames differ had a crop or flip of its own per
    frame; the crops differ between videos and some clips are flipped (the bright side on the right)."""
    flipped, crops = [], set()
    with loader(stripes_ds, uint8_clips(frames=4, stride=2, size=24, clips_per_video=2), batch_size=3) as ld:
        for _epoch in range(3):
            for b in ld:
                v = b["video"].float().numpy()  # [B, K, F, H, W, 3]
                assert np.abs(v - v[:, :1, :1]).max() <= 3  # every frame of both clips alike
                cols = v[:, 0, 0, :, :, 0].mean(axis=1)  # [B, W] column brightness
                flipped += (cols[:, -1] > cols[:, 0]).tolist()
                crops |= {tuple(np.rint(c / 10).astype(int)) for c in cols}
    assert any(flipped) and not all(flipped) and len(crops) > 3


def test_flip_false_never_flips_a_random_crop(stripes_ds):
    with loader(stripes_ds, uint8_clips(frames=2, size=24, flip=False), batch_size=3) as ld:
        for _epoch in range(3):
            for b in ld:
                cols = b["video"][:, 0, :, :, 0].float().mean(dim=1).numpy()
                assert (cols[:, 0] >= cols[:, -1]).all()  # the bright side stays on the left


def test_evaluation_is_the_center_crop_without_flip(stripes_ds):
    import fastio

    train = fastio.VideoClips(frames=2, size=24, dtype="uint8", layout="FHWC")
    ev = train.evaluation()
    assert ev.crop == "center"
    with loader(stripes_ds, ev, batch_size=6) as a, loader(stripes_ds, uint8_clips(frames=2, size=24, crop="center"),
                                                           batch_size=6) as c:
        x, y = next(iter(a))["video"], next(iter(c))["video"]
    assert (x == y).all()
    cols = x[:, 0, :, :, 0].float().mean(dim=1).numpy()
    assert (cols[:, 0] > cols[:, -1]).all()  # never flipped: bright on the left


def test_layouts_and_float_normalisation_agree_with_uint8(zoo_ds):
    import torch

    import fastio

    base = dict(frames=3, stride=2, size=16, crop="center")
    got = {}
    for layout in ("FHWC", "FCHW", "CFHW"):
        for dtype in ("uint8", "float32"):
            with loader(zoo_ds, fastio.VideoClips(layout=layout, dtype=dtype, **base), batch_size=4,
                        shuffle="none") as ld:
                got[layout, dtype] = next(iter(ld))["video"]
    ref = got["FHWC", "uint8"]
    assert ref.shape == (4, 3, 16, 16, 3)
    assert (got["FCHW", "uint8"] == ref.permute(0, 1, 4, 2, 3)).all()
    assert (got["CFHW", "uint8"] == ref.permute(0, 4, 1, 2, 3)).all()
    mean = torch.tensor(fastio.VideoClips().mean) * 255
    std = torch.tensor(fastio.VideoClips().std) * 255
    want = (ref.float() - mean) / std
    assert got["FHWC", "float32"].dtype == torch.float32
    assert (got["FHWC", "float32"] - want).abs().max() < 1.01 / (255 * 0.224)
    assert (got["FCHW", "float32"] == got["FHWC", "float32"].permute(0, 1, 4, 2, 3)).all()


def test_fields_len_drop_last_and_batches_not_dividing_the_dataset(zoo_ds):
    n = len(ZOO)  # 12
    with loader(zoo_ds, uint8_clips(fields=["cls", "probe.json"]), batch_size=5, drop_last=False) as ld:
        batches = list(ld)
        assert len(ld) == len(batches) == 3
    assert [len(b["index"]) for b in batches] == [5, 5, 5]
    real = [i for b in batches for i, p in zip(b["index"].tolist(), b["padded"].tolist()) if not p]
    assert sorted(real) == list(range(n))
    b = batches[0]
    assert {"label", "probe.json", "video", "start_frame"} <= set(b)
    assert all(json.loads(p)["kind"] == "video" for p in b["probe.json"])
    with loader(zoo_ds, uint8_clips(), batch_size=5, drop_last=True) as ld:
        assert len(ld) == len(list(ld)) == 2


@pytest.mark.parametrize("shuffle", ["none", "block"])
def test_several_clips_per_video_resume_exactly(zoo_ds, shuffle):
    from resume import check_resume

    check_resume(lambda: loader(zoo_ds, uint8_clips(clips_per_video=2), batch_size=2, shuffle=shuffle), n=2, k=3)


# -- option values -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    (dict(seconds=float("inf")), "seconds must be .*got inf"),
    (dict(seconds=float("nan")), "seconds must be .*got nan"),
    (dict(seconds=-0.5), r"seconds must be .*got -0.5"),
    (dict(sample_rate=0), "sample_rate must be an integer >= 1, got 0"),
    # a clip of 1.6e10 samples overflowed DALI's int32 slice shape: "fn.slice: shape value out of range ... Got:
    # -1.17987e+09", a DatasetError blaming the batch's keys
    (dict(seconds=1e6), r"^seconds \* sample_rate must be at most 268435456 samples \(a clip of 1 GiB of float32\), "
                        r"got 1000000.0 \* 16000 = 16000000000$"),
    (dict(seconds=20000, sample_rate=16000), r"^seconds \* sample_rate must be at most 268435456 samples"),
    (dict(seconds=1e308), r"^seconds \* sample_rate must be at most 268435456 samples .*= inf$"),  # OverflowError
    # n_fft=2**31 allocated 8 GiB (then n_mels times more) checking the mel bands: a bare numpy MemoryError, or the
    # process killed
    (dict(n_mels=40, n_fft=2**31), r"^n_fft must be at most 65536 \(4 s at 16 kHz\), got 2147483648$"),
    # hop=2**31 failed building the Loader's graph with DALI's bare RuntimeError "Invalid window step: -2147483648"
    (dict(n_mels=40, hop=2**31), r"^hop must be at most 268435456 samples \(a clip's largest length\), got "
                                 r"2147483648$"),
    (dict(n_mels=64, n_fft=64), r"n_mels=64 .*n_fft=64"),
    (dict(n_mels=128, n_fft=128, sample_rate=8000), r"n_mels=128 .*n_fft=128 at sample_rate=8000: \d+ mel bands"),
])
def test_audio_clip_options_name_the_bad_value(bad, match):
    import fastio

    with pytest.raises(ValueError, match=match):
        fastio.AudioClips(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(stride=-2), "stride must be an integer >= 1, got -2"),
    (dict(size=0), "size must be an integer >= 1, got 0"),
    (dict(clips_per_video=0), "clips_per_video must be an integer >= 1, got 0"),
    # frames=2**31 was accepted, and a Loader's first batch ran the machine out of memory: the process was killed
    (dict(frames=2**31), r"^frames \* clips_per_video \(the frames decoded per video\) must be at most 4096, got "
                         r"2147483648 \* 1: each is decoded at the video's own size first \(4096 frames of 640 x 360 are "
                         r"2.8 GB\)$"),
    (dict(frames=64, clips_per_video=100), r"^frames \* clips_per_video .* must be at most 4096, got 64 \* 100: "),
    (dict(flip="yes"), "flip must be True or False, got 'yes'"),
])
def test_video_clip_options_name_the_bad_value(bad, match):
    import fastio

    with pytest.raises(ValueError, match=match):
        fastio.VideoClips(**bad)


def test_usual_log_mel_settings_are_accepted():
    import fastio

    for rate, n_fft, n_mels in ((16000, 400, 80), (16000, 512, 128), (8000, 256, 40), (22050, 2048, 128)):
        fastio.AudioClips(sample_rate=rate, n_fft=n_fft, n_mels=n_mels)


def test_a_table_naming_a_missing_video_stops_in_one_line(tmp_path, capsys):
    """With --on-error fail; with --on-error skip (the default) the row is skipped and listed
    (test_convert_bad_sources.py)."""
    from helpers import run_cli

    make_video(tmp_path / "files" / "a.webm", "libvpx-vp9", "webm", frames=6)
    (tmp_path / "t.jsonl").write_text('{"path": "files/a.webm", "label": 0}\n{"path": "files/gone.webm", "label": 1}\n')
    code, out, err = run_cli(["convert", str(tmp_path / "t.jsonl"), str(tmp_path / "ds"), "--on-error", "fail"],
                             capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fastio: error:"), err
    assert "t.jsonl:2: path column 'path' names a missing file: files/gone.webm" in lines[0]
    assert "Traceback" not in out + err and not (tmp_path / "ds" / "manifest.json").exists()


def test_a_parquet_of_video_and_audio_bytes_names_each_field_by_its_type(tmp_path):
    """A Parquet table holding the files' bytes (Hugging Face's struct of ``bytes`` and ``path``, or plain
    binary): each column's field is named by the media type its bytes are, as an image column's is, so the
    clips load."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    import fastio

    videos = [make_video(tmp_path / "f" / f"v{i}.webm", "libvpx-vp9", "webm", frames=9 + i).read_bytes()
              for i in range(2)]
    sounds = [make_audio(tmp_path / "f" / f"a{i}.flac", "flac", "flac", rate=16000).read_bytes() for i in range(2)]
    pq.write_table(pa.table({"video": [{"bytes": v, "path": f"v{i}.webm"} for i, v in enumerate(videos)],
                             "label": [0, 1]}), tmp_path / "v.parquet")
    pq.write_table(pa.table({"audio": sounds, "label": [0, 1]}), tmp_path / "a.parquet")
    for table, field in (("v.parquet", "webm"), ("a.parquet", "flac")):
        result = convert(ConvertConfig(source=tmp_path / table, dest=tmp_path / table[0], workers=1, progress=False))
        assert result.samples == 2 and not result.skipped
        assert set(fastio.Dataset(tmp_path / table[0]).fields) == {"cls", "probe.json", field}
    with loader(tmp_path / "v", uint8_clips(frames=3, stride=3, crop="center"), batch_size=2) as ld:
        b = next(iter(ld))
    for j in range(2):
        start = int(b["start_frame"][j])
        assert frames_shown(b["video"])[j].tolist() == [start, start + 3, start + 6]
    with loader(tmp_path / "a", fastio.AudioClips(seconds=0.5), batch_size=2) as ld:
        assert next(iter(ld))["audio"].shape == (2, 8000)


# -- damage found at load time -----------------------------------------------------------------------------------

def write_media(dest: Path, field: str, files: dict[str, bytes], probes: dict[str, bytes]) -> Path:
    """A dataset as convert writes it, but of the bytes given (a file changed after its probe was taken)."""
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(dest) as writer:
        for key, data in files.items():
            writer.write({"__key__": key, field: data, "cls": b"0", PROBE_FIELD: probes[key]})
        writer.close(label_field="cls", label_map={"c": 0}, converted_from={"format": "test"}, skipped=[])
    return dest


@pytest.mark.parametrize("damage", ["cut", "garbage", "empty"])
def test_audio_damaged_after_convert_is_named_by_shard_and_key(tmp_path, damage):
    import fastio

    good = make_audio(tmp_path / "a.flac", "flac", "flac", rate=16000).read_bytes()
    bad = {"cut": good[: len(good) // 3], "garbage": good[:200] + bytes(len(good) - 200), "empty": b""}[damage]
    files = {"k0": good, "k1": bad, "k2": good}
    dest = write_media(tmp_path / "ds", "flac", files, {k: check_media(good, "flac") for k in files})
    with pytest.raises(fastio.DatasetError, match=r"shard shard-000000.tar key 'k1': field 'flac' failed to decode") \
            as got:
        with loader(dest, fastio.AudioClips(seconds=0.5), batch_size=3, shuffle="none") as ld:
            next(iter(ld))
    assert "\n" not in str(got.value)


def test_audio_dali_decodes_shorter_than_its_probe_is_named(tmp_path):
    """FFmpeg's own (experimental) Vorbis encoder writes files that PyAV probes in full but DALI's decoder stops
    reading after a few thousand samples: the clip's window then lies past what DALI decoded. The error names
    the file and says so, not only "DALI failed on a batch"."""
    import fastio

    data = make_audio(tmp_path / "v.ogg", "vorbis", "ogg", rate=44100, channels=2).read_bytes()
    good = VORBIS.read_bytes()
    files = {"k0": good, "k1": data}
    dest = write_media(tmp_path / "ds", "ogg", files, {k: check_media(v, "ogg") for k, v in files.items()})
    with pytest.raises(fastio.DatasetError, match=r"key 'k1': field 'ogg' failed to decode \(DALI's audio decoder "
                                                  r"reads \d+ of its \d+ samples"):
        with loader(dest, fastio.AudioClips(seconds=0.5), batch_size=2, shuffle="none", seed=0) as ld:
            for _ in ld:
                pass


def _ogg_crc(page: bytes) -> int:
    """An Ogg page's CRC-32 (polynomial 0x04c11db7, not reflected), of the page with its checksum field zero."""
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def opus_dali_cannot_open(tmp_path: Path) -> bytes:
    """An Ogg Opus file whose header's pre-skip (60000 samples) is past its sound: PyAV reads it (312 samples), DALI's
    decoder cannot open it ("SF_INFO struct incomplete")."""
    data = bytearray(make_audio(tmp_path / "a.opus", "libopus", "ogg", rate=48000, seconds=1.2).read_bytes())
    head = data.find(b"OpusHead")
    data[head + 10:head + 12] = (60000).to_bytes(2, "little")  # the pre-skip, on the first page
    end = 27 + data[26] + sum(data[27:27 + data[26]])
    data[22:26] = bytes(4)
    data[22:26] = _ogg_crc(bytes(data[:end])).to_bytes(4, "little")
    return bytes(data)


def test_audio_dali_cannot_open_though_pyav_reads_it_is_named(tmp_path):
    """An Ogg Opus file PyAV reads and DALI's decoder cannot open (:func:`opus_dali_cannot_open`). The error said
    "DALI failed on a batch with keys 'k0', 'k1'", naming no file: the check asked of each sample took a file DALI
    cannot open for one it reads in full."""
    import fastio

    good = make_audio(tmp_path / "b.flac", "flac", "flac", rate=16000).read_bytes()
    files = {"k0": good, "k1": opus_dali_cannot_open(tmp_path)}
    dest = write_media(tmp_path / "ds", "ogg", files, {k: check_media(v, "ogg") for k, v in files.items()})
    with pytest.raises(fastio.DatasetError, match=r"key 'k1': field 'ogg' failed to decode \(DALI's audio decoder "
                                                  r"cannot read it \(fn\.decoders\.audio: .*\); re-encode it "):
        with loader(dest, fastio.AudioClips(seconds=0.5), batch_size=2, shuffle="none", seed=0) as ld:
            next(iter(ld))


def test_verify_decode_reads_audio_with_dali_as_the_loader_does(tmp_path, capsys):
    """``verify --decode`` decoded audio with PyAV only: an Ogg Opus file DALI's decoder cannot open, and an Ogg
    Vorbis file of which it reads fewer samples than the probe counts, passed verify and then stopped the Loader.
    Now verify decodes each audio file with DALI's decoder too (the Loader's arguments) and names the shard and key."""
    from helpers import run_cli

    good = make_audio(tmp_path / "b.flac", "flac", "flac", rate=16000).read_bytes()
    short = make_audio(tmp_path / "v.ogg", "vorbis", "ogg", rate=44100, channels=2).read_bytes()
    files = {"k0": good, "k1": opus_dali_cannot_open(tmp_path), "k2": VORBIS.read_bytes(), "k3": short}
    dest = write_media(tmp_path / "ds", "ogg", files, {k: check_media(v, "ogg") for k, v in files.items()})
    code, out, err = run_cli(["verify", str(dest), "--decode"], capsys)
    lines = [line for line in (out + err).splitlines() if "shard-000000.tar" in line]
    assert code == 1, out + err
    assert len(lines) == 2, out + err
    assert lines[0].startswith("shard-000000.tar: k1: field ogg: DALI's audio decoder cannot read it (fn.decoders"
                               ".audio: "), lines
    assert lines[1].startswith("shard-000000.tar: k3: field ogg: DALI's audio decoder reads "), lines
    assert "Traceback" not in out + err


# -- ranks and elastic resume ------------------------------------------------------------------------------------

def test_elastic_resume_of_several_clips_and_of_audio_keeps_each_sample_once_with_its_clips(zoo_ds, sounds_ds):
    """2 ranks, then 3 from the 2-rank state (mid-epoch): every sample once in the epoch, with the clip starts a
    single-rank run of the same seed and epoch gives it."""
    from resume import run_ranks

    import fastio

    for dest, pipe, start in ((zoo_ds, uint8_clips(clips_per_video=2), "start_frame"),
                              (sounds_ds, fastio.AudioClips(sample_rate=8000, seconds=0.1), "start_sample")):
        def starts(batches, start=start):
            return [(int(i), tuple(np.atleast_1d(s.numpy()).tolist())) for b in batches
                    for i, s, p in zip(b["index"], b[start], b["padded"]) if not p]

        with loader(dest, pipe, batch_size=1) as ld:
            single = dict(starts(ld))
        before, states = run_ranks([loader(dest, pipe, batch_size=1, world_size=2, rank=r) for r in range(2)], n=2)
        after, _ = run_ranks([loader(dest, pipe, batch_size=1, world_size=3, rank=r, drop_last=False)
                              for r in range(3)], state=states[0])
        got = starts(b for step in before + after for b in step)
        assert sorted(i for i, _ in got) == list(range(len(single))), dest
        assert all(single[i] == s for i, s in got), dest


def test_index_of_audio_shards_with_json_delivers_the_json_beside_the_clips(tmp_path, capsys):
    """WebDataset shards of ``key.flac`` + ``key.json`` (no ``cls``): indexed, verified, and the clips come with
    each sample's json when ``fields`` asks for it."""
    import io
    import tarfile

    from helpers import run_cli

    import fastio

    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "speech-000000.tar", "w") as tar:
        for i in range(3):
            data = make_audio(tmp_path / f"a{i}.flac", "flac", "flac", rate=22050, pitch=440.0 * (i + 1)).read_bytes()
            for name, value in ((f"utt{i}.flac", data), (f"utt{i}.json", json.dumps({"text": f"u{i}"}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(value)
                tar.addfile(info, io.BytesIO(value))
    code, _, err = run_cli(["index", str(tmp_path / "wds"), "-q"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["verify", str(tmp_path / "wds")], capsys)
    assert code == 0, out + err
    with loader(tmp_path / "wds", fastio.AudioClips(seconds=0.25, fields=["json"]), batch_size=3,
                shuffle="none") as ld:
        b = next(iter(ld))
    assert b["audio"].shape == (3, 4000)
    for j in range(3):
        text = json.loads(b["json"][j])["text"]
        assert abs(tone_pitch(b["audio"][j].numpy(), 16000) - 440.0 * (int(text[1]) + 1)) < 25


def test_verify_and_inspect_of_converted_video_and_audio(zoo_ds, sounds_ds, capsys):
    from helpers import run_cli

    for dest in (zoo_ds, sounds_ds):
        code, out, err = run_cli(["verify", str(dest)], capsys)
        assert code == 0 and "verified" in out, out + err
    code, out, err = run_cli(["inspect", str(zoo_ds)], capsys)
    assert code == 0 and "vp9" in out and "mjpeg" in out and "vp8" in out, out + err
