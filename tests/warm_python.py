"""A warm interpreter for tests/test_docs.py: it imports torch and DALI once, then runs each script it is sent as
``python script.py`` would, in a child forked from it (what the child of a fresh ``python`` spends most of its time on,
the import of torch and DALI, is already done; everything else starts fresh in each child).

The child of a request: its own working directory, stdin ``/dev/null``, stdout and stderr into files of the caller's,
``sys.argv == [script, *args]``, ``sys.path[0]`` the script's folder, the script run as ``__main__`` in a fresh namespace
(so a missing ``import`` still fails), and an ordinary interpreter exit (non-daemon threads joined, ``atexit``
handlers run); an uncaught exception prints its traceback and exits 1, as ``python`` does. Only the top-level
``import torch`` and ``import nvidia.dali`` that a snippet would do itself are done ahead (and ``torch._dynamo``, which
torch imports by itself at a script's first optimizer, ``torch.optim.Optimizer``: ~1 s of CPU), never fastio.

A script can also be started (``WarmPython.start``): the caller gets its process id at once, reads its stdout as
the script writes it (``WarmRun.lines``: what it flushed), signals it (SIGINT raises KeyboardInterrupt in it, as in a
python started from a terminal, even where the server inherited SIGINT ignored; SIGKILL, SIGUSR1...) and waits for
its end (``WarmRun.wait``). One script runs at a time.

A signal at a step (``signal_at=(prefix, signal)``) is sent by the child to itself, the moment it has written and
flushed a stdout line starting with ``prefix``: a real signal, delivered as a Ctrl-C or a scheduler's signal that came
right then would be. A signal sent by the test when it reads that line raced the script: a tiny training runs its last
4 steps, an evaluation and a save in 60 ms, and on a loaded machine it had ended before the signal came.

A request may carry an environment (``env``): the child takes it, and its ``PYTHONPATH`` goes on ``sys.path`` after
the script's folder (``tempfile`` picks its folder again, from the child's ``TMPDIR``); what is read at an
interpreter's or torch's start (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``...) must be the server's (``WarmPython``
refuses otherwise).

Protocol (``WarmPython``): one JSON line a request on stdin, ``{"script", "cwd", "args", "timeout", "env", "path",
"out", "err", "signal_at"}``; two JSON lines a reply on stdout: ``{"pid": the child's process id}`` once it is forked, then
``{"rc": exit code, negative for a signal}`` (``timeout`` seconds: SIGALRM ends it)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn


def _child(request: dict) -> None:
    """In the forked child: become ``python script`` and exit as it would (never returns to the serve loop)."""
    import signal

    for fd, name in ((1, "out"), (2, "err")):
        os.dup2(os.open(request[name], os.O_WRONLY | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, as in a python started from a terminal
    signal.alarm(int(request["timeout"]))
    if request.get("signal_at"):
        sys.stdout = _SignalAt(sys.stdout, *request["signal_at"])
    script = request["script"]
    sys.argv = [script, *request.get("args", [])]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if request.get("env") is not None:
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[1:1] = request["path"]  # PYTHONPATH's folders, where the server started without them
    tempfile.tempdir = None  # chosen again from the run's TMPDIR, as a fresh python does (torch's import chose it)
    run_as_main(script)


class _SignalAt:
    """``stream`` (the child's ``sys.stdout``), which sends ``sig`` to this process once, right after a line starting
    with ``prefix`` is written (and flushed, so the caller sees it)."""

    def __init__(self, stream, prefix: str, sig: int) -> None:
        self._stream, self._prefix, self._sig = stream, prefix, sig
        self._line: str | None = ""  # the unfinished line; None once the signal is sent

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        if self._line is not None:
            *done, self._line = (self._line + text).split("\n")
            if any(line.startswith(self._prefix) for line in done):
                self._line = None
                self._stream.flush()
                os.kill(os.getpid(), self._sig)
        return written

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run_as_main(script: str) -> NoReturn:
    """Run ``script`` as ``__main__`` and exit as ``python script`` would: an uncaught exception prints its
    traceback and exits 1; ``SystemExit`` out of every caller, so the interpreter ends as usual (non-daemon
    threads joined, ``atexit`` handlers run)."""
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def ready_to_fork() -> None:
    """In a process about to fork children that run as fresh pythons would: ``torch._dynamo`` imported (torch's own
    lazy import at a process's first optimizer: ~1 s of CPU a child), then what is loaded frozen: never collected, so
    a child's collections and its interpreter's end do not write to every page of it (copy-on-write: ~0.5 s of CPU a
    child, most of a short script's run); Python's advice for fork."""
    import torch._dynamo  # noqa: F401

    gc.freeze()


def wait_forked(pids: list[int]) -> list[int]:
    """The exit codes of this process's children ``pids``, in order, once each ended; the first that fails gets the
    others killed."""
    codes: list[int | None] = [None] * len(pids)
    while None in codes:
        pid, status = os.wait()
        codes[pids.index(pid)] = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            for other, got in zip(pids, codes):
                if got is None:
                    os.kill(other, signal.SIGKILL)
    return codes


def serve() -> None:
    """Answer requests on stdin until it closes."""
    import nvidia.dali  # noqa: F401  (what a snippet's own import would load; a child finds it loaded)
    import torch  # noqa: F401

    ready_to_fork()
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


class WarmPython:
    """The warm interpreter, started by a test session; ``run(script, cwd, *args)`` runs one script."""

    # What the interpreter and the thread pools torch loads (OpenMP, MKL, OpenBLAS) read at their start, and the
    # dynamic loader's: a run's environment must not change them. (Variables torch sets while it runs, such as
    # TORCHINDUCTOR_CACHE_DIR, may differ: the child takes them as a fresh python would.)
    AT_START = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "LD_")

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """The server, with this process's environment and ``env`` over it (what a child's run may not change)."""
        self.env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).parent, env=self.env)

    def _check_env(self, env: dict[str, str]) -> None:
        """``env`` may differ from the server's only in what is read after start (and ``PYTHONPATH``, which the
        child puts on ``sys.path`` as ``python`` would)."""
        changed = sorted(k for k in set(env) ^ set(self.env) | {k for k in env if env[k] != self.env.get(k)}
                         if k.startswith(self.AT_START) and k != "PYTHONPATH")
        assert not changed, f"the warm interpreter cannot run with other {', '.join(changed)}: start a fresh python"

    def run(self, script: Path, cwd: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
            signal_at: tuple[str, int] | None = None) -> tuple[int, str, str]:
        """``python script *args`` in ``cwd`` (with ``env``, else the server's environment; ``signal_at``: see
        :meth:`start`): its exit code (negative: the signal that ended it), stdout, stderr."""
        return self.start(script, cwd, *args, timeout=timeout, env=env, signal_at=signal_at).wait()

    def start(self, script: Path, cwd: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
              signal_at: tuple[str, int] | None = None) -> WarmRun:
        """:meth:`run`'s script, started: its :class:`WarmRun` (wait for it before the next start); with
        ``signal_at=(prefix, signal)``, it sends itself ``signal`` right after it writes a line starting with
        ``prefix``."""
        path = []
        if env is not None:
            self._check_env(env)
            if env.get("PYTHONPATH") != self.env.get("PYTHONPATH"):
                assert not self.env.get("PYTHONPATH"), "the warm interpreter started with another PYTHONPATH"
                path = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
        files = {}
        for name in ("out", "err"):
            fd, files[name] = tempfile.mkstemp(suffix=f".{name}")
            os.close(fd)
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd), "args": list(args),
                                          "timeout": timeout, "env": env, "path": path, "signal_at": signal_at,
                                          **files}) + "\n")
        self.proc.stdin.flush()
        return WarmRun(self, json.loads(self._reply())["pid"], files)

    def _reply(self) -> str:
        reply = self.proc.stdout.readline()
        assert reply, f"the warm interpreter ended (exit code {self.proc.poll()})"
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class WarmRun:
    """A script :meth:`WarmPython.start` started: ``pid``; its stdout lines as they come; its end."""

    def __init__(self, warm: WarmPython, pid: int, files: dict[str, str]) -> None:
        self.warm, self.pid, self.files = warm, pid, files

    def _running(self) -> bool:
        """The child has not ended (the server reaps it at once: an ended one is a zombie for an instant)."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    def lines(self) -> Iterator[str]:
        """Its stdout, line by line, as the script writes (flushes) it, until it ends (the last line may lack its
        newline); stop reading at any line: the script runs on."""
        with open(self.files["out"], errors="replace") as out:
            pending = ""
            while True:
                running = self._running()
                pending += out.read()
                *done, pending = pending.split("\n")
                yield from (line + "\n" for line in done)
                if not running:
                    break
                if not done:
                    time.sleep(0.002)  # a step of a tiny training can take milliseconds: a signal lands soon after
            if pending:
                yield pending

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self) -> tuple[int, str, str]:
        """Its exit code (negative: the signal that ended it), stdout, stderr."""
        rc = json.loads(self.warm._reply())["rc"]
        try:
            return (rc, *(Path(self.files[n]).read_text(errors="replace") for n in ("out", "err")))
        finally:
            for name in self.files.values():
                os.unlink(name)


if __name__ == "__main__":
    serve()
