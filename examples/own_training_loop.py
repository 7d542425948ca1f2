"""Your own model, your own data, your own training loop; paramsync only syncs the gradients.

Run it with one process per worker, under ``paramsync launch`` or torchrun, unchanged:

    .venv/bin/paramsync launch --nproc 2 -- examples/own_training_loop.py
    .venv/bin/paramsync launch --nproc 4 -- examples/own_training_loop.py --steps 200
    PARAMSYNC_SECRET=$(.venv/bin/paramsync secret) .venv/bin/torchrun --nproc-per-node 2 \
        examples/own_training_loop.py

``paramsync launch`` starts a coordinator process and N copies of this script with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and a shared PARAMSYNC_SECRET set. torchrun sets the same
variables but no secret (give it PARAMSYNC_SECRET or PARAMSYNC_SECRET_FILE), and rank 0 hosts
the coordinator in its own process. The same script also runs under a coordinator you start by
hand. `paramsync.actors.train.run.trainer_from_env` reads them, joins the run and hands back a
`DistributedTrainer`; `paramsync.actors.train.run.run_script` runs ``main`` like ``trio.run`` and
turns a configuration mistake (no secret, a bad address) into one line and exit code 2. From there
the loop is ordinary Python: build a batch of *this rank's* data, call ``await
trainer.train_batch(batch)``, which runs forward and backward through your ``loss_fn``, averages the
gradients over all workers (bucket by bucket, overlapping backward), steps your optimizer, and
checks that every replica still holds the very same weights.

The problem: classify points of three interleaved 2-D spirals with a small MLP. The data set is
generated from a fixed seed, so every rank builds the same one and takes its own share of it.
Rank 0 prints the training loss as it goes and the loss/accuracy on the whole data set before
and after training.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from paramsync.actors.train.run import run_script, trainer_from_env
from paramsync.actors.train.trainer import TrainerOptions


def spirals(n_per_class: int, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``classes`` noisy spiral arms in the plane: (points (N, 2), labels (N,))."""
    gen = torch.Generator().manual_seed(seed)
    radius = torch.linspace(0.05, 1.0, n_per_class)
    points, labels = [], []
    for c in range(classes):
        angle = (
            radius * 4.0
            + c * 2 * math.pi / classes
            + 0.15 * torch.randn(n_per_class, generator=gen)
        )
        points.append(torch.stack([radius * angle.sin(), radius * angle.cos()], dim=1))
        labels.append(torch.full((n_per_class,), c, dtype=torch.int64))
    return torch.cat(points), torch.cat(labels)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # same initial weights everywhere (rank 0's are broadcast anyway)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 3),
    )


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The forward pass paramsync calls: ``loss_fn(model, batch) -> scalar loss``."""
    points, labels = batch
    return F.cross_entropy(model(points), labels)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, points: torch.Tensor, labels: torch.Tensor
) -> tuple[float, float]:
    logits = model(points)
    loss = F.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return loss, accuracy


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    points, labels = spirals(args.points_per_class)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    options = TrainerOptions(max_steps=args.steps)

    async with trainer_from_env(model, optimizer, loss_fn, options=options) as trainer:
        rank, world = trainer.dist_config.rank, trainer.world_size
        if rank == 0:
            loss, accuracy = evaluate(model, points, labels)
            print(
                f"rank 0 of {world}: {len(points)} points, before training: "
                f"loss {loss:.4f}, accuracy {accuracy:.1%}",
                flush=True,
            )
        step = 0
        epoch = 0
        while step < args.steps:
            # Your own sampler: a seeded permutation per epoch, rank r takes every world-th
            # index from position r, so the ranks' shares are disjoint and equally long.
            order = torch.randperm(len(points), generator=torch.Generator().manual_seed(epoch))
            mine = order[rank::world][: len(points) // world]
            for start in range(0, len(mine) - args.batch_size + 1, args.batch_size):
                if step == args.steps:
                    break
                index = mine[start : start + args.batch_size]
                loss = await trainer.train_batch((points[index], labels[index]))
                if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                    print(f"step {step:4d}  train loss {loss:.4f}", flush=True)
                step += 1
            epoch += 1
        await trainer.verified()  # every replica's weights agreed after the last step
        if rank == 0:
            loss, accuracy = evaluate(model, points, labels)
            print(
                f"rank 0 of {world}: after {step} steps: loss {loss:.4f}, accuracy {accuracy:.1%}",
                flush=True,
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32, help="points per worker per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--points-per-class", type=int, default=400)
    parser.add_argument("--log-every", type=int, default=25)
    return parser


if __name__ == "__main__":
    run_script(main, build_parser().parse_args())
