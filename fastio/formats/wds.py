"""WebDataset naming rules, in one place: sample keys, tar member names, field names (extensions).

A sample is stored as tar members ``KEY.FIELD``; readers split a member name at the first dot of its
basename (:func:`split_member_name`), so keys hold no dots and fields may (``seg.png``). Names stay
within the 100 characters of a USTAR name field: longer ones would need PAX headers, which DALI's
reader does not expect. The converters make keys and fields with :func:`sanitize_key` and
:func:`safe_field_name`; the shard writer refuses anything else with :func:`check_member`.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "MAX_KEY",
    "MAX_NAME",
    "check_member",
    "field_of",
    "is_field_name",
    "is_key",
    "is_plain_name",
    "member_name",
    "safe_field_name",
    "sanitize_key",
    "split_member_name",
]

MAX_NAME = 100  # USTAR name field
MAX_KEY = 80  # leaves room for the field name within MAX_NAME
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-/]")
_FIELD = re.compile(r"[A-Za-z0-9_\-.]+")
_FIELD_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")
_PLAIN = re.compile(r"[A-Za-z0-9_\-]+")


def sanitize_key(text: str) -> str:
    """A WebDataset key from a path-like string: ASCII letters, digits, ``_ - /`` only, no dots.

    Keys longer than :data:`MAX_KEY` keep their first 63 characters and a hash of ``text``.
    """
    key = _KEY_UNSAFE.sub("_", text).strip("/")
    if len(key) > MAX_KEY:
        key = key[:63] + "_" + hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return key or "_"


def is_key(key: object) -> bool:
    """Whether ``key`` is a key :func:`sanitize_key` leaves as it is."""
    return isinstance(key, str) and sanitize_key(key) == key


def safe_field_name(name: str) -> str:
    """A field name from free text (a column name): letters, digits, ``_`` and ``-``; others become ``_``."""
    return _FIELD_UNSAFE.sub("_", name.strip()) or "_"


def is_field_name(name: object) -> bool:
    """Whether ``name`` may name a field (a tar extension): letters, digits, ``_``, ``-`` and ``.``."""
    return isinstance(name, str) and _FIELD.fullmatch(name) is not None


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is letters, digits, ``_`` and ``-`` only: shard name prefixes and split names."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None


def field_of(suffix: str) -> str:
    """The field a member's suffix names in a WebDataset tar: lowercased, as WebDataset's reader does
    (``group_by_keys(lcase=True)``): ``a.JPG`` is field ``jpg``, and ``a.cls`` with ``a.CLS`` is one field twice."""
    return suffix.lower()


def member_name(key: str, field: str) -> str:
    """The tar member name of ``field`` of sample ``key``."""
    return f"{key}.{field}"


def split_member_name(name: str) -> tuple[str, str]:
    """Split a tar member name into (key, field) at the first dot of its basename, as WebDataset does."""
    dot = name.find(".", name.rfind("/") + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def check_member(key: str, field: str) -> None:
    """ValueError naming the sample unless ``field`` is a field name and the member name fits USTAR."""
    if not is_field_name(field):
        raise ValueError(f"sample {key!r}: field name {field!r} is not a safe tar extension")
    name = member_name(key, field)
    if len(name) > MAX_NAME:
        raise ValueError(f"sample {key!r}: member name {name} is over {MAX_NAME} characters")
