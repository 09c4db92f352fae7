"""Every bad input to `fastio convert / verify / inspect` is one stderr line naming the thing, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("fastio: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def table(folder: Path, name: str, body: str) -> Path:
    (folder / name).write_text(body)
    return folder / name


def mkdir(path: Path) -> Path:
    path.mkdir()
    return path


CASES = {
    "missing source": lambda t, f: ([str(t / "nope"), str(t / "out")], ["nope: no such file or directory"]),
    "empty source": lambda t, f: ([str(mkdir(t / "empty")), str(t / "out")], ["empty: source directory is empty"]),
    "unknown format": lambda t, f: ([str(f), str(t / "out"), "--format", "tfrecord"],
                                    ["unknown format 'tfrecord'", "imagefolder"]),
    "format needs a file": lambda t, f: ([str(f), str(t / "out"), "--format", "csv"], ["format csv needs a file"]),
    "unreadable csv": lambda t, f: ([str(table(t, "t.csv", "path,label\na,1,2\n")), str(t / "out")],
                                    ["t.csv:2: unreadable table"]),
    "unreadable jsonl": lambda t, f: ([str(table(t, "t.jsonl", "{bad json\n")), str(t / "out")],
                                      ["t.jsonl:1: unreadable table (invalid JSON"]),
    "jsonl nested too deeply": lambda t, f: ([str(table(t, "d.jsonl", '{"path": ' + "[" * 200_000 + "]" * 200_000
                                                        + "}\n")), str(t / "out")],
                                             ["d.jsonl:1: unreadable table (JSON nested too deeply to read)"]),
    "unreadable parquet": lambda t, f: ([str(table(t, "t.parquet", "PAR1 no")), str(t / "out")],
                                        ["t.parquet: unreadable table"]),
    "path column names missing file": lambda t, f: (
        [str(table(f.parent, "t.csv", "path,label\nsrc/circle/circle_0000.jpg,a\nsrc/gone.jpg,b\n")), str(t / "out"),
         "--on-error", "fail"],
        ["t.csv:3: path column 'path' names a missing file: src/gone.jpg (--on-error fail)"]),
    "no path column": lambda t, f: ([str(table(t, "t.csv", "name,label\na,1\n")), str(t / "out")],
                                    ["t.csv: no path column", "--path-column"]),
    "bad shard size": lambda t, f: ([str(f), str(t / "out"), "--shard-size", "lots"], ["--shard-size", "'lots'"]),
    "bad split": lambda t, f: ([str(f), str(t / "out"), "--split", "val=2"], ["--split", "'val'"]),
    "bad on-error": lambda t, f: ([str(f), str(t / "out"), "--on-error", "ignore"], ["--on-error", "'ignore'"]),
    "zero workers": lambda t, f: ([str(f), str(t / "out"), "--workers", "0"], ["--workers must be a positive integer"]),
    "dest is a file": lambda t, f: ([str(f), str(table(t, "file.txt", "x"))], ["file.txt: exists and is not a directory"]),
    "dest below a file": lambda t, f: ([str(f), str(table(t, "file2.txt", "x") / "sub")],
                                       ["file2.txt/sub: Not a directory"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_bad_input(case, tmp_path, image_folder, capsys):
    args, needles = CASES[case](tmp_path, image_folder)
    code, out, err = run_cli(["convert", *args], capsys)
    assert_one_line_error(code, err, *needles)
    assert out == ""
    assert not (tmp_path / "out").exists()  # a rejected run leaves no DEST behind


def test_foreign_dest_needs_overwrite(tmp_path, image_folder, capsys):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("x")
    code, _, err = run_cli(["convert", str(image_folder), str(dest)], capsys)
    assert_one_line_error(code, err, f"{dest}: directory is not empty and is not fastio output", "--overwrite")
    assert (dest / "mine.txt").exists()


def test_existing_dataset_needs_overwrite(tmp_path, image_folder, capsys):
    dest = tmp_path / "dest"
    assert run_cli(["convert", str(image_folder), str(dest), "-q"], capsys)[0] == 0
    code, _, err = run_cli(["convert", str(image_folder), str(dest)], capsys)
    assert_one_line_error(code, err, f"{dest}: already holds a converted dataset; pass --overwrite")
    assert run_cli(["convert", str(image_folder), str(dest), "-q", "--overwrite"], capsys)[0] == 0


def test_corrupt_image_with_on_error_fail(tmp_path, image_folder, capsys):
    bad = image_folder / "square" / "square_0004.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not much of a jpeg")
    code, _, err = run_cli(["convert", str(image_folder), str(tmp_path / "out"), "--on-error", "fail"], capsys)
    assert_one_line_error(code, err, f"{bad}: ", "--on-error fail")


def test_every_sample_bad(tmp_path, capsys):
    src = tmp_path / "src" / "only"
    src.mkdir(parents=True)
    (src / "a.jpg").write_bytes(b"nope")
    code, _, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, "every sample was skipped", "only/a.jpg")


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_verify_and_inspect_of_non_dataset(command, tmp_path, capsys):
    code, _, err = run_cli([command, str(tmp_path / "missing")], capsys)
    assert_one_line_error(code, err, f"{tmp_path / 'missing'}: no such dataset directory")


def test_real_process_prints_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fastio.cli", "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"fastio: error: {tmp_path / 'nope'}: no such file or directory\n"


def test_field_name_too_long_for_tar(tmp_path, image_folder, capsys):
    table = image_folder.parent / "wide.csv"
    table.write_text("path," + "c" * 120 + "\nsrc/circle/circle_0000.jpg,x\n")
    code, _, err = run_cli(["convert", str(table), str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, "src/circle/circle_0000.jpg: cannot be stored", "over 100 characters")


def test_inspect_names_a_missing_mixture_file_and_refuses_a_negative_epoch(tmp_path, capsys):
    from helpers import run_cli

    code, _, err = run_cli(["inspect", str(tmp_path / "mix.json")], capsys)
    assert code == 2 and f"{tmp_path / 'mix.json'}: cannot read the mixture file" in err
    code, _, err = run_cli(["inspect", str(tmp_path), "--order", "--epoch", "-1"], capsys)
    assert code == 2 and "--epoch" in err and "-1" in err


@pytest.mark.parametrize("args", [
    ["convert", "{src}", "", "--overwrite"], ["convert", "", "out"], ["index", "{shards}", "--dest", "", "--overwrite"],
    ["index", "{shards}", "--dest", " "], ["merge", "", "--overwrite"], ["verify", ""], ["inspect", ""],
], ids=lambda a: " ".join(a[:4]))
def test_an_empty_path_is_refused_never_read_as_the_current_folder(args, tmp_path, image_folder, capsys, monkeypatch):
    # Found by the newcomer pass: `fastio convert SRC "$DEST" --overwrite` with DEST unset replaced the contents of the
    # current folder with a dataset (its files deleted): '' was read as '.'. So was SOURCE, `index --dest`, merge's,
    # verify's and inspect's DEST (as `fastio ckpt ls ''` was before it was refused).
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(b"\0" * 1024)
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("the user's only copy")
    monkeypatch.chdir(here)
    args = [a.format(src=image_folder, shards=shards) for a in args]
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, "empty")
    assert sorted(p.name for p in here.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args", [["index", ""], ["index", " ", "--eos-id", "0"]], ids=["index", "index --eos-id"])
def test_an_empty_index_source_says_what_to_give(args, capsys):
    # Found by the newcomer review (round 4): `fastio index "$SRC"` with SRC unset said only 'source: empty', where
    # convert, merge, verify and inspect name the way out (storage.url.refuse_empty, the one home of that rule).
    code, _, err = run_cli(args, capsys)
    assert code == 2 and err == (f"fastio: error: the path given is empty ({args[1]!r}): name the folder ('.' for the "
                                 "current one)\n"), err
