"""`CoordinatorCore`: the coordinator's sans-I/O state machine, composed of its parts.

The core is fed events (decoded messages, disconnects, clock ticks) and returns actions
(messages to send, refusals, aborts); it opens no socket, starts no task and reads no clock, so
the trio shell (`paramsync.runtime.coordinator.service`) runs it and hypothesis drives it directly.
This module is the dispatcher: `EVENTS`, a transition table
(`paramsync.runtime.protocol.state_machine`), names the handler each event runs in each state of
the run, and each handler composes the answers of the parts, each with one job: the run's state
and the moves its handlers share (`run`: abort, drop a rank, hold, open an epoch; its lifecycle
in `run_state`), `membership`, `step_state`, `negotiation` and `group_negotiation` (bucket-spec
agreement, per run and per declared process group), `layouts`, `commits` (step ends, the
C-DDP-001 digest verdict), `liveness` and `clock` (what a tick decides), and `events` (the
events that never travel and the actions). `view` shows the run, read-only, to the outside.

One run, as the workers see it (worker -> coordinator kinds on the left)::

    join {host, port, params}          -> start_run {addresses, ring, step, ...}  (all joined)
    ready {step, bucket, spec}         -> go {step, bucket, seq}                  (all ready)
    digest {step, digest, tensors}     -> commit {step}   (digest steps: step % interval == 0)
      or step_done {step}              -> commit {step}   (other steps)
    finished {step}                    -> shutdown {reason}                       (all finished)
    heartbeat {}                          (every fraction of heartbeat_deadline, from join on)

The coordinator may instead answer ``join_refused {reason}`` to one worker, ``resync {step,
source, targets}`` before a commit whose digests diverged (``resync=True``), or ``abort
{reason}`` to all. A worker runs its buckets' collectives in ``go`` order (``seq`` grows by one
per ``go``), and sends nothing for step ``s + 1`` before it has received ``commit {s}``.

Every inconsistency is caught as soon as it is observable and becomes an :class:`Abort` whose
reason names the ranks, the step and what differs; ``handle`` never raises on logic errors.

The messages are declared in `paramsync.runtime.protocol.messages`; malformed wire input raises
:class:`~paramsync.runtime.errors.ProtocolError` in its ``event_from_wire``, before an event exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from paramsync.runtime.coordinator.clock import tick
from paramsync.runtime.coordinator.commits import CommitRecord
from paramsync.runtime.coordinator.events import (
    Action,
    Broadcast,
    Disconnected,
    Event,
    Evict,
    Malformed,
    Refuse,
    Report,
    Send,
    Tick,
)
from paramsync.runtime.coordinator.group_negotiation import GroupGo
from paramsync.runtime.coordinator.membership import EpochRecord
from paramsync.runtime.coordinator.negotiation import Disagreement, Fault, Outcome
from paramsync.runtime.coordinator.run import Run
from paramsync.runtime.coordinator.run_state import DONE, RunState, Trigger
from paramsync.runtime.coordinator.view import CoordinatorView
from paramsync.runtime.protocol.messages import (
    Apply,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Joined,
    ParamSpec,
    Ready,
    Reduced,
    Shutdown,
    StepDone,
)
from paramsync.runtime.protocol.state_machine import Row, Table

__all__ = ["CoordinatorCore", "RunState", "EpochRecord", "CommitRecord"]


class CoordinatorCore:
    """The coordinator's state machine: feed it events, execute the actions it returns.

    ``world_size`` is the number of worker slots (ranks 0..world_size-1) and the size the run
    starts with; ``signature`` fixes the reference model (else the first worker to join does);
    ``digest_interval``: steps with ``step % digest_interval == 0`` end with digests, others
    with step_done; ``resync``: on diverged digests with a strict majority, resync the minority
    from the lowest good rank instead of aborting; ``heartbeat_deadline``: seconds of silence
    after which a member is lost; ``ring``: the first epoch's ring order; ``start_step``: the
    first step of a fresh run.

    Elastic runs (``min_workers < world_size``): a lost or misbehaving member ends its epoch
    instead of the run. The step in flight is dropped unless every member already holds its
    reduced gradients (``apply`` sent), the survivors form a new epoch, and a joiner enters the
    next epoch after receiving a healthy member's whole state. Below ``min_workers`` the run
    holds for ``rejoin_seconds``, then aborts. ``rendezvous_seconds``: after a restart, start
    with at least ``min_workers`` once no one joined for that long.

    ``stall_seconds``: report (a `Report`) which ranks the step waits for, and in which phase,
    when nothing moved for that long; ``stall_deadline``: then drop them (elastic) or abort.
    """

    def __init__(
        self,
        world_size: int,
        *,
        signature: Iterable[ParamSpec] | None = None,
        digest_interval: int = 1,
        resync: bool = False,
        heartbeat_deadline: float = 10.0,
        ring: Sequence[int] | None = None,
        start_step: int = 0,
        min_workers: int | None = None,
        rejoin_seconds: float = 60.0,
        rendezvous_seconds: float = 5.0,
        stall_seconds: float = 60.0,
        stall_deadline: float | None = None,
        cache_by_spec: bool = False,
        idle_stalls: bool = True,
        run_id: str = "",
    ) -> None:
        self._run = Run(
            world_size,
            signature=signature,
            digest_interval=digest_interval,
            resync=resync,
            heartbeat_deadline=heartbeat_deadline,
            ring=ring,
            start_step=start_step,
            min_workers=min_workers,
            rejoin_seconds=rejoin_seconds,
            rendezvous_seconds=rendezvous_seconds,
            stall_seconds=stall_seconds,
            stall_deadline=stall_deadline,
            cache_by_spec=cache_by_spec,
            idle_stalls=idle_stalls,
            run_id=run_id,
        )
        self.view = CoordinatorView(self._run)
        """The run, read-only: its state, members, epochs, step, commits, liveness."""

    # ------------------------------------------------------------------- dispatch

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; return the actions to execute, in order.

        Inconsistent input becomes an Abort (or, in elastic runs, the loss of the rank that
        sent it), never an exception; once the run is FINISHED or ABORTED every event returns
        []. Raises TypeError only for an object that is no event.
        """
        row = EVENTS.row(self._run.state, type(event))
        return [] if row.handler is None else row.handler(self, event)

    # ------------------------------------------------------------------- membership

    def _on_joined(self, event: Joined) -> list[Action]:
        run, rank = self._run, event.rank
        if run.state is RunState.RUNNING and not run.elastic:
            return [Refuse(rank, f"rank {rank} cannot join: the run has already started")]
        refusal = run.membership.check_join(event)
        if refusal is not None:
            return [Refuse(rank, refusal)]
        run.membership.admit(event)
        run.liveness.joined(rank, event.now)
        joined = len(run.membership)
        if run.state is RunState.RENDEZVOUS:
            return [] if joined < run.membership.world_size else run.first_epoch()
        # An elastic run: the joiner enters a new epoch now, taking a member's state.
        if run.state is RunState.HOLDING and joined < run.min_workers:
            return [Report(f"rank {rank} joined; waiting for {run.min_workers - joined} more")]
        return run.next_epoch(f"rank {rank} joined", run.membership.joiners())

    # ------------------------------------------------------------------- buckets

    def _on_ready(self, event: Ready) -> list[Action]:
        run = self._run
        early = run.cannot_take(event)
        if early is not None:
            return early
        if event.group:
            return self._on_group_ready(event)
        members, epoch = len(run.membership.members), run.membership.epoch
        outcome = run.negotiation.report(run.current, event, members, epoch)
        return self._bucket_outcome(event.rank, outcome)

    def _bucket_outcome(self, rank: int, outcome: Outcome) -> list[Action]:
        """The actions that follow a bucket report's outcome."""
        if outcome is None:  # the usual case: taken, the bucket waits for more reports
            self._run.liveness.progressed()
            return []
        if isinstance(outcome, Fault):
            return self._run.fault(rank, outcome.reason)
        self._run.liveness.progressed()
        if isinstance(outcome, Disagreement):
            return self._run.abort(outcome.reason)
        if isinstance(outcome, Go):
            return [Broadcast(outcome)]
        return []

    def _on_group_ready(self, event: Ready) -> list[Action]:
        run = self._run
        outcome = run.group_negotiation.report(run.current, event, run.membership.epoch)
        if isinstance(outcome, Fault):
            return run.fault(event.rank, outcome.reason)
        run.liveness.progressed()
        if isinstance(outcome, Disagreement):
            return run.abort(outcome.reason)
        if isinstance(outcome, GroupGo):
            return self._group_go(outcome)
        return []

    @staticmethod
    def _group_go(outcome: GroupGo) -> list[Action]:
        return [Send(rank, outcome.go) for rank in outcome.ranks]

    def _close_buckets(self, event: Reduced | Digest | StepDone, what: str) -> list[Action] | None:
        """The step's buckets as of ``event``, a rank's first report of its step end: take a
        folded report (``cached``) as each bucket's, then a fault if one is still outstanding
        for the rank."""
        rank, step = event.rank, event.step
        if event.cached:
            folded = self._fold_reports(rank, step, event.cached)
            if folded:
                return folded
        unfinished = self._run.negotiation.unfinished(self._run.current, rank, step, what)
        return None if unfinished is None else self._run.fault(rank, unfinished)

    def _fold_reports(self, rank: int, step: int, cached: str) -> list[Action]:
        """A step report says ``rank`` reduced every bucket from the response cache under the
        agreement ``cached``: check that, then take it as a cached report of each bucket."""
        run = self._run
        negotiation, members, epoch = (
            run.negotiation,
            len(run.membership.members),
            run.membership.epoch,
        )
        refusal = negotiation.check_fold(rank, step, cached, epoch)
        if refusal is not None:
            return run.fault(rank, refusal)
        # Each bucket as a cached ready of ``rank`` (no Ready built per bucket: the step
        # report passed the checks of a run message of this rank and epoch, and nothing
        # changed since unless a bucket's answer ends the loop).
        for bucket, spec in negotiation.cache.sorted_hashes():
            outcome = negotiation.take(run.current, rank, step, bucket, spec, True, members, epoch)
            actions = self._bucket_outcome(rank, outcome)
            if actions:
                return actions
        return []

    def _on_reduced(self, event: Reduced) -> list[Action]:
        run, rank, step = self._run, event.rank, event.step
        early = run.cannot_take(event)
        if early is not None:
            return early
        refusal = run.commits.check_reduced(run.current, rank, step)
        if refusal is not None:
            return run.fault(rank, refusal)
        unfinished = self._close_buckets(event, "sent reduced")
        if unfinished is not None:
            return unfinished
        run.current.end(rank)
        run.liveness.progressed()
        if len(run.current.reduced) < len(run.membership.members):
            return []
        run.current.applied = True
        return [Broadcast(Apply(step, run.membership.epoch))]

    # ------------------------------------------------------------------- steps

    def _on_step_end(self, event: Digest | StepDone) -> list[Action]:
        run, rank = self._run, event.rank
        early = run.cannot_take(event)
        if early is not None:
            return early
        refusal = run.commits.check_step_end(run.current, event)
        if refusal is not None:
            return run.fault(rank, refusal)
        unfinished = self._close_buckets(event, "finished the step")
        if unfinished is not None:
            return unfinished
        refusal = run.commits.take_step_end(run.current, event, run.membership.epoch)
        if refusal is not None:
            return run.fault(rank, refusal)
        run.liveness.progressed()
        if len(run.current.done) < len(run.membership.members):
            return []
        if not run.commits.expects_digest(run.current):
            return self._commit()
        verdict = run.commits.verdict(run.current, len(run.membership.members))
        if verdict.abort is not None:
            return run.abort(verdict.abort)
        resyncs: list[Action] = list(verdict.resyncs)
        return resyncs + self._commit()

    def _commit(self) -> list[Action]:
        """Every member ended the step: commit it, start the next, take its early reports."""
        run = self._run
        ended, epoch, members = run.current, run.membership.epoch, run.membership.members
        actions: list[Action] = [Broadcast(run.commits.commit(ended, epoch, members))]
        if run.commits.recovering and not ended.verifying:
            run.commits.recovering = False
            text = f"epoch {epoch} recovered: step {ended.step} committed by ranks {list(members)}"
            actions.append(Report(text, "info"))
        run.current = ended.following()
        for go in run.group_negotiation.advance(run.current.step, epoch):
            actions += self._group_go(go)
        for event in ended.early.values():
            actions += self._on_ready(event)
            if run.state is not RunState.RUNNING:
                break
        return actions

    def _on_finished(self, event: Finished) -> list[Action]:
        run, rank, step = self._run, event.rank, event.step
        if rank not in run.membership:
            return [Refuse(rank, f"rank {rank} sent finished but has not joined")]
        if run.state is RunState.RENDEZVOUS:
            return run.fault(rank, f"rank {rank} sent finished before the run started")
        if run.stale(event.epoch):
            return []
        if event.epoch > run.membership.epoch or not run.membership.is_member(rank):
            return run.fault(rank, f"rank {rank} sent finished outside its epoch")
        if run.state is RunState.HOLDING:
            return run.fault(rank, f"rank {rank} sent finished while the run holds")
        members = run.membership.members
        refusal = run.commits.check_finish(run.current, rank, step, members)
        if refusal is not None:
            return run.fault(rank, refusal)
        run.current.finished.add(rank)
        run.liveness.progressed()
        if len(run.current.finished) < len(members):
            return []
        run.move(Trigger.FINISH)
        return [Broadcast(Shutdown("finished"))]

    # ------------------------------------------------------------------- liveness

    def _on_tick(self, event: Tick) -> list[Action]:
        return tick(self._run, event.now)

    def _on_heartbeat(self, event: Heartbeat) -> list[Action]:
        self._run.liveness.heartbeat(event.rank, event.now)
        return []

    # ------------------------------------------------------------------- connections

    def _on_disconnected(self, event: Disconnected) -> list[Action]:
        if event.rank not in self._run.membership:
            return []
        return self._run.lose(event.rank, f"disconnected: {event.reason}")

    def _on_malformed(self, event: Malformed) -> list[Action]:
        if event.rank not in self._run.membership:
            return [Refuse(event.rank, f"malformed message: {event.error}")]
        reason = f"sent a malformed message: {event.error}"
        if not self._run.elastic:
            return self._run.abort(f"rank {event.rank} {reason}")
        return [Evict(event.rank, reason), *self._run.lose(event.rank, reason)]


# --------------------------------------------------------------------------- the table

_Handler = Callable[[CoordinatorCore, Any], list[Action]]
_C = CoordinatorCore

_HANDLERS: dict[type, _Handler] = {
    Joined: _C._on_joined,
    Ready: _C._on_ready,
    Reduced: _C._on_reduced,
    Digest: _C._on_step_end,
    StepDone: _C._on_step_end,
    Finished: _C._on_finished,
    Heartbeat: _C._on_heartbeat,
    Tick: _C._on_tick,
    Disconnected: _C._on_disconnected,
    Malformed: _C._on_malformed,
}


def _not_an_event(state: RunState, kind: type) -> TypeError:
    return TypeError(f"not a coordinator event: {kind.__name__}")


EVENTS: Table[RunState, type, _Handler] = Table(
    RunState,
    [
        # While the run lives, every event runs its handler, whose outcome moves the run
        # through `run_state.TRANSITIONS` (a start, a hold, a finish, an abort).
        *(
            Row(state, kind, None, handler)
            for state in RunState
            if state not in DONE
            for kind, handler in _HANDLERS.items()
        ),
        # A finished or aborted run ignores every event.
        *(Row(state, kind, state) for state in DONE for kind in _HANDLERS),
    ],
    terminal=DONE,
    refuse=_not_an_event,
)
"""(run state, event type) -> the handler that takes it; an object that is no event is a
TypeError."""
