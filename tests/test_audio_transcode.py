"""Audio DALI's audio decoder does not read (MP3, AAC, ALAC, ...): stored decoded by PyAV as FLAC by default (no flag,
no ffmpeg binary needed; said once in convert's summary with a count), its sound where PyAV's decode of the original
puts it; ``--transcode none`` skips such files naming ``--transcode flac``, as before."""

from __future__ import annotations

import json

import numpy as np
import pytest

av = pytest.importorskip("av")

from audio_onsets import check_onsets, clip_onsets, encode  # noqa: E402

from fastio.convert.run import ConvertConfig, convert  # noqa: E402
from fastio.formats.media import MediaCheckError, transcode_flac  # noqa: E402


@pytest.fixture()
def lossy_folder(tmp_path):
    """An MP3 (LAME: encoder delay and padding in its header) and ALAC in MP4 named .flac, each a tone from 0.5 s."""
    (tmp_path / "src" / "c0").mkdir(parents=True)
    encode(tmp_path / "src" / "c0" / "mp3.mp3", "mp3", "libmp3lame", "fltp", 16000)
    encode(tmp_path / "src" / "c0" / "alac.flac", "ipod", "alac", "fltp", 22050)
    return tmp_path / "src"


def test_mp3_and_alac_are_stored_as_flac_by_default_and_said_once(lossy_folder, tmp_path, capsys):
    """No flag: the MP3 and the ALAC become FLAC, the convert summary says so in one clause with a count per codec,
    the probes name what each was transcoded from, and the default is not recorded in the manifest."""
    from helpers import run_cli

    import fastio

    encode(lossy_folder / "c0" / "pcm.wav", "wav", "pcm_s16le", "s16", 16000)
    code, out, err = run_cli(["convert", str(lossy_folder), str(tmp_path / "ds"), "--workers", "1"], capsys)
    assert code == 0, err
    assert "skipped 0" in out and out.count("transcoded") == 1, out
    assert ("; transcoded 2 audio files DALI's audio decoder does not read into FLAC with PyAV (alac 1, mp3float 1; "
            "--transcode none skips them)") in out, out
    ds = fastio.Dataset(tmp_path / "ds")
    assert len(ds) == 3 and set(ds.fields) == {"cls", "flac", "probe.json", "wav"}
    assert "transcode" not in ds.manifest.convert_options
    with fastio.Loader(tmp_path / "ds", pipeline=fastio.Raw(fields=["probe.json"]), batch_size=3, device="cpu",
                       shuffle="none") as loader:
        probes = [json.loads(p) for p in next(iter(loader))["probe.json"]]
    assert sorted((p["codec"], p.get("transcoded_from")) for p in probes) == [
        ("flac", "alac"), ("flac", "mp3float"), ("pcm_s16le", None)]


def test_transcode_none_skips_them_naming_transcode_flac(lossy_folder, tmp_path):
    import fastio

    encode(lossy_folder / "c0" / "pcm.wav", "wav", "pcm_s16le", "s16", 16000)
    result = convert(ConvertConfig(source=lossy_folder, dest=tmp_path / "ds", workers=1, progress=False,
                                   transcode="none"))
    reasons = {s["path"]: s["reason"] for s in result.skipped}
    assert set(reasons) == {"c0/mp3.mp3", "c0/alac.flac"} and result.samples == 1
    assert all("--transcode flac (transcode='flac')" in r for r in reasons.values()), reasons
    assert "transcoded" not in result.summary()
    assert fastio.Dataset(tmp_path / "ds").manifest.convert_options["transcode"] == "none"


def test_by_default_they_are_stored_as_flac_with_their_onset(lossy_folder, tmp_path):
    import fastio

    got = clip_onsets(lossy_folder, tmp_path / "ds")  # no transcode option: the default
    assert set(got) == {"mp3", "alac"}
    check_onsets(got, lossy_folder / "c0")  # against PyAV's decode of the MP3 and ALAC files themselves
    ds = fastio.Dataset(tmp_path / "ds")
    assert set(ds.fields) == {"cls", "flac", "probe.json"}
    with fastio.Loader(tmp_path / "ds", pipeline=fastio.Raw(fields=["probe.json"]), batch_size=2, device="cpu",
                       shuffle="none") as loader:
        probes = [json.loads(p) for p in next(iter(loader))["probe.json"]]
    assert sorted((p["codec"], p["rate"]) for p in probes) == [("flac", 16000), ("flac", 22050)]


def test_transcode_flac_keeps_the_decoded_samples(lossy_folder):
    """FLAC holds PyAV's decode of the MP3 to 16 bits: the same number of samples, each within 1/32767."""
    data = (lossy_folder / "c0" / "mp3.mp3").read_bytes()

    def decoded(blob: bytes) -> np.ndarray:
        import io

        with av.open(io.BytesIO(blob)) as c:
            frames = list(c.decode(audio=0))
        wave = np.concatenate([f.to_ndarray().astype(np.float64).reshape(-1) for f in frames])
        return wave / 32768 if frames[0].format.name.startswith("s16") else wave

    mp3, flac = decoded(data), decoded(transcode_flac(data))
    assert len(flac) == len(mp3) and np.abs(flac - mp3).max() < 2 / 32767
    with pytest.raises(MediaCheckError, match="cannot be transcoded to FLAC"):
        transcode_flac(b"ID3 not an mp3 at all")


@pytest.mark.parametrize("value, recorded", [("flac", "flac"), ("vp9", "vp9"), ("flac,vp9", "vp9,flac"),
                                             ("VP9, FLAC", "vp9,flac"), ("none", "none"), (None, "flac")])
def test_transcode_takes_vp9_flac_both_or_none(tmp_path, value, recorded):
    assert ConvertConfig(source=tmp_path, dest=tmp_path / "ds", transcode=value).transcode == recorded


def test_an_unknown_transcode_is_refused_by_name(tmp_path, capsys):
    from helpers import run_cli

    with pytest.raises(ValueError, match=r"transcode must be flac, vp9, vp9,flac or none, got 'mp3'"):
        ConvertConfig(source=tmp_path, dest=tmp_path / "ds", transcode="mp3")
    code, _, err = run_cli(["convert", str(tmp_path), str(tmp_path / "ds"), "--transcode", "opus"], capsys)
    assert code != 0 and err.count("\n") == 1 and "--transcode must be flac, vp9, vp9,flac or none" in err, err
