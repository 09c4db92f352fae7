"""A bad value of a ``fastio convert`` flag is refused in one line in the command's own words: naming the flag as
typed (``--progress-every``, whose config field is ``progress_every_s``) and saying "not given" as the command
says it (``--max-pixels 0`` is no limit), never with Python's ``None``, which no flag takes."""

from __future__ import annotations

import pytest
from helpers import run_cli


@pytest.mark.parametrize("flags, named, words", [
    (["--progress-every", "0"], "--progress-every must be > 0", "got 0.0"),
    (["--max-pixels", "-1"], "--max-pixels must be positive", "(0 for no limit)"),
    (["--split", "val=0.5", "--split-by", "nope"], "--split-by must be one of label, random", "got 'nope'"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_bad_convert_flag_value_is_named_in_the_commands_words(image_folder, tmp_path, capsys, flags, named, words):
    dest = tmp_path / "out"
    code, _, err = run_cli(["convert", str(image_folder), str(dest), *flags], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert named in err and words in err, err
    assert "None" not in err and "progress_every_s" not in err, err
    assert not dest.exists()


@pytest.mark.parametrize("flags, named", [
    (["--quality", "50"], "--quality: read only with --max-side"),
    (["--split-by", "random"], "--split-by: read only with --split"),
    (["--seed", "3"], "--seed: read only with --shuffle or --split"),
    (["--staging-dir", "stage"], "--staging-dir: read only with an s3:// DEST"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_convert_flag_that_changes_nothing_is_named_in_a_warning(image_folder, tmp_path, capsys, flags, named):
    # Found by the newcomer pass: `fastio convert images ds --quality 50` (without --max-side, the only images
    # re-encoded), `--split-by random` without --split, `--seed 3` without --shuffle or --split and `--staging-dir`
    # with a local DEST converted as if they were not given, without a word: the user believed them applied. The
    # conversion is the same as without the flag (so it goes on), and stderr says the flag was ignored.
    dest, plain = tmp_path / "out", tmp_path / "plain"
    code, _, err = run_cli(["convert", str(image_folder), str(dest), *flags, "-q"], capsys)
    assert code == 0 and err.startswith(f"warning: {named}") and err.endswith("; ignored\n"), err
    assert err.count("\n") == 1, err
    assert run_cli(["convert", str(image_folder), str(plain), "-q"], capsys)[0] == 0
    shards = sorted(p.name for p in (plain / "shards").iterdir())
    assert shards and sorted(p.name for p in (dest / "shards").iterdir()) == shards
    assert all((dest / "shards" / n).read_bytes() == (plain / "shards" / n).read_bytes() for n in shards)
    partners = {"--quality": ["--max-side", "8"], "--split-by": ["--split", "val=0.25"], "--seed": ["--shuffle"]}
    if flags[0] in partners:
        again = tmp_path / "again"
        code, _, err = run_cli(["convert", str(image_folder), str(again), *flags, *partners[flags[0]], "-q"], capsys)
        assert code == 0 and "warning" not in err, err


@pytest.mark.parametrize("flags, named", [
    (["--quality", "500"], "--quality must be in 1..100, got 500"),
    (["--split-by", "bogus"], "--split-by must be one of label, random, got 'bogus'"),
    (["--staging-dir", "stage", "--max-pixels", "-1"], "--max-pixels must be positive"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_convert_value_that_is_no_value_is_one_line_even_where_the_flag_is_idle(image_folder, tmp_path, capsys,
                                                                                  flags, named):
    # Found with inspect's idle-flag warnings: `convert SRC DEST --quality 500` (without --max-side) printed that
    # --quality is ignored, then refused its value: two lines that disagree. The values are checked first.
    dest = tmp_path / "out"
    code, _, err = run_cli(["convert", str(image_folder), str(dest), *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and named in err and "warning" not in err, err
    assert not dest.exists()
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    from tokens_helpers import train_tokenizer

    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(dest), "--tokenizer",
                            str(train_tokenizer(tmp_path / "tokenizer.json")), "--staging-dir", "stage",
                            "--max-samples-per-shard", "0"], capsys)  # a token conversion's values: likewise
    assert code == 2 and err.count("\n") == 1 and "warning" not in err, err


@pytest.mark.parametrize("flags, named", [
    (["--seed", "3"], "--seed: read only with --shuffle or --split"),
    (["--split-by", "random"], "--split-by: read only with --split"),
    (["--quality", "50"], "--quality: read only with --max-side"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_an_image_text_flag_that_changes_nothing_is_named_in_a_warning(tmp_path, capsys, flags, named):
    # Found by the review of the rule above: it was skipped whenever --tokenizer was given (a token conversion
    # refuses --seed, --split and --shuffle by name), so an image-text conversion (--tokenizer with --image-field,
    # which does take --split and --shuffle) ignored `--seed 3` without them without a word.
    from tokens_helpers import image_text_source

    src = image_text_source(tmp_path, n=4)
    common = ["--tokenizer", str(src["tokenizer"]), "--chat-template", str(src["config"]), "--image-field", "images",
              "--workers", "1", "-q"]
    dest, plain = tmp_path / "out", tmp_path / "plain"
    code, _, err = run_cli(["convert", str(src["source"]), str(dest), *common, *flags], capsys)
    assert code == 0 and err == f"warning: {named}; ignored\n", err
    assert run_cli(["convert", str(src["source"]), str(plain), *common], capsys)[0] == 0
    shards = sorted(p.name for p in (plain / "shards").iterdir())
    assert shards and all((dest / "shards" / n).read_bytes() == (plain / "shards" / n).read_bytes() for n in shards)
    code, _, err = run_cli(["convert", str(src["source"]), str(tmp_path / "shuffled"), *common, "--seed", "3",
                            "--shuffle"], capsys)
    assert code == 0 and "warning" not in err, err


@pytest.mark.parametrize("flag, kept, named", [
    (["--seed", "3"], [], "--seed: read only with --order"),
    (["--epoch", "2"], [], "--epoch: read only with --order"),
    (["--batch-size", "8"], [], "--batch-size: read only with --order"),
    (["--seq-len", "16"], [], "--seq-len: read only with --order"),
    (["--cache-dir", "cache"], [], "--cache-dir: read only with an s3:// DEST"),
    (["--cache-size", "1GB"], [], "--cache-size: read only with an s3:// DEST"),
    (["--skipped"], ["--json"], "--skipped: read only without --json"),
], ids=lambda v: v[0] if isinstance(v, list) and v else None)
def test_an_inspect_flag_that_changes_nothing_is_named_in_a_warning(image_dataset, capsys, flag, kept, named):
    # Found by review of fastio inspect: --seed, --epoch, --batch-size and --seq-len without --order, the cache flags
    # with a local DEST and --skipped with --json (which prints the whole report) were ignored without a word.
    # The rule of fastio convert: a warning on stderr, the report the same as without the flag.
    code, plain, _ = run_cli(["inspect", str(image_dataset), *kept], capsys)
    assert code == 0
    for dest in (str(image_dataset), image_dataset.as_uri()):  # a file:// URL is a local DEST too
        code, out, err = run_cli(["inspect", dest, *flag, *kept], capsys)
        assert code == 0 and err.startswith(f"warning: {named}") and err.endswith("; ignored\n"), err
        assert err.count("\n") == 1, err
        assert out == plain.replace(str(image_dataset), dest)


def test_an_inspect_flag_the_dests_kind_does_not_read_is_named_in_a_warning(image_dataset, tmp_path, capsys):
    # Found by review of fastio inspect: a token dataset's --order is its packing (--seq-len), so --seed, --epoch and
    # --batch-size changed nothing there, nor --max-images (no images); --seq-len changes nothing for a dataset of
    # samples. Known once DEST is open: a warning each, the report the same as without the flag.
    from tokens_helpers import train_tokenizer

    (tmp_path / "c.jsonl").write_text("".join(f'{{"text": "hello world number {i}"}}\n' for i in range(20)))
    tokens = tmp_path / "tok"
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tokens), "--tokenizer",
                            str(train_tokenizer(tmp_path / "tokenizer.json")), "--workers", "1", "-q"], capsys)
    assert code == 0, err
    packed = ["--order", "--seq-len", "8"]
    for dest, flag, kept, named in (
            (tokens, ["--seed", "3"], packed, "--seed: read only with a dataset of samples"),
            (tokens, ["--epoch", "1"], packed, "--epoch: read only with a dataset of samples"),
            (tokens, ["--batch-size", "8"], packed, "--batch-size: read only with a dataset of samples"),
            (tokens, ["--max-images", "5"], [], "--max-images: read only with a dataset of samples"),
            (image_dataset, ["--seq-len", "8"], ["--order"], "--seq-len: read only with a token dataset")):
        code, plain, _ = run_cli(["inspect", str(dest), *kept], capsys)
        assert code == 0
        code, out, err = run_cli(["inspect", str(dest), *flag, *kept], capsys)
        assert code == 0 and err.startswith(f"warning: {named}") and err.endswith("; ignored\n"), (flag, err)
        assert err.count("\n") == 1 and out == plain, (flag, err)
    code, _, err = run_cli(["inspect", str(tokens), *packed], capsys)
    assert code == 0 and err == "", err
    code, out, err = run_cli(["inspect", str(tokens), "--skipped", "--order"], capsys)  # --seq-len 2048: too long,
    assert code == 0 and out == f"{tokens}: nothing was skipped\n", err  # but ignored: not computed, not refused
    assert err.startswith("warning: --order: read only without --skipped"), err


def test_the_report_flags_with_skipped_are_named_in_a_warning(image_dataset, capsys):
    # Found by review of fastio inspect: --skipped prints the skipped inputs and nothing else, so --order (and its
    # options) and --max-images changed nothing beside it, without a word (the order was even computed).
    code, plain, _ = run_cli(["inspect", str(image_dataset), "--skipped"], capsys)
    assert code == 0
    code, out, err = run_cli(["inspect", str(image_dataset), "--skipped", "--order", "--seed", "3",
                              "--max-images", "5"], capsys)
    assert code == 0 and out == plain, err
    assert sorted(err.splitlines()) == [f"warning: {flag}: read only without --skipped (it lists the skipped inputs "
                                        "alone); ignored" for flag in ("--max-images", "--order", "--seed")], err


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--max-images", "-1"]], ids=lambda f: f[0])
def test_an_inspect_value_that_is_no_value_is_one_line_even_where_the_flag_is_idle(image_dataset, capsys, flag):
    # Found with the idle-flag warnings: `inspect DEST --batch-size 0` (without --order) printed "ignored", then
    # refused the value: two lines that disagree. A value that is not valid is refused in one line, as --epoch -1.
    code, out, err = run_cli(["inspect", str(image_dataset), *flag], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1 and flag[0] in err and "warning" not in err, err


def _mixture_file(tmp_path, image_folder):
    from fastio.convert.run import ConvertConfig, convert

    for name in ("a", "b"):
        convert(ConvertConfig(source=image_folder, dest=tmp_path / name, workers=1, progress=False))
    mix = tmp_path / "mix.json"
    mix.write_text('{"sources": {"a": "a", "b": "b"}, "weights": {"a": 3, "b": 1}}')
    return mix


def test_inspect_of_a_mixture_file_warns_of_what_it_does_not_read_only(image_folder, tmp_path, capsys):
    """A mixture file's report reads --seed, --epoch, --batch-size and --seq-len without --order (it is an order
    report; docs/mixtures.md): no warning for them; --max-images and --skipped it never reads, --seq-len only for
    a mixture of token datasets."""
    mix = _mixture_file(tmp_path, image_folder)
    code, out, err = run_cli(["inspect", str(mix), "--seed", "3", "--epoch", "1", "--batch-size", "8"], capsys)
    assert code == 0 and err == "" and "(seed 3)" in out and "epochs 1..2" in out, (out, err)
    code, out, err = run_cli(["inspect", str(mix), "--order", "--batch-size", "8"], capsys)  # as the docs show it
    assert code == 0 and err == "", err
    code, plain, _ = run_cli(["inspect", str(mix)], capsys)
    for flags, named in ((["--max-images", "5"], "--max-images: read only with a dataset DEST"),
                         (["--skipped"], "--skipped: read only with a dataset DEST"),
                         (["--seq-len", "8"], "--seq-len: read only with a token dataset")):
        code, out, err = run_cli(["inspect", str(mix), *flags], capsys)
        assert code == 0 and err.startswith(f"warning: {named}") and err.endswith("; ignored\n"), err
        assert err.count("\n") == 1 and out == plain


@pytest.mark.parametrize("target", ["dataset", "mixture"])
def test_inspect_refuses_a_cache_size_that_is_no_size_naming_the_flag(image_dataset, image_folder, tmp_path, capsys,
                                                                      target):
    dest = image_dataset if target == "dataset" else _mixture_file(tmp_path, image_folder)
    code, out, err = run_cli(["inspect", str(dest), "--cache-size", "lots"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("fastio: error: --cache-size: cannot read 'lots' as a size"), err


_FIELDS = ("max_pixels", "transcode=", "video_decoder", "max_tokens", "overlong=", "on_error", "part=")
"""Config fields whose flags the messages below must name instead."""


def _no_field_names(text: str) -> None:
    assert not any(field in text for field in _FIELDS), text


def test_the_skipped_inputs_a_convert_lists_name_flags_not_config_fields(tmp_path, capsys):
    from PIL import Image

    from fastio.convert.synthetic import make_audio, make_video

    src = tmp_path / "src"
    src.mkdir()
    Image.new("RGB", (40, 40)).save(src / "big.jpg")
    Image.new("RGB", (8, 8)).save(src / "small.jpg")
    make_audio(src / "tone.mp3", seconds=0.2)
    make_video(src / "clip.mp4", frames=2)
    code, out, err = run_cli(["convert", str(src), str(tmp_path / "ds"), "--workers", "1", "--max-pixels", "1000",
                              "--transcode", "none", "--video-decoder", "cpu"], capsys)
    assert code == 0, err
    assert "over the limit of 1000 (--max-pixels)" in out, out
    assert "--transcode flac, the default" in out and "--video-decoder cpu keeps" in out, out
    _no_field_names(out)
    code, out, err = run_cli(["convert", str(src), str(tmp_path / "fail"), "--workers", "1", "--max-pixels", "1000",
                              "--on-error", "fail", "--transcode", "none"], capsys)
    assert code == 2 and "(--max-pixels) (--on-error fail)" in err, err
    _no_field_names(err)


def test_a_chat_convert_summary_names_max_tokens_as_the_flag(tmp_path, capsys):
    from tokens_helpers import chat_config, chat_tokenizer, conversations, write_chats

    chats = write_chats(tmp_path / "chats.jsonl", conversations(12))
    code, out, err = run_cli(["convert", str(chats), str(tmp_path / "ds"), "--workers", "1", "--tokenizer",
                              str(chat_tokenizer(tmp_path / "tokenizer.json")), "--chat-template",
                              str(chat_config(tmp_path / "tokenizer_config.json")), "--max-tokens", "60",
                              "--overlong", "drop"], capsys)
    assert code == 0 and "over --max-tokens 60: 8 conversations dropped" in out, (out, err)
    _no_field_names(out)


def test_a_part_into_an_s3_dest_is_refused_naming_the_flag(tmp_path, capsys, image_folder):
    code, out, err = run_cli(["convert", str(image_folder), "s3://bucket/ds", "--part", "0/2"], capsys)
    assert code == 2 and "s3://bucket/ds: --part ... needs a DEST" in err, err
    _no_field_names(err)


def test_max_samples_per_shard_below_one_is_one_message_for_image_and_token_conversions(tmp_path, capsys,
                                                                                        image_folder):
    from tokens_helpers import train_tokenizer

    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    tok = train_tokenizer(tmp_path / "tokenizer.json")
    for args in ([str(image_folder)], [str(tmp_path / "c.jsonl"), "--tokenizer", str(tok)]):
        code, _, err = run_cli(["convert", args[0], str(tmp_path / "out"), *args[1:], "--max-samples-per-shard", "0"],
                               capsys)
        assert (code, err) == (2, "fastio: error: --max-samples-per-shard must be a positive integer, got 0\n"), args


def test_inspect_lists_the_recorded_skip_reasons_with_the_convert_flags(tmp_path, capsys):
    """The manifest records a reason with its config field (``(max_pixels)``); ``fastio inspect`` prints it as the
    flag the user typed (``--max-pixels``), in its summary and with ``--skipped``; ``--json`` stays the record."""
    from PIL import Image

    src, dest = tmp_path / "src", tmp_path / "ds"
    src.mkdir()
    Image.new("RGB", (40, 40)).save(src / "big.jpg")
    Image.new("RGB", (8, 8)).save(src / "small.jpg")
    assert run_cli(["convert", str(src), str(dest), "--workers", "1", "--max-pixels", "1000", "-q"], capsys)[0] == 0
    for flags in ([], ["--skipped"]):
        code, out, err = run_cli(["inspect", str(dest), *flags], capsys)
        assert code == 0 and "over the limit of 1000 (--max-pixels)" in out, (flags, out, err)
        _no_field_names(out)
    code, out, _ = run_cli(["inspect", str(dest), "--json"], capsys)
    assert code == 0 and "over the limit of 1000 (max_pixels)" in out, out


def test_merge_without_parts_names_the_convert_command_and_its_part_flag(tmp_path, capsys, image_folder):
    code, _, err = run_cli(["merge", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "fastio convert SOURCE" in err and "--part K/N" in err, err
    _no_field_names(err)
    dest = tmp_path / "parted"
    (dest / ".parts").mkdir(parents=True)
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and "fastio convert SOURCE" in err and "--part K/N" in err, err
    _no_field_names(err)
    assert run_cli(["convert", str(image_folder), str(dest), "--workers", "1", "--part", "0/2", "-q"], capsys)[0] == 0
    code, _, err = run_cli(["merge", str(dest)], capsys)
    assert code == 2 and f"fastio convert {image_folder} {dest}" in err and "--part K/2" in err, err
    _no_field_names(err)


def test_an_overlong_conversation_refused_names_both_overlong_values_as_flags(tmp_path, capsys):
    from tokens_helpers import chat_config, chat_tokenizer, conversations, write_chats

    chats = write_chats(tmp_path / "chats.jsonl", conversations(12))
    code, _, err = run_cli(["convert", str(chats), str(tmp_path / "ds"), "--workers", "1", "--tokenizer",
                            str(chat_tokenizer(tmp_path / "tokenizer.json")), "--chat-template",
                            str(chat_config(tmp_path / "tokenizer_config.json")), "--max-tokens", "60"], capsys)
    assert code == 2 and "(--overlong drop or --overlong truncate handles" in err, err
    _no_field_names(err)


def _eos_in_words_tokenizer(path):
    """A broken tokenizer: its word ``world`` has the id of its special token ``</s>`` (the end of document)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"]["</s>"] = 2
    spec["added_tokens"] = [{"id": 2, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}]
    path.write_text(json.dumps(spec))
    return path


def test_a_tokenizer_making_the_eos_id_from_text_names_the_eos_flag(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "hello world </s>"}\n')
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "ds"), "--workers", "1",
                            "--tokenizer", str(_eos_in_words_tokenizer(tmp_path / "tokenizer.json"))], capsys)
    assert code == 2 and "end-of-document id 2 inside it" in err and "--eos TOKEN" in err, err
    assert err.count("\n") == 1 and "another eos" not in err, err
