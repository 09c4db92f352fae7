"""What ``examples/accelerate_train.py`` does with inputs a user gets wrong: ``--resume`` of a folder without a saved
state (or one cut short), ``--save-weights`` into a folder not made yet or naming a folder, and a dataset without
labels: one line and exit 2 (or the folders made), never a traceback after the run."""

from __future__ import annotations

import pytest
from example_scripts import load_example
from helpers import unlabelled

pytest.importorskip("accelerate")


def _main():
    return load_example("accelerate_train").main


def test_resume_from_a_folder_without_a_saved_state_is_one_line(tmp_path, image_dataset, capsys):
    main = _main()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["--data", str(image_dataset), "--resume", str(empty)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert f"--resume {empty}: no state saved by --save-at in it (no custom_checkpoint_0.pkl" in err, err


def test_resume_from_a_state_cut_short_is_one_line(tmp_path, image_dataset, capsys):
    """The loader's position is there, the weights are not (a save killed part-way)."""
    import torch

    main = _main()
    cut = tmp_path / "cut"
    cut.mkdir()
    torch.save({"epoch": 0, "consumed": 8}, cut / "custom_checkpoint_0.pkl")
    with pytest.raises(SystemExit) as stop:
        main(["--data", str(image_dataset), "--resume", str(cut)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert f": error: --resume {cut}: cannot load the state: " in lines[-1] and "pytorch_model.bin" in lines[-1], err


def test_the_example_writes_weights_into_a_folder_not_made_yet_and_refuses_a_folder(tmp_path, image_dataset, capsys,
                                                                                     monkeypatch, one_thread):
    """``--save-weights out/w.pt`` with no ``out/`` ended the run, after all its
    epochs, in a FileNotFoundError traceback from torch.save, the weights lost; a folder, in an IsADirectoryError
    there. The folders are made now, and a folder is refused before the run, in one line."""
    import torch

    monkeypatch.chdir(tmp_path)
    main = _main()
    with pytest.raises(SystemExit) as stop:
        main(["--data", str(image_dataset), "--save-weights", str(tmp_path)])
    assert stop.value.code == 2 and f"--save-weights {tmp_path}: a folder" in capsys.readouterr().err
    weights = tmp_path / "out" / "run1" / "w.pt"
    main(["--data", str(image_dataset), "--epochs", "1", "--save-weights", str(weights)])
    assert len(torch.load(weights, weights_only=True)) >= 2
    assert sorted(p.name for p in weights.parent.iterdir()) == ["w.pt"]




def test_the_example_refuses_a_dataset_without_labels_in_one_line(tmp_path, monkeypatch):
    """a flat image folder converted (no labels) ended the example in torch's
    TypeError traceback (nn.Linear(32, None)); now a FastioError naming the dataset (one line, exit 2)."""
    from fastio import FastioError

    monkeypatch.chdir(tmp_path)
    data = unlabelled(tmp_path)
    with pytest.raises(FastioError, match=f"^{data}: a dataset without labels"):
        _main()(["--data", str(data), "--epochs", "1"])
