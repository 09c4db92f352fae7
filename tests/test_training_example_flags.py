"""examples/sft_train.py and examples/vlm_train.py refuse what cannot train in one ``SCRIPT: error:`` line naming the
flag (exit 2, no traceback, no checkpoint folder made): a size that is not a positive integer (``--batch-size 0``
raised the Loader's ValueError from inside the loop, ``--image-seq-len 0`` a ZeroDivisionError), a CKPT_DIR that
is a file (the Checkpointer's error was a traceback), and, for the image-text example, a dataset of another kind (a
chat dataset was said to lack a recorded vocabulary)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokens_helpers import chat_dataset, image_text_dataset

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Each example's dataset: image-text for vlm_train.py, chat for sft_train.py."""
    root = tmp_path_factory.mktemp("example-flags")
    (root / "vlm").mkdir()
    (root / "chat").mkdir()
    return {"vlm_train.py": image_text_dataset(root / "vlm"), "sft_train.py": chat_dataset(root / "chat", n=6)}


@pytest.mark.parametrize("script, flag, value", [
    ("vlm_train.py", "--image-seq-len", "0"), ("vlm_train.py", "--batch-size", "0"),
    ("vlm_train.py", "--seq-len", "-3"), ("vlm_train.py", "--image-size", "0"),
    ("sft_train.py", "--batch-size", "0"), ("sft_train.py", "--seq-len", "x"),
])
def test_a_size_that_is_not_a_positive_integer_is_one_line_naming_the_flag(warm, tmp_path, datasets, script, flag,
                                                                          value):
    rc, out, err = warm.run(EXAMPLES / script, tmp_path, str(datasets[script]), str(tmp_path / "ckpt"), flag, value,
                            "--steps", "1")
    assert rc == 2 and err.strip().splitlines()[-1] == (f"{script}: error: argument {flag}: must be a positive "
                                                        f"integer, got {value!r}"), out + err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_the_image_text_example_names_a_chat_dataset_as_not_image_text(warm, tmp_path, datasets):
    rc, out, err = warm.run(EXAMPLES / "vlm_train.py", tmp_path, str(datasets["sft_train.py"]), str(tmp_path / "ckpt"))
    assert rc == 2 and "a token dataset, not an image-text dataset" in err, out + err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("script", ["vlm_train.py", "sft_train.py"])
def test_a_checkpoint_folder_that_is_a_file_is_one_line_naming_it(warm, tmp_path, datasets, script):
    (tmp_path / "ckpt").write_text("not a folder")
    rc, out, err = warm.run(EXAMPLES / script, tmp_path, str(datasets[script]), str(tmp_path / "ckpt"), "--steps", "1")
    assert rc == 2 and err.strip().splitlines() == [f"{script}: error: {tmp_path / 'ckpt'}: is a file, not a "
                                                    "checkpoint directory"], out + err


@pytest.mark.parametrize("script, sizes", [
    ("vlm_train.py", ("--seq-len", "256", "--image-seq-len", "16", "--image-size", "16")),
    ("sft_train.py", ("--seq-len", "256")),
])
def test_a_token_example_takes_the_remainder_its_refusal_names(warm, tmp_path, datasets, script, sizes):
    """A --batch-size larger than the dataset's packed sequences is refused naming remainder='partial' (docs/
    image-text.md quotes it), but the examples had no way to give it. Now --remainder partial (gpt_train.py's
    add_remainder, which the token examples share) trains on one batch of them (each sequence once an epoch); a
    remainder the Loader does not know is one line naming the flag."""
    data, ckpt = str(datasets[script]), tmp_path / "ckpt"
    args = (*sizes, "--batch-size", "64", "--steps", "2")
    rc, out, err = warm.run(EXAMPLES / script, tmp_path, data, str(ckpt), *args)
    assert rc == 2 and "remainder='partial' for one batch of them" in err and "Traceback" not in err, out + err
    rc, out, err = warm.run(EXAMPLES / script, tmp_path, data, str(ckpt), *args, "--remainder", "partial")
    steps = re.findall(r"^step (\d) loss \S+ .* sequences (\[.*\])$", out, re.M)
    assert rc == 0 and [s for s, _ in steps] == ["1", "2"], out + err
    epochs = [json.loads(seqs) for _, seqs in steps]  # each step an epoch: all of its sequences, each once
    assert len(epochs[0]) > 1 and all(sorted(e) == list(range(len(epochs[0]))) for e in epochs), out
    rc, out, err = warm.run(EXAMPLES / script, tmp_path, data, str(tmp_path / "c2"), *args, "--remainder", "drop")
    assert rc == 2 and f"{script}: error: argument --remainder: invalid choice: 'drop'" in err, out + err
    assert not (tmp_path / "c2").exists()
