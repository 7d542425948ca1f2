"""`Trainer3D` under the coordinator (`paramsync.actors.parallel.coordinated`): dp=2 x pp=2 workers
join with their 3D layout, negotiate their gradient bucket within their dp group, and report their
shard digest after every step; the coordinator commits each step comparing each digest only with the
other replica of its (tp, pp) shard, and names the shard and ranks of a perturbed replica."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import trio

from paramsync.actors.client.client import CoordinatorClient, RunAborted
from paramsync.actors.parallel.coordinated import CoordinatorStepHooks, join_3d
from paramsync.actors.parallel.shard_model import ModelSpec
from paramsync.actors.parallel.trainer3d import Trainer3D
from paramsync.runtime.collectives.groups import NativeProcessGroup
from paramsync.runtime.coordinator.service import Coordinator, RunFailed
from paramsync.runtime.parallel.config import DataPlane, ParallelismConfig
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.link import MemoryLink
from tests.coordinated_run import run_with_coordinator

WORLD = 4
STEPS = 3
SECONDS = 120.0
CONFIG = ParallelismConfig(dp_size=2, pp_size=2, num_micro_batches=2, pipeline_schedule="1f1b")
SPEC = ModelSpec(vocab_size=16, d_model=16, n_heads=2, n_layers=2, context=8, seed=5)


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, SPEC.vocab_size, (4, 9), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


async def worker(
    rank: int,
    link: MemoryLink,
    world: Transport,
    perturb: tuple[int, int] | None,
    config: ParallelismConfig = CONFIG,
) -> dict[str, Any]:
    client = CoordinatorClient(link, rank)
    joined = await join_3d(client, rank, config, SPEC, ("in-process", rank + 1))
    start = client.start
    assert start is not None and joined.start is start
    hooks = CoordinatorStepHooks(client, start.epoch)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.serve)
        trainer = await Trainer3D.create(
            world,
            config,
            SPEC,
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            check_every=0,  # the coordinator checks
            hooks=hooks,
        )
        async with trainer:
            for step in range(STEPS):
                if perturb == (rank, step):
                    with torch.no_grad():
                        trainer.parameters()[0].view(-1)[0] += 1e-3
                await trainer.train_step(*batch(step, trainer.dp))
            await hooks.finish(STEPS)
        if config.data_plane is DataPlane.TORCH:  # its groups were torch communicators
            assert trainer.plane is not None
            assert isinstance(trainer.mesh.group("dp"), NativeProcessGroup)
        return trainer.coordinates


async def run(
    perturb: tuple[int, int] | None = None, config: ParallelismConfig = CONFIG
) -> tuple[dict[str, Any], Coordinator]:
    async def one(rank: int, link: MemoryLink, world: Transport) -> dict[str, Any]:
        return await worker(rank, link, world, perturb, config)

    return await run_with_coordinator(WORLD, one, SECONDS)


async def test_the_coordinator_commits_every_step_comparing_replicas_per_shard() -> None:
    outcome, coordinator = await run()
    assert outcome["coordinator"] is None, outcome
    core = coordinator.core
    assert core.view.last_commit is not None and core.view.last_commit.step == STEPS - 1
    assert core.view.layout is not None
    # mesh ("pp", "dp", "tp") = (2, 2, 1): ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
    assert (
        core.view.shard_of(0)
        == core.view.shard_of(1)
        != core.view.shard_of(2)
        == core.view.shard_of(3)
    )
    for rank in range(WORLD):
        assert outcome[f"rank {rank}"] == {"pp": rank // 2, "dp": rank % 2, "tp": 0}


async def test_the_coordinator_commits_every_step_on_torchs_data_plane() -> None:
    """data_plane="torch": each trainer forms a torch plane over its world and builds its
    dp and pp groups on it; the coordinator's sequencing, go per dp group and per-shard
    digests are unchanged, and it commits every step."""
    outcome, coordinator = await run(config=replace(CONFIG, data_plane="torch"))
    assert outcome["coordinator"] is None, outcome
    core = coordinator.core
    assert core.view.last_commit is not None and core.view.last_commit.step == STEPS - 1
    for rank in range(WORLD):
        assert outcome[f"rank {rank}"] == {"pp": rank // 2, "dp": rank % 2, "tp": 0}


async def test_the_coordinator_names_the_shard_of_a_perturbed_replica() -> None:
    outcome, _ = await run(perturb=(3, 1))
    failed = outcome["coordinator"]
    assert isinstance(failed, RunFailed), outcome
    reason = str(failed)
    assert reason.startswith(
        "step 1, shard (pp=1, tp=0): the dp replicas' parameter digests diverged"
    ), reason
    assert "ranks [2] have " in reason and ", ranks [3] have " in reason, reason
    # stage 1's first parameter (its layer's first LayerNorm), as this rank's module names it
    assert "rank 3 first differs from rank 2 at tensor 'param/0.0.0.ln1.weight'" in reason
    assert "pp=0" not in reason, reason
    for rank in range(WORLD):
        error = outcome[f"rank {rank}"]
        assert isinstance(error, BaseException), f"rank {rank} finished: {error!r}"
        assert any(
            isinstance(leaf, RunAborted) and "shard (pp=1, tp=0)" in str(leaf)
            for leaf in leaves(error)
        ), repr(error)
