"""One family for every replica divergence: `paramsync.runtime.errors.StateDiverged`, with the step,
the ranks grouped by state and the first differing tensor, whoever found it (the coordinator's
verdict as a worker receives it, a shard's dp group in band, the replicas of one process)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync import runtime
from paramsync.actors.client.client import RunAborted, RunDiverged, run_aborted
from paramsync.actors.multidevice import ReplicaDivergedError
from paramsync.actors.parallel.replica_check import ShardReplicasDiverged
from paramsync.runtime.coordinator.commits import (
    TensorNames,
    digest_verdict,
    divergence_of,
    sharded_verdict,
)
from paramsync.runtime.coordinator.layouts import Shards
from paramsync.runtime.errors import ParamsyncError, StateDiverged
from paramsync.runtime.protocol.messages import Digest

NAMES = ("param/w", "param/b", "optim/0.w/exp_avg", 'it\'s "quoted"')


def reports_for(states: list[int], differ_at: list[int], step: int) -> dict[int, Digest]:
    """Rank r holds state ``states[r]``; a rank outside state 0 differs first at its tensor
    ``differ_at[r]``."""
    out = {}
    for rank, state in enumerate(states):
        tensors = tuple(
            (name, b"%d-%d" % (index, 0 if state == 0 or index < differ_at[rank] else state))
            for index, name in enumerate(NAMES)
        )
        out[rank] = Digest(rank, step, b"state-%d" % state, tensors)
    return out


@settings(max_examples=200, deadline=None)
@given(
    states=st.lists(st.integers(0, 3), min_size=2, max_size=9),
    data=st.data(),
    step=st.integers(0, 10**6),
)
def test_every_verdict_reads_back_as_its_step_groups_and_tensor(
    states: list[int], data: st.DataObject, step: int
) -> None:
    differ_at = data.draw(st.lists(st.integers(0, len(NAMES) - 1), min_size=len(states)))
    differ_at += [0] * (len(states) - len(differ_at))
    reports = reports_for(states, differ_at, step)
    verdict = digest_verdict(step, reports, len(states), TensorNames(), resync=False)
    if len(set(states)) == 1:
        assert verdict.abort is None
        return
    assert verdict.abort is not None
    read = divergence_of(f"coordinator stopped the run: {verdict.abort}")
    assert read is not None, verdict.abort
    read_step, groups, first_tensor = read
    assert read_step == step
    assert sorted(rank for group in groups for rank in group) == list(range(len(states)))
    reference = groups[0]  # one state, which no other rank holds
    assert len({states[rank] for rank in reference}) == 1
    assert all(states[rank] != states[reference[0]] for group in groups[1:] for rank in group)
    if "no majority" in verdict.abort:  # every group is one state of its own
        assert all(len({states[rank] for rank in group}) == 1 for group in groups)
        assert len({states[group[0]] for group in groups}) == len(groups)
    else:  # the majority, then every rank outside it
        assert len(groups) == 2 and len(reference) * 2 > len(states)
    # The tensor is where the first rank named against the reference first differs.
    first_other = min(rank for group in groups[1:] for rank in group)
    if states[reference[0]] == 0:
        assert first_tensor == NAMES[differ_at[first_other]]
    else:
        assert first_tensor in NAMES


def test_a_sharded_verdict_reads_back_as_its_first_shard() -> None:
    shards = Shards(("tp", "dp"), (2, 2))  # shards: ranks {0, 1} (tp=0) and {2, 3} (tp=1)
    states = [0, 1, 0, 0]
    reports = reports_for(states, [0, 1, 0, 0], 7)
    verdict = sharded_verdict(7, reports, shards, TensorNames(), resync=False)
    assert verdict.abort is not None
    assert divergence_of(verdict.abort) == (7, [[0], [1]], "param/b")


@pytest.mark.parametrize(
    "reason",
    [
        "rank 1 sent a ready for step 3 while step 2 was in flight",
        "the run cannot start: ranks [0] and [1] disagree on the schedule digest",
        "step 4: rank 2 has no digest",
        "",
    ],
)
def test_other_aborts_are_plain_run_aborted(reason: str) -> None:
    assert divergence_of(reason) is None
    error = run_aborted(reason)
    assert type(error) is RunAborted and str(error) == reason
    assert not isinstance(error, StateDiverged)


def test_a_diverged_abort_is_run_aborted_and_state_diverged() -> None:
    reason = (
        "coordinator stopped the run: step 2: parameter digests diverged: ranks [1] differ "
        "from the majority (ranks [0, 2]); rank 1 first differs from rank 0 at tensor "
        "'param/2.bias'"
    )
    error = run_aborted(reason)
    assert isinstance(error, RunDiverged)
    assert isinstance(error, RunAborted) and isinstance(error, StateDiverged)
    assert isinstance(error, ParamsyncError) and str(error) == reason
    assert (error.step, error.ranks, error.first_tensor) == (2, [[0, 2], [1]], "param/2.bias")
    assert error.diverged_ranks == [1]
    with pytest.raises(StateDiverged):
        raise error


def test_every_divergence_is_one_family() -> None:
    replica = ReplicaDivergedError(3, 2, "cpu", "param/4.weight")
    assert isinstance(replica, StateDiverged) and isinstance(replica, RuntimeError)
    assert (replica.step, replica.ranks, replica.first_tensor) == (3, [[0], [2]], "param/4.weight")
    assert (replica.replica, replica.device, replica.entry) == (2, "cpu", "param/4.weight")
    assert "replica 2 on cpu diverged from replica 0 after step 3" in str(replica)
    shard = ShardReplicasDiverged("shard diverged", tp=1, pp=0, step=2, ranks=[[1], [3]])
    assert isinstance(shard, StateDiverged) and isinstance(shard, RuntimeError)
    assert (shard.tp, shard.pp, shard.step, shard.ranks) == (1, 0, 2, [[1], [3]])
    assert shard.first_tensor is None and shard.diverged_ranks == [3]
    assert issubclass(StateDiverged, ParamsyncError)
    assert runtime.StateDiverged is StateDiverged
