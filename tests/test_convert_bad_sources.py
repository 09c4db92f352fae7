"""Sources a hostile or unlucky user hands to `fastio convert`: bad labels, symlinks, decompression bombs,
paths outside the table's folder, mixed image formats, and two conversions racing into one DEST.

Every rejected input is skipped and listed in the manifest (or stops the run with on_error="fail")."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fastio.converters as converters
from fastio.cli import main
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import FORMATS, MIXED_FORMATS, make_imagefolder, make_mixed_imagefolder
from fastio.dataset.dataset import Dataset
from fastio.errors import ConvertError
from fastio.formats.images import check_pixels, image_size
from fastio.formats.labels import LABEL_MAX, check_label
from fastio.read.reader import Reader
from fastio.report.inspect import inspect
from fastio.report.verify import verify
from fastio.storage.lock import LOCK_NAME


def skipped_of(dest: Path) -> dict[str, str]:
    return {s["path"]: s["reason"] for s in json.loads((dest / "manifest.json").read_text())["skipped"]}


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# -- labels -------------------------------------------------------------------------------------------

def label_table(folder: Path, labels: list[str]) -> Path:
    files = sorted(folder.rglob("*.jpg"))[: len(labels)]
    rows = [f"{p.relative_to(folder).as_posix()},{label}" for p, label in zip(files, labels)]
    (folder / "t.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return folder / "t.csv"


def test_label_rule():
    assert check_label("7") == 7 and check_label(b" 12\n") == 12 and check_label(LABEL_MAX) == LABEL_MAX
    for bad, reason in [("", "empty label"), ("-3", "label -3 is negative"), (str(2**63), "does not fit int64"),
                        ("9" * 400, "does not fit int64"), ("x1", "is not an integer"), (True, "is not an integer")]:
        with pytest.raises(ValueError, match=reason):
            check_label(bad)


def test_empty_huge_and_negative_labels_are_skipped_and_listed(tmp_path, image_folder):
    table = label_table(image_folder, ["1", "", "99999999999999999999", "-3", "2", "  "])
    result = convert(ConvertConfig(source=table, dest=tmp_path / "out", workers=1))
    assert result.samples == 2
    assert skipped_of(tmp_path / "out") == {
        "t.csv:3": "empty label in column 'label'",
        "t.csv:4": "column 'label': label 99999999999999999999 does not fit int64",
        "t.csv:5": "column 'label': label -3 is negative",
        "t.csv:7": "empty label in column 'label'",
    }
    ds = Dataset(tmp_path / "out")
    with Reader(ds, ["cls"]) as reader:
        assert sorted(bytes(b) for b in reader.read(np.arange(len(ds)))["cls"]) == [b"1", b"2"]


@pytest.mark.parametrize("labels, where", [(["1", "", "2"], "t.csv:3: empty label"),
                                           (["1", "-1"], "t.csv:3: column 'label': label -1 is negative"),
                                           (["3", "18446744073709551616"],
                                            "t.csv:3: column 'label': label 18446744073709551616 does not fit")])
def test_bad_label_with_on_error_fail_stops_naming_the_line(tmp_path, image_folder, capsys, labels, where):
    table = label_table(image_folder, labels)
    code, _, err = run_cli(["convert", str(table), str(tmp_path / "out"), "--on-error", "fail", "-q"], capsys)
    assert code == 2 and err.count("\n") == 1 and where in err and "--on-error fail" in err, err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_cls_file_of_loose_files_is_rejected_at_load(tmp_path, image_folder):
    src = tmp_path / "loose"
    src.mkdir()
    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    for name, label in [("a", "1"), ("b", "-1"), ("c", "123456789012345678901234"), ("d", "2")]:
        (src / f"{name}.jpg").write_bytes(jpg)
        (src / f"{name}.cls").write_text(label)
    (src / "e.jpg").write_bytes(jpg)  # no label while the others have one
    convert(ConvertConfig(source=src, dest=tmp_path / "out", workers=1))
    skipped = skipped_of(tmp_path / "out")
    assert skipped == {"b.cls": "field 'cls': label -1 is negative",
                       "c.cls": "field 'cls': label 123456789012345678901234 does not fit int64",
                       "e": "no label (other samples have a .cls file, this one has none)"}
    assert Dataset(tmp_path / "out").table.keys == ["a", "d"]


# -- symlinks -----------------------------------------------------------------------------------------

def test_symlink_policy_in_an_image_folder(tmp_path, image_folder):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = outside / "secret.jpg"
    secret.write_bytes(min(image_folder.rglob("*.jpg")).read_bytes())
    (image_folder / "zloop").symlink_to(image_folder, target_is_directory=True)  # a class linking to the root
    (image_folder / "aalias").symlink_to("circle", target_is_directory=True)  # sorts first, all duplicates
    (image_folder / "square" / "out.jpg").symlink_to(secret)
    (image_folder / "square" / "gone.jpg").symlink_to(image_folder / "nothing.jpg")
    (image_folder / "square" / "self.jpg").symlink_to("self.jpg")
    (image_folder / "square" / "outdir").symlink_to(outside, target_is_directory=True)
    (image_folder / "vstripes" / "deeper").mkdir()
    (image_folder / "vstripes" / "deeper" / "up").symlink_to("..", target_is_directory=True)
    (image_folder / "hstripes" / "more").symlink_to(image_folder / "vstripes", target_is_directory=True)
    (image_folder / "vstripes" / "v.jpg").symlink_to("vstripes_0000.jpg")  # inside: a second path to one file

    result = converters.scan(image_folder)
    reasons = {s.path: s.reason for s in result.skipped}
    assert reasons["zloop"].startswith("symlink loop")
    assert reasons["vstripes/deeper/up"].startswith("symlink loop")
    assert reasons["square/out.jpg"].startswith("symlink points outside the source")
    assert reasons["square/outdir"].startswith("symlink points outside the source")
    assert reasons["square/gone.jpg"].startswith("dangling symlink")
    assert reasons["square/self.jpg"].startswith("symlink loop")
    assert reasons["aalias/circle_0003.jpg"] == "same file as circle/circle_0003.jpg (reached through a symlink)"
    assert reasons["hstripes/more/vstripes_0001.jpg"] == "same file as vstripes/vstripes_0001.jpg " \
                                                         "(reached through a symlink)"
    assert reasons["vstripes/v.jpg"] == "same file as vstripes/vstripes_0000.jpg (reached through a symlink)"
    assert reasons["aalias"] == "a class folder with no image, video or audio file: label 0 has no samples"
    assert all(s.error for s in result.skipped if s.path != "aalias")
    # Every real image exactly once, under its own class; nothing from outside SOURCE.
    real = {os.path.realpath(dict(e.fields)["jpg"].path) for e in result.entries}
    assert len(real) == len(result.entries) == 48
    assert all(p.startswith(os.path.realpath(image_folder)) for p in real)
    assert "zloop" not in result.label_map
    for e in result.entries:
        assert e.key.split("/")[0] in ("circle", "hstripes", "square", "vstripes")
        assert int(dict(e.fields)["cls"]) == result.label_map[e.key.split("/")[0]]


def test_symlinked_folder_inside_a_class_is_followed(tmp_path, image_folder):
    store = image_folder / "circle" / "store"  # reached only through the link below (hidden folders are not walked)
    store.mkdir()
    (store / "one.jpg").write_bytes((image_folder / "square" / "square_0000.jpg").read_bytes())
    store.rename(image_folder / "circle" / ".store")
    (image_folder / "circle" / "linked").symlink_to(".store", target_is_directory=True)
    result = converters.scan(image_folder)
    assert [e.key for e in result.entries if "linked" in e.key] == ["circle/linked/one"]
    assert len(result.entries) == 49


def test_dangling_symlink_with_on_error_fail(tmp_path, image_folder):
    (image_folder / "circle" / "gone.jpg").symlink_to(tmp_path / "never.jpg")
    with pytest.raises(ConvertError, match=r"circle/gone.jpg: dangling symlink .*\(on_error='fail'\)"):
        convert(ConvertConfig(source=image_folder, dest=tmp_path / "out", on_error="fail", workers=1))
    assert not (tmp_path / "out").exists()


def test_loose_files_follow_the_same_policy(tmp_path, image_folder):
    src = tmp_path / "loose"
    (src / "sub").mkdir(parents=True)
    jpg = min(image_folder.rglob("*.jpg"))
    (src / "a.jpg").write_bytes(jpg.read_bytes())
    (src / "sub" / "back").symlink_to("..", target_is_directory=True)
    (src / "b.jpg").symlink_to(jpg)  # outside the source
    result = converters.scan(src)
    assert [e.key for e in result.entries] == ["a"]
    assert {s.path: s.reason.split(" (")[0] for s in result.skipped} == {
        "sub/back": "symlink loop", "b.jpg": "symlink points outside the source"}


# -- decompression bombs ------------------------------------------------------------------------------

def png_bomb(side: int) -> bytes:
    """A greyscale PNG of side x side zero pixels, compressed to almost nothing (140 KB for 12000)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte + pixels
    body = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def test_image_size_reads_every_format_from_its_header(tmp_path):
    src = make_mixed_imagefolder(tmp_path / "mixed", classes=1, per_class=len(MIXED_FORMATS) * 2)
    seen = set()
    for path in sorted(src.rglob("*.*")):
        data = path.read_bytes()
        with Image.open(path) as img:
            assert image_size(data) == img.size == image_size(np.frombuffer(data, np.uint8)), path.name
        seen.add(path.suffix)
    assert seen == {f".{ext}" for ext in FORMATS.values()}


def test_bomb_is_refused_from_its_header_without_a_raw_warning(tmp_path, image_folder, capfd):
    bomb = png_bomb(12000)
    assert len(bomb) < 200_000
    (image_folder / "circle" / "bomb.png").write_bytes(bomb)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"12000x12000 = 144000000 pixels is over the limit of 100000000"):
        check_pixels(bomb, 100_000_000)
    assert time.perf_counter() - started < 0.5  # header only: decoding 144 M pixels takes seconds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "out", workers=1))
    assert not [w for w in caught if "DecompressionBomb" in type(w.message).__name__]
    assert "DecompressionBomb" not in capfd.readouterr().err
    assert result.samples == 48
    assert skipped_of(tmp_path / "out") == {
        "circle/bomb.png": "image of 12000x12000 = 144000000 pixels is over the limit of 100000000 (max_pixels)"}
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["convert_options"]["max_pixels"] == 10**8


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_bomb_costs_no_memory_at_convert(tmp_path, image_folder):
    """Peak memory of a real `fastio convert` of a folder holding a 144 M pixel PNG stays far below its
    decoded size (144 MB), because the header check comes first."""
    (image_folder / "circle" / "bomb.png").write_bytes(png_bomb(12000))
    # VmHWM: this process image's peak RSS (ru_maxrss would carry the forking pytest's over exec).
    code = ("import re, sys; from fastio.cli import main; rc = main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); sys.exit(rc)")

    def peak_kib(*extra: str) -> int:
        out = subprocess.run([sys.executable, "-c", code, "convert", str(image_folder), str(tmp_path / "o"),
                              "--workers", "1", "-q", "--overwrite", *extra],
                             capture_output=True, text=True, check=True)
        assert "DecompressionBomb" not in out.stderr, out.stderr
        return int(out.stdout.split()[-1])

    limited, unlimited = peak_kib(), peak_kib("--max-pixels", "0")
    assert "circle/bomb.png" not in skipped_of(tmp_path / "o")  # --max-pixels 0: no limit, the bomb is packed
    assert unlimited - limited > 100_000, (limited, unlimited)


def test_max_pixels_is_configurable(tmp_path, image_folder, capsys):
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "a", max_pixels=60 * 60, workers=1))
    over = {k for k, v in skipped_of(tmp_path / "a").items() if "(max_pixels)" in v}
    assert over and result.samples + len(over) == 48
    for path in over:
        with Image.open(image_folder / path) as img:
            assert img.size[0] * img.size[1] > 3600
    with pytest.raises(ValueError, match="max_pixels must be positive"):
        ConvertConfig(source=image_folder, dest=tmp_path / "b", max_pixels=0)
    code, _, err = run_cli(["convert", str(image_folder), str(tmp_path / "c"), "--max-pixels", "-5"], capsys)
    assert code == 2 and "--max-pixels must be positive" in err
    code, _, err = run_cli(["convert", str(image_folder), str(tmp_path / "d"), "--max-pixels", "3600",
                            "--on-error", "fail"], capsys)
    assert code == 2 and "pixels is over the limit of 3600" in err and err.count("\n") == 1


# -- paths outside the table --------------------------------------------------------------------------

def test_table_paths_must_resolve_inside_the_root(tmp_path, image_folder):
    outside = tmp_path / "private.jpg"
    outside.write_bytes((image_folder / "circle" / "circle_0001.jpg").read_bytes())
    (image_folder / "link.jpg").symlink_to(outside)
    table = image_folder / "t.csv"
    table.write_text("path,label\n"
                     "circle/circle_0000.jpg,0\n"
                     "../private.jpg,0\n"
                     f"{outside},0\n"
                     "/etc/passwd,0\n"
                     "link.jpg,0\n"
                     "circle/../square/square_0000.jpg,2\n"
                     f"{image_folder / 'square' / 'square_0001.jpg'},2\n")
    result = convert(ConvertConfig(source=table, dest=tmp_path / "out", workers=1))
    assert result.samples == 3
    skipped = skipped_of(tmp_path / "out")
    assert sorted(skipped) == ["t.csv:3", "t.csv:4", "t.csv:5", "t.csv:6"]
    assert all("resolves outside" in reason for reason in skipped.values())
    with Reader(Dataset(tmp_path / "out"), ["jpg"]) as reader:
        packed = {bytes(b) for b in reader.read(np.arange(3))["jpg"]}
    assert outside.read_bytes() not in packed
    with pytest.raises(ConvertError, match=r"t.csv:3: path column 'path': ../private.jpg resolves outside"):
        convert(ConvertConfig(source=table, dest=tmp_path / "fail", on_error="fail", workers=1))


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_labelled_table_naming_one_file_twice_follows_on_error(tmp_path, image_folder, capsys, kind):
    """Found by the newcomer review: a labelled table naming one image in two rows (a copy-paste, or a multi-label
    table written one row per label) packed it twice, as two samples, silently. fastio's label is one integer
    a sample, so the later row is rejected by the rule of every rejected row, naming the file and both rows; a
    table without labels (several captions of one image, each a sample) keeps them all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(name: str, columns: dict[str, list]) -> Path:
        path = image_folder / f"{name}.{kind}"
        if kind == "csv":
            rows = zip(*columns.values())
            path.write_text(",".join(columns) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
        else:
            pq.write_table(pa.table(columns), path)
        return path

    paths = ["circle/circle_0000.jpg", "circle/circle_0001.jpg", "./circle/circle_0000.jpg", "square/square_0000.jpg"]
    labelled = table("t", {"path": paths, "label": [0, 0, 1, 2]})
    first = 2 if kind == "csv" else 1  # the CSV's header is its line 1; a Parquet's row from 1
    code, out, err = run_cli(["convert", str(labelled), str(tmp_path / "out"), "--workers", "1"], capsys)
    assert code == 0, err
    said = (f"t.{kind}:{first + 2}: path column 'path': ./circle/circle_0000.jpg is the file of t.{kind}:{first} "
            "too: a labelled table names each file once (one sample, one label)")
    assert skipped_of(tmp_path / "out") == {f"t.{kind}:{first + 2}": said.split(": ", 1)[1]}
    assert said in out and "skipped 1" in out, out
    assert len(Dataset(tmp_path / "out")) == 3
    code, _, err = run_cli(["convert", str(labelled), str(tmp_path / "fail"), "--on-error", "fail", "-q"], capsys)
    assert code == 2 and err.count("\n") == 1 and said in err and "--on-error fail" in err, err
    captions = table("c", {"path": paths[:3], "caption": ["a circle", "another", "a round shape"]})
    assert run_cli(["convert", str(captions), str(tmp_path / "captions"), "-q"], capsys)[0] == 0
    assert len(Dataset(tmp_path / "captions")) == 3


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_table_rows_naming_no_file_follow_on_error(tmp_path, image_folder, capsys, kind):
    """Found by review: a table row whose path names a missing file (or a folder, or an empty cell) stopped the run
    whatever --on-error said, while a row whose path resolves outside the root, or whose label is bad, was skipped
    and listed. Such a row is now rejected by the one rule of every rejected input: skipped, listed in the manifest
    and named in the summary (--on-error skip, the default), or the run stops in one line naming the table, the
    row and the path (--on-error fail)."""
    (image_folder / "sub").mkdir()
    rows = [("circle/circle_0000.jpg", 0), ("circle/gone.jpg", 0), ("sub", 1), ("", 1), ("square/square_0000.jpg", 2)]
    data = {"path": [p for p, _ in rows], "label": [label for _, label in rows]}
    table = image_folder / f"t.{kind}"
    if kind == "csv":
        table.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows))
    elif kind == "jsonl":
        table.write_text("".join(json.dumps({"path": p, "label": label}) + "\n" for p, label in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(data), table)
    first = 2 if kind == "csv" else 1  # the CSV's header is its line 1; a JSONL's line, a Parquet's row from 1
    given = ["--workers", "1"]
    code, out, err = run_cli(["convert", str(table), str(tmp_path / "out"), *given], capsys)
    assert code == 0, err
    want = {f"t.{kind}:{first + 1}": "path column 'path' names a missing file: circle/gone.jpg",
            f"t.{kind}:{first + 2}": "path column 'path' names a folder, not a file: sub",
            f"t.{kind}:{first + 3}": "path column 'path' is empty or not text ('')"}
    assert skipped_of(tmp_path / "out") == want
    assert Dataset(tmp_path / "out").table.keys == ["circle/circle_0000", "square/square_0000"]
    assert "skipped 3" in out + err and all(f"{where}: {reason}" in out + err for where, reason in want.items())
    code, out, err = run_cli(["convert", str(table), str(tmp_path / "fail"), "--on-error", "fail", *given], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert (f"t.{kind}:{first + 1}: path column 'path' names a missing file: circle/gone.jpg (--on-error fail)"
            in err), err
    assert not (tmp_path / "fail").exists()


def test_root_names_where_paths_start_and_must_stay(tmp_path, image_folder, capsys):
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "t.jsonl").write_text(
        '{"path": "circle/circle_0000.jpg", "label": 0}\n'
        '{"path": "square/square_0000.jpg", "label": 2}\n'
        '{"path": "../elsewhere.jpg", "label": 1}\n')
    (tmp_path / "elsewhere.jpg").write_bytes(b"x")
    code, out, err = run_cli(["convert", str(meta / "t.jsonl"), str(tmp_path / "out"), "--root", str(image_folder)],
                             capsys)
    assert code == 0, err
    assert Dataset(tmp_path / "out").table.keys == ["circle/circle_0000", "square/square_0000"]
    assert list(skipped_of(tmp_path / "out")) == ["t.jsonl:3"]


# -- mixed image formats ------------------------------------------------------------------------------

def test_mixed_formats_convert_verify_and_inspect(tmp_path, capsys):
    src = make_mixed_imagefolder(tmp_path / "src", classes=2, per_class=12)
    assert make_mixed_imagefolder(tmp_path / "again", classes=2, per_class=12) and all(
        (tmp_path / "again" / p.relative_to(src)).read_bytes() == p.read_bytes() for p in src.rglob("*.*"))
    convert(ConvertConfig(source=src, dest=tmp_path / "out", workers=1))
    assert verify(tmp_path / "out", decode=True).ok
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["image_fields"] == sorted(FORMATS.values())
    info = inspect(tmp_path / "out")
    assert info["image_formats"] == {f: 4 for f in ("jpg", "bmp", "gif", "png", "tiff", "webp")}
    assert info["image_sizes"]["probed"] == 24 and info["image_sizes"]["unreadable"] == 0
    assert 48 <= info["image_sizes"]["width"]["min"] <= info["image_sizes"]["width"]["max"] <= 96
    code, out, _ = run_cli(["inspect", str(tmp_path / "out")], capsys)
    assert code == 0 and "images:   bmp 4, gif 4, jpg 4, png 4, tiff 4, webp 4; 24 probed" in out


def test_synthetic_generator_rejects_unknown_formats(tmp_path):
    with pytest.raises(ValueError, match="fmt must be one or more of"):
        make_imagefolder(tmp_path / "x", fmt=("JPEG", "HEIC"))


# -- one writer per DEST ------------------------------------------------------------------------------

def test_second_convert_into_the_same_dest_is_refused(tmp_path):
    """Two real `fastio convert` processes into one DEST: the second is refused naming DEST and the first;
    DEST ends up holding exactly the first one's complete dataset."""
    first = make_imagefolder(tmp_path / "first", classes=4, per_class=60, min_side=96, max_side=160, seed=1)
    second = make_imagefolder(tmp_path / "second", classes=2, per_class=10, seed=2)
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "fastio.cli", "convert"]
    a = subprocess.Popen([*cmd, str(first), str(dest), "--workers", "1", "-q", "--max-side", "64",
                          "--max-samples-per-shard", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (dest / "shards" / "shard-000000.tar").exists():  # the first is writing (1 of 24 shards)
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()
            time.sleep(0.002)
        os.kill(a.pid, signal.SIGSTOP)  # keep it mid-run, deterministically
        assert f'"pid": {a.pid}' in _read(dest / LOCK_NAME) and not (dest / "manifest.json").exists()
        try:
            b = subprocess.run([*cmd, str(second), str(dest), "-q"], capture_output=True, text=True, timeout=120)
            c = subprocess.run([*cmd, str(second), str(dest), "-q", "--overwrite"], capture_output=True, text=True,
                               timeout=120)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        out_a, err_a = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    for refused in (b, c):
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(f"fastio: error: {dest}: in use by "
                                                                             f"fastio convert pid {a.pid}")
    assert a.returncode == 0, err_a
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["source"]["path"] == str(first.resolve()) and manifest["total_samples"] == 240
    assert verify(dest).ok
    # Once the first has finished, a second run may replace DEST (with --overwrite) and is alone again.
    subprocess.run([*cmd, str(second), str(dest), "-q", "--overwrite"], check=True, timeout=120)
    assert json.loads((dest / "manifest.json").read_text())["source"]["path"] == str(second.resolve())
    assert verify(dest).ok


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_lock_file_does_not_make_dest_foreign(tmp_path, image_folder):
    """A run that failed after locking leaves only the lock file: the next run still takes DEST."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / LOCK_NAME).write_text("{}")
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
    assert sorted(p.name for p in dest.iterdir()) == [".fastio-lock", ".fastio-output", "manifest.json", "samples.fxi",
                                                             "shards"]


def test_inputs_that_are_not_samples_do_not_fail_a_strict_run(tmp_path, image_folder):
    """on_error="fail" stops on rejected samples only: a README beside the classes or a hidden file is listed."""
    (image_folder / "README.txt").write_text("about this dataset")
    (image_folder / "circle" / ".DS_Store").write_bytes(b"\0")
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "out", on_error="fail", workers=1))
    assert result.samples == 48
    assert skipped_of(tmp_path / "out") == {"README.txt": "not inside a class folder", "circle/.DS_Store": "hidden"}


def test_parse_labels_fast_path_agrees_with_the_rule():
    from fastio.formats.labels import parse_labels

    good = [b"0", b"7", np.frombuffer(b"123", np.uint8), b"9" * 18, str(LABEL_MAX).encode(), b" 12\n", b"+3"]
    assert parse_labels(good).tolist() == [check_label(bytes(v)) for v in good]
    assert parse_labels([b"4", b"5"]).dtype == np.int64 and parse_labels([]).tolist() == []
    for bad in ([b"1", b""], [b"1_0"], [b"-1"], [str(LABEL_MAX + 1).encode()], [b"9" * 40], [b"\xd9\xa3"]):
        with pytest.raises(ValueError):
            parse_labels(bad)


def test_file_names_that_are_not_utf8_convert_in_one_run_and_in_parts(tmp_path, image_folder):
    """Names from an old archive in Latin-1 (`a\\xfe.jpg`) are not UTF-8: Python holds them with lone surrogates, and
    hashing two that sanitise alike (`a_`), or one too long for a key, or a part's listing, raised a raw
    UnicodeEncodeError. They convert, keys apart, in one run and in parts merged to the same bytes."""
    from fastio.convert.merge import merge

    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    src = os.fsencode(tmp_path / "latin1")
    for name in (b"cl\xffass/a\xfe.jpg", b"cl\xffass/a\xfd.jpg", b"ok/" + b"z" * 80 + b"\xfe.jpg"):
        os.makedirs(os.path.dirname(os.path.join(src, name)), exist_ok=True)
        with open(os.path.join(src, name), "wb") as f:
            f.write(jpg)
    source = Path(os.fsdecode(src))
    one = convert(ConvertConfig(source=source, dest=tmp_path / "one", workers=1, max_samples_per_shard=1))
    assert one.samples == 3 and len(one.renamed) == 1
    assert len(set(Dataset(tmp_path / "one").table.keys)) == 3
    for k in (0, 1):
        convert(ConvertConfig(source=source, dest=tmp_path / "parts", workers=1, max_samples_per_shard=1,
                              part=(k, 2)))
    merge(tmp_path / "parts")
    assert {p.name: p.read_bytes() for p in (tmp_path / "parts" / "shards").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "one" / "shards").iterdir()}
    assert verify(tmp_path / "parts").ok
