"""The checkpoint section's peers, and what a save costs in CPU.

:class:`MinimalWriter` does only what any consistent asynchronous checkpoint must do: copy every tensor into staging
buffers allocated once (before ``save`` returns: the training loop may change the originals next), then on a
background thread xxh3-128 each buffer, write one file, fsync it and rename it into place. Anything a checkpointer
spends beyond it (in blocked time, in the training loop's overhead, in CPU) is the checkpointer's own.

:func:`cpu_per_gib` measures user and system CPU seconds per GiB written, of the whole process (every thread: the
caller's staging, the writer, the engine's executors, the kernel's work for them), over steady saves (buffers
allocated and the files written once before), with the bytes read and written through system calls, for the
Checkpointer with each engine, the minimal writer, and
torch.distributed.checkpoint used directly (``dcp.save``, ``dcp.async_save`` on its thread): where the Checkpointer's
DCP engine costs what plain ``dcp.save`` costs, the cost is DCP's own.

    python -m bench.checkpoint_peers [--size-mib 512] [--saves 3]   # prints the CPU rows as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from bench.model import build, train_step

__all__ = ["CPU_SAVERS", "MinimalWriter", "cpu_per_gib", "flat_tensors"]


def flat_tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a nest of dicts, lists and tuples (other leaves are not state the
    minimal writer keeps: the step counters and hyperparameters of an optimizer are a few bytes)."""
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return []
    return [pair for k, v in items for pair in flat_tensors(v, f"{prefix}/{k}")]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class MinimalWriter:
    """The least a consistent asynchronous checkpoint does: stage into buffers allocated once, then in the
    background hash (xxh3-128), write one file, fsync, rename. One save in flight: ``save`` waits for the last."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.buffers: dict[str, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.writes: list[float] = []
        self.digests: dict[str, str] = {}

    def save(self, state: dict[str, Any]) -> None:
        """Copy every tensor of ``state`` into its buffer, then start the background write."""
        self.wait()
        tensors = flat_tensors(state)
        with torch.no_grad():
            for name, t in tensors:
                buf = self.buffers.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                buf.copy_(t)
        names = [name for name, _ in tensors]
        self.thread = threading.Thread(target=self._write, args=(names,), name="minimal-writer", daemon=True)
        self.thread.start()

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _write(self, names: list[str]) -> None:
        started = time.perf_counter()
        try:
            tmp = self.path.with_name(self.path.name + ".tmp")
            index, offset = [], 0
            with open(tmp, "wb") as f:
                for name in names:
                    data = _bytes_of(self.buffers[name])
                    digest = xxhash.xxh3_128_hexdigest(data)
                    f.write(data)
                    index.append({"name": name, "offset": offset, "bytes": len(data), "xxh3_128": digest})
                    offset += len(data)
                f.write(json.dumps(index).encode() + offset.to_bytes(8, "little"))  # the index, then its offset
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self.digests = {row["name"]: row["xxh3_128"] for row in index}
            self.writes.append(time.perf_counter() - started)
        except BaseException as err:  # noqa: BLE001 - raised by the next save or wait
            self.error = err

    def read(self) -> dict[str, torch.Tensor]:
        """The tensors of the last committed file, each checked against its recorded xxh3-128."""
        raw = self.path.read_bytes()
        end = int.from_bytes(raw[-8:], "little")
        out = {}
        for row in json.loads(raw[end:-8]):
            data = raw[row["offset"]:row["offset"] + row["bytes"]]
            if xxhash.xxh3_128_hexdigest(data) != row["xxh3_128"]:
                raise ValueError(f"{self.path}: tensor {row['name']!r} does not match its xxh3-128")
            out[row["name"]] = data
        return out


# ------------------------------------------------------------------ CPU per GiB written
def _io_chars() -> tuple[int, int]:
    """(bytes read, bytes written) through system calls by this process so far (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _fastio(engine: str) -> Callable[[Path, dict], tuple[Callable[[], None], Callable[[], None]]]:
    def make(root: Path, app: dict) -> tuple[Callable[[], None], Callable[[], None]]:
        from fastio.checkpoint import Checkpointer

        ckpt = Checkpointer(root, keep=1, signals=(), engine=engine)
        step = [0]

        def save() -> None:
            step[0] += 1
            ckpt.save(step[0], app, blocking=True)

        return save, ckpt.close
    return make


def _minimal(root: Path, app: dict) -> tuple[Callable[[], None], Callable[[], None]]:
    writer = MinimalWriter(root / "state.bin")

    def save() -> None:
        writer.save({k: v.state_dict() for k, v in app.items()})
        writer.wait()

    return save, writer.wait


def _dcp(mode: str) -> Callable[[Path, dict], tuple[Callable[[], None], Callable[[], None]]]:
    """Plain DCP: ``dcp.save``, or ``dcp.async_save`` on its own thread, each save into a new directory and the one
    before it removed (as the Checkpointer's keep=1 does)."""
    def make(root: Path, app: dict) -> tuple[Callable[[], None], Callable[[], None]]:
        import torch.distributed.checkpoint as dcp

        n = [0]

        def save() -> None:
            n[0] += 1
            sd = {k: v.state_dict() for k, v in app.items()}
            where = str(root / str(n[0]))
            if mode == "save":
                dcp.save(sd, checkpoint_id=where, no_dist=True)
            else:
                dcp.async_save(sd, checkpoint_id=where, no_dist=True).result()
            shutil.rmtree(root / str(n[0] - 1), ignore_errors=True)

        return save, lambda: None
    return make


CPU_SAVERS: dict[str, Callable[[Path, dict], tuple[Callable[[], None], Callable[[], None]]]] = {
    "fastio:torchsnapshot": _fastio("torchsnapshot"),
    "fastio:dcp": _fastio("dcp"),
    "minimal": _minimal,
    "dcp.save": _dcp("save"),
    "dcp.async_save": _dcp("async_save"),
}
"""The savers :func:`cpu_per_gib` measures: name -> (root, app) -> (one blocking save, close)."""


def cpu_per_gib(work: Path, size_mib: int = 512, saves: int = 3, savers: tuple[str, ...] = tuple(CPU_SAVERS)) -> dict:
    """Per saver: user and system CPU seconds of the whole process per GiB of state, medians over ``saves`` steady
    saves (each a blocking save: staging, write, fsync, commit), after one untimed save; and the GiB it read and
    wrote through system calls per GiB of state (``/proc/self/io``: a commit that reads its files back shows here)."""
    model, optim = build(size_mib)
    train_step(model, optim)
    app = {"model": model, "optim": optim}
    gib = sum(t.numel() * t.element_size() for _, t in flat_tensors({k: v.state_dict() for k, v in app.items()}))
    gib /= 2**30
    rows = {}
    for name in savers:
        root = work / name.replace(":", "_")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        save, close = CPU_SAVERS[name](root, app)
        save()  # warm: buffers allocated, libraries imported, files written once
        user, system, wall, read, written = [], [], [], [], []
        for _ in range(saves):
            t0, w0, io0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), _io_chars()
            save()
            t1, io1 = resource.getrusage(resource.RUSAGE_SELF), _io_chars()
            wall.append(time.perf_counter() - w0)
            user.append((t1.ru_utime - t0.ru_utime) / gib)
            system.append((t1.ru_stime - t0.ru_stime) / gib)
            read.append((io1[0] - io0[0]) / 2**30 / gib)
            written.append((io1[1] - io0[1]) / 2**30 / gib)
        close()
        shutil.rmtree(root, ignore_errors=True)
        rows[name] = {"user_s_per_gib": statistics.median(user), "sys_s_per_gib": statistics.median(system),
                      "user": user, "sys": system, "save_s": statistics.median(wall),
                      "read_gib_per_gib": statistics.median(read), "written_gib_per_gib": statistics.median(written)}
    return {"gib": gib, "saves": saves, "savers": rows}


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.checkpoint_peers``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--saver", action="append", choices=sorted(CPU_SAVERS), default=None)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "peers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    res = cpu_per_gib(args.workdir, args.size_mib, args.saves, tuple(args.saver or CPU_SAVERS))
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
