"""One Loader run under a trainer, interrupted and resumed, for the tests of kinds whose batches a tiny model
trains on (``model.loss(batch)``): Lightning (ModelCheckpoint every few steps, ``ckpt_path=``) and Accelerate
(``register_for_checkpointing``, ``save_state``, ``load_state`` in a new Accelerator)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from resume import batches

__all__ = ["accelerate_run", "lightning_runs"]


def lightning_runs(tmp_path: Path, make_loader: Callable[[], Any], make_model: Callable[[], torch.nn.Module],
                   max_steps: int, every: int) -> tuple[Any, Any, dict]:
    """(the uninterrupted run's module, the module resumed from its checkpoint at step ``every``, the Loader state
    that checkpoint holds): each module's ``seen`` lists each step's ``batch["index"]``; the resumed one starts from
    other weights (they must come from the checkpoint)."""
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.seen = make_model(), []

        def training_step(self, batch, i):
            self.seen.append(batch["index"].tolist())
            return self.net.loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(model, ckpt=None, **kwargs):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, max_steps=max_steps, **kwargs)
        with make_loader() as loader:
            trainer.fit(model, loader, ckpt_path=ckpt)
        return model

    torch.manual_seed(0)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_top_k=-1,
                                               every_n_train_steps=every)
    full = fit(Module(), callbacks=[checkpoints])
    ckpt = tmp_path / "ckpt" / f"step={every}.ckpt"
    state = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    torch.manual_seed(1)
    return full, fit(Module(), ckpt, enable_checkpointing=False), state


def accelerate_run(make_loader: Callable[[], Any], make_model: Callable[[], torch.nn.Module], steps: int,
                   save_at: int | None = None, resume: str | None = None) -> tuple[list, dict]:
    """``steps`` steps under a new Accelerator (in the working directory): the Loader registered for
    checkpointing, the state saved as ``state`` after ``save_at`` steps or loaded from ``resume`` first; (each
    step's ``batch["index"]``, the final weights)."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    loader = make_loader()
    acc.register_for_checkpointing(loader)
    if resume:
        acc.load_state(resume)
    seen = []
    for batch in islice(batches(loader), steps):
        seen.append(batch["index"].tolist())
        optimizer.zero_grad()
        acc.backward(acc.unwrap_model(model).loss(batch))
        optimizer.step()
        if len(seen) == save_at:
            acc.save_state("state")
    loader.close()
    weights = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    acc.end_training()
    return seen, weights
