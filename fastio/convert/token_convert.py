"""``fastio convert SOURCE DEST --tokenizer tokenizer.json``: text documents into a token dataset.

Documents (:mod:`fastio.converters.documents`: JSONL, Parquet, plain text; a local file or folder, or an ``s3://``
object or prefix read through :mod:`fastio.convert.corpus`, in sorted key order) are tokenized in batches with the
``tokenizers`` library (the file's own tokenizer, no special tokens added), in worker processes
(:class:`~fastio.convert.workers.OrderedPool`: results in input order), and each non-empty one is written with the
end-of-document token appended, in input order, into ``DEST/shards/NAME-NNNNNN.bin`` + ``.idx`` (Megatron's format,
:mod:`fastio.formats.megatron`). A shard is cut when the next document would take its ``.bin`` past ``shard_size``
bytes or it holds ``max_samples_per_shard`` documents. Empty documents are skipped and counted. Then the
document-starts table (``DEST/doc-starts.fxs``, :mod:`fastio.tokens.starts`); the manifest
(``kind: "tokens"``, checksums of every file, token type, end-of-document id, vocabulary size, per-shard document
and token counts) is published last; DEST's life cycle and its one-writer lock are those of
:func:`fastio.convert.run.convert` (marker first, lock held throughout, a rerun redoes an interrupted DEST); a
refused run (bad input, a full disk) takes back what it made in DEST (:class:`fastio.convert.dest.Claim`).

Special tokens. The end-of-document token must be one of the tokenizer's special tokens, and no document holds a
special token's id: a document whose text holds a special token's string (``<|endoftext|>`` in web text) is
encoded again with ``encode_special_tokens`` (the string as plain text; counted), or refused with
``special_in_text="refuse"`` (naming the document). The token type fits the largest id the tokenizer has (a
vocabulary with a hole up to id 70,000 is ``int32``); the manifest's vocabulary size is that id + 1.

Conversations (``chat_template``): each document is a conversation, the list of
messages in ``messages_field``, rendered with a Hugging Face chat template and tokenized as a whole as transformers'
``apply_chat_template`` does (:mod:`fastio.convert.chat_encode`; no end-of-document token appended: the stored ids
are the template's), and each shard gets a loss mask ``NAME.mask`` beside its ``.bin``
(:mod:`fastio.formats.token_mask`) marking the tokens of the template's ``{% generation %}`` blocks (``train_on=
"all"``: every token); the manifest's ``tokens.chat`` records the template's checksum, the trained tokens and the
longest conversation, each shard record its mask's sha256. A conversion (or merge) that would train no token at all
is refused (:func:`refuse_untrained`); the options of plain documents (``text_field``, ``special_in_text``) are
refused with a template rather than ignored.

With ``part`` (K, N), only the documents of part K's span of the listing (:func:`fastio.convert.corpus.part_span`)
are tokenized, into ``DEST/.parts/part-K-of-N/`` (its own lock; ``part.json`` last, holding the part's shard
records and the plan every part must share: source listing, options, tokenizer checksum, end-of-document id);
``fastio merge DEST`` (:mod:`fastio.convert.token_merge`) then publishes the dataset a single conversion writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from fastio.checks import check_fields, checked, config_error, one_of, positive_integer, rule
from fastio.convert.chat_encode import OVERLONG, TRAIN_ON, ChatEncoder, refuse_unencodable
from fastio.convert.corpus import Corpus, open_corpus, part_span
from fastio.convert.dest import Claim, check_dest, lock_parts, upload_dataset
from fastio.convert.parts import (
    PartRecord,
    parse_part,
    part_dir,
    start_part_dir,
    write_part_record,
)
from fastio.convert.run import DEFAULT_SHARD_SIZE
from fastio.convert.workers import OrderedPool, workers_field
from fastio.dataset.manifest import (
    SHARDS_DIR,
    ChatInfo,
    IndexRecord,
    Manifest,
    ShardRecord,
    TokenInfo,
    make_manifest,
    write_manifest,
)
from fastio.errors import ConvertError, install_hint
from fastio.formats.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from fastio.formats.megatron import MegatronIndex, MegatronWriter, WrittenShard, token_dtype
from fastio.formats.token_mask import MASK_FORMAT, MaskWriter, WrittenMask, mask_path
from fastio.formats.wds import is_plain_name
from fastio.progress import count, human_bytes, parse_size, trained_line
from fastio.storage.checksum import sha256_file
from fastio.storage.url import dest_location, local_or_url
from fastio.tokens.starts import shard_starts, write_starts

__all__ = ["EOS_NAMES", "SPECIAL_IN_TEXT", "TOKEN_PLAN", "TokenConvertConfig", "TokenConvertResult", "convert_tokens",
           "eos_token_id", "load_tokenizer", "shard_record", "special_tokens", "starts_new_token_shard", "token_manifest",
           "token_shard_cuts", "tokenizer_sha256", "vocab_size", "with_specials"]

TOKEN_PLAN = "tokens"
"""``plan["kind"]`` of a token conversion's part records (:mod:`fastio.convert.token_merge` merges them)."""

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
"""Special tokens taken as the end-of-document token when ``eos`` is not given, in this order of preference."""

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
"""Special tokens taken as a chat template's ``bos_token`` when its ``tokenizer_config.json`` names none."""

SPECIAL_IN_TEXT = ("plain", "refuse")
"""What a special token's string in document text becomes: plain text (the default), or a refusal."""


_FIELD = rule(lambda v: isinstance(v, str) and v != "", "must be a field name")
"""A JSONL field or Parquet column: a non-empty str."""


@dataclass(frozen=True)
class TokenConvertConfig:
    """A token conversion's options, checked at construction (a ``ValueError`` names the parameter)."""

    source: Path | str
    """A document file or a folder of them, or an ``s3://`` object or prefix (kept as a str)."""
    dest: Path | str
    """The dataset folder to write (``..`` after a folder that does not exist folded, as
    :func:`fastio.convert.run.convert`'s), or an ``s3://`` prefix (kept as a str: written in ``staging_dir``, then
    uploaded, the manifest last, as :func:`fastio.convert.run.convert` does)."""
    tokenizer: Path
    """A Hugging Face ``tokenizer.json``."""
    text_field: str = checked(_FIELD, default="text")
    """JSONL field / Parquet column holding each document's text (with ``chat_template``: only ``"text"``, the
    messages are read from ``messages_field``: another is a ValueError)."""
    eos: str | None = None
    """End-of-document token, one of the tokenizer's special tokens (default: its end-of-text token,
    :data:`EOS_NAMES`)."""
    workers: int = workers_field()
    """Tokenizing processes (1: in this process)."""
    shard_size: int | str = DEFAULT_SHARD_SIZE
    """Largest ``.bin`` in bytes (or human units: ``256MB``)."""
    max_samples_per_shard: int | None = checked(positive_integer, default=None)
    """At most this many documents per shard."""
    name: str = checked(rule(is_plain_name, "must be letters, digits, '_' or '-'"), default="shard")
    """Shard file prefix: ``shards/NAME-000000.bin``."""
    overwrite: bool = False
    """Replace a dataset or other files in DEST."""
    batch_size: int = checked(positive_integer, default=256)
    """Documents per ``encode_batch`` call (and per message to a worker)."""
    storage_options: dict | None = None
    """For an ``s3://`` source: endpoint, region, credentials over the environment's
    (:class:`fastio.storage.StorageOptions`)."""
    part: tuple[int, int] | str | None = None
    """``(K, N)``, ``"K/N"`` or ``"auto/N"`` (K from ``SLURM_ARRAY_TASK_ID``): tokenize only part K of N into
    ``DEST/.parts/`` for a later ``fastio merge``; None: the whole dataset."""
    staging_dir: Path | None = None
    """For an ``s3://`` DEST: where the dataset is written before its upload (:func:`fastio.convert.dest.staging_path`;
    default: the system's temporary directory)."""
    special_in_text: str = checked(rule(lambda v: v in SPECIAL_IN_TEXT, "must be 'plain' or 'refuse'"), default="plain")
    """A special token's string in a document's text (``<|endoftext|>``): ``"plain"`` encodes it as text (the
    documents counted), ``"refuse"`` is a ConvertError naming the document. With ``chat_template``: only ``"plain"``
    (a ValueError otherwise: a special token's string in a message is that special token, as in transformers)."""
    chat_template: Path | None = None
    """Conversations: a Hugging Face chat template (a ``.jinja`` file, or a ``tokenizer_config.json`` holding
    ``chat_template`` and its special tokens); each document is the list of messages in ``messages_field``."""
    messages_field: str = checked(_FIELD, default="messages")
    """With ``chat_template``: the JSONL field / Parquet column holding each conversation's messages."""
    train_on: str = checked(rule(lambda v: v in TRAIN_ON, "must be 'generation' or 'all'"), default="generation")
    """With ``chat_template``: ``generation`` (the tokens of the template's ``{% generation %}`` blocks: the
    assistant's replies) or ``all`` (every token)."""
    max_tokens: int | None = checked(positive_integer, default=None)
    """With ``chat_template``: the most tokens a conversation may have (None: no limit here; a Loader refuses a
    ``seq_len + 1`` below the longest). Set it to the training ``seq_len + 1``."""
    overlong: str = checked(one_of(OVERLONG), default="refuse")
    """With ``max_tokens`` (``drop`` and ``truncate`` without it: a ValueError): a longer conversation is refused
    (``refuse``), left out and counted (``drop``), or cut to its first turns that fit, whole, ending with a reply
    (the model's: a message the template trains in a ``{% generation %}`` block, of any role but a prompt's,
    ShareGPT's ``gpt`` too, never a user's; ``truncate``; counted; dropped when even the first exchange is too
    long). Never cut mid-turn
    (:mod:`fastio.convert.chat_encode`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        object.__setattr__(self, "source", local_or_url(self.source))
        object.__setattr__(self, "dest", dest_location(self.dest))  # ``..`` after a missing folder folded
        if self.part is not None:
            object.__setattr__(self, "part", parse_part(self.part))
            if isinstance(self.dest, str):
                raise ValueError(f"part: needs a DEST on a (shared) file system, not {self.dest}; convert the "
                                 "parts there, merge, then upload")
        object.__setattr__(self, "shard_size", parse_size(self.shard_size, "shard_size"))
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", Path(self.chat_template))
        check_fields(self, config_error)
        if self.chat_template is not None:
            _refuse_plain_text_options(self)
        if self.overlong != "refuse" and self.max_tokens is None:
            raise ValueError(f"overlong={self.overlong!r} needs max_tokens=N (the most tokens a conversation may "
                             "have; without it no conversation is over)")

    @property
    def field(self) -> str:
        """The field each document is read from: the messages (a chat conversion) or the text."""
        return self.text_field if self.chat_template is None else self.messages_field


def _refuse_plain_text_options(config: TokenConvertConfig) -> None:
    """A ValueError where a conversion of conversations is given an option of plain documents only (it would be
    ignored, the user believing it applied)."""
    if config.special_in_text != "plain":
        raise ValueError(f"special_in_text={config.special_in_text!r} is not an option of a conversion of "
                         "conversations (chat_template): a special token's string in a message is that special token, "
                         "as transformers encodes it")
    if config.text_field != "text":
        raise ValueError(f"text_field={config.text_field!r} is not an option of a conversion of conversations "
                         "(chat_template): the conversations are read from "
                         f"messages_field={config.messages_field!r}")


@dataclass(frozen=True)
class TokenConvertResult:
    """What :func:`convert_tokens` wrote."""

    dest: Path | str
    shards: int
    documents: int
    tokens: int
    empty: int
    """Empty documents skipped."""
    bytes: int
    seconds: float
    dtype: str
    eos_id: int
    part: tuple[int, int] | None = None
    """(K, N) when this was one part of a conversion in parts."""
    special_text: int = 0
    """Documents whose text held a special token's string, encoded as plain text."""
    trained: int | None = None
    """A chat conversion's trained tokens (their loss mask set); None: plain documents."""
    dropped: int = 0
    """Conversations over ``max_tokens`` left out (``overlong="drop"``, or ``"truncate"`` where nothing fit)."""
    truncated: int = 0
    """Conversations over ``max_tokens`` cut to their first turns (``overlong="truncate"``)."""
    max_tokens: int | None = None
    """A chat conversion's ``max_tokens`` (what ``dropped`` and ``truncated`` were over)."""

    def summary(self, words: Callable[[str], str] = str) -> str:
        """One line: documents, tokens, shards, what was skipped, dropped or cut; ``words`` puts the options it
        names (``max_tokens=4096``) as the reader knows them (the command: ``--max-tokens 4096``)."""
        rate = self.tokens / max(self.seconds, 1e-9)
        where = f"part {self.part[0]}/{self.part[1]} of {self.dest} (merge with fastio merge)" if self.part else self.dest
        special = (f"; {count(self.special_text, 'document')} with special-token text encoded as plain text"
                   if self.special_text else "")
        if self.trained is not None:
            special += trained_line(self.trained, self.tokens)
        if self.dropped or self.truncated:
            special += (f"; over {words(f'max_tokens={self.max_tokens}')}: {count(self.dropped, 'conversation')} "
                        f"dropped, {self.truncated} cut to their first turns")
        return (f"{where}: {count(self.documents, 'document')}, {count(self.tokens, f'{self.dtype} token')} "
                f"({human_bytes(self.bytes)}) in {count(self.shards, 'shard')}; {count(self.empty, 'empty document')}"
                f" skipped{special}; end of document: id {self.eos_id}; {self.seconds:.1f}s ({rate:.0f} tokens/s)")


# -- the tokenizer ------------------------------------------------------------------------------------

def load_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` (ConvertError naming the file otherwise), without the
    truncation or padding the file may save: transformers' tokenizer applies them only when asked (its
    ``apply_chat_template`` and ``tokenizer(text)`` never), and a conversion must not cut or pad a document."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConvertError(f"tokenizers is not installed: {install_hint('tokens')}") from None
    if not Path(path).is_file():
        raise ConvertError(f"{path}: no such tokenizer file (a Hugging Face tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the Rust side raises a bare Exception)
        raise ConvertError(f"{path}: not a tokenizer.json ({str(err).splitlines()[0][:200]})") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def tokenizer_sha256(path: Path) -> str:
    """The hex sha256 of a tokenizer file's bytes, as a conversion was given it: what a token or image-text
    dataset's manifest records of its tokenizer (``tokens.tokenizer_sha256``, ``image_text.tokenizer_sha256``), and
    what a :class:`fastio.Mixture` compares. The file's bytes, not the ``tokenizers`` library's serialisation of the
    tokenizer it loads (which changes between its versions): one file gives one checksum whichever fastio reads it.
    An image-text conversion's image token is one of the file's own tokens (convert adds none), so a plain, a chat
    and an image-text dataset of one file record the same checksum."""
    return sha256_file(path)[1]


def vocab_size(tokenizer) -> int:
    """The ids of a ``tokenizers.Tokenizer``: its largest id + 1 (added tokens included, holes counted), what a
    conversion records as the manifest's ``vocab_size``."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=0) + 1


def special_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens: content -> id."""
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def eos_token_id(tokenizer, eos: str | None, path: Path, named_by: str | None = None) -> int:
    """The id of ``eos``, or of the tokenizer's end-of-text token (:data:`EOS_NAMES`) when ``eos`` is None; either
    one of its special tokens (an ordinary word as ``eos`` would end every document that holds it). ``named_by``:
    what named ``eos`` for the message where it is not one (default: the ``eos`` option)."""
    specials = special_tokens(tokenizer)
    have = ", ".join(sorted(specials)) or "none"
    if eos is not None:
        if eos not in specials:
            raise ConvertError(f"{path}: {eos!r} is not a special token ({named_by or f'eos={eos!r}'}); its special "
                               f"tokens: {have}")
        return specials[eos]
    found = next((specials[n] for n in EOS_NAMES if n in specials), None)
    if found is None:
        raise ConvertError(f"{path}: no end-of-text token among its special tokens ({have}); name the "
                           "end-of-document token with eos=TOKEN")
    return found


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Path, eos_id: int, dtype: str, special_in_text: str, text_field: str,
                 template: ChatTemplate | None = None, chat: tuple = ()) -> None:
    tok, plain = load_tokenizer(tokenizer), load_tokenizer(tokenizer)
    plain.encode_special_tokens = True  # a special token's string is split as any text (tokenizers >= 0.15.1)
    _WORKER.update(tokenizer=tok, plain=plain, specials=np.array(sorted(special_tokens(tok).values()), np.int64),
                   eos_id=eos_id, dtype=np.dtype(dtype), refuse=special_in_text == "refuse", field=text_field,
                   chat=None if template is None else ChatEncoder(tok, template, *chat[:1], text_field, np.dtype(dtype),
                                                                  *chat[1:]))


def _concat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    return lengths, np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum()))


def _documents_with(lengths: np.ndarray, flat: np.ndarray, ids: np.ndarray) -> list[int]:
    """The documents (positions in ``lengths``) holding one of ``ids``."""
    hits = np.flatnonzero(np.isin(flat, ids, kind="table"))
    return np.unique(np.searchsorted(np.cumsum(lengths), hits, side="right")).tolist()


def _encode(batch: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray, dict[str, int], np.ndarray | None]:
    """(tokens per document, all tokens, counts (``special``: documents with special-token text; a chat
    conversion's ``dropped`` and ``truncated``), all mask bits or None) of ``(wheres, texts)``: each non-empty
    document's ids + the end-of-document id (an empty document has length 0). A document whose ids hold a special
    token is refused or encoded again with its special-token strings as plain text (:func:`_as_plain_text`). A chat
    conversion's: :meth:`~fastio.convert.chat_encode.ChatEncoder.encode`."""
    wheres, texts = batch
    w = _WORKER
    if w["chat"] is not None:
        lengths, ids, mask, counts = w["chat"].encode(wheres, texts)
        return lengths, ids, counts, mask
    try:
        docs = [e.ids for e in w["tokenizer"].encode_batch(texts, add_special_tokens=False)]
    except TypeError:  # tokenizers' refusal of a str that is not text
        refuse_unencodable(wheres, texts, w["field"])
        raise
    lengths, flat = _concat(docs)
    held = _documents_with(lengths, flat, w["specials"])
    if held:
        _as_plain_text(docs, held, wheres, texts)
        lengths, flat = _concat(docs)
    ends = np.cumsum(lengths)[lengths > 0]
    flat = np.insert(flat, ends, w["eos_id"])  # after every non-empty document
    return lengths + (lengths > 0), flat.astype(w["dtype"]), {"special": len(held)}, None


def _as_plain_text(docs: list[list[int]], held: list[int], wheres: list[str], texts: list[str]) -> None:
    """``docs[i]`` for ``i`` in ``held`` encoded with special-token strings as text; a ConvertError naming the first
    document with ``special_in_text="refuse"``, or if a document still holds the end-of-document id."""
    w = _WORKER
    if w["refuse"]:
        specials = set(w["specials"].tolist())
        token = w["tokenizer"].id_to_token(next(t for t in docs[held[0]] if t in specials))
        raise ConvertError(f"{wheres[held[0]]}: field {w['field']!r} holds the special token {token!r} "
                           "(special_in_text='refuse'; 'plain' encodes it as text)")
    encodings = w["plain"].encode_batch([texts[i] for i in held], add_special_tokens=False)
    for i, e in zip(held, encodings):
        if w["eos_id"] in e.ids:  # the model itself (not the added-token split) makes the id: a broken tokenizer
            raise ConvertError(f"{wheres[i]}: the tokenizer encodes this text with the end-of-document id "
                               f"{w['eos_id']} inside it, as text; name another end-of-document token with eos=TOKEN")
        docs[i] = e.ids


# -- writing ------------------------------------------------------------------------------------------

def starts_new_token_shard(documents: int, nbytes: int, doc_bytes: int, shard_size: int,
                           max_documents: int | None) -> bool:
    """The cut rule: a shard holding ``documents`` (``nbytes`` of ``.bin``) is closed before the next document
    (``doc_bytes``) when it holds ``max_documents`` or the document would take it past ``shard_size``."""
    return documents > 0 and (max_documents is not None and documents >= max_documents
                              or nbytes + doc_bytes > shard_size)


def token_shard_cuts(doc_bytes: np.ndarray, shard_size: int, max_documents: int | None) -> list[tuple[int, int]]:
    """Where :func:`starts_new_token_shard` cuts documents of these ``.bin`` sizes, in order: ``[(start, end), ...]``
    (one binary search per shard on the running byte total, for a merge of 10^8 documents)."""
    cum = np.zeros(len(doc_bytes) + 1, np.int64)
    np.cumsum(doc_bytes, out=cum[1:])
    cuts, start, n = [], 0, len(doc_bytes)
    while start < n:
        end = int(np.searchsorted(cum, cum[start] + shard_size, side="right")) - 1  # the bytes still fit
        end = max(start + 1, min(end, n, start + (max_documents or n)))  # the document limit; at least one
        cuts.append((start, end))
        start = end
    return cuts


class _ShardSeries:
    """Shards ``NAME-NNNNNN.bin`` one after another in ``folder``, cut by :func:`starts_new_token_shard`."""

    def __init__(self, config: TokenConvertConfig, dtype: str, folder: Path):
        self.config, self.dtype, self.itemsize, self.folder = config, dtype, np.dtype(dtype).itemsize, folder
        self.written: list[WrittenShard] = []
        self.masks: list[WrittenMask] = []
        self.writer: MegatronWriter | None = None
        self.mask: MaskWriter | None = None

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append one document (and, in a chat conversion, its loss mask bits)."""
        w = self.writer
        if w is not None and starts_new_token_shard(w.documents, w.bytes, tokens.size * self.itemsize,
                                                    self.config.shard_size, self.config.max_samples_per_shard):
            self._close_shard()
            w = None
        if w is None:
            path = self.folder / f"{self.config.name}-{len(self.written):06d}.bin"
            w = self.writer = MegatronWriter(path, self.dtype)
            self.mask = None if mask is None else MaskWriter(mask_path(path))
        w.add(tokens)
        if self.mask is not None:
            self.mask.add(mask)

    def _close_shard(self) -> None:
        """The mask first: the pair's ``.idx``, published last, marks a complete shard."""
        if self.mask is not None:
            self.masks.append(self.mask.close())
            self.mask = None
        self.written.append(self.writer.close())
        self.writer = None

    def close(self) -> list[WrittenShard]:
        if self.writer is not None:
            self._close_shard()
        return self.written

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        if self.mask is not None:
            self.mask.abort()


@dataclass(frozen=True)
class _Coder:
    """What the tokenizer decides: the end-of-document id, the vocabulary (its largest id + 1, holes counted) and
    token type, the file's checksum (``sha256``: ``(size, hex)`` as a part's plan records it; the manifest records
    the hex, :func:`tokenizer_sha256`); a chat conversion's template (its special tokens filled in); the tokenizer's
    special tokens (:func:`special_tokens`: what the parts of one conversion must agree on, token by token)."""

    eos_id: int
    vocab_size: int
    dtype: str
    sha256: tuple[int, str]
    template: ChatTemplate | None = None
    specials: dict[str, int] = field(default_factory=dict)


def _coder(config: TokenConvertConfig) -> _Coder:
    tokenizer = load_tokenizer(config.tokenizer)
    template = None if config.chat_template is None else _chat_template(config)
    by_template = template is not None and not config.eos
    eos = template.variables.get("eos_token") if by_template else config.eos
    eos_id = eos_token_id(tokenizer, eos, config.tokenizer,
                          f"the eos_token of {config.chat_template}" if by_template else None)
    ids = vocab_size(tokenizer)
    if template is not None:
        template = with_specials(template, tokenizer, eos_id, config.tokenizer)
    return _Coder(eos_id, ids, token_dtype(ids), sha256_file(config.tokenizer), template, special_tokens(tokenizer))


def _chat_template(config: TokenConvertConfig) -> ChatTemplate:
    """The template (ConvertError naming the file), refused without a ``{% generation %}`` block unless every token
    is trained: nothing would be."""
    try:
        template = load_chat_template(config.chat_template)
    except ChatTemplateError as err:
        raise ConvertError(str(err)) from None
    if config.train_on == "generation" and not template.has_generation:
        raise ConvertError(f"{config.chat_template}: the chat template marks no {{% generation %}} block, so no "
                           "token would be trained: wrap each assistant reply in {% generation %}...{% endgeneration "
                           "%} (docs/tokens.md), or train on every token with --train-on all")
    return template


def with_specials(template: ChatTemplate, tokenizer, eos_id: int, path: Path) -> ChatTemplate:
    """``template`` (a ``.jinja`` file alone: no config names its special tokens) with ``eos_token`` (the
    end-of-document token) and ``bos_token`` (:data:`BOS_NAMES`); a config's template as it is (a token its config
    does not name is undefined, as transformers renders it); ConvertError naming the tokenizer (``path``) and the
    template's file for a special token the file names and the template renders (``{{ bos_token }}``) that is not
    one of the tokenizer's special tokens: transformers adds it as a new id, where the tokenizer alone splits its
    text into pieces."""
    specials = special_tokens(tokenizer)
    for name, token in template.rendered_variables.items():
        if token not in specials:
            have, named_by = ", ".join(sorted(specials)) or "none", template.config or template.path
            raise ConvertError(f"{path}: {token!r} is not a special token (the {name} of {named_by}, which its "
                               f"template renders); its special tokens: {have}")
    if template.config is not None:
        return template
    names = {i: t for t, i in specials.items()}
    filled = {"eos_token": names[eos_id]}
    bos = next((n for n in BOS_NAMES if n in specials), None)
    if bos is not None:
        filled["bos_token"] = bos
    return replace(template, variables={**filled, **template.variables})


@dataclass
class _Written:
    """What :func:`_write` wrote: the shards (and a chat conversion's masks), the documents skipped (empty) or
    with special-token text, the longest document's tokens."""

    shards: list[WrittenShard]
    empty: int = 0
    special: int = 0
    masks: list[WrittenMask] = field(default_factory=list)
    longest: int = 0
    dropped: int = 0
    """Conversations longer than ``max_tokens`` left out."""
    truncated: int = 0
    """Conversations longer than ``max_tokens`` cut to their first turns."""


def _batches(config: TokenConvertConfig, corpus: Corpus, span: tuple[int, int | None]
             ) -> Iterator[tuple[list[str], list[str]]]:
    """``(wheres, texts)`` of ``batch_size`` documents at a time."""
    docs = corpus.documents(config.field, span, messages=config.chat_template is not None)
    while batch := list(islice(docs, config.batch_size)):
        yield [where for where, _ in batch], [text for _, text in batch]


def _encoded(config: TokenConvertConfig, coder: _Coder, batches: Iterator[tuple[list[str], list[str]]]
             ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, int], np.ndarray | None]]:
    args = (config.tokenizer, coder.eos_id, coder.dtype, config.special_in_text, config.field, coder.template,
            (config.train_on, config.max_tokens, config.overlong))
    if config.workers == 1:
        _init_worker(*args)
        yield from map(_encode, batches)
        return
    with OrderedPool(_encode, config.workers, initializer=_init_worker, initargs=args) as pool:
        yield from pool.map(batches)


def _write(config: TokenConvertConfig, corpus: Corpus, coder: _Coder, out: Path,
           span: tuple[int, int | None] = (0, None)) -> _Written:
    """The documents of ``span`` into shards in ``out/shards``, in input order."""
    series, written = _ShardSeries(config, coder.dtype, out / SHARDS_DIR), _Written([])
    (out / SHARDS_DIR).mkdir()
    try:
        for lengths, flat, counts, mask in _encoded(config, coder, _batches(config, corpus, span)):
            for key, n in counts.items():
                setattr(written, key, getattr(written, key) + n)
            written.longest = max(written.longest, int(lengths.max(initial=0)))
            ends = np.cumsum(lengths)
            for end, n in zip(ends.tolist(), lengths.tolist()):
                if n == 0:
                    written.empty += 1
                else:
                    series.add(flat[end - n:end], None if mask is None else mask[end - n:end])
        written.shards, written.masks = series.close(), series.masks
        return written
    except BaseException:
        series.abort()
        raise


def shard_record(s: WrittenShard, mask: WrittenMask | None = None) -> ShardRecord:
    """The manifest's record of a written pair (and its loss mask)."""
    return ShardRecord(name=s.bin_path.name, samples=s.documents, bytes=s.bin_bytes, sha256=s.bin_sha256,
                       idx_sha256=s.idx_sha256, xxh3_128=s.bin_xxh3_128, tokens=s.tokens,
                       mask_sha256=None if mask is None else mask.sha256)


def _records(written: _Written) -> list[ShardRecord]:
    masks = written.masks or [None] * len(written.shards)
    return [shard_record(s, m) for s, m in zip(written.shards, masks)]


def token_manifest(name: str, records: list[ShardRecord], info: TokenInfo, source: dict[str, Any],
                   options: dict[str, Any]) -> Manifest:
    """A token dataset's manifest (a conversion's, or a merge's of its parts: the same bytes)."""
    return make_manifest(name=name, shards=records, fields=[], kind="tokens", tokens=info, converted_from=source,
                         convert_options=options)


def _source(config: TokenConvertConfig, corpus: Corpus) -> dict[str, Any]:
    kind = "documents" if config.chat_template is None else "conversations"
    return {"format": kind, "path": str(config.source), "files": len(corpus.files)}


def _options(config: TokenConvertConfig) -> dict[str, Any]:
    out = {"tokenizer": str(config.tokenizer), "text_field": config.text_field, "eos": config.eos,
           "shard_size": config.shard_size, "max_samples_per_shard": config.max_samples_per_shard,
           "special_in_text": config.special_in_text}
    if config.chat_template is not None:
        out.update(chat_template=str(config.chat_template), messages_field=config.messages_field,
                   train_on=config.train_on, max_tokens=config.max_tokens, overlong=config.overlong)
    return out


def _info(config: TokenConvertConfig, coder: _Coder, records: list[ShardRecord], starts: IndexRecord,
          written: _Written) -> TokenInfo:
    chat = None
    if coder.template is not None:
        chat = ChatInfo(template_sha256=coder.template.sha256, train_on=config.train_on,
                        trained_tokens=sum(m.trained for m in written.masks), longest=written.longest, mask=MASK_FORMAT)
    return TokenInfo(dtype=coder.dtype, eos_id=coder.eos_id, total_tokens=sum(r.tokens or 0 for r in records),
                     vocab_size=coder.vocab_size, one_sequence_per_document=True,  # as MegatronWriter writes
                     starts=starts, chat=chat, tokenizer_sha256=coder.sha256[1])


def convert_tokens(config: TokenConvertConfig) -> TokenConvertResult:
    """Tokenize ``config.source`` into a token dataset in ``config.dest``, or with ``config.part`` one part of it
    into ``DEST/.parts/`` (see the module docstring)."""
    if isinstance(config.dest, str):  # s3://: written in a local staging folder, then uploaded
        result = upload_dataset(config.dest, config.storage_options, config.staging_dir, config.overwrite,
                                lambda local: convert_tokens(replace(config, dest=local, overwrite=True)))
        return replace(result, dest=config.dest)
    started = time.perf_counter()
    coder = _coder(config)
    corpus = open_corpus(config.source, config.storage_options)  # refusals before DEST is touched
    local_source = config.source if isinstance(config.source, Path) else None
    check_dest(config.dest, local_source, config.overwrite)
    if config.part is not None:
        return _convert_part(config, corpus, coder, started)
    with Claim(config.dest, "fastio convert") as claim:
        claim.take()
        check_dest(config.dest, local_source, config.overwrite)  # again, under the lock
        parts = lock_parts(config.dest)  # a part still being converted: refused, nothing deleted
        try:
            claim.reset()
            written = _write_dataset(config, corpus, coder)
        except OSError as err:  # DEST unwritable, disk full, a source file unreadable mid-run
            raise ConvertError(f"{err.filename or config.dest}: {err.strerror or err}") from None
        finally:
            for part in parts:
                part.release()
    return _result(config, coder, written, started)


def _write_dataset(config: TokenConvertConfig, corpus: Corpus, coder: _Coder) -> _Written:
    """The shards, the document-starts table and the manifest (last) into DEST, emptied and locked."""
    written = _write(config, corpus, coder, config.dest)
    if not written.shards:
        if written.dropped:
            raise ConvertError(f"{config.source}: nothing to write: {count(written.dropped, 'conversation')} longer "
                               f"than max_tokens={config.max_tokens} left out (overlong={config.overlong!r})")
        raise nothing_to_write(config.source, written.empty, config.chat_template is not None)
    if config.chat_template is not None:
        refuse_untrained(config.source, config.chat_template, config.train_on, sum(m.trained for m in written.masks),
                         sum(s.documents for s in written.shards))
    records = _records(written)
    source = {**_source(config, corpus), "empty_documents": written.empty, "special_text_documents": written.special,
              **_overlong(config, written)}
    starts = write_starts(config.dest, [shard_starts(MegatronIndex(s.idx_path)) for s in written.shards])
    write_manifest(config.dest, token_manifest(config.name, records, _info(config, coder, records, starts, written), source,
                                               _options(config)))
    return written


def nothing_to_write(source: Any, empty: int, chat: bool) -> ConvertError:
    """The refusal of a conversion (or merge) whose every document was empty: no text, or every conversation rendered
    to nothing by its template."""
    if chat:
        return ConvertError(f"{source}: holds no conversation the chat template renders to any token "
                            f"({count(empty, 'conversation')} rendered empty)")
    return ConvertError(f"{source}: holds no document with text ({count(empty, 'empty document')})")


def refuse_untrained(source: Any, template: Any, train_on: str, trained: int | None, conversations: int,
                     way_out: str = "train_on='all' trains every token") -> None:
    """A ConvertError where a dataset of conversations trained on the template's generation blocks trains no token
    at all (a dataset no step would learn from: most often the assistant's messages in a role the template does not
    test for), ending with ``way_out``; a conversion or merge of chat (:mod:`fastio.convert.token_merge`) or
    image-text (:mod:`fastio.convert.image_text`) conversations calls it before its manifest. ``trained`` None: not
    known (parts converted before it was counted), never refused."""
    if train_on == "generation" and trained == 0:
        raise ConvertError(f"{source}: nothing to train: no token of the {count(conversations, 'conversation')} is "
                           f"inside a {{% generation %}} block of {template} (are the assistant's messages in the role "
                           f"the template tests for, 'assistant' where the data says 'gpt'?); {way_out}")


def _overlong(config: TokenConvertConfig, written: _Written) -> dict[str, int]:
    """The conversations over ``max_tokens`` left out or cut (a chat conversion with ``max_tokens`` only)."""
    if config.chat_template is None or config.max_tokens is None:
        return {}
    return {"overlong_dropped": written.dropped, "overlong_truncated": written.truncated}


def _result(config: TokenConvertConfig, coder: _Coder, written: _Written, started: float) -> TokenConvertResult:
    shards = written.shards
    return TokenConvertResult(dest=config.dest, shards=len(shards), documents=sum(s.documents for s in shards),
                              tokens=sum(s.tokens for s in shards), empty=written.empty,
                              bytes=sum(s.bin_bytes for s in shards), seconds=time.perf_counter() - started,
                              dtype=coder.dtype, eos_id=coder.eos_id, part=config.part, special_text=written.special,
                              trained=sum(m.trained for m in written.masks) if coder.template is not None else None,
                              dropped=written.dropped, truncated=written.truncated, max_tokens=config.max_tokens)


def _convert_part(config: TokenConvertConfig, corpus: Corpus, coder: _Coder, started: float) -> TokenConvertResult:
    """Part K of N into ``DEST/.parts/part-K-of-N/`` (its lock only: parts run side by side); ``part.json`` last."""
    k, n = config.part
    directory = part_dir(config.dest, k, n)
    with Claim(directory, f"fastio convert --part {k}/{n}") as claim:
        claim.take()
        try:
            start_part_dir(config.dest, k, n, directory)
            claim.emptied()
            span = part_span(corpus.total, k, n)
            written = _write(config, corpus, coder, directory, span)
            write_part_record(directory, PartRecord(part=k, of=n, plan=_plan(config, corpus, coder),
                                                    datasets={"": _part_dataset(config, corpus, span, written)}))
        except OSError as err:
            raise ConvertError(f"{err.filename or directory}: {err.strerror or err}") from None
    return _result(config, coder, written, started)


def _plan(config: TokenConvertConfig, corpus: Corpus, coder: _Coder) -> dict[str, Any]:
    """What every part of a conversion shares (:func:`fastio.convert.token_merge.comparable_plan`: how it is compared)."""
    return {"kind": TOKEN_PLAN, "source": _source(config, corpus), "convert_options": _options(config),
            "name": config.name,
            "listing": {"sha256": corpus.listing_digest(), "files": len(corpus.files), "bytes": corpus.total},
            "tokens": {"tokenizer_sha256": coder.sha256, "eos_id": coder.eos_id, "dtype": coder.dtype,
                       "vocab_size": coder.vocab_size, "special_tokens": coder.specials,
                       **_chat_plan(config, coder)}}


def _chat_plan(config: TokenConvertConfig, coder: _Coder) -> dict[str, Any]:
    """A chat conversion's parts share the template (by content), the special tokens it renders (``variables``: a
    ``tokenizer_config.json``'s ``bos_token``, ``eos_token``, ... that its text names) and what they train on."""
    if coder.template is None:
        return {}
    return {"chat": {"template_sha256": coder.template.sha256, "train_on": config.train_on,
                     "variables": coder.template.rendered_variables}}


def _part_dataset(config: TokenConvertConfig, corpus: Corpus, span: tuple[int, int | None], written: _Written
                  ) -> dict[str, Any]:
    end = corpus.total if span[1] is None else span[1]
    chat = {"trained_tokens": sum(m.trained for m in written.masks), "longest": written.longest} if written.masks \
        else {}
    chat.update(_overlong(config, written))
    return {"range": [span[0], end], "count": corpus.total, "empty_documents": written.empty,
            "special_text_documents": written.special, **chat,
            "shards": [r.as_dict() for r in _records(written)]}
