"""``fastio convert`` starts no more loading processes than there are samples to load (``--workers 1000`` for a handful
of images started a thousand processes), and the output stays the one every worker count gives."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastio.convert import run
from fastio.convert.run import ConvertConfig, convert
from fastio.convert.synthetic import make_imagefolder


def _digests(dest: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((dest / "shards").iterdir())}


def test_no_more_workers_than_samples_and_the_same_shards(tmp_path, monkeypatch):
    src = make_imagefolder(tmp_path / "src", classes=1, per_class=3)
    started = []
    real = run._start_pool

    def counted(workers, load_options):  # the real pool, its size noted
        started.append(workers)
        return real(workers, load_options)

    monkeypatch.setattr(run, "_start_pool", counted)
    convert(ConvertConfig(src, tmp_path / "many", workers=64, progress=False))
    convert(ConvertConfig(src, tmp_path / "one", workers=1, progress=False))
    assert started == [3, 1]
    assert _digests(tmp_path / "many") == _digests(tmp_path / "one")
