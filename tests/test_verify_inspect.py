"""`fastio verify` finds each kind of damage, naming shard and key; `fastio inspect` describes a dataset;
a manifest or split list that breaks the schema is one line naming the file and field, from every entry point."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image_dataset
from PIL import Image

from fastio.cli import main
from fastio.convert.run import ConvertConfig, convert
from fastio.dataset.dataset import Dataset
from fastio.dataset.manifest import MANIFEST_NAME, MARKER_NAME, SPLITS_NAME
from fastio.errors import DatasetError
from fastio.report.inspect import inspect, order_quality
from fastio.report.verify import verify


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
    assert problems == ["shard-000001.tar: sha256 does not match the manifest",
                        "shard-000001.tar: xxh3_128 does not match the manifest"]
    assert cli(["verify", str(image_dataset)]) == 1
    out, err = capsys.readouterr()
    assert lines(out) == problems
    assert lines(err) == [f"fastio: verify: 2 problems in {image_dataset}"]


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
    (tmp_path / "nothing" / "notes.txt").write_text("no dataset here")  # an empty folder is named as one
    with pytest.raises(DatasetError, match="not a fastio dataset"):
        verify(tmp_path / "nothing")
    assert cli(["verify", str(tmp_path / "nothing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and lines(err) == [(f"fastio: error: {tmp_path / 'nothing'}: not a fastio dataset "
                                          "(no manifest.json; an interrupted conversion?)")]


def test_an_unfinished_conversion_is_named_so_not_offered_to_fastio_index(tmp_path, capsys):
    """What a killed convert leaves (its marker, some shards, no manifest) is said to be an unfinished conversion
    to run again: making the shards written so far a dataset (`fastio index`) would publish part of the source."""
    dest = tmp_path / "killed"
    (dest / "shards").mkdir(parents=True)
    (dest / MARKER_NAME).write_text("fastio convert output; complete once manifest.json exists\n")
    (dest / "shards" / "shard-000000.tar").write_bytes(b"\0" * 1024)
    assert cli(["verify", str(dest)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and lines(err) == [f"fastio: error: {dest}: an unfinished fastio convert (killed or stopped: "
                                        f"{MARKER_NAME} without {MANIFEST_NAME}), not a dataset; run the same "
                                        "fastio convert again to finish it"]


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
    assert "samples:  48 samples in 3 shards" in out and "hstripes" in out and "width (px)         min" in out


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


def test_inspect_order_on_a_split_dest(tmp_path, image_folder, capsys):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, split="val=0.25"))
    assert main(["inspect", str(dest), "--order", "--batch-size", "8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for name, samples in (("train", 36), ("val", 12)):
        order = {q["mode"]: q for q in info["splits"][name]["order"]}
        assert set(order) == {"global", "block", "none"}
        assert {q["samples"] for q in order.values()} == {samples} and order["none"]["mean_displacement"] == 0.0
        # the same statistics as for that split opened on its own
        assert info["splits"][name]["order"] == inspect(dest / name, order=True, batch_size=8)["order"]
    assert main(["inspect", str(dest), "--order", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("order:    global batch 8") == 2 and out.index("[val]") < out.rindex("order:    none")


def test_order_quality_global_is_near_ideal_and_none_is_not():
    labels = np.repeat(np.arange(8), 100)  # stored sorted by class, like an image folder
    sizes = [100] * 8
    g = order_quality(sizes, labels, seed=0, mode="global", batch_size=32)
    n = order_quality(sizes, labels, seed=0, mode="none", batch_size=32)
    assert g["class_mixing_ratio"] > 0.95
    assert n["class_mixing_ratio"] < 0.3 and n["mean_displacement"] == 0.0
    assert abs(g["mean_displacement"] - g["mean_displacement_ideal"]) < 0.05
    with pytest.raises(ValueError, match="labels has 799 entries"):
        order_quality(sizes, labels[:-1])


def test_inspect_order_uses_the_dataset_labels_and_fingerprint(image_dataset):
    ds = Dataset(image_dataset)
    labels = np.array([int(k.split("/")[0] == "hstripes") + 2 * int(k.split("/")[0] == "square")
                       + 3 * int(k.split("/")[0] == "vstripes") for k in ds.table.keys])
    want = order_quality([s.samples for s in ds.shards], labels, seed=3, epoch=1, mode="global", batch_size=8,
                         fingerprint=ds.fingerprint)
    got = {q["mode"]: q for q in inspect(image_dataset, order=True, seed=3, epoch=1, batch_size=8)["order"]}
    assert got["global"] == want and want["classes"] == 4 and want["class_mixing"] > 2


def test_inspect_order_needs_labels(tmp_path):
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(tmp_path / "d") as writer:
        writer.write({"__key__": "a", "txt": b"x"})
    with pytest.raises(DatasetError, match="no label field; order quality needs labels"):
        inspect(tmp_path / "d", order=True)
    assert main(["inspect", str(tmp_path / "d"), "--order"]) == 2


def _edit(path: Path, change) -> None:
    """Apply ``change`` to the JSON in ``path``; a value it returns replaces the whole document."""
    data = json.loads(path.read_text())
    replaced = change(data)
    path.write_text(json.dumps(data if replaced is None else replaced))


# (what the manifest gets, what the one error line must say)
BAD_MANIFESTS = {
    "samples is text": (lambda m: m["shards"][0].update(samples="16"), "shards[0].samples: '16' is not an integer"),
    "shards is a number": (lambda m: m.update(shards=5), "shards: is int 5, not a list"),
    "fields is null": (lambda m: m.update(fields=None), "fields: null is not a list of field names"),
    "negative count": (lambda m: m["shards"][1].update(samples=-1), "shards[1].samples: -1 is negative"),
    "total is text": (lambda m: m.update(total_samples="48"), "total_samples: '48' is not an integer"),
    "bytes is float": (lambda m: m["shards"][2].update(bytes=1.5), "shards[2].bytes: 1.5 is not an integer"),
    "sha256 not hex": (lambda m: m["shards"][0].update(sha256="xyz"), "shards[0].sha256: 'xyz' is not a hex sha256"),
    "idx_sha256 null": (lambda m: m["shards"][0].update(idx_sha256=None), "shards[0].idx_sha256: None is not a hex"),
    "name with slash": (lambda m: m["shards"][0].update(name="../x.tar"), "shards[0].name: '../x.tar' is not a shard"),
    "name with dir": (lambda m: m["shards"][0].update(name="a/b.tar"), "shards[0].name: 'a/b.tar' is not a shard"),
    "shard is a list": (lambda m: m["shards"].__setitem__(0, [1]), "shards[0]: is list [1], not an object"),
    "shard lacks key": (lambda m: m["shards"][0].pop("sha256") and None, "shards[0] lacks sha256"),
    "duplicate shard": (lambda m: m["shards"].__setitem__(1, dict(m["shards"][0])), "shard-000000.tar is listed twice"),
    "version is true": (lambda m: m.update(format_version=True), "format_version True"),
    "label_map values": (lambda m: m.update(label_map={"a": "0"}), "label_map: {'a': '0'} is not an object"),
    "image_field list": (lambda m: m.update(image_field=["jpg"]), "image_field: ['jpg'] is not text"),
    "skipped entries": (lambda m: m.update(skipped=[1]), "skipped: [1] is not a list of {path, reason}"),
    "no shards": (lambda m: m.pop("shards") and None, "manifest lacks field 'shards'"),
    "top level list": (lambda m: [m], "not a fastio manifest"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_bad_manifest_is_one_line_from_every_entry_point(case, image_dataset, capsys):
    change, needle = BAD_MANIFESTS[case]
    path = image_dataset / MANIFEST_NAME
    _edit(path, change)
    with pytest.raises(DatasetError) as err:
        Dataset(image_dataset)
    assert str(err.value).startswith(f"{path}: ") and needle in str(err.value)
    for command in (["verify"], ["inspect"], ["inspect", "--order"]):
        assert cli([*command, str(image_dataset)]) == 2
        out, errs = capsys.readouterr()
        assert out == "" and lines(errs) == [f"fastio: error: {err.value}"], (command, errs)


BAD_SPLITS = {
    "splits is a list": (lambda s: s.update(splits=["train"]), "splits: is list ['train']"),
    "a string": (lambda s: "{", "not a fastio split list"),
    "name escapes": (lambda s: s["splits"].update({"../x": s["splits"]["val"]}), "'../x' is not a split name"),
    "samples is text": (lambda s: s["splits"]["val"].update(samples="12"), "splits.val.samples: '12' is not an integer"),
    "bad fingerprint": (lambda s: s["splits"]["val"].update(fingerprint=7), "splits.val.fingerprint: 7 is not 16 hex"),
    "wrong format": (lambda s: s.update(format="other"), "not a fastio split list"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPLITS))
def test_bad_split_list_is_one_line(case, tmp_path, image_folder, capsys):
    dest = tmp_path / "d"
    convert(ConvertConfig(source=image_folder, dest=dest, workers=1, split="val=0.25"))
    change, needle = BAD_SPLITS[case]
    _edit(dest / SPLITS_NAME, change)
    for command in ("verify", "inspect"):
        assert cli([command, str(dest)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(lines(err)) == 1 and err.startswith(f"fastio: error: {dest / SPLITS_NAME}: ")
        assert needle in err, err


def test_shards_record_an_xxh3_that_verify_checks_and_older_manifests_without_it_still_verify(image_dataset):
    import xxhash

    manifest = json.loads((image_dataset / MANIFEST_NAME).read_text())
    for shard in manifest["shards"]:
        data = (image_dataset / "shards" / shard["name"]).read_bytes()
        assert shard["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()
    manifest["shards"][0]["xxh3_128"] = "0" * 32  # the sha256 still matches: only the recorded xxh3 is wrong
    (image_dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert [p.line() for p in verify(image_dataset).problems] == [
        "shard-000000.tar: xxh3_128 does not match the manifest"]
    for shard in manifest["shards"]:
        del shard["xxh3_128"]  # as fastio wrote manifests before it recorded xxh3
    (image_dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert verify(image_dataset).ok and Dataset(image_dataset).shards[0].xxh3_128 is None


@pytest.mark.parametrize("value", ["abc", 7, "0" * 64, "G" * 32])
def test_a_malformed_xxh3_is_one_line_naming_the_field(image_dataset, value):
    manifest = json.loads((image_dataset / MANIFEST_NAME).read_text())
    manifest["shards"][1]["xxh3_128"] = value
    (image_dataset / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"shards\[1\]\.xxh3_128: .* is not a hex xxh3-128"):
        Dataset(image_dataset)


def test_decode_names_a_sample_without_an_image_that_the_image_pipelines_refuse(tmp_path, capsys):
    # Found by review: `fastio verify --decode` said ok for a WebDataset shard with a sample holding no image
    # (an img2dataset shard whose download failed keeps its txt and json), which fastio.ImageTrain refuses at load
    # time ("sample has no image field"): verify now names it as the Loader does.
    from helpers import indexed_tar

    from fastio import ImageTrain
    from fastio.convert.synthetic import photo_jpeg
    from fastio.loader import Loader

    jpeg = photo_jpeg(np.random.default_rng(0), 24, 20)
    folder = indexed_tar(tmp_path / "web", {"s00": {"jpg": jpeg, "cls": b"0"}, "s01": {"txt": b"a cat", "cls": b"1"},
                                            "s02": {"PNG": jpeg, "cls": b"1"}}, capsys)  # jpg or png: an image
    assert verify(folder).ok
    report = verify(folder, decode=True)
    assert [p.line() for p in report.problems] == [
        "0.tar: s01: sample has no image field (jpg, png): an image pipeline (fastio.ImageTrain, ImageEval) "
        "refuses it"] and report.decoded == 2
    assert cli(["verify", str(folder), "--decode"]) == 1
    assert lines(capsys.readouterr().out) == [p.line() for p in report.problems]
    with Loader(folder, batch_size=3, device="cpu", pipeline=ImageTrain(size=16), shuffle="none") as loader:
        with pytest.raises(DatasetError, match=r"key 's01': sample has no image field \(jpg, png\)$"):
            next(iter(loader))


def test_a_sample_holding_a_field_twice_is_named(image_dataset):
    """`a.JPG` beside `a.jpg` (what fastio convert of loose files wrote before it lowercased fields) is one field twice
    to WebDataset, whose reader refuses the sample; verify passed it."""
    shard = image_dataset / "shards" / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    at = 0
    while not data[at:at + 100].rstrip(b"\0").endswith(b".cls"):  # the header of the first sample's label member
        at += 512
    key = data[at:at + 100].rstrip(b"\0")[:-4].decode()
    data[at:at + 100] = data[at:at + 100].replace(b".cls\0", b".JPG\0", 1)
    data[at + 148:at + 156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\0 " % sum(data[at:at + 512])
    shard.write_bytes(bytes(data))
    problems = [p.line() for p in verify(image_dataset).problems]
    assert (f"shard-000001.tar: {key}: field 'jpg' twice (members {key}.JPG and {key}.jpg: fields are suffixes "
            "lowercased, as WebDataset reads them); WebDataset's reader refuses the sample") in problems
