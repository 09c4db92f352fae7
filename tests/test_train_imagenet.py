"""examples/train_imagenet.py, the ImageNet recipe: a small ResNet trained for a few epochs on a small dataset of
learnable classes, once on fastio (the image folders converted by ``fastio convert``) and once on the reference
data path (ImageFolder + DataLoader over the same image folders), with the same augmentations. Both learn, and
their accuracies agree within noise: fastio delivers the right images with the right labels."""

from __future__ import annotations

from pathlib import Path

from example_scripts import load_example
from helpers import run_cli

from fastio.convert.synthetic import make_imagefolder

REPO = Path(__file__).resolve().parent.parent


def _recipe():
    return load_example("train_imagenet")


def test_fastio_and_torchvision_backends_learn_alike(tmp_path, capsys, one_thread):
    images, ds = tmp_path / "imagenet", tmp_path / "ds"
    for split, per_class, seed in (("train", 40, 0), ("val", 25, 1)):
        make_imagefolder(images / split, classes=4, per_class=per_class, min_side=48, max_side=64, seed=seed)
        code, _, err = run_cli(["convert", str(images / split), str(ds / split)], capsys)
        assert code == 0, err
    recipe = _recipe()
    common = ["-a", "resnet10-w16", "--epochs", "6", "-b", "16", "--lr", "0.1", "--lr-schedule", "cosine",
              "--crop", "32", "-j", "1", "-p", "1000"]
    acc = {}
    for backend, data in (("fastio", ds), ("torchvision", images)):
        out = tmp_path / backend
        out.mkdir()
        if backend == "torchvision":
            common[common.index("-j") + 1] = "0"  # DataLoader in this process
        acc[backend] = recipe.main([str(data), "--data-backend", backend, "--out", str(out), *common])
        assert (out / "checkpoint.pth.tar").is_file() and (out / "model_best.pth.tar").is_file()
    # the best checkpoint, evaluated again, gives the accuracy it was saved with
    again = recipe.main([str(ds), "--evaluate", "--resume", str(tmp_path / "fastio" / "model_best.pth.tar"), *common])
    assert again == acc["fastio"]
    printed = capsys.readouterr().out
    assert printed.count("best Acc@1") == 2 and "=> loaded checkpoint" in printed, printed[-2000:]
    # 4 classes: chance is 25 %; 100 validation images, so one run's accuracy moves by several points
    assert acc["fastio"] >= 60 and acc["torchvision"] >= 60, acc
    assert abs(acc["fastio"] - acc["torchvision"]) <= 20, acc


def test_out_not_made_yet_is_made_and_a_missing_resume_is_one_line(tmp_path, capsys, one_thread):
    """Found by the integrations review: ``--out runs/exp1`` with no such folder ended the first epoch in torch.save's
    RuntimeError traceback ("Parent directory ... does not exist"), the epoch's checkpoint lost; ``--resume`` of a
    file that is not there in torch.load's FileNotFoundError traceback. The folder is made now, and a missing
    ``--resume`` (or an ``--out`` that is a file) is a usage error before anything runs."""
    import pytest

    images, ds = tmp_path / "imagenet", tmp_path / "ds"
    for split in ("train", "val"):
        make_imagefolder(images / split, classes=2, per_class=8, min_side=40, max_side=48, seed=0)
        code, _, err = run_cli(["convert", str(images / split), str(ds / split), "-q"], capsys)
        assert code == 0, err
    recipe = _recipe()
    common = ["-a", "resnet10-w16", "--epochs", "1", "-b", "8", "--crop", "32", "-j", "1", "-p", "1000"]
    for flag, value, said in (("--resume", tmp_path / "nope.pth.tar", "no such checkpoint file"),
                              ("--out", ds / "train" / "manifest.json", "a file, not a folder")):
        with pytest.raises(SystemExit) as stop:
            recipe.main([str(ds), flag, str(value), *common])
        assert stop.value.code == 2 and f"{flag} {value}: {said}" in capsys.readouterr().err
    out = tmp_path / "runs" / "exp1"
    recipe.main([str(ds), "--out", str(out), *common])
    assert (out / "checkpoint.pth.tar").is_file() and (out / "model_best.pth.tar").is_file()


def test_a_dataset_without_labels_is_one_line(tmp_path, capsys):
    """Found by the integrations review: DATA/train converted from a folder without class folders (no labels) ended in
    torch's TypeError traceback from the ResNet's nn.Linear(..., None); now a FastioError naming it, which the script
    prints in one line (exit 2)."""
    import pytest
    from PIL import Image

    from fastio import FastioError

    for split in ("train", "val"):
        (tmp_path / "flat" / split).mkdir(parents=True)
        for k in range(8):
            Image.new("RGB", (40, 30), (20 * k, 90, 200)).save(tmp_path / "flat" / split / f"p{k}.png")
        code, _, err = run_cli(["convert", str(tmp_path / "flat" / split), str(tmp_path / "ds" / split), "-q"], capsys)
        assert code == 0, err
    with pytest.raises(FastioError, match=f"^{tmp_path / 'ds' / 'train'}: a dataset without labels"):
        _recipe().main([str(tmp_path / "ds"), "-a", "resnet10-w16", "--epochs", "1", "-b", "4", "--crop", "32",
                        "-j", "1"])
