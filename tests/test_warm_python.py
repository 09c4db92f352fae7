"""The warm interpreter (tests/warm_python.py) runs a script as ``python script.py`` would: the tests that use it
(the documentation's snippets, the examples' runs) can still fail for every reason a fresh python would fail."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest


def script(tmp_path, text: str):
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_missing_import_still_fails_and_the_traceback_is_on_stderr(warm, tmp_path):
    """torch is loaded in the server, but not in the script's namespace: a script that forgot to import it fails."""
    rc, out, err = warm.run(script(tmp_path, """
        import sys
        print(sys.argv[1:], __name__)
        torch.zeros(1)
    """), tmp_path, "a", "b")
    assert rc == 1 and out == "['a', 'b'] __main__\n", out + err
    assert err.startswith("Traceback") and err.endswith("NameError: name 'torch' is not defined\n"), err


def test_exit_code_threads_atexit_cwd_and_path_are_a_fresh_pythons(warm, tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "mine.py").write_text("VALUE = 7\n")
    rc, out, err = warm.run(script(tmp_path, """
        import atexit, os, sys, threading, time
        import mine  # the script's folder is sys.path[0]
        atexit.register(lambda: print("atexit", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread", flush=True))).start()
        print(mine.VALUE, os.path.basename(os.getcwd()), flush=True)
        sys.exit(3)
    """), tmp_path / "here")
    assert (rc, out) == (3, "7 here\nthread\natexit\n"), out + err


def test_a_run_past_its_timeout_or_killed_reports_the_signal(warm, tmp_path):
    rc, _, _ = warm.run(script(tmp_path, "import time\ntime.sleep(30)\n"), tmp_path, timeout=1)
    assert rc == -14  # SIGALRM
    rc, _, _ = warm.run(script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"), tmp_path)
    assert rc == -9


def test_a_runs_environment_is_its_own_and_what_is_read_at_start_is_refused(warm, tmp_path):
    path = script(tmp_path, "import os, sys, tempfile\nprint(os.environ.get('WARM_TEST'), sys.path[1])\n"
                            "print(tempfile.gettempdir() == os.environ.get('TMPDIR'))\n")
    rc, out, _ = warm.run(path, tmp_path, env={**os.environ, "WARM_TEST": "yes", "PYTHONPATH": "/nowhere",
                                               "TMPDIR": str(tmp_path)})
    assert (rc, out) == (0, "yes /nowhere\nTrue\n")  # TMPDIR too, though the server's torch chose /tmp
    assert warm.run(path, tmp_path)[1].startswith("None ")  # the next run has the server's environment again
    with pytest.raises(AssertionError, match="cannot run with other OMP_NUM_THREADS"):
        warm.run(path, tmp_path, env={**os.environ, "OMP_NUM_THREADS": "7"})


def test_a_started_script_is_read_as_it_writes_and_ctrl_c_or_a_kill_reaches_it(warm, tmp_path):
    """``start``: its lines come while it runs; SIGINT raises KeyboardInterrupt in it (as in a python started from a
    terminal, whatever the server inherited); SIGKILL ends it, reported as the signal."""
    waiting = script(tmp_path, """
        import time
        try:  # "ready" inside: a SIGINT sent as soon as it is read must find the handler in place
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(130)
    """)
    for sig, want in ((signal.SIGINT, (130, "ready\ninterrupted\n")), (signal.SIGKILL, (-9, "ready\n"))):
        run = warm.start(waiting, tmp_path)
        assert next(run.lines()) == "ready\n"
        run.send_signal(sig)
        rc, out, _ = run.wait()
        assert (rc, out) == want


def test_signal_at_reaches_the_script_as_it_prints_that_line(warm, tmp_path):
    """``signal_at=(prefix, sig)``: the signal comes right after the first line starting with ``prefix`` is written,
    before the script's next statement, however fast the script runs on; a line that never comes sends none."""
    fast = script(tmp_path, """
        import signal, sys
        signal.signal(signal.SIGUSR1, lambda *_: print("usr1", flush=True))
        for step in range(1, 6):
            print(f"step {step}", flush=True)
            print(f"after {step}", file=sys.stderr, flush=True)
    """)
    rc, out, err = warm.run(fast, tmp_path, signal_at=("step 3", signal.SIGINT))
    assert rc == 1 and out == "step 1\nstep 2\nstep 3\n" and err.startswith("after 1\nafter 2\nTraceback"), out + err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    rc, out, _ = warm.run(fast, tmp_path, signal_at=("step 2", signal.SIGUSR1))
    assert (rc, out) == (0, "step 1\nstep 2\nusr1\nstep 3\nstep 4\nstep 5\n")
    assert warm.run(fast, tmp_path, signal_at=("step 9", signal.SIGKILL))[:2] == (0, "step 1\nstep 2\nstep 3\nstep 4\n"
                                                                                   "step 5\n")
