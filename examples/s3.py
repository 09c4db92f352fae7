"""examples/s3.py: a dataset and checkpoints on object storage (docs/storage.md).

    python examples/s3.py s3://bucket/prefix [IMAGES]

Converts IMAGES (an image folder; default: a small generated one) into s3://bucket/prefix/data, reads the
train split through the node-local cache, trains a few steps with checkpoints in s3://bucket/prefix/ckpt,
then restores the newest one in a new Checkpointer. The endpoint and credentials come from where the AWS
tools look (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ..., ~/.aws); the cache from FASTIO_CACHE_DIR, else
XDG_CACHE_HOME/fastio, else ~/.cache/fastio. tests/test_docs.py runs it against a local moto S3 server.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import fastio

if sys.argv[1:] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
if not 2 <= len(sys.argv) <= 3 or not sys.argv[1].startswith("s3://"):
    given = f"{sys.argv[1]}: not an s3:// URL; " if len(sys.argv) > 1 else ""
    print(f"s3.py: error: {given}usage: python examples/s3.py s3://bucket/prefix [IMAGES]", file=sys.stderr)
    sys.exit(2)
prefix = sys.argv[1].rstrip("/")
with tempfile.TemporaryDirectory() as tmp:
    images = sys.argv[2] if len(sys.argv) > 2 else None
    if images is None:
        from fastio.convert.synthetic import make_imagefolder

        images = str(make_imagefolder(Path(tmp, "images"), classes=4, per_class=16, seed=0))
    # The CLI, as a user would run it: written to a local staging dir, then uploaded, manifests last.
    converted = subprocess.run([sys.executable, "-m", "fastio.cli", "convert", images, f"{prefix}/data",
                                "--split", "train=0.8,val=0.2", "--quiet", "--overwrite"])
if converted.returncode:  # the CLI has said why in one line (a bucket that does not exist, ...)
    sys.exit(converted.returncode)

# Ctrl-C or a fastio error (a bucket that does not exist, ...): one line, no traceback. The Checkpointer's exit
# waits for a write in flight first.
with fastio.exit_cleanly(resume="run it again: it converts and trains afresh"):
    loader = fastio.Loader(f"{prefix}/data/train", batch_size=8, device="cpu", pipeline=fastio.ImageTrain(size=32),
                           seed=0, cache_size="1GB")                 # shards are fetched into the node-local cache
    classes = loader.dataset.classifier_outputs()                  # no labels: one line naming the dataset
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    app = {"model": model, "optim": optimizer, "loader": loader}

    with fastio.Checkpointer(f"{prefix}/ckpt", every_steps=4, keep=2) as ckpt:
        step = 0
        for batch in loader:                                  # one epoch
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ckpt.maybe_save(step, app)
        ckpt.save(step, app, blocking=True)
    print(f"trained {step} steps; storage: {loader.stats()['storage']}")
    loader.close()

    # A new run (another node, a requeued job) restores the newest checkpoint from the store.
    model2 = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, classes))
    fresh = {"model": model2, "optim": torch.optim.SGD(model2.parameters(), lr=0.01),
             "loader": fastio.Loader(f"{prefix}/data/train", batch_size=8, device="cpu",
                                     pipeline=fastio.ImageTrain(size=32), seed=0)}
    with fastio.Checkpointer(f"{prefix}/ckpt") as ckpt:
        state = ckpt.restore_latest(fresh)
    fresh["loader"].close()
    assert state is not None and state.step == step, state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    print(f"restored step {state.step} from {prefix}/ckpt")
