"""Hierarchical data parallelism: worker processes (here trio tasks with their own coordinator
client and transport, as `train_in_process` runs them) each holding several CPU devices.

2 processes x 2 devices equal 1 process with 1 device training the 4-device global batch: the
gradients are averaged inside each process (weighted by shard size), then all-reduced across
processes. C-DP-002 holds inside each process (the coordinator's digest check, every step) and
C-DDP-001 across them (the trainer's).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import trio

from paramsync.actors import DataParallelCoordinator, DistributedTrainer, TrainerOptions
from paramsync.actors.multidevice import ReplicatedOptimizer
from paramsync.actors.train.worker import train_in_process

STEPS = 6
PER_PROCESS = 5  # shards of 3 and 2 on the two devices: the in-process weighting matters


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 2),
    )  # fmt: skip
    model[0].requires_grad_(False)  # a frozen base layer: never averaged, copied or sent
    return model


def loss_fn(model: torch.nn.Module, shard: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = shard
    return torch.nn.functional.mse_loss(model(x), y)


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _sample(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(PER_PROCESS, 6, generator=generator), torch.randn(
        PER_PROCESS, 2, generator=generator
    )


def batches(processes: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(11)
    return [
        [_sample(generator) for _ in range(processes)]
        for _ in range(STEPS)
    ]  # fmt: skip


async def test_two_processes_of_two_devices_equal_one_process_on_the_whole_batch() -> None:
    data = batches(2)
    coordinators: list[DataParallelCoordinator] = []

    def make_replica(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        # rank 1 starts from other weights: the run's broadcast reaches all its replicas
        dp = DataParallelCoordinator(lambda: build(100 + rank), adam, loss_fn, ["cpu", "cpu"])
        coordinators.append(dp)
        return dp.primary_pipeline, ReplicatedOptimizer(dp)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        assert trainer.run.replicas is not None
        losses = []
        for step in range(STEPS):
            losses.append(await trainer.train_batch(data[step][trainer.run.rank]))
        await trainer.verified()
        return {
            "losses": losses,
            "replicas": [
                {n: p.detach().clone() for n, p in m.named_parameters()}
                for m in trainer.run.replicas.replicas
            ],
            "dp_step": trainer.run.replicas.step,
        }

    # train_in_process builds the trainers with the one loss function it is given
    shared_loss = loss_fn
    try:
        with trio.fail_after(120):
            results = await train_in_process(
                2,
                make_replica,
                shared_loss,
                body,
                options=TrainerOptions(bucket_bytes=256),
            )
    finally:
        for dp in coordinators:
            dp.close()

    reference = DataParallelCoordinator(lambda: build(100), adam, loss_fn, ["cpu"])
    try:
        ref_losses = []
        for step in range(STEPS):
            x = torch.cat([part[0] for part in data[step]])
            y = torch.cat([part[1] for part in data[step]])
            ref_losses.append(reference.train_batch_parallel((x, y)).loss)
        expected = dict(reference.primary_pipeline.named_parameters())
    finally:
        reference.close()

    first = results[0]["replicas"][0]
    for rank, result in enumerate(results):
        assert result["dp_step"] == STEPS
        for index, replica in enumerate(result["replicas"]):
            for name, value in replica.items():  # bitwise: C-DP-002 in, C-DDP-001 across
                assert torch.equal(value, first[name]), (rank, index, name)
    for name, value in first.items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=1e-4, atol=1e-5)
    assert torch.equal(first["0.weight"], build(100)[0].weight)  # the frozen layer
    mean_losses = [sum(r["losses"][s] for r in results) / 2 for s in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-4)


def test_the_trainer_refuses_what_the_seam_does_not_support() -> None:
    from paramsync.actors.train.trainer import _replicas_of

    with DataParallelCoordinator(lambda: build(1), adam, loss_fn, ["cpu", "cpu"]) as dp:
        optimizer = ReplicatedOptimizer(dp)
        assert _replicas_of(dp.primary_pipeline, optimizer, loss_fn, TrainerOptions(), None) is dp
        with pytest.raises(ValueError, match="primary_pipeline"):
            _replicas_of(dp.replicas[1], optimizer, loss_fn, TrainerOptions(), None)
        with pytest.raises(ValueError, match="loss_fn must be its coordinator's"):
            _replicas_of(dp.primary_pipeline, optimizer, adam, TrainerOptions(), None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="accumulation_steps not supported"):
            _replicas_of(
                dp.primary_pipeline,
                optimizer,
                loss_fn,
                TrainerOptions(accumulation_steps=2),
                None,
            )


def test_the_replicated_optimizer_shares_the_primarys_state_and_loads_into_all() -> None:
    with DataParallelCoordinator(lambda: build(2), adam, loss_fn, ["cpu", "cpu"]) as dp:
        dp.train_batch_parallel((torch.randn(4, 6), torch.randn(4, 2)))
        optimizer = ReplicatedOptimizer(dp)
        assert optimizer.param_groups is dp.optimizers[0].param_groups
        assert optimizer.state is dp.optimizers[0].state
        saved = copy.deepcopy(optimizer.state_dict())
        dp.train_batch_parallel((torch.randn(4, 6), torch.randn(4, 2)))
        optimizer.load_state_dict(saved)
        for replica_optimizer in dp.optimizers:
            states = list(replica_optimizer.state.values())
            assert all(int(state["step"]) == 1 for state in states)
        first, second = (list(o.state.values()) for o in dp.optimizers)
        assert all(a["exp_avg"] is not b["exp_avg"] for a, b in zip(first, second))
