"""How a mixture's order looks (``fastio inspect --order MIX.json``): proportions in every global batch and how
soon each source's samples come back, computed from the pure order alone (:mod:`fastio.order.mixorder`; no sample
bytes are read)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio.order.sampler import SHUFFLE_MODES, SamplerSpec
from fastio.read.mixture import Mixture

__all__ = ["mixture_order_report"]


def mixture_order_report(mixture: Mixture, *, seed: int = 0, epoch: int = 0, batch_size: int = 256,
                         shuffle: str = "global", block_shards: int = 4, epochs: int = 2, seq_len: int = 2048,
                         packing: str = "concat", window: int = 4096) -> dict[str, Any]:
    """Mixture epochs ``epoch .. epoch + epochs - 1`` of a Loader with ``seed``/``shuffle``/``block_shards``, in
    global batches of ``batch_size`` (capped at the epoch). A mixture of token datasets is reported in packed
    sequences of ``fastio.Tokens(seq_len, packing, window)`` (``unit``: ``sequences``, else ``samples``; each
    source's ``samples`` is then its sequences). JSON-serialisable:

    - ``samples_per_epoch``, counted in ``unit`` (plural) and ``unit_singular`` (``sample``, ``sequence``: for a
      count of one, as ``fastio.words.count(n, unit_singular, unit)`` words it);

    - ``sources``: per source its path, samples, share (the normalised weight at the first inspected position),
      samples per mixture epoch ``epoch`` (``per_epoch``) and how many times that covers the source
      (``cycles``);
    - ``per_batch``: per source over the full batches of those epochs, the expected count (share x batch; None
      where a schedule makes it differ between batches), the min and max count, and ``max_deviation`` = max
      |count - expected| (each batch against its own expected count: a batch across a schedule's change
      expects each phase's share of its part);
    - ``phases``: the schedule's phases that reach into those epochs: ``position`` (stream position where it
      starts), ``shares``, ``batches`` (full batches wholly inside it) and ``per_batch`` over those batches as
      above;
    - ``repeat_distance``: per source, the positions between two deliveries of the same sample (``min``,
      ``median``; ``repeats`` = how many deliveries were repeats; all None without a repeat).

    ValueError where one of those epochs is past the order's reach (:func:`_check_epochs`)."""
    _check_arguments(shuffle, batch_size, epochs)
    unit, one = "samples", "sample"
    if mixture.datasets[0].manifest.tokens is not None:  # a token mixture (Mixture() refuses mixed kinds)
        from fastio.tokens.loading import source_packings

        sized = source_packings(mixture, seq_len, packing, window, SamplerSpec(seed=seed, shuffle=shuffle))
        mixture, unit, one = mixture.in_units([p.sequences for p in sized]), "sequences", "sequence"
    n = len(mixture)
    batch_size = min(batch_size, n)
    sampler = mixture.sampler(SamplerSpec(seed=seed, shuffle=shuffle, block_shards=block_shards))
    _check_epochs(sampler, epoch, epochs)
    ids = np.concatenate([sampler.order(e)[np.arange(n)] for e in range(epoch, epoch + epochs)])
    src, _ = mixture.split(ids)
    counts, expected, phase = _full_batches(mixture, seed, src, epoch, epochs, batch_size)
    schedule = mixture.schedule(seed)
    first, last = schedule.phase_of(np.array([epoch * n, (epoch + epochs) * n - 1])).tolist()
    phases = [_phase(mixture, i, phase, counts, expected) for i in range(first, last + 1)]
    sources = [{"name": name, "path": str(ds.root), "samples": size, "share": round(w, 6), "per_epoch": int(m),
                "cycles": round(int(m) / size, 3)}
               for name, ds, size, w, m in zip(mixture.names, mixture.datasets, mixture.sizes,
                                               mixture.phases[first][1], schedule.per_epoch(epoch).tolist())]
    return {"samples_per_epoch": n, "unit": unit, "unit_singular": one, "seed": seed, "epoch": epoch, "epochs": epochs,
            "shuffle": shuffle, "batch_size": batch_size, "batches": int(counts.shape[0]), "sources": sources,
            "per_batch": _per_batch(mixture.names, counts, expected), "phases": phases,
            "repeat_distance": _repeat_distance(mixture, ids, src)}


def _check_epochs(sampler: Any, epoch: int, epochs: int) -> None:
    """ValueError naming the report's epochs where one of them is past the order's reach (as set_epoch refuses it:
    past the order's int64 positions numpy would wrap or raise)."""
    for e in range(epoch, epoch + epochs):
        try:
            sampler.check_epoch(e)
        except ValueError as err:
            raise ValueError(f"the report's epochs {epoch}..{epoch + epochs - 1}: {err}") from None


def _check_arguments(shuffle: str, batch_size: int, epochs: int) -> None:
    """ValueError naming the argument of :func:`mixture_order_report` out of its range."""
    if shuffle not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be one of {', '.join(SHUFFLE_MODES)}, got {shuffle!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if epochs < 1:
        raise ValueError(f"epochs must be positive, got {epochs}")


def _phase(mixture: Mixture, i: int, phase: np.ndarray, counts: np.ndarray, expected: np.ndarray) -> dict[str, Any]:
    """The report of the schedule's phase ``i`` over the full batches wholly inside it (``phase``: the phase of
    each batch's positions)."""
    pos, shares = mixture.phases[i]
    mine = (phase == i).all(axis=1)
    return {"position": pos, "shares": {k: round(w, 6) for k, w in zip(mixture.names, shares)},
            "batches": int(mine.sum()), "per_batch": _per_batch(mixture.names, counts[mine], expected[mine])}


def _full_batches(mixture: Mixture, seed: int, src: np.ndarray, epoch: int, epochs: int,
                  batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the full global batches of the epochs (``src``: the source at each of their positions): each
    batch's count per source, its expected count per source (the share of each position's phase, summed) and
    the phase of each of its positions."""
    n, k = len(mixture), len(mixture.names)
    full = n // batch_size
    within = np.arange(full * batch_size).reshape(full, batch_size)
    rows = np.concatenate([j * n + within for j in range(epochs)])  # into src
    stream = np.concatenate([e * n + within for e in range(epoch, epoch + epochs)])
    phase = mixture.schedule(seed).phase_of(stream)
    shares = np.asarray([w for _, w in mixture.phases], float)
    counts = np.stack([np.bincount(b, minlength=k) for b in src[rows]]) if full else np.zeros((0, k), np.int64)
    return counts, shares[phase].sum(axis=1) if full else np.zeros((0, k)), phase


def _per_batch(names: tuple[str, ...], counts: np.ndarray, expected: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per source: the expected count (None unless the same in every batch), min, max, max |count - expected|."""
    out = {}
    for s, name in enumerate(names):
        c, want = counts[:, s], expected[:, s]
        same = c.size and np.allclose(want, want[0])
        out[name] = {"expected": round(float(want[0]), 3) if same else None,
                     "min": int(c.min()) if c.size else None, "max": int(c.max()) if c.size else None,
                     "max_deviation": round(float(np.abs(c - want).max()), 3) if c.size else None}
    return out


def _repeat_distance(mixture: Mixture, ids: np.ndarray, src: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per source: positions between two deliveries of the same sample (sort positions by id, consecutive
    equal ids)."""
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
    return repeat
