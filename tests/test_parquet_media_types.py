"""A Parquet bytes column of encoded files of several types (WAV, FLAC, Opus, MP3 and a WebM video): each row is
stored in the field of its own type (by magic number), not the first row's, so each is probed as what it is."""

from __future__ import annotations

import json

import pytest

av = pytest.importorskip("av")
pq = pytest.importorskip("pyarrow.parquet")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402

TYPES = ("wav", "flac", "opus", "mp3", "webm")
PROBE, MEDIA = "probe.json", ("wav", "flac", "opus", "webm")


@pytest.fixture()
def mixed_table(tmp_path):
    import pyarrow as pa

    files = {t: (synthetic.make_video(tmp_path / "f" / "v.webm", frames=6) if t == "webm" else
                 synthetic.make_audio(tmp_path / "f" / f"a.{t}", seconds=0.5)).read_bytes() for t in TYPES}
    pq.write_table(pa.table({"key": list(TYPES), "media": [files[t] for t in TYPES], "label": [0, 1, 0, 1, 0]}),
                   tmp_path / "m.parquet")
    return tmp_path / "m.parquet"


def stored(dest, media: tuple[str, ...] = MEDIA) -> dict[str, tuple[str, str]]:
    """key -> (its media field, the codec its probe says), of a dataset whose media fields are ``media``."""
    import fastio

    ds = fastio.Dataset(dest)
    out = {}
    with fastio.Loader(dest, pipeline=fastio.Raw(fields=[PROBE, *media]), batch_size=1, device="cpu",
                       shuffle="none") as loader:
        for b in loader:
            field = next(f for f in media if f in b and b[f][0] is not None and len(b[f][0]))
            out[ds.key(int(b["index"][0]))] = field, json.loads(b[PROBE][0])["codec"]
    return out


def test_each_row_of_a_mixed_bytes_column_is_stored_as_its_own_type(mixed_table, tmp_path):
    result = convert(ConvertConfig(source=mixed_table, dest=tmp_path / "ds", workers=1, progress=False))
    assert result.skipped == [] and result.transcoded == {"flac": {"mp3float": 1}}  # the MP3 as FLAC: the default
    assert stored(tmp_path / "ds") == {"wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac"),
                                       "opus": ("opus", "opus"), "mp3": ("flac", "flac"), "webm": ("webm", "vp9")}
    none = convert(ConvertConfig(source=mixed_table, dest=tmp_path / "none", workers=1, progress=False,
                                 transcode="none"))
    assert [(s["path"], s["reason"].split(":")[0]) for s in none.skipped] == [
        ("m.parquet:4", "audio codec mp3float is not read by DALI's audio decoder")]
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["source"]["options"]["bytes_columns"] == {"media": ["flac", "mp3", "opus", "wav", "webm"]}


def test_a_column_of_one_type_keeps_its_field_name_in_the_manifest(tmp_path):
    import pyarrow as pa

    sounds = [synthetic.make_audio(tmp_path / "f" / f"a{i}.flac", seconds=0.3).read_bytes() for i in range(2)]
    pq.write_table(pa.table({"audio": sounds, "label": [0, 1]}), tmp_path / "a.parquet")
    convert(ConvertConfig(source=tmp_path / "a.parquet", dest=tmp_path / "ds", workers=1, progress=False))
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["source"]["options"]["bytes_columns"] == {"audio": "flac"}


def _webm_audio(path):
    """Opus in WebM with no video stream (a browser's MediaRecorder or a downloaded soundtrack), made with PyAV."""
    wave = synthetic.tone(0.5, 48000, 440.0, 1).reshape(1, -1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="webm") as out:
        stream = out.add_stream("libopus", rate=48000, layout="mono")
        synthetic.encode_audio(out, stream, wave, "flt", 48000, "mono")
    return path


def test_a_column_whose_first_value_is_of_no_known_type_still_stores_each_row_as_its_own(tmp_path):
    """The column was named after its first value only: one of no known type made every row an opaque field
    ``media``, the WAV and FLAC rows stored unprobed and converted 'fine'. Now the first value of a known type
    names the column, the others their own; the unknown value is probed as that type and skipped, named."""
    import pyarrow as pa

    files = [b"not a media file" * 4] + [synthetic.make_audio(tmp_path / "f" / f"a.{t}", seconds=0.3).read_bytes()
                                         for t in ("wav", "flac")]
    pq.write_table(pa.table({"key": ["junk", "wav", "flac"], "media": files, "label": [0, 1, 0]}),
                   tmp_path / "m.parquet")
    result = convert(ConvertConfig(source=tmp_path / "m.parquet", dest=tmp_path / "ds", workers=1, progress=False))
    assert [(s["path"], s["reason"].split(" (")[0]) for s in result.skipped] == [("m.parquet:1", "cannot be probed")]
    assert stored(tmp_path / "ds", ("wav", "flac")) == {"wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac")}


def test_a_webm_holding_only_audio_is_named_as_audio_and_transcoded_to_flac(tmp_path):
    """A WebM row of a sound column was skipped as 'no video stream' (after 'no audio stream' before): it is
    Opus in Matroska, which DALI's audio decoder does not read. By default (``transcode="flac"``) it is stored as
    FLAC, as MP3 is, also with ``vp9,flac``; with ``--transcode none`` the reason says what it is, with the way out."""
    import pyarrow as pa

    files = [synthetic.make_audio(tmp_path / "f" / "a.wav", seconds=0.3).read_bytes(),
             _webm_audio(tmp_path / "f" / "b.webm").read_bytes()]
    pq.write_table(pa.table({"key": ["wav", "webm"], "media": files, "label": [0, 1]}), tmp_path / "m.parquet")
    result = convert(ConvertConfig(source=tmp_path / "m.parquet", dest=tmp_path / "ds", workers=1, progress=False,
                                   transcode="none"))
    [skip] = result.skipped
    assert skip["path"] == "m.parquet:2" and "only audio (opus in matroska)" in skip["reason"], skip
    assert "--transcode flac" in skip["reason"], skip
    for name, transcode in (("flac", None), ("both", "vp9,flac")):  # vp9 too: a video field, but only audio
        convert(ConvertConfig(source=tmp_path / "m.parquet", dest=tmp_path / name, workers=1, progress=False,
                              transcode=transcode))
        assert stored(tmp_path / name, ("wav", "flac")) == {"wav": ("wav", "pcm_s16le"), "webm": ("flac", "flac")}
