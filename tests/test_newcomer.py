"""Issue 33, a newcomer's first hour: the quickstart on shards made by ``fastio index``, Ctrl-C ending a run with
one line and an exact resume, ``Dataset.num_classes``."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastio import Dataset
from fastio.errors import DatasetError

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"


def fastio_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastio.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """``ds/`` converted from a 10-class image folder (train/val), and ``wds/``: the same tar shards copied into
    plain folders and made datasets by ``fastio index`` (no label map, as for any foreign WebDataset shards)."""
    from fastio.convert.synthetic import make_imagefolder

    base = tmp_path_factory.mktemp("newcomer")
    make_imagefolder(base / "images", classes=10, per_class=20, seed=0)
    assert fastio_cli("convert", "images", "ds", "--split", "train=0.9,val=0.1", "--quiet", cwd=base).returncode == 0
    for split in ("train", "val"):
        (base / "wds" / split).mkdir(parents=True)
        for tar in (base / "ds" / split / "shards").glob("*.tar"):
            shutil.copy(tar, base / "wds" / split / tar.name)
        done = fastio_cli("index", f"wds/{split}", cwd=base)
        assert done.returncode == 0, done.stderr
    return base


def quickstart(warm, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python examples/quickstart.py ARGS`` in ``cwd`` (started by the warm interpreter: conftest's ``warm``)."""
    rc, out, err = warm.run(QUICKSTART, cwd, *args)
    return subprocess.CompletedProcess(QUICKSTART, rc, out, err)


def losses(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", out, re.MULTILINE)}


def interrupt_at(warm, script: Path, cwd: Path, *args: str, prefix: str) -> tuple[int, str]:
    """``python script ARGS`` in ``cwd`` (started by the warm interpreter), sent SIGINT (Ctrl-C, as from a terminal)
    the moment it prints a line starting with ``prefix``; its exit code and stderr."""
    rc, _, err = warm.run(script, cwd, *args, timeout=120, signal_at=(prefix, signal.SIGINT))
    return rc, err


def test_num_classes_of_converted_and_indexed_datasets_agree(data):
    converted, indexed = Dataset(data / "ds" / "train"), Dataset(data / "wds" / "train")
    assert converted.label_map and indexed.label_map is None
    assert converted.num_classes == indexed.num_classes == 10


def test_num_classes_names_a_sample_whose_label_is_not_an_integer(tmp_path):
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=4) as writer:
        for i, cls in enumerate([b"0", b"3", b"cat"]):
            writer.write({"__key__": f"s{i}", "txt": b"x", "cls": cls})
        writer.close(label_field="cls", converted_from={"format": "test"}, skipped=[])
    with pytest.raises(DatasetError, match=r"shard-000000\.tar key 's2': field 'cls' is not an integer label"):
        Dataset(tmp_path / "ds").num_classes  # noqa: B018


def test_num_classes_is_none_without_labels(tmp_path):
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(tmp_path / "ds", max_samples=4) as writer:
        writer.write({"__key__": "s0", "txt": b"x"})
        writer.close(converted_from={"format": "test"}, skipped=[])
    assert Dataset(tmp_path / "ds").num_classes is None


def test_quickstart_trains_on_indexed_shards(data, tmp_path, warm):
    """docs/byo-shards.md: an indexed dataset is an ordinary fastio dataset; the quickstart runs on it (it
    crashed on ``len(label_map)``, None for indexed shards)."""
    done = quickstart(warm, data, "wds", str(tmp_path / "ckpt"), "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done: 12 steps" in done.stdout and "epoch 1 of 1 done: val accuracy" in done.stdout


def test_ctrl_c_ends_the_quickstart_with_one_line_and_the_resume_is_exact(data, tmp_path, warm):
    """SIGINT mid-epoch (what Ctrl-C sends): exit 130, stderr one line naming the saved step and the next command,
    no traceback; the same command resumes from that step and every later step's loss equals an uninterrupted
    run's."""
    straight = quickstart(warm, data, "ds", str(tmp_path / "straight"), "1")
    assert straight.returncode == 0, straight.stderr
    rc, err = interrupt_at(warm, QUICKSTART, data, "ds", str(tmp_path / "ckpt"), "1", prefix="step 8 ")
    assert rc == 130, err
    assert "Traceback" not in err
    saved = one_interrupted_line(err, "quickstart.py", tmp_path / "ckpt")
    assert saved == 5, err  # Ctrl-C at step 8: the save of step 5 is the newest
    resumed = quickstart(warm, data, "ds", str(tmp_path / "ckpt"), "1")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {saved}, 0 of 1 epochs done" in resumed.stdout
    after = losses(resumed.stdout)
    assert sorted(after) == list(range(saved + 1, 13))
    assert after == {k: v for k, v in losses(straight.stdout).items() if k > saved}


def one_interrupted_line(err: str, script: str, ckpt: Path) -> int:
    """The step named by the one line a script interrupted by SIGINT printed (a save every 5 steps)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = re.fullmatch(rf"{script}: interrupted: step (\d+) is saved in {re.escape(str(ckpt))}; run the same command "
                     "to resume", lines[0])
    assert m, err
    return int(m.group(1))


def test_a_fastio_error_in_the_quickstart_is_one_line(data, tmp_path, warm):
    done = quickstart(warm, data, "nowhere", str(tmp_path / "ckpt"), "1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("quickstart.py: error: nowhere/train"), \
        done.stderr


def test_the_quickstart_on_a_flat_image_folder_says_it_has_no_labels_in_one_line(tmp_path, warm):
    """Found by the newcomer review: the README's commands on a flat folder of images (no class folders) converted
    and verified fine, then the quickstart ended in torch's TypeError traceback (nn.Linear(16, None)). Now one line
    naming the dataset and what to do (exit 2), from Dataset.classifier_outputs, a DatasetError for the API."""
    from PIL import Image

    (tmp_path / "images").mkdir()
    for k in range(40):
        Image.new("RGB", (40, 30), (5 * k, 90, 200)).save(tmp_path / "images" / f"p{k}.png")
    done = fastio_cli("convert", "images", "ds", "--split", "train=0.9,val=0.1", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with pytest.raises(DatasetError, match=f"^{tmp_path / 'ds' / 'train'}: a dataset without labels .*: put the "
                                           "images in one folder per class"):
        Dataset(tmp_path / "ds" / "train").classifier_outputs()
    done = quickstart(warm, tmp_path, "ds", str(tmp_path / "ckpt"), "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("quickstart.py: error: ds/train: a dataset without labels"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_quickstart_prints_its_usage_for_help_and_an_epochs_that_is_not_a_number(tmp_path, warm):
    """Found by the integrations review: `python examples/quickstart.py --help` read --help as DATA, made ./ckpt
    (its lock file inside) and said `--help/train: no such dataset directory`; EPOCHS `two` ended in int()'s
    ValueError traceback. Both print the usage now (exit 1), and make nothing."""
    for args in (["--help"], ["-h"], ["ds", "ckpt", "two"]):
        done = quickstart(warm, tmp_path, *args)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "python examples/quickstart.py [DATA [CKPT_DIR [EPOCHS]]]" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_readme_fits_two_screens_and_starts_with_the_two_setup_commands():
    """A quickstart a newcomer reads whole: at most 250 lines, the two commands of a fresh clone first."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = re.search(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert first and first.group(1) == "bash"
    assert [line.split("#")[0].strip() for line in first.group(2).splitlines()] == ["make demo", "make test"]


def summary_rows(page: Path) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first table of a Markdown page."""
    lines = [line for line in page.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return table[0], table[2:]


def test_performance_page_starts_with_one_table_read_one_way():
    """docs/performance.md's top table: one row per figure with fastio, peer, ratio, which way is better, target,
    met and source; 'met' agrees with the ratio and the target in the row's own direction."""
    page = ROOT / "docs" / "performance.md"
    header, rows = summary_rows(page)
    assert header == ["what", "fastio", "peer", "ratio", "better is", "target", "met", "source"]
    intro = page.read_text().split("\n| what |", 1)[0]
    # each source the page defines before its table (A to Z, then AA)
    sources = set(re.findall(r"\*\*([A-Z]{1,2})\*\*,", intro))
    assert {"A", "B", "H"} <= sources
    assert len(rows) >= 15
    checked = 0
    for what, _, _, ratio, better, target, met, source in rows:
        assert better in ("higher", "lower"), what
        assert source in sources, what
        value = re.match(r"[0-9.]+", ratio)
        bound = re.match(r"(>=|<=) ([0-9.]+)$", target)
        if value and bound:
            assert bound.group(1) == (">=" if better == "higher" else "<="), what
            ok = float(value.group()) >= float(bound.group(2)) if better == "higher" else \
                float(value.group()) <= float(bound.group(2))
            assert met.startswith("yes" if ok else "no"), what
            checked += 1
        elif target == "—":
            assert met == "reported", what
    assert checked >= 12


def train_py(data: Path, ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "train.py"), "--data", str(data / "ds" / "train"), "--ckpt-dir",
            str(ckpt), "--steps", "20", "--every-steps", "5", *extra]


def train_py_warm(warm, data: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess:
    """``train_py``'s command, started by the warm interpreter (conftest's ``warm``) in this directory."""
    script, *args = train_py(data, ckpt, *extra)[1:]
    rc, out, err = warm.run(Path(script), Path.cwd(), *args)
    return subprocess.CompletedProcess(script, rc, out, err)


def test_ctrl_c_ends_train_py_with_one_line_and_the_resume_ends_bitwise_equal(data, tmp_path, warm):
    """examples/train.py under SIGINT: exit 130, one line naming the saved step; the same command resumes and
    ends with the weights of an uninterrupted run, bit for bit."""
    straight = train_py_warm(warm, data, tmp_path / "straight", "--quiet")
    assert straight.returncode == 0, straight.stderr
    script, *args = train_py(data, tmp_path / "ckpt")[1:]
    rc, err = interrupt_at(warm, Path(script), Path.cwd(), *args, prefix="step 7 ")
    assert rc == 130 and "Traceback" not in err, err
    saved = one_interrupted_line(err, "train.py", tmp_path / "ckpt")
    assert saved == 5, err  # Ctrl-C at step 7: the save of step 5 is the newest
    resumed = train_py_warm(warm, data, tmp_path / "ckpt", "--quiet")
    assert resumed.returncode == 0 and f"resumed from step {saved}" in resumed.stdout, resumed.stderr

    def digest(out: str) -> str:
        return re.search(r"^final weights sha256: (\w+)$", out, re.MULTILINE).group(1)

    assert digest(resumed.stdout) == digest(straight.stdout)
