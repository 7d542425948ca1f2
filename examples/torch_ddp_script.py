"""A training script written for torch DDP, the usual way; paramsync's only line is the import.

    PARAMSYNC_SECRET=$(.venv/bin/paramsync secret) .venv/bin/torchrun --nproc-per-node 2 \\
        examples/torch_ddp_script.py
    .venv/bin/paramsync launch --nproc 2 -- examples/torch_ddp_script.py
    .venv/bin/torchrun --nproc-per-node 2 examples/torch_ddp_script.py --torch-ddp  # torch's own
    PARAMSYNC_SECRET=$(.venv/bin/paramsync secret) .venv/bin/torchrun --nproc-per-node 2 \\
        examples/torch_ddp_script.py --torch-ddp --backend paramsync  # torch's DDP on paramsync

Everything below the import is what a torch DDP script does: ``init_process_group`` first (its
``DistributedSampler`` reads the rank from it), the optimizer built before the model is wrapped
and never wrapped, ``DDP(model, device_ids=...)``, gradient accumulation through
``model.require_backward_grad_sync``, ``clip_grad_norm_`` between ``backward()`` and ``step()``,
an LR schedule set by hand, ``destroy_process_group()`` last. The problem: a small MLP learns to
classify the points of three interleaved spirals. Rank 0 prints the loss every few steps and a
last line, ``final loss L checksum C``, with C the sum of every parameter (the same on every rank,
and, up to float rounding, the same under torch's DDP).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if "--torch-ddp" in sys.argv:
    from torch.nn.parallel import DistributedDataParallel as DDP
else:
    from paramsync.actors import (
        DistributedDataParallel as DDP,  # was: from torch.nn.parallel import ...
    )


def spirals(per_class: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    points, labels = [], []
    for label in range(3):
        t = torch.linspace(0.1, 1.0, per_class)
        angle = t * 4.0 + label * 2.0 * math.pi / 3 + 0.2 * torch.randn(per_class, generator=gen)
        points.append(torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1))
        labels.append(torch.full((per_class,), label))
    return torch.cat(points), torch.cat(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--torch-ddp", action="store_true", help="torch's own DDP, to compare")
    parser.add_argument(
        "--backend",
        default=None,
        help="the torch.distributed backend (default: nccl with CUDA, else gloo); `paramsync` "
        "runs torch's own DDP on paramsync (with --torch-ddp)",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group(args.backend or ("nccl" if cuda else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    torch.manual_seed(1234)

    points, labels = spirals(400)
    sampler = DistributedSampler(TensorDataset(points, labels), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(points, labels), batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(
        nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)
    )
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model = DDP(model, device_ids=[local_rank] if cuda else None)

    step, epoch, loss_sum = 0, 0, 0.0
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < args.steps:
            micro = [next(batches, None) for _ in range(args.accumulate)]
            if any(m is None for m in micro):
                break
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine, by hand
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for index, (x, y) in enumerate(micro):  # type: ignore[misc]
                model.require_backward_grad_sync = index == args.accumulate - 1
                loss = F.cross_entropy(model(x.to(device)), y.to(device)) / args.accumulate
                loss.backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"step {step:4d} loss {loss_sum:.4f} lr {lr:.5f}", flush=True)
        epoch += 1
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    if rank == 0:
        print(f"final loss {loss_sum:.6f} checksum {checksum:.9f} world {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
