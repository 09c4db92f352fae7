"""``fastio merge DEST`` of a token conversion in parts: the dataset a single ``fastio convert --tokenizer`` writes.

Each part (:func:`fastio.convert.token_convert.convert_tokens` with ``part``) tokenized a contiguous run of the documents
and cut its own shards from its first document on. The merge reads every part shard's ``.idx`` (checked against the
part record: sha256, ``.bin`` size, document count), lays the documents end to end in part order, and cuts them
where the single conversion cuts (:func:`~fastio.convert.token_convert.token_shard_cuts` on the documents' token counts). A
result shard that is exactly a part's shard is **linked** into place (a hard link; a copy where links fail); any
other is **re-packed**: its documents' tokens copied out of the part shards (no tokenizing) through
:class:`~fastio.formats.megatron.MegatronWriter`, into ``DEST/.parts/.merge/`` first. Shards after a part's first cut
usually differ from the single run's (byte-size cuts that start elsewhere rarely meet again), so most are re-packed:
a sequential copy. The document-starts table and the manifest are the single run's, byte for byte (the empty
documents and those with special-token text of every part summed), the manifest published last; DEST's life cycle
is :mod:`fastio.convert.merge`'s. A chat conversion's loss masks (``NAME.mask``) go with their shards: linked with
a linked shard, their bits copied with a re-packed one's documents; the trained tokens and longest conversation of
every part make the manifest's ``tokens.chat``.

Parts agree on a tokenizer by its content (``tokens.tokenizer_sha256`` of the plan), not by how they name its file
(:func:`comparable_plan`): the manifest names it as part 0 does. They agree on its special tokens and, in a chat
conversion, on those the template is rendered with (a ``tokenizer_config.json``'s ``bos_token``, ...), token by
token, a difference named by the token (:func:`special_token_differences`): two tokenizers of one vocabulary size,
or one tokenizer under two configs, render other ids where the checksums alone say little or nothing.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fastio.convert.dest import check_dest, reset_dest
from fastio.convert.parts import PART_RECORD, PARTS_DIR, PartRecord, part_dir
from fastio.convert.run import DEFAULT_SHARD_SIZE
from fastio.convert.token_convert import (
    nothing_to_write,
    refuse_untrained,
    shard_record,
    token_manifest,
    token_shard_cuts,
)
from fastio.dataset.manifest import (
    SHARDS_DIR,
    ChatInfo,
    Manifest,
    ShardRecord,
    TokenInfo,
    is_shard_name,
    write_manifest,
)
from fastio.errors import ConvertError, DatasetError
from fastio.formats.megatron import MegatronIndex, MegatronShard, MegatronWriter, WrittenShard, partner_path
from fastio.formats.token_mask import MASK_FORMAT, MaskFile, MaskWriter, WrittenMask, mask_path
from fastio.progress import parse_size
from fastio.storage import is_remote
from fastio.storage.atomic import fsync_dir, place_file
from fastio.storage.lock import LOCK_NAME
from fastio.tokens.starts import STARTS_NAME, shard_starts, write_starts

__all__ = ["comparable_plan", "merge_token_parts", "part_command", "special_token_differences"]


@dataclass
class _PartShard:
    """One shard of a part: its pair, its record, and where its documents start in the merged order."""

    pair: MegatronShard
    record: ShardRecord
    first: int


def comparable_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """A token part's plan as parts are compared: its tokenizer by content (``tokens.tokenizer_sha256``), not by
    the path its file was named by (relative in one part, absolute or a copy in another); a chat template likewise
    (``tokens.chat.template_sha256``); the special tokens left to :func:`special_token_differences`."""
    options = {k: v for k, v in plan.get("convert_options", {}).items() if k not in ("tokenizer", "chat_template")}
    tokens = {k: v for k, v in plan.get("tokens", {}).items() if k != "special_tokens"}
    if isinstance(tokens.get("chat"), dict):
        tokens["chat"] = {k: v for k, v in tokens["chat"].items() if k != "variables"}
    return {**plan, "convert_options": options, "tokens": tokens}


def special_token_differences(ref: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """How a part's plan differs from part 0's (``ref``) in the tokenizer's special tokens (``special token
    '<|im_end|>' id 2 (part 0: id 1)``) and the chat template's (``the chat template's bos_token '<|im_start|>'
    (part 0: '<s>')``); each compared only where both parts record it (parts converted before they were recorded)."""
    out = []
    a, b = ref.get("tokens", {}).get("special_tokens"), plan.get("tokens", {}).get("special_tokens")
    if isinstance(a, dict) and isinstance(b, dict):
        out += [f"special token {t!r} {_id(b.get(t))} (part 0: {_id(a.get(t))})" for t in sorted(set(a) | set(b))
                if a.get(t) != b.get(t)]
    a, b = ((p.get("tokens", {}).get("chat") or {}).get("variables") for p in (ref, plan))
    if isinstance(a, dict) and isinstance(b, dict):
        out += [f"the chat template's {name} {b.get(name)!r} (part 0: {a.get(name)!r})"
                for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return out


def _id(token_id: int | None) -> str:
    return "absent" if token_id is None else f"id {token_id}"


def part_command(plan: dict[str, Any], dest: Path, n: int) -> str:
    """The command that converts a missing part (K for the part's number): the other parts' options."""
    options = plan.get("convert_options", {})
    words = ["fastio", "convert", plan["source"]["path"], str(dest), "--tokenizer", options["tokenizer"]]
    for flag, key, default in (("--text-field", "text_field", "text"), ("--eos", "eos", None),
                               ("--shard-size", "shard_size", parse_size(DEFAULT_SHARD_SIZE, "shard_size")),
                               ("--max-samples-per-shard", "max_samples_per_shard", None),
                               ("--name", "name", "shard"), ("--special-in-text", "special_in_text", "plain"),
                               ("--chat-template", "chat_template", None), ("--messages-field", "messages_field",
                                                                           "messages"),
                               ("--train-on", "train_on", "generation"), ("--max-tokens", "max_tokens", None),
                               ("--overlong", "overlong", "refuse")):
        value = plan.get(key) if key == "name" else options.get(key)
        if value is not None and value != default:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words) + f" --part K/{n}"


def merge_token_parts(dest: Path, records: list[PartRecord], plan: dict[str, Any], staging: Path, *,
                      overwrite: bool) -> tuple[Manifest, dict[str, int]]:
    """Publish the parts' documents as one token dataset in DEST (see the module docstring); returns its
    manifest and ``{"linked": ..., "repacked": ...}``. DEST's lock and every part's are held by the caller."""
    source = plan["source"]["path"]
    check_dest(dest, None if is_remote(source) else Path(source), overwrite)
    shards = _part_shards(dest, records, plan["tokens"]["dtype"])
    lengths = np.concatenate([np.asarray(s.pair.index.lengths, np.int64) for s in shards] or [np.zeros(0, np.int64)])
    empty = sum(r.datasets[""]["empty_documents"] for r in records)
    special = sum(r.datasets[""].get("special_text_documents", 0) for r in records)
    if not lengths.size:
        raise nothing_to_write(source, empty, plan["tokens"].get("chat") is not None)
    options = plan["convert_options"]
    if plan["tokens"].get("chat") is not None:
        refuse_untrained(source, options["chat_template"], plan["tokens"]["chat"]["train_on"],
                         sum(r.datasets[""].get("trained_tokens", 0) for r in records), lengths.size)
    cuts = token_shard_cuts(lengths * np.dtype(plan["tokens"]["dtype"]).itemsize, options["shard_size"],
                            options["max_samples_per_shard"])
    whole = {(s.first, s.first + s.record.samples): s for s in shards}
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    placed: list[tuple[Path, ShardRecord, bool]] = []  # (file to place, its record, a link?)
    chat = plan["tokens"].get("chat")
    for i, (a, b) in enumerate(cuts):
        name = f"{plan['name']}-{i:06d}.bin"
        if (a, b) in whole:
            placed.append((whole[(a, b)].pair.bin_path, replace(whole[(a, b)].record, name=name), True))
        else:
            written, mask = _repack(shards, a, b, staging / name, plan["tokens"]["dtype"], chat is not None)
            placed.append((written.bin_path, shard_record(written, mask), False))
    result = [r for _, r, _ in placed]
    starts = write_starts(staging, [shard_starts(MegatronIndex(partner_path(src))) for src, _, _ in placed])
    info = TokenInfo(dtype=plan["tokens"]["dtype"], eos_id=plan["tokens"]["eos_id"],
                     total_tokens=sum(r.tokens for r in result), vocab_size=plan["tokens"]["vocab_size"],
                     one_sequence_per_document=True,  # the parts' pairs and the repacked ones: MegatronWriter's
                     starts=starts, chat=None if chat is None else _chat_info(chat, records),
                     tokenizer_sha256=plan["tokens"]["tokenizer_sha256"][1])  # the plan's (size, hex)
    source = {**plan["source"], "empty_documents": empty, "special_text_documents": special}
    for key in ("overlong_dropped", "overlong_truncated"):  # a chat conversion with max_tokens
        if key in records[0].datasets[""]:
            source[key] = sum(r.datasets[""][key] for r in records)
    manifest = token_manifest(plan["name"], result, info, source, options)
    _publish(dest, placed, staging / STARTS_NAME, manifest)
    linked = sum(link for _, _, link in placed)
    return manifest, {"linked": linked, "repacked": len(placed) - linked}


def _chat_info(chat: dict[str, Any], records: list[PartRecord]) -> ChatInfo:
    """The merged dataset's ``tokens.chat``: the plan's template and rule, every part's trained tokens and longest
    conversation."""
    parts = [r.datasets[""] for r in records]
    return ChatInfo(template_sha256=chat["template_sha256"], train_on=chat["train_on"], mask=MASK_FORMAT,
                    trained_tokens=sum(p.get("trained_tokens", 0) for p in parts),
                    longest=max(p.get("longest", 0) for p in parts))


def _part_shards(dest: Path, records: list[PartRecord], dtype: str) -> list[_PartShard]:
    """Every part's shards in order, each checked against its part record."""
    out, first = [], 0
    for record in records:
        folder = part_dir(dest, record.part, record.of) / SHARDS_DIR
        entries, empty = record.datasets[""].get("shards"), record.datasets[""].get("empty_documents")
        if not isinstance(entries, list) or not isinstance(empty, int):
            raise ConvertError(f"{folder.parent / PART_RECORD}: part record lacks its shards or empty documents")
        for entry in entries:
            try:
                shard = ShardRecord(**entry)
            except TypeError:
                shard = None
            if shard is None or not is_shard_name(shard.name) or not shard.name.endswith(".bin"):
                raise ConvertError(f"{folder.parent / PART_RECORD}: part record has a malformed shard "
                                   f"{entry!r}") from None
            pair = _open_pair(folder / shard.name, shard, dtype)
            out.append(_PartShard(pair, shard, first))
            first += shard.samples
    return out


def _open_pair(path: Path, shard: ShardRecord, dtype: str) -> MegatronShard:
    """A part's pair, its ``.idx`` checksum, ``.bin`` size and document count against the part record."""
    idx = partner_path(path)
    try:
        idx_sha256 = hashlib.sha256(idx.read_bytes()).hexdigest()
        pair = MegatronShard(path, dtype)
    except (OSError, DatasetError) as err:
        raise ConvertError(f"{getattr(err, 'filename', None) or idx}: {getattr(err, 'strerror', None) or err} "
                           "(a damaged part: convert it again)") from None
    if idx_sha256 != shard.idx_sha256 or pair.index.bin_bytes != shard.bytes or pair.documents != shard.samples:
        raise ConvertError(f"{path}: does not match its part record (a damaged part: convert it again)")
    return pair


def _repack(shards: list[_PartShard], a: int, b: int, path: Path, dtype: str, masked: bool
            ) -> tuple[WrittenShard, WrittenMask | None]:
    """Documents ``[a, b)`` of the merged order, copied out of the part shards into one new pair at ``path`` (and,
    ``masked``, their loss mask bits into its mask)."""
    mask = MaskWriter(mask_path(path)) if masked else None
    try:
        with MegatronWriter(path, dtype) as writer:
            for s in shards:
                lo, hi = max(a, s.first) - s.first, min(b, s.first + s.record.samples) - s.first
                if lo >= hi:
                    continue
                starts = s.pair.index.starts(np.arange(lo, hi + 1))
                writer.add_documents(s.pair.tokens(int(starts[0]), int(starts[-1] - starts[0])), np.diff(starts))
                if mask is not None:
                    mask.add(_part_mask(s).bits(np.arange(starts[0], starts[-1])))
            return writer.close(), None if mask is None else mask.close()
    except BaseException:
        if mask is not None:
            mask.abort()
        raise


def _part_mask(s: _PartShard) -> MaskFile:
    """A part shard's loss mask (its size checked against the shard's tokens: ConvertError naming it otherwise)."""
    try:
        return MaskFile(mask_path(s.pair.bin_path), s.pair.index.tokens)
    except DatasetError as err:
        raise ConvertError(f"{err} (a damaged part: convert it again)") from None


def _publish(dest: Path, placed: list[tuple[Path, ShardRecord, bool]], starts: Path, manifest: Manifest) -> None:
    """DEST's final files first out, then every pair in place (``.idx`` after its ``.bin``), the document-starts
    table, the manifest last."""
    reset_dest(dest, keep=(PARTS_DIR, LOCK_NAME))
    (dest / SHARDS_DIR).mkdir()
    for src, record, link in placed:
        place_file(src, dest / SHARDS_DIR / record.name, link=link)
        place_file(partner_path(src), dest / SHARDS_DIR / record.idx_name, link=link)
        if record.mask_sha256 is not None:
            place_file(mask_path(src), dest / SHARDS_DIR / record.mask_name, link=link)
    fsync_dir(dest / SHARDS_DIR)
    place_file(starts, dest / STARTS_NAME, link=False)
    write_manifest(dest, manifest)
