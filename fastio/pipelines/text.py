"""Text fields delivered tokenized beside images: :class:`Tokenize` (a ``tokenizer.json`` and a length) and
:class:`TextReader`, which tokenizes each read batch's text fields in threads of its own beside the reader's, off
the training thread.

``fastio.ImageTrain(size=224, text={"txt": fastio.Tokenize("tokenizer.json", max_len=77)})`` delivers
``batch["txt"]`` int64 [B, max_len] (the ids, cut at ``max_len``, then ``pad_id``) and ``batch["txt_mask"]`` bool
[B, max_len] (True on real tokens).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastio.errors import ConvertError, DatasetError

__all__ = ["TextReader", "Tokenize", "check_text", "mask_name"]

_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Tokenize:
    """Tokenize a text field with the Hugging Face ``tokenizer.json`` at ``path`` (the ``tokenizers`` library:
    ``pip install -e '.[tokens]'`` in fastio's checkout; its special tokens added as the file says), to ``max_len``
    ids."""

    path: str
    max_len: int = 77
    """Ids per sample: longer texts are cut, shorter ones padded."""
    pad_id: int | None = None
    """The padding id (default: the tokenizer's ``<pad>`` / ``[PAD]`` token where it has one, else 0)."""

    def __post_init__(self):
        object.__setattr__(self, "path", str(self.path))
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise ValueError(f"max_len must be a positive integer, got {self.max_len!r}")
        if self.pad_id is not None and (isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int)
                                        or self.pad_id < 0):
            raise ValueError(f"pad_id must be an integer >= 0, got {self.pad_id!r}")

    def tokenizer(self) -> Any:
        """The loaded tokenizer (once per process and file; DatasetError naming the file otherwise)."""
        with _TOKENIZERS_LOCK:
            if self.path not in _TOKENIZERS:
                from fastio.convert.token_convert import load_tokenizer

                try:
                    _TOKENIZERS[self.path] = load_tokenizer(Path(self.path))
                except ConvertError as err:
                    raise DatasetError(str(err)) from None
            return _TOKENIZERS[self.path]

    def padding(self) -> int:
        if self.pad_id is not None:
            return self.pad_id
        tok = self.tokenizer()
        return next((i for i in map(tok.token_to_id, _PAD_NAMES) if i is not None), 0)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [B, max_len], mask bool [B, max_len])`` of ``texts``."""
        ids = np.full((len(texts), self.max_len), self.padding(), np.int64)
        mask = np.zeros((len(texts), self.max_len), bool)
        for row, enc in enumerate(self.tokenizer().encode_batch(texts)):
            got = enc.ids[:self.max_len]
            ids[row, :len(got)], mask[row, :len(got)] = got, True
        return ids, mask


def check_text(text: Any) -> tuple[tuple[str, Tokenize], ...] | None:
    """``text`` (a mapping field -> :class:`Tokenize`) as sorted pairs (None stays None); ValueError naming a bad
    value."""
    if text is None:
        return None
    pairs = tuple(text.items()) if isinstance(text, Mapping) else tuple(text)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]
                and isinstance(pair[1], Tokenize)):
            raise ValueError(f"text must map field names to fastio.Tokenize(...), got {text!r}")
    return tuple(sorted(pairs))


def mask_name(field: str) -> str:
    """The batch entry holding ``field``'s mask."""
    return f"{field}_mask"


class TextReader:
    """Reads batches with ``inner`` (a read set's reader), then tokenizes the ``text`` fields in one of its own
    ``threads`` (``ReadBatch.text[field] = (ids, mask)``), never in the thread that asked for the batch;
    ``where(i)`` names read-set id ``i`` in messages."""

    def __init__(self, inner: Any, text: tuple[tuple[str, Tokenize], ...], where: Callable[[int], str],
                 threads: int = 2):
        self.inner, self.text, self.where = inner, text, where
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastio-text")

    def submit(self, ids: np.ndarray) -> Future:
        return self._pool.submit(self._tokenized, self.inner.submit(ids))

    def _tokenized(self, read: Future) -> Any:
        batch = read.result()
        batch.text = {field: tok.encode(self._texts(batch, field)) for field, tok in self.text}
        return batch

    def _texts(self, batch: Any, field: str) -> list[str]:
        out = []
        for i, data in zip(batch.indices.tolist(), batch.fields[field]):
            try:
                out.append(data.tobytes().decode("utf-8"))
            except UnicodeDecodeError as err:
                raise DatasetError(f"{self.where(i)}: field {field!r} is not UTF-8 text ({err.reason} at byte "
                                   f"{err.start})") from None
        return out

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        self.inner.read_ahead_shards(batches)

    def close(self) -> None:
        """Its threads (the inner reader is the read set's, closed with it)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
