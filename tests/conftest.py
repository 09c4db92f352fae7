"""Shared fixtures: tiny synthetic data built in tmp_path, the `gpu` marker's skip rule, and the order the files run in
(the slowest first: SLOW_FILES)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from fastio.convert.synthetic import CLASS_NAMES, make_imagefolder
from fastio.dataset.manifest import MANIFEST_NAME
from fastio.dataset.shards import ShardWriter


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The files that take longest (real ranks, trainers, example runs: tens of seconds each, measured), heaviest
# first. They run before every other file, so that `make test`'s three xdist workers (--dist loadfile
# --no-loadscope-reorder: files handed out in this order) end on short files and finish together, instead of
# one idling while the other runs a long file handed out last (xdist's default order puts files with few
# tests, these ones, last).
SLOW_FILES = (  # seconds of each, summed over its tests (setup included) in one `make test` run on the 2-core
    # machine with other work running (Dec 7 2026, 17:28 UTC: 3208 tests, 1284 s of tests in 472 s with three
    # workers; about 1.9x a quiet run's seconds); every file of 9 s or more
    "test_docs.py",  # 88
    "test_checkpoint_s3.py",  # 57
    "test_accelerate.py",  # 44
    "test_media_dist.py",  # 43
    "test_lightning.py",  # 31
    "test_torchft.py",  # 29: its example's refusals run by the warm interpreter
    "test_checkpoint_resume.py",  # 28: its unlabelled-dataset refusal run by the warm interpreter
    "test_mixture.py",  # 28
    "test_convert.py",  # 27
    "test_lightning_resume.py",  # 25
    "test_checkpoint_readonly.py",  # 24: its trainer and reader processes started by the warm interpreter
    "test_newcomer.py",  # 24
    "test_index.py",  # 23
    "test_torchft_loader.py",  # 23
    "test_checkpoint.py",  # 23
    "test_tokens_index_integrity.py",  # 23
    "test_checkpoint_waiting.py",  # 23: its slow-ranks test saves 6 times, not 10
    "test_training_example_flags.py",  # 22
    "test_checkpoint_torchsnapshot_slabs.py",  # 22
    "test_checkpoint_agree.py",  # 22
    "test_checkpoint_rollback.py",  # 21
    "test_storage_cli.py",  # 20
    "test_kill.py",  # 19
    "test_workers.py",  # 18
    "test_checkpoint_dist.py",  # 18
    "test_cache.py",  # 18
    "test_vlm_example.py",  # 17
    "test_media_fallback.py",  # 17
    "test_image_text_s3.py",  # 16
    "test_checkpoint_compression.py",  # 16
    "test_storage_lease.py",  # 15
    "test_checkpoint_ranks.py",  # 15
    "test_architecture.py",  # 15
    "test_loader_errors.py",  # 15
    "test_tokens_s3_source.py",  # 15
    "test_checkpoint_s3_dist.py",  # 14
    "test_warm_python.py",  # 14
    "test_chat_convert.py",  # 14
    "test_working_set.py",  # 13
    "test_loader_resume.py",  # 13
    "test_media.py",  # 12
    "test_checkpoint_strict.py",  # 12
    "test_storage_stall.py",  # 12
    "test_tokens_read.py",  # 12
    "test_chat_loader.py",  # 11
    "test_checkpoint_fsdp.py",  # 11
    "test_image_text_load.py",  # 10
    "test_convert_bad_sources.py",  # 10
    "test_storage.py",  # 9
    "test_tokens_index_ids.py",  # 9
    "test_bench_checkpoint_peers.py",  # 9
)


def _slow_first(items: list) -> None:
    """Reorder ``items`` in place: the files of SLOW_FILES first, in that order, then the rest as collected (a
    file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


def pytest_collection_modifyitems(config, items):
    _slow_first(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_image_dataset(dest: Path, src: Path, *, max_samples: int = 16) -> Path:
    """Pack an image folder into a fastio dataset with the shard writer (no converter involved)."""
    classes = sorted(p.name for p in src.iterdir())
    with ShardWriter(dest, max_samples=max_samples) as writer:
        for path in sorted(src.rglob("*.jpg")):
            label = classes.index(path.parent.name)
            writer.write({"__key__": f"{path.parent.name}/{path.stem}", "jpg": path.read_bytes(),
                          "cls": str(label).encode()})
        writer.close(image_field="jpg", label_field="cls", label_map={c: i for i, c in enumerate(classes)},
                     converted_from={"format": "imagefolder", "path": str(src)}, skipped=[])
    return dest


@pytest.fixture(scope="session")
def _image_originals(tmp_path_factory) -> tuple[Path, Path]:
    """The image folder and its dataset, made once per test process; tests get copies (they may change them)."""
    base = tmp_path_factory.mktemp("image-originals")
    folder = make_imagefolder(base / "src", classes=len(CLASS_NAMES), per_class=12)
    return folder, write_image_dataset(base / "ds", folder)


@pytest.fixture
def image_folder(tmp_path, _image_originals) -> Path:
    """4 classes x 12 JPEGs of 48..96 px, in ImageNet layout (a copy of this process's originals)."""
    return Path(shutil.copytree(_image_originals[0], tmp_path / "src"))


@pytest.fixture
def image_dataset(tmp_path, image_folder, _image_originals) -> Path:
    """The image folder above as a fastio dataset: 48 samples in 3 shards of 16 (a copy of this process's
    original whose manifest names ``image_folder`` as its source: the bytes ``write_image_dataset`` writes)."""
    folder, dataset = _image_originals
    dest = Path(shutil.copytree(dataset, tmp_path / "ds"))
    manifest = dest / MANIFEST_NAME
    text = manifest.read_text()
    assert text.count(json.dumps(str(folder))) == 1, text
    manifest.write_text(text.replace(json.dumps(str(folder)), json.dumps(str(image_folder))))
    return dest


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 server (moto) on 127.0.0.1 for the whole test session."""
    from s3server import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(moto_server, request) -> str:
    """A fresh bucket on the moto server; its name."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", f"t-{request.node.name.lower()}")[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    moto_server.create_bucket(name)
    return name


@pytest.fixture
def fault_proxy(moto_server):
    """A fault-injecting proxy in front of the moto server (set its rates in the test)."""
    from s3server import FaultProxy

    proxy = FaultProxy(moto_server.port, seed=11)
    yield proxy
    proxy.stop()


@pytest.fixture
def aws_env(monkeypatch, moto_server, tmp_path):
    """Credentials, region and endpoint of the moto server where the AWS tools look (nothing on the command
    lines), and a cache dir in tmp_path."""
    from s3server import ACCESS_KEY, REGION, SECRET_KEY

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("FASTIO_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def warm():
    """A warm interpreter (``tests/warm_python.py``): ``warm.run(script, cwd, *args)`` is ``python script *args``
    in a child forked from a process that imported torch and DALI once; ``(exit code, stdout, stderr)``. The
    environment is this process's when the fixture started: a run that needs another starts a fresh python."""
    from warm_python import WarmPython

    runner = WarmPython()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def warm_one_thread():
    """``warm``'s interpreter with ``OMP_NUM_THREADS=1`` from its start: the runs of training scripts a test runs
    with one thread each (tests/resume.py's ``killed_and_resumed``)."""
    from warm_python import WarmPython

    runner = WarmPython(env={"OMP_NUM_THREADS": "1"})
    yield runner
    runner.close()


@pytest.fixture
def one_thread():
    """One torch thread for a tiny model trained in the test process (two would busy-wait on a shared core)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """Checkpointers that are never closed would leave their flag-only handlers in the pytest process."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class Lines(logging.Handler):
    """A logging handler keeping each record's message (tests reading what fastio logged)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def token_ds(tmp_path_factory) -> Path:
    """A token dataset of 60 documents of 1..40 tokens (end-of-document id 0), indexed in place."""
    from fastio.convert.token_index import TokenIndexConfig, index_tokens
    from fastio.formats.megatron import MegatronWriter

    dest = tmp_path_factory.mktemp("tokens") / "ds"
    dest.mkdir()
    rng = np.random.default_rng(0)
    writer = MegatronWriter(str(dest / "part-000.bin"), "uint16")
    for _ in range(60):
        writer.add(np.r_[rng.integers(1, 1000, int(rng.integers(0, 40))), 0])
    writer.close()
    index_tokens(TokenIndexConfig(dest, eos_id=0))
    return dest


@pytest.fixture(scope="module")
def image_ds(tmp_path_factory) -> Path:
    """6 solid-colour PNGs of 40 x 30 in two classes, converted."""
    from PIL import Image

    from fastio.convert.run import ConvertConfig, convert

    root = tmp_path_factory.mktemp("images")
    for k in range(6):
        (root / "src" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), (40 * k, 90, 200)).save(root / "src" / f"c{k % 2}" / f"p{k}.png")
    convert(ConvertConfig(source=root / "src", dest=root / "ds", workers=1, progress=False))
    return root / "ds"
