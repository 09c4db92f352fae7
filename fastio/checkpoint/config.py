"""What a :class:`~fastio.checkpoint.Checkpointer` does and when: one validated dataclass.

:class:`CheckpointConfig` checks every field when made (``engine="auto"``, ``compression``, ``writer_nice``,
``direct_writes``, ``preempted_exit_code``, ``read_only``: restore only, no lock or lease; ``agree_timeout``); an
``s3://`` ``dir`` becomes ``url``, and ``dir`` the local staging directory."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from fastio.checkpoint.compress import parse_compression
from fastio.checkpoint.engines import AUTO, check_engine_name
from fastio.storage.url import dest_location, local_folder, local_or_url

__all__ = ["POLICIES", "CheckpointConfig"]

POLICIES = ("wait", "skip")


@dataclass
class CheckpointConfig:
    """Options of a Checkpointer; ``Checkpointer(dir, **options)`` builds one of these."""

    dir: str | Path
    """Directory holding ``step-N/`` checkpoints (shared storage when several hosts write), or an
    ``s3://bucket/prefix`` URL: then ``dir`` becomes the local staging directory and ``url`` the URL. Kept with
    ``..`` folded where it follows a folder that does not exist (``runs/new/../ckpt`` is ``runs/ckpt``, and no
    ``runs/new`` is made: :func:`fastio.storage.url.dest_location`)."""

    every_steps: int = 0
    """Save when ``step % every_steps == 0``; 0 turns step-based saving off."""

    every_seconds: float = 0.0
    """Save when this many seconds have passed since the last save (or the start); 0 turns it off."""

    keep: int = 0
    """Keep the newest ``keep`` committed checkpoints, delete older ones after each commit; 0 keeps all."""

    policy: str = "wait"
    """A save falling due while the previous one is still writing: ``"wait"`` for it, or ``"skip"`` this one."""

    async_save: bool = True
    """Write in the background (``maybe_save`` returns once the state is staged); False blocks until committed."""

    signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")
    """Signals that request a preemption save; their handler only sets a flag. Empty: install none. SIGKILL and
    SIGSTOP, which no handler can catch, are refused."""

    requeue: bool = False
    """After a preemption save under Slurm that a warning asked for (SIGUSR1: ``#SBATCH --signal=B:USR1@120``;
    any signal of ``signals`` but SIGTERM, SIGINT, SIGHUP and SIGQUIT, on any rank), rank 0 runs ``scontrol requeue
    <job id>``. SIGTERM alone (``scancel``, the end of the time limit) saves and does not requeue; ``signals`` that
    could never requeue (SIGTERM only) get one warning."""

    preempted_exit_code: int = 0
    """The exit status a preempted run should end with: ``sys.exit(ckpt.exit_code)`` gives this after a
    preemption save and 0 otherwise. 0 (the default) reads as success; schedulers or wrappers that must tell a
    preempted run from a finished one can ask for another value (0..255)."""

    replicated: tuple[str, ...] = field(default_factory=tuple)
    """Extra globs over ``key/sub/path`` (``"model/**"``) for state identical on all ranks, written once;
    DDP modules (and optimizers over DDP parameters only) are added."""

    engine: str = AUTO
    """The checkpoint engine that writes new checkpoints: ``"torchsnapshot"``, ``"dcp"``, or ``"auto"``
    (DCP when the app holds DTensor state, e.g. FSDP2, torchsnapshot otherwise). A restore uses the engine
    named in the checkpoint's commit marker."""

    compression: str | None = None
    """``None`` (default): files are stored as the engine writes them. ``"zstd"`` or ``"zstd+shuffle"`` (bytes
    of 4-byte words grouped before compressing), level 1 or ``":LEVEL"`` (1..22): the writer compresses every
    file of a checkpoint after the engine wrote it (``NAME.zst``), the commit marker records it, and a restore
    decompresses (into a temporary directory next to the step, so it needs that much free space) without being
    told. Off by default because it does not pay on float state: on trained fp32 weights and Adam moments zstd
    saves about 8% of the bytes (x1.08), with the shuffle about 15% (x1.17), at ~300 MB/s per core: several
    core-seconds per GiB on the writer, slower than most disks take the bytes it saves."""

    writer_nice: int = 0
    """Nice value for the background writer thread and the threads it starts (Linux; 1..19 lets training threads
    win an oversubscribed CPU, at the price of a longer write; raised to this value, never lowered below the
    caller's); 0 leaves its priority alone. Off by default: see the checkpoint section of docs/performance.md."""

    direct_writes: bool = True
    """The torchsnapshot engine writes its data files past the page cache (Linux ``O_DIRECT``:
    :mod:`fastio.storage.direct`; from the staged buffers themselves, which the staging places in memory as their
    bytes lie in the files, learnt at the first save, which copies them through aligned 8 MiB chunks) where the file
    system takes it, else through the page cache as with False. A buffered write fills fresh page-cache pages with
    every byte, and the kernel's work for them was most of the write's CPU on the background core (on a 2-core VM:
    528 MiB in 0.43-2.2 s, 0.7 s of system CPU, against 0.47-0.73 s and 0.06 s direct; see the checkpoint section
    of docs/performance.md). The cost: a restore right after a save on the same host reads the files from the disk,
    not from memory (528 MiB there: 0.62 s against 0.35 s). Not used with ``compression`` (the files are read back
    to compress them), with an ``s3://`` dir (read back to upload them), nor by the DCP engine (DCP writes each
    tensor through ``torch.save`` in small pieces)."""

    staging_dir: str | Path | None = None
    """With an ``s3://`` dir: the local directory checkpoints are written in before they are uploaded
    (default ``<fastio cache dir>/checkpoints/<hash of the URL>``). Either one directory every rank sees (a
    shared file system) or one per node (each node uploads its own files); see :mod:`fastio.checkpoint.remote`."""

    storage_options: dict | None = None
    """With an ``s3://`` dir: endpoint, region, credentials over the environment's
    (:class:`fastio.storage.StorageOptions`)."""

    read_only: bool = False
    """Restore only (e.g. evaluation beside training): no lock or lease is taken (the training job holds them),
    nothing under ``dir`` is cleaned, moved aside, superseded or deleted (but a compressed step's working copy,
    ``.step-N.restore-PID``, and those of ended restores a kill left), and ``save``/``maybe_save`` raise. With
    an ``s3://`` dir and no ``staging_dir``, steps are downloaded into a private temporary directory that
    ``close`` removes (the default staging directory may be the training job's), and which the next read-only
    Checkpointer of the host removes once a kill left it (:func:`fastio.checkpoint.removal.start_private_staging`)."""

    agree_timeout: float = 300.0
    """Seconds the ranks wait for each other to start the same operation (``Checkpointer(...)``, ``maybe_save``,
    ``save``, ``restore_latest``): then every rank that arrived raises a CheckpointError naming the ranks that did
    not (stopped, stuck in another collective, or making other calls). Ranks that arrive but disagree (on the
    operation, the directory, the engine) are refused at once. Well under gloo's own 30 minutes; it bounds only
    the start of an operation, not the write or read that follows."""

    url: str | None = field(default=None, init=False)
    """The object-store URL checkpoints are uploaded to (None: ``dir`` is the checkpoint directory itself)."""

    def __post_init__(self) -> None:
        if not str(self.dir).strip():  # before Path(): Path('') is '.', the current directory
            raise ValueError(f"CheckpointConfig.dir must not be empty, got {self.dir!r}")
        where = local_or_url(self.dir)
        if isinstance(where, str):
            from fastio.checkpoint.remote import default_staging_dir

            self.url = where.rstrip("/")
            where = local_folder(self.staging_dir, "staging_dir") if self.staging_dir else default_staging_dir(self.url)
        self.dir = Path(where)
        self.dir = dest_location(self.dir)
        self._check_numbers()
        if self.policy not in POLICIES:
            raise ValueError(f"CheckpointConfig.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if isinstance(self.signals, str):
            self.signals = (self.signals,)
        self.signals = _signal_names(self.signals)
        try:
            check_engine_name(self.engine, allow_auto=True)
        except ValueError as err:
            raise ValueError(f"CheckpointConfig.engine: {err}") from None
        try:
            parse_compression(self.compression)
        except ValueError as err:
            raise ValueError(f"CheckpointConfig.{err}") from None
        if isinstance(self.replicated, str):
            self.replicated = (self.replicated,)
        self.replicated = tuple(self.replicated)

    def _check_numbers(self) -> None:
        """ValueError naming the number field that is not of its kind or range."""
        if isinstance(self.writer_nice, bool) or not isinstance(self.writer_nice, int) \
                or not 0 <= self.writer_nice <= 19:
            raise ValueError(f"CheckpointConfig.writer_nice must be an int in 0..19, got {self.writer_nice!r}")
        if isinstance(self.preempted_exit_code, bool) or not isinstance(self.preempted_exit_code, int) \
                or not 0 <= self.preempted_exit_code <= 255:
            raise ValueError(f"CheckpointConfig.preempted_exit_code must be an int in 0..255, "
                             f"got {self.preempted_exit_code!r}")
        if not isinstance(self.direct_writes, bool):
            raise ValueError(f"CheckpointConfig.direct_writes must be True or False, got {self.direct_writes!r}")
        if not isinstance(self.read_only, bool):
            raise ValueError(f"CheckpointConfig.read_only must be True or False, got {self.read_only!r}")
        for name in ("every_steps", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CheckpointConfig.{name} must be an int >= 0, got {value!r}")
        if isinstance(self.every_seconds, bool) or not isinstance(self.every_seconds, (int, float)) \
                or not self.every_seconds >= 0:  # NaN too: it compares false with every period, so never saves
            raise ValueError(f"CheckpointConfig.every_seconds must be a number >= 0, got {self.every_seconds!r}")
        if isinstance(self.agree_timeout, bool) or not isinstance(self.agree_timeout, (int, float)) \
                or not 0 < self.agree_timeout < float("inf"):
            raise ValueError(f"CheckpointConfig.agree_timeout must be a number of seconds > 0, "
                             f"got {self.agree_timeout!r}")


def _signal_names(signals) -> tuple[str, ...]:
    """The names of ``signals`` (names or numbers); ValueError naming one that is no signal, or one no handler can
    catch (SIGKILL, SIGSTOP)."""
    names = []
    for sig in signals:
        try:
            names.append(signal.Signals[sig].name if isinstance(sig, str) else signal.Signals(sig).name)
        except (KeyError, ValueError):
            raise ValueError(f"CheckpointConfig.signals: unknown signal {sig!r}") from None
        if names[-1] in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"CheckpointConfig.signals: {names[-1]} cannot be caught (no process can act on it: "
                             "preemption schedulers send SIGTERM or SIGUSR1 first)")
    return tuple(names)
