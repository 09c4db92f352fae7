"""Fault-tolerant training with torchft: one replica group of a job whose groups come and go, on a fastio dataset.

Start a lighthouse once, then each replica group with its own id (a group may be several ranks: torchrun):

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000
    TORCHFT_LIGHTHOUSE=http://HOST:29510 REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --master-port 29600 \\
        examples/torchft_train.py --data ds/train --steps 1000
    TORCHFT_LIGHTHOUSE=http://HOST:29510 REPLICA_GROUP_ID=1 torchrun --nproc-per-node 2 --master-port 29601 \\
        examples/torchft_train.py --data ds/train --steps 1000

Each step trains on global batch ``manager.current_step()`` of fastio's order (``--batch-size`` samples: what a
one-process Loader gives at that batch), split over the groups in that step's quorum and over each group's ranks.
A group that dies and is started again heals from a peer: the weights, the optimizer and the Loader's position
(its state is in the Manager's state dict) come with the step, and the group takes part again from the next step.
The loss is the sum over this rank's samples (not those flagged ``padded``) times ``num_participants() /
batch_size``: torchft's allreduce averages over the participating groups, so the gradient is that of the global
batch's mean, whatever the shares.
``--sample-log FILE`` appends one JSON line per committed step: the step, the group and rank, and the dataset
indices it trained on. A step that does not commit ``--max-retries`` times more in a row (a process group that
cannot be built, a peer that never answers in time) ends the run with one line naming the step and torchft's
error, instead of retrying it for ever; so does a step whose quorum did not form within ``--quorum-timeout``.
Started without torchrun's variables or ``TORCHFT_LIGHTHOUSE``, or given a ``--data`` that is not a dataset, it says
so in one line (exit 2) before it starts torchft.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from fastio import Dataset, FastioError, ImageTrain, Loader


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, classes))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="training dataset (a directory made by `fastio convert`)")
    parser.add_argument("--steps", type=int, default=100, help="committed steps to train")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch of one step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=30, help="seconds before a peer is taken for dead")
    parser.add_argument("--quorum-timeout", type=float, default=60,
                        help="seconds a step waits for the lighthouse's quorum before the run stops")
    parser.add_argument("--max-retries", type=int, default=10,
                        help="times a step that did not commit is tried again before the run stops")
    parser.add_argument("--sample-log", help="append a JSON line per committed step (step, group, rank, indices)")
    args = parser.parse_args(argv)
    if args.max_retries < 0:
        parser.error(f"--max-retries must be >= 0, got {args.max_retries}")
    return args


class StepFailed(Exception):
    """A step that cannot be taken: it did not commit ``--max-retries`` + 1 times in a row, or its quorum did not
    come within ``--quorum-timeout``."""


def uncommitted(manager: Manager, step: int, failures: int, max_retries: int) -> int:
    """The failures in a row after one more try of ``step`` (0 once it committed); StepFailed past ``max_retries``,
    naming the step and the error torchft recorded for its last try (the first line of it)."""
    if manager.current_step() > step:
        return 0
    failures += 1
    if failures > max_retries:
        raise StepFailed(f"step {step} did not commit in {failures} tries in a row (--max-retries {max_retries}): "
                         f"{reason(manager.errored())}")
    return failures


def take(it: Any, manager: Manager, quorum_timeout: float) -> dict:
    """``next(it)``: this rank's share of the step, which waits for the step's quorum; StepFailed naming the step
    when torchft gave up waiting for it."""
    try:
        return next(it)
    except TimeoutError as err:
        raise StepFailed(f"step {manager.current_step()}: no quorum within --quorum-timeout {quorum_timeout:g} s "
                         f"(fewer replica groups asked the lighthouse than its --min_replicas): {first_line(err)}"
                         ) from None


def reason(err: Any) -> str:
    """What torchft recorded for a step that did not commit (``manager.errored()``), in one line."""
    if err is None:  # nothing failed: the step had fewer groups than the Manager's min_replica_size
        return "too few replica groups took part (min_replica_size)"
    return first_line(err.original_exception)


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


_STARTED_BY = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE")
"""What torchrun (the group's store, this rank) and the lighthouse's address give a Manager: without them torchft
stops at a KeyError, or waits minutes for a store that is not there."""


class NotStarted(Exception):
    """The example was not started as its usage says (torchrun, TORCHFT_LIGHTHOUSE)."""


def check_started() -> None:
    """NotStarted naming the variables of :data:`_STARTED_BY` that are not set."""
    missing = [name for name in _STARTED_BY if not os.environ.get(name)]
    if missing:
        raise NotStarted(f"{', '.join(missing)} not set: start it with torchrun and "
                         "TORCHFT_LIGHTHOUSE=http://HOST:PORT (see --help)")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    check_started()
    # a dataset that is not there, or has no labels, is named now, not after torchft has connected to its peers
    classes = Dataset(args.data).classifier_outputs()
    model = optimizer = None
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"group{os.environ.get('REPLICA_GROUP_ID', '0')}", init_sync=False,
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=args.quorum_timeout))
    loader = Loader(args.data, pipeline=ImageTrain(size=args.image_size), batch_size=args.batch_size, seed=0,
                    drop_last=True, replicas=manager, device="cpu")
    torch.manual_seed(0)  # every group builds the same weights, so step 0 needs no sync (init_sync=False)
    model = make_model(classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, optimizer)
    try:
        train(args, manager, loader, ddp, opt)
    finally:
        loader.close()
        manager.shutdown(wait=False)


def train(args: argparse.Namespace, manager: Manager, loader: Loader, ddp: nn.Module, opt: OptimizerWrapper) -> None:
    """Steps until ``args.steps`` committed ones (StepFailed: one that keeps failing)."""
    it, failures = iter(loader), 0
    while manager.current_step() < args.steps:
        opt.zero_grad()  # starts this step's quorum
        batch = take(it, manager, args.quorum_timeout)  # this rank's share of global batch current_step()
        out = ddp(batch["image"].float())
        kept = ~batch["padded"]  # a rank whose share of a batch is empty gets its first sample again, flagged
        loss = F.cross_entropy(out[kept], batch["label"][kept], reduction="sum") * manager.num_participants() \
            / args.batch_size
        loss.backward()
        step = manager.current_step()
        opt.step()  # commits, or not: a step that does not commit is taken again, with the same samples
        failures = uncommitted(manager, step, failures, args.max_retries)
        if manager.current_step() > step and args.sample_log and manager.is_participating():
            with open(args.sample_log, "a") as log:
                log.write(json.dumps({"step": step, "group": os.environ.get("REPLICA_GROUP_ID", "0"),
                                      "rank": loader.rank, "index": batch["index"].tolist()}) + "\n")


if __name__ == "__main__":
    try:
        main()
    except StepFailed as err:
        sys.exit(f"torchft_train: {err}")
    except (FastioError, NotStarted) as err:  # a missing or broken dataset, no torchrun: one line, exit 2
        print(f"torchft_train: {err}", file=sys.stderr)
        sys.exit(2)
