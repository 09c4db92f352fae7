"""A table option (``--path-column``, ``--label-column``, ``--key-column``, ``--root``, ``--labels``; "Tables: ..."
in ``fastio convert --help``) given for a source that is no table (an image folder, loose files, an image-text
JSONL) is refused in one line naming the flag, before DEST is touched: it used to be parsed and silently
ignored, so a user who meant it got a dataset made without it."""

from __future__ import annotations

import pytest
from helpers import run_cli
from tokens_helpers import image_text_source

TABLE_FLAGS = [["--label-column", "cls"], ["--path-column", "path"], ["--key-column", "key"], ["--labels", "names"]]


@pytest.mark.parametrize("flag", [*TABLE_FLAGS, ["--root", "."]], ids=lambda f: f[0])
def test_a_table_option_for_an_image_folder_is_refused_naming_the_flag(image_folder, tmp_path, capsys, flag):
    dest = tmp_path / "out"
    code, out, err = run_cli(["convert", str(image_folder), str(dest), "--workers", "1", *flag], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("fastio: error: ")
    assert f"{flag[0]} " in err and "imagefolder" in err and "table" in err
    assert not dest.exists()


def test_a_table_option_for_loose_files_is_refused(tmp_path, capsys):
    src = tmp_path / "files"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "out"), "--labels", "integers"], capsys)
    assert code == 2 and "--labels integers" in err and "files" in err


@pytest.mark.parametrize("flag", [*TABLE_FLAGS, ["--format", "jsonl"]], ids=lambda f: f[0])
def test_a_table_option_for_an_image_text_conversion_is_refused(tmp_path, capsys, flag):
    src = image_text_source(tmp_path, n=2)
    dest = tmp_path / "vlm"
    code, _, err = run_cli(["convert", str(src["source"]), str(dest), "--tokenizer", str(src["tokenizer"]),
                            "--chat-template", str(src["config"]), "--image-field", "images", "--workers", "1",
                            *flag], capsys)
    assert code == 2
    assert err.count("\n") == 1 and f"{flag[0]} " in err and "image-text" in err
    assert not dest.exists()


def test_table_options_still_apply_to_a_table(image_folder, tmp_path, capsys):
    rows = sorted(image_folder.rglob("*.jpg"))[:4]
    (tmp_path / "t.csv").write_text("file,kind\n" + "".join(f"{p},{p.parent.name}\n" for p in rows))
    code, _, err = run_cli(["convert", str(tmp_path / "t.csv"), str(tmp_path / "out"), "--workers", "1", "-q",
                            "--root", "/", "--label-column", "kind", "--labels", "names"], capsys)
    assert code == 0, err
