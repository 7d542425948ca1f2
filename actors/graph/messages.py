"""The frozen in-process messages between a worker's actors (never on the wire).

The trainer asks the compute actor for a `Backward` per micro-batch; backward's hooks announce
each finished gradient bucket to the gradient-comm actor as a `BucketReady`; the trainer then
asks the optimizer actor for an `OptimizerStep`, which reports the step's state too (or tells it
to `Verify` the step's state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Backward", "BucketReady", "OptimizerStep", "Verify"]


@dataclass(frozen=True)
class Backward:
    """Run forward and backward on ``micro_batch``; ``sync`` on the step's last micro-batch."""

    step: int
    micro_batch: Any
    sync: bool


@dataclass(frozen=True)
class BucketReady:
    """Every gradient of ``bucket`` exists for ``step``: pack, negotiate and all-reduce it."""

    step: int
    bucket: int


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the averaged gradients of ``step``; ``verify``: then report its state digest (or
    step end) as a `Verify` of ``step`` would, before answering: the report leaves at once and
    the actor takes no second message for it."""

    step: int
    verify: bool = False


@dataclass(frozen=True)
class Verify:
    """Report ``step``'s state digest; ``force``: a digest even off the digest interval (an
    epoch's starting-state check); ``wait``: then wait for the coordinator's commit (the next
    `OptimizerStep` waits for it anyway)."""

    step: int
    force: bool = False
    wait: bool = False
