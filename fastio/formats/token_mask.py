"""A token shard's loss mask, ``NAME.mask`` beside ``NAME.bin``: one bit per token of the ``.bin``, in the same
order, set where the token is trained (a chat dataset's assistant tokens, :mod:`fastio.formats.assistant_mask`).

Layout::

    b"FXMASK01"                  8 bytes: the magic (format ``bits-v1``)
    bits                         ceil(T / 8) bytes: token t's bit is bit t % 8 (least significant first) of
                                 byte t // 8; the unused bits of the last byte are 0

so the file of a shard of T tokens is exactly ``8 + ceil(T / 8)`` bytes (the size is checked against the shard's
token count on every open). Written under a hidden temporary name, fsynced and renamed (:class:`MaskWriter`;
sha256 taken while writing), read mapped (:class:`MaskFile`: any tokens' bits at once). A refusal names the file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastio.errors import DatasetError, os_error_text
from fastio.storage.atomic import fsync_dir, tmp_path_for
from fastio.storage.checksum import HashingWriter
from fastio.words import count

__all__ = ["MAGIC", "MASK_FORMAT", "MASK_SUFFIX", "MaskFile", "MaskWriter", "WrittenMask", "mask_path", "mask_size"]

MAGIC = b"FXMASK01"
MASK_FORMAT = "bits-v1"
"""The manifest's name for this layout (``tokens.chat.mask``)."""
MASK_SUFFIX = ".mask"


def mask_path(bin_path: Path) -> Path:
    """``NAME.mask`` beside ``NAME.bin``."""
    return Path(bin_path).with_suffix(MASK_SUFFIX)


def mask_size(tokens: int) -> int:
    """Bytes of the mask file of a shard of ``tokens`` tokens."""
    return len(MAGIC) + (tokens + 7) // 8


@dataclass(frozen=True)
class WrittenMask:
    """What :meth:`MaskWriter.close` wrote."""

    path: Path
    tokens: int
    trained: int
    bytes: int
    sha256: str


class MaskWriter:
    """Write one shard's mask: :meth:`add` one document's bits at a time, :meth:`close` publishes the file,
    :meth:`abort` removes what was written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._tmp = tmp_path_for(self.path)
        self._file = open(self._tmp, "wb")
        self._out = HashingWriter(self._file)
        self._out.write(MAGIC)
        self._carry = np.zeros(0, bool)  # fewer than 8 bits not written yet
        self.tokens = self.trained = 0

    def add(self, mask: np.ndarray) -> None:
        """Append the bits of one document (bool, one per token)."""
        mask = np.asarray(mask, bool)
        self.tokens += mask.size
        self.trained += int(np.count_nonzero(mask))
        bits = np.concatenate([self._carry, mask]) if self._carry.size else mask
        whole = bits.size // 8 * 8
        if whole:
            self._out.write(np.packbits(bits[:whole], bitorder="little").tobytes())
        self._carry = bits[whole:].copy()

    def close(self) -> WrittenMask:
        """Publish the file (the last byte's unused bits 0)."""
        try:
            if self._carry.size:
                self._out.write(np.packbits(self._carry, bitorder="little").tobytes())
            self._out.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        return WrittenMask(self.path, self.tokens, self.trained, self._out.size, self._out.hexdigest())

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class MaskFile:
    """The mask of a shard of ``tokens`` tokens at ``path``, mapped read-only; DatasetError naming the file when it
    is missing, has another magic, or its size is not :func:`mask_size` of ``tokens``: when it is opened, and again
    before every read (the mapping's own descriptor asked: a file cut short under the mapping would read zeros in
    its last page, a mask that trains nothing, and kill the process with SIGBUS past it; one cut short during a read
    still can)."""

    def __init__(self, path: str | Path, tokens: int):
        self.path, self.tokens = Path(path), tokens
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise DatasetError(f"{self.path}: {os_error_text(err)} (a chat shard's loss mask)") from None
        try:
            self._check_size(os.fstat(fd).st_size)
            self._map = mmap.mmap(fd, mask_size(tokens), access=mmap.ACCESS_READ)  # holds its own copy of fd
        except OSError as err:
            raise DatasetError(f"{self.path}: cannot be mapped ({os_error_text(err)}; a chat shard's loss mask)"
                               ) from None
        finally:
            os.close(fd)
        if self._map[:len(MAGIC)] != MAGIC:
            raise DatasetError(f"{self.path}: not a fastio loss mask (magic {bytes(self._map[:8])!r})")
        self._bits = np.frombuffer(self._map, np.uint8, offset=len(MAGIC))

    def _check_size(self, size: int) -> None:
        if size != mask_size(self.tokens):
            raise DatasetError(f"{self.path}: {count(size, 'byte')}, a loss mask of {count(self.tokens, 'token')} has "
                               f"{mask_size(self.tokens)}: truncated or not this shard's")

    def bits(self, at: np.ndarray) -> np.ndarray:
        """bool: the bits of the tokens at offsets ``at`` (each below :attr:`tokens`)."""
        self._check_size(self._map.size())
        at = np.asarray(at, np.int64)
        return (np.take(self._bits, at >> 3) >> (at & 7).astype(np.uint8) & 1).astype(bool)

    def all(self) -> np.ndarray:
        """bool [tokens]: every token's bit."""
        self._check_size(self._map.size())
        return np.unpackbits(self._bits, count=self.tokens, bitorder="little").astype(bool)

    def close(self) -> None:
        self._bits = None
        self._map.close()
