"""An image-text conversion reading images at ``s3://`` URLs, and its JSONL at one, from a real S3 server (moto) on
loopback: stored byte for byte as the same images on disk are, checked in the worker processes, refused or skipped
naming the line and the URL (docs/image-text.md)."""

from __future__ import annotations

import filecmp
import json
import os
import socket
from pathlib import Path

import pytest

from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError
from fastio.storage import open_storage
from tests.helpers import run_cli
from tests.tokens_helpers import image_text_source


@pytest.fixture
def vlm(tmp_path, aws_env, s3_bucket):
    """``image_text_source`` under ``local/`` with its images also under ``s3://BUCKET/vlm/img/`` and its JSONL at
    ``s3://BUCKET/vlm/vlm.jsonl``; ``remote.jsonl`` (in tmp_path) names each image by URL but line 2's, which is
    a path relative to tmp_path. The endpoint and credentials come from the environment (``aws_env``)."""
    (tmp_path / "local").mkdir()
    src = image_text_source(tmp_path / "local", n=12)
    store = open_storage(f"s3://{s3_bucket}/vlm")
    for path in sorted((tmp_path / "local" / "img").iterdir()):
        store.put_file(f"img/{path.name}", path)
    store.put_file("vlm.jsonl", src["source"])
    rows = [{**r, "images": [f"local/{p}" if i == 1 else f"s3://{s3_bucket}/vlm/{p}" for p in r["images"]]}
            for i, r in enumerate(src["rows"])]
    (tmp_path / "remote.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {**src, "remote": tmp_path / "remote.jsonl", "bucket": s3_bucket, "store": store}


def _convert(vlm: dict, source, dest: Path, **config):
    options = ImageTextOptions(vlm["tokenizer"], vlm["config"])
    return convert_image_text(ConvertConfig(source, dest, **{"workers": 1, **config}), options)


def _same_files(a: Path, b: Path, under: str) -> bool:
    names = sorted(p.name for p in (a / under).iterdir())
    return names == sorted(p.name for p in (b / under).iterdir()) and all(
        filecmp.cmp(a / under / n, b / under / n, shallow=False) for n in names)


@pytest.mark.parametrize("max_side", [None, 8])
def test_images_at_s3_urls_are_stored_as_the_same_images_on_disk(tmp_path, vlm, max_side):
    _convert(vlm, vlm["source"], tmp_path / "local-ds", max_samples_per_shard=5, max_side=max_side)
    result = _convert(vlm, vlm["remote"], tmp_path / "ds", max_samples_per_shard=5, max_side=max_side, workers=2)
    assert result.samples == 12 and result.skipped == []
    assert _same_files(tmp_path / "local-ds", tmp_path / "ds", "shards")  # the same members, byte for byte
    assert filecmp.cmp(tmp_path / "local-ds" / "samples.fxi", tmp_path / "ds" / "samples.fxi", shallow=False)


def test_a_jsonl_at_an_s3_url_reads_its_images_beside_it_whole_or_in_parts(tmp_path, vlm, capsys, monkeypatch):
    _convert(vlm, vlm["source"], tmp_path / "local-ds", max_samples_per_shard=4)
    url = f"s3://{vlm['bucket']}/vlm/vlm.jsonl"
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the endpoint only on the command line: the workers get it too
    flags = ["--tokenizer", str(vlm["tokenizer"]), "--chat-template", str(vlm["config"]), "--image-field", "images",
             "--max-samples-per-shard", "4", "--endpoint-url", endpoint, "-q"]
    code, _, err = run_cli(["convert", url, str(tmp_path / "ds"), *flags, "--workers", "2"], capsys)
    assert code == 0, err
    assert _same_files(tmp_path / "local-ds", tmp_path / "ds", "shards")
    assert load_manifest(tmp_path / "ds").converted_from["path"] == url
    for k in range(2):
        code, _, err = run_cli(["convert", url, str(tmp_path / "parts"), *flags, "--part", f"{k}/2", "--workers", "1"],
                               capsys)
        assert code == 0, err
    assert run_cli(["merge", str(tmp_path / "parts")], capsys)[0] == 0
    assert _same_files(tmp_path / "ds", tmp_path / "parts", "shards")
    assert (tmp_path / "ds" / "manifest.json").read_bytes() == (tmp_path / "parts" / "manifest.json").read_bytes()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_object_or_an_unreachable_store_is_refused_naming_the_line_and_the_url(tmp_path, vlm):
    """A missing object skips its line (listed naming the line and the URL), or stops the run with on_error='fail',
    as a missing local file does; a store that does not answer stops the run."""
    bucket, store = vlm["bucket"], vlm["store"]
    store.delete("img/s2-1.jpg")
    with pytest.raises(ConvertError, match=rf"^remote\.jsonl:3 \(s3://{bucket}/vlm/img/s2-1\.jpg\): images\[1\]: no "
                                           r"such image \(on_error='fail'\)$"):
        _convert(vlm, vlm["remote"], tmp_path / "ds", on_error="fail")
    result = _convert(vlm, vlm["remote"], tmp_path / "skipped")
    assert [(s["path"], s["reason"]) for s in result.skipped] == [
        (f"remote.jsonl:3 (s3://{bucket}/vlm/img/s2-1.jpg)", "images[1]: no such image")]
    assert result.samples == len(vlm["rows"]) - 1
    down = {"endpoint": f"http://127.0.0.1:{_closed_port()}", "retries": 0}
    with pytest.raises(ConvertError, match=rf"^remote\.jsonl:3: images\[0\]: s3://{bucket}/vlm/img/s2-0\.png: HEAD "
                                           "failed") as err:
        _convert(vlm, vlm["remote"], tmp_path / "ds", storage_options=down)
    assert "\n" not in str(err.value)
    with pytest.raises(ConvertError, match=rf"^s3://{bucket}/vlm/nothing\.jsonl: no such object"):
        _convert(vlm, f"s3://{bucket}/vlm/nothing.jsonl", tmp_path / "ds")
    rows = [dict(r) for r in vlm["rows"]]
    rows[1]["images"] = ["../elsewhere.png"]
    store.put_bytes("vlm.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    with pytest.raises(ConvertError, match=rf"^vlm\.jsonl:2: images\[0\]: \.\./elsewhere\.png resolves outside "
                                           rf"s3://{bucket}/vlm"):
        _convert(vlm, f"s3://{bucket}/vlm/vlm.jsonl", tmp_path / "ds")
    rows[1]["images"] = [(tmp_path / "local" / "img" / "s1-0.png").as_uri()]  # a local file: not under its prefix
    store.put_bytes("vlm.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:2: images\[0\]: file:///\S+: a JSONL at a URL names its "
                                           r"images by s3:// URLs or by paths under its prefix$"):
        _convert(vlm, f"s3://{bucket}/vlm/vlm.jsonl", tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_an_s3_image_that_does_not_decode_skips_its_sample_naming_the_line_and_the_url(tmp_path, vlm, capsys):
    bucket = vlm["bucket"]
    vlm["store"].put_bytes("img/s2-1.jpg", b"\x89PNG\r\n\x1a\n not an image")
    result = _convert(vlm, vlm["remote"], tmp_path / "ds", workers=2)
    assert result.samples == 11
    assert [s["path"] for s in result.skipped] == [f"remote.jsonl:3 (s3://{bucket}/vlm/img/s2-1.jpg)"]
    assert load_manifest(tmp_path / "ds").skipped == result.skipped
    code, _, err = run_cli(["convert", str(vlm["remote"]), str(tmp_path / "ds2"), "--tokenizer", str(vlm["tokenizer"]),
                            "--chat-template", str(vlm["config"]), "--image-field", "images", "--on-error", "fail",
                            "--workers", "1"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fastio: error: remote.jsonl:3 (s3://{bucket}/vlm/img/s2-1.jpg): ") and "--on-error fail" in err


def test_an_image_folder_at_an_s3_url_is_refused_in_one_line(tmp_path, vlm, capsys):
    url = f"s3://{vlm['bucket']}/vlm/img/"
    code, _, err = run_cli(["convert", url, str(tmp_path / "ds")], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"fastio: error: {url.rstrip('/')}"), err
    assert "--tokenizer" in err and "--image-field" in err
    assert not (tmp_path / "ds").exists()


def test_an_object_gone_after_the_scan_leaves_its_sample_unreadable_naming_its_url(vlm):
    from fastio.convert.run import load_entry
    from fastio.converters.base import Entry, UrlRef

    url = f"s3://{vlm['bucket']}/vlm/img/s1-0.png"
    entry = Entry("00000001", (("0.png", UrlRef(url, 10)),), origin="remote.jsonl:2", sample="remote.jsonl:2")
    fields, _, _ = load_entry(entry)
    assert fields["0.png"] == (Path(vlm["source"]).parent / "img" / "s1-0.png").read_bytes()
    vlm["store"].delete("img/s1-0.png")
    fields, reason, where = load_entry(entry)
    assert fields is None and where == url and reason.startswith("unreadable object (GET failed"), reason
    assert "\n" not in reason and url not in reason


def test_parts_cut_by_bytes_predict_their_shards_from_the_objects_sizes_so_the_merge_links_them(tmp_path, vlm):
    import io

    import numpy as np
    from PIL import Image

    from fastio.convert.merge import merge

    noise = np.random.default_rng(0)
    for obj in vlm["store"].list("img/"):  # noisy images of a few kB: their sizes decide where shards are cut
        out = io.BytesIO()
        Image.fromarray(noise.integers(0, 256, (30, 40, 3), np.uint8)).save(
            out, "JPEG" if obj.key.endswith(".jpg") else "PNG")
        vlm["store"].put_bytes(obj.key, out.getvalue())
    _convert(vlm, vlm["remote"], tmp_path / "whole", shard_size=34000)
    for k in range(3):
        _convert(vlm, vlm["remote"], tmp_path / "parts", shard_size=34000, part=(k, 3))
    result = merge(tmp_path / "parts")
    assert result.repacked == 0 and result.linked == len(load_manifest(tmp_path / "whole").shards) > 3
    assert _same_files(tmp_path / "whole", tmp_path / "parts", "shards")
