"""A graph with DALI's conditionals (``GraphDef.conditionals``: per-sample ``if``, as ``VideoClips``' still images)
leaves nothing in the temporary directory, even when its process is killed: DALI's autograph writes each converted
function's source to ``<tempdir>/__autograph_generated_file<random>.py`` and removes it only at the interpreter's exit
(before: two such files left in ``/tmp`` by every build of a process that was killed; 3,238 of them on this machine).
Now the build writes them in a directory of its own (``fastio-autograph-<pid>-<random>``), deleted once the build is
done, and the next build deletes what a kill during a build left. Real DALI builds in fresh processes, ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = '''
import sys, time
import numpy as np
from fastio.pipelines.base import GraphDef, build_graph

def body(inputs, dev):
    x, flag = inputs["x"], inputs["flag"]
    if flag:
        out = x + 1
    else:
        out = x - 1
    return {"out": out}

def source():
    return [np.arange(3, dtype=np.int32)] * 2, [np.array(True), np.array(False)]

g = GraphDef(inputs=(("x", "int32"), ("flag", "bool")), feed=None, body=body, outputs=None, problem=None,
             conditionals=True)
built = build_graph(g, source, batch_size=2, num_threads=1, device="cpu", device_id=None, prefetch=1)
print("built", [np.array(t).tolist() for t in built.pipe.run()[0]], flush=True)
if sys.argv[1:] == ["wait"]:
    time.sleep(120)
'''


def _child(tmp_path: Path, tmpdir: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "conditional_graph.py"  # a file: autograph reads the body's source
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmpdir)})


def test_a_process_killed_after_its_build_leaves_nothing_in_the_temporary_directory(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    child = _child(tmp_path, tmpdir, "wait")
    try:
        line = child.stdout.readline()
        assert line.startswith("built [[1, 2, 3], [-1, 0, 1]]"), line  # each sample took its branch
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in tmpdir.rglob("*")) == []


def test_the_next_build_deletes_what_a_kill_during_a_build_left_and_nothing_else(tmp_path):
    tmpdir = tmp_path / "tmp"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has ended
    left = {name: tmpdir / name for name in (f"fastio-autograph-{dead}-a1", f"fastio-autograph-{dead}-b2",
                                             f"fastio-autograph-{dead}-d4", f"fastio-autograph-{os.getpid()}-c3",
                                             "other-dir")}
    for path in left.values():
        path.mkdir(parents=True)
        (path / "__autograph_generated_filexyz.py").write_text("x = 1\n")
    kept = left[f"fastio-autograph-{dead}-d4"] / "tmpq8x.bin"  # another thread's temporary file, made in a build
    kept.write_bytes(b"maybe the only copy")
    old = time.time() - 600
    for name in (f"fastio-autograph-{dead}-a1", f"fastio-autograph-{dead}-d4", f"fastio-autograph-{os.getpid()}-c3",
                 "other-dir"):
        os.utime(left[name], (old, old))  # the -b2 one just changed: maybe another pid namespace's build
    child = _child(tmp_path, tmpdir)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.startswith("built [[1, 2, 3], [-1, 0, 1]]"), out
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted(
        [f"fastio-autograph-{dead}-b2", f"fastio-autograph-{dead}-d4", f"fastio-autograph-{os.getpid()}-c3",
         "other-dir"])
    assert [p.name for p in kept.parent.iterdir()] == [kept.name] and kept.read_bytes() == b"maybe the only copy"
