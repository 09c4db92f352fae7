"""What ``examples/lightning_train.py`` does with inputs a user gets wrong: ``--save-weights`` into a folder not made
yet (made) or naming a folder (refused before the run), and a dataset without labels (one line, exit 2)."""

from __future__ import annotations

import importlib.util

import pytest
from example_scripts import load_example
from helpers import unlabelled

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs fastio[lightning]")


def test_the_example_writes_weights_into_a_folder_not_made_yet_and_refuses_a_folder(tmp_path, image_dataset, capsys,
                                                                                     one_thread):
    """``--save-weights out/w.pt`` with no ``out/`` ended the run, after all its
    epochs, in a FileNotFoundError traceback from torch.save, the weights lost; ``--save-weights out`` (a folder) in an
    IsADirectoryError there. The folders are made now, and a folder is refused before the run, in one line."""
    module = load_example("lightning_train")
    with pytest.raises(SystemExit) as stop:
        module.main(["--data", str(image_dataset), "--save-weights", str(tmp_path)])
    assert stop.value.code == 2 and f"--save-weights {tmp_path}: a folder" in capsys.readouterr().err
    weights = tmp_path / "out" / "run1" / "w.pt"
    module.main(["--data", str(image_dataset), "--max-epochs", "1", "--save-weights", str(weights)])
    import torch

    assert set(torch.load(weights, weights_only=True)) >= {"net.0.weight", "net.0.bias"}
    assert sorted(p.name for p in weights.parent.iterdir()) == ["w.pt"]


def test_the_example_refuses_a_dataset_without_labels_in_one_line(tmp_path):
    """a flat image folder converted (no class folders: no labels) ended the
    example in torch's TypeError traceback (nn.Linear(32, None)); now a FastioError naming the dataset, which the
    script prints in one line (exit 2)."""
    from fastio import FastioError

    module = load_example("lightning_train")
    data = unlabelled(tmp_path)
    with pytest.raises(FastioError, match=f"^{data}: a dataset without labels"):
        module.main(["--data", str(data), "--max-epochs", "1"])
