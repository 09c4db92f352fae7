"""A bad value of a ``fastio convert`` flag is refused in one line in the command's own words: naming the flag as
typed (``--progress-every``, whose config field is ``progress_every_s``) and saying "not given" as the command
says it (``--max-pixels 0`` is no limit), never with Python's ``None``, which no flag takes."""

from __future__ import annotations

import pytest
from helpers import run_cli


@pytest.mark.parametrize("flags, named, words", [
    (["--progress-every", "0"], "--progress-every must be > 0", "got 0.0"),
    (["--max-pixels", "-1"], "--max-pixels must be positive", "(0 for no limit)"),
    (["--split", "val=0.5", "--split-by", "nope"], "--split-by must be one of label, random", "got 'nope'"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_bad_convert_flag_value_is_named_in_the_commands_words(image_folder, tmp_path, capsys, flags, named, words):
    dest = tmp_path / "out"
    code, _, err = run_cli(["convert", str(image_folder), str(dest), *flags], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert named in err and words in err, err
    assert "None" not in err and "progress_every_s" not in err, err
    assert not dest.exists()
