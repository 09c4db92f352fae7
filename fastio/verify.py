"""Check a converted dataset against its manifest: checksums, counts, tar members, index (``verify``),
and that ``shards/`` holds no file the manifest does not list (a stray shard or index, e.g. from another
conversion, is reported: a reader would never see it, but it is not this dataset).

Accepts a dataset directory or a DEST written with ``split`` (holding ``splits.json``), in which
case each split is checked and shard names are prefixed with the split name.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from fastio.checksum import sha256_file
from fastio.dsindex import check_index as check_sample_index
from fastio.idx import check_index, parse_index
from fastio.images import ImageCheckError, check_image, is_image_field
from fastio.manifest import SHARDS_DIR, index_record, load_manifest, shard_records, split_names
from fastio.wds import split_member_name

__all__ = ["Problem", "VerifyReport", "verify"]


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
    """What :func:`verify` checked (shards, samples, images decoded) and every problem it found."""

    dest: Path
    shards: int = 0
    samples: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


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
            if decode and is_image_field(ext):
                data = tar.extractfile(member).read()
                try:
                    check_image(data)
                    report.decoded += 1
                except ImageCheckError as err:
                    report.problems.append(Problem(label, key, f"field {ext}: {err}"))
    return samples


def _verify_one(root: Path, prefix: str, decode: bool, report: VerifyReport) -> None:
    manifest = load_manifest(root)
    records = shard_records(manifest)
    listed = {name for shard in records for name in (shard.name, shard.idx_name)}
    folder = root / SHARDS_DIR
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name not in listed:
            report.problems.append(Problem(f"{prefix}{SHARDS_DIR}/{path.name}", None,
                                           "file is not listed in the manifest"))
    parsed, found = [], len(report.problems)  # (record, .idx entries) for the consolidated index check
    for shard in records:
        label = f"{prefix}{shard.name}"
        tar_path, idx_path = root / SHARDS_DIR / shard.name, root / SHARDS_DIR / shard.idx_name
        report.shards += 1
        if not tar_path.is_file():
            report.problems.append(Problem(label, None, "shard file is missing"))
            continue
        size, digest = sha256_file(tar_path)
        if size != shard.bytes:
            report.problems.append(Problem(label, None, f"size {size} bytes, manifest says {shard.bytes}"))
        if digest != shard.sha256:
            report.problems.append(Problem(label, None, "sha256 does not match the manifest"))
        entries = None
        if not idx_path.is_file():
            report.problems.append(Problem(label, None, f"index {idx_path.name} is missing"))
        else:
            if sha256_file(idx_path)[1] != shard.idx_sha256:
                report.problems.append(Problem(label, None, f"index {idx_path.name} sha256 does not match the manifest"))
            try:
                entries = parse_index(idx_path.read_text(), source=idx_path.name)
            except (ValueError, UnicodeDecodeError) as err:
                report.problems.append(Problem(label, None, f"index does not parse: {err}"))
            else:
                try:
                    check_index(entries, samples=len(entries), tar_bytes=shard.bytes, source=idx_path.name)
                except ValueError as err:
                    report.problems.append(Problem(label, None, f"index is inconsistent: {err}"))
        parsed.append((shard, entries))  # entries None: a problem is reported, no index rebuild
        try:
            samples = _tar_samples(tar_path, decode, report, label)
        except (tarfile.TarError, OSError, EOFError) as err:
            report.problems.append(Problem(label, None, f"tar does not parse ({err})"))
            continue
        report.samples += len(samples)
        if len(samples) != shard.samples:
            report.problems.append(Problem(label, None, f"holds {len(samples)} samples, manifest says {shard.samples}"))
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
    record = index_record(manifest)
    if record is not None:
        shards_ok = len(report.problems) == found  # else the shards' problems are the ones to report
        for what in check_sample_index(root / record.name, record, parsed if shards_ok else None, manifest["fields"]):
            report.problems.append(Problem(f"{prefix}{record.name}", None, what))


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
