"""``file:///abs/path`` names the local folder ``/abs/path`` wherever a DEST, SOURCE or checkpoint directory is
taken (docs/storage.md: "Local paths and file:///abs/path work as everywhere else"). ``fastio convert SRC
file:///abs/out`` used to write its dataset into a folder named ``file:`` below the working directory, ``fastio
verify``/``merge`` and ``inspect`` of a split DEST refused the URL as a missing folder, and a Checkpointer wrote
``./file:/abs/ckpt``."""

from __future__ import annotations

import torch
from helpers import run_cli

import fastio


def test_convert_verify_inspect_and_merge_take_a_file_url(image_folder, tmp_path, monkeypatch, capsys):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    out, parts = tmp_path / "out", tmp_path / "parts"
    assert run_cli(["convert", f"file://{image_folder}", f"file://{out}", "--workers", "1", "-q",
                    "--split", "val=0.25"], capsys)[0] == 0
    assert (out / "train" / "manifest.json").is_file() and (out / "splits.json").is_file()
    code, stdout, err = run_cli(["verify", f"file://{out}"], capsys)
    assert code == 0 and stdout.startswith("ok: "), err
    code, stdout, err = run_cli(["inspect", f"file://{out}"], capsys)
    assert code == 0 and "[train]" in stdout and "[val]" in stdout, err
    for k in (0, 1):
        assert run_cli(["convert", str(image_folder), f"file://{parts}", "--part", f"{k}/2", "--workers", "1", "-q"],
                       capsys)[0] == 0
    code, _, err = run_cli(["merge", f"file://{parts}", "-q"], capsys)
    assert code == 0 and (parts / "manifest.json").is_file(), err
    assert list(work.iterdir()) == []  # no folder named file: in the working directory


def test_a_checkpointer_takes_a_file_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    with fastio.Checkpointer(f"file://{tmp_path}/ckpt", signals=()) as ckpt:
        ckpt.save(1, {"model": model}, blocking=True)
    assert (tmp_path / "ckpt" / "step-1" / "fastio-commit.json").is_file()
    assert not (tmp_path / "file:").exists()
