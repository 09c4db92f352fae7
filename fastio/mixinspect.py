"""How a mixture's order looks (``fastio inspect --order MIX.json``): proportions in every global batch and how
soon each source's samples come back, computed from the pure order alone (:mod:`fastio.mixorder`; no sample
bytes are read)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio.mixture import Mixture
from fastio.sampler import SHUFFLE_MODES, SamplerSpec

__all__ = ["mixture_order_report"]


def mixture_order_report(mixture: Mixture, *, seed: int = 0, epoch: int = 0, batch_size: int = 256,
                         shuffle: str = "global", block_shards: int = 4, epochs: int = 2) -> dict[str, Any]:
    """Mixture epochs ``epoch .. epoch + epochs - 1`` of a Loader with ``seed``/``shuffle``/``block_shards``, in
    global batches of ``batch_size`` (capped at the epoch). JSON-serialisable:

    - ``sources``: per source its path, samples, share (the normalised weight), samples per mixture epoch
      (``per_epoch``) and how many times that covers the source (``cycles``);
    - ``per_batch``: per source over the full batches of those epochs, the expected count (share x batch),
      the min and max count, and ``max_deviation`` = max |count - expected|;
    - ``repeat_distance``: per source, the positions between two deliveries of the same sample (``min``,
      ``median``; ``repeats`` = how many deliveries were repeats; all None without a repeat).
    """
    if shuffle not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be one of {', '.join(SHUFFLE_MODES)}, got {shuffle!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if epochs < 1:
        raise ValueError(f"epochs must be positive, got {epochs}")
    n = len(mixture)
    batch_size = min(batch_size, n)
    sampler = mixture.sampler(SamplerSpec(seed=seed, shuffle=shuffle, block_shards=block_shards))
    ids = np.concatenate([sampler.order(e)[np.arange(n)] for e in range(epoch, epoch + epochs)])
    src, _ = mixture.split(ids)
    k = len(mixture.names)
    full = n // batch_size
    per_batch = {}
    counts = np.concatenate([
        np.stack([np.bincount(b, minlength=k) for b in src[e * n:e * n + full * batch_size].reshape(full, -1)])
        for e in range(epochs)]) if full else np.zeros((0, k), np.int64)
    for s, name in enumerate(mixture.names):
        want = mixture.weights[s] * batch_size
        c = counts[:, s]
        per_batch[name] = {"expected": round(want, 3), "min": int(c.min()) if c.size else None,
                           "max": int(c.max()) if c.size else None,
                           "max_deviation": round(float(np.abs(c - want).max()), 3) if c.size else None}
    # distance between two deliveries of the same sample: sort positions by id, consecutive equal ids
    pos = np.arange(len(ids))
    by_id = np.lexsort((pos, ids))
    same = ids[by_id][1:] == ids[by_id][:-1]
    gaps = (pos[by_id][1:] - pos[by_id][:-1])[same]
    gap_src = src[by_id][1:][same]
    repeat = {}
    for s, name in enumerate(mixture.names):
        g = gaps[gap_src == s]
        repeat[name] = {"repeats": int(g.size), "min": int(g.min()) if g.size else None,
                        "median": float(np.median(g)) if g.size else None}
    per_epoch = mixture.schedule(seed).per_epoch(epoch)
    sources = [{"name": name, "path": str(ds.root), "samples": len(ds), "share": round(w, 6),
                "per_epoch": int(m), "cycles": round(int(m) / len(ds), 3)}
               for name, ds, w, m in zip(mixture.names, mixture.datasets, mixture.weights, per_epoch.tolist())]
    return {"samples_per_epoch": n, "seed": seed, "epoch": epoch, "epochs": epochs, "shuffle": shuffle,
            "batch_size": batch_size, "batches": int(counts.shape[0]), "sources": sources,
            "per_batch": per_batch, "repeat_distance": repeat}
