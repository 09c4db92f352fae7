"""Train a small CNN on a fastio dataset with exact resume: Loader + Checkpointer, torchrun-ready.

    python examples/train.py --data demo-out/data/train --ckpt-dir ckpt --steps 200 --every-steps 20
    torchrun --nproc-per-node 2 examples/train.py --data ... --ckpt-dir ... --resume auto

A run killed at any step and started again with the same command (``--resume auto``, the default)
ends with the same weights, bit for bit, as a run that was never interrupted (CPU, same world size).
SIGUSR1/SIGTERM make it save at the next step and exit (``--requeue`` also requeues a Slurm job after
SIGUSR1, Slurm's warning; not after SIGTERM alone, what ``scancel`` sends).
The last line printed by rank 0 is ``final weights sha256: <hex>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fastio import Checkpointer, FastioError, ImageTrain, Loader, exit_cleanly


class SmallCNN(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, classes))  # dropout: the RNG matters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def weights_digest(model: nn.Module) -> str:
    """sha256 over every (name, dtype, shape, bytes) of the state dict, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def ordered_allreduce_hook(order: dict[int, int], bucket):
    """DDP gradient averaging whose floating-point result does not depend on the bucket's layout.

    DDP fills its first bucket in parameter order, then, after the first step of every process, rebuilds it in
    the order gradients became ready. A ring all-reduce sums each chunk of the buffer starting at a different
    rank, so with more than two ranks the same gradients summed in another layout differ in the last bits: a
    resumed run (whose first step uses the first layout) would drift from an uninterrupted one. Reducing the
    gradients concatenated in parameter order keeps every element's summation order fixed."""
    params, grads = bucket.parameters(), bucket.gradients()
    ranked = sorted(range(len(params)), key=lambda i: order[id(params[i])])
    flat = torch.cat([grads[i].reshape(-1) for i in ranked]).div_(dist.get_world_size())

    def unpack(fut) -> torch.Tensor:
        pieces = dict(zip(ranked, fut.value()[0].split([grads[i].numel() for i in ranked])))
        return torch.cat([pieces[i] for i in range(len(params))])

    return dist.all_reduce(flat, async_op=True).get_future().then(unpack)


def as_input(image: torch.Tensor) -> torch.Tensor:
    """The Loader's image batch (NCHW, normalised float, or uint8) as float32."""
    return image.float() / 255.0 if image.dtype == torch.uint8 else image.float()


def resume_choice(text: str) -> str:
    if text in ("auto", "none") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(f"expected auto, none or a step number, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="fastio dataset (DEST written by `fastio convert`)")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint directory (shared storage across hosts)")
    p.add_argument("--resume", default="auto", type=resume_choice,
                   help="'auto' (newest committed), 'none', or a step number")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps in all (0: use --epochs)")
    p.add_argument("--epochs", type=int, default=1, help="stop after this many epochs when --steps is 0")
    p.add_argument("--every-steps", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--every-seconds", type=float, default=0.0, help="also checkpoint every N seconds")
    p.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for bitwise resume)")
    p.add_argument("--loader-threads", type=int, default=None, help="DALI threads (default: core count)")
    p.add_argument("--requeue", action="store_true",
                   help="after a preemption save for SIGUSR1 (Slurm's warning; not SIGTERM: scancel), "
                        "scontrol requeue the job")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (to watch or signal a run)")
    p.add_argument("--quiet", action="store_true", help="do not print a line per step")
    p.add_argument("--sample-log", metavar="DIR",
                   help="append 'epoch index' of every sample this rank trains on to DIR/rank-R.HOST.log")
    p.add_argument("--demo-interrupt-at", type=int, metavar="K",
                   help="demo: compare an uninterrupted run with one stopped by SIGUSR1 at step K and resumed "
                        "(runs under CKPT_DIR/uninterrupted and CKPT_DIR/interrupted; exit 1 if weights differ)")
    return p.parse_args(argv)


def setup_distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    rank, world, device = setup_distributed()
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    loader = Loader(args.data, batch_size=args.batch_size, device=device.type, pipeline=ImageTrain(size=args.image_size),
                    seed=args.seed, rank=rank, world_size=world, shuffle="global",
                    num_threads=args.loader_threads)
    classes = loader.dataset.classifier_outputs()  # no labels: a DatasetError naming the dataset
    model = SmallCNN(classes).to(device)
    if world > 1:
        # One bucket and a fixed order inside it: see ordered_allreduce_hook.
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
        model.register_comm_hook({id(p): i for i, p in enumerate(model.parameters())}, ordered_allreduce_hook)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=50, gamma=0.5)
    app = {"model": model, "optim": optim, "sched": sched, "loader": loader}

    hparams = {k: v for k, v in vars(args).items() if k not in ("resume", "quiet", "step_delay", "requeue")}
    ckpt = Checkpointer(args.ckpt_dir, every_steps=args.every_steps, every_seconds=args.every_seconds,
                        keep=args.keep, requeue=args.requeue, hparams=hparams)
    with exit_cleanly(ckpt, loader):  # Ctrl-C: one line naming the saved step, exit 130; no traceback
        start = None
        if args.resume == "none" and ckpt.steps():
            raise SystemExit(f"train.py: {args.ckpt_dir} already holds checkpoints {ckpt.steps()}; "
                             "use a new --ckpt-dir for a fresh run, or --resume auto")
        if args.resume == "auto":
            start = ckpt.restore_latest(app)
        elif args.resume != "none":
            start = ckpt.restore_latest(app, step=int(args.resume))
        step = start.step if start else 0
        if rank == 0:
            print(f"resumed from step {step}" if start else "fresh start", flush=True)

        total, last_loss = args.steps, None
        sample_log = None
        if args.sample_log:
            os.makedirs(args.sample_log, exist_ok=True)
            sample_log = open(os.path.join(args.sample_log, f"rank-{rank}.{socket.gethostname()}.log"), "a")  # noqa: SIM115

        def finished() -> bool:
            return step >= total if total else loader.epoch >= args.epochs

        while not finished():
            before, epoch = step, loader.epoch
            for batch in loader:  # the rest of the current epoch; the Loader moves to the next one by itself
                x = as_input(batch["image"]).to(device)
                y = batch["label"].reshape(-1).to(device)
                if sample_log is not None:
                    sample_log.writelines(f"{epoch} {int(i)}\n" for i, pad in zip(batch["index"], batch["padded"])
                                          if not pad)
                    sample_log.flush()
                loss = nn.functional.cross_entropy(model(x), y)
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                sched.step()
                step += 1
                last_loss = loss.item()
                if rank == 0 and not args.quiet:
                    print(f"step {step} epoch {loader.epoch} loss {last_loss:.6f}", flush=True)
                ckpt.maybe_save(step, app, metrics={"loss": last_loss})
                if ckpt.preempted:
                    if rank == 0:
                        print(f"preempted: saved step {step} to {ckpt.dir}", flush=True)
                    ckpt.close()
                    loader.close()
                    if dist.is_initialized():
                        dist.destroy_process_group()
                    return ckpt.exit_code  # preempted_exit_code (default 0)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if finished():
                    break
            if step == before:
                raise SystemExit(f"train.py: {args.data}: the loader delivered no batch")
        if step:
            ckpt.save(step, app, metrics={"loss": last_loss} if last_loss is not None else None, blocking=True)
        ckpt.close()
        loader.close()
        if rank == 0:
            s = loader.stats()["overall"]
            print(f"loader: {s['samples']} samples at {s['samples_per_s']:.0f} samples/s, "
                  f"data stall {100 * s['stall_fraction']:.1f}% of the training loop's time", flush=True)
            print(f"final weights sha256: {weights_digest(model.module if world > 1 else model)}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def demo_interrupt_resume(argv: list[str], interrupt_at: int) -> bool:
    """The ``make demo`` check: an uninterrupted run, and a run stopped by SIGUSR1 at step ``interrupt_at``
    then resumed with the same command; True when both end with the same weights (printed)."""
    import signal
    import subprocess

    args = parse_args(argv)
    base = [sys.executable, os.path.abspath(__file__), *argv]
    root = args.ckpt_dir.rstrip("/")
    for d in (f"{root}/uninterrupted", f"{root}/interrupted"):
        if os.path.exists(d):
            raise SystemExit(f"train.py: {d} exists; --demo-interrupt-at needs a fresh --ckpt-dir")

    def cmd(sub: str) -> list[str]:
        return [*base, "--ckpt-dir", f"{root}/{sub}", "--quiet"]

    def digest_of(out: str) -> str:
        lines = [ln for ln in out.splitlines() if ln.startswith("final weights sha256: ")]
        if not lines:
            raise SystemExit(f"train.py: a demo run printed no final digest:\n{out}")
        return lines[-1].split(": ", 1)[1]

    print(f"demo: uninterrupted run of {args.steps or args.epochs} {'steps' if args.steps else 'epochs'}",
          flush=True)
    straight = subprocess.run(cmd("uninterrupted"), capture_output=True, text=True, check=True).stdout
    print(f"demo: second run, interrupted by SIGUSR1 at step {interrupt_at}", flush=True)
    proc = subprocess.Popen([c for c in cmd("interrupted") if c != "--quiet"], stdout=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {interrupt_at} "):
            proc.send_signal(signal.SIGUSR1)
            break
    seen += proc.stdout.readlines()
    proc.wait()
    stopped = [ln.strip() for ln in seen if ln.startswith("preempted")]
    print(f"demo:   {stopped[0] if stopped else 'the run ended before the signal'}", flush=True)
    resumed = subprocess.run(cmd("interrupted"), capture_output=True, text=True, check=True).stdout
    print(f"demo: resumed with the same command: {resumed.splitlines()[0]}", flush=True)
    for line in straight.splitlines():
        if line.startswith("loader: "):
            print(f"demo: uninterrupted run's {line}", flush=True)
    a, b = digest_of(straight), digest_of(resumed)
    print(f"demo: uninterrupted final weights sha256 {a}")
    print(f"demo: interrupted+resumed final weights sha256 {b}")
    print("demo: final weights are bitwise EQUAL" if a == b else "demo: final weights DIFFER", flush=True)
    return a == b


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo-interrupt-at" in argv:
        i = argv.index("--demo-interrupt-at")
        at, rest = int(argv[i + 1]), argv[:i] + argv[i + 2:]
        return 0 if demo_interrupt_resume(rest, at) else 1
    args = parse_args(argv)
    try:
        return train(args)
    except FastioError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
