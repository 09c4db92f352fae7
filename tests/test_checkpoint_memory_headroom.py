"""How much of a rank's files a restore reads into memory of its own (``Restorer._owners``: when they fit in half of
the memory available) counts a container's memory limit: the held files are anonymous memory (not page cache, which
the kernel could drop), so past the cgroup's limit they would bring the OOM killer, which ``MemAvailable`` (the
host's) does not see. The cgroup files as a container sees its own at ``/sys/fs/cgroup``, v2 and v1, written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastio.checkpoint.restore import cgroup_headroom

MiB = 1 << 20


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_headroom_is_the_limit_less_the_usage_plus_the_inactive_file_pages(tmp_path, version):
    files = {"v2": {"memory.max": f"{1024 * MiB}\n", "memory.current": f"{900 * MiB}\n",
                    "memory.stat": f"anon {800 * MiB}\nfile {100 * MiB}\ninactive_file {50 * MiB}\n"},
             "v1": {"memory/memory.limit_in_bytes": f"{1024 * MiB}\n", "memory/memory.usage_in_bytes": f"{900 * MiB}\n",
                    "memory/memory.stat": f"cache {100 * MiB}\ninactive_file 1\ntotal_inactive_file {50 * MiB}\n"}}
    assert cgroup_headroom(_write(tmp_path, files[version])) == (1024 - 900 + 50) * MiB


@pytest.mark.parametrize("files", [{"memory.max": "max\n", "memory.current": "5\n", "memory.stat": ""},
                                   {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                    "memory/memory.usage_in_bytes": "5\n", "memory/memory.stat": ""},
                                   {}], ids=["v2-no-limit", "v1-no-limit", "no-cgroup"])
def test_no_limit_or_no_cgroup_leaves_memavailable_alone(tmp_path, files):
    assert cgroup_headroom(_write(tmp_path, files)) is None


def test_a_cgroup_over_its_limit_leaves_no_headroom(tmp_path):
    root = _write(tmp_path, {"memory.max": f"{100 * MiB}", "memory.current": f"{120 * MiB}", "memory.stat": ""})
    assert cgroup_headroom(root) == 0
