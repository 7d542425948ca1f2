"""One process of ``make demo-3d``: a rank of the dp x tp x pp character-LM run.

Started by `paramsync.actors.demo_job.demo3d` with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and the run's secret; it joins the TCP world, builds its
`Trainer3D` from the `ParallelismConfig` its flags give, and trains the char transformer on
CPython's standard library (`paramsync.actors.demo_job.corpus`). Every dp replica draws its own
batches from one seeded generator (the tp and pp ranks of a replica draw the same ones). Every
pipeline action is a span in ``--trace`` (`paramsync.actors.parallel.traced_stage`), every step a
span.

With ``--coordinated`` it joins paramsync's coordinator at MASTER_ADDR:MASTER_PORT with its 3D
layout (`paramsync.actors.parallel.coordinated`), forms the TCP world from the start's address
table, and after every optimizer step reports its shard digest for the coordinator to compare with
the shard's other replicas; without it the ranks form the world at MASTER_ADDR:MASTER_PORT
themselves and compare digests in band over each dp group. A mismatch stops the run. At the end it
writes its summary (losses, steps per second, checks passed) as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient
from paramsync.actors.demo_job.corpus import CharDataset, load_char_dataset
from paramsync.actors.parallel.coordinated import CoordinatorStepHooks, join_3d
from paramsync.actors.parallel.shard_model import ModelSpec
from paramsync.actors.parallel.trainer3d import Trainer3D
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.parallel.config import ParallelismConfig, add_arguments, overrides_from_args
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.train_config import shared_secret
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, TcpTransport, dial_with_retry, form_mesh

__all__ = ["main", "parser", "replica_batch"]

JOIN_SECONDS = 120.0
"""How long dialing the coordinator, the start and forming the data mesh may take."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paramsync.actors.demo_job.demo3d_worker",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(p)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per dp replica per step")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--corpus-bytes", type=int, default=256 * 1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=None, help="this rank's Chrome trace file")
    p.add_argument("--summary", type=Path, default=None, help="this rank's summary JSON")
    p.add_argument(
        "--coordinated",
        action="store_true",
        help="join the coordinator at MASTER_ADDR:MASTER_PORT (it checks the layout and every "
        "shard's replicas); without it the ranks form their TCP world there themselves and "
        "compare digests in band",
    )
    return p


def replica_batch(
    dataset: CharDataset, step: int, replica: int, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of dp replica ``replica`` at ``step``: random windows from a generator seeded by
    (seed, step, replica), so every rank of the replica draws the same, and nothing else draws
    from it (Megatron PR 206)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + replica)
    indices = torch.randint(0, len(dataset), (batch_size,), generator=generator).tolist()
    return dataset.batch(indices)


def _padded(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (the vocabulary split over tp ranks;
    the padding ids never occur, as Megatron pads its vocabulary)."""
    return -(-size // multiple) * multiple


async def run(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, object]:
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    config = ParallelismConfig.resolve(
        environ={}, overrides=overrides_from_args(args), world_size=world_size
    )
    vocab, dataset = load_char_dataset(args.context, max_bytes=args.corpus_bytes)
    spec = ModelSpec(
        vocab_size=_padded(len(vocab), config.mp_size),
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        context=args.context,
        tie_weights=True,
        seed=args.seed,
    )
    tracer = TraceRecorder(f"rank {rank}", pid=rank, enabled=args.trace is not None)
    dist = DistributedConfig(world_size, rank, f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
    lr = args.lr
    losses: list[float] = []

    async def train(world: Transport, hooks: CoordinatorStepHooks | None) -> Trainer3D:
        trainer = await Trainer3D.create(
            world,
            config,
            spec,
            lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
            max_grad_norm=args.max_grad_norm,
            recv_seconds=120.0,
            tracer=tracer,
            hooks=hooks,
            check_every=0 if hooks is not None else 1,  # the coordinator checks, or in band
        )
        coords = trainer.coordinates
        tracer.process_name = f"rank {rank}: pp={coords['pp']} dp={coords['dp']} tp={coords['tp']}"
        async with trainer:
            for step in range(args.steps):
                inputs, targets = replica_batch(
                    dataset, step, trainer.dp, args.batch_size, args.seed
                )
                with tracer.span("step", "trainer", step=step) as span:
                    loss = await trainer.train_step(inputs, targets)
                    span.set(loss=loss)
                losses.append(loss)
                if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
                    print(f"  step {step:4d}  loss {loss:.3f}", flush=True)
            if hooks is not None:
                await hooks.finish(trainer.optimizer_steps)
        return trainer

    start = time.perf_counter()
    if args.coordinated:
        trainer, checks = await _coordinated(dist, config, spec, train)
    else:
        async with TcpTransport.connect(dist) as world:
            trainer = await train(world, None)
        checks = trainer.checks_passed
    elapsed = time.perf_counter() - start
    coords = trainer.coordinates
    if args.trace is not None:
        tracer.write(args.trace)
    return {
        "rank": rank,
        "coordinates": coords,
        "layout": {
            "dp": config.dp_size,
            "tp": config.mp_size,
            "pp": config.pp_size,
            "schedule": config.pipeline_schedule.value,
            "micro_batches": config.num_micro_batches,
        },
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "last_10_mean_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "steps_per_second": len(losses) / elapsed if elapsed > 0 else math.nan,
        "seconds": elapsed,
        "optimizer_steps": trainer.optimizer_steps,
        "checks_passed": checks,
        "checked_by": "coordinator" if args.coordinated else "in band (dp all-gather)",
        "parameters": sum(p.numel() for p in trainer.parameters()),
    }


async def _coordinated(
    dist: DistributedConfig,
    config: ParallelismConfig,
    spec: ModelSpec,
    train: Callable[[Transport, CoordinatorStepHooks | None], Awaitable[Trainer3D]],
) -> tuple[Trainer3D, int]:
    """Join the coordinator at ``dist.coordinator_addr`` with this rank's 3D layout, form the
    TCP world from the start's address table, and ``train`` with the coordinator's step
    hooks; return the trainer and the steps the coordinator committed."""
    key = shared_secret()
    me = Identity(DEFAULT_GROUP, dist.world_size, dist.rank)
    with trio.fail_after(JOIN_SECONDS):
        conn, _ = await dial_with_retry(dist.address, key, me)
    host = conn.socket.getsockname()[0]
    listeners = await trio.open_tcp_listeners(0, host=host)
    try:
        client = CoordinatorClient(conn, dist.rank)
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(JOIN_SECONDS):
            await join_3d(client, dist.rank, config, spec, (host, port))
        start = client.start
        assert start is not None
        hooks = CoordinatorStepHooks(client, start.epoch)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            position = start.position(dist.rank)
            ident = Identity(f"{DEFAULT_GROUP}#{start.epoch}", len(start.members), position)
            with trio.fail_after(JOIN_SECONDS):
                mesh = await form_mesh(ident, listeners[0], list(start.addresses), key)
            world = TcpTransport(position, len(start.members), mesh, secret=key)
            try:
                trainer = await train(world, hooks)
            finally:
                with trio.CancelScope(shield=True):
                    await world.aclose()
        return trainer, hooks.commits
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
            await conn.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    # Ranks dial rank 0 before it listens; the retries are expected, not worth a line each.
    logging.getLogger("stamina").setLevel(logging.ERROR)
    summary = trio.run(run, args, dict(os.environ))
    if args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
