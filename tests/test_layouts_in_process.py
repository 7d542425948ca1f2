"""3D-parallel layouts in real in-process runs: a coordinator (its trio shell over in-process
links), four workers' `CoordinatorClient`s and their data plane (in-process transports, the dp
and tp process groups of `init_device_mesh`).

The workers lay out dp=2 x tp=2. Each tp shard's replicas start from weights seeded by the
shard's coordinates (so the two shards differ and the dp replicas of one agree), negotiate
their gradient bucket within their dp group (``ready`` naming the group), average it there,
step, and report their state digest: the coordinator commits every step, comparing each digest
only with the other replica of its shard. One replica perturbed after its optimizer step
is named with its shard. A worker declaring another pipeline schedule is refused at the start,
through `train_in_process` and `TrainerOptions.parallel_layout` as well.
"""

from __future__ import annotations

from typing import Any

import torch
import trio
from torch import nn

from paramsync.actors.client.client import CoordinatorClient, RunAborted
from paramsync.actors.state.digest import state_digest
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.collectives.mesh import init_device_mesh
from paramsync.runtime.collectives.ring import all_reduce, broadcast
from paramsync.runtime.coordinator.events import bucket_spec, model_signature
from paramsync.runtime.coordinator.service import RunFailed
from paramsync.runtime.parallel.run_layout import parallel_layout
from paramsync.runtime.protocol.messages import Go, ParallelLayout
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.link import MemoryLink
from tests.coordinated_run import run_with_coordinator

SHAPE = {"dp": 2, "tp": 2}
NAMES, SIZES = tuple(SHAPE), tuple(SHAPE.values())
WORLD = 4
SCHEDULE = bytes.fromhex("5a" * 16)
OTHER_SCHEDULE = bytes.fromhex("77" * 16)
STEPS = 4
RUN_SECONDS = 60.0


def leaves(error: BaseException) -> list[BaseException]:
    """Every leaf exception of a (nested) exception group."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def shard_replica(layout: ParallelLayout) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A replica of ``layout``'s shard: the same weights for every dp replica of the shard,
    other weights for every other shard."""
    seed = 1 + sum(coordinate * 10**i for i, (_, coordinate) in enumerate(layout.shard))
    generator = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own data (dp replicas see different batches)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 3, generator=generator)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


async def shard_worker(
    rank: int, link: MemoryLink, world: Transport, perturb: tuple[int, int] | None
) -> torch.Tensor:
    """One worker of the dp x tp run: joins with its layout and the mesh's groups, trains
    ``STEPS`` steps averaging gradients within its dp group, and returns its final weights."""
    layout = parallel_layout(rank, SHAPE, SCHEDULE)
    model, optimizer = shard_replica(layout)
    client = CoordinatorClient(link, rank)
    go_send, go_receive = trio.open_memory_channel[Go](16)

    async def on_go(go: Go) -> None:
        await go_send.send(go)

    client.on_go = on_go
    await client.join(
        model_signature(model.named_parameters()),
        ("in-process", rank + 1),
        layout=layout,
        mesh=(NAMES, SIZES),
    )
    start = client.start
    assert start is not None and client.layout == layout
    async with trio.open_nursery() as nursery:
        await nursery.start(client.serve)
        async with await init_device_mesh(world, NAMES, SIZES) as mesh:
            dp = mesh.group("dp")
            assert dp.name in client.protocol.groups  # the start listed this rank's groups
            if start.broadcast:  # a fresh run: the shard's dp=0 replica's weights
                for parameter in model.parameters():  # (.data: no autograd; no_grad would
                    await broadcast(dp, parameter.data, root=0)  # leak to other tasks)
            for step in range(STEPS):
                x, y = batch(step, rank)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                grads = [p.grad for p in model.parameters()]
                assert all(g is not None for g in grads)
                bucket = torch.cat([g.reshape(-1) for g in grads if g is not None])
                await client.ready(step, 0, bucket_spec([bucket]), start.epoch, group=dp.name)
                go = await go_receive.receive()
                assert (go.step, go.bucket, go.group) == (step, 0, dp.name)
                await all_reduce(dp, bucket, "avg")
                offset = 0
                for g in grads:
                    assert g is not None
                    g.copy_(bucket[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                optimizer.step()
                if perturb == (rank, step):
                    with torch.no_grad():
                        model.weight[0, 0] += 1e-3
                digest = state_digest(model, optimizer)
                names = digest.names if step == 0 else None
                await client.digest(step, digest.digest, digest.packed, start.epoch, names=names)
                await client.wait_commit(step)
            await client.finished(STEPS, start.epoch)
            await client.done.wait()
    return flat(model)


async def run_shards(perturb: tuple[int, int] | None = None) -> tuple[dict[str, Any], Any]:
    """Run the coordinator and the four workers; each one's result or exception."""

    async def worker(rank: int, link: MemoryLink, world: Transport) -> Any:
        return await shard_worker(rank, link, world, perturb)

    return await run_with_coordinator(WORLD, worker, RUN_SECONDS)


async def test_shards_train_apart_and_dp_replicas_commit_every_step() -> None:
    outcome, coordinator = await run_shards()
    assert outcome["coordinator"] is None, outcome
    weights = [outcome[f"rank {rank}"] for rank in range(WORLD)]
    assert all(isinstance(w, torch.Tensor) for w in weights), outcome
    core = coordinator.core
    assert core.view.last_commit is not None and core.view.last_commit.step == STEPS - 1
    assert core.view.layout is not None and core.view.layout.schedule_digest == SCHEDULE
    # dp replicas (ranks 0, 2: tp=0; ranks 1, 3: tp=1) are bitwise equal; the shards differ.
    assert torch.equal(weights[0], weights[2]) and torch.equal(weights[1], weights[3])
    assert not torch.equal(weights[0], weights[1])
    assert (
        core.view.shard_of(0)
        == core.view.shard_of(2)
        != core.view.shard_of(1)
        == core.view.shard_of(3)
    )


async def test_a_perturbed_replica_is_named_with_its_shard() -> None:
    outcome, _ = await run_shards(perturb=(3, 1))
    failed = outcome["coordinator"]
    assert isinstance(failed, RunFailed), outcome
    reason = str(failed)
    assert reason.startswith(
        "step 1, shard (tp=1): the dp replicas' parameter digests diverged with no majority: "
        "ranks [1] have "
    ), reason
    assert ", ranks [3] have " in reason, reason
    assert "rank 3 first differs from rank 1 at tensor 'param/weight'" in reason, reason
    assert "tp=0" not in reason, reason
    for rank in range(WORLD):
        error = outcome[f"rank {rank}"]
        assert isinstance(error, BaseException), f"rank {rank} finished: {error!r}"
        assert any(
            isinstance(leaf, RunAborted) and "shard (tp=1)" in str(leaf) for leaf in leaves(error)
        ), repr(error)


async def test_a_disagreeing_schedule_is_refused_at_the_start_through_the_trainer() -> None:
    """`train_in_process` passes each rank's `TrainerOptions.parallel_layout` to its join."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Linear(4, 3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def layout(rank: int) -> ParallelLayout:
        return parallel_layout(rank, SHAPE, OTHER_SCHEDULE if rank == 2 else SCHEDULE)

    async def body(trainer: DistributedTrainer) -> None:
        raise AssertionError("the run must not start")

    error: BaseException | None = None
    with trio.fail_after(RUN_SECONDS):
        try:
            await train_in_process(
                WORLD,
                make_replica,
                lambda model, batch: model(batch).sum(),
                body,
                parallel_layout=layout,
            )
        except BaseException as exc:
            error = exc
    assert error is not None
    expected = (
        "the run cannot start: the ranks disagree on the pipeline schedule: ranks 0, 1, 3 "
        "declare schedule digest 5a5a5a5a5a5a...; rank 2 declares schedule digest 777777777777..."
    )
    # The first worker refused ends the in-process run (its nursery cancels the others).
    found = leaves(error)
    aborted = [leaf for leaf in found if isinstance(leaf, RunAborted)]
    assert aborted and all(str(leaf).endswith(": " + expected) for leaf in aborted), found
    assert all(isinstance(leaf, RunAborted | RunFailed) for leaf in found), found


async def test_the_trainer_joins_with_the_layout_of_its_options() -> None:
    """A clean run through the trainer: each rank joined with its own layout (a flat trainer
    keeps every replica identical, so every shard check passes)."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rank)  # position 0's weights are broadcast at the start
        model = nn.Linear(4, 3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    async def body(trainer: DistributedTrainer) -> tuple[ParallelLayout | None, float]:
        x = torch.ones(2, 4)
        await trainer.train_batch(x)
        loss = await trainer.train_batch(x)
        return trainer.parallel_layout, loss

    with trio.fail_after(RUN_SECONDS):
        results = await train_in_process(
            WORLD,
            make_replica,
            lambda model, batch: model(batch).pow(2).mean(),
            body,
            parallel_layout=lambda rank: parallel_layout(rank, SHAPE, SCHEDULE),
        )
    for rank, (layout, _) in enumerate(results):
        assert layout == parallel_layout(rank, SHAPE, SCHEDULE)
