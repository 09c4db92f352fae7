"""Several runs of ``examples/accelerate_train.py`` in one set of processes, or each in processes of its own
forked from one python (``launch(fresh=True)``; tests/test_accelerate.py), as ``torchrun`` would start each of
them: ``LOCAL_RANK=r MASTER_ADDR=127.0.0.1 python tests/accelerate_counts.py --plan PLAN.json``
(``plan_runs.launch`` and ``run_plan``). Between runs Accelerate's process group is destroyed and its process-wide
state forgotten, so the next run's ``Accelerator`` reads its own number of processes."""

from __future__ import annotations

import sys

from accelerate.state import AcceleratorState, GradientState
from example_scripts import load_example


def _forget() -> None:
    """The process group gone (``end_training`` destroyed it) and Accelerate's shared state with it."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# its imports (Accelerate, torch, fastio) at this module's: plan_runs does them once
EXAMPLE_MAIN = load_example("accelerate_train").main

if __name__ == "__main__":
    from plan_runs import run_plan

    run_plan(sys.argv[sys.argv.index("--plan") + 1], EXAMPLE_MAIN, _forget)
