"""The class label rule, in one place: a label is an integer in ``0 .. 2**63 - 1`` (it fits int64 and is
not negative), stored in a sample as ASCII decimal text (the ``cls`` field).

The converters check labels with :func:`check_label` before anything is written; the Loader parses them
back with :func:`parse_label` (:func:`parse_labels` for a batch). They raise ``ValueError`` with a reason
that names the value, not the sample: the caller adds the table line, file, shard or key.

A table's label column follows one of two rules (:data:`LABEL_RULES`), chosen by :func:`choose_label_rule`
and recorded in the manifest as ``label_rule``:

- ``integers``: every label cell is integral (``2``, ``2.0``, ``" 2"``, a JSON ``2.0``, a float column's
  ``2.0``, a decimal column's ``2.00``): the label is that number.
- ``names``: the cells are class names (text as written, blanks around it removed; other JSON values as
  JSON), numbered ``0, 1, ...`` in sorted order and listed in the manifest's ``label_map``.

``auto`` (the default) takes ``integers`` when every cell is integral and ``names`` when none is; a mix is an
error naming rows of each kind (one odd cell would otherwise renumber every label), unless the user asks for
``names``. Empty cells (blank text, null, NaN) are not labels: the converter skips and lists their rows.
"""

from __future__ import annotations

import decimal
import json
import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["LABEL_CHOICES", "LABEL_MAX", "LABEL_RULES", "check_label", "choose_label_rule", "integral_text",
           "is_empty_label", "label_bytes", "label_name", "parse_label", "parse_labels"]

LABEL_MAX = 2**63 - 1  # int64
LABEL_RULES = {
    "integers": "each label is its integral value",
    "names": "labels are class names, numbered in sorted order (label_map)",
}
"""The rules a dataset's labels follow (the manifest's ``label_rule``), with the phrase the summary prints."""
LABEL_CHOICES = ("auto", *LABEL_RULES)
"""What a user may ask for (``labels=`` / ``--labels``): ``auto`` picks a rule from the values."""

_INTEGRAL = re.compile(r"([+-]?[0-9]+)(?:\.0*)?")
_SHOWN = 3  # rows named per kind in a mixed-labels error


def is_empty_label(value: Any) -> bool:
    """A missing label cell: None, blank text or NaN."""
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, decimal.Decimal) and value.is_nan()) or (
        isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value))


def integral_text(value: Any) -> str | None:
    """The decimal text of an integral label cell (``2``, ``2.0``, ``" 2"``, ``"2.00"``, ``-1``), else None
    (booleans, fractions, other text, lists, ...). Range is :func:`check_label`'s business."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):  # also numpy's integers
        return str(int(value))
    if isinstance(value, decimal.Decimal):  # a parquet decimal column's cells
        return str(int(value)) if value.is_finite() and value == value.to_integral_value() else None
    if isinstance(value, numbers.Real):  # float, numpy's floats
        return str(int(value)) if math.isfinite(value) and value == int(value) else None
    if isinstance(value, (str, bytes)):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        match = _INTEGRAL.fullmatch(text.strip())
        return match.group(1).lstrip("+") if match and match.group(1).isascii() else None
    return None


def label_name(value: Any) -> str:
    """A label cell as a class name: text without surrounding blanks; other values as JSON (what JSON has no
    form for, a parquet date or decimal, as its text)."""
    return value.strip() if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def choose_label_rule(cells: Sequence[tuple[str, Any]], wanted: str = "auto") -> str:
    """The rule (a key of :data:`LABEL_RULES`) for the non-empty label ``cells``, given as (row, value).

    ``wanted`` is one of :data:`LABEL_CHOICES`. ValueError when ``auto`` meets a mix of integral and other
    values, or ``integers`` meets a value that is not integral, naming rows of each kind."""
    if wanted not in LABEL_CHOICES:
        raise ValueError(f"labels must be one of {', '.join(LABEL_CHOICES)}, got {wanted!r}")
    if wanted == "names":
        return "names"
    other = [(where, value) for where, value in cells if integral_text(value) is None]
    if not other:
        return "integers"
    if wanted == "auto" and len(other) == len(cells):
        return "names"

    def rows(items: list[tuple[str, Any]]) -> str:
        shown = ", ".join(f"{where} ({value!r})"[:60] for where, value in items[:_SHOWN])
        return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")

    others = rows(other)
    if wanted == "integers":
        raise ValueError(f"labels='integers', but some labels are not integral: {others}")
    integral = [(where, value) for where, value in cells if integral_text(value) is not None]
    raise ValueError(f"labels mix integral values ({rows(integral)}) and others ({others}); fix those rows, "
                     "or pass labels='names' to treat every label as a class name")


def check_label(value: int | str | bytes) -> int:
    """``value`` (an int, or its decimal text) as a label; ValueError saying why it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"label {value!r} is not an integer")
    if isinstance(value, int):
        number = value
    else:
        # bytes: a file's text, a UTF-8 byte order mark dropped (Windows tools write one), other bytes shown as \xNN
        text = value.decode("utf-8-sig", "backslashreplace") if isinstance(value, (bytes, bytearray)) else str(value)
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
