"""torch DDP itself, as the reference for the buffer tests (tests/test_buffers.py).

Shared by both sides of the comparison: the BatchNorm model (`bn_model`) and the batches
(`bn_batches`). Run as a script, once per rank of a gloo group of WORLD_SIZE processes, it
trains that model with ``torch.nn.parallel.DistributedDataParallel`` for every world size w
from 2 to WORLD_SIZE (ranks 0..w-1, over a subgroup: one set of processes serves every size),
in each buffer mode asked for, and writes each final ``state_dict`` to
``OUT/wW-MODE-rankR.safetensors``:

* ``broadcast``: DDP with ``broadcast_buffers=True`` (its default);
* ``local``: ``broadcast_buffers=False``;
* ``average`` (no DDP equivalent): ``broadcast_buffers=False``, then after each optimizer step
  the floating-point buffers are all-reduced to their mean and the integer ones broadcast from
  rank 0, by hand with ``torch.distributed``.

    python tests/ddp_reference.py RANK WORLD_SIZE PORT OUT MODE[,MODE...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 4
PER_RANK = 4
LR = 0.1


class BNNet(nn.Module):
    """Linear, BatchNorm (running statistics and a num_batches_tracked counter), Tanh, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.norm = nn.BatchNorm1d(8, momentum=0.3)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def bn_model(seed: int) -> BNNet:
    """The model with weights depending only on ``seed``, and running statistics moved off their
    defaults, the same for every seed (torch 2.13's DDP no longer broadcasts buffers at
    construction with ``broadcast_buffers=False``; paramsync's first epoch always does)."""
    torch.manual_seed(seed)
    model = BNNet()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.norm.running_mean.copy_(torch.randn(8, generator=gen))
        model.norm.running_var.copy_(torch.rand(8, generator=gen) + 0.5)
    return model


def bn_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def bn_batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` whole batches of ``world_size * PER_RANK`` samples; rank r's shard is rows
    ``r * PER_RANK`` to ``(r + 1) * PER_RANK``. Each rank's inputs have their own offset, so
    per-rank batch statistics (and running statistics) really differ."""
    gen = torch.Generator().manual_seed(77 + world_size)
    n = world_size * PER_RANK
    offsets = torch.arange(world_size, dtype=torch.float32).repeat_interleave(PER_RANK)
    return [
        (
            torch.randn(n, 5, generator=gen) + offsets[:, None],
            torch.randn(n, 3, generator=gen),
        )
        for _ in range(STEPS)
    ]


def shard(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in batch)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _train_ddp(rank: int, world_size: int, mode: str, group: Any) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = bn_model(100 + rank)  # ranks start apart: DDP's construction broadcasts rank 0's
    with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers (same meaning)
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(
            model, broadcast_buffers=mode == "broadcast", process_group=group
        )
    optimizer = bn_optimizer(ddp)
    for batch in bn_batches(world_size):
        optimizer.zero_grad()
        mse(ddp, shard(batch, rank)).backward()
        optimizer.step()
        if mode == "average":
            for buffer in model.buffers():
                if buffer.dtype.is_floating_point:
                    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
                    buffer.div_(world_size)
                else:
                    dist.broadcast(buffer, src=0, group=group)
    return {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank, world_size, port = int(argv[0]), int(argv[1]), int(argv[2])
    out, modes = Path(argv[3]), argv[4].split(",")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        for size in range(2, world_size + 1):
            group = dist.new_group(list(range(size)))  # every process takes part in creating it
            if rank >= size:
                continue
            for mode in modes:
                state = _train_ddp(rank, size, mode, group)
                save_file(state, str(out / f"w{size}-{mode}-rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
