"""Review of ``fastio index`` (issue 20) with damaged tars that :mod:`tarfile` reads without a word: a shard cut
at a member boundary, a damaged header in the middle (GNU tar fails on both; tarfile just stops), and a GNU
sparse member (its bytes are not at one offset). Each is one line naming the file and the reason, exit 2,
and nothing is written beside the shards."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import pytest
from helpers import run_cli


def _tar(path: Path, n: int = 3) -> bytes:
    """A WebDataset tar of ``n`` samples (cls + txt), as bytes, also written to ``path``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("cls", b"%d" % i), ("txt", b"text %d" % i)):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _refused(folder: Path, capsys, *reason: str) -> None:
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    code, out, err = run_cli(["index", str(folder)], capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(folder / "x.tar") in lines[0], err
    for word in reason:
        assert word in lines[0], err
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != ".fastio-lock"}
    assert after == before, "an index that was refused wrote or changed files"


def test_a_shard_cut_at_a_member_boundary_is_truncated(tmp_path, capsys):
    data = _tar(tmp_path / "x.tar")
    (tmp_path / "x.tar").write_bytes(data[:3 * 1024])  # 1.5 samples: cls, txt, cls; no end-of-archive blocks
    assert subprocess.run(["tar", "-tf", str(tmp_path / "x.tar")], capture_output=True).returncode == 0  # GNU tar: silent
    _refused(tmp_path, capsys, "truncated", "after member s1.cls", "end-of-archive")


def test_a_damaged_header_in_the_middle_is_refused_not_read_as_the_end(tmp_path, capsys):
    data = bytearray(_tar(tmp_path / "x.tar"))
    data[2 * 1024 + 148] ^= 0x01  # the checksum of the second sample's first header
    (tmp_path / "x.tar").write_bytes(data)
    assert subprocess.run(["tar", "-tf", str(tmp_path / "x.tar")], capture_output=True).returncode != 0
    _refused(tmp_path, capsys, "damaged", "byte 2048", "after member s0.txt")


def test_a_gnu_sparse_member_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cls").write_text("1")
    with open(src / "a.bin", "wb") as f:  # a hole, then data: GNU tar --sparse stores only the data
        f.seek(64 * 1024)
        f.write(b"tail")
    (tmp_path / "d").mkdir()
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tmp_path / "d" / "x.tar"), "-C", str(src),
                    "a.cls", "a.bin"], check=True)
    info = tarfile.open(tmp_path / "d" / "x.tar").getmember("a.bin")
    if not info.issparse():
        pytest.skip("this GNU tar stored the file whole")
    _refused(tmp_path / "d", capsys, "member a.bin is a GNU sparse file")


def test_an_intact_tar_still_indexes_with_trailing_zero_padding(tmp_path, capsys):
    _tar(tmp_path / "x.tar")
    code, out, err = run_cli(["index", str(tmp_path)], capsys)
    assert code == 0 and "3 samples" in out, err


def _text_label_tar(path: Path, bad: int | None = 37, n: int = 50) -> None:
    """``n`` samples (txt + cls); sample ``bad``'s cls holds a WordNet id instead of an integer."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            for ext, data in (("txt", b"t"), ("cls", b"n01440764" if i == bad else b"%d" % (i % 3))):
                info = tarfile.TarInfo(f"s{i:02d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def test_a_label_field_holding_text_is_caught_when_indexing(tmp_path, capsys):
    _text_label_tar(tmp_path / "x.tar")
    code, _, err = run_cli(["index", str(tmp_path)], capsys)
    assert code == 2, err
    assert "x.tar" in err and "s37" in err and "n01440764" in err and "'cls'" in err, err
    assert not (tmp_path / "manifest.json").exists()
    code, _, err = run_cli(["index", str(tmp_path), "--label-field", "cls", "--dest", str(tmp_path / "d")], capsys)
    assert code == 2 and "s37" in err and "n01440764" in err, err
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_a_text_label_field_that_is_not_the_label_is_accepted(tmp_path, capsys):
    """``label`` holding class names beside an integer ``cls``: cls is the label, the names are a field."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(4):
            for ext, data in (("cls", b"%d" % i), ("label", b"tench")):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "x.tar").write_bytes(buf.getvalue())
    code, _, err = run_cli(["index", str(tmp_path), "-q"], capsys)
    assert code == 0, err
    from fastio.dataset.dataset import Dataset

    assert Dataset(tmp_path).label_field == "cls"


def test_index_parts_catch_a_text_label_too(tmp_path, capsys):
    """The part that reads the bad value refuses when the label field is named; otherwise the merge does (only
    it knows which field is the label), naming the shard, key and value, and publishes nothing."""
    src = tmp_path / "src"
    for n in range(2):
        _text_label_tar(src / f"x{n}.tar", bad=37 if n == 1 else None)
    dest = tmp_path / "dest"
    assert run_cli(["index", str(src), "--dest", str(dest), "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["index", str(src), "--dest", str(dest), "--part", "1/2", "--label-field", "cls"], capsys)
    assert code == 2 and "x1.tar" in err and "s37" in err and "n01440764" in err, err
    assert run_cli(["index", str(src), "--dest", str(dest), "--part", "1/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and "x1.tar" in err and "s37" in err and "n01440764" in err, err
    assert not (dest / "manifest.json").exists()


def test_index_dest_refuses_a_folder_fastio_did_not_make(tmp_path, capsys):
    """As `fastio convert` does: a non-empty DEST without fastio's marker is refused (its files untouched) unless
    --overwrite; a DEST index made (a rerun) is its own."""
    _tar(tmp_path / "src" / "x.tar")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    code, _, err = run_cli(["index", str(tmp_path / "src"), "--dest", str(dest)], capsys)
    assert code == 2 and str(dest) in err and "not fastio output" in err and "--overwrite" in err, err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    code, _, err = run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--part", "0/2"], capsys)
    assert code == 2 and "not fastio output" in err, err
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--overwrite", "-q"], capsys)[0] == 0
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "manifest.json").is_file()
    (dest / "manifest.json").unlink()  # as if the first run had died before its manifest
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "-q"], capsys)[0] == 0


def test_merge_names_fastio_index_for_the_missing_parts_of_an_index(tmp_path, capsys):
    for n in range(2):
        _tar(tmp_path / "src" / f"x{n}.tar")
    dest = tmp_path / "dest"
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and "part-1-of-2 (missing)" in err, err
    assert f"index them (fastio index {tmp_path / 'src'} --dest {dest} --part K/2)" in err, err
    assert "convert" not in err, err


def test_jpeg_and_tif_members_are_image_fields(tmp_path, capsys):
    """WebDataset decodes ``.jpeg`` and ``.tif`` as images: so does the Loader of an indexed dataset (it said
    "dataset has no image field")."""
    import json

    import numpy as np
    from helpers import indexed_tar
    from PIL import Image

    from fastio import Loader
    from fastio.convert.synthetic import photo_jpeg

    tif = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 10)).save(tif, "TIFF")
    for ext, data in (("jpeg", photo_jpeg(np.random.default_rng(0), 32, 24)), ("tif", tif.getvalue())):
        dest = indexed_tar(tmp_path / ext, {f"k{i}": {ext: data, "cls": b"%d" % i} for i in range(3)}, capsys)
        assert json.loads((dest / "manifest.json").read_text())["image_field"] == ext
        with Loader(dest, batch_size=3, pipeline="image-eval", image_size=16, device="cpu", shuffle="none",
                    world_size=1, rank=0) as loader:
            batch = next(iter(loader))
        assert batch["image"].shape[0] == 3 and batch["label"].tolist() == [0, 1, 2]
