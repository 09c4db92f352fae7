"""Check a converted dataset against its manifest: checksums, counts, tar members, token ids, index (``verify``),
and that ``shards/`` holds no file the manifest does not list (a stray shard or index, e.g. from another
conversion, is reported: a reader would never see it, but it is not this dataset).

Accepts a dataset directory or a DEST written with ``split`` (holding ``splits.json``), in which
case each split is checked and shard names are prefixed with the split name. A token dataset's shards (Megatron
``.bin``/``.idx``) are checked for their checksums, the ``.idx`` structure, document and token counts, every document
ending with the end-of-document id, every id inside the vocabulary (and not above the largest the manifest records)
and not int32 tokens under an ``.idx`` that says uint16 (:mod:`fastio.tokens.ids`); a chat dataset's (``tokens.chat``)
also for each shard's loss mask (``NAME.mask``: listed, present, its sha256, its size for the shard's tokens) and
its conversations' lengths (none over ``tokens.chat.longest``), and not for the end-of-document id (a
conversation ends as its template ends it). An image-text sample's members
(:mod:`fastio.formats.image_text`) are checked by their sizes, and its ``tokens.i32`` by the rule of a token
dataset's ids: the first id that is negative, outside the vocabulary or above the largest id the manifest's
``image_text`` entry records is named with the shard and key (a manifest without the entry: negative ids only), and
so is a sample holding more or fewer image tokens (the id its ``convert_options.image_text`` records) than images.
With ``decode``, a sample of a dataset with an image field that holds none of its image fields
(:attr:`fastio.dataset.manifest.Manifest.image_order`) is named: the image pipelines refuse it when read.
"""

from __future__ import annotations

import importlib.util
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastio.convert.foreign_tar import as_fields
from fastio.dataset.files import LocalFiles, dest_split_names, no_manifest
from fastio.dataset.manifest import (
    MANIFEST_NAME,
    SHARDS_DIR,
    ImageTextInfo,
    IndexRecord,
    Manifest,
    ShardRecord,
    TokenInfo,
    load_manifest,
    split_names,
)
from fastio.dataset.sample_table import check_index as check_sample_index
from fastio.errors import DatasetError, StorageError, install_hint
from fastio.formats.dali_idx import check_index, parse_index
from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD, is_image_text, member_problems, options_image_token_id
from fastio.formats.images import ImageCheckError, check_image, is_image_field
from fastio.formats.media import MediaCheckError, ProbeTable, is_media_field, is_video_field, probe
from fastio.formats.megatron import MegatronShard
from fastio.formats.pyav_clips import decode_clip
from fastio.formats.token_mask import MaskFile
from fastio.formats.wds import field_of, split_member_name
from fastio.storage import local_or_url, open_storage
from fastio.storage.checksum import digests_file, sha256_file
from fastio.tokens.ids import IdScan, first_outside, id_problem
from fastio.tokens.starts import read_starts
from fastio.words import count

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
    """What :func:`verify` checked (shards, samples, images, videos and audio files decoded) and every problem it
    found."""

    dest: Path | str
    shards: int = 0
    samples: int = 0
    decoded: int = 0
    """Images decoded (``decode=True``)."""
    videos_decoded: int = 0
    """Videos of which a clip (:data:`VERIFY_CLIP_FRAMES` frames from the first) was decoded with PyAV."""
    audio_decoded: int = 0
    """Audio files decoded whole with PyAV and with DALI's audio decoder (as :class:`fastio.AudioClips` decodes them)."""
    longest_conversation: int = 0
    """A chat dataset's (the one checked last, of a ``split`` DEST) longest conversation, in tokens."""
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def decoded_line(self) -> str:
        """``48 images decoded``; with media ``0 images and 4 videos (a clip each) decoded``."""
        done = [count(self.decoded, "image")]
        done += [count(self.videos_decoded, "video") + " (a clip each)"] if self.videos_decoded else []
        done += [count(self.audio_decoded, "audio file")] if self.audio_decoded else []
        return f"{', '.join(done[:-1])} and {done[-1]} decoded" if len(done) > 1 else f"{done[0]} decoded"


VERIFY_CLIP_FRAMES = 16
"""Frames of each video ``verify(decode=True)`` decodes: one clip, from its first frame."""


def _decode_media(data: bytes, ext: str, report: VerifyReport) -> None:
    """Decode video or audio field ``ext`` (a video: its first clip; audio: whole, with PyAV and with DALI's audio
    decoder, which the Loader uses) and count it; MediaCheckError when one cannot, or is not installed."""
    if importlib.util.find_spec("av") is None:
        raise MediaCheckError(f"not decoded: PyAV is not installed ({install_hint('media')})")
    if is_video_field(ext):
        probe(data, ext)  # demuxed: a VP8/VP9 frame size change anywhere, which DALI's decoder returns wrong
        decode_clip(data, 0, VERIFY_CLIP_FRAMES, 1)
        report.videos_decoded += 1
    else:
        found = probe(data, ext)  # decodes every audio frame
        problem = _dali_audio(np.frombuffer(data, np.uint8), found)
        if problem is not None:
            raise MediaCheckError(problem)
        report.audio_decoded += 1


def _dali_audio(encoded: np.ndarray, found: dict) -> str | None:
    """Why DALI's audio decoder, as :class:`fastio.AudioClips` runs it, does not read an audio file PyAV reads
    (``found``: its probe): a file DALI cannot open, or reads fewer samples of, passes PyAV and stops the Loader."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return f"not decoded by DALI's audio decoder: DALI is not installed ({install_hint('cuda13')})"
    from fastio.formats.dali_audio import dali_audio_problem

    return dali_audio_problem(encoded, found)


@dataclass
class _TokensCheck:
    """What an image-text sample's ``tokens.i32`` is checked against: the manifest's vocabulary record (``info``,
    maybe empty) and the image token's id (None: not an image-text dataset); ``image_tokens`` gathers how many image
    tokens each sample's ``tokens.i32`` holds (by key, as the tar is read), for :func:`member_problems`."""

    info: ImageTextInfo
    image_id: int | None
    image_tokens: dict[str, int] = field(default_factory=dict)

    def problem(self, key: str, data: bytes) -> str | None:
        """The first bad id of sample ``key``'s ``tokens.i32`` ``data`` (:func:`_token_id_problem`), its image
        tokens counted."""
        if self.image_id is not None and not len(data) % 4:
            self.image_tokens[key] = int(np.count_nonzero(np.frombuffer(data, "<i4") == self.image_id))
        return _token_id_problem(data, self.info)

    def image_pair(self, key: str) -> tuple[int, int] | None:
        """(image tokens of sample ``key``, the image token's id); None where not counted."""
        n = self.image_tokens.get(key)
        return None if n is None or self.image_id is None else (n, self.image_id)


def _tar_samples(path: Path, decode: bool, report: VerifyReport, label: str, foreign: bool, ids: _TokensCheck):
    """[(key, ((ext, offset, size), ...)), ...] in tar order; member problems go into ``report``. A ``foreign``
    tar (indexed by ``fastio index``, not written by fastio) may hold what its index passed over: folders,
    links, hidden files and members without a field name (:mod:`fastio.convert.foreign_tar`). Each ``tokens.i32``
    member's ids are checked by ``ids`` (an image-text dataset's vocabulary record, maybe empty, and its image
    token: :class:`_TokensCheck`)."""
    samples: list[tuple[str, list[tuple[str, int, int]]]] = []
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            base = member.name[member.name.rfind("/") + 1:]
            if foreign and (not member.isfile() or not base or base.startswith(".")):
                continue
            if not member.isfile():
                report.problems.append(Problem(label, None, f"tar member {member.name!r} is not a regular file"))
                continue
            key, ext = split_member_name(member.name)
            if not ext and foreign:
                continue
            if not ext:
                report.problems.append(Problem(label, key, f"tar member {member.name!r} has no field extension"))
                continue
            if samples and samples[-1][0] == key:
                samples[-1][1].append((ext, member.offset_data, member.size))
            else:
                samples.append((key, [(ext, member.offset_data, member.size)]))
            what = _member_problem(tar, member, key, ext, decode, ids, report)
            if what is not None:
                report.problems.append(Problem(label, key, what))
    return samples


def _member_problem(tar: tarfile.TarFile, member: tarfile.TarInfo, key: str, ext: str, decode: bool,
                    ids: _TokensCheck, report: VerifyReport) -> str | None:
    """What is wrong with one member's bytes, read only where checked: an image, video or audio file that does not
    decode (``decode``), an image-text sample's ``tokens.i32`` holding a bad id (checked by ``ids``)."""
    if ext == TOKENS_FIELD:
        return ids.problem(key, tar.extractfile(member).read())
    if decode and is_image_field(ext):
        try:
            check_image(tar.extractfile(member).read())
            report.decoded += 1
        except ImageCheckError as err:
            return f"field {ext}: {err}"
    elif decode and is_media_field(ext):
        try:
            _decode_media(tar.extractfile(member).read(), ext, report)
        except MediaCheckError as err:
            return f"field {ext}: {err}"
    return None


def _token_id_problem(data: bytes, info: ImageTextInfo) -> str | None:
    """The first id of an image-text sample's ``tokens.i32`` that is negative, outside the vocabulary or above the
    largest id the manifest records (``info``: what it records, maybe nothing), by the rule of a token dataset's ids
    (:mod:`fastio.tokens.ids`); None for good ids, or a member that is not whole int32 ids (reported by its size)."""
    if len(data) % 4 or not data:
        return None
    tokens = np.frombuffer(data, "<i4")
    top = info.max_id + 1 if info.max_id is not None else info.vocab_size  # max_id < vocab_size (checked on load)
    at = first_outside(tokens, top, int(tokens.min()), int(tokens.max()))
    return None if at is None else f"{TOKENS_FIELD} {id_problem(int(tokens[at]), info.vocab_size, info.max_id)}"


def _token_problems(bin_path: Path, idx_path: Path, shard: ShardRecord, info: TokenInfo, report: VerifyReport,
                    starts: tuple[int, np.ndarray] | None = None):
    """What is wrong with a token shard's ``.idx`` and documents: checksum, structure, counts, every document
    ending with the end-of-document id, ids inside the vocabulary (and not negative), its entries of the
    document-starts table (``starts``: every how many documents, the entries)."""
    if not idx_path.is_file():
        return [f"index {idx_path.name} is missing"]
    problems = []
    if sha256_file(idx_path)[1] != shard.idx_sha256:
        problems.append(f"index {idx_path.name} sha256 does not match the manifest")
    try:
        pair = MegatronShard(bin_path, info.dtype, one_per_document=info.one_sequence_per_document)
        pair.index.check_structure()
    except DatasetError as err:
        return [*problems, str(err)]
    report.samples += pair.documents
    if pair.documents != shard.samples:
        problems.append(f"holds {count(pair.documents, 'document')}, manifest says {shard.samples}")
    if shard.tokens is not None and pair.index.tokens != shard.tokens:
        problems.append(f"holds {count(pair.index.tokens, 'token')}, manifest says {shard.tokens}")
    if info.chat is not None:
        problems += _mask_problems(bin_path, shard, pair.index.tokens)
    return problems + _document_problems(pair, info, starts, report)


def _mask_problems(bin_path: Path, shard: ShardRecord, tokens: int) -> list[str]:
    """What is wrong with a chat shard's loss mask: not listed, missing, its sha256, its size for the shard's
    tokens (:class:`~fastio.formats.token_mask.MaskFile`)."""
    path = bin_path.with_name(shard.mask_name)
    if shard.mask_sha256 is None:
        return [f"the manifest lists no loss mask ({shard.mask_name}) for this chat shard"]
    if not path.is_file():
        return [f"loss mask {shard.mask_name} is missing"]
    if sha256_file(path)[1] != shard.mask_sha256:
        return [f"loss mask {shard.mask_name} sha256 does not match the manifest"]
    try:
        MaskFile(path, tokens).close()
    except DatasetError as err:
        return [str(err)]
    return []


def _document_problems(pair: MegatronShard, info: TokenInfo, starts: tuple[int, np.ndarray] | None,
                       report: VerifyReport) -> list[str]:
    """A token shard's documents (its structure checked), :data:`~fastio.formats.megatron.CHECK_CHUNK` at a time
    (bounded memory): each ends with the end-of-document id, the ids as :class:`~fastio.tokens.ids.IdScan` checks
    them and not above the manifest's largest, and its entries of the document-starts table (``starts``) are its
    documents' starts; a chat shard's conversations none longer than the manifest's ``tokens.chat.longest``."""
    problems, table, ids, end_bad, longest = [], [], IdScan(info.vocab_size), None, 0
    every = starts[0] if starts is not None else 0
    for lo, edges in pair.index.edge_chunks():
        if every:
            table.append(edges[np.arange(-lo % every, edges.size - 1, every)])
        longest = max(longest, int(np.diff(edges).max(initial=0)))
        docs = np.flatnonzero(edges[1:] > edges[:-1])  # documents with tokens
        if not docs.size:
            continue
        tokens = pair.tokens(int(edges[0]), int(edges[-1] - edges[0]))
        bad = docs[tokens[edges[docs + 1] - 1 - edges[0]] != info.eos_id] if info.chat is None else docs[:0]
        end_bad = lo + int(bad[0]) if end_bad is None and bad.size else end_bad
        ids.see(int(edges[0]), tokens)
        pair.release_pages()
    if starts is not None and not np.array_equal(starts[1], np.concatenate([*table, [pair.index.tokens]])):
        problems.append(f"its entries of the document starts table {info.starts.name} disagree with its .idx")
    if end_bad is not None:
        problems.append(f"document {end_bad} does not end with the end-of-document id {info.eos_id}")
    problems += ids.problems(pair.index)
    report.longest_conversation = max(report.longest_conversation, longest) if info.chat is not None else 0
    if info.chat is not None and longest > info.chat.longest:  # a Loader would admit a seq_len that cuts it
        problems.append(f"holds a conversation of {count(longest, 'token')}, more than the manifest's "
                        f"tokens.chat.longest ({info.chat.longest})")
    if info.max_id is not None and ids.high is not None and ids.high > info.max_id:
        problems.append(id_problem(ids.high, None, info.max_id))
    return problems


def _each_shard(records: list[ShardRecord], fetch: Callable[[ShardRecord], list[Path]] | None) -> Iterator[ShardRecord]:
    """``records``; with ``fetch`` (a remote DEST), each shard's files are fetched into the dataset's folder
    before it is checked and deleted after."""
    for shard in records:
        paths = fetch(shard) if fetch is not None else []
        try:
            yield shard
        finally:
            for p in paths:
                p.unlink(missing_ok=True)


def _verify_one(root: Path, prefix: str, decode: bool, report: VerifyReport,
                fetch: Callable[[ShardRecord], list[Path]] | None = None, listed_files: list[str] | None = None) -> None:
    """Check the dataset in ``root``. A remote DEST passes ``fetch`` (its shard files, one shard at a time, into
    ``root/shards/``) and ``listed_files`` (the names under its ``shards/``); a local one's folder is listed here,
    and its shards are where the manifest says (``shards/``, or where ``fastio index`` found them)."""
    manifest = load_manifest(root)
    local = LocalFiles(root) if fetch is None else None
    if not (manifest.converted_from or {}).get("indexed_in_place"):  # in place, shards/ is the user's, not fastio's
        _stray_files(root, prefix, manifest.shards, listed_files, report)
    parsed, found = [], len(report.problems)  # (record, .idx entries) for the consolidated index check
    starts, report.longest_conversation = _starts_table(root, prefix, manifest, report), 0
    for shard in _each_shard(manifest.shards, fetch):
        checked = _verify_shard(root, prefix, shard, manifest, local, decode, report, starts.get(shard.name))
        if checked is not None:
            parsed.append(checked)
    if len(report.problems) == found:  # every shard read whole: their longest is the dataset's
        report.problems += _longest_problem(prefix, manifest, report.longest_conversation)
    record = manifest.index
    if record is not None:
        shards_ok = len(report.problems) == found  # else the shards' problems are the ones to report
        for what in check_sample_index(root / record.name, record, parsed if shards_ok else None, manifest.fields):
            report.problems.append(Problem(f"{prefix}{record.name}", None, what))
    if manifest.probes is not None:
        report.problems += [Problem(f"{prefix}{manifest.probes.name}", None, what)
                            for what in _probe_problems(root / manifest.probes.name, manifest)]


def _longest_problem(prefix: str, manifest: Manifest, longest: int) -> list[Problem]:
    """A chat dataset's manifest whose ``tokens.chat.longest`` is above its shards' ``longest`` conversation (a
    Loader would refuse a seq_len that every conversation fits; one below is named with its shard)."""
    chat = manifest.tokens.chat if manifest.tokens is not None else None
    if chat is None or chat.longest <= longest:
        return []
    return [Problem(f"{prefix}{MANIFEST_NAME}", None, f"tokens.chat.longest is {chat.longest}, the longest "
                                                      f"conversation of its shards has {count(longest, 'token')}")]


def _starts_table(root: Path, prefix: str, manifest: Manifest, report: VerifyReport
                  ) -> dict[str, tuple[int, np.ndarray]]:
    """A token dataset's document-starts table checked against the manifest (size, checksums, layout), by shard
    name, for each shard's check against its ``.idx``; empty where there is none (reported if it is missing)."""
    record = manifest.tokens.starts if manifest.tokens is not None else None
    if record is None:
        return {}
    path, label = root / record.name, f"{prefix}{record.name}"
    problems = _file_problems(path, record) if path.is_file() else ["document starts table is missing"]
    if not problems:
        try:
            every, values = read_starts(path, record, [s.samples for s in manifest.shards])
            return {s.name: (every, v) for s, v in zip(manifest.shards, values)}
        except DatasetError as err:
            problems = [f"document starts table does not parse: {err}"]
    report.problems += [Problem(label, None, what) for what in problems]
    return {}


def _probe_problems(path: Path, manifest: Manifest) -> list[str]:
    """The probe table (``fastio index``'s, of video and audio samples): size and checksums against the manifest's
    record, and its layout (a probe entry per sample)."""
    record = manifest.probes
    if not path.is_file():
        return ["probe table is missing"]
    out = _file_problems(path, record)
    if not out:
        try:
            ProbeTable.open(path, path.name, manifest.total_samples).check()
        except (OSError, ValueError) as err:
            out.append(f"probe table does not parse: {err}")
    return out


def _stray_files(root: Path, prefix: str, records: list[ShardRecord], listed_files: list[str] | None,
                 report: VerifyReport) -> None:
    """A problem for each file in ``shards/`` (``listed_files``, else the folder listed) the manifest does not list."""
    listed = {name for shard in records for name in (shard.name, shard.idx_name)}
    listed |= {shard.mask_name for shard in records if shard.mask_sha256 is not None}
    folder = root / SHARDS_DIR
    if listed_files is None:
        listed_files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    for name in listed_files:
        if name not in listed:
            report.problems.append(Problem(f"{prefix}{SHARDS_DIR}/{name}", None, "file is not listed in the manifest"))


def _verify_shard(root: Path, prefix: str, shard: ShardRecord, manifest: Manifest, local: LocalFiles | None,
                  decode: bool, report: VerifyReport, starts: tuple[int, np.ndarray] | None = None
                  ) -> tuple[ShardRecord, list | None] | None:
    """Check one shard's files (a token shard's: also against ``starts``, its entries of the document-starts table);
    its (record, .idx entries) for the consolidated index check (None: not checked that far, or a token shard)."""
    label = f"{prefix}{shard.location or shard.name}"  # where the file is (indexed in place: its path below DEST)
    tar_path, idx_path = root / SHARDS_DIR / shard.name, root / SHARDS_DIR / shard.idx_name
    if local is not None:
        try:
            tar_path, idx_path = local.shard_path(shard), local.idx_path(shard)
        except DatasetError as err:
            report.problems.append(Problem(label, None, str(err)))
            return None
    report.shards += 1
    if not tar_path.is_file():
        report.problems.append(Problem(label, None, "shard file is missing"))
        return None
    report.problems += [Problem(label, None, what) for what in _file_problems(tar_path, shard)]
    if manifest.tokens is not None:
        report.problems += [Problem(label, None, what) for what in _token_problems(tar_path, idx_path, shard,
                                                                                    manifest.tokens, report, starts)]
        return None
    entries = _idx_entries(idx_path, shard, label, report)
    # entries None: a problem is reported, no index rebuild. An indexed dataset's fields are the suffixes
    # lowercased (as_fields), unless it was indexed before fastio did so (then a field may have capitals)
    foreign = (manifest.converted_from or {}).get("format") == "webdataset"
    lower = foreign and entries is not None and all(f == f.lower() for f in manifest.fields)
    ids = _TokensCheck(manifest.image_text or ImageTextInfo(), options_image_token_id(manifest.convert_options))
    images = manifest.image_order if decode and not is_image_text(manifest.convert_options) else ()
    _verify_tar(tar_path, shard, entries, decode, foreign, label, report, ids, images)
    return shard, as_fields(entries) if lower else entries


def _file_problems(path: Path, shard: ShardRecord | IndexRecord) -> list[str]:
    """The file's size and checksums against its record (a shard's, or the probe table's)."""
    size, digests = digests_file(path, ("sha256", "xxh3_128") if shard.xxh3_128 else ("sha256",))
    out = [f"size {count(size, 'byte')}, manifest says {shard.bytes}"] if size != shard.bytes else []
    if digests["sha256"] != shard.sha256:
        out.append("sha256 does not match the manifest")
    if shard.xxh3_128 and digests["xxh3_128"] != shard.xxh3_128:
        out.append("xxh3_128 does not match the manifest")
    return out


def _idx_entries(idx_path: Path, shard: ShardRecord, label: str, report: VerifyReport) -> list | None:
    """The shard's ``.idx`` entries, checked against the record (None: missing or unparsable, reported); messages
    name it as the manifest places it (indexed in place: its path below DEST)."""
    shown = shard.idx_location or shard.idx_name
    if not idx_path.is_file():
        report.problems.append(Problem(label, None, f"index {shown} is missing"))
        return None
    if sha256_file(idx_path)[1] != shard.idx_sha256:
        report.problems.append(Problem(label, None, f"index {shown} sha256 does not match the manifest"))
    try:
        entries = parse_index(idx_path.read_text(), source=shown)
    except (ValueError, UnicodeDecodeError) as err:
        report.problems.append(Problem(label, None, f"index does not parse: {err}"))
        return None
    try:
        check_index(entries, samples=len(entries), tar_bytes=shard.bytes, source=shown)
    except ValueError as err:
        report.problems.append(Problem(label, None, f"index is inconsistent: {err}"))
    return entries


def _verify_tar(tar_path: Path, shard: ShardRecord, entries: list | None, decode: bool, foreign: bool, label: str,
                report: VerifyReport, ids: _TokensCheck, images: tuple[str, ...] = ()) -> None:
    """The tar's samples: their count against the record, keys adjacent, their ``tokens.i32`` ids checked by ``ids``
    (an image-text dataset's vocabulary record and image token), each holding one of ``images`` (the image fields
    the image pipelines read, :attr:`Manifest.image_order`; empty: not checked), and the ``.idx`` entries matching
    them."""
    try:
        samples = _tar_samples(tar_path, decode, report, label, foreign, ids)
    except (tarfile.TarError, OSError, EOFError) as err:
        report.problems.append(Problem(label, None, f"tar does not parse ({err})"))
        return
    report.samples += len(samples)
    if len(samples) != shard.samples:
        report.problems.append(Problem(label, None, f"holds {count(len(samples), 'sample')}, manifest says {shard.samples}"))
    seen: set[str] = set()
    for key, members in samples:
        if key in seen:
            report.problems.append(Problem(label, key, "key appears in two places (members not adjacent)"))
        seen.add(key)
        report.problems.extend(Problem(label, key, what) for what in _image_text_problems(members, ids.image_pair(key)))
        report.problems.extend(Problem(label, key, what) for what in _fields_twice(key, members))
        if images and not any(field_of(ext) in images or ext in images for ext, _, _ in members):
            report.problems.append(Problem(label, key, f"sample has no image field ({', '.join(images)}): an image "
                                                       "pipeline (fastio.ImageTrain, ImageEval) refuses it"))
    if entries is None:
        return
    for i, (key, members) in enumerate(samples):
        if i >= len(entries):
            report.problems.append(Problem(label, key, "sample is missing from the index"))
            break
        if entries[i].key != key or list(entries[i].members) != members:
            report.problems.append(Problem(label, key, f"index entry {i} does not match the tar"))
    if len(entries) > len(samples):
        report.problems.append(Problem(label, entries[len(samples)].key, "index lists a sample the tar lacks"))


def _fields_twice(key: str, members: list[tuple[str, int, int]]) -> list[str]:
    """A field a sample holds twice as WebDataset reads fields, lowercased (``a.jpg`` and ``a.JPG``): its reader
    refuses such a sample."""
    first: dict[str, str] = {}
    out = []
    for ext, _, _ in members:
        field = field_of(ext)
        if field in first:
            out.append(f"field {field!r} twice (members {key}.{first[field]} and {key}.{ext}: fields are suffixes "
                       "lowercased, as WebDataset reads them); WebDataset's reader refuses the sample")
        first.setdefault(field, ext)
    return out


def _image_text_problems(members: list[tuple[str, int, int]], image_tokens: tuple[int, int] | None) -> list[str]:
    """An image-text sample's members (:mod:`fastio.formats.image_text`) checked by their sizes: tokens and mask
    agreeing, images numbered 0, 1, ..., as many as its image tokens (``image_tokens``: their count and id, None
    where not counted); [] for any other sample."""
    sizes = {ext: size for ext, _, size in members}
    return member_problems(sizes, image_tokens) if TOKENS_FIELD in sizes or MASK_FIELD in sizes else []


def verify(dest: str | Path, *, decode: bool = False, storage_options: dict | None = None) -> VerifyReport:
    """Recompute every shard's sha256 (and xxh3-128, when recorded) and every index's sha256, parse every tar
    member, compare counts and the index with the manifest; with ``decode`` also decode every image, a clip of each
    video (:data:`VERIFY_CLIP_FRAMES` frames from the first, PyAV; each video also probed whole, which names a VP8/VP9
    frame size change) and every audio file (PyAV, and DALI's audio decoder
    with :class:`fastio.AudioClips`' arguments: a file it cannot open, or reads fewer samples of, is named).
    DatasetError if DEST is not a dataset at all; every other finding is a :class:`Problem` in the report.

    An ``s3://`` DEST is checked object by object: each shard and index is downloaded into a temporary
    folder (not the cache: a damaged object is reported, not refused), checked, and deleted."""
    dest = local_or_url(dest)
    if isinstance(dest, str):
        return _verify_remote(dest, decode, storage_options)
    report = VerifyReport(dest)
    splits = split_names(dest)
    for name in splits or [""]:
        _verify_one(dest / name if name else dest, f"{name}/" if name else "", decode, report)
    return report


def _remote_file(storage, prefix: str, location: str):
    """The storage and key of a shard file of the remote dataset at ``storage``/``prefix`` (a key relative to it,
    or an ``s3://`` URL anywhere)."""
    if location.startswith("s3://"):
        bucket, key = location[len("s3://"):].split("/", 1)
        return open_storage(f"s3://{bucket}", storage.options), key
    return storage, f"{prefix}{location}"


def _verify_remote(url: str, decode: bool, storage_options: dict | None) -> VerifyReport:
    storage = open_storage(url, storage_options)
    report = VerifyReport(url)
    splits = dest_split_names(url, storage_options)
    with tempfile.TemporaryDirectory(prefix="fastio-verify-") as tmp:
        for name in splits or [""]:
            sub, prefix = Path(tmp) / name, f"{name}/" if name else ""
            (sub / SHARDS_DIR).mkdir(parents=True)
            try:
                storage.get_to_file(f"{prefix}{MANIFEST_NAME}", sub / MANIFEST_NAME)
            except StorageError as err:
                if err.missing:
                    raise no_manifest(storage.url_of(prefix.rstrip("/")), storage) from None
                raise
            try:  # the sample index and probe table are small: fetched once, checked like local ones
                loaded = load_manifest(sub)
                for record in (loaded.index, loaded.probes, loaded.tokens.starts if loaded.tokens else None):
                    if record is not None:
                        storage.get_to_file(f"{prefix}{record.name}", sub / record.name)
            except StorageError as err:
                if not err.missing:
                    raise
            except DatasetError:
                pass  # reported by _verify_one, naming the URL
            listed_files = sorted(o.key.rsplit("/", 1)[1] for o in storage.list(f"{prefix}{SHARDS_DIR}/"))

            def fetch(shard: ShardRecord, sub: Path = sub, prefix: str = prefix) -> list[Path]:
                paths = []
                mask = ((shard.mask_name, f"{SHARDS_DIR}/{shard.mask_name}"),) if shard.mask_sha256 else ()
                for file, location in ((shard.name, shard.tar_key), (shard.idx_name, shard.idx_key), *mask):
                    path = sub / SHARDS_DIR / file
                    where, key = _remote_file(storage, prefix, location)
                    try:
                        where.get_to_file(key, path)
                    except StorageError as err:
                        if not err.missing:
                            raise
                        path.unlink(missing_ok=True)  # reported as missing by the check
                    paths.append(path)
                return paths

            try:
                _verify_one(sub, prefix, decode, report, fetch, listed_files)
            except DatasetError as err:  # name the URL, not the temporary copy
                raise DatasetError(str(err).replace(str(sub / MANIFEST_NAME), storage.url_of(prefix + MANIFEST_NAME))
                                   .replace(str(sub), url)) from None
    return report
