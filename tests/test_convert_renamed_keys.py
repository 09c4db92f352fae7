"""Two inputs whose keys would be the same (``tone_2.wav`` and ``tone_2.flac`` in one class folder; ``a b`` and
``a_b`` after sanitising) get keys apart, the later one with a hash of its name; convert's summary says how many
were renamed and names the first pair, and the CLI prints it."""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("av")

from fastio.convert import synthetic  # noqa: E402
from fastio.convert.run import ConvertConfig, convert  # noqa: E402


@pytest.fixture()
def same_stems(tmp_path):
    for name in ("tone_2.wav", "tone_2.flac", "tone_3.flac"):
        synthetic.make_audio(tmp_path / "src" / "c0" / name, seconds=0.2)
    return tmp_path / "src"


def hashed(text: str) -> str:
    return f"{text}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def test_the_summary_counts_renamed_keys_and_names_the_first_pair(same_stems, tmp_path):
    import fastio

    result = convert(ConvertConfig(source=same_stems, dest=tmp_path / "ds", workers=1, progress=False))
    assert result.renamed == [("c0/tone_2.wav", hashed("c0/tone_2"), "c0/tone_2.flac")]
    assert (f"; renamed 1 key another input had (e.g. c0/tone_2.wav is key '{hashed('c0/tone_2')}', as "
            "c0/tone_2.flac has the key it would have had)") in result.summary()
    ds = fastio.Dataset(tmp_path / "ds")
    assert sorted(ds.key(i) for i in range(len(ds))) == sorted(["c0/tone_2", hashed("c0/tone_2"), "c0/tone_3"])


def test_no_rename_no_note(tmp_path):
    synthetic.make_audio(tmp_path / "src" / "c0" / "a.flac", seconds=0.2)
    result = convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    assert result.renamed == [] and "renamed" not in result.summary()


def test_a_table_and_loose_files_count_theirs_and_the_cli_prints_it(tmp_path, capsys):
    from helpers import run_cli

    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text(str(i))
    (tmp_path / "t.csv").write_text("key,path,label\na b,f0.txt,0\na_b,f1.txt,1\nc,f2.txt,0\n")
    code, out, err = run_cli(["convert", str(tmp_path / "t.csv"), str(tmp_path / "ds")], capsys)
    assert code == 0, err
    assert f"renamed 1 key another input had (e.g. f1.txt is key '{hashed('a_b')}', as f0.txt has" in out + err
    (tmp_path / "loose").mkdir()
    for name in ("a b.txt", "a_b.txt"):
        (tmp_path / "loose" / name).write_text(name)
    result = convert(ConvertConfig(source=tmp_path / "loose", dest=tmp_path / "ds2", format="files", workers=1))
    assert result.renamed == [("a_b", hashed("a_b"), "a b")]
