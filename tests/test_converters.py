"""Each converter turns its source format into the expected entries (keys, fields, labels, skips)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastio.converters as converters
from fastio.converters.base import FileRef, ScanOptions, unique_key
from fastio.errors import ConvertError


def fields_of(entry) -> dict:
    return dict(entry.fields)


def test_imagefolder_keys_labels_and_skips(image_folder):
    (image_folder / "README.txt").write_text("not a class")
    (image_folder / "circle" / "notes.txt").write_text("not an image")
    assert converters.detect(image_folder) == "imagefolder"
    result = converters.scan(image_folder)
    assert result.label_map == {"circle": 0, "hstripes": 1, "square": 2, "vstripes": 3}
    assert result.image_field == "jpg" and result.label_field == "cls"
    assert len(result.entries) == 48
    first = result.entries[0]
    assert first.key == "circle/circle_0000"
    assert fields_of(first) == {"jpg": FileRef(str(image_folder / "circle" / "circle_0000.jpg")), "cls": b"0"}
    assert fields_of(result.entries[-1])["cls"] == b"3"
    assert [e.key for e in result.entries] == sorted(e.key for e in result.entries)
    assert {(s.path, s.reason.split(" (")[0]) for s in result.skipped} == {
        ("README.txt", "not inside a class folder"), ("circle/notes.txt", "not an image, video or audio file")}
    assert result.description["format"] == "imagefolder"


def test_imagefolder_keys_stay_unique_and_safe(image_folder):
    src = image_folder / "circle"
    (src / "a b.jpg").write_bytes((src / "circle_0000.jpg").read_bytes())
    (src / "a_b.jpg").write_bytes((src / "circle_0001.jpg").read_bytes())
    (src / "a_b.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    keys = [e.key for e in converters.scan(image_folder).entries if e.origin.startswith("circle/a")]
    assert len(keys) == len(set(keys)) == 3
    assert all(k.startswith("circle/a_b") and " " not in k and "." not in k for k in keys)


def test_unique_key_is_deterministic():
    def keys():
        taken: set[str] = set()
        return [unique_key(t, taken) for t in ("x y", "x_y", "x.y", "x y")]

    first = keys()
    assert first == keys()
    assert first[0] == "x_y" and len(set(first)) == 4
    assert all(k.startswith("x_y") and "." not in k for k in first)


def write_csv(folder: Path, files: list[Path], *, header="path,label,caption,score") -> Path:
    lines = [header] + [f"{p.relative_to(folder).as_posix()},{p.parent.name},\"hello, {i}\",{i / 2}"
                        for i, p in enumerate(files)]
    table = folder / "table.csv"
    table.write_text("\n".join(lines) + "\n")
    return table


def test_csv_paths_labels_and_text_columns(image_folder):
    files = sorted(image_folder.rglob("*.jpg"))[::7]
    table = write_csv(image_folder, files)
    assert converters.detect(table) == "csv"
    result = converters.scan(table)
    classes = sorted({p.parent.name for p in files})
    assert result.label_map == {c: i for i, c in enumerate(classes)}
    assert [e.key for e in result.entries] == [f"{p.parent.name}/{p.stem}" for p in files]
    e = fields_of(result.entries[1])
    assert e == {"jpg": FileRef(str(files[1])), "cls": str(classes.index(files[1].parent.name)).encode(),
                 "caption": b"hello, 1", "score": b"0.5"}
    assert result.description["options"] == {"path_column": "path", "label_column": "label"}


def test_jsonl_integer_labels_and_json_values(image_folder):
    files = sorted(image_folder.rglob("*.jpg"))[:4]
    table = image_folder / "meta.jsonl"
    rows = [{"file": f"{p.parent.name}/{p.name}", "label": 7 - i, "meta": {"i": i}, "ok": i % 2 == 0}
            for i, p in enumerate(files)]
    table.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    result = converters.scan(table)
    assert result.label_map is None
    assert [fields_of(e)["cls"] for e in result.entries] == [b"7", b"6", b"5", b"4"]
    assert fields_of(result.entries[2])["meta"] == b'{"i": 2}'
    assert fields_of(result.entries[1])["ok"] == b"false"


def test_table_options_name_columns(image_folder):
    files = sorted(image_folder.rglob("*.jpg"))[:3]
    table = write_csv(image_folder, files, header="where,kind,caption,id")
    with pytest.raises(ConvertError, match=r"table.csv: no path column"):
        converters.scan(table)
    result = converters.scan(table, "csv", ScanOptions(path_column="where", label_column="kind", key_column="id"))
    assert [e.key for e in result.entries] == ["0_0", "0_5", "1_0"]
    with pytest.raises(ConvertError, match=r"no label column 'nope'"):
        converters.scan(table, "csv", ScanOptions(path_column="where", label_column="nope"))


def test_parquet_bytes_columns_become_fields(tmp_path, image_folder):
    files = sorted(image_folder.rglob("*.jpg"))[:5]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({
        "image": [{"bytes": p.read_bytes(), "path": p.name} for p in files],  # Hugging Face layout
        "mask": pa.array([b"\x00\x01"] * 5, pa.binary()),
        "label": [p.parent.name for p in files],
        "text": [f"t{i}" for i in range(5)],
    }), path)
    assert converters.detect(path) == "parquet"
    result = converters.scan(path)
    assert result.image_field == "jpg"
    e = fields_of(result.entries[3])
    assert e == {"jpg": files[3].read_bytes(), "mask": b"\x00\x01", "cls": b"0", "text": b"t3"}
    assert [x.key for x in result.entries] == [p.stem for p in files]  # from the struct's "path"
    pq.write_table(pa.table({"img": [p.read_bytes() for p in files], "n": list(range(5))}), path)
    result = converters.scan(path)
    assert [x.key for x in result.entries] == ["00000000", "00000001", "00000002", "00000003", "00000004"]
    assert fields_of(result.entries[4]) == {"jpg": files[4].read_bytes(), "n": b"4"}


def test_a_parquet_of_image_paths_reads_its_images(tmp_path, image_folder):
    """Found by review: a Parquet of image paths and labels (no bytes column) was converted with its paths as text and
    no image at all, saying nothing (a path column was read only when named). A Parquet without a column of encoded
    files (images, video, audio; other bytes, a mask, may be there) takes
    its path column as CSV does (``path``, ``file``, ``image``, ...) where one of its first 100 paths names a file;
    a column of that name whose values name none (a code dataset's repository paths) stays text."""
    files = sorted(image_folder.rglob("*.jpg"))[:3]
    names = [p.relative_to(image_folder).as_posix() for p in files]
    masks = pa.array([b"\x00", b"\x01", b"\x02", b"\x03"], pa.binary())  # bytes, but of no image: paths still read
    pq.write_table(pa.table({"path": ["gone.jpg", *names], "label": [1, 0, 1, 0], "mask": masks}),
                   image_folder / "t.parquet")
    result = converters.scan(image_folder / "t.parquet")
    assert result.image_field == "jpg" and result.description["options"]["path_column"] == "path"
    assert [fields_of(e) for e in result.entries] == [{"jpg": FileRef(str(p)), "cls": c, "mask": m} for p, c, m in
                                                      zip(files, [b"0", b"1", b"0"], [b"\x01", b"\x02", b"\x03"])]
    assert [(s.path, s.reason) for s in result.skipped] == [
        ("t.parquet:1", "path column 'path' names a missing file: gone.jpg")]  # the first: the column is still paths
    (tmp_path / "meta").mkdir()  # absolute paths outside the table's folder: rows rejected, named, never text
    pq.write_table(pa.table({"path": [str(p) for p in files], "label": [0, 1, 0]}), tmp_path / "meta" / "t.parquet")
    with pytest.raises(ConvertError, match=r"t.parquet:1: path column 'path': .*circle_0000.jpg resolves outside"):
        converters.scan(tmp_path / "meta" / "t.parquet")
    pq.write_table(pa.table({"path": ["a\0b", "src/a.py"], "content": ["x = 1", "y = 2"]}), tmp_path / "c.parquet")
    assert converters.scan(tmp_path / "c.parquet").entries[0].fields == (("content", b"x = 1"), ("path", b"a\0b"))
    pq.write_table(pa.table({"path": ["src/a.py", "lib/b.py"], "content": ["x = 1", "y = 2"]}), tmp_path / "c.parquet")
    result = converters.scan(tmp_path / "c.parquet")
    assert [fields_of(e) for e in result.entries] == [{"path": b"src/a.py", "content": b"x = 1"},
                                                      {"path": b"lib/b.py", "content": b"y = 2"}]
    assert "path_column" not in result.description["options"] and not result.skipped


def test_files_grouped_by_basename(tmp_path, image_folder):
    src = tmp_path / "loose"
    (src / "sub").mkdir(parents=True)
    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    (src / "a.jpg").write_bytes(jpg)
    (src / "a.json").write_text("{}")
    (src / "a.cls").write_text("3")
    (src / "sub" / "b.seg.png").write_bytes(b"png?")
    (src / "sub" / "b.cls").write_text("1")
    (src / "README").write_text("no extension")
    assert converters.detect(src) == "files"
    result = converters.scan(src)
    assert [e.key for e in result.entries] == ["a", "sub/b"]
    assert sorted(fields_of(result.entries[0])) == ["cls", "jpg", "json"]
    assert list(fields_of(result.entries[1])) == ["cls", "seg.png"]
    assert result.label_field == "cls" and result.image_field == "jpg"
    assert [s.path for s in result.skipped] == ["README"]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", r"missing: no such file or directory"),
    (lambda d: (d / "empty").mkdir() or d / "empty", r"empty: source directory is empty"),
    (lambda d: (d / "x.bin").write_bytes(b"1") and d / "x.bin", r"x.bin: cannot tell the format"),
    # found by the newcomer review: one image (video) given as SOURCE was told to give format=NAME, where every
    # format but a table's wants a folder
    (lambda d: (d / "a").mkdir() or (d / "a" / "x.jpg").write_bytes(b"1") and d / "a" / "x.jpg",
     r"^\S+/a/x.jpg: an image file, not a source: give the folder of images that holds it \(\S+/a\), or a table "
     r"naming the files$"),
    (lambda d: (d / "v.mp4").write_bytes(b"1") and d / "v.mp4", r"v.mp4: a video file, not a source: give the folder"),
])
def test_detect_errors_name_the_source(tmp_path, make, message):
    with pytest.raises(ConvertError, match=message):
        converters.scan(make(tmp_path))


def test_unknown_format_is_rejected(image_folder):
    with pytest.raises(ConvertError, match=r"unknown format 'tfrecord'"):
        converters.scan(image_folder, "tfrecord")


@pytest.mark.parametrize("name, body, message", [
    ("t.csv", "path,label\na.jpg,1,extra\n", r"t.csv:2: unreadable table \(expected 2 columns, found 3\)"),
    ("t.csv", "", r"t.csv: unreadable table \(no header row\)"),
    ("t.jsonl", '{"path": "a.jpg"}\n{oops\n', r"t.jsonl:2: unreadable table \(invalid JSON"),
    ("t.jsonl", '[1, 2]\n', r"t.jsonl:1: unreadable table \(a line is a list"),
    ("t.csv", "path\nmissing.jpg\n", r"t.csv:2: path column 'path' names a missing file: missing.jpg"),
])
def test_bad_tables_name_file_and_line(tmp_path, name, body, message):
    (tmp_path / name).write_text(body)
    with pytest.raises(ConvertError, match=message):
        converters.scan(tmp_path / name)


def test_non_utf8_table(tmp_path):
    (tmp_path / "t.csv").write_bytes(b"path\n\xff\xfe.jpg\n")
    with pytest.raises(ConvertError, match=r"t.csv:2: unreadable table \(not UTF-8: invalid start byte at byte 5\)"):
        converters.scan(tmp_path / "t.csv")


def test_corrupt_parquet(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConvertError, match=r"t.parquet: unreadable table"):
        converters.scan(tmp_path / "t.parquet")


def test_files_fields_are_lowercased_suffixes_and_one_per_sample(tmp_path, image_folder):
    """WebDataset reads `a.JPG` as field `jpg` and refuses a sample holding `a.JPG` and `a.jpg` (a field twice): the
    loose files `a.JPG` and `a.jpg` were both packed into sample `a`, a shard webdataset could not read."""
    src = tmp_path / "loose"
    src.mkdir()
    jpgs = sorted(image_folder.rglob("*.jpg"))
    (src / "a.JPG").write_bytes(jpgs[0].read_bytes())
    (src / "a.jpg").write_bytes(jpgs[1].read_bytes())
    (src / "b.PNG.Json").write_text("{}")
    result = converters.scan(src)
    assert [(e.key, sorted(fields_of(e))) for e in result.entries] == [("a", ["jpg"]), ("b", ["png.json"])]
    assert fields_of(result.entries[0])["jpg"].path == str(src / "a.JPG")
    [skip] = result.skipped
    assert (skip.path, skip.error) == ("a.jpg", True)
    assert "field 'jpg' twice" in skip.reason and "a.JPG" in skip.reason


def test_parquet_null_in_an_image_column_is_a_rejected_row(tmp_path, image_folder):
    """A row whose image cell is null (a Hugging Face image struct that is null, or one whose `bytes` is) was packed as
    a sample with a label and no image, which ImageTrain refuses on its batch; an empty cell (b"") was refused. A null
    cell of a column of encoded files is refused the same way, naming the row and the column; in a column of other
    bytes (a mask) a null is an absent field."""
    files = sorted(image_folder.rglob("*.jpg"))[:4]
    path = tmp_path / "hf.parquet"
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({
        "image": pa.array([{"bytes": files[0].read_bytes(), "path": "a.jpg"}, None,
                           {"bytes": None, "path": "c.jpg"}, {"bytes": files[3].read_bytes(), "path": "d.jpg"}], struct),
        "mask": pa.array([b"\x00", b"\x01", b"\x02", None], pa.binary()),
        "label": [0, 1, 2, 3],
    }), path)
    result = converters.scan(path)
    assert [(e.key, sorted(fields_of(e))) for e in result.entries] == [("00000000", ["cls", "jpg", "mask"]),
                                                                      ("00000003", ["cls", "jpg"])]
    assert [(s.path, s.reason, s.error) for s in result.skipped] == [
        ("hf.parquet:2", "column 'image': no value (null), where other rows hold an encoded file (jpg)", True),
        ("hf.parquet:3", "column 'image': an image by path only ('c.jpg'), its bytes not in the table: fastio reads "
                         "the images a Parquet holds, not files it names; embed them, or convert a CSV of the paths", True)]


def test_a_table_path_that_is_no_file_says_what_it_is(tmp_path):
    """A path naming a folder or a FIFO was called `a missing file`, and so was `café.jpg` typed in a table (NFC) for
    the file a Mac wrote (NFD: the same letters on screen), and `ok.jpg ` (a blank after it in a hand-written CSV)
    where `ok.jpg` is there, the blank unseen in the message. Each now says what is there, in the reason of the
    rejected row (skipped and listed, or the run stopped with on_error="fail": test_convert_bad_sources.py)."""
    import unicodedata

    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / unicodedata.normalize("NFD", "café.jpg")).write_bytes(b"x")
    (tmp_path / "ok.jpg").write_bytes(b"x")
    cases = {"sub": "path column 'path' names a folder, not a file: sub",
             "pipe.jpg": "path column 'path' names no regular file (a FIFO, socket or device): pipe.jpg",
             unicodedata.normalize("NFC", "café.jpg"): "path column 'path' names a missing file: café.jpg "
             "(a file whose name differs only in Unicode normalization is there: 'cafe\\u0301.jpg'; rename one)",
             "ok.jpg ": "path column 'path' names a missing file: ok.jpg  (the cell's name has blanks around it, "
             "'ok.jpg ', and a file named without them is there: 'ok.jpg')"}
    for value, message in cases.items():
        (tmp_path / "t.csv").write_text(f"path\nok.jpg\n{value}\n")
        result = converters.scan(tmp_path / "t.csv")
        assert [e.key for e in result.entries] == ["ok"]
        assert [(s.path, s.reason, s.error) for s in result.skipped] == [("t.csv:3", message, True)]


def test_a_folder_already_split_is_not_labelled_by_its_split_names(tmp_path):
    """Found by the newcomer review: `fastio convert images ds` of a dataset already split (images/train/<class>/,
    images/val/<class>/, as ImageNet and most downloads come) converted it as 2 classes, 'train' and 'val': every
    label the split's name, and nothing said. Detected, it is scanned as its splits now, labelled by the class
    folders (one class list for all splits; tests/test_convert.py converts one); format='imagefolder' given still
    labels by the split folders. A file beside the split folders is listed, not dropped unsaid."""
    from fastio.convert.synthetic import make_imagefolder

    make_imagefolder(tmp_path / "images" / "train", classes=3, per_class=2)
    make_imagefolder(tmp_path / "images" / "val", classes=2, per_class=1)
    src = tmp_path / "images"
    (src / "README.txt").write_text("ImageNet-ish")
    scan = converters.scan(src)
    assert scan.label_map == {"circle": 0, "hstripes": 1, "square": 2}
    assert {name: [scan.entries[i].key for i in got] for name, got in scan.splits.items()} == {
        "train": ["circle/circle_0000", "circle/circle_0001", "hstripes/hstripes_0000", "hstripes/hstripes_0001",
                  "square/square_0000", "square/square_0001"],
        "val": ["circle/circle_0000", "hstripes/hstripes_0000"]}
    assert scan.notes == ["val has no 'square'"]
    assert [(s.path, s.reason) for s in scan.skipped] == [("README.txt", "not inside a split folder")]
    assert converters.scan(src, "imagefolder").label_map == {"train": 0, "val": 1}
    assert converters.scan(src, "imagefolder").splits is None


def test_a_stray_image_beside_class_folders_is_not_guessed_away(tmp_path, image_folder):
    """One `preview.jpg` beside the class folders made detection call the whole image folder loose files: every image
    packed with no label, the classes gone, and nothing said. Detection now refuses to guess, naming the file and
    both formats; either format given converts (the image folder lists the stray file as skipped)."""
    import shutil

    src = tmp_path / "stray"
    shutil.copytree(image_folder, src)
    shutil.copy(min(image_folder.rglob("*.jpg")), src / "preview.jpg")
    with pytest.raises(ConvertError) as err:
        converters.scan(src)
    assert str(err.value) == (f"{src}: cannot tell the format: class folders of images, and 1 file beside them "
                              "(preview.jpg) that is an image, video or audio file; give format='imagefolder' (the "
                              "files beside the class folders are skipped and listed) or format='files'")
    as_folder = converters.scan(src, "imagefolder")
    assert as_folder.label_map == converters.scan(image_folder).label_map
    assert [(s.path, s.reason) for s in as_folder.skipped] == [("preview.jpg", "not inside a class folder")]
    assert len(converters.scan(src, "files").entries) == len(as_folder.entries) + 1
    (src / "preview.json").write_text("{}")  # loose files of WebDataset's kind: a sample of several files
    assert converters.detect(src) == "files"


def test_a_table_file_named_without_a_suffix_takes_the_field_of_its_type(tmp_path, image_folder):
    """Images named by a hash or a number with no suffix (`imgs/0001`) were stored as field `file`: the dataset's
    image field is `jpg`, so ImageTrain refused those samples on their batch, and convert never checked them. Such a
    file takes the field of its type by magic number; one of no known type stays `file`."""
    (tmp_path / "imgs").mkdir()
    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    (tmp_path / "imgs" / "0001").write_bytes(jpg)
    (tmp_path / "imgs" / "0002.jpg").write_bytes(jpg)
    (tmp_path / "imgs" / "0003").write_bytes(b"just some text")
    (tmp_path / "t.csv").write_text("path,label\nimgs/0001,0\nimgs/0002.jpg,1\nimgs/0003,1\n")
    result = converters.scan(tmp_path / "t.csv")
    assert [(e.key, sorted(fields_of(e))) for e in result.entries] == [
        ("imgs/0001", ["cls", "jpg"]), ("imgs/0002", ["cls", "jpg"]), ("imgs/0003", ["cls", "file"])]


def test_webdatasets_own_sample_keys_are_not_stored_as_fields(tmp_path, image_folder):
    """A table read from WebDataset shards (a Hugging Face dataset of them has `__key__` and `__url__` columns) put a
    `__url__` field in every sample, and webdataset then refused every shard: `duplicate file name in tar file
    __url__` (it sets `__url__` and `__local_path__` itself). Such columns, WebDataset's, are left out and named in
    the source's options; `__key__` is still the key."""
    (tmp_path / "x.jpg").write_bytes(min(image_folder.rglob("*.jpg")).read_bytes())
    (tmp_path / "t.csv").write_text("path,label,__url__,__local_path__,__key__,note\nx.jpg,1,http://a,/p,k1,hi\n")
    result = converters.scan(tmp_path / "t.csv")
    [entry] = result.entries
    assert entry.key == "k1" and sorted(fields_of(entry)) == ["cls", "jpg", "note"]
    assert result.description["options"]["left_out_columns"] == ["__url__", "__local_path__"]


def test_a_class_folder_without_samples_is_listed_with_its_label(image_folder):
    """An empty class folder, or one holding only hidden files (`__MACOSX/` of a zip made on a Mac, its `._x.jpg`),
    took a label and shifted every later class's, and nothing said so (torchvision's ImageFolder refuses such a
    folder). Its label stays (the rule is the index in sorted class names), and the folder is listed as skipped,
    naming the label that has no samples."""
    (image_folder / "empty").mkdir()
    (image_folder / "__MACOSX").mkdir()
    (image_folder / "__MACOSX" / "._circle_0000.jpg").write_bytes(b"\0\5\x16\7")
    result = converters.scan(image_folder)
    assert result.label_map == {"__MACOSX": 0, "circle": 1, "empty": 2, "hstripes": 3, "square": 4, "vstripes": 5}
    listed = [(s.path, s.reason, s.error) for s in result.skipped]
    assert ("__MACOSX", "a class folder with no image, video or audio file: label 0 has no samples", False) in listed
    assert ("empty", "a class folder with no image, video or audio file: label 2 has no samples", False) in listed


def test_parquet_cells_json_cannot_hold_are_named_or_stored_as_text(tmp_path, image_folder):
    """A column of lists of images (Hugging Face's `Sequence(Image())`, as vision-language datasets hold them), or a
    struct holding bytes, raised a raw `TypeError: Object of type bytes is not JSON serializable`; so did a timestamp
    or a decimal column. Bytes inside a list or struct are refused in one line naming the row and column; a
    timestamp or decimal is stored as its text."""
    import datetime
    import decimal

    jpg = min(image_folder.rglob("*.jpg")).read_bytes()
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    path = tmp_path / "vlm.parquet"
    pq.write_table(pa.table({"images": pa.array([[{"bytes": jpg, "path": "a.jpg"}]], pa.list_(struct)),
                             "label": [0]}), path)
    with pytest.raises(ConvertError) as err:
        converters.scan(path)
    assert str(err.value) == ("vlm.parquet:1: column 'images' holds bytes inside a list or struct (a list of images?), "
                              "which is stored only as a column of bytes of its own; give each image a column")
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"image": [jpg], "ts": pa.array([datetime.datetime(2024, 5, 1, 12)], pa.timestamp("s")),
                             "price": pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)), "label": [0]}), path)
    [entry] = converters.scan(path).entries
    assert fields_of(entry)["ts"] == b"2024-05-01 12:00:00" and fields_of(entry)["price"] == b"1.50"


def test_a_folder_holding_a_table_is_not_guessed_away(tmp_path, image_folder):
    """A folder of Parquet shards (a Hugging Face dataset's `train-00000-of-00002.parquet`) was detected as loose files,
    each table packed whole as one sample; a `labels.csv` beside folders of images was skipped and the folders taken
    as classes. Detection now refuses both, naming the table and what to give instead."""
    import shutil

    shards = tmp_path / "hf"
    shards.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"img": [b"x"], "label": [i]}), shards / f"train-0000{i}-of-00002.parquet")
    with pytest.raises(ConvertError) as err:
        converters.scan(shards)
    assert str(err.value) == (f"{shards}: a folder of tables (train-00000-of-00002.parquet, "
                              "train-00001-of-00002.parquet): give one as SOURCE (a conversion reads one table), or "
                              "format='files' to pack the files as they are")
    assert len(converters.scan(shards, "files").entries) == 2
    labelled = tmp_path / "labelled"
    shutil.copytree(image_folder, labelled)
    (labelled / "labels.csv").write_text("path,label\ncircle/circle_0000.jpg,1\n")
    with pytest.raises(ConvertError) as err:
        converters.scan(labelled)
    assert str(err.value) == (f"{labelled}: cannot tell the format: class folders of images, and a table beside them "
                              f"(labels.csv): give the table as SOURCE ({labelled / 'labels.csv'}) to convert its "
                              "rows, or format='imagefolder' to label images by their folder")
    assert converters.scan(labelled, "imagefolder").label_map == converters.scan(image_folder).label_map


def test_parquet_images_stored_by_path_only_are_refused_naming_the_path(tmp_path, image_folder):
    """A Parquet whose image structs hold a path and no bytes (datasets' `to_parquet` of images loaded from files)
    made samples with a label and no image, silently when no row had bytes. Each such row is refused, naming the path
    and why: fastio reads the images a Parquet holds, not files it names."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    path = tmp_path / "by_path.parquet"
    pq.write_table(pa.table({"image": pa.array([{"bytes": None, "path": "/data/a.jpg"}] * 2, struct),
                             "label": [0, 1]}), path)
    with pytest.raises(ConvertError) as err:
        converters.scan(path)
    assert str(err.value) == (f"{path}: no samples found as parquet (2 files left out, e.g. by_path.parquet:1: column "
                              "'image': an image by path only ('/data/a.jpg'), its bytes not in the table: fastio "
                              "reads the images a Parquet holds, not files it names; embed them, or convert a CSV of "
                              "the paths)")


def test_a_split_folder_of_images_without_class_folders_is_not_labelled_by_its_split_name(tmp_path, capsys):
    """ImageNet's raw download has train/<class>/ but val/ holding its 50,000 images flat (their classes in a
    separate file); some have an empty test/. Such a folder was not seen as already split (val holds no class
    folder), so detection read it as one image folder with classes 'test', 'train' and 'val': every label a split's
    name, and nothing said. It is refused now, naming each split that is no split of class folders and why;
    format='imagefolder' still labels by the folders."""
    from fastio.cli import main
    from fastio.convert.synthetic import make_imagefolder

    src = tmp_path / "images"
    make_imagefolder(src / "train", classes=2, per_class=2)
    make_imagefolder(tmp_path / "flat", classes=1, per_class=2)
    (src / "val").mkdir()
    for image in (tmp_path / "flat" / "circle").iterdir():
        image.rename(src / "val" / image.name)
    (src / "test").mkdir()  # and an empty test/, as some downloads have
    said = (f"{src}: already split (test, train, val), but test holds no class folder of images, val holds images "
            "outside class folders: labelled by these folders, every label would be a split's name; convert the "
            "splits of class folders (the others moved aside), those of loose images as loose files (format='files') "
            "or from a table naming their labels, or give format='imagefolder' to label by the split folders")
    with pytest.raises(ConvertError) as err:
        converters.scan(src)
    assert str(err.value) == said
    assert main(["convert", str(src), str(tmp_path / "ds")]) == 2
    told = said.replace("format='files'", "--format files").replace("format='imagefolder'", "--format imagefolder")
    assert capsys.readouterr().err == f"fastio: error: {told}\n"
    assert converters.scan(src, "imagefolder").label_map == {"test": 0, "train": 1, "val": 2}
