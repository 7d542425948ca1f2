"""Gradient edits between ``backward()`` and ``step()`` under paramsync's DDP (hypothesis).

torch DDP guarantees that ``loss.backward()`` returns with every ``.grad`` averaged, so a loop
may clip, scale or zero gradients in place before ``optimizer.step()``. Hypothesis draws the
edits of every step (scale a gradient, clip all of them by norm, zero one) and the world size;
2 or 3 workers run the loop with their own optimizer stepped unwrapped (its step hooks report
the digest). Then:

* every rank holds bitwise the same parameters and optimizer state after every step (and the
  coordinator's C-DDP-001 check passed every step: `verified`);
* the weights are torch DDP's: one process that averages the ranks' gradients, applies the
  same edits and steps (within float tolerance: the all-reduce sums in another order).
"""

from __future__ import annotations

from typing import Any

import torch
import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

from paramsync.actors import DistributedDataParallel
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.actors.train.worker import train_in_process

STEPS = 3
PER_RANK = 4
SECONDS = 60.0

Edit = tuple[str, int, float]
"""(kind, parameter index, value): ("scale", i, factor), ("zero", i, _), ("clip", _, norm)."""

edits = st.one_of(
    st.tuples(st.just("scale"), st.integers(0, 5), st.floats(-3.0, 3.0, width=32)),
    st.tuples(st.just("zero"), st.integers(0, 5), st.just(0.0)),
    st.tuples(st.just("clip"), st.just(0), st.floats(0.0625, 2.0, width=32)),
)


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11 + world)
    return [
        (
            torch.randn(world * PER_RANK, 5, generator=gen),
            torch.randn(world * PER_RANK, 3, generator=gen),
        )
        for _ in range(STEPS)
    ]


def apply_edits(params: list[nn.Parameter], step_edits: list[Edit]) -> None:
    with torch.no_grad():
        for kind, index, value in step_edits:
            grad = params[index].grad
            if kind == "clip":
                torch.nn.utils.clip_grad_norm_(params, value)
            elif grad is not None and kind == "zero":
                grad.zero_()
            elif grad is not None:
                grad.mul_(value)


def optimizer_of(params: Any, momentum: bool) -> torch.optim.Optimizer:
    if momentum:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


async def run_case(world: int, plan: list[list[Edit]], momentum: bool) -> None:
    batches = data(world)

    def make_replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        replica = model(rank)  # ranks start apart: rank 0's weights are broadcast
        return replica, optimizer_of(replica.parameters(), momentum)

    def dummy_loss(module: nn.Module, batch: Any) -> torch.Tensor:
        raise AssertionError("the loop runs its own forward")

    async def body(trainer: DistributedTrainer) -> list[list[bytes]]:
        rank = trainer.run.rank
        wrapped = DistributedDataParallel.unwrapped_around(trainer, optimizer_known=False)
        optimizer = trainer.run.optimizer
        params = list(trainer.model.parameters())

        def loop() -> list[list[bytes]]:
            history = []
            for (x, y), step_edits in zip(batches, plan):
                rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                optimizer.zero_grad()
                nn.functional.mse_loss(wrapped(x[rows]), y[rows]).backward()
                apply_edits(params, step_edits)
                optimizer.step()
                wrapped.verified()
                history.append(_state_bytes(trainer.model, optimizer))
            return history

        return await trio.to_thread.run_sync(loop, abandon_on_cancel=True)

    with trio.fail_after(SECONDS):
        results = await train_in_process(world, make_replica, dummy_loss, body)
    for rank, history in enumerate(results[1:], start=1):
        assert history == results[0], f"rank {rank} differs from rank 0 (C-DDP-001)"

    reference = model(0)
    ref_optimizer = optimizer_of(reference.parameters(), momentum)
    params = list(reference.parameters())
    for (x, y), step_edits in zip(batches, plan):
        grads = []
        for rank in range(world):
            reference.zero_grad()
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        for index, param in enumerate(params):
            param.grad = sum(g[index] for g in grads) / world  # type: ignore[assignment]
        apply_edits(params, step_edits)
        ref_optimizer.step()
    final = results[0][-1]
    for index, param in enumerate(params):
        ours = torch.frombuffer(bytearray(final[index]), dtype=param.dtype).reshape(param.shape)
        torch.testing.assert_close(ours, param.detach(), rtol=1e-5, atol=1e-6)


def _state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[bytes]:
    out = [p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in module.parameters()]
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(
                    value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
    return out


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    world=st.integers(2, 3),
    plan=st.lists(st.lists(edits, max_size=3), min_size=STEPS, max_size=STEPS),
    momentum=st.booleans(),
)
def test_gradient_edits_between_backward_and_step(
    world: int, plan: list[list[Edit]], momentum: bool
) -> None:
    note(f"world={world} plan={plan} momentum={momentum}")
    trio.run(run_case, world, plan, momentum)
