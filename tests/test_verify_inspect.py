"""`fastio verify` finds each kind of damage, naming shard and key; `fastio inspect` describes a dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_image_dataset
from PIL import Image

from fastio.cli import main
from fastio.convert import ConvertConfig, convert
from fastio.errors import DatasetError
from fastio.manifest import MANIFEST_NAME
from fastio.verify import inspect, verify


def cli(args: list[str]) -> int:
    """The real ``fastio`` entry point in-process; its exit status."""
    try:
        return main(args)
    except SystemExit as exit_:
        return exit_.code


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_clean_dataset_verifies(image_dataset, capsys):
    report = verify(image_dataset, decode=True)
    assert report.ok and (report.shards, report.samples, report.decoded) == (3, 48, 48)
    assert cli(["verify", str(image_dataset), "--decode"]) == 0
    out, err = capsys.readouterr()
    assert out == f"ok: {image_dataset}: 3 shards, 48 samples verified, 48 images decoded\n" and err == ""


def test_flipped_byte_is_reported_with_shard(image_dataset, capsys):
    shard = image_dataset / "shards" / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = [p.line() for p in verify(image_dataset).problems]
    assert problems == ["shard-000001.tar: sha256 does not match the manifest"]
    assert cli(["verify", str(image_dataset)]) == 1
    out, err = capsys.readouterr()
    assert lines(out) == problems
    assert lines(err) == [f"fastio: verify: 1 problem(s) in {image_dataset}"]


def test_missing_shard_and_damaged_index(image_dataset):
    (image_dataset / "shards" / "shard-000000.tar").unlink()
    idx = image_dataset / "shards" / "shard-000002.idx"
    idx.write_text(idx.read_text().replace(" 512 ", " 1024 ", 1))
    problems = [p.line() for p in verify(image_dataset).problems]
    assert problems[0] == "shard-000000.tar: shard file is missing"
    assert "shard-000002.tar: index shard-000002.idx sha256 does not match the manifest" in problems
    assert any(p.startswith("shard-000002.tar: ") and "index entry 0 does not match the tar" in p for p in problems)


def test_sample_count_mismatch(image_dataset):
    manifest = json.loads((image_dataset / MANIFEST_NAME).read_text())
    manifest["shards"][2]["samples"] = 17
    manifest["total_samples"] = 49
    (image_dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert [p.line() for p in verify(image_dataset).problems] == [
        "shard-000002.tar: holds 16 samples, manifest says 17"]


def test_truncated_tar(image_dataset):
    shard = image_dataset / "shards" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    problems = [p.line() for p in verify(image_dataset).problems]
    assert problems[0].startswith("shard-000000.tar: size 5000 bytes, manifest says")
    assert "shard-000000.tar: sha256 does not match the manifest" in problems
    assert any("tar does not parse" in p or "holds" in p for p in problems)


def test_decode_names_the_key_of_a_bad_image(tmp_path, image_folder, capsys):
    bad = image_folder / "square" / "square_0002.jpg"
    bad.write_bytes(bad.read_bytes()[:400])  # a shard writer does not decode: the dataset is consistent
    dest = write_image_dataset(tmp_path / "ds", image_folder)
    assert verify(dest).ok
    problems = [p.line() for p in verify(dest, decode=True).problems]
    assert len(problems) == 1
    assert problems[0].startswith("shard-000001.tar: square/square_0002: field jpg: ")
    assert cli(["verify", str(dest), "--decode"]) == 1
    assert lines(capsys.readouterr().out) == problems


def test_verify_on_a_non_dataset_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DatasetError, match="not a fastio dataset"):
        verify(tmp_path / "nothing")
    assert cli(["verify", str(tmp_path / "nothing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and lines(err) == [(f"fastio: error: {tmp_path / 'nothing'}: not a fastio dataset "
                                          "(no manifest.json; an interrupted conversion?)")]


def test_inspect_counts_classes_and_sizes(image_dataset, image_folder):
    info = inspect(image_dataset)
    sizes = [Image.open(p).size for p in sorted(image_folder.rglob("*.jpg"))]
    assert (info["samples"], info["shards"]) == (48, 3)
    assert info["bytes"] == sum(p.stat().st_size for p in (image_dataset / "shards").glob("*.tar"))
    assert info["fields"] == {"cls": 48, "jpg": 48}
    assert info["classes"] == [{"label": i, "name": n, "count": 12}
                               for i, n in enumerate(["circle", "hstripes", "square", "vstripes"])]
    img = info["image_sizes"]
    assert img["probed"] == 48 and img["unreadable"] == 0
    assert img["width"]["min"] == min(w for w, _ in sizes) and img["height"]["max"] == max(h for _, h in sizes)
    assert inspect(image_dataset, max_images=5)["image_sizes"]["probed"] == 5


def test_inspect_cli_text_and_json(image_dataset, capsys):
    assert cli(["inspect", str(image_dataset), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == 48 and info["fingerprint"] == inspect(image_dataset)["fingerprint"]
    assert cli(["inspect", str(image_dataset)]) == 0
    out = capsys.readouterr().out
    assert "samples:  48 in 3 shards" in out and "hstripes" in out and "width   min" in out


def test_split_dest_verifies_and_inspects(tmp_path, image_folder, capsys):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, split="val=0.25"))
    report = verify(dest)
    assert report.ok and report.samples == 48
    info = inspect(dest)
    assert {n: s["samples"] for n, s in info["splits"].items()} == {"train": 36, "val": 12}
    (dest / "val" / "shards" / "shard-000000.tar").unlink()
    assert [p.line() for p in verify(dest).problems] == ["val/shard-000000.tar: shard file is missing"]


def test_inspect_skipped_and_source(tmp_path, image_folder):
    (image_folder / "circle" / "circle_0001.jpg").write_bytes(b"junk")
    info = inspect(convert(ConvertConfig(source=image_folder, dest=tmp_path / "d", workers=1)).dest)
    assert info["skipped"] == 1 and info["samples"] == 47
    assert info["source"]["format"] == "imagefolder" and Path(info["source"]["path"]) == image_folder.resolve()


def test_inspect_order_rates_each_shuffle_mode(image_dataset, capsys):
    assert main(["inspect", str(image_dataset), "--order", "--batch-size", "4", "--json"]) == 0
    order = {q["mode"]: q for q in json.loads(capsys.readouterr().out)["order"]}
    assert set(order) == {"global", "block", "none"}
    # The fixture is stored class by class (12 each): unshuffled batches of 4 hold one class.
    assert order["none"]["class_mixing"] == 1.0 and order["none"]["mean_displacement"] == 0.0
    assert order["global"]["class_mixing_ratio"] > 0.8
    assert main(["inspect", str(image_dataset), "--order", "--batch-size", "8"]) == 0
    assert "order:    global batch 8" in capsys.readouterr().out
