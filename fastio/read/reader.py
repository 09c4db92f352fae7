"""Sample bytes by dataset-wide index: byte ranges from the sample index (``Dataset.locate``), read in
(shard, offset) order with neighbouring ranges coalesced into one ``os.pread`` on cached file descriptors,
a thread pool so that reads run ahead of the consumer. A sample's image is the first image field it has,
so a dataset may mix formats.

A shard file is checked when it is opened: its size against the manifest (always), its sha256 (with
``verify``). A byte range outside its shard (a damaged or tampered index) is refused before any read. A
shard replaced or rewritten while it is read (a new file renamed over it, or the old one written in place)
is detected after each batch's reads: the descriptor's and the path's (device, inode, size, mtime) must
still be those seen at open, else :class:`~fastio.errors.DatasetError` (two ``stat`` calls per shard per
batch).

A shard rewritten *before* it is opened (after ``fastio index``) with the same size, e.g. two samples of the
same sizes swapped, is caught on every read: each run of coalesced ranges is read from 512 bytes before its
first member, so every member's own tar header comes with the same ``pread``, and its name (key and field)
and size must be those of the index (the key compared by a CRC-32 of each shard's ``.idx`` keys, 4 bytes a
sample, kept from the shard's first read: :func:`fastio.formats.dali_idx.key_crcs` reads the keys only, no
whole parse), else a DatasetError naming the shard, the key and what changed.
Not detected: new member bytes under the same names and sizes (``verify=True`` checks the sha256), and the key
of a member whose name is 99 bytes or longer or not ASCII (a GNU or pax long name, a pax name: the header holds
a stand-in; the size is still checked).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from struct import error as struct_error
from typing import Protocol

import numpy as np

from fastio.dataset.dataset import Dataset, Rows
from fastio.errors import DatasetError
from fastio.formats.images import image_size
from fastio.formats.labels import parse_label as _parse_label_bytes
from fastio.formats.labels import parse_labels as _parse_labels_bytes
from fastio.formats.media import is_audio_field, is_video_field
from fastio.storage.checksum import sha256_fd
from fastio.words import count

__all__ = ["ReadBatch", "Reader", "ShardFiles", "parse_label", "parse_labels", "sample_where"]


class ShardFiles(Protocol):
    """A source of shard descriptors other than opening the shard paths (see ``Reader(files=...)``)."""

    def acquire(self, shard_index: int) -> int: ...

    def release(self, shard_index: int) -> None: ...

    def read_ahead(self, order: Iterable[int]) -> None: ...

    def close(self) -> None: ...


def sample_where(ds: Dataset, index: int) -> str:
    """``"DEST: shard NAME key KEY"`` for error messages."""
    return ds.where(index)


def parse_label(ds: Dataset, field: str, index: int, data: np.ndarray | bytes) -> int:
    """The integer class label stored as ASCII text in ``field`` of sample ``index`` (:mod:`fastio.formats.labels`)."""
    text = bytes(data)
    try:
        return _parse_label_bytes(text)
    except ValueError as err:
        raise DatasetError(f"{sample_where(ds, index)}: field {field!r} is not an integer label: {text[:32]!r} "
                           f"({err})") from None


def parse_labels(ds: Dataset, field: str, indices: np.ndarray, values: Sequence[np.ndarray | bytes]) -> np.ndarray:
    """:func:`parse_label` for a batch (``values[j]`` is sample ``indices[j]``), as int64."""
    try:
        return _parse_labels_bytes(values)
    except ValueError:
        for i, data in zip(indices.tolist(), values):
            parse_label(ds, field, i, data)  # raises, naming the sample
        raise


class ReadBatch:
    """The bytes of one batch: ``fields[f][j]`` is a uint8 array (empty where an optional field is absent);
    ``image[j]`` the sample's image and ``image_field[j]`` the field it came from (if an image was requested);
    ``sizes`` is [B, 2] (w, h) of those images (if requested); ``present[f]`` is a bool [B] array: which samples
    have field ``f`` (an optional field's absent value and a present empty one both read as empty arrays)."""

    def __init__(self, indices: np.ndarray, fields: dict[str, list[np.ndarray]], sizes: np.ndarray | None,
                 image: list[np.ndarray] | None = None, image_field: list[str] | None = None,
                 present: dict[str, np.ndarray] | None = None):
        self.indices, self.fields, self.sizes = indices, fields, sizes
        self.image, self.image_field = image, image_field
        self.present = present if present is not None else {f: np.ones(len(indices), bool) for f in fields}
        self.text: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        """Text fields tokenized once read, off the training thread: field -> (ids, mask) (:mod:`fastio.pipelines.text`)."""
        self.frames: dict[tuple[int, int], np.ndarray] = {}
        """Video clips decoded once read, off the training thread: (sample, clip) -> uint8 [F, H, W, 3]
        (:mod:`fastio.pipelines.video_fallback`)."""
        self.draws: np.ndarray | None = None
        """Each sample's key for its random draws where it is not its index (a sample a mixture delivers again in
        one epoch: set by the :class:`~fastio.read.feeder.Feeder` from :meth:`~fastio.order.sampler.EpochPlan.draw_keys`)."""

    @property
    def draw_keys(self) -> np.ndarray:
        """What a pipeline's random draws hash per sample (:mod:`fastio.pipelines.augment`): ``draws``, else the
        indices."""
        return self.indices if self.draws is None else self.draws


# Neighbouring byte ranges of one shard are read with one pread when the gap between them is at most
# _GAP bytes (tar headers and padding) and the whole read stays under _RUN bytes.
_GAP = 4096
_RUN = 4 << 20
_EMPTY = np.empty(0, np.uint8)
_HEADER = 512  # a tar member's header, right before its data (read with it: the member check)
_LONG_NAME = 99  # a header name this long may be the start of a longer one (GNU long name, pax path)
log = logging.getLogger("fastio")
_NO_KEY = -1  # a shard whose .idx cannot be read: member names are checked by field and size, not key
_UNREAD = object()  # a shard whose key CRCs were not read yet


def _tar_header(header: bytes) -> tuple[bytes, int | None]:
    """(member name, size) of a 512-byte tar header: the USTAR prefix joined, the size octal or base-256;
    None for a size that is neither."""
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0" and header[345]:
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    field = header[124:136]
    if field[0] & 0x80:
        return name, int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return name, int(digits, 8) if digits else 0
    except ValueError:
        return name, None


def _member_matches(name: bytes, size: int | None, key_crc: int, field: str, want: int) -> bool:
    """Whether a member header (``name``, ``size``) is field ``field`` (its suffix, any case) of a sample
    whose key has CRC-32 ``key_crc`` (:data:`_NO_KEY`: unknown, not compared), ``want`` bytes long; a long name
    (see :data:`_LONG_NAME`): the size only."""
    if size != want:
        return False
    if len(name) >= _LONG_NAME:
        return True
    cut = len(name) - len(field) - 1
    return (cut >= 0 and name[cut:cut + 1] == b"." and name[cut + 1:].lower() == field.lower().encode()
            and (key_crc == _NO_KEY or zlib.crc32(name[:cut]) == key_crc))


def _decoded_kind(fields: Sequence[str]) -> str:
    """What the decoded fields hold, for messages: ``video``, ``audio`` or ``image``."""
    if all(is_video_field(f) for f in fields):
        return "video"
    return "audio" if all(is_audio_field(f) for f in fields) else "image"


class Reader:
    """Read fields of samples from a dataset's shards.

    Args:
        dataset: the opened dataset.
        fields: the fields to read (each must exist in the dataset).
        threads: reader threads; ``submit`` keeps up to this many batches being read at once.
        verify: check each shard's sha256 against the manifest the first time it is opened.
        image: image fields in order of preference: each sample's image is the first of them it has
            (``ReadBatch.image``), so a dataset may mix formats (``jpg`` here, ``png`` there).
        sizes: also parse (width, height) from each image's header (``ReadBatch.sizes``), in the reader thread.
        optional: fields (of ``fields``) a sample may lack: read as empty arrays instead of failing.
        transcode: applied to each image's bytes in the reader thread (e.g. formats a decoder lacks);
            may raise ``ValueError`` for bytes it cannot handle.
        files: where shard descriptors come from when not the shard paths themselves (an object-store DEST's
            cache: :class:`fastio.storage.cache.CachedShardFiles`, which verifies shards as it fills them);
            the reader holds the shards of a batch while it reads it, and releases them after.

    The byte ranges a batch needs are read in (shard, offset) order; neighbouring ranges are coalesced
    into one ``os.pread``.
    """

    def __init__(self, dataset: Dataset, fields: Sequence[str], threads: int = 2, verify: bool = False,
                 image: Sequence[str] = (), sizes: bool = False, optional: Collection[str] = (),
                 transcode: Callable[[np.ndarray], np.ndarray] | None = None, files: ShardFiles | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if sizes and not image:
            raise ValueError("sizes=True needs image fields")
        dataset.require_fields([*fields, *image])
        self.ds, self.fields, self.verify = dataset, list(fields), verify
        self.image, self.sizes, self.optional = tuple(image), sizes, frozenset(optional)
        self.transcode = transcode
        self.index = dataset.index  # opened (and checked) now, not in the first read
        self._shard_bytes = np.array([s.bytes for s in dataset.shards], np.int64)
        self._files = files
        self._verified: set[int] = set()  # shards of a shard source (cache) whose bytes verify=True has checked
        self._key_crcs: dict[int, np.ndarray | None] = {}  # shard -> CRC-32 of each sample's key (from its .idx)
        self._key_lock = threading.Lock()  # guards _key_locks
        self._key_locks: dict[int, threading.Lock] = {}  # shard -> held by the one thread reading its key CRCs
        self._fds = _Descriptors()
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fastio-read")
        self._starting: threading.Barrier | None = None  # the pool's threads started ahead of use (deferred)
        # A reader dropped without close() still releases its threads and file descriptors.
        self._finalizer = weakref.finalize(self, _release, self._pool, self._fds, files)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._starting is not None:  # a thread still waiting for the others to start stops waiting
            self._starting.abort()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._finalizer()

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """Tell the shard source the coming samples, so that it fetches their shards ahead of need; a no-op for
        shards read in place. ``batches()`` iterates them (arrays of dataset-wide indices, in order: a batch or a
        chunk of batches each), lazily; it is called at most once (a mixture's reader calls it once a source)."""
        if self._files is not None:
            self._files.read_ahead(_first_uses(self.ds.index.shard_of, batches(), len(self.ds.shards)))

    def submit(self, indices: np.ndarray) -> Future:
        """Start reading a batch in the pool; the future's result is a :class:`ReadBatch`."""
        return self._pool.submit(self.read_batch, np.asarray(indices, dtype=np.int64))

    def deferred(self, indices: np.ndarray) -> Future:
        """A batch's read that runs in the thread that first asks for its result, when it asks (the Loader's first
        batches: read as they are fed, by the thread feeding them, while no other thread of the reader takes the
        interpreter lock from it; issue 45). The pool's threads are started now, each waiting for the others
        (never running a read meanwhile), so that the later reads find them started: a thread started under a busy
        interpreter lock holds up the one starting it."""
        if self._starting is None:
            self._starting = threading.Barrier(self._threads)
            for _ in range(self._threads):  # no thread is idle while the others wait: each wait gets its own
                self._pool.submit(_started, self._starting)
        return _Deferred(self.read_batch, np.asarray(indices, dtype=np.int64))

    def read(self, indices: np.ndarray) -> dict[str, list[np.ndarray]]:
        return self.read_batch(np.asarray(indices, dtype=np.int64)).fields

    def image_fields_of(self, indices: np.ndarray, rows: Rows | None = None) -> np.ndarray:
        """For each sample, the position in ``image`` of the image field it has (its first one)."""
        t = self.ds.locate(indices) if rows is None else rows
        which = np.full(len(indices), -1, np.int64)
        for k in range(len(self.image) - 1, -1, -1):
            which[t.sizes[self.image[k]] >= 0] = k
        return which

    def read_batch(self, indices: np.ndarray) -> ReadBatch:
        t, n = self.ds.locate(indices), len(indices)  # row j: sample indices[j]
        self._check_inside(indices, t)
        # Every wanted (sample j, column c) range: the fields, then the image (column len(fields)).
        columns = list(self.fields)
        offsets = [t.offsets[f] for f in columns]
        sizes = [t.sizes[f] for f in columns]
        names = list(self.fields) * n  # each range's field, flat: range (j, c) at j * columns + c
        image_field = None
        if self.image:
            which = self.image_fields_of(indices, t)
            image_field = [self.image[k] for k in which.tolist()]
            names = [f for image in image_field for f in (*self.fields, image)]
            off, size = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
            for k, f in enumerate(self.image):
                sel = which == k
                off[sel], size[sel] = t.offsets[f][sel], t.sizes[f][sel]
            offsets.append(off)
            sizes.append(size)
            columns.append(None)
        off = np.stack(offsets, 1) if offsets else np.empty((n, 0), np.int64)
        size = np.stack(sizes, 1) if sizes else np.empty((n, 0), np.int64)
        if (size < 0).any():
            self._refuse_missing(indices, columns, size)
        held = self._hold(np.unique(t.shard).tolist())
        try:
            got = self._read_ranges(indices, t.shard, off, size, held, names)
        finally:
            if self._files is not None:
                for s_i in held:
                    self._files.release(s_i)
        for s_i in held:  # the bytes above came from the file opened
            self._check_unchanged(int(s_i))
        cols = len(columns)
        out = {f: got[c::cols] for c, f in enumerate(self.fields)}
        image = dims = None
        if self.image:
            image = got[cols - 1::cols]
            dims = self._image_bytes(indices, image, image_field)
        present = {f: size[:, c] >= 0 for c, f in enumerate(self.fields)}
        return ReadBatch(indices, out, dims, image, image_field, present)

    def _check_inside(self, indices: np.ndarray, t: Rows) -> None:
        """DatasetError naming the first sample whose byte range lies outside its shard (a damaged or tampered
        index: never hand pread an absurd range)."""
        outside = np.flatnonzero(t.span_offset + t.span_size > self._shard_bytes[t.shard])
        if outside.size:
            j = int(outside[0])
            raise DatasetError(f"{self.index.source}: {sample_where(self.ds, int(indices[j]))}: byte range "
                               f"{int(t.span_offset[j])}+{int(t.span_size[j])} lies outside the shard's "
                               f"{count(int(self._shard_bytes[t.shard[j]]), 'byte')}")

    def _refuse_missing(self, indices: np.ndarray, columns: list, size: np.ndarray) -> None:
        """DatasetError naming the first sample that lacks a wanted field (``size`` < 0) it may not lack."""
        for j, c in zip(*np.nonzero(size < 0)):
            f = columns[c]
            if f is not None and f in self.optional:
                continue
            wanted = f"field {f!r}" if f is not None else f"{_decoded_kind(self.image)} field ({', '.join(self.image)})"
            raise DatasetError(f"{sample_where(self.ds, int(indices[j]))}: sample has no {wanted}")

    def _image_bytes(self, indices: np.ndarray, image: list, image_field: list[str]) -> np.ndarray | None:
        """Each image as the graph decodes it (``transcode``, in place in ``image``) and, with ``sizes``, its
        (w, h) from its header; DatasetError naming the sample and field of one that does not decode."""
        dims = np.empty((len(image), 2), np.int64) if self.sizes else None
        if self.transcode is None and dims is None:
            return None
        for j, (i, data) in enumerate(zip(indices.tolist(), image)):
            try:
                if self.transcode is not None:
                    image[j] = data = self.transcode(data)
                if dims is not None:
                    dims[j] = image_size(data)
            except (ValueError, IndexError, struct_error) as err:
                raise DatasetError(f"{sample_where(self.ds, i)}: field {image_field[j]!r} failed to "
                                   f"decode: {err}") from None
        return dims

    def _read_ranges(self, indices: np.ndarray, shards: np.ndarray, off: np.ndarray, size: np.ndarray,
                     fds: dict[int, int], names: list[str]) -> list[np.ndarray]:
        """uint8 arrays, flat (range (j, c) at ``j * columns + c``): the range (off, size, ``[n, columns]``) of each
        sample's shard (absent ranges, size < 0, are empty arrays), coalescing neighbouring ranges into one pread
        that starts at the first one's tar header; each range's header is checked (``names``: its field, flat).
        Python lists and loops over the ranges, few numpy calls: beside the decoders each numpy call costs a few
        microseconds (issue 45)."""
        n, cols = off.shape
        got = [_EMPTY] * (n * cols)
        flat_off, flat_size = off.reshape(-1), size.reshape(-1)
        flat_shard = np.repeat(shards.astype(np.int64), cols)
        present = np.flatnonzero(flat_size >= 0)
        ids = indices.tolist()
        order = present[np.lexsort((flat_off[present], flat_shard[present]))]
        o, z, s = flat_off[order].tolist(), flat_size[order].tolist(), flat_shard[order].tolist()
        order = order.tolist()
        a, m = 0, len(order)
        while a < m:  # ranges a..b-1 become one read
            shard, start, end, b = s[a], o[a], o[a] + z[a], a + 1
            while b < m and s[b] == shard and start <= o[b] <= end + _GAP and \
                    max(end, o[b] + z[b]) - start <= _RUN:
                end = max(end, o[b] + z[b])
                b += 1
            first = max(0, start - _HEADER)
            data = os.pread(fds[shard], end - first, first)
            buf = np.frombuffer(data, dtype=np.uint8)
            crcs, base = self._shard_key_crcs(shard), self.ds.shards[shard].first
            for r in range(a, b):
                lo, k = o[r] - first, order[r]
                piece = buf[lo:lo + z[r]]
                i = ids[k // cols]
                if len(piece) != z[r]:
                    f = self.fields[k % cols] if k % cols < len(self.fields) else "image"
                    raise DatasetError(f"{sample_where(self.ds, i)}: field {f!r} is truncated "
                                       f"({len(piece)} of {count(z[r], 'byte')} at offset {o[r]})")
                name, got_size = _tar_header(data[lo - _HEADER:lo]) if lo >= _HEADER else (b"", None)
                crc = _NO_KEY if crcs is None else int(crcs[i - base])
                if not _member_matches(name, got_size, crc, names[k], z[r]):
                    self._recheck_member(i, names[k], z[r], o[r], name, got_size)
                got[k] = piece
            a = b
        return got

    def _shard_key_crcs(self, shard_index: int) -> np.ndarray | None:
        """CRC-32 of the key of each sample of a shard (uint32), from its ``.idx`` (read on the shard's first use, by one
        thread: another wanting the same shard meanwhile waits for it instead of parsing the file again); None when it
        cannot be read."""
        crcs = self._key_crcs.get(shard_index, _UNREAD)
        if crcs is not _UNREAD:
            return crcs
        with self._key_lock:
            lock = self._key_locks.setdefault(shard_index, threading.Lock())
        with lock:
            crcs = self._key_crcs.get(shard_index, _UNREAD)
            if crcs is not _UNREAD:
                return crcs
            shard = self.ds.shards[shard_index]
            try:
                crcs = self.ds.key_crcs(shard)
            except DatasetError as err:  # samples.fxi locates every field without it: read on, say what is not checked
                log.warning("fastio: %s; the members of shard %s are checked by field and size only, not by key "
                            "(fastio verify names the damage)", err, shard.name)
                crcs = None
            self._key_crcs[shard_index] = crcs
            return crcs

    def _recheck_member(self, index: int, field: str, size: int, offset: int, name: bytes, got: int | None) -> None:
        """DatasetError: the tar header before a field's bytes is not the one the index describes; but a key
        that is not ASCII may stand in a pax member's header as a substitute (``?`` for each other character,
        the name itself in the pax record before it): its size is checked only."""
        key = self.ds.key(index)
        if got == size and not key.isascii():
            return
        found = (f"member {name.decode('utf-8', 'replace')!r} of {count(got, 'byte')}" if got is not None
                 else f"no tar header ({name[:16]!r}...)")
        raise DatasetError(f"{sample_where(self.ds, index)}: field {field!r}: the index says member "
                           f"{key + '.' + field!r} of {count(size, 'byte')} at offset {offset}, the shard holds {found} "
                           f"there: it was rewritten after it was indexed; {self.ds.rebuild_hint}")

    def _hold(self, shards: list[int]) -> dict[int, int]:
        """Descriptors of these shards, held (in use) until released when they come from a shard source."""
        if self._files is None:
            return {s: self._fd(s) for s in shards}
        held: dict[int, int] = {}
        try:
            for s in shards:
                held[s] = self._files.acquire(s)
                if self.verify and s not in self._verified:  # a cached copy too: damage on the node's disk
                    self._check_digest(s, held[s], where=f" (cached copy {self._files.path_of(s)})")
                    self._verified.add(s)
        except BaseException:
            for s in held:
                self._files.release(s)
            raise
        return held

    def _fd(self, shard_index: int) -> int:
        fd = self._fds.get(shard_index)
        if fd is not None:
            return fd
        # One thread opens (and, with verify, hashes) a given shard; others wait for that shard only.
        with self._fds.opening(shard_index):
            fd = self._fds.get(shard_index)
            if fd is None:
                fd = self._open(shard_index)
                if not self._fds.publish(shard_index, fd):
                    os.close(fd)
                    raise RuntimeError(f"{self.ds.root}: the reader is closed")
        return fd

    def _check_unchanged(self, shard_index: int) -> None:
        """DatasetError if the shard's file changed or was replaced since it was opened."""
        fd, seen = self._fds.get(shard_index), self._fds.identity.get(shard_index)
        if fd is None or seen is None:
            return
        try:
            now = (_identity(os.fstat(fd)), _identity(os.stat(self._fds.paths[shard_index])))
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {self.ds.shards[shard_index].name} vanished while being read "
                               f"({err.strerror})") from None
        if now != (seen, seen):
            shard = self.ds.shards[shard_index]
            raise DatasetError(f"{self.ds.root}: shard {shard.name} was replaced or modified while being read "
                               "(inode, size or mtime changed since it was opened); restart to read the new file")

    def _open(self, shard_index: int) -> int:
        shard = self.ds.shards[shard_index]
        path = str(shard.path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} cannot be opened: {err.strerror}") from None
        st = os.fstat(fd)
        if st.st_size != shard.bytes:
            os.close(fd)
            raise DatasetError(f"{self.ds.root}: shard {shard.name} is {count(st.st_size, 'byte')}, manifest says "
                               f"{shard.bytes}: it changed after it was indexed; {self.ds.rebuild_hint}")
        self._fds.identity[shard_index] = _identity(st)
        self._fds.paths[shard_index] = path
        if self.verify:
            try:
                self._check_digest(shard_index, fd)
            except DatasetError:
                os.close(fd)
                raise
        return fd

    def _check_digest(self, shard_index: int, fd: int, where: str = "") -> None:
        """DatasetError unless the bytes behind ``fd`` have the shard's sha256 (``verify=True``)."""
        shard = self.ds.shards[shard_index]
        try:
            _, digest = sha256_fd(fd)
        except OSError as err:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} cannot be read{where}: {err.strerror}") from None
        if digest != shard.sha256:
            raise DatasetError(f"{self.ds.root}: shard {shard.name} sha256 mismatch{where} "
                               f"(manifest {shard.sha256[:16]}…, file {digest[:16]}…)")


class _Descriptors:
    """Open shard file descriptors by shard index; every one is closed by :meth:`close_all`."""

    def __init__(self):
        self._fds: dict[int, int] = {}
        self._opening: dict[int, threading.Lock] = {}
        self.identity: dict[int, tuple[int, int, int, int]] = {}  # (dev, inode, size, mtime) at open
        self.paths: dict[int, str] = {}  # the path opened
        self._lock = threading.Lock()  # guards the two dicts and `closed`, never held during I/O
        self.closed = False

    def __len__(self) -> int:
        return len(self._fds)

    def get(self, shard_index: int) -> int | None:
        return self._fds.get(shard_index)

    def opening(self, shard_index: int) -> threading.Lock:
        """The lock a thread holds while it opens this shard."""
        with self._lock:
            return self._opening.setdefault(shard_index, threading.Lock())

    def publish(self, shard_index: int, fd: int) -> bool:
        """Keep ``fd`` as this shard's; False (and nothing kept) once closed."""
        with self._lock:
            if self.closed:
                return False
            self._fds[shard_index] = fd
            return True

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _Deferred(Future):
    """A future whose work runs in the thread that first asks for its result (:meth:`Reader.deferred`); cancelled
    before that, it never runs."""

    def __init__(self, work: Callable[[np.ndarray], ReadBatch], indices: np.ndarray):
        super().__init__()
        self._work: Callable[[np.ndarray], ReadBatch] | None = work
        self._indices = indices
        self._claim = threading.Lock()  # taken by the one thread that runs the work

    def result(self, timeout: float | None = None) -> ReadBatch:
        with self._claim:
            work, self._work = self._work, None
        if work is not None and self.set_running_or_notify_cancel():  # False: cancelled (raised below)
            try:
                self.set_result(work(self._indices))
            except BaseException as err:  # raised by super().result(), as a pool read's error would be
                self.set_exception(err)
            finally:
                self._indices = None
        return super().result(timeout)


_START_WAIT = 10.0
"""Seconds a pool thread started by :meth:`Reader.deferred` waits for the others at most: a thread that never comes
(the pool made no more) must not keep the ones waiting, and with them the interpreter's exit, which joins them."""


def _started(barrier: threading.Barrier) -> None:
    """A pool task that returns once every thread of the pool has started (or the reader closed, or
    :data:`_START_WAIT` passed)."""
    try:
        barrier.wait(_START_WAIT)
    except threading.BrokenBarrierError:
        pass


def _first_uses(shard_of: Callable[[np.ndarray], np.ndarray], batches: Iterable[np.ndarray],
                shards: int) -> Iterator[int]:
    """The shards of ``batches`` in the order they are first wanted, each once, done once all ``shards`` were
    seen (this runs in a read-ahead thread beside the training loop: one vectorised lookup per array)."""
    seen: set[int] = set()
    for block in batches:
        if len(seen) >= shards:
            return
        wanted = shard_of(block)
        _, first = np.unique(wanted, return_index=True)
        for s in wanted[np.sort(first)].tolist():
            if s not in seen:
                seen.add(s)
                yield s


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _release(pool: ThreadPoolExecutor, fds: _Descriptors, files: ShardFiles | None = None) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    fds.close_all()
    if files is not None:  # its shards stop being in use (evictable) and its read-ahead stops
        files.close()
