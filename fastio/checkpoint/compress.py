"""File-level checkpoint compression (``CheckpointConfig.compression``): the one home of the codec.

The engines have no per-file compression hook, and compressing state dicts would break DCP's resharding,
so compression works on files: after the engine has written ``step-N.tmp``, every data file ``NAME`` is
replaced by ``NAME.zst`` (one zstd frame with its own content checksum; written as ``NAME.zst.tmp``, then
renamed, then ``NAME`` removed) and the commit marker lists the stored files with ``"compression": "zstd"``.
``ckpt verify`` checks the stored bytes. A restore verifies them too, then decompresses into a private
directory next to the step (:func:`fastio.checkpoint.removal.start_restore_dir`) and the engine reads that.

``"zstd+shuffle"`` byte-shuffles before compressing: each 1 MiB block of the file (the last one shorter) is
rearranged as all first bytes of its 4-byte words, then all second bytes, ... (the tail that is not a whole
word stays as is), which puts the sign/exponent bytes of fp32 values together; a restore undoes it exactly.

``zstandard`` is imported only when a checkpoint is compressed or decompressed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastio.errors import CheckpointError
from fastio.storage.atomic import start_writeback

if TYPE_CHECKING:
    from fastio.checkpoint.record import CommitRecord

__all__ = ["CODECS", "SUFFIX", "Compression", "check_marker", "compress_file", "parse_compression",
           "restore_file", "stored_name"]

SHUFFLE = "zstd+shuffle"
CODECS = ("zstd", SHUFFLE)
"""Codecs a commit marker may name under ``"compression"``."""
SUFFIX = ".zst"
"""What a compressed file's name ends with (``NAME`` is stored as ``NAME.zst``)."""
DEFAULT_LEVEL = 1
"""zstd level 1: measured as good a ratio on trained fp32 state as level 3, at ~300 MB/s per core."""
_LEVELS = range(1, 23)  # zstd's levels; negative "fast" levels are not offered
_CHUNK = 1 << 20
_BLOCK = 1 << 20  # the shuffle block: part of the "zstd+shuffle" format
_WORD = 4


@dataclass(frozen=True)
class Compression:
    """A parsed ``compression=`` value."""

    codec: str
    level: int


def parse_compression(value: Any) -> Compression | None:
    """``None`` -> None; ``"zstd"``, ``"zstd+shuffle"``, optionally ``":LEVEL"`` (1..22) -> :class:`Compression`;
    ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"compression must be None or one of {', '.join(CODECS)} (optionally ':LEVEL'), got {value!r}")
    codec, sep, level = value.partition(":")
    if codec not in CODECS:
        raise ValueError(f"compression {value!r}: unknown codec {codec!r} (known: {', '.join(CODECS)})")
    if not sep:
        return Compression(codec, DEFAULT_LEVEL)
    try:
        n = int(level)
    except ValueError:
        n = None
    if n is None or n not in _LEVELS:
        raise ValueError(f"compression {value!r}: level must be an integer in {_LEVELS.start}..{_LEVELS.stop - 1}")
    return Compression(codec, n)


def check_marker(commit: CommitRecord) -> str | None:
    """Why this fastio cannot read a commit marker's ``compression`` (None when it can, or there is none)."""
    codec = commit.compression
    if codec is None or codec in CODECS:
        return None
    return f"compressed with {codec!r}, this fastio reads {', '.join(CODECS)}"


def _zstd():
    try:
        import zstandard
    except ImportError:  # a runtime dependency; named in one line if an install lacks it
        raise CheckpointError("checkpoint compression needs the 'zstandard' package (pip install zstandard)") from None
    return zstandard


def _shuffle(block: bytes) -> bytes:
    import numpy as np

    n = len(block) // _WORD * _WORD
    return np.frombuffer(block, np.uint8, count=n).reshape(-1, _WORD).T.tobytes() + block[n:]


def _unshuffle(block: bytes) -> bytes:
    import numpy as np

    n = len(block) // _WORD * _WORD
    return np.frombuffer(block, np.uint8, count=n).reshape(_WORD, -1).T.tobytes() + block[n:]


def _read_block(f) -> bytes:
    """Exactly ``_BLOCK`` bytes from ``f``, fewer only at its end."""
    parts, got = [], 0
    while got < _BLOCK:
        b = f.read(_BLOCK - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def compress_file(path: Path, comp: Compression) -> Path:
    """Replace the file ``path`` by ``path.zst`` (via ``path.zst.tmp``); returns the new path.
    Not fsynced here: the commit flushes every stored file (its writeback started here,
    :func:`~fastio.storage.atomic.start_writeback`)."""
    zstd = _zstd()
    path = Path(path)
    out = path.with_name(path.name + SUFFIX)
    part = out.with_name(out.name + ".tmp")
    cctx = zstd.ZstdCompressor(level=comp.level, write_checksum=True, write_content_size=True)
    try:
        with open(path, "rb") as src, open(part, "wb") as dst:
            size = os.fstat(src.fileno()).st_size
            if comp.codec == SHUFFLE:
                # No ``with``: its close after a failed write would raise zstd's "Src size is incorrect" instead.
                w = cctx.stream_writer(dst, size=size, write_size=_CHUNK, closefd=False)
                while block := _read_block(src):
                    w.write(_shuffle(block))
                w.close()
            else:
                cctx.copy_stream(src, dst, size=size, read_size=_CHUNK, write_size=_CHUNK)
            dst.flush()
            start_writeback(dst.fileno())
        os.replace(part, out)
    except OSError as err:
        part.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot compress: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001 - zstandard.ZstdError (the file changed size meanwhile), named here
        part.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot compress: {err}") from None
    path.unlink()
    return out


def restore_file(src: Path, dst: Path, codec: str) -> None:
    """Write the plain file ``dst`` from the stored ``src`` (of a checkpoint compressed with ``codec``):
    decompressed when ``src`` ends with ``.zst``, else copied. CheckpointError naming ``src`` when its frame
    is damaged."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not src.name.endswith(SUFFIX):
            shutil.copyfile(src, dst)
            return
        zstd = _zstd()
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            if codec == SHUFFLE:
                with zstd.ZstdDecompressor().stream_reader(fin, read_size=_CHUNK, closefd=False) as r:
                    while block := _read_block(r):
                        fout.write(_unshuffle(block))
            else:
                zstd.ZstdDecompressor().copy_stream(fin, fout, read_size=_CHUNK, write_size=_CHUNK)
    except OSError as err:
        raise CheckpointError(f"{src}: cannot decompress into {dst}: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001 - zstandard.ZstdError: a damaged frame, named here
        raise CheckpointError(f"{src}: damaged zstd data: {err}") from None


def stored_name(rel: str) -> str:
    """The plain name a stored file is restored as (``NAME.zst`` -> ``NAME``)."""
    return rel[: -len(SUFFIX)] if rel.endswith(SUFFIX) else rel
