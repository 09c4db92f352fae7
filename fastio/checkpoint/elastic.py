"""Restoring a checkpoint written by a different number of ranks (elastic resume).

The rule, when the saving run had ``A`` ranks and this one has ``B != A``:

- replicated state (a DDP model and its optimizer, written once) is restored by torchsnapshot on every
  rank as usual, also on ranks that did not exist at save time;
- every other app object (also one only partly replicated) on rank ``r`` gets the state that rank
  ``r % A`` saved (its own, on a rank that existed then), and the progress record
  (step, epoch, metrics, elapsed) comes from rank 0. The fastio Loader's state is global (the same on
  every rank) and its ``load_state_dict`` re-splits the rest of the epoch over the ``B`` ranks, so every
  remaining sample of the epoch is still seen exactly once;
- RNG streams are not restored: another rank's stream means nothing at another world size, and handing
  one stream to several ranks would make them draw the same numbers. The RNG stays as this run seeded it.

A per-rank object is rebuilt from the saving rank's manifest leaves (``Snapshot.read_object``) with
torchsnapshot's own inverse of its flattening (``inflate``), so nested dicts, lists and OrderedDicts come
back as they were saved.
"""

from __future__ import annotations

import logging
from typing import Any

from torchsnapshot.flatten import inflate
from torchsnapshot.manifest import PrimitiveEntry, ShardedTensorEntry, is_container_entry, is_replicated

from fastio.errors import CheckpointError

__all__ = ["rank_view", "read_state", "split_keys"]


def _encode(key: str) -> str:
    # torchsnapshot's escaping of a top-level key in manifest paths (app keys never contain "/")
    return key.replace("%", "%25")


def rank_view(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """The entries saving rank ``rank`` can read, by unranked path: its own plus the replicated ones
    (stored under rank 0 only)."""
    view = {path.split("/", 1)[1]: entry for path, entry in manifest.items()
            if path.startswith("0/") and is_replicated(entry)}
    view.update((path.split("/", 1)[1], entry) for path, entry in manifest.items() if path.startswith(f"{rank}/"))
    return view


def _entries(view: dict[str, Any], key: str) -> dict[str, Any]:
    prefix = _encode(key)
    return {path: entry for path, entry in view.items() if path.split("/", 1)[0] == prefix}


def split_keys(view: dict[str, Any], keys: list[str]) -> tuple[list[str], list[str]]:
    """``(replicated, per_rank)``: keys all of whose saved leaves are replicated, and the rest."""
    per_rank = [k for k in keys
                if any(not is_container_entry(e) and not is_replicated(e) for e in _entries(view, k).values())]
    return [k for k in keys if k not in per_rank], per_rank


class _QuietObjOut(logging.Filter):
    """Drops torchsnapshot's per-leaf warning that a leaf read without ``obj_out`` is not loaded in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support in-place load" not in record.getMessage()


def read_state(snap: Any, view: dict[str, Any], src: int, key: str, where: str) -> Any:
    """The state_dict that saving rank ``src`` wrote for ``key`` (``view`` is ``rank_view(manifest, src)``)."""
    entries = _entries(view, key)
    if not entries:
        raise CheckpointError(f"{where}: checkpoint has no state for app key {key} on saving rank {src}")
    containers = {p: e for p, e in entries.items() if is_container_entry(e)}
    leaves: dict[str, Any] = {}
    quiet, ts_log = _QuietObjOut(), logging.getLogger("torchsnapshot.snapshot")
    ts_log.addFilter(quiet)
    try:
        for path, entry in entries.items():
            if path in containers:
                continue
            if isinstance(entry, ShardedTensorEntry):
                raise CheckpointError(f"{where}: {src}/{path} is a ShardedTensor: elastic restore of sharded "
                                      "state is not supported; restore at the saved world size")
            if isinstance(entry, PrimitiveEntry):
                leaves[path] = entry.get_value()
            else:
                leaves[path] = snap.read_object(f"{src}/{path}")
        return inflate(containers, leaves, prefix=key)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - an unreadable leaf or a structure inflate cannot rebuild
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{where}: cannot rebuild the state of app key {key} saved by rank {src}: "
                              f"{type(err).__name__}: {first}") from err
    finally:
        ts_log.removeFilter(quiet)
