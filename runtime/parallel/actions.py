"""The vocabulary of pipeline schedules: one closed set of frozen actions, and the p2p tag of
every send and receive.

A schedule gives each pipeline rank one list of `Action`s per training step, executed in order
(the torch.distributed.pipelining form: compute actions F, B, I, W and the communication actions
a lowering pass adds). ``stage`` is the model stage (chunk) index, 0 .. p*v-1 for p pipeline ranks
holding v chunks each; ``microbatch`` the micro-batch index, 0 .. m-1. A send or receive names
the ``peer`` pipeline rank on the other side; the tag both ends use is `p2p_tag` of the step, the
stage whose output or input gradient travels, the micro-batch and the direction, so two messages
between the same two ranks can never be confused (Megatron PR 5271's swap).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ActionKind",
    "Action",
    "Direction",
    "p2p_tag",
    "TAG_STAGE_LIMIT",
    "TAG_MICROBATCH_LIMIT",
]


class ActionKind(enum.Enum):
    """What one action does; the value is torch.distributed.pipelining's short name."""

    FORWARD = "F"
    """Run the stage's forward on one micro-batch (its input received or loaded)."""
    BACKWARD = "B"
    """Full backward of one micro-batch: input gradient and weight gradients together."""
    BACKWARD_INPUT = "I"
    """Zero-bubble split: the gradient with respect to the stage's input only."""
    BACKWARD_WEIGHT = "W"
    """Zero-bubble split: the weight gradients, after this micro-batch's BACKWARD_INPUT."""
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRADIENT = "SEND_B"
    RECV_GRADIENT = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRADIENT)


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)


class Direction(enum.IntEnum):
    """Which way a pipeline message travels: activations forward, gradients backward."""

    ACTIVATION = 0
    GRADIENT = 1


@dataclass(frozen=True, order=True)
class Action:
    """One step of one pipeline rank's list. ``peer`` is set exactly for sends and receives.

    For SEND_ACTIVATION/RECV_ACTIVATION, ``stage`` is the stage whose *output* travels (the
    sender's stage; the receiver's stage is ``stage + 1``). For SEND_GRADIENT/RECV_GRADIENT it is
    the stage whose *input gradient* travels (the sender's stage; the receiver's is ``stage - 1``).
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"an action needs stage and micro-batch >= 0, got {self}")
        if self.kind.is_compute != (self.peer is None):
            raise ValueError(
                f"{self.kind.name} {'takes no' if self.kind.is_compute else 'needs a'} peer"
            )

    @property
    def direction(self) -> Direction | None:
        if self.kind in (ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION):
            return Direction.ACTIVATION
        if self.kind in (ActionKind.SEND_GRADIENT, ActionKind.RECV_GRADIENT):
            return Direction.GRADIENT
        return None

    def tag(self, step: int) -> int:
        """The p2p tag of this send or receive at training step ``step``."""
        direction = self.direction
        if direction is None:
            raise ValueError(f"{self.kind.name} is not a send or receive: it has no tag")
        return p2p_tag(step, self.stage, self.microbatch, direction)

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.stage}{self.kind.value}{self.microbatch}{peer}"


TAG_STAGE_LIMIT = 1 << 12
"""Stages (p*v) a tag can name: 4096."""
TAG_MICROBATCH_LIMIT = 1 << 20
"""Micro-batches per step a tag can name."""


def p2p_tag(step: int, stage: int, microbatch: int, direction: Direction) -> int:
    """The tag of a pipeline message: step, stage, micro-batch and direction packed in 63 bits
    (step in the high 30, then 12 for the stage, 20 for the micro-batch, 1 for the direction)."""
    if not 0 <= stage < TAG_STAGE_LIMIT:
        raise ValueError(f"stage {stage} outside the tag's range 0..{TAG_STAGE_LIMIT - 1}")
    if not 0 <= microbatch < TAG_MICROBATCH_LIMIT:
        raise ValueError(
            f"micro-batch {microbatch} outside the tag's range 0..{TAG_MICROBATCH_LIMIT - 1}"
        )
    if not 0 <= step < (1 << 30):
        raise ValueError(f"step {step} outside the tag's range 0..{(1 << 30) - 1}")
    return (((step << 12 | stage) << 20 | microbatch) << 1) | int(direction)
