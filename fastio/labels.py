"""The class label rule, in one place: a label is an integer in ``0 .. 2**63 - 1`` (it fits int64 and is
not negative), stored in a sample as ASCII decimal text (the ``cls`` field).

The converters check labels with :func:`check_label` before anything is written; the Loader parses them
back with :func:`parse_label` (:func:`parse_labels` for a batch). They raise ``ValueError`` with a reason
that names the value, not the sample: the caller adds the table line, file, shard or key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LABEL_MAX", "check_label", "label_bytes", "parse_label", "parse_labels"]

LABEL_MAX = 2**63 - 1  # int64


def check_label(value: int | str | bytes) -> int:
    """``value`` (an int, or its decimal text) as a label; ValueError saying why it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"label {value!r} is not an integer")
    if isinstance(value, int):
        number = value
    else:
        text = value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
        text = text.strip()
        if not text:
            raise ValueError("empty label")
        digits = text[1:] if text[:1] in "+-" else text
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"label {text[:32]!r} is not an integer")
        if len(digits) > 19:  # int() of a huge decimal string is quadratic: refuse before converting
            raise ValueError(f"label {text[:32]}{'…' if len(text) > 32 else ''} does not fit int64")
        number = int(text)
    if number < 0:
        raise ValueError(f"label {number} is negative")
    if number > LABEL_MAX:
        raise ValueError(f"label {number} does not fit int64")
    return number


def label_bytes(value: int | str | bytes) -> bytes:
    """The stored form of a label: its ASCII decimal text (after :func:`check_label`)."""
    return str(check_label(value)).encode()


def parse_label(data: bytes) -> int:
    """The label stored as ``data``; ValueError saying why it is not one."""
    return check_label(bytes(data))


def parse_labels(values: Sequence[bytes | np.ndarray]) -> np.ndarray:
    """The labels stored as ``values`` (one batch), as int64; ``ValueError`` for the first that is not one.
    The text fastio writes (1 to 18 ASCII digits, which always fits int64) is parsed in one pass; anything
    else goes through :func:`parse_label` one by one."""
    texts = [bytes(v) for v in values]
    if texts and all(0 < len(t) < 19 for t in texts) and b"".join(texts).isdigit():
        return np.array([int(t) for t in texts], dtype=np.int64)
    return np.array([parse_label(t) for t in texts], dtype=np.int64)
