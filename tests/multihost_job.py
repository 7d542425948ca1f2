"""The training script of the multi-host tests (tests/test_multihost.py), and its reference.

Run as a script under ``paramsync launch`` (one copy per rank): ``multihost_job.py OUT STEPS``.
Step s trains on ``batches()[s]``, split evenly over the epoch's members by ring position, so
the run equals `reference` (one process on the whole batch) whatever the membership. Each
rank writes ``OUT/pid<rank>`` at the start, ``OUT/step<rank>`` after every step, and
``OUT/rank<rank>.json`` at the end: its final weights (hex of the raw bytes), the trainer's
summary, its host identity and whether its transport had a shared-memory plane.

``--nudge RANK:STEP`` adds 1e-3 to rank RANK's last bias after step STEP (a replica that
diverges: the coordinator's digest check names it).

A restarted worker (``PARAMSYNC_RESTART_COUNT`` > 0) writes ``OUT/rejoined`` after its first
step; with ``--until-rejoined`` every rank trains on past STEPS until that file exists (with
``TrainerOptions(join=True)``, so ranks that stop at different steps still end together).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import trio

PER_STEP = 24
"""Samples per step: divides evenly over 1, 2, 3, 4, 6 or 8 members."""
DIM = 32
HIDDEN = 256
"""Large enough that the gradient buckets take the ring (or the shared-memory plane), not the
one-round path of small all-reduces."""
HARD_MAX_STEPS = 4000


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM)
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(PER_STEP, DIM, generator=gen)
    return x, torch.sin(x * 1.5)


def shard(
    data: tuple[torch.Tensor, torch.Tensor], position: int, members: int
) -> tuple[torch.Tensor, torch.Tensor]:
    size = PER_STEP // members
    return data[0][position * size : (position + 1) * size], data[1][
        position * size : (position + 1) * size
    ]


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch of every step: the model a run of any membership equals."""
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, batch(step)).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def decode_params(hexes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The weights a rank wrote, as float32 tensors of the reference's shapes."""
    shapes = {name: p.shape for name, p in make_model().named_parameters()}
    return {
        name: torch.frombuffer(bytearray(bytes.fromhex(text)), dtype=torch.float32).reshape(
            shapes[name]
        )
        for name, text in hexes.items()
    }


async def main(
    out: Path, steps: int, until_rejoined: bool, step_sleep: float, nudge: str | None = None
) -> None:
    from paramsync.actors.train.run import trainer_from_env
    from paramsync.actors.train.trainer import TrainerOptions
    from paramsync.runtime.transport.shm import host_identity

    rank = int(os.environ["RANK"])
    restarted = int(os.environ.get("PARAMSYNC_RESTART_COUNT", "0")) > 0
    (out / f"pid{rank}").write_text(str(os.getpid()))
    model = make_model()
    optimizer = make_optimizer(model)
    options = TrainerOptions(max_steps=HARD_MAX_STEPS, join=until_rejoined)
    planes: list[str | None] = []
    async with trainer_from_env(model, optimizer, loss_fn, options=options) as trainer:

        def done() -> bool:
            if trainer.step < steps:
                return False
            if until_rejoined and trainer.step < HARD_MAX_STEPS:
                return (out / "rejoined").exists()
            return True

        while not done():
            step = trainer.step
            try:
                plane = getattr(trainer.supervisor.live_epoch().transport, "shared_memory", None)
                planes.append(type(plane).__name__ if plane is not None else None)
            except RuntimeError:  # between epochs (the coordinator was lost): none to look at
                pass
            await trainer.train_batch(
                shard(batch(step), trainer.supervisor.position, trainer.world_size)
            )
            (out / f"step{rank}").write_text(str(trainer.step))
            if nudge is not None and nudge == f"{rank}:{step}":
                with torch.no_grad():
                    model[2].bias.add_(1e-3)
            if restarted and not (out / "rejoined").exists():
                (out / "rejoined").write_text(str(trainer.step))
            if step_sleep:
                await trio.sleep(step_sleep)  # the test has time to act between steps
        if until_rejoined:
            await trainer.join()
        await trainer.verified()
        result = {
            "rank": rank,
            "host": host_identity(),
            "planes": sorted({str(p) for p in planes}),
            "restarted": restarted,
            "summary": trainer.summary(),
            "params": {
                name: p.detach().contiguous().numpy().tobytes().hex()
                for name, p in model.named_parameters()
            },
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from paramsync.actors.train.run import run_script

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--until-rejoined", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--nudge", metavar="RANK:STEP")
    args = parser.parse_args()
    run_script(main, args.out, args.steps, args.until_rejoined, args.step_sleep, args.nudge)
