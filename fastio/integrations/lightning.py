"""fastio inside Lightning: Loaders made for Lightning's ranks, following Lightning's epochs, saved in its checkpoints.

:class:`FastioDataModule` makes the Loaders in ``train_dataloader()``/``val_dataloader()``, that is after the
strategy has set up the processes, with ``rank=trainer.global_rank`` and ``world_size=trainer.world_size``
(a Loader made at the top of a script launched by ``strategy="ddp"`` would see no rank yet). Each is handed to
Lightning as a :class:`LightningLoader`:

- not a ``torch.utils.data.DataLoader``, so Lightning does not wrap it, inject a ``DistributedSampler`` or re-shard
  it (``use_distributed_sampler`` does not apply): every rank gets its own slice of fastio's global order;
- ``state_dict``/``load_state_dict`` make it stateful in Lightning's sense: the position is saved in every
  checkpoint (``loops.fit_loop.state_dict.combined_loader``) and restored by ``trainer.fit(ckpt_path=...)``,
  mid-epoch included; the state is global (samples consumed by all ranks), so rank 0's serves every rank;
- ``sampler.set_epoch`` is what Lightning calls at the start of each epoch: it moves the training Loader to that
  epoch (a no-op when the Loader is already there, e.g. restored mid-epoch), so fastio's epochs follow Lightning's
  also when ``limit_train_batches`` or a restore ends an epoch early. Lightning may call ``iter()`` before
  ``set_epoch`` (a resume from an end-of-epoch checkpoint does), so the Loader's iteration starts at the first
  batch asked for, not at ``iter()``;
- the validation Loader has no ``sampler``: every validation run reads its epoch 0 from the start, so each
  sample comes with the same clip (a clip kind draws its starts per epoch) on every run of a fit and of a
  resumed or another fit, and validation losses compare the same inputs;
- a mid-epoch position restored at another world size leaves the Loader fewer (or more) batches than
  Lightning's restored batch counter implies (it counts the batches of the old size and ends the epoch at
  ``len(loader)`` of the new one). The training loader sets that counter of the fit loop to
  ``len(loader) - loader.batches_left()``, so Lightning's epoch ends exactly where the Loader's does and every
  remaining sample is trained once (global steps, and with them ``every_n_train_steps``, are not changed).
  A position at the start of an epoch saved within the one before (at its last batch, where the Loader moves
  on) ends that epoch in Lightning's count too, so the next one is trained whole.
  A checkpoint saved in ``on_train_epoch_end`` and restarted (``max_steps`` runs restart it) would send
  Lightning back into the finished epoch (for one more batch, or none) and then past the Loader's next epoch;
  the restore marks that epoch completed and starts the next afresh, as Lightning does when ``max_epochs`` runs
  resume. One saved there mid-epoch, as a stop cut the epoch short (``max_steps``), would make
  Lightning ``set_epoch`` the next epoch while it counts on in this one (the rest of this epoch never trained,
  the next one's start trained twice); the restore unmarks that epoch, and Lightning resumes it where the Loader
  is.

A position the Loader refuses is a :class:`~fastio.errors.LoaderStateError` raised from ``trainer.fit`` once
Lightning has restored the model (it restores the loaders' positions last, and nothing of fastio runs before
its model); a mixture whose weights changed mid-epoch says how to resume under Lightning (from a checkpoint saved
at an epoch's end).

Lightning's data fetcher reads one batch ahead only for iterables without a length; a Loader has one, so the
position Lightning saves after batch ``k`` is the one after batch ``k`` and not ``k + 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from fastio.errors import LoaderStateError
from fastio.loader import Loader, LoaderConfig
from fastio.pipelines import evaluation_of

__all__ = ["FastioDataModule", "LightningLoader"]


class _EpochSetter:
    """What Lightning finds as ``loader.sampler``: its ``set_epoch(epoch)`` calls ``Loader.set_epoch``."""

    def __init__(self, loader: Loader):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


def _align_progress(trainer: pl.Trainer, loader: Loader) -> None:
    """Reconcile the fit loop's progress with the position the Loader was just restored to, before Lightning's
    loop resumes (Lightning restores a training loader's position only when it restarts an epoch)."""
    epochs, batches = trainer.fit_loop.epoch_progress, trainer.fit_loop.epoch_loop.batch_progress
    if loader.state_dict()["consumed"]:
        # what the Loader delivered of this epoch at its world size, so Lightning ends it (at len(loader)) when
        # the Loader does; at the world size of the save the counter already is that
        _set_batch_counter(trainer, len(loader) - loader.batches_left())
        if epochs.current.ready == epochs.current.processed == epochs.current.completed + 1 and not batches.is_last_batch:
            # Saved in on_train_epoch_end of an epoch a stop cut short (max_steps, max_time, should_stop): Lightning
            # marked it processed, and would set_epoch the next one (the Loader leaves its position for that
            # epoch's start) while it counts on in this one. Resume it mid-epoch, where the Loader is.
            epochs.current.processed, epochs.total.processed = epochs.current.completed, epochs.total.completed
        return
    if epochs.current.ready == epochs.current.processed == epochs.current.completed + 1:
        # Saved in on_train_epoch_end (every_n_epochs), and restarted (max_steps runs are): Lightning would go
        # back into the finished epoch (for one more batch, or none and then past the Loader's next epoch).
        # Resume as max_epochs runs do: that epoch completed, the next one started afresh (its epoch loop not
        # restarting resets its own counters).
        epochs.current.completed, epochs.total.completed = epochs.current.processed, epochs.total.processed
        trainer.fit_loop.epoch_loop.restarting = False
    elif batches.current.ready:
        # Saved within an epoch (at its last batch: the Loader moves on as it hands that out) whose samples are all
        # trained at this world size. Lightning ends its epoch when its count of the old size's batches reaches
        # len(loader): with more batches an epoch here it would go on in the epoch it counts, with the next
        # epoch's batches (or, after its set_epoch, the finished one's again), and end the next epoch early.
        # Finish it as Lightning does an epoch saved at its last batch: the next one starts afresh.
        _set_batch_counter(trainer, len(loader))
        batches.is_last_batch = True


def _set_batch_counter(trainer: pl.Trainer, done: int) -> None:
    """Set the fit loop's count of the batches done in the current epoch to ``done``. Every field of the counter
    moves by the same amount, so Lightning's own restart rules (which compare them) decide as before."""
    counter = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = done - counter.ready
    for name in ("ready", "started", "processed", "completed"):
        setattr(counter, name, getattr(counter, name) + shift)


def _lightning_hint(loader: Loader, state: dict[str, Any]) -> str:
    """What a Lightning run can do about a position the Loader refuses but would take at the start of the next
    epoch (a mixture whose weights changed): Lightning restores the position with the model, and has no
    ``loader_policy``; empty for any other refusal."""
    try:
        loader.check_state_dict({**state, "epoch": int(state["epoch"]) + 1, "consumed": 0})
    except (LoaderStateError, KeyError, TypeError, ValueError):
        return ""
    return ("; under Lightning (trainer.fit(ckpt_path=...)): resume from a checkpoint saved at the end of an epoch "
            "(ModelCheckpoint(every_n_epochs=1), the default), from which the new weights apply, or resume this one "
            "with the saved weights")


class LightningLoader:
    """A :class:`fastio.Loader` as Lightning expects a stateful dataloader (see the module docstring).

    Iterating, ``len``, ``state_dict``/``load_state_dict`` and every other attribute are the Loader's own
    (``loader.stats()``, ``loader.key(i)``, ``loader.loader`` for the Loader itself). ``whole_epochs=True``
    (validation): each iteration reads epoch 0 from its beginning, also when the last one was left unfinished
    (Lightning's sanity check reads 2 batches; ``limit_val_batches``), and there is no ``sampler`` for Lightning's
    ``set_epoch``: the same batches every time. ``trainer`` (the training loader's): ``load_state_dict``
    reconciles the trainer's batch counter with the restored position (module docstring).
    """

    batch_sampler = None  # Lightning looks for a sampler here too; there is none

    def __init__(self, loader: Loader, *, whole_epochs: bool = False, trainer: pl.Trainer | None = None):
        self.loader = loader
        self.sampler = None if whole_epochs else _EpochSetter(loader)
        self.whole_epochs = whole_epochs
        self._trainer = trainer

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _FromFirstBatch(self)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.loader.load_state_dict(state)
        except LoaderStateError as err:
            raise LoaderStateError(f"{err}{_lightning_hint(self.loader, state)}") from None
        if self._trainer is not None:
            _align_progress(self._trainer, self.loader)

    def __getattr__(self, name: str) -> Any:  # only for names not found above
        if "loader" not in self.__dict__:  # not made yet (copy.copy asks for __setstate__ first): no forwarding
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["loader"], name)


class _FromFirstBatch:
    """A :class:`LightningLoader`'s iterator: the Loader's own, made at the first ``next()``, not at ``iter()``, so a
    ``set_epoch`` between them (Lightning's order when it resumes from an end-of-epoch checkpoint) moves the Loader
    before it starts; after a failed ``next()`` the next one asks for the batch that failed again, as the Loader's
    iterator does (a generator here would end the loop silently instead)."""

    __slots__ = ("_of", "_batches")

    def __init__(self, of: LightningLoader):
        self._of, self._batches = of, None

    def __iter__(self) -> _FromFirstBatch:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._batches is None:
            if self._of.whole_epochs:
                _rewind(self._of.loader)
            self._batches = iter(self._of.loader)
        return next(self._batches)


def _rewind(loader: Loader) -> None:
    """Move ``loader`` to the start of its epoch 0 (``set_epoch`` would keep a position within the epoch)."""
    state = loader.state_dict()
    if (state["epoch"], state["consumed"]) != (0, 0):
        loader.load_state_dict({**state, "epoch": 0, "consumed": 0})


class FastioDataModule(pl.LightningDataModule):
    """Training (and optionally validation) Loaders for ``trainer.fit(model, datamodule=...)``.

    ``train``/``val``: dataset directories or URLs (``val`` may be None). ``config`` and ``**options``: the training
    Loader's :class:`~fastio.LoaderConfig` and overrides (``batch_size=``, ``device=``, ...). The validation Loader
    takes the same options with the training pipeline's evaluation form (``ImageTrain``'s options in ``ImageEval``,
    ``VideoClips`` center-cropped, ``Tokens`` as it is), ``shuffle="none"`` and ``remainder="partial"`` (each sample
    once; repeats flagged in ``batch["padded"]``), then ``val_options`` over them; every validation run reads the
    same whole epoch of it (epoch 0: the same samples with the same clips each time). ``rank`` and ``world_size``
    come from the trainer and cannot be given. A Loader made again (``reload_dataloaders_every_n_epochs``) closes
    the one it replaces; ``teardown`` closes the last ones.
    """

    def __init__(self, train: str | Path | None, val: str | Path | None = None, *,
                 config: LoaderConfig | None = None, val_options: dict[str, Any] | None = None, **options: Any):
        super().__init__()
        for name in ("rank", "world_size"):
            if name in options or name in (val_options or {}):
                raise ValueError(f"{name}= is taken from the Lightning trainer; do not pass it")
        self.train, self.val = train, val
        self.config = dataclasses.replace(config, **options) if config is not None else LoaderConfig(**options)
        validate = {"pipeline": evaluation_of(self.config.pipeline), "shuffle": "none", "remainder": "partial",
                    **(val_options or {})}
        self.val_config = dataclasses.replace(self.config, **validate)
        self._loaders: dict[bool, Loader] = {}  # the training (True) and validation Loaders Lightning holds
        if val is None:  # Lightning runs no validation loop for a datamodule without this method
            self.val_dataloader = None

    def _make(self, dest: str | Path, config: LoaderConfig, training: bool) -> LightningLoader:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("FastioDataModule makes its Loaders for a trainer: pass it to trainer.fit(...)")
        loader = Loader(dest, config, rank=trainer.global_rank, world_size=trainer.world_size)
        replaced = self._loaders.pop(training, None)  # reload_dataloaders_every_n_epochs: Lightning drops it
        if replaced is not None:
            replaced.close()
        self._loaders[training] = loader
        return LightningLoader(loader, whole_epochs=not training, trainer=trainer if training else None)

    def train_dataloader(self) -> LightningLoader:
        if self.train is None:
            raise ValueError("FastioDataModule(train=None) has no training data")
        return self._make(self.train, self.config, training=True)

    def val_dataloader(self) -> LightningLoader:
        return self._make(self.val, self.val_config, training=False)

    def teardown(self, stage: str) -> None:
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()
