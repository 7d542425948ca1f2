"""`RootCore`: the root of the coordinator tree, sans-I/O: it sees hosts, not workers.

Each host's sub-coordinator (`paramsync.runtime.coordinator.host_fold.HostFold`) folds its
workers' reports into one report per host; the root agrees on every bucket among the hosts
(`paramsync.runtime.coordinator.root_step`), passes the apply barrier, decides each step's
digest verdict from the hosts' digest groups (`paramsync.runtime.coordinator.digest_groups`:
one (digest, algorithm) everywhere commits; else it asks the hosts for their per-tensor
digests, `DigestQuery`, and decides with the flat `digest_verdict`, so a divergence names the
same ranks and tensor), commits, and
changes the membership: a host's lost member is one epoch change, and so is a whole host lost
(its link gone), naming the host and its ranks. The root keeps the run's ranks in the flat
coordinator's `Membership` (joins, the restart's donor rule, epochs), touched only at joins
and membership changes; per step it does O(1) work per host, none per rank, until a digest
check disagrees.

Events: the host kinds (`HostJoined`, `HostReady`, `HostReduced`, `HostDigest`,
`HostStepDone`, `HostFinished`, `HostLost`, `HostAbort`, `HostTensors`), `HostGone`,
`HostMalformed` and `Tick`. Actions: `ToHosts` (the root's kinds, for every host of the epoch),
`RefuseHost`, `Abort` and `Report`. The dispatch is `EVENTS`, a transition table over the
run's states (`paramsync.runtime.coordinator.run_state`).

Not taken by the tree: process groups and parallel layouts (a host refuses such joins), the
resync of a diverged minority (the run stops), holding below ``min_workers`` for joiners
(the run stops) and a worker's join after the start (a host's join after the start, its
restarted sub-coordinator's, opens a new epoch in an elastic run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paramsync.runtime.coordinator.commits import CommitRecord
from paramsync.runtime.coordinator.digest_groups import (
    check_cover,
    check_tensors,
    full_mask,
    tree_verdict,
)
from paramsync.runtime.coordinator.events import (
    MAX_WORLD,
    Abort,
    Report,
    Tick,
    is_int,
)
from paramsync.runtime.coordinator.membership import EpochRecord, Membership, resume_plan
from paramsync.runtime.coordinator.negotiation import Disagreement, Fault, Outcome
from paramsync.runtime.coordinator.root_step import Ended, HostNegotiation, RootStep
from paramsync.runtime.coordinator.run_state import DONE, RunState, Trigger, next_state
from paramsync.runtime.coordinator.tree_events import (
    HostGone,
    HostMalformed,
    RefuseHost,
    ToHosts,
)
from paramsync.runtime.protocol.messages import (
    Apply,
    Commit,
    DigestQuery,
    Go,
    HostAbort,
    HostDigest,
    HostFinished,
    HostJoined,
    HostLost,
    HostReady,
    HostReduced,
    HostStall,
    HostStepDone,
    HostTensors,
    Joined,
    Shutdown,
    StartRun,
)
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = ["RootCore", "HostRecord", "RootAction", "EVENTS"]

RootAction = ToHosts | RefuseHost | Abort | Report


@dataclass(frozen=True)
class HostRecord:
    """A joined host: its name and the world ranks of its workers."""

    name: str
    ranks: tuple[int, ...]


class RootCore:
    """The root coordinator of ``world_size`` workers on hosts. ``digest_interval``,
    ``heartbeat_deadline``, ``start_step``, ``min_workers`` and ``run_id`` are the flat
    `CoordinatorCore`'s (an elastic run has ``min_workers < world_size``)."""

    def __init__(
        self,
        world_size: int,
        *,
        digest_interval: int = 1,
        heartbeat_deadline: float = 10.0,
        start_step: int = 0,
        min_workers: int | None = None,
        run_id: str = "",
        by_spec: bool = False,
        stall_seconds: float = 60.0,
        stall_deadline: float | None = None,
        idle_stalls: bool = True,
    ) -> None:
        if not is_int(world_size) or not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be in [1, {MAX_WORLD}], got {world_size!r}")
        if not is_int(digest_interval) or digest_interval < 1:
            raise ValueError(f"digest_interval must be a positive int, got {digest_interval!r}")
        min_workers = world_size if min_workers is None else min_workers
        if not is_int(min_workers) or not 1 <= min_workers <= world_size:
            raise ValueError(f"min_workers must be in [1, {world_size}], got {min_workers!r}")
        self.world_size = world_size
        self.interval = digest_interval
        self.heartbeat_deadline = heartbeat_deadline
        self.start_step = start_step
        self.min_workers = min_workers
        self.elastic = min_workers < world_size
        if self.elastic and stall_deadline is not None:
            raise ValueError(
                "the coordinator tree does not drop the stalled ranks of an elastic run: "
                "leave stall_deadline unset (stalls are reported)"
            )
        self.run_id = run_id
        self.stall_seconds = stall_seconds
        self.stall_deadline = stall_deadline
        self.idle_stalls = idle_stalls
        """Whether a step no host reported anything of counts towards a stall
        (`paramsync.runtime.coordinator.tree_stall`)."""
        self.stall_notices: dict[int, HostStall] = {}
        """host -> its latest `HostStall` (only those about the step in flight count)."""
        self.state = RunState.RENDEZVOUS
        self.abort_reason: str | None = None
        self.membership = Membership(world_size, ring=tuple(range(world_size)), reference=None)
        self.hosts: dict[int, HostRecord] = {}
        self.host_of: dict[int, int] = {}
        """rank -> the host it runs on."""
        self.epoch_hosts: tuple[int, ...] = ()
        """The hosts with members in the current epoch."""
        self.host_members: dict[int, tuple[int, ...]] = {}
        """host -> its members in the current epoch."""
        self.full_masks: dict[int, bytes] = {}
        """host -> the `MEMBERS_MASK` of all its members in the current epoch."""
        self.current = RootStep(start_step)
        self.negotiation = HostNegotiation(self.describe, self._ranks_of, by_spec=by_spec)
        self.last_commit: CommitRecord | None = None
        self.recovering = False

    # ------------------------------------------------------------------- views

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.membership.members

    @property
    def history(self) -> tuple[EpochRecord, ...]:
        return self.membership.history

    def describe(self, host: int) -> str:
        """A host as messages name it: "host 'node3' (ranks [6, 7])"."""
        record = self.hosts.get(host)
        if record is None:
            return f"host {host}"
        return f"host {record.name!r} (ranks {list(record.ranks)})"

    def _ranks_of(self, host: int) -> tuple[int, ...]:
        return self.host_members.get(host, ())

    def handle(self, event: Any) -> list[RootAction]:
        """Feed one event; return the actions to execute, in order. TypeError: no event."""
        row = EVENTS.row(self.state, type(event))
        return [] if row.handler is None else row.handler(self, event)

    # ------------------------------------------------------------------- the run's moves

    def _move(self, trigger: Trigger) -> None:
        self.state = next_state(self.state, trigger)

    def _abort(self, reason: str) -> list[RootAction]:
        self._move(Trigger.ABORT)
        self.abort_reason = reason
        return [Abort(reason)]

    def stop(self, reason: str) -> list[RootAction]:
        """Stop the run with ``reason`` (a stall past its deadline: `tree_stall`)."""
        return self._abort(reason)

    def _fault(self, host: int, reason: str) -> list[RootAction]:
        """Host ``host`` broke the protocol: stop a static run, drop the host from an
        elastic one."""
        if not self.elastic:
            return self._abort(reason)
        return self._lose_host(host, reason)

    def _lose_host(self, host: int, reason: str) -> list[RootAction]:
        record = self.hosts.pop(host, None)
        if record is None:
            return []
        lost = f"{self.describe_record(record)} {reason}"
        if not self.elastic:
            return self._abort(lost)
        for rank in record.ranks:
            if rank in self.membership:
                self.membership.remove(rank)
        return self._after_loss(lost, record.ranks)

    @staticmethod
    def describe_record(record: HostRecord) -> str:
        return f"host {record.name!r} (ranks {list(record.ranks)})"

    def _after_loss(self, lost: str, ranks: tuple[int, ...]) -> list[RootAction]:
        if self.state is RunState.RENDEZVOUS:
            return [Report(f"{lost} before the start")]
        if not any(self.membership.is_member(r) for r in ranks):
            return [Report(f"{lost} (no member of epoch {self.epoch})")]
        head = f"step {self.current.resume_step}, epoch {self.epoch}: {lost}"
        survivors = self.membership.survivors()
        if len(self.membership) >= self.min_workers and survivors:
            opened = self._start_epoch(
                self.current.resume_step, tuple(sorted(survivors)), lost, min(survivors)
            )
            return [Report(head, "error"), *opened]
        return [
            Report(head, "error"),
            *self._abort(
                f"{head}; {len(self.membership)} worker(s) remain, below min_workers "
                f"{self.min_workers} (the coordinator tree does not hold a run for joiners)"
            ),
        ]

    def _first_epoch(self) -> list[RootAction]:
        joins = self.membership.joins
        everyone = tuple(sorted(joins))
        self.membership.resume_from(max(j.epoch for j in joins.values()))
        plan = resume_plan(joins)
        if plan is None:
            return self._start_epoch(self.start_step, everyone, "the run starts", broadcast=True)
        top = plan.step
        actions = self._start_epoch(
            top, everyone, f"the run resumes at step {top}", plan.donor, plan.receivers
        )
        self.recovering = True
        level = "error" if plan.conflict else "warning" if plan.rolled_back else "info"
        return [Report(plan.describe(), level), *actions]

    def _start_epoch(
        self,
        step: int,
        members: tuple[int, ...],
        reason: str,
        donor: int = -1,
        receivers: tuple[int, ...] = (),
        *,
        broadcast: bool = False,
    ) -> list[RootAction]:
        opening = self.membership.open_epoch(step, members, reason)
        self._move(Trigger.START_EPOCH)
        broadcast = broadcast or step == 0
        if broadcast:
            donor, receivers = -1, ()
        self.current = RootStep.opening(step, broadcast=broadcast)
        self.negotiation.new_epoch(fold=opening.fold)
        self.recovering = not opening.first
        by_host: dict[int, list[int]] = {}
        for rank in members:
            by_host.setdefault(self.host_of[rank], []).append(rank)
        self.host_members = {host: tuple(ranks) for host, ranks in sorted(by_host.items())}
        self.epoch_hosts = tuple(self.host_members)
        self.full_masks = {host: full_mask(len(r)) for host, r in self.host_members.items()}
        addresses = self.membership.addresses
        start = StartRun(
            addresses=tuple(addresses[r] for r in members),
            ring=opening.ring,
            step=step,
            digest_interval=self.interval,
            heartbeat_deadline=self.heartbeat_deadline,
            epoch=self.epoch,
            members=members,
            donor=donor,
            receivers=receivers,
            broadcast=broadcast,
            apply_barrier=self.elastic,
            fold=opening.fold,
            run=self.run_id,
        )
        starts: list[RootAction] = [ToHosts(start, self.epoch_hosts)]
        if opening.first:
            return starts
        text = f"epoch {self.epoch} starts at step {step} with ranks {list(members)} ({reason})"
        return [Report(text, "info"), *starts]

    def _to_hosts(self, message: Any) -> ToHosts:
        return ToHosts(message, self.epoch_hosts)

    # ------------------------------------------------------------------- joins

    def _on_joined(self, event: HostJoined) -> list[RootAction]:
        host = event.host
        if host in self.hosts:
            return [RefuseHost(host, f"host {host} ({event.name!r}) has already joined")]
        rejoining = self.elastic and self.state is RunState.RUNNING
        if self.state is not RunState.RENDEZVOUS and not rejoining:
            return [RefuseHost(host, f"host {event.name!r} cannot join: the run has started")]
        if not event.members:
            return [RefuseHost(host, f"host {event.name!r} joined with no worker")]
        reference = self.membership.reference, self.membership.reference_rank
        admitted: list[int] = []
        for rank, address, port, step, digest, epoch, committed, fold in event.members:
            join = Joined(
                rank,
                event.signature,
                (address, port),
                step=step,
                digest=digest,
                epoch=epoch,
                committed=committed,
                fold=fold,
            )
            refusal = self.membership.check_join(join)
            if refusal is not None:
                for taken in admitted:  # the host joins whole or not at all
                    self.membership.remove(taken)
                self.membership.reference, self.membership.reference_rank = reference
                return [RefuseHost(host, f"host {event.name!r}: {refusal}")]
            self.membership.admit(join)
            admitted.append(rank)
        ranks = tuple(sorted(admitted))
        self.hosts[host] = HostRecord(event.name, ranks)
        for rank in ranks:
            self.host_of[rank] = host
        if rejoining:
            return self._rejoin(host, ranks)
        if len(self.membership) < self.world_size:
            return []
        return self._first_epoch()

    def _rejoin(self, host: int, ranks: tuple[int, ...]) -> list[RootAction]:
        """Host ``host`` (a restarted sub-coordinator) joined an elastic run with ``ranks``:
        as the flat core takes a joiner, a new epoch now, its ranks receiving the state of the
        lowest surviving member."""
        survivors = self.membership.survivors()
        joined = f"{self.describe(host)} joined"
        if not survivors:
            return self._abort(f"{joined}: no worker holding the run's state remains")
        members = tuple(sorted({*survivors, *ranks}))
        step = self.current.resume_step
        return self._start_epoch(step, members, joined, min(survivors), ranks)

    # ------------------------------------------------------------------- reports

    def _cannot_take(self, host: int, epoch: int, what: str) -> list[RootAction] | None:
        if host not in self.hosts:
            return [RefuseHost(host, f"host {host} sent {what} but has not joined")]
        if self.state is RunState.RENDEZVOUS:
            return self._fault(host, f"{self.describe(host)} sent {what} before the run started")
        if epoch != self.epoch:
            if epoch < self.epoch:
                return []  # it raced a membership change
            return self._fault(
                host,
                f"{self.describe(host)} sent {what} for epoch {epoch}, but the run is at "
                f"{self.epoch}",
            )
        if host not in self.host_members:
            return self._fault(host, f"{self.describe(host)} sent {what} with no member")
        return None

    def _wrong_step(self, host: int, step: int, what: str) -> list[RootAction] | None:
        state = self.current
        if step == state.step:
            return None
        return self._fault(
            host,
            f"{self.describe(host)} sent {what} for step {step}, but the run is at step "
            f"{state.resume_step if state.verifying else state.step}",
        )

    def _outcome(self, host: int, outcome: Outcome) -> list[RootAction]:
        if outcome is None:
            return []
        if isinstance(outcome, Fault):
            return self._fault(host, outcome.reason)
        if isinstance(outcome, Disagreement):
            return self._abort(outcome.reason)
        if isinstance(outcome, Go):
            return [self._to_hosts(outcome)]
        return []

    def _on_ready(self, event: HostReady) -> list[RootAction]:
        host = event.host
        early = self._cannot_take(host, event.epoch, f"bucket {event.bucket} ready")
        if early is not None:
            return early
        if self.current.verifying:
            return self._fault(
                host,
                f"{self.describe(host)} reported bucket {event.bucket} ready during the "
                f"epoch's check of step {self.current.step}",
            )
        wrong = self._wrong_step(host, event.step, f"bucket {event.bucket} ready")
        if wrong is not None:
            return wrong
        outcome = self.negotiation.take(
            self.current,
            host,
            event.bucket,
            event.spec,
            event.cached,
            len(self.epoch_hosts),
            self.epoch,
        )
        return self._outcome(host, outcome)

    def _close_buckets(self, host: int, cached: str, what: str) -> list[RootAction]:
        """A host's first step report: its folded buckets, then any bucket outstanding."""
        state = self.current
        if host in state.ended:
            return []
        actions: list[RootAction] = []
        if cached:
            hosts = len(self.epoch_hosts)
            for outcome in self.negotiation.fold(state, host, cached, hosts, self.epoch):
                actions += self._outcome(host, outcome)
                if self.state is not RunState.RUNNING or host not in self.hosts:
                    return actions
        unfinished = self.negotiation.unfinished(state, host, what)
        if unfinished is not None:
            return actions + self._fault(host, unfinished)
        state.ended.add(host)
        return actions

    def _on_reduced(self, event: HostReduced) -> list[RootAction]:
        host, state = event.host, self.current
        early = self._cannot_take(host, event.epoch, "reduced")
        if early is not None:
            return early
        if not self.elastic:
            return self._fault(
                host, f"{self.describe(host)} sent reduced, but the run has no apply barrier"
            )
        wrong = self._wrong_step(host, event.step, "reduced")
        if wrong is not None or state.verifying:
            return wrong or self._fault(host, f"{self.describe(host)} sent reduced for a check")
        if host in state.reduced or state.applied:
            return self._fault(host, f"step {state.step}: {self.describe(host)} reduced twice")
        actions = self._close_buckets(host, event.cached, "sent reduced")
        if host not in state.ended or state is not self.current:
            return actions  # a fault of the host ended its report
        state.reduced.add(host)
        if len(state.reduced) < len(self.epoch_hosts):
            return actions
        state.applied = True
        return [*actions, self._to_hosts(Apply(state.step, self.epoch))]

    def _on_step_end(self, event: HostDigest | HostStepDone) -> list[RootAction]:
        host, state = event.host, self.current
        what = "a digest" if isinstance(event, HostDigest) else "step_done"
        early = self._cannot_take(host, event.epoch, what)
        if early is not None:
            return early
        wrong = self._wrong_step(host, event.step, what)
        if wrong is not None:
            return wrong
        digest_step = state.verifying or state.step % self.interval == 0
        if isinstance(event, HostDigest) != digest_step:
            expected = "a digest" if digest_step else "step_done"
            return self._fault(
                host,
                f"{self.describe(host)} sent {what} for step {state.step}: expected {expected}",
            )
        if host in state.done:
            return self._fault(host, f"step {state.step}: {self.describe(host)} ended it twice")
        if self.elastic and not state.applied:
            return self._fault(
                host, f"step {state.step}: {self.describe(host)} sent {what} before apply"
            )
        actions = self._close_buckets(host, event.cached, "finished the step")
        if host not in state.ended or state is not self.current:
            return actions  # a fault of the host ended its report
        ended: Ended
        if isinstance(event, HostDigest):
            groups = event.groups
            if len(groups) != 1 or groups[0][0] != self.full_masks[host]:
                why = check_cover([g[0] for g in groups], len(self.host_members[host]))
                if why is not None:
                    return self._fault(
                        host,
                        f"step {event.step}: {self.describe(host)} sent digests that do not "
                        f"fit its members: {why}",
                    )
            first = state.state_key
            for _, digest, algorithm in groups:
                if first is None:
                    first = state.state_key = (digest, algorithm)
                elif digest != first[0] or algorithm != first[1]:
                    state.split = True
            ended = groups
        else:
            ended = event
        state.done[host] = ended
        if len(state.done) < len(self.epoch_hosts):
            return actions
        if not digest_step or not state.split:
            return actions + self._commit()
        state.querying = True
        return [*actions, self._to_hosts(DigestQuery(state.step, self.epoch))]

    def _on_tensors(self, event: HostTensors) -> list[RootAction]:
        """A host's per-tensor digests, answering the root's query of a split digest check;
        once every host answered, the flat verdict."""
        host, state = event.host, self.current
        early = self._cannot_take(host, event.epoch, "per-tensor digests")
        if early is not None:
            return early
        wrong = self._wrong_step(host, event.step, "per-tensor digests")
        if wrong is not None:
            return wrong
        who = self.describe(host)
        if not state.querying:
            return self._fault(
                host, f"step {state.step}: {who} sent per-tensor digests the root did not ask for"
            )
        if host in state.answers:
            return self._fault(host, f"step {state.step}: {who} sent per-tensor digests twice")
        summary = state.done[host]
        assert isinstance(summary, tuple), "the root asks only after every host's digests"
        why = check_tensors(event.groups, summary, len(self.host_members[host]))
        if why is not None:
            return self._fault(
                host, f"step {state.step}: {who} sent per-tensor digests that do not fit: {why}"
            )
        state.answers[host] = event.groups
        if len(state.answers) < len(self.epoch_hosts):
            return []
        answers = [
            (group, self.host_members[h]) for h, groups in state.answers.items() for group in groups
        ]
        verdict = tree_verdict(state.step, self.epoch, answers, len(self.members))
        if verdict.abort is not None:
            return self._abort(verdict.abort)
        return self._commit()

    def _commit(self) -> list[RootAction]:
        ended, epoch = self.current, self.epoch
        digests = self.members if ended.state_key is not None else ()
        self.last_commit = CommitRecord(ended.step, epoch, self.members, digests)
        actions: list[RootAction] = [self._to_hosts(Commit(ended.step, epoch))]
        if self.recovering and not ended.verifying:
            self.recovering = False
            text = f"epoch {epoch} recovered: step {ended.step} committed by ranks " + str(
                list(self.members)
            )
            actions.append(Report(text, "info"))
        self.current = ended.following()
        return actions

    def _on_finished(self, event: HostFinished) -> list[RootAction]:
        host, state = event.host, self.current
        early = self._cannot_take(host, event.epoch, "finished")
        if early is not None:
            return early
        if host in state.finished:
            return self._fault(host, f"{self.describe(host)} finished the run twice")
        if event.step != state.step or state.verifying or state.started:
            return self._fault(
                host,
                f"{self.describe(host)} finished the run at step {event.step}, but the run is "
                f"at step {state.resume_step} (started: {state.started})",
            )
        state.finished.add(host)
        if len(state.finished) < len(self.epoch_hosts):
            return []
        self._move(Trigger.FINISH)
        return [self._to_hosts(Shutdown("finished"))]

    # ------------------------------------------------------------------- losses

    def _on_lost(self, event: HostLost) -> list[RootAction]:
        host = event.host
        record = self.hosts.get(host)
        if record is None:
            return [RefuseHost(host, f"host {host} reported lost ranks but has not joined")]
        strangers = sorted(set(event.ranks) - set(record.ranks))
        if strangers:
            return self._fault(
                host,
                f"{self.describe(host)} reported ranks {strangers} lost, which it does not run",
            )
        ranks = tuple(sorted(event.ranks))
        if len(ranks) == 1:
            lost = f"rank {ranks[0]} {event.reason}"
        else:
            lost = f"ranks {list(ranks)} {event.reason}"
        if not self.elastic:
            return self._abort(lost)
        gone = tuple(r for r in ranks if r in self.membership)
        if not gone:
            return []
        for rank in gone:
            self.membership.remove(rank)
        remaining = tuple(r for r in record.ranks if r not in gone)
        if remaining:
            self.hosts[host] = HostRecord(record.name, remaining)
        else:
            del self.hosts[host]
        return self._after_loss(lost, gone)

    def _on_stall(self, event: HostStall) -> list[RootAction]:
        """A host's notice that its step waits for some of its members (`tree_stall`)."""
        if event.host not in self.hosts:
            return [RefuseHost(event.host, f"host {event.host} sent a stall but has not joined")]
        self.stall_notices[event.host] = event
        return []

    def _on_host_abort(self, event: HostAbort) -> list[RootAction]:
        if event.host not in self.hosts:
            return [RefuseHost(event.host, f"host {event.host} sent abort but has not joined")]
        return self._abort(event.reason)

    def _on_gone(self, event: HostGone) -> list[RootAction]:
        return self._lose_host(event.host, f"disconnected: {event.reason}")

    def _on_malformed(self, event: HostMalformed) -> list[RootAction]:
        if event.host not in self.hosts:
            return [RefuseHost(event.host, f"malformed message: {event.error}")]
        return self._fault(event.host, f"sent a malformed message: {event.error}")

    def _on_tick(self, event: Tick) -> list[RootAction]:
        return []


# --------------------------------------------------------------------------- the table

_Handler = Callable[[RootCore, Any], list[RootAction]]
_C = RootCore
_HANDLERS: dict[type, _Handler] = {
    HostJoined: _C._on_joined,
    HostReady: _C._on_ready,
    HostReduced: _C._on_reduced,
    HostDigest: _C._on_step_end,
    HostStepDone: _C._on_step_end,
    HostFinished: _C._on_finished,
    HostLost: _C._on_lost,
    HostAbort: _C._on_host_abort,
    HostTensors: _C._on_tensors,
    HostStall: _C._on_stall,
    HostGone: _C._on_gone,
    HostMalformed: _C._on_malformed,
    Tick: _C._on_tick,
}


def _not_an_event(state: RunState, kind: type) -> TypeError:
    return TypeError(f"not a root coordinator event: {kind.__name__}")


EVENTS: Table[RunState, type, _Handler] = Table(
    RunState,
    [
        *(
            Row(state, kind, None, handler)
            for state in RunState
            if state not in DONE and state is not RunState.HOLDING
            for kind, handler in _HANDLERS.items()
        ),
        *(Row(state, kind, state) for state in DONE for kind in _HANDLERS),
    ],
    terminal=DONE,
    refuse=_not_an_event,
)
"""(run state, event type) -> the handler that takes it; the root never holds (HOLDING has
no row), and an object that is no event is a TypeError."""
