"""examples/quickstart.py: a complete training loop on a fastio dataset that resumes exactly.

    python examples/quickstart.py [DATA [CKPT_DIR [EPOCHS]]]    # default: ds ckpt 2
    (DATA/train and DATA/val from `fastio convert images DATA --split train=0.9,val=0.1`, or folders of
    WebDataset shards made datasets by `fastio index DATA/train` and `fastio index DATA/val`)

Run it again with the same arguments after Ctrl-C, a kill, a SIGTERM or a SIGUSR1 and it continues where it
stopped; run it again after it finished and it trains nothing more. tests/test_docs.py runs it.
"""

import sys

import torch

import fastio

data, ckpt_dir, epochs = (sys.argv[1:] + ["ds", "ckpt", "2"][len(sys.argv) - 1:])[:3]
epochs = int(epochs) if epochs.isdigit() and not {"-h", "--help"} & set(sys.argv) else sys.exit(__doc__)
torch.manual_seed(0)

ckpt = fastio.Checkpointer(ckpt_dir, every_steps=5, keep=2)  # SIGTERM/SIGUSR1 make the next save blocking
with fastio.exit_cleanly(ckpt):  # Ctrl-C or a fastio error: one line (what is saved, how to resume), no traceback
    train = fastio.Loader(f"{data}/train", batch_size=16, device="cpu", pipeline=fastio.ImageTrain(size=32),
                          seed=0)                      # device="cuda" on a GPU: batches are decoded there
    val = fastio.Loader(f"{data}/val", batch_size=16, device="cpu", pipeline=fastio.ImageEval(size=32),
                        shuffle="none", remainder="partial")   # every sample once, in order
    classes = train.dataset.classifier_outputs()             # the largest label + 1; no labels: an error
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    app = {"model": model, "optim": optimizer, "loader": train}  # the Loader's position is saved with the rest

    start = ckpt.restore_latest(app)                             # None on a fresh start
    step = start.step if start else 0
    print(f"resumed at step {step}, {train.epoch} of {epochs} epochs done" if start else "fresh start", flush=True)

    def evaluate() -> float:
        correct = seen = 0
        with torch.no_grad():
            for batch in val:
                real = ~batch["padded"]          # samples repeated to even out the ranks do not count
                predicted = model(batch["image"]).argmax(1)
                correct += int((predicted == batch["label"])[real].sum())
                seen += int(real.sum())
        return correct / seen

    while train.epoch < epochs:                  # after a restore, the epoch the checkpoint was in
        for batch in train:                      # the rest of the current epoch, then the next epoch begins
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            print(f"step {step} loss {loss.item():.3f}", flush=True)
            ckpt.maybe_save(step, app, metrics={"loss": loss.item()})
            if ckpt.preempted:                   # a signal came and the blocking save is made
                ckpt.close()
                print(f"preempted: saved step {step}; run the same command to resume", flush=True)
                sys.exit(ckpt.exit_code)         # preempted_exit_code (default 0): the same command resumes
        print(f"epoch {train.epoch} of {epochs} done: val accuracy {evaluate():.2f}", flush=True)

    if not start or step > start.step:           # the final state, so that a relaunch trains nothing more
        ckpt.save(step, app, blocking=True)
    ckpt.close()
    train.close()
    val.close()
    print(f"done: {step} steps", flush=True)
