"""How a training script ends on Ctrl-C or a fastio error: :func:`exit_cleanly`.

Inside its ``with`` block, a ``KeyboardInterrupt`` (wherever the main thread was: a DALI run, numpy, the
optimizer) and a :class:`~fastio.errors.FastioError` end the process with one line on stderr instead of a
traceback through the libraries' internals: for Ctrl-C, which step is saved and how to resume (exit status
130, the shell's code for Ctrl-C); for an error, its message (exit status 2, as the ``fastio`` command).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from fastio.errors import FastioError

__all__ = ["ERROR_EXIT_CODE", "INTERRUPTED_EXIT_CODE", "exit_cleanly"]

INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT: what a shell reports for a program ended by Ctrl-C."""
ERROR_EXIT_CODE = 2
"""What the ``fastio`` command exits with on a FastioError."""


@contextlib.contextmanager
def exit_cleanly(checkpointer: Any = None, *closing: Any, name: str | None = None,
                 resume: str = "run the same command to resume") -> Iterator[None]:
    """End the process with one line on Ctrl-C or a FastioError raised inside the block.

    Then: a second Ctrl-C stops at once; ``checkpointer`` (a :class:`fastio.Checkpointer`, optional) is
    closed, which waits for a write in flight to commit; the objects of ``closing`` (Loaders, ...) are closed;
    one line goes to stderr, prefixed with ``name`` (default: the script's file name), e.g. ``quickstart.py:
    interrupted: step 15 is saved in ckpt; run the same command to resume`` (without a Checkpointer: ``resume``
    alone) or ``quickstart.py: error: ...``;
    and ``SystemExit`` is raised with 130 (Ctrl-C) or 2 (an error). Under ``torch.distributed`` only the
    Checkpointer's rank 0 prints. Other exceptions pass through unchanged. On resume, the steps after the last
    save are trained again (a Checkpointer's preemption signals, SIGTERM and SIGUSR1, save first instead).
    """
    name = name or _script_name()
    try:
        yield
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C does not wait for the commit
        _say(checkpointer, f"{name}: interrupted: {_close_all(checkpointer, closing, resume)}")
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    except FastioError as err:
        _close_all(checkpointer, closing, resume)
        _say(checkpointer, f"{name}: error: {err}")
        raise SystemExit(ERROR_EXIT_CODE) from None


def _script_name() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    return argv0.replace("\\", "/").rsplit("/", 1)[-1]


def _say(checkpointer: Any, line: str) -> None:
    if getattr(checkpointer, "rank", 0) == 0:
        print(line, file=sys.stderr, flush=True)


def _close_all(checkpointer: Any, closing: tuple[Any, ...], resume: str) -> str:
    """Close everything; what the run leaves behind, in words."""
    for obj in closing:
        with contextlib.suppress(Exception):  # on the way out: the line printed is what matters
            obj.close()
    if checkpointer is None:
        return resume
    where = checkpointer.config.url or checkpointer.dir
    try:
        checkpointer.close()
        steps = checkpointer.steps()
    except FastioError as err:
        return f"the last checkpoint write failed ({err}); {resume}"
    if not steps:
        return f"no checkpoint saved yet in {where}; {resume} from the start"
    return f"step {steps[-1]} is saved in {where}; {resume}"
