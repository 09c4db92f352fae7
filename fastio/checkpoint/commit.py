"""Where a Checkpointer's steps are committed and found again: one interface, two implementations.

:class:`Commit` owns a checkpoint directory's steps as the Checkpointer sees them: the temporary a save is
written into (``step-N.tmp``, names from :mod:`fastio.checkpoint.naming`), its files (and deleting it when a save
fails), publishing it with its commit marker last (:mod:`fastio.checkpoint.publish`), retention, which steps
exist, and making a step readable locally before a restore checks it. The Checkpointer keeps the scheduling
and its :class:`~fastio.checkpoint.restore.Restorer` decides what to restore, one restore flow over either
implementation (plan, fetch, check, fall back).

- :class:`LocalCommit`: a directory every rank sees (a file system, or an ``s3://`` dir staged in one shared
  directory). Rank 0 commits ``step-N.tmp`` to ``step-N/`` (:func:`publish.commit`) and applies retention (the
  expired steps renamed away, their files deleted by :meth:`Commit.prune` after the save counts as done); for
  ``s3://`` it then uploads every committed step the store lacks and applies retention there
  (:meth:`RemoteCheckpoints.after_commit`). Restore candidates: local committed steps, and the store's.
- :class:`NodeLocalCommit`: an ``s3://`` dir staged in one directory per node. Each node's ranks upload their
  node's files, rank 0 writes the commit marker to the store last and applies retention there, then the
  temporaries go (:mod:`fastio.checkpoint.remote`). Restore candidates: the store's committed steps.

Every method that takes a :class:`~fastio.checkpoint.group.RankGroup` is collective over it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fastio.checkpoint import naming, publish, removal, retention, rollback, scan
from fastio.errors import CheckpointError, StorageError
from fastio.words import agree

if TYPE_CHECKING:
    from fastio.checkpoint.group import RankGroup
    from fastio.checkpoint.record import CommitInfo
    from fastio.checkpoint.remote import RemoteCheckpoints

__all__ = ["Commit", "LocalCommit", "NodeLocalCommit", "Unrecognised"]

log = logging.getLogger(__name__)

Unrecognised = tuple[int, str, str]
"""A ``step-N`` directory that is not a committed checkpoint: (step, path, why)."""


class Commit(Protocol):
    """The steps of one checkpoint directory (see the module docstring)."""

    root: Path
    """The local directory steps are written in and read from."""
    ranks_here: tuple[int, ...]
    """The ranks that see ``root`` (they share its files' work), lowest first; the lowest creates and cleans."""
    restored: int | None
    """Set by the restore (:class:`~fastio.checkpoint.restore.Restorer`) to the step it loaded: the next
    :meth:`publish` first supersedes every committed step above it (the abandoned branch of a rollback,
    crash-safely: see :mod:`fastio.checkpoint.rollback`), then forgets it as soon as the new step is published,
    also when what follows in that commit fails (retention, the upload to the store): that step is on the
    run's branch, and a later commit must not take it for the abandoned one."""

    def tmp_dir(self, step: int) -> Path: ...

    def step_dir(self, step: int) -> Path: ...

    def start(self, step: int) -> Path:
        """The lowest rank of ``ranks_here``: create ``step``'s temporary, marked as fastio's own (on the training
        thread: nothing waits on the disk)."""
        ...

    def ready(self, step: int) -> None:
        """The lowest rank of ``ranks_here``, on the writer thread before the engine writes: make what
        :meth:`start` made durable."""
        ...

    def data_files(self, step: int) -> list[Path]:
        """The files in ``step``'s temporary that its commit marker will list (the engine's, as written)."""
        ...

    def discard(self, step: int) -> None:
        """The lowest rank of ``ranks_here``: delete ``step``'s temporary (a save that failed)."""
        ...

    def publish(self, ranks: RankGroup, rank: int, step: int, info: CommitInfo, keep: int,
                written: dict[str, dict[str, Any]] | None = None) -> None:
        """Writer thread, collective: supersede the committed steps above ``step`` (above ``restored`` after a
        rollback), commit the fully written temporary of ``step`` (marker last), then retention keeping ``keep``
        (0: all): the expired steps are renamed away (no checkpoints from then on) and their files left for
        :meth:`prune`; any rank's failure raises on every rank, nothing half-published is visible. ``written``:
        the files this rank's engine wrote with their checksums taken while writing (see
        :meth:`~fastio.checkpoint.engines.base.Engine.save`), which the commit need not read back."""
        ...

    @property
    def expired(self) -> list[Path]:
        """The renamed-away steps retention expired whose files are not deleted yet (:meth:`prune` deletes them)."""
        ...

    def prune(self) -> None:
        """Delete the files of the :attr:`expired` steps: after the save that expired them counts as done (its
        caller does not wait for it)."""
        ...

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        ...

    def clean(self) -> None:
        """The lowest rank of ``ranks_here``: delete fastio's own abandoned temporaries in ``root``."""
        ...

    def plan(self, step: int | None) -> tuple[list[int], list[Unrecognised]]:
        """Rank 0: the steps a restore tries (``[step]``, or every committed one newest first) and the step
        directories that are not committed checkpoints. CheckpointError when ``step`` is not committed."""
        ...

    def fetch(self, step: int) -> list[str]:
        """The lowest rank of ``ranks_here``: make committed ``step`` readable in ``root`` (downloaded when it
        is only on the store; not verified here, the caller checks every copy). Returns the step's problems found
        on the way (an object gone from the store); CheckpointError when the store could not be read."""
        ...

    @property
    def fetches(self) -> bool:
        """:meth:`fetch` may download (an ``s3://`` dir): the other ranks wait for it before they read the step.
        False when every step is already in ``root``."""
        ...

    def downloaded(self, step: int) -> str | None:
        """The store's URL of ``step`` when ``root``'s copy of it is what :meth:`fetch` downloaded in this process
        (not the only copy); None otherwise."""
        ...


def _warn_superseded(where: object, step: int, restored: int | None, steps: list[int]) -> None:
    """The warning naming the steps a commit of ``step`` superseded: after a rollback to ``restored``, or (None)
    below steps this Checkpointer never restored, most often a run started without ``restore_latest``."""
    if not steps:
        return
    why = (f"after a rollback to step {restored}" if restored is not None else
           "below committed steps this Checkpointer did not restore (started without restore_latest?)")
    log.warning("fastio: %s: committing step %d %s: %s %s superseded (files kept, no longer checkpoints)", where, step,
                why, agree(len(steps), "step"), ", ".join(map(str, steps)))


class _Steps:
    def __init__(self, root: Path, remote: RemoteCheckpoints | None, ranks_here: tuple[int, ...]):
        self.root, self.remote, self.ranks_here = Path(root), remote, ranks_here
        self.restored: int | None = None
        """The step the last restore loaded, until the next commit: every committed step above it is the
        abandoned branch of a rollback, superseded before that commit."""
        self._expired: list[Path] = []

    @property
    def expired(self) -> list[Path]:
        return list(self._expired)

    def prune(self) -> None:
        doomed, self._expired = self._expired, []
        removal.finish_removal(doomed)

    def _floor(self, step: int) -> int:
        """The step above which a commit of ``step`` supersedes every committed step."""
        return step if self.restored is None else min(step, self.restored)

    def tmp_dir(self, step: int) -> Path:
        return naming.tmp_dir(self.root, step)

    def step_dir(self, step: int) -> Path:
        return naming.step_dir(self.root, step)

    def start(self, step: int) -> Path:
        try:
            return publish.start_tmp(self.root, step)
        except OSError as err:
            raise CheckpointError(f"{self.tmp_dir(step)}: cannot create checkpoint directory: "
                                  f"{err.strerror or err}") from None

    def ready(self, step: int) -> None:
        try:
            publish.sync_tmp(self.tmp_dir(step))
        except OSError as err:
            raise CheckpointError(f"{self.tmp_dir(step)}: cannot flush checkpoint directory to disk: "
                                  f"{err.strerror or err}") from None

    def data_files(self, step: int) -> list[Path]:
        return publish.data_files(self.tmp_dir(step))

    def discard(self, step: int) -> None:
        removal.remove_step(self.tmp_dir(step))

    def clean(self) -> None:
        _, left = removal.remove_abandoned(self.root)
        for entry in left:
            if entry.temporary:
                log.warning("fastio: leaving %s alone: %s", entry.path, entry.problem)

    def fetch(self, step: int) -> list[str]:
        return self.remote.fetch(step) if self.remote is not None else []

    @property
    def fetches(self) -> bool:
        return self.remote is not None

    def downloaded(self, step: int) -> str | None:
        return self.remote.download_of(step) if self.remote is not None else None

    def _remote_steps(self) -> list[int]:
        try:
            return self.remote.committed_steps()
        except StorageError as err:
            raise CheckpointError(f"{self.remote.url}: cannot list checkpoints: {err}") from None

    def _remote_listing(self) -> tuple[list[int], frozenset[int]]:
        """The store's committed steps and the steps of its rollback in progress (its record read once)."""
        try:
            return self.remote.listing()
        except StorageError as err:
            raise CheckpointError(f"{self.remote.url}: cannot list checkpoints: {err}") from None


class LocalCommit(_Steps):
    """Steps committed in a directory every rank sees (and uploaded from there for an ``s3://`` dir)."""

    def __init__(self, root: Path, remote: RemoteCheckpoints | None, world: int):
        super().__init__(root, remote, tuple(range(world)))

    def publish(self, ranks: RankGroup, rank: int, step: int, info: CommitInfo, keep: int,
                written: dict[str, dict[str, Any]] | None = None) -> None:
        def commit() -> None:
            if rank == 0:
                floor, remote = self._floor(step), self.remote
                if remote is not None:  # both records first, so a kill anywhere leaves every doomed step hidden
                    remote.start_rollback(floor)
                rollback.start_rollback(self.root, floor, [e.step for e in scan.committed(self.root)])
                _warn_superseded(self.root, step, self.restored, rollback.finish_rollback(self.root))
                if remote is not None:
                    _warn_superseded(remote.url, step, self.restored, remote.finish_rollback())
                if remote is not None:  # what the store held, and a rollback an outage held up: before the commit
                    remote.record_staged(step)
                publish.commit(self.tmp_dir(step), self.step_dir(step), step=step, info=info, known=written)
                self.restored = None  # the rollback is done, whatever fails after it (the upload of this step)
                self._expired += retention.expire(self.root, keep)  # the files go in prune()
                if remote is not None:
                    remote.after_commit(keep)

        ranks.run("commit", commit)
        self.restored = None

    def steps(self) -> list[int]:
        if self.remote is not None:
            return self._remote_steps()
        return [e.step for e in scan.committed(self.root)]

    def plan(self, step: int | None) -> tuple[list[int], list[Unrecognised]]:
        try:
            entries = scan.scan(self.root)
        except OSError as err:
            raise CheckpointError(f"{self.root}: cannot read checkpoint directory: {err}") from None
        done = {e.step for e in entries if e.committed}
        if self.remote is not None:  # steps on the store not here yet are downloaded (and checked) when tried
            steps, pending = self._remote_listing()
            done |= set(steps)
            done -= pending  # a rollback a kill cut short: its record outlives the local one
        unrecognised = [(e.step, str(e.path), e.problem or "") for e in entries  # superseded: left where it is
                        if not e.committed and not e.temporary and not e.superseded and e.step not in done]
        if step is not None and step not in done:
            have = ", ".join(str(s) for s in sorted(done)) or "none"
            raise CheckpointError(f"{self.remote.url if self.remote else self.root}: no committed checkpoint for "
                                  f"step {step} (committed: {have})")
        return ([step] if step is not None else sorted(done, reverse=True)), unrecognised


class NodeLocalCommit(_Steps):
    """Steps of an ``s3://`` dir whose ranks stage in one directory per node: each node uploads its own files."""

    remote: RemoteCheckpoints

    def publish(self, ranks: RankGroup, rank: int, step: int, info: CommitInfo, keep: int,
                written: dict[str, dict[str, Any]] | None = None) -> None:
        remote, tmp = self.remote, self.tmp_dir(step)
        floor = self._floor(step)

        def confirm() -> None:  # every engine.save has returned; the abandoned branch goes before any upload
            if rank == 0:
                remote.confirm()
                remote.start_rollback(floor)
                _warn_superseded(remote.url, step, self.restored, remote.finish_rollback())
                remote.make_room(step)

        ranks.run("confirm", confirm)
        i, n = self.ranks_here.index(rank), len(self.ranks_here)
        records = ranks.run("upload", lambda: remote.upload_files(step, tmp, self.data_files(step)[i::n]))
        every = ranks.gather("upload", records)

        def commit() -> None:
            if rank == 0:
                files: dict[str, Any] = {}
                for part in every:
                    twice = sorted(set(files) & set(part))
                    if twice:  # two nodes wrote the same file: the engine assumed one directory
                        raise CheckpointError(f"{tmp}: {twice[0]} was written on two nodes; give staging_dir= on "
                                              "a shared file system")
                    files.update(part)
                remote.publish_commit(step, publish.commit_data(files, step=step, info=info), keep)
                self.restored = None  # the rollback is done, whatever fails after it
            if rank == self.ranks_here[0]:  # uploaded, and no node holds the whole step: the temporaries go, within
                self.discard(step)  # the phase (a large step takes seconds: this rank is seen busy)

        ranks.run("commit", commit)
        self.restored = None

    def steps(self) -> list[int]:
        return self._remote_steps()

    def plan(self, step: int | None) -> tuple[list[int], list[Unrecognised]]:
        steps = self._remote_steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.remote.url}: no committed checkpoint for step {step} (committed: "
                                  f"{', '.join(map(str, steps)) or 'none'})")
        return ([step] if step is not None else steps[::-1]), []
