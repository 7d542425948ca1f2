"""`HostDriver`: a host's sub-coordinator (`host_fold.HostFold`) as the coordinator's shell
drives a core (`shell_core.ShellCore`), sans-I/O.

The fold takes its workers' reports and the root's answers; the driver adds what the fold
leaves to its shell: the workers' liveness (`liveness.Liveness`: a worker silent past the
heartbeat deadline is disconnected, which its host handles as the flat coordinator handles a
lost member), the run's state and abort reason as the shell reads them (`ShellView`), and a
stall clock (`tree_stall.StallClock`): a step partly reported with no worker report for a
quarter of ``stall_seconds`` is told to the root (`HostFold.stall_notice`). The fold's
`tree_events.Up` actions pass through for the shell to send to the root.
"""

from __future__ import annotations

from collections.abc import Sequence

from paramsync.runtime.coordinator.events import Abort, Disconnected, Evict, Tick
from paramsync.runtime.coordinator.host_fold import HostAction, HostFold, HostState
from paramsync.runtime.coordinator.liveness import Liveness
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.tree_events import FromRoot, Up
from paramsync.runtime.coordinator.tree_stall import NOTICE_FRACTION, StallClock
from paramsync.runtime.protocol.messages import Heartbeat, Joined, JoinRefused, Signature

__all__ = ["HostDriver"]

_STATES = {
    HostState.JOINING: RunState.RENDEZVOUS,
    HostState.JOINED: RunState.RENDEZVOUS,
    HostState.RUNNING: RunState.RUNNING,
}


class HostDriver:
    """Drives ``fold`` for the shell; ``heartbeat_deadline``: seconds of silence after which
    a joined worker is lost. It is its own view (``driver.view is driver``)."""

    def __init__(
        self, fold: HostFold, *, heartbeat_deadline: float, stall_seconds: float = 60.0
    ) -> None:
        if not heartbeat_deadline > 0:
            raise ValueError(f"heartbeat_deadline must be positive, got {heartbeat_deadline!r}")
        self.fold = fold
        self.liveness = Liveness(
            heartbeat_deadline=heartbeat_deadline,
            rejoin_seconds=heartbeat_deadline,
            rendezvous_seconds=heartbeat_deadline,
            stall_seconds=heartbeat_deadline,
            stall_deadline=None,
        )
        self.stall_clock = StallClock(stall_seconds / NOTICE_FRACTION, None)
        """Moved by every worker report and root message: a partly reported step that it
        finds stalled is told to the root."""
        self.abort_reason: str | None = None
        """Why the run ended here, when it did not finish: an abort or the root's refusal."""

    # ------------------------------------------------------------------- the view

    @property
    def view(self) -> HostDriver:
        return self

    @property
    def state(self) -> RunState:
        fold_state = self.fold.state
        if fold_state is HostState.DONE:
            return RunState.FINISHED if self.abort_reason is None else RunState.ABORTED
        return _STATES[fold_state]

    @property
    def step(self) -> int:
        return self.fold.current.step

    @property
    def epoch(self) -> int:
        return self.fold.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.fold.members

    @property
    def joined(self) -> tuple[int, ...]:
        return tuple(sorted(self.fold.joins))

    @property
    def reference_signature(self) -> Signature | None:
        return self.fold.reference

    # ------------------------------------------------------------------- events

    def handle(self, event: object) -> Sequence[HostAction]:
        """Feed one event (a worker's, a `Tick`, the root's); the actions, in order."""
        fold, live = self.fold, self.liveness
        if isinstance(event, Heartbeat):
            live.heartbeat(event.rank, event.now)
            return []
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, Disconnected):
            live.forget(event.rank)
        self.stall_clock.moved()
        actions = fold.handle(event)
        if isinstance(event, Joined) and event.rank in fold.joins:
            live.joined(event.rank, event.now)
        for action in actions:
            if isinstance(action, Evict):
                live.forget(action.rank)
            elif isinstance(action, Abort) and self.abort_reason is None:
                self.abort_reason = action.reason
        if (
            isinstance(event, FromRoot)
            and isinstance(event.message, JoinRefused)
            and self.abort_reason is None
        ):
            self.abort_reason = f"the root refused host {fold.name!r}: {event.message.reason}"
        return actions

    def _tick(self, now: float) -> list[HostAction]:
        """Workers silent past the deadline are disconnected (and their links closed)."""
        live = self.liveness
        live.observe(now)
        actions: list[HostAction] = []
        for rank, gap in live.silent(now):
            if self.fold.state is HostState.DONE:
                break
            live.forget(rank)
            reason = live.missed(gap)
            lost = self.fold.handle(Disconnected(rank, reason))
            actions += [Evict(rank, reason), *lost] if lost else []
        if self.fold.state is HostState.RUNNING:
            stall = self.stall_clock.check(now)
            notice = None if stall is None else self.fold.stall_notice(stall.waited)
            if notice is not None:
                actions.append(Up(notice))
        return actions
