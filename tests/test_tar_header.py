"""The shard writer's direct USTAR header is byte for byte tarfile's, for every name and size it may see."""

from __future__ import annotations

import random
import tarfile

import pytest

from fastio.dataset.shards import _member_header


def _tarfile_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uname, info.gname = size, 0o444, 0, "", ""
    return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")


def test_header_equals_tarfiles_for_random_names_and_sizes():
    rng = random.Random(0)
    for _ in range(3000):
        name = "".join(rng.choice("abcXYZ019_-./") for _ in range(rng.randint(1, 180))).strip("/") or "a"
        size = rng.choice([0, 1, 511, 512, 10**6, rng.randint(0, 8**11 - 1), 8**11 - 1])
        assert _member_header(name, size) == _tarfile_header(name, size), (name, size)


@pytest.mark.parametrize(("name", "size"), [("é.jpg", 1), ("a.jpg", 8**11)])
def test_what_tarfile_refuses_is_refused(name, size):
    for make in (_member_header, _tarfile_header):
        with pytest.raises(ValueError):
            make(name, size)
