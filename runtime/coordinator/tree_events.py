"""The coordinator tree's vocabulary beyond the flat core's: what a host's sub-coordinator
(`paramsync.runtime.coordinator.host_fold`) and the root (`paramsync.runtime.coordinator.root_core`)
are fed that never travels, and the actions that address the other level of the tree.

The worker-facing actions are the flat core's (`paramsync.runtime.coordinator.events`: `Send`,
`Broadcast` to the host's members, `Refuse`, `Abort`, `Evict`, `Report`); the messages between
the levels are declared in `paramsync.runtime.protocol.messages` (the host kinds up, the
root kinds down: the coordinator's and `DigestQuery`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paramsync.runtime.protocol.messages import HostReport, JoinRefused, RootMessage

__all__ = [
    "FromRoot",
    "RootLost",
    "Up",
    "ToHost",
    "ToHosts",
    "RefuseHost",
    "HostGone",
    "HostMalformed",
]


# --------------------------------------------------------------------------- host events


@dataclass(frozen=True)
class FromRoot:
    """The root sent the host ``message`` (decoded by `root_message_from_wire`)."""

    message: RootMessage


@dataclass(frozen=True)
class RootLost:
    """The host's link to the root closed or failed: the run is over for its workers."""

    reason: str


# --------------------------------------------------------------------------- host actions


@dataclass(frozen=True)
class Up:
    """Send ``message`` to the root."""

    message: HostReport


# --------------------------------------------------------------------------- root actions


@dataclass(frozen=True)
class ToHost:
    """Send ``message`` to host ``host`` (which fans it out to its members)."""

    host: int
    message: RootMessage


@dataclass(frozen=True)
class ToHosts:
    """Send ``message`` to every host with a member in the current epoch (``hosts``)."""

    message: RootMessage
    hosts: tuple[int, ...]


@dataclass(frozen=True)
class RefuseHost:
    """Refuse host ``host``'s join: send ``message`` (its host refuses each of its workers)
    and close its link."""

    host: int
    reason: str

    @property
    def message(self) -> JoinRefused:
        return JoinRefused(self.reason)


# --------------------------------------------------------------------------- root events


@dataclass(frozen=True)
class HostGone:
    """Host ``host``'s link to the root closed or failed (its machine, or its sub-coordinator
    alone, is lost): ``reason``."""

    host: int
    reason: str


@dataclass(frozen=True)
class HostMalformed:
    """Host ``host`` sent something the root's shell could not parse (``error``)."""

    host: int
    error: str
