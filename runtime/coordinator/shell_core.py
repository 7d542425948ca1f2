"""What the coordinator's trio shell (`paramsync.runtime.coordinator.service`) needs of the
core it drives: `ShellCore`, a sans-I/O state machine fed events that answers actions, and the
read-only `ShellView` it shows.

The flat `paramsync.runtime.coordinator.core.CoordinatorCore` is one; the coordinator tree's
drivers are the others (`paramsync.runtime.coordinator.host_driver.HostDriver` on each host,
`paramsync.runtime.coordinator.root_driver.RootDriver` at the root), so one shell serves
workers, hosts and the root alike: the same handshake, admission, frame caps, outboxes and
heartbeats.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.protocol.messages import Signature

__all__ = ["ShellCore", "ShellView"]


class ShellView(Protocol):
    """The run as the shell reads it."""

    @property
    def state(self) -> RunState: ...

    @property
    def abort_reason(self) -> str | None: ...

    @property
    def step(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def members(self) -> tuple[int, ...]:
        """Who a `Broadcast` reaches (the peers of the current epoch)."""
        ...

    @property
    def joined(self) -> Collection[int]:
        """The peers whose join was taken (a join ends a peer's join deadline)."""
        ...

    @property
    def reference_signature(self) -> Signature | None:
        """The run's model once known (it bounds the frames a peer may send)."""
        ...


class ShellCore(Protocol):
    """A sans-I/O core the shell feeds events and whose actions it executes."""

    @property
    def view(self) -> ShellView: ...

    def handle(self, event: Any) -> Sequence[object]:
        """The actions for ``event``: the flat core's (`events.Action`), and a driver's own."""
        ...
