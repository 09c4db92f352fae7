"""An image-text sample of no tokens (a conversation its template renders as nothing: here a template that writes
only the assistant's turns, and a line with a user turn alone) packed with ``max_images``: it holds nothing to
train and is left out, as without ``max_images``; before, the packer placed it as a piece of size 0, which named
the next sample, read twice, and the Loader failed with "the sample does not match its samples.fxi; run fastio
verify" (a dataset verify passes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokens_helpers import chat_config, image_text_source

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig

ONLY_ASSISTANT = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                  "{% endgeneration %}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def with_empty(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-empty")
    src = image_text_source(root, n=8)
    rows = [json.loads(line) for line in src["source"].read_text().splitlines()]
    for r in rows:  # the images' placeholders in the assistant's turn, which the template writes
        r["messages"][1]["content"] = "<image>" * len(r["images"]) + r["messages"][1]["content"]
    user_only = {"images": [], "messages": [{"role": "user", "content": "hi"}]}
    rows = [user_only, *rows[:3], user_only, *rows[3:], user_only]
    (root / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert_image_text(ConvertConfig(root / "e.jsonl", root / "ds", workers=1),
                       ImageTextOptions(src["tokenizer"], chat_config(root / "only.json", ONLY_ASSISTANT)))
    return root / "ds", len(rows) - 3


@pytest.mark.parametrize("max_images", [None, 3])
def test_a_sample_of_no_tokens_is_left_out_with_or_without_max_images(with_empty, max_images):
    dest, filled = with_empty
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=95, image_seq_len=4, max_images=max_images)
    segments = 0
    with fastio.Loader(dest, pipeline=pipe, batch_size=1, device="cpu", drop_last=True) as loader:
        for batch in loader:
            seg = batch["segment_ids"].numpy()[0]
            segments += np.unique(seg[seg > 0]).size
    assert segments == filled
