"""Every ```python block of README.md and docs/*.md runs, and the README's quickstart is examples/quickstart.py.

Each block runs as a standalone script (``python snippet.py``) in a fresh temporary directory holding
``./images/`` (``fastio.convert.synthetic.make_imagefolder``: 10 classes of small JPEGs) and ``./ds/`` (that folder
converted by ``fastio convert images ds --split train=0.9,val=0.1``: ``ds/train``, ``ds/val``), both made once
per session. A snippet that cannot run there lives under ``examples/`` and is run by a test of its own.
The snippets and the quickstart's runs (its preempted one too) are started by ``tests/warm_python.py`` (a child
forked from an interpreter that imported torch and DALI once: ``python snippet.py`` without the ~2 s of those imports
each time).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of every fenced ```python block of a Markdown page."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


def distinct_snippets() -> list:
    """Every block once: the README's copy of examples/quickstart.py is run (preempted and resumed) by its own
    test below, and a block shown on two pages (the README's trainer scripts, also in docs/trainers.md) runs once."""
    seen = {QUICKSTART.read_text().rstrip()}
    params = []
    for page in PAGES:
        for line, code in python_blocks(page):
            if code.rstrip() not in seen:
                seen.add(code.rstrip())
                params.append(pytest.param(page, line, code, id=f"{page.relative_to(ROOT)}:{line}"))
    return params


SNIPPETS = distinct_snippets()


@pytest.fixture(scope="session")
def docs_data(tmp_path_factory) -> Path:
    """``images/`` and ``ds/`` as the documentation's snippets expect them."""
    from fastio.convert.synthetic import make_imagefolder

    base = tmp_path_factory.mktemp("docs-data")
    make_imagefolder(base / "images", classes=10, per_class=20, seed=0)
    subprocess.run([sys.executable, "-m", "fastio.cli", "convert", "images", "ds", "--split", "train=0.9,val=0.1",
                    "--quiet"], cwd=base, check=True)
    return base


@pytest.fixture
def workdir(docs_data, tmp_path) -> Path:
    """A fresh directory with copies of ``images/`` and ``ds/`` (a snippet may write into them)."""
    for name in ("images", "ds"):
        shutil.copytree(docs_data / name, tmp_path / name)
    return tmp_path


def test_the_pages_have_snippets():
    """The fence pattern finds blocks (a changed pattern must not make every snippet test vanish)."""
    assert len(SNIPPETS) >= 4
    assert python_blocks(ROOT / "README.md")


@pytest.mark.parametrize("page,line,code", SNIPPETS)
def test_snippet_runs(page, line, code, workdir, warm):
    script = workdir / "snippet.py"
    script.write_text(code)
    rc, out, err = warm.run(script, workdir)
    assert rc == 0, f"{page.relative_to(ROOT)}:{line}: the snippet exited {rc}\n{out[-3000:]}\n{err[-3000:]}"


def test_readme_quickstart_is_the_tested_example():
    """The README shows examples/quickstart.py verbatim, so the code a newcomer copies is the code tested here."""
    example = (ROOT / "examples" / "quickstart.py").read_text().rstrip()
    assert any(code.rstrip() == example for _, code in python_blocks(ROOT / "README.md"))


def run_quickstart(warm, workdir: Path, *args: str) -> str:
    rc, out, err = warm.run(ROOT / "examples" / "quickstart.py", workdir, *args)
    assert rc == 0, out + err
    return out


def test_quickstart_preempted_resumes_and_a_finished_run_trains_nothing(workdir, warm):
    """SIGUSR1 mid-epoch: the run saves, says so and exits 0; the same command resumes at that step and ends
    at the same step count as an uninterrupted run would (180 train samples, batch 16: 12 steps an epoch);
    a third launch restores the final save and trains nothing."""
    rc, out, err = warm.run(QUICKSTART, workdir, signal_at=("step 3 ", signal.SIGUSR1))
    assert rc == 0, out + err
    saved = re.search(r"^preempted: saved step (\d+)", out, re.MULTILINE)
    assert saved, out
    at = int(saved.group(1))
    assert at == 3, out  # the signal came as step 3 was printed: that step's save is the blocking one

    second = run_quickstart(warm, workdir)
    assert f"resumed at step {at}, 0 of 2 epochs done" in second
    assert f"step {at + 1} " in second and "done: 24 steps" in second
    # the epochs are counted one way: the first to end after "0 of 2 epochs done" is "epoch 1 of 2"
    assert re.findall(r"^epoch (\d) of 2 done: val accuracy [0-9.]+$", second, re.MULTILINE) == ["1", "2"], second

    third = run_quickstart(warm, workdir)
    assert "resumed at step 24, 2 of 2 epochs done" in third and "done: 24 steps" in third
    assert not re.search(r"^step \d+ ", third, re.MULTILINE), third


def test_quickstart_on_a_split_smaller_than_a_batch_says_so_in_the_line_the_readme_quotes(tmp_path, warm):
    """Found by the newcomer review (round 4): a folder of 80 images, converted as the README says, gave a ds/val of
    8 samples, and the quickstart stopped with one line the README did not prepare for. Its validation Loader reads
    with remainder='partial', which now takes a split smaller than a batch (one batch of its 8 samples); a training
    split smaller than a batch still stops with the one line the README quotes."""
    from fastio.convert.synthetic import make_imagefolder

    make_imagefolder(tmp_path / "images", classes=4, per_class=20, seed=0)
    subprocess.run([sys.executable, "-m", "fastio.cli", "convert", "images", "ds", "--split", "train=0.9,val=0.1",
                    "--quiet"], cwd=tmp_path, check=True)
    rc, out, err = warm.run(QUICKSTART, tmp_path, "ds", "ckpt", "1")
    assert rc == 0 and "epoch 1 of 1 done: val accuracy" in out, out + err
    make_imagefolder(tmp_path / "few", classes=2, per_class=5, seed=0)
    subprocess.run([sys.executable, "-m", "fastio.cli", "convert", "few", "small", "--split", "train=0.9,val=0.1",
                    "--quiet"], cwd=tmp_path, check=True)
    rc, out, err = warm.run(QUICKSTART, tmp_path, "small", "ckpt-small")
    line = ("quickstart.py: error: small/train: batch_size 16 is larger than the dataset (9 samples): give a smaller "
            "batch_size, or remainder='partial' for one batch of them")
    assert rc == 2 and err.strip() == line, out + err
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    assert f"`{line.replace('small/', 'ds/')}` (exit 2)" in readme


def test_s3_example_against_a_local_s3_server(aws_env, s3_bucket, warm):
    """docs/storage.md's example (examples/s3.py): convert to s3://, load through the cache, checkpoint to
    s3://, restore in a new Checkpointer; the endpoint and credentials only in the environment (``aws_env``'s,
    given to the run)."""
    rc, out, err = warm.run(ROOT / "examples" / "s3.py", Path.cwd(), f"s3://{s3_bucket}/run", env=dict(os.environ))
    assert rc == 0, out + err
    assert re.search(r"^restored step (\d+) from s3://", out, re.MULTILINE), out


def test_s3_example_help_and_a_missing_bucket_in_one_line(aws_env, s3_bucket, warm, tmp_path):
    """Found by the integrations review: `python examples/s3.py --help` generated images and ran `fastio convert
    ... --help/data`, ending in a CalledProcessError traceback; a bucket that does not exist printed the CLI's line
    and then that traceback too. Now --help prints the usage, a PREFIX that is not an s3:// URL is refused, and a
    failed conversion ends the run with the CLI's own line and its exit code."""
    rc, out, err = warm.run(ROOT / "examples" / "s3.py", tmp_path, "--help", env=dict(os.environ))
    assert rc == 0 and "python examples/s3.py s3://bucket/prefix" in out and not err, out + err
    rc, out, err = warm.run(ROOT / "examples" / "s3.py", tmp_path, "bucket/prefix", env=dict(os.environ))
    assert rc == 2 and "s3.py: error: bucket/prefix: not an s3:// URL" in err and "Traceback" not in err, err
    rc, out, err = warm.run(ROOT / "examples" / "s3.py", tmp_path, f"s3://{s3_bucket}-missing/run",
                            env=dict(os.environ))
    assert rc == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and f"{s3_bucket}-missing" in err, err
    assert list(tmp_path.iterdir()) == []


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) gives a heading."""
    text = re.sub(r"[`*]", "", heading).strip()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists (and a heading on that page);
    `make docs` checks the same for the site, strictly, where mkdocs is installed."""
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (strictly: a warning fails), into a temporary folder."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.docs
def test_site_builds_strictly(site):
    """`make docs`: the site and the API reference build with no warning (a broken link, anchor or reference
    fails). Marked ``docs``: it needs the `docs` extra (mkdocs), which `make docs` installs and `make test` does not
    (it deselects the test); run by another command where mkdocs is missing, it says so and skips."""
    reference = (site / "reference.html").read_text()
    assert "Samples per batch on each rank" in reference
    quickstart = re.sub(r"<[^>]+>", "", (site / "quickstart.html").read_text())
    assert "with fastio.exit_cleanly(ckpt):" in quickstart  # the README (its quickstart) is a page


BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`?[\w~]")  # a role with its target


def rendered(page: Path) -> str:
    """The page's DOM after a real headless browser loaded it from file:// (scripts run)."""
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


@pytest.mark.docs
def test_site_browses_from_disk_in_a_headless_browser(site):
    """`make docs` says "open site/index.html": in a real browser over file://, every page's every link names a
    file (a page, not a folder, which a browser would list) and every #anchor exists on its page; no Sphinx role
    shows as raw text; the API reference shows the Loader's constructor signature. Skips, saying why, where no
    Chromium is installed (`make docs` installs Debian's `chromium`)."""
    from concurrent.futures import ThreadPoolExecutor
    from html import unescape
    from urllib.parse import unquote, urljoin, urlsplit

    if BROWSER is None:
        pytest.skip("no chromium on PATH (make docs installs Debian's chromium package)")
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # a server's page, links from /
    with ThreadPoolExecutor(4) as pool:
        doms = dict(zip(pages, pool.map(rendered, pages)))
    ids = {page: set(re.findall(r'\bid="([^"]+)"', dom)) for page, dom in doms.items()}
    broken, raw = [], []
    for page, dom in doms.items():
        for href in re.findall(r'<a\b[^>]*\bhref="([^"]*)"', dom):
            url = urlsplit(urljoin(page.as_uri(), unescape(href)))
            if url.scheme != "file":
                continue
            target = Path(unquote(url.path))
            if not target.is_file():
                broken.append(f"{page.name}: {href} ({'a folder' if target.is_dir() else 'no such file'})")
            elif url.fragment and target in ids and unquote(url.fragment) not in ids[target]:
                broken.append(f"{page.name}: {href} (no such anchor)")
        text = re.sub(r"<[^>]+>", "", re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.DOTALL))
        raw += [f"{page.name}: ...{text[m.start() - 40:m.end() + 40]!r}" for m in ROLE.finditer(unescape(text))]
    assert not broken, "\n".join(broken)
    assert not raw, "\n".join(raw)
    signature = re.sub(r"<[^>]+>|\s+", "", doms[site / "reference.html"])
    assert ("Loader(dest:str|Path|Dataset|Mixture,config:LoaderConfig|None=None,*,replicas:Any=None,**overrides:Any"
            in unescape(signature))
