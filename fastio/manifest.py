"""The manifest schema: ``DEST/manifest.json``, written last, whose presence makes DEST a dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fastio.atomic import atomic_write_bytes
from fastio.errors import DatasetError

__all__ = [
    "MANIFEST_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "SHARDS_DIR",
    "MARKER_NAME",
    "write_manifest",
    "load_manifest",
    "fingerprint",
]

MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
# Written first by a conversion: marks DEST as fastio's own output even before the manifest exists,
# so that an interrupted run can be redone in place without --overwrite.
MARKER_NAME = ".fastio-output"
FORMAT = "fastio-webdataset"
FORMAT_VERSION = 1

_SHARD_KEYS = ("name", "samples", "bytes", "sha256", "idx_sha256")


def write_manifest(dest: Path, manifest: dict[str, Any]) -> None:
    data = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    atomic_write_bytes(Path(dest) / MANIFEST_NAME, data)


def load_manifest(dest: Path) -> dict[str, Any]:
    """Read and validate ``DEST/manifest.json``; raise :class:`DatasetError` naming what is wrong."""
    path = Path(dest) / MANIFEST_NAME
    if not Path(dest).is_dir():
        raise DatasetError(f"{dest}: no such dataset directory")
    if not path.is_file():
        raise DatasetError(f"{dest}: not a fastio dataset (no {MANIFEST_NAME}; an interrupted conversion?)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{path}: not a fastio manifest (format is not {FORMAT!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(f"{path}: manifest format_version {version!r}, this fastio reads {FORMAT_VERSION}")
    for field in ("shards", "total_samples", "fields"):
        if field not in manifest:
            raise DatasetError(f"{path}: manifest lacks field {field!r}")
    for i, shard in enumerate(manifest["shards"]):
        missing = [k for k in _SHARD_KEYS if k not in shard]
        if missing:
            raise DatasetError(f"{path}: shards[{i}] lacks {', '.join(missing)}")
    if sum(s["samples"] for s in manifest["shards"]) != manifest["total_samples"]:
        raise DatasetError(f"{path}: total_samples does not equal the sum of shard sample counts")
    return manifest


def fingerprint(manifest: dict[str, Any]) -> str:
    """Identity of a dataset's content: shard names, counts and checksums, in order (16 hex digits)."""
    h = hashlib.sha256()
    for shard in manifest["shards"]:
        h.update(f"{shard['name']}:{shard['samples']}:{shard['sha256']}\n".encode())
    return h.hexdigest()[:16]
