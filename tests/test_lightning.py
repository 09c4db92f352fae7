"""fastio inside Lightning (``fastio[lightning]``), on the CPU: mid-epoch checkpoints resume bit for bit, on one
process (a plain Loader given to ``trainer.fit``) and on two (``strategy="ddp"`` on gloo, through
``examples/lightning_train.py`` and ``FastioDataModule``); Lightning neither wraps nor re-shards the Loaders and
their epochs follow Lightning's; ``FastioDataModule``'s validation Loader takes the training pipeline object's
kind and options."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from resume import same_batch

import fastio
from fastio import ImageTrain, Loader, Raw

# Lightning (~1.4 s to import: torchmetrics, matplotlib) is imported by the tests that use it, not at collection:
# both of make test's workers collect this file, one runs it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs fastio[lightning]")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "lightning_train.py"
RUNS = Path(__file__).resolve().parent / "lightning_train_runs.py"
OPTIONS = dict(batch_size=8, pipeline=ImageTrain(size=32), device="cpu", num_threads=1, reader_threads=1)


def _example():
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(tmp_path: Path, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, **kwargs)



def test_one_process_resume_from_mid_epoch_checkpoints_is_bitwise(tmp_path, image_dataset, one_thread):
    import lightning.pytorch as pl

    Classifier = _example().Classifier
    pl.seed_everything(0, verbose=False)
    model = Classifier(4)
    ckpt_dir = tmp_path / "ckpt"
    every = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", save_top_k=-1, every_n_train_steps=2)
    with Loader(image_dataset, **OPTIONS) as loader:  # 48 samples: 6 batches an epoch
        _trainer(tmp_path, max_epochs=2, callbacks=[every]).fit(model, loader)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(model.seen) == 12

    # step 4: mid epoch 0; step 6: the last batch of epoch 0; step 8: mid epoch 1
    for step, (epoch, consumed) in ((4, (0, 32)), (6, (1, 0)), (8, (1, 16))):
        ckpt = ckpt_dir / f"step={step}.ckpt"
        saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert (saved[0]["epoch"], saved[0]["consumed"]) == (epoch, consumed)
        pl.seed_everything(1, verbose=False)  # other initial weights: they must come from the checkpoint
        resumed = Classifier(4)
        with Loader(image_dataset, **OPTIONS) as loader:
            _trainer(tmp_path, max_epochs=2, enable_checkpointing=False).fit(resumed, loader, ckpt_path=ckpt)
        assert resumed.seen == model.seen[step:], f"batches after step {step}"
        assert same_batch(resumed.state_dict(), want), f"weights after resuming from step {step}"


def test_epochs_follow_lightning_when_it_ends_an_epoch_early(tmp_path, image_dataset, one_thread):
    """limit_train_batches=2: Lightning's epoch 1 starts the Loader's epoch 1, not batch 3 of epoch 0."""
    from fastio.integrations.lightning import FastioDataModule

    Classifier = _example().Classifier
    model = Classifier(4)
    data = FastioDataModule(image_dataset, **OPTIONS)
    _trainer(tmp_path, max_epochs=2, limit_train_batches=2, enable_checkpointing=False).fit(model, datamodule=data)
    with Loader(image_dataset, **OPTIONS) as ref:
        epoch0 = [b["index"].tolist() for b in ref][:2]
        epoch1 = [b["index"].tolist() for b in ref][:2]
    assert epoch0 != epoch1
    assert model.seen == [(0, i) for i in epoch0] + [(1, i) for i in epoch1]


def test_every_validation_sees_the_whole_validation_set(tmp_path, image_dataset, one_thread):
    """Lightning's sanity check runs 2 validation batches before training; the validation after epoch 0 must
    still see every sample, not the rest of an epoch the sanity check started."""
    from fastio.integrations.lightning import FastioDataModule

    class Recording(_example().Classifier):
        def on_validation_epoch_start(self):
            self.val_runs = [*getattr(self, "val_runs", []), []]

        def validation_step(self, batch, batch_idx):
            self.val_runs[-1] += batch["index"][~batch["padded"]].tolist()
            return super().validation_step(batch, batch_idx)

    model = Recording(4)
    data = FastioDataModule(image_dataset, image_dataset, **OPTIONS)
    _trainer(tmp_path, max_epochs=2, limit_train_batches=1, enable_checkpointing=False).fit(model, datamodule=data)
    sanity, *after_epochs = model.val_runs
    assert sanity == list(range(16))  # 2 batches of 8, in dataset order (shuffle="none")
    assert after_epochs == [list(range(48))] * 2


def test_loaders_made_again_each_epoch_close_the_ones_they_replace(tmp_path, image_dataset, one_thread):
    """reload_dataloaders_every_n_epochs=1: Lightning asks the DataModule for new Loaders every epoch; those they
    replace are closed then, not at the end of the fit (each kept its threads and open shards: 2 more threads an
    epoch), and the epochs still follow Lightning's."""
    from fastio.errors import LoaderClosedError
    from fastio.integrations.lightning import FastioDataModule

    class Recording(_example().Classifier):
        made: list = []

        def on_train_epoch_start(self):
            now = [self.trainer.train_dataloader.loader, self.trainer.val_dataloaders.loader]
            self.made += [loader for loader in now if all(loader is not seen for seen in self.made)]
            for old in self.made:
                if all(old is not loader for loader in now):
                    with pytest.raises(LoaderClosedError):
                        iter(old)

    model = Recording(4)
    data = FastioDataModule(image_dataset, image_dataset, **OPTIONS)
    _trainer(tmp_path, max_epochs=3, limit_train_batches=1, limit_val_batches=1, reload_dataloaders_every_n_epochs=1,
             enable_checkpointing=False).fit(model, datamodule=data)
    with Loader(image_dataset, **OPTIONS) as ref:
        want = [(epoch, next(iter(ref))["index"].tolist()) for epoch in range(3) if ref.set_epoch(epoch) is None]
    assert len(model.made) >= 4 and model.seen == want


def test_the_example_refuses_a_missing_resume_checkpoint_in_one_line(tmp_path, image_dataset, capsys):
    """``--resume`` of a checkpoint that is not there ended in Lightning's FileNotFoundError traceback after the
    trainer was set up; it is a usage error now, naming the option and the path."""
    with pytest.raises(SystemExit) as stop:
        _example().main(["--data", str(image_dataset), "--resume", str(tmp_path / "step=4.ckpt")])
    assert stop.value.code == 2
    assert f"--resume {tmp_path / 'step=4.ckpt'}: no such checkpoint file" in capsys.readouterr().err


def test_the_datamodule_refuses_a_rank_of_its_own(image_dataset):
    from fastio.integrations.lightning import FastioDataModule

    with pytest.raises(ValueError, match="rank= is taken from the Lightning trainer"):
        FastioDataModule(image_dataset, rank=1, **OPTIONS)


def test_lightning_loader_is_stateful_and_not_a_dataloader(image_dataset):
    from lightning.pytorch.utilities.combined_loader import _Stateful

    from fastio.integrations.lightning import LightningLoader

    with Loader(image_dataset, **OPTIONS) as loader:
        wrapped = LightningLoader(loader)
        assert isinstance(wrapped, _Stateful) and not isinstance(wrapped, torch.utils.data.DataLoader)
        assert len(wrapped) == 6 and wrapped.dataset is loader.dataset
        wrapped.sampler.set_epoch(3)
        assert wrapped.state_dict()["epoch"] == 3
        # copy.copy makes the object before its __dict__ is filled, and asks it for __setstate__: an
        # AttributeError, not a KeyError from the attribute forwarding (copy.copy failed with KeyError: 'loader')
        copied = copy.copy(wrapped)
        assert copied.loader is loader and len(copied) == 6
        assert not hasattr(LightningLoader.__new__(LightningLoader), "no_such_name")


def test_two_process_ddp_resume_is_bitwise_and_every_rank_gets_its_own_slice(tmp_path, image_dataset):
    """``examples/lightning_train.py --devices 2``, twice: a run saving mid-epoch, then one resumed from there, each
    run's 2 processes new (started as torchrun would, forked from one python that imported Lightning once:
    ``tests/lightning_train_runs.py``; Lightning's own launch of the other rank is Lightning's)."""
    from plan_runs import launch

    common = ["--data", str(image_dataset), "--val", str(image_dataset), "--devices", "2", "--max-epochs", "2"]
    # 48 samples, 2 ranks x 8: 3 steps an epoch; checkpoints at steps 2, 4 and 6
    launch(RUNS, tmp_path, [(2, [*common, "--ckpt-dir", str(tmp_path / "ckpt"), "--every-n-steps", "2",
                                 "--save-weights", str(tmp_path / "full.pt"), "--log-indices", str(tmp_path / "seen")]),
                            (2, [*common, "--resume", str(tmp_path / "ckpt" / "step=4.ckpt"), "--save-weights",
                                 str(tmp_path / "resumed.pt")])], fresh=True)
    out = (tmp_path / "rank0.out").read_text()
    # validation ran, on both ranks (sync_dist), in each run: rank 0 prints it once a run
    assert len(re.findall(r"^val_acc \d", out, re.MULTILINE)) == 2, out[-3000:]
    full, resumed = (torch.load(tmp_path / name, weights_only=True) for name in ("full.pt", "resumed.pt"))
    assert same_batch(full, resumed)

    seen = [json.loads((tmp_path / f"seen.rank{r}").read_text()) for r in (0, 1)]
    for epoch in (0, 1):
        ranks = [[i for e, batch in s if e == epoch for i in batch] for s in seen]
        assert len(ranks[0]) == len(ranks[1]) == 24
        assert sorted(ranks[0] + ranks[1]) == list(range(48)), f"epoch {epoch}: the ranks' slices"
        for r in (0, 1):  # exactly what a Loader of that rank delivers: Lightning did not re-shard it
            with Loader(image_dataset, rank=r, world_size=2, **{**OPTIONS, "pipeline": Raw(fields=())}) as ref:
                ref.set_epoch(epoch)
                assert ranks[r] == [i for b in ref for i in b["index"].tolist()]


def test_the_datamodule_refuses_the_old_image_options_naming_the_pipeline_object(image_dataset):
    """The old flat options (``image_size=``, ``eval_crop_ratio=``, ``pipeline="raw"`` in ``val_options``) are
    refused in one line naming the object; the object's options reach the validation ``ImageEval``."""
    from fastio.integrations.lightning import FastioDataModule

    options = {k: v for k, v in OPTIONS.items() if k != "pipeline"}
    with pytest.raises(fastio.LoaderArgumentError, match=r"^image_size=32, eval_crop_ratio=0\.5: the old spelling; "
                       r"give the pipeline object: pipeline=fastio\.ImageEval\(size=32, crop_ratio=0\.5\)$"):
        FastioDataModule(image_dataset, image_dataset, **options, image_size=32, eval_crop_ratio=0.5)
    with pytest.raises(fastio.LoaderArgumentError, match=r"^pipeline='raw': .*pipeline=fastio\.Raw\(\)$"):
        FastioDataModule(image_dataset, image_dataset, val_options={"pipeline": "raw"}, **OPTIONS)
    data = FastioDataModule(image_dataset, image_dataset, **OPTIONS)
    assert data.val_config.pipeline == fastio.ImageEval(size=32)
    assert (data.val_config.shuffle, data.val_config.remainder, data.val_config.batch_size) == ("none", "partial", 8)
    raw = FastioDataModule(image_dataset, image_dataset, val_options={"pipeline": Raw(fields=("cls",))}, **OPTIONS)
    assert raw.val_config.pipeline == fastio.Raw(fields=("cls",))


def _datamodule(train, val, **options):
    pytest.importorskip("lightning")
    from fastio.integrations.lightning import FastioDataModule

    return FastioDataModule(train, val, batch_size=4, device="cpu", num_threads=1, **options)


def test_datamodule_validates_a_token_dataset_with_the_training_tokens_pipeline(token_ds):
    """docs/tokens.md: FastioDataModule(DEST, pipeline=fastio.Tokens(...)); with a validation dataset its Loader
    read it as images ('image-eval') and was refused: a token dataset ..."""
    pipe = fastio.Tokens(seq_len=8)
    data = _datamodule(token_ds, token_ds, pipeline=pipe)
    assert data.val_config.pipeline == pipe
    assert (data.val_config.shuffle, data.val_config.remainder) == ("none", "partial")
    with fastio.Loader(token_ds, data.val_config, rank=0, world_size=1) as val:
        assert next(iter(val))["tokens"].shape == (4, 9)


def test_datamodule_validates_images_at_the_training_pipelines_size(image_ds):
    """ImageTrain(size=32, dtype='uint8') for training gave a validation Loader of ImageEval(size=224, float32):
    the object's options were lost, where the old spelling's image_size=32 carried over."""
    data = _datamodule(image_ds, image_ds, pipeline=fastio.ImageTrain(size=32, dtype="uint8"))
    assert data.val_config.pipeline == fastio.ImageEval(size=32, dtype="uint8")
    with fastio.Loader(image_ds, data.val_config, rank=0, world_size=1) as val:
        image = next(iter(val))["image"]
    assert image.shape == (4, 3, 32, 32) and str(image.dtype) == "torch.uint8"
    with pytest.raises(fastio.LoaderArgumentError, match=r"pipeline=fastio\.ImageTrain\(size=32\)$"):
        _datamodule(image_ds, image_ds, pipeline="image-train", image_size=32)  # the old spelling: refused
