"""An image-text dataset (``fastio convert --image-field``) read by a kind other than fastio.ImageText: the image
kinds (one image a sample) and fastio.Tokens (token datasets) refuse it in one line that names the dataset and
the kind that reads it, fastio.ImageText, not a way out that refuses it in turn."""

from __future__ import annotations

import pytest
from tokens_helpers import image_text_dataset

import fastio
from fastio.errors import DatasetError


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-kinds")
    return image_text_dataset(root, n=6)


@pytest.mark.parametrize("pipeline", [fastio.ImageTrain(size=8), fastio.ImageEval(size=8),
                                      fastio.Tokens(seq_len=64)], ids=["ImageTrain", "ImageEval", "Tokens"])
def test_another_kind_names_fastio_imagetext(vlm, pipeline):
    with pytest.raises(DatasetError) as err:
        fastio.Loader(vlm, pipeline=pipeline, batch_size=2, device="cpu")
    message = str(err.value)
    assert str(vlm) in message and "image-text dataset" in message and "fastio.ImageText" in message
    assert "\n" not in message and "fastio.Raw" not in message and "fastio.ImageTrain" not in message
