"""The benchmarks' training model: a stack of Linear layers with Adam whose state comes to a chosen size, and one
training step. Shared by :mod:`bench.checkpoint`, :mod:`bench.checkpoint_overhead` and :mod:`bench.checkpoint_probe`
(its own module, so that none of those imports another back)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LAYER_MIB", "WIDTH", "build", "build_fsdp", "line_up", "state_mib", "train_step"]

WIDTH = 2048  # one Linear(WIDTH, WIDTH) layer: 16 MiB of fp32 weights; Adam adds 32 MiB
LAYER_MIB = WIDTH * WIDTH * 4 / 2**20


def build(size_mib: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of Linear layers whose weights + Adam moments come to about ``size_mib``."""
    torch.manual_seed(seed)
    layers = max(1, round(size_mib / (3 * LAYER_MIB)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def build_fsdp(size_mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`build`'s model as FSDP2 (every layer and the whole ``fully_shard``; the process group is the
    caller's), Adam over the sharded parameters, after one training step (its moments exist)."""
    from torch.distributed.fsdp import fully_shard

    model, _ = build(size_mib)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_step(model, optim)
    return model, optim


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor | None = None) -> float:
    x = batch if batch is not None else torch.randn(8, WIDTH)
    if x.shape[-1] != WIDTH:
        x = x.reshape(x.shape[0], -1)[:, :WIDTH]
        x = nn.functional.pad(x, (0, WIDTH - x.shape[1]))
    loss = model(x).square().mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return loss.item()


def state_mib(model: nn.Module, optim: torch.optim.Optimizer) -> float:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
             if isinstance(t, torch.Tensor))
    return n / 2**20


def line_up() -> None:
    """Before a timed call on every rank: a full garbage collection here, then a barrier (the ranks start together).

    CPython runs a full (generation-2) collection, which walks every object of the process (torch's modules and
    the model's: 0.15-0.28 s on the 2-core development machine), after about 100 young ones. In a loop of saves and
    restores it lands in whichever call crosses that count, on either rank, and the barrier after the call makes
    the other rank wait for it: in the FSDP2 measurements of 2026-12-07 every slow round of the Checkpointer's
    restore, and of ``dcp.load``, held one (notes of issue 45). Collected here, none starts inside a timed call (one
    makes fewer than 30 young collections): each side is timed for its own work, both alike."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()


def end_rank(rank: int, path, result) -> None:
    """The end of a benchmark's rank process: rank 0 writes ``result`` as JSON to ``path``, every rank meets the
    others and leaves the group, then exits at once (torch's gloo teardown can abort at interpreter exit; the
    result is in the file)."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    if rank == 0:
        Path(path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)

