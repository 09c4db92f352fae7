"""A Loader's replica groups and step from a ``torchft.Manager`` (``fastio.Loader(..., replicas=manager)``).

The Loader asks :class:`TorchftReplicas` at each batch for the step and this rank's :class:`~fastio.order.replicas.Share`
of it (after the step's quorum), and registers its state with the Manager, so that a group that heals from a peer
gets the data position with the weights (until the Loader is closed: then it takes it out again). The order
arithmetic is in :mod:`fastio.order.replicas`; this module only reads the Manager, but where torchft has no call
for what it needs (taking a state out, checking a healing peer's state before it is applied) it replaces the
Manager's state-dict hooks or wraps the call that applies that state. It sits in ``read/``, below the
Loader that uses it (not in ``integrations/``, which imports the Loader), and is the only importer of ``torchft``,
imported only when a Manager is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastio.errors import LoaderArgumentError, LoaderStateError
from fastio.order.replicas import Share, step_position
from fastio.words import agree

__all__ = ["STATE_KEY", "TorchftReplicas"]

_READ = ("_group_rank", "_group_world_size", "_user_state_dicts", "_load_state_dict_fns", "register_state_dict_fn",
         "current_step", "num_participants", "participating_rank", "is_participating", "_quorum_future", "_healing",
         "_pending_state_dict", "_apply_pending_state_dict")
"""What fastio reads of a Manager: its rank in its group and the group's size, the state dict hooks it registers the
Loader's state with, the step and the quorum, the state a healing group received from its peer and the call that
applies it (torchft-nightly 2026.10.26 has them all)."""

STATE_KEY = "fastio_loader"
"""The key of a Loader's state in the Manager's state dict (``fastio_loader_1``, ... for further Loaders open at once)."""


class TorchftReplicas:
    """The replica groups of a ``torchft.Manager`` as a Loader sees them."""

    def __init__(self, manager: Any):
        try:
            import torchft
        except ImportError as err:
            raise LoaderArgumentError(f"replicas= needs torchft, which does not import here ({err}): install it "
                                      "(pip install torchft-nightly; fastio is tested with torchft-nightly "
                                      "2026.10.26)") from None
        if not isinstance(manager, torchft.Manager):
            given = f"the class {manager.__qualname__}" if isinstance(manager, type) else type(manager).__name__
            raise LoaderArgumentError(f"replicas= takes a torchft.Manager, got {given}: pass the Manager of this "
                                      "replica group")
        missing = [name for name in _READ if not hasattr(manager, name)]
        if missing:
            raise LoaderArgumentError(f"replicas=: this torchft.Manager has no {', '.join(missing)} (torchft "
                                      f"{_torchft_version()}), which fastio reads (its rank, step and quorum, and the "
                                      "state dict hooks it registers the Loader's state with); fastio is tested "
                                      "with torchft-nightly 2026.10.26")
        self.manager = manager
        self._key: str | None = None  # the key registered in the Manager's state dict, until unregister
        self._quorum: tuple[Any, int] | None = None  # the quorum (its future) a batch was last cut by, its step

    @property
    def group_world_size(self) -> int:
        """The ranks of this replica group (the Manager's ``world_size``, its env ``WORLD_SIZE`` by default)."""
        return int(self.manager._group_world_size)

    def ranks(self, rank: int | None, world_size: int | None) -> tuple[int, int]:
        """``(rank, world_size)`` of the Loader in its replica group: the Manager's (``rank``/``world_size`` it was
        made with, else its environment's ``RANK``/``WORLD_SIZE``); LoaderArgumentError for given ones that are not
        (two ranks of a group would take the same share, and no rank the other)."""
        group, mine = self.group_world_size, int(self.manager._group_rank)
        if world_size is not None and world_size != group:
            raise LoaderArgumentError(
                f"Loader got world_size={world_size} with replicas=: it counts the ranks of one replica group "
                f"({group} for this Manager), not of all groups; leave world_size= (and rank=) out, or pass the "
                "group's")
        if rank is not None and rank != mine:
            raise LoaderArgumentError(f"Loader got rank={rank} with replicas=: this torchft.Manager is rank {mine} "
                                      f"of its replica group of {group}; leave rank= out, or pass {mine}")
        return mine, group

    def step(self) -> int:
        """The Manager's step: the global batch the next batch is a share of."""
        return int(self.manager.current_step())

    def share(self, rank: int, world_size: int) -> tuple[int, Share | None]:
        """``(step, share)`` once the step's quorum is known; the share is None when this group does not take part
        (it is healing, or a spare)."""
        participants = self.manager.num_participants()  # waits for the quorum (and a healing group's step)
        if participants < 1:
            raise LoaderArgumentError("no torchft quorum yet: start the step (optimizer.zero_grad() of "
                                      "torchft.optim.OptimizerWrapper, or manager.start_quorum()) before taking its "
                                      "batch")
        self.check_peer_loaders()
        participant = self.manager.participating_rank()
        step = self.step()
        self._check_started(step)
        if participant is None or not self.manager.is_participating():
            return step, None
        return step, Share(participants, participant, rank, world_size)

    def _check_started(self, step: int) -> None:
        """LoaderArgumentError when step ``step``'s batch would be cut by the quorum of an earlier step (this one's
        was not started: its groups need not be the same), or is asked a second time in one step (the same samples
        again)."""
        quorum = self.manager._quorum_future  # a new one at each start_quorum
        if self._quorum is not None and quorum is self._quorum[0]:
            if step != self._quorum[1]:
                raise LoaderArgumentError(
                    f"the batch of torchft step {step} was asked before that step's quorum was started: start it "
                    "first (optimizer.zero_grad() of torchft.optim.OptimizerWrapper, or manager.start_quorum()); "
                    "the last step's quorum need not have this step's replica groups")
            raise LoaderArgumentError(
                f"a second batch of torchft step {step} was asked in that step: with replicas= a step has one batch "
                "(this rank's share of the step's global batch; a step that does not commit is taken again after "
                "the next quorum); for gradient accumulation make batch_size the global batch of the whole step "
                "and split the batch into micro-batches; torchft's LocalSGD/DiLoCo (a Manager step per sync) are "
                "not supported")
        self._quorum = quorum, step

    def check_peer_loaders(self) -> None:
        """LoaderStateError when this group heals (after the quorum) from a peer whose state lacks a Loader registered
        on this group's Manager (torchft would fail applying it with a ``KeyError`` naming nothing else), naming
        the Loaders of both; nothing when not healing."""
        _check_peer_loaders(self.manager)

    def register(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]) -> str:
        """Put a Loader's state into the Manager's state dict (sent to a healing group with the weights); returns
        its key. A peer's state lacking one of this group's Loaders is refused before the Manager applies any of it
        (:func:`_guard_healing`), whether it heals in ``start_quorum`` (``use_async_quorum=False``) or in
        ``should_commit``."""
        taken, key, n = self.manager._user_state_dicts, STATE_KEY, 0
        while key in taken:
            n += 1
            key = f"{STATE_KEY}_{n}"
        _guard_healing(self.manager)
        self.manager.register_state_dict_fn(key, load_state_dict, state_dict)
        self._key = key
        return key

    def unregister(self) -> None:
        """Take the registered state out of the Manager's state dict: the Manager no longer asks the Loader for it
        (a checkpoint sent to a healing peer) nor hands it a peer's (healing), and a Loader made next takes the key.
        Does nothing once done. torchft has no call for it, so its two dicts are replaced by copies without the
        key (a checkpoint being sent from the Manager's quorum thread goes on with the dict it is reading)."""
        key, self._key = self._key, None
        if key is not None:
            m = self.manager
            m._user_state_dicts = {k: f for k, f in m._user_state_dicts.items() if k != key}
            m._load_state_dict_fns = {k: f for k, f in m._load_state_dict_fns.items() if k != key}

    def check_restored_with(self, app: Mapping[str, Any], state: Any, step_key: str) -> None:
        """LoaderStateError when ``state`` (a Loader state a checkpoint restores) is at a torchft step and ``app``
        (what it restores with it) lacks the Manager: its step is the Loader's position. A state saved without
        replicas= (no step) needs none: the Manager's step is checked against its position."""
        if isinstance(state, dict) and step_key in state and not any(obj is self.manager for obj in app.values()):
            raise LoaderStateError("its position is the step of the torchft.Manager it was given (replicas=), which "
                                   "this app does not restore: put that Manager into the app state with it "
                                   "({'loader': loader, 'torchft': manager, ...})")

    def check_state(self, state: dict[str, Any], batch_size: int, step_key: str, batches_per_epoch: int) -> None:
        """LoaderStateError unless ``state`` is of the same global batch, and a state saved without replicas= (no
        step) at the position of the Manager's step (a state with a step: :meth:`check_step` as it loads)."""
        plain = state.get(step_key) is None
        saved = _global_batch(state, plain)
        if saved is not None and saved[0] != batch_size:
            raise LoaderStateError(f"loader state has {saved[1]}, this Loader's global batch is {batch_size} (with "
                                   "replicas= batch_size is the global batch of one step)")
        if plain:
            self._check_position(state["epoch"], state["consumed"], batch_size, batches_per_epoch)

    def check_step(self, state: dict[str, Any], step_key: str) -> None:
        """LoaderStateError unless ``state``'s step (if it has one) is the Manager's: a restore must restore the
        Manager's state too (checked as the Loader's state loads: a checkpoint restore loads the Manager first)."""
        step = state.get(step_key)
        if step is not None and step != self.step():
            raise LoaderStateError(
                f"loader state is at torchft step {step}, the Manager at step {self.step()}: with replicas= the "
                "position is the Manager's step; restore the Manager's state_dict() with the Loader's (put the "
                "Manager into the Checkpointer's app state)")

    def refuse_next_epoch(self, epoch: int, batches_per_epoch: int) -> None:
        """LoaderStateError: a state moved to the start of ``epoch`` (``loader_policy="next-epoch"``) cannot move
        the position, which is the Manager's step; names the step that starts that epoch."""
        raise LoaderStateError(f"loader_policy='next-epoch' with replicas=: the position is the torchft Manager's "
                               "step, not the Loader's state; restore with loader_policy='exact', or without the "
                               f"Loader's key and with the Manager at step {epoch * batches_per_epoch} (the "
                               f"first of epoch {epoch})")

    def _check_position(self, epoch: int, consumed: int, batch_size: int, batches_per_epoch: int) -> None:
        """LoaderStateError unless ``(epoch, consumed)`` (a state saved without replicas=) is where the Manager's
        step is."""
        now = self.step()
        if (epoch, consumed) == step_position(now, batches_per_epoch, batch_size):
            return
        g, rest = divmod(consumed, batch_size)
        at, fix = (f"global batch {epoch * batches_per_epoch + g} of {batch_size} samples",
                   f"restore the Manager at step {epoch * batches_per_epoch + g} (manager.load_state_dict)") \
            if not rest else (f"not at the end of a global batch of {batch_size} samples",
                              "no step is at that position")
        raise LoaderStateError(f"loader state (saved without replicas=) is at epoch {epoch}, {consumed} samples "
                               f"consumed: {at}, the torchft Manager at step {now}: with replicas= the position is "
                               f"the Manager's step; {fix}, or start without the loader state")


def _check_peer_loaders(m: Any) -> None:
    """See :meth:`TorchftReplicas.check_peer_loaders` (of Manager ``m``, whichever Loader asks)."""
    pending = m._pending_state_dict if m._healing else None
    user = pending.get("user") if isinstance(pending, dict) else None
    if not isinstance(user, Mapping):
        return
    mine, theirs = _loader_keys(m._load_state_dict_fns), _loader_keys(user)
    lacking = [k for k in mine if k not in user]
    if lacking:
        raise LoaderStateError(
            f"this group's {agree(len(lacking), 'Loader')} {', '.join(lacking)} (registered on its torchft.Manager)"
            f" {'is' if len(lacking) == 1 else 'are'} not in the state of the peer it heals from, whose Loaders "
            f"are {', '.join(theirs) or 'none'} (this group's: {', '.join(mine)}): every replica group makes the "
            "same Loaders with its Manager, in the same order (close() takes one out)")


_GUARDED = "_fastio_checks_peer_loaders"
"""Set on a Manager whose ``_apply_pending_state_dict`` :func:`_guard_healing` wrapped."""


def _guard_healing(m: Any) -> None:
    """Make Manager ``m`` check a healing peer's state for its Loaders (:func:`_check_peer_loaders`) before it applies
    any of it: torchft applies it in ``start_quorum`` with ``use_async_quorum=False`` (before a batch is asked, so the
    Loader's own check comes too late; torchft raised ``KeyError: 'fastio_loader'``), else in ``should_commit``, one
    registered state after another (a peer's model state was applied before a Loader's was found lacking). torchft
    has no hook there: the Manager's bound method is wrapped, once."""
    if getattr(m, _GUARDED, False):
        return
    apply = m._apply_pending_state_dict

    def checked_apply() -> None:
        _check_peer_loaders(m)
        apply()

    m._apply_pending_state_dict = checked_apply
    setattr(m, _GUARDED, True)


def _global_batch(state: dict[str, Any], plain: bool) -> tuple[int, str] | None:
    """The global batch of a Loader state and how to name it, None if it has no ``batch_size``: a state with
    replicas= has it as its ``batch_size``; one saved without (``plain``) has ``batch_size`` on each of its
    ``world_size`` ranks (a torchrun run of 4 ranks of 8 moving to torchft has a global batch of 32)."""
    size = state.get("batch_size")
    if size is None:
        return None
    if not plain:
        return size, f"batch_size={size!r}"
    ranks = state["world_size"]
    return size * ranks, f"a global batch of {size * ranks} (saved without replicas=: batch_size={size} on each of " \
                         f"{ranks} {agree(ranks, 'rank')})"


def _loader_keys(keys: Mapping[str, Any]) -> list[str]:
    """The keys of fastio Loaders' states among a Manager's state dict keys (:data:`STATE_KEY`, ``STATE_KEY_N``)."""
    return [k for k in keys if k == STATE_KEY or k.startswith(f"{STATE_KEY}_") and k[len(STATE_KEY) + 1:].isdigit()]


def _torchft_version() -> str:
    from importlib import metadata

    for dist in ("torchft-nightly", "torchft"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "of unknown version"
