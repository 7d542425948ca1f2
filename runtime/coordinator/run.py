"""`Run`: one run's state as the coordinator's handlers share it, and the moves they share.

The run holds its lifecycle state (`paramsync.runtime.coordinator.run_state`), the parts with
one job each (membership, liveness, negotiation per run and per process group, commits) and
the step in flight. Its moves are those every handler of
`paramsync.runtime.coordinator.core` may end in: abort the run, drop a faulty rank (or stop
a static run), lose a member, hold, and open an epoch (the first, fresh, resumed or sharded,
or the next one after a change). Each returns the actions to execute; each moves the run's
state only through the transition table. Pure: no socket, no task, no clock.
`paramsync.runtime.coordinator.view.CoordinatorView` reads it for the outside.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from paramsync.runtime.coordinator.commits import Commits
from paramsync.runtime.coordinator.events import (
    MAX_WORLD,
    Abort,
    Action,
    Broadcast,
    Evict,
    Refuse,
    Report,
    Send,
    format_seconds,
    is_int,
)
from paramsync.runtime.coordinator.group_negotiation import GroupNegotiation
from paramsync.runtime.coordinator.layouts import (
    AgreedLayout,
    Shards,
    layout_disagreement,
    sharded_resume_step,
)
from paramsync.runtime.coordinator.liveness import Liveness
from paramsync.runtime.coordinator.membership import Membership, resume_plan
from paramsync.runtime.coordinator.negotiation import Negotiation
from paramsync.runtime.coordinator.run_state import RunState, Trigger, next_state
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.protocol.messages import (
    Digest,
    Hold,
    ParamSpec,
    Ready,
    Reduced,
    StartRun,
    StepDone,
    normalize_signature,
)

__all__ = ["Run"]


class Run:
    """One run's state, its parts and the step in flight; the options are
    `paramsync.runtime.coordinator.core.CoordinatorCore`'s (ValueError for one out of range).
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
        self.run_id = run_id
        """The run's id, told to every member in each start (empty: none)."""
        self.min_workers = min_workers
        self.elastic = min_workers < world_size
        self.start_step = start_step
        self.state = RunState.RENDEZVOUS
        self.abort_reason: str | None = None
        self.membership = Membership(world_size, ring=ring, reference=reference)
        self.liveness = Liveness(
            heartbeat_deadline=heartbeat_deadline,
            rejoin_seconds=rejoin_seconds,
            rendezvous_seconds=rendezvous_seconds,
            stall_seconds=stall_seconds,
            stall_deadline=stall_deadline,
        )
        self.negotiation = Negotiation(by_spec=cache_by_spec)
        self.idle_stalls = idle_stalls
        """Whether a step nobody has reported anything in counts as stalled (a trainer's
        steps never idle; a torch.distributed group may sit between calls for any time)."""
        self.group_negotiation = GroupNegotiation()
        self.commits = Commits(
            digest_interval=digest_interval, resync=bool(resync), elastic=self.elastic
        )
        self.current = StepState(start_step)
        """The step in flight: replaced whole at each commit, epoch start and hold."""
        self.stale_messages = 0
        """Messages of an earlier epoch, dropped (they raced a membership change)."""

    @property
    def declared_groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The process groups every join declared, in creation order: (name, ranks)."""
        return self.membership.groups or ()

    # ------------------------------------------------------------------- the moves

    def move(self, trigger: Trigger) -> None:
        self.state = next_state(self.state, trigger)

    def abort(self, reason: str) -> list[Action]:
        self.move(Trigger.ABORT)
        self.abort_reason = reason
        return [Abort(reason)]

    def fault(self, rank: int, reason: str) -> list[Action]:
        """``rank`` broke the protocol: drop it from an elastic run, else stop the run."""
        if not self.elastic:
            return self.abort(reason)
        return [Evict(rank, reason), *self.lose(rank, reason)]

    def stale(self, epoch: int) -> bool:
        """Whether a run message of ``epoch`` raced a membership change and is to be dropped."""
        if epoch < self.membership.epoch:
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

    def cannot_take(self, event: Ready | Reduced | Digest | StepDone) -> list[Action] | None:
        """The answer to a run message that cannot be taken now (None: go on). The text is
        built only for a refusal: every report of every rank passes here."""
        rank, epoch = event.rank, event.epoch
        if rank not in self.membership:
            return [Refuse(rank, f"rank {rank} sent {self._describe(event)} but has not joined")]
        if self.state is RunState.RENDEZVOUS:
            what = self._describe(event)
            return self.fault(rank, f"rank {rank} sent {what} before the run started")
        if epoch != self.membership.epoch:
            if self.stale(epoch):
                return []
            return self.fault(
                rank,
                f"rank {rank} sent {self._describe(event)} for epoch {epoch}, but the run is at "
                f"{self.membership.epoch}",
            )
        if not self.membership.is_member(rank) or self.state is RunState.HOLDING:
            what = self._describe(event)
            return self.fault(rank, f"rank {rank} sent {what} while not in a running epoch")
        if self.current.finished:
            return self.fault(
                rank,
                f"rank {rank} sent {self._describe(event)} after ranks "
                f"{sorted(self.current.finished)} finished the run at step {self.current.step}",
            )
        return None

    # ------------------------------------------------------------------- epochs

    def first_epoch(self) -> list[Action]:
        """Everyone is in: the first epoch starts afresh, or from the state the donor rule
        (`resume_plan`) picks among those the joins report. Joins declaring 3D-parallel
        layouts must agree on one (else the run stops, naming the ranks and the field)."""
        joins = self.membership.joins
        everyone = tuple(sorted(joins))
        disagreement = layout_disagreement(joins)
        if disagreement is not None:
            return self.abort(f"the run cannot start: {disagreement}")
        layout = AgreedLayout.of(joins)
        if layout is not None and self.elastic:
            return self.abort(
                f"the run cannot start: ranks {list(everyone)} declare a parallel layout, which "
                f"needs every rank of the mesh: min_workers ({self.min_workers}) must equal the "
                f"world size ({self.membership.world_size})"
            )
        self.membership.layout = layout
        self.commits.shards = Shards.of_layout(layout)
        # Workers that took part in an epoch (a restarted coordinator) get a later one, even
        # when none of them applied a step yet: they refuse an epoch that does not grow.
        self.membership.resume_from(max(j.epoch for j in joins.values()))
        if self.commits.shards is not None:
            return self._first_sharded_epoch(everyone, self.commits.shards)
        plan = resume_plan(joins)
        if plan is None:
            # A fresh run: position 0's weights go to everyone.
            return self.start_epoch(self.start_step, everyone, "the run starts", broadcast=True)
        # Resumed workers (a checkpoint, a restarted coordinator): the donor rule
        # (`resume_plan`) picks the newest committed or majority state; everyone else
        # receives it, ranks ahead of it rolling back.
        top, donor, receivers = plan.step, plan.donor, plan.receivers
        actions = self.start_epoch(
            top, everyone, f"the run resumes at step {top}", donor, receivers
        )
        self.commits.recovering = True  # report the first commit after the restart
        given = f"; rank {donor} sends its state to ranks {list(receivers)}" if receivers else ""
        text = (
            f"the run resumes at step {top} in epoch {self.membership.epoch} with ranks "
            f"{list(everyone)}{given}"
        )
        level = "error" if plan.conflict else "warning" if plan.rolled_back else "info"
        return [Report(plan.describe(), level), Report(text, "info"), *actions]

    def _first_sharded_epoch(self, everyone: tuple[int, ...], shards: Shards) -> list[Action]:
        """The first epoch of a 3D-parallel run: afresh, or (a restarted coordinator) at the
        step where every shard's replicas hold one state, checked per shard before it runs."""
        resume = sharded_resume_step(self.membership.joins, shards)
        if isinstance(resume, str):
            return self.abort(f"the run cannot resume: {resume}")
        if resume is None:
            return self.start_epoch(self.start_step, everyone, "the run starts", broadcast=True)
        actions = self.start_epoch(resume, everyone, f"the run resumes at step {resume}")
        self.commits.recovering = True  # report the first commit after the restart
        text = (
            f"the run resumes at step {resume} in epoch {self.membership.epoch} with ranks "
            f"{list(everyone)}: every shard's replicas hold one state"
        )
        return [Report(text, "info"), *actions]

    def start_epoch(
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
        opening = self.membership.open_epoch(step, members, reason)
        epoch = self.membership.epoch
        self.move(Trigger.START_EPOCH)
        self.liveness.resume()
        broadcast = broadcast or step == 0
        if broadcast:
            donor, receivers = -1, ()
        self.current = StepState.opening(step, broadcast=broadcast)
        self.negotiation.new_epoch(fold=opening.fold)
        self.group_negotiation.new_epoch(self.declared_groups, members)
        self.commits.new_epoch()
        self.commits.recovering = not opening.first
        self.liveness.progressed()
        addresses = self.membership.addresses
        start = StartRun(
            addresses=tuple(addresses[r] for r in members),
            ring=opening.ring,
            step=step,
            digest_interval=self.commits.interval,
            heartbeat_deadline=self.liveness.deadline,
            epoch=epoch,
            members=members,
            donor=donor,
            receivers=receivers,
            broadcast=broadcast,
            apply_barrier=self.elastic,
            fold=opening.fold,
            run=self.run_id,
        )
        starts = self._starts(start)
        if opening.first:
            return starts
        text = f"epoch {epoch} starts at step {step} with ranks {list(members)} ({reason})"
        return [Report(text, "info"), *starts]

    def _starts(self, start: StartRun) -> list[Action]:
        """The start to every member: one broadcast, or, when the joins declared process
        groups, each member's own start listing its groups (members and addresses)."""
        if not self.declared_groups:
            return [Broadcast(start)]
        addresses = self.membership.addresses
        present = set(start.members)
        starts: list[Action] = []
        for rank in start.members:
            peers = []
            for name, ranks in self.declared_groups:
                if rank in ranks:
                    active = tuple(r for r in ranks if r in present)
                    peers.append((name, active, tuple(addresses[r] for r in active)))
            starts.append(Send(rank, replace(start, groups=tuple(peers))))
        return starts

    def next_epoch(self, reason: str, joiners: tuple[int, ...] = ()) -> list[Action]:
        survivors = self.membership.survivors()
        members = tuple(sorted(set(survivors) | set(joiners)))
        step = self.current.resume_step
        if not survivors:
            # Nobody holds the run's state any more; joiners cannot be given it.
            return self.abort(f"{reason}: no worker holding the run's state remains")
        return self.start_epoch(step, members, reason, min(survivors), tuple(sorted(joiners)))

    def lose(self, rank: int, reason: str) -> list[Action]:
        """``rank`` is gone (dead, silent, cut off or evicted)."""
        if rank not in self.membership:
            return []
        where = self.membership.hosts_note([rank])
        if not self.elastic:
            # A static run ends with its membership as it was (every joined rank a member).
            return self.abort(f"rank {rank} {reason}{where}")
        self.membership.remove(rank)
        self.liveness.forget(rank)
        if self.state is RunState.RENDEZVOUS:
            return [Report(f"rank {rank} left before the start: {reason}")]
        if not self.membership.is_member(rank):
            return [Report(f"joining rank {rank} left: {reason}")]
        lost = f"rank {rank} {reason}{where}"
        head = f"step {self.current.resume_step}, epoch {self.membership.epoch}: {lost}"
        if len(self.membership) >= self.min_workers and self.membership.survivors():
            return [Report(head, "error"), *self.next_epoch(lost, self.membership.joiners())]
        return [Report(head, "error"), *self.hold(lost)]

    def hold(self, reason: str) -> list[Action]:
        """Fewer than ``min_workers`` remain: drop the step in flight and wait for joiners."""
        step = self.current.resume_step
        self.membership.hold(step, reason)
        self.move(Trigger.HOLD)
        self.liveness.hold()
        self.current = StepState.holding(step)
        self.negotiation.new_epoch(fold=self.negotiation.cache.fold)
        self.group_negotiation.new_epoch(self.declared_groups, ())
        self.commits.new_epoch()
        rejoin = format_seconds(self.liveness.rejoin)
        text = (
            f"{reason}; {len(self.membership)} worker(s) remain, min_workers is "
            f"{self.min_workers}: holding at step {step} for up to {rejoin} s for joiners"
        )
        return [Broadcast(Hold(step, self.membership.epoch, text)), Report(text, "error")]
