"""The coordinator tree (a `HostFold` per host under a `RootCore`) against the flat
`CoordinatorCore`: the same verdicts for the same worker reports, whatever the grouping of
the workers into hosts.

One scripted run of simulated workers drives both systems: joins, buckets (negotiated, then
cached or folded into the step report), the apply barrier of elastic runs, digests (some ranks
diverging at a tensor) or step_done, a worker's death mid-step (handled on its host) and a
whole host's loss (one membership change at the root). Everything between a host and the root
travels as real CBOR frames. After each scripted move the test compares the committed steps,
the members, and an abort's reason (a divergence parsed by `divergence_of`: the same step,
ranks by state and first tensor).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from paramsync.runtime.coordinator.commits import divergence_of
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import (
    Abort,
    Broadcast,
    Disconnected,
    Evict,
    Refuse,
    Report,
    agreement_hash,
    spec_hash,
)
from paramsync.runtime.coordinator.host_fold import HostFold, HostState
from paramsync.runtime.coordinator.negotiation import Negotiation
from paramsync.runtime.coordinator.root_core import RootCore
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.coordinator.tree_events import FromRoot, HostGone, RefuseHost, ToHosts, Up
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Commit,
    Digest,
    DigestQuery,
    Go,
    HostDigest,
    HostReady,
    HostTensors,
    Joined,
    Ready,
    Reduced,
    StartRun,
    StepDone,
    event_from_wire,
    host_event_from_wire,
    message_from_wire,
    root_message_from_wire,
)
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes

TENSORS = tuple(f"layers.{i}.weight" for i in range(5))
SIGNATURE = tuple((name, (4, 4), "float32", True) for name in TENSORS)
SIZE = 16


def frame(message: Any) -> dict[str, Any]:
    kind, fields = message.to_wire()
    return decode_frame(encode_frame_bytes(kind, fields))


def specs(buckets: int) -> list[tuple[tuple[tuple[int, ...], str], ...]]:
    return [tuple(((4, 4 + b), "float32") for _ in range(2)) for b in range(buckets)]


# --------------------------------------------------------------------------- the two systems


@dataclass
class Seen:
    """What a system answered, as the workers see it."""

    starts: list[StartRun] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)
    gos: list[int] = field(default_factory=list)
    abort: str | None = None
    reports: list[str] = field(default_factory=list)

    def take(self, message: Any) -> None:
        if isinstance(message, StartRun):
            self.starts.append(message)
        elif isinstance(message, Commit):
            self.commits.append(message.step)
        elif isinstance(message, Go):
            self.gos.append(message.bucket)
        elif isinstance(message, AbortRun) and self.abort is None:
            self.abort = message.reason


class Flat:
    def __init__(self, world: int, *, elastic: bool, interval: int, by_spec: bool = False) -> None:
        self.core = CoordinatorCore(
            world,
            digest_interval=interval,
            heartbeat_deadline=60.0,
            min_workers=1 if elastic else None,
            cache_by_spec=by_spec,
        )
        self.seen = Seen()

    def feed(self, rank: int, event: Any) -> None:
        for action in self.core.handle(event_from_wire(frame(event), rank=rank, now=0.0)):
            self._act(action)

    def _act(self, action: Any) -> None:
        if isinstance(action, Broadcast):
            self.seen.take(action.message)
        elif isinstance(action, Abort):
            self.seen.take(action.message)
        elif isinstance(action, Report):
            self.seen.reports.append(action.text)
        elif isinstance(action, Refuse | Evict):
            raise AssertionError(f"flat: unexpected {action!r}")

    def kill(self, rank: int, reason: str) -> None:
        for action in self.core.handle(Disconnected(rank, reason)):
            self._act(action)

    def lose_host(self, index: int, ranks: tuple[int, ...]) -> None:
        for rank in ranks:
            self.kill(rank, "host lost")

    @property
    def done(self) -> bool:
        return self.core.view.state in (RunState.ABORTED, RunState.FINISHED)


class Tree:
    def __init__(
        self,
        world: int,
        groups: list[list[int]],
        *,
        elastic: bool,
        interval: int,
        by_spec: bool = False,
    ) -> None:
        self.root = RootCore(
            world,
            digest_interval=interval,
            heartbeat_deadline=60.0,
            min_workers=1 if elastic else None,
            by_spec=by_spec,
        )
        self.hosts = [
            HostFold(f"node{i}", i, ranks, world_size=world, elastic=elastic, by_spec=by_spec)
            for i, ranks in enumerate(groups)
        ]
        self.host_of = {rank: i for i, ranks in enumerate(groups) for rank in ranks}
        self.dead: set[int] = set()
        self.seen = Seen()
        self.received: dict[int, list[Any]] = {rank: [] for rank in self.host_of}
        self.up: list[Any] = []
        self.queries: list[tuple[DigestQuery, tuple[int, ...]]] = []

    def feed(self, rank: int, event: Any) -> None:
        index = self.host_of[rank]
        if index in self.dead:
            return
        parsed = event_from_wire(frame(event), rank=rank, now=0.0)
        self._host(index, self.hosts[index].handle(parsed))

    def _host(self, index: int, actions: list[Any]) -> None:
        host = self.hosts[index]
        for action in actions:
            if isinstance(action, Up):
                self.up.append(action.message)
                message = host_event_from_wire(frame(action.message), host=index)
                self._root(self.root.handle(message))
            elif isinstance(action, Broadcast):
                for rank in host.members:
                    self.received[rank].append(action.message)
            elif isinstance(action, Abort):
                for rank in host.joins:
                    self.received[rank].append(action.message)
            elif isinstance(action, Report | Evict):
                pass
            else:
                raise AssertionError(f"host {index}: unexpected {action!r}")

    def _root(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, ToHosts):
                self.seen.take(action.message)
                if isinstance(action.message, DigestQuery):
                    self.queries.append((action.message, action.hosts))
                for index in action.hosts:
                    self._down(index, action.message)
            elif isinstance(action, Abort):
                self.seen.take(action.message)
                for index in range(len(self.hosts)):
                    self._down(index, action.message)
            elif isinstance(action, Report):
                self.seen.reports.append(action.text)
            elif isinstance(action, RefuseHost):
                raise AssertionError(f"root: unexpected {action!r}")

    def _down(self, index: int, message: Any) -> None:
        if index in self.dead or self.hosts[index].state is HostState.DONE:
            return
        decoded = root_message_from_wire(frame(message))
        self._host(index, self.hosts[index].handle(FromRoot(decoded)))

    def kill(self, rank: int, reason: str) -> None:
        index = self.host_of[rank]
        self._host(index, self.hosts[index].handle(Disconnected(rank, reason)))

    def lose_host(self, index: int, ranks: tuple[int, ...]) -> None:
        self.dead.add(index)
        self._root(self.root.handle(HostGone(index, "host lost")))

    @property
    def done(self) -> bool:
        return self.root.state in (RunState.ABORTED, RunState.FINISHED)


# --------------------------------------------------------------------------- the workers


@dataclass(frozen=True)
class Move:
    """One scripted step: ``seed`` orders the reports; ``diverge``: rank -> the tensor its
    digest differs at; ``fault``: ("kill", rank) or ("host", index), at report ``at``."""

    seed: int
    diverge: tuple[tuple[int, int], ...] = ()
    fault: tuple[str, int] | None = None
    at: int = 0
    rotate: int = 0
    """A cached report of bucket b names the spec agreed at bucket b + ``rotate`` (a torch
    group's calls in another order, each agreed before: taken only by spec)."""


class Workers:
    """Simulated workers of one system: they read its answers and report as real ones do."""

    def __init__(self, system: Flat | Tree, world: int, buckets: int, fold: bool) -> None:
        self.system, self.world, self.buckets, self.fold = system, world, buckets, fold
        self.specs = specs(buckets)
        self.hashes = [spec_hash(s) for s in self.specs]
        self.agreement = agreement_hash(dict(enumerate(self.hashes)))
        self.starts = 0
        self.host_ranks: list[list[int]] = []
        self.alive = set(range(world))
        for rank in range(world):
            join = Joined(rank, SIGNATURE, ("10.0.0.1", 20_000 + rank), now=0.0, fold=fold)
            system.feed(rank, join)
        self._sync()

    def _sync(self) -> None:
        """Take the last start_run: a new epoch begins (worker-side caches reset)."""
        seen = self.system.seen
        if len(seen.starts) == self.starts:
            return
        self.starts = len(seen.starts)
        start = seen.starts[-1]
        self.epoch, self.members = start.epoch, tuple(sorted(start.members))
        self.verify, self.next = start.verify, start.step
        self.agreed: set[int] = set()
        self.listed: set[int] = set()
        self.gos = len(seen.gos)

    def reports(self, move: Move) -> list[tuple[int, Any]]:
        rng = random.Random(move.seed)
        members = list(self.members)
        if self.verify:
            step = self.next - 1
            rng.shuffle(members)
            return [(r, self._digest(r, step, dict(move.diverge), "")) for r in members]
        step, out = self.next, []
        folded = self.fold and len(self.agreed) == self.buckets
        rotated = len(self.agreed) == self.buckets and move.rotate
        for bucket in reversed(range(self.buckets)):
            if folded:
                break
            rng.shuffle(members)
            for r in members:
                if bucket in self.agreed:
                    named = (bucket + move.rotate) % self.buckets if rotated else bucket
                    out.append((r, Ready(r, step, bucket, self.hashes[named], self.epoch, True)))
                else:
                    out.append((r, Ready(r, step, bucket, self.specs[bucket], self.epoch)))
        cached = self.agreement if folded else ""
        elastic = self._elastic
        if elastic:
            rng.shuffle(members)
            out += [(r, Reduced(r, step, self.epoch, cached)) for r in members]
            cached = ""
        rng.shuffle(members)
        for r in members:
            if step % self._interval == 0:
                out.append((r, self._digest(r, step, dict(move.diverge), cached)))
            else:
                out.append((r, StepDone(r, step, self.epoch, cached)))
        return out

    @property
    def _elastic(self) -> bool:
        system = self.system
        return system.core.view.elastic if isinstance(system, Flat) else system.root.elastic

    @property
    def _interval(self) -> int:
        system = self.system
        return (
            system.core.view.digest_interval if isinstance(system, Flat) else system.root.interval
        )

    def _digest(self, rank: int, step: int, diverge: dict[int, int], cached: str) -> Digest:
        packed = bytearray(bytes([step % 251]) * (SIZE * len(TENSORS)))
        digest = b"d%015d" % step
        if rank in diverge:
            packed[diverge[rank] * SIZE] ^= 0xFF
            digest = b"x%015d" % diverge[rank]
        names = None if rank in self.listed else TENSORS
        self.listed.add(rank)
        return Digest(rank, step, digest, (), self.epoch, bytes(packed), names, cached, "xxh3-128")

    def play(self, move: Move) -> None:
        """One step (or an epoch's check), with the move's fault at report ``at``."""
        system = self.system
        starts, commits = len(system.seen.starts), len(system.seen.commits)
        reports = self.reports(move)
        for index, (rank, report) in enumerate(reports):
            if move.fault is not None and index == move.at % max(len(reports), 1):
                self._fault(move.fault)
            if system.done or len(system.seen.starts) != starts:
                break
            if rank in self.alive:
                system.feed(rank, report)
            self._took_gos()
        if len(system.seen.starts) != starts:
            self._sync()
        elif len(system.seen.commits) > commits:
            if self.verify:
                self.verify = False
            else:
                self.next += 1

    def _took_gos(self) -> None:
        seen = self.system.seen.gos
        self.agreed.update(seen[self.gos :])
        self.gos = len(seen)

    def _fault(self, fault: tuple[str, int]) -> None:
        kind, target = fault
        if kind == "kill":
            if target in self.alive:
                self.alive.discard(target)
                self.system.kill(target, "killed")
            return
        ranks = tuple(r for r in self.host_ranks[target] if r in self.alive)
        self.alive -= set(ranks)
        self.system.lose_host(target, ranks)


# --------------------------------------------------------------------------- the machine


class TreeAgainstFlat(RuleBasedStateMachine):
    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        world = data.draw(st.integers(2, 8), label="world")
        ranks = data.draw(st.permutations(range(world)), label="ranks")
        cuts = sorted(data.draw(st.sets(st.integers(1, world - 1), max_size=3), label="cuts"))
        groups = [sorted(ranks[a:b]) for a, b in zip([0, *cuts], [*cuts, world])]
        elastic = data.draw(st.booleans(), label="elastic")
        interval = data.draw(st.integers(1, 2), label="interval")
        buckets = data.draw(st.integers(1, 3), label="buckets")
        fold = data.draw(st.booleans(), label="fold")
        self.by_spec = data.draw(st.booleans(), label="by_spec")
        self.groups = groups
        self.flat = Flat(world, elastic=elastic, interval=interval, by_spec=self.by_spec)
        self.tree = Tree(world, groups, elastic=elastic, interval=interval, by_spec=self.by_spec)
        self.sims = [Workers(s, world, buckets, fold) for s in (self.flat, self.tree)]
        for sim in self.sims:
            sim.host_ranks = groups
        self.host_losses = 0

    def _play(self, move: Move) -> None:
        for sim in self.sims:
            sim.play(move)

    @precondition(lambda self: not self.flat.done)
    @rule(seed=st.integers(0, 2**16))
    def step(self, seed: int) -> None:
        self._play(Move(seed))

    @precondition(lambda self: not self.flat.done and self.by_spec)
    @rule(seed=st.integers(0, 2**16), rotate=st.integers(1, 2))
    def calls_in_another_order(self, seed: int, rotate: int) -> None:
        """Cached reports naming specs agreed at other buckets (a torch group's calls made in
        another order): both systems take them by spec, with the same commits."""
        self._play(Move(seed, rotate=rotate))

    @precondition(lambda self: not self.flat.done)
    @rule(data=st.data())
    def diverge(self, data: st.DataObject) -> None:
        members = self.sims[0].members
        ranks = data.draw(st.sets(st.sampled_from(members), min_size=1, max_size=2))
        tensor = data.draw(st.integers(0, len(TENSORS) - 1))
        self._play(Move(data.draw(st.integers(0, 2**16)), tuple((r, tensor) for r in ranks)))

    @precondition(lambda self: not self.flat.done and len(self.sims[0].members) > 1)
    @rule(data=st.data())
    def kill_worker(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(self.sims[0].members))
        at = data.draw(st.integers(0, 64))
        self._play(Move(data.draw(st.integers(0, 2**16)), fault=("kill", rank), at=at))

    @precondition(lambda self: not self.flat.done and len(self.groups) > 1)
    @rule(data=st.data())
    def lose_host(self, data: st.DataObject) -> None:
        alive = self.sims[0].alive
        hosts = [i for i, ranks in enumerate(self.groups) if set(ranks) & alive]
        if len(hosts) < 2:
            return
        index = data.draw(st.sampled_from(hosts))
        starts = len(self.tree.seen.starts)
        at = data.draw(st.integers(0, 64))
        self._play(Move(data.draw(st.integers(0, 2**16)), fault=("host", index), at=at))
        lost = [t for t in self.tree.seen.reports if f"host 'node{index}'" in t]
        if self.tree.root.elastic and self.tree.seen.abort is None:
            assert lost, "the root names the lost host"
            assert len(self.tree.seen.starts) - starts <= 1, "a host's loss is one epoch change"
        self.host_losses += 1

    @rule()
    def wait(self) -> None:
        """Nothing happens (a run that ended takes no more moves)."""

    @invariant()
    def same_verdicts(self) -> None:
        if not hasattr(self, "flat"):
            return
        flat, tree = self.flat.seen, self.tree.seen
        assert tree.commits == flat.commits
        assert (tree.abort is None) == (flat.abort is None), (flat.abort, tree.abort)
        if flat.abort is not None and tree.abort is not None:
            diverged = divergence_of(flat.abort)
            assert divergence_of(tree.abort) == diverged, (flat.abort, tree.abort)
            if diverged is None and "host 'node" not in tree.abort:
                assert tree.abort == flat.abort
            elif diverged is None:  # a static run's host lost: named with its ranks
                rank = int(flat.abort.split()[1])
                assert f"{rank}" in tree.abort.split("(ranks")[1].split(")")[0]
        if flat.abort is None:
            assert tree.starts[-1].members == flat.starts[-1].members
            assert tree.starts[-1].step == flat.starts[-1].step
            # Every live member heard every commit of its epoch through its host.
            last = self.tree.seen.commits[-1:] or [None]
            for rank in tree.starts[-1].members:
                got = [m.step for m in self.tree.received[rank] if isinstance(m, Commit)]
                if last[0] is not None and got:
                    assert got[-1] == last[0]

    @invariant()
    def per_tensor_digests_only_after_a_disagreement(self) -> None:
        """The root asks for per-tensor digests only when a step's digests disagree (the
        run then stops on the divergence), and each host asked answers once."""
        if not hasattr(self, "tree"):
            return
        tree = self.tree
        if not tree.queries:
            assert not any(isinstance(m, HostTensors) for m in tree.up)
            return
        assert len(tree.queries) == 1, "one divergence stops the run"
        assert tree.seen.abort is not None and divergence_of(tree.seen.abort) is not None
        query, asked = tree.queries[0]
        answered = [m.host for m in tree.up if isinstance(m, HostTensors)]
        assert sorted(answered) == sorted(h for h in asked if h not in tree.dead)
        assert query.epoch == tree.seen.starts[-1].epoch

    @invariant()
    def one_report_per_host_per_step(self) -> None:
        """The root hears one digest per host of the epoch per step, never one per worker."""
        if not hasattr(self, "tree"):
            return
        digests = [m for m in self.tree.up if isinstance(m, HostDigest)]
        assert len(digests) <= len(self.tree.hosts) * (len(self.tree.seen.commits) + 1) * 4


TreeAgainstFlat.TestCase.settings = settings(
    max_examples=int(os.environ.get("PARAMSYNC_TREE_EXAMPLES", "30")),
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_against_flat = TreeAgainstFlat.TestCase


@pytest.mark.soak
def test_tree_against_flat_soak() -> None:
    run_state_machine_as_test(
        TreeAgainstFlat,
        settings=settings(
            max_examples=1500,
            stateful_step_count=16,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# --------------------------------------------------------------------------- pinned cases


def _tree(groups: list[list[int]], *, elastic: bool = False) -> tuple[Tree, Workers]:
    world = sum(len(g) for g in groups)
    tree = Tree(world, groups, elastic=elastic, interval=1)
    sim = Workers(tree, world, 2, True)
    sim.host_ranks = groups
    return tree, sim


def test_a_divergence_is_named_down_to_the_rank_and_tensor() -> None:
    tree, sim = _tree([[0, 3], [1, 2], [4, 5]])
    sim.play(Move(1))
    sim.play(Move(2, diverge=((2, 3),)))
    assert divergence_of(tree.seen.abort or "") == (1, [[0, 1, 3, 4, 5], [2]], TENSORS[3])


def test_the_root_hears_one_report_per_host_when_workers_fold() -> None:
    tree, sim = _tree([[0, 1, 2, 3], [4, 5, 6, 7]])
    for seed in range(3):
        sim.play(Move(seed))
    assert tree.seen.commits == [0, 1, 2]
    later = [m for m in tree.up if not isinstance(m, HostReady)][-2:]
    assert [type(m) for m in later] == [HostDigest, HostDigest]
    # One group per host, its members as one byte; no per-tensor digest travels.
    assert [m.groups for m in later] == [((b"\x0f", b"d%015d" % 2, "xxh3-128"),)] * 2
    assert not tree.queries and not any(isinstance(m, HostTensors) for m in tree.up)


def test_a_lost_host_is_one_membership_change_naming_its_ranks() -> None:
    tree, sim = _tree([[0, 1], [2, 3], [4, 5]], elastic=True)
    sim.play(Move(0))
    sim.play(Move(1, fault=("host", 1), at=3))
    assert [s.members for s in tree.seen.starts] == [(0, 1, 2, 3, 4, 5), (0, 1, 4, 5)]
    assert any(
        "host 'node1' (ranks [2, 3]) disconnected: host lost" in t for t in tree.seen.reports
    )
    sim.play(Move(2))  # the epoch's check of step 0
    sim.play(Move(3))
    assert tree.seen.commits == [0, 0, 1]


def test_a_dead_worker_is_handled_on_its_host() -> None:
    tree, sim = _tree([[0, 1], [2, 3]], elastic=True)
    sim.play(Move(0, fault=("kill", 3), at=2))
    assert tree.seen.starts[-1].members == (0, 1, 2)
    assert any("rank 3 disconnected: killed" in t for t in tree.seen.reports)
    static, sim = _tree([[0, 1], [2, 3]])
    sim.play(Move(0, fault=("kill", 3), at=2))
    assert static.seen.abort == "rank 3 disconnected: killed"


# --------------------------------------------------------------------------- digest queries


def test_per_tensor_digests_travel_only_after_a_disagreement() -> None:
    tree, sim = _tree([[0, 3], [1, 2], [4, 5]])
    sim.play(Move(1))
    sim.play(Move(2))
    assert tree.seen.commits == [0, 1] and not tree.queries
    sim.play(Move(3, diverge=((4, 1),)))
    assert [(q.step, hosts) for q, hosts in tree.queries] == [(2, (0, 1, 2))]
    answers = [m for m in tree.up if isinstance(m, HostTensors)]
    assert sorted(m.host for m in answers) == [0, 1, 2]
    assert divergence_of(tree.seen.abort or "") == (2, [[0, 1, 2, 3, 5], [4]], TENSORS[1])
    # Host 2 answers with two groups: rank 4 (position 0) and rank 5 (position 1).
    (host_2,) = [m for m in answers if m.host == 2]
    assert sorted(g[0] for g in host_2.groups) == [b"\x01", b"\x02"]


def _root_at_a_split_digest() -> tuple[Tree, Workers]:
    """Two hosts of two; step 0 commits; step 1's digests disagree: the root asked, host 0
    answered, host 1's answer is the test's."""
    tree, sim = _tree([[0, 1], [2, 3]])
    sim.play(Move(0))
    host = tree.hosts[1]
    handle = host.handle

    def mute(event: Any) -> list[Any]:  # host 1 leaves the query to the test
        if isinstance(event, FromRoot) and isinstance(event.message, DigestQuery):
            return []
        return handle(event)

    host.handle = mute  # type: ignore[method-assign]
    sim.play(Move(1, diverge=((3, 0),)))
    assert [q.step for q, _ in tree.queries] == [1] and tree.seen.abort is None
    return tree, sim


def _from_host(tree: Tree, message: Any) -> None:
    host = message.host
    tree._root(tree.root.handle(host_event_from_wire(frame(message), host=host)))


def test_an_answer_that_contradicts_the_hosts_digests_stops_the_run() -> None:
    tree, _ = _root_at_a_split_digest()
    names = TENSORS
    packed = bytes(SIZE * len(names))
    # Host 1 reported ranks 2 and 3 as two states; it answers that both hold rank 2's.
    lie = HostTensors(1, 1, 1, ((b"\x03", b"d%015d" % 1, "xxh3-128", packed, names),))
    _from_host(tree, lie)
    assert tree.seen.abort == (
        "step 1: host 'node1' (ranks [2, 3]) sent per-tensor digests that do not fit: its "
        "per-tensor digests do not match the digests it reported"
    )


def test_unasked_or_misfit_digest_reports_are_faults_of_the_host() -> None:
    tree, sim = _tree([[0, 1], [2, 3]])
    sim.play(Move(0))
    packed = bytes(SIZE * len(TENSORS))
    _from_host(tree, HostTensors(0, 1, 1, ((b"\x03", b"d", "xxh3-128", packed, TENSORS),)))
    assert tree.seen.abort == (
        "step 1: host 'node0' (ranks [0, 1]) sent per-tensor digests the root did not ask for"
    )
    tree, sim = _tree([[0, 1], [2, 3]])
    sim.play(Move(0))
    _from_host(tree, HostDigest(0, 1, 1, ((b"\x01", b"d", "xxh3-128"),)))
    assert tree.seen.abort == (
        "step 1: host 'node0' (ranks [0, 1]) sent digests that do not fit its members: its "
        "group does not hold exactly its members"
    )


def test_a_host_asked_for_digests_it_has_not_sent_stops() -> None:
    tree, sim = _tree([[0, 1], [2, 3]])
    sim.play(Move(0))
    actions = tree.hosts[0].handle(FromRoot(DigestQuery(step=1, epoch=1)))
    assert [type(a) for a in actions] == [Abort]
    assert "has not sent its digests of it (at step 1 of epoch 1)" in actions[0].reason
    assert tree.hosts[0].state is HostState.DONE


def test_a_digest_query_is_for_hosts_not_workers() -> None:
    query = frame(DigestQuery(step=3, epoch=2))
    assert root_message_from_wire(query) == DigestQuery(step=3, epoch=2)
    with pytest.raises(ProtocolError, match="a digest_query message does not come from the"):
        message_from_wire(query)
    with pytest.raises(ProtocolError, match="a host_tensors message does not come from the"):
        root_message_from_wire(frame(HostTensors(0, 1, 1, ())))


def test_a_host_takes_its_members_folded_step_reports_in_one_step_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once every bucket is agreed, a member's folded step report costs its host O(1): no
    bucket is taken one by one (`Negotiation.take`), whatever the number of buckets."""
    tree, sim = _tree([[0, 1, 2, 3], [4, 5, 6, 7]])
    sim.play(Move(0))  # step 0 negotiates every bucket
    taken: list[int] = []
    take = Negotiation.take

    def counted(self: Negotiation, state: Any, rank: int, *args: Any) -> Any:
        taken.append(rank)
        return take(self, state, rank, *args)

    monkeypatch.setattr(Negotiation, "take", counted)
    for seed in (1, 2, 3):
        sim.play(Move(seed))
    assert tree.seen.commits == [0, 1, 2, 3]
    assert not taken
