"""``convert --video-decoder nvdec``: H.264 (and the other codecs only DALI's mixed decoder reads) kept as they are
for decoding on a GPU; the manifest's count of videos per codec; a CPU Loader refusing such a dataset when it is
made; parts + merge; the keyframe cut left to those codecs' decoder; a video whose first frame is not a
keyframe skipped. Media made here with PyAV (frame numbers in
the pixels); the clips by content on a GPU in the one ``gpu``-marked test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from test_media import write_wds_tar  # noqa: E402

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.errors import DatasetError  # noqa: E402
from fastio.formats.media import MediaCheckError, check_media, probe, trim_video  # noqa: E402


def make_ffv1(path: Path, frames: int = 6, encoder: str = "ffv1", size: tuple[int, int] = (64, 48),
              options: dict[str, str] | None = None) -> Path:
    """A video in a codec neither of DALI's decoders reads (FFV1 in Matroska), or of another ``encoder``; frame k
    a flat gray ``frame_level(k)`` as :func:`fastio.convert.synthetic.make_video` makes."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=12)
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if encoder == "mjpeg" else "yuv420p"
        stream.options = options or {}
        for k in range(frames):
            rgb = np.full((size[1], size[0], 3), synthetic.frame_level(k), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def h264_folder(tmp_path_factory) -> Path:
    """c0: two H.264 .mp4 (B-frames, a keyframe every 8 frames) and a VP9 .webm; c1: one H.264 .mp4 and an FFV1
    .mkv that neither decoder reads."""
    root = tmp_path_factory.mktemp("h264")
    synthetic.make_video(root / "c0" / "a.mp4", frames=20, fps=12, keyframe_every=8, bframes=2)
    synthetic.make_video(root / "c0" / "b.mp4", frames=28, fps=12, keyframe_every=8, bframes=2)
    synthetic.make_video(root / "c0" / "c.webm", frames=16, fps=12)
    synthetic.make_video(root / "c1" / "d.mp4", frames=36, fps=12, keyframe_every=8, bframes=2)
    make_ffv1(root / "c1" / "odd.mkv")
    return root


@pytest.fixture(scope="module")
def nvdec_ds(tmp_path_factory, h264_folder) -> Path:
    dest = tmp_path_factory.mktemp("nvds") / "ds"
    convert(ConvertConfig(source=h264_folder, dest=dest, workers=1, video_decoder="nvdec"))
    return dest


def clips_loader(dest, pipeline=None, **kw):
    import fastio

    pipeline = pipeline or fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC")
    opts = dict(batch_size=2, device="cpu", seed=3, num_threads=1, world_size=1, rank=0)
    return fastio.Loader(dest, pipeline=pipeline, **{**opts, **kw})


def test_check_media_keeps_what_the_chosen_decoder_reads(h264_folder):
    h264 = (h264_folder / "c0" / "a.mp4").read_bytes()
    info = json.loads(check_media(h264, "mp4", "nvdec"))
    assert (info["codec"], info["frames"], info["keyframes"]) == ("h264", 20, [0, 8, 16])
    assert json.loads(check_media(h264, "mp4")) == info  # the default (auto) keeps it too
    with pytest.raises(MediaCheckError, match=r"^video codec h264 is not read by DALI's CPU decoder .*: convert with "
                                              r"--transcode vp9 .* or leave out --video-decoder cpu"):
        check_media(h264, "mp4", "cpu")
    odd = (h264_folder / "c1" / "odd.mkv").read_bytes()
    for decoder in ("auto", "cpu", "nvdec"):
        with pytest.raises(MediaCheckError, match="^video codec ffv1 is not decoded by a Loader") as got:
            check_media(odd, "mkv", decoder)
        assert "--transcode vp9" in str(got.value) and "--video-decoder" not in str(got.value)


@pytest.mark.parametrize("encoder, suffix, codec", [("libx265", "mp4", "hevc"), ("mpeg4", "mp4", "mpeg4"),
                                                    ("libsvtav1", "mp4", "av1"), ("mjpeg", "avi", "mjpeg")])
def test_each_codec_nvdec_reads_is_probed_by_its_own_name(tmp_path, encoder, suffix, codec):
    """The probe names a codec as DALI's list does (PyAV opens AV1 with its libdav1d decoder: still ``av1``), so
    nvdec keeps each; the CPU path keeps only MJPEG of them."""
    import av

    try:
        data = make_ffv1(tmp_path / f"v.{suffix}", encoder=encoder).read_bytes()
    except (av.FFmpegError, ValueError) as err:  # an encoder this PyAV build lacks
        pytest.skip(f"{encoder}: {err}")
    info = json.loads(check_media(data, suffix, "nvdec"))
    assert (info["codec"], info["frames"]) == (codec, 6)
    assert json.loads(check_media(data, suffix)) == info  # the default (auto) keeps each
    if codec == "mjpeg":
        assert json.loads(check_media(data, suffix, "cpu")) == info
    else:
        with pytest.raises(MediaCheckError, match=f"^video codec {codec} is not read by DALI's CPU decoder"):
            check_media(data, suffix, "cpu")


def test_convert_with_nvdec_keeps_h264_as_it_is_and_counts_codecs(nvdec_ds, h264_folder):
    import fastio

    ds = fastio.Dataset(nvdec_ds)
    m = ds.manifest
    assert set(m.fields) == {"cls", "mp4", "probe.json", "webm"} and m.total_samples == 4
    assert [s["path"] for s in m.skipped] == ["c1/odd.mkv"]
    assert m.skipped[0]["reason"].startswith("video codec ffv1 is not decoded by a Loader")
    assert m.convert_options["video_decoder"] == "nvdec" and "transcode" not in m.convert_options
    keys = [ds.key(i) for i in range(4)]
    assert keys == ["c0/a", "c0/b", "c0/c", "c1/d"]
    assert m.video_codecs == {"h264": {"count": 3, "first": 0}, "vp9": {"count": 1, "first": 2}}
    # the stored bytes are the files' own, their probes the probe of those bytes
    import tarfile

    with tarfile.open(nvdec_ds / "shards" / "shard-000000.tar") as tar:
        stored = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert stored["c0/a.mp4"] == (h264_folder / "c0" / "a.mp4").read_bytes()
    assert json.loads(stored["c1/d.probe.json"]) == probe(stored["c1/d.mp4"], "mp4")


def test_convert_on_the_cpu_path_still_skips_h264_and_counts_vp9(tmp_path, h264_folder):
    result = convert(ConvertConfig(source=h264_folder, dest=tmp_path / "ds", workers=1, video_decoder="cpu"))
    m = result.manifests[""]
    assert sorted(s["path"] for s in result.skipped) == ["c0/a.mp4", "c0/b.mp4", "c1/d.mp4", "c1/odd.mkv"]
    assert m.convert_options["video_decoder"] == "cpu" and m.video_codecs == {"vp9": {"count": 1, "first": 0}}
    with clips_loader(tmp_path / "ds", batch_size=1) as loader:
        assert next(iter(loader))["video"].shape == (1, 4, 24, 24, 3)


def test_nvdec_with_transcode_reencodes_only_what_nvdec_cannot_read(tmp_path, h264_folder):
    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                          transcode="vp9"))
    import fastio

    m = fastio.Dataset(tmp_path / "ds").manifest
    assert m.skipped == [] and m.convert_options["transcode"] == "vp9"
    assert m.video_codecs == {"h264": {"count": 3, "first": 0}, "vp9": {"count": 2, "first": 2}}
    assert set(m.fields) == {"cls", "mp4", "probe.json", "webm"}  # odd.mkv became c1/odd.webm; the mp4s stay


def test_a_cpu_loader_without_cpu_fallback_refuses_h264_when_it_is_made(nvdec_ds, tmp_path):
    import shutil

    import fastio

    clips = fastio.VideoClips(frames=4, stride=2, size=24, cpu_fallback=None)

    expected = (f"{nvdec_ds}: holds 3 videos in codec h264, which DALI's CPU decoder does not read (the first: "
                "shard shard-000000.tar key 'c0/a'): decode them on a GPU with device='cuda' (NVDEC), decode them on the "
                "CPU with PyAV with VideoClips(cpu_fallback='pyav'), or convert the files with --transcode vp9 "
                "(transcode='vp9')")
    import torch

    for device in ("cpu",) + (() if torch.cuda.is_available() else ("auto",)):  # auto: the CPU where no GPU is
        with pytest.raises(DatasetError) as got:
            clips_loader(nvdec_ds, clips, device=device)  # made, never iterated
        assert str(got.value) == expected
    also = shutil.copytree(nvdec_ds, tmp_path / "also")  # one place twice is refused; a copy mixes
    mix = fastio.Mixture({"gpu": str(nvdec_ds), "also": str(also)})
    with pytest.raises(DatasetError) as got:
        clips_loader(mix, clips)
    assert str(got.value) == expected


def test_the_first_non_cpu_video_is_named_by_its_shard(tmp_path, h264_folder):
    """The count's first sample is dataset-wide: in a later shard it is named with that shard."""
    import fastio

    src = tmp_path / "src"
    synthetic.make_video(src / "c0" / "a.webm", frames=8, fps=12)
    synthetic.make_video(src / "c0" / "b.webm", frames=8, fps=12)
    (src / "c0" / "c.mp4").write_bytes((h264_folder / "c0" / "a.mp4").read_bytes())
    convert(ConvertConfig(source=src, dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                          max_samples_per_shard=2))
    with pytest.raises(DatasetError, match=r"holds 1 video in codec h264, .* \(the first: shard shard-000001.tar "
                                           r"key 'c0/c'\)"):
        clips_loader(tmp_path / "ds", fastio.VideoClips(frames=4, size=24, cpu_fallback=None))


def test_cli_video_decoder(tmp_path, h264_folder, capsys):
    from helpers import run_cli

    code, out, err = run_cli(["convert", str(h264_folder), str(tmp_path / "ds"), "--video-decoder", "nvdec",
                              "--workers", "2", "-q"], capsys)  # the option reaches the worker processes
    assert code == 0, err
    import fastio

    assert fastio.Dataset(tmp_path / "ds").manifest.convert_options["video_decoder"] == "nvdec"
    code, out, err = run_cli(["convert", str(h264_folder), str(tmp_path / "ds2"), "--video-decoder", "gpu"], capsys)
    assert code == 2 and err == "fastio: error: --video-decoder must be one of auto, cpu, nvdec, got 'gpu'\n"
    assert not (tmp_path / "ds2").exists()
    code, out, err = run_cli(["inspect", str(tmp_path / "ds")], capsys)
    assert code == 0 and "videos:   h264 3 (NVDEC on a GPU, PyAV on a CPU), vp9 1\n" in out
    code, out, err = run_cli(["convert", "--help"], capsys)
    assert "--video-decoder" in out and "nvdec" in out
    with pytest.raises(ValueError, match="video_decoder must be one of auto, cpu, nvdec, got 'cuda'"):
        ConvertConfig(source=h264_folder, dest=tmp_path / "x", video_decoder="cuda")


def test_parts_then_merge_give_the_whole_conversion(tmp_path, h264_folder, nvdec_ds, capsys):
    from helpers import run_cli

    import fastio

    for k in range(2):
        convert(ConvertConfig(source=h264_folder, dest=tmp_path / "parted", workers=1, video_decoder="nvdec",
                              max_samples_per_shard=1, part=(k, 2)))
    assert run_cli(["merge", str(tmp_path / "parted"), "-q"], capsys)[0] == 0
    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "one", workers=1, video_decoder="nvdec",
                          max_samples_per_shard=1))
    merged, one = fastio.Dataset(tmp_path / "parted").manifest, fastio.Dataset(tmp_path / "one").manifest
    assert merged.video_codecs == one.video_codecs == {"h264": {"count": 3, "first": 0},
                                                       "vp9": {"count": 1, "first": 2}}
    assert merged.convert_options == one.convert_options and merged.shards == one.shards
    # a part made for the other decoder is named by the merge
    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "mixed", workers=1, video_decoder="nvdec",
                          max_samples_per_shard=1, part=(0, 2)))
    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "mixed", workers=1, max_samples_per_shard=1,
                          part=(1, 2)))
    code, out, err = run_cli(["merge", str(tmp_path / "mixed"), "-q"], capsys)
    assert code == 2 and "part-1-of-2: video_decoder None (part 0: 'nvdec')" in err and err.count("\n") == 1


def test_each_split_counts_its_own_videos(tmp_path, h264_folder):
    """With a split, each split's manifest counts its videos and names its own first sample of each codec."""
    import fastio

    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "ds", workers=1, video_decoder="nvdec",
                          split="val=0.5", split_by="random", seed=1))
    codec_of = {"c0/a": "h264", "c0/b": "h264", "c0/c": "vp9", "c1/d": "h264"}
    seen = []
    for split in ("train", "val"):
        ds = fastio.Dataset(tmp_path / "ds" / split)
        codecs = [codec_of[ds.key(i)] for i in range(len(ds))]
        seen += codecs
        assert ds.manifest.video_codecs == {c: {"count": codecs.count(c), "first": codecs.index(c)}
                                            for c in set(codecs)}
    assert sorted(seen) == ["h264", "h264", "h264", "vp9"]


def test_a_manifest_without_the_codec_count_still_loads(tmp_path, h264_folder):
    """Manifests written before the count: a dataset of VP9 reads on the CPU as before; a bad count is named."""
    import fastio

    convert(ConvertConfig(source=h264_folder, dest=tmp_path / "ds", workers=1, video_decoder="cpu"))
    path = tmp_path / "ds" / "manifest.json"
    data = json.loads(path.read_text())
    del data["video_codecs"]
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    assert fastio.Dataset(tmp_path / "ds").manifest.video_codecs is None
    with clips_loader(tmp_path / "ds", batch_size=1) as loader:
        assert next(iter(loader))["video"].shape == (1, 4, 24, 24, 3)
    data["video_codecs"] = {"vp9": {"count": 2, "first": 0}}  # more videos than samples
    path.write_text(json.dumps(data))
    with pytest.raises(DatasetError, match=r"manifest.json: video_codecs: .* is not an object of codec to "
                                           r"\{count, first\} within the samples"):
        fastio.Dataset(tmp_path / "ds")


def test_h264_is_not_cut_at_a_keyframe(h264_folder):
    """Cutting H.264 with B-frames at the keyframe before a clip keeps packets in decode order up to the clip's
    last frame, which are not its frames (frame 10 missing, 11 in its place): the clip pipeline hands such videos
    whole to the decoder, while VP9 is still cut."""
    import av

    import fastio

    data = (h264_folder / "c0" / "a.mp4").read_bytes()
    cut, k = trim_video(data, 9, 10, [0, 8, 16])
    with av.open(__import__("io").BytesIO(cut)) as c:
        shown = synthetic.frame_of_level([f.to_ndarray(format="rgb24").mean() for f in c.decode(video=0)])
    assert k == 8 and shown.tolist() == [8, 9, 11]  # why: not frames 8..10
    pipe = fastio.VideoClips(frames=2, stride=1, size=16)
    encoded = [np.frombuffer(data, np.uint8)]
    out, decode = pipe._trimmed(encoded, [probe(data, "mp4")], np.array([[9]], np.int32))
    assert out[0][0] is encoded[0] and decode.tolist() == [[9]]
    vp9 = synthetic.make_video(h264_folder.parent / "cut" / "v.webm", frames=24, keyframe_every=8).read_bytes()
    out, decode = pipe._trimmed([np.frombuffer(vp9, np.uint8)], [probe(vp9, "webm")], np.array([[17]], np.int32))
    assert decode.tolist() == [[1]] and len(out[0][0]) < len(vp9)


@pytest.fixture(scope="module")
def h264_tars(tmp_path_factory, h264_folder) -> Path:
    """Two existing shards: a VP9 and an H.264 video in the first, two H.264 videos in the second."""
    root = tmp_path_factory.mktemp("wds")
    files = {"k0.webm": "c0/c.webm", "k1.mp4": "c0/a.mp4", "k2.mp4": "c0/b.mp4", "k3.mp4": "c1/d.mp4"}
    for s, keys in enumerate((("k0.webm", "k1.mp4"), ("k2.mp4", "k3.mp4"))):
        members = {}
        for name in keys:
            members[name] = (h264_folder / files[name]).read_bytes()
            members[name.split(".")[0] + ".cls"] = str(s).encode()
        write_wds_tar(root / f"v-00000{s}.tar", members)
    return root


def test_index_with_nvdec_probes_h264_and_a_cpu_loader_refuses_it(tmp_path, h264_folder, h264_tars, capsys):
    from helpers import run_cli

    import fastio

    code, out, err = run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "cpu"), "--video-decoder", "cpu",
                              "-q"], capsys)
    assert code == 0, err
    cpu = fastio.Dataset(tmp_path / "cpu").manifest
    assert [s["path"].rsplit("/", 1)[1] for s in cpu.skipped] == ["v-000000.tar:k1.mp4", "v-000001.tar:k2.mp4",
                                                                    "v-000001.tar:k3.mp4"]
    assert cpu.skipped[0]["reason"].startswith("not probed (kept in the shard): video codec h264 is not read by "
                                               "DALI's CPU decoder") and "--video-decoder cpu" in cpu.skipped[0]["reason"]
    assert cpu.video_codecs == {"vp9": {"count": 1, "first": 0}}
    code, out, err = run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "gpu"), "--video-decoder", "nvdec",
                              "-q"], capsys)
    assert code == 0, err
    ds = fastio.Dataset(tmp_path / "gpu")
    assert ds.manifest.skipped == []
    assert ds.manifest.video_codecs == {"h264": {"count": 3, "first": 1}, "vp9": {"count": 1, "first": 0}}
    assert json.loads(ds.probes.probe(3, "mp4")) == probe((h264_folder / "c1" / "d.mp4").read_bytes(), "mp4")
    with pytest.raises(DatasetError) as got:
        clips_loader(tmp_path / "gpu", fastio.VideoClips(frames=4, size=24, cpu_fallback=None))
    assert str(got.value) == (f"{tmp_path / 'gpu'}: holds 3 videos in codec h264, which DALI's CPU decoder does not "
                              "read (the first: shard v-000000.tar key 'k1'): decode them on a GPU with "
                              "device='cuda' (NVDEC), decode them on the CPU with PyAV with "
                              "VideoClips(cpu_fallback='pyav'), or convert the files with --transcode vp9 "
                              "(transcode='vp9')")
    code, out, err = run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "x"), "--video-decoder", "gpu"],
                             capsys)
    assert code == 2 and err == "fastio: error: --video-decoder: must be one of auto, cpu, nvdec, got 'gpu'\n"


def test_index_in_parts_with_nvdec_then_merge(tmp_path, h264_tars, capsys):
    from helpers import run_cli

    import fastio

    for k in range(2):
        assert run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "parted"), "--part", f"{k}/2",
                        "--video-decoder", "nvdec", "-q"], capsys)[0] == 0
    assert run_cli(["merge", str(tmp_path / "parted"), "-q"], capsys)[0] == 0
    assert fastio.Dataset(tmp_path / "parted").manifest.video_codecs == {"h264": {"count": 3, "first": 1},
                                                                         "vp9": {"count": 1, "first": 0}}
    assert run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "mixed"), "--part", "0/2", "--video-decoder",
                    "nvdec", "-q"], capsys)[0] == 0
    assert run_cli(["index", str(h264_tars), "--dest", str(tmp_path / "mixed"), "--part", "1/2", "-q"],
                   capsys)[0] == 0
    code, out, err = run_cli(["merge", str(tmp_path / "mixed"), "-q"], capsys)
    assert code == 2 and "part-1-of-2: options" in err


def test_hevc_keyframes_in_decode_order_are_not_display_frames(tmp_path):
    """x265 with B-frames and a keyframe every 8 frames: the keyframe shown as frame 8 is the 8th packet (position
    7): the probe's ``keyframes`` count packets, so a cut at them would be wrong for HEVC; it is not cut."""
    path = make_ffv1(tmp_path / "v.mp4", 20, "libx265", options=X265)
    info = probe(path.read_bytes(), "mp4")
    assert info["codec"] == "hevc" and info["keyframes"] == [0, 7, 15]


X265 = {"crf": "4", "preset": "ultrafast", "x265-params": "keyint=8:min-keyint=8:bframes=2:b-adapt=0:log-level=error"}


@pytest.fixture(scope="module")
def gpu_ds(tmp_path_factory) -> Path:
    """H.264 and HEVC with B-frames and a keyframe every 8 frames, and VP9, at 160 x 144 (NVDEC has minimum frame
    sizes per codec), converted for NVDEC."""
    root = tmp_path_factory.mktemp("gpu")
    synthetic.make_video(root / "src" / "c0" / "a.mp4", frames=40, fps=12, width=160, height=144, keyframe_every=8,
                         bframes=2)
    synthetic.make_video(root / "src" / "c0" / "b.webm", frames=32, fps=12, width=160, height=144, keyframe_every=8)
    make_ffv1(root / "src" / "c1" / "c.mp4", 36, "libx265", size=(160, 144), options=X265)
    synthetic.make_video(root / "src" / "c1" / "d.mp4", frames=24, fps=12, width=160, height=144, bframes=2)
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, video_decoder="nvdec"))
    return root / "ds"


def test_the_gpu_dataset_holds_what_the_gpu_test_reads(gpu_ds):
    """What the gpu test below decodes, checked here: H.264 and HEVC kept, nothing skipped, each stored video's
    frames (decoded with PyAV) showing their numbers."""
    import io
    import tarfile

    import av

    import fastio

    m = fastio.Dataset(gpu_ds).manifest
    assert m.skipped == [] and m.video_codecs == {"h264": {"count": 2, "first": 0}, "hevc": {"count": 1, "first": 2},
                                                  "vp9": {"count": 1, "first": 1}}
    with tarfile.open(gpu_ds / "shards" / "shard-000000.tar") as tar:
        videos = {t.name: tar.extractfile(t).read() for t in tar.getmembers() if t.name.endswith((".mp4", ".webm"))}
    assert len(videos) == 4
    for name, data in videos.items():
        with av.open(io.BytesIO(data)) as c:
            levels = [f.to_ndarray(format="rgb24").mean() for f in c.decode(video=0)]
        assert synthetic.frame_of_level(levels).tolist() == list(range(probe(data, name)["frames"])), name


@pytest.mark.gpu
def test_h264_and_hevc_clips_on_cuda_hold_the_frames_their_start_says(gpu_ds):
    """device='cuda': fn.decoders.video on the mixed backend (NVDEC) decodes the kept H.264 and HEVC (B-frames,
    keyframes every 8 frames, whole files: no keyframe cut) and the VP9 beside them (cut): every clip shows the
    frames its start_frame says, by content, two clips per video included."""
    import fastio

    for pipe in (fastio.VideoClips(frames=4, stride=3, size=24, dtype="uint8", layout="FHWC", crop="center"),
                 fastio.VideoClips(frames=3, stride=2, size=16, dtype="uint8", layout="FHWC", clips_per_video=2)):
        seen, late = 0, 0
        with clips_loader(gpu_ds, pipe, device="cuda", batch_size=2) as loader:
            for _epoch in range(3):
                for b in loader:
                    assert b["video"].is_cuda
                    video, starts = b["video"].cpu(), b["start_frame"].cpu()
                    if pipe.clips_per_video == 1:
                        video, starts = video[:, None], starts[:, None]
                    for j in range(video.shape[0]):
                        for c in range(video.shape[1]):
                            shown = synthetic.frame_of_level(video[j, c].float().mean(dim=(1, 2, 3)).numpy())
                            start = int(starts[j, c])
                            assert shown.tolist() == [start + pipe.stride * f for f in range(pipe.frames)]
                            seen, late = seen + 1, late + (start > 8)  # past the second keyframe
        assert seen >= 12 and late >= 1


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
