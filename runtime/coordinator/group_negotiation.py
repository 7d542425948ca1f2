"""Bucket negotiation within declared process groups: one agreement and response cache per group.

A ``ready`` that names a group (``group``) is negotiated among that group's members only:
once every member of the group that trains in the epoch reported the same spec for a
(step, bucket), the coordinator sends those members a ``go`` carrying the group and the
group's own ``seq`` (each group's gos are numbered apart, so two groups' collectives
interleave independently). Specs are compared among the group's members only; a mismatch
is a :class:`Disagreement` naming the group and the ranks that differ. The agreement enters
the group's :class:`ResponseCache`, against which a later ``cached`` report of the group is
checked (and, when every member of the group reported the bucket cached, no go is sent).

The world's negotiation (`paramsync.runtime.coordinator.negotiation`) is untouched: a ``ready``
without a group never reaches this part. A go for step ``s + 1`` is held until step ``s`` commits
(`advance`), as the world's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paramsync.runtime.coordinator.group_decl import Declaration
from paramsync.runtime.coordinator.negotiation import (
    Disagreement,
    Fault,
    ResponseCache,
    spec_groups,
)
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.errors import quoted
from paramsync.runtime.protocol.messages import BucketSpec, Go, Ready

__all__ = ["GroupGo", "GroupNegotiation", "GroupOutcome"]


@dataclass(frozen=True)
class GroupGo:
    """Send ``go`` (which names its group) to each of ``ranks``."""

    go: Go
    ranks: tuple[int, ...]


GroupOutcome = GroupGo | Fault | Disagreement | None
"""What a group's bucket report leads to."""


@dataclass
class _Group:
    """One group's negotiation in the epoch: its active members, cache, seq and reports."""

    name: str
    ranks: tuple[int, ...]
    """The group's ranks that are members of the epoch."""
    cache: ResponseCache = field(default_factory=ResponseCache)
    pending: dict[tuple[int, int], dict[int, BucketSpec]] = field(default_factory=dict)
    plain: set[tuple[int, int]] = field(default_factory=set)
    """(step, bucket) some member reported negotiated (not from the cache)."""
    gone: set[tuple[int, int]] = field(default_factory=set)
    """(step, bucket) every active member reported: settled (a go sent or none needed)."""
    held: list[tuple[tuple[int, int], BucketSpec]] = field(default_factory=list)
    """(step, bucket) and spec of the next step that every member reported: its go waits
    for the commit."""


class GroupNegotiation:
    """Every declared group's bucket agreements in the current epoch."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, int] = {}
        self.dropped = 0
        """Group buckets left unsettled when their step committed or their epoch ended."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def seq(self, group: str) -> int:
        """The seq the next go of ``group`` carries (gos of that group so far)."""
        return self._seqs.get(group, 0)

    def cache(self, group: str) -> ResponseCache:
        return self._groups[group].cache

    def new_epoch(self, declaration: Declaration, members: tuple[int, ...]) -> None:
        """A new epoch (or a hold, with no members): every group's cache starts empty."""
        for group in self._groups.values():
            self.dropped += len(group.pending) + len(group.held)
        active = set(members)
        self._groups = {
            name: _Group(name, tuple(r for r in ranks if r in active))
            for name, ranks in declaration
        }

    def report(self, state: StepState, event: Ready, epoch: int) -> GroupOutcome:
        """Take rank ``event.rank``'s report of a bucket ready within ``event.group``, while
        the run is at ``state``'s step of ``epoch``."""
        rank, step, bucket, name = event.rank, event.step, event.bucket, event.group
        group = self._groups.get(name)
        if group is None:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} ready in group {quoted(name)}, "
                f"which no join declared"
            )
        if rank not in group.ranks:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} ready in group {quoted(name)}, "
                f"whose members in epoch {epoch} are ranks {list(group.ranks)}"
            )
        if step not in (state.step, state.step + 1) or state.verifying:
            return Fault(
                f"rank {rank} reported bucket {bucket} of group {quoted(name)} ready for step "
                f"{step}, but the run is at step {state.resume_step}"
            )
        key = (step, bucket)
        reports = group.pending.get(key, {})
        if key in group.gone or rank in reports:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} of group {quoted(name)} twice"
            )
        agreed = group.cache.spec(bucket)
        if event.cached:
            if agreed is None:
                return Fault(
                    f"step {step} bucket {bucket}: rank {rank} reduced it in group {quoted(name)} "
                    f"without a go, but the group agreed on no spec for it in epoch {epoch}"
                )
            if not group.cache.matches(bucket, event.spec):
                return Fault(
                    f"step {step} bucket {bucket}: rank {rank} reduced it in group {quoted(name)} "
                    f"without a go as {quoted(event.spec)}, but the group agreed on "
                    f"{quoted(agreed)} in epoch {epoch}"
                )
        else:
            group.plain.add(key)
        reports = group.pending.setdefault(key, {})
        reports[rank] = agreed if event.cached else event.spec  # type: ignore[assignment]
        if len(set(reports.values())) > 1:
            return Disagreement(
                f"group {quoted(name)} step {step} bucket {bucket}: {spec_groups(reports)}"
            )
        if len(reports) < len(group.ranks):
            return None
        del group.pending[key]
        group.gone.add(key)
        if key not in group.plain:
            return None  # every member reduced it from the group's agreement
        group.plain.discard(key)
        spec = next(iter(reports.values()))
        if step > state.step:
            group.held.append((key, spec))
            return None
        return self._go(group, key, spec, epoch)

    def advance(self, step: int, epoch: int) -> list[GroupGo]:
        """Step ``step - 1`` committed: drop what it left unsettled, send the held gos."""
        gos: list[GroupGo] = []
        for group in self._groups.values():
            stale = [key for key in group.pending if key[0] < step]
            self.dropped += len(stale)
            for key in stale:
                del group.pending[key]
                group.plain.discard(key)
            group.gone = {key for key in group.gone if key[0] >= step}
            held, group.held = group.held, []
            for key, spec in held:
                gos.append(self._go(group, key, spec, epoch))
        return gos

    def _go(self, group: _Group, key: tuple[int, int], spec: BucketSpec, epoch: int) -> GroupGo:
        step, bucket = key
        group.cache.agree(bucket, spec)
        seq = self._seqs.get(group.name, 0)
        self._seqs[group.name] = seq + 1
        return GroupGo(Go(step, bucket, seq, epoch, group.name), group.ranks)
