"""Train with Lightning on a fastio dataset, on one process or several (``strategy="ddp"``), resumable mid-epoch.

    python examples/lightning_train.py --data ds/train --val ds/val --max-epochs 2
    python examples/lightning_train.py --data ds/train --devices 2 --ckpt-dir ckpt --every-n-steps 4
    python examples/lightning_train.py --data ds/train --devices 2 --ckpt-dir ckpt --resume ckpt/step=4.ckpt
    python examples/lightning_train.py --data ds/train --devices 3 --ckpt-dir ckpt --resume ckpt/step=4.ckpt

``FastioDataModule`` makes the Loaders once Lightning has started its processes, with Lightning's rank and world
size; Lightning neither wraps nor re-shards them, calls their ``set_epoch`` at each epoch, and keeps their
position in every checkpoint, so ``--resume`` from a mid-epoch checkpoint ends with the same weights, bit for
bit, as the run that was never interrupted (CPU, same number of devices). On another number of devices the
rest of the epoch is re-split over them, each sample once. ``--save-weights`` writes the weights. The resumed run
writes checkpoints only with ``--ckpt-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from fastio import Dataset, FastioError, ImageTrain
from fastio.integrations.lightning import FastioDataModule


class Classifier(pl.LightningModule):
    """A small CNN trained with SGD; logs validation accuracy (padding repeats not counted)."""

    def __init__(self, classes: int, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
        )
        self.seen: list[tuple[int, list[int]]] = []  # (epoch, dataset indices) of every training batch

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["index"].tolist()))
        loss = F.cross_entropy(self.net(batch["image"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        real = ~batch["padded"]
        hits = (self.net(batch["image"]).argmax(1) == batch["label"])[real]
        self.log("val_acc", hits.float().mean(), batch_size=int(real.sum()), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def classes_of(data: str) -> int:
    """The classifier's outputs for DATA's labels; FastioError naming DATA where it has none."""
    return Dataset(data).classifier_outputs()


_CKPT_WORDS = ("last", "best", "hpc", "registry")  # what Lightning's ckpt_path= takes besides a path or URL


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="training dataset (a directory made by `fastio convert`)")
    parser.add_argument("--val", help="validation dataset")
    parser.add_argument("--classes", type=int, default=None, help="number of classes (default: the label map's)")
    parser.add_argument("--devices", type=int, default=1, help="processes (CPU) or GPUs; >1 runs strategy='ddp'")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", help="save a checkpoint here every --every-n-steps steps")
    parser.add_argument("--every-n-steps", type=int, default=4)
    parser.add_argument("--resume", help="a checkpoint to continue from (mid-epoch ones included)")
    parser.add_argument("--save-weights", help="rank 0 writes the final state_dict here")
    parser.add_argument("--log-indices", help="each rank writes the dataset indices of its batches to PATH.rankR")
    args = parser.parse_args(argv)
    if args.resume and "://" not in args.resume and args.resume not in _CKPT_WORDS and not os.path.isfile(args.resume):
        parser.error(f"--resume {args.resume}: no such checkpoint file")
    if args.save_weights and os.path.isdir(args.save_weights):
        parser.error(f"--save-weights {args.save_weights}: a folder; name the file to write (e.g. {args.save_weights}"
                     "/weights.pt)")

    pl.seed_everything(args.seed, workers=False, verbose=False)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    data = FastioDataModule(args.data, args.val, batch_size=args.batch_size, pipeline=ImageTrain(size=args.image_size),
                            seed=args.seed, device="cuda" if accelerator == "gpu" else "cpu", num_threads=1)
    if args.classes is None:
        args.classes = classes_of(args.data)
    model = Classifier(args.classes)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=args.every_n_steps))
    trainer = pl.Trainer(accelerator=accelerator, devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", max_epochs=args.max_epochs,
                         callbacks=callbacks, logger=False, enable_checkpointing=bool(args.ckpt_dir),
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    if args.log_indices:
        with open(f"{args.log_indices}.rank{trainer.global_rank}", "w") as f:
            json.dump(model.seen, f)
    if args.save_weights and trainer.is_global_zero:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_weights)), exist_ok=True)
        tmp = f"{args.save_weights}.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.save_weights)
    if trainer.is_global_zero and "val_acc" in trainer.callback_metrics:
        print(f"val_acc {float(trainer.callback_metrics['val_acc']):.3f}")


if __name__ == "__main__":
    try:
        main()
    except FastioError as err:  # a missing or broken dataset: one line, not a traceback
        print(f"lightning_train.py: error: {err}", file=sys.stderr)
        sys.exit(2)
