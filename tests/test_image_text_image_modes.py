"""Images of every PIL mode a conversation may hold (grayscale, grayscale with alpha, RGBA with a translucent
alpha, palette, CMYK JPEG, 16-bit grayscale PNG) reach ``batch["images"]`` as RGB by the convention of the image
kinds' DALI decoder, documented in docs/image-text.md: grey repeated in the three channels, alpha dropped (not
composited), the palette's colour, CMYK converted, 16 bits scaled to 8 (not clipped, as PIL's ``convert("RGB")``
clips)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer
from tokens_helpers import image_text_source

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig

RGB = (200, 60, 20)


def _palette() -> Image.Image:
    img = Image.new("P", (16, 16), 1)
    img.putpalette([0, 0, 0, *RGB] + [0] * 762)
    return img


MODES = {  # name: (image, the RGB pixel it delivers)
    "plaingrey": (Image.new("L", (16, 16), 120), (120, 120, 120)),
    "greyalpha": (Image.new("LA", (16, 16), (120, 40)), (120, 120, 120)),
    "translucent": (Image.new("RGBA", (16, 16), (*RGB, 128)), RGB),
    "palette": (_palette(), RGB),
    "cmyk": (Image.new("RGB", (16, 16), RGB).convert("CMYK"), RGB),
    "sixteen": (Image.new("I;16", (16, 16), 30000), (117, 117, 117)),
}


@pytest.fixture(scope="module")
def modes(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-modes")
    src = image_text_source(root, n=1)
    rows = []
    for name, (img, _) in MODES.items():
        path = f"img/{name}.{'jpg' if name == 'cmyk' else 'png'}"
        img.save(root / path, quality=100) if name == "cmyk" else img.save(root / path)
        rows.append({"images": [path], "messages": [{"role": "user", "content": f"<image> {name}"},
                                                    {"role": "assistant", "content": "yes"}]})
    (root / "modes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convert_image_text(ConvertConfig(root / "modes.jsonl", root / "ds", workers=1),
                       ImageTextOptions(src["tokenizer"], src["config"]))
    return root / "ds", Tokenizer.from_file(str(src["tokenizer"]))


def test_every_mode_arrives_as_rgb_by_the_decoders_convention(modes):
    dest, tok = modes
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8, dtype="uint8", crop_ratio=1.0), seq_len=89,
                            image_seq_len=50)  # one sample a sequence
    seen = {}
    with fastio.Loader(dest, pipeline=pipe, batch_size=1, device="cpu") as loader:
        for batch in loader:
            text = tok.decode([t for t in batch["tokens"][0].tolist() if t])
            name = next(n for n in MODES if f" {n}" in text)
            assert batch["images"].shape == (1, 3, 8, 8)
            seen[name] = batch["images"][0].numpy()
    assert sorted(seen) == sorted(MODES)
    for name, (_, want) in MODES.items():
        got = seen[name].reshape(3, -1)
        assert np.abs(got - np.array(want)[:, None].astype(int)).max() <= 2, (name, got[:, 0], want)
