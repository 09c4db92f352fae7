"""One period of a mixture's source schedule and the integer weights it is laid out from, against the
implementations they replaced (kept below as small pure-Python references): the order is a pure function of
(seed, epoch) that runs depend on, so a faster layout must give the very same positions for every input, ties
included (a resume across versions delivers the same samples)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest

from fastio.order.mixorder import MAX_PERIOD, _period, integer_weights


def _reference_period(n):
    """The largest-deficit layout as fastio 0.x computed it: one Python ``max`` over the sources per position."""
    w = sum(n)
    src, rank, count = [], [], [0] * len(n)
    for q in range(w):
        s = max(range(len(n)), key=lambda s: (n[s] * (q + 1) - w * count[s], -s))
        src.append(s)
        rank.append(count[s])
        count[s] += 1
    return src, rank


def _reference_integer_weights(weights):
    fr = [Fraction(w).limit_denominator(MAX_PERIOD) for w in weights]
    if all(f > 0 for f in fr):
        lcm = math.lcm(*(f.denominator for f in fr))
        ints = [int(f * lcm) for f in fr]
        g = math.gcd(*ints)
        ints = [i // g for i in ints]
        if sum(ints) <= MAX_PERIOD and all(abs(i / sum(ints) - w / sum(weights)) < 1e-12 for i, w in zip(ints, weights)):
            return tuple(ints)
    total = float(sum(weights))
    quota = [w / total * MAX_PERIOD for w in weights]
    ints = [max(1, int(q)) for q in quota]
    order = sorted(range(len(quota)), key=lambda s: quota[s] - int(quota[s]), reverse=True)
    k = 0
    while sum(ints) < MAX_PERIOD:
        ints[order[k % len(order)]] += 1
        k += 1
    while sum(ints) > MAX_PERIOD:
        s = max(range(len(ints)), key=lambda s: ints[s])
        ints[s] -= 1
    return tuple(ints)


def _check(n):
    n = tuple(n)
    src, rank = _period.__wrapped__(n)
    want_src, want_rank = _reference_period(n)
    assert src.dtype == rank.dtype == np.int64 and not src.flags.writeable and not rank.flags.writeable
    first = np.flatnonzero(src != np.array(want_src))
    assert first.size == 0, f"counts {n}: position {first[:1]} differs from the reference layout"
    assert rank.tolist() == want_rank, f"counts {n}: ranks differ from the reference"


def _random_counts(rng):
    m = rng.choice([1, 2, 3, 4, 5, 8, 13, 40, 100, 300])
    budget = min(MAX_PERIOD, max(m, 30_000 // m))  # the reference costs sources x period
    kind = rng.choice(["random", "equal", "dominant", "ties", "small"])
    if kind == "equal":
        return [rng.randint(1, max(1, budget // m))] * m
    if kind == "dominant":
        return [budget - (m - 1)] + [1] * (m - 1) if budget > m else [1] * m
    if kind == "ties":
        values = [rng.randint(1, max(1, budget // (2 * m))) for _ in range(3)]
        return [rng.choice(values) for _ in range(m)]
    if kind == "small":
        return [rng.randint(1, 3) for _ in range(m)]
    cuts = sorted(rng.sample(range(1, budget), m - 1)) if m > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, budget])]


@pytest.mark.parametrize("seed", range(8))
def test_the_period_is_the_reference_layout_for_random_counts(seed):
    rng = random.Random(seed)
    for _ in range(25):
        _check(_random_counts(rng))


@pytest.mark.parametrize("counts", [
    (1,), (5,), (1, 1), (2, 1), (1, 2), (3, 3, 3), (7, 3), (MAX_PERIOD - 1, 1), (1, MAX_PERIOD - 1),
    (MAX_PERIOD // 2, MAX_PERIOD // 2), (21845, 21845, 21846), (40000, 25535, 1), (1,) * 300, (2,) * 150 + (1,) * 150,
    (1,) * 150 + (200,) + (1,) * 149, (3, 5, 7, 11, 13) * 60])
def test_the_period_is_the_reference_layout_for_edge_counts(counts):
    """Whole periods of MAX_PERIOD positions, one dominant source (first, last, in the middle), equal weights."""
    _check(counts)


def test_integer_weights_are_the_reference_ones():
    rng = random.Random(7)
    cases = [[1.0], [0.7, 0.3], [3, 1], [1 / 3, 2 / 3], [1e6, 15.26], [MAX_PERIOD - 1, 1], [1.0] * 1000,
             [1.0] * 700 + [3.0] * 300, [1.0 + 1e-9 * i for i in range(1000)], [2.0 ** -k for k in range(16)]]
    for _ in range(20):
        m = rng.choice([2, 3, 10, 100, 300])
        cases.append([rng.uniform(0.5, 2.0) for _ in range(m)])
        cases.append([rng.choice([1.0, 1.0 + 1e-9, 2.5]) for _ in range(m)])
    for weights in cases:
        assert integer_weights(weights) == _reference_integer_weights(weights), f"weights {weights[:5]}..."
