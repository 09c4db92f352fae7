"""A batch (or a global batch with drop_last) larger than an epoch of fastio.ImageText, whose units are packed
sequences, not samples: the refusal counts the sequences the samples pack into, and says so, rather than calling
them samples (20 samples packed into 1 sequence were "1 samples")."""

from __future__ import annotations

import pytest
from tokens_helpers import image_text_dataset

import fastio
from fastio.errors import DatasetError


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-batch")
    return image_text_dataset(root, n=8)


def _loader(vlm, **options):
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8), seq_len=4095, image_seq_len=4)
    return fastio.Loader(vlm, pipeline=pipe, device="cpu", **options)


def test_a_batch_larger_than_an_epochs_sequences_is_refused_counting_sequences(vlm):
    with pytest.raises(DatasetError, match=r"batch_size 2 is larger than the dataset \(1 packed sequence\)") as err:
        _loader(vlm, batch_size=2)
    assert "samples" not in str(err.value)


def test_partial_remainder_gives_the_epochs_one_sequence_as_one_batch(vlm):
    """remainder='partial' takes a batch larger than the epoch's packed sequences: one batch of the one there is
    (on two ranks, the rank left with none gets it again, flagged padded)."""
    with _loader(vlm, batch_size=2, remainder="partial") as loader:
        (batch,) = list(loader)
    assert batch["index"].tolist() == [0] and not batch["padded"].any() and batch["tokens"].shape[0] == 1
    for rank in (0, 1):
        with _loader(vlm, batch_size=2, remainder="partial", world_size=2, rank=rank) as loader:
            (got,) = list(loader)
        assert got["index"].tolist() == [0] and got["padded"].tolist() == [rank == 1]


def test_drop_last_on_ranks_counts_sequences(vlm):
    with pytest.raises(DatasetError, match=r"global batch 2 is larger than the dataset \(1 packed sequence\) and "
                                           "drop_last leaves no batch"):
        _loader(vlm, batch_size=1, world_size=2, rank=0, drop_last=True)
