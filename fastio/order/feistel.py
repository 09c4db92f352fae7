"""A keyed pseudo-random permutation of ``[0, n)``, evaluated at any positions: the primitive under every
order fastio computes (one dataset's :class:`~fastio.order.sampler.EpochOrder`, a mixture's cycling sources,
the token packers' block and document orders).

A Feistel network over the smallest power of two >= n (halves of floor(bits/2) and ceil(bits/2) bits, their
widths swapping each round), with cycle walking (re-encrypt until the value falls below n), which keeps it a
permutation of [0, n). Round keys come from sha256 of (seed, epoch, fingerprint, shuffle, purpose); the round
function is the splitmix64 finaliser. Everything is vectorised over arrays of positions; nothing of size n is
ever built. Changing anything here changes every order: :data:`ORDER_ALGORITHM` names it, and the Loader's
state version changes with it.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["GOLDEN", "ORDER_ALGORITHM", "domain_bits", "feistel", "permute", "round_keys"]

ORDER_ALGORITHM = "feistel-v2"
"""Names the order the permutation computes (the loader state's version changes with it)."""
_ROUNDS = 6  # even, so that the halves end at their starting widths
_U64 = np.uint64
GOLDEN = _U64(0x9E3779B97F4A7C15)
"""The 64-bit golden ratio: spreads a small integer (a window, a block) into a tweak."""


def round_keys(seed: int, shuffle: str, epoch: int, fingerprint: str, purpose: str) -> tuple[np.uint64, ...]:
    """The round keys of one permutation: a pure function of its arguments (``purpose`` separates the
    permutations one epoch uses: ``"samples"``, ``"windows"``, ``"shards"``, ``"token-blocks"``, ...)."""
    base = f"fastio-order:{ORDER_ALGORITHM}:{seed}:{epoch}:{fingerprint}:{shuffle}:{purpose}"
    return tuple(_U64(int.from_bytes(hashlib.sha256(f"{base}:{r}".encode()).digest()[:8], "little"))
                 for r in range(_ROUNDS))


def domain_bits(n: int) -> int:
    """Width of the Feistel domain for n values (at least 2 bits, so that both halves are non-empty)."""
    return max(2, (int(n) - 1).bit_length())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64, wrapping): every output bit depends on every input bit."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def feistel(x: np.ndarray, bits, keys, tweak) -> np.ndarray:
    """One encryption of ``x`` < 2**bits (uint64; ``bits`` and ``tweak`` scalars or per-element arrays)."""
    if not any(isinstance(a, np.ndarray) for a in (bits, tweak, *keys)) and x.size >= 4 << ((int(bits) + 1) // 2):
        return _tabled(x, int(bits), keys, tweak)
    wl = bits >> _U64(1)
    wr = bits - wl
    one = _U64(1)
    left, right = x >> wr, x & ((one << wr) - one)
    for key in keys:
        f = _mix((right + key) ^ tweak)
        left, right = right, (left ^ f) & ((one << wl) - one)
        wl, wr = wr, wl
    return (left << wr) | right


def _tabled(x: np.ndarray, bits: int, keys, tweak) -> np.ndarray:
    """:func:`feistel` with scalar arguments over many values: each round's function of the right half, for
    its every value (fewer than ``x.size / 4``), computed at once for all rounds into a table and looked up
    instead of computed for each element."""
    wl = bits >> 1
    wr = bits - wl
    widths = [(wl, wr) if r % 2 == 0 else (wr, wl) for r in range(len(keys))]  # (left, right) each round
    values = np.arange(1 << max(wl, wr), dtype=_U64)
    masks = np.array([(1 << w) - 1 for w, _ in widths], _U64)[:, None]
    tables = (_mix((values[None, :] + np.array(keys, _U64)[:, None]) ^ _U64(tweak)) & masks).astype(np.intp)
    left, right = (x >> _U64(wr)).astype(np.intp), (x & _U64((1 << wr) - 1)).astype(np.intp)
    for table in tables:
        left, right = right, left ^ table[right]
    return ((left << widths[-1][0]) | right).astype(_U64)


def permute(x: np.ndarray, n, bits, keys, tweak) -> np.ndarray:
    """The keyed permutation of [0, n) at ``x`` (int64 < n), by cycle walking; per-element or scalar
    ``n``/``bits``/``tweak`` and round keys (``keys``: a tuple of scalars, or of per-element arrays)."""
    def pick(a, i):
        return a[i] if isinstance(a, np.ndarray) else a

    n, bits, tweak = (a.astype(_U64) if isinstance(a, np.ndarray) else _U64(a) for a in (n, bits, tweak))
    out = feistel(x.astype(_U64), bits, keys, tweak)
    todo = np.flatnonzero(out >= n)
    while todo.size:
        y = feistel(out[todo], pick(bits, todo), tuple(pick(k, todo) for k in keys), pick(tweak, todo))
        out[todo] = y
        todo = todo[y >= pick(n, todo)]
    return out.astype(np.int64)
