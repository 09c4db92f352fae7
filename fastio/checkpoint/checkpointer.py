"""The Checkpointer: staged async saves through an engine, atomic publish, retention, restore, preemption.

A save copies the state into the :class:`~fastio.checkpoint.staging.Stager`'s buffers on the calling
thread (the only part the training loop waits for), then one background thread hands that private
copy to the checkpoint engine (:mod:`fastio.checkpoint.engines`: torchsnapshot's ``Snapshot.take``, or
``torch.distributed.checkpoint.save`` for DTensor state), checksums and commits (rank 0), and prunes.
The engines' own async saves (torchsnapshot's ``async_take``, DCP's ``async_save``) are not used:
torchsnapshot's would run its collectives and slab packing on the training thread and, for CPU
tensors, still read live memory in the background; one staging rule serves both engines. The writer's
collectives go over a gloo group of their own, so they never interleave with the training thread's.
The Checkpointer talks to the engine only through :class:`~fastio.checkpoint.engines.base.Engine`.

One writer per directory: rank 0 holds :class:`fastio.storage.lock.DirLock` on DIR from construction to
``close`` (a second job is refused; the kernel drops the lock of a dead job); for an ``s3://`` DIR also the
prefix's lease, and with node-local staging the lowest rank of each node locks its node's staging directory
(:mod:`fastio.checkpoint.remote`). ``read_only=True`` (restore only, e.g. evaluation beside training) takes none
of them and changes nothing in DIR; ``save`` is refused. A restore (the Checkpointer's
:class:`~fastio.checkpoint.restore.Restorer`, given the :class:`Commit`, the training thread's rank group and
the engines) checks every file of the checkpoint it loads against the commit marker's checksums (the ranks
share the reading) and falls back past damaged or unrecognised steps; see :mod:`fastio.checkpoint.removal` for
what may be deleted. A save's progress (epoch, metrics, elapsed time, hparams, world size) is recorded once, in
the commit marker (:class:`~fastio.checkpoint.record.CommitRecord`).
With ``compression=`` the writer compresses the engine's files before the commit, the ranks sharing them,
and a restore decompresses into a private directory the engine reads (:mod:`fastio.checkpoint.compress`).
"""

from __future__ import annotations

import json
import logging
import numbers
import shutil
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastio.checkpoint import agree, compress, naming, removal, scan
from fastio.checkpoint.commit import Commit, LocalCommit, NodeLocalCommit
from fastio.checkpoint.config import CheckpointConfig
from fastio.checkpoint.engines import choose_engine, get_engine
from fastio.checkpoint.engines.base import Engine, first_line
from fastio.checkpoint.engines.strict import optimizer_classes
from fastio.checkpoint.group import RankGroup
from fastio.checkpoint.preemption import PreemptionFlag, requeue_slurm_job, warn_if_nothing_requeues
from fastio.checkpoint.record import CommitInfo, Progress
from fastio.checkpoint.restore import (
    LOADER_POLICIES,
    RESERVED_PREFIX,
    RNG_KEY,
    Restorer,
    TrainState,
    loader_epoch,
    loader_keys,
)
from fastio.checkpoint.rng import capture_rng
from fastio.checkpoint.staging import Stager
from fastio.checkpoint.writer import start_writer
from fastio.checks import integer
from fastio.dist import rank_and_world
from fastio.errors import CheckpointError, FastioError
from fastio.storage.lock import DirLock, LockedError

__all__ = ["LOADER_POLICIES", "RNG_KEY", "Checkpointer", "TrainState", "loader_epoch"]

log = logging.getLogger(__name__)

READ_ONLY_HINT = ("to restore only (e.g. evaluation beside training), use Checkpointer(dir, read_only=True), which "
                  "takes no lock")


def _rank_world() -> tuple[int, int]:
    """``fastio.dist.rank_and_world()``, refusing several ranks without a process group: saves and
    restores are collectives."""
    rank, world = rank_and_world()
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(f"WORLD_SIZE={world} (rank {rank}) but torch.distributed is not initialised: "
                              "call torch.distributed.init_process_group before creating the Checkpointer")
    return rank, world


def _check_restore_options(app: dict[str, Any], loader_policy: str, cast_dtypes: bool) -> None:
    """``restore_latest``'s options, checked where they enter (a TypeError or ValueError naming the value)."""
    if not isinstance(cast_dtypes, bool):
        raise TypeError(f"cast_dtypes must be True or False, got {cast_dtypes!r}")
    if loader_policy not in LOADER_POLICIES:
        raise ValueError(f"loader_policy must be one of {', '.join(LOADER_POLICIES)}, got {loader_policy!r}")
    if loader_policy != "exact" and not loader_keys(app):
        raise ValueError(f"loader_policy={loader_policy!r}, but no app object has check_state_dict (a fastio "
                         "Loader)")


def _whole_number(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (a NumPy integer too; not a bool, a float or a string); ValueError naming ``name``. A
    save's step taken otherwise would commit ``step--1``, ``step-1.5`` or ``step-True``, which no restore lists."""
    number = integer(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(number)


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a metric a save can record as a float: a real number (NumPy's too) or a one-element
    tensor, told by its type alone (no float() here: a CUDA tensor's would wait for the device at every call)."""
    return isinstance(value, numbers.Real) or isinstance(value, torch.Tensor) and value.numel() == 1 \
        and not value.is_complex()


def _check_progress(metrics: Any, epoch: Any) -> int | None:
    """A save's ``epoch`` as an int (None: the loader's) once ``metrics`` are checked; ValueError naming a metric
    that is not a number, or an epoch that is not an int >= 0: recorded as given, or cut to an int, it was a failed
    save naming no key, or another epoch without a word."""
    if metrics is not None and not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict of numbers, got {metrics!r}")
    for key, value in (metrics or {}).items():
        if not _is_number(value):
            raise ValueError(f"metrics[{key!r}] must be a number, got {value!r}")
    return None if epoch is None else _whole_number("epoch", epoch)


def _state_dicts(prepared: dict[str, Any]) -> dict[str, Any]:
    """Every app object's ``state_dict()``; one that raises is a CheckpointError naming its app key."""
    states = {}
    for key, obj in prepared.items():
        try:
            states[key] = obj.state_dict()
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - the app's own code: named, not a bare traceback line
            raise CheckpointError(f"app key {key}: state_dict() failed: {first_line(err)}") from err
    return states


def _engine_of(engines: dict[str, Engine], name: str) -> Engine:
    """The engine ``name`` from a Checkpointer's ``engines``, made at its first use (its library imported then)."""
    if name not in engines:
        engines[name] = get_engine(name)
    return engines[name]


def _replicated_keys(app: dict[str, Any]) -> list[str]:
    """Globs for DDP modules and for optimizers over nothing but DDP parameters: identical on every rank."""
    ddp = [k for k, obj in app.items() if isinstance(obj, DistributedDataParallel)]
    shared = {id(p) for k in ddp for p in app[k].parameters()}
    optims = [k for k, obj in app.items() if type(obj).__name__ != "ZeroRedundancyOptimizer"
              and isinstance(obj, torch.optim.Optimizer)
              and all(id(p) in shared for g in obj.param_groups for p in g["params"])]
    return [f"{k}/**" for k in ddp + (optims if shared else [])]


class Checkpointer:
    """Saves ``app`` (a dict of objects with ``state_dict``/``load_state_dict``) as ``DIR/step-N/``.

    ``Checkpointer("ckpt/", every_steps=500, keep=3)`` takes :class:`CheckpointConfig` fields as keywords,
    or a ready config. ``hparams`` (plain values) are stored with every save and handed back on restore.
    All ranks must call ``maybe_save``/``restore_latest``/``close`` at the same steps, with the same directory
    and engine: ranks that do not are refused on every rank (naming the difference, or after ``agree_timeout`` the
    ranks that did not arrive).
    """

    def __init__(self, dir: str | Path | CheckpointConfig, *, hparams: dict[str, Any] | None = None,
                 **options: Any):
        if isinstance(dir, CheckpointConfig):
            if options:
                raise ValueError("pass either a CheckpointConfig or keyword options, not both")
            self.config = dir
        else:
            self.config = CheckpointConfig(dir=dir, **options)
        self.dir: Path = self.config.dir
        self.hparams = dict(hparams or {})
        try:  # stored in the JSON commit marker
            json.dumps(self.hparams, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"hparams must hold plain JSON values (numbers, strings, lists, dicts): {err}") from None
        self.rank, self.world_size = _rank_world()
        self.read_only = self.config.read_only
        if self.read_only and self.config.url is not None and self.config.staging_dir is None:
            self.dir = removal.start_private_staging()  # the default may be a writer's; a killed one's go
        # Every collective of the Checkpointer goes through one of its two rank groups (fastio.checkpoint.group),
        # each on a gloo group of its own: the training thread's (construction, scheduling, restores) and the
        # writer thread's (a save's write and commit, and the engine's own collectives), so that the two
        # threads' collectives never interleave, nor meet the training's own on the default group.
        self._ranks = RankGroup("checkpointer", self.rank, self.world_size, agree_timeout=self.config.agree_timeout)
        self._writer_ranks = RankGroup("checkpoint writer", self.rank, self.world_size)
        # Before anything is created or locked: every rank names the same directory and codec (or refuses, naming
        # both: ranks compressing and ranks not wait in different collectives of every save).
        where = self.config.url or str(Path(self.dir).expanduser().resolve())
        self._compression = compress.parse_compression(self.config.compression)
        self._ranks.enter("Checkpointer()", {"checkpoint directory": where, "compression": getattr(
            self._compression, "codec", "none")})
        # An s3:// dir: steps are committed in the local staging dir, then uploaded (see fastio.checkpoint.remote).
        self._remote = None
        if self.config.url is not None:
            from fastio.checkpoint.remote import RemoteCheckpoints

            self._remote = RemoteCheckpoints(self.config.url, self.dir, self.config.storage_options)
        self._engines: dict[str, Engine] = {}
        self._lock = DirLock(self.dir, purpose="fastio checkpointer")
        self._ranks.run("open", self._take_dir)  # every rank fails together; rank 0 busy, not waited for as stopped
        self._start_commit()
        self._start_state()
        self.preempted = False
        """True once a preemption signal has been turned into a committed blocking save."""
        self.last_blocked_s = 0.0
        """Seconds the last save held the caller (staging plus handing the write to the background)."""
        self.last_write_s = 0.0
        """Seconds the last completed background write took, from start to commit."""
        self._flag = PreemptionFlag(self.config.signals)
        if self.config.requeue and self.rank == 0:
            warn_if_nothing_requeues(self.config.signals)

    def _start_commit(self) -> None:
        """The ranks that see this rank's directory (all, except for an ``s3://`` dir staged node-locally: a
        collective finds them), which share hashing, compressing and checking its files, the lowest of them
        creating and cleaning its step dirs; the :class:`Commit` over them, and the :class:`Restorer` given them."""
        self._dir_ranks: tuple[int, ...] = tuple(range(self.world_size))
        if self._remote is not None and self.world_size > 1:
            self._group_staging()
        self._commit: Commit = (NodeLocalCommit(self.dir, self._remote, self._dir_ranks)
                                if len(self._dir_ranks) < self.world_size
                                else LocalCommit(self.dir, self._remote, self.world_size))
        self._leader = self._dir_ranks[0] == self.rank
        # Given the engine cache, not a bound method: no cycle keeps an unclosed Checkpointer (its lock) alive.
        self._restorer = Restorer(commit=self._commit, ranks=self._ranks, engine=partial(_engine_of, self._engines),
                                  rank=self.rank, world_size=self.world_size, leader=self._leader, share=self._share,
                                  read_only=self.read_only, where=str(self.config.url or self.dir))

    def _take_dir(self) -> None:
        """Rank 0 at construction: refuse a dataset directory, create DIR and take its lock (and an ``s3://`` dir's
        lease), unless read-only; the problem is one CheckpointError line. Nothing on the other ranks."""
        if self.rank != 0:
            return
        problem: str | None = None
        try:
            scan.refuse_dataset_dir(self.dir)
            if self._remote is not None:
                scan.refuse_dataset_dir(self._remote.mirror.storage)
            scan.refuse_file_or_step(self.dir)
            if not self.read_only:  # a restore-only Checkpointer takes no lock and no lease
                self.dir.mkdir(parents=True, exist_ok=True)
                self._lock.acquire()
                if self._remote is not None:
                    self._remote.bind_staging(write=True)
                    self._remote.hold()
            elif self._remote is not None and self.config.staging_dir is not None:
                self._remote.bind_staging(write=False)
        except OSError as err:
            problem = f"{self.dir}: cannot create checkpoint directory: {err.strerror or err}"
        except LockedError as err:  # the lease's names the URL; an s3:// dir's staging dir lock names the URL first
            named = not self.config.url or str(err).startswith(self.config.url)
            problem = f"{'' if named else self.config.url + ': its staging directory '}{err}; {READ_ONLY_HINT}"
        except FastioError as err:
            problem = str(err)
        if problem:
            self._lock.release()
            raise CheckpointError(problem)

    def _start_state(self) -> None:
        """The scheduling state of a new Checkpointer: nothing in flight, no step saved, the clock started."""
        self._stager = Stager()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._inflight_step: int | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._started = time.monotonic()
        self._elapsed_before = 0.0

    # ----------------------------------------------------------------- public API
    @property
    def preemption_requested(self) -> bool:
        """A preemption signal arrived and has not been acted on yet."""
        return self._flag.requested

    @property
    def exit_code(self) -> int:
        """What the process should exit with: ``preempted_exit_code`` once a preemption save was made
        (``preempted``), else 0. ``sys.exit(ckpt.exit_code)`` at the end of the training script."""
        return self.config.preempted_exit_code if self.preempted else 0

    def request_preemption(self) -> None:
        """Act as if a preemption warning (SIGUSR1) had arrived: the next ``maybe_save`` saves and sets ``preempted``
        (and requeues the Slurm job with ``requeue=True``)."""
        self._flag.request()

    def maybe_save(self, step: int, app: dict[str, Any], *, metrics: dict[str, float] | None = None,
                   epoch: int | None = None, force: bool = False) -> bool:
        """Save after ``step`` (an int >= 0, a NumPy integer too; anything else is a ValueError) when one is due (or
        forced, or a preemption signal came); True if a save started.

        Returns once the state is staged; the write goes on in the background. An error of an
        earlier background write is raised here as a :class:`CheckpointError`. Without ``epoch``, the
        epoch of the app's loader is recorded (whatever its app key, see :func:`loader_epoch`). ``metrics`` are numbers
        by name (a one-element tensor too), ``epoch`` an int >= 0: anything else is a ValueError naming it.
        """
        self._refuse_if_read_only()
        step = _whole_number("step", step)
        epoch = _check_progress(metrics, epoch)
        self._raise_if_failed(wait=False)
        every = self.config.every_steps
        due = force or (every > 0 and step % every == 0)
        if self.config.every_seconds > 0 and time.monotonic() - self._last_time >= self.config.every_seconds:
            due = due or self.rank == 0
        busy = self._thread is not None and self._thread.is_alive()
        preempt, due, busy, requeue = self._ranks.enter(
            "maybe_save", flags=(self._flag.requested, due, busy, self._flag.requeue_wanted),
            label=f"maybe_save at step {step}")
        if step == self._last_step and not preempt:
            return False
        if preempt:
            self._save(step, app, metrics, epoch, blocking=True)
            self._flag.clear()  # acted on; a later signal asks again
            self.preempted = True
            if requeue and self.config.requeue and self.rank == 0:  # a warning came, not only SIGTERM (scancel)
                requeue_slurm_job()
            return True
        if not due:
            return False
        if busy and self.config.policy == "skip":
            log.info("fastio: checkpoint at step %d skipped: step %s is still being written", step,
                     self._inflight_step)
            return False
        self._save(step, app, metrics, epoch, blocking=not self.config.async_save)
        return True

    def save(self, step: int, app: dict[str, Any], *, metrics: dict[str, float] | None = None,
             epoch: int | None = None, blocking: bool = False) -> None:
        """Save after ``step`` (an int >= 0, as for :meth:`maybe_save`) now (waiting for an earlier write first);
        ``blocking`` also waits for the commit. The step this Checkpointer saved last (or restored) is not saved again:
        the state of one step is saved once (a final ``save`` after a periodic one at the same step writes nothing)."""
        self._refuse_if_read_only()
        step = _whole_number("step", step)
        epoch = _check_progress(metrics, epoch)
        self._raise_if_failed(wait=False)
        self._save(step, app, metrics, epoch, blocking=blocking)

    def wait(self) -> None:
        """Wait for the write in flight to be committed; raise its error as a CheckpointError. The steps its
        retention (``keep``) expired are renamed away by then (no checkpoints any more); their files are deleted in
        the background, before the next save's engine writes and by ``close`` at the latest."""
        self._raise_if_failed(wait=True)

    def close(self) -> None:
        """Wait for the last write and for retention's deletions (for an ``s3://`` dir, rank 0: the upload of steps a
        store outage or a refused upload left only in the staging dir, each request within ``deadline_s``, else a
        CheckpointError naming them), remove the signal handlers, free staging memory and release DIR's lock. Closing
        again does nothing; a save or restore after it is a CheckpointError (``steps()`` still lists the committed
        steps)."""
        try:
            self._raise_if_failed(wait=True)
            self._finish_pruning()
            if self._remote is not None and self.rank == 0 and not self.read_only:
                self._remote.upload_unsent(self.config.keep)  # steps an outage (or refusal) left only in staging
        finally:
            self._closed = True
            self._ranks.close()
            self._flag.uninstall()
            self._stager.release()
            if self._remote is not None:
                self._remote.release()
            self._lock.release()
            if self.read_only and self.config.url is not None and self.config.staging_dir is None:
                shutil.rmtree(self.dir, ignore_errors=True)  # this Checkpointer's private download directory

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Committed steps in DIR (for an ``s3://`` dir: on the store, less the steps a rollback staged in the staging
        dir during an outage supersedes at its upload), oldest first."""
        return self._commit.steps()

    def restore_latest(self, app: dict[str, Any], step: int | None = None, *, strict: bool = True,
                       loader_policy: str = "exact", cast_dtypes: bool = False) -> TrainState | None:
        """Load the newest intact checkpoint (or ``step``) into ``app``; None when DIR holds none at all.

        Every file of the chosen checkpoint is first checked against its commit marker (size and
        checksum). A damaged or unrecognised newer step is skipped with one warning naming it and the
        reason, and moved aside (``step-N.quarantined``) so that a later save of that step cannot replace
        it; the newest intact one is restored. CheckpointError when step directories exist but none is
        intact, or when ``step`` is asked for and is missing or damaged. fastio's own abandoned
        temporaries (``step-N.tmp``) are deleted; with ``read_only=True`` nothing is deleted or moved aside, and a
        directory that does not exist (an ``s3://`` prefix holding no ``step-N/`` and no writer's lease) is a
        CheckpointError (a restore-only process has no fresh start).
        RNG states are restored last. A checkpoint written by another number of ranks is restored elastically
        (see :mod:`fastio.checkpoint.elastic`). The progress returned (epoch, metrics, elapsed, hparams) is the
        commit marker's, rank 0's at the save, on every rank. The restore itself is the Checkpointer's
        :class:`~fastio.checkpoint.restore.Restorer`.

        Strict by default: state in the checkpoint that ``app`` has no place for (an app key, a module's
        parameter or buffer, an optimizer's entry), state of ``app`` the checkpoint lacks, and a tensor of
        another shape or dtype are a CheckpointError naming the keys. ``strict=False`` restores what matches, leaves
        the rest as it is, and lists what it skipped (one warning, and ``TrainState.skipped``). ``cast_dtypes=True``
        casts a tensor saved in another dtype (fp32 into a bf16 model, or the reverse) as torch's copy does: the
        opt-in for a dtype changed on purpose.

        All or nothing: the loader's state (every app object with ``check_state_dict``, as the fastio Loader) is
        read and checked before anything is loaded, and loaded last; the app's own objects (neither torch modules
        and optimizers nor loaders) load first, so that one refusing its state leaves the rest as it was.
        ``loader_policy="next-epoch"`` replaces the loader's state by the start of the epoch after the saved one,
        or of the saved one itself where nothing of it was delivered (saved at an epoch boundary, ``consumed`` 0:
        :func:`fastio.checks.next_epoch_start`; everything else is restored as saved; an object with
        ``next_epoch_state``, as the fastio Loader, makes that state itself): for a loader that cannot continue the
        saved position, such as a mixture whose weights changed or a dataset converted again with more samples;
        ``TrainState.epoch`` is then the epoch the loader starts.
        """
        self._refuse_if_closed()
        self._check_app(app)
        step = None if step is None else _whole_number("step", step)
        _check_restore_options(app, loader_policy, cast_dtypes)
        self._ranks.enter("restore_latest")  # before any collective: a rank saving instead is refused by name
        if self.read_only:
            self._refuse_a_typo()
        self._raise_if_failed(wait=True)
        self._finish_pruning()  # the restore's clean-up deletes hidden leftovers too
        state = self._restorer.restore_latest(app, step, strict, loader_policy, cast_dtypes)
        if state is not None:  # the next save continues the restored run's clock
            self._last_step = state.step
            self._last_time = self._started = time.monotonic()
            self._elapsed_before = state.elapsed
        return state

    def _refuse_a_typo(self) -> None:
        """A read-only restore of a directory that does not exist, or of an ``s3://`` prefix that holds no checkpoint's
        objects (:func:`~fastio.checkpoint.scan.refuse_empty_prefix`), is a CheckpointError: a typo, not a fresh
        start (a restore-only process has none)."""
        why = " (read_only=True: nothing to restore)"
        if self._remote is not None:
            storage = self._remote.mirror.storage
            scan.refuse_empty_prefix(storage, scan.remote_steps(storage), why)
        elif not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory does not exist{why}")

    def _refuse_if_closed(self) -> None:
        """After ``close`` the lock is released (another job may hold it) and the handlers gone: no save or restore."""
        if self._closed:
            raise CheckpointError(f"{self.config.url or self.dir}: this Checkpointer is closed (close() released the "
                                  "directory's lock): make a new one")

    def _refuse_if_read_only(self) -> None:
        self._refuse_if_closed()
        if self.read_only:
            raise CheckpointError(f"{self.config.url or self.dir}: this Checkpointer is read-only (read_only=True): "
                                  "it restores, it does not save")

    # ----------------------------------------------------------------- internals
    def _group_staging(self) -> None:
        """Collective at construction: find the ranks sharing this rank's staging dir; the lowest rank of each
        node-local dir (other than rank 0's) takes its DirLock and checks (or records) the prefix it stages. Every
        rank fails together, naming the problem."""
        from fastio.checkpoint.remote import staging_groups, staging_views

        groups = staging_groups(staging_views(self.dir, self._ranks))  # the same on every rank
        problem = groups if isinstance(groups, str) and self.rank == 0 else None
        if not isinstance(groups, str):
            self._dir_ranks = next(g for g in groups if self.rank in g)
            if len(groups) > 1 and self._dir_ranks[0] == self.rank and self.rank != 0 and not self.read_only:
                try:
                    self._lock.acquire()
                    self._remote.bind_staging(write=True)  # as rank 0 did its own (_take_dir)
                except (LockedError, OSError, CheckpointError) as err:
                    problem = str(err)
            if len(groups) > 1 and self.rank == 0:
                log.info("fastio: %s: %d node-local staging directories; each node uploads its own files",
                         self.config.url, len(groups))
        try:
            self._ranks.check("staging", problem, blame=False)  # each problem names its directory and rank
        except CheckpointError:
            if self.rank == 0:
                self._remote.release()
            self._lock.release()
            raise

    def _engine(self, name: str) -> Engine:
        return _engine_of(self._engines, name)

    @property
    def _share(self) -> tuple[int, int]:
        """This rank's place among the ranks that see its directory, and their number (they share its files)."""
        return self._dir_ranks.index(self.rank), len(self._dir_ranks)

    def _progress(self, states: dict[str, Any], metrics: dict[str, float] | None, epoch: int | None) -> Progress:
        """This save's progress (rank 0's goes into the commit marker): the epoch given, else the app's loader's."""
        found = loader_epoch(states) if epoch is None else epoch
        return Progress(epoch=-1 if found is None else int(found),
                        metrics={str(k): float(v) for k, v in (metrics or {}).items()},
                        elapsed=float(self._elapsed_before + time.monotonic() - self._started), hparams=self.hparams,
                        world_size=self.world_size)

    def _check_app(self, app: dict[str, Any]) -> None:
        if not isinstance(app, dict) or not app:
            raise ValueError("app must be a non-empty dict of objects with state_dict/load_state_dict")
        for key, obj in app.items():
            if not isinstance(key, str) or not key or "/" in key or key.startswith(RESERVED_PREFIX):
                raise ValueError(f"app key {key!r}: keys must be non-empty strings without '/' "
                                 f"not starting with {RESERVED_PREFIX!r}")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"app[{key!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")

    def _raise_if_failed(self, *, wait: bool) -> None:
        thread = self._thread
        if thread is not None and (wait or not thread.is_alive()):
            thread.join()
            self._thread = None
        if self._error is not None:
            err, step = self._error, self._error_step
            self._error = self._error_step = None
            why = str(err) if isinstance(err, CheckpointError) else first_line(err)
            raise CheckpointError(f"{self._step_named(step)}: checkpoint write failed: "
                                  f"{why} (the previous checkpoint is intact)") from err

    def _step_named(self, step: int) -> str:
        """Step ``step`` as a message names it: ``URL/step-N`` for an ``s3://`` dir (the same on every rank; its
        staging dir, one a node, is where it is written), else its folder."""
        if self.config.url is not None:
            return f"{self.config.url}/{naming.step_name(step)}"
        return str(naming.step_dir(self.dir, step))

    def _direct_writes(self) -> bool:
        """Whether the engine writes past the page cache (``direct_writes``): not when the files are read back before
        they are done with (compressed, or uploaded to an ``s3://`` dir)."""
        return self.config.direct_writes and self._compression is None and self._remote is None

    def _finish_pruning(self) -> None:
        """Wait for the deletion of the steps the last save's retention expired (see :meth:`Commit.prune`)."""
        pruner = self._pruner
        if pruner is not None:
            pruner.join()

    def _save(self, step: int, app: dict[str, Any], metrics: dict[str, float] | None, epoch: int | None,
              *, blocking: bool) -> None:
        engine_name = self._enter_save(step, app)
        if step == self._inflight_step or step == self._last_step:
            self._raise_if_failed(wait=True)
            if blocking:
                self._ranks.barrier("save")
            return
        self._raise_if_failed(wait=True)  # one save in flight: staging buffers are free again after this
        t0 = time.perf_counter()
        engine, staged, global_keys, progress = self._stage(step, app, engine_name, metrics, epoch)
        replicated = list(self.config.replicated)
        if self.world_size > 1 and not global_keys:
            replicated += _replicated_keys(app)
        info = CommitInfo(engine=engine.name, progress=progress,
                          compression=self._compression.codec if self._compression is not None else None,
                          optimizers=optimizer_classes(app))
        self._inflight_step = step
        self._last_step = step
        self._last_time = time.monotonic()
        tmp = self._commit.tmp_dir(step)
        self._thread = start_writer(self._write, (engine, staged, replicated, global_keys, step, tmp, info),
                                    name=f"fastio-ckpt-{step}", nice=self.config.writer_nice)
        self.last_blocked_s = time.perf_counter() - t0
        if blocking:
            self._raise_if_failed(wait=True)
            self._ranks.barrier("save")

    def _stage(self, step: int, app: dict[str, Any], engine_name: str, metrics: dict[str, float] | None,
               epoch: int | None) -> tuple[Engine, dict[str, Any], frozenset[str], Progress]:
        """Collective: every rank's private copy of ``app`` for the save of ``step`` (the step's temporary
        directory made first), with the same shapes of global state everywhere; every rank fails together (or
        the others would wait forever in the write's collectives), the temporary deleted."""
        made: list[Path] = []
        shapes: list[tuple[str, str, str]] = []

        def stage() -> tuple[Engine, dict[str, Any], frozenset[str], Progress]:
            """This rank's part: the engine (its library imported at the first save: within the phase, so that a
            rank slow there is seen busy), the step's temporary directory (the directory's lowest rank), a private
            copy."""
            engine = self._engine(engine_name)
            prepared, global_keys = engine.prepare(app)
            if self._leader:
                made.append(self._commit.start(step))
            rng = capture_rng()
            states = _state_dicts(prepared)
            progress = self._progress(states, metrics, epoch)
            states[RNG_KEY] = rng
            shapes.extend(agree.global_shapes(states, global_keys))
            placements = engine.placements() if self._direct_writes() else None
            staged = self._stager.stage(states, engine.refusal, placements, engine.placeable)
            return engine, staged, global_keys, progress

        try:
            engine, staged, global_keys, progress = self._ranks.run("stage", stage)
            if self.world_size > 1 and global_keys:  # written once from all ranks: the same shapes everywhere
                self._agree_shapes(step, app, shapes)
        except CheckpointError:
            if made:
                self._commit.discard(step)
            raise
        return engine, staged, global_keys, progress

    def _agree_shapes(self, step: int, app: dict[str, Any], shapes: list[tuple[str, str, str]]) -> None:
        """Collective: every rank stages global state of the same shapes, or every rank raises, naming the first
        rank that differs and how."""
        signatures = self._ranks.gather("stage", agree.save_signature(step, list(app), shapes))
        if agree.first_difference(signatures):  # every rank sees it: all gather the shapes to name it
            why = agree.first_difference(signatures, self._ranks.gather("stage", shapes))
            raise CheckpointError(f"checkpoint save at step {step}: {why}")

    def _enter_save(self, step: int, app: dict[str, Any]) -> str:
        """Before a save's first collective: the app checked, every rank in the same operation with the same engine
        (and, with several ranks, the same step and app keys); returns the engine's name."""
        self._check_app(app)
        engine_name = choose_engine(self.config.engine, app)
        # before any collective: the operation and the engine
        self._ranks.enter("save", {"engine": engine_name}, label=f"save at step {step}")
        if self.world_size > 1:  # before any rank can return early or write: the step, the app's keys, its loaders
            # as a phase: a loader's state_dict() failing on one rank fails every rank's save (none left waiting)
            loaders = self._ranks.run("save", lambda: agree.global_loaders(
                _state_dicts({k: app[k] for k in loader_keys(app)})))
            signatures = self._ranks.gather("save", agree.save_signature(step, list(app), [], loaders))
            if agree.first_difference(signatures):  # every rank sees it: all gather the loaders to name it
                why = agree.first_difference(signatures, loaders=self._ranks.gather("save", loaders))
                raise CheckpointError(f"checkpoint save: {why}")  # (not "at step N": that may be what differs)
        return engine_name

    def _write(self, engine: Engine, staged: dict[str, Any], replicated: list[str], global_keys: frozenset[str],
               step: int, tmp: Path, info: CommitInfo) -> None:
        """Background thread (the seam where a staged save runs): the engine writes the staged copy, the ranks
        compress (if asked), then the step is committed and retention renames the expired steps away; each phase is
        agreed over the writer's rank group, so any rank's failure fails every rank's save. The save is done when
        this thread ends; the expired steps' files are deleted on a thread of their own after it."""
        started = time.perf_counter()
        ranks = self._writer_ranks
        try:
            def write() -> None:
                self._finish_pruning()  # the last save's expired steps leave the disk before this one fills it
                if self._leader:  # the temporary staging made, durable before the engine writes into it
                    self._commit.ready(step)
                self._stager.wait_copies()
                return engine.save(tmp, staged, pg=ranks.pg, replicated=replicated, global_keys=global_keys,
                                   writeback=self._compression is None,  # compressed: replaced before the commit
                                   direct=self._direct_writes())

            written = ranks.run("write", write)
            if self._compression is not None:
                written = None  # the files are replaced: the commit hashes what is there
                files = self._commit.data_files(step)[self._share[0]::self._share[1]]
                ranks.barrier("compress")  # every rank has listed the files before any replaces one
                ranks.run("compress", lambda: [compress.compress_file(p, self._compression) for p in files])
            self._commit.publish(ranks, self.rank, step, info, self.config.keep, written=written)
            self.last_write_s = time.perf_counter() - started
        except BaseException as err:  # noqa: BLE001 - raised at the caller's next maybe_save/wait/close
            if self._leader:
                try:
                    self._commit.discard(step)
                except OSError:
                    pass
            # Published only after the clean-up: a caller that sees it may exit at once (this is a daemon thread).
            self._error, self._error_step = err, step
        finally:
            self._inflight_step = None
            if self._commit.expired:  # deleted after the save counts as done: nobody waits for it but close()
                self._pruner = start_writer(self._commit.prune, (), name=f"fastio-ckpt-prune-{step}",
                                            nice=self.config.writer_nice)
