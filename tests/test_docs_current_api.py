"""What a newcomer reads first shows the current API: the README's code, every example and every doc snippet use the
pipeline objects (not the old `pipeline="image-train", image_size=` spelling, refused since 0.1), and
every synthetic-data helper the docs and examples use is in the API reference (docs/reference.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_SPELLING = re.compile(r"""pipeline\s*=\s*["']|\bimage_size\s*=""")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_the_readme_and_the_quickstart_use_the_pipeline_objects():
    code = python_blocks((ROOT / "README.md").read_text()) + [(ROOT / "examples" / "quickstart.py").read_text()]
    old = [line.strip() for block in code for line in block.splitlines() if OLD_SPELLING.search(line)]
    assert old == []
    assert "pipeline=fastio.ImageTrain(size=32)" in code[-1] and "pipeline=fastio.ImageEval(size=32)" in code[-1]



def test_the_synthetic_helpers_the_docs_show_are_in_the_api_reference():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
    shown = set()
    for page in pages:
        text = page.read_text()
        shown |= set(re.findall(r"fastio\.convert\.synthetic\.(\w+)", text))
        for names in re.findall(r"from fastio\.convert\.synthetic import ([\w, ]+)", text):
            shown |= {n.strip() for n in names.split(",")}
    assert {"make_imagefolder", "make_video"} <= shown
    documented = set(re.findall(r"^::: fastio\.convert\.synthetic\.(\w+)$", (ROOT / "docs" / "reference.md").read_text(),
                                re.M))
    assert shown <= documented, sorted(shown - documented)


def old_spellings(root: Path) -> list[str]:
    """``file: line`` of each old-spelling line in the examples and the docs' code (refused since 0.1: no page
    shows one as code, docs/loader.md included)."""
    code = [(path, path.read_text()) for path in sorted((root / "examples").glob("*.py"))]
    code += [(path, block) for path in sorted((root / "docs").glob("*.md")) for block in python_blocks(path.read_text())]
    return [f"{path.relative_to(root)}: {line.strip()}" for path, text in code for line in text.splitlines()
            if OLD_SPELLING.search(line)]


def test_every_example_and_doc_snippet_uses_the_pipeline_objects():
    assert old_spellings(ROOT) == []
