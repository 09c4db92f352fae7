"""`fastio convert / verify / inspect` with an s3:// DEST, against a real S3 server (moto) on loopback."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from helpers import run_cli

from fastio import ImageTrain, Loader
from fastio.errors import DatasetError
from fastio.storage import open_storage
from fastio.storage.options import StorageOptions


def test_convert_verify_inspect_load_on_s3(aws_env, s3_bucket, image_folder, tmp_path, capsys, monkeypatch):
    url = f"s3://{s3_bucket}/imagenet"
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["convert", str(image_folder), url, "--max-samples-per-shard", "16", "-q",
                          "--staging-dir", str(tmp_path / "staging")], capsys)
    assert code == 0, err
    assert not (tmp_path / "s3:").exists() and list((tmp_path / "staging").iterdir()) == []
    keys = [o.key for o in open_storage(url).list()]
    assert keys == [".fastio-output", "manifest.json", "samples.fxi"] + [f"shards/shard-{i:06d}.{e}" for i in range(3)
                                                          for e in ("idx", "tar")]
    code, out, err = run_cli(["verify", url, "--decode"], capsys)
    assert code == 0 and out.strip() == f"ok: {url}: 3 shards, 48 samples verified, 48 images decoded", err
    code, out, err = run_cli(["inspect", url, "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and info["path"] == url and info["samples"] == 48 and len(info["classes"]) == 4
    with Loader(url, batch_size=16, device="cpu", pipeline=ImageTrain(size=32)) as loader:
        assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(48))
    # the same DEST again: refused without --overwrite, replaced with it
    code, _, err = run_cli(["convert", str(image_folder), url, "-q"], capsys)
    assert code == 2 and f"fastio: error: {url}: already holds a converted dataset; pass --overwrite" in err
    code, _, err = run_cli(["convert", str(image_folder), url, "-q", "--overwrite", "--max-samples-per-shard", "24"],
                       capsys)
    assert code == 0, err
    assert [o.key for o in open_storage(url).list("shards/")] == [f"shards/shard-{i:06d}.{e}" for i in range(2)
                                                                  for e in ("idx", "tar")]


def test_verify_names_a_damaged_object(aws_env, s3_bucket, image_folder, capsys):
    url = f"s3://{s3_bucket}/ds"
    assert run_cli(["convert", str(image_folder), url, "--max-samples-per-shard", "16", "-q"], capsys)[0] == 0
    st = open_storage(url)
    data = bytearray(st.get("shards/shard-000001.tar"))
    data[-1] ^= 1
    st.put_bytes("shards/shard-000001.tar", bytes(data))
    st.delete("shards/shard-000002.idx")
    code, out, err = run_cli(["verify", url], capsys)
    assert code == 1, err
    assert "shard-000001.tar: sha256 does not match the manifest" in out
    assert "shard-000002.tar: index shard-000002.idx is missing" in out


def test_split_dest_on_s3(aws_env, s3_bucket, image_folder, capsys):
    url = f"s3://{s3_bucket}/split"
    code, _, err = run_cli(["convert", str(image_folder), url, "--split", "val=0.25", "-q"], capsys)
    assert code == 0, err
    keys = [o.key for o in open_storage(url).list()]
    assert "splits.json" in keys and "train/manifest.json" in keys and "val/manifest.json" in keys
    code, out, err = run_cli(["inspect", url, "--json"], capsys)
    assert code == 0 and sorted(json.loads(out)["splits"]) == ["train", "val"], err
    assert run_cli(["verify", url], capsys)[0] == 0
    with Loader(f"{url}/val", batch_size=4, device="cpu", pipeline=ImageTrain(size=32)) as loader:
        assert len(loader) == 3
    with pytest.raises(DatasetError, match=rf"{url}: holds the splits train, val, not one dataset: open {url}/train "
                                           rf"or {url}/val$"):
        Loader(url, batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    # found by the newcomer review: a split splits.json does not list said only 'no such dataset directory', as on
    # a local disk (tests/test_newcomer_messages.py)
    said = f"fastio: error: {url}/test: no split 'test' in {url} (its splits.json lists train, val)\n"
    assert run_cli(["verify", f"{url}/test"], capsys)[1:] == ("", said)


def test_an_endpoint_without_a_scheme_is_one_line_in_every_command(s3_bucket, capsys, monkeypatch):
    """``--endpoint-url 127.0.0.1:9000`` (the usual MinIO typo) was a raw ValueError traceback in verify and index."""
    for argv in (["verify", f"s3://{s3_bucket}/ds", "--endpoint-url", "127.0.0.1:9000"],
                 ["index", f"s3://{s3_bucket}/ds/", "--endpoint-url", "127.0.0.1:9000"],
                 ["inspect", f"s3://{s3_bucket}/ds", "--endpoint-url", "127.0.0.1:9000"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err == "fastio: error: endpoint must be an http:// or https:// URL, got '127.0.0.1:9000'\n"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    code, _, err = run_cli(["index", f"s3://{s3_bucket}/ds/", "--dest", f"s3://{s3_bucket}/zz"], capsys)
    assert code == 2 and "got 'localhost:9000'" in err and "Traceback" not in err


def test_bad_urls_and_foreign_prefixes_are_refused(aws_env, s3_bucket, image_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for dest, needle in [("gs://bucket/x", "gs://bucket/x: unsupported URL scheme 'gs'"),
                         ("s3:/bucket/x", "s3:/bucket/x: an S3 URL is s3://bucket/prefix")]:
        code, _, err = run_cli(["convert", str(image_folder), dest, "-q"], capsys)
        assert code == 2 and err.startswith("fastio: error: ") and needle in err, err
    assert not any(":" in p.name for p in tmp_path.rglob("*"))  # no local folder named after a URL scheme
    open_storage(f"s3://{s3_bucket}/mine").put_bytes("notes.txt", b"precious")
    code, _, err = run_cli(["convert", str(image_folder), f"s3://{s3_bucket}/mine", "-q"], capsys)
    assert code == 2 and "prefix is not empty and is not fastio output" in err
    assert open_storage(f"s3://{s3_bucket}/mine").get("notes.txt") == b"precious"
    theirs = open_storage(f"s3://{s3_bucket}/theirs")  # another tool's manifest.json: no fastio output either
    theirs.put_bytes("manifest.json", b'{"name": "my-project"}')
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(["convert", str(image_folder), f"s3://{s3_bucket}/theirs", "-q", *extra], capsys)
        assert code == 2 and "prefix is not empty and is not fastio output" in err, err
    assert theirs.get("manifest.json") == b'{"name": "my-project"}'
    code, _, err = run_cli(["verify", f"s3://{s3_bucket}/nothing"], capsys)
    assert code == 2 and f"s3://{s3_bucket}/nothing: no such dataset directory" in err
    for command in ("verify", "inspect"):  # said "not a fastio dataset (no manifest.json ...)"
        code, _, err = run_cli([command, "s3://no-such-bucket-here/ds"], capsys)
        assert code == 2 and "s3://no-such-bucket-here/ds: no such bucket 'no-such-bucket-here'" in err, err
    # An endpoint nothing listens on: a refused connection is transient, retried until deadline_s (120 s by
    # default), then one line. Here a 2 s deadline: the same retries and the same error, 118 s sooner.
    resolve = StorageOptions.resolve.__func__
    monkeypatch.setattr(StorageOptions, "resolve", classmethod(
        lambda cls, overrides=None, env=None: dataclasses.replace(resolve(cls, overrides, env), deadline_s=2.0)))
    code, _, err = run_cli(["inspect", f"s3://{s3_bucket}/nothing", "--endpoint-url", "http://127.0.0.1:9"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"s3://{s3_bucket}/nothing" in err and "Traceback" not in err
    assert "deadline_s=2" in err, err  # it was retried to the deadline (a refusal not retried would not say so)


def test_verify_with_no_room_for_a_download_is_one_line(aws_env, s3_bucket, image_folder, capsys):
    """Before: `fastio verify s3://...` whose temporary folder could not hold a shard (here the file size limit, a
    quota-free stand-in for a full disk) died with a raw OSError traceback from the download. Now one line names
    the object and the folder, exit 2."""
    import resource
    import signal

    url = f"s3://{s3_bucket}/ds"
    assert run_cli(["convert", str(image_folder), url, "--max-samples-per-shard", "16", "-q"], capsys)[0] == 0
    smallest = min(o.size for o in open_storage(url).list("shards/") if o.key.endswith(".tar"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (smallest // 2, hard))
    try:
        code, out, err = run_cli(["verify", url], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fastio: error: {url}/shards/shard-000000.tar: cannot download into ") and \
        err.endswith(": File too large\n"), err


def test_unindexed_tars_and_a_dataset_file_on_s3_are_named_as_locally(aws_env, s3_bucket, image_folder, tmp_path,
                                                                    capsys):
    """Before: `fastio verify|inspect s3://b/wds` of WebDataset tars without a manifest said 'not a fastio dataset (no
    manifest.json; an interrupted conversion?)' where a local folder of them says to run `fastio index`; and the URL of
    a dataset's manifest (s3://b/ds/manifest.json), of its splits.json or of one of its shards said the same where a
    local path names its dataset. Now each says what a local path says, naming the URL (a few objects listed)."""
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("k0.jpg")
        tar.addfile(info, io.BytesIO(b""))
    wds, local = open_storage(f"s3://{s3_bucket}/wds"), tmp_path / "wds"
    local.mkdir()
    for i in range(3):
        wds.put_bytes(f"{i:05d}.tar", data.getvalue())
        (local / f"{i:05d}.tar").write_bytes(data.getvalue())
    for dest in (str(local), wds.url, wds.url + "/"):
        said = (f"fastio: error: {dest.rstrip('/')}: tar shards without a manifest.json, not yet a dataset: make it "
                f"one with `fastio index {dest.rstrip('/')}`\n")
        for command in ("verify", "inspect"):
            assert run_cli([command, dest], capsys)[1:] == ("", said), (command, dest)
    with pytest.raises(DatasetError, match=re.escape(f"fastio index {wds.url}`")):
        Loader(wds.url, batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    for folder in (str(local), wds.url):  # what other loaders take: a brace pattern, a glob; Megatron pairs
        for given, command in ((f"{folder}/{{00000..00002}}.tar", f"'{folder}/{{00000..00002}}.tar'"),
                               (f"{folder}/*.tar", folder)):
            said = (f"fastio: error: {given}: a pattern of tar shards, not a dataset: a dataset is a folder; make "
                    f"its shards one with `fastio index {command}`, then give {folder}\n")
            assert run_cli(["verify", given], capsys)[1:] == ("", said), given
    mg, local_mg = open_storage(f"s3://{s3_bucket}/mg"), tmp_path / "mg"
    local_mg.mkdir()
    for name in ("web_text_document.bin", "web_text_document.idx"):
        mg.put_bytes(name, b"\0" * 16)
        (local_mg / name).write_bytes(b"\0" * 16)
    for folder in (str(local_mg), mg.url):
        said = (f"fastio: error: {folder}: a folder of Megatron .bin/.idx pairs without a manifest.json, not yet a "
                f"dataset: make it one with `fastio index {folder} --eos-id N` (N: the id that ends every document), "
                "then give that folder\n")
        assert run_cli(["inspect", folder], capsys)[1:] == ("", said), folder
    url, split = f"s3://{s3_bucket}/ds", f"s3://{s3_bucket}/split"
    assert run_cli(["convert", str(image_folder), url, "--max-samples-per-shard", "16", "-q"], capsys)[0] == 0
    assert run_cli(["convert", str(image_folder), split, "--split", "val=0.25", "-q"], capsys)[0] == 0
    local_ds = tmp_path / "ds"
    assert run_cli(["convert", str(image_folder), str(local_ds), "-q"], capsys)[0] == 0
    for given, what, dataset in ((f"{url}/manifest.json", "file", url),
                                 (f"{url}/shards/shard-000001.tar", "shard", url),
                                 (f"{url}/shards", "folder", url),  # said to run `fastio index`, which refuses it
                                 (f"{local_ds}/shards", "folder", local_ds),
                                 (f"{split}/splits.json", "file", split),
                                 (f"{split}/val/manifest.json", "file", f"{split}/val")):
        said = f"fastio: error: {given}: a {what} of the dataset {dataset}: give the dataset folder\n"
        for command in ("verify", "inspect"):
            assert run_cli([command, given], capsys)[1:] == ("", said), (command, given)
    with pytest.raises(DatasetError, match=re.escape(f"a file of the dataset {url}: give the dataset folder")):
        Loader(f"{url}/manifest.json", batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    code, _, err = run_cli(["index", f"{url}/manifest.json"], capsys)  # said "holds no .tar files"
    assert code == 2 and err == (f"fastio: error: {url}/manifest.json: an object, not a prefix: give the prefix "
                                 "holding the shards, or a brace pattern\n"), err
    for run, marker in (("fastio convert", b"fastio convert output; complete once manifest.json or splits.json "
                                           b"exists\n"),
                        ("fastio index", b"fastio index output; complete once manifest.json exists\n")):
        killed = open_storage(f"s3://{s3_bucket}/killed-{run[7:]}")  # a run killed mid-upload: its marker, shards
        killed.put_bytes(".fastio-output", marker)
        killed.put_bytes("shards/shard-000000.tar", data.getvalue())
        said = (f"fastio: error: {killed.url}: an unfinished {run} (killed or stopped: .fastio-output without "
                f"manifest.json), not a dataset; run the same {run} again to finish it\n")
        assert run_cli(["verify", killed.url], capsys)[1:] == ("", said)
    run = open_storage(f"s3://{s3_bucket}/killed-split")  # a --split conversion killed mid-upload: not a source
    run.put_bytes(".fastio-output", b"fastio convert output; complete once manifest.json or splits.json exists\n")
    run.put_bytes("train/shards/shard-000000.tar", data.getvalue())
    said = (f"fastio: error: {run.url}/train: a split of {run.url}: an unfinished fastio convert (killed or stopped: "
            ".fastio-output without splits.json), not a dataset; run the same fastio convert again to finish it\n")
    assert run_cli(["verify", f"{run.url}/train"], capsys)[1:] == ("", said)
    notes = open_storage(f"s3://{s3_bucket}/notes")  # nothing fastio names there: as before
    notes.put_bytes("notes.txt", b"no dataset here")
    code, _, err = run_cli(["verify", notes.url], capsys)
    assert code == 2 and err == f"fastio: error: {notes.url}: not a fastio dataset (no manifest.json; " \
                                "an interrupted conversion?)\n"


def test_a_prefix_of_datasets_of_images_or_of_nothing_is_named_as_a_local_folder_is(aws_env, moto_server, s3_bucket,
                                                                                    image_dataset, image_folder,
                                                                                    tmp_path, capsys):
    """Before: `fastio verify|inspect` and the Loader given an s3:// prefix holding converted datasets in its
    sub-prefixes (no splits.json), a prefix of plain .jpg objects, or a mistyped prefix (no object at all) each said
    'not a fastio dataset (no manifest.json; an interrupted conversion?)' (so did a local folder of datasets) where
    a local folder of images or a missing one is named as such. Now each names the URL and what it is: the datasets
    to open, that the images are to be converted (from a local copy: convert reads images from disk), no such
    dataset (and the prefix nearest a typo), an empty folder (a console's folder object, an empty bucket); as a
    local folder's message says it."""
    import shutil

    from fastio.dataset.manifest import MANIFEST_NAME

    local, remote = tmp_path / "many", f"s3://{s3_bucket}/many"
    for name in ("a", "b"):
        shutil.copytree(image_dataset, local / name)
        open_storage(f"{remote}/{name}").publish_dir(image_dataset, keys_last=(MANIFEST_NAME,))
    for dest in (str(local), remote):
        said = f"{dest}: holds the datasets a, b, not one dataset: open {dest}/a or {dest}/b"
        for command in ("verify", "inspect"):
            assert run_cli([command, dest], capsys)[1:] == ("", f"fastio: error: {said}\n"), (command, dest)
        with pytest.raises(DatasetError, match=f"^{re.escape(said)}$"):
            Loader(dest, batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    images = open_storage(f"s3://{s3_bucket}/imgs")
    for path in sorted(image_folder.rglob("*.jpg")):
        images.put_bytes(path.relative_to(image_folder).as_posix(), path.read_bytes())
    said = (f"fastio: error: {image_folder}: a folder of images, not a dataset: convert it with `fastio convert "
            f"{image_folder} DEST`, then give DEST\n")
    assert run_cli(["verify", str(image_folder)], capsys)[1:] == ("", said)
    said = (f"fastio: error: {images.url}: a folder of images, not a dataset: copy it to a local folder and convert "
            "that with `fastio convert FOLDER DEST`, then give DEST\n")
    for command in ("verify", "inspect"):
        assert run_cli([command, images.url], capsys)[1:] == ("", said), command
    for folder in (str(tmp_path), f"s3://{s3_bucket}"):
        for typo, near in (("mnay", "many"), ("many/aa", "many/a"), ("zzz", None)):
            hint = f" (did you mean {folder}/{near}?)" if near else ""
            said = f"fastio: error: {folder}/{typo}: no such dataset directory{hint}\n"
            for command in ("verify", "inspect"):
                assert run_cli([command, f"{folder}/{typo}"], capsys)[1:] == ("", said), (command, typo)
    with pytest.raises(DatasetError, match=rf"^s3://{s3_bucket}/mnay: no such dataset directory \(did you mean "):
        Loader(f"s3://{s3_bucket}/mnay", batch_size=4, device="cpu", pipeline=ImageTrain(size=32))
    # an empty folder: a console's "Create folder" (an object "empty/"; it was named as a typo of itself), a bucket
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", moto_server.port, timeout=10)
    conn.request("PUT", f"/{s3_bucket}/empty/", body=b"")
    assert conn.getresponse().status == 200
    conn.close()
    moto_server.create_bucket(f"{s3_bucket}-e")
    (tmp_path / "empty").mkdir()
    for dest in (str(tmp_path / "empty"), f"s3://{s3_bucket}/empty", f"s3://{s3_bucket}-e"):
        said = (f"fastio: error: {dest}: an empty folder, not a dataset: give the folder `fastio convert` or "
                "`fastio index` made\n")
        assert run_cli(["verify", dest], capsys)[1:] == ("", said), dest


def test_a_listing_the_role_may_not_make_leaves_the_message_without_its_hint(moto_server, s3_bucket, image_dataset,
                                                                            fault_proxy, tmp_path):
    """The nearest prefix (a typo's) and the datasets below a prefix come from a listing with a delimiter, of the
    parent or of the prefix: where the role may not make it (a 403, as a policy that lets a role list some prefixes
    only answers), the message is what it is without that look, not the listing's refusal."""
    from fastio.dataset.dataset import Dataset
    from fastio.dataset.manifest import MANIFEST_NAME

    open_storage(f"s3://{s3_bucket}/many/a", moto_server.options()).publish_dir(image_dataset,
                                                                                 keys_last=(MANIFEST_NAME,))
    fault_proxy.forbidden = {"delimiter="}
    opts = dict(cache_dir=tmp_path / "cache", storage_options=moto_server.options(fault_proxy.endpoint))
    with pytest.raises(DatasetError, match=rf"^s3://{s3_bucket}/mnay: no such dataset directory$"):
        Dataset(f"s3://{s3_bucket}/mnay", **opts)
    with pytest.raises(DatasetError, match=rf"^s3://{s3_bucket}/many: not a fastio dataset \(no manifest.json"):
        Dataset(f"s3://{s3_bucket}/many", **opts)
    assert fault_proxy.counts["forbid"] >= 2, fault_proxy.counts
