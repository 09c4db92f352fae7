"""Checkpoints on an object store: ``Checkpointer("s3://bucket/runs/r1/ckpt", ...)``.

Steps are written in a local staging directory, then uploaded by the background writer thread; which way
depends on who sees that directory, found at construction (:func:`staging_views`: every rank drops a probe
file into its staging directory and reports whose probes it sees; :func:`staging_groups`):

- **Shared** (one node, or a shared file system: every rank sees every probe). The engine writes and rank 0
  commits ``step-N/`` exactly as on a file system; then each committed step is uploaded with its commit marker
  last (:class:`fastio.storage.mirror.DirMirror`). A restore downloads a committed remote step that is not
  already local (:meth:`RemoteCheckpoints.fetch`), checks every file against its commit marker and falls back to
  the next older one (a copy that does not verify is moved aside, not deleted).
- **Node-local** (each group of ranks sees only its own directory, e.g. the default one under each node's
  cache dir). Every rank writes into its own node's ``step-N.tmp``; the ranks of a node share hashing and
  uploading that node's files to ``step-N/`` (:meth:`RemoteCheckpoints.upload_files`); rank 0 gathers every
  file's size and checksum and, after all uploads, writes the commit marker to the store last
  (:meth:`RemoteCheckpoints.publish_commit`); the temporaries are then removed (no node holds a whole step).
  A restore pulls each candidate step into every node's staging directory (one puller per directory, the
  lowest rank that sees it) and the ranks of each node check their node's copy before the engine reads it.
- Anything else (a rank that cannot write its staging directory, or sees probes of ranks that do not see its
  own) is refused with one CheckpointError naming the ranks and hosts.

Retention deletes only committed older steps on the store (marker first), and ``step-N/`` objects without a commit
marker of steps older than the newest committed one (what a retention cut short by a kill leaves). One writer per
prefix: rank 0 holds the prefix's lease (``PREFIX/.fastio-lock``, :mod:`fastio.storage.lease`) from construction
to ``close``, beside the staging directory's DirLock (held by the lowest rank of each node-local directory), and
confirms it before a step's upload, before its commit marker, before a rollback supersedes the abandoned steps
(``PREFIX/fastio-rollback.json`` lists them first, as on disk: :mod:`fastio.checkpoint.rollback`) and
before retention; a lost lease fails that save
(nothing more is uploaded or deleted). Listing and retention look only at ``step-N/`` keys, so the lease object is
never touched.

A store outage at a shared staging dir's commit: holding the lease, rank 0 knows the store's committed steps
(listed when it took the lease, at restores, and once at each commit: its upload uses that listing), so the step
is committed in the staging dir without the store (:meth:`RemoteCheckpoints.start_rollback`), its upload left to the
next commit or ``close()`` (:meth:`RemoteCheckpoints.upload_unsent`, which names the steps only staged when the
store still does not answer). A rollback that must supersede steps on the store is staged with the step
(:data:`UNSENT_RECORD`) and done on the store just before that step's upload; until then the steps it supersedes
count as no checkpoints for this staging dir (:meth:`RemoteCheckpoints.committed_steps`). A staged
step the store lacks is an upload pending unless the store superseded it (its own marker kept as superseded) or gained
committed steps its writer did not know when it staged it (:data:`UNSENT_RECORD`: another writer continued without
it): those are neither restored nor uploaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastio.checkpoint import naming, publish, removal, rollback, scan
from fastio.checkpoint.group import RankGroup
from fastio.checkpoint.record import CommitRecord
from fastio.checkpoint.retention import expired
from fastio.errors import CheckpointError, StorageError
from fastio.storage import open_storage
from fastio.storage.atomic import atomic_write_bytes
from fastio.storage.cache import CHECKPOINT_STAGING, default_cache_dir
from fastio.storage.lease import Lease, LeaseLostError, writer_lease
from fastio.storage.mirror import DirMirror
from fastio.words import agree

__all__ = ["STAGING_RECORD", "RemoteCheckpoints", "default_staging_dir", "staging_groups", "staging_views"]

STAGING_RECORD = ".fastio-staging.json"
"""In a staging dir: ``{"url": ...}``, the ``s3://`` prefix whose checkpoints it stages."""

UNSENT_RECORD = ".fastio-unsent.json"
"""In a staging dir: ``{"N": [steps...]}``: for each step committed there and not uploaded yet, the store's committed
steps its writer knew when it committed it. A step the store has since gained others than those is of a branch
another writer continued (the newest save is the run's state): neither restored nor uploaded. A step committed after
a rollback whose superseding the store's outage held up is ``{"N": {"known": [...], "rollback_to": S, "supersedes":
[...]}}``: the store's steps above S, superseded on the store just before ``step-N`` is uploaded (:class:`Unsent`)."""

log = logging.getLogger(__name__)


def default_staging_dir(url: str) -> Path:
    """``<fastio cache dir>/checkpoints/<hash of url>``."""
    return default_cache_dir() / CHECKPOINT_STAGING / hashlib.sha256(url.encode()).hexdigest()[:20]


def staging_views(root: Path, ranks: RankGroup) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """Collective over ``ranks``: ``(rank, host, staging dir, ranks whose probe file that rank sees)`` for every
    rank.

    Each rank writes ``root/.fastio-staging-probe-<token>-<rank>`` (creating ``root``), all wait, each lists the
    probes of that token in its own ``root``, the views are gathered, and each rank removes its own probe."""
    rank = ranks.rank
    token = ranks.broadcast("staging", uuid.uuid4().hex if rank == 0 else None)
    stem = f".fastio-staging-probe-{token}-"
    mine = Path(root) / f"{stem}{rank}"
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        mine.write_bytes(b"")
    except OSError:
        pass  # then this rank sees nothing, not even itself: reported like a staging dir apart
    ranks.barrier("staging")
    try:
        seen = tuple(sorted(int(p.name[len(stem):]) for p in Path(root).glob(stem + "*")))
    except (OSError, ValueError):
        seen = ()
    views = ranks.gather("staging", (rank, socket.gethostname(), str(root), seen))
    try:
        mine.unlink(missing_ok=True)
    except OSError:
        pass
    return views


def staging_groups(views: list[tuple[int, str, str, tuple[int, ...]]]) -> list[tuple[int, ...]] | str:
    """The ranks sharing each staging directory, lowest rank first, groups ordered by their lowest rank (one
    group: shared staging); or, when the views do not split the ranks that way, the refusal (one line)."""
    by_rank = {rank: seen for rank, _, _, seen in views}
    for rank, host, root, seen in views:
        if rank not in seen:
            return (f"{root}: rank {rank} ({host}) cannot use this staging directory (its probe file could not be "
                    "written or listed); give staging_dir= a writable directory")
        odd = [other for other in seen if by_rank.get(other) != seen]
        if odd:
            other = odd[0]
            return (f"{views[0][2]}: ranks {rank} ({host}, {root}) and {other} ({views[other][1]}, {views[other][2]}) "
                    "see different sets of staging directories; give staging_dir= either one directory on a shared "
                    "file system or one directory per node that no other node sees")
    return sorted(set(by_rank.values()), key=min)


def _copy_objects(source, dest, objects) -> None:
    """Copy ``objects`` (keys of ``source``) to the same keys under ``dest``, one at a time through a temp file."""
    with tempfile.TemporaryDirectory(prefix="fastio-ckpt-copy-") as tmp:
        local = Path(tmp) / "object"
        for o in objects:
            source.get_to_file(o.key, local, o.size)
            dest.put_file(o.key, local)


def _outage_of(err: Exception) -> StorageError | None:
    """The StorageError behind ``err`` when it is an outage (the store unreachable or failing past ``deadline_s``:
    retrying could cure it), else None (a refusal, a missing object, damage)."""
    cause = err if isinstance(err, StorageError) else err.__cause__
    return cause if isinstance(cause, StorageError) and cause.transient else None


@dataclass
class Unsent:
    """One step of :data:`UNSENT_RECORD`: the store's committed steps its writer knew when it committed it, and (a
    rollback staged with it) the floor and the store's steps to supersede before it is uploaded."""

    known: set[int]
    rollback_to: int | None = None
    supersedes: set[int] = field(default_factory=set)

    @classmethod
    def parse(cls, value: Any) -> Unsent:
        if isinstance(value, list):  # the form of a step staged without a rollback (and of every older fastio's)
            return cls(set(map(int, value)))
        return cls(set(map(int, value["known"])), int(value["rollback_to"]), set(map(int, value["supersedes"])))

    def encode(self) -> Any:
        if not self.supersedes:
            return sorted(self.known)
        return {"known": sorted(self.known), "rollback_to": self.rollback_to, "supersedes": sorted(self.supersedes)}


class RemoteCheckpoints:
    """The object-store side of a Checkpointer whose local ``root`` stages what is written to ``url``."""

    def __init__(self, url: str, root: Path, storage_options: dict | None = None):
        self.url, self.root = url, Path(root)
        self.mirror = DirMirror(open_storage(url, storage_options), naming.COMMIT_FILE)
        self.lease: Lease | None = None
        self._downloaded: dict[int, tuple[str, int]] = {}  # step -> (its URL, the inode of its download's folder)
        self._known: set[int] | None = None
        """The store's committed steps as this process last listed them (None: not listed yet); holding the lease,
        no other writer changes them, so a commit during an outage knows whether it must supersede any."""
        self._outage: StorageError | None = None  # the store's, met by this commit's rollback: nothing superseded
        self._deferred: tuple[int, set[int]] | None = None
        """This commit's rollback the outage held up: its floor and the store's steps it supersedes at the upload."""
        self._unsent = False  # a commit met an outage: steps committed in the staging dir may be missing on the store
        self._no_record = False
        """This commit's :meth:`start_rollback` found no rollback record on the store and wrote none: holding the lease,
        :meth:`finish_rollback` has nothing to finish and does not read the record again."""
        self._listed = False
        """This commit's :meth:`start_rollback` listed the store (``_known``, less the steps its rollback supersedes):
        :meth:`after_commit` uploads against that listing instead of listing again (the lease, confirmed before the
        upload, shows that no other writer changed the store since)."""

    def bind_staging(self, *, write: bool) -> None:
        """CheckpointError when the staging directory stages another prefix's checkpoints (its
        :data:`STAGING_RECORD` names it): its committed steps would be restored, and uploaded, as this prefix's.
        When nothing is recorded (a staging dir of an older fastio, or a new one), the dir is adopted only when
        every step committed in it is committed on the store too (:meth:`_refuse_unknown_steps`); with ``write``,
        this prefix is then recorded."""
        record, url = self.root / STAGING_RECORD, self.mirror.storage.url
        try:
            staged = json.loads(record.read_text())["url"]
        except FileNotFoundError:
            self._refuse_unknown_steps()
            if write:
                atomic_write_bytes(record, json.dumps({"url": url}).encode())
            return
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{url}: staging_dir {self.root} has an unreadable {STAGING_RECORD} ({err}): give "
                                  "another staging_dir") from None
        if staged != url:
            raise CheckpointError(f"{url}: staging_dir {self.root} stages the checkpoints of {staged}; its steps would "
                                  "be restored and uploaded as this prefix's: give another staging_dir")

    def _refuse_unknown_steps(self) -> None:
        """CheckpointError naming the steps committed in a staging dir that records no prefix which the store does not
        hold committed: they may be another prefix's (a staging dir an older fastio shared between runs), which a
        restore would take and the next commit upload as this prefix's."""
        local = [e.step for e in scan.committed(self.root)]
        if not local:
            return
        url = self.mirror.storage.url
        try:
            unknown = sorted(set(local) - set(self.committed_steps()))
        except StorageError as err:
            raise CheckpointError(f"{url}: staging_dir {self.root} records no prefix and cannot be checked against the "
                                  f"store: {err}") from None
        if unknown:
            names = ", ".join(naming.step_dir(self.root, s).name for s in unknown)
            raise CheckpointError(
                f"{url}: staging_dir {self.root} records no prefix (a staging dir of an older fastio) and holds "
                f"committed {names}, which {url} lacks: they may be another prefix's checkpoints, which would be "
                f"restored and uploaded as this one's; move them out of {self.root} (upload them to {url} first if "
                "they are this prefix's), or give another staging_dir")

    def hold(self, purpose: str = "fastio checkpointer") -> None:
        """Take the prefix's lease (:class:`~fastio.storage.lock.LockedError` naming the holder; StorageError if the
        store cannot be reached or ignores conditional writes). Rank 0 only."""
        lease = writer_lease(self.mirror.storage, purpose)
        if lease is not None:
            lease.acquire()
        self.lease = lease
        try:
            self.committed_steps()  # what the store holds, for a commit that meets an outage (_may_defer)
        except (StorageError, CheckpointError):
            self._known = None

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def _confirm(self) -> None:
        if self.lease is not None:
            self.lease.confirm()

    def confirm(self) -> None:
        """CheckpointError unless the lease (if held) is confirmed by a renewal now."""
        try:
            self._confirm()
        except (LeaseLostError, StorageError) as err:
            raise CheckpointError(f"{err}; nothing uploaded") from None

    def upload_files(self, step: int, tmp: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
        """Checksum and upload files of ``step-N.tmp`` to ``step-N/`` (no marker); their commit-marker records."""
        sub = self.mirror.storage.child(naming.step_name(step))

        def one(path: Path) -> tuple[str, dict[str, Any]]:
            rel = path.relative_to(tmp).as_posix()
            record = publish.file_record(path)
            sub.put_file(rel, path)
            return rel, record

        try:
            with ThreadPoolExecutor(max(1, min(4, len(paths))), thread_name_prefix="fastio-ckpt-put") as pool:
                return dict(pool.map(one, paths))
        except StorageError as err:
            raise CheckpointError(f"{self.url}: upload failed: {err}") from None
        except OSError as err:
            raise CheckpointError(f"{tmp}: cannot read a written file: {err}") from None

    def publish_commit(self, step: int, data: CommitRecord, keep: int) -> None:
        """Write ``step-N``'s commit marker to the store (its files are uploaded), then apply retention; each
        only while the lease (if held) is confirmed."""
        try:
            self._confirm()
            self.mirror.storage.child(naming.step_name(step)).put_bytes(naming.COMMIT_FILE, data.encode())
            self._retain(keep)
        except LeaseLostError as err:
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except StorageError as err:
            raise CheckpointError(f"{self.url}: upload failed: {err}") from None

    def pending_rollback(self) -> frozenset[int]:
        """The steps of a rollback in progress on the store (``PREFIX/fastio-rollback.json``); none are
        checkpoints."""
        return rollback.pending_remote_rollback(self.mirror.storage)

    def start_rollback(self, floor: int) -> list[int]:
        """Before the first commit after a restore of step ``floor``: record on the store every committed step
        above it (and those of a rollback a kill cut short) in ``ROLLBACK_FILE``; from then on none of them is
        a checkpoint. Only while the lease (if held) is confirmed. When the store cannot be reached (an outage past
        ``deadline_s``) and the steps this writer knows on it (:meth:`_may_defer`) leave nothing above ``floor`` to
        supersede, returns [] instead of raising: the commit goes on in the staging dir, its upload later. When the
        steps it knows on the store (:meth:`_may_defer`) hold some above ``floor``, the rollback is staged with the
        step (:meth:`record_staged`) and done on the store just before the step's upload (:meth:`_push_staged`)."""
        self._outage, self._deferred, self._no_record, self._listed = None, None, False, False
        try:
            doomed = rollback.start_remote_rollback(self.mirror.storage, floor, self.committed_steps, self._confirm)
        except LeaseLostError as err:
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except (StorageError, CheckpointError) as err:
            self._outage = _outage_of(err)
            if self._outage is None or not self._may_defer():
                self._outage = None
                raise self._cannot_supersede(err, floor) from None
            self._stage_rollback(floor, {s for s in self._known or () if s > floor})
            return []
        if self._known is not None:
            self._known -= set(doomed)
        self._stage_rollback(floor, set())
        self._no_record = not doomed  # none was pending (those are doomed too) and none was written
        self._listed = self._known is not None
        return doomed

    def _stage_rollback(self, floor: int, above: set[int]) -> None:
        """The rollback this commit's step is staged with (:meth:`record_staged`): the store's steps ``above`` this
        commit's floor that an outage kept it from superseding, and those of the rollbacks staged with steps not
        uploaded yet, which this commit's rollback or retention in the staging dir may remove before their upload
        (their abandoned steps would then stay checkpoints on the store, for its retention to delete)."""
        earlier = list(self._staged_rollbacks(self._known or set()).values())
        supersedes = above.union(*(r.supersedes for r in earlier))
        floors = [floor] if above else []
        self._deferred = (min(floors + [r.rollback_to for r in earlier]), supersedes) if supersedes else None

    def finish_rollback(self) -> list[int]:
        """Supersede every step the store's rollback record lists (its marker copied to ``SUPERSEDED_FILE``, then
        deleted; every other object kept), then delete the record; returns the steps it listed. Nothing (and [])
        after :meth:`start_rollback` met an outage, or when this one meets one: a record written stays on the store,
        hiding its steps, and the next commit finishes it. Nothing is read when this commit's :meth:`start_rollback`
        found no record and wrote none (no other writer adds one while the lease is held)."""
        no_record, self._no_record = self._no_record, False
        if self._outage is not None or no_record:
            return []
        try:
            return rollback.finish_remote_rollback(self.mirror.storage, self._confirm)
        except LeaseLostError as err:
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except (StorageError, CheckpointError) as err:
            self._outage = _outage_of(err)
            if self._outage is None:
                raise self._cannot_supersede(err, None) from None
            return []

    def _may_defer(self) -> bool:
        """A commit may go on in the staging dir while the store is out: this writer listed the store's committed
        steps (so it knows those a rollback must supersede there) and its lease (if any) is not known lost. A lease not
        renewed during a long outage may be taken over meanwhile; the staging dir is this writer's still (its
        DirLock), and the upload confirms the lease before anything is written to the store."""
        if self._known is None:
            return False
        return self.lease is None or (self.lease.held and self.lease.lost is None)

    def _cannot_supersede(self, err: Exception, floor: int | None) -> CheckpointError:
        """The CheckpointError of a rollback that failed on the store: before a commit, every commit checks for committed
        steps above its floor (most often there are none), so that step names both."""
        what = f"check or supersede the committed steps above step {floor}" if floor is not None else \
            "supersede the steps of a rollback"
        return CheckpointError(f"{self.url}: cannot {what}: {err}")

    def make_room(self, step: int, objects: list | None = None) -> str | None:
        """Before a new ``step-N`` is written to the store: a superseded step of that number there is moved aside to
        ``step-N.quarantined/`` (``-2``...: each object copied through a temporary file, then deleted), not written
        over; returns the new name (None when there was nothing to move). Only while the lease is confirmed.
        ``objects``: the store's objects under ``step-N/`` when the caller has just listed them (else listed here)."""
        storage, name = self.mirror.storage, naming.step_name(step)
        try:
            if objects is None:
                objects = storage.child(name).list()
            if not any(o.key == rollback.SUPERSEDED_FILE for o in objects):
                return None
            self._confirm()
            taken = {o.key.split("/")[0] for o in storage.list()}  # a store lists by whole path segments
            target = next(n for n in naming.quarantine_names(name) if n not in taken)
            _copy_objects(storage.child(name), storage.child(target), objects)
            for o in objects:
                storage.child(name).delete(o.key)
        except LeaseLostError as err:
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except StorageError as err:
            raise CheckpointError(f"{self.url}/{name}: cannot move the superseded step aside: {err}") from err
        log.warning("fastio: %s/%s: a superseded step of that number moved aside to %s", self.url, name, target)
        return target

    def fetch(self, step: int) -> list[str]:
        """Make ``step-N`` committed in the staging directory, downloaded when it is not (not verified here:
        the caller checks every node's copy). Returns the step's problems: an object listed, then gone (404:
        retention racing a read-only restore), makes it incomplete. Any other failure (the store unreachable past
        ``deadline_s``, a refusal, the staging disk) is a CheckpointError: a step that could not be read is not
        known to be damaged, and falling back past it would have the next commit supersede it."""
        dest = naming.step_dir(self.root, step)
        replaced = False
        if any(e.step == step for e in scan.committed(self.root)):
            why = self._staged_differs(dest)
            if why is None:
                return self._continued_past(step)
            if why == rollback.SUPERSEDED_FILE:  # skipped, then moved aside by the restore
                return [f"{dest}: superseded on the store by a rollback ({self.url}/{dest.name}/{why})"]
            replaced = True
        try:
            if dest.exists():
                moved = removal.quarantine(dest)  # an uncommitted leftover, or another branch's: never deleted
                if replaced:
                    log.warning("fastio: %s/%s: the store's commit marker is not this staging dir's (%s, a step of "
                                "a branch the run gave up, or of another writer): moved aside to %s, the store's "
                                "downloaded", self.url, dest.name, dest, moved.name)
            self.mirror.pull(dest.name, dest)
        except StorageError as err:
            if err.missing:
                return [str(err)]
            raise CheckpointError(f"{self.url}/{dest.name}: cannot be downloaded: {err}") from None
        except OSError as err:
            raise CheckpointError(f"{self.url}/{dest.name}: cannot be downloaded into {self.root}: "
                                  f"{err.strerror or err}") from None
        self._downloaded[step] = (self.mirror.storage.url_of(dest.name), dest.stat().st_ino)
        return []

    def _staged_differs(self, dest: Path) -> str | None:
        """Why the committed step in the staging dir (``dest``) is not the store's: ``"marker"`` when the store's
        step has another commit marker (committed again after a rollback, by another node), ``SUPERSEDED_FILE`` when
        the store superseded it; None when it is the store's, or the store has no commit of it yet (an upload
        pending: the staging dir's is the newest copy)."""
        sub = self.mirror.storage.child(dest.name)
        try:
            keys = {o.key for o in sub.list()}
            if naming.COMMIT_FILE in keys:
                return None if sub.get(naming.COMMIT_FILE) == (dest / naming.COMMIT_FILE).read_bytes() else "marker"
        except StorageError as err:
            raise CheckpointError(f"{self.url}/{dest.name}: cannot be compared with the store's: {err}") from None
        except OSError as err:
            raise CheckpointError(f"{dest}: cannot read: {err.strerror or err}") from None
        return rollback.SUPERSEDED_FILE if rollback.SUPERSEDED_FILE in keys else None

    def record_staged(self, step: int) -> None:
        """Rank 0, before ``step`` is committed in the staging dir (a step committed without the rollback staged with
        it would be uploaded beside the abandoned steps; an entry of a step whose commit fails is dropped by the next
        upload, or replaced by its next commit): note in :data:`UNSENT_RECORD` the store's committed steps this
        writer knows now and the steps staged before it, not uploaded yet, which this writer uploads first (nothing
        when it has not listed the store), and the rollback an outage held up (:meth:`start_rollback`), done on the
        store before this step is uploaded. CheckpointError naming the record when it cannot be written."""
        deferred, self._deferred = self._deferred, None
        if self._known is None:
            return
        records = self._unsent_records()
        known = set(self._known) | (set(records) - {step})  # the steps staged before it: uploaded first
        records[step] = Unsent(known, *deferred) if deferred else Unsent(known)
        self._write_unsent(records)

    def _unsent_records(self) -> dict[int, Unsent]:
        """:data:`UNSENT_RECORD` (empty when there is none, or it cannot be read: its steps then count as pending)."""
        try:
            return {int(k): Unsent.parse(v) for k, v in json.loads((self.root / UNSENT_RECORD).read_text()).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
            log.warning("fastio: %s: unreadable (%s); its steps count as uploads pending", self.root / UNSENT_RECORD,
                        err)
            return {}

    def _write_unsent(self, records: dict[int, Unsent]) -> None:
        path = self.root / UNSENT_RECORD
        try:
            if records:
                atomic_write_bytes(path, json.dumps({str(k): v.encode() for k, v in sorted(records.items())}).encode())
            else:
                path.unlink(missing_ok=True)
        except OSError as err:
            raise CheckpointError(f"{path}: cannot write: {err.strerror or err}") from None

    def _staged_rollbacks(self, store: set[int]) -> dict[int, Unsent]:
        """The steps committed in the staging dir with a rollback staged with them that is still to do: the store
        (``store``: its committed steps now) has gained no steps their writer did not know (else another writer
        continued the run without them, and the store is not rolled back)."""
        staged = {e.step for e in scan.committed(self.root)}
        return {s: r for s, r in self._unsent_records().items() if r.supersedes and s in staged and not store - r.known}

    def _live(self, store: set[int]) -> set[int]:
        """The store's committed steps (``store``) less those a rollback staged in the staging dir supersedes: none
        of them is a checkpoint any more for this staging dir's writer."""
        doomed = set().union(*(r.supersedes for r in self._staged_rollbacks(store).values()))
        return store - doomed

    def _continued_past(self, step: int) -> list[str]:
        """Why staged ``step``, which the store has no commit of, is no upload pending (one problem; none when it
        is): the store has committed steps its writer did not know when it committed it (:data:`UNSENT_RECORD`),
        another writer's, who continued the run from the store without it."""
        record = self._unsent_records().get(step)
        since = sorted(set(self._known or ()) - record.known) if record is not None else []
        if not since:
            return []
        return [f"{naming.step_dir(self.root, step)}: committed only in this staging dir, and {agree(len(since), 'step')} "
                f"{', '.join(map(str, since))} {agree(len(since), 'was', 'were')} committed on the store since (another "
                "writer continued the run without it)"]

    def download_of(self, step: int) -> str | None:
        """The store's URL of ``step`` when ``root``'s ``step-N`` is still the folder :meth:`fetch` downloaded it
        into (a copy of what the store keeps; not a step committed here since, which may be the only copy); else
        None."""
        url, ino = self._downloaded.get(step, ("", -1))
        try:
            return url if url and naming.step_dir(self.root, step).stat().st_ino == ino else None
        except FileNotFoundError:
            return None

    def committed_steps(self, pending: frozenset[int] | None = None) -> list[int]:
        """The store's committed steps, oldest first, less those of a rollback in progress on the store (``pending``:
        its steps when the caller has just read its record, else it is read) and those a rollback staged in the
        staging dir supersedes (:meth:`_live`); all it lists is remembered as what the store holds."""
        return self.listing(pending)[0]

    def listing(self, pending: frozenset[int] | None = None) -> tuple[list[int], frozenset[int]]:
        """:meth:`committed_steps`, and the steps of the rollback in progress on the store (read once for both)."""
        doomed = self.pending_rollback() if pending is None else pending
        steps = {s for s in map(naming.parse_step_name, self.mirror.names()) if s is not None and s not in doomed}
        self._known = set(steps)
        return sorted(self._live(steps)), doomed

    def _retain(self, keep: int) -> None:
        """Rank 0, holding the lease: retention (older committed steps, marker first), then the leftovers of
        steps older than the newest committed one: ``step-N/`` objects without a commit marker, which a kill
        during an earlier retention (or upload) left behind. While the lease is held no other writer is
        uploading, and such a step was never, or is no longer, a checkpoint; the one listing of the prefix names every
        object each removal deletes."""
        listed = scan.remote_steps(self.mirror.storage)
        steps = {step: naming.COMMIT_FILE in keys for step, keys in listed.items()}
        done = sorted(s for s, marked in steps.items() if marked)
        if not done:
            return
        old = expired(done, keep)
        leftovers = [s for s, marked in steps.items()  # a superseded step is kept (see finish_rollback)
                     if not marked and s < done[-1] and rollback.SUPERSEDED_FILE not in listed[s]]
        if old or leftovers:
            self._confirm()
        for step in old + sorted(leftovers):
            self.mirror.remove(naming.step_name(step), listed[step])  # its keys as just listed: not listed again
            if self._known is not None:
                self._known.discard(step)
        if leftovers:
            log.info("fastio: %s: removed leftovers of uncommitted %s %s (older than committed step %d)",
                     self.url, agree(len(leftovers), "step"), ", ".join(map(str, sorted(leftovers))), done[-1])

    def after_commit(self, keep: int) -> None:
        """Upload every locally committed step the store lacks, then apply retention on the store; each only while
        the lease (if held) is confirmed. An outage (the store unreachable past ``deadline_s``) fails nothing: one
        warning names the steps committed only in the staging dir, uploaded at the next commit or by
        :meth:`upload_unsent` (``close()``). Not tried when this commit's rollback has just met the outage: each
        request would wait ``deadline_s`` again, and the next save waits for this one. The store's committed steps are
        those this commit's :meth:`start_rollback` listed (no other writer changes them while the lease holds, and
        the lease is confirmed before the first upload)."""
        listed, self._listed = self._listed, False
        if self._outage is not None:
            outage, self._unsent = self._outage, True
        else:
            outage = self._upload(keep, listed=listed)
        if outage is not None:
            unsent = self.unsent()
            if unsent:
                log.warning("fastio: %s/%s: committed in %s, not on the store yet (%s); uploaded at the next save, or "
                            "by close()", self.url, ", ".join(p.name for p in unsent), ", ".join(map(str, unsent)),
                            outage)
            else:
                log.warning("fastio: %s: retention not applied on the store (%s); applied at the next save", self.url,
                            outage)

    def upload_unsent(self, keep: int) -> None:
        """``close()``: when a commit's upload met an outage or a refusal, upload what the store still lacks
        (:meth:`after_commit`, each request within ``deadline_s``); a CheckpointError naming the steps still committed
        only in the staging dir, where they are and what uploads them (or, when the upload was refused, a lost lease,
        that it did not)."""
        if not self._unsent:
            return
        try:
            outage = self._upload(keep)
        except CheckpointError as err:
            unsent = self.unsent()
            if unsent:
                raise CheckpointError(f"{err}; {self._only_staged(unsent)} (not uploaded){self._rollbacks_staged()}"
                                      ) from None
            raise
        unsent = self.unsent() if outage is not None else []
        if unsent:
            them = "it" if len(unsent) == 1 else "them"
            rolled = self._rollbacks_staged()
            elsewhere = (f"; a job resumed with another staging dir restores from the store, which does not know of the "
                         f"rollback: restore_latest(..., step={self._rollback_floor()}) there repeats it") if rolled else ""
            raise CheckpointError(
                f"{self.url}: {self._only_staged(unsent)} (not on the store: {outage}){rolled}: the next Checkpointer("
                f"{self.url!r}, staging_dir={str(self.root)!r}) uploads {them} at its first save (its restore_latest "
                f"restores the newest first); keep the staging dir until then{elsewhere}")

    def _rollback_floor(self) -> int | None:
        """The lowest floor of the rollbacks staged in the staging dir and not done on the store yet (None: none)."""
        floors = [r.rollback_to for r in self._staged_rollbacks(self._known or set()).values()]
        return min(floors) if floors else None  # type: ignore[type-var]

    def _rollbacks_staged(self) -> str:
        """``, after a rollback to step 1 that supersedes steps 2, 5 on the store`` when rollbacks staged in the
        staging dir are not done on the store yet (one clause: the steps staged after one carry it too), else ``""``."""
        rollbacks = self._staged_rollbacks(self._known or set()).values()
        doomed = sorted(set().union(*(r.supersedes for r in rollbacks)))
        if not doomed:
            return ""
        return (f", after a rollback to step {self._rollback_floor()} that supersedes {agree(len(doomed), 'step')} "
                f"{', '.join(map(str, doomed))} on the store")

    def _only_staged(self, unsent: list[Path]) -> str:
        """``step 4 is committed only in /stage/step-4`` (``steps 2, 4 are ... in /stage (step-2, step-4)``)."""
        steps = ", ".join(str(naming.parse_step_name(p.name)) for p in unsent)
        if len(unsent) == 1:
            return f"step {steps} is committed only in {unsent[0]}"
        return f"steps {steps} are committed only in {self.root} ({', '.join(p.name for p in unsent)})"

    def _set_aside_if_abandoned(self, path: Path, step: int, keys: set[str]) -> bool:
        """True when staged ``step`` (``path``), which the store lacks, is of a branch the run gave up, not an upload
        pending: the store keeps it superseded with this staging dir's own commit marker (a rollback on another
        node; ``keys``: the store's keys under ``step-N/``, just listed), or another writer committed steps since
        (:meth:`_continued_past`); it is moved aside (``step-N.quarantined``, never deleted), with one warning."""
        why = self._continued_past(step)
        sub = self.mirror.storage.child(path.name)
        try:
            if not why and rollback.SUPERSEDED_FILE in keys \
                    and sub.get(rollback.SUPERSEDED_FILE) == (path / naming.COMMIT_FILE).read_bytes():
                why = [f"superseded on the store by a rollback ({rollback.SUPERSEDED_FILE} holds this staging dir's "
                       "commit marker, a step of a branch the run gave up)"]
            if not why:
                return False  # a superseded step of that number with another marker: make_room moves it aside
            done = f"moved aside to {removal.quarantine(path).name}"
        except OSError as err:
            done = f"left in place (cannot move it aside: {err.strerror or err})"
        log.warning("fastio: %s/%s: not uploaded: %s; %s %s", self.url, path.name, why[0], path, done)
        return True

    def unsent(self) -> list[Path]:
        """The steps committed in the staging dir that the store lacked when this writer last listed it."""
        live = None if self._known is None else self._live(self._known)
        return [e.path for e in scan.committed(self.root) if live is None or e.step not in live]

    def _push_staged(self, remote: set[int]) -> None:
        """Upload every step committed in the staging dir that the store (``remote``: its committed steps) lacks,
        oldest first, but for those of a branch the run gave up (:meth:`_set_aside_if_abandoned`), each after the
        rollback staged with it (:meth:`_supersede_staged`); then drop the :data:`UNSENT_RECORD` entries of the steps
        the store has or the staging dir no longer commits."""
        rollbacks = self._staged_rollbacks(remote)
        for entry in scan.committed(self.root):
            rolled = rollbacks.get(entry.step)
            if entry.step in remote and not (rolled and entry.step in rolled.supersedes):
                continue
            objects = self.mirror.storage.child(entry.path.name).list()  # one listing: superseded? and make_room's
            if self._set_aside_if_abandoned(entry.path, entry.step, {o.key for o in objects}):
                continue
            if rolled:
                self._supersede_staged(entry.step, rolled, remote)
                rollbacks = self._staged_rollbacks(remote)
                objects = None  # the rollback may have superseded this number: make_room lists it again
            self.make_room(entry.step, objects)
            self.mirror.push(entry.path, entry.path.name, before_marker=self._confirm)
            remote.add(entry.step)
            self._known = set(remote)
        staged, records = {e.step for e in scan.committed(self.root)}, self._unsent_records()
        if any(s in remote or s not in staged for s in records):
            self._write_unsent({s: k for s, k in records.items() if s not in remote and s in staged})

    def _supersede_staged(self, step: int, staged: Unsent, remote: set[int]) -> None:
        """Before staged ``step`` is uploaded: the rollback staged with it done on the store (as
        :meth:`start_rollback` and :meth:`finish_rollback` do: the record, then each marker renamed, every object
        kept) for its steps the store (``remote``) still commits, then dropped from :data:`UNSENT_RECORD`, from every
        step's entry (the steps staged after it carry it too), so that a step uploaded since with the number of an
        abandoned one is never superseded by them."""
        doomed = staged.supersedes & remote
        if doomed:
            rollback.start_remote_rollback(self.mirror.storage, staged.rollback_to, lambda _: doomed,
                                            self._confirm)
        rollback.finish_remote_rollback(self.mirror.storage, self._confirm)  # also one an outage cut short
        if doomed:
            log.warning("fastio: %s: uploading step %d, staged after a rollback to step %d during an outage: %s %s "
                        "superseded (files kept, no longer checkpoints)", self.url, step, staged.rollback_to,
                        agree(len(doomed), "step"), ", ".join(map(str, sorted(doomed))))
            remote -= doomed
            self._known = set(remote)
        records = self._unsent_records()
        for s, record in records.items():
            left = record.supersedes - staged.supersedes
            records[s] = replace(record, rollback_to=record.rollback_to if left else None, supersedes=left)
        self._write_unsent(records)

    def _upload(self, keep: int, listed: bool = False) -> StorageError | None:
        """:meth:`after_commit`'s work; the store's error when it was an outage (retried later), a CheckpointError
        for any other failure (a refusal, a lost lease). ``listed``: ``_known`` is this commit's listing (taken by
        :meth:`start_rollback` under the lease this confirms), not listed again."""
        try:
            self._confirm()
            if not listed:
                self.committed_steps()
            self._push_staged(set(self._known))
            self._retain(keep)
        except LeaseLostError as err:
            self._unsent = True  # close() names the steps left in the staging dir
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except (StorageError, CheckpointError) as err:
            self._unsent = True  # a refusal too (credentials expired): close() tries again, else names the steps
            outage = _outage_of(err)
            if outage is None:
                raise (err if isinstance(err, CheckpointError) else
                       CheckpointError(f"{self.url}: upload failed: {err}")) from None
            return outage
        self._unsent = False
        return None
