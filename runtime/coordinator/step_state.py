"""The per-step state of the coordinator: what one step of one epoch has gathered so far.

A :class:`StepState` is created fresh at every step boundary (a commit, a new epoch, a hold)
and replaced whole: nothing of one step leaks into the next, and there is one place that says
what a step starts with. Within its step it fills up as reports arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paramsync.runtime.protocol.messages import CALL_PREFIX, BucketSpec, Digest, Ready, StepDone

__all__ = ["StepState", "MAX_EARLY_READIES", "MAX_EARLY_READY_BYTES", "spec_bytes"]

MAX_EARLY_READIES = 16_384
"""The most ``ready`` reports for the next step one rank may hold before its epoch agreed on a
bucket layout (afterwards a bucket id is bounded by the agreed number of buckets)."""

MAX_EARLY_READY_BYTES = 1 << 20
"""The most bytes of bucket specs (`spec_bytes`) one member's reports for the next step may
hold at once. A legitimate member's early reports describe its model once (one entry per
gradient tensor: about 30 bytes each, so 1 MiB covers some 35,000 tensors, far beyond the
largest models' parameter counts in tensors), and from an epoch's second step on they carry
only the spec's hash. Held as decoded Python objects, 1 MiB of specs costs about 8 MiB of
the coordinator's memory per member, at most."""


def spec_bytes(spec: BucketSpec) -> int:
    """An upper estimate of ``spec``'s size on the wire: each (shape, dtype) entry's array
    heads, its dtype name and 9 bytes per dimension (a hash string: its length)."""
    if isinstance(spec, str):
        return len(spec) + 9
    return sum(16 + len(dtype) + 9 * len(shape) for shape, dtype in spec)


@dataclass(slots=True, eq=False)
class StepState:
    """What step ``step`` of the current epoch has gathered.

    ``applied``: every member holds the step's reduced gradients (``apply`` was sent, or the
    epoch started from a state transfer); ``verifying``: the step is the check that follows an
    epoch's state transfer (digests only, no buckets).
    """

    step: int
    applied: bool = False
    verifying: bool = False
    pending: dict[int, dict[int, BucketSpec]] = field(default_factory=dict)
    """Buckets some rank reported ready, not yet reported by all: bucket -> rank -> spec."""
    plain: set[int] = field(default_factory=set)
    """Buckets with a report that waits for a go (not from the response cache)."""
    reported: dict[int, set[int]] = field(default_factory=dict)
    """Buckets each rank has reported ready."""
    gone: set[int] = field(default_factory=set)
    """Buckets every member reported (a go was sent, or all reduced them from the cache)."""
    reduced: set[int] = field(default_factory=set)
    """Ranks that sent ``reduced`` (elastic runs' apply barrier)."""
    done: dict[int, Digest | StepDone] = field(default_factory=dict)
    """Each rank's step end (a digest or step_done)."""
    early: dict[tuple[int, int], Ready] = field(default_factory=dict)
    """Reports for the next step, held until this one commits: (rank, bucket) -> report, in
    arrival order (a dict, so a duplicate is found in O(1))."""
    early_count: dict[int, int] = field(default_factory=dict)
    """How many reports of ``early`` each rank holds."""
    early_bytes: dict[int, int] = field(default_factory=dict)
    """How many bytes of specs (`spec_bytes`) the reports of ``early`` hold, per rank."""
    finished: set[int] = field(default_factory=set)
    """Ranks that finished the run at this step."""
    ended_with: dict[int, int] = field(default_factory=dict)
    """bucket -> how many ranks of `ended` reported it (kept by `end`, so a report can tell
    in O(1) whether some rank ended the step without its bucket)."""
    folded: list[int] = field(default_factory=list)
    """Ranks whose folded step report `defer_fold` took without writing it bucket by bucket
    into ``pending``, ``gone``, ``reported`` and ``ended_with``; `settle` writes them."""
    folded_buckets: tuple[tuple[int, BucketSpec], ...] = ()
    """The agreed (bucket, spec) pairs the ranks of ``folded`` reported."""
    folded_members: int = 0
    """The members the step counted when ``folded`` was taken."""
    _ended: set[int] = field(default_factory=set)

    @classmethod
    def opening(cls, step: int, *, broadcast: bool) -> StepState:
        """The first step of an epoch that starts at ``step``: after a state transfer (not
        ``broadcast``, ``step > 0``) the epoch first checks step ``step - 1``'s state."""
        verifying = not broadcast and step > 0
        return cls(step if broadcast or step == 0 else step - 1, verifying, verifying)

    @classmethod
    def holding(cls, resume: int) -> StepState:
        """The state while the run holds, to resume at step ``resume``."""
        return cls(resume - 1 if resume > 0 else 0, applied=resume > 0)

    def following(self) -> StepState:
        """The step after this one commits (its early reports are taken out first)."""
        return StepState(self.step + 1)

    @property
    def resume_step(self) -> int:
        """Where a new epoch starts: after this step if every member holds its gradients."""
        return self.step + 1 if self.applied else self.step

    @property
    def ended(self) -> set[int]:
        """Ranks that ended the step (reduced, or sent their digest or step_done)."""
        return set(self.done) | self.reduced

    def end(self, rank: int, report: Digest | StepDone | None = None) -> None:
        """``rank`` ended the step: its step end ``report``, or (None) its ``reduced``."""
        if report is None:
            self.reduced.add(rank)
        else:
            self.done[rank] = report
        if rank not in self._ended:
            self._ended.add(rank)
            for bucket in self.reported.get(rank, ()):
                self.ended_with[bucket] = self.ended_with.get(bucket, 0) + 1

    def ended_without(self, bucket: int) -> bool:
        """Whether some rank ended the step without reporting ``bucket`` (O(1))."""
        if self.folded:
            self.settle()
        return len(self._ended) > self.ended_with.get(bucket, 0)

    def defer_fold(
        self, rank: int, step: int, agreed: tuple[tuple[int, BucketSpec], ...], members: int
    ) -> bool:
        """Take ``rank``'s folded step report of ``step`` as its cached report of every
        ``agreed`` (bucket, spec), in O(1), when nothing but such reports touched the step's
        buckets (no ready, no rank ended without folding, the same agreement and ``members``
        for all): each would pass the per-bucket checks (`Negotiation.take`) and be written
        the same way, which `settle` does once something else looks at the buckets. False:
        not taken (the caller takes it bucket by bucket)."""
        if (
            not agreed
            or step != self.step
            or self.verifying
            or self.applied
            or rank in self.done
            or rank in self.reduced
            or self.pending
            or self.gone
            or self.plain
            or self.reported
            or len(self._ended) != len(self.folded)
            or len(self.folded) >= members
        ):
            return False
        if self.folded and (agreed is not self.folded_buckets or members != self.folded_members):
            return False
        self.folded.append(rank)
        self.folded_buckets, self.folded_members = agreed, members
        return True

    def settle(self) -> None:
        """Write the reports `defer_fold` took, as `Negotiation.take` would have written
        them one bucket at a time (the buckets every member reported are gone)."""
        if not self.folded:
            return
        ranks, self.folded = self.folded, []
        agreed, members = self.folded_buckets, self.folded_members
        buckets = [bucket for bucket, _ in agreed]
        pending, ended_with = self.pending, self.ended_with
        for rank in ranks:
            for bucket, spec in agreed:
                reports = pending.get(bucket)
                if reports is None:
                    reports = pending[bucket] = {}
                reports[rank] = spec
                if len(reports) >= members:
                    del pending[bucket]
                    self.gone.add(bucket)
            self.reported[rank] = set(buckets)
            if rank in self._ended:
                for bucket in buckets:
                    ended_with[bucket] = ended_with.get(bucket, 0) + 1

    @property
    def started(self) -> bool:
        """Whether any rank has reported anything for this step (or the next)."""
        return bool(
            self.pending or self.gone or self.done or self.early or self.reduced or self.folded
        )

    def active_ranks(self, members: tuple[int, ...]) -> list[int]:
        """The ranks known to have started this step, ascending."""
        self.settle()
        active = self.ended | {rank for rank, _ in self.early}
        for reports in self.pending.values():
            active.update(reports)
        if self.gone:
            active.update(members)
        return sorted(active)

    def partly_reported(self, members: tuple[int, ...]) -> bool:
        """Whether some members reported a bucket or the step's end that others have not."""
        self.settle()
        return bool(self.pending) or 0 < len(self.done) < len(members)

    def waiting_call(self, members: tuple[int, ...]) -> tuple[str, int, tuple[int, ...]] | None:
        """The torch.distributed call the step waits in, when it waits for some members to
        make a call others made (its spec names it: `CALL_PREFIX`): the call's name, its
        number (bucket) and the ranks of ``members`` that have not called it; else None."""
        self.settle()
        if self.verifying or self.applied or self.reduced or not self.pending:
            return None
        bucket = min(self.pending)
        reports = self.pending[bucket]
        spec = next(iter(reports.values()))
        if isinstance(spec, str) or not spec or not isinstance(spec[0][1], str):
            return None
        if not spec[0][1].startswith(CALL_PREFIX):
            return None
        missing = tuple(r for r in members if r not in reports)
        return spec[0][1][len(CALL_PREFIX) :], bucket, missing

    def waiting_for(self, members: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """What the step waits for: a phase and the ranks of ``members`` it waits on."""
        self.settle()
        if self.verifying:
            missing = tuple(r for r in members if r not in self.done)
            return f"the epoch's state transfer and check of step {self.step}", missing
        if self.applied:
            missing = tuple(r for r in members if r not in self.done)
            return "the optimizer step and digest", missing
        if self.reduced:
            missing = tuple(r for r in members if r not in self.reduced)
            return "the all-reduce", missing
        if self.pending:
            bucket = min(self.pending)
            missing = tuple(r for r in members if r not in self.pending[bucket])
            return f"backward (bucket {bucket} not ready)", missing
        if self.done:
            missing = tuple(r for r in members if r not in self.done)
            return "the all-reduce, optimizer step and digest", missing
        if self.gone:
            return "backward or the all-reduce", members
        started = {rank for rank, _ in self.early}
        return "data loading and forward", tuple(r for r in members if r not in started)
