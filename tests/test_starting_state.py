"""C-DDP-001 before the first step of a broadcast epoch (second security review, row 1).

An epoch that starts from a state transfer checks every member's digest of the step before
(the coordinator's opening check); a broadcast epoch (the run's start) now checks too, on its
own data plane, right after the initial broadcast: every member's per-tensor digests against
position 0's, or every member fails naming the ranks that differ (and, on those, the first
tensor), before any step runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from torch import nn

from paramsync.actors.train.trainer import DistributedTrainer, StartingStateDiffers
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.errors import pick_error
from paramsync.runtime.transport.base import InProcessTransport

SECONDS = 60.0


class MisLanding(InProcessTransport):
    """Rank 1's landing of the broadcast's ``nth`` tensor is off by one in its first element:
    what a receiver that lost or altered bytes after their check would hold."""

    nth = 2

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        message = await super().recv_into(peer, out)
        self.nth -= 1
        if self.nth == 0 and out.is_floating_point():
            out.view(-1)[0] += 1.0
        return message


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(rank)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


async def test_a_rank_whose_broadcast_state_differs_stops_the_run_before_any_step() -> None:
    transports = InProcessTransport.create_group(2)
    bad = MisLanding(1, 2, transports[1]._senders, transports[1]._receivers)
    transports[1] = bad
    stepped: list[int] = []

    async def body(trainer: DistributedTrainer) -> None:
        stepped.append(trainer.run.rank)

    with pytest.raises(BaseException) as info, trio.fail_after(SECONDS):
        await train_in_process(2, replica, mse, body, transports=transports)
    error = pick_error(info.value)
    assert isinstance(error, StartingStateDiffers), repr(error)
    assert error.ranks == [1] and error.step == 0
    assert "after the initial broadcast, ranks [1] hold another state than position 0's" in str(
        error
    )
    assert stepped == []  # no rank reached its first step


async def test_identical_starting_states_pass_the_check() -> None:
    async def body(trainer: DistributedTrainer) -> list[bytes]:
        await trainer.train_batch((torch.randn(3, 4), torch.randn(3, 2)))
        return [p.detach().numpy().tobytes() for p in trainer.model.parameters()]

    with trio.fail_after(SECONDS):
        results = await train_in_process(3, replica, mse, body)
    assert results[0] == results[1] == results[2]
