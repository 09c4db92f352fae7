"""`fastio convert` end to end: determinism, shuffle, split, limits, bad samples, DEST rules, kill-and-rerun."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from fastio.cli import main
from fastio.convert.run import ConvertConfig, convert, parse_size, parse_split
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, MARKER_NAME
from fastio.errors import ConvertError, DatasetError
from fastio.progress import progress_wanted
from fastio.report.verify import verify
from fastio.storage.lock import LOCK_NAME


def tree(dest: Path) -> dict[str, bytes]:
    """Every file under ``dest`` (hidden ones included, but the writer lock, which names its holder) by relative path."""
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def keys(dest: Path) -> list[str]:
    return Dataset(dest).table.keys


@pytest.mark.parametrize("text, value", [
    ("256MB", 256 * 10**6), ("1GiB", 2**30), ("500k", 500_000), ("1024", 1024), ("1.5 MiB", 1572864),
    ("64kb", 64_000), (4096, 4096),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MB", "12 parsecs", "0", "-5MB", "1 iB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="^shard_size"):
        parse_size(text)


def test_parse_split():
    assert parse_split("val=0.05") == {"val": 0.05}
    assert parse_split("val=0.1,test=0.2") == {"val": 0.1, "test": 0.2}
    assert parse_split("train=0.9,val=0.1") == parse_split("val=0.1,train=0.9") == {"val": 0.1}
    assert parse_split("train=0.8,val=0.1,test=0.1") == {"val": 0.1, "test": 0.1}
    for bad in ("val", "val=x", "val=1.5", "train=0.1", "a=0.6,b=0.5", "v al=0.1", "train=0.8,val=0.1",
                "train=0.5,train=0.4,val=0.1"):
        with pytest.raises(ValueError, match="^split: "):
            parse_split(bad)


def test_same_bytes_for_any_worker_count(tmp_path, image_folder):
    outs = []
    for workers in (1, 3):
        dest = tmp_path / f"w{workers}"
        convert(ConvertConfig(source=image_folder, dest=dest, workers=workers, shuffle=True, seed=3,
                              split="val=0.25", max_samples_per_shard=5, max_side=64, quality=80))
        outs.append(tree(dest))
    assert outs[0] == outs[1]
    assert "train/shards/shard-000007.tar" in outs[0] and "val/manifest.json" in outs[0]


def test_shuffle_is_a_seeded_permutation(tmp_path, image_folder):
    plain = keys(convert(ConvertConfig(source=image_folder, dest=tmp_path / "a", workers=1)).dest)
    s0 = keys(convert(ConvertConfig(source=image_folder, dest=tmp_path / "b", workers=1, shuffle=True)).dest)
    s1 = keys(convert(ConvertConfig(source=image_folder, dest=tmp_path / "c", workers=1, shuffle=True,
                                    seed=1)).dest)
    assert plain == sorted(plain)
    assert sorted(s0) == sorted(s1) == plain
    assert s0 != plain and s1 != s0
    manifest = json.loads((tmp_path / "b" / MANIFEST_NAME).read_text())
    assert manifest["convert_options"]["shuffle"] is True and manifest["convert_options"]["seed"] == 0


def test_split_writes_complete_disjoint_datasets(tmp_path, image_folder):
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "d", workers=1, split="val=0.25"))
    train, val = Dataset(tmp_path / "d" / "train"), Dataset(tmp_path / "d" / "val")
    assert (len(train), len(val)) == (36, 12)
    assert set(train.table.keys).isdisjoint(val.table.keys)
    everything = sorted(f"{p.parent.name}/{p.stem}" for p in image_folder.rglob("*.jpg"))
    assert sorted(train.table.keys + val.table.keys) == everything
    assert train.table.keys == sorted(train.table.keys)  # no --shuffle: source order within each split
    assert train.label_map == val.label_map == {"circle": 0, "hstripes": 1, "square": 2, "vstripes": 3}
    splits = json.loads((tmp_path / "d" / "splits.json").read_text())["splits"]
    assert splits == {"train": {"samples": 36, "fingerprint": train.fingerprint},
                      "val": {"samples": 12, "fingerprint": val.fingerprint}}
    assert result.samples == 48 and verify(tmp_path / "d").ok
    again = convert(ConvertConfig(source=image_folder, dest=tmp_path / "e", workers=2, split="val=0.25"))
    assert keys(again.dest / "val") == val.table.keys  # same seed, other worker count: same split
    other = convert(ConvertConfig(source=image_folder, dest=tmp_path / "f", workers=1, split="val=0.25", seed=5))
    assert keys(other.dest / "val") != val.table.keys


def test_shard_size_and_sample_limits(tmp_path, image_folder):
    ds = Dataset(convert(ConvertConfig(source=image_folder, dest=tmp_path / "a", workers=1,
                                       shard_size="20k")).dest)
    assert len(ds.shards) > 3
    assert all(s.bytes <= 20_000 for s in ds.shards)
    assert sum(s.samples for s in ds.shards) == 48
    ds = Dataset(convert(ConvertConfig(source=image_folder, dest=tmp_path / "b", workers=1,
                                       max_samples_per_shard=10)).dest)
    assert [s.samples for s in ds.shards] == [10, 10, 10, 10, 8]


def damage(image_folder: Path) -> tuple[Path, Path]:
    truncated = image_folder / "square" / "square_0003.jpg"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # header intact: only a full decode notices
    garbage = image_folder / "circle" / "circle_0005.jpg"
    garbage.write_bytes(b"this is not a jpeg")
    return truncated, garbage


def test_bad_images_are_skipped_and_listed(tmp_path, image_folder):
    damage(image_folder)
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "d", workers=2))
    ds = Dataset(tmp_path / "d")
    assert len(ds) == 46 and result.samples == 46
    skipped = {s["path"]: s["reason"] for s in ds.manifest.skipped}
    assert set(skipped) == {"square/square_0003.jpg", "circle/circle_0005.jpg"}
    assert skipped["square/square_0003.jpg"].startswith("image does not decode")
    assert "truncated" in skipped["square/square_0003.jpg"]
    assert skipped["circle/circle_0005.jpg"].startswith("not a readable image")
    assert "circle/circle_0005" not in ds.table.keys


def test_bad_image_with_on_error_fail_stops_naming_it(tmp_path, image_folder):
    damage(image_folder)
    with pytest.raises(ConvertError, match=r"circle_0005.jpg: not a readable image .*on_error='fail'"):
        convert(ConvertConfig(source=image_folder, dest=tmp_path / "d", workers=2, on_error="fail"))
    assert not (tmp_path / "d").exists()  # made by the failed run: taken back with it (test_convert_failed_runs.py)


def test_max_side_downscales_only_big_images(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=8, min_side=40, max_side=120)
    ds = Dataset(convert(ConvertConfig(source=src, dest=tmp_path / "d", workers=2, max_side=64,
                                       quality=85)).dest)
    import webdataset as wds

    shrunk = 0
    for sample in wds.WebDataset([str(s.path) for s in ds.shards], shardshuffle=False):
        original = (src / f"{sample['__key__']}.jpg").read_bytes()
        img = Image.open(io.BytesIO(sample["jpg"]))
        img.load()
        w0, h0 = Image.open(io.BytesIO(original)).size
        assert max(img.size) == min(64, max(w0, h0)) and img.format == "JPEG"
        if max(w0, h0) <= 64:
            assert sample["jpg"] == original
        else:
            shrunk += 1
    assert shrunk > 0
    assert ds.manifest.convert_options["max_side"] == 64


def test_max_side_keeps_the_colours_of_transparent_pixels(tmp_path):
    """Found by the newcomer review: --max-side turned every fully transparent pixel of an RGBA PNG black (PIL
    resizes RGBA premultiplied, and 0 alpha keeps no colour), so a model reading RGB saw black where the original
    held a colour. The resized PNG keeps them: a transparent region of one colour is that colour after the resize,
    as a resize of the colours alone gives; opaque pixels and the alpha are resized as before."""
    import numpy as np

    pixels = np.zeros((64, 96, 4), np.uint8)
    pixels[...] = (200, 50, 30, 0)  # transparent, of a known colour
    pixels[16:48, 24:72] = (10, 120, 240, 255)  # an opaque square in the middle
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(pixels, "RGBA").save(tmp_path / "src" / "a" / "x.png")
    (tmp_path / "src" / "b").mkdir()
    Image.fromarray(pixels[..., [1, 3]].copy(), "LA").save(tmp_path / "src" / "b" / "y.png")
    ds = Dataset(convert(ConvertConfig(source=tmp_path / "src", dest=tmp_path / "d", workers=1, max_side=24,
                                       progress=False)).dest)
    import webdataset as wds

    got = {s["__key__"]: np.asarray(Image.open(io.BytesIO(s["png"])))
           for s in wds.WebDataset([str(s.path) for s in ds.shards], shardshuffle=False)}
    rgba, la = got["a/x"], got["b/y"]
    assert rgba.shape == (16, 24, 4) and la.shape == (16, 24, 2)
    assert (rgba[0, 0] == (200, 50, 30, 0)).all() and (rgba[8, 12] == (10, 120, 240, 255)).all()
    assert (la[0, 0] == (50, 0)).all() and (la[8, 12] == (120, 255)).all()

    def resized(array, mode):
        return np.asarray(Image.fromarray(array, mode).resize((24, 16), Image.Resampling.BICUBIC, reducing_gap=3.0))

    clear = rgba[..., 3] == 0
    assert clear.sum() > 100
    assert (rgba[clear][:, :3] == resized(pixels[..., :3].copy(), "RGB")[clear]).all()  # the colours alone
    assert (la[la[..., 1] == 0][:, 0] == resized(pixels[..., 1].copy(), "L")[la[..., 1] == 0]).all()
    assert (rgba[~clear] == resized(pixels, "RGBA")[~clear]).all()  # what shows: as PIL resizes it, premultiplied


def test_another_tools_manifest_is_not_called_a_converted_dataset(tmp_path, image_folder):
    """A DEST holding a ``manifest.json`` fastio did not write (another tool's, the user's own) is "not fastio output",
    as any other file: it was called "a converted dataset" to be replaced, and --overwrite would then have replaced
    that folder's contents on a false description. The file stays."""
    dest = tmp_path / "theirs"
    dest.mkdir()
    for theirs in ('{"name": "my-project", "version": 2}', "not json"):
        (dest / "manifest.json").write_text(theirs)
        with pytest.raises(ConvertError, match=r"theirs: directory is not empty and is not fastio output"):
            convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
        assert (dest / "manifest.json").read_text() == theirs


def test_dest_rules(tmp_path, image_folder):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
    clean = tree(dest)
    with pytest.raises(ConvertError, match=r"d: already holds a converted dataset; pass overwrite=True"):
        convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, overwrite=True))
    assert tree(dest) == clean

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ConvertError, match=r"foreign: directory is not empty and is not fastio output"):
        convert(ConvertConfig(source=image_folder, dest=foreign, workers=1))
    assert (foreign / "precious.txt").read_text() == "keep me"
    convert(ConvertConfig(source=image_folder, dest=foreign, workers=1, overwrite=True))
    assert tree(foreign) == clean

    with pytest.raises(ConvertError, match="must not contain one another"):
        convert(ConvertConfig(source=image_folder, dest=image_folder / "out", workers=1))


def test_interrupted_dest_is_redone_without_overwrite(tmp_path, image_folder):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, max_samples_per_shard=8))
    clean = tree(dest)
    (dest / MANIFEST_NAME).unlink()  # what a run killed before its last step leaves ...
    (dest / "shards" / ".shard-000006.tar.tmp").write_bytes(b"half a shard")  # ... plus a half-written one
    convert(ConvertConfig(source=image_folder, dest=dest, workers=2, max_samples_per_shard=8))
    assert tree(dest) == clean


def test_a_run_killed_while_writing_the_marker_leaves_a_dest_the_rerun_takes(tmp_path, image_folder):
    """The marker is DEST's first file; a run killed while writing it leaves only the marker's temporary file,
    which is fastio's: the rerun converts without overwrite=True. Beside anything else, it proves nothing."""
    from fastio.storage.atomic import tmp_path_for

    dest, clean = tmp_path / "d", tmp_path / "clean"
    convert(ConvertConfig(source=image_folder, dest=clean, workers=1))
    dest.mkdir()
    tmp_path_for(dest / MARKER_NAME).write_bytes(b"fastio conv")
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
    assert tree(dest) == tree(clean)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    tmp_path_for(foreign / MARKER_NAME).write_bytes(b"fastio conv")
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ConvertError, match=r"foreign: directory is not empty and is not fastio output"):
        convert(ConvertConfig(source=image_folder, dest=foreign, workers=1))
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_kill_and_rerun_gives_identical_output(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=4, per_class=60, min_side=160, max_side=240)
    args = ["convert", str(src), "DEST", "--max-samples-per-shard", "2", "--max-side", "96",
            "--workers", "1", "--quiet"]
    reference = tmp_path / "reference"
    assert main([a.replace("DEST", str(reference)) for a in args]) == 0

    dest = tmp_path / "killed"
    cmd = [sys.executable, "-m", "fastio.cli", *[a.replace("DEST", str(dest)) for a in args]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = dest / "shards" / "shard-000000.tar"
    deadline = time.monotonic() + 60
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert first.exists() and (dest / MARKER_NAME).exists()
    assert not (dest / MANIFEST_NAME).exists(), "the run finished before it was killed"
    with pytest.raises(DatasetError):
        Dataset(dest)

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stderr == ""
    assert tree(dest) == tree(reference)


def test_cli_summary_line_and_quiet(tmp_path, image_folder, capsys):
    assert main(["convert", str(image_folder), str(tmp_path / "a"), "--workers", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("converted 48 samples (") and "into 1 shard at" in out and out.count("\n") == 1
    assert err == ""  # stderr is not a terminal here: no progress bar
    assert main(["convert", str(image_folder), str(tmp_path / "b"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_summary_of_a_flat_image_folder_says_it_has_no_labels(tmp_path, capsys):
    """Found by the newcomer review: a folder of images with no class folders converted (as loose files) with a
    summary that said nothing about labels, and the training script failed far from the cause. The summary says so
    now, and how to label them; the conversion still succeeds (a dataset without labels is legitimate)."""
    (tmp_path / "flat").mkdir()
    for k in range(3):
        Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(tmp_path / "flat" / f"p{k}.png")
    assert main(["convert", str(tmp_path / "flat"), str(tmp_path / "ds")]) == 0
    out, _ = capsys.readouterr()
    assert out.count("\n") == 1
    assert out.rstrip().endswith(f"; no labels: images directly in {tmp_path / 'flat'}; put them in one folder per "
                                 "class to label them"), out
    assert Dataset(tmp_path / "ds").num_classes is None


def test_summary_of_a_flat_folder_of_videos_says_it_has_no_labels(tmp_path, capsys):
    """The same for a folder of videos with no class folders (the note named only images)."""
    from fastio.convert.synthetic import make_video

    for k in range(2):
        make_video(tmp_path / "flat" / f"v{k}.webm", frames=4)
    assert main(["convert", str(tmp_path / "flat"), str(tmp_path / "ds"), "--workers", "1"]) == 0
    out, _ = capsys.readouterr()
    assert out.rstrip().endswith(f"; no labels: videos directly in {tmp_path / 'flat'}; put them in one folder per "
                                 "class to label them"), out


def test_summary_of_a_labelled_source_says_nothing_of_missing_labels(tmp_path, image_folder, capsys):
    assert main(["convert", str(image_folder), str(tmp_path / "a"), "--quiet"]) == 0
    result = convert(ConvertConfig(source=image_folder, dest=tmp_path / "b", workers=1, progress=False))
    assert "no labels" not in result.summary()


def test_progress_bar_on_a_real_terminal(tmp_path, image_folder):
    """stderr is a pseudo-terminal: the bar shows samples and MB/s, then the summary line follows."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "fastio.cli", "convert", str(image_folder), str(tmp_path / "d"),
                             "--workers", "1", "--max-side", "32"], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert "convert:" in text and "/48 [" in text and "sample/s" in text and "MB/s" in text
    assert text.rstrip().splitlines()[-1].lstrip("\r ").startswith("converted 48 samples")


def test_progress_only_on_a_terminal(tmp_path):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_wanted(False, Tty()) is True
    assert progress_wanted(True, Tty()) is False
    assert progress_wanted(False, io.StringIO()) is False
    with open(os.devnull, "w") as devnull:
        assert progress_wanted(False, devnull) is False


def test_convert_command_imports_neither_torch_nor_dali(tmp_path, image_folder):
    """Start-up matters for conversion: the convert command (without other command modules) stays torch-free."""
    script = (
        "import sys\n"
        "from fastio.cli import cli\n"
        "import fastio.cli.dataset_commands\n"
        f"cli.main(args=['convert', {str(image_folder)!r}, {str(tmp_path / 'd')!r}, '--workers', '2', '-q'],"
        " standalone_mode=False)\n"
        "print(sorted(m for m in ('torch', 'nvidia.dali') if sys.modules.get(m) is not None))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert len(Dataset(tmp_path / "d")) == 48


def test_downscale_keeps_orientation_and_format():
    from fastio.formats.images import downscale

    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW when shown": the stored pixels are not rotated
    buf = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 10, 10)).save(buf, "JPEG", exif=exif.tobytes())
    out, size = downscale(buf.getvalue(), "jpg", 100, 80)
    img = Image.open(io.BytesIO(out))
    assert size == img.size == (100, 67) and img.format == "JPEG"
    assert img.getexif().get(0x0112) == 6
    png = io.BytesIO()
    Image.new("RGBA", (50, 120), (0, 0, 255, 128)).save(png, "PNG")
    out, size = downscale(png.getvalue(), "png", 60, 80)
    assert Image.open(io.BytesIO(out)).format == "PNG" and size == (25, 60)
    assert downscale(png.getvalue(), "png", 500, 80)[0] == png.getvalue()


def test_image_that_cannot_be_reencoded_is_skipped_not_fatal(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=4, min_side=40, max_side=80)
    buf = io.BytesIO()
    Image.new("CMYK", (300, 200)).save(buf, "JPEG")  # decodes fine, but PNG cannot hold CMYK
    (src / "circle" / "cmyk.png").write_bytes(buf.getvalue())
    ds = Dataset(convert(ConvertConfig(source=src, dest=tmp_path / "d", workers=1, max_side=64)).dest)
    assert len(ds) == 8
    assert [(s["path"], s["reason"][:29]) for s in ds.manifest.skipped] == [
        ("circle/cmyk.png", "cannot re-encode as PNG (cann")]


def test_label_files_are_stored_as_ascii_decimal_text(tmp_path, image_folder):
    """A `.cls` file Windows wrote (UTF-8 byte order mark, CRLF) was refused as `label '���2' is not an integer`, and
    one with blanks (` 4 `, `+5`) was stored as it is: WebDataset's `int()` then fails on a BOM. Each is a label,
    stored as its ASCII decimal text."""
    import webdataset

    src = tmp_path / "loose"
    src.mkdir()
    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    for name, label in [("a", b"\xef\xbb\xbf2\r\n"), ("b", b" 4 \n"), ("c", b"+5"), ("d", b"\xef\xbb\xbfx")]:
        (src / f"{name}.jpg").write_bytes(jpg)
        (src / f"{name}.cls").write_bytes(label)
    result = convert(ConvertConfig(source=src, dest=tmp_path / "ds", workers=1))
    [skip] = result.skipped
    assert skip["path"] == "d.cls" and skip["reason"] == "field 'cls': label 'x' is not an integer"
    shards = [str(s) for s in sorted((tmp_path / "ds" / "shards").glob("*.tar"))]
    assert {s["__key__"]: s["cls"] for s in webdataset.WebDataset(shards, shardshuffle=False)} == {
        "a": b"2", "b": b"4", "c": b"5"}


def test_a_split_of_a_killed_run_is_unfinished_and_not_offered_to_fastio_index(tmp_path, image_folder, capsys):
    """A `--split` run killed while writing `train` leaves `DEST/train/shards/` with no manifest, its marker in DEST.
    `fastio inspect DEST/train` (and the Loader) said `tar shards without a manifest.json ...: make it one with
    fastio index DEST/train`, and that index made a dataset of part of the source. Now both name the unfinished
    conversion, and the index refuses the folder."""
    import shutil

    from tests.helpers import run_cli

    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, split="val=0.25", max_samples_per_shard=4))
    clean = tree(dest)
    shutil.copytree(dest / "val", tmp_path / "keep_val")
    for done in (dest / "splits.json", dest / "train" / MANIFEST_NAME, dest / "train" / "samples.fxi"):
        done.unlink()  # what the kill left: train's shards so far, nothing of val
    shutil.rmtree(dest / "val")
    unfinished = f"{dest}: an unfinished fastio convert"
    with pytest.raises(DatasetError, match=f"^{dest / 'val'}: a split of {unfinished}"):
        shutil.copytree(tmp_path / "keep_val", dest / "val")  # a run killed after val was written: val is whole ...
        Dataset(dest / "val")  # ... but not yet the run's output: it says so, as DEST does
    shutil.rmtree(dest / "val")
    with pytest.raises(DatasetError, match=f"^{dest / 'train'}: a split of {unfinished}"):
        Dataset(dest / "train")
    code, out, err = run_cli(["index", str(dest / "train")], capsys)
    assert (code, out) == (2, "") and f"a split of {unfinished}" in err and "fastio index" not in err
    assert not (dest / "train" / MANIFEST_NAME).exists()
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, split="val=0.25", max_samples_per_shard=4))
    assert tree(dest) == clean


def test_a_dest_that_is_a_dangling_symlink_is_named_as_one(tmp_path, image_folder):
    """A DEST that is a link to a folder not made yet failed as `DEST: File exists` (mkdir's word), naming nothing of
    the link. It now says where the link points."""
    dest = tmp_path / "ds"
    dest.symlink_to(tmp_path / "scratch" / "ds")
    with pytest.raises(ConvertError) as err:
        convert(ConvertConfig(source=image_folder, dest=dest, workers=1))
    assert str(err.value) == (f"{dest}: a symlink to {tmp_path / 'scratch' / 'ds'}, which does not exist: make that "
                              "folder, or give another DEST")
    assert dest.is_symlink() and not (tmp_path / "scratch").exists()


def test_a_file_name_with_a_newline_stays_on_its_line(tmp_path, image_folder, capsys):
    """A file named `evil\\nfastio: error: fake.jpg` printed its name as it is: the summary's skipped line, and the one
    line of a run that stops on it, broke in two, the second one reading as another error of fastio's. Names are
    printed with their control characters escaped."""
    from tests.helpers import run_cli

    (image_folder / "circle" / "evil\nfastio: error: fake.jpg").write_bytes(b"not an image")
    (image_folder / "circle" / "tab\tand\rreturn.jpg").write_bytes(b"not an image")
    code, out, err = run_cli(["convert", str(image_folder), str(tmp_path / "ds")], capsys)
    assert code == 0, err
    assert not any(line.startswith("fastio: error") for line in (out + err).splitlines())
    assert "circle/evil\\nfastio: error: fake.jpg" in out + err
    assert "circle/tab\tand\\rreturn.jpg" in out + err
    code, out, err = run_cli(["inspect", str(tmp_path / "ds"), "--skipped"], capsys)
    assert code == 0 and len(out.splitlines()) == 2 and "circle/evil\\nfastio: error: fake.jpg: not a" in out
    code, out, err = run_cli(["convert", str(image_folder), str(tmp_path / "ds2"), "--on-error", "fail"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "circle/evil\\nfastio: error: fake.jpg" in err


def _labels_by_class(ds: Dataset) -> dict[str, set[int]]:
    """The ``cls`` values stored for each sample's class folder (its key's first part), read from the tars."""
    import tarfile

    got: dict[str, set[int]] = {}
    for shard in ds.shards:
        with tarfile.open(shard.path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".cls"):
                    got.setdefault(member.name.split("/", 1)[0], set()).add(int(tar.extractfile(member).read()))
    return got


def test_a_folder_already_split_converts_every_split_with_one_class_list(tmp_path, capsys):
    """images/train/<class>/ and images/val/<class>/ (ImageNet's layout) were refused, and converting each split
    by itself numbered its labels by its own classes: a val lacking one of train's classes had label k name another
    class than in train, silently. One conversion now writes DEST/train and DEST/val (and splits.json) with the
    sorted union of the class folders as the one class list, and says which split lacks which class."""
    src = tmp_path / "images"
    make_imagefolder(src / "train", classes=4, per_class=3)
    make_imagefolder(src / "val", classes=4, per_class=2)
    for image in (src / "val" / "circle").iterdir():  # val lacks the first class: separately, its labels shift
        image.unlink()
    (src / "val" / "circle").rmdir()
    code = main(["convert", str(src), str(tmp_path / "ds"), "--workers", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    train, val = Dataset(tmp_path / "ds" / "train"), Dataset(tmp_path / "ds" / "val")
    classes = {"circle": 0, "hstripes": 1, "square": 2, "vstripes": 3}
    assert train.label_map == val.label_map == classes
    assert (len(train), len(val)) == (12, 6)
    assert _labels_by_class(train) == {name: {k} for name, k in classes.items()}
    assert _labels_by_class(val) == {name: {k} for name, k in classes.items() if name != "circle"}
    assert json.loads((tmp_path / "ds" / "splits.json").read_text())["splits"].keys() == {"train", "val"}
    assert "[train: 12, val: 6]" in out.out and "val has no 'circle'" in out.out.splitlines()[0]
    assert verify(tmp_path / "ds").ok
    assert main(["convert", str(src), str(tmp_path / "again"), "--split", "val=0.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastio: error: {src}: already split into train, val") and "--split" in err
    assert err.count("\n") == 1 and not (tmp_path / "again" / "train").exists()


def test_classes_from_numbers_a_split_converted_apart_as_the_other(tmp_path, capsys):
    """Converting val/ apart from train/ numbered its labels by val's own class folders: a val lacking one of
    train's classes had label k name another class. --classes-from DATASET labels by that dataset's class list
    (its manifest's label_map); a class folder it does not list is refused in one line, as is a dataset without
    class names and an option for a source that is no image folder."""
    make_imagefolder(tmp_path / "train", classes=4, per_class=2)
    make_imagefolder(tmp_path / "val", classes=4, per_class=1)
    for image in (tmp_path / "val" / "circle").iterdir():
        image.unlink()
    (tmp_path / "val" / "circle").rmdir()
    assert main(["convert", str(tmp_path / "train"), str(tmp_path / "ds_train"), "--workers", "1", "-q"]) == 0
    assert main(["convert", str(tmp_path / "val"), str(tmp_path / "ds_val"), "--workers", "1", "-q",
                 "--classes-from", str(tmp_path / "ds_train")]) == 0
    train, val = Dataset(tmp_path / "ds_train"), Dataset(tmp_path / "ds_val")
    assert val.label_map == train.label_map == {"circle": 0, "hstripes": 1, "square": 2, "vstripes": 3}
    assert _labels_by_class(val) == {"hstripes": {1}, "square": {2}, "vstripes": {3}}
    assert val.manifest.convert_options["classes_from"] == str(tmp_path / "ds_train")
    capsys.readouterr()

    make_imagefolder(tmp_path / "more", classes=5, per_class=1)
    assert main(["convert", str(tmp_path / "more"), str(tmp_path / "ds_more"), "--classes-from",
                 str(tmp_path / "ds_train")]) == 2
    assert capsys.readouterr().err == (f"fastio: error: {tmp_path / 'more'}/circle2: a class folder not in the class "
                                       f"list of --classes-from {tmp_path / 'ds_train'} (4 classes: circle, hstripes, "
                                       "square, vstripes)\n")
    assert not (tmp_path / "ds_more").exists()
    assert main(["convert", str(tmp_path / "val"), str(tmp_path / "x"), "--classes-from", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"fastio: error: --classes-from: {tmp_path}")
    assert main(["convert", str(tmp_path / "train"), str(tmp_path / "split"), "--split", "val=0.25", "-q"]) == 0
    assert main(["convert", str(tmp_path / "val"), str(tmp_path / "x"), "--classes-from", str(tmp_path / "split")]) == 2
    assert capsys.readouterr().err == (f"fastio: error: --classes-from: {tmp_path / 'split'}: holds the splits train, "
                                       f"val: give one of them, {tmp_path / 'split' / 'train'}\n")
    (tmp_path / "t.csv").write_text("path,label\ntrain/circle/circle_0000.jpg,circle\n")
    assert main(["convert", str(tmp_path / "t.csv"), str(tmp_path / "y"), "--classes-from",
                 str(tmp_path / "ds_train")]) == 2
    assert capsys.readouterr().err == (f"fastio: error: --classes-from {tmp_path / 'ds_train'}: an option of an "
                                       "image folder source, not of csv\n")
