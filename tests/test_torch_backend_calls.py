"""The pure parts of the torch.distributed backend: how a call is described, how the
coordinator's response cache takes a call agreed at another place (``cache_by_spec``), and
how a worker decides a call may run at once (`WorkerProtocol.may_cache`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_coordinator_core import started, the_abort
from test_worker_protocol import joined

from paramsync.actors.client.events import Received, ReportReady
from paramsync.actors.client.protocol import LocalProtocolError, WorkerProtocol
from paramsync.actors.torch_backend.calls import Call, UnsupportedCall, reduce_op_name
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Broadcast, Report, Tick, spec_hash
from paramsync.runtime.coordinator.negotiation import spec_groups
from paramsync.runtime.protocol.messages import BucketSpec, Go, Ready


def test_a_call_is_its_operation_then_its_tensors() -> None:
    call = Call.of("allreduce", [torch.ones(2, 3), torch.zeros(4, dtype=torch.int64)], "sum")
    assert call.spec() == (((), "call:allreduce(sum)"), ((2, 3), "float32"), ((4,), "int64"))
    assert str(call) == "allreduce(sum) of [[2, 3] float32, [4] int64]"


def test_reports_of_different_calls_name_both() -> None:
    ours = Call.of("allreduce", [torch.ones(4)], "sum").spec()
    theirs = Call.of("broadcast", [torch.ones(4)], "root 0").spec()
    assert spec_groups({0: ours, 1: theirs, 2: ours}) == (
        "ranks [0, 2] report 'allreduce(sum)' of [(4,), float32], "
        "ranks [1] report 'broadcast(root 0)' of [(4,), float32]"
    )


def test_reduce_ops_by_torch_name() -> None:
    assert reduce_op_name(dist.ReduceOp.MAX) == "max"
    assert reduce_op_name(dist.ReduceOp.BXOR) == "bxor"
    with pytest.raises(UnsupportedCall, match="PREMUL_SUM is not supported"):
        reduce_op_name(dist.ReduceOp.PREMUL_SUM)


CALL_A = Call.of("allreduce", [torch.ones(4)], "sum").spec()
CALL_B = Call.of("broadcast", [torch.ones(4)], "root 0").spec()


def _agree(core: CoordinatorCore, bucket: int, spec: BucketSpec) -> None:
    assert core.handle(Ready(0, 0, bucket, spec)) == []
    assert core.handle(Ready(1, 0, bucket, spec)) == [Broadcast(Go(0, bucket, bucket))]


def test_a_call_agreed_elsewhere_runs_cached_when_the_coordinator_caches_by_spec() -> None:
    core = started(2, cache_by_spec=True)
    _agree(core, 0, CALL_A)
    _agree(core, 1, CALL_B)
    # Bucket 2 was never agreed, but both calls were: the ranks run them at once ...
    assert core.handle(Ready(0, 0, 2, spec_hash(CALL_A), cached=True)) == []
    assert core.handle(Ready(1, 0, 2, spec_hash(CALL_A), cached=True)) == []
    # ... and ranks that start different agreed calls are stopped, both named.
    assert core.handle(Ready(0, 0, 3, spec_hash(CALL_A), cached=True)) == []
    reason = the_abort(core.handle(Ready(1, 0, 3, spec_hash(CALL_B), cached=True)))
    assert reason == (
        "step 0 bucket 3: ranks [0] report 'allreduce(sum)' of [(4,), float32], "
        "ranks [1] report 'broadcast(root 0)' of [(4,), float32]"
    )


def test_a_call_never_agreed_cannot_run_cached() -> None:
    core = started(2, cache_by_spec=True)
    _agree(core, 0, CALL_A)
    reason = the_abort(core.handle(Ready(0, 0, 1, spec_hash(CALL_B), cached=True)))
    assert "agreed on no spec for bucket 1" in reason


def test_a_trainer_coordinator_keeps_the_per_bucket_rule() -> None:
    core = started(2)
    _agree(core, 0, CALL_A)
    reason = the_abort(core.handle(Ready(0, 0, 1, spec_hash(CALL_A), cached=True)))
    assert "agreed on no spec for bucket 1" in reason


def test_a_worker_caches_a_call_agreed_elsewhere_only_when_told() -> None:
    for by_spec in (False, True):
        protocol: WorkerProtocol = joined()
        protocol.cache_by_spec = by_spec
        protocol.handle(ReportReady(0, 0, CALL_A, 1))
        protocol.handle(Received(Go(0, 0, 0, 1)))
        assert protocol.may_cache(0, spec_hash(CALL_A), 1)
        assert protocol.may_cache(1, spec_hash(CALL_A), 1) is by_spec
        assert not protocol.may_cache(1, spec_hash(CALL_B), 1)
        if by_spec:
            protocol.handle(ReportReady(0, 1, spec_hash(CALL_A), 1, cached=True))
        else:
            with pytest.raises(LocalProtocolError, match="agreed on no spec for it"):
                protocol.handle(ReportReady(0, 1, spec_hash(CALL_A), 1, cached=True))


def test_a_call_some_ranks_never_make_is_named_with_them_at_the_timeout() -> None:
    """torch's test_barrier_timeout_*: only rank 0 calls barrier(); at the group's timeout
    (the coordinator's stall deadline) the run stops naming the call, the ranks that did not
    call it and those waiting in it, with the word torch's test looks for."""
    core = started(
        3,
        cache_by_spec=True,
        idle_stalls=False,
        stall_seconds=1.0,
        stall_deadline=2.0,
        heartbeat_deadline=100.0,
    )
    assert core.handle(Ready(0, 0, 0, Call("barrier", "", ()).spec())) == []
    core.handle(Tick(0.5))
    (report,) = core.handle(Tick(1.6))
    assert report == Report(
        "stall: barrier() (step 0, call 0): ranks [0] have waited 1.1 s for ranks [1, 2], "
        "which have not called it"
    )
    reason = the_abort(core.handle(Tick(2.7)))
    assert reason == (
        "barrier() (step 0, call 0): ranks [1, 2] did not call it within the timeout of 2.0 s "
        "(ranks [0] waited in it)"
    )
