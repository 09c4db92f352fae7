"""Train with Hugging Face Accelerate on a fastio dataset, on one process or several, resumable mid-epoch.

    python examples/accelerate_train.py --data ds/train --epochs 2 --save-at 5 --state-dir state
    python examples/accelerate_train.py --data ds/train --epochs 2 --resume state
    torchrun --nproc-per-node 2 examples/accelerate_train.py --data ds/train ...
    torchrun --nproc-per-node 3 examples/accelerate_train.py --data ds/train --resume state  (another world size)
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_train.py --data ds/train ...  (GPUs)

On the CPU, start several processes with torchrun: ``accelerate launch --cpu`` starts one, whatever
``--num_processes`` says.

The Loader is made with Accelerate's process index and count, and is NOT passed to ``accelerator.prepare``: that
would return it unchanged (it is not a torch ``DataLoader``), but a ``DataLoader`` wrapping it would be re-sharded
and its batches re-split. ``accelerator.register_for_checkpointing(loader)`` puts its position into
``save_state``; ``load_state`` in a new process continues from there, mid-epoch included, and the run ends with
the same weights, bit for bit, as one that was never interrupted (CPU, same number of processes). The position is
global (samples consumed by all processes), so the copy Accelerate saves from the main process serves them all,
also at another number of processes: the rest of the epoch is re-split over them, each sample once (the loop
runs on the Loader's epochs, not on a count of steps; the processes without a saved RNG state start from the
seed).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn import functional as F

from fastio import FastioError, ImageTrain, Loader

POSITION = "custom_checkpoint_0.pkl"
"""What ``save_state`` writes for the first object registered for checkpointing: the loader's position."""


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, classes),  # dropout: RNG matters
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="training dataset (a directory made by `fastio convert`)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", help="where --save-at saves the training state")
    parser.add_argument("--save-at", type=int, default=0, help="save the state after this many steps of this run")
    parser.add_argument("--resume", help="a state directory written by --save-at")
    parser.add_argument("--save-weights", help="the main process writes the final state_dict here")
    parser.add_argument("--log-indices", help="each process writes [epoch, dataset indices] of its batches to "
                        "PATH.rankR (padding repeats left out)")
    args = parser.parse_args(argv)
    if args.resume and not os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume}: no such state directory (one that --save-at wrote)")
    if args.resume and not os.path.isfile(os.path.join(args.resume, POSITION)):
        parser.error(f"--resume {args.resume}: no state saved by --save-at in it (no {POSITION}: the loader's "
                     "position)")
    if args.save_at and not args.state_dir:
        parser.error("--save-at needs --state-dir (where to save the state)")
    if args.save_weights and os.path.isdir(args.save_weights):
        parser.error(f"--save-weights {args.save_weights}: a folder; name the file to write (e.g. {args.save_weights}"
                     "/weights.pt)")

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    loader = Loader(args.data, batch_size=args.batch_size, pipeline=ImageTrain(size=args.image_size), seed=args.seed,
                    device=accelerator.device.type, num_threads=1,
                    rank=accelerator.process_index, world_size=accelerator.num_processes)
    model = make_model(loader.dataset.classifier_outputs())  # no labels: a DatasetError naming the dataset
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader (see the docstring)
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        try:
            accelerator.load_state(args.resume)  # weights, optimizer, RNG of each process, the loader's position
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:  # a save cut short, another model
            parser.error(f"--resume {args.resume}: cannot load the state: {str(err).strip().splitlines()[0]}")

    steps, seen = 0, []
    model.train()
    while loader.epoch < args.epochs:
        epoch = loader.epoch  # the loader moves to the next epoch as it hands out the last batch
        for batch in loader:  # the rest of the current epoch (all of it unless just restored mid-epoch)
            seen.append((epoch, batch["index"][~batch["padded"]].tolist()))
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == args.save_at:
                accelerator.save_state(args.state_dir)
    loader.close()
    if args.log_indices:
        with open(f"{args.log_indices}.rank{accelerator.process_index}", "w") as f:
            json.dump(seen, f)
    accelerator.wait_for_everyone()
    if args.save_weights and accelerator.is_main_process:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_weights)), exist_ok=True)
        tmp = f"{args.save_weights}.tmp"
        torch.save(accelerator.unwrap_model(model).state_dict(), tmp)
        os.replace(tmp, args.save_weights)
    accelerator.end_training()


if __name__ == "__main__":
    try:
        main()
    except FastioError as err:  # a missing or broken dataset: one line, not a traceback
        print(f"accelerate_train.py: error: {err}", file=sys.stderr)
        sys.exit(2)
