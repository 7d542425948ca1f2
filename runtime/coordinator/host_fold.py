"""`HostFold`: a host's sub-coordinator, sans-I/O: it admits the host's workers, folds their
reports into one report per host for the root, and fans the root's answers back out.

The sub-coordinator checks each worker report as the flat coordinator does, with the flat
coordinator's parts and words (`negotiation.Negotiation` per bucket, `step_state.StepState`,
`commits.Commits` for the step ends and packed digest names): a fault names the worker's rank
and is the flat one. What the root hears from a host (`paramsync.runtime.protocol.messages`,
the host kinds):

    every worker joined                      -> host_join {name, members, params}
    every member ready for a bucket          -> host_ready {step, bucket, spec, cached}
        (not sent when every member reduced the bucket from the cache, folded in its step
        report: the host's own step report then says ``cached``)
    every member reduced (elastic runs)      -> host_reduced {step, cached}
    every member's digest                    -> host_digest {step, groups, cached}
        (the members grouped by digest and algorithm; the per-tensor digests stay here)
    the root's digest_query of the step      -> host_tensors {step, groups}
      or every member's step_done            -> host_step_done {step, cached}
    every member finished                    -> host_finished {step}
    a member lost or evicted (elastic)       -> host_lost {ranks, reason}
    the run cannot go on (static loss, fault, a bucket whose reports differ)
                                             -> host_abort {reason}

The root answers with the coordinator's kinds (start_run, go, apply, commit, shutdown, abort,
join_refused), which the host takes (a commit starts its next step and replays the early
reports it held) and sends to each of its members, and asks with a digest_query for the
per-tensor digests of a step whose digests disagree (answered here, never sent on).
Transitions are `EVENTS`, a `paramsync.runtime.protocol.state_machine.Table` over
(`HostState`, event type).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from typing import Any

from paramsync.runtime.coordinator.commits import Commits
from paramsync.runtime.coordinator.digest_groups import summarize, tensor_groups, unfoldable
from paramsync.runtime.coordinator.events import (
    Abort,
    Action,
    Broadcast,
    Disconnected,
    Evict,
    Malformed,
    Refuse,
    Report,
    Tick,
    is_int,
    signature_mismatch,
    spec_hash,
)
from paramsync.runtime.coordinator.negotiation import Disagreement, Fault, Negotiation, Outcome
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.coordinator.tree_events import FromRoot, RootLost, Up
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Apply,
    BucketSpec,
    Commit,
    Digest,
    DigestQuery,
    Finished,
    Go,
    Heartbeat,
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
    JoinRefused,
    MemberJoin,
    Ready,
    Reduced,
    Shutdown,
    Signature,
    StartRun,
    StepDone,
)
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = ["HostState", "HostFold", "EVENTS"]

HostAction = Action | Up


class HostState(enum.Enum):
    """Where a host's sub-coordinator is."""

    JOINING = "joining"
    """Admitting its workers."""
    JOINED = "joined"
    """Every worker joined; its host_join is sent; waiting for the root's start_run."""
    RUNNING = "running"
    DONE = "done"
    """The run ended here (finished, stopped, refused, or the root was lost)."""

    __hash__ = object.__hash__  # by identity, at C speed (as `RunState`)


class HostFold:
    """The sub-coordinator of host ``name``: the root's index ``index`` for it, the world
    ranks ``ranks`` of its workers, the run's ``world_size`` and whether it is ``elastic``
    (a lost member ends its epoch, not the run). ``by_spec``: a cached report may name any
    spec agreed in the epoch (a torch.distributed group: `Negotiation.by_spec`);
    ``root_name``: the root as a lost root is named. Feed it events; execute what it
    returns.
    """

    def __init__(
        self,
        name: str,
        index: int,
        ranks: Sequence[int],
        *,
        world_size: int,
        elastic: bool,
        by_spec: bool = False,
        root_name: str = "the root coordinator",
    ) -> None:
        ranks = tuple(sorted(ranks))
        if not name:
            raise ValueError("a host needs a name")
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"host {name!r} needs distinct ranks, at least one; got {ranks}")
        if not all(is_int(r) and 0 <= r < world_size for r in ranks):
            raise ValueError(f"host {name!r}: ranks {list(ranks)} are not all in [0, {world_size})")
        self.name = name
        self.index = index
        self.ranks = ranks
        self._rank_set = frozenset(ranks)
        self.elastic = elastic
        self.root_name = root_name
        self.state = HostState.JOINING
        self.joins: dict[int, Joined] = {}
        """The workers with a live join, by rank."""
        self.reference: Signature | None = None
        self._reference_rank = -1
        self.epoch = 0
        self.members: tuple[int, ...] = ()
        """The current epoch's members on this host, ascending."""
        self._member_set: frozenset[int] = frozenset()
        self.current = StepState(0)
        self.negotiation = Negotiation(by_spec=by_spec)
        self.commits = Commits(digest_interval=1, resync=False, elastic=elastic)
        self._explicit: set[int] = set()
        """Buckets of the step some member reported with a ready (not folded)."""
        self._folded = False
        """Whether some member folded its cached bucket reports into its step report."""
        self._ended: set[int] = set()
        """Members whose first step report (reduced, or the step end) is in."""
        self.forwarded = 0
        """Reports sent to the root (a count, for the benchmarks)."""

    def handle(self, event: Any) -> list[HostAction]:
        """Feed one event; return the actions to execute, in order. TypeError: no event."""
        row = EVENTS.row(self.state, type(event))
        return [] if row.handler is None else row.handler(self, event)

    # ------------------------------------------------------------------- helpers

    def _up(self, message: Any) -> Up:
        self.forwarded += 1
        return Up(message)

    def _fan_out(self, message: Any) -> list[HostAction]:
        return [Broadcast(message)] if self.members else []

    def _fault(self, rank: int, reason: str) -> list[HostAction]:
        """``rank`` broke the protocol: the flat `Run.fault`, the loss told to the root."""
        if not self.elastic:
            return [self._up(HostAbort(self.index, reason))]
        return [Evict(rank, reason), *self._lose(rank, reason)]

    def _lose(self, rank: int, reason: str) -> list[HostAction]:
        """``rank`` is gone: the flat `Run.lose`, decided by the root for the run."""
        if rank not in self.joins:
            return []
        if not self.elastic:
            return [self._up(HostAbort(self.index, f"rank {rank} {reason}"))]
        del self.joins[rank]
        if self.state is HostState.JOINING:
            return [Report(f"rank {rank} left before the start: {reason}")]
        if rank in self._member_set:
            self.members = tuple(r for r in self.members if r != rank)
            self._member_set = frozenset(self.members)
            self.current.done.pop(rank, None)  # the host's step counts its members only
        return [self._up(HostLost(self.index, self.epoch, (rank,), reason))]

    # ------------------------------------------------------------------- joins

    def _on_joined(self, event: Joined) -> list[HostAction]:
        rank = event.rank
        if self.state is not HostState.JOINING:
            return [Refuse(rank, f"rank {rank} cannot join: the run has already started")]
        refusal = self._check_join(event)
        if refusal is not None:
            return [Refuse(rank, refusal)]
        if self.reference is None:
            self.reference, self._reference_rank = event.signature, rank
        self.joins[rank] = event
        if len(self.joins) < len(self.ranks):
            return []
        self.state = HostState.JOINED
        members: tuple[MemberJoin, ...] = tuple(
            (r, j.address[0], j.address[1], j.step, j.digest, j.epoch, j.committed, j.fold)
            for r, j in sorted(self.joins.items())
        )
        assert self.reference is not None
        return [self._up(HostJoined(self.index, self.name, members, self.reference))]

    def _check_join(self, event: Joined) -> str | None:
        rank = event.rank
        if rank not in self._rank_set:
            return f"rank {rank} does not run on host {self.name!r} (its ranks: {list(self.ranks)})"
        if rank in self.joins:
            return f"rank {rank} has already joined"
        if event.mesh is not None or event.groups is not None or event.layout is not None:
            return (
                f"rank {rank} declares process groups or a parallel layout, which the "
                "coordinator tree does not take: run it with the flat coordinator"
            )
        if self.reference is not None:
            where = signature_mismatch(event.signature, self.reference)
            if where is not None:
                return f"rank {rank}'s model differs from rank {self._reference_rank}'s {where}"
        return None

    # ------------------------------------------------------------------- reports

    def _cannot_take(self, event: Ready | Reduced | Digest | StepDone) -> list[HostAction] | None:
        rank = event.rank
        if rank not in self.joins:
            return [Refuse(rank, f"rank {rank} sent a report but has not joined")]
        if self.state is not HostState.RUNNING:
            return self._fault(rank, f"rank {rank} sent a report before the run started")
        if event.epoch != self.epoch:
            if event.epoch < self.epoch:
                return []  # it raced a membership change
            return self._fault(
                rank,
                f"rank {rank} sent a report for epoch {event.epoch}, but the run is at "
                f"{self.epoch}",
            )
        if rank not in self._member_set:
            return self._fault(rank, f"rank {rank} sent a report while not in a running epoch")
        if isinstance(event, Ready) and event.group:
            return self._fault(
                rank,
                f"rank {rank} reported bucket {event.bucket} of process group "
                f"{event.group!r}, which the coordinator tree does not take",
            )
        return None

    def _on_ready(self, event: Ready) -> list[HostAction]:
        early = self._cannot_take(event)
        if early is not None:
            return early
        state = self.current
        if event.step == state.step:
            self._explicit.add(event.bucket)
        outcome = self.negotiation.report(state, event, len(self.members), self.epoch)
        actions, _ = self._bucket_outcome(event.rank, event.step, event.bucket, outcome, event.spec)
        return actions

    def _bucket_outcome(
        self,
        rank: int,
        step: int,
        bucket: int,
        outcome: Outcome,
        reported: BucketSpec | None = None,
    ) -> tuple[list[HostAction], bool]:
        """The actions after one bucket report's outcome, and whether they end the report."""
        if isinstance(outcome, Fault):
            return self._fault(rank, outcome.reason), True
        if isinstance(outcome, Disagreement):
            return [self._up(HostAbort(self.index, outcome.reason))], True
        cache = self.negotiation.cache
        if isinstance(outcome, Go):
            # Every member reported what the last one did: its spec, or (cached, by spec) the
            # spec its hash names, which need not be the one agreed at this bucket before.
            if reported is None or isinstance(reported, str):
                spec = (cache.known(reported) if reported else None) or cache.spec(bucket)
            else:
                spec = reported
            assert spec is not None, "a go agrees on the bucket's spec"
            return [self._up(HostReady(self.index, step, bucket, spec, self.epoch))], False
        # A None outcome with the bucket gone: this report was its last, every one cached.
        # The root hears of it only if some member reported it with a ready: buckets every
        # member folded are covered by the host's step report (``cached``).
        if step == self.current.step and bucket in self.current.gone and bucket in self._explicit:
            self._explicit.discard(bucket)
            # Every member's report matched the last one (``reported``): with ``by_spec`` it
            # may be a spec agreed at another bucket of the epoch.
            spec = cache.spec(bucket) if reported is None else reported
            assert spec is not None, "a cached report matched an agreement"
            key = spec if isinstance(spec, str) else spec_hash(spec)
            ready = HostReady(self.index, step, bucket, key, self.epoch, True)
            return [self._up(ready)], False
        return [], False

    def _close_buckets(self, event: Reduced | Digest | StepDone, what: str) -> list[HostAction]:
        """The flat `CoordinatorCore._close_buckets` on the host: take a folded report as
        each bucket's, then a fault if one is still outstanding for the rank."""
        rank, step = event.rank, event.step
        negotiation, state = self.negotiation, self.current
        if event.cached:
            refusal = negotiation.check_fold(rank, step, event.cached, self.epoch)
            if refusal is not None:
                return self._fault(rank, refusal)
            self._folded = True
            members = len(self.members)
            if not self._explicit and state.defer_fold(
                rank, step, negotiation.cache.agreed(), members
            ):
                return []  # O(1): every bucket taken as `take` would, nothing outstanding
            actions: list[HostAction] = []
            for bucket, spec in negotiation.cache.sorted_hashes():
                outcome = negotiation.take(
                    state, rank, step, bucket, spec, True, members, self.epoch
                )
                taken, stop = self._bucket_outcome(rank, step, bucket, outcome)
                actions += taken
                if stop:
                    return actions
            if actions:
                return actions + self._unfinished(rank, step, what)
        return self._unfinished(rank, step, what)

    def _unfinished(self, rank: int, step: int, what: str) -> list[HostAction]:
        reason = self.negotiation.unfinished(self.current, rank, step, what)
        return [] if reason is None else self._fault(rank, reason)

    def _first_report(self, event: Reduced | Digest | StepDone, what: str) -> list[HostAction]:
        """A member's first report of its step end closes its buckets (once)."""
        if event.rank in self._ended:
            return []
        self._ended.add(event.rank)
        return self._close_buckets(event, what)

    @staticmethod
    def _stops(actions: list[HostAction]) -> bool:
        """Whether ``actions`` drop the report (a fault of its rank or the run's end)."""
        return bool(actions) and any(
            isinstance(a, Evict)
            or (isinstance(a, Up) and isinstance(a.message, HostAbort | HostLost))
            for a in actions
        )

    def _on_reduced(self, event: Reduced) -> list[HostAction]:
        early = self._cannot_take(event)
        if early is not None:
            return early
        rank, step, state = event.rank, event.step, self.current
        refusal = self.commits.check_reduced(state, rank, step)
        if refusal is not None:
            return self._fault(rank, refusal)
        actions = self._first_report(event, "sent reduced")
        if self._stops(actions):
            return actions
        state.end(rank)
        if len(state.reduced) < len(self.members):
            return actions
        cached = self.negotiation.cache.fold_hash() if self._folded else ""
        return [*actions, self._up(HostReduced(self.index, step, self.epoch, cached))]

    def _on_step_end(self, event: Digest | StepDone) -> list[HostAction]:
        early = self._cannot_take(event)
        if early is not None:
            return early
        rank, state = event.rank, self.current
        refusal = self.commits.check_step_end(state, event)
        if refusal is None and isinstance(event, Digest):
            refusal = unfoldable(event)
        if refusal is not None:
            return self._fault(rank, refusal)
        actions = self._first_report(event, "finished the step")
        if self._stops(actions):
            return actions
        refusal = self.commits.take_step_end(state, event, self.epoch)
        if refusal is not None:
            return [*actions, *self._fault(rank, refusal)]
        if len(state.done) < len(self.members):
            return actions
        cached = self.negotiation.cache.fold_hash() if self._folded and not self.elastic else ""
        if not self.commits.expects_digest(state):
            return [*actions, self._up(HostStepDone(self.index, state.step, self.epoch, cached))]
        groups = tuple(summarize(state.done, self.members))
        digest = HostDigest(self.index, state.step, self.epoch, groups, cached)
        return [*actions, self._up(digest)]

    def _on_finished(self, event: Finished) -> list[HostAction]:
        rank = event.rank
        if rank not in self.joins:
            return [Refuse(rank, f"rank {rank} sent finished but has not joined")]
        if self.state is not HostState.RUNNING:
            return self._fault(rank, f"rank {rank} sent finished before the run started")
        if event.epoch < self.epoch:
            return []
        if event.epoch > self.epoch or rank not in self._member_set:
            return self._fault(rank, f"rank {rank} sent finished outside its epoch")
        refusal = self.commits.check_finish(self.current, rank, event.step, self.members)
        if refusal is not None:
            return self._fault(rank, refusal)
        self.current.finished.add(rank)
        if len(self.current.finished) < len(self.members):
            return []
        return [self._up(HostFinished(self.index, event.step, self.epoch))]

    def stall_notice(self, waited: float) -> HostStall | None:
        """What the root hears when the host's step has not moved for ``waited`` seconds
        while some members are in it and others not (None: the step is not partly reported
        here, idle between calls or waiting on the root): the bucket it waits in (-1: the
        step's end), the members that reported it, and the torch.distributed call's name."""
        state, members = self.current, self.members
        if self.state is not HostState.RUNNING or not state.partly_reported(members):
            return None
        reporters: Collection[int]
        if state.pending:
            bucket = min(state.pending)
            reporters = state.pending[bucket]
            call = state.waiting_call(members)
            name = call[0] if call is not None and call[1] == bucket else ""
        else:
            bucket, reporters, name = -1, state.done, ""
        bits = sum(1 << i for i, rank in enumerate(members) if rank in reporters)
        mask = bits.to_bytes((len(members) + 7) // 8, "little")
        return HostStall(self.index, state.step, self.epoch, bucket, mask, name, waited)

    def _on_heartbeat(self, event: Heartbeat) -> list[HostAction]:
        return []

    def _on_tick(self, event: Tick) -> list[HostAction]:
        return []

    def _on_disconnected(self, event: Disconnected) -> list[HostAction]:
        return self._lose(event.rank, f"disconnected: {event.reason}")

    def _on_malformed(self, event: Malformed) -> list[HostAction]:
        if event.rank not in self.joins:
            return [Refuse(event.rank, f"malformed message: {event.error}")]
        reason = f"sent a malformed message: {event.error}"
        if not self.elastic:
            return [self._up(HostAbort(self.index, f"rank {event.rank} {reason}"))]
        return [Evict(event.rank, reason), *self._lose(event.rank, reason)]

    # ------------------------------------------------------------------- the root's answers

    def _from_root(self, event: FromRoot) -> list[HostAction]:
        message = event.message
        handler = _ROOT_MESSAGES.get(type(message))
        if handler is None:
            return self._end(f"the root sent a {message.KIND} message, which a host does not take")
        return handler(self, message)

    def _start(self, start: StartRun) -> list[HostAction]:
        if start.epoch <= self.epoch:
            return self._end(
                f"the root started epoch {start.epoch}, but host {self.name!r} is at {self.epoch}"
            )
        self.state = HostState.RUNNING
        self.epoch = start.epoch
        self.members = tuple(sorted(r for r in start.members if r in self.joins))
        self._member_set = frozenset(self.members)
        self.current = StepState.opening(start.step, broadcast=start.broadcast)
        self.negotiation.new_epoch(fold=start.fold)
        self.commits.interval = start.digest_interval
        self.commits.new_epoch()
        self._new_step()
        return self._fan_out(start)

    def _new_step(self) -> None:
        self._explicit.clear()
        self._ended.clear()
        self._folded = False

    def _go(self, go: Go) -> list[HostAction]:
        return self._fan_out(go)

    def _apply(self, apply: Apply) -> list[HostAction]:
        if apply.epoch == self.epoch and apply.step == self.current.step:
            self.current.applied = True
        return self._fan_out(apply)

    def _commit(self, commit: Commit) -> list[HostAction]:
        ended = self.current
        if commit.epoch != self.epoch or commit.step != ended.step:
            return self._end(
                f"the root committed step {commit.step} of epoch {commit.epoch}, but host "
                f"{self.name!r} is at step {ended.step} of epoch {self.epoch}"
            )
        actions = self._fan_out(commit)
        self.current = ended.following()
        self._new_step()
        for early in ended.early.values():
            actions += self._on_ready(early)
            if self.state is not HostState.RUNNING:
                break
        return actions

    def _query(self, query: DigestQuery) -> list[HostAction]:
        """The root asks for the step's per-tensor digests (its hosts' digests disagree)."""
        state = self.current
        if query.epoch < self.epoch:
            return []  # it raced a membership change
        if (
            query.epoch != self.epoch
            or query.step != state.step
            or len(state.done) < len(self.members)
            or not self.commits.expects_digest(state)
        ):
            return self._end(
                f"the root asked for the per-tensor digests of step {query.step} of epoch "
                f"{query.epoch}, but host {self.name!r} has not sent its digests of it (at "
                f"step {state.step} of epoch {self.epoch})"
            )
        groups = tensor_groups(state.done, self.commits.names, self.members)
        return [self._up(HostTensors(self.index, state.step, self.epoch, tuple(groups)))]

    def _stop(self, message: Shutdown | AbortRun) -> list[HostAction]:
        self.state = HostState.DONE
        if isinstance(message, AbortRun):
            return [Abort(message.reason)]
        return [Broadcast(message)]

    def _refused(self, message: JoinRefused) -> list[HostAction]:
        self.state = HostState.DONE
        return [Refuse(rank, message.reason) for rank in sorted(self.joins)]

    def _end(self, reason: str) -> list[HostAction]:
        self.state = HostState.DONE
        return [Abort(reason)]

    def _on_root_lost(self, event: RootLost) -> list[HostAction]:
        return self._end(f"host {self.name!r} lost {self.root_name}: {event.reason}")


_RootHandler = Callable[[HostFold, Any], list[HostAction]]
_ROOT_MESSAGES: dict[type, _RootHandler] = {
    StartRun: HostFold._start,
    Go: HostFold._go,
    Apply: HostFold._apply,
    Commit: HostFold._commit,
    Shutdown: HostFold._stop,
    AbortRun: HostFold._stop,
    JoinRefused: HostFold._refused,
    DigestQuery: HostFold._query,
}

_Handler = Callable[[HostFold, Any], list[HostAction]]
_H = HostFold
_WORKER: dict[type, _Handler] = {
    Joined: _H._on_joined,
    Ready: _H._on_ready,
    Reduced: _H._on_reduced,
    Digest: _H._on_step_end,
    StepDone: _H._on_step_end,
    Finished: _H._on_finished,
    Heartbeat: _H._on_heartbeat,
    Tick: _H._on_tick,
    Disconnected: _H._on_disconnected,
    Malformed: _H._on_malformed,
}
_LINK: dict[type, _Handler] = {FromRoot: _H._from_root, RootLost: _H._on_root_lost}


def _not_an_event(state: HostState, kind: type) -> TypeError:
    return TypeError(f"not a host coordinator event: {kind.__name__}")


_LIVE = (HostState.JOINING, HostState.JOINED, HostState.RUNNING)

EVENTS: Table[HostState, type, _Handler] = Table(
    HostState,
    [
        # While the host lives, every event runs its handler, which moves the host itself
        # (the last join to JOINED, a start to RUNNING, the run's end to DONE).
        *(Row(s, kind, None, handler) for s in _LIVE for kind, handler in _WORKER.items()),
        *(Row(s, kind, None, handler) for s in _LIVE for kind, handler in _LINK.items()),
        # Once the run ended here, every event is absorbed.
        *(Row(HostState.DONE, kind, HostState.DONE) for kind in (*_WORKER, *_LINK)),
    ],
    terminal={HostState.DONE},
    refuse=_not_an_event,
)
"""(host state, event type) -> the handler that takes it; an object that is no event is a
TypeError."""
