"""A name the CLI prints that no encoding can write (a lone surrogate: a JSON ``\\ud800`` escape in a table's path, a
file name of bytes that are not UTF-8 as Python reads it) is printed escaped, never a UnicodeEncodeError traceback
after the work is done (the dataset written, exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys

from PIL import Image


def test_a_skipped_path_holding_a_lone_surrogate_is_listed_escaped_and_the_run_succeeds(tmp_path):
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "a.png")
    (tmp_path / "t.jsonl").write_text('{"path": "a.png", "label": "x"}\n{"path": "c\\ud800.png", "label": "y"}\n')
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # strict, as a UTF-8 locale's stdout is
    proc = subprocess.run([sys.executable, "-m", "fastio.cli", "convert", str(tmp_path / "t.jsonl"),
                           str(tmp_path / "d"), "--workers", "1"], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "c\\ud800.png" in proc.stdout and (tmp_path / "d" / "manifest.json").exists()
