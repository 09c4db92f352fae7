"""`make demo`: the whole fastio story on a small dataset that fastio generates itself.

    python examples/demo.py OUT

OUT is made (or, made by an earlier demo, replaced: it holds a .fastio-demo file, or exactly the raw/, data/ and
ckpt/ folders a demo made before that file existed); a folder that holds anything else is refused, never deleted.

1. generate a 4-class image folder (deterministic, no download) under OUT/raw;
2. `fastio convert` it into shards with a train/val split, `fastio verify --decode`, `fastio inspect --order`;
3. iterate the train split with the Loader and print throughput and the data-stall fraction;
4. train a small CNN with Loader + Checkpointer twice: once straight through, once interrupted by SIGUSR1
   part-way and resumed with the same command, and check that both end with bitwise equal weights.
Exits non-zero when any step fails.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FASTIO = [sys.executable, "-m", "fastio.cli"]
DEMO_MARK = ".fastio-demo"
"""The file in OUT that says an earlier demo made it: only such a folder (or an empty one) is replaced."""


def run(cmd: list[str], shown: list[str]) -> None:
    print(f"\n$ {shlex.join(shown)}", flush=True)
    rc = subprocess.run(cmd).returncode
    if rc:
        raise SystemExit(f"demo: `{shlex.join(shown)}` exited with {rc}")


def fastio(*args: str) -> None:
    run([*FASTIO, *args], ["fastio", *args])


def load(dest: Path) -> None:
    from fastio import ImageTrain, Loader

    print(f"\n# one epoch of {dest} through the Loader (ImageTrain, 64 px)", flush=True)
    with Loader(dest, batch_size=32, pipeline=ImageTrain(size=64), device="auto", seed=0) as loader:
        shape = None
        for batch in loader:
            shape = tuple(batch["image"].shape)
        s = loader.stats()["last_epoch"]
        print(f"load: {s['samples']} samples in {s['batches']} batches of {shape} on {loader.device}: "
              f"{s['samples_per_s']:.0f} samples/s, data stall {100 * s['stall_fraction']:.1f}% "
              "(this loop does no training work, so nearly all of its time is spent waiting for data)",
              flush=True)


def next_steps(data: Path, out: Path) -> str:
    """What to try after the demo: the commands, with this run's paths."""
    return (f"\nNext, try the CLI and the quickstart training loop on the demo's dataset:\n"
            f"  source .venv/bin/activate        # puts `fastio` on your PATH\n"
            f"  fastio inspect {data / 'train'}\n"
            f"  python examples/quickstart.py {data} {out / 'quickstart-ckpt'}\n"
            f"Then your own data: README.md, \"Your own data in 5 minutes\".")


OLD_OUT = {"raw", "data", "ckpt", "quickstart-ckpt"}
"""What a demo wrote in OUT before :data:`DEMO_MARK` existed (24ab31f to 40a488d): the image folder, its
conversion, train.py's checkpoints, and the quickstart's that its closing hint makes."""


def made_by_an_older_demo(out: Path) -> bool:
    """Whether ``out`` holds exactly what a demo older than :data:`DEMO_MARK` wrote, by name, and nothing else:
    ``raw/`` (4 class folders of ``<class>_NNNN.jpg``), ``data/`` (their conversion into train and val),
    ``ckpt/`` (train.py's two runs: ``uninterrupted/`` and ``interrupted/``) and ``quickstart-ckpt/``, each of
    ``step-N`` folders. Anything more (a file of the user's) and it is not."""
    from fastio.convert.synthetic import class_name

    def only(folder: Path, allowed) -> bool:  # a real folder whose entries are all allowed (a name or a test)
        if folder.is_symlink() or not folder.is_dir():
            return False
        test = allowed if callable(allowed) else allowed.__contains__
        return all(test(p.name) and not p.is_symlink() for p in folder.iterdir())

    classes = [class_name(label) for label in range(4)]
    splits = [out / "data" / split for split in ("train", "val")]
    checkpoints = [out / "ckpt" / "uninterrupted", out / "ckpt" / "interrupted", out / "quickstart-ckpt"]
    return (only(out, OLD_OUT) and (out / "raw").is_dir()
            and only(out / "raw", classes)
            and all(only(out / "raw" / c, re.compile(rf"{c}_00[0-6]\d\.jpg").fullmatch) for c in classes
                    if (out / "raw" / c).exists())
            and (not (out / "data").exists() or only(out / "data", {".fastio-lock", ".fastio-output",
                                                                    "splits.json", "train", "val"}))
            and all(only(split, {"manifest.json", "samples.fxi", "shards"}) for split in splits if split.exists())
            and all(only(split / "shards", re.compile(r"shard-\d{6}\.(tar|idx)").fullmatch) for split in splits
                    if (split / "shards").exists())
            and (not (out / "ckpt").exists() or only(out / "ckpt", {"uninterrupted", "interrupted"}))
            and all(only(ckpt, re.compile(r"\.fastio-lock|step-\d+").fullmatch) for ckpt in checkpoints
                    if ckpt.exists()))


def fresh_out(out: Path) -> None:
    """Make ``out`` an empty folder holding only :data:`DEMO_MARK`: a new one, an empty one, or one an earlier demo
    made (replaced); SystemExit (exit 2) in one line for anything else, which may hold the only copy of someone's
    files."""
    old = out.is_dir() and not (out / DEMO_MARK).exists() and made_by_an_older_demo(out)
    if out.exists() and not old and not (out / DEMO_MARK).is_file() and (not out.is_dir() or any(out.iterdir())):
        print(f"demo: {out}: exists and was not made by the demo (no {DEMO_MARK} in it); give a new folder, or an "
              "empty one", file=sys.stderr)
        raise SystemExit(2)
    if old or (out / DEMO_MARK).is_file():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARK).write_text("made by examples/demo.py: it replaces this folder when it runs again\n")


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    fresh_out(out)
    from fastio.convert.synthetic import make_imagefolder

    raw = make_imagefolder(out / "raw", classes=4, per_class=64, min_side=64, max_side=160, seed=0)
    print(f"# generated {sum(1 for _ in raw.rglob('*.jpg'))} JPEGs in 4 class folders under {raw}")
    data = out / "data"
    fastio("convert", str(raw), str(data), "--split", "val=0.1", "--shuffle", "--seed", "0",
           "--max-samples-per-shard", "64")
    fastio("verify", str(data), "--decode")
    fastio("inspect", str(data / "train"), "--order", "--batch-size", "32")
    load(data / "train")
    train = ["examples/train.py", "--data", str(data / "train"), "--ckpt-dir", str(out / "ckpt"),
             "--steps", "60", "--every-steps", "10", "--demo-interrupt-at", "37"]
    run([sys.executable, str(HERE / "train.py"), *train[1:]], ["python", *train])
    print("\ndemo: done", flush=True)
    print(next_steps(data, out), flush=True)
    return 0


if __name__ == "__main__":
    from fastio import exit_cleanly

    with exit_cleanly(name="demo", resume="run `make demo` again (it starts over)"):  # Ctrl-C: one line
        sys.exit(main(sys.argv[1:]))
