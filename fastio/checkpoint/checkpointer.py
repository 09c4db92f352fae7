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

One writer per directory: rank 0 holds :class:`fastio.lock.DirLock` on DIR from construction to
``close`` (a second job is refused; the kernel drops the lock of a dead job); for an ``s3://`` DIR also the
prefix's lease, and with node-local staging the lowest rank of each node locks its node's staging directory
(:mod:`fastio.checkpoint.remote`). A restore checks every file
of the checkpoint it loads against the commit marker's checksums (the ranks share the reading) and falls
back past damaged or unrecognised steps; see :mod:`fastio.checkpoint.layout` for what may be deleted.
With ``compression=`` the writer compresses the engine's files before the commit, the ranks sharing them,
and a restore decompresses into a private directory the engine reads (:mod:`fastio.checkpoint.compress`).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastio.checkpoint import compress, layout
from fastio.checkpoint.config import CheckpointConfig
from fastio.checkpoint.elastic import restore_elastic
from fastio.checkpoint.engines import DEFAULT_ENGINE, ENGINES, choose_engine, get_engine, holds_dtensor
from fastio.checkpoint.engines.base import Engine, first_line
from fastio.checkpoint.preemption import PreemptionFlag, requeue_slurm_job
from fastio.checkpoint.rng import capture_rng, restore_rng
from fastio.checkpoint.staging import Frozen, Stager
from fastio.checkpoint.writer import start_writer
from fastio.dist import rank_and_world
from fastio.errors import CheckpointError, FastioError, StorageError
from fastio.lock import DirLock, LockedError

__all__ = ["PROGRESS_KEY", "PROGRESS_VERSION", "RNG_KEY", "Checkpointer", "TrainState", "loader_epoch"]

log = logging.getLogger(__name__)

RNG_KEY = "_fastio_rng"
PROGRESS_KEY = "_fastio_progress"
PROGRESS_VERSION = 1
_RESERVED_PREFIX = "_fastio"


@dataclass
class TrainState:
    """What ``restore_latest`` found: the step the checkpoint was taken after, and the run's progress."""

    step: int
    """The last completed step; continue with ``step + 1``."""
    epoch: int | None
    """The epoch given to (or found by) ``maybe_save``, None when unknown."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics passed with that save."""
    elapsed: float = 0.0
    """Seconds of training (summed over restarts) up to that save."""
    time: float = 0.0
    """Unix time of the commit."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """The ``hparams`` the saving run was created with."""
    path: Path | None = None
    """The checkpoint directory restored from."""


def _rank_world() -> tuple[int, int]:
    """``fastio.dist.rank_and_world()``, refusing several ranks without a process group: saves and
    restores are collectives."""
    rank, world = rank_and_world()
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(f"WORLD_SIZE={world} (rank {rank}) but torch.distributed is not initialised: "
                              "call torch.distributed.init_process_group before creating the Checkpointer")
    return rank, world


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
    All ranks must call ``maybe_save``/``restore_latest``/``close`` at the same steps.
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
        try:  # stored in the JSON commit marker and in torchsnapshot's manifest
            json.dumps(self.hparams, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"hparams must hold plain JSON values (numbers, strings, lists, dicts): {err}") from None
        self.rank, self.world_size = _rank_world()
        # An s3:// dir: steps are committed in the local staging dir, then uploaded (see fastio.checkpoint.remote).
        self._remote = None
        if self.config.url is not None:
            from fastio.checkpoint.remote import RemoteCheckpoints

            self._remote = RemoteCheckpoints(self.config.url, self.dir, self.config.storage_options)
        self._engines: dict[str, Engine] = {}
        self._compression = compress.parse_compression(self.config.compression)
        self._lock = DirLock(self.dir, purpose="fastio checkpointer")
        problem: list[str | None] = [None]
        if self.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._lock.acquire()
                if self._remote is not None:
                    self._remote.hold()
            except OSError as err:
                problem[0] = f"{self.dir}: cannot create checkpoint directory: {err.strerror or err}"
            except (LockedError, FastioError) as err:
                problem[0] = str(err)
            if problem[0]:
                self._lock.release()
        if self.world_size > 1:  # every rank fails together
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise CheckpointError(problem[0])
        # The ranks that see this rank's directory (all, except for an s3:// dir staged node-locally): they
        # share hashing, compressing and checking its files; the lowest of them creates and cleans its step dirs.
        self._group: tuple[int, ...] = tuple(range(self.world_size))
        if self._remote is not None and self.world_size > 1:
            self._group_staging()
        self._share = (self._group.index(self.rank), len(self._group))
        self._leader = self._share[0] == 0
        self._stager = Stager()
        # Checkpoint collectives run on the writer thread, so they get a gloo group of their own and
        # never interleave with the training thread's collectives on the default group.
        self._pg = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self._thread: threading.Thread | None = None
        self._inflight_step: int | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._started = time.monotonic()
        self._elapsed_before = 0.0
        self.preempted = False
        """True once a preemption signal has been turned into a committed blocking save."""
        self.last_blocked_s = 0.0
        """Seconds the last save held the caller (staging plus handing the write to the background)."""
        self.last_write_s = 0.0
        """Seconds the last completed background write took, from start to commit."""
        self._flag = PreemptionFlag(self.config.signals)

    # ----------------------------------------------------------------- public API
    @property
    def preemption_requested(self) -> bool:
        """A preemption signal arrived and has not been acted on yet."""
        return self._flag.requested

    def request_preemption(self) -> None:
        """Act as if a preemption signal had arrived (the next ``maybe_save`` saves and sets ``preempted``)."""
        self._flag.request()

    def maybe_save(self, step: int, app: dict[str, Any], *, metrics: dict[str, float] | None = None,
                   epoch: int | None = None, force: bool = False) -> bool:
        """Save after ``step`` when one is due (or forced, or a preemption signal came); True if a save started.

        Returns once the state is staged; the write goes on in the background. An error of an
        earlier background write is raised here as a :class:`CheckpointError`. Without ``epoch``, the
        epoch of the app's loader is recorded (whatever its app key, see :func:`loader_epoch`).
        """
        self._raise_if_failed(wait=False)
        every = self.config.every_steps
        due = force or (every > 0 and step % every == 0)
        if self.config.every_seconds > 0 and time.monotonic() - self._last_time >= self.config.every_seconds:
            due = due or self.rank == 0
        busy = self._thread is not None and self._thread.is_alive()
        preempt, due, busy = self._agree(self._flag.requested, due, busy)
        if step == self._last_step and not preempt:
            return False
        if preempt:
            self._save(step, app, metrics, epoch, blocking=True)
            self._flag.clear()  # acted on; a later signal asks again
            self.preempted = True
            if self.config.requeue and self.rank == 0:
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
        """Save after ``step`` now (waiting for an earlier write first); ``blocking`` also waits for the commit."""
        self._raise_if_failed(wait=False)
        self._save(step, app, metrics, epoch, blocking=blocking)

    def wait(self) -> None:
        """Wait for the write in flight to be committed; raise its error as a CheckpointError."""
        self._raise_if_failed(wait=True)

    def close(self) -> None:
        """Wait for the last write, remove the signal handlers, free staging memory and release DIR's lock."""
        try:
            self._raise_if_failed(wait=True)
        finally:
            self._flag.uninstall()
            self._stager.release()
            if self._remote is not None:
                self._remote.release()
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Committed steps in DIR (for an ``s3://`` dir: on the store), oldest first."""
        if self._remote is not None:
            return self._remote.committed_steps()
        return [e.step for e in layout.committed(self.dir)]

    def restore_latest(self, app: dict[str, Any], step: int | None = None) -> TrainState | None:
        """Load the newest intact checkpoint (or ``step``) into ``app``; None when DIR holds none at all.

        Every file of the chosen checkpoint is first checked against its commit marker (size and
        checksum). A damaged or unrecognised newer step is skipped with one warning naming it and the
        reason, and moved aside (``step-N.quarantined``) so that a later save of that step cannot replace
        it; the newest intact one is restored. CheckpointError when step directories exist but none is
        intact, or when ``step`` is asked for and is missing or damaged. fastio's own abandoned
        temporaries (``step-N.tmp``) are deleted. RNG states are restored last. A checkpoint written by
        another number of ranks is restored elastically (see :mod:`fastio.checkpoint.elastic`).
        """
        self._check_app(app)
        self._raise_if_failed(wait=True)
        if self._node_local:
            return self._restore_node_local(app, step)
        plan: list[Any] = [None, None, None]  # candidate steps newest first, error, unrecognised step dirs
        if self.rank == 0:
            try:
                _, left = layout.remove_abandoned(self.dir)
                for entry in left:
                    if entry.temporary:
                        log.warning("fastio: leaving %s alone: %s", entry.path, entry.problem)
                if self._remote is not None:  # the newest remote step not here yet (verified below like any)
                    self._remote.pull(step)
                entries = layout.scan(self.dir)
                done = [e.step for e in entries if e.committed]
                plan[2] = [(e.step, str(e.path), e.problem) for e in entries if not e.committed and not e.temporary]
                if step is not None:
                    if step not in done:
                        have = ", ".join(str(s) for s in done) or "none"
                        plan[1] = f"{self.dir}: no committed checkpoint for step {step} (committed: {have})"
                    plan[0] = [step]
                else:
                    plan[0] = done[::-1]
            except OSError as err:
                plan[1] = f"{self.dir}: cannot read checkpoint directory: {err}"
            except CheckpointError as err:
                plan[1] = str(err)
        if self.world_size > 1:
            dist.broadcast_object_list(plan, src=0)
        candidates, error, unrecognised = plan
        if error:
            raise CheckpointError(error)
        skipped: list[tuple[int, str, str]] = []
        chosen = None
        for cand in candidates:
            path = layout.step_dir(self.dir, cand)
            problems = self._check_step(path)
            if not problems:
                chosen = cand
                break
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            skipped.append((cand, str(path), problems[0] + more))
            if step is not None:
                raise CheckpointError(f"{path}: damaged checkpoint: {problems[0]}{more}")
        newer = sorted((s for s in skipped + list(unrecognised) if chosen is None or s[0] > chosen), reverse=True)
        if chosen is None:
            if newer:  # nothing to fall back to: leave everything where it is and say so
                raise CheckpointError(f"{self.dir}: no intact checkpoint: {len(newer)} step director(ies) damaged or "
                                      f"unrecognised, newest {newer[0][1]}: {newer[0][2]}")
            return None
        if self.rank == 0:
            for _, where, reason in newer:
                try:
                    moved = f"; moved aside to {layout.quarantine(Path(where)).name}"
                except OSError as err:
                    moved = f"; left in place ({err.strerror or err})"
                reason = reason[len(where) + 2:] if reason.startswith(f"{where}: ") else reason
                log.warning("fastio: skipping checkpoint %s: %s%s", where, reason, moved)
        path = layout.step_dir(self.dir, chosen)
        commit = layout.read_commit(path)
        return self._restore(path, commit, app)

    # ----------------------------------------------------------------- internals
    @property
    def _node_local(self) -> bool:
        """An s3:// dir whose staging directories are not all one (see fastio.checkpoint.remote)."""
        return len(self._group) < self.world_size

    def _group_staging(self) -> None:
        """Collective at construction: find the ranks sharing this rank's staging dir; the lowest rank of each
        node-local dir (other than rank 0's) takes its DirLock. Every rank fails together, naming the problem."""
        from fastio.checkpoint.remote import staging_groups, staging_views

        groups = staging_groups(staging_views(self.dir, self.rank, self.world_size))
        problem = groups if isinstance(groups, str) else None
        if problem is None:
            self._group = next(g for g in groups if self.rank in g)
            if len(groups) > 1 and self._group[0] == self.rank and self.rank != 0:
                try:
                    self._lock.acquire()
                except (LockedError, OSError) as err:
                    problem = str(err)
            if len(groups) > 1 and self.rank == 0:
                log.info("fastio: %s: %d node-local staging directories; each node uploads its own files",
                         self.config.url, len(groups))
        problems = [problem]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, problems)
        first = next((p[0] for p in every if p[0]), None)
        if first:
            if self.rank == 0:
                self._remote.release()
            self._lock.release()
            raise CheckpointError(first)

    def _agree_problem(self, mine: str | None) -> str | None:
        """Collective on the default group: the first rank's problem, so that every rank fails together."""
        if self.world_size == 1:
            return mine
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return next((p for p in every if p), None)

    def _engine(self, name: str) -> Engine:
        if name not in self._engines:
            self._engines[name] = get_engine(name)
        return self._engines[name]

    def _check_step(self, path: Path) -> list[str]:
        """Collective: problems with the committed checkpoint in ``path`` (its marker, then every listed file
        against its recorded size and checksum, the ranks sharing the files); empty when intact."""
        try:
            entry = layout.StepEntry(int(path.name.split("-")[1]), path, layout.read_commit(path))
            name = entry.commit.get("engine", DEFAULT_ENGINE)  # markers from before engines were recorded
            if name not in ENGINES:
                return [f"{path / layout.COMMIT_FILE}: written by checkpoint engine {name!r}, this fastio has "
                        f"{', '.join(sorted(ENGINES))}"]
            why = compress.check_marker(entry.commit)
            if why:
                return [f"{path / layout.COMMIT_FILE}: {why}"]
            mine = layout.verify_files(entry, part=self._share)  # every directory's copy, by the ranks seeing it
        except CheckpointError as err:
            mine = [str(err)]
        return self._gather(mine)

    def _gather(self, mine: list[str]) -> list[str]:
        """Collective over the checkpoint group: every rank's problems, rank order (also a barrier)."""
        if self.world_size == 1:
            return list(mine)
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, list(mine), group=self._pg)
        return [p for part in every for p in part]

    def _check_app(self, app: dict[str, Any]) -> None:
        if not isinstance(app, dict) or not app:
            raise ValueError("app must be a non-empty dict of objects with state_dict/load_state_dict")
        for key, obj in app.items():
            if not isinstance(key, str) or not key or "/" in key or key.startswith(_RESERVED_PREFIX):
                raise ValueError(f"app key {key!r}: keys must be non-empty strings without '/' "
                                 f"not starting with {_RESERVED_PREFIX!r}")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"app[{key!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")

    def _agree(self, preempt: bool, due: bool, busy: bool) -> tuple[bool, bool, bool]:
        if self.world_size == 1:
            return preempt, due, busy
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flags = torch.tensor([int(preempt), int(due), int(busy)], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        p, d, b = (bool(v) for v in flags.tolist())
        return p, d, b

    def _raise_if_failed(self, *, wait: bool) -> None:
        thread = self._thread
        if thread is not None and (wait or not thread.is_alive()):
            thread.join()
            self._thread = None
        if self._error is not None:
            err, step = self._error, self._error_step
            self._error = self._error_step = None
            raise CheckpointError(f"{layout.step_dir(self.dir, step)}: checkpoint write failed: "
                                  f"{first_line(err)} (the previous checkpoint is intact)") from err

    def _save(self, step: int, app: dict[str, Any], metrics: dict[str, float] | None, epoch: int | None,
              *, blocking: bool) -> None:
        self._check_app(app)
        if step == self._inflight_step or step == self._last_step:
            self._raise_if_failed(wait=True)
            if blocking and self.world_size > 1:
                dist.barrier()
            return
        self._raise_if_failed(wait=True)  # one save in flight: staging buffers are free again after this
        t0 = time.perf_counter()
        tmp, final = layout.tmp_dir(self.dir, step), layout.step_dir(self.dir, step)
        engine = self._engine(choose_engine(self.config.engine, app))
        prepared, global_keys = engine.prepare(app)
        problem = None
        if self._leader:
            try:
                layout.start_tmp(self.dir, step)
            except OSError as err:
                problem = f"{tmp}: cannot create checkpoint directory: {err.strerror or err}"
        problem = self._agree_problem(problem)  # every rank fails together, or the others would wait forever
        if problem:
            raise CheckpointError(problem)
        rng = capture_rng()
        states = {key: obj.state_dict() for key, obj in prepared.items()}
        if epoch is None:
            epoch = loader_epoch(states)
        elapsed = self._elapsed_before + time.monotonic() - self._started
        progress = {"version": PROGRESS_VERSION, "step": int(step), "epoch": -1 if epoch is None else int(epoch),
                    "metrics": {str(k): float(v) for k, v in (metrics or {}).items()}, "elapsed": float(elapsed),
                    "hparams": self.hparams, "world_size": self.world_size}
        states[RNG_KEY] = rng
        states[PROGRESS_KEY] = progress
        staged = self._stager.stage(states)
        replicated = list(self.config.replicated)  # progress holds per-rank metrics: not replicated
        if self.world_size > 1 and not global_keys:
            replicated += _replicated_keys(app)
        info = {"epoch": progress["epoch"], "metrics": progress["metrics"], "world_size": self.world_size,
                "elapsed": elapsed, "hparams": self.hparams, "engine": engine.name}
        if self._compression is not None:
            info["compression"] = self._compression.codec
        self._inflight_step = step
        self._last_step = step
        self._last_time = time.monotonic()
        self._thread = start_writer(self._write, (engine, staged, replicated, global_keys, step, tmp, final, info),
                                    name=f"fastio-ckpt-{step}", nice=self.config.writer_nice)
        self.last_blocked_s = time.perf_counter() - t0
        if blocking:
            self._raise_if_failed(wait=True)
            if self.world_size > 1:
                dist.barrier()

    def _write(self, engine: Engine, staged: dict[str, Any], replicated: list[str], global_keys: frozenset[str],
               step: int, tmp: Path, final: Path, info: dict[str, Any]) -> None:
        """Background thread: the engine writes the staged copy, then rank 0 commits and prunes."""
        started = time.perf_counter()
        try:
            self._stager.wait_copies()
            if self._compression is None:
                engine.save(tmp, staged, pg=self._pg, replicated=replicated, global_keys=global_keys)
            else:
                self._save_compressed(engine, tmp, staged, replicated, global_keys)
            if self._node_local:
                self._commit_node_local(tmp, step, info)
            elif self.rank == 0:
                layout.commit(tmp, final, step=step, info=info)
                layout.apply_retention(self.dir, self.config.keep)
                if self._remote is not None:
                    self._remote.after_commit(self.config.keep)
            self.last_write_s = time.perf_counter() - started
        except BaseException as err:  # noqa: BLE001 - raised at the caller's next maybe_save/wait/close
            if self._leader:
                try:
                    layout.remove_step(tmp)
                except OSError:
                    pass
            # Published only after the clean-up: a caller that sees it may exit at once (this is a daemon thread).
            self._error, self._error_step = err, step
        finally:
            self._inflight_step = None

    def _commit_node_local(self, tmp: Path, step: int, info: dict[str, Any]) -> None:
        """Writer thread, collective: every node's files are uploaded by that node's ranks, then rank 0 writes
        the commit marker to the store last and applies retention; any failure fails every rank's save. The
        temporaries go afterwards: no node holds the whole step."""
        remote = self._remote
        mine: list[str] = []
        if self.rank == 0:  # every engine.save has returned once this gather is through
            try:
                remote.confirm()
            except CheckpointError as err:
                mine.append(str(err))
        problems = self._gather(mine)
        if problems:
            raise CheckpointError(problems[0])
        records: dict[str, Any] = {}
        try:
            i, n = self._share
            records = remote.upload_files(step, tmp, layout.data_files(tmp)[i::n])
        except CheckpointError as err:
            mine.append(f"rank {self.rank}: {err}")
        every = self._gather_objects((records, mine))
        problems = [p for _, part in every for p in part]
        if problems:
            raise CheckpointError(problems[0])
        if self.rank == 0:
            files: dict[str, Any] = {}
            for part, _ in every:
                twice = sorted(set(files) & set(part))
                if twice:  # two nodes wrote the same file: the engine assumed one directory
                    mine.append(f"{tmp}: {twice[0]} was written on two nodes; give staging_dir= on a shared "
                                "file system")
                    break
                files.update(part)
            if not mine:
                try:
                    remote.publish_commit(step, layout.commit_data(files, step=step, info=info), self.config.keep)
                except CheckpointError as err:
                    mine.append(str(err))
        problems = self._gather(mine)
        if problems:
            raise CheckpointError(problems[0])
        if self._leader:
            layout.remove_step(tmp)

    def _gather_objects(self, mine: Any) -> list[Any]:
        """Collective over the checkpoint group: every rank's ``mine``, in rank order."""
        if self.world_size == 1:
            return [mine]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self._pg)
        return every

    def _save_compressed(self, engine: Engine, tmp: Path, staged: dict[str, Any], replicated: list[str],
                         global_keys: frozenset[str]) -> None:
        """Writer thread, collective: the engine writes, then (once every rank's files are there) the ranks
        share compressing them; any rank's failure fails every rank's save."""
        failed: BaseException | None = None
        try:
            engine.save(tmp, staged, pg=self._pg, replicated=replicated, global_keys=global_keys)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            failed = err
        others = self._gather([f"rank {self.rank}: {first_line(failed)}"] if failed is not None else [])
        if failed is not None:
            raise failed
        if others:
            raise CheckpointError(f"another rank's write failed: {others[0]}")
        i, n = self._share  # the ranks that see this directory share its files
        files = layout.data_files(tmp)[i::n]
        self._gather([])  # every rank has listed the files before any replaces one by its compressed file
        mine: list[str] = []
        try:
            for p in files:
                compress.compress_file(p, self._compression)
        except CheckpointError as err:
            mine.append(str(err))
        problems = self._gather(mine)
        if problems:
            raise CheckpointError(problems[0])

    def _restore_node_local(self, app: dict[str, Any], step: int | None) -> TrainState | None:
        """``restore_latest`` with node-local staging: the candidates are the store's committed steps (newest
        first); each is pulled into every staging dir that lacks it (by its lowest rank) and every copy checked
        by the ranks that see it; a step that fails anywhere is moved aside on every node and the next tried."""
        plan: list[Any] = [None, None]  # candidate steps newest first, error
        if self.rank == 0:
            try:
                steps = self._remote.committed_steps()
                if step is not None and step not in steps:
                    plan[1] = (f"{self.config.url}: no committed checkpoint for step {step} (committed: "
                               f"{', '.join(map(str, steps)) or 'none'})")
                plan[0] = [step] if step is not None else steps[::-1]
            except StorageError as err:
                plan[1] = f"{self.config.url}: cannot list checkpoints: {err}"
        dist.broadcast_object_list(plan, src=0)
        candidates, error = plan
        if error:
            raise CheckpointError(error)
        if self._leader:
            layout.remove_abandoned(self.dir)
        skipped: list[str] = []
        for cand in candidates:
            path = layout.step_dir(self.dir, cand)
            mine: list[str] = []
            if self._leader:
                try:
                    self._remote.fetch(cand)
                except (CheckpointError, OSError) as err:
                    mine.append(str(err))
            problems = self._gather(mine) or self._check_step(path)
            if not problems:
                if skipped:
                    log.warning("fastio: %s: skipped newer checkpoint(s): %s", self.config.url, "; ".join(skipped))
                return self._restore(path, layout.read_commit(path), app)
            if step is not None:
                raise CheckpointError(f"{path}: damaged checkpoint: {problems[0]}")
            skipped.append(f"step {cand}: {problems[0]}")
            if self._leader and path.exists():
                try:
                    layout.quarantine(path)  # this node's copy: moved aside, a later restore downloads it again
                except OSError:
                    pass
        if skipped:
            raise CheckpointError(f"{self.config.url}: no intact checkpoint: {len(skipped)} step(s) could not be "
                                  f"restored on every node, newest {skipped[0]}")
        return None

    def _restore(self, path: Path, commit: dict[str, Any], app: dict[str, Any]) -> TrainState:
        if not commit.get("compression"):
            return self._restore_from(path, path, commit, app)
        # Verified stored files -> plain files in a private directory next to the step, the ranks sharing
        # the work; the engine reads there; the directory goes when every rank is done with it.
        where: tuple[str | None, str | None] = (None, None)
        if self._leader:  # one private directory per staging directory, made by the lowest rank seeing it
            try:
                where = (str(layout.start_restore_dir(self.dir, commit["step"])), None)
            except OSError as err:
                where = (None, f"{layout.restore_dir(self.dir, commit['step'])}: cannot create: {err.strerror or err}")
        every = self._gather_objects(where)
        error = next((e for _, e in every if e), None)
        if error:
            raise CheckpointError(error)
        work = Path(every[self._group[0]][0])
        try:
            mine: list[str] = []
            try:
                i, n = self._share
                for rel in sorted(commit["files"])[i::n]:
                    compress.restore_file(path / rel, work / compress.stored_name(rel), commit["compression"])
            except CheckpointError as err:
                mine.append(str(err))
            problems = self._gather(mine)
            if problems:
                raise CheckpointError(problems[0])
            try:
                return self._restore_from(path, work, commit, app)
            except CheckpointError as err:  # name the checkpoint, not the directory about to go
                raise CheckpointError(str(err).replace(str(work), str(path))) from err.__cause__
        finally:
            self._gather([])  # every rank is done reading
            if self._leader:
                shutil.rmtree(work, ignore_errors=True)

    def _restore_from(self, path: Path, files: Path, commit: dict[str, Any], app: dict[str, Any]) -> TrainState:
        """Restore the checkpoint ``path`` (its plain files are in ``files``) into ``app``."""
        name = commit.get("engine", DEFAULT_ENGINE)  # markers from before engines were recorded: torchsnapshot
        engine = self._engine(name)
        sharded = holds_dtensor(app)
        if sharded and name != "dcp":
            raise CheckpointError(f"{path}: written by the {name} engine, which cannot restore into DTensor (FSDP2 / "
                                  f"tensor parallel) state of app key(s) {', '.join(sharded)}: restore it into the "
                                  "unsharded model and save again with engine='dcp'")
        app, _ = engine.prepare(app)
        saved = engine.open(files, pg=self._pg)
        saved_world = int(commit.get("world_size") or saved.world_size)
        elastic = saved_world != self.world_size  # see fastio.checkpoint.elastic for the rule
        src = self.rank % saved_world  # the saving rank whose per-rank state this rank takes
        have = saved.keys(src)
        missing = sorted(k for k in app if k not in have)
        if missing:
            holds = ", ".join(sorted(k for k in have if not k.startswith(_RESERVED_PREFIX))) or "nothing"
            raise CheckpointError(
                f"{path}: checkpoint has no state for app key(s) {', '.join(missing)} on rank {src} "
                f"(it holds: {holds}; written by {saved_world} rank(s), this run has {self.world_size})")
        progress = Frozen({})
        targets = dict(app)
        targets[PROGRESS_KEY] = progress
        has_rng = not elastic and RNG_KEY in saved.keys(self.rank)
        if has_rng:
            targets[RNG_KEY] = Frozen(capture_rng())
        try:
            if elastic:
                replicated, per_rank = restore_elastic(saved, targets, rank=self.rank, saved_world=saved_world,
                                                       from_rank_zero=(PROGRESS_KEY,))
            else:
                saved.restore(targets)
        except CheckpointError:
            raise
        except Exception as err:  # a mismatched model or a loader refusing its state lands here
            raise CheckpointError(f"{path}: restore failed: {first_line(err)}") from err
        if elastic:
            if self.rank == 0:
                log.warning("fastio: %s was written by %d rank(s), this run has %d: replicated %s restored on "
                            "every rank; per-rank %s from saved rank r %% %d, progress from rank 0; RNG not "
                            "restored (left as this run seeded it)", path, saved_world, self.world_size,
                            ", ".join(replicated) or "nothing",
                            ", ".join(k for k in per_rank if k != PROGRESS_KEY) or "nothing", saved_world)
        elif has_rng:
            restore_rng(targets[RNG_KEY].state)
        else:
            log.warning("fastio: %s holds no RNG state for rank %d; RNG not restored", path, self.rank)
        p = progress.state
        if p.get("version") != PROGRESS_VERSION:
            raise CheckpointError(f"{path}: progress record version {p.get('version')!r}, "
                                  f"this fastio reads {PROGRESS_VERSION}")
        self._last_step = int(p.get("step", commit["step"]))
        self._last_time = time.monotonic()
        self._elapsed_before = float(p.get("elapsed", 0.0))
        self._started = time.monotonic()
        epoch = p.get("epoch", -1)
        return TrainState(step=self._last_step, epoch=None if epoch is None or epoch < 0 else int(epoch),
                          metrics=dict(p.get("metrics", {})), elapsed=self._elapsed_before,
                          time=float(commit.get("time", 0.0)), hparams=dict(p.get("hparams", {})), path=path)
