"""A chat Loader (fastio.Tokens, best-fit, a stored loss mask) inside the trainers, on the CPU, one process: under
Lightning (the Loader given to ``trainer.fit``, ModelCheckpoint mid-epoch, ``ckpt_path=``) and under Accelerate
(``register_for_checkpointing``, ``save_state`` mid-epoch, ``load_state`` in a new Accelerator) the resumed run
trains the same batches, ``loss_mask`` included, and ends with the same weights bit for bit as the run that was
never interrupted; the ``loss_mask`` each training step used is the Loader's own (not all True: prompts are not
trained)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from resume import same_batch
from tokens_helpers import chat_dataset

import fastio

SEQ = 160
BATCH = 4
VOCAB = 512


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    """40 conversations: several batches an epoch."""
    return chat_dataset(tmp_path_factory.mktemp("chat-trainers"), n=40)


def _loader(chat: Path) -> fastio.Loader:
    return fastio.Loader(chat, pipeline=fastio.Tokens(seq_len=SEQ, packing="best-fit", window=16),
                         batch_size=BATCH, device="cpu", seed=3, reader_threads=1)


def _model(dropout: float = 0.0) -> torch.nn.Module:
    """A tiny next-token model; ``dropout``: the RNG matters (Accelerate's state holds it; a Lightning checkpoint
    does not)."""
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, VOCAB))


def _masked_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy of the next token, on the trained targets only (``loss_mask[:, 1:]``)."""
    logits = model(batch["tokens"][:, :-1])
    each = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten(),
                                             reduction="none")
    trained = batch["loss_mask"][:, 1:].flatten()
    return (each * trained).sum() / trained.sum().clamp(min=1)


def _seen(batch: dict) -> tuple:
    """What a step trained on: its tokens and loss mask, as lists."""
    return batch["tokens"].tolist(), batch["loss_mask"].tolist()


def _reference(chat: Path, epochs: int) -> list[tuple]:
    """The Loader's own batches of ``epochs`` epochs, outside any trainer."""
    with _loader(chat) as ld:
        return [_seen(b) for _ in range(epochs) for b in ld]


def _check_masks(seen: list[tuple], reference: list[tuple]) -> None:
    assert seen == reference  # the training steps got the Loader's batches, loss_mask included
    masks = torch.tensor([m for _, mask in seen for m in mask])
    assert masks.any() and not masks.all()  # replies trained, prompts and padding not


def test_lightning_resumes_a_chat_loader_bitwise_with_its_loss_mask(tmp_path, chat, one_thread):
    pl = pytest.importorskip("lightning.pytorch")

    class Sft(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.seen = _model(), []

        def training_step(self, batch, batch_idx):
            self.seen.append(_seen(batch))
            return _masked_loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(model, ckpt_path=None, **kwargs):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path, max_epochs=2, **kwargs)
        with _loader(chat) as ld:
            trainer.fit(model, ld, ckpt_path=ckpt_path)
        return model

    pl.seed_everything(0, verbose=False)
    every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_top_k=-1,
                                         every_n_train_steps=3)
    full = fit(Sft(), callbacks=[every])
    _check_masks(full.seen, _reference(chat, 2))
    steps = len(full.seen) // 2
    assert steps > 3  # step 3 is mid epoch 0
    for step in (3, steps + 3):  # mid epoch 0, mid epoch 1
        pl.seed_everything(1, verbose=False)  # other initial weights: they must come from the checkpoint
        resumed = fit(Sft(), enable_checkpointing=False, ckpt_path=tmp_path / "ckpt" / f"step={step}.ckpt")
        assert resumed.seen == full.seen[step:], f"batches after step {step}"
        assert same_batch(resumed.state_dict(), full.state_dict()), f"weights after resuming from step {step}"


def test_accelerate_resumes_a_chat_loader_bitwise_with_its_loss_mask(tmp_path, chat, one_thread):
    pytest.importorskip("accelerate")
    full, full_weights = _accelerate_run(chat, save_at=4, state=tmp_path / "state")
    _check_masks(full, _reference(chat, 2))
    assert 4 < len(full) // 2  # saved mid epoch 0
    resumed, weights = _accelerate_run(chat, resume=tmp_path / "state")
    assert resumed == full[4:]
    assert same_batch(weights, full_weights)


def _accelerate_run(chat: Path, save_at: int = 0, state: Path | None = None, resume: Path | None = None
                    ) -> tuple[list[tuple], dict]:
    """Two epochs under an Accelerator (a new one each run, as a new process makes): the Loader registered for
    checkpointing, the state saved after ``save_at`` steps or loaded from ``resume``; (what each step trained on,
    the final weights)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _model(dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []
    with _loader(chat) as ld:
        accelerator.register_for_checkpointing(ld)
        if resume is not None:
            accelerator.load_state(str(resume))
        while ld.epoch < 2:
            for batch in ld:
                seen.append(_seen(batch))
                accelerator.backward(_masked_loss(model, batch))
                optimizer.step()
                optimizer.zero_grad()
                if len(seen) == save_at:
                    accelerator.save_state(str(state))
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.end_training()
    return seen, weights
