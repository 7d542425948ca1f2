"""The coordinator's checks for 3D-parallel runs (paramsync.runtime.coordinator.layouts, commits):
the layout every join declares (one mesh, one pipeline schedule digest, each rank at its
coordinates) and the digest check within each (tp, pp) shard's dp replicas only.

The core is pure, so hypothesis drives it directly with random layouts; the worker's protocol
carries the layout from its join on. The runs with real workers are in
tests/test_layouts_in_process.py.
"""

from __future__ import annotations

import gc
import math
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramsync.actors.client.events import ConnectionLost, Join, Received
from paramsync.actors.client.events import Send as WorkerSend
from paramsync.actors.client.protocol import WorkerProtocol
from paramsync.runtime.collectives.mesh import mesh_coordinates, mesh_groups
from paramsync.runtime.coordinator.commits import TensorNames, digest_verdict, sharded_verdict
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Abort, Action, Broadcast, Refuse, Resync
from paramsync.runtime.coordinator.layouts import Shards, layout_disagreement
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.errors import CollectiveError, ProtocolError
from paramsync.runtime.parallel.run_layout import parallel_layout
from paramsync.runtime.protocol.messages import (
    Digest,
    Joined,
    ParallelLayout,
    StartRun,
    event_from_wire,
)
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION

SIG = (("w", (4, 2), "float32", True),)
SCHEDULE = bytes(range(16))
OTHER_SCHEDULE = bytes(range(1, 17))
TENSORS = ("param/a", "param/b", "opt/a")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def addr(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 7000 + rank)


def layout(rank: int, shape: dict[str, int], schedule: bytes = SCHEDULE) -> ParallelLayout:
    return parallel_layout(rank, shape, schedule)


def join(rank: int, lay: ParallelLayout | None, **kwargs: Any) -> Joined:
    return Joined(rank, SIG, addr(rank), now=0.0, layout=lay, **kwargs)


def join_all(core: CoordinatorCore, layouts: dict[int, ParallelLayout | None]) -> list[Action]:
    actions: list[Action] = []
    for rank in sorted(layouts):
        actions = core.handle(join(rank, layouts[rank]))
        assert not any(isinstance(a, Refuse) for a in actions), actions
    return actions


def the_abort(actions: list[Action]) -> str:
    aborts = [a for a in actions if isinstance(a, Abort)]
    assert len(aborts) == 1, actions
    return aborts[0].reason


def digest(
    rank: int, step: int, state: bytes, bad_tensor: int | None = None, epoch: int = 1
) -> Digest:
    """A digest of ``state`` (the same bytes for every replica of one state); ``bad_tensor``:
    that tensor differs."""
    per = tuple(
        (name, state + (b"!" if i == bad_tensor else b"")) for i, name in enumerate(TENSORS)
    )
    whole = state + (b"!%d" % bad_tensor if bad_tensor is not None else b"")
    return Digest(rank, step, whole, per, epoch)


def shard_coordinates(rank: int, shape: dict[str, int]) -> str:
    """``(tp=1, pp=0)``: the coordinates of ``rank`` on every dimension but dp."""
    names, sizes = tuple(shape), tuple(shape.values())
    coordinates = mesh_coordinates(rank, sizes)
    pairs = [f"{n}={c}" for n, c in zip(names, coordinates, strict=True) if n != "dp"]
    return "(" + ", ".join(pairs) + ")" if pairs else "(the whole model)"


def dp_groups(shape: dict[str, int]) -> list[list[int]]:
    """The ranks of each shard (its dp replicas), from the mesh's own group rule."""
    names, sizes = tuple(shape), tuple(shape.values())
    if "dp" not in names:
        return [[rank] for rank in range(math.prod(sizes))]
    return mesh_groups(sizes, names, "dp")


@st.composite
def shapes(draw: st.DrawFn, max_world: int = 16, min_dp: int = 1) -> dict[str, int]:
    """A mesh of some of pp, dp, tp (any order, dp at least ``min_dp``), at most
    ``max_world`` ranks."""
    names = draw(st.lists(st.sampled_from(["pp", "dp", "tp"]), min_size=1, max_size=3, unique=True))
    if min_dp > 1 and "dp" not in names:
        names.append("dp")
    names = draw(st.permutations(names))
    shape: dict[str, int] = {}
    for name in names:
        room = max_world // max(1, math.prod(shape.values()))
        low = min_dp if name == "dp" else 1
        shape[name] = draw(st.integers(low, max(low, min(4, room))))
    if math.prod(shape.values()) > max_world:
        shape = {name: (min_dp if name == "dp" else 1) for name in names}
    return shape


def started(shape: dict[str, int], **kwargs: Any) -> CoordinatorCore:
    world = math.prod(shape.values())
    core = CoordinatorCore(world, heartbeat_deadline=5.0, **kwargs)
    actions = join_all(core, {rank: layout(rank, shape) for rank in range(world)})
    assert core.view.state is RunState.RUNNING, actions
    assert isinstance(actions[0], Broadcast) and isinstance(actions[0].message, StartRun)
    return core


def end_step(core: CoordinatorCore, step: int, states: dict[int, bytes], **bad: int) -> list:
    actions: list[Action] = []
    for rank in sorted(states):
        tensor = bad.get(f"r{rank}")
        actions += core.handle(digest(rank, step, states[rank], tensor, core.view.epoch))
    return actions


# --------------------------------------------------------------------------- the digest check


@SETTINGS
@given(shapes(), st.integers(0, 10_000))
def test_replicas_of_a_shard_agree_and_shards_may_differ(shape: dict[str, int], salt: int) -> None:
    """Every shard's replicas report one state, every shard another: all steps commit, and no
    two shards are ever compared."""
    core = started(shape)
    for step in range(3):
        states = {
            rank: b"shard-%d-%d-%d" % (core.view.shard_of(rank), step, salt)
            for rank in range(core.view.world_size)
        }
        actions = end_step(core, step, states)
        assert [type(a.message).__name__ for a in actions if isinstance(a, Broadcast)] == [
            "Commit"
        ], actions
        assert core.view.last_commit is not None and core.view.last_commit.step == step


@SETTINGS
@given(shapes(min_dp=2), st.data())
def test_a_single_diverging_replica_is_named_with_its_shard(
    shape: dict[str, int], data: st.DataObject
) -> None:
    core = started(shape)
    world = core.view.world_size
    bad = data.draw(st.integers(0, world - 1), label="bad rank")
    tensor = data.draw(st.integers(0, len(TENSORS) - 1), label="bad tensor")
    states = {rank: b"shard-%d" % core.view.shard_of(rank) for rank in range(world)}
    reason = the_abort(end_step(core, 0, states, **{f"r{bad}": tensor}))
    replicas = next(group for group in dp_groups(shape) if bad in group)
    good = [rank for rank in replicas if rank != bad]
    assert reason.startswith(f"step 0, shard {shard_coordinates(bad, shape)}: "), reason
    if len(good) > 1:  # a majority: the others are named as such
        assert f"ranks [{bad}] differ from the majority (ranks {good})" in reason, reason
    else:  # two replicas: no majority, both named
        assert "with no majority" in reason and f"ranks [{bad}] have" in reason, reason
        assert f"ranks [{good[0]}] have" in reason, reason
    ref = good[0] if len(good) > 1 else min(replicas)
    other = bad if ref != bad else good[0]
    assert f"rank {other} first differs from rank {ref} at tensor '{TENSORS[tensor]}'" in reason
    # Only the bad shard is named: no other shard's ranks appear.
    assert reason.count("shard (") == 1 or "(the whole model)" in reason, reason
    assert core.view.state is RunState.ABORTED


@SETTINGS
@given(shapes(min_dp=3, max_world=12), st.data())
def test_resync_repairs_each_shards_minority_from_its_own_replicas(
    shape: dict[str, int], data: st.DataObject
) -> None:
    core = started(shape, resync=True)
    groups = dp_groups(shape)
    chosen = data.draw(st.lists(st.sampled_from(groups), min_size=1, unique_by=tuple))
    bad = {data.draw(st.sampled_from(group), label="bad replica"): 0 for group in chosen}
    states = {rank: b"shard-%d" % core.view.shard_of(rank) for rank in range(core.view.world_size)}
    actions = end_step(core, 0, states, **{f"r{rank}": t for rank, t in bad.items()})
    resyncs = [a for a in actions if isinstance(a, Resync)]
    assert len(resyncs) == len(chosen), actions
    for resync in resyncs:
        (target,) = resync.targets
        group = next(g for g in groups if target in g)
        assert target in bad
        assert resync.source_rank == min(r for r in group if r != target)
    assert isinstance(actions[-1], Broadcast) and core.view.last_commit is not None


def test_without_a_layout_every_rank_is_compared_with_all() -> None:
    """A flat run: one shard, today's verdict and text."""
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    join_all(core, {rank: None for rank in range(4)})
    assert core.view.layout is None and {core.view.shard_of(r) for r in range(4)} == {0}
    states = {rank: b"same" for rank in range(4)}
    reason = the_abort(end_step(core, 0, states, r2=1))
    assert reason.startswith(
        "step 0: parameter digests diverged: ranks [2] differ from the majority (ranks [0, 1, 3])"
    ), reason


def test_packed_per_tensor_digests_name_the_tensor_within_the_shard() -> None:
    shape = {"dp": 2, "tp": 2}
    core = started(shape)
    names = ("param/w", "param/b")

    def packed(rank: int, bad: bool) -> Digest:
        per = b"a" * 16 + (b"x" if bad else b"b") * 16
        base = b"shard-%d" % core.view.shard_of(rank)
        return Digest(rank, 0, base + (b"!" if bad else b""), (), packed=per, names=names)

    actions: list[Action] = []
    for rank in range(4):
        actions += core.handle(packed(rank, rank == 2))
    reason = the_abort(actions)
    assert reason.startswith("step 0, shard (tp=0): the dp replicas' parameter digests"), reason
    assert "rank 2 first differs from rank 0 at tensor 'param/b'" in reason, reason


def test_sharded_verdict_names_every_failing_shard() -> None:
    shards = Shards(("tp", "dp"), (2, 2))  # shards: ranks {0, 1} (tp=0) and {2, 3} (tp=1)
    reports = {
        rank: Digest(rank, 4, b"s%d" % (rank + (rank in (1, 3))), ((TENSORS[0], b"x%d" % rank),))
        for rank in range(4)
    }
    verdict = sharded_verdict(4, reports, shards, TensorNames(), resync=True)
    assert verdict.abort is not None and verdict.resyncs == ()
    assert "step 4, shard (tp=0):" in verdict.abort and "step 4, shard (tp=1):" in verdict.abort
    assert "ranks [0] have" in verdict.abort and "ranks [3] have" in verdict.abort
    flat = digest_verdict(4, reports, 4, TensorNames(), resync=False)
    assert flat.abort is not None and "shard" not in flat.abort


def test_sharded_verdict_refuses_mixed_digest_algorithms_across_shards() -> None:
    shards = Shards(("tp", "dp"), (2, 2))
    names = ("fold31x4", "fold31x4", "xxh3-128", "xxh3-128")  # each shard agrees within
    reports = {
        rank: Digest(rank, 4, b"s", ((TENSORS[0], b"x"),), algorithm=names[rank])
        for rank in range(4)
    }
    verdict = sharded_verdict(4, reports, shards, TensorNames(), resync=True)
    assert verdict.resyncs == () and verdict.abort is not None
    assert "ranks [0, 1] report fold31x4; ranks [2, 3] report xxh3-128" in verdict.abort


# --------------------------------------------------------------------------- the layout check


@SETTINGS
@given(shapes(max_world=12), st.data())
def test_disagreeing_schedule_digests_stop_the_run_naming_both_sides(
    shape: dict[str, int], data: st.DataObject
) -> None:
    world = math.prod(shape.values())
    if world == 1:
        return
    others = data.draw(
        st.lists(st.integers(0, world - 1), min_size=1, max_size=world - 1, unique=True)
    )
    core = CoordinatorCore(world, heartbeat_deadline=5.0)
    layouts = {
        rank: layout(rank, shape, OTHER_SCHEDULE if rank in others else SCHEDULE)
        for rank in range(world)
    }
    reason = the_abort(join_all(core, layouts))
    assert core.view.state is RunState.ABORTED
    same = sorted(set(range(world)) - set(others))
    assert reason.startswith("the run cannot start: the ranks disagree on the pipeline schedule")

    def side(ranks: list[int], schedule: bytes) -> str:
        who = (
            f"rank {ranks[0]} declares"
            if len(ranks) == 1
            else ("ranks " + ", ".join(map(str, ranks)) + " declare")
        )
        return f"{who} schedule digest {schedule.hex()[:12]}..."

    assert side(same, SCHEDULE) in reason, reason
    assert side(sorted(others), OTHER_SCHEDULE) in reason, reason


@SETTINGS
@given(shapes(max_world=12), st.data())
def test_duplicate_or_misplaced_coordinates_stop_the_run_naming_the_ranks(
    shape: dict[str, int], data: st.DataObject
) -> None:
    world = math.prod(shape.values())
    if world == 1:
        return
    names, sizes = tuple(shape), tuple(shape.values())
    liar = data.draw(st.integers(0, world - 1), label="liar")
    victim = data.draw(st.integers(0, world - 1).filter(lambda r: r != liar), label="victim")
    swap = data.draw(st.booleans(), label="swap")
    coordinates = {rank: mesh_coordinates(rank, sizes) for rank in range(world)}
    coordinates[liar] = mesh_coordinates(victim, sizes)
    if swap:  # the victim takes the liar's place: no duplicate, two misplaced ranks
        coordinates[victim] = mesh_coordinates(liar, sizes)
    layouts = {
        rank: ParallelLayout(names, sizes, coordinates[rank], SCHEDULE) for rank in range(world)
    }
    core = CoordinatorCore(world, heartbeat_deadline=5.0)
    reason = the_abort(join_all(core, layouts))
    text = "(" + ", ".join(f"{n}={c}" for n, c in zip(names, coordinates[liar], strict=True)) + ")"
    pair = sorted((liar, victim))
    if swap:
        assert "claim" not in reason, reason
        assert f"rank {victim} declares" in reason, reason
    else:
        assert f"ranks {pair[0]}, {pair[1]} all claim the coordinates {text}" in reason, reason
    assert f"rank {liar} declares {text} but its rank is at" in reason, reason
    assert "row-major, the last named dimension fastest" in reason, reason


def test_mixed_and_disagreeing_meshes_stop_the_run() -> None:
    shape = {"dp": 2, "tp": 2}
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    reason = the_abort(
        join_all(core, {rank: None if rank == 1 else layout(rank, shape) for rank in range(4)})
    )
    assert reason == (
        "the run cannot start: the ranks disagree on the parallel layout: ranks 0, 2, 3 declare "
        "a parallel layout; rank 1 declares none"
    )
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    swapped = {"tp": 2, "dp": 2}
    layouts = {rank: layout(rank, swapped if rank >= 2 else shape) for rank in range(4)}
    reason = the_abort(join_all(core, layouts))
    assert reason == (
        "the run cannot start: the ranks disagree on the parallel layout's mesh: ranks 0, 1 "
        "declare the mesh {dp: 2, tp: 2}; ranks 2, 3 declare the mesh {tp: 2, dp: 2}"
    )


def test_a_layout_that_cannot_hold_the_world_is_refused_at_the_join() -> None:
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    [refusal] = core.handle(join(0, layout(0, {"dp": 2, "tp": 4})))
    assert isinstance(refusal, Refuse)
    assert refusal.reason == (
        "rank 0 declares a parallel layout on the mesh {dp: 2, tp: 4} holding 8 ranks, but the "
        "world has 4"
    )
    [refusal] = core.handle(join(0, layout(0, {"dp": 2, "tp": 2}), mesh=(("tp", "dp"), (2, 2))))
    assert isinstance(refusal, Refuse)
    assert "its process groups on the mesh {tp: 2, dp: 2} but its parallel layout on the mesh " in (
        refusal.reason
    )
    # The same mesh for both is taken, and its groups are declared.
    assert core.handle(join(0, layout(0, {"dp": 2, "tp": 2}), mesh=(("dp", "tp"), (2, 2)))) == []


def test_an_elastic_run_refuses_layouts() -> None:
    core = CoordinatorCore(4, heartbeat_deadline=5.0, min_workers=2)
    layouts = {rank: layout(rank, {"dp": 2, "tp": 2}) for rank in range(4)}
    reason = the_abort(join_all(core, layouts))
    assert "min_workers (2) must equal the world size (4)" in reason, reason


def test_layout_disagreement_is_none_without_layouts() -> None:
    assert layout_disagreement({rank: join(rank, None) for rank in range(3)}) is None


# --------------------------------------------------------------------------- a restart


def rejoin(rank: int, lay: ParallelLayout, step: int, state: bytes) -> Joined:
    return Joined(rank, SIG, addr(rank), now=0.0, step=step, digest=state, epoch=3, layout=lay)


def test_a_restart_resumes_where_every_shard_holds_one_state_and_checks_it_per_shard() -> None:
    shape = {"dp": 2, "tp": 2}
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    actions: list[Action] = []
    for rank in range(4):
        state = b"shard-%d" % (rank % 2)
        actions = core.handle(rejoin(rank, layout(rank, shape), 6, state))
    [start] = [a.message for a in actions if isinstance(a, Broadcast)]
    assert isinstance(start, StartRun) and start.step == 6 and start.verify
    assert start.donor == -1 and start.receivers == () and start.epoch == 4
    commits = end_step(core, 5, {rank: b"shard-%d" % (rank % 2) for rank in range(4)})
    assert core.view.last_commit is not None and core.view.last_commit.step == 5, commits


def test_a_restart_whose_replicas_differ_stops_naming_the_shard() -> None:
    shape = {"dp": 2, "tp": 2}
    core = CoordinatorCore(4, heartbeat_deadline=5.0)
    actions: list[Action] = []
    for rank in range(4):
        step = 5 if rank == 3 else 6
        actions = core.handle(rejoin(rank, layout(rank, shape), step, b"shard-%d" % (rank % 2)))
    reason = the_abort(actions)
    assert reason.startswith("the run cannot resume: a 3D-parallel run resumes only where"), reason
    assert "shard (tp=1): rank 1 holds step 6 (digest " in reason, reason
    assert "rank 3 holds step 5 (digest " in reason, reason
    assert "(tp=0)" not in reason


# --------------------------------------------------------------------------- the wire and worker


def test_the_layout_travels_in_the_join_and_bad_ones_name_the_field() -> None:
    lay = layout(2, {"pp": 2, "dp": 1, "tp": 2}, SCHEDULE)
    assert lay.coordinates == (1, 0, 0) and lay.shard == (("pp", 1), ("tp", 0))
    kind, fields = join(2, lay).to_wire()
    assert fields["layout"] == [["pp", "dp", "tp"], [2, 1, 2], [1, 0, 0], SCHEDULE]
    event = event_from_wire({"v": PROTOCOL_VERSION, "kind": kind, **fields}, rank=2, now=0.0)
    assert isinstance(event, Joined) and event.layout == lay
    assert isinstance(event.layout, ParallelLayout)
    assert "layout" not in join(2, None).to_wire()[1]
    for bad, problem in [
        ([["dp", "dp"], [1, 1], [0, 0], b""], "'layout' names ['dp', 'dp'] repeat a name"),
        ([["dp"], [2, 2], [0], b""], "'layout' sizes holds 2 for 1 names"),
        ([["dp"], [2], [2], b""], "'layout' coordinates [2] put dp=2 outside its size 2"),
        ([["dp"], [2], [0], b"x" * 65], "'layout' schedule_digest is longer than 64 bytes"),
        ([["dp"], [2], [0]], "'layout' must be [names, sizes, coordinates, schedule_digest]"),
    ]:
        with pytest.raises(ProtocolError, match=problem.replace("[", r"\[").replace("]", r"\]")):
            event_from_wire(
                {"v": PROTOCOL_VERSION, "kind": kind, **fields, "layout": bad}, rank=2, now=0.0
            )


def test_parallel_layout_places_the_rank_by_the_mesh_rule() -> None:
    assert parallel_layout(5, {"pp": 2, "dp": 2, "tp": 2}).coordinates == (1, 0, 1)
    assert parallel_layout(5, {"pp": 2, "dp": 2, "tp": 2}).describe_coordinates() == (
        "(pp=1, dp=0, tp=1)"
    )
    with pytest.raises(CollectiveError, match="rank 8 is not in a mesh of 8 ranks"):
        parallel_layout(8, {"pp": 2, "dp": 2, "tp": 2})
    with pytest.raises(CollectiveError, match="positive int size"):
        parallel_layout(0, {"dp": 0})
    with pytest.raises(CollectiveError, match="at least one mesh dimension"):
        parallel_layout(0, {})


def test_the_worker_declares_its_layout_and_a_rejoin_keeps_it() -> None:
    lay = layout(1, {"dp": 2, "tp": 2})
    protocol = WorkerProtocol(1)
    [send] = protocol.handle(Join(SIG, addr(1), layout=lay))
    assert isinstance(send, WorkerSend) and isinstance(send.message, Joined)
    assert send.message.layout == lay and protocol.layout == lay
    start = StartRun(addresses=tuple(addr(r) for r in range(4)), ring=(0, 1, 2, 3))
    protocol.handle(Received(start, 0.0))
    protocol.handle(ConnectionLost("gone", rejoin=True))
    [again] = protocol.handle(Join(None, None, step=3, digest=b"d", epoch=1))
    assert isinstance(again, WorkerSend) and isinstance(again.message, Joined)
    assert again.message.layout == lay


def test_the_sharded_check_keeps_no_state_per_step() -> None:
    """The per-shard verdict groups each step's reports afresh (O(members) once per step, O(1)
    per report) and keeps nothing of it: the heap is flat over 200 steps of 16 workers."""
    core = started({"pp": 2, "dp": 4, "tp": 2})
    states = {rank: b"shard-%d" % core.view.shard_of(rank) for rank in range(16)}
    reports = {rank: digest(rank, 0, states[rank]) for rank in range(16)}

    def run(first: int, count: int) -> int:
        for step in range(first, first + count):
            for rank in range(16):
                core.handle(Digest(rank, step, reports[rank].digest, reports[rank].tensor_digests))
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        at_50 = run(0, 50)
        at_250 = run(50, 200)
    finally:
        tracemalloc.stop()
    assert core.view.last_commit is not None and core.view.last_commit.step == 249
    assert at_250 - at_50 < 8 * 1024, (at_50, at_250)
