"""Preemption: signals that only set a flag, and Slurm requeue of the current job.

Which signal came decides whether a requeue is wanted (:data:`NO_REQUEUE`): Slurm's warning before a time limit or
a preemption (``#SBATCH --signal=B:USR1@120``) asks for one; SIGTERM, what ``scancel`` (and the end of the time
limit) sends, asks the job to end: it saves, but a job the user cancelled must not come back."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping

__all__ = ["NO_REQUEUE", "PreemptionFlag", "requeue_slurm_job", "slurm_job_id", "warn_if_nothing_requeues"]

log = logging.getLogger(__name__)

NO_REQUEUE = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
"""Signals that ask the process to end (``scancel``, Ctrl-C on ``srun``, a hang-up): a preemption save, never a
requeue. Any other signal of ``signals=`` (SIGUSR1: Slurm's warning) is a warning, and requeues."""


def warn_if_nothing_requeues(signals: tuple[str, ...]) -> None:
    """One warning when ``requeue=True`` meets ``signals`` (names) that are all in :data:`NO_REQUEUE`: none of them
    will requeue (``signals=()``, where the app calls ``request_preemption()`` itself, is not warned about)."""
    if signals and all(signal.Signals[name] in NO_REQUEUE for name in signals):
        log.warning("fastio: Checkpointer(requeue=True, signals=%s): none of these signals requeues the Slurm job "
                    "(they ask it to end: scancel sends SIGTERM); add Slurm's warning, SIGUSR1, and "
                    "#SBATCH --signal=B:USR1@120", ", ".join(signals))


class PreemptionFlag:
    """Installs handlers for ``signals`` that record the signal and do nothing else; ``uninstall`` puts the old ones back.

    Handlers can only be installed from the main thread; elsewhere nothing is installed and
    ``installed`` stays False (the flag can still be set with :meth:`request`).
    """

    def __init__(self, signals: tuple[str, ...]):
        self.signums: set[int] = set()
        """The signals that came since the last :meth:`clear`."""
        self._previous: dict[int, object] = {}
        if signals and threading.current_thread() is threading.main_thread():
            for name in signals:
                sig = signal.Signals[name]
                self._previous[sig] = signal.signal(sig, self._handler)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def requested(self) -> bool:
        return bool(self.signums)

    @property
    def requeue_wanted(self) -> bool:
        """A warning came (a signal not in :data:`NO_REQUEUE`), whatever came after it."""
        return any(s not in NO_REQUEUE for s in self.signums)

    def request(self, signum: int = signal.SIGUSR1) -> None:
        self.signums.add(int(signum))

    def clear(self) -> None:
        self.signums.clear()

    def _handler(self, signum, frame) -> None:
        self.signums.add(signum)

    def uninstall(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else ``SLURM_JOB_ID``; None outside Slurm."""
    env = os.environ if env is None else env
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID") or None


def requeue_slurm_job(env: Mapping[str, str] | None = None, timeout: float = 60.0) -> bool:
    """Run ``scontrol requeue <id>``; False (with a logged warning) when not under Slurm or it fails."""
    job = slurm_job_id(env)
    if job is None:
        log.warning("fastio: requeue asked for, but SLURM_JOB_ID is not set; not requeueing")
        return False
    exe = shutil.which("scontrol")
    if exe is None:
        log.warning("fastio: cannot requeue Slurm job %s: scontrol is not on PATH", job)
        return False
    try:
        proc = subprocess.run([exe, "requeue", job], check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("fastio: scontrol requeue %s failed: %s", job, err)
        return False
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        log.warning("fastio: scontrol requeue %s exited %d: %s; the job is not requeued (resubmit it to resume)",
                    job, proc.returncode, said[-1] if said else "no message")
        return False
    return True
