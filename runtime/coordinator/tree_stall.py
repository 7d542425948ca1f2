"""Stalls in the coordinator tree (pure): when a step stops moving, whom it waits for.

A host knows which of its workers a step waits for; the root knows which hosts. A host whose
step is partly reported (some members made a call, or ended the step, and others did not)
with no report for a quarter of the stall time sends the root a `HostStall`: what it waits
in, its members that reported it, and how long it has waited (again at each quarter while it
waits). The root keeps each host's latest notice of the step in flight; its `StallClock` is
moved by every host report and set forward by a notice (the host moved ``waited`` seconds
before it), so it measures, as the flat coordinator's does, the time since any worker last
reported. `root_stall` then decides as `paramsync.runtime.coordinator.clock` does: at
``stall_seconds`` a `Report` naming the ranks, past ``stall_deadline`` the run stops, in the
flat coordinator's words (a torch.distributed call: its name, number, the ranks that have not
called it and those waiting in it). With ``idle_stalls`` off (a torch.distributed group) a
step no host reported anything of and no host sent a notice about is idle, not stalled.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from paramsync.runtime.coordinator.digest_groups import mask_positions
from paramsync.runtime.coordinator.events import Report, format_seconds
from paramsync.runtime.coordinator.liveness import Stall
from paramsync.runtime.coordinator.root_core import RootAction, RootCore
from paramsync.runtime.protocol.messages import CALL_PREFIX, BucketSpec, HostStall

__all__ = ["StallClock", "root_stall", "call_name"]

NOTICE_FRACTION = 4
"""A host sends its notice after this fraction of the stall time without a report."""


class StallClock:
    """When the tree last moved, as the ticks read it: a `Stall` once nothing moved for
    ``stall_seconds`` (again at each multiple), ``give_up`` past ``stall_deadline`` (None:
    never). `moved` counts a report (its time is the next tick's); `moved_at` takes a host's
    notice that its workers last reported at ``at``."""

    def __init__(self, stall_seconds: float, stall_deadline: float | None) -> None:
        if not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be positive, got {stall_seconds!r}")
        if stall_deadline is not None and not stall_deadline > 0:
            raise ValueError(f"stall_deadline must be positive, got {stall_deadline!r}")
        self.stall = float(stall_seconds)
        self.deadline = stall_deadline
        self._moves = 0
        self._seen = -1
        self._since: float | None = None
        self._reports = 0

    def moved(self) -> None:
        self._moves += 1

    def moved_at(self, at: float) -> None:
        """A host's workers last reported at ``at`` (its notice): the wait counts from then
        when that is later than the clock's last move."""
        if self._seen == self._moves and self._since is not None and at > self._since:
            self._since = at
            self._reports = 0

    def check(self, now: float) -> Stall | None:
        """At a tick: a `Stall` when nothing moved for ``stall_seconds`` (once per multiple)
        or past ``stall_deadline``; None otherwise."""
        if self._moves != self._seen or self._since is None:
            self._seen, self._since, self._reports = self._moves, now, 0
            return None
        waited = now - self._since
        if self.deadline is not None and waited > self.deadline:
            return Stall(waited, give_up=True)
        if waited < self.stall * (self._reports + 1):
            return None
        self._reports += 1
        return Stall(waited, give_up=False)


def call_name(spec: BucketSpec | None) -> str | None:
    """The torch.distributed call a bucket spec describes (`CALL_PREFIX`), or None."""
    if spec is None or isinstance(spec, str) or not spec or not isinstance(spec[0][1], str):
        return None
    dtype = spec[0][1]
    return dtype[len(CALL_PREFIX) :] if dtype.startswith(CALL_PREFIX) else None


# --------------------------------------------------------------------------- the root's side


def _notices(root: RootCore) -> dict[int, HostStall]:
    """The hosts' notices about the step in flight (older ones are stale)."""
    state, epoch = root.current, root.epoch
    return {
        host: notice
        for host, notice in root.stall_notices.items()
        if notice.epoch == epoch and notice.step == state.step and host in root.host_members
    }


def _noticed(root: RootCore, notice: HostStall) -> set[int]:
    members = root.host_members[notice.host]
    return {members[i] for i in mask_positions(notice.members) if i < len(members)}


def _missing(
    root: RootCore, hosts: Collection[int], notices: Mapping[int, HostStall], bucket: int
) -> tuple[int, ...]:
    """The epoch's ranks outside ``hosts`` and outside the notices about ``bucket``."""
    present: set[int] = set()
    for host in hosts:
        present.update(root.host_members.get(host, ()))
    for host, notice in notices.items():
        if host not in hosts and notice.bucket == bucket:
            present |= _noticed(root, notice)
    return tuple(r for r in root.members if r not in present)


def _waiting_call(
    root: RootCore, notices: Mapping[int, HostStall]
) -> tuple[str, int, tuple[int, ...]] | None:
    """The torch.distributed call the step waits in, some ranks having made it and others
    not: its name, its number and the ranks that have not called it (`StepState.waiting_call`
    over hosts)."""
    state = root.current
    if state.verifying or state.applied or state.reduced:
        return None
    buckets = set(state.pending)
    open_buckets = (n.bucket for n in notices.values() if n.bucket not in state.gone)
    buckets.update(b for b in open_buckets if b >= 0)
    if not buckets:
        return None
    bucket = min(buckets)
    reports = state.pending.get(bucket, {})
    name = None
    cache = root.negotiation.cache
    for spec in reports.values():
        full = (cache.known(spec) or cache.spec(bucket)) if isinstance(spec, str) else spec
        name = call_name(full)
        break
    if name is None:
        name = next((n.call for n in notices.values() if n.bucket == bucket and n.call), None)
    if not name:
        return None
    return name, bucket, _missing(root, reports, notices, bucket)


def _waiting_for(root: RootCore, notices: Mapping[int, HostStall]) -> tuple[str, tuple[int, ...]]:
    """What the step waits for: a phase and the ranks (`StepState.waiting_for` over hosts)."""
    state = root.current
    if state.verifying:
        phase = f"the epoch's state transfer and check of step {state.step}"
        return phase, _missing(root, state.done, notices, -1)
    if state.applied:
        return "the optimizer step and digest", _missing(root, state.done, notices, -1)
    if state.reduced:
        return "the all-reduce", _missing(root, state.reduced, notices, -1)
    noticed = sorted(n.bucket for n in notices.values() if n.bucket >= 0)
    if state.pending or noticed:
        bucket = min([*state.pending, *noticed])
        reports = state.pending.get(bucket, {})
        return f"backward (bucket {bucket} not ready)", _missing(root, reports, notices, bucket)
    if state.done or notices:
        return "the all-reduce, optimizer step and digest", _missing(root, state.done, notices, -1)
    if state.gone:
        return "backward or the all-reduce", root.members
    return "data loading and forward", root.members


def _partly_reported(root: RootCore, notices: Mapping[int, HostStall]) -> bool:
    state = root.current
    return bool(state.pending) or bool(notices) or 0 < len(state.done) < len(root.epoch_hosts)


def root_stall(root: RootCore, stall: Stall) -> list[RootAction]:
    """The root's clock says nothing moved for ``stall.waited`` seconds: a `Report` naming
    the ranks the step waits for, or past the deadline (``stall.give_up``) the run's end, in
    the flat coordinator's words; nothing for an idle step when ``idle_stalls`` is off."""
    notices = _notices(root)
    if not root.idle_stalls and not _partly_reported(root, notices):
        return []  # every member at the same point between calls: idle, not stalled
    state, epoch = root.current, root.epoch
    waited = format_seconds(stall.waited)
    deadline = format_seconds(root.stall_deadline or stall.waited)
    call = _waiting_call(root, notices)
    if call is not None and not root.elastic:
        name, number, missing = call
        waiting = [r for r in root.members if r not in missing]
        where = f"{name} (step {state.resume_step}, call {number})"
        return _report_or_stop(
            root,
            stall,
            f"stall: {where}: ranks {waiting} have waited {waited} s for "
            f"ranks {list(missing)}, which have not called it",
            f"{where}: ranks {list(missing)} did not call it within the timeout of "
            f"{deadline} s (ranks {waiting} waited in it)",
        )
    phase, ranks = _waiting_for(root, notices)
    step = state.resume_step
    return _report_or_stop(
        root,
        stall,
        f"stall: step {step} (epoch {epoch}) has waited {waited} s for ranks "
        f"{list(ranks)} in {phase}",
        f"step {step}: ranks {list(ranks)} stalled for {waited} s in {phase} "
        f"(stall deadline {deadline} s)",
    )


def _report_or_stop(root: RootCore, stall: Stall, report: str, stop: str) -> list[RootAction]:
    """Before the deadline (or in an elastic run, which the root never stops for a stall):
    the ``report``; past it: the run's end with ``stop``."""
    if not stall.give_up or root.elastic:
        return [Report(report)]
    return root.stop(stop)
