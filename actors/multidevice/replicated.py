"""The seam between a process holding several devices and `DistributedTrainer` (hierarchical data
parallelism): `ReplicatedOptimizer`.

A multi-process run whose worker processes each hold a `DataParallelCoordinator` passes the
trainer the coordinator's primary replica as its model and ``ReplicatedOptimizer(coordinator)``
as its optimizer. Per step:

1. the trainer's compute actor sees the replicated optimizer and calls `primary_backward`
   instead of running the loss itself: every device's shard runs forward and backward in
   parallel, and the in-process average, weighted by shard size, lands in the primary replica's
   gradients;
2. the trainer all-reduces the primary's gradients across processes, as for any model (the mean
   over processes: with equal per-process batches it is the gradient of the whole global
   batch's mean loss, exactly what one process training the global batch computes);
3. the optimizer actor calls `ReplicatedOptimizer.step`, which hands the all-reduced gradient to
   every replica's own optimizer (C-DP-002 inside the process, digest-checked; C-DDP-001 across
   processes is the trainer's usual check of the primary's state).

The replicated optimizer shares replica 0's ``param_groups`` and ``state`` (what the trainer's
digest and checkpoints read); loading a state loads it into every replica's optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from paramsync.actors.multidevice.coordinator import DataParallelCoordinator

__all__ = ["ReplicatedOptimizer", "primary_backward"]


def primary_backward(coordinator: DataParallelCoordinator, samples: Any) -> float:
    """Forward and backward of ``samples`` over every replica in parallel; the weighted average
    of their trainable gradients is left in the primary replica's ``.grad``. Returns the
    batch's mean loss."""
    losses, sizes = coordinator.compute_gradients(samples)
    total = sum(sizes)
    averaged = coordinator.average_gradients([size / total for size in sizes])
    coordinator.load_primary_gradient(averaged)
    return sum(loss * size for loss, size in zip(losses, sizes)) / total


class ReplicatedOptimizer(torch.optim.Optimizer):
    """An optimizer over a `DataParallelCoordinator`'s replicas, seen by a trainer as the
    primary replica's: `step` applies the primary's (all-reduced) gradient on every replica."""

    def __init__(self, coordinator: DataParallelCoordinator) -> None:
        primary = coordinator.optimizers[0]
        super().__init__([dict(group) for group in primary.param_groups], dict(primary.defaults))
        self.coordinator = coordinator
        self.primary = primary
        self.param_groups = primary.param_groups
        self.state = primary.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Every replica steps its own optimizer with the primary replica's current gradient
        (then the replicas' digests are checked, at the coordinator's interval)."""
        if closure is not None:
            raise ValueError("ReplicatedOptimizer.step takes no closure")
        self.coordinator.apply_gradients(self.coordinator.primary_gradient())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.coordinator.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.primary.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer in self.coordinator.optimizers:
            # a copy each: torch's load_state_dict may keep the very tensors it is given
            optimizer.load_state_dict(copy.deepcopy(state_dict))
        self.param_groups = self.primary.param_groups
        self.state = self.primary.state
