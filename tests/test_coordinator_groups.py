"""The coordinator knows the process groups: declarations at the join, each rank's groups at the
start, and per-group bucket negotiation (paramsync.runtime.coordinator.group_decl,
group_negotiation)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
from conftest import open_group, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.actors.client.events import EnterEpoch, Join, Received, ReportReady, RunGo
from paramsync.actors.client.events import Send as WorkerSend
from paramsync.actors.client.protocol import LocalProtocolError, WorkerProtocol
from paramsync.runtime.collectives.groups import derive_group_name
from paramsync.runtime.collectives.mesh import init_device_mesh, mesh_groups
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Abort, Action, Broadcast, Refuse, Send
from paramsync.runtime.coordinator.group_decl import declaration_of
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import Digest, Go, Joined, Ready, StartRun, decode_message
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION
from paramsync.runtime.transport.base import Transport

SIG = (("w", (4, 2), "float32", True),)


def addr(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 7000 + rank)


def spec(bucket: int, width: int = 4) -> tuple[tuple[tuple[int, ...], str], ...]:
    return (((bucket + 1, width), "float32"),)


def join(rank: int, **kwargs: Any) -> Joined:
    return Joined(rank, SIG, addr(rank), now=0.0, **kwargs)


PAIRS = (("a", (0, 1)), ("b", (2, 3)))


def started(n: int, **declaration: Any) -> tuple[CoordinatorCore, list[Action]]:
    core = CoordinatorCore(n, heartbeat_deadline=5.0)
    actions: list[Action] = []
    for rank in range(n):
        actions = core.handle(join(rank, **declaration))
    assert core.view.state is RunState.RUNNING, actions
    return core, actions


def sends(actions: list[Action]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for action in actions:
        assert isinstance(action, Send), action
        out.setdefault(action.rank, []).append(action.message)
    return out


# --------------------------------------------------------------------------- declarations


def test_a_mesh_declares_its_groups_under_the_names_new_group_gives_them() -> None:
    async def main() -> None:
        async with open_group("inproc", 4) as world:

            async def rank_fn(transport: Transport) -> dict[str, tuple[str, tuple[int, ...]]]:
                mesh = await init_device_mesh(transport, ("dp", "tp"), (2, 2))
                async with mesh:
                    return {
                        dim: (mesh.group(dim).name, mesh.group(dim).world_ranks)
                        for dim in ("dp", "tp")
                    }

            by_rank = await run_ranks(world, rank_fn)
        declared = declaration_of(join(0, mesh=(("dp", "tp"), (2, 2))), 4)
        assert not isinstance(declared, str)
        for groups in by_rank:
            for name, ranks in groups.values():
                assert (name, tuple(ranks)) in declared

    trio.run(main)


def test_mesh_groups_are_named_in_creation_order() -> None:
    declared = declaration_of(join(0, mesh=(("pp", "dp"), (2, 3))), 6)
    assert not isinstance(declared, str)
    order = [tuple(g) for dim in ("pp", "dp") for g in mesh_groups((2, 3), ("pp", "dp"), dim)]
    assert [ranks for _, ranks in declared] == order
    assert [name for name, _ in declared] == [
        derive_group_name("world", i, ranks) for i, ranks in enumerate(order)
    ]


@pytest.mark.parametrize(
    ("declaration", "problem"),
    [
        ({"mesh": (("dp", "tp"), (2, 3))}, "holding 6 ranks, but the world has 4"),
        ({"groups": (("a", (0, 4)),)}, "group 'a' with ranks [4] outside the world of 4"),
        ({"groups": (("a", (1, 1)),)}, "group 'a' listing a rank twice"),
        ({"groups": (("a", (0,)), ("a", (1,)))}, "group 'a' twice"),
        ({"groups": (("a", ()),)}, "group 'a' with no ranks"),
        ({"mesh": (("dp",), (4,)), "groups": PAIRS}, "both as a mesh and as a list"),
        ({"mesh": (("dp", "dp"), (2, 2))}, "invalid mesh"),
    ],
)
def test_an_invalid_declaration_is_refused_with_the_problem(
    declaration: dict[str, Any], problem: str
) -> None:
    core = CoordinatorCore(4)
    [refusal] = core.handle(join(2, **declaration))
    assert isinstance(refusal, Refuse) and refusal.rank == 2
    assert problem in refusal.reason and "rank 2" in refusal.reason


def test_a_join_declaring_other_groups_is_refused_naming_group_rank_and_both() -> None:
    core = CoordinatorCore(4)
    assert core.handle(join(0, groups=PAIRS)) == []
    other = (("a", (0, 1)), ("b", (1, 3)))
    [refusal] = core.handle(join(1, groups=other))
    assert isinstance(refusal, Refuse)
    assert "rank 1 declares other process groups than rank 0" in refusal.reason
    assert "group 'b' has ranks [1, 3], not [2, 3]" in refusal.reason
    assert "{a: [0, 1], b: [1, 3]}" in refusal.reason and "{a: [0, 1], b: [2, 3]}" in refusal.reason
    [refusal] = core.handle(join(2))
    assert isinstance(refusal, Refuse) and "rank 2 declares no groups" in refusal.reason


def test_without_groups_the_start_is_one_broadcast_as_before() -> None:
    _, actions = started(2)
    [start] = actions
    assert isinstance(start, Broadcast) and isinstance(start.message, StartRun)
    assert start.message.groups == ()
    assert "groups" not in start.message.to_wire()[1]


def test_each_rank_starts_with_its_groups_and_their_addresses() -> None:
    _, actions = started(4, groups=PAIRS)
    starts = sends(actions)
    assert sorted(starts) == [0, 1, 2, 3]
    for rank, [start] in starts.items():
        assert isinstance(start, StartRun) and start.members == (0, 1, 2, 3)
        name, ranks = PAIRS[rank // 2]
        assert start.groups == ((name, ranks, tuple(addr(r) for r in ranks)),)
        assert (
            decode_message(start.to_wire()[1] | {"kind": "start_run", "v": PROTOCOL_VERSION})
            == start
        )


# --------------------------------------------------------------------------- negotiation


def test_a_group_go_needs_only_that_groups_members_and_goes_to_them() -> None:
    core, _ = started(4, groups=PAIRS)
    assert core.handle(Ready(0, 0, 5, spec(5), group="a")) == []
    actions = core.handle(Ready(1, 0, 5, spec(5), group="a"))
    assert sends(actions) == {0: [Go(0, 5, 0, 1, "a")], 1: [Go(0, 5, 0, 1, "a")]}
    assert core.view.group_seq("a") == 1 and core.view.group_seq("b") == 0 and core.view.seq == 0


def test_two_groups_interleave_independently() -> None:
    core, _ = started(4, groups=PAIRS)
    got: dict[int, list[Go]] = {r: [] for r in range(4)}
    order = [(0, "a", 1), (2, "b", 7), (3, "b", 7), (1, "a", 1), (3, "b", 8), (2, "b", 8)]
    for rank, group, bucket in order:
        for r, messages in sends(
            core.handle(Ready(rank, 0, bucket, spec(bucket), group=group))
        ).items():
            got[r] += messages
    assert got[2] == got[3] == [Go(0, 7, 0, 1, "b"), Go(0, 8, 1, 1, "b")]
    assert got[0] == got[1] == [Go(0, 1, 0, 1, "a")]


def test_a_mismatch_aborts_naming_the_group_and_the_ranks() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(2, 0, 3, spec(3), group="b"))
    [abort] = core.handle(Ready(3, 0, 3, spec(3, width=9), group="b"))
    assert isinstance(abort, Abort)
    assert abort.reason.startswith("group 'b' step 0 bucket 3: ranks [2] report shapes")
    assert "ranks [3] report" in abort.reason


def test_specs_are_compared_within_the_group_only() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(0, 0, 3, spec(3), group="a"))
    core.handle(Ready(1, 0, 3, spec(3), group="a"))
    core.handle(Ready(2, 0, 3, spec(3, width=9), group="b"))
    assert sends(core.handle(Ready(3, 0, 3, spec(3, width=9), group="b")))[2][0].group == "b"
    assert core.view.state is RunState.RUNNING


def test_the_response_cache_is_per_group() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(0, 0, 3, spec(3), group="a"))
    core.handle(Ready(1, 0, 3, spec(3), group="a"))
    # Group a agreed on bucket 3: a cached report of it is taken for a later step...
    for rank in range(4):
        core.handle(_step_done(rank))
    assert core.view.step == 1
    assert core.handle(Ready(0, 1, 3, spec(3), cached=True, group="a")) == []
    assert core.handle(Ready(1, 1, 3, spec(3), cached=True, group="a")) == []  # no go: cached
    # ...but group b agreed on nothing: its cached report is a fault.
    [abort] = core.handle(Ready(2, 1, 3, spec(3), cached=True, group="b"))
    assert isinstance(abort, Abort)
    assert "group 'b' without a go, but the group agreed on no spec" in abort.reason


def test_a_cached_report_must_match_the_groups_agreement() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(0, 0, 3, spec(3), group="a"))
    core.handle(Ready(1, 0, 3, spec(3), group="a"))
    for rank in range(4):
        core.handle(_step_done(rank))
    [abort] = core.handle(Ready(1, 1, 3, spec(3, width=2), cached=True, group="a"))
    assert isinstance(abort, Abort) and "rank 1 reduced it in group 'a'" in abort.reason


@pytest.mark.parametrize(
    ("ready", "problem"),
    [
        (Ready(0, 0, 1, spec(1), group="z"), "group 'z', which no join declared"),
        (Ready(0, 0, 1, spec(1), group="b"), "whose members in epoch 1 are ranks [2, 3]"),
        (Ready(0, 4, 1, spec(1), group="a"), "ready for step 4, but the run is at step 0"),
    ],
)
def test_bad_group_reports_are_faults_naming_rank_and_group(ready: Ready, problem: str) -> None:
    core, _ = started(4, groups=PAIRS)
    [abort] = core.handle(ready)
    assert isinstance(abort, Abort) and problem in abort.reason


def test_a_group_report_twice_is_a_fault() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(0, 0, 1, spec(1), group="a"))
    [abort] = core.handle(Ready(0, 0, 1, spec(1), group="a"))
    assert isinstance(abort, Abort) and "reported bucket 1 of group 'a' twice" in abort.reason


def test_a_go_for_the_next_step_waits_for_the_commit() -> None:
    core, _ = started(4, groups=PAIRS)
    core.handle(Ready(0, 1, 2, spec(2), group="a"))
    assert core.handle(Ready(1, 1, 2, spec(2), group="a")) == []
    actions: list[Action] = []
    for rank in range(4):
        actions += core.handle(_step_done(rank))
    gos = [a for a in actions if isinstance(a, Send)]
    assert [(a.rank, a.message) for a in gos] == [
        (0, Go(1, 2, 0, 1, "a")),
        (1, Go(1, 2, 0, 1, "a")),
    ]


def _step_done(rank: int) -> Digest:
    """Rank ``rank``'s (agreeing) digest ending step 0."""
    return Digest(rank, 0, b"same", (("w", b"same"),))


# --------------------------------------------------------------------------- random meshes


@st.composite
def meshes(draw: st.DrawFn) -> tuple[tuple[str, ...], tuple[int, ...]]:
    world = draw(st.integers(2, 16))
    sizes: list[int] = []
    left = world
    while left > 1:
        factor = draw(st.sampled_from([f for f in range(2, left + 1) if left % f == 0]))
        sizes.append(factor)
        left //= factor
    if draw(st.booleans()):
        sizes.insert(draw(st.integers(0, len(sizes))), 1)
    names = tuple(f"d{i}" for i in range(len(sizes)))
    return names, tuple(sizes)


@settings(max_examples=40, deadline=None)
@given(mesh=meshes(), data=st.data())
def test_random_meshes_give_every_rank_its_groups_and_one_go_order_per_group(
    mesh: tuple[tuple[str, ...], tuple[int, ...]], data: st.DataObject
) -> None:
    names, sizes = mesh
    world = math.prod(sizes)
    core, actions = started(world, mesh=mesh)
    starts = sends(actions)
    expected: dict[int, set[tuple[int, ...]]] = {r: set() for r in range(world)}
    for dim in names:
        for along in mesh_groups(sizes, names, dim):
            for r in along:
                expected[r].add(tuple(along))
    for rank in range(world):
        [start] = starts[rank]
        groups = start.groups
        assert {members for _, members, _ in groups} == expected[rank]
        assert len(groups) == len(names)  # one per dimension, even of size 1
        for _, ranks, addresses in groups:
            assert addresses == tuple(addr(r) for r in ranks)
    # Every rank reports buckets 0..2 in every one of its groups, all interleaved at random.
    reports = [
        Ready(rank, 0, bucket, spec(bucket), group=name)
        for rank in range(world)
        for name, _, _ in starts[rank][0].groups
        for bucket in range(3)
    ]
    shuffled = data.draw(st.permutations(reports))
    received: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for report in shuffled:
        for rank, messages in sends(core.handle(report)).items():
            for go in messages:
                received.setdefault((rank, go.group), []).append((go.bucket, go.seq))
    members = {name: ranks for name, ranks in core.view.groups}
    for name, ranks in members.items():
        orders = [received[(rank, name)] for rank in ranks]
        assert all(order == orders[0] for order in orders)
        assert [seq for _, seq in orders[0]] == [0, 1, 2]
        assert sorted(b for b, _ in orders[0]) == [0, 1, 2]


# --------------------------------------------------------------------------- the worker


def test_the_worker_declares_its_groups_and_runs_a_groups_go() -> None:
    protocol = WorkerProtocol(0)
    [send] = protocol.handle(Join(SIG, addr(0), groups=PAIRS))
    assert isinstance(send, WorkerSend) and isinstance(send.message, Joined)
    assert send.message.groups == PAIRS
    core = CoordinatorCore(4)
    starts: dict[int, list[Any]] = {}
    for rank in range(4):
        starts = sends(core.handle(send.message if rank == 0 else join(rank, groups=PAIRS)))
    [start] = starts[0]
    protocol.handle(Received(start, 0.0))
    assert protocol.groups == {"a": ((0, 1), (addr(0), addr(1)))}
    [ready] = protocol.handle(ReportReady(0, 4, spec(4), 1, group="a"))
    assert isinstance(ready, WorkerSend) and ready.message == Ready(0, 0, 4, spec(4), group="a")
    [run] = protocol.handle(Received(Go(0, 4, 0, 1, "a"), 0.0))
    assert isinstance(run, RunGo) and run.go == Go(0, 4, 0, 1, "a")
    with pytest.raises(ProtocolError, match="ready in group 'a'"):
        protocol.handle(Received(Go(0, 5, 1, 1, "a"), 0.0))


def test_the_worker_refuses_to_report_in_a_group_it_is_not_in() -> None:
    protocol = WorkerProtocol(0)
    protocol.handle(Join(SIG, addr(0), groups=PAIRS))
    start = StartRun(
        addresses=(addr(0), addr(1)), ring=(0, 1), groups=(("a", (0, 1), (addr(0), addr(1))),)
    )
    protocol.handle(Received(start, 0.0))
    protocol.handle(EnterEpoch(start))
    with pytest.raises(LocalProtocolError, match="group 'b', which is not one of its groups"):
        protocol.handle(ReportReady(0, 1, spec(1), 1, group="b"))
