"""What every rank must agree on: before any operation, what it is (:func:`terms_code`, :func:`first_disagreement`:
the operation, the directory, the engine); before a save writes anything, the step, the app's keys, and the
shape of the global state (the state an engine such as DCP writes once, from all ranks together).

Ranks that disagree would otherwise write a checkpoint no rank can restore (a step whose files lack one
rank's shard, a global tensor stored with one rank's shape), and commit it. :func:`save_signature` is what a
rank brings to the agreement; :func:`first_difference` names what differs, for one ``CheckpointError`` on
every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["first_difference", "first_disagreement", "global_loaders", "global_shapes", "save_signature",
           "terms_code"]


def global_shapes(states: dict[str, Any], global_keys: frozenset[str]) -> list[tuple[str, str, str]]:
    """``(path, shape, dtype)`` of every tensor of the global keys' states, in a stable order (a DTensor's shape
    is its global shape, the same on every rank)."""
    out: list[tuple[str, str, str]] = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((path, "x".join(map(str, value.shape)) or "scalar", str(value.dtype).replace("torch.", "")))
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{path}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v)

    for key in sorted(global_keys):
        walk(key, states.get(key))
    return out


def global_loaders(states: dict[str, Any]) -> dict[str, Any]:
    """Of the app's loader states (app key -> ``state_dict()`` of an object with ``check_state_dict``), those that
    are global: the same on every rank (a fastio Loader's, whose ranks take slices of one order: its ``world_size``
    above 1). A Loader of one rank's own (``world_size=1``) is left out."""
    return {k: s for k, s in states.items() if isinstance(s, dict) and isinstance(s.get("world_size"), int)
            and s["world_size"] > 1}


def save_signature(step: int, keys: list[str], shapes: list[tuple[str, str, str]],
                   loaders: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank's part of a save's agreement (small: the shapes and the global loader states travel as digests)."""
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    held = hashlib.sha256(repr(sorted((loaders or {}).items())).encode()).hexdigest()[:16]
    return {"step": int(step), "keys": sorted(keys), "shapes": digest, "loaders": held}


def first_difference(signatures: list[dict[str, Any]], shapes: list[list[tuple[str, str, str]]] | None = None,
                     loaders: list[dict[str, Any]] | None = None) -> str | None:
    """None when every rank's signature is rank 0's; else one line naming the first rank that differs and how
    (``shapes``: every rank's :func:`global_shapes`, to name the first tensor whose shape differs; ``loaders``:
    every rank's :func:`global_loaders`, to name the first entry that differs)."""
    base = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        if sig["step"] != base["step"]:
            return f"ranks save different steps: rank 0 step {base['step']}, rank {rank} step {sig['step']}"
        if sig["keys"] != base["keys"]:
            only0 = sorted(set(base["keys"]) - set(sig["keys"]))
            only = sorted(set(sig["keys"]) - set(base["keys"]))
            return (f"ranks save different app keys: rank 0 only {only0 or 'none'}, rank {rank} only "
                    f"{only or 'none'}")
        if sig.get("loaders") != base.get("loaders"):
            detail = "" if loaders is None else _first_entry(loaders[0], loaders[rank], rank)
            return (f"ranks' loader states differ{detail}: a fastio Loader's order is global (each rank takes its "
                    "slice of one order), so every rank's Loader must be made alike (seed, shuffle, dataset, "
                    "batch_size, pipeline) and step with the others, or samples come twice and others never")
        if sig["shapes"] != base["shapes"]:
            detail = ""
            if shapes is not None:
                mine, theirs = dict((p, (s, d)) for p, s, d in shapes[0]), dict((p, (s, d)) for p, s, d in shapes[rank])
                for path in sorted(set(mine) | set(theirs)):
                    if mine.get(path) != theirs.get(path):
                        a, b = mine.get(path), theirs.get(path)
                        detail = (f": {path} is {'/'.join(a) if a else 'absent'} on rank 0, "
                                  f"{'/'.join(b) if b else 'absent'} on rank {rank}")
                        break
            return f"ranks hold different global state (it is written once, from all ranks){detail}"
    return None


def _first_entry(mine: dict[str, Any], theirs: dict[str, Any], rank: int) -> str:
    """`` (app key 'K'): ENTRY=A on rank 0, ENTRY=B on rank R``: the first loader state entry that differs (the
    position, ``epoch`` and ``consumed``, last)."""
    for key in sorted(set(mine) | set(theirs)):
        if (key in mine) != (key in theirs):
            return f" (app key {key!r}): a global loader on {'rank 0' if key in mine else f'rank {rank}'} only"
        a, b = mine[key], theirs[key]
        # what the Loaders were made with before where they stand (a batch_size differs: so does consumed)
        for entry in sorted(dict.fromkeys([*a, *b]), key=lambda e: e in ("epoch", "consumed")):
            x, y = a.get(entry), b.get(entry)
            if repr(x) != repr(y):
                return f" (app key {key!r}): {entry}={x!r:.80} on rank 0, {entry}={y!r:.80} on rank {rank}"
    return ""


def terms_code(terms: dict[str, Any]) -> int:
    """``terms`` (``{"operation": "save", "engine": "dcp"}``) as one 62-bit integer (a digest of their text): what
    ranks compare cheaply (one all-reduce of its maximum and minimum) before they exchange the terms themselves."""
    text = repr(sorted((str(k), repr(v)) for k, v in terms.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


def first_disagreement(every: list[dict[str, Any]]) -> str | None:
    """None when every rank brought rank 0's terms (``{"operation": "save", "engine": "dcp", ...}``); else one
    line naming the first term that differs, rank 0's value and the first other rank's."""
    base = every[0]
    for name in dict.fromkeys(k for terms in every for k in terms):
        for rank, terms in enumerate(every[1:], start=1):
            if terms.get(name) != base.get(name):
                return (f"ranks disagree on the {name}: rank 0 {base.get(name, 'none')}, "
                        f"rank {rank} {terms.get(name, 'none')}")
    return None
