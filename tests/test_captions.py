"""Captions beside images: a jpg + txt dataset (as img2dataset writes) with its text field delivered tokenized
(``ImageTrain(text={"txt": fastio.Tokenize(...)})``), tokenized in threads beside the reader's."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from helpers import indexed_tar
from PIL import Image
from resume import check_resume
from tokens_helpers import train_tokenizer

import fastio
from fastio.errors import DatasetError

CAPTIONS = ["the quick brown fox", "a stream of tokens for language models " * 8, "héllo wörld — ünïcode", ""]


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (24, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def captioned(tmp_path, capsys):
    samples = {f"{i:04d}": {"jpg": _jpeg(i), "txt": CAPTIONS[i % 4].encode()} for i in range(12)}
    return indexed_tar(tmp_path / "caps", samples, capsys), train_tokenizer(tmp_path / "tokenizer.json")


def test_captions_come_tokenized_beside_the_images(captioned, monkeypatch):
    ds, tok_path = captioned
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    threads = set()
    real_encode = fastio.Tokenize.encode

    def encode(self, texts):
        threads.add(threading.current_thread().name)
        return real_encode(self, texts)
    monkeypatch.setattr(fastio.Tokenize, "encode", encode)
    pipeline = fastio.ImageTrain(size=16, text={"txt": fastio.Tokenize(str(tok_path), max_len=12)})
    with fastio.Loader(ds, pipeline=pipeline, batch_size=4, device="cpu", shuffle="none", num_threads=1) as ld:
        seen = 0
        for b in ld:
            assert b["image"].shape == (4, 3, 16, 16)
            assert b["txt"].dtype == torch.int64 and b["txt"].shape == (4, 12)
            assert b["txt_mask"].dtype == torch.bool and b["txt_mask"].shape == (4, 12)
            for row, mask, i in zip(b["txt"].tolist(), b["txt_mask"].tolist(), b["index"].tolist()):
                want = tok.encode(CAPTIONS[i % 4]).ids[:12]
                assert row[:len(want)] == want and mask == [True] * len(want) + [False] * (12 - len(want))
                assert row[len(want):] == [0] * (12 - len(want))
            seen += 4
    assert seen == 12
    assert threads and all(t.startswith("fastio-text") for t in threads), threads  # off the training thread



def test_caption_loader_resumes_bitwise(captioned):
    ds, tok_path = captioned
    pipeline = fastio.ImageTrain(size=16, text={"txt": fastio.Tokenize(str(tok_path), max_len=8)})
    check_resume(lambda: fastio.Loader(ds, pipeline=pipeline, batch_size=2, device="cpu", num_threads=1, seed=1),
                 n=2, k=3)


def test_caption_refusals(captioned, tmp_path, capsys):
    ds, tok_path = captioned
    with pytest.raises(ValueError, match="text must map field names to fastio.Tokenize"):
        fastio.ImageTrain(text={"txt": "tokenizer.json"})
    with pytest.raises(ValueError, match="max_len must be a positive integer, got 0"):
        fastio.Tokenize(str(tok_path), max_len=0)
    with pytest.raises(DatasetError, match=r"caps: dataset has no field 'caption'"):
        fastio.Loader(ds, pipeline=fastio.ImageEval(size=16, text={"caption": fastio.Tokenize(str(tok_path))}),
                      batch_size=2, device="cpu")
    bad = indexed_tar(tmp_path / "bad", {"a": {"jpg": _jpeg(0), "txt": b"ok"}, "b": {"jpg": _jpeg(1), "txt": b"\xff"}},
                      capsys)
    pipeline = fastio.ImageEval(size=16, text={"txt": fastio.Tokenize(str(tok_path))})
    with fastio.Loader(bad, pipeline=pipeline, batch_size=2, device="cpu", shuffle="none") as ld:
        with pytest.raises(DatasetError, match=r"bad: shard 0\.tar key 'b': field 'txt' is not UTF-8 text"):
            next(iter(ld))
    with fastio.Loader(ds, pipeline=fastio.ImageEval(size=16, text={"txt": fastio.Tokenize(str(tmp_path / "no.json"))}),
                       batch_size=2, device="cpu") as ld:
        with pytest.raises(DatasetError, match=r"no\.json: no such tokenizer file"):
            next(iter(ld))


def test_captions_from_a_mixture(captioned, tmp_path, capsys):
    ds, tok_path = captioned
    other = indexed_tar(tmp_path / "other", {f"o{i}": {"jpg": _jpeg(50 + i), "txt": b"megatron"} for i in range(6)},
                        capsys)
    pipeline = fastio.ImageEval(size=16, text={"txt": fastio.Tokenize(str(tok_path), max_len=6)})
    mix = fastio.Mixture({"a": ds, "b": other}, weights={"a": 2, "b": 1})
    with fastio.Loader(mix, pipeline=pipeline, batch_size=3, device="cpu", num_threads=1) as ld:
        b = next(iter(ld))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    for row, source, i in zip(b["txt"].tolist(), b["source"].tolist(), b["index"].tolist()):
        text = CAPTIONS[i % 4] if source == 0 else "megatron"
        want = tok.encode(text).ids[:6]
        assert row == want + [0] * (6 - len(want))
