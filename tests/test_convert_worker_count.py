"""``fastio convert`` starts no more loading processes than there are samples to load (``--workers 1000`` for a handful
of images started a thousand processes), and the output stays the one every worker count gives."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fastio.convert import run
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder


def _digests(dest: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((dest / "shards").iterdir())}


def test_no_more_workers_than_samples_and_the_same_shards(tmp_path, monkeypatch):
    src = make_imagefolder(tmp_path / "src", classes=1, per_class=3)
    started = []
    real = run._start_pool

    def counted(workers, load_options):  # the real pool, its size noted
        started.append(workers)
        return real(workers, load_options)

    monkeypatch.setattr(run, "_start_pool", counted)
    convert(ConvertConfig(src, tmp_path / "many", workers=64, progress=False))
    convert(ConvertConfig(src, tmp_path / "one", workers=1, progress=False))
    assert started == [3, 1]
    assert _digests(tmp_path / "many") == _digests(tmp_path / "one")


def test_a_worker_count_below_one_is_one_message_for_every_conversion(tmp_path, capsys):
    from helpers import run_cli
    from tokens_helpers import chat_config, chat_tokenizer, conversations, image_text_source, write_chats

    from fastio.convert.token_convert import TokenConvertConfig

    src = make_imagefolder(tmp_path / "src", classes=1, per_class=3)
    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    chats = write_chats(tmp_path / "chats.jsonl", conversations(3))
    template = chat_config(tmp_path / "tokenizer_config.json")
    (tmp_path / "vlm").mkdir()
    vlm = image_text_source(tmp_path / "vlm", n=3)
    kinds = {"images": [str(src)], "tokens": [str(chats), "--tokenizer", str(tok), "--text-field", "messages"],
             "chat": [str(chats), "--tokenizer", str(tok), "--chat-template", str(template)],
             "image-text": [str(vlm["source"]), "--tokenizer", str(vlm["tokenizer"]), "--chat-template",
                            str(vlm["config"]), "--image-field", "images"]}
    for workers in ("0", "-2"):
        for kind, args in kinds.items():
            code, out, err = run_cli(["convert", args[0], str(tmp_path / "out"), *args[1:], "--workers", workers],
                                     capsys)
            assert (code, err) == (2, f"fastio: error: --workers must be a positive integer, got {workers}\n"), kind
    assert not (tmp_path / "out").exists()
    for make in (lambda: ConvertConfig(src, tmp_path / "out", workers=0),
                 lambda: TokenConvertConfig(chats, tmp_path / "out", tok, workers=0)):
        with pytest.raises(ValueError, match=r"^workers must be a positive integer, got 0$"):
            make()
