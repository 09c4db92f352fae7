"""A conversion that fails (a refused input, an error or Ctrl-C mid-way, an upload refused) leaves DEST as it was
before the run: a DEST the run made is gone, a DEST that was there keeps what it held; nothing but what the run
made is removed. Image folders, loose files, tables, token, chat and image-text conversions, local and s3://."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli
from PIL import Image
from tokens_helpers import chat_config, chat_tokenizer, conversations, image_text_source, train_tokenizer, write_chats

from fastio.convert.run import ConvertConfig, convert
from fastio.dataset.manifest import MARKER_NAME
from fastio.report.verify import verify
from fastio.storage.atomic import tmp_path_for
from fastio.storage.lock import LOCK_NAME


def _jpeg(path: Path, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (shade, 0, 0)).save(path)


def _files(root: Path) -> tuple[Path, list[str]]:
    """Loose files: three JPEGs, then one that is not (the reproduction of the report)."""
    for i in range(3):
        _jpeg(root / "src" / f"{i}.jpg", 40 * i)
    (root / "src" / "3.jpg").write_text("notajpeg")
    return root / "src", ["--on-error", "fail", "--max-samples-per-shard", "1"]


def _imagefolder(root: Path) -> tuple[Path, list[str]]:
    for i in range(4):
        _jpeg(root / "src" / "ab"[i % 2] / f"{i}.jpg", 40 * i)
    (root / "src" / "b" / "9.jpg").write_text("notajpeg")
    return root / "src", ["--on-error", "fail", "--max-samples-per-shard", "1"]


def _table(root: Path) -> tuple[Path, list[str]]:
    for i in range(3):
        _jpeg(root / "src" / f"{i}.jpg", 40 * i)
    (root / "src" / "3.jpg").write_text("notajpeg")
    (root / "src" / "t.csv").write_text("path,label\n0.jpg,0\n1.jpg,1\n2.jpg,0\n3.jpg,1\n")
    return root / "src" / "t.csv", ["--on-error", "fail", "--max-samples-per-shard", "1"]


def _tokens(root: Path) -> tuple[Path, list[str]]:
    (root / "src").mkdir()
    (root / "src" / "a.jsonl").write_text("".join(json.dumps({"text": f"the quick fox {i}"}) + "\n" for i in range(9)))
    (root / "src" / "b.jsonl").write_text('{"text": "fine"}\n{broken\n')
    return root / "src", ["--tokenizer", str(train_tokenizer(root / "tokenizer.json")), "--max-samples-per-shard", "2"]


def _chat(root: Path) -> tuple[Path, list[str]]:
    source = write_chats(root / "chats.jsonl", conversations(8))
    source.write_text(source.read_text() + "{broken\n")
    return source, ["--tokenizer", str(chat_tokenizer(root / "tokenizer.json")), "--chat-template",
                    str(chat_config(root / "tokenizer_config.json")), "--max-samples-per-shard", "2"]


def _image_text(root: Path) -> tuple[Path, list[str]]:
    src = image_text_source(root, n=8)
    last = src["rows"][-1]["images"][-1]
    (root / last).write_bytes(b"notanimage")
    return src["source"], ["--tokenizer", str(src["tokenizer"]), "--chat-template", str(src["config"]),
                           "--image-field", "images", "--on-error", "fail", "--max-samples-per-shard", "1"]


SOURCES = {"loose files": _files, "image folder": _imagefolder, "table": _table, "tokens": _tokens, "chat": _chat,
           "image-text": _image_text}


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` with its bytes (None: a folder; the lock file's holder record, which each run
    that takes the lock writes anew, not compared)."""
    return {p.relative_to(folder).as_posix(): None if p.is_dir() or p.name == LOCK_NAME else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


def _fails(capsys, source: Path, dest: Path, *options: str) -> str:
    code, out, err = run_cli(["convert", str(source), str(dest), "--workers", "1", "-q", *options], capsys)
    assert code == 2 and err.startswith("fastio: error: ") and err.count("\n") == 1, (code, out, err)
    return err


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_failed_conversion_removes_the_dest_it_made_and_empties_no_folder_that_was_there(tmp_path, capsys, kind):
    source, options = SOURCES[kind](tmp_path)
    _fails(capsys, source, tmp_path / "out" / "new", *options)
    assert not (tmp_path / "out").exists()  # DEST made by the run (and its parent): gone with it
    (tmp_path / "mine").mkdir()
    _fails(capsys, source, tmp_path / "mine", *options)
    assert _tree(tmp_path / "mine") == {}  # the user's empty folder stays, empty (no marker, lock, shards/)


def test_a_failed_conversion_keeps_what_an_existing_dest_held(tmp_path, capsys):
    source, options = _files(tmp_path)
    (source / "3.jpg").unlink()
    code, out, err = run_cli(["convert", str(source), str(tmp_path / "ds"), "--workers", "1", "-q"], capsys)
    assert code == 0, err
    before = _tree(tmp_path / "ds")
    (source / "3.jpg").write_text("notajpeg")
    err = _fails(capsys, source, tmp_path / "ds", *options)
    assert "already holds a converted dataset" in err and "--overwrite" in err
    assert _tree(tmp_path / "ds") == before  # refused: byte for byte what it held
    # an interrupted run's leftovers (the marker, a shard) are the run's own to replace; the marker stays, so DEST
    # still says it is fastio's unfinished output
    (tmp_path / "half" / "shards").mkdir(parents=True)
    (tmp_path / "half" / MARKER_NAME).write_text("fastio convert output; complete once manifest.json exists\n")
    (tmp_path / "half" / "shards" / "shard-000000.tar").write_bytes(b"x" * 512)
    _fails(capsys, source, tmp_path / "half", *options)
    assert sorted(_tree(tmp_path / "half")) == [MARKER_NAME]


def test_an_error_or_ctrl_c_midway_takes_back_what_the_run_made(tmp_path):
    source, _ = _files(tmp_path)
    (source / "3.jpg").unlink()

    class Stop:  # a conversion built on convert() (image-text's vocabulary) counts each sample as it is written
        def __init__(self, error: BaseException):
            self.error, self.seen = error, 0

        def add(self, fields):
            self.seen += 1
            if self.seen == 2:
                raise self.error

        def manifest_fields(self):
            return {}

    for error, workers in ((KeyboardInterrupt(), 2), (RuntimeError("mid-way"), 1)):
        (tmp_path / "mine").mkdir(exist_ok=True)
        for dest in (tmp_path / "new", tmp_path / "mine"):
            config = ConvertConfig(source, dest, workers=workers, max_samples_per_shard=1,
                                   tally=lambda error=error: Stop(error))
            with pytest.raises(type(error)):
                convert(config)
        assert not (tmp_path / "new").exists()
        assert _tree(tmp_path / "mine") == {}


@pytest.mark.parametrize("kind", ["tokens", "image folder"])
def test_a_dest_spelt_through_a_new_folder_and_dotdot_is_judged_and_taken_back_where_the_os_finds_it(
        tmp_path, capsys, kind):
    """``x/new/../ds`` (``x/new`` missing) is ``x/ds``: a failed run leaves no ``x/new`` behind, and an empty
    ``x/ds`` that was there stays; through a link (``x/link/..`` is the parent of the link's target, not ``x``),
    ``..`` keeps the meaning the OS gives it."""
    source, options = SOURCES[kind](tmp_path)
    x, elsewhere = tmp_path / "x", tmp_path / "elsewhere"
    (elsewhere / "target").mkdir(parents=True)
    x.mkdir()
    _fails(capsys, source, x / "new" / ".." / "ds", *options)
    assert _tree(x) == {}
    (x / "ds").mkdir()
    _fails(capsys, source, x / "new" / ".." / "ds", *options)
    assert _tree(x) == {"ds": None}  # the user's empty folder: there before the run, so it stays
    (x / "ds").rmdir()
    (x / "link").symlink_to(elsewhere / "target")
    _fails(capsys, source, x / "link" / ".." / "new" / ".." / "ds", *options)
    assert _tree(x) == {"link": None} and _tree(elsewhere) == {"target": None}


def test_a_failed_part_removes_the_folders_it_made(tmp_path, capsys):
    source, options = _files(tmp_path)
    _fails(capsys, source, tmp_path / "parts", *options, "--part", "1/2")
    assert not (tmp_path / "parts").exists()


def test_a_failed_conversion_to_s3_leaves_nothing_under_the_prefix(tmp_path, capsys, aws_env, s3_bucket,
                                                                   fault_proxy, monkeypatch):
    from fastio.storage import open_storage

    source, options = _files(tmp_path)
    staging = tmp_path / "staging"
    _fails(capsys, source, f"s3://{s3_bucket}/ds", *options, "--staging-dir", str(staging))
    assert [o.key for o in open_storage(f"s3://{s3_bucket}/ds").list()] == []
    assert _tree(staging) == {}
    # an upload refused half-way (the second shard): the objects this run put are taken back
    (source / "3.jpg").unlink()
    fault_proxy.forbidden = {"/ds/shards/shard-000001"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    err = _fails(capsys, source, f"s3://{s3_bucket}/ds", "--max-samples-per-shard", "1", "--staging-dir", str(staging))
    assert "shard-000001" in err, err
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{fault_proxy.upstream_port}")
    assert [o.key for o in open_storage(f"s3://{s3_bucket}/ds").list()] == []
    assert _tree(staging) == {}


def test_no_shard_is_uploaded_before_the_marker(tmp_path, capsys, aws_env, s3_bucket, fault_proxy, monkeypatch):
    """Before: the upload of a conversion to s3:// put the marker (.fastio-output) in parallel with the shards, so a
    run killed mid-upload could leave shards without marker or manifest: a prefix that `fastio verify` then calls
    WebDataset tars to index (the shards of an unfinished conversion as a dataset), and that the rerun refuses as
    not fastio output. Now the marker is stored first: here it is refused, and no shard is sent at all."""
    source, _ = _files(tmp_path)
    (source / "3.jpg").unlink()
    fault_proxy.forbidden = {"/ds/.fastio-output"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    err = _fails(capsys, source, f"s3://{s3_bucket}/ds", "--max-samples-per-shard", "1", "--staging-dir",
                 str(tmp_path / "staging"))
    assert ".fastio-output" in err, err
    assert not [ident for ident in fault_proxy._seen if ident.startswith("PUT ") and "/ds/shards/" in ident]


def test_a_staging_dir_spelt_through_a_new_folder_and_dotdot_is_made_where_the_os_finds_it(tmp_path, capsys,
                                                                                            aws_env, s3_bucket):
    """``--staging-dir x/new/../st`` (``x/new`` missing) is ``x/st``, as DEST: no ``x/new`` is left behind."""
    source, options = _files(tmp_path)
    x = tmp_path / "x"
    x.mkdir()
    _fails(capsys, source, f"s3://{s3_bucket}/ds", *options, "--staging-dir", str(x / "new" / ".." / "st"))
    assert _tree(x) == {"st": None}


def test_the_lock_file_left_by_an_earlier_run_stays(tmp_path, capsys):
    source, options = _files(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / LOCK_NAME).write_text("{}")
    _fails(capsys, source, tmp_path / "mine", *options)
    assert sorted(_tree(tmp_path / "mine")) == [LOCK_NAME]  # the run's holder record in it, the file the user's


def test_a_failed_run_whose_lock_file_was_replaced_takes_back_nothing_of_the_next_writer(tmp_path):
    """The lock file removed while the run holds it (``rm -rf`` of DEST's lock, a remount) lets a second writer lock
    a new file and write DEST; the first run, failing afterwards, no longer holds DEST's lock: it deletes nothing
    (not the second writer's complete dataset, not its lock file)."""
    source, _ = _files(tmp_path)
    (source / "3.jpg").unlink()
    dest = tmp_path / "ds"

    class NextWriter:  # at the first run's second sample: its lock file goes and another conversion writes DEST
        seen = 0

        def add(self, fields):
            NextWriter.seen += 1
            if NextWriter.seen == 2:
                (dest / LOCK_NAME).unlink()
                convert(ConvertConfig(source, dest, workers=1, overwrite=True))
                raise RuntimeError("the first run fails after the second one finished")

        def manifest_fields(self):
            return {}

    with pytest.raises(RuntimeError):
        convert(ConvertConfig(source, dest, workers=1, max_samples_per_shard=1, tally=NextWriter))
    assert (dest / "manifest.json").is_file() and (dest / LOCK_NAME).is_file()
    assert verify(dest).ok


def test_an_overwrite_that_fails_before_it_emptied_dest_keeps_the_old_dataset(tmp_path, capsys):
    """A run with --overwrite that cannot even write its marker (here its temporary name is taken by a folder; a
    full disk alike) has deleted nothing: the old dataset stays, byte for byte."""
    source, options = _files(tmp_path)
    (source / "3.jpg").unlink()
    code, out, err = run_cli(["convert", str(source), str(tmp_path / "ds"), "--workers", "1", "-q"], capsys)
    assert code == 0, err
    before = _tree(tmp_path / "ds")
    blocked = tmp_path_for(tmp_path / "ds" / MARKER_NAME)
    blocked.mkdir()
    _fails(capsys, source, tmp_path / "ds", "--overwrite")
    assert blocked.is_dir() and (tmp_path / "ds" / "manifest.json").is_file()
    blocked.rmdir()
    assert _tree(tmp_path / "ds") == before


@pytest.mark.parametrize("planted", ["a link to another folder", "a folder others can write in"])
def test_a_staging_folder_that_is_not_the_users_own_is_refused_before_anything_is_written(
        tmp_path, capsys, aws_env, s3_bucket, planted):
    """The staging folder's name is known in advance (``/tmp`` by default, shared by every user): one planted there
    (a link to a folder of the user's, or a folder anyone can write a ``dest`` link into) would have the conversion
    empty that folder (it replaces a killed run's copy) and delete it after. It is refused, naming it; the folder
    it leads to keeps its files."""
    from fastio.convert.dest import staging_path

    source, options = _files(tmp_path)
    (source / "3.jpg").unlink()
    url, stage = f"s3://{s3_bucket}/ds", tmp_path / "stage"
    staging = staging_path(url, stage)
    mine = tmp_path / "mine" / "dest"
    mine.mkdir(parents=True)
    (mine / "only-copy.txt").write_text("irreplaceable")
    stage.mkdir()
    if planted == "a link to another folder":
        staging.symlink_to(tmp_path / "mine")
    else:
        staging.mkdir(mode=0o777)
        staging.chmod(0o777)
        (staging / "dest").symlink_to(mine)
    err = _fails(capsys, source, url, "--staging-dir", str(stage))
    assert str(staging) in err, err
    assert _tree(tmp_path / "mine") == {"dest": None, "dest/only-copy.txt": b"irreplaceable"}


def test_files_another_process_puts_in_dest_during_a_failed_run_stay(tmp_path, capsys):
    """DEST is the user's folder: what someone else writes in it while the run writes (under names a conversion
    never writes) is not the run's to take back. It stays, and so that the next conversion refuses DEST instead of
    emptying it, the run's marker goes too."""
    source, _ = _files(tmp_path)
    (source / "3.jpg").unlink()
    dest = tmp_path / "new" / "ds"

    class Meanwhile:  # at the run's second sample, another process writes into DEST; the run then fails
        seen = 0

        def add(self, fields):
            Meanwhile.seen += 1
            if Meanwhile.seen == 2:
                (dest / "notes.txt").write_text("the user's")
                (dest / "train").mkdir()
                (dest / "train" / "mine.txt").write_text("the user's too")
                (dest / "train" / "manifest.json").write_text("{}")
                raise RuntimeError("the run fails")

        def manifest_fields(self):
            return {}

    with pytest.raises(RuntimeError):
        convert(ConvertConfig(source, dest, workers=1, max_samples_per_shard=1, tally=Meanwhile))
    assert _tree(dest) == {"notes.txt": b"the user's", "train": None, "train/mine.txt": b"the user's too",
                           "train/manifest.json": b"{}"}
    err = _fails(capsys, source, dest)
    assert "not fastio output" in err and _tree(dest)["notes.txt"] == b"the user's"


def test_emptying_dest_deletes_nothing_through_a_link_in_it(tmp_path, capsys):
    """A link in DEST to another dataset's folder (an interrupted run's DEST, replaced by the rerun; or a folder
    given with --overwrite) goes as a link: the dataset it leads to keeps its manifest."""
    source, _ = _files(tmp_path)
    (source / "3.jpg").unlink()
    code, out, err = run_cli(["convert", str(source), str(tmp_path / "other"), "--workers", "1", "-q"], capsys)
    assert code == 0, err
    before = _tree(tmp_path / "other")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / MARKER_NAME).write_text("fastio convert output; complete once manifest.json exists\n")
    (tmp_path / "half" / "val").symlink_to(tmp_path / "other")
    code, out, err = run_cli(["convert", str(source), str(tmp_path / "half"), "--workers", "1", "-q"], capsys)
    assert code == 0, err
    assert not (tmp_path / "half" / "val").exists() and _tree(tmp_path / "other") == before
