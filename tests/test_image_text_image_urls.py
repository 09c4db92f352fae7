"""An image-text line whose image is a URL fastio does not read (LLaVA-style data often holds ``https://`` links;
``s3://`` ones are read: tests/test_image_text_s3.py): refused in one line naming the file, the line, the field and
the URL, whatever the URL's scheme or bucket; before, it was a storage error naming the URL alone."""

from __future__ import annotations

import json

import pytest
from tokens_helpers import image_text_source

from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.errors import ConvertError


@pytest.mark.parametrize("url", ["https://example.com/cat.jpg", "s3://b/x.png", "gs://bucket/x.png"])
def test_an_image_url_is_refused_naming_the_line_and_field(tmp_path, url):
    src = image_text_source(tmp_path, n=2)
    rows = [json.loads(line) for line in src["source"].read_text().splitlines()]
    rows[1]["images"] = [url]
    src["source"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConvertError) as err:
        convert_image_text(ConvertConfig(src["source"], tmp_path / "ds", workers=1),
                           ImageTextOptions(src["tokenizer"], src["config"]))
    message = str(err.value)
    assert message.startswith("vlm.jsonl:2: images[0]: ") and url in message and "\n" not in message
    assert not (tmp_path / "ds").exists()
