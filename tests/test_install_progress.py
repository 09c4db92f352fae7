"""`make install` says what it is doing: one line before each step (pip runs with -q, silent for a minute with a
wheel cache and for many without one). The real Makefile runs here with a stand-in python whose venv's pip only
records its arguments, so nothing is downloaded."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/bin/sh
# python -m venv DIR: a venv whose pip prints its arguments and does nothing else
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
printf '#!/bin/sh\\necho "pip $*"\\n' > "$3/bin/pip"
chmod +x "$3/bin/pip"
"""


def test_make_install_prints_a_numbered_line_before_each_step(tmp_path):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "--no-print-directory", "install", f"PYTHON={python}", f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "MAKEFLAGS": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("make install [")]
    pips = [i for i, line in enumerate(lines) if line.startswith("pip install")]
    assert len(pips) == 8 and len(steps) == 8, lines
    assert [re.match(r"make install \[(\d)/8\] \S", lines[i])[1] for i in steps] == list("12345678")
    assert all(step < pip for step, pip in zip(steps[1:], pips)), lines  # each pip step is announced before it runs
    assert "torch" in lines[steps[2]] and "minutes without a wheel cache" in lines[steps[2]]
    assert lines[-1] == f"make install: done ({venv})" and (venv / ".installed").exists()
