"""The node-local shard cache: object-store shards on local disk, verified, bounded, shared by every process.

Layout of ``cache_dir`` (shared by all ranks and jobs on a node)::

    .fastio-cache              marker: this directory is a fastio cache (a non-empty directory without it is refused)
    .evict.lock                flock held while space is counted, reserved or freed
    objects/SHA256.tar         a filled shard, named by its content's sha256 (so a re-converted dataset never
                               reads a stale copy, and the same shard in two datasets is stored once)
    objects/.SHA256.tar.tmp    a fill in progress, created at its full size (the space is reserved)
    objects/.SHA256.lock       flock held by the one process filling that shard
    meta/URLHASH/...           manifests and ``.idx`` files of opened datasets (small, never evicted)

Rules:

- **Fill**: under the shard's fill lock (so each shard is downloaded once per node), into the ``.tmp`` name,
  checked against the manifest's xxh3-128 (sha256 for manifests without it), fsynced, then renamed. A mismatch
  is downloaded once more, then raised naming the shard and the URL.
- **In use**: a process reading a shard holds a shared ``flock`` on it (kept for half a second after its last
  read, so that consecutive batches do not reopen it); eviction takes an exclusive one without
  waiting and skips the shard when it cannot. The kernel drops every lock when its process dies (even SIGKILL),
  so there are no stale locks; a dead filler's ``.tmp`` is removed by the next scan (its fill lock is free).
- **Bound**: before a fill, the least recently used entries (by mtime, refreshed on every open and at least
  every 10 s of use) not in use are deleted until the new shard fits in ``cache_size``. Only
  ``objects/<sha256>.tar`` and ``.tmp`` names are ever deleted: files the cache did not make are never touched.
- **No torn reads**: a reader opens, locks, then checks that the file is still linked; an entry evicted in
  between is filled again. It checks the size too: a copy cut short on the node's disk (a crash, a full disk, a
  hand copy) is removed (under the fill lock, only if still the same file), named in one warning, and filled again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fastio.errors import StorageError
from fastio.progress import human_bytes, parse_size
from fastio.storage.base import Storage
from fastio.storage.checksum import DIGESTS, digest_file
from fastio.storage.url import local_folder
from fastio.words import count

__all__ = ["CACHE_MARKER", "CHECKPOINT_STAGING", "CacheEntry", "CachedShardFiles", "ShardCache", "default_cache_dir"]

CACHE_MARKER = ".fastio-cache"
OBJECTS_DIR = "objects"
META_DIR = "meta"
CHECKPOINT_STAGING = "checkpoints"
"""The default root shares: ``<default_cache_dir()>/checkpoints/`` is the Checkpointer's staging area for
``s3://`` checkpoints (:func:`fastio.checkpoint.remote.default_staging_dir`), beside the shard cache's own
names; the cache accepts it in a root it opens and never touches it."""
_OWN_NAMES = {CACHE_MARKER, OBJECTS_DIR, META_DIR, ".evict.lock", CHECKPOINT_STAGING}
_ENTRY = re.compile(r"[0-9a-f]{64}\.tar")
_TMP = re.compile(r"\.([0-9a-f]{64})\.tar\.tmp")
_TOUCH_S = 10.0  # a shard kept open across batches has its mtime (LRU age) refreshed at most this often


def default_cache_dir() -> Path:
    """``$FASTIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastio``, else ``~/.cache/fastio``."""
    if os.environ.get("FASTIO_CACHE_DIR"):
        return Path(os.environ["FASTIO_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastio"


@dataclass(frozen=True)
class CacheEntry:
    """One shard as the cache needs to know it."""

    name: str
    """Shard name, for messages."""
    key: str
    """Its key in the storage."""
    sha256: str
    """Its sha256 (also its name in the cache)."""
    size: int
    xxh3_128: str | None = None
    """Its xxh3-128 when the manifest records it: fills are checked against it (memory speed), else sha256."""

    @property
    def check(self) -> tuple[str, str]:
        """``(algorithm, hex digest)`` a fill is checked against."""
        return ("xxh3_128", self.xxh3_128) if self.xxh3_128 else ("sha256", self.sha256)


@contextmanager
def _flocked(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def _try_exclusive(path: Path) -> int | None:
    """An fd of ``path`` with an exclusive flock taken without waiting, or None (in use, or gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


_OWN_HELD: dict[str, int] = {}  # cache entries this process's readers hold in use (acquired, not released), by path
_OWN_LOCK = threading.Lock()


def _hold(path: Path, delta: int) -> None:
    """Count a reader of this process taking ``path`` into use (+1) or releasing it (-1)."""
    with _OWN_LOCK:
        n = _OWN_HELD.get(str(path), 0) + delta
        if n > 0:
            _OWN_HELD[str(path)] = n
        else:
            _OWN_HELD.pop(str(path), None)


_CLAIMS: dict[str, weakref.WeakKeyDictionary] = {}  # cache dir -> {live CachedShardFiles: (what, working set)}


def _claim(files: CachedShardFiles, need: int, what: str) -> None:
    """Record ``files``' working set in this process's claims on its cache; StorageError naming the other live
    claimants when together they need more than ``cache_size`` (see :meth:`CachedShardFiles.claim`)."""
    cache = files.cache
    with _OWN_LOCK:
        live = _CLAIMS.setdefault(str(cache.dir.resolve()), weakref.WeakKeyDictionary())
        others = [(w, b) for f, (w, b) in live.items() if f is not files]
        total = need + sum(b for _, b in others)
        if others and total > cache.size:
            named = ", ".join(f"{w} {human_bytes(b)}" for w, b in others)
            raise StorageError(
                f"{what}: cache_size {human_bytes(cache.size)} of {cache.dir} cannot hold this Loader's working set "
                f"({human_bytes(need)}) beside those of the other Loaders in this process reading through it "
                f"({named}; {human_bytes(total)} together): close them first, raise cache_size, or read fewer "
                "shards at once (shuffle='block' with a smaller block_shards, a lower shard_read_ahead)", url=what)
        live[files] = (what, need)


def _unclaim(files: CachedShardFiles) -> None:
    with _OWN_LOCK:
        live = _CLAIMS.get(str(files.cache.dir.resolve()))
        if live is not None:
            live.pop(files, None)


class NoRoom(Exception):
    """A fill that was told not to wait found no room (read-ahead skips the shard)."""


class ShardCache:
    """A bounded, verified shard cache in ``cache_dir`` shared by the processes of a node.

    Args:
        cache_dir: the directory (created if missing; a non-empty directory must already be a fastio cache).
        cache_size: upper bound of the bytes of shards kept (an int or ``"500GB"``); None: half the free space of
            ``cache_dir``'s file system when the cache is opened.
        wait_s: how long a fill waits for space held by shards in use before it raises.
    """

    def __init__(self, cache_dir: str | Path, cache_size: int | str | None = None, *, wait_s: float = 120.0):
        self.dir = local_folder(cache_dir, "cache_dir")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not (self.dir / CACHE_MARKER).is_file():
                # several processes may open a new cache at once: what they create is not "foreign"
                if any(p.name not in _OWN_NAMES for p in self.dir.iterdir()):
                    raise StorageError(f"{self.dir}: cache_dir is not empty and is not a fastio cache "
                                       f"(no {CACHE_MARKER}); give an empty or new directory", url=str(self.dir))
                try:
                    fd = os.open(self.dir / CACHE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    pass
                else:
                    os.write(fd, json.dumps({"format": "fastio-cache", "version": 1}).encode())
                    os.close(fd)
            (self.dir / OBJECTS_DIR).mkdir(exist_ok=True)
            (self.dir / META_DIR).mkdir(exist_ok=True)
        except OSError as err:
            raise StorageError(f"{self.dir}: cannot use as cache_dir: {err.strerror}", url=str(self.dir)) from None
        if cache_size is None:
            st = os.statvfs(self.dir)
            cache_size = st.f_bavail * st.f_frsize // 2
        self.size = parse_size(cache_size, "cache_size")
        self.wait_s = wait_s
        self.objects = self.dir / OBJECTS_DIR
        self._evict_lock = self.dir / ".evict.lock"

    def __repr__(self) -> str:
        return f"ShardCache({str(self.dir)!r}, cache_size={human_bytes(self.size)})"

    def path(self, sha256: str) -> Path:
        return self.objects / f"{sha256}.tar"

    def meta_dir(self, name: str, *, url: str, subfolders: tuple[str, ...] = ()) -> Path:
        """A per-dataset folder (for the dataset at ``url``) for small metadata files (manifest, indexes), with its
        ``subfolders``; not counted, never evicted. StorageError naming ``url`` and cache_dir if it cannot be made."""
        d = self.dir / META_DIR / name
        try:
            for folder in (d, *(d / sub for sub in subfolders)):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self.write_error(url, err) from None
        return d

    def put_meta(self, path: Path, data: bytes, url: str) -> None:
        """Publish ``data`` (the verified copy of object ``url``) at ``path`` in a :meth:`meta_dir` through a temporary
        name of this process and thread (several processes of a node may write the same file at once; each rename
        is atomic); StorageError naming ``url`` and cache_dir if it cannot be written, and no temporary left."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as err:
            raise self.write_error(url, err) from None

    def write_error(self, url: str, err: OSError) -> StorageError:
        """The error for ``err``, raised where the cache writes to its own directory (read-only, full) while it
        keeps a copy of ``url``: one line naming both and the reason."""
        return StorageError(f"{url}: cannot write to cache_dir {self.dir}: {err.strerror or err}", url=url)

    # -- space ----------------------------------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """``(bytes, entries)`` of filled shards and fills in progress."""
        total, n = 0, 0
        for p in self.objects.iterdir():
            if _ENTRY.fullmatch(p.name) or _TMP.fullmatch(p.name):
                try:
                    total += p.stat().st_size
                    n += 1
                except FileNotFoundError:
                    pass
        return total, n

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """Bytes used and the filled entries as ``(mtime, size, path)``; removes dead fillers' ``.tmp`` files."""
        used, entries = 0, []
        for p in self.objects.iterdir():
            try:
                if _ENTRY.fullmatch(p.name):
                    st = p.stat()
                    used += st.st_size
                    entries.append((st.st_mtime, st.st_size, p))
                elif m := _TMP.fullmatch(p.name):
                    lock_fd = _try_exclusive(self.objects / f".{m[1]}.lock")
                    if lock_fd is None:  # a live filler (or our own fill) holds it
                        used += p.stat().st_size
                        continue
                    try:  # nobody fills it: what a killed filler left behind
                        p.unlink()
                    finally:
                        os.close(lock_fd)
            except FileNotFoundError:
                pass
        return used, entries

    def _reserve(self, entry: CacheEntry, tmp: Path, url: str, wait: bool) -> None:
        """Create ``tmp`` at the entry's size once it fits, evicting unused entries (oldest use first).
        Without ``wait``, raise :class:`NoRoom` at once when shards in use leave no room."""
        if entry.size > self.size:
            raise StorageError(f"{url}: shard {entry.name} ({human_bytes(entry.size)}) is larger than cache_size "
                               f"{human_bytes(self.size)} of {self.dir}", url=url)
        deadline, said = time.monotonic() + self.wait_s, False
        while True:
            with _flocked(self._evict_lock, fcntl.LOCK_EX):
                used, entries = self._scan()
                for _, size, path in sorted(entries):
                    if used + entry.size <= self.size:
                        break
                    fd = _try_exclusive(path)
                    if fd is None:
                        continue  # in use by some process
                    try:
                        path.unlink()
                        used -= size
                    except FileNotFoundError:
                        pass
                    finally:
                        os.close(fd)
                if used + entry.size <= self.size:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        os.ftruncate(fd, entry.size)
                    finally:
                        os.close(fd)
                    return
            if not wait:
                raise NoRoom(url)
            with _OWN_LOCK:
                own = sum(size for _, size, path in entries if str(path) in _OWN_HELD)
            if own + entry.size > self.size:  # what others hold may go; this process's own shards in use stay
                raise StorageError(f"{url}: no room for shard {entry.name} in {self.dir}: cache_size "
                                   f"{human_bytes(self.size)}, {human_bytes(own)} held by this process's own shards "
                                   "in use (the reader's working set: raise cache_size, or read fewer shards at "
                                   "once: shuffle='block', a smaller block_shards or shard_read_ahead)", url=url)
            if not said:
                said = True
                logging.getLogger("fastio").warning(
                    "%s: waiting up to %.0fs for room in %s: %s of cache_size %s held by other processes' shards "
                    "in use", url, self.wait_s, self.dir, human_bytes(used - own), human_bytes(self.size))
            if time.monotonic() > deadline:
                raise StorageError(f"{url}: no room for shard {entry.name} in {self.dir}: cache_size "
                                   f"{human_bytes(self.size)}, {human_bytes(used - own)} held by other processes' "
                                   f"shards in use for {self.wait_s:.0f}s (raise cache_size)", url=url)
            time.sleep(0.05)

    # -- fill -----------------------------------------------------------------------------------------

    def fill(self, storage: Storage, entry: CacheEntry, *, wait: bool = True) -> bool:
        """Make sure the entry is in the cache; True if this call downloaded it. ``wait=False`` (read-ahead)
        raises :class:`NoRoom` rather than wait for shards in use to make room."""
        final = self.path(entry.sha256)
        if final.exists():
            return False
        url = storage.url_of(entry.key)
        try:
            return self._fill(storage, entry, final, url, wait)
        except OSError as err:  # the cache's own disk: read-only, full (the store's faults are StorageErrors)
            raise self.write_error(url, err) from None

    def _fill(self, storage: Storage, entry: CacheEntry, final: Path, url: str, wait: bool) -> bool:
        """:meth:`fill` once ``final`` was not there."""
        tmp = self.objects / f".{entry.sha256}.tar.tmp"
        with _flocked(self.objects / f".{entry.sha256}.lock", fcntl.LOCK_EX):
            if final.exists():  # another process filled it while we waited for the lock
                return False
            try:
                for attempt in (1, 2):
                    self._reserve(entry, tmp, url, wait)
                    size, digest = self._download(storage, entry, tmp)
                    algo, want = entry.check
                    if size == entry.size and digest == want:
                        # the data is fsynced; the rename is not (a rename lost in a crash costs one refill)
                        os.replace(tmp, final)
                        return True
                    if attempt == 2:
                        raise StorageError(f"{url}: shard {entry.name} does not match the manifest after 2 downloads "
                                           f"(manifest {algo} {want[:16]}…, {count(entry.size, 'byte')}; downloaded "
                                           f"{digest[:16]}…, {count(size, 'byte')})", url=url)
            finally:
                try:
                    tmp.unlink()
                except FileNotFoundError:
                    pass
        return True

    def drop_cut_short(self, entry: CacheEntry, seen: os.stat_result, url: str) -> None:
        """Remove the entry's copy whose stat is ``seen`` (its size not the manifest's: cut short on this node's disk,
        by a crash, a full disk or a hand copy), named in one warning, so that the next open fills it again. Under
        the shard's fill lock, and only if the copy there is still that file (another process may have replaced it
        with a good one already); readers holding it keep their descriptors."""
        path = self.path(entry.sha256)
        try:
            with _flocked(self.objects / f".{entry.sha256}.lock", fcntl.LOCK_EX):
                try:
                    now = path.stat()
                except FileNotFoundError:
                    return
                if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
                    return
                path.unlink()
        except OSError as err:
            raise self.write_error(url, err) from None
        logging.getLogger("fastio").warning(
            "%s: the cached copy %s is %s, the manifest says %d (cut short on this node's disk): filled again", url,
            path, count(seen.st_size, "byte"), entry.size)

    @staticmethod
    def _download(storage: Storage, entry: CacheEntry, tmp: Path) -> tuple[int, str]:
        """Fill ``tmp`` (already at its full size) and return ``(size, sha256)`` of what arrived, fsynced.
        One part: hashed in memory as it is written; several parts (parallel ranged GETs): hashed after. The
        digest is of the entry's :attr:`CacheEntry.check` algorithm."""
        algo = entry.check[0]
        part = getattr(getattr(storage, "options", None), "part_size", None)
        if part is None or entry.size > part:
            storage.get_to_file(entry.key, tmp, entry.size)
            size, digest = digest_file(tmp, algo)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return size, digest
        data = storage.get_buffer(entry.key)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.ftruncate(fd, len(data))
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        h = DIGESTS[algo]()
        h.update(data)
        return len(data), h.hexdigest()


@dataclass
class FillStats:
    """What a :class:`CachedShardFiles` did: shards found, filled on demand (the reader waited) or ahead."""

    hits: int = 0
    waited_fills: int = 0
    ahead_fills: int = 0
    bytes_downloaded: int = 0
    wait_s: float = 0.0
    fill_s: float = 0.0

    def as_dict(self, retries: int = 0) -> dict:
        return {"hits": self.hits, "waited_fills": self.waited_fills, "ahead_fills": self.ahead_fills,
                "bytes_downloaded": self.bytes_downloaded, "wait_s": self.wait_s,
                "download_MBps": self.bytes_downloaded / self.fill_s / 1e6 if self.fill_s else 0.0,
                "retries": retries}


class CachedShardFiles:
    """Open shard files for a reader, through a :class:`ShardCache`, with shard read-ahead.

    ``acquire(i)`` returns a read-only descriptor of shard ``i`` (filled first if absent) and keeps it in use
    until the matching ``release(i)``; ``read_ahead(order)`` fills shards in the order they will be wanted,
    ``depth`` shards ahead of the furthest one acquired so far.

    A released shard stays open (and in use) for ``keep_open_s`` more, at most ``max_idle`` of them, so
    that the next batches of the same shards skip the open, lock and checks; a fill of this process closes
    them first, and a timer closes them after ``keep_open_s``, so other processes can evict them then.
    """

    def __init__(self, cache: ShardCache, storage: Storage, entries: list[CacheEntry], *, depth: int = 2,
                 threads: int = 2, keep_open_s: float = 0.5, max_idle: int = 8):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if keep_open_s < 0 or max_idle < 0:
            raise ValueError(f"keep_open_s and max_idle must be >= 0, got {keep_open_s} and {max_idle}")
        self.cache, self.storage, self.entries, self.depth = cache, storage, entries, depth
        self.keep_open_s, self.max_idle = keep_open_s, max_idle
        self.stats = FillStats()
        self._open: dict[int, list[int]] = {}  # shard -> [fd, holders]
        self._idle: OrderedDict[int, tuple[int, float]] = OrderedDict()  # released, still open: (fd, when)
        self._touched: dict[int, float] = {}  # when the shard's mtime (its LRU age) was last refreshed
        self._sweeper: threading.Timer | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="fastio-fill") if depth else None
        self._epoch = 0  # bumped by read_ahead(): an older read-ahead thread stops
        self._pos: dict[int, int] = {}
        self._reached = -1
        self._closed = False

    def claim(self, need: int, what: str) -> None:
        """Claim ``need`` bytes of the cache (the working set of the Loader reading ``what`` through these files)
        beside the other live claims of this process on the same cache directory: together they must fit in
        ``cache_size``, else a :class:`~fastio.errors.StorageError` names the others (two Loaders of one process
        would otherwise fill the cache with each other's shards in use and wait for room in vain). The claim
        ends with :meth:`close`, or when these files are garbage collected. Other processes' use is not known here."""
        _claim(self, need, what)

    # -- reader side ------------------------------------------------------------------------------------

    def path_of(self, i: int) -> Path:
        """Where shard ``i``'s copy lives (or will) in the cache."""
        return self.cache.path(self.entries[i].sha256)

    def acquire(self, i: int) -> int:
        with self._lock:
            held = self._open.get(i)
            if held is not None:
                held[1] += 1
                self._note(i)
                return held[0]
            idle = self._idle.pop(i, None)
            if idle is not None:  # still open and locked since its release: it cannot have been evicted
                self._open[i] = [idle[0], 1]
                self._in_use(i, +1)
                self.stats.hits += 1
                self._note(i)
                fd = idle[0]
                if time.monotonic() - self._touched.get(i, 0.0) > _TOUCH_S:
                    self._touched[i] = time.monotonic()
                    os.utime(fd)
                return fd
        fd = self._open_entry(i)
        with self._lock:
            held = self._open.get(i)
            if held is not None:  # another thread opened it meanwhile
                os.close(fd)
                held[1] += 1
            else:
                idle = self._idle.pop(i, None)  # another thread opened, read and released it meanwhile
                if idle is not None:
                    os.close(idle[0])  # else its descriptor (and shared lock) would be lost, never closed
                self._open[i] = [fd, 1]
                self._in_use(i, +1)
            self._note(i)
            return self._open[i][0]

    def release(self, i: int) -> None:
        with self._lock:
            held = self._open[i]
            held[1] -= 1
            if held[1] == 0:
                del self._open[i]
                self._in_use(i, -1)
                if self._closed or not self.max_idle or not self.keep_open_s:
                    os.close(held[0])  # drops the shared lock: the shard may be evicted now
                    return
                self._idle[i] = (held[0], time.monotonic())
                self._close_idle(keep=self.max_idle)
                if self._sweeper is None:
                    self._sweeper = threading.Timer(self.keep_open_s, self._sweep)
                    self._sweeper.daemon = True
                    self._sweeper.start()

    def _close_idle(self, keep: int = 0, older_than: float | None = None) -> None:  # under self._lock
        """Close released shards (their shared lock goes with the descriptor), oldest first, down to ``keep``;
        with ``older_than``, also every one released before that time."""
        while self._idle:
            i, (fd, when) = next(iter(self._idle.items()))
            if len(self._idle) <= keep and (older_than is None or when > older_than):
                break
            del self._idle[i]
            os.close(fd)

    def _in_use(self, i: int, delta: int) -> None:
        """Count shard ``i`` in (+1) or out of (-1) this process's use (released shards kept open are not in
        use: they close within ``keep_open_s``, so a fill may wait for them)."""
        _hold(self.cache.path(self.entries[i].sha256), delta)

    def _sweep(self) -> None:
        with self._lock:
            self._sweeper = None
            if self._closed:
                return
            self._close_idle(keep=self.max_idle, older_than=time.monotonic() - self.keep_open_s)
            if self._idle:
                self._sweeper = threading.Timer(self.keep_open_s, self._sweep)
                self._sweeper.daemon = True
                self._sweeper.start()

    def _note(self, i: int) -> None:  # under self._lock
        pos = self._pos.get(i)
        if pos is not None and pos > self._reached:
            self._reached = pos
            self._cond.notify_all()

    def _open_entry(self, i: int) -> int:
        entry, filled = self.entries[i], False
        path = self.cache.path(entry.sha256)
        for _ in range(8):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                with self._lock:  # room may be needed: let go of what this process keeps open idly
                    self._close_idle()
                t = time.perf_counter()
                if self.cache.fill(self.storage, entry):
                    self.stats.bytes_downloaded += entry.size
                    self.stats.waited_fills += 1
                    self.stats.fill_s += time.perf_counter() - t
                self.stats.wait_s += time.perf_counter() - t
                filled = True
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use: eviction skips it from now on
            st = os.fstat(fd)
            if st.st_nlink == 0:  # evicted between open and lock
                os.close(fd)
                continue
            if st.st_size != entry.size:  # cut short on this node's disk: never read, filled again
                os.close(fd)
                self.cache.drop_cut_short(entry, st, self.storage.url_of(entry.key))
                continue
            os.utime(fd)  # most recently used
            self._touched[i] = time.monotonic()
            if not filled:
                self.stats.hits += 1
            return fd
        url = self.storage.url_of(entry.key)
        raise StorageError(f"{url}: shard {entry.name} was evicted from {self.cache.dir} again and again before it "
                           f"could be read (cache_size {human_bytes(self.cache.size)} too small?)", url=url)

    # -- read-ahead -------------------------------------------------------------------------------------

    def read_ahead(self, order: Iterable[int]) -> None:
        """Fill shards in ``order`` (the order they will first be wanted; repeats are skipped) ahead of use, at
        most ``depth`` ahead of the furthest one acquired; those already cached are only marked recently used
        (at once: a warm epoch costs one ``utime`` per shard here, and no waiting)."""
        if self._pool is None:
            return
        with self._lock:
            self._epoch += 1
            self._pos, self._reached = {}, -1
            epoch = self._epoch
            self._cond.notify_all()
        threading.Thread(target=self._read_ahead, args=(iter(order), epoch), name="fastio-read-ahead",
                         daemon=True).start()

    def _read_ahead(self, order: Iterator[int], epoch: int) -> None:
        k = 0
        for i in order:
            with self._lock:
                if self._epoch != epoch or self._closed:
                    return
                if i in self._pos:
                    continue
                self._pos[i] = k
            k += 1
            path = self.cache.path(self.entries[i].sha256)
            try:  # already cached: mark it recently used now (evicted last) and go on without waiting
                os.utime(path)
                continue
            except FileNotFoundError:
                pass
            with self._lock:
                while self._epoch == epoch and not self._closed and k - 1 > self._reached + self.depth:
                    self._cond.wait(0.5)
                if self._epoch != epoch or self._closed:
                    return
            try:
                self._pool.submit(self._fill_ahead, i)
            except RuntimeError:  # pool shut down
                return

    def _fill_ahead(self, i: int) -> None:
        entry = self.entries[i]
        t = time.perf_counter()
        try:
            if self.cache.fill(self.storage, entry, wait=False):
                self.stats.ahead_fills += 1
                self.stats.bytes_downloaded += entry.size
                self.stats.fill_s += time.perf_counter() - t
            else:
                os.utime(self.cache.path(entry.sha256))  # keep it recent until it is read
        except Exception:  # NoRoom or a fault: the reader fills it when it needs it, and reports errors then
            pass

    def close(self) -> None:
        _unclaim(self)
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            for i, (fd, _) in self._open.items():
                os.close(fd)
                self._in_use(i, -1)
            self._open.clear()
            self._close_idle()
            if self._sweeper is not None:
                self._sweeper.cancel()
                self._sweeper = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
