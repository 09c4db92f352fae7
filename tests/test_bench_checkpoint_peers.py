"""The checkpoint section's peers and windows (bench/checkpoint_peers.py, bench/checkpoint_overhead.py): the minimal
writer is a consistent asynchronous checkpoint, adjacent windows compare a saver's window with its neighbours,
CPU per GiB is user and system time apart, and busy readings travel with the figures they qualify; the phase probe
(bench/checkpoint_phases.py) times each phase of both writers and leaves the library as it found it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from bench.checkpoint import busy_note
from bench.checkpoint_overhead import Window, compare, measure, window
from bench.checkpoint_peers import MinimalWriter, cpu_per_gib, flat_tensors


def test_the_minimal_writer_saves_a_staged_copy_in_one_checked_file_through_buffers_allocated_once(tmp_path):
    state = {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "optim": {"state": {0: {"m": torch.ones(7)}}}}
    writer = MinimalWriter(tmp_path / "ck" / "state.bin")
    writer.save(state)
    buffers = {k: v.data_ptr() for k, v in writer.buffers.items()}
    state["model"]["w"].add_(1)  # the training step after save returned: not in this checkpoint
    writer.wait()
    saved = writer.read()
    assert torch.equal(torch.frombuffer(bytearray(saved["/model/w"]), dtype=torch.float32),
                       torch.arange(1000, dtype=torch.float32))
    writer.save(state)
    writer.wait()
    assert {k: v.data_ptr() for k, v in writer.buffers.items()} == buffers
    assert torch.equal(torch.frombuffer(bytearray(writer.read()["/model/w"]), dtype=torch.float32),
                       torch.arange(1000, dtype=torch.float32) + 1)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["state.bin"]  # renamed into place, no temporary
    assert len(writer.writes) == 2 and len(writer.digests) == 2


def test_the_minimal_writer_refuses_a_file_whose_bytes_changed(tmp_path):
    writer = MinimalWriter(tmp_path / "state.bin")
    writer.save({"t": torch.zeros(64)})
    writer.wait()
    raw = bytearray(writer.path.read_bytes())
    raw[3] ^= 0xFF
    writer.path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="tensor '/t' does not match its xxh3-128"):
        writer.read()


def test_flat_tensors_finds_every_tensor_of_a_nested_state():
    state = {"a": torch.zeros(1), "b": [torch.ones(2), {"c": torch.ones(3)}], "lr": 0.1, "step": (1, torch.ones(4))}
    assert [(k, t.numel()) for k, t in flat_tensors(state)] == [("/a", 1), ("/b/0", 2), ("/b/1/c", 3),
                                                                ("/step/1", 4)]


def test_a_window_is_compared_with_the_mean_of_its_neighbours():
    before = Window(wall=10.0, cpu=9.0, wait=0.5, save_s=0.0, finish_s=0.0, steps=[1.0] * 10)
    after = Window(wall=12.0, cpu=9.5, wait=1.5, save_s=0.0, finish_s=0.0, steps=[1.2] * 10)
    ours = Window(wall=11.55, cpu=9.5, wait=1.5, save_s=0.05, finish_s=0.2, steps=[1.13] * 10)
    got = compare(ours, before, after)
    assert got["ratio"] == pytest.approx(11.55 / 11.0)  # a drift from 10 to 12 s cancels: +5%, not +15% or -4%
    assert got["blocked"] == pytest.approx(0.25) and got["save_call"] == pytest.approx(0.05)
    assert got["cpu"] == pytest.approx(0.25) and got["wait"] == pytest.approx(0.5)
    assert got["off_cpu"] == pytest.approx((11.55 - 9.5 - 1.5) - (11.0 - 9.25 - 1.0))
    assert got["slowed"] == pytest.approx(11.3 - 10 * 1.1)  # the median step of the neighbours: 1.1


class _Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def save(self, step: int) -> None:
        self.calls.append(f"save {step}")
        time.sleep(0.02)

    def finish(self) -> None:
        self.calls.append("finish")


def test_a_window_saves_after_its_first_step_and_waits_for_the_write_at_its_end():
    steps: list[int] = []
    saver = _Recorder()
    got = window(None, None, 6, saver, every=3, step_no=[10], step=lambda m, o: steps.append(len(saver.calls)))
    assert saver.calls == ["save 11", "save 12", "finish"]
    assert steps == [0, 1, 1, 1, 2, 2]  # saves after steps 1 and 4 of 6 (K = 3)
    assert got.save_s >= 0.04 and len(got.steps) == 6 and got.wall >= got.save_s
    plain = window(None, None, 4, step=lambda m, o: steps.append(-1))
    assert plain.save_s == plain.finish_s == 0.0 and len(plain.steps) == 4


@pytest.mark.bench
def test_adjacent_windows_end_to_end_at_two_cadences(tmp_path):
    """One round, one saver, K fixed at 2 steps (the cadence rule is test_checkpoint_writer's): every figure the
    section prints is there, with the machine's readings for the round."""
    got = measure(tmp_path / "w", size_mib=48, rounds=1, savers=("minimal",), every=2, factors=(1.0, 4.0))
    assert set(got["cadences"]) == {"1x", "4x"}
    for c in got["cadences"].values():
        row = c["savers"]["minimal"]
        assert c["every"] == 2 and len(row["ratios"]) == 1 and row["ratios"][0] > 0
        assert row["blocked_per_save_s"] >= row["save_call_s"] > 0
        assert set(c["quiet"][0]) == {"before", "during"}


class _TimedWriter:
    """A saver whose background writes report ``write_s`` each (what the windows see)."""

    def __init__(self, write_s: float):
        self.write_s, self.writes, self.saves, self.steps = write_s, [], 0, []

    def save(self, step: int) -> None:
        self.saves += 1
        self.steps.append(step)

    def finish(self) -> None:
        self.writes.append(self.write_s)


@pytest.mark.parametrize("seen, again", [(1.0, True), (0.25, False), (0.05, False)])
def test_a_cadence_whose_writes_took_longer_than_the_calibration_is_measured_again_with_their_time(seen, again):
    """A calibration write of 0.29 s for writes of 1.03 s once made the "1x" cadence every 2 steps instead of 6:
    the windows' own write time now sets K again (once), and the record says so. Shorter writes leave K (a K cut
    to a short write's made every saver wait again); the next cadence's K comes from the longer of the two."""
    from bench.checkpoint_overhead import _cadence
    from bench.model import build

    model, optim = build(1)
    saver = _TimedWriter(seen)
    got, next_write = _cadence(model, optim, {"w": saver}, 1.0, step_s=0.5, write_s=0.2, every=None, args=(1, 1, 0.0),
                               step_no=[1000])
    assert got["write_s"] == (seen if again else 0.2) and got["windows_write_s"] == seen
    assert next_write == max(seen, 0.2)
    assert got["every"] == (2 if again else 1)  # K x 0.5 s >= 1.0 s, or >= 0.2 s
    assert ("recalibrated_from_write_s" in got) is again and got.get("recalibrated_from_write_s", 0.2) == 0.2
    assert saver.saves == (2 if again else 1) and len(got["savers"]["w"]["ratios"]) == 1


def test_the_step_numbers_saved_rise_across_cadences():
    """Each cadence's windows go on from the step the one before saved last: a Checkpointer given a step below its
    last commit warns that it superseded the later ones (and the bench timed that bookkeeping)."""
    from bench.checkpoint_overhead import _cadence
    from bench.model import build

    model, optim = build(1)
    saver, step_no = _TimedWriter(0.01), [1000]
    for factor in (4.0, 1.0):
        _cadence(model, optim, {"w": saver}, factor, step_s=0.01, write_s=0.01, every=2, args=(2, 1, 0.0),
                 step_no=step_no)
    assert len(saver.steps) == 4 and saver.steps == sorted(set(saver.steps)) and saver.steps[0] > 1000


def test_cpu_per_gib_counts_user_and_system_time_apart(tmp_path):
    got = cpu_per_gib(tmp_path, size_mib=48, saves=1, savers=("minimal",))
    row = got["savers"]["minimal"]
    assert 0.04 < got["gib"] < 0.06
    assert row["user_s_per_gib"] >= 0 and row["sys_s_per_gib"] >= 0
    assert row["user_s_per_gib"] + row["sys_s_per_gib"] > 0  # copying and writing 48 MiB costs something
    assert list(Path(tmp_path).iterdir()) == []  # its files are gone


def test_a_figure_measured_while_busy_carries_the_note():
    quiet = {"busy": False, "others": 0.1, "cores": 2, "load": 0.5, "waited_s": 3.0}
    busy = {"busy": True, "others": 1.4, "cores": 2, "load": 3.0, "waited_s": 60.0}
    assert busy_note({"before": quiet, "during": quiet}) == ""
    rounds = [{"before": quiet, "during": quiet}, {"before": busy, "during": quiet}]
    assert busy_note(rounds) == " [machine busy: other processes used 1.40 of 2 cores, load 3.0, went on after " \
                                "waiting 60 s]"


def test_bench_run_hands_the_checkpoint_section_its_quiet_wait_and_a_small_size():
    import bench.checkpoint
    import bench.index
    from bench.run import parser, section_options

    args = parser().parse_args(["--only", "checkpoint", "--quiet-wait", "0", "--checkpoint-mib", "48"])
    assert section_options(bench.checkpoint, args) == {"quiet_wait": 0.0, "size_mib": 48, "cadence_mib": 48}
    assert section_options(bench.checkpoint, parser().parse_args([])) == {"quiet_wait": 60.0}
    assert section_options(bench.index, args) == {}  # its run() takes neither


def test_the_phase_probe_times_both_writers_phases_and_unwraps_what_it_wrapped(tmp_path):
    import bench.checkpoint_peers as peers
    from bench.checkpoint_phases import phases
    from fastio.checkpoint import publish, retention

    before = (publish.commit, retention.expire, peers.os)
    got = phases(tmp_path / "work", size_mib=48, rounds=1)
    fastio, minimal = got["fastio"], got["minimal"]
    for key in ("stage_wall", "engine_wall", "engine_cpu", "commit_wall", "files_wall", "marker_wall",
                "retention_wall", "total_wall", "total_cpu"):
        assert fastio[key] > 0, (key, fastio)
    assert fastio["total_wall"] >= fastio["engine_wall"] + fastio["commit_wall"]
    assert minimal["fsync_wall"] > 0 and minimal["rename_wall"] > 0 and minimal["total_wall"] >= minimal["fsync_wall"]
    assert (publish.commit, retention.expire, peers.os) == before
    assert not (tmp_path / "work").exists()
