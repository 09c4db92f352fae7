"""``fastio convert vlm.jsonl DEST --tokenizer ... --chat-template ... --image-field images``: image-text
conversations stored as image samples holding their images, token ids and loss mask (docs/image-text.md)."""

from __future__ import annotations

import filecmp
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.merge import merge
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest
from fastio.dataset.sample_table import SampleIndex
from fastio.dataset.shards import ShardWriter
from fastio.errors import ConvertError
from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD, decode_sample, image_number
from fastio.report.verify import verify
from fastio.words import count as _count
from tests.helpers import run_cli
from tests.tokens_helpers import (
    CHATML,
    chat_config,
    hf_ids_and_mask,
    hf_tokenizer,
    image_colour,
    image_text_source,
    stored_image_text,
)


def _convert(src: dict, dest: Path, **config) -> object:
    options = ImageTextOptions(src["tokenizer"], src["config"])
    return convert_image_text(ConvertConfig(src["source"], dest, workers=1, **config), options)


def _images(sample: dict[str, bytes]) -> list[bytes]:
    found = sorted((image_number(f), v) for f, v in sample.items() if image_number(f) is not None)
    return [v for _, v in found]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    src = image_text_source(root)
    result = _convert(src, root / "ds", max_samples_per_shard=5)
    return src, root / "ds", result


def assert_sample_is_its_line(sample: dict[str, bytes], src: dict, hf) -> None:
    """The stored sample (keyed by its line) holds its line's transformers tokens and mask and its images."""
    row = src["rows"][int(sample["__key__"])]
    image_id = hf.convert_tokens_to_ids("<image>")
    ids, mask = decode_sample(sample[TOKENS_FIELD], sample[MASK_FIELD])
    want_ids, want_mask = hf_ids_and_mask(hf, CHATML, row["messages"])
    assert ids.tolist() == want_ids and mask.astype(int).tolist() == want_mask
    assert mask.any() and not mask[ids == image_id].any()
    assert int(np.count_nonzero(ids == image_id)) == len(row["images"])
    assert _images(sample) == [(src["source"].parent / p).read_bytes() for p in row["images"]]


def test_each_sample_holds_transformers_tokens_and_mask_and_its_images_byte_equal(converted):
    src, dest, result = converted
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    image_id = hf.convert_tokens_to_ids("<image>")
    stored = stored_image_text(dest)
    assert len(stored) == len(src["rows"]) == result.samples and result.shards == 3
    assert [s["__key__"] for s in stored] == [f"{i:08d}" for i in range(len(src["rows"]))]
    for sample in stored:
        assert_sample_is_its_line(sample, src, hf)
    options = load_manifest(dest).convert_options["image_text"]
    assert options["image_token"] == "<image>" and options["image_token_id"] == image_id


def test_samples_fxi_gives_each_samples_token_and_image_count_without_reading_a_shard(converted):
    src, dest, _ = converted
    manifest = load_manifest(dest)
    index = SampleIndex.open(dest / "samples.fxi", [s.samples for s in manifest.shards], manifest.fields)
    rows = index.locate(np.arange(len(src["rows"])))
    tokens = rows.sizes[TOKENS_FIELD] // 4
    images = sum((rows.sizes[f] >= 0).astype(int) for f in manifest.fields if image_number(f) is not None)
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    assert tokens.tolist() == [len(hf_ids_and_mask(hf, CHATML, r["messages"])[0]) for r in src["rows"]]
    assert images.tolist() == [len(r["images"]) for r in src["rows"]]


def test_verify_passes_the_dataset_and_names_a_sample_whose_mask_does_not_fit_its_tokens(converted, tmp_path):
    _, dest, _ = converted
    assert verify(dest, decode=True).ok
    png = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(png, "png")
    with ShardWriter(tmp_path / "bad") as writer:
        writer.write({"__key__": "a", "0.png": png.getvalue(), TOKENS_FIELD: bytes(4 * 9), MASK_FIELD: b"\0"})
        writer.write({"__key__": "b", "1.png": png.getvalue(), TOKENS_FIELD: bytes(4), MASK_FIELD: b"\0"})
        writer.close()
    report = verify(tmp_path / "bad")
    assert [(p.key, p.what) for p in report.problems] == [
        ("a", f"{MASK_FIELD} holds 1 byte, not one bit for each of the 9 tokens"),
        ("b", "its images are numbered [1], not 0..0 once each")]


def test_max_side_stores_each_image_downscaled_in_its_own_colour(tmp_path):
    src = image_text_source(tmp_path, n=6, size=(40, 30))
    _convert(src, tmp_path / "ds", max_side=16)
    for i, sample in enumerate(stored_image_text(tmp_path / "ds")):
        images = _images(sample)
        assert len(images) == i % 4
        for k, data in enumerate(images):
            pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            assert pixels.shape == (12, 16, 3)
            assert np.abs(pixels.astype(int) - image_colour(i, k)).max() <= 3


def test_parts_then_merge_are_byte_equal_to_one_conversion(tmp_path):
    src = image_text_source(tmp_path)
    _convert(src, tmp_path / "whole", max_samples_per_shard=4)
    for k in range(2):
        _convert(src, tmp_path / "merged", max_samples_per_shard=4, part=(k, 2))
    merge(tmp_path / "merged")
    whole, merged = (sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))
                     for d in (tmp_path / "whole", tmp_path / "merged"))
    assert whole == merged and any(p.suffix == ".tar" for p in whole)
    for rel in whole:
        assert filecmp.cmp(tmp_path / "whole" / rel, tmp_path / "merged" / rel, shallow=False), rel


def test_parts_rendered_with_other_special_tokens_are_refused_naming_the_token(tmp_path, capsys):
    """Found by review (as for chat parts, test_chat_convert.py): a part converted with a tokenizer_config.json whose
    bos_token differs, the tokenizer and template the same, merged silently. The manifest's
    convert_options.image_text now records the special tokens the template is rendered with; parts that differ in
    one are refused in one line naming it."""
    src = image_text_source(tmp_path)
    other = tmp_path / "other" / "tokenizer_config.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**json.loads(src["config"].read_text()), "bos_token": "<|im_start|>"}))
    _convert(src, tmp_path / "p", part=(0, 2))
    convert_image_text(ConvertConfig(src["source"], tmp_path / "p", workers=1, part=(1, 2)),
                       ImageTextOptions(src["tokenizer"], other))
    code, _, err = run_cli(["merge", str(tmp_path / "p")], capsys)
    assert code == 2 and err.count("\n") == 1 and "part-1-of-2: " in err, err
    assert "image_text.template_variables.bos_token '<|im_start|>' (part 0: '<s>')" in err, err
    assert not (tmp_path / "p" / "manifest.json").exists()
    for k in range(2):  # part 1 converted before the record: compared without it
        _convert(src, tmp_path / "old", part=(k, 2))
    record = tmp_path / "old" / ".parts" / "part-1-of-2" / "part.json"
    data = json.loads(record.read_text())
    del data["plan"]["convert_options"]["image_text"]["template_variables"]
    record.write_text(json.dumps(data))
    code, _, err = run_cli(["merge", str(tmp_path / "old")], capsys)
    assert code == 0, err


def _rewrite(src: dict, line: int, **changes) -> None:
    rows = [dict(r) for r in src["rows"]]
    rows[line - 1].update(changes)
    src["source"].write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_placeholder_count_unlike_the_image_count_is_refused_naming_the_line(tmp_path):
    src = image_text_source(tmp_path, n=4)
    _rewrite(src, 3, images=src["rows"][2]["images"][:1])
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:3: 1 image in 'images' but 2 '<image>' placeholders"):
        _convert(src, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_an_image_token_in_a_trained_reply_is_in_the_stored_mask_as_transformers_has_it(tmp_path):
    """docs/image-text.md: the stored mask covers an image token only where the template trains the turn holding
    it (here an assistant's reply), as transformers' mask does; the Loader never trains its run
    (tests/test_image_text_load.py)."""
    src = image_text_source(tmp_path, n=2)
    messages = [{"role": "user", "content": "draw it"}, {"role": "assistant", "content": "here <image> it is"}]
    _rewrite(src, 2, images=["img/s1-0.png"], messages=messages)
    _convert(src, tmp_path / "ds")
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    ids, mask = decode_sample(*(stored_image_text(tmp_path / "ds")[1][f] for f in (TOKENS_FIELD, MASK_FIELD)))
    assert (ids.tolist(), mask.astype(int).tolist()) == hf_ids_and_mask(hf, CHATML, messages)
    assert mask[ids == hf.convert_tokens_to_ids("<image>")].tolist() == [True]


def test_the_scan_tokenizes_a_bounded_batch_of_lines_at_a_time(tmp_path, monkeypatch):
    """The scan tokenized the whole JSONL in one batch: every conversation's encoding (ids, offsets, ...: about
    170 bytes a token with a tokenizer ``tokenizers`` encodes) held at once, tens of GB for a LLaVA-sized file
    (665k conversations). It encodes ``_ENCODE_BATCH`` lines at a time (a chat conversion: 256), the same
    samples."""
    from fastio.convert import image_text

    src = image_text_source(tmp_path, n=10)
    options = ImageTextOptions(src["tokenizer"], src["config"])
    whole = image_text.scan_image_text(src["source"], options).entries
    monkeypatch.setattr(image_text, "_ENCODE_BATCH", 3)
    coder, batches = image_text._Coder(options), []
    encode = coder.encoder.encode
    coder.encoder.encode = lambda wheres, messages: (batches.append(len(wheres)), encode(wheres, messages))[1]
    assert image_text.scan_image_text(src["source"], options, coder).entries == whole
    assert batches == [3, 3, 3, 1]


def test_image_tokens_the_template_writes_itself_are_named_as_the_templates(tmp_path):
    """An image token the chat template writes itself (here ChatML's own <|im_end|>, given as --image-token) was
    counted as the messages' placeholders: '0 images in 'images' but 6 '<|im_end|>' placeholders in 'messages'',
    though no message holds one. The line says how many the template wrote."""
    src = image_text_source(tmp_path, n=2)
    options = ImageTextOptions(src["tokenizer"], src["config"], image_token="<|im_end|>")
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:1: 0 images in 'images' but (\d+) '<\|im_end\|>' "
                                           r"placeholders in 'messages' \(\1 of them written by the chat template "
                                           r"\S*tokenizer_config\.json, not in the messages' text\)$"):
        convert_image_text(ConvertConfig(src["source"], tmp_path / "ds", workers=1), options)
    assert not (tmp_path / "ds").exists()


def test_image_tokens_in_messages_the_template_leaves_out_are_named_as_left_out(tmp_path):
    """Found by review: a placeholder in a message the chat template does not render (here a system message, under
    a template that skips them) was refused as '1 image in 'images' but 0 '<image>' placeholders in 'messages'',
    though the messages hold one. The line says how many of the messages' placeholders the template left out."""
    src = image_text_source(tmp_path, n=2)
    skips_system = CHATML.replace("{% for message in messages %}",
                                  "{% for message in messages %}{% if message['role'] != 'system' %}").replace(
                                      "{% endfor %}", "{% endif %}{% endfor %}")
    config = chat_config(tmp_path / "skips_system.json", skips_system)
    messages = [{"role": "system", "content": "<image> look"}, {"role": "user", "content": "what is it"},
                {"role": "assistant", "content": "a square"}]
    _rewrite(src, 2, images=["img/s1-0.png"], messages=messages)
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:2: 1 image in 'images' but 0 '<image>' placeholders in "
                                           r"'messages' \(1 in the messages' text left out by the chat template "
                                           r"\S*skips_system\.json\)$"):
        convert_image_text(ConvertConfig(src["source"], tmp_path / "ds", workers=1),
                           ImageTextOptions(src["tokenizer"], config))
    assert not (tmp_path / "ds").exists()


LLAVA_HF = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
            "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
            "{{ '<image>\\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
            "{% endfor %}{% else %}{% generation %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
            "{% endfor %}{% endgeneration %}{% endif %}{% endfor %}")
"""llava-hf's chat template (with a generation block): it writes the image token for each ``{"type": "image"}``
content part, the messages' text holding none."""


def test_content_parts_whose_image_token_the_template_writes_convert_as_transformers_renders_them(tmp_path):
    src = image_text_source(tmp_path, n=2)
    config = chat_config(tmp_path / "llava_config.json", LLAVA_HF)
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    rows = [{"images": ["img/s1-0.png"], "messages": [
                {"role": "user", "content": [{"type": "image"}, text("What is this?")]},
                {"role": "assistant", "content": [text("A flat colour.")]}]},
            {"images": ["img/s1-0.png", "img/s1-0.png"], "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "image"}, text("Same?")]},
                {"role": "assistant", "content": [text("No.")]}, {"role": "user", "content": [text("Sure?")]},
                {"role": "assistant", "content": [text("Quite.")]}]},
            {"messages": [{"role": "user", "content": [text("hi")]}, {"role": "assistant", "content": [text("yo")]}]}]
    src["source"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert_image_text(ConvertConfig(src["source"], tmp_path / "ds", workers=1),
                       ImageTextOptions(src["tokenizer"], config))
    hf = hf_tokenizer(src["tokenizer"], config)
    stored = stored_image_text(tmp_path / "ds")
    assert len(stored) == 3
    for sample, row in zip(stored, rows):
        ids, mask = decode_sample(sample[TOKENS_FIELD], sample[MASK_FIELD])
        assert (ids.tolist(), mask.astype(int).tolist()) == hf_ids_and_mask(hf, LLAVA_HF, row["messages"])
        assert int(np.count_nonzero(ids == hf.convert_tokens_to_ids("<image>"))) == len(row.get("images", []))
        assert _images(sample) == [(tmp_path / p).read_bytes() for p in row.get("images", [])] and mask.any()


def test_a_samples_key_is_its_line_where_blank_lines_come_before_it(tmp_path):
    """docs/image-text.md: samples are keyed by line (line N: key N - 1, as messages name it ``vlm.jsonl:N``). A
    blank line (which holds no conversation) shifted every later key by one: line 3's sample was 00000001."""
    src = image_text_source(tmp_path, n=3)
    lines = [json.dumps(r) for r in src["rows"]]
    src["source"].write_text(f"{lines[0]}\n\n{lines[1]}\n  \n{lines[2]}\n")
    _convert(src, tmp_path / "ds")
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    stored = stored_image_text(tmp_path / "ds")
    assert [s["__key__"] for s in stored] == ["00000000", "00000002", "00000004"]
    for sample, row in zip(stored, src["rows"]):
        ids, mask = decode_sample(sample[TOKENS_FIELD], sample[MASK_FIELD])
        assert (ids.tolist(), mask.astype(int).tolist()) == hf_ids_and_mask(hf, CHATML, row["messages"])


def _keys(dest: Path) -> list[str]:
    return [s["__key__"] for s in stored_image_text(dest)]


def test_split_writes_each_line_once_into_datasets_of_the_asked_sizes(tmp_path):
    src = image_text_source(tmp_path, n=20)
    result = _convert(src, tmp_path / "ds", split="val=0.25,test=0.1", seed=5, max_samples_per_shard=4)
    assert sorted(result.manifests) == ["test", "train", "val"]
    assert {n: m.total_samples for n, m in result.manifests.items()} == {"train": 13, "val": 5, "test": 2}
    splits = json.loads((tmp_path / "ds" / "splits.json").read_text())["splits"]
    assert {name: s["samples"] for name, s in splits.items()} == {"train": 13, "val": 5, "test": 2}
    keys = {name: _keys(tmp_path / "ds" / name) for name in result.manifests}
    assert all(k == sorted(k) for k in keys.values())  # without --shuffle each split keeps the lines' order
    assert sorted(sum(keys.values(), [])) == [f"{i:08d}" for i in range(20)]  # each line once
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    for name in result.manifests:
        assert verify(tmp_path / "ds" / name, decode=True).ok
        for sample in stored_image_text(tmp_path / "ds" / name):
            assert_sample_is_its_line(sample, src, hf)
    again = _convert(src, tmp_path / "again", split="val=0.25,test=0.1", seed=5)
    assert {n: _keys(tmp_path / "again" / n) for n in again.manifests} == keys  # a pure function of the seed
    other = _convert(src, tmp_path / "other", split="val=0.25,test=0.1", seed=6)
    assert {n: _keys(tmp_path / "other" / n) for n in other.manifests} != keys


def test_shuffle_permutes_the_lines_as_a_pure_function_of_the_seed(tmp_path):
    src = image_text_source(tmp_path, n=16)
    _convert(src, tmp_path / "a", shuffle=True, seed=3, max_samples_per_shard=5)
    _convert(src, tmp_path / "b", shuffle=True, seed=3, max_samples_per_shard=5)
    _convert(src, tmp_path / "c", shuffle=True, seed=4, max_samples_per_shard=5)
    order = _keys(tmp_path / "a")
    assert sorted(order) == [f"{i:08d}" for i in range(16)] and order != sorted(order)  # a permutation
    assert _keys(tmp_path / "c") != order
    shards = sorted((tmp_path / "a" / "shards").iterdir())
    assert [p.name for p in shards] == [p.name for p in sorted((tmp_path / "b" / "shards").iterdir())]
    assert all(filecmp.cmp(p, tmp_path / "b" / "shards" / p.name, shallow=False) for p in shards)
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    for sample in stored_image_text(tmp_path / "a"):
        assert_sample_is_its_line(sample, src, hf)
    assert load_manifest(tmp_path / "a").convert_options["shuffle"] is True


def test_split_and_shuffle_in_parts_then_merge_are_byte_equal_to_one_conversion(tmp_path, capsys):
    src = image_text_source(tmp_path, n=16)
    common = ["--tokenizer", str(src["tokenizer"]), "--chat-template", str(src["config"]), "--image-field", "images",
              "--split", "val=0.25", "--shuffle", "--seed", "9", "--max-samples-per-shard", "3", "--workers", "1",
              "-q"]
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "whole"), *common], capsys)
    assert code == 0, err
    for k in range(3):
        code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "merged"), *common, "--part",
                                f"{k}/3"], capsys)
        assert code == 0, err
    assert run_cli(["merge", str(tmp_path / "merged")], capsys)[0] == 0
    whole, merged = (sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))
                     for d in (tmp_path / "whole", tmp_path / "merged"))
    assert whole == merged and {p.parts[0] for p in whole} == {"train", "val", "splits.json"}
    for rel in whole:
        assert filecmp.cmp(tmp_path / "whole" / rel, tmp_path / "merged" / rel, shallow=False), rel
    assert _keys(tmp_path / "whole" / "train") != sorted(_keys(tmp_path / "whole" / "train"))


def test_root_names_the_folder_the_image_paths_start_from_as_in_a_llava_layout(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    src = image_text_source(tmp_path / "data", n=4)  # data/vlm.jsonl naming img/...
    (tmp_path / "shared").mkdir()
    (tmp_path / "data" / "img").rename(tmp_path / "shared" / "img")  # the images on shared storage,
    (tmp_path / "data" / "img").symlink_to(tmp_path / "shared" / "img")  # linked in beside the JSONL
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:2: images\[0\]: img/s1-0\.png resolves outside "):
        _convert(src, tmp_path / "refused")
    _convert(src, tmp_path / "ds", root=tmp_path / "shared")
    hf = hf_tokenizer(src["tokenizer"], src["config"])
    stored = stored_image_text(tmp_path / "ds")
    assert len(stored) == 4
    for sample in stored:
        assert_sample_is_its_line(sample, src, hf)
    assert load_manifest(tmp_path / "ds").converted_from["options"]["root"] == str((tmp_path / "shared").resolve())
    flags = ["--tokenizer", str(src["tokenizer"]), "--chat-template", str(src["config"]), "--image-field", "images",
             "--workers", "1", "-q"]
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "cli"), *flags, "--root",
                            str(tmp_path / "data")], capsys)  # the link leaves it
    assert code == 2 and err == (f"fastio: error: vlm.jsonl:2: images[0]: img/s1-0.png resolves outside "
                                 f"{tmp_path / 'data'} (to {tmp_path / 'shared' / 'img' / 's1-0.png'})\n"), err
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "cli"), *flags, "--root",
                            str(tmp_path / "none")], capsys)
    assert code == 2 and err == f"fastio: error: --root {tmp_path / 'none'}: no such folder\n", err
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "cli"), *flags, "--root",
                            str(src["source"])], capsys)  # a file there: not called missing
    assert code == 2 and err == f"fastio: error: --root {src['source']}: a file, not a folder\n", err
    assert not (tmp_path / "cli").exists()


def test_a_file_url_names_its_local_image_as_its_path_does(tmp_path):
    src = image_text_source(tmp_path, n=4)
    by_path = _convert(src, tmp_path / "by-path")
    rows = [{**r, "images": [(tmp_path / p).as_uri() for p in r["images"]]} for r in src["rows"]]
    (tmp_path / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _convert(src, tmp_path / "by-url").samples == by_path.samples == 4
    assert stored_image_text(tmp_path / "by-url") == stored_image_text(tmp_path / "by-path")
    rows[1]["images"] = [(tmp_path.parent / "elsewhere.png").as_uri()]
    (tmp_path / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:2: images\[0\]: file:///\S+/elsewhere\.png resolves outside "):
        _convert(src, tmp_path / "outside")


def test_a_missing_image_skips_its_sample_naming_the_line_or_stops_the_run(tmp_path, capsys):
    """Found by review: a conversation whose image file is missing stopped the run even with on_error='skip' (the
    default), unlike a sample whose image does not decode. It is now a rejected sample: skipped, listed naming the
    line and the path, and counted; on_error='fail' stops the run in one line naming the same, DEST untouched."""
    src = image_text_source(tmp_path, n=6)
    (tmp_path / src["rows"][1]["images"][0]).unlink()
    (tmp_path / src["rows"][3]["images"][2]).unlink()
    with pytest.raises(ConvertError) as err:
        _convert(src, tmp_path / "ds", on_error="fail")
    assert str(err.value) == "vlm.jsonl:2 (img/s1-0.png): images[0]: no such image (on_error='fail')"
    assert not (tmp_path / "ds").exists()
    result = _convert(src, tmp_path / "ds")
    assert result.samples == 4 and [(s["path"], s["reason"]) for s in result.skipped] == [
        ("vlm.jsonl:2 (img/s1-0.png)", "images[0]: no such image"),
        ("vlm.jsonl:4 (img/s3-2.png)", "images[2]: no such image")]
    assert "skipped 2" in result.summary() and "vlm.jsonl:4 (img/s3-2.png)" in result.summary()
    assert [s["__key__"] for s in stored_image_text(tmp_path / "ds")] == ["00000000", "00000002", "00000004",
                                                                         "00000005"]
    assert load_manifest(tmp_path / "ds").skipped == result.skipped
    code, out, _ = run_cli(["convert", str(src["source"]), str(tmp_path / "cli"), "--tokenizer", str(src["tokenizer"]),
                            "--chat-template", str(src["config"]), "--image-field", "images", "--workers", "1"], capsys)
    assert code == 0 and "skipped 2" in out and "images[2]: no such image" in out, out
    for path in src["rows"][2]["images"]:  # every line an image of which is missing (a wrong --root, say)
        (tmp_path / path).unlink()
    src["source"].write_text("".join(json.dumps(r) + "\n" for r in src["rows"][1:4]))
    with pytest.raises(ConvertError, match=r"^\S+vlm\.jsonl: every sample was skipped \(e\.g\. vlm\.jsonl:1 "
                                           r"\(img/s1-0\.png\): images\[0\]: no such image\)$"):
        _convert(src, tmp_path / "none")


def test_an_undecodable_image_skips_its_sample_naming_the_line_or_stops_the_run(tmp_path):
    src = image_text_source(tmp_path, n=6)
    (tmp_path / src["rows"][2]["images"][1]).write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    result = _convert(src, tmp_path / "ds")
    assert result.samples == 5 and len(result.skipped) == 1
    assert result.skipped[0]["path"] == "vlm.jsonl:3 (img/s2-1.jpg)"
    assert "skipped 1" in result.summary()
    assert [len(_images(s)) for s in stored_image_text(tmp_path / "ds")] == [0, 1, 3, 0, 1]
    with pytest.raises(ConvertError, match=r"^vlm\.jsonl:3 \(img/s2-1\.jpg\): .*on_error='fail'"):
        _convert(src, tmp_path / "ds2", on_error="fail")


@pytest.mark.parametrize("fmt", ["TGA", "ICO", "PCX"])
def test_an_image_pil_reads_but_the_loaders_decoder_does_not_skips_its_sample_naming_it(tmp_path, fmt):
    src = image_text_source(tmp_path, n=4)
    Image.new("RGB", (16, 16), (200, 60, 20)).save(tmp_path / src["rows"][1]["images"][0], fmt)  # named .png
    result = _convert(src, tmp_path / "ds")
    assert result.samples == 3 and [s["path"] for s in result.skipped] == ["vlm.jsonl:2 (img/s1-0.png)"]
    assert result.skipped[0]["reason"] == (f"a {fmt} image: not a type the Loader decodes (JPEG, PNG, WebP, BMP, GIF "
                                           "or TIFF)")
    with pytest.raises(ConvertError, match=rf"^vlm\.jsonl:2 \(img/s1-0\.png\): a {fmt} image: .*on_error='fail'"):
        _convert(src, tmp_path / "ds2", on_error="fail")
    assert "not a type the Loader decodes" in verify_decoded_problem(tmp_path / "ds", src, 1)


def test_a_zero_byte_image_is_called_empty(tmp_path):
    src = image_text_source(tmp_path, n=4)
    (tmp_path / src["rows"][1]["images"][0]).write_bytes(b"")
    result = _convert(src, tmp_path / "ds")
    assert [(s["path"], s["reason"]) for s in result.skipped] == [
        ("vlm.jsonl:2 (img/s1-0.png)", "an empty file (0 bytes), not an image")]


@pytest.mark.parametrize("mode, value, why", [
    ("LA", (120, 40), "its alpha read as colour): store it as PNG"),
    ("I", 100000, "32-bit integer pixels refused): store it with 8 or 16 bits a pixel")])
def test_a_tiff_the_loaders_decoder_misreads_skips_its_sample_naming_why(tmp_path, mode, value, why):
    src = image_text_source(tmp_path, n=4)
    src["rows"][1]["images"] = ["img/s1-0.tiff"]
    (tmp_path / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in src["rows"]))
    Image.new(mode, (16, 16), value).save(tmp_path / "img" / "s1-0.tiff")
    result = _convert(src, tmp_path / "ds")
    assert result.samples == 3 and [s["path"] for s in result.skipped] == ["vlm.jsonl:2 (img/s1-0.tiff)"]
    assert result.skipped[0]["reason"] == f"a TIFF image of mode {mode}, which the Loader's decoder misreads ({why}"
    src["rows"][1]["images"] = ["img/s1-0.tiff"]
    assert "which the Loader's decoder misreads" in verify_decoded_problem(tmp_path / "ds", src, 1)


def verify_decoded_problem(dest: Path, src: dict, line: int) -> str:
    """What ``fastio verify --decode`` says of line ``line``'s image when it is written into a dataset as it is
    (a dataset converted before convert refused it)."""
    png = (dest.parent / src["rows"][line]["images"][0]).read_bytes()
    with ShardWriter(dest.parent / "old") as writer:
        writer.write({"__key__": "a", "0.png": png, TOKENS_FIELD: bytes(4), MASK_FIELD: b"\0"})
        writer.close()
    return " ".join(p.what for p in verify(dest.parent / "old", decode=True).problems)


def test_an_image_token_the_tokenizer_lacks_is_refused_in_one_line(tmp_path, capsys):
    src = image_text_source(tmp_path, n=2)
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "ds"), "--tokenizer", str(src["tokenizer"]),
                            "--chat-template", str(src["config"]), "--image-field", "images",
                            "--image-token", "<img>"], capsys)
    assert code != 0 and err.count("\n") == 1
    assert err.startswith("fastio: error: ") and "image token '<img>' is not one token of the tokenizer" in err
    assert not (tmp_path / "ds").exists()


def test_an_ordinary_vocabulary_token_as_image_token_is_refused_as_docs_say(tmp_path):
    """docs/image-text.md: the image token must be one of the tokenizer's added tokens. A word of its vocabulary
    that encodes to itself alone ('alpha') was taken: text merges it with its neighbours ('x alpha' is 'Ġalpha',
    'alphaalpha' one 'alpha'), so the placeholders counted were not the ones written."""
    src = image_text_source(tmp_path, n=2)
    options = ImageTextOptions(src["tokenizer"], src["config"], image_token="alpha")
    with pytest.raises(ConvertError, match=r"tokenizer\.json: image token 'alpha' is an ordinary token of the "
                                           r"tokenizer's vocabulary, not one of its added tokens"):
        convert_image_text(ConvertConfig(src["source"], tmp_path / "ds", workers=1), options)
    assert not (tmp_path / "ds").exists()


def test_the_cli_converts_an_image_text_jsonl(tmp_path, capsys):
    src = image_text_source(tmp_path, n=3)
    code, out, err = run_cli(["convert", str(src["source"]), str(tmp_path / "ds"), "--tokenizer",
                              str(src["tokenizer"]), "--chat-template", str(src["config"]), "--image-field", "images",
                              "--image-token", "<image>", "--workers", "1"], capsys)
    assert code == 0, err
    assert "converted 3 samples" in out and [len(_images(s)) for s in stored_image_text(tmp_path / "ds")] == [0, 1, 2]
    ids, masks = zip(*(decode_sample(s[TOKENS_FIELD], s[MASK_FIELD]) for s in stored_image_text(tmp_path / "ds")))
    trained, tokens = int(sum(m.sum() for m in masks)), sum(i.size for i in ids)
    assert 0 < trained < tokens and f"; {trained} tokens trained ({100 * trained / tokens:.1f}%)" in out, out
    info = load_manifest(tmp_path / "ds").image_text
    assert (info.trained_tokens, info.total_tokens) == (trained, tokens)


def test_parts_count_their_trained_tokens_and_older_parts_without_the_count_still_merge(tmp_path):
    """A merge adds the parts' trained tokens; parts converted before the count was recorded merge (the count not
    known) rather than be refused as training nothing."""
    src = image_text_source(tmp_path, n=8)
    whole = _convert(src, tmp_path / "whole")
    for dest in ("merged", "old"):
        for k in range(2):
            _convert(src, tmp_path / dest, part=(k, 2))
    for manifest in (tmp_path / "old" / ".parts").glob("part-*/manifest.json"):
        data = json.loads(manifest.read_text())
        for key in ("trained_tokens", "total_tokens"):
            del data["image_text"][key]
        manifest.write_text(json.dumps(data))
    assert merge(tmp_path / "merged").samples == merge(tmp_path / "old").samples == 8
    info = load_manifest(tmp_path / "whole").image_text
    assert info.trained_tokens > 0 and whole.manifests[""].image_text == info
    assert load_manifest(tmp_path / "merged").image_text == info
    old = load_manifest(tmp_path / "old").image_text
    assert (old.trained_tokens, old.total_tokens, old.max_id) == (None, None, info.max_id)


def test_conversations_over_max_tokens_with_their_images_expanded_are_refused_or_dropped(tmp_path, capsys):
    """Found by review: an image-text conversion refused --max-tokens and --overlong, so a conversation longer than
    the training sequence was converted and only refused by the Loader, with no way to leave it out. Now a line
    over max_tokens, counting each image as image_seq_len tokens (the Loader's rule), stops the run naming it
    (overlong='refuse', the default) or is left out, listed and counted (overlong='drop'); the others are stored
    as without the limit."""
    src = image_text_source(tmp_path, n=12)
    _convert(src, tmp_path / "whole")
    whole = stored_image_text(tmp_path / "whole")
    lengths = [len(decode_sample(s[TOKENS_FIELD], s[MASK_FIELD])[0]) + 7 * len(_images(s)) for s in whole]
    limit = sorted(lengths)[len(lengths) // 2]
    over = [i for i, n in enumerate(lengths) if n > limit]
    assert 0 < len(over) < len(lengths) and any(len(_images(whole[i])) for i in over)

    def convert(dest, **options):
        return convert_image_text(ConvertConfig(src["source"], dest, workers=1),
                                  ImageTextOptions(src["tokenizer"], src["config"], **options))

    def counted(i):
        images = len(_images(whole[i]))
        return f"{lengths[i]} tokens" + (f" with its {_count(images, 'image')} counted as image_seq_len 8 each"
                                         if images else "")

    with pytest.raises(ConvertError) as err:
        convert(tmp_path / "refused", max_tokens=limit, image_seq_len=8)
    assert str(err.value) == (f"vlm.jsonl:{over[0] + 1}: field 'messages': the conversation has {counted(over[0])}, "
                              f"more than max_tokens={limit} (overlong='drop' handles such conversations)")
    assert not (tmp_path / "refused").exists()
    result = convert(tmp_path / "dropped", max_tokens=limit, image_seq_len=8, overlong="drop")
    kept = [s for i, s in enumerate(whole) if i not in over]
    assert stored_image_text(tmp_path / "dropped") == kept and result.samples == len(kept)
    assert [(s["path"], s["reason"]) for s in result.skipped] == [
        (f"vlm.jsonl:{i + 1}", f"longer than max_tokens={limit}, each image counted as image_seq_len 8 tokens "
                               "(overlong='drop')") for i in over]
    assert f"skipped {len(over)}" in result.summary() and f"\n  {len(over)} inputs (vlm.jsonl:" in result.summary()
    recorded = load_manifest(tmp_path / "dropped").convert_options["image_text"]
    assert (recorded["max_tokens"], recorded["image_seq_len"], recorded["overlong"]) == (limit, 8, "drop")
    code, out, err = run_cli(["convert", str(src["source"]), str(tmp_path / "cli"), "--tokenizer", str(src["tokenizer"]),
                              "--chat-template", str(src["config"]), "--image-field", "images", "--workers", "1",
                              "--max-tokens", str(limit), "--image-seq-len", "8", "--overlong", "drop"], capsys)
    assert code == 0 and f"skipped {len(over)}" in out and stored_image_text(tmp_path / "cli") == kept, err
    for flags, said in [(["--max-tokens", "9"], "--max-tokens needs --image-seq-len N (the tokens each image becomes "
                                                "in the Loader: fastio.ImageText's image_seq_len)"),
                        (["--overlong", "drop"], "--overlong drop needs --max-tokens N (the most tokens a "
                                                 "conversation may have; without it no conversation is over)"),
                        (["--image-seq-len", "8"], "--image-seq-len needs --max-tokens N (it only counts a "
                                                   "conversation's length against it)"),
                        (["--max-tokens", "9", "--image-seq-len", "8", "--overlong", "truncate"],
                         "--overlong must be one of refuse, drop (an image-text conversion never truncates: the "
                         "images of the turns cut would be lost), got 'truncate'")]:
        code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "bad"), "--tokenizer",
                                str(src["tokenizer"]), "--chat-template", str(src["config"]), "--image-field", "images",
                                "--workers", "1", *flags], capsys)
        assert code == 2 and err == f"fastio: error: {said}\n", err
    assert not (tmp_path / "bad").exists()
