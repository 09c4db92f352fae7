"""Issue 33, point 4, 5 and 9: messages that name the next step, skipped inputs named with their reasons,
``fastio index`` of several shard paths (an unquoted glob), class lists of indexed shards, counts in words."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

import pytest

from fastio import Dataset, Loader
from fastio.convert.synthetic import make_imagefolder
from fastio.errors import DatasetError
from tests.conftest import write_image_dataset
from tests.helpers import run_cli


@pytest.fixture
def shards(tmp_path, image_folder) -> Path:
    """Three plain WebDataset tar shards (a fastio dataset's, copied) in ``wds/``, no fastio metadata."""
    ds = write_image_dataset(tmp_path / "ds", image_folder)
    (tmp_path / "wds").mkdir()
    for tar in sorted((ds / "shards").glob("*.tar")):
        shutil.copy(tar, tmp_path / "wds" / tar.name)
    return tmp_path / "wds"


def test_a_loader_given_a_shard_file_names_fastio_index(shards):
    tar = shards / "shard-000000.tar"
    with pytest.raises(DatasetError, match=rf"^{tar}: a tar shard, not a dataset: .*`fastio index {shards}`"):
        Loader(str(tar), batch_size=4, device="cpu")


def test_a_loader_given_a_list_of_shards_names_fastio_index(shards):
    tars = [str(p) for p in sorted(shards.glob("*.tar"))]
    with pytest.raises(DatasetError, match=rf"a list; a dataset is one folder: .*`fastio index {shards}`"):
        Loader(tars, batch_size=4, device="cpu")


def test_a_loader_given_a_webdataset_shard_spec_names_fastio_index(shards, capsys):
    # Found by review: Loader('wds/shard-{000000..000002}.tar'), the spec WebDataset takes, and a quoted glob said
    # only 'no such dataset directory'.
    spec = f"{shards}/shard-{{000000..000002}}.tar"
    with pytest.raises(DatasetError, match=rf"^{re.escape(spec)}: a pattern of tar shards, not a dataset: .*"
                                           rf"`fastio index '{re.escape(spec)}'`, then give {shards}"):
        Loader(spec, batch_size=4, device="cpu")
    glob = f"{shards}/*.tar"
    with pytest.raises(DatasetError, match=rf"^{re.escape(glob)}: a pattern of tar shards, not a dataset: .*"
                                           rf"`fastio index {shards}`, then give {shards}"):
        Dataset(glob)
    code, _, err = run_cli(["verify", spec], capsys)
    assert code == 2 and f"`fastio index '{spec}'`" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(DatasetError, match=r"no such dataset directory"):
        Dataset(shards / "none" / "x{1,2}")
    assert run_cli(["index", str(shards), "-q"], capsys)[0] == 0
    with pytest.raises(DatasetError, match=rf"^{re.escape(spec)}: .*: their folder {shards} is one; give it$"):
        Dataset(spec)


def test_a_shard_inside_a_dataset_names_the_dataset(image_dataset):
    with pytest.raises(DatasetError, match=rf"a shard of the dataset {image_dataset}: give the dataset folder"):
        Dataset(image_dataset / "shards" / "shard-000000.tar")


def test_a_file_of_a_dataset_names_its_folder(shards, capsys):
    """Found by review (round 4): a shard of indexed WebDataset shards (beside their manifest) was told to run
    `fastio index` on a folder that already is a dataset (which then refuses: 'pass --overwrite'); its manifest.json
    said only 'a file, not a dataset', and `fastio inspect DS/manifest.json` read it as a mixture file."""
    assert run_cli(["index", str(shards), "-q"], capsys)[0] == 0
    for file in (shards / "shard-000000.tar", shards / "shard-000000.idx", shards / "manifest.json"):
        with pytest.raises(DatasetError, match=rf"^{file}: a (shard|file) of the dataset {shards}: give the dataset "
                                               rf"folder$"):
            Dataset(file)
    manifest = shards / "manifest.json"
    for command in ("inspect", "verify"):
        code, _, err = run_cli([command, str(manifest)], capsys)
        assert code == 2 and err.strip() == (f"fastio: error: {manifest}: a file of the dataset {shards}: "
                                             "give the dataset folder"), err


def test_verify_on_unconverted_folders_names_the_command(shards, image_folder, capsys):
    code, _, err = run_cli(["verify", str(shards)], capsys)
    assert code == 2 and f"`fastio index {shards}`" in err and "interrupted" not in err, err
    code, _, err = run_cli(["verify", str(image_folder)], capsys)
    assert code == 2 and f"`fastio convert {image_folder} DEST`" in err and "interrupted" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_index_takes_several_shard_paths(shards, capsys):
    """`fastio index wds/*.tar` unquoted: the shell gives every path; they are indexed as one dataset in their
    folder (it was click's 'Got unexpected extra arguments')."""
    tars = [str(p) for p in sorted(shards.glob("*.tar"))]
    code, out, err = run_cli(["index", *tars], capsys)
    assert code == 0, err
    assert out.startswith("indexed 3 shards, 48 samples (") and f"-> {shards};" in out
    assert len(Dataset(shards)) == 48


def test_index_of_several_paths_refuses_a_folder_among_them(shards, capsys):
    code, _, err = run_cli(["index", str(shards / "shard-000000.tar"), str(shards)], capsys)
    assert code == 2 and f"{shards}: not a .tar file: fastio index takes one SOURCE" in err, err


def test_one_shard_is_counted_in_words(shards, capsys):
    for tar in sorted(shards.glob("*.tar"))[1:]:
        tar.unlink()
    code, out, err = run_cli(["index", str(shards)], capsys)
    assert code == 0 and out.startswith("indexed 1 shard, 16 samples ("), out + err


def test_inspect_of_indexed_shards_lists_labels_without_blank_names(shards, capsys):
    assert run_cli(["index", str(shards), "-q"], capsys)[0] == 0
    code, out, _ = run_cli(["inspect", str(shards)], capsys)
    assert code == 0
    lines = out[out.index("classes:"):].splitlines()[1:5]
    assert lines == [f"  {label:>6}  12" for label in range(4)], out  # no blank name column


@pytest.fixture
def broken_folder(tmp_path) -> Path:
    """An image folder with 7 files that do not decode."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=4)
    good = next(src.rglob("*.jpg")).read_bytes()
    for i in range(6):
        (src / "circle" / f"bad{i}.jpg").write_bytes(good[:100])
    (src / "circle" / "notes.jpg").write_bytes(b"not an image")
    return src


def test_convert_names_the_first_skipped_inputs_and_inspect_lists_all(tmp_path, broken_folder, capsys):
    dest = tmp_path / "ds"
    code, out, err = run_cli(["convert", str(broken_folder), str(dest)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert "skipped 7" in lines[0] and len(lines) == 3, out  # each reason once, with its count
    assert lines[1].startswith("  6 inputs (circle/bad0.jpg, circle/bad1.jpg, circle/bad2.jpg, and 3 more): not a "
                               "readable image"), lines[1]
    assert lines[2].startswith("  circle/notes.jpg: not a readable image"), lines[2]
    code, out, _ = run_cli(["inspect", str(dest), "--skipped"], capsys)
    assert code == 0
    listed = out.splitlines()
    assert [line.split(":")[0] for line in listed] == [f"circle/bad{i}.jpg" for i in range(6)] + ["circle/notes.jpg"]
    assert all(": not a readable image" in line for line in listed)
    code, out, _ = run_cli(["inspect", str(dest)], capsys)
    assert "(skipped at conversion: 7)\n  6 inputs (circle/bad0.jpg, circle/bad1.jpg, circle/bad2.jpg, and 3 more): " \
        "not a readable image" in out


def test_inspect_skipped_of_a_clean_dataset_says_so(image_dataset, capsys):
    code, out, _ = run_cli(["inspect", str(image_dataset), "--skipped"], capsys)
    assert code == 0 and out == f"{image_dataset}: nothing was skipped\n"


def test_the_tar_fixture_is_a_plain_webdataset_tar(shards):
    with tarfile.open(shards / "shard-000000.tar") as tar:
        assert sorted({Path(m.name).suffix for m in tar.getmembers()}) == [".cls", ".jpg"]


def test_skipped_lines_say_each_reason_once_then_how_many_more():
    """Each reason once with its count and first three inputs; past the first five reasons, how many inputs are
    left and the command that lists them."""
    from fastio.progress import skipped_lines

    skipped = [{"path": f"a{i}.mp4", "reason": "same reason"} for i in range(3)]
    skipped += [{"path": f"b{i}.jpg", "reason": f"reason {i}"} for i in range(6)]
    skipped += [{"path": "c.jpg", "reason": "reason 5"}]
    lines = skipped_lines(skipped, "fastio inspect DEST --skipped").splitlines()
    assert lines == ["", "  3 inputs (a0.mp4, a1.mp4, a2.mp4): same reason", "  b0.jpg: reason 0", "  b1.jpg: reason 1",
                     "  b2.jpg: reason 2", "  b3.jpg: reason 3", "  ... and 3 more: fastio inspect DEST --skipped"]
    assert skipped_lines([], "x") == ""


def test_index_of_an_image_folder_names_fastio_convert(image_folder, capsys):
    # Found by the newcomer review (round 4): `fastio index images` said only 'holds no .tar files' (verify and
    # inspect of the same folder name `fastio convert`).
    code, _, err = run_cli(["index", str(image_folder)], capsys)
    assert code == 2 and err == (f"fastio: error: {image_folder}: holds no .tar files but images: a folder of images "
                                 f"is converted, not indexed: `fastio convert {image_folder} DEST`\n"), err


def test_index_of_a_folder_of_videos_names_fastio_convert(tmp_path, capsys):
    # Found by the newcomer review: `fastio index clips` of a folder of videos said only 'holds no .tar files'.
    (tmp_path / "clips" / "a").mkdir(parents=True)
    (tmp_path / "clips" / "a" / "v0.mp4").write_bytes(b"x")
    (tmp_path / "clips" / "v1.webm").write_bytes(b"x")
    code, _, err = run_cli(["index", str(tmp_path / "clips")], capsys)
    assert code == 2 and err == (f"fastio: error: {tmp_path / 'clips'}: holds no .tar files but videos (.mp4/.webm "
                                 "files): a folder of videos is converted, not indexed: "
                                 f"`fastio convert {tmp_path / 'clips'} DEST`\n"), err


def test_the_commands_named_for_a_folder_with_a_space_are_quoted(tmp_path, shards, image_folder, capsys):
    # Found by the newcomer review (round 4): `fastio index my wds` (the command the message named, pasted) indexes
    # two folders, 'my' and 'wds'.
    spaced = shutil.move(shards, tmp_path / "my wds")
    images = shutil.move(image_folder, tmp_path / "my images")
    with pytest.raises(DatasetError, match=re.escape(f"make it one with `fastio index '{spaced}'`")):
        Dataset(spaced)
    with pytest.raises(DatasetError, match=re.escape(f"`fastio index '{spaced}'`, then give that folder")):
        Dataset(spaced / "shard-000000.tar")
    with pytest.raises(DatasetError, match=re.escape(f"convert it with `fastio convert '{images}' DEST`")):
        Dataset(images)
    code, _, err = run_cli(["index", str(images)], capsys)
    assert code == 2 and f"`fastio convert '{images}' DEST`" in err, err


def test_a_mistyped_dataset_folder_names_the_nearest_one(tmp_path, image_dataset, capsys):
    # Found by the newcomer review (round 4): Loader('ds/trian') and `fastio verify ds/trian` said only 'no such
    # dataset directory', beside a ds/train the user meant.
    typo = image_dataset.parent / "dss"
    with pytest.raises(DatasetError, match=rf"^{typo}: no such dataset directory \(did you mean {image_dataset}\?\)$"):
        Dataset(typo)
    code, _, err = run_cli(["verify", str(image_dataset.parent / "zzz")], capsys)
    assert err == f"fastio: error: {image_dataset.parent / 'zzz'}: no such dataset directory\n", err


def test_a_split_the_conversion_did_not_make_names_the_splits_there_are(tmp_path, image_folder, capsys):
    """Found by the newcomer review: Loader('ds/test') of a DEST converted with train/val said only 'no such dataset
    directory'. It names the split and lists the ones splits.json has; a split listed whose folder was removed is
    named as such."""
    from fastio.convert.run import ConvertConfig, convert

    ds = tmp_path / "ds"
    convert(ConvertConfig(source=image_folder, dest=ds, split="train=0.75,val=0.25", workers=1, progress=False))
    with pytest.raises(DatasetError, match=rf"^{ds / 'test'}: no split 'test' in {ds} \(its splits.json lists train, "
                                           r"val\)$"):
        Loader(str(ds / "test"), batch_size=4, device="cpu")
    code, _, err = run_cli(["verify", str(ds / "test")], capsys)
    assert code == 2 and err == f"fastio: error: {ds / 'test'}: no split 'test' in {ds} (its splits.json lists " \
                                "train, val)\n", err
    shutil.rmtree(ds / "val")
    with pytest.raises(DatasetError, match=rf"^{ds / 'val'}: a split {ds}/splits.json lists, but its folder is "
                                           "missing"):
        Dataset(ds / "val")


def test_a_folder_of_videos_or_audio_given_as_a_dataset_names_what_it_holds(tmp_path, capsys):
    """Found by the newcomer review: Loader('clips') of a folder of .mp4/.webm files (class folders or not) and
    `fastio verify clips` said 'not a fastio dataset (no manifest.json; an interrupted conversion?)', where a folder
    of images names `fastio convert`. Now: what was found, the command, and the pipeline that reads it."""
    from fastio import ImageTrain

    for name in ("a/v0.mp4", "b/v1.webm"):
        (tmp_path / "clips" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "clips" / name).write_bytes(b"not looked at")
    (tmp_path / "sounds").mkdir()
    (tmp_path / "sounds" / "s0.flac").write_bytes(b"x")
    clips, sounds = tmp_path / "clips", tmp_path / "sounds"
    said = (f"{clips}: a folder of videos (.mp4/.webm files), not a dataset: convert it with `fastio convert {clips} "
            "DEST`, then read DEST with fastio.VideoClips (docs/media.md)")
    with pytest.raises(DatasetError, match=f"^{re.escape(said)}$"):
        Loader(str(clips), batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    assert run_cli(["verify", str(clips)], capsys)[1:] == ("", f"fastio: error: {said}\n")
    with pytest.raises(DatasetError, match=re.escape(f"{sounds}: a folder of audio (.flac files), not a dataset: "
                                                     "convert it with ")):
        Dataset(sounds)


def test_an_empty_folder_is_named_as_such(tmp_path, capsys):
    # Found by the newcomer review (round 4): Loader('empty') said 'not a fastio dataset (no manifest.json; an
    # interrupted conversion?)': nothing was ever converted there.
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=rf"^{tmp_path / 'empty'}: an empty folder, not a dataset: give the "
                                           rf"folder `fastio convert` or `fastio index` made$"):
        Dataset(tmp_path / "empty")
