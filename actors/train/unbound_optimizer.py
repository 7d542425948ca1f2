"""`UnboundOptimizer`: what a trainer holds until the caller's own optimizer is known.

`paramsync.actors.train.ddp_wrapper.DistributedDataParallel` joins its run at construction, as
torch's does, before the caller's loop names its optimizer (at its first step, or `wrap_optimizer`).
Until then the trainer holds this: no state, no hyperparameters, every rank alike, never stepped. A
state transfer cannot land in it (the donor's optimizer state has nowhere to go), so a worker that
would receive one is refused with a line saying what to pass (`check_can_receive_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["UnboundOptimizer", "check_can_receive_state"]


class UnboundOptimizer(torch.optim.Optimizer):
    """Stands for the caller's optimizer until it is known; never stepped."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__(list(params) or [torch.nn.Parameter(torch.zeros(0))], {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the unbound optimizer is never stepped")


def check_can_receive_state(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Refuse to receive a donor's training state into an `UnboundOptimizer`, saying what to
    pass instead."""
    if isinstance(optimizer, UnboundOptimizer):
        raise RuntimeError(
            f"rank {rank} joins a run in progress and must receive the training state, but "
            "its optimizer is not known yet: pass it when wrapping, "
            "DistributedDataParallel(model, optimizer=optimizer)"
        )
