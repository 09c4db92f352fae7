"""The one rule for what a DEST string names: a local path (or ``file://``), or an object-store URL.

``s3://bucket/prefix`` is an object store; any other ``scheme://`` is an error naming the URL, never a
local path (``fastio convert SRC s3:/x`` must not create a folder named ``s3:``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from fastio.errors import StorageError

__all__ = ["REMOTE_SCHEMES", "Location", "dest_location", "is_remote", "join_key", "local_folder", "local_or_url",
           "parse_location", "refuse_empty"]

REMOTE_SCHEMES = ("s3",)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class Location:
    """Where a DEST lives: ``scheme`` is ``"file"`` (``path`` set) or ``"s3"`` (``bucket`` and ``prefix`` set)."""

    scheme: str
    url: str
    """The DEST as given, for messages (an ``s3://`` URL without a trailing slash)."""
    path: Path | None = None
    bucket: str = ""
    prefix: str = ""
    """Key prefix inside the bucket, without leading or trailing ``/`` ("" for the bucket's root)."""

    @property
    def remote(self) -> bool:
        return self.scheme != "file"


def join_key(prefix: str, key: str) -> str:
    """``prefix/key`` without doubled or leading slashes."""
    key = key.lstrip("/")
    return f"{prefix}/{key}" if prefix and key else prefix or key


def is_remote(dest: str | Path) -> bool:
    """True for an object-store URL (``s3://...``); False for a local path; StorageError for another scheme."""
    return parse_location(dest).remote


def local_or_url(dest: str | Path) -> str | Path:
    """A DEST as the code keeps it: an object-store URL as the string given, anything else as its local Path
    (``file:///abs/path`` is ``/abs/path``, never a folder named ``file:``); StorageError as :func:`parse_location`."""
    location = parse_location(dest)
    return str(dest) if location.remote else location.path


def local_folder(value: str | Path, what: str) -> Path:
    """A folder that holds this node's own files (``cache_dir``, a ``staging_dir``) as a Path: a local path, or
    ``file:///abs/path`` given as a str; StorageError naming ``what`` for any other URL, also one that pathlib
    mangled (``Path("s3://b/x")`` is ``s3:/b/x``), never a local folder named ``s3:``."""
    text = str(value)
    m = _SCHEME.match(text)
    if m is None:
        return Path(value)
    if isinstance(value, str) and m[1].lower() == "file" and text.lower().startswith("file://"):
        return parse_location(text).path
    raise StorageError(f"{what} {text}: must be a local directory (a path, or file:///absolute/path), not a URL",
                       url=text)


def dest_location(dest: str | Path) -> str | Path:
    """A folder fastio writes into (a conversion's or an index's DEST, a checkpoint directory) as it keeps it
    (:func:`local_or_url`), a local one as the OS will find it once its missing folders are made
    (:func:`_as_made`)."""
    where = local_or_url(dest)
    return _as_made(where) if isinstance(where, Path) else where


def _as_made(path: Path) -> Path:
    """``path`` with ``..`` folded in its part that does not exist yet (``x/new/../ds`` with no ``x/new`` is
    ``x/ds``), the part that exists kept as written. Made as written, ``x/new`` would be made on the way and left
    behind, and ``x/ds`` judged (is it there, does it hold a dataset) by a path that does not lead to it yet. Only
    the missing part is folded: no link can be in it, while in the existing part ``link/..`` is the folder above
    the link's target, which folding would change."""
    parts = path.parts
    missing = next((k for k in range(1, len(parts) + 1) if not os.path.lexists(Path(*parts[:k]))), None)
    if missing is None:
        return path
    return Path(*parts[:missing - 1], os.path.normpath(os.path.join(*parts[missing - 1:])))


def refuse_empty(path: str | Path) -> None:
    """StorageError where ``path`` is a str that is empty or only spaces: a shell variable that is not set
    (``"$DEST"``), never the current folder, which ``Path("")`` is (a DEST replaced with ``overwrite`` is emptied)."""
    if isinstance(path, str) and not path.strip():
        raise StorageError(f"the path given is empty ({path!r}): name the folder ('.' for the current one)", url=path)


def _refuse_colon_left_out(text: str) -> None:
    """StorageError where a local path reads as a remote URL with its ``:`` left out (``s3//bucket/ds``): a dataset
    converted there would land in a local ``s3/bucket/ds`` while its user believes it is on S3 (``./s3//x`` is
    a local path)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*)//", text)
    if m and m[1].lower() in REMOTE_SCHEMES:
        url = f"{m[1].lower()}://{text[m.end():]}"
        raise StorageError(f"{text}: looks like {url} with its ':' left out; write ./{text} for a local folder",
                           url=text)


def parse_location(dest: str | Path) -> Location:
    """Parse a DEST: a local path, ``file:///abs/path``, or ``s3://bucket[/prefix]``; an empty one is refused
    (:func:`refuse_empty`)."""
    refuse_empty(dest)
    if isinstance(dest, Path):
        if _SCHEME.match(str(dest)):  # Path("s3://b/x") is "s3:/b/x": a URL mangled by pathlib, never a folder
            raise StorageError(f"{dest}: looks like a URL passed as a Path (pass URLs as str)", url=str(dest))
        return Location("file", str(dest), path=dest)
    text = str(dest)
    m = _SCHEME.match(text)
    if m is None:
        _refuse_colon_left_out(text)
        return Location("file", text, path=Path(text))
    scheme = m[1].lower()
    if scheme == "file":
        if not text.lower().startswith("file://"):
            raise StorageError(f"{text}: a file URL is file:///absolute/path", url=text)
        return Location("file", text, path=Path(unquote(text[len("file://"):]) or "/"))
    if scheme not in REMOTE_SCHEMES:
        raise StorageError(f"{text}: unsupported URL scheme {scheme!r} (fastio reads local paths, file:// and "
                           f"{', '.join(s + '://' for s in REMOTE_SCHEMES)})", url=text)
    if not text[m.end():].startswith("/"):
        raise StorageError(f"{text}: an S3 URL is s3://bucket/prefix", url=text)
    rest = text[m.end() + 1:]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise StorageError(f"{text}: {bucket!r} is not a valid bucket name", url=text)
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StorageError(f"{text}: key prefix {prefix!r} has an empty, '.' or '..' part", url=text)
    return Location(scheme, f"{scheme}://{join_key(bucket, prefix)}", bucket=bucket, prefix=prefix)
