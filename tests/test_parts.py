"""Conversion in parts (`fastio convert --part K/N`) and `fastio merge`: the merged dataset is byte-identical
to a single conversion; missing, incomplete and mismatched parts are named;
``convert --overwrite`` is refused while a part runs, and a part does not start under a whole conversion."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastio.cli import main
from fastio.convert.merge import merge
from fastio.convert.parts import PART_RECORD, PARTS_DIR, parse_part, part_dir, part_range
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset
from fastio.errors import ConvertError
from fastio.report.verify import verify
from fastio.storage.lock import LOCK_NAME


def tree(dest: Path) -> dict[str, bytes]:
    """Every file under ``dest`` (hidden ones included, but the lock file) by relative path."""
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def in_parts(source: Path, dest: Path, n: int, order=None, **options) -> None:
    for k in order or range(n):
        result = convert(ConvertConfig(source=source, dest=dest, part=(k, n), **options))
        assert result.part == (k, n)
        assert (part_dir(dest, k, n) / PART_RECORD).is_file()


def single_and_merged(tmp_path: Path, source: Path, n: int, order=None, **options):
    convert(ConvertConfig(source=source, dest=tmp_path / "single", **options))
    in_parts(source, tmp_path / "parted", n, order, **options)
    result = merge(tmp_path / "parted")
    return tree(tmp_path / "single"), tree(tmp_path / "parted"), result


def test_part_range_covers_in_order_and_aligns():
    for count in (0, 1, 7, 48, 1001):
        for n in (1, 2, 3, 8, 60):
            for align in (None, 1, 5, 16):
                starts = None if align is None else list(range(0, count, align))
                ranges = [part_range(count, k, n, starts) for k in range(n)]
                assert ranges[0][0] == 0 and ranges[-1][1] == count
                assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
                assert all(s <= e for s, e in ranges)
                if align:
                    assert all(e % align == 0 for _, e in ranges[:-1])
    assert [part_range(10, k, 3) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [part_range(10, k, 3, [0, 2, 3, 7]) for k in range(3)] == [(0, 2), (2, 3), (3, 10)]


def test_parse_part_and_slurm_array_task_id():
    assert parse_part("2/8") == (2, 8)
    assert parse_part("auto/4", {"SLURM_ARRAY_TASK_ID": "3"}) == (3, 4)
    for text, env, message in [("8/8", {}, "K must be in 0..7"), ("1/0", {}, "at least 1"), ("x/2", {}, "K/N"),
                               ("auto/4", {}, "SLURM_ARRAY_TASK_ID, which is not set"),
                               ("auto/4", {"SLURM_ARRAY_TASK_ID": "4"}, "K must be in 0..3")]:
        with pytest.raises(ValueError, match=f"^part: .*{message}"):
            parse_part(text, env)


def test_imagefolder_shuffle_split_parts_merge_identical_by_linking(tmp_path, image_folder):
    """Shards cut by size: every part predicts the single run's cuts from the file sizes and starts on one,
    so the merge links every part shard into place; the result is the same bytes, file for file."""
    single, merged, result = single_and_merged(tmp_path, image_folder, 3, order=(2, 0, 1), shuffle=True, seed=5,
                                               split="val=0.25", shard_size="40k", workers=1)
    assert sorted(single) == sorted(merged)
    assert [name for name in single if single[name] != merged[name]] == []
    assert result.repacked == 0 and result.linked == len([n for n in single if n.endswith(".tar")]) > 6
    assert not (tmp_path / "parted" / PARTS_DIR).exists()
    assert json.loads(single["splits.json"])["splits"]["val"]["samples"] == 12
    for split in ("train", "val"):
        assert verify(tmp_path / "parted" / split).problems == []


def test_a_source_already_split_in_parts_merges_to_the_single_runs_bytes(tmp_path):
    """An image folder already split (images/train/<class>/, images/val/<class>/ lacking a class) converted in parts
    and merged is the single conversion's dataset, file for file: both splits, one class list, splits.json."""
    make_imagefolder(tmp_path / "images" / "train", classes=3, per_class=6)
    make_imagefolder(tmp_path / "images" / "val", classes=2, per_class=3)
    single, merged, result = single_and_merged(tmp_path, tmp_path / "images", 3, order=(1, 2, 0), shuffle=True,
                                               shard_size="20k", workers=1)
    assert [name for name in sorted(set(single) | set(merged)) if single.get(name) != merged.get(name)] == []
    assert json.loads(single["splits.json"])["splits"].keys() == {"train", "val"}
    assert result.samples == 24
    for split in ("train", "val"):
        assert Dataset(tmp_path / "parted" / split).label_map == {"circle": 0, "hstripes": 1, "square": 2}
    assert verify(tmp_path / "parted").ok


def test_sample_count_shards_merge_by_linking_only(tmp_path, image_folder):
    """--max-samples-per-shard M with shards below --shard-size: parts are ranges of multiples of M and every
    shard of the result is a part's shard, linked, nothing copied."""
    single, merged, result = single_and_merged(tmp_path, image_folder, 4, shuffle=True, seed=1,
                                               max_samples_per_shard=5, workers=2)
    assert single == merged
    assert result.repacked == 0 and result.linked == 10
    parted = Dataset(tmp_path / "parted")
    assert len(parted) == 48 and parted.fingerprint == Dataset(tmp_path / "single").fingerprint


def test_table_source_with_more_parts_than_shards(tmp_path, image_folder):
    files = sorted(image_folder.rglob("*.jpg"))[::3]
    lines = ["path,label,caption"] + [f"img/{p.relative_to(image_folder).as_posix()},{p.parent.name},\"c {i}\""
                                      for i, p in enumerate(files)]
    table = tmp_path / "meta" / "table.csv"
    table.parent.mkdir()
    table.write_text("\n".join(lines) + "\n")
    shutil.copytree(image_folder, tmp_path / "meta" / "img")  # table paths must stay inside its folder
    single, merged, result = single_and_merged(tmp_path, table, 7, shard_size="30k", workers=1)
    assert single == merged
    assert result.samples == len(files) == 16
    assert b"c 3" in b"".join(v for k, v in merged.items() if k.endswith(".tar"))


def test_skipped_samples_in_parts_are_listed_like_a_single_run(tmp_path, image_folder):
    (image_folder / "circle" / "circle_0005.jpg").write_bytes(b"this is not a jpeg")
    (image_folder / "square" / "square_0003.jpg").write_bytes(b"nor this")
    (image_folder / "notes.txt").write_text("not inside a class folder")
    single, merged, result = single_and_merged(tmp_path, image_folder, 3, shard_size="25k", workers=1)
    assert single == merged
    # A skipped sample moves the single run's cuts away from the predicted ones: the merge re-packs.
    assert result.repacked > 0 and result.linked > 0, result.summary()
    skipped = json.loads(merged["manifest.json"])["skipped"]
    assert {s["path"] for s in skipped} == {"notes.txt", "circle/circle_0005.jpg", "square/square_0003.jpg"}


def test_parts_run_at_the_same_time_through_the_cli(tmp_path, image_folder):
    """Four `fastio convert --part auto/4` processes at once (K from SLURM_ARRAY_TASK_ID), then `fastio merge`."""
    args = ["convert", str(image_folder), str(tmp_path / "parted"), "--shuffle", "--seed", "9", "--shard-size",
            "30k", "--workers", "1", "-q", "--part", "auto/4"]
    procs = [subprocess.Popen([sys.executable, "-m", "fastio.cli", *args], env={"SLURM_ARRAY_TASK_ID": str(k),
                              "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(4)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert main(["merge", str(tmp_path / "parted"), "-q"]) == 0
    assert main(["convert", str(image_folder), str(tmp_path / "single"), "--shuffle", "--seed", "9",
                 "--shard-size", "30k", "--workers", "1", "-q"]) == 0
    assert tree(tmp_path / "single") == tree(tmp_path / "parted")


def test_missing_incomplete_and_rerun_part(tmp_path, image_folder, capsys):
    dest = tmp_path / "parted"
    in_parts(image_folder, dest, 4, order=(0, 2), shard_size="30k", workers=1)
    (part_dir(dest, 1, 4)).mkdir(parents=True)  # a part that died before finishing
    assert main(["merge", str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastio: error: ") and err.count("\n") == 1
    assert "2 of 4 parts not complete" in err
    assert "part-1-of-4 (incomplete: failed or interrupted)" in err and "part-3-of-4 (missing)" in err
    assert not (dest / "manifest.json").exists()
    in_parts(image_folder, dest, 4, order=(1, 3), shard_size="30k", workers=1)
    (part_dir(dest, 2, 4) / PART_RECORD).unlink()  # part 2 failed after all: rerun it alone
    in_parts(image_folder, dest, 4, order=(2,), shard_size="30k", workers=1)
    merge(dest)
    convert(ConvertConfig(source=image_folder, dest=tmp_path / "single", shard_size="30k", workers=1))
    assert tree(dest) == tree(tmp_path / "single")


def test_mismatched_parts_are_named(tmp_path, image_folder):
    dest = tmp_path / "parted"
    in_parts(image_folder, dest, 3, shuffle=True, seed=0, workers=1)
    convert(ConvertConfig(source=image_folder, dest=dest, part=(1, 3), shuffle=True, seed=7, workers=1))
    with pytest.raises(ConvertError, match=r"not made from the same source, options and seed as part-0-of-3: "
                                           r"part-1-of-3: seed 7 \(part 0: 0\)$"):
        merge(dest)
    convert(ConvertConfig(source=image_folder, dest=dest, part=(1, 3), shuffle=True, seed=0, workers=1))
    (image_folder / "circle" / "extra.jpg").write_bytes((image_folder / "circle" / "circle_0000.jpg").read_bytes())
    convert(ConvertConfig(source=image_folder, dest=dest, part=(2, 3), shuffle=True, seed=0, workers=1))
    with pytest.raises(ConvertError, match=r"part-2-of-3: source listing \(the source changed"):
        merge(dest)
    convert(ConvertConfig(source=image_folder, dest=dest, part=(0, 2), workers=1))
    with pytest.raises(ConvertError, match=r"holds parts of conversions in 2 and 3 parts"):
        merge(dest)
    with pytest.raises(ConvertError, match=r"no parts to merge"):
        merge(tmp_path / "nothing")


def test_merge_refuses_to_replace_a_dataset_without_overwrite(tmp_path, image_folder):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, seed=1, shuffle=True))
    before = tree(dest)
    with pytest.raises(ConvertError, match=r"already holds a converted dataset; pass overwrite=True"):
        in_parts(image_folder, dest, 2, workers=1)
    in_parts(image_folder, dest, 2, workers=1, overwrite=True)
    assert tree(dest)["manifest.json"] == before["manifest.json"]  # parts never touch the published dataset
    with pytest.raises(ConvertError, match=r"already holds a converted dataset; pass overwrite=True"):
        merge(dest)
    assert main(["merge", str(dest), "--overwrite", "--keep-parts", "-q"]) == 0
    assert (dest / PARTS_DIR).is_dir()
    assert Dataset(dest).manifest.convert_options["shuffle"] is False


def test_a_part_in_use_is_refused_by_a_second_run_and_by_merge(tmp_path, image_folder):
    from fastio.storage.lock import DirLock

    dest = tmp_path / "parted"
    in_parts(image_folder, dest, 2, workers=1)
    with DirLock(part_dir(dest, 1, 2), "fastio convert --part 1/2"):
        with pytest.raises(ConvertError, match=r"part-1-of-2: in use by fastio convert --part 1/2 pid"):
            convert(ConvertConfig(source=image_folder, dest=dest, part=(1, 2), workers=1))
        with pytest.raises(ConvertError, match=r"part-1-of-2: in use by"):
            merge(dest)
    assert (part_dir(dest, 1, 2) / PART_RECORD).is_file()  # the refused run touched nothing
    assert merge(dest).samples == 48


def test_more_parts_than_shards_leaves_empty_parts_that_merge_cleanly(tmp_path, image_folder, capsys):
    single, merged, result = single_and_merged(tmp_path, image_folder, 12, max_samples_per_shard=8, workers=1)
    assert single == merged and result.linked == 6 and result.repacked == 0
    assert main(["convert", str(image_folder), str(tmp_path / "x"), "--part", "12/12"]) == 2
    assert capsys.readouterr().err == "fastio: error: --part: K must be in 0..11 for 12 parts, got 12\n"


def _files(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def test_overwrite_is_refused_while_a_part_runs_and_the_parts_still_merge(tmp_path):
    """Before: `convert --overwrite` deleted the running part 0's early shards and part 1's shards/; the part
    then failed (or the overwrite did) and the merge found a damaged part."""
    src = make_imagefolder(tmp_path / "src", classes=4, per_class=40, min_side=96, max_side=160, seed=1)
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "fastio.cli", "convert", str(src), str(dest), "--workers", "1", "-q",
           "--max-side", "64", "--max-samples-per-shard", "5"]
    subprocess.run([*cmd, "--part", "1/2"], check=True, timeout=120)
    part1 = dest / PARTS_DIR / "part-1-of-2"
    before = _files(part1)
    a = subprocess.Popen([*cmd, "--part", "0/2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = dest / PARTS_DIR / "part-0-of-2" / "shards" / "shard-000000.tar"
        deadline = time.monotonic() + 60
        while not first.exists():  # part 0 is writing
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()
            time.sleep(0.002)
        os.kill(a.pid, signal.SIGSTOP)  # keep it mid-run, deterministically
        try:
            c = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=120)
            assert first.exists() and _files(part1) == before  # nothing deleted
        finally:
            os.kill(a.pid, signal.SIGCONT)
        _, err_a = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
    assert c.returncode == 2 and c.stderr.count("\n") == 1, c.stderr
    assert c.stderr.startswith(f"fastio: error: {dest}: part 0/2 of a conversion in parts is running (fastio "
                               f"convert --part 0/2 pid {a.pid} on "), c.stderr
    assert a.returncode == 0, err_a
    merged = subprocess.run([sys.executable, "-m", "fastio.cli", "merge", str(dest), "-q"], capture_output=True,
                            text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert json.loads((dest / "manifest.json").read_text())["total_samples"] == 160 and verify(dest).ok


def test_a_part_does_not_start_under_a_whole_conversion(tmp_path):
    """The other order: DEST's lock is held (a whole conversion resetting DEST); a part started then is refused
    before it writes anything (it would be deleted under it)."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=4, seed=1)
    dest = tmp_path / "dest"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from fastio.storage.lock import DirLock; "
                               "lock = DirLock(sys.argv[1], 'fastio convert').acquire(); print('held', flush=True); "
                               "time.sleep(60)", str(dest)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConvertError, match=rf"^{dest}: in use by fastio convert pid {holder.pid} on .*; part "
                                               r"0/2 was not started"):
            convert(ConvertConfig(source=src, dest=dest, workers=1, part=(0, 2)))
    finally:
        holder.kill()
        holder.wait()
    assert not (dest / PARTS_DIR / "part-0-of-2" / "shards").exists()
    convert(ConvertConfig(source=src, dest=dest, workers=1, part=(0, 2)))
    assert (dest / PARTS_DIR / "part-0-of-2" / "part.json").is_file()


def test_unmerged_parts_and_a_killed_merge_name_fastio_merge(tmp_path, image_folder):
    """A DEST holding parts only was `not a fastio dataset (no manifest.json; an interrupted conversion?)`, and a merge
    killed half-way (its marker and some shards beside `.parts/`) said `run the same fastio convert again`, though
    the parts are complete and `fastio merge DEST` is what finishes it."""
    from fastio.dataset.manifest import MARKER_NAME
    from fastio.errors import DatasetError

    dest = tmp_path / "parted"
    in_parts(image_folder, dest, 2, workers=1)
    with pytest.raises(DatasetError) as err:
        Dataset(dest)
    assert str(err.value) == (f"{dest}: parts of a --part K/N run ({PARTS_DIR}/), not merged yet, not a dataset; "
                              f"merge them with `fastio merge {dest}`")
    (dest / MARKER_NAME).write_bytes(b"fastio convert output; complete once manifest.json or splits.json exists")
    (dest / "shards").mkdir()  # what a merge killed after its first step leaves
    with pytest.raises(DatasetError) as err:
        Dataset(dest)
    assert str(err.value) == (f"{dest}: an unfinished fastio merge (killed or stopped: {MARKER_NAME} without "
                              f"manifest.json), not a dataset; run `fastio merge {dest}` again to finish it")
    merge(dest)
    assert verify(dest).ok


def test_merge_without_parts_says_whether_dest_is_missing_or_merged_already(tmp_path, image_folder, capsys):
    # Found by the newcomer review (round 4): `fastio merge` of a folder that does not exist, and of a dataset that
    # was merged already (its .parts/ removed), both said only 'no parts to merge (no .parts/)'.
    from helpers import run_cli

    code, _, err = run_cli(["merge", str(tmp_path / "nothing")], capsys)
    assert code == 2 and err.startswith(f"fastio: error: {tmp_path / 'nothing'}: no such folder, so no parts to "
                                        "merge; first write them: fastio convert SOURCE "), err
    dest = tmp_path / "d"
    for k in range(2):
        convert(ConvertConfig(source=image_folder, dest=dest, part=(k, 2), workers=1))
    assert run_cli(["merge", str(dest), "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and err == (f"fastio: error: {dest}: a dataset already (merged, or converted in one run), and no "
                                 "parts to merge: nothing to do\n"), err
