"""Bad image-text input a user writes by mistake, refused in one line naming the line and field before DEST is
touched (never a traceback from ``tokenizers``, never a flag's empty value silently replaced by its default): a JSON
``\\ud800`` escape in a message, a folder named as an image, an empty ``--image-token``, a missing messages field;
a byte that is not UTF-8 deep in the JSONL (named by its line and file offset: the offset was the text reader's
chunk's); and a Loader state whose ``image_text`` entry is not a record (a LoaderStateError, not an
AttributeError)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_cli
from tokens_helpers import SHAREGPT_ROLES, image_text_dataset, image_text_source, stored_image_text, train_tokenizer

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError, LoaderStateError
from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD, decode_sample


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return image_text_source(tmp_path_factory.mktemp("vlmbad"), n=3)


def _with_line(src: dict, line: dict | str) -> None:
    """``src``'s JSONL: its first two lines, then ``line`` (line 3)."""
    rows = "".join(json.dumps(r) + "\n" for r in src["rows"][:2])
    src["source"].write_text(rows + (line if isinstance(line, str) else json.dumps(line)) + "\n")


def _convert(src: dict, dest, **options) -> None:
    convert_image_text(ConvertConfig(src["source"], dest, workers=1),
                       ImageTextOptions(src["tokenizer"], src["config"], **options))


def test_a_lone_surrogate_escape_in_a_message_is_named_by_line_and_field(source, tmp_path):
    _with_line(source, '{"images": [], "messages": [{"role": "user", "content": "a \\ud800"}, '
                       '{"role": "assistant", "content": "b"}]}')
    with pytest.raises(ConvertError, match=r"vlm.jsonl:3: field 'messages' holds '\\ud800', half of a UTF-16"):
        _convert(source, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_folder_named_as_an_image_is_called_a_folder(source, tmp_path):
    (source["source"].parent / "img" / "dir.png").mkdir(exist_ok=True)
    _with_line(source, {"images": ["img/dir.png"], "messages": [{"role": "user", "content": "<image> a"},
                                                                {"role": "assistant", "content": "b"}]})
    with pytest.raises(ConvertError, match=r"^vlm.jsonl:3: images\[0\]: img/dir.png is a folder, not an image$"):
        _convert(source, tmp_path / "d")


@pytest.mark.parametrize("images,what", [
    ("img/s1-0.png", r"field 'images' is str, not a list of image paths \(one image is a list of one: "
                     r"\[\"img/s1-0.png\"\]\)"),
    (None, "field 'images' is null, not a list of image paths"),
    ({"0": "img/s1-0.png"}, "field 'images' is dict, not a list of image paths"),
    (["img/s1-0.png", None], r"images\[1\] is null, not an image path"),
    (["img/s1-0.png", ""], r"images\[1\] is an empty string, not an image path"),
    ([3], r"images\[0\] is int, not an image path")], ids=["str", "null", "dict", "null-item", "empty", "int"])
def test_an_images_field_that_is_not_a_list_of_paths_is_named_with_what_it_is(source, tmp_path, images, what):
    """LLaVA's own JSON holds one image as a string (``"image": "x.jpg"``): the line says what the field (or which
    item) is, not only that it is wrong."""
    _with_line(source, {"images": images, "messages": [{"role": "user", "content": "<image> a"},
                                                       {"role": "assistant", "content": "b"}]})
    with pytest.raises(ConvertError, match=rf"^vlm.jsonl:3: {what}$"):
        _convert(source, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_missing_messages_field_is_called_missing_naming_the_fields_the_line_has(source, tmp_path):
    """The words are a chat conversion's, naming the option and the line's fields (a LLaVA line's
    'conversations': found by review, the line said only that 'messages' was missing or null)."""
    _with_line(source, {"images": [], "conversations": []})
    with pytest.raises(ConvertError, match=r"^vlm.jsonl:3: has no field 'messages' \(messages_field='messages'; the "
                                           r"line's fields: 'images', 'conversations'\)$"):
        _convert(source, tmp_path / "d")
    _with_line(source, {"images": [], "messages": None})
    with pytest.raises(ConvertError, match=r"^vlm.jsonl:3: field 'messages' is missing or null, not a list"):
        _convert(source, tmp_path / "d")


def test_an_empty_image_token_is_refused_not_replaced_by_the_default(source, tmp_path, capsys):
    _with_line(source, json.dumps(source["rows"][2]))
    code, _, err = run_cli(["convert", str(source["source"]), str(tmp_path / "d"), "--tokenizer",
                            str(source["tokenizer"]), "--chat-template", str(source["config"]), "--image-field",
                            "images", "--image-token", "", "--workers", "1"], capsys)
    assert code == 2 and err == "fastio: error: --image-token must be a token's text, got ''\n", err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag,value", [("--train-on", "all"), ("--eos", "<s>"), ("--special-in-text", "plain")])
def test_a_token_conversion_flag_is_refused_naming_that_flag_alone(source, tmp_path, capsys, flag, value):
    _with_line(source, json.dumps(source["rows"][2]))
    code, _, err = run_cli(["convert", str(source["source"]), str(tmp_path / "d"), "--tokenizer",
                            str(source["tokenizer"]), "--chat-template", str(source["config"]), "--image-field",
                            "images", flag, value, "--workers", "1"], capsys)
    assert code == 2 and err == f"fastio: error: {flag}: not an option of an image-text conversion (--image-field)\n"
    assert not (tmp_path / "d").exists()


def test_a_state_whose_image_text_entry_is_not_a_record_is_refused_naming_it(tmp_path):
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=255, image_seq_len=4)
    with fastio.Loader(image_text_dataset(tmp_path, n=4), pipeline=pipe, batch_size=1, device="cpu") as loader:
        state = {**loader.state_dict(), "image_text": "damaged"}
        with pytest.raises(LoaderStateError, match=r"^loader state's 'image_text' entry is str, not the options of "
                                                   r"fastio.ImageText \(a damaged state\)$"):
            loader.load_state_dict(state)


def test_a_byte_that_is_not_utf8_deep_in_the_jsonl_is_named_by_its_line_and_file_offset(source, tmp_path):
    line = (json.dumps(source["rows"][0]) + "\n").encode()
    data = line * 80  # well past the text reader's first chunk
    at = len(line) * 60 + 5
    source["source"].write_bytes(data[:at] + b"\xff" + data[at:])
    with pytest.raises(ConvertError, match=rf"vlm.jsonl:61: unreadable table \(not UTF-8: invalid start byte at byte "
                                           rf"{at}\)$"):
        _convert(source, tmp_path / "d")


@pytest.mark.parametrize("escape", ["\\ud800", "\\u0000"])
def test_an_image_path_no_file_system_can_name_is_refused_naming_the_line(source, tmp_path, escape):
    line = ('{"images": ["img/a' + escape + '.png"], "messages": [{"role": "user", "content": "<image> a"}, '
            '{"role": "assistant", "content": "b"}]}')
    _with_line(source, line)
    shown = repr("img/a" + json.loads(f'"{escape}"') + ".png")
    with pytest.raises(ConvertError) as err:
        _convert(source, tmp_path / "d")
    assert str(err.value) == (f"vlm.jsonl:3: images[0]: {shown} is not a file name (it holds a NUL or a lone "
                              "surrogate character)")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("image, option", [
    (lambda: fastio.ImageTrain(size=16, fields=["0.jpg"]), "fields=('0.jpg',)"),
    (lambda: fastio.ImageEval(size=16, text={"txt": fastio.Tokenize("tokenizer.json", max_len=8)}), "text="),
])
def test_an_image_option_imagetext_does_not_use_is_refused_not_ignored(image, option):
    with pytest.raises(ValueError, match=r"^image: fastio.ImageText decodes each image of a sample alone, so the "
                                         rf"image object's {re.escape(option)}.* is not used: leave it out"):
        fastio.ImageText(image=image(), seq_len=64, image_seq_len=4)


def test_an_eos_token_the_template_config_names_but_the_tokenizer_lacks_is_blamed_on_the_config(source, tmp_path):
    bare = train_tokenizer(tmp_path / "bare.json", eos=None, specials=("<|im_start|>", "<|im_end|>", "<s>", "<image>"))
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(bare))}: '<\|endoftext\|>' is not a special token \(the "
                                           rf"eos_token of {re.escape(str(source['config']))}\); its special tokens"):
        convert_image_text(ConvertConfig(source["source"], tmp_path / "d", workers=1),
                           ImageTextOptions(bare, source["config"]))


def test_a_bos_token_the_template_renders_but_the_tokenizer_lacks_is_blamed_on_the_config(source, tmp_path):
    # transformers adds such a token as a new id; tokenizers alone would split '<s>' into pieces: ids unlike its
    other = train_tokenizer(tmp_path / "other.json", specials=("<|im_start|>", "<|im_end|>", "<image>"))
    with pytest.raises(ConvertError) as err:
        convert_image_text(ConvertConfig(source["source"], tmp_path / "d", workers=1),
                           ImageTextOptions(other, source["config"]))
    assert str(err.value) == (f"{other}: '<s>' is not a special token (the bos_token of {source['config']}, which "
                              "its template renders); its special tokens: <image>, <|endoftext|>, <|im_end|>, "
                              "<|im_start|>")
    assert not (tmp_path / "d").exists()


def _sharegpt(src: dict, trained: tuple[int, ...] = ()) -> None:
    """``src``'s JSONL with ShareGPT's roles ('human', 'gpt'), but the lines ``trained`` (0-based), whose replies
    keep role 'assistant'."""
    rows = []
    for i, row in enumerate(src["rows"]):
        roles = {"user": "human", "assistant": "assistant" if i in trained else "gpt"}
        rows.append({**row, "messages": [{**m, "role": roles[m["role"]]} for m in row["messages"]]})
    src["source"].write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_conversations_of_which_no_token_is_trained_are_refused_not_published(tmp_path, capsys):
    """ShareGPT's roles under a template that trains role 'assistant': every sample rendered, none trained; it used
    to be published with exit 0 (and no trained count in the summary), a dataset that trains nothing."""
    src = image_text_source(tmp_path, n=4)
    template = tmp_path / "t.jinja"
    template.write_text(SHAREGPT_ROLES)
    _sharegpt(src)
    flags = ["--tokenizer", str(src["tokenizer"]), "--chat-template", str(template), "--image-field", "images",
             "--workers", "1"]
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "d"), *flags], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fastio: error: {src['source']}: nothing to train: no token of the 4 conversations is "
                          f"inside a {{% generation %}} block of {template} (are the assistant's messages in the role "
                          "the template tests for, 'assistant' where the data says 'gpt'?); rename"), err
    assert "an image-text conversion trains only those blocks" in err and not (tmp_path / "d").exists()
    options = ImageTextOptions(src["tokenizer"], template)
    for k in (0, 1):  # parts: each may train nothing, the merge refuses the whole
        convert_image_text(ConvertConfig(src["source"], tmp_path / "p", workers=1, part=(k, 2)), options)
    code, _, err = run_cli(["merge", str(tmp_path / "p")], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fastio: error: {src['source']}: nothing to train: no token of the 4 conversations is "
                          "inside a {% generation %} block of the chat template of sha256 "), err
    assert not (tmp_path / "p" / "manifest.json").exists() and not (tmp_path / "p" / "shards").exists()
    _sharegpt(src, trained=(1,))  # one trained conversation is enough
    result = convert_image_text(ConvertConfig(src["source"], tmp_path / "d", workers=1), options)
    masks = [decode_sample(s[TOKENS_FIELD], s[MASK_FIELD])[1] for s in stored_image_text(tmp_path / "d")]
    trained = int(sum(m.sum() for m in masks))
    assert result.samples == 4 and trained > 0 and masks[1].any() and not any(m.any() for i, m in enumerate(masks)
                                                                               if i != 1)
    assert load_manifest(tmp_path / "d").image_text.trained_tokens == trained
    assert f"; {trained} tokens trained (" in result.summary()


def test_a_split_in_which_no_token_is_trained_is_refused_naming_it(tmp_path):
    """Each split is a dataset of its own: one whose samples train nothing is refused, naming the split."""
    src = image_text_source(tmp_path, n=4)
    (tmp_path / "t.jinja").write_text(SHAREGPT_ROLES)
    _sharegpt(src, trained=(0,))
    with pytest.raises(ConvertError, match=r"vlm\.jsonl \(split (train|val)\): nothing to train: no token of the 2 "
                                           r"conversations"):
        convert_image_text(ConvertConfig(src["source"], tmp_path / "d", workers=1, split="val=0.5"),
                           ImageTextOptions(src["tokenizer"], tmp_path / "t.jinja"))
    assert not (tmp_path / "d").exists()
