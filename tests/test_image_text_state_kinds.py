"""A fastio.ImageText state (its position counts packed sequences) loaded into a Loader of another kind over the
same image-text dataset (fastio.Raw reads its samples): refused naming the entry, not taken as a position among
samples (which resumed at the wrong sample, silently); the other kind's own state still loads."""

from __future__ import annotations

import pytest
from tokens_helpers import image_text_dataset

import fastio
from fastio.errors import LoaderStateError


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-state")
    return image_text_dataset(root, n=8)


def test_an_image_text_state_is_refused_by_a_loader_of_samples(vlm):
    packed = fastio.Loader(vlm, pipeline=fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=127,
                                                          image_seq_len=4), batch_size=1, device="cpu")
    with packed:
        next(iter(packed))
    state = packed.state_dict()
    raw = fastio.Loader(vlm, pipeline=fastio.Raw(), batch_size=1, device="cpu")
    with pytest.raises(LoaderStateError, match=r"'image_text'.*fastio\.ImageText.*'raw'"):
        raw.load_state_dict(state)
    with raw:
        next(iter(raw))
    own = raw.state_dict()
    fastio.Loader(vlm, pipeline=fastio.Raw(), batch_size=1, device="cpu").load_state_dict(own)


def test_a_resume_on_image_text_of_other_loss_masks_is_refused(vlm):
    """The same conversations converted with a template whose generation spans leave the end-of-turn token out:
    the same tokens, other mask.bits, so another fingerprint (a sample's mask is a member of its tar): refused."""
    from tokens_helpers import CHATML, chat_config

    from fastio.convert.image_text import ImageTextOptions, convert_image_text
    from fastio.convert.run import ConvertConfig

    root = vlm.parent
    other = CHATML.replace("{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
                           "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}")
    assert other != CHATML
    (root / "other").mkdir()
    config = chat_config(root / "other" / "tokenizer_config.json", other)
    convert_image_text(ConvertConfig(root / "vlm.jsonl", root / "ds-other", workers=1),
                       ImageTextOptions(root / "tokenizer.json", config))

    def loader(dest):
        return fastio.Loader(dest, pipeline=fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=127,
                                                             image_seq_len=4), batch_size=1, device="cpu")
    with loader(vlm) as ld:
        next(iter(ld))
        state = ld.state_dict()
    with loader(root / "ds-other") as ld, pytest.raises(LoaderStateError, match="fingerprint"):
        ld.load_state_dict(state)
