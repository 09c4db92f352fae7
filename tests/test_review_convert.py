"""Review of ``fastio convert --split`` (issue 19 data side): the spelling a user types first,
``--split train=0.9,val=0.1`` (train named with the remainder), gives the same dataset as ``--split val=0.1``;
a train fraction that is not the remainder is one line naming --split, exit 2. (main fixed the same independently:
this branch carries main's parse_split verbatim, so the two merge without a conflict.)"""

from __future__ import annotations

from helpers import run_cli

from fastio.convert.synthetic import make_imagefolder
from fastio.dataset.dataset import Dataset


def test_train_may_be_named_with_the_remainder(tmp_path, capsys):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=5, seed=3)
    prints = []
    for name, split in (("a", "train=0.8,val=0.2"), ("b", "val=0.2,train=0.8"), ("c", "val=0.2")):
        code, out, err = run_cli(["convert", str(src), str(tmp_path / name), "--workers", "1", "--split", split], capsys)
        assert code == 0, err
        prints.append([Dataset(tmp_path / name / s).fingerprint for s in ("train", "val")])
        assert len(Dataset(tmp_path / name / "train")) == 8 and len(Dataset(tmp_path / name / "val")) == 2
    assert prints[0] == prints[1] == prints[2]
    code, _, err = run_cli(["convert", str(src), str(tmp_path / "d"), "--split", "train=0.7,val=0.2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--split: train=0.7 and the other fractions add up to 0.9" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
