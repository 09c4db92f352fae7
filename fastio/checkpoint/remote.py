"""Checkpoints on an object store: ``Checkpointer("s3://bucket/runs/r1/ckpt", ...)``.

The engine writes and commits ``step-N/`` in a local staging directory exactly as on a file system; then,
in the same background writer thread, each committed step is uploaded with its commit marker last
(:class:`fastio.storage.mirror.DirMirror`), and retention deletes only committed older steps on the store
(marker first). A restore downloads the newest committed remote step that is not already local, checks every
file against its commit marker and falls back to the next older one when a download does not verify.
The staging directory must be seen by every rank that writes (one node, or a shared file system): with several
ranks, the Checkpointer checks that at construction (:func:`staging_views`: every rank drops a probe file into
its staging directory and reports whose probes it sees) and refuses, naming the ranks and hosts that do not
see rank 0's, rather than upload steps that lack their files.

One writer per prefix: rank 0 holds the prefix's lease (``PREFIX/.fastio-lock``, :mod:`fastio.storage.lease`)
from construction to ``close``, beside the staging directory's DirLock, and confirms it before each step's
upload, before its commit marker and before retention; a lost lease fails that save (nothing more is uploaded
or deleted). Listing and retention look only at ``step-N/`` keys, so the lease object is never touched.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from fastio.checkpoint import layout
from fastio.errors import CheckpointError, StorageError
from fastio.storage import open_storage
from fastio.storage.cache import default_cache_dir
from fastio.storage.lease import Lease, LeaseLostError, writer_lease
from fastio.storage.mirror import DirMirror

__all__ = ["RemoteCheckpoints", "default_staging_dir", "staging_views", "unshared_staging"]

log = logging.getLogger(__name__)


def default_staging_dir(url: str) -> Path:
    """``<fastio cache dir>/checkpoints/<hash of url>``."""
    return default_cache_dir() / "checkpoints" / hashlib.sha256(url.encode()).hexdigest()[:20]


def staging_views(root: Path, rank: int, world: int) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """Collective over the default group: ``(rank, host, staging dir, ranks whose probe file that rank sees)``
    for every rank.

    Each rank writes ``root/.fastio-staging-probe-<token>-<rank>`` (creating ``root``), all wait, each lists the
    probes of that token in its own ``root``, the views are gathered, and each rank removes its own probe."""
    token: list[str | None] = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    stem = f".fastio-staging-probe-{token[0]}-"
    mine = Path(root) / f"{stem}{rank}"
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        mine.write_bytes(b"")
    except OSError:
        pass  # then this rank sees nothing, not even itself: reported like a staging dir apart
    dist.barrier()
    try:
        seen = tuple(sorted(int(p.name[len(stem):]) for p in Path(root).glob(stem + "*")))
    except (OSError, ValueError):
        seen = ()
    views: list = [None] * world
    dist.all_gather_object(views, (rank, socket.gethostname(), str(root), seen))
    mine.unlink(missing_ok=True)
    return views


def unshared_staging(views: list[tuple[int, str, str, tuple[int, ...]]]) -> str | None:
    """The refusal when some rank does not see rank 0's staging directory (from :func:`staging_views`), or None."""
    apart = [f"{rank} ({host})" for rank, host, _, seen in views if 0 not in seen or rank not in seen]
    if not apart:
        return None
    return (f"{views[0][2]}: the staging directory of rank 0 is not seen by rank(s) {', '.join(apart)}; an s3:// "
            "Checkpointer commits each step there, so every writing rank must see it: give staging_dir= on a "
            "shared file system")


def _step_of(name: str) -> int:
    return int(name.split("-", 1)[1])


class RemoteCheckpoints:
    """The object-store side of a Checkpointer whose local ``root`` stages what is written to ``url``."""

    def __init__(self, url: str, root: Path, storage_options: dict | None = None):
        self.url, self.root = url, Path(root)
        self.mirror = DirMirror(open_storage(url, storage_options), layout.COMMIT_FILE)
        self.lease: Lease | None = None

    def hold(self, purpose: str = "fastio checkpointer") -> None:
        """Take the prefix's lease (:class:`~fastio.lock.LockedError` naming the holder; StorageError if the
        store cannot be reached or ignores conditional writes). Rank 0 only."""
        lease = writer_lease(self.mirror.storage, purpose)
        if lease is not None:
            lease.acquire()
        self.lease = lease

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def _confirm(self) -> None:
        if self.lease is not None:
            self.lease.confirm()

    def committed_steps(self) -> list[int]:
        return sorted(_step_of(n) for n in self.mirror.names() if n.startswith("step-") and n[5:].isdigit())

    def after_commit(self, keep: int) -> None:
        """Upload every locally committed step the store lacks, then apply retention on the store; each only
        while the lease (if held) is confirmed."""
        try:
            self._confirm()
            remote = set(self.committed_steps())
            for entry in layout.committed(self.root):
                if entry.step not in remote:
                    self.mirror.push(entry.path, entry.path.name, before_marker=self._confirm)
                    remote.add(entry.step)
            if keep > 0:
                self._confirm()
                for step in sorted(remote)[:-keep]:
                    self.mirror.remove(f"step-{step}")
        except LeaseLostError as err:
            raise CheckpointError(f"{err}; nothing more uploaded or deleted") from None
        except StorageError as err:
            raise CheckpointError(f"{self.url}: upload failed: {err}") from None

    def pull(self, step: int | None = None) -> None:
        """Make the newest verified remote step (or ``step``) committed locally, unless it already is."""
        try:
            steps = self.committed_steps()
        except StorageError as err:
            raise CheckpointError(f"{self.url}: cannot list checkpoints: {err}") from None
        local = {e.step for e in layout.committed(self.root)}
        wanted = [step] if step is not None else sorted(steps, reverse=True)
        for s in wanted:
            if s in local:
                return
            if s not in steps:
                continue
            dest = layout.step_dir(self.root, s)
            try:
                self.mirror.pull(dest.name, dest)
            except StorageError as err:
                log.warning("fastio: %s/step-%d cannot be downloaded (%s); trying an older step", self.url, s, err)
                continue
            try:
                problems = layout.verify_step(layout.StepEntry(s, dest, layout.read_commit(dest)))
            except CheckpointError as err:  # an unreadable or unknown commit marker
                problems = [str(err)]
            if not problems:
                return
            log.warning("fastio: %s/step-%d does not verify (%s); trying an older step", self.url, s, problems[0])
            shutil.rmtree(dest, ignore_errors=True)
