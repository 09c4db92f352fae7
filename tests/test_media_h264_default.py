"""H.264 ``.mp4``, the common video dataset, on a machine without a GPU or an ffmpeg binary: ``fastio convert``
keeps it with no flag, a CPU Loader decodes it (DALI's CPU decoder where it reads the codec, PyAV for the rest,
said once), a skipped file's reason is said once per reason with a count, ``fastio inspect`` says how each codec
is decoded, ``--transcode vp9`` is the first remedy and needs no ffmpeg binary, and ``fastio verify --decode``
decodes each video and audio file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("av")

from helpers import run_cli  # noqa: E402
from test_media_nvdec import make_ffv1  # noqa: E402

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.errors import DatasetError  # noqa: E402
from fastio.formats.media import MediaCheckError, check_media  # noqa: E402


@pytest.fixture(scope="module")
def mp4_folder(tmp_path_factory) -> Path:
    """c0: two H.264 .mp4 (B-frames) and a VP9 .webm; c1: one H.264 .mp4 and three FFV1 .mkv no decoder reads."""
    root = tmp_path_factory.mktemp("mp4")
    synthetic.make_video(root / "c0" / "a.mp4", frames=12, fps=12, keyframe_every=8, bframes=2)
    synthetic.make_video(root / "c0" / "b.mp4", frames=16, fps=12, keyframe_every=8, bframes=2)
    synthetic.make_video(root / "c0" / "c.webm", frames=12, fps=12)
    synthetic.make_video(root / "c1" / "d.mp4", frames=12, fps=12, keyframe_every=8, bframes=2)
    for name in ("x", "y", "z"):
        make_ffv1(root / "c1" / f"{name}.mkv")
    return root


@pytest.fixture(scope="module")
def mp4_ds(mp4_folder, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("mp4ds") / "ds"
    convert(ConvertConfig(source=mp4_folder, dest=dest, workers=1, progress=False))
    return dest


def clips(**kw):
    import fastio

    return fastio.VideoClips(frames=4, stride=2, size=24, dtype="uint8", layout="FHWC", **kw)


def test_convert_keeps_h264_mp4_with_no_flag(mp4_ds):
    import fastio

    m = fastio.Dataset(mp4_ds).manifest
    assert m.total_samples == 4 and m.video_codecs == {"h264": {"count": 3, "first": 0}, "vp9": {"count": 1, "first": 2}}
    assert sorted(s["path"] for s in m.skipped) == ["c1/x.mkv", "c1/y.mkv", "c1/z.mkv"]
    assert "video_decoder" not in m.convert_options  # the default is not written


def test_a_cpu_loader_decodes_h264_with_pyav_by_itself_and_says_so_once(mp4_ds, caplog):
    import fastio

    caplog.set_level(logging.INFO, logger="fastio")
    for _ in range(2):
        with fastio.Loader(mp4_ds, pipeline=clips(), batch_size=4, device="cpu", seed=1, num_threads=1,
                           shuffle="none") as loader:
            batch = next(iter(loader))
            assert batch["video"].shape == (4, 4, 24, 24, 3)
    said = [r.getMessage() for r in caplog.records if "PyAV" in r.getMessage()]
    assert said == [f"{mp4_ds}: 3 videos in codec h264 are decoded on the CPU with PyAV (DALI's CPU decoder does "
                    "not read h264; a Loader on a GPU decodes them with NVDEC)"], said


def test_cpu_fallback_none_still_refuses_and_auto_is_the_default(mp4_ds):
    import fastio

    assert fastio.VideoClips().cpu_fallback == "auto"
    with pytest.raises(DatasetError, match=r"holds 3 videos in codec h264, which DALI's CPU decoder does not read"):
        fastio.Loader(mp4_ds, pipeline=clips(cpu_fallback=None), batch_size=2, device="cpu")
    with pytest.raises(ValueError, match="cpu_fallback must be None or one of auto, pyav, got 'ffmpeg'"):
        fastio.VideoClips(cpu_fallback="ffmpeg")
    fastio.VideoClips(cpu_fallback="auto").check_device(None, "cuda")  # auto on a GPU: NVDEC, nothing refused


def test_video_decoder_cpu_still_skips_h264(mp4_folder, tmp_path):
    result = convert(ConvertConfig(source=mp4_folder, dest=tmp_path / "ds", workers=1, video_decoder="cpu"))
    assert sorted(s["path"] for s in result.skipped) == ["c0/a.mp4", "c0/b.mp4", "c1/d.mp4", "c1/x.mkv", "c1/y.mkv",
                                                        "c1/z.mkv"]
    assert result.manifests[""].convert_options["video_decoder"] == "cpu"


def test_a_skipped_reason_is_said_once_with_its_count(mp4_folder, tmp_path, capsys):
    dest = tmp_path / "ds"
    code, out, err = run_cli(["convert", str(mp4_folder), str(dest)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert "skipped 3" in lines[0] and len(lines) == 2, out
    assert lines[1].startswith("  3 inputs (c1/x.mkv, c1/y.mkv, c1/z.mkv): video codec ffv1 is not decoded by a "
                               "Loader")
    code, out, err = run_cli(["inspect", str(dest)], capsys)
    assert code == 0 and out.count("video codec ffv1") == 1, out
    assert "videos:   h264 3 (NVDEC on a GPU, PyAV on a CPU), vp9 1\n" in out


def test_the_first_remedy_is_transcode_which_needs_no_ffmpeg_binary(mp4_folder, tmp_path, capsys, monkeypatch):
    with pytest.raises(MediaCheckError) as got:
        check_media((mp4_folder / "c1" / "x.mkv").read_bytes(), "mkv")
    reason = str(got.value)
    assert reason.index("--transcode vp9") < reason.index("ffmpeg -i"), reason
    assert len(reason) < 250, reason
    monkeypatch.setenv("PATH", str(tmp_path))  # no ffmpeg binary to be found
    code, out, err = run_cli(["convert", str(mp4_folder), str(tmp_path / "ds"), "--transcode", "vp9", "-q"], capsys)
    assert code == 0, err
    import fastio

    m = fastio.Dataset(tmp_path / "ds").manifest
    assert m.skipped == [] and m.video_codecs == {"h264": {"count": 3, "first": 0}, "vp9": {"count": 4, "first": 2}}


def test_verify_decode_decodes_videos_and_audio(mp4_ds, tmp_path, capsys):
    code, out, err = run_cli(["verify", str(mp4_ds), "--decode"], capsys)
    assert code == 0, err
    assert out.strip() == f"ok: {mp4_ds}: 1 shard, 4 samples verified, 0 images and 4 videos (a clip each) decoded"
    synthetic.make_audio(tmp_path / "a" / "c0" / "t.flac", seconds=0.5)
    convert(ConvertConfig(source=tmp_path / "a", dest=tmp_path / "ads", workers=1, progress=False))
    code, out, err = run_cli(["verify", str(tmp_path / "ads"), "--decode"], capsys)
    assert code == 0 and out.strip().endswith(" 1 sample verified, 0 images and 1 audio file decoded"), out


def test_verify_decode_names_a_video_that_does_not_decode(tmp_path, capsys):
    """A video PyAV probes (demuxes) but cannot decode: kept at convert, named by verify --decode."""
    from test_media_fallback import garbage_h264

    (tmp_path / "src" / "c0").mkdir(parents=True)
    (tmp_path / "src" / "c0" / "bad.mp4").write_bytes(garbage_h264(tmp_path))
    synthetic.make_video(tmp_path / "src" / "c0" / "fine.mp4", frames=12, fps=12)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    code, out, err = run_cli(["verify", str(tmp_path / "ds"), "--decode"], capsys)
    assert code == 1 and "shard-000000.tar: c0/bad: field mp4: cannot be decoded by PyAV" in out + err, out + err
