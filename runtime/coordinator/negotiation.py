"""Bucket negotiation: the members agree on each gradient bucket's spec before it is reduced.

A bucket is reduced after a ``go`` once every member reported the same spec for it; the go
also enters the spec into the epoch's :class:`ResponseCache` (Horovod's response cache), after
which a member may reduce that bucket at once and report it ``cached``: the report is checked
against the agreement instead of waiting for a go. A member may also fold all its cached
reports into its step report (one agreement hash for every bucket).

:class:`Negotiation` takes one bucket report against the step's :class:`StepState` and says
what follows: nothing yet, a go to broadcast, a fault of the reporting rank, or members that
disagree (the run cannot go on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from paramsync.runtime.coordinator.events import agreement_hash, spec_hash, spec_text
from paramsync.runtime.coordinator.step_state import (
    MAX_EARLY_READIES,
    MAX_EARLY_READY_BYTES,
    StepState,
    spec_bytes,
)
from paramsync.runtime.protocol.messages import BucketSpec, Go, Ready

__all__ = ["ResponseCache", "Negotiation", "Fault", "Disagreement", "Outcome", "spec_groups"]


@dataclass(frozen=True)
class Fault:
    """The reporting rank broke the protocol: ``reason`` says how."""

    reason: str


@dataclass(frozen=True)
class Disagreement:
    """The members reported different specs for a bucket: the run cannot go on."""

    reason: str


Outcome = Go | Fault | Disagreement | None
"""What a bucket report leads to: a go to broadcast, a fault, a disagreement, or nothing yet."""


class ResponseCache:
    """The bucket specs every member of one epoch agreed on (a go was sent), with their
    `spec_hash`. A report marked cached must match the spec or its hash; a new epoch starts
    with an empty cache. ``fold``: whether this epoch's members fold cached reports into
    their step reports."""

    def __init__(self, *, fold: bool = False, by_spec: bool = False) -> None:
        self.fold = fold
        self.by_spec = by_spec
        """Whether a cached report may name any spec agreed in the epoch (`known`)."""
        self._agreed: dict[int, tuple[BucketSpec, str]] = {}
        self._known: dict[str, BucketSpec] = {}
        """Every spec agreed in the epoch, at any bucket, by its hash (`known`)."""
        self._hashes: dict[int, str] | None = None
        self._specs: tuple[tuple[int, BucketSpec], ...] | None = None
        self._fold_hash: str | None = None
        """`hashes` and `fold_hash`, kept until the next agreement (every folded report of
        every rank asks for them)."""

    def __len__(self) -> int:
        return len(self._agreed)

    def id_bound(self) -> int:
        """One past the highest bucket id agreed (0: none agreed): with the usual dense ids,
        the number of buckets in the agreed layout."""
        return max(self._agreed) + 1 if self._agreed else 0

    def spec(self, bucket: int) -> BucketSpec | None:
        """The spec agreed for ``bucket`` (None: no agreement yet)."""
        agreement = self._agreed.get(bucket)
        return None if agreement is None else agreement[0]

    def matches(self, bucket: int, spec: BucketSpec) -> bool:
        """Whether ``spec`` (a spec, or its hash) is the one agreed for ``bucket``."""
        agreement = self._agreed.get(bucket)
        return agreement is not None and spec in agreement

    def agree(self, bucket: int, spec: BucketSpec) -> None:
        """Every member reported ``spec`` for ``bucket`` and got a go."""
        digest = spec_hash(spec)
        self._agreed[bucket] = (spec, digest)
        self._known[digest] = spec
        self._hashes = self._fold_hash = self._specs = None

    def known(self, spec: BucketSpec) -> BucketSpec | None:
        """The spec, agreed at any bucket of the epoch, that ``spec`` (a spec or its hash)
        is (None: never agreed). A caller whose calls do not repeat at the same place every
        step (a torch.distributed process group: `paramsync.actors.torch_backend`) reduces a call at
        once when every member agreed on the very same call before; the members' reports of it are
        still compared, here, and must all be that spec."""
        if not self.by_spec:
            return None
        return self._known.get(spec if isinstance(spec, str) else spec_hash(spec))

    def hashes(self) -> dict[int, str]:
        """bucket -> the agreed spec's hash (a copy)."""
        return dict(self._bucket_hashes())

    def _bucket_hashes(self) -> dict[int, str]:
        if self._hashes is None:
            self._hashes = {bucket: agreement[1] for bucket, agreement in self._agreed.items()}
        return self._hashes

    def agreed(self) -> tuple[tuple[int, BucketSpec], ...]:
        """(bucket, agreed spec) of every agreement, by bucket (the same tuple until the
        next agreement)."""
        if self._specs is None:
            self._specs = tuple((b, self._agreed[b][0]) for b in sorted(self._agreed))
        return self._specs

    def sorted_hashes(self) -> list[tuple[int, str]]:
        """(bucket, hash) of every agreement, by bucket."""
        hashes = self._bucket_hashes()
        return [(bucket, hashes[bucket]) for bucket in sorted(hashes)]

    def fold_hash(self) -> str:
        """The hash of the whole agreement, as a folded step report must carry it."""
        if self._fold_hash is None:
            hashes = self._bucket_hashes()
            self._fold_hash = agreement_hash(hashes) if hashes else "none"
        return self._fold_hash


def spec_groups(reports: Mapping[int, BucketSpec]) -> str:
    """Ranks grouped by the spec they reported: "ranks [0, 2] report shapes [...], ..."."""
    groups: dict[BucketSpec, list[int]] = {}
    for rank in sorted(reports):
        groups.setdefault(reports[rank], []).append(rank)
    parts = []
    for index, (spec, ranks) in enumerate(groups.items()):
        text = spec_text(spec)
        if index == 0 and not isinstance(spec, str) and text.startswith("["):
            text = "shapes " + text
        parts.append(f"ranks {ranks} report {text}")
    return ", ".join(parts)


class Negotiation:
    """The run's bucket agreements: the epoch's response cache and the seq of the next go."""

    def __init__(self, *, by_spec: bool = False) -> None:
        self.by_spec = by_spec
        """Cached reports may name any spec agreed in the epoch (a torch.distributed group's
        coordinator: `CoordinatorOptions.cache_by_spec`)."""
        self.cache = ResponseCache(by_spec=by_spec)
        self.seq = 0
        """The seq the next go carries (= gos sent so far, counted from 0)."""

    def new_epoch(self, *, fold: bool) -> None:
        """A new epoch (or a hold): agreements of the last one no longer stand."""
        self.cache = ResponseCache(fold=fold, by_spec=self.by_spec)

    def report(self, state: StepState, event: Ready, members: int, epoch: int) -> Outcome:
        """Take rank ``event.rank``'s report of a bucket ready, in a step of ``members``
        members of ``epoch``. A report for the step after ``state`` is kept in ``state.early``
        until the step commits."""
        rank, step, bucket = event.rank, event.step, event.bucket
        if step == state.step + 1:
            # Step s+1's backward may finish before step s's digests are in: hold the report
            # until step s commits (no Go for s+1 before that; a cached report, already being
            # reduced, is checked then), keeping the check off the critical path.
            return self._hold_early(state, event)
        return self.take(state, rank, step, bucket, event.spec, event.cached, members, epoch)

    def take(
        self,
        state: StepState,
        rank: int,
        step: int,
        bucket: int,
        spec: BucketSpec,
        cached: bool,
        members: int,
        epoch: int,
    ) -> Outcome:
        """`report` of a report that is not for the next step, by its fields (a folded step
        report's buckets come here without a `Ready` built for each)."""
        if state.folded:
            state.settle()
        if step != state.step or state.verifying:
            return Fault(
                f"rank {rank} reported bucket {bucket} ready for step {step}, "
                f"but the run is at step {state.resume_step}"
            )
        if rank in state.done or rank in state.reduced or state.applied:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} ready after finishing the step"
            )
        reports = state.pending.get(bucket)
        if bucket in state.gone or (reports is not None and rank in reports):
            return Fault(f"step {step}: rank {rank} reported bucket {bucket} twice")
        agreed = self.cache.spec(bucket)
        if cached and not self.cache.matches(bucket, spec):
            agreed = self.cache.known(spec) or agreed  # agreed at another bucket, or a fault
        if cached:
            fault = self._check_cached(state, rank, step, bucket, spec, agreed, epoch)
            if fault is not None:
                return fault
        else:
            if state.done or state.reduced:
                return Fault(
                    f"step {step}: rank {rank} reported bucket {bucket} ready after ranks "
                    f"{sorted(state.ended)} finished the step without it"
                )
            state.plain.add(bucket)  # negotiated: the go, if all agree, updates the agreement
        if reports is None:
            reports = state.pending[bucket] = {}
        # A cached report matched the agreement (spec or hash): compare peers by the spec.
        # (A cached report without an agreement faulted above.)
        reported = agreed if cached and agreed is not None else spec
        # Every earlier report of the bucket agrees (a disagreement stops the run), so the
        # first one stands for all: one comparison per report, not a set of all of them.
        first = next(iter(reports.values()), reported)
        reports[rank] = reported
        buckets = state.reported.get(rank)
        if buckets is None:
            state.reported[rank] = {bucket}
        else:
            buckets.add(bucket)
        if reported != first:
            return Disagreement(f"step {step} bucket {bucket}: {spec_groups(reports)}")
        if len(reports) < members:
            return None
        del state.pending[bucket]
        state.gone.add(bucket)
        if bucket not in state.plain:
            return None  # every member reduced it from the agreement: no go to send
        state.plain.discard(bucket)
        if not cached:  # a cached report matched the agreement: it stands as it is
            self.cache.agree(bucket, spec)
        go = Go(step, bucket, self.seq, epoch)
        self.seq += 1
        return go

    def _hold_early(self, state: StepState, event: Ready) -> Fault | None:
        """Keep a report for the next step until this one commits, bounded: once the epoch
        agreed on its buckets, an id must be below their number; before, a rank holds at most
        `MAX_EARLY_READIES` early reports. Each check is O(1), so a flood costs linear time."""
        rank, step, bucket = event.rank, event.step, event.bucket
        key = (rank, bucket)
        if key in state.early:
            return Fault(f"step {step}: rank {rank} reported bucket {bucket} twice")
        layout = self.cache.id_bound()
        if layout and not bucket < layout:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} ready, but the members "
                f"agreed on {layout} buckets (ids 0 to {layout - 1})"
            )
        held = state.early_count.get(rank, 0)
        if held >= MAX_EARLY_READIES:
            return Fault(
                f"step {step}: rank {rank} reported more than {MAX_EARLY_READIES} buckets ready "
                "ahead of the step"
            )
        size = state.early_bytes.get(rank, 0) + spec_bytes(event.spec)
        if size > MAX_EARLY_READY_BYTES:
            return Fault(
                f"step {step}: rank {rank}'s bucket reports ahead of the step hold more than "
                f"{MAX_EARLY_READY_BYTES} bytes of specs (bucket {bucket} would make {size})"
            )
        state.early[key] = event
        state.early_count[rank] = held + 1
        state.early_bytes[rank] = size
        return None

    def _check_cached(
        self,
        state: StepState,
        rank: int,
        step: int,
        bucket: int,
        spec: BucketSpec,
        agreed: BucketSpec | None,
        epoch: int,
    ) -> Fault | None:
        """A cached report: the rank is already reducing, so check it against the epoch's
        agreement. It may trail a peer's step end (links race), but that peer must have
        reported the bucket too: its own reports precede its step end on its link."""
        if agreed is None:
            return Fault(
                f"step {step} bucket {bucket}: rank {rank} reduced it without a go, but the "
                f"members agreed on no spec for bucket {bucket} in epoch {epoch}"
            )
        if not self.cache.matches(bucket, spec) and self.cache.known(spec) is None:
            return Fault(
                f"step {step} bucket {bucket}: rank {rank} reduced shapes "
                f"{spec_text(spec)} without a go, but the members agreed on "
                f"{spec_text(agreed)} in epoch {epoch}"
            )
        if not state.ended_without(bucket):
            return None  # every rank that ended the step reported it (O(1): no scan)
        without = sorted(r for r in state.ended if bucket not in state.reported.get(r, ()))
        if without:
            return Fault(
                f"step {step}: rank {rank} reported bucket {bucket} ready after ranks "
                f"{without} finished the step without it"
            )
        return None

    def check_fold(self, rank: int, step: int, cached: str, epoch: int) -> str | None:
        """Why a step report of ``rank`` saying it reduced every bucket from the response
        cache under agreement ``cached`` cannot be taken (None: it can)."""
        if not self.cache.fold:
            return (
                f"step {step}: rank {rank} folded its bucket reports into its step report, but "
                f"not every member of epoch {epoch} joined offering to fold"
            )
        expected = self.cache.fold_hash()
        if cached != expected:
            return (
                f"step {step}: rank {rank} reduced its buckets from the response cache under "
                f"agreement {cached}, but the members agreed on {expected} in epoch {epoch}"
            )
        return None

    @staticmethod
    def unfinished(state: StepState, rank: int, step: int, what: str) -> str | None:
        """Why ``rank`` cannot end ``step`` (``what``) with a bucket outstanding: one still
        negotiated (no go yet), or one that peers reduced from the cache and it never
        reported (its peers' reports may still be on their way: those are checked as they
        come). None: no bucket is outstanding for it."""
        state.settle()
        for bucket in sorted(state.pending):
            reports = state.pending[bucket]
            if bucket in state.plain:
                return (
                    f"step {step}: rank {rank} {what} while bucket {bucket} is still being "
                    f"negotiated (ready from ranks {sorted(reports)})"
                )
            if rank not in reports:
                return (
                    f"step {step}: rank {rank} {what} without bucket {bucket}, which ranks "
                    f"{sorted(reports)} reduced"
                )
        return None
