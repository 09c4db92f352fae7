"""A converted dataset that was damaged or tampered with after conversion: the index is checked whenever it is read, a
shard replaced while it is read is noticed, `fastio verify` sees stray files, labels that do not fit int64 name their
shard and key, and bare `fastio` is not an error; a shard rewritten in place after `fastio index` (two samples of the
same sizes swapped) is refused by its tar headers, and a damaged .idx says what is no longer checked."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from fastio import ImageEval, ImageTrain, Raw
from fastio.cli import main
from fastio.convert.synthetic import photo_jpeg
from fastio.dataset.dataset import Dataset
from fastio.dataset.sample_table import INDEX_NAME, build_index
from fastio.dataset.shards import ShardWriter
from fastio.errors import DatasetError
from fastio.formats.dali_idx import IndexEntry, check_index
from fastio.loader import Loader
from fastio.read.reader import Reader
from fastio.report.verify import verify

IDX = "shard-000001.idx"


def _loader(dest, **kw):
    opts = dict(batch_size=8, pipeline=Raw(), device="cpu", world_size=1, rank=0, num_threads=1)
    opts.update(kw)
    return Loader(dest, **opts)


def _tamper(dest: Path, edit, *, consistent: bool) -> None:
    """Rewrite shard 1's index with ``edit(lines) -> lines``; with ``consistent``, also record the new
    index's sha256 in the manifest (a tamperer who covers their tracks)."""
    path = dest / "shards" / IDX
    lines = path.read_text().splitlines()
    path.write_text("\n".join(edit(lines)) + "\n")
    if consistent:
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest["shards"][1]["idx_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (dest / "manifest.json").write_text(json.dumps(manifest))


def _drop_sample_index(dest: Path) -> None:
    """Make ``dest`` a dataset of the kind written before the sample index existed: readers, the Loader
    included, then take every location from the ``.idx`` files."""
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["index"]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    (dest / INDEX_NAME).unlink()


def _set_member(lines: list[str], row: int, offset=None, size=None) -> list[str]:
    parts = lines[row].split(" ")
    if offset is not None:
        parts[1] = str(offset)
    if size is not None:
        parts[2] = str(size)
    return [*lines[:row], " ".join(parts), *lines[row + 1:]]


def _shard_bytes(dest: Path) -> int:
    return (dest / "shards" / "shard-000001.tar").stat().st_size


TAMPERING = {
    "negative offset": (lambda d: lambda ls: _set_member(ls, 3, offset=-512), "not two non-negative integers"),
    "absurd size": (lambda d: lambda ls: _set_member(ls, 3, size=10**15), "reaches past the end of the shard"),
    "beyond the shard": (lambda d: lambda ls: _set_member(ls, 16, offset=_shard_bytes(d)),
                         "reaches past the end of the shard"),
    "unaligned offset": (lambda d: lambda ls: _set_member(ls, 3, offset=int(ls[3].split()[1]) + 7),
                         "is not the start of a member's data"),
    "two samples share bytes": (lambda d: lambda ls: _set_member(ls, 4, offset=int(ls[3].split()[1])),
                                "is not the start of a member's data"),
    "swapped keys": (lambda d: lambda ls: [*ls[:3], ls[4], ls[3], *ls[5:]], "is not the start of a member's data"),
    "duplicated sample": (lambda d: lambda ls: [*ls[:4], ls[3], *ls[5:]], "is listed twice"),
    "member of another key": (lambda d: lambda ls: [ls[0], *ls[1:3], ls[3].replace(ls[3].split()[3].split(".")[0],
                                                                                     "intruder", 1), *ls[4:]],
                              "does not match key"),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_tampered_index_names_the_index_file(case, image_dataset):
    make_edit, reason = TAMPERING[case]
    _tamper(image_dataset, make_edit(image_dataset), consistent=True)
    with pytest.raises(DatasetError, match=rf"shards/{IDX}.*{reason}"):
        _ = Dataset(image_dataset).table
    problems = [p.line() for p in verify(image_dataset).problems]
    assert any(IDX in p for p in problems), problems
    _drop_sample_index(image_dataset)  # a Loader reads the .idx files only for datasets without samples.fxi
    with pytest.raises(DatasetError, match=rf"shards/{IDX}"):
        list(_loader(image_dataset))


@pytest.mark.parametrize("verify_shards", [True, False])
def test_index_sha256_is_checked_whenever_it_is_read(image_dataset, verify_shards):
    """Swapping two samples' lines delivers one sample's bytes under the other's key; the manifest's
    idx_sha256 catches it (always: hashing the index costs a few per cent of parsing it)."""
    def swap_offsets(ls):
        a, b = ls[2].split(" "), ls[3].split(" ")
        a[1], b[1], a[5], b[5] = b[1], a[1], b[5], a[5]
        return [*ls[:2], " ".join(a), " ".join(b), *ls[4:]]

    _drop_sample_index(image_dataset)
    _tamper(image_dataset, swap_offsets, consistent=False)
    with pytest.raises(DatasetError, match=rf"shards/{IDX}: sha256 does not match the manifest"):
        list(_loader(image_dataset, verify=verify_shards))


def _forge_sample_index(dest: Path, tmp_path: Path, edit) -> None:
    """Replace ``dest``'s samples.fxi by one built from its shards' entries after ``edit(entries of shard 1)``
    (same size, valid header: only the rows differ)."""
    ds = Dataset(dest)
    shards = [(s, list(ds.read_index(s))) for s in ds.shards]
    edit(shards[1][1], shards[1][0])
    build_index(tmp_path / INDEX_NAME, shards, ds.fields)
    assert (tmp_path / INDEX_NAME).stat().st_size == (dest / INDEX_NAME).stat().st_size
    os.replace(tmp_path / INDEX_NAME, dest / INDEX_NAME)


def _as_old_manifest(dest: Path) -> None:
    """Drop the sample index's xxh3-128 from the manifest (one written before fastio recorded it)."""
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["index"]["xxh3_128"]
    (dest / "manifest.json").write_text(json.dumps(manifest))


def _swap(entries, record):
    entries[2], entries[5] = entries[5], entries[2]


def _duplicate(entries, record):
    entries[3] = entries[2]


def _past_the_end(entries, record):
    first, far = entries[0], record.bytes + 4096
    entries[0] = IndexEntry(first.key, tuple((ext, offset - first.span[0] + far, size)
                                             for ext, offset, size in first.members))


@pytest.mark.parametrize("edit", [_swap, _duplicate, _past_the_end], ids=lambda f: f.__name__.strip("_"))
def test_a_tampered_sample_index_is_refused_on_open(image_dataset, tmp_path, edit):
    """Issue 19.6: a swapped, duplicated or moved row of samples.fxi delivered other samples' bytes under the
    default verify=False. Now every open checks its xxh3-128 against the manifest, and (for manifests without
    it) its structure: samples in tar order, inside their shard."""
    _forge_sample_index(image_dataset, tmp_path, edit)
    with pytest.raises(DatasetError, match=rf"{INDEX_NAME}: sample index xxh3_128 does not match the manifest"):
        _loader(image_dataset)
    with pytest.raises(DatasetError, match="sample index sha256 does not match the manifest"):
        _loader(image_dataset, verify=True)
    _as_old_manifest(image_dataset)
    what = "past the shard's" if edit is _past_the_end else "inside the previous sample"
    with pytest.raises(DatasetError, match=rf"{INDEX_NAME}: sample index row 1[0-9] \(shard #1, sample \d\) .*{what}"):
        Dataset(image_dataset)


def test_an_intact_sample_index_of_an_old_manifest_still_opens(image_dataset):
    """A manifest without the index's xxh3-128 opens (structure checked) and reads every sample once."""
    _as_old_manifest(image_dataset)
    loader = _loader(image_dataset, shuffle="none")
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(48))


def test_a_big_sample_index_is_checked_once_per_node_while_it_is_the_same_file(image_dataset, tmp_path, monkeypatch):
    """Past CHECKED_STAMP_MIN_BYTES the checks of samples.fxi (xxh3-128 + structure: ~1 s per 10^7 samples) run once
    per node: a stamp named by the file's identity in $TMPDIR/fastio-checked-UID/. A file rewritten afterwards
    has another identity, so it is checked again."""
    import tempfile

    from fastio.dataset import sample_table

    monkeypatch.setattr(sample_table, "CHECKED_STAMP_MIN_BYTES", 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    checks = []
    real = sample_table.SampleIndex.check_structure
    monkeypatch.setattr(sample_table.SampleIndex, "check_structure",
                        lambda self, *a, **k: checks.append(1) or real(self, *a, **k))
    Dataset(image_dataset)
    Dataset(image_dataset)
    assert len(checks) == 1 and len(list((tmp_path / "node-tmp").glob("fastio-checked-*/*"))) == 1
    _forge_sample_index(image_dataset, tmp_path, _swap)  # a new file (same size): checked again, refused
    with pytest.raises(DatasetError, match="sample index xxh3_128 does not match the manifest"):
        Dataset(image_dataset)


def test_check_index_accepts_what_the_writer_writes(tmp_path, image_dataset):
    ds = Dataset(image_dataset)
    for shard in ds.shards:
        check_index(ds.read_index(shard), samples=shard.samples, tar_bytes=shard.bytes)
    with pytest.raises(ValueError, match="index lists 1 sample, manifest says 2"):
        check_index([IndexEntry("a", (("jpg", 512, 3),))], samples=2, tar_bytes=10240)


# -- a shard replaced while it is read ----------------------------------------------------------------

def _replace_by_rename(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[600] ^= 0xFF
    tmp = path.with_name(".new")
    tmp.write_bytes(bytes(data))  # same size
    os.replace(tmp, path)


def _rewrite_in_place(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[600] ^= 0xFF
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.write(bytes(data))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a coarse clock may not move the mtime


@pytest.mark.parametrize("replace", [_replace_by_rename, _rewrite_in_place])
@pytest.mark.parametrize("verify_shards", [False, True])
def test_shard_replaced_during_iteration_is_detected(image_dataset, replace, verify_shards):
    ds = Dataset(image_dataset)
    with Reader(ds, ["jpg"], verify=verify_shards) as reader:
        first = reader.read(np.arange(0, 4))["jpg"]
        assert len(first) == 4
        replace(image_dataset / "shards" / "shard-000000.tar")
        reader.read(np.arange(20, 24))  # other shards stay readable
        with pytest.raises(DatasetError, match=r"shard shard-000000.tar was replaced or modified while being read"):
            reader.read(np.arange(4, 8))


def test_shard_of_the_wrong_size_is_refused_at_open(image_dataset):
    path = image_dataset / "shards" / "shard-000001.tar"
    path.chmod(0o644)
    with open(path, "ab") as f:
        f.write(bytes(512))
    with Reader(Dataset(image_dataset), ["jpg"]) as reader, \
            pytest.raises(DatasetError, match=r"shard shard-000001.tar is \d+ bytes, manifest says \d+: it changed "
                          r"after it was indexed; convert the source again \(fastio convert with --overwrite\)$"):
        reader.read(np.arange(16, 18))  # a converted dataset's manifest is never replaced by fastio index


# -- labels in the Loader -----------------------------------------------------------------------------

@pytest.mark.parametrize("label", [b"99999999999999999999", b"-4", b""])
def test_label_outside_int64_names_shard_and_key(tmp_path, image_folder, label):
    writer = ShardWriter(tmp_path / "lbl", max_samples=4)
    for k, path in enumerate(sorted(image_folder.rglob("*.jpg"))[:8]):
        writer.write({"__key__": f"k{k}", "jpg": path.read_bytes(), "cls": label if k == 6 else b"1"})
    writer.close(image_field="jpg", label_field="cls")
    loader = Loader(tmp_path / "lbl", batch_size=4, pipeline=ImageTrain(size=32), device="cpu", world_size=1, rank=0,
                    num_threads=1, shuffle="none")
    with pytest.raises(DatasetError, match=r"lbl: shard shard-000001.tar key 'k6': field 'cls' is not an integer "
                                           r"label"):
        list(loader)


# -- fastio verify: files the manifest does not list --------------------------------------------------

def test_verify_reports_shard_files_missing_from_the_manifest(image_dataset, capsys):
    shards = image_dataset / "shards"
    (shards / "shard-000099.tar").write_bytes((shards / "shard-000000.tar").read_bytes())
    (shards / "other-000000.idx").write_text("v1.2 0\n")
    problems = [p.line() for p in verify(image_dataset).problems]
    assert problems == ["shards/other-000000.idx: file is not listed in the manifest",
                        "shards/shard-000099.tar: file is not listed in the manifest"]
    assert main(["verify", str(image_dataset)]) == 1
    out, err = capsys.readouterr()
    assert "shards/shard-000099.tar: file is not listed in the manifest" in out and "2 problems" in err


# -- bare `fastio` ------------------------------------------------------------------------------------

def test_bare_fastio_prints_usage_on_stdout_and_exits_0(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Usage: fastio") and "convert" in out and err == ""
    proc = subprocess.run([sys.executable, "-m", "fastio.cli"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: fastio") and proc.stderr == ""
    assert main(["ckpt"]) == 0  # a group without its command: the same rule
    out, err = capsys.readouterr()
    assert out.startswith("Usage: fastio ckpt") and "error" not in err


def _write_tar(path: Path, samples: dict[str, dict[str, bytes]], fmt=tarfile.GNU_FORMAT) -> None:
    with tarfile.open(path, "w", format=fmt) as tar:
        for key, fields in samples.items():
            for field, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_shard_rewritten_with_two_samples_swapped_is_refused(tmp_path, capsys, fmt):
    """Two samples of the same sizes swapped in a shard after `fastio index` (same size, so the size check at open
    passes): before, each was delivered under the other's key; now every read checks each member's tar header."""
    jpeg = photo_jpeg(np.random.default_rng(0), 32, 24)  # one image for all: only the names tell them apart
    samples = {f"s{i:02d}": {"cls": b"%d" % (i % 2), "jpg": jpeg, "txt": b"text of sample %02d" % i}
               for i in range(8)}
    folder = tmp_path / "web"
    folder.mkdir()
    _write_tar(folder / "0.tar", samples, fmt)
    code, _, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err
    with Loader(folder, batch_size=8, pipeline=Raw(fields=("txt",)), device="cpu", shuffle="none") as loader:
        assert next(iter(loader))["txt"] == [samples[f"s{i:02d}"]["txt"] for i in range(8)]  # the check passes
    size = (folder / "0.tar").stat().st_size
    order = ["s00", "s01", "s03", "s02", *[f"s{i:02d}" for i in range(4, 8)]]
    _write_tar(folder / "0.tar", {k: samples[k] for k in order}, fmt)  # in place, s02 and s03 swapped
    assert (folder / "0.tar").stat().st_size == size
    refused = (rf"^{folder}: shard 0\.tar key 's02': field 'txt': the index says member 's02\.txt' of 17 bytes at "
               r"offset \d+, the shard holds member 's03\.txt' of 17 bytes there: it was rewritten after it was "
               rf"indexed; re-run `fastio index {folder} --overwrite`$")
    with Loader(folder, batch_size=8, pipeline=Raw(fields=("txt",)), device="cpu", shuffle="none") as loader:
        with pytest.raises(DatasetError, match=refused):
            next(iter(loader))
    with Loader(folder, batch_size=8, pipeline=ImageEval(size=16), device="cpu", num_threads=1,
                shuffle="none") as loader:  # a decoding pipeline: the image's member (and the label's)
        with pytest.raises(DatasetError, match=r"key 's02': field '(jpg|cls)': .* holds member 's03\.(jpg|cls)'"):
            next(iter(loader))
    with Reader(Dataset(folder), ["cls"]) as reader:  # the label members too (same sizes)
        assert reader.read(np.arange(2))["cls"][1].tobytes() == b"1"  # samples before the swap still read
        with pytest.raises(DatasetError, match=r"key 's02': field 'cls': .* holds member 's03\.cls' of 1 byte"):
            reader.read(np.arange(8))


def test_a_damaged_idx_leaves_member_names_checked_by_field_and_size_and_says_so(image_dataset, caplog):
    """The Loader reads samples.fxi, not the .idx files; the tar-header check wants their keys. A damaged .idx
    does not stop training (as before the check), but the warning names it and what is no longer checked."""
    for idx in (image_dataset / "shards").glob("*.idx"):
        idx.chmod(0o644)
        idx.write_text("garbage that no parser accepts\n")
    with caplog.at_level(logging.WARNING, logger="fastio"):
        loader = Loader(image_dataset, batch_size=8, pipeline=ImageTrain(size=32), device="cpu", world_size=1, rank=0,
                        num_threads=1)
        n = sum(len(b["label"]) for b in loader)
        loader.close()
    assert n == len(Dataset(image_dataset))
    said = [r.getMessage() for r in caplog.records if "checked by field and size only" in r.getMessage()]
    assert said and "shard-000000.idx" in said[0] and "sha256" in said[0]
