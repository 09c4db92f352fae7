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


def stored(dest) -> dict[str, tuple[str, str]]:
    """key -> (its media field, the codec its probe says)."""
    import fastio

    ds = fastio.Dataset(dest)
    out = {}
    with fastio.Loader(dest, pipeline=fastio.Raw(fields=[PROBE, *MEDIA]), batch_size=1, device="cpu",
                       shuffle="none") as loader:
        for b in loader:
            field = next(f for f in MEDIA if f in b and b[f][0] is not None and len(b[f][0]))
            out[ds.key(int(b["index"][0]))] = field, json.loads(b[PROBE][0])["codec"]
    return out


def test_each_row_of_a_mixed_bytes_column_is_stored_as_its_own_type(mixed_table, tmp_path):
    result = convert(ConvertConfig(source=mixed_table, dest=tmp_path / "ds", workers=1, progress=False))
    assert [(s["path"], s["reason"].split(":")[0]) for s in result.skipped] == [
        ("m.parquet:4", "audio codec mp3float is not read by DALI's audio decoder")]
    assert stored(tmp_path / "ds") == {"wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac"),
                                       "opus": ("opus", "opus"), "webm": ("webm", "vp9")}
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["source"]["options"]["bytes_columns"] == {"media": ["flac", "mp3", "opus", "wav", "webm"]}


def test_a_column_of_one_type_keeps_its_field_name_in_the_manifest(tmp_path):
    import pyarrow as pa

    sounds = [synthetic.make_audio(tmp_path / "f" / f"a{i}.flac", seconds=0.3).read_bytes() for i in range(2)]
    pq.write_table(pa.table({"audio": sounds, "label": [0, 1]}), tmp_path / "a.parquet")
    convert(ConvertConfig(source=tmp_path / "a.parquet", dest=tmp_path / "ds", workers=1, progress=False))
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["source"]["options"]["bytes_columns"] == {"audio": "flac"}
