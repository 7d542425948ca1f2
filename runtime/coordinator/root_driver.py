"""`RootDriver`: the root of the coordinator tree (`root_core.RootCore`) as the coordinator's
shell drives a core (`shell_core.ShellCore`), sans-I/O.

The shell's peers are the hosts' sub-coordinators, each known by its index (the rank its link
authenticated with). The driver turns the shell's connection events into the root's (a closed
link is `tree_events.HostGone`, a bad frame `tree_events.HostMalformed`), keeps each joined
host's liveness (`liveness.Liveness`: a host link silent past the heartbeat deadline is a lost
host, one membership change naming the host and its ranks) and turns the root's actions into
the shell's (`ToHosts` for the epoch's hosts: a `Broadcast`; `RefuseHost`: a `Refuse`).
Its `tree_stall.StallClock`, moved by every host report and set forward by the hosts' stall
notices, decides when a step stalled (`tree_stall.root_stall` names the ranks).
"""

from __future__ import annotations

from paramsync.runtime.coordinator.events import (
    Abort,
    Action,
    Broadcast,
    Disconnected,
    Malformed,
    Refuse,
    Report,
    Send,
    Tick,
)
from paramsync.runtime.coordinator.liveness import Liveness
from paramsync.runtime.coordinator.root_core import RootAction, RootCore
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.tree_events import HostGone, HostMalformed, RefuseHost, ToHosts
from paramsync.runtime.coordinator.tree_stall import StallClock, root_stall
from paramsync.runtime.protocol.messages import Heartbeat, HostJoined, HostStall, Signature

__all__ = ["RootDriver"]


class RootDriver:
    """Drives ``root`` for the shell; its peers are hosts. It is its own view."""

    def __init__(self, root: RootCore) -> None:
        self.root = root
        deadline = root.heartbeat_deadline
        self.liveness = Liveness(
            heartbeat_deadline=deadline,
            rejoin_seconds=deadline,
            rendezvous_seconds=deadline,
            stall_seconds=deadline,
            stall_deadline=None,
        )
        self._hosts = 0
        """How many hosts the root held when the driver last looked (per step it does O(1):
        the hosts are looked through only when their number changed)."""
        self._largest = 1
        self.stall_clock = StallClock(root.stall_seconds, root.stall_deadline)

    # ------------------------------------------------------------------- the view

    @property
    def view(self) -> RootDriver:
        return self

    @property
    def state(self) -> RunState:
        return self.root.state

    @property
    def abort_reason(self) -> str | None:
        return self.root.abort_reason

    @property
    def step(self) -> int:
        return self.root.current.step

    @property
    def epoch(self) -> int:
        return self.root.epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The hosts with members in the current epoch."""
        return self.root.epoch_hosts

    @property
    def joined(self) -> tuple[int, ...]:
        """The hosts whose join the root took (and has not lost)."""
        return tuple(sorted(self.root.hosts))

    @property
    def reference_signature(self) -> Signature | None:
        return self.root.membership.reference

    @property
    def largest_host(self) -> int:
        """The most workers a joined host runs (1 before any joined)."""
        return self._largest

    # ------------------------------------------------------------------- events

    def handle(self, event: object) -> list[Action]:
        """Feed one event from host link ``rank`` (a host report, a heartbeat, a closed link,
        a bad frame) or a `Tick`; the shell's actions, in order."""
        root, live = self.root, self.liveness
        if isinstance(event, Heartbeat):
            live.heartbeat(event.rank, event.now)
            return []
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, Disconnected):
            live.forget(event.rank)
            return self._actions(root.handle(HostGone(event.rank, event.reason)))
        if isinstance(event, Malformed):
            return self._actions(root.handle(HostMalformed(event.rank, event.error)))
        if isinstance(event, HostStall):
            if live.now is not None:
                self.stall_clock.moved_at(live.now - event.waited)
        else:
            self.stall_clock.moved()
        actions = self._actions(root.handle(event))
        if isinstance(event, HostJoined) and event.host in root.hosts:
            live.joined(event.host, live.now)
        return actions

    def _tick(self, now: float) -> list[Action]:
        """Hosts silent past the deadline are lost; then the root's own tick."""
        live = self.liveness
        live.observe(now)
        actions: list[Action] = []
        for host, gap in live.silent(now):
            live.forget(host)
            if self.root.state is not RunState.ABORTED:
                actions += self._actions(self.root.handle(HostGone(host, live.missed(gap))))
        actions += self._actions(self.root.handle(Tick(now)))
        if self.root.state is RunState.RUNNING:
            stall = self.stall_clock.check(now)
            if stall is not None:
                actions += self._actions(root_stall(self.root, stall))
        return actions

    def _actions(self, actions: list[RootAction]) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            if isinstance(action, ToHosts):
                if action.hosts == self.root.epoch_hosts:
                    out.append(Broadcast(action.message))
                else:
                    out += [Send(host, action.message) for host in action.hosts]
            elif isinstance(action, RefuseHost):
                out.append(Refuse(action.host, action.reason))
            elif isinstance(action, Abort | Report):
                out.append(action)
            else:
                raise TypeError(f"not a root coordinator action: {action!r}")
        self._hosts_changed()
        return out

    def _hosts_changed(self) -> None:
        """After a join or a loss: forget the liveness of hosts the root no longer holds and
        take the largest host's size (for the frame cap)."""
        hosts = self.root.hosts
        if len(hosts) == self._hosts:
            return
        self._hosts = len(hosts)
        for host in self.liveness.last_heartbeat:
            if host not in hosts:
                self.liveness.forget(host)
        self._largest = max((len(record.ranks) for record in hosts.values()), default=1)
