"""Loaders given to Lightning without the DataModule, and epochs a stop cuts short: a validation Loader given to
``trainer.fit(model, train, val)`` as it is continues where the last validation run stopped (after Lightning's
2-batch sanity check the first validation saw 32 of 48 samples); ``LightningLoader(val, whole_epochs=True)``, as
docs/trainers.md says, validates the whole set on every run. A plain training Loader goes on with its epoch after
``limit_train_batches`` ended Lightning's. And a run stopped by ``max_steps`` mid-epoch, resumed with a larger
``max_steps`` from the checkpoint ``ModelCheckpoint`` saved as it stopped (tests/lightning_counts.py in this process,
one device), trains the rest of that epoch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from example_scripts import load_example

from fastio import ImageEval, ImageTrain, Loader

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs fastio[lightning]")

REPO = Path(__file__).resolve().parent.parent
OPTIONS = dict(batch_size=8, device="cpu", num_threads=1, reader_threads=1)


def _classifier():
    module = load_example("lightning_train")

    class Recording(module.Classifier):
        def on_validation_epoch_start(self):
            self.val_runs = [*getattr(self, "val_runs", []), []]

        def validation_step(self, batch, batch_idx):
            self.val_runs[-1] += batch["index"][~batch["padded"]].tolist()
            return super().validation_step(batch, batch_idx)

    return Recording(4)


def _fit(tmp_path: Path, model, train, val) -> None:
    import lightning.pytorch as pl

    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tmp_path, max_epochs=2, limit_train_batches=1,
               enable_checkpointing=False).fit(model, train, val)


def _validation(dest: Path) -> Loader:
    return Loader(dest, pipeline=ImageEval(size=32), shuffle="none", remainder="partial", **OPTIONS)


def test_a_validation_loader_given_to_fit_wrapped_as_the_docs_say_validates_every_sample(tmp_path, image_dataset,
                                                                                      one_thread):
    from fastio.integrations.lightning import LightningLoader

    model = _classifier()
    with Loader(image_dataset, pipeline=ImageTrain(size=32), **OPTIONS) as train, _validation(image_dataset) as val:
        _fit(tmp_path, model, train, LightningLoader(val, whole_epochs=True))
    sanity, *after_epochs = model.val_runs
    assert sanity == list(range(16))  # Lightning's sanity check: 2 batches
    assert after_epochs == [list(range(48))] * 2


def test_the_docs_say_how_to_give_a_validation_loader_without_the_datamodule():
    """The plain Loader's behaviour (it continues its epoch on each ``iter()``: a training loop that breaks and
    comes back resumes) is right for training; for validation under Lightning the docs name the wrapper."""
    text = " ".join((REPO / "docs" / "trainers.md").read_text().split())
    assert "LightningLoader(val_loader, whole_epochs=True)" in text
    assert "32 of 48" in text


def test_a_run_stopped_by_max_steps_mid_epoch_resumes_the_rest_of_that_epoch(tmp_path, one_thread):
    """Run 1: max_steps=7 of 20 batches an epoch; ModelCheckpoint(every_n_epochs=1) saves as it stops (Lightning
    calls on_train_epoch_end there, and marks the epoch processed). Run 2: max_steps=40 from that checkpoint. It
    trained 13 batches of the Loader's epoch 1 as the rest of epoch 0 (Lightning's set_epoch(1) moved the Loader
    off its saved position), then the rest of epoch 1 and the start of epoch 2 as epoch 1: the 52 samples left of
    epoch 0 never trained (20 of its 80 missing and 20 twice, as counted). Now epoch 0's 52 samples left are
    trained, then epoch 1 whole: what the uninterrupted run trains."""
    import lightning_counts
    from trainer_counts import assert_exactly_once, dataset80, per_epoch

    data = dataset80(tmp_path)
    first = lightning_counts.main([str(data), str(tmp_path / "first"), "--max-steps", "7", "--save-every-epoch",
                                   str(tmp_path / "ckpt")])
    assert len(first) == 7 and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=7.ckpt"]
    second = lightning_counts.main([str(data), str(tmp_path / "second"), "--max-steps", "40", "--resume",
                                    str(tmp_path / "ckpt" / "step=7.ckpt")])
    assert len(second) == 33
    counts = per_epoch([first], [second])
    assert sorted(counts) == [0, 1]
    assert_exactly_once(counts[0], "epoch 0, stopped by max_steps and resumed")
    assert_exactly_once(counts[1], "epoch 1, after the resume")


def test_a_plain_training_loader_goes_on_with_its_epoch_after_one_lightning_ended_early(tmp_path, image_dataset,
                                                                                       one_thread):
    """docs/trainers.md said a plain Loader given to trainer.fit takes one Loader epoch per Lightning epoch; with
    limit_train_batches=1 Lightning's epoch 1 got the Loader's epoch 0 batch 2 (Lightning calls no set_epoch on a
    plain Loader). The docs say so now and name the DataModule for it (test_lightning.py checks the DataModule)."""
    model = _classifier()
    with Loader(image_dataset, pipeline=ImageTrain(size=32), **OPTIONS) as train:
        import lightning.pytorch as pl

        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path, max_epochs=2, limit_train_batches=1, enable_checkpointing=False,
                   num_sanity_val_steps=0).fit(model, train)
    with Loader(image_dataset, pipeline=ImageTrain(size=32), **OPTIONS) as ref:
        epoch0 = [b["index"].tolist() for b in ref]
    assert model.seen == [(0, epoch0[0]), (1, epoch0[1])]
    text = " ".join((REPO / "docs" / "trainers.md").read_text().split())
    assert "after an epoch that `limit_train_batches` ends early, Lightning's next epoch goes on with the rest of " \
           "the Loader's" in text
