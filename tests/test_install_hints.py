"""What a missing optional dependency says: fastio is installed from its checkout (docs/install.md: it is not on
the package index, where ``pip install 'fastio[media]'`` would fetch someone else's package), so every hint says
``pip install -e '.[EXTRA]'`` in the checkout (:func:`fastio.errors.install_hint`, its one home). Each test hides the
dependency from this process (``sys.modules[name] = None``: ``import`` raises ImportError, ``find_spec`` finds
nothing, as where it is not installed) and reads what the user sees; the docs say the same."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import run_cli

import fastio
from fastio.convert import synthetic
from fastio.convert.run import ConvertConfig, convert

ROOT = Path(__file__).resolve().parent.parent
HINT = re.escape("pip install -e '.[media]' in fastio's checkout, as docs/install.md says")


@pytest.fixture
def no_pyav(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)


def test_the_hint_installs_the_extra_from_the_checkout():
    from fastio.errors import install_hint

    assert install_hint("tokens") == "pip install -e '.[tokens]' in fastio's checkout, as docs/install.md says"


def test_convert_without_tokenizers_says_how_to_add_them(tmp_path, monkeypatch, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    code, out, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "ds"),
                              "--tokenizer", str(tmp_path / "tokenizer.json")], capsys)
    assert code != 0
    assert "fastio: error: tokenizers is not installed: pip install -e '.[tokens]' in fastio's checkout, " \
           "as docs/install.md says" in err, err


def test_index_of_audio_without_pyav_says_how_to_add_it(tmp_path, no_pyav):
    from test_media import write_wds_tar

    from fastio.convert.wds_index import IndexConfig, index_shards

    write_wds_tar(tmp_path / "wds" / "a-000000.tar", {"k0.flac": b"fLaC" + bytes(64), "k0.cls": b"0"})
    with pytest.raises(fastio.DatasetError, match=rf"a-000000.tar: holds video or audio \(flac\); probing it needs "
                                                  rf"PyAV: {HINT}$"):
        index_shards(IndexConfig(source=tmp_path / "wds"))


def test_pyav_fallback_without_pyav_says_how_to_add_it(no_pyav):
    with pytest.raises(ValueError, match=rf"^cpu_fallback='pyav' needs PyAV: {HINT}$"):
        fastio.VideoClips(frames=2, size=8, cpu_fallback="pyav")


@pytest.fixture(scope="module")
def h264_ds(tmp_path_factory) -> Path:
    """One H.264 .mp4 converted (kept as it is: DALI's CPU decoder does not read it)."""
    root = tmp_path_factory.mktemp("h264")
    synthetic.make_video(root / "src" / "c0" / "a.mp4", frames=6, fps=12)
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False))
    return root / "ds"


def test_cpu_loader_of_h264_without_pyav_says_how_to_add_it(h264_ds, no_pyav):
    with pytest.raises(fastio.DatasetError, match=rf"VideoClips\(cpu_fallback='pyav'\) \({HINT}\), or convert"):
        fastio.Loader(h264_ds, pipeline=fastio.VideoClips(frames=2, size=8, dtype="uint8"), batch_size=1,
                      device="cpu", shuffle="none", num_threads=1, world_size=1, rank=0)


def test_verify_decode_without_pyav_says_how_to_add_it(h264_ds, no_pyav, capsys):
    code, out, err = run_cli(["verify", str(h264_ds), "--decode"], capsys)
    assert code != 0
    said = "not decoded: PyAV is not installed (pip install -e '.[media]' in fastio's checkout, as docs/install.md says)"
    assert said in out + err, out + err


def test_no_hint_installs_fastio_from_the_index():
    """``pip install 'fastio[...]'`` / ``pip install fastio[...]`` (the index's fastio) is said nowhere (a built
    wheel's ``'fastio[cuda13] @ file:///...'``, docs/install.md, is fastio's own)."""
    from_index = re.compile(r"pip install '?fastio\[[\w,]*\]'?(?! @)")
    files = [*ROOT.joinpath("fastio").rglob("*.py"), *ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md"]
    said = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
            if from_index.search(line)]
    assert said == []


def test_verify_decode_of_audio_without_dali_says_how_to_add_it(tmp_path, monkeypatch, capsys):
    """verify --decode reads audio with DALI's decoder, as the Loader does: without DALI it names each audio file
    as not decoded by it, with the extra that installs it (not a bare ImportError)."""
    synthetic.make_audio(tmp_path / "src" / "c0" / "t.flac", seconds=0.5)
    convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "ds", workers=1, progress=False))
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    code, out, err = run_cli(["verify", str(tmp_path / "ds"), "--decode"], capsys)
    assert code == 1, out + err
    said = ("shard-000000.tar: c0/t: field flac: not decoded by DALI's audio decoder: DALI is not installed (pip "
            "install -e '.[cuda13]' in fastio's checkout, as docs/install.md says)")
    assert said in out, out + err
