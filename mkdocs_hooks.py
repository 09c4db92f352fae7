"""mkdocs hooks (mkdocs.yml ``hooks:``) for ``make docs``.

- ``docs/quickstart.md`` is the repository's ``README.md``: its text is put in that page at build time, with
  its ``docs/X.md`` links made relative to the site (one source: the README a clone shows first).
- Sphinx roles in the docstrings (``:class:`X```, ``:func:`~a.b```) become plain code in the API reference
  (mkdocstrings renders Markdown, where a role shows as raw text); ``~`` keeps the last name, as Sphinx does.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
README_PAGE = "quickstart.md"
_ROLE_HTML = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")
_DOCS_LINK = re.compile(r"\]\(docs/")


def readme_markdown() -> str:
    """README.md with its links into docs/ made relative to a page of docs/."""
    return _DOCS_LINK.sub("](", (ROOT / "README.md").read_text())


def plain_roles(html: str) -> str:
    """``:class:<code>~a.B</code>`` (a role mkdocstrings left as text) -> ``<code>B</code>``."""
    return _ROLE_HTML.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    return readme_markdown() if page.file.src_uri == README_PAGE else markdown


def on_page_content(html: str, page, **kwargs) -> str:
    return plain_roles(html)
