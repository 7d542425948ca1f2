"""A user's mistakes under paramsync's DDP: each is one clear line naming the step, the rank and
what to do (or the parameter), not a hang or a digest mismatch later.

Every run is a coordinator and its workers in this trio run (`train_in_process`); each worker's
own loop runs in a thread, its optimizer stepped unwrapped, as a torch DDP script's is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
from torch import nn

from paramsync.actors import DistributedDataParallel
from paramsync.actors.client.client import RunAborted
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.errors import pick_error

SECONDS = 60.0


def mlp(width: int = 7) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))


def dummy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("the loop runs its own forward")


Loop = Callable[[DistributedDataParallel, torch.optim.Optimizer, int], str]


async def run_loop(loop: Loop, world: int = 1) -> list[str]:
    """Run ``loop(model, optimizer, rank)`` on every worker; returns what each returned."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    async def body(trainer: DistributedTrainer) -> str:
        wrapped = DistributedDataParallel.unwrapped_around(trainer)
        return await trio.to_thread.run_sync(
            loop, wrapped, trainer.run.optimizer, trainer.run.rank, abandon_on_cancel=True
        )

    with trio.fail_after(SECONDS):
        return await train_in_process(world, make_replica, dummy_loss, body)


def step(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
    optimizer.step()


async def test_a_parameter_registered_after_wrapping_is_named() -> None:
    def loop(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int) -> str:
        step(model, optimizer)
        model.module.add_module("extra", nn.Linear(3, 3))
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(4, 5))
        return str(info.value)

    [message] = await run_loop(loop)
    assert "rank 0, step 1" in message and "'extra.weight'" in message, message
    assert "add every parameter before wrapping" in message, message


async def test_a_forward_with_no_backward_then_a_step_is_named() -> None:
    def loop(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int) -> str:
        step(model, optimizer)
        model(torch.randn(4, 5))  # the loss is never backpropagated
        with pytest.raises(RuntimeError) as info:
            optimizer.step()
        return str(info.value)

    [message] = await run_loop(loop)
    assert message.startswith("step 1, rank 0: optimizer.step() after a forward with no "), message
    assert "call loss.backward() first" in message, message


async def test_a_step_with_no_forward_is_named() -> None:
    def loop(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int) -> str:
        step(model, optimizer)
        with pytest.raises(RuntimeError) as info:
            optimizer.step()  # twice for one backward
        return str(info.value)

    [message] = await run_loop(loop)
    assert message.startswith("rank 0, step 1: optimizer.step() with no forward"), message


async def test_wrapping_twice_is_refused() -> None:
    def loop(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int) -> str:
        with pytest.raises(ValueError) as info:
            DistributedDataParallel(model)
        step(model, optimizer)  # the first wrapper is unharmed
        # torch DDP's names: the wrapped module is `module`, its keys carry the prefix.
        assert list(model.state_dict()) == [f"module.{k}" for k in model.module.state_dict()]
        return str(info.value)

    [message] = await run_loop(loop)
    assert (
        "already wrapped by paramsync.actors.train.ddp_wrapper.DistributedDataParallel" in message
    )


async def test_ranks_that_disagree_on_the_model_are_stopped_naming_both() -> None:
    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp(7 + rank)  # rank 1's hidden layer is wider: a bug in its script
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    async def body(trainer: DistributedTrainer) -> None:
        raise AssertionError("no rank may start training")

    with pytest.raises(BaseException) as info, trio.fail_after(SECONDS):
        await train_in_process(2, make_replica, dummy_loss, body)
    error = pick_error(info.value)
    assert isinstance(error, RunAborted), repr(error)
    assert "model differs from rank" in str(error) and "'0.weight'" in str(error), error
    # Named against whichever rank joined first: both ranks and both shapes are in the line.
    assert re.search(r"rank (0|1)'s model differs from rank (1|0)'s", str(error)), error
    assert "(7, 5) vs (8, 5)" in str(error) or "(8, 5) vs (7, 5)" in str(error), error


async def test_a_rank_whose_loss_scaler_differs_is_caught_at_that_step() -> None:
    """Both ranks register their GradScaler; after step 2 rank 1 changes its scaler's growth
    tracker by hand (nothing numeric changes that step): the next digest differs only in the
    scaler's entry, and the coordinator stops the run naming it."""

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    async def body(trainer: DistributedTrainer) -> None:
        wrapped = DistributedDataParallel.unwrapped_around(trainer)
        optimizer = trainer.run.optimizer
        amp = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=100)

        def loop() -> None:
            wrapped.register_grad_scaler(amp)
            gen = torch.Generator().manual_seed(trainer.run.rank)
            for index in range(6):
                optimizer.zero_grad()
                x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
                amp.scale(nn.functional.mse_loss(wrapped(x), y)).backward()
                amp.step(optimizer)
                amp.update()
                wrapped.verified()
                if trainer.run.rank == 1 and index == 2:
                    amp._growth_tracker.fill_(7)  # type: ignore[union-attr]

        await trio.to_thread.run_sync(loop, abandon_on_cancel=True)

    with pytest.raises(BaseException) as info, trio.fail_after(SECONDS):
        await train_in_process(2, make_replica, dummy_loss, body)
    error = pick_error(info.value)
    assert isinstance(error, RunAborted), repr(error)
    assert "amp/grad_scaler" in str(error) and "step 3" in str(error), str(error)


def test_a_rejoining_worker_without_its_optimizer_is_told_to_pass_it() -> None:
    """A wrapper built without ``optimizer=`` holds an unbound optimizer until the loop's first
    step: a worker that joins a run in progress (a live restart) cannot receive the donor's
    optimizer state into it, and says what to pass instead of a manifest mismatch."""
    from paramsync.actors.train.unbound_optimizer import UnboundOptimizer, check_can_receive_state

    model = mlp()
    with pytest.raises(
        RuntimeError, match=r"DistributedDataParallel\(model, optimizer=optimizer\)"
    ):
        check_can_receive_state(UnboundOptimizer(list(model.parameters())), 2)
    check_can_receive_state(torch.optim.SGD(model.parameters(), lr=0.1), 2)  # a real one: fine
    with pytest.raises(RuntimeError, match="never stepped"):
        UnboundOptimizer(list(model.parameters())).step()
