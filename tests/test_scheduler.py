"""LR schedulers (issue 14): stepped with the optimizer, part of the training state and digest.

* Parity: N workers with a scheduler reach the weights, learning rates and scheduler state of
  ONE plain-torch process that trains rank 0's initial model on the concatenated batch and
  calls ``scheduler.step()`` after each ``optimizer.step()``, for N = 1..4 (StepLR with SGD),
  with other schedulers (cosine annealing with Adam, a LambdaLR, a SequentialLR) and over TCP.
* The scheduler's state is part of the training state: captured, written to and read from a
  checkpoint, restored (training then continues on the same learning rates), carried by the
  live state transfer to a joiner, and refused when the scheduler does not match.
* The digest covers it: ranks whose schedulers disagree are stopped by the coordinator, which
  names ``sched/state``.
* Schedulers the trainer cannot step in lockstep are refused by name; the synchronous
  `SyncTrainer` steps the scheduler it is given and exports the model too.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from safetensors.torch import load_file
from torch import nn
from torch.optim import lr_scheduler

from paramsync.actors.client.client import RunAborted
from paramsync.actors.state.checkpoint import CheckpointStore
from paramsync.actors.state.digest import state_digest
from paramsync.actors.state.training_state import StateMismatch, capture_state, restore_state
from paramsync.actors.train.state_transfer import receive_state, send_state
from paramsync.actors.train.sync import SyncTrainer
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.transport.base import InProcessTransport
from paramsync.runtime.transport.tcp import TcpTransport

RUN_SECONDS = 30.0
STEPS = 6
PER_RANK = 4


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


Schedule = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]

SCHEDULES: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Schedule]] = {
    "step-sgd": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    ),
    "cosine-adam": (
        lambda p: torch.optim.Adam(p, lr=0.02),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4, eta_min=1e-3),
    ),
    "lambda-sgd": (
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda o: lr_scheduler.LambdaLR(o, warmup),
    ),
    "sequential-adamw": (
        lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.1),
        lambda o: lr_scheduler.SequentialLR(
            o,
            [lr_scheduler.LinearLR(o, 0.25, total_iters=2), lr_scheduler.ExponentialLR(o, 0.8)],
            milestones=[2],
        ),
    ),
}


def batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(40 + world_size)
    n = world_size * PER_RANK
    return [
        (torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)) for _ in range(STEPS)
    ]


def lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


async def check_parity(world_size: int, schedule: str, transport: str = "inproc") -> None:
    make_optimizer, make_scheduler = SCHEDULES[schedule]
    data = batches(world_size)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = mlp(10 + rank)
        optimizer = make_optimizer(model.parameters())
        return model, optimizer, make_scheduler(optimizer)

    async def body(trainer: DistributedTrainer) -> dict[str, Any]:
        rank = trainer.dist_config.rank
        seen = []
        for x, y in data:
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            await trainer.train_batch((x[rows], y[rows]))
            seen.append(lrs(trainer.run.optimizer))
        await trainer.verified()
        assert trainer.run.scheduler is not None
        return {
            "params": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
            "lrs": seen,
            "scheduler": trainer.run.scheduler.state_dict(),
            "digest": trainer.run.state_digest(),
        }

    with trio.fail_after(RUN_SECONDS):
        if transport == "tcp":
            async with TcpTransport.open_group(world_size) as transports:
                results = await train_in_process(
                    world_size, make_replica, mse, body, transports=list(transports)
                )
        else:
            results = await train_in_process(world_size, make_replica, mse, body)

    reference = mlp(10)
    optimizer = make_optimizer(reference.parameters())
    scheduler = make_scheduler(optimizer)
    ref_lrs = []
    for batch in data:
        optimizer.zero_grad()
        mse(reference, batch).backward()
        optimizer.step()
        scheduler.step()
        ref_lrs.append(lrs(optimizer))
    assert len({lr for step in ref_lrs for lr in step}) > 1, "the schedule must change the lr"

    for rank, result in enumerate(results):
        assert result["lrs"] == ref_lrs, f"rank {rank}: learning rates"
        assert result["scheduler"] == scheduler.state_dict(), f"rank {rank}: scheduler state"
        for name, value in reference.named_parameters():
            torch.testing.assert_close(
                result["params"][name], value.detach(), rtol=1e-4, atol=2e-5, msg=f"rank {rank}"
            )
        assert result["digest"] == results[0]["digest"]
        assert "sched/state" in result["digest"].names


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_parity_with_a_step_scheduler(world_size: int) -> None:
    await check_parity(world_size, "step-sgd")


@pytest.mark.parametrize("schedule", ["cosine-adam", "lambda-sgd", "sequential-adamw"])
async def test_parity_with_other_schedulers(schedule: str) -> None:
    await check_parity(2, schedule)


async def test_parity_with_a_scheduler_over_tcp() -> None:
    await check_parity(3, "sequential-adamw", transport="tcp")


# --------------------------------------------------------------------------- training state


def trained(schedule: str, steps: int, seed: int = 0) -> tuple[nn.Module, Any, Any]:
    make_optimizer, make_scheduler = SCHEDULES[schedule]
    model = mlp(seed)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        mse(model, (torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen))).backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def continue_lrs(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        optimizer.step()  # no gradients: only the schedule moves
        scheduler.step()
        out.append(lrs(optimizer))
    return out


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_scheduler_state_survives_a_checkpoint(schedule: str, tmp_path: Path) -> None:
    model, optimizer, scheduler = trained(schedule, 3)
    state = capture_state(model, optimizer, 3, scheduler=scheduler)
    assert (
        state.meta["scheduler"]["class"] == f"torch.optim.lr_scheduler.{type(scheduler).__name__}"
    )
    store = CheckpointStore(tmp_path)
    loaded = store.load(store.save(state))

    fresh_model, fresh_optimizer, fresh_scheduler = trained(schedule, 0, seed=1)
    restore_state(fresh_model, fresh_optimizer, loaded, scheduler=fresh_scheduler)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert lrs(fresh_optimizer) == lrs(optimizer)
    assert state_digest(fresh_model, fresh_optimizer, fresh_scheduler) == state_digest(
        model, optimizer, scheduler
    )
    assert continue_lrs(fresh_optimizer, fresh_scheduler, 3) == continue_lrs(
        optimizer, scheduler, 3
    )


def test_scheduler_mismatches_are_refused_and_change_nothing() -> None:
    model, optimizer, scheduler = trained("step-sgd", 3)
    with_scheduler = capture_state(model, optimizer, 3, scheduler=scheduler)
    without = capture_state(model, optimizer, 3)
    assert without.meta["scheduler"] is None

    target, target_optimizer, target_scheduler = trained("step-sgd", 0, seed=1)
    before = target_scheduler.state_dict()
    with pytest.raises(StateMismatch, match="StepLR' LR scheduler state, no scheduler given"):
        restore_state(target, target_optimizer, with_scheduler)
    with pytest.raises(StateMismatch, match="holds no LR scheduler state, the scheduler is"):
        restore_state(target, target_optimizer, without, scheduler=target_scheduler)
    other = lr_scheduler.ExponentialLR(target_optimizer, 0.5)
    with pytest.raises(StateMismatch, match=r"LR scheduler class: .*StepLR.* in the state"):
        restore_state(target, target_optimizer, with_scheduler, scheduler=other)
    # A peer's scheduler state is untrusted: torch would set each key as an attribute.
    hostile = capture_state(model, optimizer, 3, scheduler=scheduler)
    hostile.meta["scheduler"]["state"]["optimizer"] = "not an optimizer"
    with pytest.raises(StateMismatch, match=r"keys differ \(unexpected \['optimizer'\]"):
        restore_state(target, target_optimizer, hostile, scheduler=target_scheduler)
    hostile = capture_state(model, optimizer, 3, scheduler=scheduler)
    hostile.meta["scheduler"]["state"]["_last_lr"] = "0.1"
    with pytest.raises(StateMismatch, match=r"\['_last_lr'\]: expected a list of 1"):
        restore_state(target, target_optimizer, hostile, scheduler=target_scheduler)
    assert target_scheduler.state_dict() == before
    assert target_scheduler.optimizer is target_optimizer


async def test_live_state_transfer_carries_the_scheduler() -> None:
    model, optimizer, scheduler = trained("sequential-adamw", 3)
    joiner, joiner_optimizer, joiner_scheduler = trained("sequential-adamw", 0, seed=2)
    donor_side, joiner_side = InProcessTransport.create_group(2)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_state, donor_side, 1, model, optimizer, 3, scheduler)
            state = await receive_state(
                joiner_side, 0, joiner, joiner_optimizer, scheduler=joiner_scheduler
            )
    assert state.step == 3
    assert joiner_scheduler.state_dict() == scheduler.state_dict()
    assert state_digest(joiner, joiner_optimizer, joiner_scheduler) == state_digest(
        model, optimizer, scheduler
    )


def test_the_digest_covers_the_scheduler() -> None:
    model, optimizer, scheduler = trained("lambda-sgd", 1)
    before = state_digest(model, optimizer, scheduler)
    assert before.names[-2:] == ("optim/param_groups", "sched/state")
    scheduler.last_epoch += 1  # the schedule's position alone
    after = state_digest(model, optimizer, scheduler)
    changed = [n for (n, a), (_, b) in zip(before.tensors, after.tensors) if a != b]
    assert changed == ["sched/state"]
    for group in optimizer.param_groups:  # a learning rate alone
        group["lr"] *= 2
    changed = [
        n
        for (n, a), (_, b) in zip(after.tensors, state_digest(model, optimizer, scheduler).tensors)
        if a != b
    ]
    assert changed == ["optim/param_groups"]


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


async def failure_of(run: Callable[[], Any]) -> list[BaseException]:
    with trio.fail_after(RUN_SECONDS):
        try:
            await run()
        except BaseException as exc:
            return leaves(exc)
    pytest.fail("the run did not fail")


async def test_ranks_whose_schedulers_disagree_are_stopped_naming_it() -> None:
    data = batches(2)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = mlp(3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # Same learning rate at every step of this short run; only the schedule's own state
        # (its decay factor) differs.
        return model, optimizer, lr_scheduler.StepLR(optimizer, 100, gamma=0.5 + 0.1 * rank)

    async def body(trainer: DistributedTrainer) -> None:
        rank = trainer.dist_config.rank
        for x, y in data:
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            await trainer.train_batch((x[rows], y[rows]))
        await trainer.verified()

    found = await failure_of(lambda: train_in_process(2, make_replica, mse, body))
    aborted = [leaf for leaf in found if isinstance(leaf, RunAborted)]
    assert aborted, found
    assert "sched/state" in str(aborted[0])


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda o, other: lr_scheduler.ReduceLROnPlateau(o),
            ValueError,
            "ReduceLROnPlateau steps on a metric",
        ),
        (
            lambda o, other: lr_scheduler.StepLR(other, 2),
            ValueError,
            "schedules another optimizer",
        ),
        (lambda o, other: object(), TypeError, "must be a torch.optim.lr_scheduler.LRScheduler"),
    ],
    ids=["plateau", "other-optimizer", "not-a-scheduler"],
)
async def test_schedulers_the_trainer_cannot_step_in_lockstep_are_refused(
    make: Callable[[Any, Any], Any], error: type[Exception], match: str
) -> None:
    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = mlp(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(mlp(1).parameters(), lr=0.1)
        return model, optimizer, make(optimizer, other)

    async def body(trainer: DistributedTrainer) -> None:
        pytest.fail("the trainer started")

    found = await failure_of(
        lambda: train_in_process(1, make_replica, mse, body, options=TrainerOptions())
    )
    refusals = [leaf for leaf in found if isinstance(leaf, error) and leaf.args]
    assert refusals, found
    assert any(match in str(leaf) for leaf in refusals), found


def test_sync_trainer_steps_its_scheduler_and_exports(tmp_path: Path) -> None:
    """The synchronous trainer (a torchrun-style script) passes its scheduler through."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = mlp(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    overrides = {"world_size": 1, "rank": 0, "coordinator_addr": f"127.0.0.1:{port}"}
    data = batches(1)
    with SyncTrainer(
        model,
        optimizer,
        mse,
        scheduler=scheduler,
        overrides=overrides,
        secret="scheduler-tests-secret",
    ) as trainer:
        assert trainer.trainer.run.scheduler is scheduler
        for batch in data[:4]:
            trainer.train_batch(batch)
        trainer.verified()
        state = trainer.state_dict()
        path = trainer.save_safetensors(tmp_path / "model.safetensors")
    assert lrs(optimizer) == [pytest.approx(0.025)]  # two halvings in four steps
    assert scheduler.last_epoch == 4
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(load_file(str(path))[k], v) for k, v in state.items())
