"""fastio.Loader(..., replicas=manager) under a real torchft lighthouse and Managers on ProcessGroupGloo: every
committed step takes exactly the global batch a one-process Loader gives at that batch, split over the replica groups
of that step's quorum, through a group SIGKILLed and started again (it heals its data position from a peer).

All on loopback: the lighthouse binds 127.0.0.1, each group's TCPStore is on 127.0.0.1, gloo on ``lo``."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import fastio
from fastio.order.replicas import Share
from tests.helpers import rank_process
from tests.torchft_helpers import LOOPBACK, group_store, lighthouse, manager

GLOBAL_BATCH = 6
STEPS = 22  # 48 samples: 8 global batches an epoch, so the run crosses two epoch boundaries
KILL_AT, GATE = 5, 8


def _one_process(dest, steps: int, batch_size: int = GLOBAL_BATCH, **options) -> list[list[int]]:
    """The one-process run's batches 0 .. steps-1, through the epochs."""
    with fastio.Loader(dest, batch_size=batch_size, seed=0, drop_last=True, device="cpu", rank=0, world_size=1,
                       **options) as loader:
        batches = []
        while len(batches) < steps:
            batches += [b["index"].tolist() for b in loader]
        return batches[:steps]


def _group_main(group: int, rank: int, world: int, store_port: int, lighthouse_addr: str, dest: str, log: str,
                gate: str, restarted: bool) -> None:
    """One rank of one replica group: the issue's loop, a line per batch and per commit. From step ``GATE`` on the
    first groups wait for the restarted one to be up (``gate``), so that it comes back before the run ends."""
    os.environ.update(LOOPBACK)
    mgr = manager(store_port, lighthouse_addr, group, rank, world, timeout_s=5)  # a busy machine is not a dead peer
    loader = fastio.Loader(dest, pipeline=fastio.Raw(), batch_size=GLOBAL_BATCH, seed=0, drop_last=True, replicas=mgr,
                           rank=rank, world_size=world)
    if restarted:  # ready to ask for its first quorum (made before: on a busy machine the others could finish first)
        Path(gate).touch()
    it = iter(loader)
    with open(log, "a") as out:
        def write(**record):
            out.write(json.dumps({"group": group, "rank": rank, "pid": os.getpid(), **record}) + "\n")
            out.flush()

        while mgr.current_step() < STEPS:
            while mgr.current_step() >= GATE and not os.path.exists(gate):
                time.sleep(0.02)
            mgr.start_quorum()
            batch = next(it)
            write(event="batch", step=mgr.current_step(), participating=mgr.is_participating(),
                  participants=mgr.num_participants(), prank=mgr.participating_rank(),
                  index=batch["index"].tolist(), padded=batch["padded"].tolist())
            mgr.allreduce(torch.tensor([float(len(batch["index"]))])).wait()
            step = mgr.current_step()
            write(event="commit", step=step, committed=mgr.should_commit())
            time.sleep(0.05)
    loader.close()
    mgr.shutdown(wait=False)


def _records(logs: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(logs.glob("*.jsonl")) for line in f.read_text().splitlines() if line]


def _wait_for(what, deadline: float, procs) -> None:
    while not what():
        assert time.monotonic() < deadline, "the torchft run did not get there in time"
        assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        time.sleep(0.05)


def _run(dest: Path, logs: Path, groups: int, world: int, kill: int, kill_at: int = KILL_AT) -> None:
    """``groups`` replica groups of ``world`` ranks; group ``kill`` SIGKILLed once it took step ``kill_at``'s batch,
    started again once the others committed a step without it."""
    house = lighthouse(min_replicas=groups - 1, join_ms=1000)
    stores = [group_store() for _ in range(groups)]

    def start(g: int, store: TCPStore, restarted: bool = False) -> list:
        procs = [rank_process(_group_main, (g, r, world, store.port, house.address(), str(dest),
                                            str(logs / f"g{g}-r{r}.jsonl"), str(logs / "gate"), restarted))
                 for r in range(world)]
        for p in procs:
            p.start()
        return procs

    procs = {g: start(g, stores[g]) for g in range(groups)}
    everyone = [p for ps in procs.values() for p in ps]
    deadline = time.monotonic() + 90
    try:
        _wait_for(lambda: any(r["group"] == kill and r["event"] == "batch" and r["step"] >= kill_at
                              for r in _records(logs)), deadline, everyone)
        for p in procs[kill]:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        _wait_for(lambda: any(r["event"] == "commit" and r["committed"] and r["step"] > kill_at
                              and _participants(r, _records(logs)) == groups - 1 for r in _records(logs)),
                  deadline, [p for g, ps in procs.items() if g != kill for p in ps])
        stores.append(group_store())
        procs[kill] = start(kill, stores[-1], restarted=True)
        for p in (p for ps in procs.values() for p in ps):
            p.join(max(0.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"a rank ended with {p.exitcode}"
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.is_alive():
                p.kill()
                p.join()
        house.shutdown()


def _participants(commit: dict, records: list[dict]) -> int | None:
    batch = _batch_of(commit, records)
    return batch["participants"] if batch else None


def _batch_of(commit: dict, records: list[dict]) -> dict | None:
    """The batch record a commit record is of: the same process's last batch line before it."""
    same = [r for r in records if r["pid"] == commit["pid"] and r["rank"] == commit["rank"]]
    before = same[:same.index(commit)]
    return next((r for r in reversed(before) if r["event"] == "batch"), None)


def _check(records: list[dict], want: list[list[int]], groups: int, world: int, kill: int) -> None:
    committed = [_batch_of(r, records) for r in records if r["event"] == "commit" and r["committed"]]
    assert sorted({b["step"] for b in committed}) == list(range(STEPS))
    for b in (b for b in committed if b["participating"]):  # each rank's share of its step, as its quorum cut it
        where, _ = Share(b["participants"], b["prank"], b["rank"], world).pick(GLOBAL_BATCH)
        assert b["index"] == want[b["step"]][where], b
    batches = [r for r in records if r["event"] == "batch" and r["participating"]]
    agreed = shrunk = 0
    for step in range(STEPS):
        sizes = {b["participants"] for b in committed if b["step"] == step and b["participating"]}
        if len(sizes) > 1:
            continue  # torchft commits per group: one that timed out may retry a step the others committed
        agreed += 1
        # the shares of the committed quorum, also of a group killed after its gradients went into the allreduce
        taken = [b for b in batches if b["step"] == step and b["participants"] in sizes]
        shares = {(b["prank"], b["rank"]): b["index"] for b in taken}
        assert all(b["index"] == shares[b["prank"], b["rank"]] for b in taken)  # a retry takes the same samples
        assert [i for key in sorted(shares) for i in shares[key]] == want[step], step  # the one-process batch
        assert {p for p, _ in shares} == set(range(min(sizes)))
        shrunk += min(sizes) == groups - 1
    assert agreed >= STEPS - 2 and shrunk >= 1, (agreed, shrunk)  # shrunk: steps the groups left after the kill took
    lives = sorted({r["pid"] for r in records if r["group"] == kill and r["rank"] == 0}, key=lambda pid: next(
        i for i, r in enumerate(records) if r["pid"] == pid))
    again = [r for r in records if r["pid"] == lives[-1] and r["event"] == "batch"]
    assert len(lives) == 2 and not again[0]["participating"] and again[0]["index"] == []  # healing: an empty batch
    back = next(b for b in again if b["participating"])
    assert back["step"] - again[0]["step"] <= 3 and back in committed


@pytest.mark.parametrize("groups,world", [(3, 1), (2, 2)])
def test_every_committed_step_is_the_one_process_batch_through_a_killed_group(tmp_path, image_dataset, groups,
                                                                                world, monkeypatch):
    for key, value in LOOPBACK.items():
        monkeypatch.setenv(key, value)
    logs = tmp_path / "logs"
    logs.mkdir()
    _run(image_dataset, logs, groups, world, kill=groups - 1)
    want = _one_process(image_dataset, STEPS, pipeline=fastio.Raw())
    _check(_records(logs), want, groups, world, kill=groups - 1)


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchft_train.py"


def _example_main(argv: list[str], stderr: str) -> None:
    """``python examples/torchft_train.py ARGV`` in a rank process (its environment from the test's), every address
    it advertises 127.0.0.1 (torchft takes the host name for its manager and checkpoint servers); its stderr goes to
    the file ``stderr``, and SIGUSR1 writes the stacks of all its threads to ``stderr``.stacks."""
    import faulthandler
    import runpy
    import socket
    import sys

    with open(stderr, "a") as out:
        os.dup2(out.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=open(_stacks(stderr), "w"), all_threads=True)
    socket.gethostname = lambda: "127.0.0.1"
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


def _stacks(stderr: str | Path) -> Path:
    return Path(f"{stderr}.stacks")


def _hung_says(stderr: Path) -> str:
    """The stacks a process sent SIGUSR1 writes (waited for, 10 s at most), then the end of its stderr."""
    stacks, until = _stacks(stderr), time.monotonic() + 10
    while not (stacks.exists() and stacks.stat().st_size) and time.monotonic() < until:
        time.sleep(0.1)
    return f"{stacks.read_text() if stacks.exists() else '(no stacks written)'}...\n{stderr.read_text()[-2000:]}"


def _said(stderr: Path) -> str:
    """The example's one line of why it stopped (``torchft_train: ...``) in its stderr, where torchft's own threads
    log too, also after it (the whole stderr's end when there is not exactly one such line)."""
    said = [line for line in stderr.read_text().splitlines() if line.startswith("torchft_train: ")]
    return said[0] if len(said) == 1 else stderr.read_text()[-2000:]


def _start_example(monkeypatch, house, group: int, store: TCPStore, argv: list[str], stderr: Path, **env: str):
    """Replica group ``group`` of the example (one rank, its Manager finding the group's ``store``) on the lighthouse
    ``house``; ``env`` over ``LOOPBACK``."""
    env = {**LOOPBACK, "TORCHFT_LIGHTHOUSE": house.address(), "REPLICA_GROUP_ID": str(group), "RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), **env}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    proc = rank_process(_example_main, (argv, str(stderr)))
    proc.start()
    return proc


def _join_examples(procs: list, stderrs: list[Path], seconds: float) -> None:
    """Wait for the example's groups to end, ``seconds`` in all; one still running then fails the test with the
    stacks of its threads (SIGUSR1) and the end of its stderr, then is killed."""
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [g for g, p in enumerate(procs) if p.is_alive()]
    for g in hung:
        os.kill(procs[g].pid, signal.SIGUSR1)
    said = {g: _hung_says(stderrs[g]) for g in hung}
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, "\n".join(f"group {g} still running after {seconds:.0f} s; its threads and the end of its "
                               f"stderr:\n{said[g]}" for g in hung)


def test_the_example_trains_each_step_on_its_global_batch(tmp_path, image_dataset, monkeypatch):
    house = lighthouse(min_replicas=2, join_ms=1000)
    log = tmp_path / "samples.jsonl"
    argv = ["--data", str(image_dataset), "--steps", "8", "--batch-size", "8", "--image-size", "16", "--timeout",
            "10", "--sample-log", str(log)]
    stores, stderrs = [group_store() for _ in range(2)], [tmp_path / f"g{g}.stderr" for g in range(2)]
    try:
        procs = [_start_example(monkeypatch, house, g, stores[g], argv, stderrs[g]) for g in range(2)]
        _join_examples(procs, stderrs, 90)
    finally:
        house.shutdown()
    assert [p.exitcode for p in procs] == [0, 0], [stderr.read_text()[-2000:] for stderr in stderrs]
    want = _one_process(image_dataset, 8, batch_size=8, pipeline=fastio.Raw())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for step in range(8):
        shares = sorted((r for r in lines if r["step"] == step), key=lambda r: r["group"])
        assert sorted(i for r in shares for i in r["index"]) == sorted(want[step]), step


def test_the_example_stops_on_a_step_that_never_commits(tmp_path, image_dataset, monkeypatch):
    """A group whose process group cannot be built (gloo on an interface that does not exist) fails every try of
    step 0: torchft reports the error, the step does not commit, the lighthouse bumps the quorum for the failure
    and the group reconfigures and fails again. The example ends after ``--max-retries`` more tries, in one line
    naming the step and the error (it used to try step 0 for ever, a new DALI pipeline each time)."""
    house, store, stderr = lighthouse(min_replicas=1), group_store(), tmp_path / "g0.stderr"
    argv = ["--data", str(image_dataset), "--steps", "3", "--batch-size", "8", "--image-size", "16", "--timeout",
            "5", "--max-retries", "2"]
    try:
        proc = _start_example(monkeypatch, house, 0, store, argv, stderr, GLOO_SOCKET_IFNAME="nosuchif0")
        _join_examples([proc], [stderr], 60)
    finally:
        house.shutdown()
    last = _said(stderr)
    assert proc.exitcode == 1, last
    assert last.startswith("torchft_train: step 0 did not commit in 3 tries in a row (--max-retries 2): "), last
    assert "nosuchif0" in last, last


def test_the_example_stops_when_its_step_gets_no_quorum(tmp_path, image_dataset, monkeypatch):
    """A lighthouse waiting for two groups and one group started: step 0's quorum never forms. The example ends
    once ``--quorum-timeout`` has passed, in one line naming the step and the wait (torchft's TimeoutError came out
    as a traceback)."""
    house, store, stderr = lighthouse(min_replicas=2), group_store(), tmp_path / "g0.stderr"
    argv = ["--data", str(image_dataset), "--steps", "3", "--batch-size", "8", "--image-size", "16",
            "--quorum-timeout", "3"]
    try:
        proc = _start_example(monkeypatch, house, 0, store, argv, stderr)
        _join_examples([proc], [stderr], 60)
    finally:
        house.shutdown()
    last = _said(stderr)
    assert proc.exitcode == 1, last
    assert last.startswith("torchft_train: step 0: no quorum within --quorum-timeout 3 s (fewer replica groups "
                           "asked the lighthouse than its --min_replicas): "), last


def _example_alone(warm, env: dict[str, str], *argv: str, seconds: float = 60):
    """``python examples/torchft_train.py ARGV`` as a user starts it by hand (run by the warm interpreter: torch is
    imported already): ``env`` over an environment without torchrun's and torchft's variables."""
    import subprocess

    clean = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE")}
    rc, out, err = warm.run(EXAMPLE, Path.cwd(), *argv, env={**clean, **env}, timeout=seconds)
    return subprocess.CompletedProcess([str(EXAMPLE), *argv], rc, out, err)


def test_the_example_started_without_torchrun_says_so_in_one_line(image_dataset, warm):
    """Found by the integrations review: `python examples/torchft_train.py --data ds/train` (no torchrun) ended in
    torchft's KeyError: 'MASTER_ADDR' traceback; without TORCHFT_LIGHTHOUSE it would be a KeyError too."""
    done = _example_alone(warm, {}, "--data", str(image_dataset))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == ("torchft_train: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, TORCHFT_LIGHTHOUSE not "
                                   "set: start it with torchrun and TORCHFT_LIGHTHOUSE=http://HOST:PORT (see --help)"), \
        done.stderr
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"}
    done = _example_alone(warm, torchrun, "--data", str(image_dataset))
    assert done.returncode == 2 and done.stderr.strip().startswith("torchft_train: TORCHFT_LIGHTHOUSE not set"), \
        done.stderr


def test_the_example_names_a_missing_dataset_before_it_waits_for_torchft(tmp_path, warm):
    """Found by the integrations review: a --data that does not exist was found only after the Manager had connected
    to the group's store, which a store that is not there (a typo in MASTER_PORT) made a silent wait of minutes."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1",
           "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    done = _example_alone(warm, env, "--data", str(tmp_path / "nowhere"), seconds=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"torchft_train: {tmp_path / 'nowhere'}: no such dataset directory", done.stderr


def test_the_example_names_a_dataset_without_labels_before_it_waits_for_torchft(tmp_path, warm):
    """Found by the integrations review: a dataset without labels (a flat image folder converted) ended in torch's
    TypeError traceback (nn.Linear(8, None)) once torchft was up; now one line before torchft starts."""
    from PIL import Image

    from fastio.convert.run import ConvertConfig, convert

    (tmp_path / "flat").mkdir()
    for k in range(8):
        Image.new("RGB", (40, 30), (20 * k, 90, 200)).save(tmp_path / "flat" / f"p{k}.png")
    convert(ConvertConfig(source=tmp_path / "flat", dest=tmp_path / "unlabelled", workers=1, progress=False))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1",
           "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    done = _example_alone(warm, env, "--data", str(tmp_path / "unlabelled"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().startswith(f"torchft_train: {tmp_path / 'unlabelled'}: a dataset without labels"), \
        done.stderr
