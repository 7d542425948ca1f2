"""`CoordinatorCore`: the coordinator's sans-I/O state machine, composed of its parts.

The core is fed events (decoded messages, disconnects, clock ticks) and returns actions
(messages to send, refusals, aborts); it opens no socket, starts no task and reads no clock, so
the trio shell (`paramsync.runtime.coordinator.service`) runs it and hypothesis drives it directly.
This module only routes each event and composes the answers of the parts, each with one job:

- :mod:`~paramsync.runtime.coordinator.run_state`: the run's lifecycle, a table of legal
  transitions;
- :mod:`~paramsync.runtime.coordinator.membership`: joins, members and epochs;
- :mod:`~paramsync.runtime.coordinator.step_state`: what the step in flight gathered, replaced whole
  at every step boundary;
- :mod:`~paramsync.runtime.coordinator.negotiation`: bucket-spec agreement and the response cache;
- :mod:`~paramsync.runtime.coordinator.group_negotiation`: the same per declared process group (a
  ``ready`` naming a ``group``; its ``go`` goes to that group's members only); the groups
  themselves are declared at the join (:mod:`~paramsync.runtime.coordinator.group_decl`, checked by
  membership) and each member's start lists its own;
- :mod:`~paramsync.runtime.coordinator.layouts`: the 3D-parallel layouts the joins declare (one
  mesh, one schedule digest, each rank at its coordinates), checked when the first epoch's ranks are
  in, and the (tp, pp) shards whose dp replicas the digest verdict compares;
- :mod:`~paramsync.runtime.coordinator.commits`: step ends, the C-DDP-001 digest verdict (per shard
  with a layout), commits;
- :mod:`~paramsync.runtime.coordinator.liveness`: heartbeats, hold and rendezvous deadlines, stalls;
- :mod:`~paramsync.runtime.coordinator.events`: the events that never travel, the actions, the
  helpers.

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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from paramsync.runtime.coordinator.commits import CommitRecord, Commits
from paramsync.runtime.coordinator.events import (
    MAX_WORLD,
    Abort,
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
    format_seconds,
    is_int,
)
from paramsync.runtime.coordinator.group_negotiation import GroupGo, GroupNegotiation
from paramsync.runtime.coordinator.layouts import (
    AgreedLayout,
    Shards,
    layout_disagreement,
    sharded_resume_step,
)
from paramsync.runtime.coordinator.liveness import Liveness
from paramsync.runtime.coordinator.membership import EpochRecord, Membership, resume_plan
from paramsync.runtime.coordinator.negotiation import Disagreement, Fault, Negotiation, Outcome
from paramsync.runtime.coordinator.run_state import DONE, RunState, Trigger, next_state
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.protocol.messages import (
    Apply,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Hold,
    Joined,
    ParamSpec,
    Ready,
    Reduced,
    Shutdown,
    Signature,
    StartRun,
    StepDone,
    normalize_signature,
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
    ) -> None:
        if not is_int(world_size) or not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be in [1, {MAX_WORLD}], got {world_size!r}")
        if not is_int(digest_interval) or digest_interval < 1:
            raise ValueError(f"digest_interval must be a positive int, got {digest_interval!r}")
        if not heartbeat_deadline > 0:
            raise ValueError(f"heartbeat_deadline must be positive, got {heartbeat_deadline!r}")
        if not is_int(start_step) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        min_workers = world_size if min_workers is None else min_workers
        if not is_int(min_workers) or not 1 <= min_workers <= world_size:
            raise ValueError(f"min_workers must be in [1, {world_size}], got {min_workers!r}")
        for name, value in (
            ("rejoin_seconds", rejoin_seconds),
            ("rendezvous_seconds", rendezvous_seconds),
            ("stall_seconds", stall_seconds),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if stall_deadline is not None and not stall_deadline > 0:
            raise ValueError(f"stall_deadline must be positive, got {stall_deadline!r}")
        ring = tuple(range(world_size)) if ring is None else tuple(ring)
        if sorted(ring) != list(range(world_size)):
            raise ValueError(f"ring {list(ring)} is not a permutation of ranks 0..{world_size - 1}")
        reference = None
        if signature is not None:
            reference = normalize_signature(tuple(signature))
        self._min = min_workers
        self._elastic = min_workers < world_size
        self._start_step = start_step
        self._state = RunState.RENDEZVOUS
        self._abort_reason: str | None = None
        self._membership = Membership(world_size, ring=ring, reference=reference)
        self._liveness = Liveness(
            heartbeat_deadline=heartbeat_deadline,
            rejoin_seconds=rejoin_seconds,
            rendezvous_seconds=rendezvous_seconds,
            stall_seconds=stall_seconds,
            stall_deadline=stall_deadline,
        )
        self._negotiation = Negotiation(by_spec=cache_by_spec)
        self._idle_stalls = idle_stalls
        """Whether a step nobody has reported anything in counts as stalled (a trainer's
        steps never idle; a torch.distributed group may sit between calls for any time)."""
        self._groups = GroupNegotiation()
        self._commits = Commits(
            digest_interval=digest_interval, resync=bool(resync), elastic=self._elastic
        )
        self._current = StepState(start_step)
        """The step in flight: replaced whole at each commit, epoch start and hold."""
        self.stale_messages = 0
        """Messages of an earlier epoch, dropped (they raced a membership change)."""

    # ------------------------------------------------------------------- observability

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def step(self) -> int:
        """The step now running (the next one to commit)."""
        return self._current.step

    @property
    def seq(self) -> int:
        """The seq the next Go will carry (= Gos sent so far, counted from 0)."""
        return self._negotiation.seq

    @property
    def world_size(self) -> int:
        """The number of worker slots."""
        return self._membership.world_size

    @property
    def min_workers(self) -> int:
        return self._min

    @property
    def elastic(self) -> bool:
        """Whether the run survives the loss of a member (``min_workers < world_size``)."""
        return self._elastic

    @property
    def epoch(self) -> int:
        """The membership epoch (0 before the start; grows by one per membership change)."""
        return self._membership.epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The current epoch's members by ring position; before the start, the joined ranks."""
        if self._membership.epoch == 0:
            return self._membership.joined
        return self._membership.members

    @property
    def joined(self) -> tuple[int, ...]:
        """Every rank with a live join (members and joiners waiting for an epoch), ascending."""
        return self._membership.joined

    @property
    def history(self) -> tuple[EpochRecord, ...]:
        """Every epoch so far: where it started and who was in it."""
        return self._membership.history

    @property
    def last_commit(self) -> CommitRecord | None:
        return self._commits.last

    @property
    def addresses(self) -> Mapping[int, tuple[str, int]]:
        return MappingProxyType(dict(self._membership.addresses))

    @property
    def last_heartbeat(self) -> Mapping[int, float | None]:
        """Each member's last heartbeat (or join) time; None: not known until the next Tick."""
        return self._liveness.last_heartbeat

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    @property
    def reference_signature(self) -> Signature | None:
        return self._membership.reference

    @property
    def digest_interval(self) -> int:
        return self._commits.interval

    @property
    def applied(self) -> bool:
        """Whether every member holds this step's reduced gradients (``apply`` was sent)."""
        return self._current.applied

    @property
    def layout(self) -> AgreedLayout | None:
        """The 3D-parallel layout every rank declared (None: a flat run, or not started)."""
        return self._membership.layout

    def shard_of(self, rank: int) -> int:
        """Rank ``rank``'s shard (the rank of its dp=0 replica); a flat run's ranks are each
        compared with all: its shard is 0."""
        shards = self._commits.shards
        return 0 if shards is None else shards.of(rank)

    @property
    def groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The process groups every join declared, in creation order: (name, ranks)."""
        return self._membership.groups or ()

    def group_seq(self, group: str) -> int:
        """The seq the next go of process group ``group`` will carry."""
        return self._groups.seq(group)

    @property
    def pending_buckets(self) -> Mapping[int, tuple[int, ...]]:
        """Buckets of this step some rank reported ready, not yet sent a Go: bucket -> ranks."""
        return MappingProxyType({b: tuple(sorted(r)) for b, r in self._current.pending.items()})

    def is_digest_step(self, step: int) -> bool:
        return self._commits.is_digest_step(step)

    def waiting_for(self) -> tuple[str, tuple[int, ...]]:
        """What the step in flight waits for: a phase and the ranks it waits on."""
        return self._current.waiting_for(self._membership.members)

    # ------------------------------------------------------------------- dispatch

    def handle(self, event: Event) -> list[Action]:
        """Feed one event; return the actions to execute, in order.

        Inconsistent input becomes an Abort (or, in elastic runs, the loss of the rank that
        sent it), never an exception; once the run is FINISHED or ABORTED every event returns
        []. Raises TypeError only for an object that is no event.
        """
        row = EVENTS.row(self._state, type(event))
        return [] if row.handler is None else row.handler(self, event)

    def _move(self, trigger: Trigger) -> None:
        self._state = next_state(self._state, trigger)

    def _abort(self, reason: str) -> list[Action]:
        self._move(Trigger.ABORT)
        self._abort_reason = reason
        return [Abort(reason)]

    def _fault(self, rank: int, reason: str) -> list[Action]:
        """``rank`` broke the protocol: drop it from an elastic run, else stop the run."""
        if not self._elastic:
            return self._abort(reason)
        return [Evict(rank, reason), *self._lose(rank, reason)]

    def _stale(self, epoch: int) -> bool:
        """Whether a run message of ``epoch`` raced a membership change and is to be dropped."""
        if epoch < self._membership.epoch:
            self.stale_messages += 1
            return True
        return False

    @staticmethod
    def _describe(event: Ready | Reduced | Digest | StepDone) -> str:
        """What a run message says, for a refusal: "bucket 2 ready for step 7", ..."""
        if isinstance(event, Ready):
            return f"bucket {event.bucket} ready for step {event.step}"
        if isinstance(event, Reduced):
            return f"reduced for step {event.step}"
        kind = "a digest" if isinstance(event, Digest) else "step_done"
        return f"{kind} for step {event.step}"

    def _run_message(self, event: Ready | Reduced | Digest | StepDone) -> list[Action] | None:
        """The answer to a run message that cannot be taken now (None: go on). The text is
        built only for a refusal: every report of every rank passes here."""
        rank, epoch = event.rank, event.epoch
        if rank not in self._membership:
            return [Refuse(rank, f"rank {rank} sent {self._describe(event)} but has not joined")]
        if self._state is RunState.RENDEZVOUS:
            what = self._describe(event)
            return self._fault(rank, f"rank {rank} sent {what} before the run started")
        if epoch != self._membership.epoch:
            if self._stale(epoch):
                return []
            return self._fault(
                rank,
                f"rank {rank} sent {self._describe(event)} for epoch {epoch}, but the run is at "
                f"{self._membership.epoch}",
            )
        if not self._membership.is_member(rank) or self._state is RunState.HOLDING:
            what = self._describe(event)
            return self._fault(rank, f"rank {rank} sent {what} while not in a running epoch")
        if self._current.finished:
            return self._fault(
                rank,
                f"rank {rank} sent {self._describe(event)} after ranks "
                f"{sorted(self._current.finished)} finished the run at step {self._current.step}",
            )
        return None

    # ------------------------------------------------------------------- membership

    def _on_joined(self, event: Joined) -> list[Action]:
        rank = event.rank
        if self._state is RunState.RUNNING and not self._elastic:
            return [Refuse(rank, f"rank {rank} cannot join: the run has already started")]
        refusal = self._membership.check_join(event)
        if refusal is not None:
            return [Refuse(rank, refusal)]
        self._membership.admit(event)
        self._liveness.joined(rank, event.now)
        joined = len(self._membership)
        if self._state is RunState.RENDEZVOUS:
            if joined < self._membership.world_size:
                return []
            return self._first_epoch()
        # An elastic run: the joiner enters a new epoch now, taking a member's state.
        if self._state is RunState.HOLDING and joined < self._min:
            return [Report(f"rank {rank} joined; waiting for {self._min - joined} more")]
        return self._next_epoch(f"rank {rank} joined", self._membership.joiners())

    def _first_epoch(self) -> list[Action]:
        """Everyone is in: the first epoch starts afresh, or from the state the donor rule
        (`resume_plan`) picks among those the joins report. Joins declaring 3D-parallel
        layouts must agree on one (else the run stops, naming the ranks and the field)."""
        joins = self._membership.joins
        everyone = tuple(sorted(joins))
        disagreement = layout_disagreement(joins)
        if disagreement is not None:
            return self._abort(f"the run cannot start: {disagreement}")
        layout = AgreedLayout.of(joins)
        if layout is not None and self._elastic:
            return self._abort(
                f"the run cannot start: ranks {list(everyone)} declare a parallel layout, which "
                f"needs every rank of the mesh: min_workers ({self._min}) must equal the world "
                f"size ({self.world_size})"
            )
        self._membership.layout = layout
        self._commits.shards = Shards.of_layout(layout)
        # Workers that took part in an epoch (a restarted coordinator) get a later one, even
        # when none of them applied a step yet: they refuse an epoch that does not grow.
        self._membership.resume_from(max(j.epoch for j in joins.values()))
        if self._commits.shards is not None:
            return self._first_sharded_epoch(everyone, self._commits.shards)
        plan = resume_plan(joins)
        if plan is None:
            # A fresh run: position 0's weights go to everyone.
            return self._start_epoch(self._start_step, everyone, "the run starts", broadcast=True)
        # Resumed workers (a checkpoint, a restarted coordinator): the donor rule
        # (`resume_plan`) picks the newest committed or majority state; everyone else
        # receives it, ranks ahead of it rolling back.
        top, donor, receivers = plan.step, plan.donor, plan.receivers
        actions = self._start_epoch(
            top, everyone, f"the run resumes at step {top}", donor, receivers
        )
        self._commits.recovering = True  # report the first commit after the restart
        given = f"; rank {donor} sends its state to ranks {list(receivers)}" if receivers else ""
        text = (
            f"the run resumes at step {top} in epoch {self._membership.epoch} with ranks "
            f"{list(everyone)}{given}"
        )
        level = "error" if plan.conflict else "warning" if plan.rolled_back else "info"
        return [Report(plan.describe(), level), Report(text, "info"), *actions]

    def _first_sharded_epoch(self, everyone: tuple[int, ...], shards: Shards) -> list[Action]:
        """The first epoch of a 3D-parallel run: afresh, or (a restarted coordinator) at the
        step where every shard's replicas hold one state, checked per shard before it runs."""
        resume = sharded_resume_step(self._membership.joins, shards)
        if isinstance(resume, str):
            return self._abort(f"the run cannot resume: {resume}")
        if resume is None:
            return self._start_epoch(self._start_step, everyone, "the run starts", broadcast=True)
        actions = self._start_epoch(resume, everyone, f"the run resumes at step {resume}")
        self._commits.recovering = True  # report the first commit after the restart
        text = (
            f"the run resumes at step {resume} in epoch {self._membership.epoch} with ranks "
            f"{list(everyone)}: every shard's replicas hold one state"
        )
        return [Report(text, "info"), *actions]

    def _start_epoch(
        self,
        step: int,
        members: tuple[int, ...],
        reason: str,
        donor: int = -1,
        receivers: tuple[int, ...] = (),
        *,
        broadcast: bool = False,
    ) -> list[Action]:
        """Open a new epoch of ``members`` at ``step`` and tell them (a StartRun)."""
        opening = self._membership.open_epoch(step, members, reason)
        epoch = self._membership.epoch
        self._move(Trigger.START_EPOCH)
        self._liveness.resume()
        broadcast = broadcast or step == 0
        if broadcast:
            donor, receivers = -1, ()
        self._current = StepState.opening(step, broadcast=broadcast)
        self._negotiation.new_epoch(fold=opening.fold)
        self._groups.new_epoch(self.groups, members)
        self._commits.new_epoch()
        self._commits.recovering = not opening.first
        self._liveness.progressed()
        addresses = self._membership.addresses
        start = StartRun(
            addresses=tuple(addresses[r] for r in members),
            ring=opening.ring,
            step=step,
            digest_interval=self._commits.interval,
            heartbeat_deadline=self._liveness.deadline,
            epoch=epoch,
            members=members,
            donor=donor,
            receivers=receivers,
            broadcast=broadcast,
            apply_barrier=self._elastic,
            fold=opening.fold,
        )
        starts = self._starts(start)
        if opening.first:
            return starts
        text = f"epoch {epoch} starts at step {step} with ranks {list(members)} ({reason})"
        return [Report(text, "info"), *starts]

    def _starts(self, start: StartRun) -> list[Action]:
        """The start to every member: one broadcast, or, when the joins declared process
        groups, each member's own start listing its groups (members and addresses)."""
        if not self.groups:
            return [Broadcast(start)]
        addresses = self._membership.addresses
        present = set(start.members)
        starts: list[Action] = []
        for rank in start.members:
            peers = []
            for name, ranks in self.groups:
                if rank in ranks:
                    active = tuple(r for r in ranks if r in present)
                    peers.append((name, active, tuple(addresses[r] for r in active)))
            starts.append(Send(rank, replace(start, groups=tuple(peers))))
        return starts

    def _next_epoch(self, reason: str, joiners: tuple[int, ...] = ()) -> list[Action]:
        survivors = self._membership.survivors()
        members = tuple(sorted(set(survivors) | set(joiners)))
        step = self._current.resume_step
        if not survivors:
            # Nobody holds the run's state any more; joiners cannot be given it.
            return self._abort(f"{reason}: no worker holding the run's state remains")
        return self._start_epoch(step, members, reason, min(survivors), tuple(sorted(joiners)))

    def _lose(self, rank: int, reason: str) -> list[Action]:
        """``rank`` is gone (dead, silent, cut off or evicted)."""
        if rank not in self._membership:
            return []
        if not self._elastic:
            # A static run ends with its membership as it was (every joined rank a member).
            return self._abort(f"rank {rank} {reason}")
        self._membership.remove(rank)
        self._liveness.forget(rank)
        if self._state is RunState.RENDEZVOUS:
            return [Report(f"rank {rank} left before the start: {reason}")]
        if not self._membership.is_member(rank):
            return [Report(f"joining rank {rank} left: {reason}")]
        lost = f"rank {rank} {reason}"
        head = f"step {self._current.resume_step}, epoch {self._membership.epoch}: {lost}"
        if len(self._membership) >= self._min and self._membership.survivors():
            return [Report(head, "error"), *self._next_epoch(lost, self._membership.joiners())]
        return [Report(head, "error"), *self._hold(lost)]

    def _hold(self, reason: str) -> list[Action]:
        """Fewer than ``min_workers`` remain: drop the step in flight and wait for joiners."""
        step = self._current.resume_step
        self._membership.hold(step, reason)
        self._move(Trigger.HOLD)
        self._liveness.hold()
        self._current = StepState.holding(step)
        self._negotiation.new_epoch(fold=self._negotiation.cache.fold)
        self._groups.new_epoch(self.groups, ())
        self._commits.new_epoch()
        text = (
            f"{reason}; {len(self._membership)} worker(s) remain, min_workers is {self._min}: "
            f"holding at step {step} for up to {format_seconds(self._liveness.rejoin)} s "
            "for joiners"
        )
        return [Broadcast(Hold(step, self._membership.epoch, text)), Report(text, "error")]

    # ------------------------------------------------------------------- buckets

    def _on_ready(self, event: Ready) -> list[Action]:
        early = self._run_message(event)
        if early is not None:
            return early
        if event.group:
            return self._on_group_ready(event)
        members = len(self._membership.members)
        outcome = self._negotiation.report(self._current, event, members, self._membership.epoch)
        return self._bucket_outcome(event.rank, outcome)

    def _bucket_outcome(self, rank: int, outcome: Outcome) -> list[Action]:
        """The actions that follow a bucket report's outcome."""
        if outcome is None:  # the usual case: taken, the bucket waits for more reports
            self._liveness.progressed()
            return []
        if isinstance(outcome, Fault):
            return self._fault(rank, outcome.reason)
        self._liveness.progressed()
        if isinstance(outcome, Disagreement):
            return self._abort(outcome.reason)
        if isinstance(outcome, Go):
            return [Broadcast(outcome)]
        return []

    def _on_group_ready(self, event: Ready) -> list[Action]:
        outcome = self._groups.report(self._current, event, self._membership.epoch)
        if isinstance(outcome, Fault):
            return self._fault(event.rank, outcome.reason)
        self._liveness.progressed()
        if isinstance(outcome, Disagreement):
            return self._abort(outcome.reason)
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
        unfinished = self._negotiation.unfinished(self._current, rank, step, what)
        return None if unfinished is None else self._fault(rank, unfinished)

    def _fold_reports(self, rank: int, step: int, cached: str) -> list[Action]:
        """A step report says ``rank`` reduced every bucket from the response cache under the
        agreement ``cached``: check that, then take it as a cached report of each bucket."""
        refusal = self._negotiation.check_fold(rank, step, cached, self._membership.epoch)
        if refusal is not None:
            return self._fault(rank, refusal)
        # Each bucket as a cached ready of ``rank`` (no Ready built per bucket: the step
        # report passed the checks of a run message of this rank and epoch, and nothing
        # changed since unless a bucket's answer ends the loop).
        negotiation, members = self._negotiation, len(self._membership.members)
        for bucket, spec in negotiation.cache.sorted_hashes():
            outcome = negotiation.take(
                self._current, rank, step, bucket, spec, True, members, self._membership.epoch
            )
            actions = self._bucket_outcome(rank, outcome)
            if actions:
                return actions
        return []

    def _on_reduced(self, event: Reduced) -> list[Action]:
        rank, step = event.rank, event.step
        early = self._run_message(event)
        if early is not None:
            return early
        refusal = self._commits.check_reduced(self._current, rank, step)
        if refusal is not None:
            return self._fault(rank, refusal)
        unfinished = self._close_buckets(event, "sent reduced")
        if unfinished is not None:
            return unfinished
        self._current.end(rank)
        self._liveness.progressed()
        if len(self._current.reduced) < len(self._membership.members):
            return []
        self._current.applied = True
        return [Broadcast(Apply(step, self._membership.epoch))]

    # ------------------------------------------------------------------- steps

    def _on_step_end(self, event: Digest | StepDone) -> list[Action]:
        rank = event.rank
        early = self._run_message(event)
        if early is not None:
            return early
        refusal = self._commits.check_step_end(self._current, event)
        if refusal is not None:
            return self._fault(rank, refusal)
        unfinished = self._close_buckets(event, "finished the step")
        if unfinished is not None:
            return unfinished
        refusal = self._commits.take_step_end(self._current, event, self._membership.epoch)
        if refusal is not None:
            return self._fault(rank, refusal)
        self._liveness.progressed()
        if len(self._current.done) < len(self._membership.members):
            return []
        if not self._commits.expects_digest(self._current):
            return self._commit()
        verdict = self._commits.verdict(self._current, len(self._membership.members))
        if verdict.abort is not None:
            return self._abort(verdict.abort)
        resyncs: list[Action] = list(verdict.resyncs)
        return resyncs + self._commit()

    def _commit(self) -> list[Action]:
        """Every member ended the step: commit it, start the next, take its early reports."""
        ended, epoch, members = self._current, self._membership.epoch, self._membership.members
        commit = self._commits.commit(ended, epoch, members)
        actions: list[Action] = [Broadcast(commit)]
        if self._commits.recovering and not ended.verifying:
            self._commits.recovering = False
            actions.append(
                Report(
                    f"epoch {epoch} recovered: step {ended.step} committed by ranks "
                    f"{list(members)}",
                    "info",
                )
            )
        self._current = ended.following()
        for go in self._groups.advance(self._current.step, epoch):
            actions += self._group_go(go)
        for event in ended.early.values():
            actions += self._on_ready(event)
            if self._state is not RunState.RUNNING:
                break
        return actions

    def _on_finished(self, event: Finished) -> list[Action]:
        rank, step = event.rank, event.step
        if rank not in self._membership:
            return [Refuse(rank, f"rank {rank} sent finished but has not joined")]
        if self._state is RunState.RENDEZVOUS:
            return self._fault(rank, f"rank {rank} sent finished before the run started")
        if self._stale(event.epoch):
            return []
        if event.epoch > self._membership.epoch or not self._membership.is_member(rank):
            return self._fault(rank, f"rank {rank} sent finished outside its epoch")
        if self._state is RunState.HOLDING:
            return self._fault(rank, f"rank {rank} sent finished while the run holds")
        members = self._membership.members
        refusal = self._commits.check_finish(self._current, rank, step, members)
        if refusal is not None:
            return self._fault(rank, refusal)
        self._current.finished.add(rank)
        self._liveness.progressed()
        if len(self._current.finished) < len(members):
            return []
        self._move(Trigger.FINISH)
        return [Broadcast(Shutdown("finished"))]

    # ------------------------------------------------------------------- liveness

    def _on_heartbeat(self, event: Heartbeat) -> list[Action]:
        self._liveness.heartbeat(event.rank, event.now)
        return []

    def _on_tick(self, event: Tick) -> list[Action]:
        now = event.now
        live = self._liveness
        live.observe(now)
        silent = live.silent(now)
        actions: list[Action] = []
        if silent:
            if not self._elastic:
                parts = [
                    f"rank {rank} missed heartbeats for {format_seconds(gap)} s"
                    for rank, gap in silent
                ]
                return self._abort(
                    f"{'; '.join(parts)} (deadline {format_seconds(live.deadline)} s)"
                )
            for rank, gap in silent:
                reason = live.missed(gap)
                actions += [Evict(rank, reason), *self._lose(rank, reason)]
                if self._state in DONE:
                    return actions
        if self._state is RunState.HOLDING and live.hold_expired(now):
            return actions + self._abort(
                f"only {len(self._membership)} worker(s) remain (ranks {self.joined}), "
                f"fewer than min_workers={self._min}, and none joined within "
                f"{format_seconds(live.rejoin)} s"
            )
        if (
            self._state is RunState.RENDEZVOUS
            and self._elastic
            and len(self._membership) >= self._min
            and live.rendezvous_due(now)
        ):
            return actions + self._first_epoch()
        if self._state is RunState.RUNNING:
            actions += self._check_stall(now)
        return actions

    def _check_stall(self, now: float) -> list[Action]:
        stall = self._liveness.check_stall(now)
        if stall is None:
            return []
        if not self._idle_stalls and not self._current.partly_reported(self._membership.members):
            return []  # every member at the same point between calls: idle, not stalled
        phase, ranks = self.waiting_for()
        step, waited = self._current.resume_step, format_seconds(stall.waited)
        if not stall.give_up:
            return [
                Report(
                    f"stall: step {step} (epoch {self._membership.epoch}) has waited "
                    f"{waited} s for ranks {list(ranks)} in {phase}"
                )
            ]
        reason = f"stalled for {waited} s in {phase}"
        if not self._elastic:
            deadline = self._liveness.stall_deadline
            assert deadline is not None
            return self._abort(
                f"step {step}: ranks {list(ranks)} {reason} "
                f"(stall deadline {format_seconds(deadline)} s)"
            )
        actions: list[Action] = []
        for rank in ranks:
            actions += [Evict(rank, reason), *self._lose(rank, reason)]
            if self._state is not RunState.RUNNING:
                break
        return actions

    # ------------------------------------------------------------------- connections

    def _on_disconnected(self, event: Disconnected) -> list[Action]:
        if event.rank not in self._membership:
            return []
        return self._lose(event.rank, f"disconnected: {event.reason}")

    def _on_malformed(self, event: Malformed) -> list[Action]:
        if event.rank not in self._membership:
            return [Refuse(event.rank, f"malformed message: {event.error}")]
        reason = f"sent a malformed message: {event.error}"
        if not self._elastic:
            return self._abort(f"rank {event.rank} {reason}")
        return [Evict(event.rank, reason), *self._lose(event.rank, reason)]


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
