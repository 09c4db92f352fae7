"""``fastio merge DEST``: publish one dataset from the N complete parts of a conversion in parts.

The result is byte-identical to a single ``fastio convert`` with the same source, options and seed: the same
samples in the same order, the same shard files and ``.idx`` files, the same manifest.

Shard boundaries. A single conversion cuts shards greedily (:func:`fastio.dataset.shards.starts_new_shard`: a new
shard when the next sample would overflow ``shard_size`` or the shard holds ``max_samples_per_shard``). Each
part starts on a cut that it predicts from file sizes (:func:`fastio.convert.parts.predicted_shard_starts`) and cuts
its range by the same rule. The merge computes where the single run really cuts, from the sample sizes in the
parts' ``.idx`` files, and then, per shard of the result:

- a part shard that holds exactly the samples of a result shard is **linked** into place (a hard link, no
  copy; a copy where the file system refuses links);
- any other result shard is **re-packed**: its samples' bytes are copied out of the part shards (no decode)
  through the same :class:`~fastio.dataset.shards.ShardWriter`.

When the prediction holds (no sample skipped while loading, no ``max_side`` re-encoding) every shard is
linked. A skipped or re-encoded sample moves the single run's cuts after it, and greedy cuts that started
elsewhere rarely meet again, so the shards from there on are re-packed (still the same bytes; a sequential
copy). Cuts by sample count alone (``max_samples_per_shard`` with shards that stay under ``shard_size``)
only move at a skip.

Safety: DEST and every part are locked for the merge (a part still being converted is refused), the parts are
checked first (all N complete, same plan: source, options, seed, listing), DEST's final files are written
last by :func:`publish_dataset`, and ``.parts`` is removed only after the dataset is published (``keep_parts`` keeps it).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastio.convert.dest import check_dest, reset_dest
from fastio.convert.image_text import refuse_untrained
from fastio.convert.parts import PARTS_DIR, PartRecord, parse_part_dir, part_dir, part_name, read_part_record
from fastio.convert.token_convert import TOKEN_PLAN
from fastio.convert.token_merge import comparable_plan, merge_token_parts, part_command, special_token_differences
from fastio.convert.wds_index import INDEX_PLAN, merge_index_parts
from fastio.dataset.manifest import (
    MANIFEST_NAME,
    SHARDS_DIR,
    SPLITS_NAME,
    ImageTextInfo,
    Manifest,
    ShardRecord,
    load_manifest,
    make_manifest,
    write_manifest,
    write_splits,
)
from fastio.dataset.sample_table import INDEX_NAME, build_index
from fastio.dataset.shards import ShardWriter, sample_span, starts_new_shard
from fastio.errors import ConvertError, DatasetError
from fastio.formats.dali_idx import IndexEntry, parse_index
from fastio.formats.images import is_image_field
from fastio.formats.media import join_video_codecs
from fastio.progress import count
from fastio.storage import local_or_url
from fastio.storage.atomic import fsync_dir, place_file
from fastio.storage.lock import LOCK_NAME, DirLock, LockedError

__all__ = ["MergeResult", "merge", "publish_dataset"]

STAGING = ".merge"


@dataclass
class MergeResult:
    """What a merge published: one manifest per dataset (key ``""`` without split), and how shards were made."""

    dest: Path
    parts: int
    manifests: dict[str, Manifest]
    linked: int
    """Result shards that are a part's shard, linked into place."""
    repacked: int
    """Result shards whose samples were copied out of the parts' shards into a new tar."""
    seconds: float

    @property
    def samples(self) -> int:
        return sum(m.total_samples for m in self.manifests.values())

    def summary(self) -> str:
        shards = self.linked + self.repacked
        noun = "document" if all(m.kind == "tokens" for m in self.manifests.values()) else "sample"
        return (f"merged {count(self.parts, 'part')} into {self.dest}: {count(self.samples, noun)} in "
                f"{count(shards, 'shard')} "
                f"({self.linked} linked, {self.repacked} re-packed) in {self.seconds:.1f}s")


@dataclass
class _Sample:
    shard: ShardRecord
    path: Path
    """The part shard holding the sample."""
    entry: IndexEntry


@dataclass
class _Planned:
    """One shard of the result: taken from a part (``source`` set) or re-packed (``record`` set after)."""

    start: int
    end: int
    source: Path | None = None
    record: ShardRecord | None = None
    staged: Path | None = None


def _local_dest(dest: str | Path) -> Path:
    """DEST's folder (``file:///abs`` is ``/abs``); a ConvertError for an object-store URL: parts are merged on a
    file system."""
    where = local_or_url(dest)
    if isinstance(where, str):
        raise ConvertError(f"{where}: fastio merge needs the parts on a (shared) file system; merge there, then upload")
    return where


def merge(dest: str | Path, *, overwrite: bool = False, keep_parts: bool = False) -> MergeResult:
    """Check the parts under ``DEST/.parts`` and publish them as one dataset in DEST (see the module docstring).

    Raises ConvertError naming missing, incomplete, still-running or mismatched parts."""
    started = time.perf_counter()
    dest = _local_dest(dest)
    root = dest / PARTS_DIR
    if not root.is_dir():
        raise _no_parts(dest)
    locks = [DirLock(dest, "fastio merge")]
    try:
        try:
            locks[0].acquire()
            n = _part_count(dest)
            for k in range(n):
                if part_dir(dest, k, n).is_dir():
                    locks.append(DirLock(part_dir(dest, k, n), "fastio merge").acquire())
        except LockedError as err:
            raise ConvertError(str(err)) from None
        records = _complete_parts(dest, n)
        plan = _check_plans(dest, records)
        if plan.get("kind") == INDEX_PLAN:  # parts of `fastio index`: the shards stay where they are
            try:
                manifests = {"": merge_index_parts(dest, records, plan, overwrite=overwrite)}
            except DatasetError as err:
                raise ConvertError(str(err)) from None
            counts = {"linked": len(manifests[""].shards), "repacked": 0}
        elif plan.get("kind") == TOKEN_PLAN:  # parts of `fastio convert --tokenizer`: Megatron pairs
            manifest, counts = merge_token_parts(dest, records, plan, root / STAGING, overwrite=overwrite)
            manifests = {"": manifest}
        else:
            source = plan["source"]["path"]  # a URL (an image-text JSONL on s3://) stays a str
            check_dest(dest, local_or_url(source), overwrite)
            staging = root / STAGING
            if staging.exists():
                shutil.rmtree(staging)
            counts = {"linked": 0, "repacked": 0}
            datasets = {name: _assemble(dest, name, records, plan, staging / (name or "_"), counts)
                        for name in sorted(records[0].datasets)}
            manifests = publish_dataset(dest, datasets)
        if not keep_parts:
            shutil.rmtree(root)
    except OSError as err:
        raise ConvertError(f"{err.filename or dest}: {err.strerror or err}") from None
    finally:
        for lock in reversed(locks):
            lock.release()
    return MergeResult(dest=dest, parts=n, manifests=manifests, linked=counts["linked"],
                       repacked=counts["repacked"], seconds=time.perf_counter() - started)


def publish_dataset(dest: Path, datasets: dict[str, tuple[list[_Planned], dict[str, Any]]]) -> dict[str, Manifest]:
    """Publish the merged dataset: clear DEST (its final files first, ``.parts`` kept), put every shard and
    index in place, then each dataset's manifest, then (with splits) ``splits.json`` last. Returns the manifests."""
    reset_dest(dest, keep=(PARTS_DIR, LOCK_NAME))
    manifests: dict[str, Manifest] = {}
    for name, (planned, manifest_fields) in datasets.items():
        out = dest / name if name else dest
        (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        records, located = [], []
        for i, shard in enumerate(planned):
            record = replace(shard.record, name=f"{manifest_fields['name']}-{i:06d}.tar")
            for src, dst in ((shard.source or shard.staged, record.name),
                             (_idx(shard.source or shard.staged), record.idx_name)):
                place_file(src, out / SHARDS_DIR / dst, link=shard.source is not None)
            records.append(record)
            located.append((record, parse_index((out / SHARDS_DIR / record.idx_name).read_text(), record.idx_name)))
        fsync_dir(out / SHARDS_DIR)
        fields = manifest_fields.pop("fields")
        index = build_index(out / INDEX_NAME, located, fields)  # the sample index, as the writer makes it
        manifest = make_manifest(shards=records, fields=fields, index=index, **manifest_fields)
        write_manifest(out, manifest)
        manifests[name] = manifest
    if "" not in manifests:
        write_splits(dest, manifests)
    return manifests


# -- checks -------------------------------------------------------------------------------------------

def _part_count(dest: Path) -> int:
    found = sorted({n for k, n in (parse_part_dir(p.name) or (None, None) for p in (dest / PARTS_DIR).iterdir())
                    if n is not None})
    if not found:
        raise ConvertError(f"{dest}: no parts to merge in {PARTS_DIR}/; first write them: {_write_parts(dest)}")
    if len(found) > 1:
        raise ConvertError(f"{dest}: {PARTS_DIR}/ holds parts of conversions in {' and '.join(map(str, found))} "
                           "parts; move away the ones that do not belong to this conversion")
    return found[0]


def _complete_parts(dest: Path, n: int) -> list[PartRecord]:
    records, missing = [], []
    for k in range(n):
        directory = part_dir(dest, k, n)
        record = read_part_record(directory) if directory.is_dir() else None
        if record is None:
            missing.append(f"{part_name(k, n)} ({'incomplete: failed or interrupted' if directory.is_dir() else 'missing'})")
        elif (record.part, record.of) != (k, n):
            raise ConvertError(f"{directory}: part record says part {record.part} of {record.of}")
        records.append(record)
    if missing:
        raise ConvertError(f"{dest}: {len(missing)} of {count(n, 'part')} not complete, {_rerun(dest, n, records)} and "
                           f"merge again: {', '.join(missing)}")
    return records


def _rerun(dest: Path, n: int, records: list[PartRecord | None]) -> str:
    """How to make the missing parts: the command that made the others (an index's, or a conversion's)."""
    plan = next((r.plan for r in records if r is not None), {})
    if plan.get("kind") == INDEX_PLAN:
        where = "" if plan.get("options", {}).get("in_place") else f" --dest {shlex.quote(str(dest))}"
        return f"index them (fastio index {shlex.quote(str(plan['source']['path']))}{where} --part K/{n})"
    if plan.get("kind") == TOKEN_PLAN:
        return f"convert them ({part_command(plan, dest, n)})"
    source = plan.get("source", {}).get("path", "SOURCE")
    return (f"convert them (fastio convert {shlex.quote(str(source))} {shlex.quote(str(dest))} --part K/{n} with the "
            "other parts' options)")


def _no_parts(dest: Path) -> ConvertError:
    """The refusal of a DEST without ``.parts/``: one that does not exist, or a dataset already (merged, whose parts
    are removed), said as such."""
    if (dest / MANIFEST_NAME).is_file() or (dest / SPLITS_NAME).is_file():
        return ConvertError(f"{dest}: a dataset already (merged, or converted in one run), and no parts to merge: "
                            "nothing to do")
    if not dest.exists():
        return ConvertError(f"{dest}: no such folder, so no parts to merge; first write them: {_write_parts(dest)}")
    return ConvertError(f"{dest}: no parts to merge (no {PARTS_DIR}/); first write them: {_write_parts(dest)}")


def _write_parts(dest: Path) -> str:
    """The commands that write the parts (``fastio merge`` names what the user types, as :func:`_rerun` does)."""
    return (f"fastio convert SOURCE {dest} --part K/N (or fastio index SOURCE --dest {dest} --part K/N) "
            "for each K in 0..N-1")


def _check_plans(dest: Path, records: list[PartRecord]) -> dict[str, Any]:
    """The plan every part shares; ConvertError naming each part that differs and in what."""
    ref = records[0]
    problems = []
    for record in records[1:]:
        plans = ([comparable_plan(r.plan) for r in (ref, record)] if record.plan.get("kind") == TOKEN_PLAN else
                 _image_text_comparable(ref.plan, record.plan))
        diff = [key for key in sorted(set(plans[0]) | set(plans[1])) if plans[0].get(key) != plans[1].get(key)]
        if sorted(record.datasets) != sorted(ref.datasets):
            diff.append("splits")
        detail = []
        for key in diff:
            if key in ("convert_options", "tokens"):  # the options (a token conversion's: eos, tokenizer_sha256)
                detail += _option_differences(plans[0].get(key) or {}, plans[1].get(key) or {})
            elif key == "listing":
                detail.append("source listing (the source changed between the parts' scans)")
            else:
                detail.append(key)
        if record.plan.get("kind") == TOKEN_PLAN:
            detail += special_token_differences(ref.plan, record.plan)
        if detail:
            problems.append(f"{part_name(record.part, record.of)}: {', '.join(detail)}")
    if problems:
        raise ConvertError(f"{dest}: parts were not made from the same source, options and seed as "
                           f"{part_name(ref.part, ref.of)}: {'; '.join(problems)}")
    for name in ref.datasets:
        at = 0
        for record in records:
            start, end = record.datasets[name]["range"]
            if start != at:
                raise ConvertError(f"{part_dir(dest, record.part, record.of)}: range {start}..{end} does not "
                                   f"continue at {at}")
            at = end
        if at != ref.datasets[name]["count"]:
            raise ConvertError(f"{dest}: parts cover {at} of {count(ref.datasets[name]['count'], 'sample')}")
    return ref.plan


def _option_differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Each option in which part 0's ``a`` and another part's ``b`` differ, with both values (``seed 7 (part 0:
    0)``); of an option that is a mapping in both, each entry that differs (``image_text.template_variables.bos_token
    '<|im_start|>' (part 0: '<s>')``)."""
    out = []
    for o in sorted(set(a) | set(b)):
        x, y = a.get(o), b.get(o)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _option_differences(x, y, f"{prefix}{o}.")
        elif x != y:
            out.append(f"{prefix}{o} {y!r} (part 0: {x!r})")
    return out


def _image_text_comparable(ref: dict[str, Any], plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Two parts' plans as compared: an image-text conversion's ``template_variables`` (the special tokens its
    template is rendered with) left out of both where one part was converted before they were recorded."""
    entries = [p.get("convert_options", {}).get("image_text") for p in (ref, plan)]
    if not all(isinstance(e, dict) for e in entries) or all("template_variables" in e for e in entries):
        return [ref, plan]
    return [{**p, "convert_options": {**p["convert_options"], "image_text": {
        k: v for k, v in e.items() if k != "template_variables"}}} for p, e in zip((ref, plan), entries)]


# -- assembling one dataset -----------------------------------------------------------------------------

def _assemble(dest: Path, name: str, records: list[PartRecord], plan: dict[str, Any], staging: Path,
              counts: dict[str, int]) -> tuple[list[_Planned], dict[str, Any]]:
    """The shards of one output dataset (linked or re-packed into ``staging``) and its manifest fields."""
    options = plan["convert_options"]
    max_bytes, max_samples = options["shard_size"], options["max_samples_per_shard"]
    samples: list[_Sample] = []
    part_shards: dict[tuple[int, int], Path] = {}
    fields: set[str] = set()
    codecs: dict[str, dict[str, int]] = {}
    skipped = list(plan["scan_skipped"])
    vocabularies: list[ImageTextInfo | None] = []
    for record in records:
        out = part_dir(dest, record.part, record.of) / name
        try:
            manifest = load_manifest(out)
        except DatasetError as err:
            raise ConvertError(f"{part_name(record.part, record.of)}: {err}") from None
        vocabularies.append(manifest.image_text)
        fields.update(manifest.fields)
        join_video_codecs(codecs, manifest.video_codecs, len(samples))
        skipped += manifest.skipped or []
        for shard in manifest.shards:
            path = out / SHARDS_DIR / shard.name
            entries = _read_index(path, shard)
            part_shards[(len(samples), len(samples) + len(entries))] = path
            samples += [_Sample(shard, path, e) for e in entries]
    if not samples:
        example = f" (e.g. {skipped[0]['path']}: {skipped[0]['reason']})" if skipped else ""
        of_split = f" of split {name}" if name else ""
        raise ConvertError(f"{plan['source']['path']}: every sample{of_split} was skipped{example}")

    planned = [_Planned(a, b, part_shards.get((a, b))) for a, b in _cuts(samples, max_bytes, max_samples)]
    _place(samples, planned, staging, plan["name"], max_bytes, max_samples, counts)
    vocabulary = _merged_vocabulary(vocabularies, records)
    if vocabulary:  # image-text parts: the whole must train a token
        template = f"the chat template of sha256 {options.get('image_text', {}).get('template_sha256', '')[:12]}"
        refuse_untrained(plan["source"]["path"], name, template, vocabulary["image_text"].trained_tokens,
                         len(samples))
    more = {**({"video_codecs": codecs} if codecs else {}), **vocabulary}
    if name:
        more["split"] = {"name": name, "of": sorted(records[0].datasets)}
    return planned, dict(
        name=plan["name"], fields=sorted(fields), skipped=skipped,
        image_fields=sorted(f for f in fields if is_image_field(f)), converted_from=plan["source"],
        label_map=plan["label_map"], image_field=plan["image_field"], label_field=plan["label_field"],
        label_rule=plan.get("label_rule"), convert_options=options, **more)


def _place(samples: list[_Sample], planned: list[_Planned], staging: Path, name: str, max_bytes: int,
           max_samples: int | None, counts: dict[str, int]) -> None:
    """Give each planned shard its record: a part shard's where one holds exactly its samples (linked), else the
    one re-packed into ``staging`` with the runs of its neighbours that no part shard holds (counted in ``counts``)."""
    run: list[_Planned] = []
    for shard in [*planned, None]:
        if shard is not None and shard.source is None:
            run.append(shard)
            continue
        if run:
            _repack(samples, run, staging / f"run-{run[0].start}", name, max_bytes, max_samples)
            counts["repacked"] += len(run)
            run = []
        if shard is not None:
            shard.record = samples[shard.start].shard
            counts["linked"] += 1


def _merged_vocabulary(parts: list[ImageTextInfo | None], records: list[PartRecord]) -> dict[str, ImageTextInfo]:
    """``{"image_text": the parts' records joined}`` (:meth:`ImageTextInfo.joined`: the same vocabulary size, the
    largest of the largest ids), ``{}`` where no part records one (a conversion of images); ConvertError naming
    the part whose record disagrees with the parts before it."""
    if all(part is None for part in parts):
        return {}
    joined = parts[0]
    for part, record in zip(parts[1:], records[1:]):
        try:
            if joined is None or part is None:
                raise ValueError("image_text: recorded by some parts and not by others (parts of other fastio "
                                 "versions: convert them again)")
            joined = joined.joined(part)
        except ValueError as err:
            raise ConvertError(f"{part_name(record.part, record.of)}: {err}") from None
    return {"image_text": joined}


def _cuts(samples: list[_Sample], max_bytes: int, max_samples: int | None) -> list[tuple[int, int]]:
    """Where a single conversion cuts ``samples`` into shards: ``[(start, end), ...]``."""
    cuts, start, end, members_end = [], 0, 0, 0
    for i, sample in enumerate(samples):
        span = sample_span(size for _, _, size in sample.entry.members)
        if starts_new_shard(members_end, i - start, span, max_bytes, max_samples):
            cuts.append((start, i))
            start, members_end = i, 0
        members_end += span
        end = i + 1
    cuts.append((start, end))
    return cuts


def _repack(samples: list[_Sample], run: list[_Planned], staging: Path, name: str, max_bytes: int,
            max_samples: int | None) -> None:
    """Write the samples of consecutive result shards ``run`` (which starts at a cut) through one writer."""
    handles: dict[Path, Any] = {}
    try:
        with ShardWriter(staging, name=name, max_bytes=max_bytes, max_samples=max_samples) as writer:
            for sample in samples[run[0].start:run[-1].end]:
                f = handles.get(sample.path) or handles.setdefault(sample.path, open(sample.path, "rb"))  # noqa: SIM115
                data = {"__key__": sample.entry.key}
                for ext, offset, size in sample.entry.members:
                    data[ext] = os.pread(f.fileno(), size, offset)
                writer.write(data)
            writer.close()
    finally:
        for f in handles.values():
            f.close()
    if len(writer.shards) != len(run) or any(r.samples != p.end - p.start for r, p in zip(writer.shards, run)):
        raise ConvertError(f"{staging}: re-packed shards do not match the computed cuts (a damaged part?)")
    for record, shard in zip(writer.shards, run):
        shard.record, shard.staged = record, staging / SHARDS_DIR / record.name


def _read_index(path: Path, shard: ShardRecord) -> list[IndexEntry]:
    """A part shard's index, checked against its manifest record (sha256, sample count, tar size)."""
    idx = _idx(path)
    try:
        data = idx.read_bytes()
        size = path.stat().st_size
    except OSError as err:
        raise ConvertError(f"{err.filename}: {err.strerror or err} (a damaged part?)") from None
    if hashlib.sha256(data).hexdigest() != shard.idx_sha256 or size != shard.bytes:
        raise ConvertError(f"{path}: does not match its part's manifest (a damaged part: convert it again)")
    try:
        entries = parse_index(data.decode(), str(idx))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConvertError(f"{idx}: {err}") from None
    if len(entries) != shard.samples:
        raise ConvertError(f"{idx}: lists {count(len(entries), 'sample')}, its manifest {shard.samples}")
    return entries


def _idx(tar: Path) -> Path:
    return tar.with_name(tar.name[: -len(".tar")] + ".idx")
