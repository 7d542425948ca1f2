"""Fault injection for the fault-tolerance trials: a process SIGKILLs itself at a chosen point.

A `Fault` names the point, ``phase:step``. Nothing in the production modules knows about
faults: a fault is injected by wrapping what a process runs. Here are the engine's wrappers:
`FaultyTransport` (a transport that dies right after a frame leaves, once armed) and
`commit_fault_core` (a `CoordinatorCore` that dies when it decides to commit the step, before
anyone hears of it); `forged_report_core` is a deliberately broken core (it acts on a report
from a peer that never joined), the target `paramsync.runtime.testing.hostile` must catch. The
worker's phases are wrapped around its actors by `paramsync.actors.testing.faults`;
`paramsync.runtime.testing.faulty_daemon` passes either side into a daemon process's normal
``paramsync`` main. The kill is a real SIGKILL of the process: no cleanup, no goodbye on any socket.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Action, Broadcast, Event, Send
from paramsync.runtime.protocol.messages import WORKER_KINDS, Commit, Shutdown
from paramsync.runtime.transport.base import Transport
from paramsync.runtime.transport.capabilities import (
    AllReducePlane,
    PrecodedFrames,
    SharedMemoryHolder,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "PHASES",
    "COORDINATOR_PHASES",
    "Fault",
    "FaultyTransport",
    "commit_fault_core",
    "forged_report_core",
    "parse_fault",
]

PHASES = ("data", "forward", "backward", "allreduce", "optimizer", "digest")
"""Where a worker can be killed: loading the batch, forward, backward, in the middle of a
gradient all-reduce (after its first frame left), in the optimizer step, before its digest."""
COORDINATOR_PHASES = ("commit",)
"""Where the coordinator can be killed: when it has decided to commit a step, before anyone
hears of it."""


def parse_fault(text: str | None) -> tuple[str, int] | None:
    """``"phase:step"`` -> (phase, step); None for an empty value; ValueError names the problem."""
    if not text:
        return None
    phase, _, step = text.partition(":")
    phases = PHASES + COORDINATOR_PHASES
    if phase not in phases or not step.isdigit():
        raise ValueError(
            f"fault {text!r}: expected PHASE:STEP with PHASE one of {', '.join(phases)}"
        )
    return phase, int(step)


@dataclass(frozen=True)
class Fault:
    """Kill this process with SIGKILL at ``phase`` of ``step``; first write the wall-clock
    time of the kill to ``stamp`` (the trials' detection figures start there)."""

    phase: str
    step: int
    stamp: str | None = None

    @classmethod
    def parse(cls, text: str, stamp: str | None = None) -> Fault:
        """The fault ``"phase:step"`` names (ValueError if it names none)."""
        parsed = parse_fault(text)
        if parsed is None:
            raise ValueError("fault: expected PHASE:STEP, got an empty value")
        return cls(*parsed, stamp=stamp)

    def at(self, phase: str, step: int) -> bool:
        """Whether ``phase`` of ``step`` is this fault's point."""
        return (phase, step) == (self.phase, self.step)

    def kill(self) -> None:
        """Write the stamp, then SIGKILL this process (from any thread); never returns."""
        if self.stamp:
            with open(self.stamp, "w") as out:
                out.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def strike(self, phase: str, step: int) -> None:
        """Kill this process if ``phase`` of ``step`` is this fault's point."""
        if self.at(phase, step):
            self.kill()


class FaultyTransport(SharedMemoryHolder):
    """A transport that, once `arm` ed, SIGKILLs the process right after the next frame it
    sends has left: a rank dying in the middle of a collective, its peers waiting for the
    rest of its part.

    Everything else is the wrapped transport's (its op ids, its shared-memory plane, its
    receives). It lends no blocking links, so the ring runs on trio tasks and every frame
    passes through `send`; the shared-memory plane's threaded mode signals its peers on a
    thread the wrapper does not see (the caller then kills after the collective, see
    `paramsync.actors.testing.faults`).
    """

    def __init__(self, inner: Transport, fault: Fault) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner = inner
        self.fault = fault
        self.armed = False

    @property
    def shared_memory(self) -> AllReducePlane | None:
        """The wrapped transport's shared-memory plane, if any: a member whose wrapper hid it
        would run another algorithm than its peers."""
        inner = self.__dict__.get("inner")
        return inner.shared_memory if isinstance(inner, SharedMemoryHolder) else None

    @shared_memory.setter
    def shared_memory(self, plane: AllReducePlane | None) -> None:
        inner = self.__dict__.get("inner")
        if isinstance(inner, SharedMemoryHolder):
            inner.shared_memory = plane

    @property
    def stall_seconds(self) -> float:  # type: ignore[override]
        inner = self.__dict__.get("inner")
        return inner.stall_seconds if isinstance(inner, PrecodedFrames) else 10.0

    def arm(self) -> None:
        """Kill the process after the next frame this transport sends."""
        self.armed = True

    def _sent(self) -> None:
        if self.armed:
            self.fault.kill()

    def next_op_id(self) -> int:
        return self.inner.next_op_id()

    def check_peer(self, peer: int) -> None:
        self.inner.check_peer(peer)

    def describe_peer(self, peer: int) -> str:
        return self.inner.describe_peer(peer)

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        await self.inner.send(peer, kind, fields, bulk)
        self._sent()

    async def send_frame(self, peer: int, frame: bytes) -> None:
        """An encoded frame to ``peer`` (TCP transports: the shared-memory plane's signals)."""
        if not isinstance(self.inner, PrecodedFrames):
            raise TypeError(f"{type(self.inner).__name__} sends no pre-encoded frames")
        await self.inner.send_frame(peer, frame)
        self._sent()

    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        if not isinstance(self.inner, PrecodedFrames):
            raise TypeError(f"{type(self.inner).__name__} matches no pre-encoded frames")
        return await self.inner.recv_matching(peer, expected)

    async def recv(self, peer: int) -> dict[str, Any]:
        return await self.inner.recv(peer)

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        return await self.inner.recv_into(peer, out)

    def abort(self) -> None:
        self.inner.abort()

    async def aclose(self) -> None:
        await self.inner.aclose()


def commit_fault_core(fault: Fault) -> type[CoordinatorCore]:
    """A `CoordinatorCore` whose `handle` SIGKILLs the process when the actions it returns
    commit ``fault.step``: the core has decided, nobody has heard of it yet."""

    class CommitFaultCore(CoordinatorCore):
        def handle(self, event: Event) -> list[Action]:
            actions = super().handle(event)
            for action in actions:
                if isinstance(action, Broadcast) and isinstance(action.message, Commit):
                    fault.strike("commit", action.message.step)
            return actions

    return CommitFaultCore


def forged_report_core(kind: str = "heartbeat") -> type[CoordinatorCore]:
    """A broken `CoordinatorCore` that acts on a ``kind`` report (one of the worker's kinds)
    from a rank that never joined: it tells the sender the run is over, where a correct core
    refuses the sender. The daemon's shell passes a peer that has not joined only a join or a
    heartbeat (`paramsync.runtime.coordinator.frame_caps.JOINING_KINDS`), so only a forged
    ``heartbeat`` core is reachable through it. The fault the hostile-peer machine
    (`paramsync.runtime.testing.hostile`) must catch; pass it as a
    `paramsync.runtime.coordinator.service.Coordinator`'s ``core_type`` (or to
    `paramsync.runtime.cli.main.main` as ``coordinator_core``)."""
    if kind not in WORKER_KINDS or kind == "join":
        raise ValueError(
            f"forged report kind {kind!r}: expected one of "
            f"{', '.join(k for k in WORKER_KINDS if k != 'join')}"
        )
    report = WORKER_KINDS[kind]

    class ForgedReportCore(CoordinatorCore):
        def handle(self, event: Event) -> list[Action]:
            if isinstance(event, report) and getattr(event, "rank", None) not in self.view.joined:
                rank = event.rank
                return [Send(rank, Shutdown(f"finished (on a {kind} from rank {rank})"))]
            return super().handle(event)

    return ForgedReportCore
