"""examples/vlm_train.py: a tiny vision encoder and language model trained on fastio.ImageText's packed batches
(the images' embeddings over their runs, the loss on loss_mask[:, 1:] only), killed with SIGKILL mid-run and
resumed: the same sequences, bit-identical losses and final weights as a run never stopped."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from resume import killed_and_resumed
from tokens_helpers import image_text_source, train_tokenizer

from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import load_manifest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vlm_train.py"
STEPS = 18


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-example")
    src = image_text_source(root, n=24)
    convert_image_text(ConvertConfig(src["source"], root / "ds", workers=1, max_samples_per_shard=8),
                       ImageTextOptions(src["tokenizer"], src["config"]))
    return root / "ds", src["tokenizer"]


def _args(vlm, ckpt: Path) -> list[str]:
    dest, tokenizer = vlm
    return [str(dest), str(ckpt), "--tokenizer", str(tokenizer), "--seq-len", "256", "--image-seq-len", "16",
            "--image-size", "16", "--batch-size", "2"]


def _warm(warm, vlm, ckpt: Path, *more: str) -> tuple[int, str, str]:
    """``python examples/vlm_train.py ...`` from the warm interpreter (torch and DALI imported once)."""
    return warm.run(EXAMPLE, ckpt.parent, *_args(vlm, ckpt), *more)


def _weights(stdout: str) -> str:
    return re.search(rf"^done: {STEPS} steps, weights (\w+)$", stdout, re.M)[1]


@pytest.fixture(scope="module")
def straight(vlm, warm, tmp_path_factory) -> str:
    """The stdout of a run of STEPS steps never stopped, with ``--tokenizer`` (the reference of the resumed run, and
    of the run whose embedding is sized by the dataset)."""
    rc, out, err = _warm(warm, vlm, tmp_path_factory.mktemp("vlm-straight") / "ckpt", "--steps", str(STEPS))
    assert rc == 0, out + err
    return out


def _steps(stdout: str) -> dict[int, str]:
    """Each ``step N loss ...`` line of a run: ``{N: "loss ..."}``."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) (loss .*)$", stdout, re.M)}


def test_vlm_example_trains_on_images_and_the_mask_and_resumes_exactly_after_sigkill(vlm, straight, warm,
                                                                                      warm_one_thread, tmp_path):
    steps = _steps(straight)
    assert sorted(steps) == list(range(1, STEPS + 1))
    command = [sys.executable, str(EXAMPLE), *_args(vlm, tmp_path / "ckpt")]
    before, after, start = killed_and_resumed(warm_one_thread, command, tmp_path / "ckpt", steps=STEPS)
    assert start in (5, 10) and sorted(after) == list(range(start + 1, STEPS + 1))
    assert all(after[s] == steps[s] for s in after) and all(before[s] == steps[s] for s in before)
    rc, resumed, err = _warm(warm, vlm, tmp_path / "ckpt", "--steps", str(STEPS))  # restores the last step
    assert rc == 0 and f"resumed at step {STEPS}" in resumed, resumed + err
    assert _weights(resumed) == _weights(straight)
    trained = [int(re.search(r" trained (\d+)", line)[1]) for line in steps.values()]
    images = [int(re.search(r" images (\d+)", line)[1]) for line in steps.values()]
    assert all(0 < t < 2 * 256 for t in trained) and sum(images) > 0  # the replies only; images in the batches


def test_an_image_seq_len_that_cuts_no_square_patches_is_refused_naming_it(vlm, warm, tmp_path):
    rc, out, err = _warm(warm, vlm, tmp_path / "ckpt", "--image-seq-len", "12")
    assert rc == 2 and "--image-seq-len 12 must be a square" in err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_without_tokenizer_the_embedding_is_sized_by_the_dataset_as_with_the_tokenizer(vlm, straight, warm,
                                                                                        tmp_path):
    """Two steps without ``--tokenizer``: the embedding has the rows of the run with it (``straight``), and its two
    steps are that run's first two, bit for bit (losses, masks, sequences: another size draws other weights)."""
    dest, _ = vlm
    common = ["--seq-len", "256", "--image-seq-len", "16", "--image-size", "16", "--batch-size", "2", "--steps", "2"]
    rc, sized, err = warm.run(EXAMPLE, tmp_path, str(dest), str(tmp_path / "sized"), *common)
    assert rc == 0, sized + err
    embedding = load_manifest(dest).image_text.embedding_size
    assert all(f"embedding: {embedding} rows" in out for out in (straight, sized))
    first_two = {s: line for s, line in _steps(straight).items() if s <= 2}
    assert _steps(sized) == first_two and len(first_two) == 2


def test_a_tokenizer_of_another_vocabulary_than_the_datasets_is_refused_naming_both(vlm, warm, tmp_path):
    dest, _ = vlm
    other = train_tokenizer(tmp_path / "other.json", vocab_size=280, specials=("<image>",))
    rc, out, err = warm.run(EXAMPLE, tmp_path, str(dest), str(tmp_path / "ckpt"), "--tokenizer", str(other))
    embedding = load_manifest(dest).image_text.embedding_size
    assert rc == 2 and str(other) in err and f"a vocabulary of {embedding} (manifest.image_text)" in err, out + err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


def test_a_dataset_converted_before_its_vocabulary_was_recorded_needs_the_tokenizer(vlm, warm, tmp_path):
    dest, _ = vlm
    old = tmp_path / "old"
    old.mkdir()
    (old / "shards").symlink_to(dest / "shards")
    (old / "samples.fxi").write_bytes((dest / "samples.fxi").read_bytes())
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["image_text"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    rc, out, err = warm.run(EXAMPLE, tmp_path, str(old), str(tmp_path / "ckpt"))
    assert rc == 2 and f"{old}: the manifest records no vocabulary size" in err and "give --tokenizer" in err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()
