"""Check a converted dataset against its manifest (``verify``) and describe it (``inspect``).

Both accept a dataset directory or a DEST written with ``--split`` (holding ``splits.json``), in
which case each split is handled and shard names are prefixed with the split name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastio.convert import SPLITS_NAME
from fastio.errors import DatasetError
from fastio.idx import parse_index
from fastio.images import IMAGE_FIELDS, ImageCheckError, check_image, image_size
from fastio.manifest import MANIFEST_NAME, SHARDS_DIR, load_manifest
from fastio.wds import split_member_name

__all__ = ["Problem", "VerifyReport", "inspect", "split_names", "verify"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset: which shard, which sample key (if any), what."""

    shard: str
    key: str | None
    what: str

    def line(self) -> str:
        return f"{self.shard}: {self.key}: {self.what}" if self.key else f"{self.shard}: {self.what}"


@dataclass
class VerifyReport:
    dest: Path
    shards: int = 0
    samples: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def split_names(dest: Path) -> list[str] | None:
    """Split names of a DEST written with --split, or None for a plain dataset directory."""
    dest = Path(dest)
    if (dest / MANIFEST_NAME).is_file() or not (dest / SPLITS_NAME).is_file():
        return None
    try:
        splits = json.loads((dest / SPLITS_NAME).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DatasetError(f"{dest / SPLITS_NAME}: unreadable split list ({err})") from None
    return sorted(splits)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_image(ext: str) -> bool:
    return ext.rsplit(".", 1)[-1].lower() in IMAGE_FIELDS


def _tar_samples(path: Path, decode: bool, report: VerifyReport, label: str):
    """[(key, ((ext, offset, size), ...)), ...] in tar order; member problems go into ``report``."""
    samples: list[tuple[str, list[tuple[str, int, int]]]] = []
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                report.problems.append(Problem(label, None, f"tar member {member.name!r} is not a regular file"))
                continue
            key, ext = split_member_name(member.name)
            if not ext:
                report.problems.append(Problem(label, key, f"tar member {member.name!r} has no field extension"))
                continue
            if samples and samples[-1][0] == key:
                samples[-1][1].append((ext, member.offset_data, member.size))
            else:
                samples.append((key, [(ext, member.offset_data, member.size)]))
            if decode and _is_image(ext):
                data = tar.extractfile(member).read()
                try:
                    check_image(data)
                    report.decoded += 1
                except ImageCheckError as err:
                    report.problems.append(Problem(label, key, f"field {ext}: {err}"))
    return samples


def _verify_one(root: Path, prefix: str, decode: bool, report: VerifyReport) -> None:
    manifest = load_manifest(root)
    for shard in manifest["shards"]:
        name = shard["name"]
        label = f"{prefix}{name}"
        tar_path = root / SHARDS_DIR / name
        idx_path = tar_path.with_suffix(".idx")
        report.shards += 1
        if not tar_path.is_file():
            report.problems.append(Problem(label, None, "shard file is missing"))
            continue
        if tar_path.stat().st_size != shard["bytes"]:
            report.problems.append(Problem(label, None, f"size {tar_path.stat().st_size} bytes, manifest says "
                                                        f"{shard['bytes']}"))
        if _sha256(tar_path) != shard["sha256"]:
            report.problems.append(Problem(label, None, "sha256 does not match the manifest"))
        entries = None
        if not idx_path.is_file():
            report.problems.append(Problem(label, None, f"index {idx_path.name} is missing"))
        else:
            if _sha256(idx_path) != shard["idx_sha256"]:
                report.problems.append(Problem(label, None, f"index {idx_path.name} sha256 does not match the manifest"))
            try:
                entries = parse_index(idx_path.read_text(), source=idx_path.name)
            except (ValueError, UnicodeDecodeError) as err:
                report.problems.append(Problem(label, None, f"index does not parse: {err}"))
        try:
            samples = _tar_samples(tar_path, decode, report, label)
        except (tarfile.TarError, OSError, EOFError) as err:
            report.problems.append(Problem(label, None, f"tar does not parse ({err})"))
            continue
        report.samples += len(samples)
        if len(samples) != shard["samples"]:
            report.problems.append(Problem(label, None, f"holds {len(samples)} samples, manifest says {shard['samples']}"))
        seen: set[str] = set()
        for key, _ in samples:
            if key in seen:
                report.problems.append(Problem(label, key, "key appears in two places (members not adjacent)"))
            seen.add(key)
        if entries is not None:
            for i, (key, members) in enumerate(samples):
                if i >= len(entries):
                    report.problems.append(Problem(label, key, "sample is missing from the index"))
                    break
                if entries[i].key != key or list(entries[i].members) != members:
                    report.problems.append(Problem(label, key, f"index entry {i} does not match the tar"))
            if len(entries) > len(samples):
                report.problems.append(Problem(label, entries[len(samples)].key, "index lists a sample the tar lacks"))


def verify(dest: str | Path, *, decode: bool = False) -> VerifyReport:
    """Recompute every shard's and index's sha256, parse every tar member, compare counts and the
    index with the manifest; with ``decode`` also decode every image. DatasetError if DEST is not a
    dataset at all; every other finding is a :class:`Problem` in the report."""
    dest = Path(dest)
    report = VerifyReport(dest)
    splits = split_names(dest)
    for name in splits or [""]:
        _verify_one(dest / name if name else dest, f"{name}/" if name else "", decode, report)
    return report


def _size_or_none(data: bytes) -> tuple[int, int] | None:
    try:
        return image_size(data)
    except ValueError:
        return None


def _stats(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": round(statistics.fmean(values), 1),
            "median": statistics.median(values)}


def _inspect_one(root: Path, max_images: int) -> dict[str, Any]:
    from fastio.dataset import Dataset

    ds = Dataset(root)
    table = ds.table
    n = len(ds)
    info: dict[str, Any] = {
        "path": str(root), "samples": n, "shards": len(ds.shards), "bytes": sum(s.bytes for s in ds.shards),
        "fingerprint": ds.fingerprint, "source": ds.manifest.get("source"),
        "fields": {f: int((table.sizes[f] >= 0).sum()) for f in ds.fields},
        "image_field": ds.image_field, "label_field": ds.label_field,
        "skipped": len(ds.manifest.get("skipped") or []),
    }
    files: dict[int, Any] = {}

    def read(i: int, f: str) -> bytes:
        s = int(table.shard[i])
        if s not in files:
            files[s] = stack.enter_context(open(ds.shards[s].path, "rb"))  # noqa: SIM115 (ExitStack closes it)
        files[s].seek(int(table.offsets[f][i]))
        return files[s].read(int(table.sizes[f][i]))

    with contextlib.ExitStack() as stack:
        label = ds.label_field
        if label in table.offsets:
            names = {v: k for k, v in (ds.label_map or {}).items()}
            counts: dict[int, int] = {}
            for i in range(n):
                if table.sizes[label][i] >= 0:
                    raw = read(i, label).strip()
                    value = int(raw) if raw.lstrip(b"-").isdigit() else raw.decode(errors="replace")
                    counts[value] = counts.get(value, 0) + 1
            labels = set(counts) | set(names)  # classes of the label map that no sample has count 0
            info["classes"] = [{"label": k, "name": names.get(k), "count": counts.get(k, 0)}
                               for k in sorted(labels, key=lambda v: (isinstance(v, str), v))]
        image = ds.image_field
        if image in table.offsets:
            have = [i for i in range(n) if table.sizes[image][i] >= 0]
            step = max(1, len(have) // max_images) if max_images > 0 else len(have) + 1
            probe = have[::step][:max_images]
            sizes = [s for s in (_size_or_none(read(i, image)) for i in probe) if s is not None]
            info["image_sizes"] = {
                "field": image, "probed": len(probe), "unreadable": len(probe) - len(sizes),
                "width": _stats([w for w, _ in sizes]) if sizes else None,
                "height": _stats([h for _, h in sizes]) if sizes else None,
                "bytes": _stats([int(table.sizes[image][i]) for i in have]) if have else None,
            }
    return info


def inspect(dest: str | Path, *, max_images: int = 1000) -> dict[str, Any]:
    """Samples, shards, bytes, fields (with how many samples have each), classes with counts and
    image size statistics (headers of at most ``max_images`` evenly spaced images). For a split DEST:
    ``{"path", "splits": {name: <that dict>}}``. JSON-serialisable."""
    if max_images < 0:
        raise ValueError(f"--max-images must be 0 or more, got {max_images}")
    dest = Path(dest)
    splits = split_names(dest)
    if splits is None:
        return _inspect_one(dest, max_images)
    return {"path": str(dest), "splits": {name: _inspect_one(dest / name, max_images) for name in splits}}
