"""paramsync embedded in your own trio application.

paramsync is a library of trio tasks, not a framework that takes over the process: the training
runs inside a nursery *you* open, next to tasks of your own, under cancel scopes *you* own.
This program is such an application. Its `main` opens one nursery and runs in it:

- a heartbeat task of the app's own that prints a status line (step, loss, elapsed time) every
  ``--heartbeat`` seconds, whatever the training is doing;
- with ``--stop-after SECONDS``, a watchdog task of the app's own that asks the training to stop
  early; every rank stops after the same step (see `request_stop`), so the run ends cleanly;
- the training itself: `paramsync.actors.train.worker.train_in_process` starts a coordinator and
  ``--workers`` data-parallel workers as tasks of this same trio run (in-process links and
  transports: no sockets, no subprocesses), each rank training the built-in character-level
  transformer on its shard of the stdlib corpus through `DistributedTrainer.fit`.

When the training returns, the app cancels its own heartbeat (its nursery's cancel scope) and
carries on with the trained model: it samples a few characters from it.

    .venv/bin/python examples/embedded_trio_app.py
    .venv/bin/python examples/embedded_trio_app.py --steps 1000 --stop-after 3
"""

from __future__ import annotations

import argparse
import time

import torch
import trio

from paramsync.actors.demo_job.corpus import load_char_dataset
from paramsync.actors.demo_job.model import CharTransformer
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="data-parallel workers")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="seconds between lines")
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="ask the training to stop after this many seconds (all ranks at the same step)",
    )
    return parser


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # every worker is a task of this one process: stay on one core
    context = 32
    vocab, dataset = load_char_dataset(context, max_bytes=256 * 1024)

    def build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        # Same seed on every rank (and paramsync broadcasts rank 0's weights anyway).
        model = CharTransformer(len(vocab), 64, 4, 1, context, seed=0)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    # Everything synchronous blocks the event loop, and with it the app's other tasks: build
    # the replicas up front (torch's first optimizer takes a second or two to set up) and let
    # `train_in_process` just pick them up.
    replicas = [build(rank) for rank in range(args.workers)]
    make_replica = replicas.__getitem__

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return model.loss(inputs, targets)

    # The app's own state, read by its heartbeat task and written by rank 0's on_step callback.
    status = {"step": 0, "loss": float("nan"), "first_loss": None}
    trainers: list[DistributedTrainer] = []
    stop_at = {"step": None}  # set by request_stop: the first step no rank may start
    started = time.monotonic()

    def request_stop() -> None:
        """Stop every rank before the same step.

        A stop decision must be the same on every rank, or the ranks that go on would wait
        forever for the ones that stopped. `fit` checks ``should_stop`` right after a step
        ends, with no checkpoint in between, so a rank whose ``trainer.step`` is s has already
        committed to step s; no rank has started step max(s) + 1 yet. Stop all of them there
        (all trio tasks of this one thread: nothing runs between reading and setting).
        """
        stop_at["step"] = max((trainer.step for trainer in trainers), default=-1) + 1

    async def body(trainer: DistributedTrainer) -> torch.nn.Module:
        """What each worker does with its trainer (runs once per rank, as a trio task)."""
        trainers.append(trainer)

        def on_step(step: int, loss: float) -> None:
            if trainer.dist_config.rank == 0:
                if status["first_loss"] is None:
                    status["first_loss"] = loss
                status["step"], status["loss"] = step + 1, loss

        def should_stop() -> bool:
            return stop_at["step"] is not None and trainer.step >= stop_at["step"]

        await trainer.fit(
            dataset, args.batch_size, steps=args.steps, on_step=on_step, should_stop=should_stop
        )
        return trainer.model

    async def heartbeat() -> None:
        """A task of the app's own: it knows nothing about paramsync's actors."""
        while True:
            await trio.sleep(args.heartbeat)
            print(
                f"[app] heartbeat t={time.monotonic() - started:5.1f}s "
                f"step {status['step']}/{args.steps} loss {status['loss']:.3f}",
                flush=True,
            )

    async def watchdog(seconds: float) -> None:
        """Another task of the app's own: a time budget for the training."""
        await trio.sleep(seconds)
        request_stop()
        print(f"[app] time budget spent: stopping every rank before step {stop_at['step']}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        if args.stop_after is not None:
            nursery.start_soon(watchdog, args.stop_after)
        models = await train_in_process(
            args.workers,
            make_replica,
            loss_fn,
            body,
            options=TrainerOptions(bucket_bytes=64 * 1024),
        )
        # Training is over; the heartbeat and the watchdog are ours to stop.
        nursery.cancel_scope.cancel()

    steps = [trainer.step for trainer in trainers]
    print(
        f"[app] training finished: {args.workers} workers, steps per rank {steps}, "
        f"{time.monotonic() - started:.1f}s, rank 0 loss {status['first_loss']:.3f} -> "
        f"{status['loss']:.3f}",
        flush=True,
    )
    # The replicas are identical (paramsync checked it every step); use rank 0's.
    model = models[0]
    prompt = vocab.encode_tensor("def ")[None, :]
    gen = torch.Generator().manual_seed(0)
    sample = model.generate(prompt, 40, temperature=0.8, generator=gen)
    print(f"[app] sample from the trained model: {vocab.decode(sample[0])!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(trio.run(main, build_parser().parse_args()))
