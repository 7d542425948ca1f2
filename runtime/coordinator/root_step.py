"""The root coordinator's step in flight and its bucket agreement, over hosts (pure).

The root of the coordinator tree sees each host as one reporter: a host reports a bucket ready
once all its members did (`HostReady`), and ends the step once all its members did. A
:class:`RootStep` is what one step has gathered from the hosts; :class:`HostNegotiation` takes
one host's bucket report (or the buckets its step report folds) against it and says what
follows, with the flat `paramsync.runtime.coordinator.negotiation`'s rules and its
`ResponseCache`: nothing yet, a go for every host, a fault of the host, or hosts that
disagree. Per step it costs O(hosts), and O(1) per host whose members folded every bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paramsync.runtime.coordinator.events import spec_hash
from paramsync.runtime.coordinator.negotiation import (
    Disagreement,
    Fault,
    Outcome,
    ResponseCache,
    spec_groups,
)
from paramsync.runtime.protocol.messages import (
    BucketSpec,
    DigestGroup,
    Go,
    HostStepDone,
    TensorGroup,
)

__all__ = ["RootStep", "HostNegotiation"]

Ended = tuple[DigestGroup, ...] | HostStepDone
"""A host's step end as the root keeps it: its digest groups, or its step_done."""


@dataclass(slots=True, eq=False)
class RootStep:
    """What step ``step`` of the current epoch has gathered from the hosts (the flat
    `StepState`'s fields, keyed by host)."""

    step: int
    applied: bool = False
    verifying: bool = False
    pending: dict[int, dict[int, BucketSpec]] = field(default_factory=dict)
    """bucket -> host -> the spec it reported (hosts that folded the bucket included)."""
    first_key: dict[int, str] = field(default_factory=dict)
    """bucket -> the spec hash of its first report (every later one is compared with it)."""
    plain: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    reported: dict[int, set[int]] = field(default_factory=dict)
    """host -> the buckets it reported."""
    ended: set[int] = field(default_factory=set)
    """Hosts whose first step report (reduced, or the step end) is in."""
    folded: set[int] = field(default_factory=set)
    """Hosts whose step report covered every agreed bucket it did not report."""
    reduced: set[int] = field(default_factory=set)
    done: dict[int, Ended] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    state_key: tuple[bytes, str] | None = None
    """The (digest, algorithm) of the step's first digest group (None: no digest yet)."""
    split: bool = False
    """Whether some digest group differs from ``state_key`` (the step cannot commit at once)."""
    querying: bool = False
    """Whether the root asked the hosts for their per-tensor digests (`DigestQuery`)."""
    answers: dict[int, tuple[TensorGroup, ...]] = field(default_factory=dict)
    """host -> its per-tensor digest groups, answering the query."""

    @classmethod
    def opening(cls, step: int, *, broadcast: bool) -> RootStep:
        """The first step of an epoch that starts at ``step`` (`StepState.opening`)."""
        verifying = not broadcast and step > 0
        return cls(step if broadcast or step == 0 else step - 1, verifying, verifying)

    def following(self) -> RootStep:
        return RootStep(self.step + 1)

    @property
    def resume_step(self) -> int:
        return self.step + 1 if self.applied else self.step

    @property
    def started(self) -> bool:
        return bool(self.pending or self.gone or self.done or self.reduced or self.ended)


class HostNegotiation:
    """The epoch's bucket agreements among hosts and the seq of the next go. ``describe``
    names a host in a reason ("host 'node3' (ranks [6, 7])"); ``ranks_of`` lists a host's
    members (a disagreement names the ranks)."""

    def __init__(
        self,
        describe: Callable[[int], str],
        ranks_of: Callable[[int], tuple[int, ...]],
        *,
        by_spec: bool = False,
    ) -> None:
        self.by_spec = by_spec
        """A cached report may name any spec the hosts agreed on in the epoch, not only its
        bucket's (a torch.distributed group: `Negotiation.by_spec`)."""
        self.cache = ResponseCache(by_spec=by_spec)
        self.seq = 0
        self._describe = describe
        self._ranks_of = ranks_of

    def new_epoch(self, *, fold: bool) -> None:
        self.cache = ResponseCache(fold=fold, by_spec=self.by_spec)

    def take(
        self,
        state: RootStep,
        host: int,
        bucket: int,
        spec: BucketSpec,
        cached: bool,
        hosts: int,
        epoch: int,
    ) -> Outcome:
        """Host ``host`` reports ``bucket`` of ``state``'s step ready (every member of it)."""
        who, step = self._describe(host), state.step
        if host in state.ended or state.applied:
            return Fault(f"step {step}: {who} reported bucket {bucket} ready after finishing it")
        reports = state.pending.get(bucket)
        if bucket in state.gone or (reports is not None and host in reports):
            return Fault(f"step {step}: {who} reported bucket {bucket} twice")
        if cached and not self.cache.matches(bucket, spec) and self.cache.known(spec) is None:
            return Fault(
                f"step {step} bucket {bucket}: {who} reduced it from the response cache as "
                f"{spec!r}, but the hosts agreed on "
                f"{spec_hash(agreed) if (agreed := self.cache.spec(bucket)) else 'no spec'} "
                f"in epoch {epoch}"
            )
        if cached:  # hosts that ended the step without reporting the bucket nor folding it
            without = sorted(
                h
                for h in state.ended
                if h not in state.folded and bucket not in state.reported.get(h, ())
            )
        else:  # a bucket still to negotiate: nobody may have ended the step
            without = sorted(state.ended)
        if without:
            return Fault(
                f"step {step}: {who} reported bucket {bucket} ready after "
                + ", ".join(self._describe(h) for h in without)
                + " finished the step without it"
            )
        if reports is None:
            reports = state.pending[bucket] = {}
            agreed = self.cache.spec(bucket)
            for folder in sorted(state.folded):  # their step reports covered the bucket
                if agreed is not None:
                    reports[folder] = agreed
        if not cached:
            state.plain.add(bucket)
        return self._add(state, host, bucket, spec, cached, hosts, epoch)

    def _add(
        self,
        state: RootStep,
        host: int,
        bucket: int,
        spec: BucketSpec,
        cached: bool,
        hosts: int,
        epoch: int,
    ) -> Outcome:
        reports = state.pending[bucket]
        key = spec if isinstance(spec, str) else spec_hash(spec)
        first = state.first_key.setdefault(bucket, key)
        reports[host] = spec
        state.reported.setdefault(host, set()).add(bucket)
        if key != first:
            by_rank = {r: s for h, s in reports.items() for r in self._ranks_of(h)}
            return Disagreement(f"step {state.step} bucket {bucket}: {spec_groups(by_rank)}")
        if len(reports) < hosts:
            return None
        del state.pending[bucket]
        state.gone.add(bucket)
        if bucket not in state.plain:
            return None
        state.plain.discard(bucket)
        plain = next((s for s in reports.values() if not isinstance(s, str)), spec)
        self.cache.agree(bucket, plain)
        go = Go(state.step, bucket, self.seq, epoch)
        self.seq += 1
        return go

    def fold(
        self, state: RootStep, host: int, cached: str, hosts: int, epoch: int
    ) -> list[Outcome]:
        """Host ``host``'s step report says its members reduced every agreed bucket it did
        not report from the response cache under ``cached``: check that, and take it as the
        host's report of every bucket still pending (O(1) when none is)."""
        step = state.step
        if not self.cache.fold:
            who = self._describe(host)
            return [
                Fault(
                    f"step {step}: {who} folded its bucket reports into its step report, but "
                    f"not every member of epoch {epoch} joined offering to fold"
                )
            ]
        expected = self.cache.fold_hash()
        if cached != expected:
            who = self._describe(host)
            return [
                Fault(
                    f"step {step}: {who} reduced its buckets from the response cache under "
                    f"agreement {cached}, but the hosts agreed on {expected} in epoch {epoch}"
                )
            ]
        state.folded.add(host)
        if not state.pending:
            return []
        outcomes: list[Outcome] = []
        for bucket in sorted(state.pending):
            if host in state.pending[bucket]:
                continue
            agreed = self.cache.spec(bucket)
            if agreed is None:
                continue  # a bucket still negotiated: `unfinished` names it
            outcomes.append(self._add(state, host, bucket, agreed, True, hosts, epoch))
        return outcomes

    def unfinished(self, state: RootStep, host: int, what: str) -> str | None:
        """Why ``host`` cannot end the step (``what``) with a bucket outstanding for it."""
        if not state.pending:
            return None
        who, step = self._describe(host), state.step
        for bucket in sorted(state.pending):
            reports = state.pending[bucket]
            if bucket in state.plain and host not in reports:
                ready = ", ".join(self._describe(h) for h in sorted(reports))
                return (
                    f"step {step}: {who} {what} while bucket {bucket} is still being "
                    f"negotiated (ready from {ready})"
                )
            if bucket in state.plain:
                return f"step {step}: {who} {what} while bucket {bucket} waits for its go"
            if host not in reports:
                return f"step {step}: {who} {what} without bucket {bucket}"
        return None
