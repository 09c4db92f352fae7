"""`fastio index`: WebDataset shards written by `webdataset.ShardWriter` and by GNU `tar` (long names, pax
headers, nested keys, multi-dot fields, scrambled member order, missing fields, an empty shard) become a fastio
dataset in place or with --dest, locally and on the moto S3 server; every sample is read exactly once with its
own bytes and label; refusals name the file and the reason (damaged tars that tarfile reads without a word: cut at a member
boundary, a damaged header, a GNU sparse member; a label field holding text; a DEST fastio did not make)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from fastio import ImageEval, ImageTrain, Raw
from fastio.convert.synthetic import photo_jpeg
from fastio.dataset.dataset import Dataset
from fastio.loader import Loader

WDS2IDX = Path(sys.executable).with_name("wds2idx")
LONG = "k" * 110  # a GNU tar long name (over USTAR's 100 bytes with its field)


def _wds_shards(folder: Path, n: int = 20, per_shard: int = 8) -> dict[str, dict[str, bytes]]:
    """Shards by webdataset.ShardWriter: jpg + cls, a json in two of three samples."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    samples = {}
    with wds.ShardWriter(str(folder / "wds-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            sample = {"jpg": photo_jpeg(rng, 24 + i % 5, 20), "cls": str(i % 7).encode()}
            if i % 3:
                sample["json"] = json.dumps({"i": i}).encode()
            sink.write({"__key__": f"w{i:04d}", **sample})
            samples[f"w{i:04d}"] = sample
    return samples


def _gnu_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]], fmt: str = "gnu") -> None:
    """A tar by GNU tar with the members of each sample in the given (not sorted) order."""
    src = path.parent / f".{path.name}.src"
    src.mkdir(parents=True)
    names = []
    for key, fields in samples:
        for field, data in fields.items():
            (src / f"{key}.{field}").parent.mkdir(parents=True, exist_ok=True)
            (src / f"{key}.{field}").write_bytes(data)
            names.append(f"{key}.{field}")
    (src / ".list").write_text("".join(n + "\n" for n in names))
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(path), "-C", str(src), "--no-recursion", "-T",
                    str(src / ".list")], check=True)
    shutil.rmtree(src)


def _small_tar(path: Path, members: list[tuple[str, bytes]], end_blocks: bool = True) -> None:
    """A tar of ``members`` (name, data) by tarfile; without ``end_blocks``, the file ends after the last member."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    path.write_bytes(data if end_blocks else data[:sum(512 + -(-len(d) // 512) * 512 for _, d in members)])


def _tar_samples(n0: int, n: int) -> list[tuple[str, dict[str, bytes]]]:
    """Nested keys, long keys, multi-dot fields, members in scrambled order, some fields missing."""
    rng = np.random.default_rng(n0)
    out = []
    for i in range(n0, n0 + n):
        key = f"deep/er/t{i:04d}" if i % 2 else f"{LONG}{i:04d}"
        fields = {"seg.png": f"mask {i}".encode(), "cls": str(i % 7).encode(), "jpg": photo_jpeg(rng, 20, 24)}
        if i % 4 == 0:
            del fields["seg.png"]
        out.append((key, fields))
    return out


@pytest.fixture
def shards(tmp_path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """A folder of 3 ShardWriter shards, a GNU tar, a pax tar and an empty tar; and every sample's fields."""
    folder = tmp_path / "shards"
    expected = _wds_shards(folder)
    gnu, pax = _tar_samples(100, 6), _tar_samples(200, 5)
    _gnu_tar(folder / "sub" / "gnu.tar", gnu)
    _gnu_tar(folder / "sub" / "pax.tar", pax, fmt="pax")
    _gnu_tar(folder / "sub" / "zz-empty.tar", [])
    expected.update(dict(gnu + pax))
    return folder, expected


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.tar"))}


def _read_all(dest, expected: dict[str, dict[str, bytes]], batch_size: int = 5, **kw) -> None:
    """Every sample exactly once, each field its own bytes (b"" where the sample lacks an image field), label =
    int(cls). (json, which some samples lack, is not asked for: the raw pipeline's optional non-image fields are
    issue 19.7.)"""
    ds = Dataset(dest, **{k: v for k, v in kw.items() if k in ("cache_dir", "cache_size")})
    fields = [f for f in ds.fields if f != "json"]
    seen = []
    with Loader(dest, batch_size=batch_size, device="cpu", pipeline=Raw(fields=fields), num_threads=1, **kw) as loader:
        for batch in loader:
            for j, index in enumerate(batch["index"].tolist()):
                if batch["padded"][j]:
                    continue
                key = ds.key(index)
                want = expected[key]
                for field in fields:
                    assert bytes(batch[field][j]) == want.get(field, b""), (key, field)
                assert batch["label"][j].item() == int(want["cls"])
                seen.append(key)
    assert sorted(seen) == sorted(expected)


def test_index_in_place_reads_every_sample_once_with_its_bytes_and_label(shards, capsys):
    folder, expected = shards
    before = _digests(folder)
    code, out, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err
    assert _digests(folder) == before  # not one byte of a shard written
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format_version"] == 2  # shards outside DEST/shards/: an older fastio refuses it by version
    assert [s["location"] for s in manifest["shards"]] == [
        "sub/gnu.tar", "sub/pax.tar", "wds-000000.tar", "wds-000001.tar", "wds-000002.tar"]
    assert (folder / "sub" / "gnu.idx").is_file() and (folder / "wds-000000.idx").is_file()
    assert manifest["field_counts"] == {"cls": 31, "jpg": 31, "json": 13, "seg.png": 7}
    assert manifest["label_field"] == "cls" and manifest["image_field"] == "jpg"
    assert manifest["skipped"] == [{"path": str(folder / "sub" / "zz-empty.tar"), "reason": "empty shard (no samples)"}]
    for shuffle in ("global", "block", "none"):
        _read_all(folder, expected, shuffle=shuffle, block_shards=2)
    assert run_cli(["verify", str(folder)], capsys)[0] == 0
    code, out, _ = run_cli(["inspect", str(folder), "--json"], capsys)
    assert code == 0 and json.loads(out)["samples"] == 31


@pytest.mark.skipif(not WDS2IDX.exists(), reason="wds2idx comes with DALI")
def test_idx_files_equal_wds2idx_except_where_wds2idx_misplaces_gnu_long_names(shards, tmp_path, capsys):
    """Byte-equal to wds2idx for ShardWriter and pax tars. For GNU long names wds2idx records the offset of the
    long-name block (tar --block-num), not of the data: fastio records the data's offset (checked by reading)."""
    folder, _ = shards
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    for tar in ("wds-000000.tar", "wds-000002.tar", "sub/pax.tar", "sub/gnu.tar"):
        theirs = tmp_path / "theirs.idx"
        subprocess.run([str(WDS2IDX), str(folder / tar), str(theirs)], check=True, capture_output=True)
        ours = (folder / tar).with_suffix(".idx").read_bytes()
        assert (ours == theirs.read_bytes()) is (tar != "sub/gnu.tar"), tar


def test_an_existing_idx_is_checked_and_never_overwritten(shards, capsys):
    folder, expected = shards
    good = folder / "wds-000001.idx"
    subprocess.run([str(WDS2IDX), str(folder / "wds-000001.tar"), str(good)], check=True, capture_output=True)
    stamp = good.stat().st_mtime_ns
    bad = folder / "wds-000002.idx"
    bad.write_text("v1.2 1\njpg 512 3 w0016.jpg\n")
    code, _, err = run_cli(["index", str(folder)], capsys)
    assert code == 2 and f"{bad}: exists and differs from the index of {folder / 'wds-000002.tar'} (" in err
    assert err.count("\n") == 1 and not (folder / "manifest.json").exists()
    assert bad.read_text() == "v1.2 1\njpg 512 3 w0016.jpg\n"
    bad.unlink()
    code, out, err = run_cli(["index", str(folder)], capsys)
    assert code == 0 and "4 .idx written" in out, err
    assert good.stat().st_mtime_ns == stamp
    code, _, err = run_cli(["index", str(folder)], capsys)
    assert code == 2 and "already holds a dataset" in err and "--overwrite" in err
    assert run_cli(["index", str(folder), "--overwrite", "-q"], capsys)[0] == 0


def test_index_with_dest_leaves_a_read_only_source_alone(shards, tmp_path, capsys):
    folder, expected = shards
    listing = sorted(p.name for p in folder.rglob("*"))
    for p in [folder, *folder.rglob("*")]:
        if p.is_dir():
            p.chmod(0o555)
    try:
        code, _, err = run_cli(["index", f"{folder}/wds-{{000000..000002}}.tar", "--dest", str(tmp_path / "meta"),
                                "-q"], capsys)
        assert code == 0, err
    finally:
        for p in [folder, *folder.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
    assert sorted(p.name for p in folder.rglob("*")) == listing
    manifest = json.loads((tmp_path / "meta" / "manifest.json").read_text())
    assert [s["location"] for s in manifest["shards"]] == [str(folder / f"wds-00000{i}.tar") for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "meta" / "shards").iterdir()) == [
        f"wds-00000{i}.idx" for i in range(3)]
    _read_all(tmp_path / "meta", {k: v for k, v in expected.items() if k.startswith("w")})
    # a shard changed after indexing: verify names it, the Loader refuses it at open (size)
    with open(folder / "wds-000001.tar", "ab") as f:
        f.write(b"\0" * 512)
    code, out, _ = run_cli(["verify", str(tmp_path / "meta")], capsys)
    assert code == 1 and "wds-000001.tar: sha256 does not match the manifest" in out


def test_a_dest_spelt_through_a_new_folder_and_dotdot_is_made_where_the_os_finds_it(shards, tmp_path, capsys):
    """``--dest x/new/../meta`` (``x/new`` missing) is ``x/meta``, as ``fastio convert``'s DEST: no ``x/new`` is
    made on the way and left behind."""
    folder, expected = shards
    x = tmp_path / "x"
    x.mkdir()
    code, _, err = run_cli(["index", f"{folder}/wds-{{000000..000002}}.tar", "--dest", str(x / "new" / ".." / "meta"),
                            "-q"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in x.iterdir()) == ["meta"]
    _read_all(x / "meta", {k: v for k, v in expected.items() if k.startswith("w")})


def _refused(capsys, source, needle: str, *extra: str) -> None:
    code, out, err = run_cli(["index", str(source), *extra], capsys)
    assert code == 2 and err.startswith("fastio: error: ") and needle in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_refusals_name_the_file_and_the_reason(tmp_path, capsys):
    folder = tmp_path / "bad"
    folder.mkdir()
    dup = folder / "dup.tar"
    _gnu_tar(dup, [("a", {"jpg": b"1"}), ("b", {"jpg": b"2"}), ("a", {"cls": b"3"})])
    _refused(capsys, folder, f"{dup}: key 'a' appears twice: members a.jpg and a.cls are not adjacent")
    dup.unlink()
    _gnu_tar(folder / "ok.tar", [("a", {"jpg": b"1", "cls": b"1"})])
    data = (folder / "ok.tar").read_bytes()
    import gzip

    (folder / "x.tar.gz").write_bytes(gzip.compress(data))
    _refused(capsys, folder, f"{folder / 'x.tar.gz'}: a compressed tar")
    _refused(capsys, folder, "`fastio convert` it")
    (folder / "x.tar.gz").unlink()
    (folder / "gz.tar").write_bytes(gzip.compress(data))  # compressed whatever its name
    _refused(capsys, folder, f"{folder / 'gz.tar'}: a gzip-compressed tar")
    (folder / "gz.tar").unlink()
    (folder / "cut.tar").write_bytes(data[:512 + 1])
    _refused(capsys, folder, f"{folder / 'cut.tar'}: truncated")
    (folder / "cut.tar").write_bytes(b"hello, not a tar\n" * 40)
    _refused(capsys, folder, f"{folder / 'cut.tar'}: not a tar")
    _small_tar(folder / "cut.tar", [("a.jpg", b"1")], end_blocks=False)  # what `head -c` of a tar gives
    _refused(capsys, folder, "without tar's end-of-archive blocks (a tar cut short and one written without them look "
                             "the same); if the shard is whole, write it again with `tar` or webdataset's ShardWriter")
    _small_tar(folder / "cut.tar", [("k.cls", b"1"), ("k.jpg", b"2"), ("k.CLS", b"3")])
    _refused(capsys, folder, f"{folder / 'cut.tar'}: sample 'k' has field 'cls' twice: members k.cls and k.CLS")
    (folder / "cut.tar").unlink()
    _refused(capsys, folder, "--label-field: no sample has field 'label'", "--label-field", "label")
    _refused(capsys, tmp_path / "none", f"{tmp_path / 'none'}: no such folder")
    assert not (folder / "manifest.json").exists()
    assert sorted(p.name for p in folder.iterdir()) == [".fastio-lock", "ok.tar"]


def test_index_on_s3_in_place_and_with_dest(aws_env, s3_bucket, shards, tmp_path, capsys):
    from fastio.storage import open_storage

    folder, expected = shards
    ro = open_storage(f"s3://{s3_bucket}/ro")
    for p in sorted(folder.rglob("*.tar")):
        ro.put_file(str(p.relative_to(folder)), p)
    from fastio.storage.lease import writer_lease

    with writer_lease(open_storage(f"s3://{s3_bucket}/meta"), "another fastio index"):  # one writer per DEST
        code, _, err = run_cli(["index", f"s3://{s3_bucket}/ro/", "--dest", f"s3://{s3_bucket}/meta", "-q"], capsys)
        assert code == 2 and "another fastio index" in err, err
    for source, said in ((f"s3://{s3_bucket}/ro/wds-*.tar", "fastio does not expand globs"),
                         (f"s3://{s3_bucket}/ro/wds-000000.tar", "an object, not a prefix")):  # said "holds no .tar"
        code, _, err = run_cli(["index", source, "--dest", f"s3://{s3_bucket}/x", "-q"], capsys)
        assert code == 2 and said in err, err
    code, _, err = run_cli(["index", f"s3://{s3_bucket}/ro/", "--dest", f"s3://{s3_bucket}/meta", "-q"], capsys)
    assert code == 0, err
    assert sorted(o.key for o in ro.list()) == sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tar"))
    _read_all(f"s3://{s3_bucket}/meta", expected, shuffle="block", block_shards=2, cache_dir=tmp_path / "c1")
    assert run_cli(["verify", f"s3://{s3_bucket}/meta"], capsys)[0] == 0
    code, _, err = run_cli(["index", f"s3://{s3_bucket}/ro", "-q"], capsys)
    assert code == 0, err
    assert ro.exists("manifest.json") and ro.exists("sub/gnu.idx")
    _read_all(f"s3://{s3_bucket}/ro", expected, cache_dir=tmp_path / "c2")
    # on S3 too: another tool's manifest.json is never replaced; an index again into its DEST takes the .idx of a
    # shard gone from SOURCE
    other = open_storage(f"s3://{s3_bucket}/other")
    other.put_bytes("manifest.json", b"[1, 2]")
    code, _, err = run_cli(["index", f"s3://{s3_bucket}/ro/", "--dest", other.url, "--overwrite", "-q"], capsys)
    assert code == 2 and f"{other.url}/manifest.json: not a fastio manifest" in err, err
    assert other.get("manifest.json") == b"[1, 2]" and [o.key for o in other.list()] == ["manifest.json"]
    ro.delete("wds-000001.tar")
    code, _, err = run_cli(["index", f"s3://{s3_bucket}/ro/", "--dest", f"s3://{s3_bucket}/meta", "--overwrite",
                            "-q"], capsys)
    assert code == 0, err
    meta = open_storage(f"s3://{s3_bucket}/meta")
    assert meta.exists("shards/wds-000000.idx") and not meta.exists("shards/wds-000001.idx")
    assert run_cli(["verify", meta.url], capsys)[0] == 0


def test_exact_resume_over_indexed_shards(shards, capsys):
    from resume import check_resume

    folder, _ = shards
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    for shuffle in ("global", "block"):
        check_resume(lambda mode=shuffle: Loader(folder, batch_size=4, device="cpu", pipeline=Raw(fields=["cls", "jpg"]),
                                                 num_threads=1, shuffle=mode, block_shards=2, seed=3), n=3, k=4)


def test_elastic_resume_over_indexed_shards(shards, capsys):
    """2 ranks stop after 2 global batches; 3 ranks take the state and deliver the rest of the epoch, each
    sample once."""
    folder, expected = shards
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0

    def make(world, rank):
        return Loader(folder, batch_size=4, device="cpu", pipeline=Raw(fields=["cls"]), num_threads=1, shuffle="block",
                      block_shards=2, seed=5, world_size=world, rank=rank, drop_last=False)

    first, states = [], []
    for rank in range(2):
        loader = make(2, rank)
        it = iter(loader)
        for _ in range(2):
            b = next(it)
            first += b["index"][~b["padded"]].tolist()
        states.append(loader.state_dict())
        loader.close()
    assert states[0] == states[1] and states[0]["consumed"] == 16
    rest = []
    for rank in range(3):
        loader = make(3, rank)
        loader.load_state_dict(states[0])
        for b in loader:
            rest += b["index"][~b["padded"]].tolist()
        loader.close()
    assert sorted(first + rest) == list(range(len(expected)))


def test_the_image_pipeline_decodes_indexed_shards(shards, capsys):
    folder, _ = shards
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    with Loader(folder, batch_size=8, device="cpu", pipeline=ImageTrain(size=16), num_threads=1) as loader:
        batches = list(loader)
    assert sum(b["image"].shape[0] for b in batches) >= 31 and batches[0]["image"].shape[1:] == (3, 16, 16)


def test_index_in_parts_then_merge_equals_one_run(shards, tmp_path, capsys, monkeypatch):
    """--part K/N (auto/N from SLURM_ARRAY_TASK_ID) + `fastio merge`: the same manifest and samples.fxi as one run."""
    folder, expected = shards
    assert run_cli(["index", str(folder), "--dest", str(tmp_path / "one"), "-q"], capsys)[0] == 0
    parted = tmp_path / "parted"
    code, _, err = run_cli(["merge", str(parted)], capsys)
    assert code == 2 and "no parts to merge" in err
    for k in (2, 0):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(k))
        assert run_cli(["index", str(folder), "--dest", str(parted), "--part", "auto/3", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(parted)], capsys)
    assert code == 2 and "1 of 3 parts not complete" in err and "part-1-of-3 (missing)" in err
    assert run_cli(["index", str(folder), "--dest", str(parted), "--part", "1/3", "-q"], capsys)[0] == 0
    code, out, err = run_cli(["merge", str(parted)], capsys)
    assert code == 0, err
    for name in ("manifest.json", "samples.fxi"):
        assert (parted / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    assert not (parted / ".parts").exists()
    _read_all(parted, expected)


def test_expand_braces():
    from fastio.convert.listing import expand_braces

    assert expand_braces("d/{000..002}.tar") == ["d/000.tar", "d/001.tar", "d/002.tar"]
    assert expand_braces("s3://b/{a,b}-{8..10}.tar") == [
        "s3://b/a-8.tar", "s3://b/a-9.tar", "s3://b/a-10.tar", "s3://b/b-8.tar", "s3://b/b-9.tar", "s3://b/b-10.tar"]
    assert os.sep == "/"


def test_expand_braces_as_webdataset_does(tmp_path, capsys):
    # Found by review: nested braces listed a shard twice ('{a,{b,c}}.tar': a, b, a, c; then refused as named
    # twice), letter and stepped ranges were taken as names ('{a..c}', '{0..8..2}': "no such shard"), and a
    # group without a comma lost its braces ('{a}.tar' named a.tar); WebDataset (braceexpand) reads each as bash.
    from braceexpand import braceexpand

    from fastio.convert.listing import expand_braces
    from fastio.errors import DatasetError

    for pattern in ("{a,{b,c}}.tar", "d/{0..4..2}-{x..z}.tar", "{a}.tar", "x{}.tar", "{a,b{1..2},}c", "{0..10}",
                    "{08..11}", "{000..9}", "{9..011}", "{3..1}", "{-1..1}", "{01..-1}", "{c..a}", "{Z..b..3}",
                    "{,a}", "{a,}{{b}}", "s3://b/p/{00000..00002}.tar", "a{b}c{d,e}f"):
        assert expand_braces(pattern) == list(braceexpand(pattern)), pattern
    for pattern in ("{a,b", "a}b{", "{a,{b}"):
        with pytest.raises(DatasetError, match=re.escape(f"{pattern}: unbalanced braces")):
            expand_braces(pattern)
    for name in "abc":
        _tar(tmp_path / f"{name}.tar")
    code, out, err = run_cli(["index", str(tmp_path / "{a,{b,c}}.tar")], capsys)
    assert code == 0 and "3 shards" in out, err



def test_a_brace_range_too_large_is_refused_before_it_is_expanded(tmp_path, capsys):
    # Found by review: expand_braces made every name before any was looked at, so a range typed with a digit
    # too many ('{0..9999999999}.tar') or two ranges multiplied held the index in a loop filling memory.
    from fastio.convert.listing import MAX_PATTERN_NAMES, expand_braces
    from fastio.errors import DatasetError

    for pattern, names in (("d/{0..9999999999}.tar", 10**10), ("{0..99999}-{0..99999}.tar", 10**10),
                           ("{a,b}{0..99999999..2}", 5 * 10**7)):
        with pytest.raises(DatasetError, match=re.escape(f"{pattern}: names {names:,} shards, more than fastio "
                                                         f"lists ({MAX_PATTERN_NAMES:,})")):
            expand_braces(pattern)
    code, _, err = run_cli(["index", str(tmp_path / "{0..9999999999}.tar")], capsys)
    assert code == 2 and "more than fastio lists" in err, err


def test_listing_refusals_name_the_path_and_what_it_is(tmp_path, capsys):
    """A *.tar that is a broken link (a missing mount), a device, a FIFO or a folder; a shard named twice; a
    glob; a DEST under a file; an .idx place taken by a folder: one line each, nothing half-written left."""
    folder = tmp_path / "src"
    _small_tar(folder / "0.tar", [("a.jpg", b"1"), ("a.cls", b"0")])
    link = folder / "1.tar"
    link.symlink_to(tmp_path / "unmounted" / "1.tar")
    _refused(capsys, folder, f"{link}: a broken link (-> {tmp_path / 'unmounted' / '1.tar'}: No such file")
    link.unlink()
    link.symlink_to("/dev/zero")
    _refused(capsys, folder, f"{link}: a link (-> /dev/zero) to a character device, not a tar file")
    _refused(capsys, f"{folder}/{{0,1}}.tar", f"{link}: a link (-> /dev/zero) to a character device, not a tar file")
    link.unlink()
    os.mkfifo(link)
    _refused(capsys, folder, f"{link}: a FIFO (named pipe), not a tar file")
    link.unlink()
    link.mkdir()
    _refused(capsys, folder, f"{link}: a folder, not a tar file")
    link.rmdir()
    _refused(capsys, f"{folder}/{{0,0}}.tar", f"{folder / '0.tar'}: named twice: each of its samples would come twice")
    link.symlink_to("0.tar")
    _refused(capsys, folder, f"{link}: named twice (the same file as {folder / '0.tar'})")
    link.unlink()
    _refused(capsys, f"{folder}/*.tar", "fastio does not expand globs (the shell matched nothing, or the pattern was "
                                        "quoted): give the folder, or a brace pattern such as")
    (tmp_path / "file").touch()
    _refused(capsys, folder, f"{tmp_path / 'file' / 'sub'}: DEST cannot be made: {tmp_path / 'file'} is not a "
                             "directory", "--dest", str(tmp_path / "file" / "sub"))
    (folder / "0.idx").mkdir()
    _refused(capsys, folder, f"{folder / '0.idx'}: the .idx of {folder / '0.tar'} goes there, but it exists and is "
                             "not a file")
    assert sorted(p.name for p in folder.iterdir()) == [".fastio-lock", "0.idx", "0.tar"]
    (tmp_path / "d" / "shards" / "0.idx").mkdir(parents=True)  # in fastio's own DEST/shards/: found when written
    (tmp_path / "d" / ".fastio-output").touch()
    _refused(capsys, folder, f"{tmp_path / 'd' / 'shards' / '0.idx'}: Is a directory", "--dest", str(tmp_path / "d"))
    assert sorted(p.name for p in (tmp_path / "d" / "shards").iterdir()) == ["0.idx"]  # no temporary left


def test_links_to_folders_are_listed_in_skipped_not_followed(tmp_path, capsys):
    folder, other = tmp_path / "src", tmp_path / "other"
    _small_tar(folder / "0.tar", [("a.jpg", b"1"), ("a.cls", b"0")])
    _small_tar(other / "1.tar", [("b.jpg", b"2"), ("b.cls", b"1")])
    (folder / "more").symlink_to(other)
    (folder / "loop").symlink_to(folder)
    (folder / "gone").symlink_to(tmp_path / "gone")
    code, _, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [s["location"] for s in manifest["shards"]] == ["0.tar"]
    assert manifest["skipped"] == [
        {"path": str(folder / "gone"), "reason": f"a broken link (-> {tmp_path / 'gone'}): not followed"},
        {"path": str(folder / "loop"), "reason": f"a link to a folder (-> {folder}): not followed"},
        {"path": str(folder / "more"), "reason": f"a link to a folder (-> {other}): not followed"}]


def test_fields_are_suffixes_lowercased_as_webdataset_reads_them(tmp_path, capsys):
    """a.JPG / a.CLS: fields jpg and cls (the label), read by the Loader with their own bytes; the .idx keeps
    the suffixes as written (byte-equal to wds2idx); verify passes."""
    rng = np.random.default_rng(1)
    expected, members = {}, []
    for i, (jpg, cls) in enumerate((("JPG", "CLS"), ("jpg", "cls"), ("Jpg", "Cls"))):
        expected[f"u{i}"] = {"jpg": photo_jpeg(rng, 24, 20), "cls": str(i + 3).encode()}
        members += [(f"u{i}.{jpg}", expected[f"u{i}"]["jpg"]), (f"u{i}.{cls}", expected[f"u{i}"]["cls"])]
    folder = tmp_path / "upper"
    _small_tar(folder / "0.tar", members)
    code, _, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["label_field"] == "cls" and manifest["image_field"] == "jpg"
    assert manifest["field_counts"] == {"cls": 3, "jpg": 3}
    if WDS2IDX.exists():
        subprocess.run([str(WDS2IDX), str(folder / "0.tar"), str(tmp_path / "theirs.idx")], check=True,
                       capture_output=True)
        assert (folder / "0.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    _read_all(folder, expected, batch_size=2)
    assert run_cli(["verify", str(folder)], capsys)[0] == 0


def test_shard_paths_with_spaces(tmp_path, capsys):
    """Spaces in a shard's name, its folder, and DEST: indexed in place and with --dest, read back, verified."""
    folder = tmp_path / "my data"
    expected = {"a": {"jpg": b"one", "cls": b"1"}, "b": {"jpg": b"two", "cls": b"2"}}
    _small_tar(folder / "my shard.tar", [("a.jpg", b"one"), ("a.cls", b"1")])
    _small_tar(folder / "a b" / "x.tar", [("b.jpg", b"two"), ("b.cls", b"2")])
    for dest in (folder, tmp_path / "d e"):
        code, _, err = run_cli(["index", str(folder), "--dest", str(dest), "-q"], capsys)
        assert code == 0, err
        locations = [s["location"] for s in json.loads((dest / "manifest.json").read_text())["shards"]]
        assert locations == (["a b/x.tar", "my shard.tar"] if dest == folder else
                             [str(folder / "a b" / "x.tar"), str(folder / "my shard.tar")])
        _read_all(dest, expected, batch_size=2)
        assert run_cli(["verify", str(dest)], capsys)[0] == 0


def _tar(path: Path, n: int = 3) -> bytes:
    """A WebDataset tar of ``n`` samples (cls + txt), as bytes, also written to ``path``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("cls", b"%d" % i), ("txt", b"text %d" % i)):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _refused_unchanged(folder: Path, capsys, *reason: str) -> None:
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    code, out, err = run_cli(["index", str(folder)], capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(folder / "x.tar") in lines[0], err
    for word in reason:
        assert word in lines[0], err
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name != ".fastio-lock"}
    assert after == before, "an index that was refused wrote or changed files"


def test_a_shard_cut_at_a_member_boundary_is_truncated(tmp_path, capsys):
    data = _tar(tmp_path / "x.tar")
    (tmp_path / "x.tar").write_bytes(data[:3 * 1024])  # 1.5 samples: cls, txt, cls; no end-of-archive blocks
    assert subprocess.run(["tar", "-tf", str(tmp_path / "x.tar")], capture_output=True).returncode == 0  # GNU tar: silent
    _refused_unchanged(tmp_path, capsys, "truncated", "after member s1.cls", "end-of-archive")


def test_a_damaged_header_in_the_middle_is_refused_not_read_as_the_end(tmp_path, capsys):
    data = bytearray(_tar(tmp_path / "x.tar"))
    data[2 * 1024 + 148] ^= 0x01  # the checksum of the second sample's first header
    (tmp_path / "x.tar").write_bytes(data)
    assert subprocess.run(["tar", "-tf", str(tmp_path / "x.tar")], capture_output=True).returncode != 0
    _refused_unchanged(tmp_path, capsys, "damaged", "byte 2048", "after member s0.txt")


def test_a_gnu_sparse_member_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cls").write_text("1")
    with open(src / "a.bin", "wb") as f:  # a hole, then data: GNU tar --sparse stores only the data
        f.seek(64 * 1024)
        f.write(b"tail")
    (tmp_path / "d").mkdir()
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tmp_path / "d" / "x.tar"), "-C", str(src),
                    "a.cls", "a.bin"], check=True)
    info = tarfile.open(tmp_path / "d" / "x.tar").getmember("a.bin")
    if not info.issparse():
        pytest.skip("this GNU tar stored the file whole")
    _refused_unchanged(tmp_path / "d", capsys, "member a.bin is a GNU sparse file")


def test_an_intact_tar_still_indexes_with_trailing_zero_padding(tmp_path, capsys):
    _tar(tmp_path / "x.tar")
    code, out, err = run_cli(["index", str(tmp_path)], capsys)
    assert code == 0 and "3 samples" in out, err


def _text_label_tar(path: Path, bad: int | None = 37, n: int = 50) -> None:
    """``n`` samples (txt + cls); sample ``bad``'s cls holds a WordNet id instead of an integer."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            for ext, data in (("txt", b"t"), ("cls", b"n01440764" if i == bad else b"%d" % (i % 3))):
                info = tarfile.TarInfo(f"s{i:02d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def test_a_label_field_holding_text_is_caught_when_indexing(tmp_path, capsys):
    _text_label_tar(tmp_path / "x.tar")
    code, _, err = run_cli(["index", str(tmp_path)], capsys)
    assert code == 2, err
    assert "x.tar" in err and "s37" in err and "n01440764" in err and "'cls'" in err, err
    assert not (tmp_path / "manifest.json").exists()
    code, _, err = run_cli(["index", str(tmp_path), "--label-field", "cls", "--dest", str(tmp_path / "d")], capsys)
    assert code == 2 and "s37" in err and "n01440764" in err, err
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_a_text_label_field_that_is_not_the_label_is_accepted(tmp_path, capsys):
    """``label`` holding class names beside an integer ``cls``: cls is the label, the names are a field."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(4):
            for ext, data in (("cls", b"%d" % i), ("label", b"tench")):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "x.tar").write_bytes(buf.getvalue())
    code, _, err = run_cli(["index", str(tmp_path), "-q"], capsys)
    assert code == 0, err
    from fastio.dataset.dataset import Dataset

    assert Dataset(tmp_path).label_field == "cls"


def test_index_parts_catch_a_text_label_too(tmp_path, capsys):
    """The part that reads the bad value refuses when the label field is named; otherwise the merge does (only
    it knows which field is the label), naming the shard, key and value, and publishes nothing."""
    src = tmp_path / "src"
    for n in range(2):
        _text_label_tar(src / f"x{n}.tar", bad=37 if n == 1 else None)
    dest = tmp_path / "dest"
    assert run_cli(["index", str(src), "--dest", str(dest), "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["index", str(src), "--dest", str(dest), "--part", "1/2", "--label-field", "cls"], capsys)
    assert code == 2 and "x1.tar" in err and "s37" in err and "n01440764" in err, err
    assert run_cli(["index", str(src), "--dest", str(dest), "--part", "1/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and "x1.tar" in err and "s37" in err and "n01440764" in err, err
    assert not (dest / "manifest.json").exists()


def test_index_dest_refuses_a_folder_fastio_did_not_make(tmp_path, capsys):
    """As `fastio convert` does: a non-empty DEST without fastio's marker is refused (its files untouched) unless
    --overwrite; a DEST index made (a rerun) is its own."""
    _tar(tmp_path / "src" / "x.tar")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    code, _, err = run_cli(["index", str(tmp_path / "src"), "--dest", str(dest)], capsys)
    assert code == 2 and str(dest) in err and "not fastio output" in err and "--overwrite" in err, err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    code, _, err = run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--part", "0/2"], capsys)
    assert code == 2 and "not fastio output" in err, err
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--overwrite", "-q"], capsys)[0] == 0
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "manifest.json").is_file()
    (dest / "manifest.json").unlink()  # as if the first run had died before its manifest
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "-q"], capsys)[0] == 0


def test_merge_quotes_the_brace_pattern_and_paths_of_the_command_it_names(tmp_path, capsys):
    # Found by the newcomer review (round 4): the command named for a missing part, pasted into bash, had its brace
    # pattern expanded by the shell (and a path with a space split in two): it is quoted as the shell needs it.
    for n in range(2):
        _tar(tmp_path / "my src" / f"x{n}.tar")
    pattern, dest = str(tmp_path / "my src" / "x{0..1}.tar"), tmp_path / "my dest"
    assert run_cli(["index", pattern, "--dest", str(dest), "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and f"index them (fastio index '{pattern}' --dest '{dest}' --part K/2)" in err, err


def test_merge_names_fastio_index_for_the_missing_parts_of_an_index(tmp_path, capsys):
    for n in range(2):
        _tar(tmp_path / "src" / f"x{n}.tar")
    dest = tmp_path / "dest"
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and "part-1-of-2 (missing)" in err, err
    assert f"index them (fastio index {tmp_path / 'src'} --dest {dest} --part K/2)" in err, err
    assert "convert" not in err, err


def test_jpeg_and_tif_members_are_image_fields(tmp_path, capsys):
    """WebDataset decodes ``.jpeg`` and ``.tif`` as images: so does the Loader of an indexed dataset (it said
    "dataset has no image field")."""
    import json

    import numpy as np
    from helpers import indexed_tar
    from PIL import Image

    from fastio import Loader
    from fastio.convert.synthetic import photo_jpeg

    tif = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 10)).save(tif, "TIFF")
    for ext, data in (("jpeg", photo_jpeg(np.random.default_rng(0), 32, 24)), ("tif", tif.getvalue())):
        dest = indexed_tar(tmp_path / ext, {f"k{i}": {ext: data, "cls": b"%d" % i} for i in range(3)}, capsys)
        assert json.loads((dest / "manifest.json").read_text())["image_field"] == ext
        with Loader(dest, batch_size=3, pipeline=ImageEval(size=16), device="cpu", shuffle="none",
                    world_size=1, rank=0) as loader:
            batch = next(iter(loader))
        assert batch["image"].shape[0] == 3 and batch["label"].tolist() == [0, 1, 2]


def test_indexing_the_shards_folder_of_a_dataset_is_refused_and_leaves_that_dataset_whole(shards, tmp_path, capsys):
    # Found by review: `fastio index DATASET/shards` wrote a manifest.json and samples.fxi among DATASET's tar
    # shards (the folder the tars are in), and `fastio verify DATASET` then failed ('file is not listed').
    folder, _ = shards
    code, out, err = run_cli(["index", str(folder), "--dest", str(tmp_path / "ds")], capsys)
    assert code == 0, err
    inner = tmp_path / "ds" / "shards"  # where DEST's own files go (its .idx files)
    for tar in sorted(folder.glob("wds-*.tar"))[:1]:
        shutil.copy(tar, inner / tar.name)
    before = sorted(p.name for p in inner.iterdir())
    _refused(capsys, inner, f"{inner}: the shards/ folder of the dataset {tmp_path / 'ds'}")
    _refused(capsys, folder, f"{inner}: the shards/ folder of the dataset {tmp_path / 'ds'}", "--dest", str(inner))
    assert sorted(p.name for p in inner.iterdir()) == before


def test_a_manifest_json_fastio_did_not_write_is_never_replaced(tmp_path, capsys):
    # Found by review: a shard folder holding the user's own manifest.json was refused as "already holds a
    # dataset (manifest.json); pass --overwrite", and --overwrite then replaced that file (maybe its only copy)
    # with fastio's manifest; with --dest the same, since a manifest.json counted as fastio output.
    _tar(tmp_path / "src" / "x.tar")
    mine = b'{"shards": "my own list, the only copy"}\n'
    (tmp_path / "src" / "manifest.json").write_bytes(mine)
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(["index", str(tmp_path / "src"), *extra], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"{tmp_path / 'src' / 'manifest.json'}: not a fastio manifest" in err and "--dest" in err, err
        assert "--overwrite" not in err, err
    assert (tmp_path / "src" / "manifest.json").read_bytes() == mine
    assert not (tmp_path / "src" / "x.idx").exists() and not (tmp_path / "src" / "samples.fxi").exists()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "manifest.json").write_bytes(b"not even json")
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), *extra], capsys)
        assert code == 2 and f"{dest / 'manifest.json'}: not a fastio manifest" in err, err
    assert sorted(p.name for p in dest.iterdir()) == ["manifest.json"]
    assert (dest / "manifest.json").read_bytes() == b"not even json"
    # fastio's own manifest is still indexed again with --overwrite
    (tmp_path / "src" / "manifest.json").unlink()
    assert run_cli(["index", str(tmp_path / "src"), "-q"], capsys)[0] == 0
    assert run_cli(["index", str(tmp_path / "src"), "--overwrite", "-q"], capsys)[0] == 0



def test_one_tar_path_is_indexed_as_several_are(tmp_path, capsys):
    # Found by review: `fastio index wds/*.tar` indexed a folder's shards when the glob matched two or more, but
    # when it matched one the single path was refused ("a file: give the folder holding the shards").
    _tar(tmp_path / "wds" / "only.tar")
    (tmp_path / "wds" / "notes.tar.txt").write_text("not a shard")
    code, out, err = run_cli(["index", str(tmp_path / "wds" / "only.tar")], capsys)
    assert code == 0 and "1 shard, 3 samples" in out, err
    manifest = json.loads((tmp_path / "wds" / "manifest.json").read_text())
    assert [s["location"] for s in manifest["shards"]] == ["only.tar"]
    assert run_cli(["verify", str(tmp_path / "wds")], capsys)[0] == 0
    code, _, err = run_cli(["index", str(tmp_path / "wds" / "notes.tar.txt")], capsys)
    assert code == 2 and f"{tmp_path / 'wds' / 'notes.tar.txt'}: a file" in err, err


def test_verify_names_a_shard_below_the_folder_by_its_path(shards, tmp_path, capsys):
    # Found by review: `fastio verify` of shards indexed in place below sub-folders named them by their record
    # name, sub/gnu.tar as 'sub-gnu.tar' and its index as 'gnu.idx', files that exist nowhere; with --dest, a
    # shard by its bare name, not where it is.
    folder, _ = shards
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    with open(folder / "sub" / "gnu.tar", "ab") as f:
        f.write(b"\0" * 512)
    (folder / "sub" / "pax.idx").unlink()
    code, out, _ = run_cli(["verify", str(folder)], capsys)
    assert code == 1, out
    assert "sub/gnu.tar: sha256 does not match the manifest" in out.splitlines(), out
    assert "sub/pax.tar: index sub/pax.idx is missing" in out.splitlines(), out
    assert "sub-" not in out, out
    meta = tmp_path / "meta"
    assert run_cli(["index", str(folder), "--dest", str(meta), "-q"], capsys)[0] == 0
    (folder / "sub" / "gnu.tar").unlink()
    code, out, _ = run_cli(["verify", str(meta)], capsys)
    assert code == 1 and f"{folder / 'sub' / 'gnu.tar'}: shard file is missing" in out.splitlines(), out


def test_opening_a_dataset_names_a_missing_shard_of_any_of_its_folders(shards, tmp_path, capsys):
    # Dataset() lists each folder holding shards once, finding a key's folder from its text (issue 45: a Path a
    # key cost ~0.1 ms a Loader()): shards in place in two folders (relative keys), then below a --dest (absolute).
    folder, _ = shards
    meta = tmp_path / "meta"
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    assert run_cli(["index", str(folder), "--dest", str(meta), "-q"], capsys)[0] == 0
    from fastio.errors import DatasetError
    inside, outside = Dataset(folder), Dataset(meta)
    assert {s.idx_key for s in inside.shards} >= {"sub/gnu.idx", "sub/pax.idx"}, [s.idx_key for s in inside.shards]
    assert str(folder / "sub" / "gnu.tar") in {s.tar_key for s in outside.shards}
    assert "shards/sub-gnu.idx" in {s.idx_key for s in outside.shards}
    assert len({s.path.parent for s in inside.shards}) == 2 and len(inside.shards) == len(outside.shards)
    (meta / "shards" / "sub-pax.idx").unlink()
    with pytest.raises(DatasetError, match=re.escape(f"{meta}: shard file sub-pax.idx is missing")):
        Dataset(meta)
    (folder / "sub" / "gnu.tar").unlink()
    for dest in (folder, meta):
        with pytest.raises(DatasetError, match=re.escape(f"shard file {folder / 'sub' / 'gnu.tar'} is missing")):
            Dataset(dest)


def test_links_inside_a_tar_are_named_in_skipped(tmp_path, capsys):
    # Found by review: GNU tar stores a file hard-linked to one already in the archive (images deduplicated by
    # hard links) as a link member without bytes; WebDataset and wds2idx pass it over, and so did fastio index,
    # unsaid: the sample came without that field. The .idx is still wds2idx's; the manifest's skipped names it.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"same image")
    (src / "a.cls").write_text("0")
    os.link(src / "a.jpg", src / "b.jpg")
    (src / "b.cls").write_text("1")
    os.symlink("a.cls", src / "c.cls")
    (src / "c.jpg").write_bytes(b"other")
    (tmp_path / "wds").mkdir()
    subprocess.run(["tar", "--format=gnu", "-cf", str(tmp_path / "wds" / "x.tar"), "-C", str(src),
                    "a.jpg", "a.cls", "b.jpg", "b.cls", "c.cls", "c.jpg"], check=True)
    assert tarfile.open(tmp_path / "wds" / "x.tar").getmember("b.jpg").islnk()
    code, out, err = run_cli(["index", str(tmp_path / "wds")], capsys)
    assert code == 0 and "3 samples" in out and "2 skipped" in out, err
    x = tmp_path / "wds" / "x.tar"
    skipped = json.loads((tmp_path / "wds" / "manifest.json").read_text())["skipped"]
    assert skipped == [
        {"path": f"{x}:b.jpg", "reason": "a hard link to another member (its bytes are not stored under this name; "
                                         "WebDataset reads none for it)"},
        {"path": f"{x}:c.cls", "reason": "a symbolic link (its bytes are not stored in the tar; WebDataset reads "
                                         "none for it)"}], skipped
    if WDS2IDX.exists():
        subprocess.run([str(WDS2IDX), str(x), str(tmp_path / "dali.idx")], check=True, capture_output=True)
        assert (tmp_path / "dali.idx").read_bytes() == (tmp_path / "wds" / "x.idx").read_bytes()


def test_tars_joined_with_cat_are_refused_not_read_as_the_first(tmp_path, capsys):
    # Found by review: `cat a.tar b.tar > ab.tar` makes a file whose second tar follows the first one's
    # end-of-archive blocks; tarfile (so WebDataset) and GNU tar without -i stop there, and fastio index made a
    # dataset of a.tar's samples alone, b.tar's left out unsaid.
    a, b = _tar(tmp_path / "parts" / "a.tar", 2), _tar(tmp_path / "parts" / "b.tar", 3)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "x.tar").write_bytes(a + b)
    _refused_unchanged(folder, capsys, f"data after its end-of-archive blocks (at byte {len(a)})",
                       "tars joined with `cat`")
    (folder / "x.tar").write_bytes(a + b"\0" * 4096)  # more zero padding is still a whole tar
    assert run_cli(["index", str(folder / "x.tar"), "-q"], capsys)[0] == 0


def test_a_dest_that_is_the_source_folder_spelt_another_way_is_in_place(tmp_path, capsys, monkeypatch):
    # Found by review: DEST was in place only when spelt as SOURCE's folder was: `fastio index wds/ --dest wds`,
    # `--dest /abs/wds` from inside, or DEST through a link to the folder were refused as a folder that is "not
    # fastio output", and with --overwrite indexed as another DEST (a shards/ folder and a .fastio-output marker
    # among the user's tars, the shards named by absolute path).
    _tar(tmp_path / "wds" / "x.tar")
    (tmp_path / "link").symlink_to(tmp_path / "wds")
    monkeypatch.chdir(tmp_path)
    for source, dest in (("wds/", "wds"), ("wds", str(tmp_path / "wds")), ("wds", "link"), ("link/x.tar", "./wds")):
        code, out, err = run_cli(["index", source, "--dest", dest, "--overwrite", "-q"], capsys)
        assert code == 0, (source, dest, err)
        assert sorted(p.name for p in (tmp_path / "wds").iterdir()) == [
            ".fastio-idx.json", ".fastio-lock", "manifest.json", "samples.fxi", "x.idx", "x.tar"], (source, dest)
        manifest = json.loads((tmp_path / "wds" / "manifest.json").read_text())
        assert [s["location"] for s in manifest["shards"]] == ["x.tar"], (source, dest)
        assert manifest["source"]["indexed_in_place"] is True


def test_an_index_again_into_its_dest_takes_the_idx_of_a_shard_gone_away(tmp_path, capsys):
    # Found by review: `fastio index SRC --dest D --overwrite` after a shard left SRC published a manifest without
    # it but left its D/shards/NAME.idx, and `fastio verify D` then failed ('file is not listed in the manifest').
    for n in range(3):
        _tar(tmp_path / "src" / f"x{n}.tar")
    dest = tmp_path / "meta"
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "-q"], capsys)[0] == 0
    (tmp_path / "src" / "x1.tar").unlink()
    (dest / "shards" / "notes.txt").write_text("someone's file")  # not fastio's: left alone
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--overwrite", "-q"], capsys)[0] == 0
    assert sorted(p.name for p in (dest / "shards").iterdir()) == ["notes.txt", "x0.idx", "x2.idx"]
    (dest / "shards" / "notes.txt").unlink()
    code, out, err = run_cli(["verify", str(dest)], capsys)
    assert code == 0, out + err


def test_a_brace_in_a_name_that_expands_to_nothing_else_is_a_name(tmp_path, capsys):
    # Found by review: any '{' made SOURCE a brace pattern, so a folder named 'b{x}' was refused as 'a folder, not
    # a tar file', and 'b{x}/0.tar' was indexed into b{x}'s parent (the folder before the brace), its manifest there.
    for name in ("b{x}", "c{"):
        _tar(tmp_path / name / "0.tar")
        for source in (tmp_path / name, tmp_path / name / "0.tar"):
            code, out, err = run_cli(["index", str(source), "--overwrite", "-q"], capsys)
            assert code == 0, err
            assert (tmp_path / name / "manifest.json").is_file() and not (tmp_path / "manifest.json").exists()
    code, _, err = run_cli(["index", str(tmp_path / "d{0..1")], capsys)
    assert code == 2 and f"{tmp_path / 'd{0..1'}: unbalanced braces" in err, err


def test_a_merge_again_takes_the_idx_of_a_shard_gone_away(tmp_path, capsys):
    # Found by review: as one run did, `fastio index --part K/N` then `fastio merge --overwrite` after a shard
    # left SOURCE left its DEST/shards/NAME.idx, and `fastio verify` failed ('file is not listed in the manifest').
    for n in range(3):
        _tar(tmp_path / "src" / f"x{n}.tar")
    dest = tmp_path / "meta"
    for again in ([], ["--overwrite"]):
        for k in range(2):
            assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--part", f"{k}/2", "-q", *again],
                           capsys)[0] == 0
        code, _, err = run_cli(["merge", str(dest), "-q", *again], capsys)
        assert code == 0, err
        (tmp_path / "src" / "x2.tar").unlink(missing_ok=True)
    assert sorted(p.name for p in (dest / "shards").iterdir()) == ["x0.idx", "x1.idx"]
    code, out, err = run_cli(["verify", str(dest)], capsys)
    assert code == 0, out + err


def test_a_users_folder_named_shards_is_indexed(shards, tmp_path, capsys):
    # Found by review: a folder SOURCE's shards/ was never entered (meant for a fastio dataset's own), so
    # `fastio index data` with the user's tars in data/shards/ said 'holds no .tar files', and with one more tar
    # beside it indexed that one alone, data/shards/ left out unsaid; then `fastio index data/shards` was refused
    # as 'the shards/ folder of the dataset data' (the index in place, whose files lie beside its tars).
    data = tmp_path / "data"
    _tar(data / "shards" / "a.tar")
    _tar(data / "more" / "b.tar", 2)
    code, out, err = run_cli(["index", str(data)], capsys)
    assert code == 0 and "2 shards, 5 samples" in out, err
    manifest = json.loads((data / "manifest.json").read_text())
    assert [s["location"] for s in manifest["shards"]] == ["more/b.tar", "shards/a.tar"]
    assert run_cli(["verify", str(data)], capsys)[0] == 0
    code, out, err = run_cli(["index", str(data / "shards"), "-q"], capsys)
    assert code == 0, err
    # a fastio dataset's own shards/ (made with --dest: its .idx files, here a tar put there) is still not entered
    folder, _ = shards
    ds = tmp_path / "ds"
    assert run_cli(["index", str(folder), "--dest", str(ds), "-q"], capsys)[0] == 0
    _tar(ds / "shards" / "stray.tar")
    code, _, err = run_cli(["index", str(ds / "shards")], capsys)
    assert code == 2 and f"{ds / 'shards'}: the shards/ folder of the dataset {ds}" in err, err
    code, _, err = run_cli(["index", str(ds), "--dest", str(tmp_path / "again")], capsys)
    assert code == 2 and f"{ds}: a fastio dataset already (its shards/ are its own): nothing to index" in err, err


def test_a_label_field_some_samples_lack_names_the_first_of_them(tmp_path, capsys):
    # Found by review: `--label-field cls` where one sample of 50 lacked it said only 'label_field: 1 of 50 samples
    # lacks field 'cls'', naming no shard nor sample to look at.
    members = [(f"s{i}.{ext}", data) for i in range(50) for ext, data in (("jpg", b"x"), ("cls", b"%d" % (i % 3)))
               if not (i == 37 and ext == "cls")]
    _small_tar(tmp_path / "wds" / "sub" / "x.tar", members)
    _refused(capsys, tmp_path / "wds", "--label-field: 1 of 50 samples lacks field 'cls' (the first: shard sub/x.tar key "
                                      "'s37')", "--label-field", "cls")


def test_a_label_field_one_sample_lacks_is_said_not_dropped_unsaid(tmp_path, capsys):
    # Found by review: with `cls` in 49 of 50 samples the index took no label field (the rule: one every sample
    # has) and said nothing; the Loader then gave batches without labels, far from the cause.
    members = [(f"s{i}.{ext}", data) for i in range(50) for ext, data in (("jpg", b"x"), ("cls", b"%d" % (i % 3)))
               if not (i == 37 and ext == "cls")]
    _small_tar(tmp_path / "wds" / "x.tar", members)
    code, out, err = run_cli(["index", str(tmp_path / "wds")], capsys)
    assert code == 0, err
    assert out.splitlines()[1] == ("  no label field: cls is in 49 of 50 samples (the first without it: shard x.tar "
                                   "key 's37'); a label field is one every sample has"), out
    assert json.loads((tmp_path / "wds" / "manifest.json").read_text())["label_field"] is None
    _tar(tmp_path / "ok" / "x.tar")
    code, out, err = run_cli(["index", str(tmp_path / "ok")], capsys)
    assert code == 0 and len(out.splitlines()) == 1, out


def test_an_index_in_place_never_replaces_a_converted_datasets_manifest(image_dataset, capsys):
    # Found by review: tars put in a converted dataset's folder (ds/extra/x.tar) and `fastio index ds --overwrite`
    # replaced that dataset's manifest (its label map, its shards in shards/) with an index of the extra tars.
    _tar(image_dataset / "extra" / "x.tar")
    before = (image_dataset / "manifest.json").read_bytes()
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(["index", str(image_dataset), *extra], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"{image_dataset / 'manifest.json'}: the manifest of a dataset fastio index did not make" in err, err
        assert "--dest" in err and "--overwrite" not in err, err
    assert (image_dataset / "manifest.json").read_bytes() == before
    assert not (image_dataset / "extra" / "x.idx").exists()


def test_a_shard_named_in_capitals_is_indexed(tmp_path, capsys):
    # Found by review: `fastio index wds/A.TAR wds/b.tar` (or the brace pattern naming them) wrote the .idx files,
    # then died with a raw ValueError from the manifest ('A.TAR' is not a shard file name); the folder's walk
    # passed A.TAR over without a word (only *.tar in lower case), indexing b.tar alone.
    _tar(tmp_path / "wds" / "A.TAR")
    _tar(tmp_path / "wds" / "b.tar", 2)
    for source in ([str(tmp_path / "wds" / "A.TAR"), str(tmp_path / "wds" / "b.tar")], [str(tmp_path / "wds")]):
        code, out, err = run_cli(["index", *source, "--overwrite", "-q"], capsys)
        assert code == 0 and "Traceback" not in err, err
        manifest = json.loads((tmp_path / "wds" / "manifest.json").read_text())
        assert [(s["name"], s["location"], s["samples"]) for s in manifest["shards"]] == [
            ("A.tar", "A.TAR", 3), ("b.tar", "b.tar", 2)], manifest["shards"]
        assert run_cli(["verify", str(tmp_path / "wds")], capsys)[0] == 0


def test_overwrite_replaces_the_idx_fastio_wrote_for_a_changed_shard_never_the_users(tmp_path, capsys):
    # Found by review: a shard rewritten after `fastio index DIR` (in place) was refused by the Loader with "re-run
    # `fastio index`", which refused (a manifest exists), and `fastio index DIR --overwrite` then refused the .idx
    # fastio itself had written ("an existing .idx is never overwritten"): the user had to delete it by hand.
    folder = tmp_path / "web"
    samples = [(f"s{i:02d}", b"text of sample %02d" % i) for i in range(6)]
    _small_tar(folder / "a.tar", [(f"{k}.{f}", d) for k, v in samples for f, d in (("txt", v), ("cls", b"1"))])
    _small_tar(folder / "b.tar", [("u0.txt", b"user's"), ("u0.cls", b"0")])
    assert run_cli(["index", str(folder / "b.tar"), "--dest", str(tmp_path / "elsewhere"), "-q"], capsys)[0] == 0
    shutil.copy(tmp_path / "elsewhere" / "shards" / "b.idx", folder / "b.idx")  # the user's own .idx, as fastio's
    code, out, err = run_cli(["index", str(folder)], capsys)
    assert code == 0 and "1 .idx written" in out, err
    assert json.loads((folder / "manifest.json").read_text())["source"]["idx_kept"] == ["b.idx"]
    assert run_cli(["index", str(folder), "--overwrite", "-q"], capsys)[0] == 0  # found again: still the user's
    order = [samples[i] for i in (0, 2, 1, 3, 4, 5)]  # rewritten, the same size: s01 and s02 swapped
    _small_tar(folder / "a.tar", [(f"{k}.{f}", d) for k, v in order for f, d in (("txt", v), ("cls", b"1"))])
    with Loader(folder, batch_size=6, pipeline=Raw(fields=("txt",)), device="cpu", shuffle="none") as loader:
        with pytest.raises(Exception, match=re.escape(f"re-run `fastio index {folder} --overwrite`")):
            next(iter(loader))
    code, out, err = run_cli(["index", str(folder), "--overwrite"], capsys)  # the command the Loader named
    assert code == 0 and "1 .idx written" in out, err
    assert (folder / "b.idx").read_bytes() == (tmp_path / "elsewhere" / "shards" / "b.idx").read_bytes()
    with Loader(folder, batch_size=7, pipeline=Raw(fields=("txt",)), device="cpu", shuffle="none") as loader:
        assert sorted(bytes(t) for t in next(iter(loader))["txt"]) == sorted([v for _, v in samples] + [b"user's"])
    _small_tar(folder / "b.tar", [("u1.txt", b"user's"), ("u1.cls", b"0")])  # the user's .idx is never replaced
    code, _, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 2 and f"{folder / 'b.idx'}: exists and differs" in err and "does not record as fastio's" in err, err
    assert (folder / "b.idx").read_bytes() == (tmp_path / "elsewhere" / "shards" / "b.idx").read_bytes()
    _small_tar(folder / "b.tar", [("u0.txt", b"user's"), ("u0.cls", b"0")])
    (folder / "a.idx").write_text("v1.2 1\ntxt 512 3 s00.txt\n")  # fastio's .idx, replaced by the user since
    code, _, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 2 and f"{folder / 'a.idx'}: exists and differs" in err and "does not record as fastio's" in err, err


def _unshare_ro_works(tmp: Path) -> bool:
    """Whether this process may make a read-only bind mount in a mount namespace of its own (root, unshare)."""
    folder = tmp / "probe-ro"
    folder.mkdir()
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro {folder} {folder} && ! touch {folder}/x"],
                          capture_output=True)
    return done.returncode == 0


def test_an_index_in_place_of_a_read_only_folder_names_the_way_out(tmp_path, capsys):
    # Found by review: `fastio index DIR` of a read-only folder (a read-only mount of the shards) said
    # "DIR/.fastio-lock: Read-only file system": the file, but not that --dest indexes such shards. Tested with a
    # read-only bind mount in a mount namespace of its own (as root chmod does not stop writes).
    if not _unshare_ro_works(tmp_path):
        pytest.skip("needs unshare -m and mount --bind -o ro (root)")
    folder = tmp_path / "ro"
    _small_tar(folder / "a.tar", [("s0.txt", b"zero"), ("s1.txt", b"one")])
    cli = "import sys; from fastio.cli import main; sys.exit(main(sys.argv[1:]))"
    script = (f"mount --bind -o ro {folder} {folder} && {sys.executable} -c '{cli}' index {folder} -q; "
              f"echo rc=$?; {sys.executable} -c '{cli}' index {folder} --dest {tmp_path / 'meta'} -q; echo rc=$?")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.split() == ["rc=2", "rc=0"], (done.stdout, done.stderr)
    assert done.stderr == (f"fastio: error: {folder}/.fastio-lock: Read-only file system; the shards' folder cannot "
                           f"be written: index them into another folder with --dest DIR\n"), done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["a.tar"]
    assert (tmp_path / "meta" / "manifest.json").is_file() and (tmp_path / "meta" / "shards" / "a.idx").is_file()


def test_overwrite_replaces_the_idx_fastio_wrote_on_s3_too(aws_env, s3_bucket, tmp_path, capsys):
    from fastio.storage import open_storage

    src = open_storage(f"s3://{s3_bucket}/web")
    for name, keys in (("a.tar", ("s0", "s1", "s2")), ("b.tar", ("u0",))):
        _small_tar(tmp_path / name, [(f"{k}.{f}", d) for k in keys for f, d in (("txt", k.encode()), ("cls", b"1"))])
        src.put_file(name, tmp_path / name)
    src.put_bytes("b.idx", b"v1.2 1\ntxt 512 2 u0.txt cls 1536 1 u0.cls\n")  # the user's, as fastio makes it
    assert run_cli(["index", src.url, "-q"], capsys)[0] == 0
    _small_tar(tmp_path / "a.tar", [(f"{k}.{f}", d) for k in ("s0", "s2", "s1") for f, d in (("txt", k.encode()),
                                                                                           ("cls", b"1"))])
    src.put_file("a.tar", tmp_path / "a.tar")
    code, out, err = run_cli(["index", src.url, "--overwrite"], capsys)
    assert code == 0 and "1 .idx written" in out, err
    assert src.get("b.idx") == b"v1.2 1\ntxt 512 2 u0.txt cls 1536 1 u0.cls\n"
    assert run_cli(["verify", src.url], capsys)[0] == 0


def test_the_rebuild_command_of_a_relative_source_with_dest_works_from_anywhere(tmp_path, capsys, monkeypatch):
    # Found by review: `fastio index web --dest meta` recorded SOURCE as typed ('web'), and the Loader's "re-run
    # `fastio index web --dest /abs/meta --overwrite`" was right only from the folder the index was run in.
    samples = [(f"s{i:02d}", b"text of sample %02d" % i) for i in range(4)]
    _small_tar(tmp_path / "web" / "a.tar", [(f"{k}.txt", v) for k, v in samples])
    monkeypatch.chdir(tmp_path)
    assert run_cli(["index", "web", "--dest", "meta", "-q"], capsys)[0] == 0
    assert json.loads((tmp_path / "meta" / "manifest.json").read_text())["source"]["path"] == str(tmp_path / "web")
    order = [samples[i] for i in (0, 2, 1, 3)]  # rewritten, the same size: s01 and s02 swapped
    _small_tar(tmp_path / "web" / "a.tar", [(f"{k}.txt", v) for k, v in order])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    command = f"fastio index {tmp_path / 'web'} --dest {tmp_path / 'meta'} --overwrite"
    with Loader(tmp_path / "meta", batch_size=4, pipeline=Raw(fields=("txt",)), device="cpu", shuffle="none") as loader:
        with pytest.raises(Exception, match=re.escape(f"re-run `{command}`")):
            next(iter(loader))
    code, out, err = run_cli(command.split()[1:], capsys)  # the command it names, from another folder
    assert code == 0 and "1 .idx written" in out, err
    for n in range(2):  # a brace pattern too ('./' dropped; '..' kept: '{a,b}/..' is no folder to fold)
        _small_tar(tmp_path / "web2" / f"{n}.tar", [(f"{k}.txt", v) for k, v in samples])
    assert run_cli(["index", "../web2/./{0..1}.tar", "--dest", "meta2", "-q"], capsys)[0] == 0
    recorded = json.loads((elsewhere / "meta2" / "manifest.json").read_text())["source"]["path"]
    assert recorded == f"{elsewhere}/../web2/{{0..1}}.tar", recorded


def _start_time(pid: int) -> str:
    """Process ``pid``'s start time (clock ticks after boot), as /proc/PID/stat gives it."""
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19].decode()


def test_a_killed_index_leaves_no_download_a_later_run_does_not_take_away(tmp_path, capsys, monkeypatch):
    # Found by review: an index reading from S3 that is killed left its download (a whole shard) in
    # /tmp/fastio-index-*, and every later run left it there. Now a run's folder is named by its process (pid and
    # start time), and a later run removes those whose process is gone; never a live process's.
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _tar(tmp_path / "src" / "x0.tar")
    try:
        folders = {"dead": f"fastio-index-{dead_pid}-{_start_time(os.getpid())}-abc",  # its pid ended
                   "reused": f"fastio-index-{live.pid}-1-abc",  # a live pid, another process's start time
                   "live": f"fastio-index-{live.pid}-{_start_time(live.pid)}-abc",
                   "me": f"fastio-index-{os.getpid()}-{_start_time(os.getpid())}-abc",
                   "older": "fastio-index-k2j4x8q1",  # an older fastio's: whose is unknown
                   "other": f"fastio-verify-{dead_pid}-1-abc"}
        for name in folders.values():
            (scratch / name).mkdir()
            (scratch / name / ".fastio-index-x.tar").write_bytes(b"a shard's download")
            for path in (scratch / name / ".fastio-index-x.tar", scratch / name):
                os.utime(path, (1e9, 1e9))  # nothing changed there for long
        (scratch / folders["dead"] / "new.tar").write_bytes(b"")  # just written: maybe a process of another pid
        assert run_cli(["index", str(tmp_path / "src"), "-q"], capsys)[0] == 0  # namespace, not seen from here
        assert (scratch / folders["dead"]).is_dir()
        for path in (scratch / folders["dead"] / "new.tar", scratch / folders["dead"]):
            os.utime(path, (1e9, 1e9))
        assert run_cli(["index", str(tmp_path / "src"), "--overwrite", "-q"], capsys)[0] == 0
        assert sorted(p.name for p in scratch.iterdir()) == sorted(folders[k] for k in ("live", "me", "older", "other"))
    finally:
        live.kill()
        live.wait()


def _killed_before_the_manifest(monkeypatch, args: list[str], capsys) -> None:
    """Run ``fastio index ARGS`` stopped as a kill would stop it: after its .idx files, before its manifest."""
    import fastio.convert.wds_index as wds_index

    publish = wds_index.publish_uploads

    def killed_at_the_manifest(dest, uploads):
        if any(key == "manifest.json" for key, _ in uploads):
            raise KeyboardInterrupt  # a kill here: no manifest
        publish(dest, uploads)

    monkeypatch.setattr(wds_index, "publish_uploads", killed_at_the_manifest)
    assert run_cli(["index", *args, "-q"], capsys)[0] == 130
    monkeypatch.setattr(wds_index, "publish_uploads", publish)


def _text_tar(path: Path, keys: tuple[str, ...]) -> None:
    _small_tar(path, [(f"{k}.{f}", d) for k in keys for f, d in (("txt", k.encode()), ("cls", b"1"))])


def test_the_idx_files_of_a_killed_first_run_are_fastios_never_the_users(tmp_path, capsys, monkeypatch):
    # Found by review: an index in place killed after its .idx files but before its manifest left .idx files no
    # manifest lists; the rerun counted them as the user's (source.idx_kept), and once a shard changed, `fastio
    # index DIR --overwrite` refused to replace fastio's own .idx. The user's own .idx is still never replaced.
    folder = tmp_path / "web"
    _text_tar(folder / "a.tar", ("s0", "s1", "s2"))
    _text_tar(folder / "b.tar", ("u0",))
    users = b"v1.2 1\ntxt 512 2 u0.txt cls 1536 1 u0.cls\n"  # the user's, as fastio makes it
    (folder / "b.idx").write_bytes(users)
    _killed_before_the_manifest(monkeypatch, [str(folder)], capsys)
    assert (folder / "a.idx").is_file() and not (folder / "manifest.json").exists()
    _text_tar(folder / "a.tar", ("s0", "s2", "s1"))  # changed before the rerun
    code, out, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 0 and "1 .idx written" in out, err
    assert json.loads((folder / "manifest.json").read_text())["source"]["idx_kept"] == ["b.idx"]
    assert run_cli(["verify", str(folder)], capsys)[0] == 0
    _text_tar(folder / "b.tar", ("u1",))  # the user's .idx is never replaced
    code, _, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 2 and "does not record as fastio's" in err and (folder / "b.idx").read_bytes() == users, err
    # killed again, with the shards unchanged: the rerun finds fastio's .idx as it left it, and still its own
    _text_tar(folder / "b.tar", ("u0",))
    (folder / "manifest.json").unlink()
    (folder / "a.idx").unlink()
    _killed_before_the_manifest(monkeypatch, [str(folder)], capsys)
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    assert json.loads((folder / "manifest.json").read_text())["source"]["idx_kept"] == ["b.idx"]


def test_a_killed_first_run_with_dest_leaves_no_idx_the_rerun_does_not_list(tmp_path, capsys, monkeypatch):
    # Found by review: `fastio index SRC --dest D` killed before its manifest left D/shards/*.idx; a shard removed
    # from SRC before the rerun left its .idx there, listed by no manifest, and `fastio verify D` failed.
    for n in range(3):
        _tar(tmp_path / "src" / f"x{n}.tar")
    dest = tmp_path / "meta"
    _killed_before_the_manifest(monkeypatch, [str(tmp_path / "src"), "--dest", str(dest)], capsys)
    assert sorted(p.name for p in (dest / "shards").iterdir()) == ["x0.idx", "x1.idx", "x2.idx"]
    (tmp_path / "src" / "x1.tar").unlink()
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "-q"], capsys)[0] == 0
    assert sorted(p.name for p in (dest / "shards").iterdir()) == ["x0.idx", "x2.idx"]
    code, out, err = run_cli(["verify", str(dest)], capsys)
    assert code == 0, out + err
    # a damaged ledger names nothing fastio may remove: outside shards/, or a file changed since it was recorded
    (tmp_path / "mine.idx").write_text("the user's")
    (dest / "shards" / "x9.idx").write_text("the user's too")
    sha = hashlib.sha256(b"the user's").hexdigest()
    ledger = json.loads((dest / ".fastio-idx.json").read_text())
    ledger["idx"].update({"../mine.idx": sha, str(tmp_path / "mine.idx"): sha, "shards/x9.idx": sha})
    (dest / ".fastio-idx.json").write_text(json.dumps(ledger))
    assert run_cli(["index", str(tmp_path / "src"), "--dest", str(dest), "--overwrite", "-q"], capsys)[0] == 0
    assert (tmp_path / "mine.idx").read_text() == "the user's" and (dest / "shards" / "x9.idx").is_file()


def test_the_idx_fastio_wrote_for_a_shard_gone_away_is_replaced_for_a_new_tar_of_its_name(tmp_path, capsys):
    # Found by review: the .idx fastio wrote beside a shard later removed stayed (in place, .idx files are never
    # deleted); the next manifest no longer listed it, so a different tar of that name was then refused: "an .idx
    # that DEST's manifest does not record as fastio's", and the user had to delete fastio's .idx by hand.
    folder = tmp_path / "web"
    _text_tar(folder / "a.tar", ("s0", "s1"))
    _text_tar(folder / "b.tar", ("t0", "t1"))
    assert run_cli(["index", str(folder), "-q"], capsys)[0] == 0
    (folder / "b.tar").unlink()
    assert run_cli(["index", str(folder), "--overwrite", "-q"], capsys)[0] == 0
    assert (folder / "b.idx").is_file()  # never deleted in place
    _text_tar(folder / "b.tar", ("t0", "t1", "t2"))  # another tar of that name
    code, out, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 0 and "1 .idx written" in out, err
    assert run_cli(["verify", str(folder)], capsys)[0] == 0
    (folder / "b.idx").write_text("v1.2 1\ntxt 512 2 t0.txt\n")  # changed since by the user: theirs
    _text_tar(folder / "b.tar", ("t0", "t1"))
    code, _, err = run_cli(["index", str(folder), "--overwrite"], capsys)
    assert code == 2 and "does not record as fastio's" in err, err


def test_merge_help_and_its_no_parts_message_name_fastio_index_too(tmp_path, capsys):
    # Found by the newcomer pass: `fastio merge --help` said it publishes the parts of `fastio convert --part K/N`
    # only, and `fastio merge DEST` with no parts named only `fastio convert` to write them, though it publishes the
    # parts of `fastio index --part K/N` as well.
    code, out, _ = run_cli(["merge", "--help"], capsys)
    assert code == 0 and "fastio index" in " ".join(out.split()), out
    code, _, err = run_cli(["merge", str(tmp_path / "dest")], capsys)
    assert code == 2 and f"fastio index SOURCE --dest {tmp_path / 'dest'} --part K/N" in err, err


def test_a_split_dest_or_a_converted_dataset_is_not_indexed_again(image_folder, tmp_path, capsys):
    # Found by the newcomer review (round 4): `fastio index ds` on the DEST of `fastio convert images ds --split
    # train=0.9,val=0.1` walked into ds/train/shards/ and ds/val/shards/ and published ds/manifest.json: ds became one
    # dataset of train and val together (a Loader of it trained on the validation samples; inspect showed no splits).
    # A converted dataset's own shards/ are not entered at any depth, and a split DEST is named as such.
    ds = tmp_path / "out" / "ds"
    assert run_cli(["convert", str(image_folder), str(ds), "--split", "train=0.75,val=0.25", "-q"], capsys)[0] == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, _, err = run_cli(["index", str(ds)], capsys)
    assert code == 2 and err == (f"fastio: error: {ds}: holds the splits train, val of a fastio convert, each a "
                                 f"dataset already: nothing to index; give {ds / 'train'} or {ds / 'val'} to the "
                                 "Loader, verify or inspect\n"), err
    code, _, err = run_cli(["index", str(ds / "train")], capsys)
    assert code == 2 and err == (f"fastio: error: {ds / 'train'}: a fastio dataset already (its shards/ are its own): "
                                 "nothing to index; give it to the Loader, verify or inspect as it is\n"), err
    code, _, err = run_cli(["index", str(tmp_path / "out")], capsys)  # a folder holding converted datasets
    assert code == 2 and err == (f"fastio: error: {tmp_path / 'out'}: holds no .tar files but the fastio datasets "
                                 f"ds/train, ds/val (their shards/ are their own): nothing to index; give "
                                 f"{ds / 'train'} or {ds / 'val'} to the Loader, verify or inspect\n"), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    (tmp_path / "mine").mkdir()
    shutil.copy(next((ds / "train" / "shards").glob("*.tar")), tmp_path / "mine" / "a.tar")
    (tmp_path / "mine" / "splits.json").write_text('{"my": "own file"}')  # not fastio's: the tars are indexed
    assert run_cli(["index", str(tmp_path / "mine"), "-q"], capsys)[0] == 0


def test_datasets_below_an_s3_source_are_not_indexed_again(aws_env, s3_bucket, image_folder, tmp_path, capsys):
    """Before: `fastio index s3://b/two` of a prefix holding the datasets train/ and val/ (each converted on its own,
    no splits.json) entered their shards/ (a local folder does not): one dataset of train and val together, and
    beside other tars, 6 shards of them indexed with the one of the user's. Now a prefix is listed as a folder is:
    a fastio dataset's own shards/ are not entered at any depth, and a SOURCE holding only datasets names them."""
    from fastio.storage import open_storage

    local, url = tmp_path / "two", f"s3://{s3_bucket}/two"
    for split in ("train", "val"):
        for dest in (local / split, f"{url}/{split}"):
            assert run_cli(["convert", str(image_folder), str(dest), "-q", "--max-samples-per-shard", "16"],
                           capsys)[0] == 0
    before = sorted(o.key for o in open_storage(url).list())
    for source in (str(local), url, url + "/"):
        shown = source.rstrip("/") if source == url + "/" else source
        code, _, err = run_cli(["index", source], capsys)
        assert code == 2 and err == (f"fastio: error: {source}: holds no .tar files but the fastio datasets train, "
                                     f"val (their shards/ are their own): nothing to index; give {shown}/train or "
                                     f"{shown}/val to the Loader, verify or inspect\n"), err
    assert sorted(o.key for o in open_storage(url).list()) == before
    _tar(local / "raw" / "0.tar")
    open_storage(url).put_file("raw/0.tar", local / "raw" / "0.tar")
    for source in (str(local), url):
        code, out, err = run_cli(["index", source], capsys)
        assert code == 0 and out.startswith("indexed 1 shard, 3 samples "), (source, out, err)
    assert json.loads(open_storage(url).get("manifest.json"))["total_samples"] == 3


def test_the_shards_folder_of_an_s3_dataset_is_not_indexed_into(aws_env, s3_bucket, image_folder, capsys):
    """Before: `fastio index s3://b/ds/shards` (a converted dataset's own shards/) wrote a manifest, samples.fxi and
    a marker among that dataset's shards, where a local ds/shards is refused. Now it is refused as locally."""
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/ds"
    assert run_cli(["convert", str(image_folder), url, "-q", "--max-samples-per-shard", "16"], capsys)[0] == 0
    before = sorted(o.key for o in open_storage(url).list())
    for source, extra in ((f"{url}/shards", ()), (f"{url}/shards/", ()), (f"{url}/shards", ("--overwrite",)),
                          (f"{url}/shards/shard-{{000000..000002}}.tar", ("--dest", f"{url}/shards"))):
        code, _, err = run_cli(["index", source, *extra], capsys)
        assert code == 2 and err == (f"fastio: error: {url}/shards: the shards/ folder of the dataset {url}: an index "
                                     "here would add files to that dataset; it is read as it is (give the dataset's "
                                     "folder), or index these shards into another folder (--dest)\n"), (source, err)
    assert sorted(o.key for o in open_storage(url).list()) == before


def test_a_split_of_an_unfinished_s3_conversion_is_not_indexed(aws_env, s3_bucket, tmp_path, capsys):
    """Before: `fastio index s3://b/run/train`, a split of a --split conversion killed mid-upload (run/.fastio-output,
    run/train/shards/, no splits.json), indexed its shards as a dataset in place, where a local run/train is refused
    naming the conversion to run again. Now the same refusal, and nothing is written."""
    from fastio.storage import open_storage

    run = open_storage(f"s3://{s3_bucket}/run")
    run.put_bytes(".fastio-output", b"fastio convert output; complete once manifest.json or splits.json exists\n")
    run.put_bytes("train/shards/shard-000000.tar", _tar(tmp_path / "0.tar"))
    before = sorted(o.key for o in run.list())
    for argv in (["index", f"{run.url}/train"], ["index", f"{run.url}/train/", "--overwrite"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err == (f"fastio: error: {run.url}/train: a split of {run.url}: an unfinished fastio "
                                     "convert (killed or stopped: .fastio-output without splits.json), not a "
                                     "dataset; run the same fastio convert again to finish it\n"), err
    assert sorted(o.key for o in run.list()) == before


def test_the_dest_of_an_unfinished_split_conversion_is_not_indexed(aws_env, s3_bucket, tmp_path, capsys):
    """Before: `fastio index run` of the DEST of a --split conversion that was killed (its marker, train/shards/, no
    splits.json) indexed the unfinished split's shards into run/manifest.json, locally and on S3: a dataset of half a
    split, which the rerun of the conversion then refused as 'already holds a converted dataset'. Now it is refused
    naming the conversion to run again, and nothing is written."""
    from fastio.storage import open_storage

    marker = b"fastio convert output; complete once manifest.json or splits.json exists\n"
    local, s3 = open_storage(tmp_path / "run"), open_storage(f"s3://{s3_bucket}/run")
    for run in (local, s3):
        if not run.remote:
            (tmp_path / "run" / "train" / "shards").mkdir(parents=True)
        run.put_bytes(".fastio-output", marker)
        run.put_bytes("train/shards/shard-000000.tar", _tar(tmp_path / "0.tar"))
        before = sorted(o.key for o in run.list())
        for argv in (["index", str(run.url)], ["index", str(run.url), "--overwrite"]):
            code, _, err = run_cli(argv, capsys)
            assert code == 2 and err == (f"fastio: error: {run.url}: an unfinished fastio convert (killed or stopped: "
                                         ".fastio-output without manifest.json), not a dataset; run the same fastio "
                                         "convert again to finish it\n"), err
        assert sorted(o.key for o in run.list()) == before
