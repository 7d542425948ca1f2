"""Liveness: heartbeats, the deadlines of holds and rendezvous, and stalled steps.

:class:`Liveness` keeps the clock as the shell last read it (the core reads none itself), each
joined rank's last heartbeat, and a progress counter that every accepted report moves. Asked at
a tick, it says who fell silent past the heartbeat deadline, whether a hold or an elastic
rendezvous ran out, and whether the step in flight stalled (:class:`Stall`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from paramsync.runtime.coordinator.events import format_seconds

__all__ = ["Liveness", "Stall"]


@dataclass(frozen=True)
class Stall:
    """Nothing moved for ``waited`` seconds: report it, or (``give_up``) drop the laggards."""

    waited: float
    give_up: bool


class Liveness:
    """The deadlines of one run, checked against the clock the shell feeds the core.

    ``heartbeat_deadline``: seconds of silence after which a rank is lost; ``rejoin_seconds``:
    how long a hold waits for joiners; ``rendezvous_seconds``: after a restart, how long after
    the last join an elastic rendezvous starts with whoever came; ``stall_seconds``: report a
    step that has not moved for that long (again at each multiple); ``stall_deadline``: then
    give up on the ranks it waits for (None: never).
    """

    def __init__(
        self,
        *,
        heartbeat_deadline: float,
        rejoin_seconds: float,
        rendezvous_seconds: float,
        stall_seconds: float,
        stall_deadline: float | None,
    ) -> None:
        self.deadline = float(heartbeat_deadline)
        self.rejoin = float(rejoin_seconds)
        self.rendezvous = float(rendezvous_seconds)
        self.stall = float(stall_seconds)
        self.stall_deadline = stall_deadline
        self.now: float | None = None
        """The latest clock reading seen (a tick, a heartbeat or a join)."""
        self._last_heartbeat: dict[int, float | None] = {}
        self._last_join_at: float | None = None
        self._hold_since: float | None = None
        self._progress = 0
        self._stall_seen = -1
        self._stall_since: float | None = None
        self._stall_reports = 0

    @property
    def last_heartbeat(self) -> Mapping[int, float | None]:
        """Each rank's last heartbeat (or join) time; None: not known until the next Tick."""
        return MappingProxyType(dict(self._last_heartbeat))

    def observe(self, now: float) -> None:
        """The clock reads ``now`` (never goes back); ranks joined without a time start now."""
        self.now = now if self.now is None else max(self.now, now)
        for rank, seen in self._last_heartbeat.items():
            if seen is None:
                self._last_heartbeat[rank] = now

    def joined(self, rank: int, now: float | None) -> None:
        """``rank`` joined at ``now`` (None: the time is not known; the next tick's)."""
        self._last_heartbeat[rank] = now
        if now is not None:
            self.observe(now)
        self._last_join_at = now if now is not None else self.now

    def forget(self, rank: int) -> None:
        """``rank`` left: its heartbeats no longer count."""
        self._last_heartbeat.pop(rank, None)

    def heartbeat(self, rank: int, now: float) -> None:
        """``rank`` sent a heartbeat at ``now`` (ignored for ranks not joined)."""
        self.observe(now)
        if rank in self._last_heartbeat:
            seen = self._last_heartbeat[rank]
            if seen is None or now > seen:
                self._last_heartbeat[rank] = now

    def silent(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds of silence) of every rank silent past the deadline, ascending."""
        return [
            (rank, now - seen)
            for rank, seen in sorted(self._last_heartbeat.items())
            if seen is not None and now - seen > self.deadline
        ]

    def missed(self, gap: float) -> str:
        """Why a rank silent for ``gap`` seconds is lost."""
        deadline = format_seconds(self.deadline)
        return f"missed heartbeats for {format_seconds(gap)} s (deadline {deadline} s)"

    def hold(self) -> None:
        """The run starts holding now (the rejoin deadline runs from the last clock reading)."""
        self._hold_since = self.now

    def resume(self) -> None:
        """An epoch started: no hold is running."""
        self._hold_since = None

    def hold_expired(self, now: float) -> bool:
        """Whether a hold has waited longer than ``rejoin_seconds`` for joiners."""
        return self._hold_since is not None and now - self._hold_since > self.rejoin

    def rendezvous_due(self, now: float) -> bool:
        """Whether no one joined for longer than ``rendezvous_seconds`` (after some join)."""
        return self._last_join_at is not None and now - self._last_join_at > self.rendezvous

    def progressed(self) -> None:
        """Something moved the run (a report taken, an epoch started)."""
        self._progress += 1

    def check_stall(self, now: float) -> Stall | None:
        """At a tick of a running step: a `Stall` when nothing moved for ``stall_seconds``
        (once per multiple of it) or past ``stall_deadline``; None otherwise."""
        if self._progress != self._stall_seen or self._stall_since is None:
            self._stall_seen = self._progress
            self._stall_since = now
            self._stall_reports = 0
            return None
        waited = now - self._stall_since
        if self.stall_deadline is not None and waited > self.stall_deadline:
            return Stall(waited, give_up=True)
        if waited < self.stall * (self._stall_reports + 1):
            return None
        self._stall_reports += 1
        return Stall(waited, give_up=False)
