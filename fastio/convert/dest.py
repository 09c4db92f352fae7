"""DEST's life cycle, for every writer of a dataset (``convert``, ``--tokenizer``, ``fastio index``, ``merge``):
check it, lock it, reset it, stage an ``s3://`` one locally and upload it, final files last.

Local DEST: :func:`check_dest` (a conversion's: new, empty or fastio's own output) or :func:`check_index_dest`
(``fastio index`` with a DEST other than SOURCE's folder); :func:`reset_dest` empties it but for the marker
(written first: fastio output, without a final file an interrupted run) before it is written again. A run that
fails (an exception, Ctrl-C) takes back what it made under its :class:`Claim`: DEST as it was before the run.

One writer per DEST: a writer holds DEST's :class:`~fastio.storage.lock.DirLock` (``DEST/.fastio-lock``,
:func:`lock_dest`; :func:`writer_lock` for a DEST that may be on an object store) from before it checks DEST until
its last file is published; a second writer into the same DEST is refused at once naming DEST and the holder; so
is a whole conversion into a DEST whose parts (``DEST/.parts/part-K-of-N/``, each locked by its writer) are still
being converted, before anything is deleted (:func:`lock_parts`). The kernel drops the lock when the holder dies,
so a killed run never blocks the next. An ``s3://`` DEST is guarded the same way by a lease object
(:mod:`fastio.storage.lease`), which a killed run leaves until it expires (at once for a rerun on the same host or a
requeue of the same Slurm job).

Object-store DEST: a dataset is written into a local staging folder named after DEST (:func:`staging_path`), then
uploaded, final files last (:func:`upload_dataset`; an upload that fails deletes the objects it put that were not
there before); ``fastio index`` puts its few files with :func:`publish_uploads`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fastio.convert.listing import display_of, owns_shards_dir
from fastio.convert.parts import PART_RECORD, PARTS_DIR, parse_part_dir
from fastio.dataset.files import unfinished_split_of
from fastio.dataset.manifest import (
    FORMAT,
    MANIFEST_NAME,
    MARKER_NAME,
    SHARDS_DIR,
    SPLITS_NAME,
    fastio_json,
    unfinished_split,
)
from fastio.dataset.sample_table import INDEX_NAME
from fastio.errors import ConvertError, DatasetError
from fastio.formats.media import PROBES_NAME
from fastio.storage import S3Storage, Storage, open_storage
from fastio.storage.atomic import atomic_write_bytes, tmp_path_for
from fastio.storage.lease import Lease, LeaseLostError, writer_lease
from fastio.storage.lock import LOCK_NAME, DirLock, LockedError, holder_of
from fastio.storage.url import dest_location, local_folder, parse_location
from fastio.tokens.starts import STARTS_NAME

T = TypeVar("T")

__all__ = ["Claim", "check_dest", "check_index_dest", "lock_dest", "lock_parts", "mark_index_dest",
           "publish_uploads", "refuse_a_foreign_manifest", "reset_dest", "staging_path", "upload_dataset", "writer_lock"]


# -- a local DEST ------------------------------------------------------------------------------------

def _is_complete(dest: Path) -> bool:
    """Whether DEST holds a converted dataset: fastio's manifest or split list (another tool's ``manifest.json`` is
    none: DEST is then "not fastio output")."""
    return any(_fastio_file(dest / name) for name in (MANIFEST_NAME, SPLITS_NAME))


def _fastio_file(path: Path) -> bool:
    try:
        return path.is_file() and fastio_json(path.read_bytes()) is not None
    except OSError:
        return False


def check_dest(dest: Path, source: Path | str | None, overwrite: bool) -> None:
    """Raise ConvertError if DEST may not be (re)written by this conversion (``source`` None or a str: a SOURCE
    that is no local path, which DEST cannot contain)."""
    if dest.exists() and not dest.is_dir():
        raise ConvertError(f"{dest}: exists and is not a directory")
    src, dst = (source.resolve() if isinstance(source, Path) else None), dest.resolve()
    if src is not None and (src == dst or src in dst.parents or dst in src.parents):
        raise ConvertError(f"{dest}: DEST and SOURCE {source} must not contain one another")
    entries = {p.name for p in dest.iterdir()} - {LOCK_NAME} if dest.is_dir() else set()
    if entries:
        complete = _is_complete(dest)
        # the marker is written first: a run killed while writing it leaves only the marker's temporary file
        ours = (complete or (dest / MARKER_NAME).is_file() or (dest / PARTS_DIR).is_dir()
                or entries == {tmp_path_for(dest / MARKER_NAME).name})
        if complete and not overwrite:
            raise ConvertError(f"{dest}: already holds a converted dataset; pass overwrite=True to replace it")
        if not ours and not overwrite:
            raise ConvertError(f"{dest}: directory is not empty and is not fastio output; "
                               "pass overwrite=True to replace its contents")


def reset_dest(dest: Path, keep: tuple[str, ...] = ()) -> None:
    """Make DEST an empty directory holding only the marker and the entries named in ``keep`` (call
    :func:`check_dest` first)."""
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dest / MARKER_NAME, b"fastio convert output; complete once manifest.json or splits.json exists\n")
    _empty(dest, keep=(MARKER_NAME, LOCK_NAME, *keep))  # the holder's lock is on the lock file


def _empty(folder: Path, keep: tuple[str, ...], only: Callable[[Path], bool] = lambda entry: True) -> None:
    """Remove every entry of ``folder`` but those named in ``keep`` and those ``only`` refuses (an entry of
    ``folder``); the final files (manifests, a part's record) first, so that ``folder`` stops being a dataset (or a
    complete part) before anything else changes."""
    for final in [folder / SPLITS_NAME, folder / MANIFEST_NAME, *folder.glob(f"*/{MANIFEST_NAME}"),
                  folder / PART_RECORD]:
        if final.parent == folder or (not final.parent.is_symlink() and only(final.parent)):  # not through a link
            final.unlink(missing_ok=True)
    for child in folder.iterdir():
        if child.name in keep or not only(child):
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


# the files a conversion writes in DEST, a split's folder or a part's folder (beside shards/): a failed run takes
# back only these, their temporary names, shards/ and folders holding nothing else
_RUN_FILES = frozenset({MARKER_NAME, MANIFEST_NAME, SPLITS_NAME, PART_RECORD, INDEX_NAME, PROBES_NAME, STARTS_NAME})
_RUN_NAMES = _RUN_FILES | {tmp_path_for(Path(name)).name for name in _RUN_FILES}


def _a_runs_entry(entry: Path, depth: int = 0) -> bool:
    """Whether ``entry`` (in a folder a run emptied) is of a kind a conversion writes there: a file of
    ``_RUN_NAMES``, ``shards/``, or a folder (a split's) holding only such entries."""
    if entry.name in _RUN_NAMES or (entry.name == SHARDS_DIR and not entry.is_symlink()):
        return True
    if depth > 0 or entry.is_symlink() or not entry.is_dir():
        return False
    return all(_a_runs_entry(child, depth + 1) for child in entry.iterdir())


class Claim:
    """``folder`` (DEST, or a part's directory) locked for one run, and taken back if the run fails: by an
    exception or an interruption (Ctrl-C; a SIGKILL or SIGTERM leaves an interrupted run, which the same command
    redoes). A ``with`` block; :meth:`take` locks (:func:`lock_dest`), :meth:`reset` empties DEST
    (:func:`reset_dest`), :meth:`emptied` says the run emptied a part's folder.

    Taking back removes only what the run made, and only while it holds the lock and the lock file at the folder is
    still the one it locked (removed or replaced mid-run: another writer may be using the folder, so nothing is
    taken back and the run's files stay, marked unfinished). Once the folder was emptied (this run's marker
    written): the entries a conversion writes (final and index files, ``shards/``, split folders holding nothing
    else; what another process put there meanwhile stays), then the marker, kept if it was there before the run.
    Then the lock file if the run made it, then the folders the run made (the folder and the parents it was made
    in), innermost first, each only if empty (one that holds another process's files stays). Nothing that was
    there before the run goes, but what emptying the folder deleted (an interrupted run's files, a dataset
    replaced with ``overwrite``)."""

    def __init__(self, folder: Path, purpose: str):
        self.folder, self._emptied = folder, False
        self._made = list(itertools.takewhile(lambda d: not d.exists(), (folder, *folder.parents)))  # innermost first
        self._had = {name for name in (LOCK_NAME, MARKER_NAME) if (folder / name).exists()}
        self.lock = DirLock(folder, purpose)

    def take(self) -> None:
        lock_dest(self.lock, self.folder)

    def reset(self) -> None:
        """:func:`reset_dest` under the claim: once the marker is in place, what the folder holds is the run's (an
        interruption while it is emptied included)."""
        before = _file_id(self.folder / MARKER_NAME)
        try:
            reset_dest(self.folder)
        finally:  # this run's marker is a new file (written beside the old one, then renamed over it)
            self._emptied = _file_id(self.folder / MARKER_NAME) not in (None, before)

    def emptied(self) -> None:
        """The run emptied the folder itself (a part's, :func:`~fastio.convert.parts.start_part_dir`)."""
        self._emptied = True

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, kind, err, tb) -> None:
        try:
            if kind is not None and self.lock.owns_path():  # not once its lock file was removed or replaced
                self._take_back()
        finally:
            self.lock.release()

    def _take_back(self) -> None:
        try:
            if self._emptied:  # what others put in the folder meanwhile stays (the marker keeps no run from it)
                _empty(self.folder, keep=(LOCK_NAME, MARKER_NAME), only=_a_runs_entry)
                if MARKER_NAME not in self._had:
                    (self.folder / MARKER_NAME).unlink(missing_ok=True)
            if LOCK_NAME not in self._had:
                (self.folder / LOCK_NAME).unlink(missing_ok=True)  # still held: DirLock.acquire sees it gone
            for folder in self._made:
                folder.rmdir()
        except OSError:  # a folder another run writes in too, or one this one cannot change: left as it is
            pass


def _file_id(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of the file at ``path``, None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def lock_dest(lock: DirLock, dest: Path) -> None:
    """Take ``lock`` (DEST's, a part's or a staging folder's); ConvertError naming the holder, or the folder that
    cannot be made."""
    try:
        lock.acquire()
    except LockedError as err:
        raise ConvertError(str(err)) from None  # names DEST and the holder
    except OSError as err:  # DEST cannot be created
        if dest.is_symlink() and not dest.exists():  # mkdir's word for it is "File exists"
            raise ConvertError(f"{dest}: a symlink to {os.readlink(dest)}, which does not exist: make that folder, or "
                               "give another DEST") from None
        raise ConvertError(f"{err.filename or dest}: {err.strerror or err}") from None


def lock_parts(dest: Path) -> list[DirLock]:
    """Lock every part directory under ``DEST/.parts/`` (DEST's own lock is held), so that resetting DEST
    deletes no running part's files; a running part is a ConvertError naming it and its holder, before
    anything is deleted. (A part started later sees DEST's lock and refuses: :func:`fastio.convert.parts.start_part_dir`.)"""
    root, locks = dest / PARTS_DIR, []
    children = sorted(root.iterdir()) if root.is_dir() else []
    try:
        for child in children:
            kn = parse_part_dir(child.name)
            if kn is None or not child.is_dir() or child.is_symlink():
                continue
            try:
                locks.append(DirLock(child, "fastio convert").acquire())
            except LockedError:
                raise ConvertError(
                    f"{dest}: part {kn[0]}/{kn[1]} of a conversion in parts is running ({holder_of(child)}); "
                    f"nothing was deleted: let it finish and run `fastio merge {dest}`, or stop it, before "
                    "converting into DEST again") from None
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def refuse_a_datasets_shards(dest: Storage) -> None:
    """DatasetError where a DEST of ``fastio index`` (a folder or an ``s3://`` prefix) is the ``shards/`` folder of a
    dataset (beside its manifest, :func:`~fastio.convert.listing.owns_shards_dir`): the index would put its own
    manifest and tables among that dataset's files, and ``fastio verify`` of it would then fail. Whatever
    ``overwrite`` says: it is another dataset's folder."""
    if dest.remote:
        shown, (parent, _, name) = dest.url, dest.url.rstrip("/").rpartition("/")
        owner = open_storage(parent, dest.options) if name == SHARDS_DIR and parent.count("/") >= 2 else None
    else:
        path, real = dest.location.path, Path(os.path.realpath(dest.location.path))
        shown, parent = path, path.parent
        owner = open_storage(real.parent) if real.name == SHARDS_DIR else None
    if owner is not None and owns_shards_dir(owner):
        raise DatasetError(f"{shown}: the {SHARDS_DIR}/ folder of the dataset {parent}: an index here would add "
                           "files to that dataset; it is read as it is (give the dataset's folder), or index these "
                           "shards into another folder (--dest)")


def refuse_a_split_of_an_unfinished_convert(folder: Storage) -> None:
    """DatasetError where a folder (or ``s3://`` prefix) ``fastio index`` would read or write is a split folder
    (``DEST/train``) of an unfinished ``fastio convert``: its shards are part of the source only, and the same
    convert redoes them."""
    err = unfinished_split_of(folder.url, folder.options) if folder.remote else unfinished_split(folder.location.path)
    if err is not None:
        raise err


def refuse_a_foreign_manifest(dest: Storage) -> None:
    """DatasetError where DEST of ``fastio index`` (SOURCE's folder by default) holds a ``manifest.json`` that is not
    the manifest of an index of WebDataset shards: another tool's or the user's own (maybe the only copy), or that of
    a dataset ``fastio convert`` made (its label map, its shards in ``shards/``). Either would be replaced by the
    index's. Whatever ``overwrite`` says: overwrite re-indexes an index, it replaces no other dataset or file."""
    if not dest.exists(MANIFEST_NAME):
        return
    where = display_of(dest, MANIFEST_NAME)
    try:
        data = dest.get(MANIFEST_NAME) if dest.remote else (dest.location.path / MANIFEST_NAME).read_bytes()
    except OSError:  # a folder of that name
        data = b""
    manifest = fastio_json(data)
    if manifest is None or manifest["format"] != FORMAT:  # not fastio's, or a split list
        raise DatasetError(f"{where}: not a fastio manifest, and fastio index writes its manifest.json there; it is "
                           "left as it is: move it away, or index into another folder (--dest)")
    source = manifest.get("source")
    if not (isinstance(source, dict) and "indexed_in_place" in source):  # what only fastio index records
        raise DatasetError(f"{where}: the manifest of a dataset fastio index did not make (a conversion's); that "
                           "dataset is left as it is: index these shards into another folder (--dest)")


def check_index_dest(dest: Storage, overwrite: bool) -> None:
    """A DEST other than SOURCE's folder must be new, empty or fastio's (its marker, a manifest, parts), as
    ``fastio convert``'s; with ``overwrite`` any folder is written into (``fastio index --eos-id`` too)."""
    if not dest.remote:
        path = dest.location.path
        if path.exists() and not path.is_dir():
            raise DatasetError(f"{path}: DEST exists and is not a directory")
        above = next((p for p in path.parents if p.exists() or p.is_symlink()), None)
        if above is not None and not above.is_dir():
            raise DatasetError(f"{path}: DEST cannot be made: {above} is not a directory")
    if overwrite:
        return
    if dest.remote:
        names = {o.key.split("/")[0] for o in dest.list("")}
    else:
        names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    names.discard(LOCK_NAME)
    if names and not names & {MARKER_NAME, MANIFEST_NAME, PARTS_DIR}:
        raise DatasetError(f"{dest.url}: DEST is not empty and is not fastio output (no {MARKER_NAME}); give a new "
                           "or empty folder, or pass overwrite (--overwrite) to write into it")


def writer_lock(dest: Storage, purpose: str, folder: Path | None = None) -> DirLock | Lease | None:
    """The one-writer guard of DEST, not yet taken: the :class:`DirLock` of ``folder`` (default: DEST's own folder;
    a part's directory) on a local DEST, the lease object of an ``s3://`` prefix (None where leases are off)."""
    if dest.remote:
        return writer_lease(dest, purpose)
    return DirLock(folder if folder is not None else dest.location.path, purpose)


def mark_index_dest(dest: Storage, confirm: Callable[[], None] = lambda: None) -> None:
    """Write ``fastio index``'s marker into a DEST other than SOURCE's folder (a rerun after a failure then finds
    DEST its own), unless it is there; ``confirm()`` (the lease's) just before it is written."""
    if not dest.exists(MARKER_NAME):
        confirm()
        dest.put_bytes(MARKER_NAME, b"fastio index output; complete once manifest.json exists\n")


# -- an object-store DEST -----------------------------------------------------------------------------

_FINAL_NAMES = (MANIFEST_NAME, SPLITS_NAME)


def _is_dataset_key(key: str) -> bool:
    """A key that a conversion writes (and so may replace or delete): marker, manifests, shards (a token
    conversion's ``.bin``), indexes."""
    parts = key.split("/")
    return (parts[-1] in (*_FINAL_NAMES, MARKER_NAME) and len(parts) <= 2) or (
        len(parts) in (2, 3) and parts[-2] == "shards" and parts[-1].endswith((".tar", ".bin", ".idx")))


def _check_remote_dest(storage: Storage, overwrite: bool) -> list[str]:
    """Every key under DEST but the lease object (``.fastio-lock``: the writer's, never deleted); ConvertError if
    DEST holds a dataset (without ``overwrite``) or objects fastio did not write."""
    keys = [o.key for o in storage.list() if o.key != LOCK_NAME]
    if not keys:
        return []
    # another tool's manifest.json is no fastio output (overwrite would replace it): its bytes are looked at
    ours = MARKER_NAME in keys or any(k in keys and fastio_json(storage.get(k)) is not None for k in _FINAL_NAMES)
    if not ours:
        raise ConvertError(f"{storage.url}: prefix is not empty and is not fastio output; give a new prefix")
    if any(k.split("/")[-1] in _FINAL_NAMES for k in keys) and not overwrite:
        raise ConvertError(f"{storage.url}: already holds a converted dataset; pass overwrite=True to replace it")
    return keys


def upload_dataset(dest: str, storage_options: dict | None, staging_dir: Path | None, overwrite: bool,
                   write: Callable[[Path], T]) -> T:
    """Write a dataset with ``write(local)`` into DEST's local staging folder (:func:`staging_path`), then upload
    it to the URL ``dest``, final files last; returns what ``write`` returned.

    With ``overwrite`` the old manifests are deleted first (the old dataset stops being readable), and after the
    upload the old dataset's shards and indexes that the new one did not replace. Nothing else under DEST is
    deleted. One writer per DEST: the conversion holds DEST's lease (``DEST/.fastio-lock``,
    :mod:`fastio.storage.lease`) from before it checks DEST until the last upload, and confirms it before it
    deletes anything and before the final files; a second conversion is refused at once naming the holder."""
    storage = open_storage(dest, storage_options)
    lease = writer_lease(storage, "fastio convert") if isinstance(storage, S3Storage) else None
    if lease is not None:
        try:
            lease.acquire()
        except LockedError as err:
            raise ConvertError(str(err)) from None  # names DEST and the holder
    guard = lease.confirm if lease is not None else (lambda: None)
    try:
        return _upload_converted(dest, storage, staging_dir, overwrite, write, guard)
    except LeaseLostError as err:
        raise ConvertError(f"{err} (nothing more was uploaded)") from None
    finally:
        if lease is not None:
            lease.release()


def staging_path(dest: str, staging_dir: Path | None = None) -> Path:
    """The local folder a conversion into the URL ``dest`` is written in before its upload:
    ``STAGING_DIR/fastio-convert-<uid>-<sha256 of dest, 16 hex>`` (default ``STAGING_DIR``: the system's
    temporary directory; ``..`` after a folder that does not exist folded, as DEST's:
    :func:`~fastio.storage.url.dest_location`). One name per DEST and user, so a rerun after a kill finds the copy
    the killed run left, locks it and replaces it; it holds the whole dataset until the upload ends, then is
    removed."""
    url = parse_location(str(dest)).url  # s3://b/ds/ and s3://b/ds are one DEST: one copy for both
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    root = local_folder(staging_dir, "staging_dir") if staging_dir else Path(tempfile.gettempdir())
    return dest_location(root) / f"fastio-convert-{uid}-{digest}"


def _upload_converted(dest: str, storage: Storage, staging_dir: Path | None, overwrite: bool,
                      write: Callable[[Path], T], guard: Callable[[], None]) -> T:
    before = _check_remote_dest(storage, overwrite)
    old = [k for k in before if _is_dataset_key(k)]  # a previous conversion's: deleted after an overwrite
    staging = _own_staging(staging_path(str(dest), staging_dir), dest)
    lock = DirLock(staging, f"fastio convert to {dest}")
    lock_dest(lock, staging)  # a second conversion of DEST on this host is refused here, before it touches the copy
    try:
        # the folder is this DEST's own staging copy: what a killed run left there is replaced
        local = staging / "dest"
        result = write(local)
        (local / LOCK_NAME).unlink(missing_ok=True)  # the staging folder's own lock (released): not data
        guard()
        for key in old:
            if key.split("/")[-1] in _FINAL_NAMES:
                storage.delete(key)
        try:
            uploaded = _publish(storage, local, guard)
        except BaseException:
            _take_back_uploads(storage, local, set(before), guard)
            raise
        guard()
        for key in sorted(set(old) - set(uploaded)):
            storage.delete(key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # the lock file with it, while still held: we are done
        lock.release()
    return result


def _own_staging(staging: Path, dest: str) -> Path:
    """DEST's staging folder, made (mode 0700) if missing; ConvertError naming it if the one there is not a folder
    of this user's that only they can write in: its name is known in advance, in a folder every user writes in
    (``/tmp``), and a link or a folder planted there would have the conversion empty, then delete, what it leads
    to."""
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(staging)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConvertError(f"{staging}: the staging folder of {dest} is not a folder of this user's that only they "
                           "can write in (a link, another user's folder, or one others can write in); nothing was "
                           "written: remove it, or give another --staging-dir")
    return staging


def _publish(storage: Storage, local: Path, guard: Callable[[], None]) -> list[str]:
    """Upload the dataset in ``local``: the run's marker first (no shard is ever under DEST without it: a run killed
    mid-upload leaves an unfinished conversion, which its rerun replaces), each manifest after the shards,
    ``splits.json`` last; the keys."""
    splits = sorted(p.parent.name for p in local.glob(f"*/{MANIFEST_NAME}"))
    last = tuple(f"{split}/{MANIFEST_NAME}" for split in splits) + (MANIFEST_NAME, SPLITS_NAME)
    return storage.publish_dir(local, keys_last=last, before_last=guard, keys_first=(MARKER_NAME,))


def _take_back_uploads(storage: Storage, local: Path, before: set[str], guard: Callable[[], None]) -> None:
    """After an upload that failed: delete the objects it may have put that were not under DEST before it (the
    marker last), while the lease is still this writer's; what cannot be deleted stays (a marked, unfinished
    conversion, which the rerun replaces)."""
    keys = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    new = sorted((k for k in keys if k not in before), key=lambda k: k == MARKER_NAME)
    try:
        guard()
        for key in new:
            storage.delete(key)
    except Exception:  # noqa: BLE001 - the upload's own error is the one to report
        pass


def publish_uploads(dest: Storage, uploads: list[tuple[str, Path]]) -> None:
    """Put each staged file at its key in DEST, in order (the manifest is last): rename locally, upload on S3
    (``fastio index --eos-id``'s manifest too)."""
    for key, path in uploads:
        if dest.remote:
            dest.put_file(key, path)
        else:
            final = dest.location.path / key
            final.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(final, path.read_bytes())
