"""What the worker's protocol core is fed (events) and what it returns (actions).

Events: the coordinator's decoded messages (`Received`, its heartbeats `HeartbeatReceived`),
the link's fate (`ConnectionLost`, a `Tick` after a silence), and the trainer's requests
(`Join`, `ReportReady`, `ReportFolded`, `ReportReduced`, `ReportDigest`, `ReportStepDone`,
`ReportFinished`, `EnterEpoch`, `HeartbeatDue`). Actions: a message to send (`Send`, one of
the message dataclasses of `paramsync.runtime.coordinator.core`) and results for the trainer
(`Started`, `Announce`, `RunGo`, `RunResync`, `Progress`, `Ended`, `Silent`).
`paramsync.actors.client.protocol.WorkerProtocol` turns the one into the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from paramsync.runtime.coordinator.events import Message
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Hold,
    Joined,
    JoinRefused,
    ParallelLayout,
    Ready,
    Reduced,
    ResyncOrder,
    Shutdown,
    Signature,
    StartRun,
    StepDone,
)

__all__ = [
    # events
    "Received",
    "HeartbeatReceived",
    "ConnectionLost",
    "Tick",
    "Join",
    "ReportReady",
    "ReportFolded",
    "ReportReduced",
    "ReportDigest",
    "ReportStepDone",
    "ReportFinished",
    "EnterEpoch",
    "HeartbeatDue",
    "WorkerEvent",
    # actions
    "Report",
    "Send",
    "Started",
    "Announce",
    "RunGo",
    "RunResync",
    "Progress",
    "Ended",
    "Silent",
    "WorkerAction",
]


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Received:
    """The coordinator's message ``message`` arrived at the shell's time ``now``."""

    message: Message
    now: float | None = None


@dataclass(frozen=True)
class HeartbeatReceived:
    """The coordinator's heartbeat arrived at ``now``: it is alive."""

    now: float | None = None
    KIND: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class ConnectionLost:
    """The link broke (or the coordinator went silent): ``reason`` says how. ``rejoin``: the
    shell can redial, so hold the state and rejoin; else the run ends here."""

    reason: str
    rejoin: bool = True


@dataclass(frozen=True)
class Tick:
    """The shell's clock reads ``now`` and it heard nothing lately: check the deadline."""

    now: float


@dataclass(frozen=True)
class Join:
    """Join (or, after a loss, rejoin) with this model and data-plane address; ``step``,
    ``digest``, ``epoch``: the state this worker holds. ``fold`` None keeps the last offer;
    ``signature``/``address`` None: those of the last join."""

    signature: Signature | None
    address: tuple[str, int] | None
    step: int = 0
    digest: bytes = b""
    epoch: int = 0
    fold: bool | None = None
    mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    """The device mesh this worker's process groups follow (or ``groups``; None: neither)."""
    groups: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    """Explicit process groups, (name, ranks) each (None: none, or the mesh's)."""
    committed: bool | None = None
    """Whether (``step``, ``digest``) is a committed state (a checkpoint written only once
    committed); None: the protocol says, from the commits it saw (`WorkerProtocol.verified`)."""
    layout: ParallelLayout | None = None
    """This worker's place in a 3D-parallel run (mesh, coordinates, schedule digest); None
    keeps the last join's (none at the first: a flat data-parallel run)."""


@dataclass(frozen=True)
class ReportReady:
    """Bucket ``bucket`` of ``step`` is packed (``cached``: reduced at once, no go waited);
    ``group``: reduced within that declared process group ("": the world)."""

    step: int
    bucket: int
    spec: Any
    epoch: int
    cached: bool = False
    group: str = ""


@dataclass(frozen=True)
class ReportFolded:
    """``step``'s buckets are reduced from the response cache under ``agreement``: no ready
    each; the step's first report says so."""

    step: int
    epoch: int
    agreement: str


@dataclass(frozen=True)
class ReportReduced:
    """Every bucket of ``step`` is all-reduced here (elastic runs' apply barrier)."""

    step: int
    epoch: int


@dataclass(frozen=True)
class ReportDigest:
    """The state digest after ``step``'s optimizer step; ``tensors``: (name, digest) pairs,
    or packed bytes in the order of ``names`` (None: the names of the last packed digest);
    ``algorithm``: the name of the algorithm that computed them (empty: unnamed)."""

    step: int
    digest: bytes
    tensors: Sequence[tuple[str, bytes]] | bytes
    epoch: int
    names: Sequence[str] | None = None
    algorithm: str = ""


@dataclass(frozen=True)
class ReportStepDone:
    """``step`` is done (a step without a digest check)."""

    step: int
    epoch: int


@dataclass(frozen=True)
class ReportFinished:
    """This worker has run its last step; ``step`` is the first it will not run (``epoch``
    None: the newest announced)."""

    step: int
    epoch: int | None = None


@dataclass(frozen=True)
class EnterEpoch:
    """The trainer enters ``start``'s epoch: count commits and applies afresh from it."""

    start: StartRun


@dataclass(frozen=True)
class HeartbeatDue:
    """The shell's heartbeat timer fired at ``now``."""

    now: float = 0.0


WorkerEvent = (
    Received
    | HeartbeatReceived
    | ConnectionLost
    | Tick
    | Join
    | ReportReady
    | ReportFolded
    | ReportReduced
    | ReportDigest
    | ReportStepDone
    | ReportFinished
    | EnterEpoch
    | HeartbeatDue
)
"""What the shell feeds :meth:`WorkerProtocol.handle`."""


# --------------------------------------------------------------------------- actions


Report = Ready | Reduced | Digest | StepDone | Finished
"""A report of the trainer's, as the coordinator's core parses it."""


@dataclass(frozen=True)
class Send:
    """Send ``message`` to the coordinator (``message.to_wire()`` gives kind and fields)."""

    message: Joined | Report | Heartbeat


@dataclass(frozen=True)
class Started:
    """The coordinator answered the join with ``start``: the run (or the rejoined run) is on."""

    start: StartRun
    rejoined: bool


@dataclass(frozen=True)
class Announce:
    """A later epoch starts, or hold (the coordinator's, or this worker's own after losing the
    coordinator): tell the trainer."""

    message: StartRun | Hold


@dataclass(frozen=True)
class RunGo:
    """Run ``go``'s bucket collective now."""

    go: Go


@dataclass(frozen=True)
class RunResync:
    """Take part in ``order``'s state re-sync."""

    order: ResyncOrder


@dataclass(frozen=True)
class Progress:
    """A commit or apply moved (or an epoch was entered): wake whoever waits on them."""


@dataclass(frozen=True)
class Ended:
    """The run is over for this worker: ``error`` None after a clean finish, else the
    sentence to raise (`RunAborted`)."""

    message: Shutdown | AbortRun | JoinRefused
    error: str | None


@dataclass(frozen=True)
class Silent:
    """The coordinator stayed silent past its heartbeat deadline: treat it as lost."""

    reason: str


WorkerAction = Send | Started | Announce | RunGo | RunResync | Progress | Ended | Silent
"""What :meth:`WorkerProtocol.handle` asks the shell to do, in order."""
