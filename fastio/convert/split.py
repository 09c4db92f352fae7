"""How ``convert --split`` draws its subsets: a pure function of the scan order, the labels and the seed.

``by="random"``: the entries are shuffled with the seed and each split takes ``round(fraction * n)`` of them in
turn; ``train`` keeps the rest.

``by="label"`` (stratified; the default when the source has labels): each split takes the same fraction of
every class. Its size is still ``round(fraction * n)``; each class gives ``floor(fraction * n_class)`` samples
and the samples left to reach that size go, one each, to the classes with the largest remainders (ties in an
order drawn from the seed). So a class with at least ``1 / fraction`` samples (10 for ``val=0.1``) always
appears in that split. Which samples of a class go where is drawn from the seed and the class.

Nothing here reads files or knows the output; the result is the same for every run, part and worker count.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence

from fastio.progress import count

__all__ = ["SPLIT_BY", "assign_splits"]

SPLIT_BY = ("label", "random")


def assign_splits(n: int, fractions: dict[str, float], seed: int, labels: Sequence[Hashable] | None = None
                  ) -> dict[str, list[int]]:
    """Sorted entry indices per split name (``train`` first: the remainder), stratified by ``labels`` (one per
    entry) when given, else drawn at random. ``fractions`` as :func:`fastio.convert.run.parse_split` returns them.
    Raises ValueError naming the split that would be empty, or ``train`` when nothing is left for it."""
    sizes = {}
    for name, frac in fractions.items():
        size = round(frac * n)
        if size == 0:
            raise ValueError(f"split fraction {frac} for {name!r} of {count(n, 'sample')} leaves it empty")
        sizes[name] = size
    if sum(sizes.values()) >= n:
        raise ValueError(f"split fractions {', '.join(map(str, fractions.values()))} of {count(n, 'sample')} leave "
                         "train empty")
    if labels is None:
        order = list(range(n))
        random.Random(f"{seed}:split").shuffle(order)
        groups, start = {}, 0
        for name, size in sizes.items():
            groups[name] = sorted(order[start:start + size])
            start += size
        return {"train": sorted(order[start:]), **groups}
    return _stratified(n, fractions, sizes, seed, labels)


def _stratified(n: int, fractions: dict[str, float], sizes: dict[str, int], seed: int,
                labels: Sequence[Hashable]) -> dict[str, list[int]]:
    classes: dict[Hashable, list[int]] = {}
    for i, label in enumerate(labels):
        classes.setdefault(label, []).append(i)
    names = sorted(classes, key=repr)
    for name in names:
        random.Random(f"{seed}:split:{name!r}").shuffle(classes[name])
    ties = names[:]
    random.Random(f"{seed}:split-ties").shuffle(ties)
    rank = {name: k for k, name in enumerate(ties)}
    left = {name: len(members) for name, members in classes.items()}
    taken = dict.fromkeys(names, 0)
    groups: dict[str, list[int]] = {}
    for split, frac in fractions.items():
        quota = {c: frac * len(classes[c]) for c in names}
        share = {c: min(left[c], math.floor(quota[c])) for c in names}
        short = sizes[split] - sum(share.values())
        for c in sorted(names, key=lambda c: (-(quota[c] - math.floor(quota[c])), rank[c])):
            if short <= 0:
                break
            if left[c] > share[c]:
                share[c] += 1
                short -= 1
        for c in sorted(names, key=lambda c: (-left[c], rank[c])):  # still short (tiny classes): the biggest give
            if short <= 0:
                break
            if left[c] > share[c]:
                share[c] += 1
                short -= 1
        picked = []
        for c in names:
            picked += classes[c][taken[c]:taken[c] + share[c]]
            taken[c] += share[c]
            left[c] -= share[c]
        groups[split] = sorted(picked)
    rest = sorted(i for c in names for i in classes[c][taken[c]:])
    return {"train": rest, **groups}
