"""A torch DDP-style script: wrap the model and the optimizer, keep your own training loop.

Run it with one process per worker, under ``paramsync launch`` or torchrun, unchanged:

    .venv/bin/paramsync launch --nproc 2 -- examples/ddp_style_loop.py
    .venv/bin/paramsync launch --nproc 4 -- examples/ddp_style_loop.py --steps 200 --accumulate 2
    PARAMSYNC_SECRET=$(.venv/bin/paramsync secret) .venv/bin/torchrun --nproc-per-node 2 \\
        examples/ddp_style_loop.py

The loop is the one a torch ``DistributedDataParallel`` script has, in plain synchronous
Python (no trio, no ``loss_fn`` handed over):

    model = DistributedDataParallel(model)
    optimizer = model.wrap_optimizer(optimizer)      # joins the run: rank 0's weights everywhere
    for inputs, targets in my_shard:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()        # each gradient bucket's all-reduce starts as backward finishes it
        optimizer.step()       # waits for the buckets, steps, checks the replicas are identical

``--accumulate K`` splits each step's batch into K micro-batches and runs the first K-1 under
``model.no_sync()``, as with DDP. The problem is examples/own_training_loop.py's: classify the
points of three interleaved spirals with a small MLP; rank 0 prints the training loss and the
loss/accuracy on the whole data set before and after training.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

# The problem, its model and its evaluation are own_training_loop.py's (this directory is on
# sys.path when a script in it runs): the two scripts differ only in their loop.
from own_training_loop import evaluate, make_model, spirals

from paramsync.actors import DistributedDataParallel, TrainerOptions
from paramsync.actors.train.run import exit_on_configuration_error


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    points, labels = spirals(args.points_per_class)
    with DistributedDataParallel(make_model(), options=TrainerOptions()) as model:
        optimizer = model.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
        rank, world = model.rank, model.world_size
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
                parts = list(
                    zip(points[index].chunk(args.accumulate), labels[index].chunk(args.accumulate))
                )
                optimizer.zero_grad()
                total = 0.0
                with model.no_sync():  # accumulate the first micro-batches locally
                    for x, y in parts[:-1]:
                        loss = F.cross_entropy(model(x), y) / len(parts)
                        loss.backward()
                        total += loss.item()
                x, y = parts[-1]
                loss = F.cross_entropy(model(x), y) / len(parts)
                loss.backward()  # this backward all-reduces the summed gradients
                total += loss.item()
                optimizer.step()
                if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                    print(f"step {step:4d}  train loss {total:.4f}", flush=True)
                step += 1
            epoch += 1
        model.verified()  # every replica's weights agreed after the last step
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
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--points-per-class", type=int, default=400)
    parser.add_argument("--log-every", type=int, default=25)
    return parser


if __name__ == "__main__":
    with exit_on_configuration_error():  # no secret, a bad address...: one line, exit 2
        train(build_parser().parse_args())
