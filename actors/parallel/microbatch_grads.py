"""A stage's weight gradients, accumulated in ascending micro-batch order whatever the schedule.

Schedules run a stage's backwards in different orders (GPipe may go last-to-first, interleaved
and zero-bubble schedules defer weight gradients). Floating-point addition does not commute
bitwise, so accumulating in arrival order would give each schedule its own last bits.
`OrderedGradients` holds each micro-batch's gradients until every earlier micro-batch's are
folded in, then folds them into ``param.grad``: ``g0``, then ``+= g1``, ``+= g2``, ... exactly as
one process calling ``backward()`` per micro-batch in order does, so every schedule gives bitwise
the same gradients as that reference (the parallelism anchors' note).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["OrderedGradients"]


class OrderedGradients:
    """Folds per-micro-batch gradients of ``params`` into their ``.grad`` in micro-batch order."""

    def __init__(self, stage: int, params: Sequence[nn.Parameter]) -> None:
        self.stage = stage
        self.params = list(params)
        self._pending: dict[int, list[torch.Tensor | None]] = {}
        self._next = 0
        self._microbatches = 0

    def start(self, microbatches: int) -> None:
        """Begin a step of ``microbatches`` micro-batches."""
        self._pending.clear()
        self._next = 0
        self._microbatches = microbatches

    @property
    def folded(self) -> int:
        """How many micro-batches (0, 1, ...) have been folded in so far this step."""
        return self._next

    def add(self, microbatch: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Micro-batch ``microbatch``'s gradients (one per parameter, None: no gradient);
        folded now if every earlier one is, else held until they are."""
        if not 0 <= microbatch < self._microbatches:
            raise ValueError(
                f"stage {self.stage}: weight gradients of micro-batch {microbatch}, outside "
                f"0..{self._microbatches - 1}"
            )
        if microbatch < self._next or microbatch in self._pending:
            raise ValueError(
                f"stage {self.stage}: weight gradients of micro-batch {microbatch} computed twice"
            )
        if len(grads) != len(self.params):
            raise ValueError(
                f"stage {self.stage}: {len(grads)} gradients for {len(self.params)} parameters"
            )
        self._pending[microbatch] = list(grads)
        while self._next in self._pending:
            self._fold(self._pending.pop(self._next))
            self._next += 1

    def missing(self) -> list[int]:
        """The micro-batches whose weight gradients have not been folded in."""
        return list(range(self._next, self._microbatches))

    def _fold(self, grads: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for param, grad in zip(self.params, grads, strict=True):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
