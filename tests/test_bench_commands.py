"""Every `python -m bench.NAME ...` (or `python bench/NAME.py ...`) command line the docs show parses with that
module's real argparse parser (nothing is run): a documented flag that the bench refuses fails here."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:python3? +(?:-m +bench\.(\w+)|bench/(\w+)\.py)|bench/(\w+)\.py(?= +-))(.*)$")


def code_spans(text: str) -> list[str]:
    """The page's inline code spans (one span may wrap over lines) and the lines of its fenced blocks."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    inline = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", inline)] + [
        line.split("#")[0].strip() for block in fenced for line in block.splitlines()]


def commands() -> list[tuple[str, str, str, list[str]]]:
    """``(page, command line, bench module, its arguments)`` for every bench command the pages show."""
    found = []
    for page in PAGES:
        for span in code_spans(page.read_text()):
            m = COMMAND.match(span)
            module = m and next(g for g in m.groups()[:3] if g)
            if module and not module.isupper():  # `python -m bench.NAME` names no module
                found.append((page.name, span, module, shlex.split(m.group(4))))
    return found


def test_the_docs_show_bench_commands_of_every_kind():
    found = commands()
    assert len(found) >= 20
    shown = {module for _, _, module, _ in found}
    assert {"run", "loader", "tokens", "media", "restart", "checkpoint_overhead", "mixture", "index"} <= shown
    assert any(module == "run" and "--out" in args for _, _, module, args in found)


@pytest.mark.parametrize(("page", "line", "module", "args"), commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_documented_bench_command_parses(page, line, module, args):
    parser = importlib.import_module(f"bench.{module}").parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit as exit:
        pytest.fail(f"{page}: `{line}` does not parse (exit {exit.code}): {err.getvalue().strip()}")
