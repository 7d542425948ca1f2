"""The coordinator tree as a torch.distributed group runs it (pure, against the flat core).

A torch group's coordinator takes a cached call agreed at any place of the epoch (the response
cache by spec: `CoordinatorOptions.cache_by_spec`), and it stops a call some ranks never make
at the group's timeout, naming the call and the ranks, while ranks that all sit between calls
are idle, not stalled (`idle_stalls=False`). The tree (`HostDriver` per host under a
`RootDriver`, every message between them a real CBOR frame) gives the same verdicts in the same
words as the flat `CoordinatorCore`, with a host's stall notice (`host_stall`) telling the root
which of its workers are in the call.
"""

from __future__ import annotations

from typing import Any

import pytest

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Abort, Broadcast, Report, Send, Tick, spec_hash
from paramsync.runtime.coordinator.host_driver import HostDriver
from paramsync.runtime.coordinator.host_fold import HostFold
from paramsync.runtime.coordinator.root_core import RootCore
from paramsync.runtime.coordinator.root_driver import RootDriver
from paramsync.runtime.coordinator.tree_events import FromRoot, Up
from paramsync.runtime.coordinator.tree_stall import StallClock
from paramsync.runtime.protocol.messages import (
    CALL_PREFIX,
    AbortRun,
    Commit,
    Digest,
    Go,
    HostStall,
    Joined,
    Ready,
    StartRun,
    event_from_wire,
    host_event_from_wire,
    root_message_from_wire,
)
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes

SIGNATURE = (("torch.distributed group 0", (4,), "group", False),)
STALL, DEADLINE = 2.0, 4.0


def frame(message: Any) -> dict[str, Any]:
    kind, fields = message.to_wire()
    return decode_frame(encode_frame_bytes(kind, fields))


def call(name: str, *shape: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """A torch call's spec as the backend reports it (`Call.spec`)."""
    return (((), f"{CALL_PREFIX}{name}"), (shape, "float32"))


ALLREDUCE, BROADCAST = call("allreduce", 4), call("broadcast", 4)


class Seen:
    def __init__(self) -> None:
        self.starts: list[StartRun] = []
        self.commits: list[int] = []
        self.gos: list[tuple[int, int]] = []
        self.abort: str | None = None
        self.reports: list[str] = []

    def take(self, message: Any) -> None:
        if isinstance(message, StartRun):
            self.starts.append(message)
        elif isinstance(message, Commit):
            self.commits.append(message.step)
        elif isinstance(message, Go):
            self.gos.append((message.step, message.bucket))
        elif isinstance(message, AbortRun) and self.abort is None:
            self.abort = message.reason


class Flat:
    def __init__(self, world: int) -> None:
        self.core = CoordinatorCore(
            world,
            heartbeat_deadline=60.0,
            stall_seconds=STALL,
            stall_deadline=DEADLINE,
            cache_by_spec=True,
            idle_stalls=False,
        )
        self.seen = Seen()

    def feed(self, rank: int, event: Any) -> None:
        self._act(self.core.handle(event_from_wire(frame(event), rank=rank, now=0.0)))

    def tick(self, now: float) -> None:
        self._act(self.core.handle(Tick(now)))

    def _act(self, actions: Any) -> None:
        for action in actions:
            if isinstance(action, Broadcast | Abort):
                self.seen.take(action.message)
            elif isinstance(action, Report):
                self.seen.reports.append(action.text)


class Tree:
    def __init__(self, groups: list[list[int]], *, by_spec: bool = True) -> None:
        world = sum(len(g) for g in groups)
        root = RootCore(
            world,
            heartbeat_deadline=60.0,
            by_spec=by_spec,
            stall_seconds=STALL,
            stall_deadline=DEADLINE,
            idle_stalls=False,
        )
        self.root = RootDriver(root)
        self.hosts = [
            HostDriver(
                HostFold(f"node{i}", i, ranks, world_size=world, elastic=False, by_spec=by_spec),
                heartbeat_deadline=60.0,
                stall_seconds=STALL,
            )
            for i, ranks in enumerate(groups)
        ]
        self.host_of = {rank: i for i, ranks in enumerate(groups) for rank in ranks}
        self.seen = Seen()
        self.up: list[Any] = []

    def feed(self, rank: int, event: Any) -> None:
        index = self.host_of[rank]
        parsed = event_from_wire(frame(event), rank=rank, now=0.0)
        self._host(index, self.hosts[index].handle(parsed))

    def tick(self, now: float) -> None:
        for index, host in enumerate(self.hosts):
            self._host(index, host.handle(Tick(now)))
        self._root(self.root.handle(Tick(now)))

    def _host(self, index: int, actions: Any) -> None:
        for action in actions:
            if isinstance(action, Up):
                self.up.append(action.message)
                message = host_event_from_wire(frame(action.message), host=index)
                self._root(self.root.handle(message))

    def _root(self, actions: Any) -> None:
        for action in actions:
            if isinstance(action, Broadcast | Send | Abort):
                self.seen.take(action.message)
                targets = [action.rank] if isinstance(action, Send) else range(len(self.hosts))
                for index in targets:
                    message = root_message_from_wire(frame(action.message))
                    self._host(index, self.hosts[index].handle(FromRoot(message)))
            elif isinstance(action, Report):
                self.seen.reports.append(action.text)


def _digest(rank: int, step: int) -> Digest:
    packed = bytes([step % 251]) * 16
    return Digest(rank, step, b"d%015d" % step, (), 1, packed, ("w",), "", "xxh3-128")


def _both(groups: list[list[int]]) -> tuple[Flat, Tree]:
    world = sum(len(g) for g in groups)
    systems = Flat(world), Tree(groups)
    for system in systems:
        for rank in range(world):
            system.feed(rank, Joined(rank, SIGNATURE, ("10.0.0.1", 20_000 + rank), now=0.0))
        assert len(system.seen.starts) == 1
    return systems


def _calls(system: Flat | Tree, ranks: list[int], step: int, specs: list[Any]) -> None:
    """Each of ``ranks`` reports the calls ``specs`` (a spec: negotiated; a hash: cached)."""
    for bucket, spec in enumerate(specs):
        cached = isinstance(spec, str)
        for rank in ranks:
            system.feed(rank, Ready(rank, step, bucket, spec, 1, cached))


def _end(system: Flat | Tree, ranks: list[int], step: int) -> None:
    for rank in ranks:
        system.feed(rank, _digest(rank, step))


def test_a_call_agreed_at_another_place_runs_cached_under_the_tree() -> None:
    """Step 0 agrees on allreduce at call 0 and broadcast at call 1; step 1 makes them in the
    other order, each rank at once from the cache: the tree takes it as the flat core does
    (no go, the step commits)."""
    flat, tree = _both([[0, 1], [2, 3]])
    for system in (flat, tree):
        _calls(system, [0, 1, 2, 3], 0, [ALLREDUCE, BROADCAST])
        _end(system, [0, 1, 2, 3], 0)
        _calls(system, [0, 1, 2, 3], 1, [spec_hash(BROADCAST), spec_hash(ALLREDUCE)])
        _end(system, [0, 1, 2, 3], 1)
        assert system.seen.abort is None, system.seen.abort
    assert tree.seen.commits == flat.seen.commits == [0, 1]
    assert tree.seen.gos == flat.seen.gos == [(0, 0), (0, 1)]


def test_a_cached_call_that_differs_is_named_under_the_tree() -> None:
    """Rank 3 starts the other agreed call from the cache: its host names it, as the flat
    coordinator does, with the ranks on each side."""
    flat, tree = _both([[0, 1], [2, 3]])
    for system in (flat, tree):
        _calls(system, [0, 1, 2, 3], 0, [ALLREDUCE, BROADCAST])
        _end(system, [0, 1, 2, 3], 0)
        _calls(system, [2], 1, [spec_hash(ALLREDUCE)])
        _calls(system, [3], 1, [spec_hash(BROADCAST)])
    assert flat.seen.abort is not None and tree.seen.abort is not None
    assert tree.seen.abort == flat.seen.abort
    assert "ranks [2] report" in tree.seen.abort and "ranks [3] report" in tree.seen.abort


@pytest.mark.parametrize(
    "missing",
    [
        pytest.param([3], id="one rank of one host"),
        pytest.param([1, 3], id="one rank of every host (the root hears nothing)"),
        pytest.param([2, 3], id="a whole host"),
    ],
)
def test_a_call_some_ranks_never_make_is_named_as_the_flat_coordinator_names_it(
    missing: list[int],
) -> None:
    flat, tree = _both([[0, 1], [2, 3]])
    callers = [r for r in range(4) if r not in missing]
    for system in (flat, tree):
        _calls(system, [0, 1, 2, 3], 0, [ALLREDUCE])
        _end(system, [0, 1, 2, 3], 0)
        _calls(system, callers, 1, [spec_hash(ALLREDUCE)])
    now = 0.0
    while flat.seen.abort is None and now < 20:
        now += 0.25
        flat.tick(now)
        tree.tick(now)
    assert flat.seen.abort is not None
    assert tree.seen.abort == flat.seen.abort
    assert tree.seen.abort == (
        f"allreduce (step 1, call 0): ranks {missing} did not call it within the timeout of "
        f"4.0 s (ranks {callers} waited in it)"
    )
    # It was reported first, at the stall time, naming the same ranks.
    stalls = [t for t in tree.seen.reports if t.startswith("stall:")]
    assert stalls and f"for ranks {missing}, which have not called it" in stalls[0], stalls
    if missing == [1, 3]:  # each host told the root which of its workers are in the call
        notices = [m for m in tree.up if isinstance(m, HostStall)]
        assert {n.host for n in notices} == {0, 1} and all(n.call == "allreduce" for n in notices)


def test_ranks_that_all_sit_between_calls_are_idle_not_stalled() -> None:
    flat, tree = _both([[0, 1], [2, 3]])
    for system in (flat, tree):
        _calls(system, [0, 1, 2, 3], 0, [ALLREDUCE])
    now = 0.0
    while now < 3 * DEADLINE:
        now += 0.5
        flat.tick(now)
        tree.tick(now)
    assert flat.seen.abort is None and tree.seen.abort is None
    assert not any(isinstance(m, HostStall) for m in tree.up)
    for system in (flat, tree):  # and the group goes on
        _end(system, [0, 1, 2, 3], 0)
    assert tree.seen.commits == flat.seen.commits == [0]


def test_a_hosts_notice_sets_the_roots_clock_to_its_workers_last_report() -> None:
    clock = StallClock(2.0, 4.0)
    assert clock.check(10.0) is None  # the clock starts at the first tick after a move
    clock.moved_at(13.0)  # a host's worker reported at 13
    assert clock.check(16.5) is not None and not clock.check(16.9)
    stall = clock.check(17.5)
    assert stall is not None and stall.give_up and stall.waited == pytest.approx(4.5)
    clock.moved_at(12.0)  # an older report changes nothing
    assert clock.check(17.6) is not None


def test_the_tree_refuses_a_stall_deadline_it_cannot_keep() -> None:
    """An elastic run's stalled ranks are dropped by the flat coordinator; the tree does not
    drop single ranks of a host, so it refuses the deadline rather than ignore it."""
    with pytest.raises(ValueError, match="does not drop the stalled ranks of an elastic run"):
        RootCore(4, min_workers=2, stall_deadline=5.0)


def test_a_call_some_ranks_report_cached_and_others_negotiate_gets_its_go() -> None:
    """Step 1's call 0 is the broadcast agreed at step 0's call 1: rank 0 has not heard that
    go yet and negotiates it, the others run it from the cache. Each host says which call it
    is (not the one agreed at call 0 before), so the hosts agree and the go comes."""
    flat, tree = _both([[0, 1], [2, 3]])
    for system in (flat, tree):
        _calls(system, [0, 1, 2, 3], 0, [ALLREDUCE, BROADCAST])
        _end(system, [0, 1, 2, 3], 0)
        _calls(system, [0], 1, [BROADCAST])
        _calls(system, [1, 2, 3], 1, [spec_hash(BROADCAST)])
        _end(system, [0, 1, 2, 3], 1)
        assert system.seen.abort is None, system.seen.abort
    assert tree.seen.gos == flat.seen.gos == [(0, 0), (0, 1), (1, 0)]
    assert tree.seen.commits == flat.seen.commits == [0, 1]
