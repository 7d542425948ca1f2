"""`CoordinatorView`: what the coordinator's core shows of its run, read-only.

A core hands out its view as ``core.view``; the service, the metrics it feeds, the CLI, the
benchmarks and the tests read the run through it. The view holds nothing of its own but the
run it reads (`paramsync.runtime.coordinator.run.Run`), so it always shows the run as it is
now; it has no setter, and what it returns cannot change the run (tuples, read-only mappings,
frozen records).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from paramsync.runtime.coordinator.commits import CommitRecord
from paramsync.runtime.coordinator.layouts import AgreedLayout
from paramsync.runtime.coordinator.membership import EpochRecord
from paramsync.runtime.coordinator.run import Run
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.protocol.messages import Signature

__all__ = ["CoordinatorView"]


class CoordinatorView:
    """The run of one `paramsync.runtime.coordinator.core.CoordinatorCore`, read-only."""

    __slots__ = ("_run",)

    def __init__(self, run: Run) -> None:
        self._run = run

    # -- the run --------------------------------------------------------------------------------

    @property
    def state(self) -> RunState:
        return self._run.state

    @property
    def abort_reason(self) -> str | None:
        return self._run.abort_reason

    @property
    def world_size(self) -> int:
        """The number of worker slots."""
        return self._run.membership.world_size

    @property
    def min_workers(self) -> int:
        return self._run.min_workers

    @property
    def elastic(self) -> bool:
        """Whether the run survives the loss of a member (``min_workers < world_size``)."""
        return self._run.elastic

    @property
    def reference_signature(self) -> Signature | None:
        return self._run.membership.reference

    @property
    def digest_interval(self) -> int:
        return self._run.commits.interval

    def is_digest_step(self, step: int) -> bool:
        return self._run.commits.is_digest_step(step)

    @property
    def stale_messages(self) -> int:
        """Messages of an earlier epoch, dropped (they raced a membership change)."""
        return self._run.stale_messages

    # -- members and epochs -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The membership epoch (0 before the start; grows by one per membership change)."""
        return self._run.membership.epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The current epoch's members by ring position; before the start, the joined ranks."""
        membership = self._run.membership
        return membership.joined if membership.epoch == 0 else membership.members

    @property
    def joined(self) -> tuple[int, ...]:
        """Every rank with a live join (members and joiners waiting for an epoch), ascending."""
        return self._run.membership.joined

    @property
    def history(self) -> tuple[EpochRecord, ...]:
        """Every epoch so far: where it started and who was in it."""
        return self._run.membership.history

    @property
    def addresses(self) -> Mapping[int, tuple[str, int]]:
        return MappingProxyType(dict(self._run.membership.addresses))

    @property
    def last_heartbeat(self) -> Mapping[int, float | None]:
        """Each member's last heartbeat (or join) time; None: not known until the next Tick."""
        return self._run.liveness.last_heartbeat

    @property
    def layout(self) -> AgreedLayout | None:
        """The 3D-parallel layout every rank declared (None: a flat run, or not started)."""
        return self._run.membership.layout

    def shard_of(self, rank: int) -> int:
        """Rank ``rank``'s shard (the rank of its dp=0 replica); a flat run's ranks are each
        compared with all: its shard is 0."""
        shards = self._run.commits.shards
        return 0 if shards is None else shards.of(rank)

    @property
    def groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The process groups every join declared, in creation order: (name, ranks)."""
        return self._run.declared_groups

    # -- the step in flight -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step now running (the next one to commit)."""
        return self._run.current.step

    @property
    def seq(self) -> int:
        """The seq the next Go will carry (= Gos sent so far, counted from 0)."""
        return self._run.negotiation.seq

    def group_seq(self, group: str) -> int:
        """The seq the next go of process group ``group`` will carry."""
        return self._run.group_negotiation.seq(group)

    @property
    def applied(self) -> bool:
        """Whether every member holds this step's reduced gradients (``apply`` was sent)."""
        return self._run.current.applied

    @property
    def pending_buckets(self) -> Mapping[int, tuple[int, ...]]:
        """Buckets of this step some rank reported ready, not yet sent a Go: bucket -> ranks."""
        pending = self._run.current.pending
        return MappingProxyType({b: tuple(sorted(r)) for b, r in pending.items()})

    def waiting_for(self) -> tuple[str, tuple[int, ...]]:
        """What the step in flight waits for: a phase and the ranks it waits on."""
        return self._run.current.waiting_for(self._run.membership.members)

    @property
    def last_commit(self) -> CommitRecord | None:
        return self._run.commits.last
