"""Runs of ``examples/lightning_train.py`` on several processes (tests/test_lightning.py), as ``torchrun`` would
start each of them: ``LOCAL_RANK=r MASTER_ADDR=127.0.0.1 python tests/lightning_train_runs.py --plan PLAN.json``
(``plan_runs.launch`` and ``run_plan``): with ``LOCAL_RANK`` set Lightning takes the processes as started for it and
starts none of its own, and Lightning is imported once, in the python the ranks are forked from, instead of once a
process."""

from __future__ import annotations

import sys

import torch.distributed
from example_scripts import load_example

# its imports (Lightning, torch, fastio) at this module's: plan_runs does them once
EXAMPLE_MAIN = load_example("lightning_train").main

if __name__ == "__main__":
    from plan_runs import run_plan

    run_plan(sys.argv[sys.argv.index("--plan") + 1], EXAMPLE_MAIN, torch.distributed.destroy_process_group)
