"""The coordinator core's parts, each on its own: the run-state table, the per-step state,
membership and epochs, bucket negotiation and the response cache, commits and the digest
verdict, and liveness with explicit clocks. The composed core is tested in
test_coordinator_core.py and test_coordinator_elastic.py."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.runtime.coordinator.commits import (
    CommitRecord,
    Commits,
    TensorNames,
    digest_verdict,
    divergence_of,
)
from paramsync.runtime.coordinator.events import Resync, agreement_hash, spec_hash
from paramsync.runtime.coordinator.liveness import Liveness, Stall
from paramsync.runtime.coordinator.membership import EpochRecord, Membership, resume_plan
from paramsync.runtime.coordinator.negotiation import (
    Disagreement,
    Fault,
    Negotiation,
    ResponseCache,
    spec_groups,
)
from paramsync.runtime.coordinator.run_state import (
    DONE,
    TRANSITIONS,
    IllegalTransition,
    RunState,
    Trigger,
    next_state,
)
from paramsync.runtime.coordinator.step_state import StepState
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import Commit, Digest, Go, Joined, Ready, StepDone

SIG = (("w", (4, 2), "float32", True), ("b", (2,), "float32", True))
TENSORS = ("w", "b", "norm")


def spec(bucket: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    return (((bucket + 1, 4), "float32"), ((3,), "float32"))


def join(rank: int, **kwargs: object) -> Joined:
    return Joined(rank, SIG, ("10.0.0.1", 7000 + rank), **kwargs)  # type: ignore[arg-type]


def digest(rank: int, total: bytes, differ_at: int | None = None, step: int = 0) -> Digest:
    per = tuple((name, b"other" if i == differ_at else b"same") for i, name in enumerate(TENSORS))
    return Digest(rank, step, total, per)


# --------------------------------------------------------------------------- run state


def test_the_table_names_every_legal_transition() -> None:
    assert next_state(RunState.RENDEZVOUS, Trigger.START_EPOCH) is RunState.RUNNING
    assert next_state(RunState.RUNNING, Trigger.START_EPOCH) is RunState.RUNNING
    assert next_state(RunState.RUNNING, Trigger.HOLD) is RunState.HOLDING
    assert next_state(RunState.HOLDING, Trigger.HOLD) is RunState.HOLDING
    assert next_state(RunState.HOLDING, Trigger.START_EPOCH) is RunState.RUNNING
    assert next_state(RunState.RUNNING, Trigger.FINISH) is RunState.FINISHED
    for state in (RunState.RENDEZVOUS, RunState.RUNNING, RunState.HOLDING):
        assert next_state(state, Trigger.ABORT) is RunState.ABORTED
    assert len(TRANSITIONS) == 9


def test_an_illegal_transition_is_a_protocol_error_naming_state_and_trigger() -> None:
    illegal = [
        (state, trigger)
        for state, trigger in itertools.product(RunState, Trigger)
        if (state, trigger) not in TRANSITIONS
    ]
    # Terminal states have no way out; a rendezvous cannot hold or finish; a hold cannot finish.
    assert {(s, t) for s, t in illegal if s not in DONE} == {
        (RunState.RENDEZVOUS, Trigger.HOLD),
        (RunState.RENDEZVOUS, Trigger.FINISH),
        (RunState.HOLDING, Trigger.FINISH),
    }
    for state, trigger in illegal:
        with pytest.raises(IllegalTransition) as info:
            next_state(state, trigger)
        assert isinstance(info.value, ProtocolError)
        assert info.value.state is state and info.value.trigger is trigger
        assert state.value in str(info.value) and trigger.value in str(info.value)
    assert {s for s, _ in TRANSITIONS}.isdisjoint(DONE)


# --------------------------------------------------------------------------- step state


def test_an_epoch_opens_on_its_step_or_on_the_check_of_the_transferred_state() -> None:
    fresh = StepState.opening(0, broadcast=True)
    assert (fresh.step, fresh.applied, fresh.verifying) == (0, False, False)
    broadcast = StepState.opening(7, broadcast=True)
    assert (broadcast.step, broadcast.applied, broadcast.verifying) == (7, False, False)
    transfer = StepState.opening(7, broadcast=False)
    assert (transfer.step, transfer.applied, transfer.verifying) == (6, True, True)
    assert transfer.resume_step == 7
    assert StepState.opening(0, broadcast=False).step == 0


def test_a_hold_keeps_the_step_to_resume_at() -> None:
    assert StepState.holding(5).resume_step == 5
    assert (StepState.holding(5).step, StepState.holding(5).applied) == (4, True)
    assert (StepState.holding(0).step, StepState.holding(0).applied) == (0, False)


def test_the_next_step_starts_empty() -> None:
    state = StepState(3, applied=True)
    state.pending[0] = {1: spec(0)}
    state.plain.add(0)
    state.reported[1] = {0}
    state.gone.add(1)
    state.reduced.add(1)
    state.done[1] = StepDone(1, 3)
    state.early[0, 0] = Ready(0, 4, 0, spec(0))
    state.finished.add(2)
    after = state.following()
    assert after is not state
    assert after.step == 4 and not after.applied and not after.verifying
    assert not after.started and not after.finished and not after.plain and not after.reported
    assert state.early and state.pending  # the old step's state is left as it was


def test_waiting_for_names_the_phase_and_the_missing_ranks() -> None:
    members = (0, 1, 2)
    state = StepState(2)
    assert state.waiting_for(members) == ("data loading and forward", members)
    state.early[1, 0] = Ready(1, 3, 0, spec(0))
    assert state.waiting_for(members) == ("data loading and forward", (0, 2))
    state.gone.add(0)
    assert state.waiting_for(members) == ("backward or the all-reduce", members)
    state.pending[1] = {0: spec(1), 2: spec(1)}
    assert state.waiting_for(members) == ("backward (bucket 1 not ready)", (1,))
    state.reduced.add(2)
    assert state.waiting_for(members) == ("the all-reduce", (0, 1))
    state.applied = True
    state.done[0] = StepDone(0, 2)
    assert state.waiting_for(members) == ("the optimizer step and digest", (1, 2))
    assert state.active_ranks(members) == [0, 1, 2]
    check = StepState.opening(9, broadcast=False)
    phase, missing = check.waiting_for(members)
    assert phase == "the epoch's state transfer and check of step 8" and missing == members


# --------------------------------------------------------------------------- membership


def test_a_join_is_checked_against_range_duplicates_addresses_and_the_model() -> None:
    members = Membership(3, ring=(0, 1, 2), reference=None)
    assert members.check_join(join(3)) == "rank 3 is out of range for a world of 3 ranks"
    members.admit(join(0))
    assert members.reference == SIG and members.reference_rank == 0
    assert members.check_join(join(0)) == "rank 0 has already joined"
    taken = Joined(1, SIG, ("10.0.0.1", 7000))
    assert members.check_join(taken) == "rank 1's address 10.0.0.1:7000 is rank 0's"
    other = Joined(2, (("w", (4, 3), "float32", True), SIG[1]), ("10.0.0.1", 7002))
    assert members.check_join(other) == (
        "rank 2's model differs from rank 0's at parameter 'w': shape (4, 3) vs (4, 2)"
    )
    fixed = Membership(2, ring=(0, 1), reference=SIG[:1])
    assert fixed.check_join(join(1)) == (
        "rank 1's model differs from the reference model at parameter 'b': extra parameter"
    )


def test_epochs_keep_their_history_ring_and_fold() -> None:
    members = Membership(3, ring=(2, 0, 1), reference=None)
    for rank in range(3):
        members.admit(join(rank, fold=rank != 1))
    first = members.open_epoch(0, (0, 1, 2), "the run starts")
    assert first.first and first.ring == (2, 0, 1) and not first.fold
    assert members.epoch == 1 and members.members == (0, 1, 2)
    members.remove(1)
    assert members.survivors() == (0, 2) and members.joined == (0, 2) and 1 not in members
    members.hold(4, "rank 1 left")
    assert members.members == (0, 2) and members.epoch == 2
    members.admit(join(1, fold=True))
    assert members.joiners() == (1,)
    later = members.open_epoch(4, (0, 1, 2), "rank 1 joined")
    assert not later.first and later.ring == (0, 1, 2) and later.fold
    assert members.history == (
        EpochRecord(1, 0, (0, 1, 2), "the run starts"),
        EpochRecord(2, 4, (0, 2), "hold: rank 1 left"),
        EpochRecord(3, 4, (0, 1, 2), "rank 1 joined"),
    )


def test_a_restart_resumes_from_the_newest_majority_state() -> None:
    fresh = {r: join(r) for r in range(2)}
    assert resume_plan(fresh) is None
    joins = {
        0: join(0, step=5, digest=b"a", epoch=2),
        1: join(1, step=6, digest=b"b", epoch=3),
        2: join(2, step=6, digest=b"c", epoch=3),
        3: join(3, step=6, digest=b"c", epoch=1),
    }
    plan = resume_plan(joins)
    assert plan is not None
    assert (plan.step, plan.donor, plan.receivers, plan.epoch) == (6, 2, (0, 1), 3)


# --------------------------------------------------------------------------- negotiation


def test_the_response_cache_takes_the_agreed_spec_or_its_hash_and_nothing_else() -> None:
    cache = ResponseCache(fold=True)
    assert cache.spec(0) is None and not cache.matches(0, spec(0))
    assert cache.fold_hash() == "none"
    cache.agree(0, spec(0))
    cache.agree(3, spec(3))
    assert cache.spec(0) == spec(0) and len(cache) == 2
    assert cache.matches(0, spec(0)) and cache.matches(0, spec_hash(spec(0)))
    assert not cache.matches(0, spec(1)) and not cache.matches(0, spec_hash(spec(1)))
    assert not cache.matches(1, spec(0))
    assert cache.hashes() == {0: spec_hash(spec(0)), 3: spec_hash(spec(3))}
    assert cache.fold_hash() == agreement_hash({3: spec_hash(spec(3)), 0: spec_hash(spec(0))})


def test_a_go_follows_the_last_of_equal_plain_reports_and_enters_the_cache() -> None:
    negotiation, state = Negotiation(), StepState(0)
    assert negotiation.report(state, Ready(1, 0, 0, spec(0)), 2, 1) is None
    assert state.pending == {0: {1: spec(0)}} and state.plain == {0}
    assert negotiation.report(state, Ready(0, 0, 0, spec(0)), 2, 1) == Go(0, 0, 0, 1)
    assert negotiation.seq == 1 and state.gone == {0} and not state.pending and not state.plain
    assert negotiation.cache.spec(0) == spec(0)
    assert negotiation.report(state, Ready(0, 0, 1, spec(1)), 2, 1) is None
    assert negotiation.report(state, Ready(1, 0, 1, spec(1)), 2, 1) == Go(0, 1, 1, 1)
    # The next step reduces both from the cache: no go, and the seq does not move.
    state = state.following()
    assert negotiation.report(state, Ready(0, 1, 0, spec_hash(spec(0)), cached=True), 2, 1) is None
    assert negotiation.report(state, Ready(1, 1, 0, spec(0), cached=True), 2, 1) is None
    assert state.gone == {0} and negotiation.seq == 2


def test_disagreeing_members_are_named_by_group() -> None:
    negotiation, state = Negotiation(), StepState(4)
    negotiation.report(state, Ready(0, 4, 2, spec(2)), 3, 1)
    negotiation.report(state, Ready(2, 4, 2, spec(2)), 3, 1)
    outcome = negotiation.report(state, Ready(1, 4, 2, spec(5)), 3, 1)
    assert outcome == Disagreement(
        "step 4 bucket 2: ranks [0, 2] report shapes [(3, 4), float32; (3,), float32], "
        "ranks [1] report [(6, 4), float32; (3,), float32]"
    )
    assert spec_groups({0: "xxh3:a", 1: "xxh3:b"}) == (
        "ranks [0] report spec 'xxh3:a', ranks [1] report spec 'xxh3:b'"
    )


def test_a_cached_report_needs_an_agreement_it_matches() -> None:
    negotiation, state = Negotiation(), StepState(2)
    assert negotiation.report(state, Ready(1, 2, 0, spec(0), cached=True), 2, 3) == Fault(
        "step 2 bucket 0: rank 1 reduced it without a go, but the members agreed on no spec "
        "for bucket 0 in epoch 3"
    )
    negotiation.cache.agree(0, spec(0))
    assert negotiation.report(state, Ready(1, 2, 0, spec(1), cached=True), 2, 3) == Fault(
        "step 2 bucket 0: rank 1 reduced shapes [(2, 4), float32; (3,), float32] without a go, "
        "but the members agreed on [(1, 4), float32; (3,), float32] in epoch 3"
    )
    state.end(0, StepDone(0, 2))  # rank 0 ended the step without reporting bucket 0
    assert negotiation.report(state, Ready(1, 2, 0, spec(0), cached=True), 2, 3) == Fault(
        "step 2: rank 1 reported bucket 0 ready after ranks [0] finished the step without it"
    )
    negotiation.new_epoch(fold=False)
    assert negotiation.cache.spec(0) is None


def test_reports_out_of_step_twice_or_after_the_step_end_are_faults() -> None:
    negotiation, state = Negotiation(), StepState(2)
    assert negotiation.report(state, Ready(0, 3, 1, spec(1)), 2, 1) is None
    assert [e.bucket for e in state.early.values()] == [1]
    assert negotiation.report(state, Ready(0, 3, 1, spec(1)), 2, 1) == Fault(
        "step 3: rank 0 reported bucket 1 twice"
    )
    assert negotiation.report(state, Ready(0, 5, 1, spec(1)), 2, 1) == Fault(
        "rank 0 reported bucket 1 ready for step 5, but the run is at step 2"
    )
    negotiation.report(state, Ready(0, 2, 1, spec(1)), 2, 1)
    assert negotiation.report(state, Ready(0, 2, 1, spec(1)), 2, 1) == Fault(
        "step 2: rank 0 reported bucket 1 twice"
    )
    state.reduced.add(1)
    assert negotiation.report(state, Ready(1, 2, 0, spec(0)), 2, 1) == Fault(
        "step 2: rank 1 reported bucket 0 ready after finishing the step"
    )
    assert negotiation.report(state, Ready(0, 2, 0, spec(0)), 2, 1) == Fault(
        "step 2: rank 0 reported bucket 0 ready after ranks [1] finished the step without it"
    )


def test_a_step_end_with_a_bucket_outstanding_is_named() -> None:
    negotiation, state = Negotiation(), StepState(1)
    negotiation.report(state, Ready(0, 1, 4, spec(4)), 2, 1)
    assert negotiation.unfinished(state, 0, 1, "sent reduced") == (
        "step 1: rank 0 sent reduced while bucket 4 is still being negotiated "
        "(ready from ranks [0])"
    )
    negotiation.cache.agree(2, spec(2))
    state = StepState(2)
    negotiation.report(state, Ready(1, 2, 2, spec(2), cached=True), 2, 1)
    assert negotiation.unfinished(state, 0, 2, "finished the step") == (
        "step 2: rank 0 finished the step without bucket 2, which ranks [1] reduced"
    )
    assert negotiation.unfinished(state, 1, 2, "finished the step") is None


def test_a_folded_report_must_carry_the_whole_agreement() -> None:
    negotiation = Negotiation()
    assert negotiation.check_fold(0, 1, "none", 2) == (
        "step 1: rank 0 folded its bucket reports into its step report, but not every member "
        "of epoch 2 joined offering to fold"
    )
    negotiation.new_epoch(fold=True)
    assert negotiation.check_fold(0, 1, "none", 2) is None
    negotiation.cache.agree(0, spec(0))
    expected = agreement_hash({0: spec_hash(spec(0))})
    assert negotiation.check_fold(0, 1, expected, 2) is None
    assert negotiation.check_fold(0, 1, "xxh3:0", 2) == (
        f"step 1: rank 0 reduced its buckets from the response cache under agreement xxh3:0, "
        f"but the members agreed on {expected} in epoch 2"
    )


class _Folding:
    """One step's bucket state of ``members`` ranks over ``buckets`` agreed buckets, fed the
    way a host's sub-coordinator feeds it (`HostFold`): a folded step report is taken in O(1)
    when ``defer`` and `StepState.defer_fold` allow, else bucket by bucket with `take`."""

    def __init__(self, members: int, buckets: int, *, defer: bool) -> None:
        self.members, self.defer = members, defer
        self.negotiation = Negotiation()
        self.negotiation.new_epoch(fold=True)
        for bucket in range(buckets):
            self.negotiation.cache.agree(bucket, spec(bucket))
        self.state = StepState(3)

    def fold(self, rank: int) -> tuple[object, ...]:
        """What the rank's folded step report led to: its buckets' outcomes (those that are
        not None), then why its step end was refused (None: taken)."""
        negotiation, state = self.negotiation, self.state
        if self.defer and state.defer_fold(rank, 3, negotiation.cache.agreed(), self.members):
            state.end(rank)  # nothing is outstanding for it: `unfinished` would say None
            return (None,)
        outcomes: list[object] = []
        for bucket, hashed in negotiation.cache.sorted_hashes():
            outcome = negotiation.take(state, rank, 3, bucket, hashed, True, self.members, 1)
            if outcome is not None:
                outcomes.append(outcome)
            if isinstance(outcome, Fault | Disagreement):
                return tuple(outcomes)
        return (*outcomes, self.end(rank))

    def end(self, rank: int) -> object:
        """The rank's step end, once its buckets are closed (`unfinished`), as `reduced`."""
        reason = self.negotiation.unfinished(self.state, rank, 3, "sent reduced")
        if reason is None and rank not in self.state.reduced:
            self.state.end(rank)
        return reason

    def ready(self, rank: int, bucket: int, cached: bool, other: bool) -> object:
        sent = spec(bucket + 1 if other else bucket)
        report = spec_hash(sent) if cached else sent
        return self.negotiation.take(self.state, rank, 3, bucket, report, cached, self.members, 1)

    def buckets(self) -> tuple[object, ...]:
        """The step's bucket state, every deferred fold written."""
        state = self.state
        state.settle()
        ended = tuple(state.ended_without(b) for b in range(8))
        return (state.pending, state.gone, state.plain, state.reported, ended, state.started)


_FOLD_MOVES = st.lists(
    st.tuples(
        st.sampled_from(["fold", "ready", "end"]),
        st.integers(0, 4),
        st.integers(0, 3),
        st.booleans(),
        st.booleans(),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(members=st.integers(1, 5), buckets=st.integers(0, 3), moves=_FOLD_MOVES)
def test_a_deferred_fold_is_the_fold_taken_bucket_by_bucket(
    members: int, buckets: int, moves: list[tuple[str, int, int, bool, bool]]
) -> None:
    """Whatever the order of folded step reports, readies and plain step ends, taking a
    folded report in O(1) (`StepState.defer_fold`, written by `settle` once something else
    looks at the buckets) gives the outcomes and the state of taking it bucket by bucket."""
    deferred, eager = (
        _Folding(members, buckets, defer=True),
        _Folding(members, buckets, defer=False),
    )
    for kind, rank, bucket, cached, other in moves:
        rank %= members
        results = []
        for run in (deferred, eager):
            if kind == "fold":
                results.append(run.fold(rank))
            elif kind == "ready":
                results.append(run.ready(rank, bucket, cached, other))
            else:
                results.append(run.end(rank))
        assert results[0] == results[1], (kind, rank, bucket, cached, other)
    assert deferred.buckets() == eager.buckets()


def test_every_member_folding_touches_no_bucket_until_settled() -> None:
    """64 members fold over 6 agreed buckets: nothing is written per bucket until something
    looks at the buckets; then it is what 64 x 6 takes would have written."""
    run = _Folding(64, 6, defer=True)
    for rank in range(63):
        assert run.fold(rank) == (None,)
    state = run.state
    assert not state.pending and not state.reported and len(state.folded) == 63
    assert state.started
    state.settle()
    assert sorted(state.pending) == list(range(6)) and not state.gone
    assert all(list(reports) == list(range(63)) for reports in state.pending.values())
    assert not state.ended_without(0)
    assert run.fold(63) == (None,)
    assert not state.pending and state.gone == set(range(6))


# --------------------------------------------------------------------------- commits


def test_equal_digests_commit() -> None:
    reports = {r: digest(r, b"same") for r in range(3)}
    verdict = digest_verdict(0, reports, 3, TensorNames(), resync=False)
    assert verdict.resync is None and verdict.abort is None


def test_the_verdict_names_the_diverging_ranks_and_their_first_tensor() -> None:
    reports = {0: digest(0, b"x"), 1: digest(1, b"y", differ_at=1), 2: digest(2, b"x")}
    verdict = digest_verdict(5, reports, 3, TensorNames(), resync=False)
    assert verdict.abort == (
        "step 5: parameter digests diverged: ranks [1] differ from the majority (ranks [0, 2]); "
        "rank 1 first differs from rank 0 at tensor 'b'"
    )
    resynced = digest_verdict(5, reports, 3, TensorNames(), resync=True)
    assert resynced.abort is None and resynced.resync == Resync(5, 0, (1,))


def test_ranks_of_different_digest_algorithms_are_refused_not_diverged() -> None:
    def named(rank: int, value: bytes, algorithm: str) -> Digest:
        return Digest(rank, 6, value, (("w", value),), algorithm=algorithm)

    reports = {
        0: named(0, b"x", "fold31x4"),
        1: named(1, b"y", "xxh3-128"),
        2: named(2, b"x", "fold31x4"),
        3: named(3, b"z", ""),
    }
    for resync in (False, True):
        verdict = digest_verdict(6, reports, 4, TensorNames(), resync=resync)
        assert verdict.resync is None
        assert verdict.abort == (
            "step 6: the ranks computed their state digests with different algorithms, which "
            "cannot be compared: ranks [0, 2] report fold31x4; ranks [1] report xxh3-128; "
            "ranks [3] name no algorithm (choose one for every rank: TrainerOptions.state_digest, "
            "or PARAMSYNC_STATE_DIGEST for the torch backend)"
        )
        assert "\n" not in verdict.abort and divergence_of(verdict.abort) is None
    # Equal digests of one algorithm still commit; the same bytes under two names do not.
    same = {r: named(r, b"x", "fold31x4") for r in range(3)}
    assert digest_verdict(6, same, 3, TensorNames(), resync=False).abort is None
    same[1] = named(1, b"x", "xxh3-128")
    assert digest_verdict(6, same, 3, TensorNames(), resync=False).abort is not None


def test_without_a_majority_every_group_is_listed() -> None:
    reports = {0: digest(0, b"\x01" * 8), 1: digest(1, b"\x02" * 8, differ_at=2)}
    verdict = digest_verdict(3, reports, 2, TensorNames(), resync=True)
    assert verdict.resync is None
    assert verdict.abort == (
        "step 3: parameter digests diverged with no majority: ranks [0] have 010101010101, "
        "ranks [1] have 020202020202; rank 1 first differs from rank 0 at tensor 'norm'"
    )


def test_at_most_four_diverging_ranks_are_detailed() -> None:
    reports = {r: digest(r, b"x") if r < 7 else digest(r, b"y", differ_at=0) for r in range(12)}
    verdict = digest_verdict(0, reports, 12, TensorNames(), resync=False)
    assert verdict.abort is not None
    assert "ranks [7, 8, 9, 10, 11] differ from the majority" in verdict.abort
    assert verdict.abort.count("first differs from rank 0 at tensor 'w'") == 4
    assert verdict.abort.endswith("; 1 more")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"b", b"c"]), min_size=1, max_size=7), st.booleans())
def test_the_verdict_follows_a_strict_majority(totals: list[bytes], resync: bool) -> None:
    reports = {r: digest(r, total) for r, total in enumerate(totals)}
    verdict = digest_verdict(1, reports, len(totals), TensorNames(), resync=resync)
    top = max(set(totals), key=totals.count)
    if len(set(totals)) == 1:
        assert verdict.abort is None and verdict.resync is None
    elif totals.count(top) * 2 > len(totals):
        bad = tuple(r for r, t in enumerate(totals) if t != top)
        if resync:
            assert verdict.abort is None
            assert verdict.resync == Resync(1, totals.index(top), bad)
        else:
            assert verdict.resync is None and verdict.abort is not None
            assert f"ranks {list(bad)} differ from the majority" in verdict.abort
    else:
        assert verdict.resync is None and verdict.abort is not None
        assert "no majority" in verdict.abort


def test_packed_digests_need_names_that_fit() -> None:
    names = TensorNames()
    bare = Digest(2, 4, b"t", packed=b"\x00" * 6)
    assert names.take(bare, 3) == (
        "step 4: rank 2 sent packed per-tensor digests without their names, and listed none "
        "before in epoch 3"
    )
    listed = Digest(2, 4, b"t", packed=b"\x00" * 6, names=("a", "b", "c"))
    assert names.take(listed, 3) is None and names.get(2) == ("a", "b", "c")
    assert names.take(bare, 3) is None  # the names listed before in the epoch
    short = Digest(2, 5, b"t", packed=b"\x00" * 7)
    assert names.take(short, 3) == (
        "step 5: rank 2 sent 7 bytes of per-tensor digests for the 3 tensors it listed"
    )


def test_step_ends_are_checked_then_recorded_and_committed() -> None:
    commits = Commits(digest_interval=2, resync=False, elastic=True)
    state = StepState(3)
    assert commits.check_step_end(state, Digest(0, 3, b"x")) == (
        "rank 0 sent a digest for step 3, which is not a digest step (digest_interval 2): "
        "expected step_done"
    )
    assert commits.check_step_end(state, StepDone(0, 2)) == (
        "rank 0 sent step_done for step 2, but the run is at step 3"
    )
    assert commits.check_step_end(state, StepDone(0, 3)) is None
    assert commits.take_step_end(state, StepDone(0, 3), 1) == (
        "step 3: rank 0 sent step_done before every member reduced"
    )
    assert commits.check_reduced(state, 0, 3) is None
    state.reduced.update((0, 1))
    assert commits.check_reduced(state, 0, 3) == "step 3: rank 0 sent reduced twice"
    state.applied = True
    assert commits.take_step_end(state, StepDone(0, 3), 1) is None
    assert commits.check_step_end(state, StepDone(0, 3)) == (
        "step 3: rank 0 finished the step twice"
    )
    assert commits.take_step_end(state, StepDone(1, 3), 1) is None
    assert not commits.expects_digest(state)
    assert commits.commit(state, 1, (0, 1)) == Commit(3, 1)
    assert commits.last == CommitRecord(3, 1, (0, 1), ())
    static = Commits(digest_interval=1, resync=False, elastic=False)
    assert static.check_reduced(StepState(0), 1, 0) == (
        "rank 1 sent reduced, but the run has no apply barrier"
    )


def test_a_run_finishes_only_between_steps() -> None:
    state = StepState(4)
    assert Commits.check_finish(state, 0, 4, (0, 1)) is None
    assert Commits.check_finish(state, 0, 3, (0, 1)) == (
        "rank 0 finished the run at step 3, but the run is at step 4"
    )
    state.pending[0] = {1: spec(0)}
    assert Commits.check_finish(state, 0, 4, (0, 1)) == (
        "rank 0 finished the run at step 4, but ranks [1] have started step 4"
    )
    state = StepState(4)
    state.finished.add(0)
    assert Commits.check_finish(state, 0, 4, (0, 1)) == "rank 0 finished the run twice"


# --------------------------------------------------------------------------- liveness


def liveness(**kwargs: float | None) -> Liveness:
    options: dict[str, float | None] = {
        "heartbeat_deadline": 2.0,
        "rejoin_seconds": 10.0,
        "rendezvous_seconds": 3.0,
        "stall_seconds": 5.0,
        "stall_deadline": None,
    }
    options.update(kwargs)
    return Liveness(**options)  # type: ignore[arg-type]


def test_a_rank_is_silent_only_past_the_deadline() -> None:
    live = liveness()
    live.joined(0, 1.0)
    live.joined(1, None)  # its clock starts at the next reading
    assert live.last_heartbeat == {0: 1.0, 1: None}
    live.observe(2.5)
    assert live.last_heartbeat == {0: 1.0, 1: 2.5}
    live.heartbeat(1, 3.0)
    live.heartbeat(1, 2.8)  # late, out of order: never goes back
    live.heartbeat(7, 9.0)  # not joined: only the clock moves
    assert live.last_heartbeat == {0: 1.0, 1: 3.0} and live.now == 9.0
    assert live.silent(3.0) == []  # rank 0 exactly at its deadline
    assert live.silent(5.25) == [(0, 4.25), (1, 2.25)]
    assert live.missed(4.25) == "missed heartbeats for 4.25 s (deadline 2.0 s)"
    live.forget(0)
    assert live.silent(5.25) == [(1, 2.25)]


def test_holds_and_elastic_rendezvous_run_out_on_their_deadlines() -> None:
    live = liveness()
    assert not live.rendezvous_due(100.0)  # no one joined yet
    live.joined(0, 4.0)
    assert not live.rendezvous_due(7.0) and live.rendezvous_due(7.5)
    assert not live.hold_expired(100.0)
    live.observe(20.0)
    live.hold()
    assert not live.hold_expired(30.0) and live.hold_expired(30.5)
    live.resume()
    assert not live.hold_expired(1000.0)


def test_a_stall_is_reported_at_each_multiple_then_given_up_on() -> None:
    live = liveness(stall_seconds=5.0, stall_deadline=12.0)
    assert live.check_stall(0.0) is None  # arms
    assert live.check_stall(4.9) is None
    assert live.check_stall(5.0) == Stall(5.0, give_up=False)
    assert live.check_stall(9.0) is None  # reported once per multiple
    assert live.check_stall(10.0) == Stall(10.0, give_up=False)
    assert live.check_stall(12.5) == Stall(12.5, give_up=True)
    live.progressed()
    assert live.check_stall(13.0) is None  # progress re-arms the clock
    assert live.check_stall(17.0) is None
    assert live.check_stall(18.0) == Stall(5.0, give_up=False)
