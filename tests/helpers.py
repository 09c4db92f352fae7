"""Small helpers several test modules share: a stateful holder for checkpoint tests, the CLI in-process, a
WebDataset tar indexed by ``fastio index``, real ranks in processes forked from a server that imported torch once
(``free_port``, ``join_group``, ``spawn_ranks``, ``start_ranks``, ``rank_process``; ``fork_ranks``: from one of them
that did the ranks' other imports once), a rank stopping itself for a while (``stop_for``), Ctrl-C's default
action for a child a test interrupts (``ctrl_c_default``), and a converted dataset without labels (``unlabelled``)."""

import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

from fastio.cli import main


class StateHolder:
    """``state_dict()`` returns the state it holds; ``load_state_dict`` replaces it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


class Position:
    """Per-rank loader-like state (``consumed``) for the multi-rank checkpoint tests."""

    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"version": 1, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """``fastio ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def indexed_tar(folder: Path, samples: dict[str, dict[str, bytes]], capsys) -> Path:
    """``folder`` holding one tar ``0.tar`` of ``samples`` (key -> field -> bytes, members in that order),
    indexed in place by ``fastio index``."""
    folder.mkdir(parents=True)
    with tarfile.open(folder / "0.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for key, fields in samples.items():
            for field, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    code, _, err = run_cli(["index", str(folder), "-q"], capsys)
    assert code == 0, err
    return folder


def rchar() -> int:
    """Bytes this process has read through read(2) and its kin (page cache included), all threads."""
    text = Path("/proc/self/io").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar:")))


def reseal(step: Path) -> None:
    """Recompute the commit marker's checksums, as a consistent (but malicious) checkpoint would have them."""
    import json

    from fastio.checkpoint import naming, record
    from fastio.storage.checksum import digest_file

    marker = step / naming.COMMIT_FILE
    data = json.loads(marker.read_text())
    for rel in data["files"]:
        size, digest = digest_file(step / rel, record.CHECKSUM)
        data["files"][rel] = {"bytes": size, record.CHECKSUM: digest}
    data["bytes"] = sum(f["bytes"] for f in data["files"].values())
    marker.write_text(json.dumps(data))


def restore_dir_of(root: Path, step: int, pid: int) -> Path:
    """A restore's working copy of ``step`` in ``root`` as process ``pid`` of this host marks it (``removal.
    start_restore_dir`` made in that process): ``.step-N.restore-PID``, its mark naming the host, pid and start."""
    import json

    from fastio.checkpoint import naming, removal
    from fastio.dist import process_start

    path = root / f".step-{step}.restore-{pid}"
    os.replace(removal.start_restore_dir(root, step), path)
    (path / naming.RESTORING_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                                          "start": process_start(pid), "time": time.time()}))
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a gloo rendezvous that starts at once: any other
    process may bind it later, see :func:`join_group`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp2_adam(rank: int, port: int, widths: tuple[int, ...]):
    """In a rank process: join a 2-rank gloo group on 127.0.0.1:``port``, then ``(model, optim)``: a Sequential of
    Linear layers of ``widths`` (seeded), every layer and the whole ``fully_shard``, and Adam over it."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def restore_flipped_shard(ckpt, app: dict, rank: int, step_dir: Path, flip: int) -> str | None:
    """In a rank process of :func:`fsdp2_adam`'s group: rank 0 XORs ``flip`` into the middle byte of ``step_dir``'s
    ``__0_0.distcp`` (rank 0's DCP shard, the same size), then every rank asks to restore that step: the error's
    text, None when it restored."""
    import torch.distributed as dist

    from fastio.errors import CheckpointError

    dist.barrier()
    if rank == 0:
        shard = Path(step_dir, "__0_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= flip
        shard.write_bytes(data)
    dist.barrier()
    try:
        ckpt.restore_latest(app, step=int(Path(step_dir).name.split("-")[1]))
    except CheckpointError as err:
        return str(err)
    return None


def join_group(rank: int, world: int, meeting: str | Path, *, timeout: float = 300) -> None:
    """In a rank process: ``dist.init_process_group("gloo")`` of ``world`` ranks on 127.0.0.1, through a TCPStore that
    rank 0 hosts on a port the kernel picks as it binds, published in the file ``meeting`` (new for each group),
    which the other ranks wait for (at most ``timeout`` seconds).

    For a group that starts well after the test did (a second run of the same ranks): a port ``free_port`` picked
    when the test started is free only then, and another process (a gloo listener, another test's server) can bind
    it meanwhile; rank 0 then failed with EADDRINUSE in full-suite runs."""
    from datetime import timedelta

    import torch.distributed as dist

    meeting, minutes = Path(meeting), timedelta(minutes=30)  # torch's own default for a gloo group
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=minutes, wait_for_workers=False)
        part = meeting.with_name(meeting.name + ".part")
        part.write_text(str(store.port))
        os.replace(part, meeting)
    else:
        deadline = time.monotonic() + timeout
        while not meeting.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{meeting}: rank 0 published no port within {timeout} s")
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(meeting.read_text()), world, is_master=False, timeout=minutes)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def stop_for(seconds: float) -> None:
    """Stop this process (SIGSTOP) here and now, for at least ``seconds``: a shell continues it (SIGCONT) that long
    after it has seen it stopped. The stop lands here however slowly the shell starts on a loaded machine (a shell
    that sent SIGSTOP itself, with the rank sleeping meanwhile, stopped it wherever it had got to by then)."""
    pid = os.getpid()
    subprocess.Popen(["sh", "-c", f"while [ -e /proc/{pid} ] && ! grep -q '^State:[[:space:]]*T' /proc/{pid}/status; "
                                  f"do sleep 0.05; done; sleep {seconds}; kill -CONT {pid}"])
    os.kill(pid, signal.SIGSTOP)


# Rank processes are forked from one server process per test process that imported torch once
# (multiprocessing's forkserver), not spawned: a spawned rank spends ~2 s importing torch before its first line.
# The server also imported what nearly every rank imports next, each rank again before (~0.6 s of CPU a rank,
# and as much again for one that makes an optimizer): torch.distributed.tensor (the Checkpointer's first save
# looks for DTensors), DCP and torchsnapshot (the engines), torch._dynamo (a torch.optim optimizer's construction
# imports it), pytest (the test module a rank's function comes from imports conftest, which imports it).
# The server is a fresh interpreter (nothing of pytest's state, no threads of the test process), like a spawned
# rank's; each rank takes the test process's environment and working directory as they are when it starts,
# as a spawned one would (the server's are those of its own start).
RANKS = mp.get_context("forkserver")
RANKS.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
                              "torchsnapshot", "torch._dynamo", "pytest"])


def as_started_here(env: dict[str, str], cwd: str, target: Callable, *args) -> None:
    """In a rank process: the starting process's environment and working directory, then ``target(*args)``."""
    import os

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def rank_process(target: Callable, args: tuple):
    """A process of ``RANKS`` (not started) that runs ``target(*args)`` as if spawned from this process now."""
    import os

    return RANKS.Process(target=as_started_here, args=(dict(os.environ), os.getcwd(), target, *args))


def start_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with ``RANKS``' processes: ``fn(rank, *args)`` in each,
    joined; a rank that fails raises here with its traceback."""
    import os

    mp.start_processes(_rank_as_started_here, args=(dict(os.environ), os.getcwd(), fn, *args), nprocs=nprocs,
                       join=True, start_method="forkserver")


def _rank_as_started_here(rank: int, env: dict[str, str], cwd: str, fn: Callable, *args) -> None:
    as_started_here(env, cwd, fn, rank, *args)


def forked(fn: Callable, *args) -> int:
    """A child of this process running ``fn(*args)`` that exits 0, or 1 with the traceback printed; its pid."""
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def fork_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """In a process of ``start_ranks`` that imported what every rank imports (Lightning: ~2 s of CPU a process), the
    ranks forked from it: ``fn(rank, *args)`` in each, joined; a rank that fails prints its traceback, the others
    are killed then, and this raises naming it (``start_ranks`` then raises here)."""

    from warm_python import ready_to_fork, wait_forked

    ready_to_fork()
    pids = [forked(fn, rank, *args) for rank in range(nprocs)]
    failed = {rank: code for rank, code in enumerate(wait_forked(pids)) if code != 0}
    assert not failed, f"ranks failed (rank: exit code): {failed}"


def spawn_ranks(target: Callable, args_of: Callable[[int], tuple], world: int, timeout: float) -> None:
    """Run ``target(*args_of(rank))`` in ``world`` rank processes (``rank_process``); fail naming the ranks still
    running after ``timeout`` seconds in all (killed first): a hang is a failure, never a stuck suite."""
    procs = [rank_process(target, args_of(r)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"


def ctrl_c_default() -> None:
    """``preexec_fn`` of a child a test sends SIGINT (Ctrl-C): SIGINT's default action, as from a terminal, even
    where pytest runs as a shell's background job (which inherits SIGINT ignored: Python would then install no
    handler, and the child would run on as if never interrupted)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def unlabelled(tmp_path: Path) -> Path:
    """``tmp_path/unlabelled``: a flat folder of 12 images (no class folders) converted: a dataset without labels."""
    from PIL import Image

    from fastio.convert.run import ConvertConfig, convert

    (tmp_path / "flat").mkdir()
    for k in range(12):
        Image.new("RGB", (40, 30), (20 * k, 90, 200)).save(tmp_path / "flat" / f"p{k}.png")
    convert(ConvertConfig(source=tmp_path / "flat", dest=tmp_path / "unlabelled", workers=1, progress=False))
    return tmp_path / "unlabelled"
