"""The Checkpointer's restore path, beside its save path (:mod:`fastio.checkpoint.checkpointer`).

The Checkpointer makes and owns one :class:`Restorer`, given what a restore uses: the directory's
:class:`~fastio.checkpoint.commit.Commit`, the training thread's :class:`~fastio.checkpoint.group.RankGroup`, the
engine getter, this rank's place among the ranks sharing the directory, ``read_only``. Its ``restore_latest``
plans the candidates (rank 0: the newest committed steps first, or the one asked for; every directory's own
abandoned temporaries deleted first unless read-only), fetches each candidate (an ``s3://`` dir: into its staging
directory), checks every file against the commit marker (the ranks sharing the files; each rank the files the
engine foresees it will load, kept for the engine to read by ``pread``, never mapped: ``Restorer.held``)
and falls back past a damaged or unrecognised step, which it moves aside (``step-N.quarantined``) along the run's
current branch (none of it with ``read_only=True``). The chosen step is decompressed when compressed
(:mod:`fastio.checkpoint.compress`), opened by the engine its marker names, the loaders' states read and checked
before anything loads (``loader_policy``), and so are the optimizers' parameter groups and, at another world size,
the per-rank modules (from the engine's metadata), then loaded: the app's own objects first (which no check can
vouch for: one that refuses its state leaves the rest as it was), the engine's other keys, the loaders, the RNG
streams last (or, at another world size, :mod:`fastio.checkpoint.elastic`'s rule). Each phase is agreed over the training
thread's :class:`~fastio.checkpoint.group.RankGroup`, so one rank's failure is every rank's.

The progress handed back (:class:`TrainState`) is the commit marker's (:class:`~fastio.checkpoint.record.Progress`,
rank 0's at the save, the same on every rank). Older checkpoints also hold a per-rank progress record
(the engine's ``_fastio_progress`` key): it is not read, the marker's wins.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastio.checkpoint import catalog, compress, naming, removal, scan
from fastio.checkpoint.elastic import restore_elastic
from fastio.checkpoint.engines import ENGINES, holds_dtensor, meta_refusal
from fastio.checkpoint.engines.base import RESERVED_PREFIX, first_line
from fastio.checkpoint.engines.strict import (
    Mismatch,
    class_mismatch,
    group_sizes,
    groups_mismatch,
    other_dtypes,
    settings_mismatch,
    shape_of,
    state_mismatch,
)
from fastio.checkpoint.record import CommitRecord
from fastio.checkpoint.rng import capture_rng, restore_rng
from fastio.checkpoint.staging import Frozen
from fastio.checks import next_epoch_start
from fastio.errors import CheckpointError, FastioError
from fastio.words import agree, count

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastio.checkpoint.commit import Commit, Unrecognised
    from fastio.checkpoint.engines.base import Engine
    from fastio.checkpoint.group import RankGroup


__all__ = ["LOADER_POLICIES", "RESERVED_PREFIX", "RNG_KEY", "Restorer", "TrainState", "check_state_dicts",
           "loader_epoch", "loader_keys", "own_keys"]

log = logging.getLogger(__name__)

RNG_KEY = "_fastio_rng"
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)
"""A directory this process may not write (a read-only mount, another user's)."""
LOADER_POLICIES = ("exact", "next-epoch")
"""``restore_latest(loader_policy=)``: the loader continues where it was saved, or from the start of the next epoch
not begun (:func:`fastio.checks.next_epoch_start`)."""


@dataclass
class TrainState:
    """What ``restore_latest`` found: the step the checkpoint was taken after, and the run's progress."""

    step: int
    """The last completed step; continue with ``step + 1``."""
    epoch: int | None
    """The epoch given to (or found by) ``maybe_save``, None when unknown."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics passed with that save (rank 0's)."""
    elapsed: float = 0.0
    """Seconds of training (summed over restarts) up to that save."""
    time: float = 0.0
    """Unix time of the commit."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """The ``hparams`` the saving run was created with."""
    path: Path | None = None
    """The checkpoint directory restored from."""
    skipped: list[str] = field(default_factory=list)
    """What a ``strict=False`` restore left out (app keys, state keys, shape mismatches); empty otherwise."""


def loader_epoch(states: dict[str, Any]) -> int | None:
    """The epoch of the app's data loader, found by its state rather than by its app key.

    A loader is an app object whose state_dict carries the position part of the fastio Loader's state
    contract: integer ``epoch`` and ``consumed`` entries. The first such object in app order counts;
    None when there is none.
    """
    for state in states.values():
        if isinstance(state, dict) and all(isinstance(state.get(k), int) and not isinstance(state.get(k), bool)
                                           for k in ("epoch", "consumed")):
            return int(state["epoch"])
    return None


def loader_keys(app: dict[str, Any]) -> list[str]:
    """App keys of objects that can check a state before loading it (``check_state_dict``: the fastio Loader)."""
    return [k for k, obj in app.items() if callable(getattr(obj, "check_state_dict", None))]


def check_state_dicts(saved: Any, app: dict[str, Any], keys: list[str], src: int, path: Path,
                      policy: str) -> dict[str, Any]:
    """The saved state of each of ``keys`` (saving rank ``src``'s), checked by its object before anything is
    loaded; with ``policy="next-epoch"`` moved to the start of an epoch: the saved one where nothing of it was
    delivered, else the one after it (:func:`~fastio.checks.next_epoch_start`; by the object's ``next_epoch_state``
    where it has one, as the fastio Loader: the data it reads may have changed since). An
    object with a ``check_restored_with(app, state)`` is asked first whether ``app`` restores what its position
    lies in (the fastio Loader of a torchft job: the Manager)."""
    held: dict[str, Any] = {}
    for key in keys:
        state, obj = saved.read(key, src), app[key]
        _check_restored_with(app, key, state, path)
        move = getattr(obj, "next_epoch_state", None) if policy == "next-epoch" else None
        if policy == "next-epoch" and not callable(move):
            if not isinstance(state, dict) or loader_epoch({key: state}) is None:
                raise CheckpointError(f"{path}: app key {key!r}: loader_policy='next-epoch' needs a loader state "
                                      "with integer 'epoch' and 'consumed'")
            state = {**state, "epoch": next_epoch_start(int(state["epoch"]), int(state["consumed"])), "consumed": 0}
        try:
            if callable(move):
                state = move(state)
            else:
                obj.check_state_dict(state)
        except FastioError as err:
            raise CheckpointError(f"{path}: app key {key!r}: {err}") from err
        held[key] = state
    return held


def _check_restored_with(app: dict[str, Any], key: str, state: Any, path: Path) -> None:
    """CheckpointError naming ``key`` when its object says ``app`` lacks what the position of ``state`` lies in."""
    check = getattr(app[key], "check_restored_with", None)
    if callable(check):
        try:
            check(app, state)
        except FastioError as err:
            raise CheckpointError(f"{path}: app key {key!r}: {err}") from err


def _set_aside(newer: list[Unrecognised], *, read_only: bool, downloaded: Callable[[int], str | None]) -> None:
    """Move the damaged or unrecognised steps above the chosen one aside (not with ``read_only``), one warning
    each; a step this restore downloaded (``downloaded(step)``: the store's URL) is removed instead: the store keeps
    it (a restart would otherwise keep one more copy of it each time)."""
    for step, path_, reason in newer:
        if not Path(path_).exists():  # never downloaded here (an object gone from the store): nothing to move
            log.warning("fastio: skipping checkpoint %s: %s", path_, reason)
            continue
        source = downloaded(step)
        try:
            if read_only:
                moved = "; left in place (read_only)"
            elif source is not None:
                removal.remove_step(Path(path_))
                moved = f"; the download of {source} removed (the store keeps it)"
            else:
                moved = f"; moved aside to {removal.quarantine(Path(path_)).name}"
        except OSError as err:
            moved = f"; left in place ({err.strerror or err})"
        reason = reason[len(path_) + 2:] if reason.startswith(f"{path_}: ") else reason
        log.warning("fastio: skipping checkpoint %s: %s%s", path_, reason, moved)


@dataclass
class _Opened:
    """A checkpoint opened for this rank: the app's targets, what was saved, and what was checked."""

    prepared: dict[str, Any]
    saved: Any
    saved_world: int
    extra: list[str]
    """App keys the checkpoint holds and this app lacks (skipped with ``strict=False``)."""
    held: dict[str, Any]
    """The loaders' checked states, loaded last."""
    dropped: dict[str, str]
    """Optimizers whose parameter groups cannot load (``strict=False``): app key -> why, left as they are."""
    cast: bool = False
    """A tensor saved in another dtype than the app's is cast by the load (``cast_dtypes=True``), not refused."""


def _precheck(saved: Any, targets: dict[str, Any], src: int, strict: bool, *, elastic: bool, where: str,
              modules: dict[str, Any] | None = None, classes: dict[str, str] | None = None,
              cast: bool = False) -> dict[str, str]:
    """What the engines' load would refuse only while loading, checked from the checkpoint's metadata (no tensor
    read) before anything loads: each optimizer's parameter groups (torch's own check) and, for torch's own
    optimizers, the settings its groups need (a checkpoint of another kind of optimizer) and the shapes of its
    positional state against the app's parameters (neither of which torch checks), and its class against the one
    the commit marker records (``classes``: the line of each app key whose class differs; Adam and AdamW hold the
    same state and settings), and
    at another world size each per-rank module's state keys, shapes and dtypes (the engine checks replicated ones),
    and with ``modules`` (the app) every module's (the app's own objects load first, before the engine's own check);
    ``cast``: a dtype is no difference.
    ``strict``: the first difference is a CheckpointError; otherwise the optimizers that cannot load, each with its
    line (left as they are; a module loads what matches, :func:`restore_elastic`)."""
    from torch import nn

    dropped: dict[str, str] = {}
    for key, obj in targets.items():
        own = group_sizes(getattr(obj, "param_groups", None))
        line = groups_mismatch(key, saved.param_groups(key, src), own) if own is not None else None
        if own is not None and not line:
            line = (settings_mismatch(key, saved.group_settings(key, src), obj)
                    or state_mismatch(key, saved.state_shapes(key, src), obj))
        line = line or (classes or {}).get(key)
        if line and strict:
            raise CheckpointError(f"{where}: checkpoint does not match the app: {line} (restore_latest(..., "
                                  "strict=False) leaves that optimizer as it is and loads the rest)")
        if line:
            dropped[key] = f"{line} (optimizer left as it was)"
        module = (modules or {}).get(key, obj)  # the app's module; its state as the engine loads it: ``obj``'s
        if strict and isinstance(module, nn.Module) and (modules or elastic and not saved.is_replicated(key, src)):
            own_state = obj.state_dict()  # once: an FSDP module's gathers its state
            found = Mismatch(key, saved.shapes(key, src), {k: shape_of(v) for k, v in own_state.items()},
                             dtypes=other_dtypes(saved.dtypes(key, src), own_state, cast=cast))
            if found:
                raise found.refusal(where)
    return dropped


def own_keys(app: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    """Keys of ``targets`` whose ``load_state_dict`` is the app's own code, which no check before the load can
    vouch for: every app object but torch modules and optimizers (checked from the checkpoint's metadata), an
    optimizer wrapper (an object with an optimizer's ``param_groups``, checked as one: accelerate's, Lightning's),
    torch's LR schedulers (whose state goes with the optimizer's) and the loaders (checked by their
    ``check_state_dict``, not among ``targets``). Loaded first, so that one that refuses its state leaves the
    modules, optimizers, schedulers, loaders and RNG as they were."""
    from torch import nn, optim

    torch_own = (nn.Module, optim.Optimizer, optim.lr_scheduler.LRScheduler, optim.lr_scheduler.ReduceLROnPlateau)
    return [k for k in targets if k in app and not isinstance(app[k], torch_own)
            and group_sizes(getattr(app[k], "param_groups", None)) is None]


def _load_loaders(path: Path, opened: _Opened, app: dict[str, Any]) -> None:
    """The loaders' states, checked by their ``check_state_dict`` before anything loaded."""
    try:
        for key, state in opened.held.items():
            app[key].load_state_dict(state)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - its own check passed it: said as the engine's errors are
        raise CheckpointError(f"{path}: restore failed: app key {key!r}: {first_line(err)}") from err


def _train_state(path: Path, commit: CommitRecord, loader_policy: str, skipped: list[str],
                 loaders: dict[str, Any]) -> TrainState:
    """What the restore hands back: the marker's step and progress; after a next-epoch restore the epoch is the one
    the loader now starts (``loaders``: the loaders' states as loaded, the first with an ``epoch`` in app order
    counts, as at save)."""
    p = commit.progress
    epoch = p.epoch
    if loader_policy == "next-epoch":
        moved = loader_epoch(loaders)  # where the loader now starts
        if moved is not None:
            epoch = moved
        elif epoch >= 0:  # a loader state of no known epoch: the saved epoch's next, as before
            epoch += 1
    return TrainState(step=commit.step, epoch=None if epoch < 0 else int(epoch), metrics=dict(p.metrics),
                      elapsed=p.elapsed, time=commit.time, hparams=dict(p.hparams), path=path, skipped=skipped)


@dataclass(frozen=True)
class Restorer:
    """The restore behind :meth:`Checkpointer.restore_latest <fastio.checkpoint.checkpointer.Checkpointer>`: made by
    the Checkpointer once the ranks that see its directory are known, and given what a restore uses (not the
    Checkpointer itself). :meth:`restore_latest` is collective over ``ranks``."""

    commit: Commit
    """The checkpoint directory's steps: the candidates (``plan``), making one readable here (``fetch``), its
    directory; ``restored`` is set to the step loaded (the next commit supersedes every step above it)."""
    ranks: RankGroup
    """The training thread's rank group: every phase is agreed over it, and the engine reads over its ``pg``."""
    engine: Callable[[str], Engine]
    """The checkpoint engine of a name (the one a step's marker names), as the Checkpointer's saves get it."""
    rank: int
    world_size: int
    leader: bool
    """This rank is the lowest of ``commit.ranks_here``: it cleans, fetches, moves aside and decompresses into
    its directory."""
    share: tuple[int, int]
    """This rank's place among ``commit.ranks_here`` and their number: they share checking and decompressing."""
    read_only: bool
    """Delete and move aside nothing (``Checkpointer(read_only=True)``)."""
    where: str
    """The checkpoint directory as the user named it (an ``s3://`` URL, else the directory), in messages."""
    held: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The files of the step being restored that this rank checked and will load (path relative to the step -> its
    ``fastio.storage.checksum.CheckedFile``), from the check to the end of the restore (:meth:`_owners`)."""

    def restore_latest(self, app: dict[str, Any], step: int | None, strict: bool,
                       loader_policy: str, cast: bool = False) -> TrainState | None:
        """The newest intact committed step (or ``step``) loaded into ``app``, None when there is none; the
        Checkpointer has checked the arguments and entered the operation on every rank. ``cast``: a tensor saved in
        another dtype than the app's is cast (``restore_latest(..., cast_dtypes=True)``), not a difference."""
        try:
            return self._restore_latest(app, step, strict, loader_policy, cast)
        finally:
            self.held.clear()  # the files checked go with the restore

    def _restore_latest(self, app: dict[str, Any], step: int | None, strict: bool,
                        loader_policy: str, cast: bool) -> TrainState | None:
        commit = self.commit
        candidates, unrecognised = self.ranks.broadcast("plan", self.ranks.run("plan", lambda: self._plan(step)))
        chosen, skipped = self._choose(candidates, step)
        newer = sorted((s for s in skipped + list(unrecognised) if chosen is None or s[0] > chosen), reverse=True)
        if chosen is None:
            if newer:  # nothing to fall back to: leave everything where it is and say so
                raise CheckpointError(f"{self.where}: no intact checkpoint: {len(newer)} step director(ies) "
                                      f"damaged or unrecognised, newest {newer[0][1]}: {newer[0][2]}")
            return None
        if self.leader:  # moved aside, so that a later save of that step cannot replace it (each node its copy)
            _set_aside(newer, read_only=self.read_only, downloaded=commit.downloaded)
        path = commit.step_dir(chosen)
        state = self._restore(path, scan.read_commit(path), app, strict, loader_policy, cast)
        commit.restored = chosen  # a rollback: the next commit supersedes every committed step above it
        return state

    def _plan(self, step: int | None) -> tuple[list[int], list[Unrecognised]] | None:
        """Rank 0's candidates, newest first (after every directory's abandoned temporaries are cleaned)."""
        if self.leader and not self.read_only:
            self.commit.clean()
        return self.commit.plan(step) if self.rank == 0 else None

    def _choose(self, candidates: list[int], step: int | None) -> tuple[int | None, list[Unrecognised]]:
        """The first intact candidate (fetched and checked on every rank), and the damaged ones before it."""
        commit = self.commit
        skipped: list[Unrecognised] = []
        for cand in candidates:
            path = commit.step_dir(cand)
            self.held.clear()  # a damaged step's files, or the last restore's
            problems = self._fetch(cand) or self._check_step(cand, path)
            if not problems:
                return cand, skipped
            more = f" (and {count(len(problems) - 1, 'more problem')})" if len(problems) > 1 else ""
            skipped.append((cand, str(path), problems[0] + more))
            if step is not None:
                raise CheckpointError(f"{path}: damaged checkpoint: {problems[0]}{more}")
        return None, skipped

    def _fetch(self, step: int) -> list[str]:
        """Collective where the commit fetches (an ``s3://`` dir): ``step`` made readable here by each directory's
        lowest rank, the others waiting for it; every rank's problems (an object gone from the store). A store
        that could not be read fails the restore on every rank (no fallback: the step is not known to be damaged,
        and the next commit would supersede it). Nothing to do (no agreement) otherwise."""
        if not self.commit.fetches:
            return []
        problems: list[str] = []
        failure: str | None = None
        if self.leader:
            try:
                problems = self.commit.fetch(step)
            except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
                failure = str(err) if isinstance(err, FastioError) else f"{self.where}: {first_line(err)}"
        self.ranks.check("fetch", failure, blame=False)
        return self.ranks.collect("fetched", lambda: problems)

    def _check_step(self, step: int, path: Path) -> list[str]:
        """Collective: problems with the committed checkpoint ``step`` in ``path`` (its marker, then every listed file
        against its recorded size and checksum, the ranks sharing the files); empty when intact."""
        def check() -> list[str]:
            entry = scan.StepEntry(step, path, scan.read_commit(path))
            if entry.commit.engine not in ENGINES:
                return [f"{path / naming.COMMIT_FILE}: written by checkpoint engine {entry.commit.engine!r}, this "
                        f"fastio has {', '.join(sorted(ENGINES))}"]
            why = compress.check_marker(entry.commit)
            if why:
                return [f"{path / naming.COMMIT_FILE}: {why}"]
            owners, keep = self._owners(entry.commit)  # every directory's copy, by the ranks seeing it
            return catalog.verify_files(entry, part=self.share, owners=owners, held=self.held if keep else None)

        return self.ranks.collect("check", check)

    def _owners(self, commit: CommitRecord) -> tuple[dict[str, int], bool]:
        """``(owners, keep)``: the files each rank sharing this directory will read while loading (as the engine
        that wrote ``commit`` foresees them), by its place among them, so that it checks them itself (every rank
        the same); ``keep``: the engine reads this rank's own through the check's ``CheckedFile`` objects
        (:attr:`held`: by ``pread``, a DCP tensor straight into the app's tensor, a file changed or cut short since
        the check named; not for a compressed step, whose engine reads the decompressed copies)."""
        if commit.compression:
            return {}, False
        here = self.commit.ranks_here
        reads = self.engine(commit.engine).reads(sorted(commit.files), commit.progress.world_size, self.world_size)
        owners = {rel: here.index(r) for rel, r in reads.items() if r in here}
        return owners, self.share[0] in owners.values()

    def _restore(self, path: Path, commit: CommitRecord, app: dict[str, Any], strict: bool,
                 loader_policy: str, cast: bool) -> TrainState:
        """Restore the verified step ``path`` (its marker ``commit``): from its own files, or, compressed, from
        their plain copies decompressed into a private directory next to it. A failure of a step gone meanwhile
        (another job's retention) says so."""
        try:
            return self._restore_step(path, commit, app, strict, loader_policy, cast)
        except CheckpointError as err:
            if (path / naming.COMMIT_FILE).exists():
                raise
            raise CheckpointError(f"{path}: deleted while it was being restored (by the retention of the job writing "
                                  f"the directory? keep it at keep=2 or more beside a read-only restore): {err}"
                                  ) from err.__cause__

    def _restore_step(self, path: Path, commit: CommitRecord, app: dict[str, Any], strict: bool,
                      loader_policy: str, cast: bool) -> TrainState:
        if not commit.compression:
            return self._restore_from(path, path, commit, app, strict, loader_policy, cast)
        # Verified stored files -> plain files in a private directory next to the step, the ranks sharing
        # the work; the engine reads there; the directory goes when every rank is done with it.
        made = self.ranks.run("decompress", lambda: self._start_restore_dir(commit.step))
        work = Path(self.ranks.gather("decompress", made)[self.commit.ranks_here[0]])  # this directory's lowest rank's
        try:
            i, n = self.share
            mine = sorted(commit.files)[i::n]
            self.ranks.run("decompress", lambda: [compress.restore_file(path / rel, work / compress.stored_name(rel),
                                                                        commit.compression) for rel in mine])
            try:
                return self._restore_from(path, work, commit, app, strict, loader_policy, cast)
            except CheckpointError as err:  # name the checkpoint, not the directory about to go
                raise CheckpointError(str(err).replace(str(work), str(path))) from err.__cause__
        finally:
            try:
                self.ranks.barrier("restore")  # every rank is done reading
            finally:
                if self.leader:
                    removal.end_restore_dir(work)

    def _start_restore_dir(self, step: int) -> str | None:
        """One private directory per staging directory, made by the lowest rank seeing it; a read-only restore first
        deletes the ones of ended restores (a killed evaluation's: no writer's restore may come to delete them). A
        read-only restore of one rank that cannot write DIR (a read-only mount) decompresses into a private
        temporary directory instead (:func:`~fastio.checkpoint.removal.start_private_staging`)."""
        if not self.leader:
            return None
        try:
            if self.read_only:
                removal.remove_ended_restores(self.commit.root)
            return str(removal.start_restore_dir(self.commit.root, step))
        except OSError as err:
            if self.read_only and len(self.commit.ranks_here) == 1 and err.errno in _CANNOT_WRITE:
                return str(removal.start_private_staging())
            raise CheckpointError(f"{naming.restore_dir(self.commit.root, step)}: cannot create: "
                                  f"{err.strerror or err}") from None

    def _open(self, path: Path, files: Path, commit: CommitRecord, app: dict[str, Any], strict: bool,
              loader_policy: str, cast: bool) -> _Opened:
        """This rank's checks before anything loads: no app tensor is on the meta device, the engine can restore this
        app, the checkpoint has state for
        every app key (and, when ``strict``, none other), the loaders' states pass their own checks."""
        name = commit.engine
        meta = meta_refusal(app)
        if meta:
            raise CheckpointError(f"{path}: {meta}")
        sharded = holds_dtensor(app)
        if sharded and name != "dcp":
            raise CheckpointError(f"{path}: written by the {name} engine, which cannot restore into DTensor "
                                  f"(FSDP2 / tensor parallel) state of {agree(len(sharded), 'app key')} "
                                  f"{', '.join(sharded)}: restore it into the unsharded model and save again with "
                                  "engine='dcp'")
        engine = self.engine(name)
        prepared, _ = engine.prepare(app)
        saved = engine.open(files, pg=self.ranks.pg, held=self.held)
        world = commit.progress.world_size or saved.world_size
        src = self.rank % world  # the saving rank whose per-rank state this rank takes
        have = saved.keys(src)
        missing = sorted(k for k in prepared if k not in have)
        if missing:
            holds = ", ".join(sorted(k for k in have if not k.startswith(RESERVED_PREFIX))) or "nothing"
            raise CheckpointError(
                f"{path}: checkpoint has no state for {agree(len(missing), 'app key')} {', '.join(missing)} on rank "
                f"{src} (it holds: {holds}; written by {count(world, 'rank')}, this run has {self.world_size})")
        extra = sorted(k for k in have if k not in prepared and not k.startswith(RESERVED_PREFIX))
        if extra and strict:
            raise CheckpointError(f"{path}: checkpoint holds state for {agree(len(extra), 'app key')} "
                                  f"{', '.join(extra)}, which this app lacks (restore_latest(..., strict=False) skips them)")
        held = check_state_dicts(saved, app, loader_keys(app), src, path, loader_policy)
        targets = {k: v for k, v in prepared.items() if k not in held}
        whose = f" (rank {self.rank} takes saved rank {src}'s state)" if world != self.world_size else ""
        classes = {k: line for k in targets if (line := class_mismatch(k, commit.optimizers.get(k), app.get(k)))}
        dropped = _precheck(saved, targets, src, strict, elastic=world != self.world_size, where=f"{path}{whose}",
                            modules=app if own_keys(app, targets) else None, classes=classes, cast=cast)
        return _Opened(prepared, saved, world, extra, held, dropped, cast)

    def _load(self, path: Path, opened: _Opened, targets: dict[str, Any],
              strict: bool) -> tuple[list[str], list[str], list[str]]:
        """The engine's load of ``targets``: ``(replicated, per_rank, skipped)``."""
        try:
            if opened.saved_world != self.world_size:
                replicated, per_rank, skipped = restore_elastic(opened.saved, targets, rank=self.rank,
                                                                saved_world=opened.saved_world, strict=strict,
                                                                cast=opened.cast)
                return replicated, per_rank, list(skipped or [])
            return [], [], list(opened.saved.restore(targets, strict=strict, cast=opened.cast) or [])
        except CheckpointError:
            raise
        except Exception as err:  # a mismatched model or an app object refusing its state lands here
            raise CheckpointError(f"{path}: restore failed: {first_line(err)}") from err

    def _load_all(self, path: Path, opened: _Opened, targets: dict[str, Any], app: dict[str, Any],
                  strict: bool) -> tuple[list[str], list[str], list[str]]:
        """Load in two agreed ``load`` phases: the app's own objects (:func:`own_keys`: one that refuses its state
        fails the restore on every rank before anything else loads), then the engine's other keys and the loaders'
        checked states. ``(replicated, per_rank, skipped)`` of them all."""
        first = own_keys(app, targets)
        parts = []
        if first:
            try:
                parts.append(self.ranks.run("load", lambda: self._load(path, opened, {k: targets[k] for k in first},
                                                                       strict)))
            except CheckpointError as err:
                raise CheckpointError(f"{err} (the app's modules, optimizers, schedulers, loaders and RNG are "
                                      "left as they were)") from err.__cause__

        def load() -> tuple[list[str], list[str], list[str]]:
            done = self._load(path, opened, {k: v for k, v in targets.items() if k not in first}, strict)
            _load_loaders(path, opened, app)
            return done

        parts.append(self.ranks.run("load", load))
        replicated, per_rank, skipped = ([k for part in parts for k in part[i]] for i in range(3))
        return replicated, per_rank + (list(opened.held) if opened.saved_world != self.world_size else []), skipped

    def _restore_from(self, path: Path, files: Path, commit: CommitRecord, app: dict[str, Any],
                      strict: bool, loader_policy: str, cast: bool) -> TrainState:
        """Restore the checkpoint ``path`` (its plain files are in ``files``) into ``app``: the checks each rank
        makes (the loaders' states read and checked too), then the loads (:func:`_load_all`); each agreed,
        so a rank that fails fails every rank's restore."""
        opened = self.ranks.run("open", lambda: self._open(path, files, commit, app, strict, loader_policy,
                                                                    cast))
        elastic = opened.saved_world != self.world_size  # see fastio.checkpoint.elastic for the rule
        targets = {k: v for k, v in opened.prepared.items()  # loaders: checked, loaded last
                   if k not in opened.held and k not in opened.dropped}
        has_rng = not elastic and RNG_KEY in opened.saved.keys(self.rank)
        if has_rng:
            targets[RNG_KEY] = Frozen(capture_rng())
        replicated, per_rank, skipped = self._load_all(path, opened, targets, app, strict)
        skipped = [f"app key {k} (not in this app)" for k in opened.extra] + list(opened.dropped.values()) + skipped
        if skipped and self.rank == 0:
            log.warning("fastio: %s restored with strict=False; skipped: %s", path, "; ".join(skipped))
        if elastic:
            if self.rank == 0:
                log.warning("fastio: %s was written by %s, this run has %d: replicated %s restored on "
                            "every rank; per-rank %s from saved rank r %% %d, progress from rank 0; RNG not "
                            "restored (left as this run seeded it)", path, count(opened.saved_world, "rank"),
                            self.world_size,
                            ", ".join(replicated) or "nothing", ", ".join(per_rank) or "nothing", opened.saved_world)
        elif has_rng:
            restore_rng(targets[RNG_KEY].state)
        else:
            log.warning("fastio: %s holds no RNG state for rank %d; RNG not restored", path, self.rank)
        return _train_state(path, commit, loader_policy, skipped, opened.held)
