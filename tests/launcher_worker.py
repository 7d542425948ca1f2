"""A torch DDP script with its import swapped, as tests/test_launchers.py starts it under each
launcher's variables (no torchrun, no ``paramsync launch``).

    python tests/launcher_worker.py [--init env|tcp://HOST:PORT] [--place RANK WORLD]
                                    [--kill RANK STEP] [--steps N]

``--init env``: ``init_process_group("gloo")`` first, from torch's variables (rank 0's TCP
store then holds MASTER_PORT); ``--init tcp://...``: ``init_process_group`` with the rank and
world size the script reads from Slurm's or Open MPI's variables itself, as scripts written
for those launchers do, or from ``--place`` (what ``torch.multiprocessing.spawn`` hands a
script's function: no variable says it); none: paramsync's DDP alone reads the environment.
``--kill RANK STEP``: that rank SIGKILLs itself before the forward of STEP. Each rank prints
``rank R step S`` per step, and at the end ``final rank R world W checksum C`` (C: the sum of
every parameter, the same on every rank). A run that ends on an error prints
``error: <its line>`` and exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

from paramsync import DistributedDataParallel as DDP


def _launcher_place() -> tuple[int, int]:
    """The rank and world size as a script written for Slurm or Open MPI reads them."""
    for rank, world in (
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("RANK", "WORLD_SIZE"),
    ):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[world])
    raise SystemExit("no launcher variables")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", default=None)
    parser.add_argument("--place", type=int, nargs=2, default=None)
    parser.add_argument("--kill", type=int, nargs=2, default=None)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.init == "env":
        dist.init_process_group("gloo")
    elif args.init is not None:
        rank, world = args.place if args.place is not None else _launcher_place()
        dist.init_process_group("gloo", init_method=args.init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DDP(model)
    rank = ddp.rank
    data = torch.Generator().manual_seed(rank)
    try:
        for step in range(args.steps):
            if args.kill is not None and args.kill == [rank, step]:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = torch.randn(8, 4, generator=data), torch.randint(0, 3, (8,), generator=data)
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} step {step}", flush=True)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"final rank {rank} world {ddp.world_size} checksum {checksum:.12f}", flush=True)
    ddp.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
