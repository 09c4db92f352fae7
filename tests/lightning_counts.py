"""A Lightning run on a fastio dataset that records which samples each rank trained in each epoch (issue 28,
points 1 and 2: resumes that lost samples), on one process or several (``strategy="ddp"`` on gloo). By hand,
Lightning starts the other ranks by running this script again:

    python tests/lightning_counts.py DATA LOG --devices 2 --max-epochs 1 --save-every-epoch CKPT_DIR
    python tests/lightning_counts.py DATA LOG --devices 3 --max-epochs 2 --resume CKPT_DIR/step=6.ckpt

tests/test_lightning_resume.py calls ``main(argv)`` in its own process (one device), and starts the ranks of its
multi-process runs itself (``--plan``, below). Each rank writes ``LOG.rankR``: a JSON list of
``[epoch, [dataset indices]]``, one per training batch, padding repeats left out. The model is one parameter:
the point is the data, and raw batches need no DALI graph.

    LOCAL_RANK=r MASTER_ADDR=127.0.0.1 python tests/lightning_counts.py --plan PLAN.json   (r = 0 .. N-1)

runs a list of runs in one set of N processes started by the caller (``plan_runs.launch`` and ``run_plan``):
each process imports Lightning once for all of them, instead of once a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fastio import Raw
from fastio.integrations.lightning import FastioDataModule


class Counting(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch["index"][~batch["padded"]].tolist()))
        return (self.weight - 1.0).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> list[tuple[int, list[int]]]:
    """Run; this rank's batches (also written to ``LOG.rankR``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("log")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-epochs", type=int, default=-1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--save-every-epoch", help="ModelCheckpoint(every_n_epochs=1) into this directory")
    parser.add_argument("--save-every-steps", type=int, default=0, help="with --ckpt-dir: every N steps")
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--resume")
    parser.add_argument("--validate", action="store_true", help="validate on DATA after each epoch (checkpoints "
                        "are then saved after validation)")
    args = parser.parse_args(argv)

    callbacks = []
    if args.save_every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=args.save_every_epoch, filename="{step}", save_top_k=-1,
                                         every_n_epochs=1))
    if args.save_every_steps:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=args.save_every_steps))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                         max_epochs=args.max_epochs, max_steps=args.max_steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    data = FastioDataModule(args.data, args.data if args.validate else None, val_options={"pipeline": Raw()},
                            batch_size=args.batch_size, pipeline=Raw(fields=()), device="cpu",
                            num_threads=1, reader_threads=1)
    model = Counting()
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    with open(f"{args.log}.rank{trainer.global_rank}", "w") as f:
        json.dump(model.seen, f)
    return model.seen


def _plan_run(argv: list[str]) -> None:
    """One run of a plan (``plan_runs.run_plan``): ``--devices`` is the run's number of ranks."""
    main([*argv, "--devices", os.environ["WORLD_SIZE"]])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plan"]:
        from plan_runs import run_plan

        run_plan(sys.argv[2], _plan_run, torch.distributed.destroy_process_group)
    else:
        main()
