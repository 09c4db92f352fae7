"""Restoring a checkpoint written by a different number of ranks (elastic resume).

The rule, when the saving run had ``A`` ranks and this one has ``B != A``:

- replicated state (a DDP model and its optimizer, written once) is restored by the engine on every
  rank as usual, also on ranks that did not exist at save time;
- every other app object (also one only partly replicated) on rank ``r`` gets the state that rank
  ``r % A`` saved (its own, on a rank that existed then); the progress (step, epoch, metrics, elapsed) is the
  commit marker's, rank 0's (:mod:`fastio.checkpoint.record`). The fastio Loader's state is global (the same on
  every rank) and its ``load_state_dict`` re-splits the rest of the epoch over the ``B`` ranks, so every
  remaining sample of the epoch is still seen exactly once;
- a per-rank module and optimizer are checked against the app's before anything loads (the restore's pre-check:
  state keys, shapes, parameter groups), and a module loads by the strict rule
  (:mod:`fastio.checkpoint.engines.strict`): with ``strict=False`` what fits, the rest listed;
- RNG streams are not restored: another rank's stream means nothing at another world size, and handing
  one stream to several ranks would make them draw the same numbers. The RNG stays as this run seeded it.

A per-rank object is rebuilt from what the saving rank wrote (:meth:`SavedCheckpoint.read
<fastio.checkpoint.engines.base.SavedCheckpoint.read>`), so nested dicts, lists and OrderedDicts come
back as they were saved. The engine does the reading; this module only applies the rule.
"""

from __future__ import annotations

from fastio.checkpoint.engines.base import SavedCheckpoint, Stateful
from fastio.checkpoint.engines.strict import CheckedModule

__all__ = ["restore_elastic"]


def restore_elastic(saved: SavedCheckpoint, targets: dict[str, Stateful], *, rank: int, saved_world: int,
                    strict: bool = True, cast: bool = False) -> tuple[list[str], list[str], list[str]]:
    """Restore ``targets`` on this ``rank`` by the rule above (``saved_world`` ranks wrote ``saved``);
    returns the ``(replicated, per_rank)`` keys and what a non-``strict`` restore skipped (see
    :meth:`SavedCheckpoint.restore <fastio.checkpoint.engines.base.SavedCheckpoint.restore>`).

    Collective (the replicated part).
    """
    from torch import nn

    src = rank % saved_world
    per_rank = [k for k in targets if not saved.is_replicated(k, src)]
    replicated = [k for k in targets if k not in per_rank]
    skipped = saved.restore({k: targets[k] for k in replicated}, strict=strict, cast=cast)
    for key in per_rank:  # another rank's state, read leaf by leaf; a module by the strict rule
        target = targets[key]
        if isinstance(target, nn.Module):
            target = CheckedModule(key, target, strict=strict, where=str(saved.path), skipped=skipped, cast=cast)
        target.load_state_dict(saved.read(key, src))
    return replicated, per_rank, skipped
