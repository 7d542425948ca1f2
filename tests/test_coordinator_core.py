"""The coordinator's sans-I/O core: examples for every path, wire parsing, and a stateful model.

The core is pure, so hypothesis drives it directly (no trio): the state machine plays the
workers, mostly honestly, sometimes duplicating, delaying, reordering or corrupting their
messages, and checks the coordinator's actions against what it was fed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import event as note
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import (
    Abort,
    Action,
    Broadcast,
    Disconnected,
    Event,
    Malformed,
    Refuse,
    Report,
    Resync,
    Tick,
    agreement_hash,
    bucket_spec,
    model_signature,
    spec_hash,
)
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Commit,
    Digest,
    Finished,
    Go,
    Heartbeat,
    Joined,
    JoinRefused,
    Ready,
    ResyncOrder,
    Shutdown,
    StartRun,
    StepDone,
    event_from_wire,
    message_from_wire,
)
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION, decode_frame, encode_frame_bytes

SIG = (
    ("embed.w", (16, 8), "float32", True),
    ("layers.1.attn.w", (64, 64), "float32", True),
    ("norm.b", (8,), "float32", False),
)
TENSORS = ("embed.w", "layers.1.attn.w", "norm.b")


def addr(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 7000 + rank)


def spec(bucket: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    return (((bucket + 1, 4), "float32"), ((3,), "float32"))


def digest(rank: int, step: int, bad: frozenset[int] = frozenset(), tensor: int = 1) -> Digest:
    """Rank ``rank``'s digest for ``step``; ranks in ``bad`` differ at tensor #``tensor``."""
    per = tuple(
        (name, b"bad" if rank in bad and i == tensor else b"good") for i, name in enumerate(TENSORS)
    )
    total = b"bad-%d" % rank if rank in bad else b"good-%d" % step
    return Digest(rank, step, total, per)


def started(n: int, **kwargs: Any) -> CoordinatorCore:
    core = CoordinatorCore(n, heartbeat_deadline=kwargs.pop("heartbeat_deadline", 5.0), **kwargs)
    for rank in range(n):
        actions = core.handle(Joined(rank, SIG, addr(rank), now=0.0))
    assert core.view.state is RunState.RUNNING
    assert len(actions) == 1 and isinstance(actions[0].message, StartRun)
    return core


def run_buckets(core: CoordinatorCore, step: int, buckets: int) -> list[Action]:
    """Every rank reports every bucket, each rank in its own (rotated) order."""
    actions: list[Action] = []
    n = core.view.world_size
    for position in range(buckets):
        for rank in range(n):
            bucket = (position + rank) % buckets
            actions += core.handle(Ready(rank, step, bucket, spec(bucket)))
    return actions


def end_step(core: CoordinatorCore, step: int, bad: frozenset[int] = frozenset()) -> list[Action]:
    actions: list[Action] = []
    for rank in range(core.view.world_size):
        if core.view.is_digest_step(step):
            actions += core.handle(digest(rank, step, bad))
        else:
            actions += core.handle(StepDone(rank, step))
    return actions


def the_abort(actions: list[Action]) -> str:
    assert len(actions) == 1 and isinstance(actions[0], Abort), actions
    return actions[0].reason


def the_refusal(actions: list[Action]) -> str:
    assert len(actions) == 1 and isinstance(actions[0], Refuse), actions
    return actions[0].reason


# --------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("interval", [1, 2])
def test_happy_path(n: int, interval: int) -> None:
    core = CoordinatorCore(n, digest_interval=interval, heartbeat_deadline=5.0)
    assert core.view.state is RunState.RENDEZVOUS
    for rank in reversed(range(n)):
        actions = core.handle(Joined(rank, SIG, addr(rank), now=0.0))
    assert actions == [
        Broadcast(StartRun(tuple(addr(r) for r in range(n)), tuple(range(n)), 0, interval, 5.0))
    ]
    assert core.view.members == tuple(range(n))
    seq = 0
    for step in range(4):
        actions = run_buckets(core, step, 3)
        assert all(isinstance(a, Broadcast) and isinstance(a.message, Go) for a in actions)
        gos = [a.message for a in actions]
        assert [g.seq for g in gos] == list(range(seq, seq + 3))
        assert sorted(g.bucket for g in gos) == [0, 1, 2] and {g.step for g in gos} == {step}
        seq += 3
        assert core.view.seq == seq
        for rank in range(n):
            assert core.handle(Heartbeat(rank, step + 1.0)) == []
        assert core.handle(Tick(step + 1.5)) == []
        assert end_step(core, step) == [Broadcast(Commit(step))]
        assert core.view.step == step + 1
    for rank in range(n):
        actions = core.handle(Finished(rank, 4))
    assert actions == [Broadcast(Shutdown("finished"))]
    assert core.view.state is RunState.FINISHED
    assert core.handle(Tick(1000.0)) == []
    assert core.handle(Disconnected(0, "eof")) == []


def test_go_is_sent_when_the_last_rank_is_ready() -> None:
    core = started(3)
    assert core.handle(Ready(2, 0, 5, spec(5))) == []
    assert core.handle(Ready(0, 0, 7, "h7")) == []
    assert core.handle(Ready(0, 0, 5, spec(5))) == []
    assert core.handle(Ready(1, 0, 5, spec(5))) == [Broadcast(Go(0, 5, 0))]
    assert core.view.pending_buckets == {7: (0,)}
    assert core.handle(Ready(1, 0, 7, "h7")) == []
    assert core.handle(Ready(2, 0, 7, "h7")) == [Broadcast(Go(0, 7, 1))]


def test_step_without_buckets_commits_on_digests() -> None:
    core = started(2)
    assert end_step(core, 0) == [Broadcast(Commit(0))]


def test_start_run_custom_ring_and_start_step() -> None:
    core = CoordinatorCore(3, ring=[2, 0, 1], start_step=7, signature=SIG)
    for rank in (1, 2, 0):
        actions = core.handle(Joined(rank, SIG, addr(rank)))
    start = actions[0].message
    assert start == StartRun((addr(0), addr(1), addr(2)), (2, 0, 1), 7, 1, 10.0)
    assert core.view.step == 7
    assert core.handle(Ready(0, 0, 0, spec(0)))[0].reason.startswith(
        "rank 0 reported bucket 0 ready for step 0, but the run is at step 7"
    )


@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("epochs", [(1, 1, 1), (0, 3, 2), (4, 0, 0)])
def test_a_restart_at_step_0_opens_an_epoch_after_the_workers_latest(
    elastic: bool, epochs: tuple[int, int, int]
) -> None:
    """A coordinator restarted before any worker applied step 0: every join reports step 0
    but an epoch the workers already took part in; the fresh run must open a later epoch
    (workers refuse a start_run whose epoch does not grow: EpochRegression)."""
    kwargs: dict[str, Any] = {"min_workers": 2} if elastic else {}
    core = CoordinatorCore(3, heartbeat_deadline=5.0, **kwargs)
    for rank, epoch in enumerate(epochs):
        actions = core.handle(Joined(rank, SIG, addr(rank), now=0.0, epoch=epoch))
    starts = [a.message for a in actions if isinstance(a, Broadcast)]
    assert len(starts) == 1 and isinstance(starts[0], StartRun), actions
    start = starts[0]
    assert start.step == 0 and start.broadcast and start.donor == -1
    assert start.epoch == max(epochs) + 1 and core.view.epoch == start.epoch
    assert start.members == (0, 1, 2)
    epoch = start.epoch
    actions = [a for r in range(3) for a in core.handle(Ready(r, 0, 0, spec(0), epoch=epoch))]
    assert actions == [Broadcast(Go(0, 0, 0, epoch=epoch))]


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="world_size"):
        CoordinatorCore(0)
    with pytest.raises(ValueError, match="digest_interval"):
        CoordinatorCore(2, digest_interval=0)
    with pytest.raises(ValueError, match="ring"):
        CoordinatorCore(2, ring=[0, 0])
    with pytest.raises(ValueError, match="heartbeat_deadline"):
        CoordinatorCore(2, heartbeat_deadline=0)


# --------------------------------------------------------------------------- rendezvous refusals


def test_refuses_out_of_range_and_duplicate_ranks() -> None:
    core = CoordinatorCore(3)
    assert the_refusal(core.handle(Joined(3, SIG, addr(3)))) == (
        "rank 3 is out of range for a world of 3 ranks"
    )
    assert the_refusal(core.handle(Joined(-1, SIG, addr(9)))).startswith("rank -1 is out of range")
    assert core.handle(Joined(1, SIG, addr(1))) == []
    assert the_refusal(core.handle(Joined(1, SIG, addr(5)))) == "rank 1 has already joined"
    reason = the_refusal(core.handle(Joined(2, SIG, addr(1))))
    assert reason == "rank 2's address 10.0.0.1:7001 is rank 1's"
    assert core.view.members == (1,)
    assert core.view.state is RunState.RENDEZVOUS


def _sig_with(index: int, **changes: Any) -> tuple:
    sig = [list(p) for p in SIG]
    for key, value in changes.items():
        sig[index][{"name": 0, "shape": 1, "dtype": 2, "requires_grad": 3}[key]] = value
    return tuple(tuple(p) for p in sig)


@pytest.mark.parametrize(
    ("signature", "expected"),
    [
        (
            _sig_with(1, shape=(64, 32)),
            "rank 2's model differs from rank 0's at parameter 'layers.1.attn.w': "
            "shape (64, 32) vs (64, 64)",
        ),
        (
            _sig_with(1, dtype="bfloat16"),
            "rank 2's model differs from rank 0's at parameter 'layers.1.attn.w': "
            "dtype bfloat16 vs float32",
        ),
        (
            _sig_with(2, requires_grad=True),
            "rank 2's model differs from rank 0's at parameter 'norm.b': "
            "requires_grad True vs False",
        ),
        (
            (SIG[0], SIG[2]),
            "rank 2's model differs from rank 0's at parameter 'layers.1.attn.w': missing",
        ),
        (
            SIG[:2],
            "rank 2's model differs from rank 0's at parameter 'norm.b': missing",
        ),
        (
            (*SIG, ("head.w", (8, 8), "float32", True)),
            "rank 2's model differs from rank 0's at parameter 'head.w': extra parameter",
        ),
        (
            (SIG[0], ("extra.w", (1,), "float32", True), *SIG[1:]),
            "rank 2's model differs from rank 0's at parameter 'extra.w': extra parameter",
        ),
        (
            (SIG[1], SIG[0], SIG[2]),
            "rank 2's model differs from rank 0's at position 0: "
            "parameter 'layers.1.attn.w' vs 'embed.w' (order differs)",
        ),
    ],
)
def test_refuses_a_different_model_naming_the_first_mismatch(
    signature: tuple, expected: str
) -> None:
    core = CoordinatorCore(3)
    assert core.handle(Joined(0, SIG, addr(0))) == []
    assert the_refusal(core.handle(Joined(2, signature, addr(2)))) == expected
    assert core.handle(Joined(2, SIG, addr(2))) == []  # the fixed worker may come back
    assert core.view.members == (0, 2)


def test_constructor_signature_is_the_reference() -> None:
    core = CoordinatorCore(2, signature=SIG)
    reason = the_refusal(core.handle(Joined(0, _sig_with(0, shape=(8, 16)), addr(0))))
    assert reason == (
        "rank 0's model differs from the reference model at parameter 'embed.w': "
        "shape (8, 16) vs (16, 8)"
    )
    assert core.view.reference_signature == SIG


def test_refuses_joins_once_running_and_non_members() -> None:
    core = started(2)
    reason = the_refusal(core.handle(Joined(1, SIG, addr(1))))
    assert reason == "rank 1 cannot join: the run has already started"
    assert the_refusal(core.handle(Ready(2, 0, 0, spec(0)))) == (
        "rank 2 sent bucket 0 ready for step 0 but has not joined"
    )
    assert core.view.state is RunState.RUNNING


def test_rendezvous_protocol_violations() -> None:
    core = CoordinatorCore(3)
    core.handle(Joined(0, SIG, addr(0)))
    assert the_refusal(core.handle(Ready(1, 0, 0, spec(0)))).startswith("rank 1 sent bucket 0")
    assert the_refusal(core.handle(Malformed(1, "bad cbor"))) == "malformed message: bad cbor"
    assert core.handle(Disconnected(1, "eof")) == []
    assert core.handle(Heartbeat(1, 3.0)) == []
    reason = the_abort(core.handle(Ready(0, 0, 0, spec(0))))
    assert reason == "rank 0 sent bucket 0 ready for step 0 before the run started"
    assert core.view.state is RunState.ABORTED


# --------------------------------------------------------------------------- bucket aborts


def test_spec_mismatch_names_both_groups() -> None:
    core = started(3)
    assert core.handle(Ready(0, 0, 1, (((10,), "float32"),))) == []
    assert core.handle(Ready(2, 0, 1, (((10,), "float32"),))) == []
    reason = the_abort(core.handle(Ready(1, 0, 1, (((12,), "float32"),))))
    assert reason == (
        "step 0 bucket 1: ranks [0, 2] report shapes [(10,), float32], "
        "ranks [1] report [(12,), float32]"
    )
    assert core.view.state is RunState.ABORTED
    assert core.view.abort_reason == reason


def test_spec_mismatch_is_detected_at_the_second_report() -> None:
    core = started(4)
    core.handle(Ready(3, 0, 0, "hash-a"))
    reason = the_abort(core.handle(Ready(1, 0, 0, "hash-b")))
    assert (
        reason == "step 0 bucket 0: ranks [1] report spec 'hash-b', ranks [3] report spec 'hash-a'"
    )


def test_spec_mismatch_at_a_later_step_names_it() -> None:
    core = started(2)
    run_buckets(core, 0, 2)
    end_step(core, 0)
    run_buckets(core, 1, 1)
    end_step(core, 1)
    core.handle(Ready(0, 2, 1, (((10,), "float32"), ((4, 4), "bfloat16"))))
    reason = the_abort(core.handle(Ready(1, 2, 1, (((10,), "float32"),))))
    assert reason == (
        "step 2 bucket 1: ranks [0] report shapes [(10,), float32; (4, 4), bfloat16], "
        "ranks [1] report [(10,), float32]"
    )


@pytest.mark.parametrize("bad_step", [0, 3, 5])
def test_ready_for_another_step_aborts(bad_step: int) -> None:
    core = started(2)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    reason = the_abort(core.handle(Ready(1, bad_step, 0, spec(0))))
    assert reason == f"rank 1 reported bucket 0 ready for step {bad_step}, but the run is at step 1"


def test_ready_for_the_next_step_is_held_until_the_commit() -> None:
    """Step s+1's backward may beat step s's digest: its Ready waits, its Go follows the
    commit, and a second early report of the same bucket aborts."""
    core = started(2)
    run_buckets(core, 0, 1)
    assert core.handle(Ready(0, 1, 0, spec(0))) == []  # early: rank 0 has not even sent its digest
    assert core.handle(Ready(1, 1, 0, spec(0))) == []
    actions = end_step(core, 0)  # the digests arrive: commit 0, then the held reports: Go(1, 0)
    assert [type(a.message).__name__ for a in actions if isinstance(a, Broadcast)] == [
        "Commit",
        "Go",
    ]
    go = actions[-1].message
    assert (go.step, go.bucket) == (1, 0) and core.view.step == 1
    core2 = started(2)
    run_buckets(core2, 0, 1)
    core2.handle(Ready(0, 1, 0, spec(0)))
    assert the_abort(core2.handle(Ready(0, 1, 0, spec(0)))) == (
        "step 1: rank 0 reported bucket 0 twice"
    )


# --------------------------------------------------------------------------- response cache


def cached(rank: int, step: int, bucket: int, layout: Any = None) -> Ready:
    """A report of a bucket the rank reduces at once, under the epoch's agreed spec."""
    return Ready(rank, step, bucket, spec(bucket) if layout is None else layout, cached=True)


def test_cached_reports_need_no_go_once_every_member_agreed() -> None:
    """Step 0 negotiates (one go per bucket); later steps' cached reports are checked and
    commit without a single go."""
    core = started(3)
    assert len([a for a in run_buckets(core, 0, 2) if isinstance(a, Broadcast)]) == 2
    assert end_step(core, 0) == [Broadcast(Commit(0))]
    for step in (1, 2):
        for rank in range(3):
            for bucket in (1, 0):
                assert core.handle(cached(rank, step, bucket)) == []
        assert core.view.pending_buckets == {}
        assert end_step(core, step) == [Broadcast(Commit(step))]
    assert core.view.seq == 2  # the two gos of step 0, none since


def test_a_cached_report_may_trail_a_peers_step_end() -> None:
    """Rank 0 reduced with rank 1 and sent its digest; rank 1's report, sent before the ring
    started, comes in on its own link after it: no fault."""
    core = started(2)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    assert core.handle(cached(0, 1, 0)) == []
    assert core.handle(digest(0, 1)) == []
    assert core.handle(cached(1, 1, 0)) == []
    assert core.handle(digest(1, 1)) == [Broadcast(Commit(1))]


def test_a_cached_report_held_for_the_commit_is_checked_then() -> None:
    core = started(2)
    run_buckets(core, 0, 1)
    assert core.handle(cached(0, 1, 0)) == []  # step 0 not committed yet: held
    assert core.handle(cached(1, 1, 0, (((9,), "float32"),))) == []
    actions = end_step(core, 0)
    assert actions[0] == Broadcast(Commit(0))
    assert isinstance(actions[-1], Abort) and actions[-1].reason == (
        "step 1 bucket 0: rank 1 reduced shapes [(9,), float32] without a go, but the members "
        "agreed on [(1, 4), float32; (3,), float32] in epoch 1"
    )


def test_a_cached_report_off_the_agreement_names_the_rank() -> None:
    core = started(3)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    assert core.handle(cached(0, 1, 0)) == []
    reason = the_abort(core.handle(cached(2, 1, 0, (((1, 4), "float16"), ((3,), "float32")))))
    assert reason == (
        "step 1 bucket 0: rank 2 reduced shapes [(1, 4), float16; (3,), float32] without a go, "
        "but the members agreed on [(1, 4), float32; (3,), float32] in epoch 1"
    )


def test_a_cached_report_without_an_agreement_aborts() -> None:
    core = started(2)
    assert the_abort(core.handle(cached(1, 0, 0))) == (
        "step 0 bucket 0: rank 1 reduced it without a go, but the members agreed on no spec "
        "for bucket 0 in epoch 1"
    )
    core = started(2)
    run_buckets(core, 0, 1)  # bucket 0 agreed, bucket 1 never
    end_step(core, 0)
    reason = the_abort(core.handle(cached(0, 1, 1)))
    assert "agreed on no spec for bucket 1" in reason


def test_a_changed_spec_is_negotiated_afresh_and_replaces_the_agreement() -> None:
    core = started(2)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    wider = (((2, 4), "float32"), ((3,), "float32"))
    assert core.handle(Ready(0, 1, 0, wider)) == []  # not cached: waits for a go
    assert core.handle(Ready(1, 1, 0, wider)) == [Broadcast(Go(1, 0, 1))]
    end_step(core, 1)
    assert core.handle(cached(0, 2, 0, wider)) == []  # the new agreement holds ...
    assert the_abort(core.handle(cached(1, 2, 0))).startswith(  # ... the old one no longer
        "step 2 bucket 0: rank 1 reduced shapes [(1, 4), float32; (3,), float32] without a go, "
        "but the members agreed on [(2, 4), float32; (3,), float32]"
    )


def test_a_changed_spec_against_cached_peers_is_diagnosed_naming_the_ranks() -> None:
    """Rank 0's layout changed (it negotiates), rank 1 reduces under the agreement: the
    reports differ and the abort names both groups, whichever arrives first."""
    wider = (((2, 4), "float32"), ((3,), "float32"))
    expected = (
        "step 1 bucket 0: ranks [0] report shapes [(2, 4), float32; (3,), float32], "
        "ranks [1] report [(1, 4), float32; (3,), float32]"
    )
    for first_cached in (True, False):
        core = started(2)
        run_buckets(core, 0, 1)
        end_step(core, 0)
        events = [Ready(0, 1, 0, wider), cached(1, 1, 0)]
        if first_cached:
            events.reverse()
        assert core.handle(events[0]) == []
        assert the_abort(core.handle(events[1])) == expected


def test_finishing_without_a_bucket_the_peers_reduced_from_the_cache_aborts() -> None:
    core = started(3)
    run_buckets(core, 0, 2)
    end_step(core, 0)
    for rank in range(3):
        core.handle(cached(rank, 1, 0))
    core.handle(cached(0, 1, 1))
    assert the_abort(core.handle(digest(1, 1))) == (
        "step 1: rank 1 finished the step without bucket 1, which ranks [0] reduced"
    )
    core = started(2)
    run_buckets(core, 0, 2)
    end_step(core, 0)
    core.handle(cached(0, 1, 0))
    core.handle(digest(0, 1))  # rank 0 skipped bucket 1; nobody reported it yet
    assert the_abort(core.handle(cached(1, 1, 1))) == (
        "step 1: rank 1 reported bucket 1 ready after ranks [0] finished the step without it"
    )


def test_cached_reports_round_trip_the_wire() -> None:
    ready = cached(2, 7, 3)
    kind, fields = ready.to_wire()
    assert fields["cached"] is True
    decoded = event_from_wire(decode_frame(encode_frame_bytes(kind, fields)), rank=2, now=0.0)
    assert decoded == ready
    plain = Ready(2, 7, 3, spec(3))
    kind, fields = plain.to_wire()
    assert "cached" not in fields  # an older coordinator reads it unchanged
    assert event_from_wire(decode_frame(encode_frame_bytes(kind, fields)), rank=2, now=0.0) == plain


def test_duplicate_bucket_aborts_pending_or_gone() -> None:
    core = started(3)
    core.handle(Ready(1, 0, 4, spec(4)))
    assert the_abort(core.handle(Ready(1, 0, 4, spec(4)))) == (
        "step 0: rank 1 reported bucket 4 twice"
    )
    core = started(2)
    run_buckets(core, 0, 1)
    assert (
        the_abort(core.handle(Ready(0, 0, 0, spec(0)))) == "step 0: rank 0 reported bucket 0 twice"
    )


def test_finishing_a_step_with_a_bucket_pending_aborts() -> None:
    core = started(3)
    core.handle(Ready(0, 0, 2, spec(2)))
    core.handle(Ready(2, 0, 2, spec(2)))
    reason = the_abort(core.handle(digest(1, 0)))
    assert reason == (
        "step 0: rank 1 finished the step while bucket 2 is still being negotiated "
        "(ready from ranks [0, 2])"
    )


def test_ready_after_others_finished_the_step_aborts() -> None:
    core = started(3)
    run_buckets(core, 0, 1)
    core.handle(digest(0, 0))
    core.handle(digest(2, 0))
    reason = the_abort(core.handle(Ready(1, 0, 9, spec(9))))
    assert (
        reason
        == "step 0: rank 1 reported bucket 9 ready after ranks [0, 2] finished the step without it"
    )
    core = started(2)
    core.handle(digest(0, 0))
    reason = the_abort(core.handle(Ready(0, 0, 0, spec(0))))
    assert reason == "step 0: rank 0 reported bucket 0 ready after finishing the step"


# --------------------------------------------------------------------------- digests


def test_diverged_minority_aborts_naming_step_ranks_and_tensor() -> None:
    core = started(4)
    run_buckets(core, 0, 2)
    assert end_step(core, 0) == [Broadcast(Commit(0))]
    run_buckets(core, 1, 2)
    actions = end_step(core, 1, bad=frozenset({2}))
    reason = the_abort(actions)
    assert reason == (
        "step 1: parameter digests diverged: ranks [2] differ from the majority (ranks [0, 1, 3]); "
        "rank 2 first differs from rank 0 at tensor 'layers.1.attn.w'"
    )
    assert core.view.step == 1
    assert core.handle(Ready(0, 2, 0, spec(0))) == []


def test_diverged_digest_reports_each_minority_rank() -> None:
    core = started(5)
    for rank in range(5):
        tensor = 2 if rank == 4 else 0
        actions = core.handle(digest(rank, 0, frozenset({1, 4}), tensor=tensor))
    reason = the_abort(actions)
    assert "ranks [1, 4] differ from the majority (ranks [0, 2, 3])" in reason
    assert "rank 1 first differs from rank 0 at tensor 'embed.w'" in reason
    assert "rank 4 first differs from rank 0 at tensor 'norm.b'" in reason


def test_diverged_digest_with_identical_tensors_says_so() -> None:
    core = started(3)
    core.handle(Digest(0, 0, b"x", (("w", b"1"),)))
    core.handle(Digest(1, 0, b"x", (("w", b"1"),)))
    reason = the_abort(core.handle(Digest(2, 0, b"y", (("w", b"1"), ("v", b"2")))))
    assert reason.endswith("rank 2 first differs from rank 0 at tensor 'v' (extra)")
    core = started(3)
    core.handle(Digest(0, 0, b"x", (("w", b"1"),)))
    core.handle(Digest(1, 0, b"x", (("w", b"1"),)))
    reason = the_abort(core.handle(Digest(2, 0, b"y", (("w", b"1"),))))
    assert reason.endswith("at no listed tensor (every per-tensor digest matches)")


@pytest.mark.parametrize("resync", [False, True])
def test_no_majority_aborts_even_with_resync(resync: bool) -> None:
    core = started(4, resync=resync)
    reason = the_abort(end_step(core, 0, bad=frozenset({2, 3})))
    assert reason.startswith(
        "step 0: parameter digests diverged with no majority: ranks [0, 1] have "
    )
    assert "rank 2 first differs from rank 0 at tensor 'layers.1.attn.w'" in reason
    assert "rank 3 first differs from rank 0" in reason
    core = started(2, resync=resync)
    reason = the_abort(end_step(core, 0, bad=frozenset({1})))
    assert "no majority" in reason and "rank 1 first differs from rank 0" in reason


def test_resync_policy_resyncs_the_minority_from_the_lowest_good_rank() -> None:
    core = started(3, resync=True)
    run_buckets(core, 0, 2)
    actions = end_step(core, 0, bad=frozenset({1}))
    assert actions == [Resync(0, 0, (1,)), Broadcast(Commit(0))]
    assert actions[0].message == ResyncOrder(0, 0, (1,))
    assert actions[0].recipients == (0, 1)
    assert core.view.step == 1 and core.view.state is RunState.RUNNING
    core = started(5, resync=True)
    actions = end_step(core, 0, bad=frozenset({0, 3}))
    assert actions == [Resync(0, 1, (0, 3)), Broadcast(Commit(0))]


def test_digest_interval() -> None:
    core = started(2, digest_interval=3)
    assert end_step(core, 0) == [Broadcast(Commit(0))]  # step 0: digests
    reason = the_abort(core.handle(digest(1, 1)))
    assert reason == (
        "rank 1 sent a digest for step 1, which is not a digest step (digest_interval 3): "
        "expected step_done"
    )
    core = started(2, digest_interval=3)
    for step in range(3):
        assert end_step(core, step) == [Broadcast(Commit(step))]
    reason = the_abort(core.handle(StepDone(0, 3)))
    assert reason == (
        "rank 0 sent step_done for step 3, which is a digest step (digest_interval 3): "
        "expected a digest"
    )


def test_step_done_commits_without_comparing_anything() -> None:
    core = started(3, digest_interval=2)
    end_step(core, 0)
    run_buckets(core, 1, 2)
    assert core.handle(StepDone(2, 1)) == []
    assert core.handle(StepDone(0, 1)) == []
    assert core.handle(StepDone(1, 1)) == [Broadcast(Commit(1))]


def test_step_end_protocol_violations() -> None:
    core = started(2)
    core.handle(digest(0, 0))
    assert the_abort(core.handle(digest(0, 0))) == "step 0: rank 0 finished the step twice"
    core = started(2)
    assert the_abort(core.handle(StepDone(1, 4))).startswith(
        "rank 1 sent step_done for step 4, but the run is at step 0"
    )


# --------------------------------------------------------------------------- finishing


def test_finished_protocol_violations() -> None:
    core = started(2)
    end_step(core, 0)
    assert the_abort(core.handle(Finished(0, 2))) == (
        "rank 0 finished the run at step 2, but the run is at step 1"
    )
    core = started(3)
    core.handle(Ready(2, 0, 0, spec(0)))
    assert the_abort(core.handle(Finished(0, 0))) == (
        "rank 0 finished the run at step 0, but ranks [2] have started step 0"
    )
    core = started(2)
    core.handle(Finished(1, 0))
    assert the_abort(core.handle(Finished(1, 0))) == "rank 1 finished the run twice"
    core = started(3)
    core.handle(Finished(1, 0))
    assert the_abort(core.handle(Ready(0, 0, 0, spec(0)))) == (
        "rank 0 sent bucket 0 ready for step 0 after ranks [1] finished the run at step 0"
    )


# --------------------------------------------------------------------------- liveness


def test_heartbeat_deadline_names_the_silent_rank() -> None:
    core = started(4, heartbeat_deadline=5.0)
    for rank in range(3):
        core.handle(Heartbeat(rank, 104.0))
    core.handle(Heartbeat(3, 100.0))
    assert core.view.last_heartbeat == {0: 104.0, 1: 104.0, 2: 104.0, 3: 100.0}
    assert core.handle(Tick(105.0)) == []
    assert the_abort(core.handle(Tick(105.2))) == (
        "rank 3 missed heartbeats for 5.2 s (deadline 5.0 s)"
    )


def test_heartbeat_deadline_names_every_silent_rank_and_counts_from_join() -> None:
    core = CoordinatorCore(3, heartbeat_deadline=2.5)
    core.handle(Joined(0, SIG, addr(0), now=10.0))
    core.handle(Joined(2, SIG, addr(2), now=11.0))
    core.handle(Heartbeat(2, 12.0))
    assert core.handle(Tick(12.5)) == []
    reason = the_abort(core.handle(Tick(20.0)))
    assert reason == (
        "rank 0 missed heartbeats for 10.0 s; rank 2 missed heartbeats for 8.0 s (deadline 2.5 s)"
    )


def test_join_without_time_counts_from_the_next_clock_reading() -> None:
    core = CoordinatorCore(2, heartbeat_deadline=1.0)
    core.handle(Joined(0, SIG, addr(0)))
    assert core.view.last_heartbeat == {0: None}
    assert core.handle(Tick(500.0)) == []
    assert core.view.last_heartbeat == {0: 500.0}
    assert core.handle(Heartbeat(0, 499.0)) == []  # out of order: never moves time back
    assert core.view.last_heartbeat == {0: 500.0}
    assert core.handle(Tick(501.0)) == []
    assert the_abort(core.handle(Tick(501.25))) == (
        "rank 0 missed heartbeats for 1.25 s (deadline 1.0 s)"
    )


def test_disconnect_and_malformed_abort_naming_the_rank() -> None:
    core = started(3)
    assert the_abort(core.handle(Disconnected(2, "connection reset"))) == (
        "rank 2 disconnected: connection reset"
    )
    core = started(3)
    error = ProtocolError("ready message: field 'step'=-1 is below 0", peer=1)
    assert the_abort(core.handle(Malformed(1, str(error)))) == (
        "rank 1 sent a malformed message: peer 1: ready message: field 'step'=-1 is below 0"
    )


def two_hosts(deadline: float = 5.0, elastic: bool = False) -> CoordinatorCore:
    """4 ranks started on two hosts, ranks 0 and 1 on 10.0.0.1, ranks 2 and 3 on 10.0.0.2."""
    kwargs: dict[str, Any] = {"min_workers": 1} if elastic else {}
    core = CoordinatorCore(4, heartbeat_deadline=deadline, **kwargs)
    for rank in range(4):
        core.handle(Joined(rank, SIG, (f"10.0.0.{1 + rank // 2}", 7000 + rank), now=0.0))
    assert core.view.state is RunState.RUNNING
    return core


def test_a_loss_on_ranks_of_two_hosts_names_the_host_and_the_ranks_it_runs() -> None:
    """A host that dies takes all its ranks: the first one lost says which host it ran on
    and which ranks run there too (torchrun --nnodes 2, one host killed)."""
    assert the_abort(two_hosts().handle(Disconnected(2, "connection reset"))) == (
        "rank 2 disconnected: connection reset; host 10.0.0.2 runs ranks 2, 3"
    )
    core = two_hosts(deadline=2.0)
    for rank in (0, 1):
        core.handle(Heartbeat(rank, 3.0))
    assert the_abort(core.handle(Tick(3.5))) == (
        "rank 2 missed heartbeats for 3.5 s; rank 3 missed heartbeats for 3.5 s (deadline "
        "2.0 s); host 10.0.0.2 runs ranks 2, 3"
    )
    actions = two_hosts(elastic=True).handle(Disconnected(0, "connection reset"))
    reports = [a.text for a in actions if isinstance(a, Report)]
    assert reports[0].endswith(
        "rank 0 disconnected: connection reset; host 10.0.0.1 runs ranks 0, 1"
    )
    # One host: the address says nothing the rank does not.
    assert the_abort(started(3).handle(Disconnected(2, "eof"))) == "rank 2 disconnected: eof"


def test_a_static_rendezvous_abort_keeps_the_joined_ranks() -> None:
    """Found by the state machine on a fresh clone: a rank leaving before the start aborts
    a static run, and the run ends with the membership it had."""
    core = CoordinatorCore(2)
    core.handle(Joined(0, SIG, ("h", 1), 0.0))
    assert the_abort(core.handle(Disconnected(0, "connection reset"))) == (
        "rank 0 disconnected: connection reset"
    )
    assert core.view.members == (0,)


def test_after_abort_everything_is_ignored() -> None:
    core = started(2)
    core.handle(Disconnected(0, "eof"))
    events: list[Event] = [
        Ready(1, 0, 0, spec(0)),
        digest(1, 0),
        StepDone(1, 0),
        Finished(1, 0),
        Heartbeat(1, 1.0),
        Tick(1e9),
        Disconnected(1, "eof"),
        Malformed(1, "x"),
        Joined(0, SIG, addr(0)),
    ]
    for event in events:
        assert core.handle(event) == []
    assert core.view.state is RunState.ABORTED
    assert core.view.abort_reason == "rank 0 disconnected: eof"
    with pytest.raises(TypeError):
        core.handle("ready")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- wire


def roundtrip(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    return decode_frame(encode_frame_bytes(kind, fields))


@pytest.mark.parametrize(
    "message",
    [
        StartRun((addr(0), addr(1)), (1, 0), 3, 2, 7.5),
        Go(2, 5, 17),
        Commit(9),
        ResyncOrder(4, 1, (0, 3)),
        Shutdown("finished"),
        AbortRun("rank 2 disconnected: eof"),
        JoinRefused("rank 2 has already joined"),
    ],
)
def test_coordinator_messages_roundtrip(message: Any) -> None:
    assert message_from_wire(roundtrip(*message.to_wire())) == message


@pytest.mark.parametrize(
    "event",
    [
        Joined(3, SIG, addr(3), now=12.5),
        Ready(3, 2, 1, spec(1)),
        Ready(3, 2, 1, "sha256:abc"),
        Ready(3, 0, 0, ()),
        digest(3, 4, frozenset({3})),
        Digest(3, 4, b"d" * 16, packed=b"a" * 32, names=("w", "v")),
        Digest(3, 4, b"d" * 16, packed=b"a" * 32),
        StepDone(3, 5),
        Heartbeat(3, 12.5),
        Finished(3, 6),
    ],
)
def test_worker_messages_roundtrip(event: Any) -> None:
    assert event_from_wire(roundtrip(*event.to_wire()), rank=3, now=12.5) == event


def test_actions_carry_their_messages() -> None:
    assert Refuse(1, "no").message.to_wire() == ("join_refused", {"reason": "no"})
    assert Abort("x" * 10_000).message.to_wire()[1]["reason"].endswith("...")
    assert len(message_from_wire(roundtrip(*Abort("y" * 10_000).message.to_wire())).reason) == 4096


def test_signature_and_spec_helpers() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].bias.requires_grad_(False)
    sig = model_signature(model.named_parameters())
    assert sig == (
        ("0.weight", (3, 4), "float32", True),
        ("0.bias", (3,), "float32", True),
        ("1.weight", (3,), "float32", True),
        ("1.bias", (3,), "float32", False),
    )
    assert bucket_spec([torch.zeros(2, 2, dtype=torch.bfloat16)]) == (((2, 2), "bfloat16"),)


def wire(kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "kind": kind, **fields}


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            wire("ready", epoch=1, step=-1, bucket=0, spec="h"),
            "peer 2: ready message: field 'step'=-1",
        ),
        (wire("ready", epoch=1, step=0, bucket=0, spec=[[[-3], "f"]]), r"'spec'\[0\] shape\[0\]"),
        (
            wire("ready", epoch=1, step=0, bucket=0, spec=[[[3]]]),
            r"'spec'\[0\] must be \[shape, dtype\]",
        ),
        (
            wire("ready", epoch=1, step=0, bucket=0, spec=""),
            "field 'spec' must be a non-empty string",
        ),
        (wire("ready", epoch=1, step=0, bucket=0), "missing field 'spec'"),
        (wire("digest", epoch=1, step=1, digest=b"x" * 65, tensors=[]), "longer than 64"),
        (
            wire("digest", epoch=1, step=1, digest=b"x", tensors=[["w", "x"]]),
            r"'tensors'\[0\] digest",
        ),
        (wire("step_done", epoch=1, step=True), "field 'step' must be int"),
        (wire("finished", epoch=1, step=0, extra=1), "unknown field 'extra'"),
        (wire("heartbeat", step=1), "unknown field 'step'"),
        (wire("join", host="h", port=0, params=[]), "field 'port'=0 is below 1"),
        (
            wire("join", host="h", port=1, params=[["w", [2], "float32", 1]]),
            r"'params'\[0\] requires_grad must be a bool",
        ),
        (wire("join", host="h", port=1, params=[["w", [2], "float32"]]), r"'params'\[0\] must be"),
        (wire("go", epoch=1, step=0, bucket=0, seq=0), "a go message is not for the coordinator"),
        (wire("nonsense"), "unknown message kind"),
        ({"kind": "ready"}, "no protocol version"),
    ],
)
def test_event_from_wire_names_the_bad_field(message: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        event_from_wire(message, rank=2, now=0.0)


def test_message_from_wire_refuses_worker_kinds_and_bad_rings() -> None:
    with pytest.raises(ProtocolError, match="does not come from the coordinator"):
        message_from_wire(wire("step_done", epoch=1, step=1))
    with pytest.raises(ProtocolError, match="not a permutation"):
        message_from_wire(
            wire(
                "start_run",
                addresses=[["h", 1], ["h", 2]],
                ring=[0, 0],
                step=0,
                digest_interval=1,
                heartbeat_deadline=1.0,
                epoch=1,
                members=[0, 1],
                donor=-1,
                receivers=[],
                broadcast=True,
                apply_barrier=False,
            )
        )
    with pytest.raises(ProtocolError, match="expected a commit message"):
        Commit.from_wire(wire("go", epoch=1, step=0, bucket=0, seq=0))


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=70),
)
_junk = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4), max_leaves=12)
_names = st.sampled_from(
    ["step", "bucket", "spec", "digest", "tensors", "host", "port", "params", "seq", "x"]
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["join", "ready", "digest", "step_done", "heartbeat", "finished", "go"]),
    fields=st.dictionaries(_names, _junk, max_size=5),
)
def test_event_from_wire_raises_only_protocol_errors(kind: str, fields: dict[str, Any]) -> None:
    try:
        event = event_from_wire(wire(kind, **fields), rank=1, now=0.0)
    except ProtocolError:
        return
    core = started(2)
    core.handle(event)  # whatever parses is an event the core takes without raising


# --------------------------------------------------------------------------- stateful model

DEADLINE = 5.0
FAULTS = ["none"] * 2 + [
    "prestart",
    "dup",
    "stale",
    "future",
    "badspec",
    "baddigest",
    "early",
    "wrongkind",
    "badsig",
    "outofrange",
    "finish",
    "newbucket",
]


class WorkerModel:
    """What one simulated worker has sent and seen."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.joined = False
        self.step: int | None = None
        self.reported: set[int] = set()
        self.done_sent = False
        self.finished_sent = False
        self.last: Event | None = None


class CoordinatorMachine(RuleBasedStateMachine):
    """Workers, mostly honest, against the core; every action is checked against the inputs."""

    @initialize(
        n=st.integers(1, 5),
        buckets=st.integers(0, 3),
        interval=st.integers(1, 3),
        resync=st.booleans(),
        total=st.integers(1, 3),
        start=st.integers(0, 2),
        diverged=st.sampled_from(
            [frozenset(), *(frozenset({r}) for r in range(4)), frozenset({1, 3})]
        ),
        diverge_at=st.integers(0, 1),
        prejoin=st.booleans(),
    )
    def setup(
        self,
        n: int,
        buckets: int,
        interval: int,
        resync: bool,
        total: int,
        start: int,
        diverged: frozenset[int],
        diverge_at: int,
        prejoin: bool,
    ) -> None:
        self.n, self.buckets, self.interval, self.resync = n, buckets, interval, resync
        self.start, self.end = start, start + total
        self.diverged, self.diverge_at = diverged, start + diverge_at  # honest but wrong digests
        self.core = CoordinatorCore(
            n,
            digest_interval=interval,
            resync=resync,
            heartbeat_deadline=DEADLINE,
            start_step=start,
        )
        self.workers = [WorkerModel(rank) for rank in range(n)]
        self.now = 0.0
        self.heard: dict[int, float] = {}
        # what the core was fed
        self.fed_ready: dict[tuple[int, int], dict[int, Any]] = defaultdict(dict)
        self.fed_end: dict[int, dict[int, bytes | None]] = defaultdict(dict)
        self.fed_finished: set[int] = set()
        # what the core did
        self.expected_step = start
        self.last_seq = -1
        self.gone: dict[int, set[int]] = defaultdict(set)
        self.started = False
        self.aborted = False
        self.finished = False
        if prejoin:  # half the runs skip the rendezvous, to spend their steps running
            for worker in self.workers:
                self.feed(Joined(worker.rank, SIG, addr(worker.rank), now=self.now))

    # ------------------------------------------------------------------- feeding and checking

    def feed(self, event: Event) -> list[Action]:
        rank = getattr(event, "rank", None)
        terminal = self.aborted or self.finished
        actions = self.core.handle(event)  # must never raise
        if terminal:
            assert actions == []
            return actions
        if not (actions and isinstance(actions[0], Refuse)):  # a refused message changes nothing
            if isinstance(event, Ready):
                self.fed_ready[(event.step, event.bucket)].setdefault(event.rank, event.spec)
            elif isinstance(event, Digest | StepDone):
                self.fed_end[event.step].setdefault(event.rank, getattr(event, "digest", None))
            elif isinstance(event, Finished):
                self.fed_finished.add(event.rank)
        if rank is not None and 0 <= rank < self.n:
            self.after_send(self.workers[rank], event, actions)
        resync: Resync | None = None
        for index, action in enumerate(actions):
            if isinstance(action, Abort | Refuse):
                assert len(actions) == 1
            if isinstance(action, Abort):
                assert action.reason
                self.aborted = True
                note(f"abort: {type(event).__name__}")
            elif isinstance(action, Refuse):
                assert action.rank == rank
            elif isinstance(action, Resync):
                resync = action
                assert index == 0 and len(actions) == 2
            elif isinstance(action, Broadcast):
                self.check_broadcast(action.message, event, resync)
            else:  # pragma: no cover - the core emits nothing else today
                raise AssertionError(f"unexpected action {action}")
        if isinstance(event, Tick):
            silent = [r for r, t in self.heard.items() if event.now - t > DEADLINE]
            assert bool(silent) == self.aborted
        return actions

    def check_broadcast(self, message: Any, event: Event, resync: Resync | None) -> None:
        n = self.n
        assert not self.aborted and not self.finished
        if isinstance(message, StartRun):
            assert not self.started and isinstance(event, Joined)
            assert all(w.joined for w in self.workers)
            assert message.addresses == tuple(addr(r) for r in range(n))
            self.started = True
            for worker in self.workers:
                worker.step = message.step
        elif isinstance(message, Go):
            assert self.started
            assert message.seq > self.last_seq
            self.last_seq = message.seq
            # no Go before the previous step's commit, none for a committed step
            assert message.step == self.expected_step
            reports = self.fed_ready[(message.step, message.bucket)]
            assert set(reports) == set(range(n))
            assert len({reports[r] for r in range(n)}) == 1
            assert message.bucket not in self.gone[message.step]
            self.gone[message.step].add(message.bucket)
        elif isinstance(message, Commit):
            step = message.step
            assert step == self.expected_step
            ends = self.fed_end[step]
            assert set(ends) == set(range(n))  # every member reported the step's end
            readied = {b for (s, b) in self.fed_ready if s == step}
            assert readied <= self.gone[step]
            if step % self.interval == 0:
                counts = Counter(ends.values())
                if resync is None:
                    assert len(counts) == 1
                else:
                    assert self.resync and resync.step == step
                    top, votes = counts.most_common(1)[0]
                    assert votes * 2 > n
                    good = sorted(r for r, d in ends.items() if d == top)
                    assert resync.source_rank == good[0]
                    assert set(resync.targets) == set(range(n)) - set(good)
            else:
                assert resync is None and set(ends.values()) == {None}
            self.expected_step += 1
            note("resync" if resync else "commit")
            for worker in self.workers:
                if worker.step == step:
                    worker.step = step + 1
                    worker.reported = set()
                    worker.done_sent = False
        elif isinstance(message, Shutdown):
            assert self.fed_finished >= set(range(n))
            assert message.reason == "finished"
            self.finished = True
            note("shutdown")
        else:  # pragma: no cover
            raise AssertionError(f"unexpected broadcast {message}")

    def after_send(self, worker: WorkerModel, event: Event, actions: list[Action]) -> None:
        worker.last = event
        if isinstance(event, Joined) and not any(isinstance(a, Refuse | Abort) for a in actions):
            worker.joined = True
            self.heard[worker.rank] = self.now
        if isinstance(event, Heartbeat) and worker.joined:
            self.heard[worker.rank] = max(self.heard[worker.rank], event.now)
        if worker.step is None or getattr(event, "step", None) != worker.step:
            return
        if isinstance(event, Ready):
            worker.reported.add(event.bucket)
        elif isinstance(event, Digest | StepDone):
            worker.done_sent = True
        elif isinstance(event, Finished):
            worker.finished_sent = True

    # ------------------------------------------------------------------- worker behaviour

    def end_message(self, rank: int, step: int, good: bool = True) -> Event:
        if step % self.interval:
            return StepDone(rank, step)
        good = good and not (rank in self.diverged and step == self.diverge_at)
        return digest(rank, step, frozenset() if good else frozenset({rank}), tensor=rank % 3)

    def order(self, worker: WorkerModel) -> list[int]:
        shift = worker.rank + (worker.step or 0)
        return [(i + shift) % self.buckets for i in range(self.buckets)] if self.buckets else []

    def honest(self, worker: WorkerModel) -> Event | None:
        rank = worker.rank
        if not worker.joined:
            return Joined(rank, SIG, addr(rank), now=self.now)
        step = worker.step
        if step is None or worker.finished_sent:
            return None
        if step >= self.end and not worker.reported and not worker.done_sent:
            return Finished(rank, step)
        for bucket in self.order(worker):
            if bucket not in worker.reported:
                return Ready(rank, step, bucket, spec(bucket))
        if worker.reported <= self.gone[step] and not worker.done_sent:
            return self.end_message(rank, step)
        return None

    def faulty(self, worker: WorkerModel, fault: str) -> Event | None:
        rank = worker.rank
        if worker.step is None and fault not in ("badsig", "outofrange", "dup", "prestart"):
            return self.honest(worker)  # run-phase faults wait for the run
        step = self.start if worker.step is None else worker.step
        todo = [b for b in self.order(worker) if b not in worker.reported] or [0]
        if fault == "dup":
            return worker.last
        if fault == "prestart":
            return Ready(rank, step, 0, spec(0))
        if fault == "stale":
            return self.end_message(rank, step - 1) if step else Ready(rank, step, 0, spec(0))
        if fault == "future":  # step + 1 is held until the commit (early ready); +2 is wrong
            return Ready(rank, step + 2, todo[0], spec(todo[0]))
        if fault == "badspec":
            return Ready(rank, step, todo[0], (((99,), "float16"),))
        if fault == "newbucket":
            return Ready(rank, step, self.buckets + 1, spec(self.buckets + 1))
        if fault == "baddigest":
            honest = self.honest(worker)
            if isinstance(honest, Digest):
                return self.end_message(rank, step, good=False)
            return honest
        if fault == "early":
            return self.end_message(rank, step)
        if fault == "wrongkind":
            if step % self.interval:
                return digest(rank, step)
            return StepDone(rank, step)
        if fault == "badsig":
            return Joined(rank, SIG[:2], addr(rank), now=self.now)
        if fault == "outofrange":
            return Ready(self.n, step, 0, spec(0))
        if fault == "finish":
            return Finished(rank, step)
        return self.honest(worker)

    # ------------------------------------------------------------------- rules

    @rule(index=st.integers(0, 4), fault=st.sampled_from(FAULTS))
    def act(self, index: int, fault: str) -> None:
        worker = self.workers[index % self.n]
        running = worker.step is not None and not (self.aborted or self.finished)
        event = self.faulty(worker, fault)
        if event is None:
            return
        actions = self.feed(event)
        # inconsistencies visible in this one message are refused at once, never waited on
        certain = fault in ("future", "wrongkind") or (fault == "stale" and bool(worker.step))
        if running and certain:
            note(f"certain {fault}")
            assert len(actions) == 1 and isinstance(actions[0], Abort), (event, actions)
            assert f"rank {worker.rank}" in actions[0].reason

    @rule(reverse=st.booleans(), rounds=st.integers(1, 4))
    def honest_rounds(self, reverse: bool, rounds: int) -> None:
        """Every worker sends its next honest message, ``rounds`` times (no time passes)."""
        for _ in range(rounds):
            for worker in reversed(self.workers) if reverse else self.workers:
                event = self.honest(worker)
                if event is not None:
                    self.feed(event)

    @rule(index=st.integers(0, 4), dt=st.floats(0, 1))
    def heartbeat(self, index: int, dt: float) -> None:
        self.now += dt
        self.feed(Heartbeat(index % self.n, self.now))

    @rule(dt=st.floats(0, 1))
    def heartbeat_all(self, dt: float) -> None:
        self.now += dt
        for worker in self.workers:
            self.feed(Heartbeat(worker.rank, self.now))

    @rule(dt=st.one_of(st.floats(0, 2), st.floats(0, 2), st.floats(0, 1.5 * DEADLINE)))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))

    @rule(
        index=st.integers(0, 5),
        kind=st.sampled_from(["disconnect", "malformed"]),
        roll=st.integers(0, 3),
    )
    def chaos(self, index: int, kind: str, roll: int) -> None:
        if roll:
            return
        rank = index % (self.n + 1)  # sometimes a rank that is not a member
        if kind == "disconnect":
            actions = self.feed(Disconnected(rank, "connection reset"))
        else:
            actions = self.feed(Malformed(rank, "malformed CBOR"))
        joined = rank < self.n and self.workers[rank].joined
        if actions and isinstance(actions[0], Abort):
            assert joined and f"rank {rank}" in actions[0].reason

    # ------------------------------------------------------------------- invariants

    @invariant()
    def core_agrees(self) -> None:
        if not hasattr(self, "core"):
            return
        assert self.core.view.step == self.expected_step
        assert self.core.view.seq == self.last_seq + 1
        if self.aborted:
            assert self.core.view.state is RunState.ABORTED and self.core.view.abort_reason
        elif self.finished:
            assert self.core.view.state is RunState.FINISHED
        elif self.started:
            assert self.core.view.state is RunState.RUNNING
        else:
            assert self.core.view.state is RunState.RENDEZVOUS
        assert self.core.view.members == tuple(w.rank for w in self.workers if w.joined)


CoordinatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestCoordinatorMachine = CoordinatorMachine.TestCase


def test_a_cached_report_may_carry_the_agreed_specs_hash() -> None:
    """Workers send `spec_hash` of the agreed spec in cached reports (one string, not every
    shape); it is checked like the spec, peers sending either form agree, and a hash of any
    other spec names the rank."""
    assert spec_hash(spec(0)) == spec_hash([[list(shape), dtype] for shape, dtype in spec(0)])
    assert spec_hash(spec(0)) != spec_hash(spec(1))
    assert spec_hash("xxh3:abc") == "xxh3:abc"
    core = started(3)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    assert core.handle(cached(0, 1, 0, spec_hash(spec(0)))) == []
    assert core.handle(cached(1, 1, 0)) == []
    assert core.handle(cached(2, 1, 0, spec_hash(spec(0)))) == []
    assert core.view.pending_buckets == {}
    assert end_step(core, 1) == [Broadcast(Commit(1))]
    wrong = spec_hash((((1, 4), "float16"), ((3,), "float32")))
    reason = the_abort(core.handle(cached(1, 2, 0, wrong)))
    assert reason == (
        f"step 2 bucket 0: rank 1 reduced shapes spec {wrong!r} without a go, but the members "
        "agreed on [(1, 4), float32; (3,), float32] in epoch 1"
    )


# --------------------------------------------------------------------------- packed digests


def packed(rank: int, step: int, bad: frozenset[int] = frozenset(), *, named: bool) -> Digest:
    """``digest`` in the packed form workers send: names only when ``named``."""
    plain = digest(rank, step, bad)
    values = [value.ljust(16, b".") for _, value in plain.tensor_digests]
    return Digest(
        rank, step, plain.digest, packed=b"".join(values), names=TENSORS if named else None
    )


def test_packed_digests_list_their_names_once_an_epoch() -> None:
    """The first digest lists the tensor names; later ones reuse them, and a divergence is
    still named by its tensor."""
    core = started(3)
    assert [a for r in range(3) for a in core.handle(packed(r, 0, named=True))] == [
        Broadcast(Commit(0))
    ]
    for step in (1, 2):
        for rank in range(3):
            actions = core.handle(packed(rank, step, named=False))
        assert actions == [Broadcast(Commit(step))]
    for rank in range(3):
        actions = core.handle(packed(rank, 3, frozenset({1}), named=False))
    assert the_abort(actions) == (
        "step 3: parameter digests diverged: ranks [1] differ from the majority (ranks [0, 2]); "
        "rank 1 first differs from rank 0 at tensor 'layers.1.attn.w'"
    )


def test_packed_digests_without_names_or_that_do_not_fit_name_the_rank() -> None:
    core = started(2)
    assert the_abort(core.handle(packed(1, 0, named=False))) == (
        "step 0: rank 1 sent packed per-tensor digests without their names, and listed none "
        "before in epoch 1"
    )
    core = started(2)
    core.handle(packed(0, 0, named=True))
    core.handle(packed(1, 0, named=True))
    short = Digest(1, 1, b"good-1", packed=b"x" * 47)
    core.handle(packed(0, 1, named=False))
    assert the_abort(core.handle(short)) == (
        "step 1: rank 1 sent 47 bytes of per-tensor digests for the 3 tensors it listed"
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tensors": b"x" * 10, "names": ["a", "b", "c"]}, "holds 10 bytes, which are not 3"),
        ({"tensors": b"x" * 130, "names": ["a", "b"]}, "not 2 equal digests of 1 to 64"),
        ({"tensors": [], "names": ["a"]}, "'names' comes only with packed 'tensors'"),
        ({"tensors": b"", "names": [""]}, r"'names'\[0\]"),
    ],
)
def test_packed_digest_fields_are_checked(fields: dict[str, Any], match: str) -> None:
    message = {
        "v": PROTOCOL_VERSION,
        "kind": "digest",
        "epoch": 1,
        "step": 0,
        "digest": b"d",
        **fields,
    }
    with pytest.raises(ProtocolError, match=match):
        event_from_wire(message, rank=1, now=0.0)


def test_a_plain_report_beside_cached_ones_keeps_the_agreement_whole() -> None:
    """A worker without the response cache reports every bucket in full and waits for its go,
    while its peers report the agreed spec's hash: the go must not replace the agreement with
    a peer's hash, or the next step's full report would look like a different layout."""
    core = started(3)
    run_buckets(core, 0, 1)
    end_step(core, 0)
    for step in (1, 2):
        assert core.handle(cached(0, step, 0, spec_hash(spec(0)))) == []
        assert core.handle(Ready(1, step, 0, spec(0))) == []
        actions = core.handle(cached(2, step, 0, spec_hash(spec(0))))
        assert [type(a.message).__name__ for a in actions if isinstance(a, Broadcast)] == ["Go"]
        assert end_step(core, step) == [Broadcast(Commit(step))]


# --------------------------------------------------------------------------- folded reports


def folding(n: int, offers: tuple[bool, ...] | None = None) -> tuple[CoordinatorCore, StartRun]:
    """A started run whose ranks joined offering to fold (or as ``offers`` says)."""
    core = CoordinatorCore(n, heartbeat_deadline=5.0)
    offers = offers or (True,) * n
    for rank in range(n):
        actions = core.handle(Joined(rank, SIG, addr(rank), now=0.0, fold=offers[rank]))
    start = actions[0].message
    assert isinstance(start, StartRun)
    return core, start


def folded(rank: int, step: int, agreement: str) -> Digest:
    """``digest(rank, step)`` saying every bucket was reduced from the cache under
    ``agreement``."""
    plain = digest(rank, step)
    return Digest(rank, step, plain.digest, plain.tensor_digests, cached=agreement)


def test_folding_members_report_cached_buckets_in_their_step_report() -> None:
    """Once every bucket is agreed, a folding rank sends no ready: its digest says which
    agreement it reduced under, which the core checks and counts as each bucket's report."""
    core, start = folding(3)
    assert start.fold and StartRun.from_wire(roundtrip(*start.to_wire())) == start
    run_buckets(core, 0, 2)
    assert end_step(core, 0) == [Broadcast(Commit(0))]
    agreement = agreement_hash({0: spec_hash(spec(0)), 1: spec_hash(spec(1))})
    for step in (1, 2):
        actions = [a for rank in range(3) for a in core.handle(folded(rank, step, agreement))]
        assert actions == [Broadcast(Commit(step))]
    assert core.view.seq == 2  # step 0's gos only
    done = StepDone(1, 3, cached=agreement)
    assert event_from_wire(roundtrip(*done.to_wire()), rank=1, now=0.0) == done


def test_a_folded_report_under_another_agreement_names_the_rank() -> None:
    core, _ = folding(2)
    run_buckets(core, 0, 2)
    end_step(core, 0)
    only_one = agreement_hash({0: spec_hash(spec(0))})
    reason = the_abort(core.handle(folded(1, 1, only_one)))
    assert reason.startswith(
        f"step 1: rank 1 reduced its buckets from the response cache under agreement {only_one}, "
        "but the members agreed on xxh3:"
    )


def test_folding_needs_every_member_to_offer_it() -> None:
    core, start = folding(2, (True, False))
    assert not start.fold and "fold" not in start.to_wire()[1]
    run_buckets(core, 0, 1)
    end_step(core, 0)
    reason = the_abort(core.handle(folded(0, 1, agreement_hash({0: spec_hash(spec(0))}))))
    assert reason == (
        "step 1: rank 0 folded its bucket reports into its step report, but not every member "
        "of epoch 1 joined offering to fold"
    )
