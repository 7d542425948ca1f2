"""The coordinator core in elastic runs: deaths, joins, holds, stale and duplicated messages.

Unit tests pin the epoch rules; a hypothesis rule-based machine drives honest simulated workers
through arbitrary deaths, rejoins, duplicated and stale messages and clock ticks, checking the
fault-tolerance invariants after every event.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Abort, Broadcast, Disconnected, Evict, Report, Tick
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.protocol.messages import (
    Apply,
    Commit,
    Digest,
    Finished,
    Go,
    Hold,
    Joined,
    Ready,
    Reduced,
    StartRun,
    StepDone,
)

SIG = (("w", (2,), "float32", True),)
SPEC = (((2,), "float32"),)


def join(core: CoordinatorCore, rank: int, now: float = 0.0, **kw: Any) -> list[Any]:
    return core.handle(Joined(rank, SIG, ("h", 1000 + rank), now, **kw))


def started(actions: list[Any]) -> StartRun:
    starts = [
        a.message for a in actions if isinstance(a, Broadcast) and isinstance(a.message, StartRun)
    ]
    assert len(starts) == 1, actions
    return starts[0]


def run_step(core: CoordinatorCore, step: int, members: tuple[int, ...]) -> list[Any]:
    """Every member reports the one bucket, reduces, and sends its digest."""
    epoch = core.view.epoch
    out: list[Any] = []
    for r in members:
        out += core.handle(Ready(r, step, 0, SPEC, epoch))
    for r in members:
        out += core.handle(Reduced(r, step, epoch))
    for r in members:
        out += core.handle(Digest(r, step, b"d%d" % step, (), epoch))
    return out


def elastic(n: int = 3, m: int = 2, **kw: Any) -> CoordinatorCore:
    core = CoordinatorCore(n, min_workers=m, **kw)
    for r in range(n):
        join(core, r)
    return core


def test_a_death_before_apply_reruns_the_step_with_the_survivors() -> None:
    core = elastic()
    run_step(core, 0, (0, 1, 2))
    core.handle(Ready(0, 1, 0, SPEC, 1))
    actions = core.handle(Disconnected(2, "killed"))
    start = started(actions)
    assert (start.epoch, start.step, start.members, start.receivers) == (2, 1, (0, 1), ())
    assert start.verify and start.apply_barrier
    assert any(isinstance(a, Report) and "rank 2" in a.text for a in actions)
    # the survivors report their starting state (step 0's digest), then run step 1 again
    out = core.handle(Digest(0, 0, b"d0", (), 2)) + core.handle(Digest(1, 0, b"d0", (), 2))
    assert Broadcast(Commit(0, 2)) in out
    out = run_step(core, 1, (0, 1))
    assert Broadcast(Apply(1, 2)) in out and Broadcast(Commit(1, 2)) in out


def test_a_death_after_apply_finishes_the_step_and_resumes_after_it() -> None:
    core = elastic()
    for r in (0, 1, 2):
        core.handle(Ready(r, 0, 0, SPEC, 1))
    for r in (0, 1, 2):
        actions = core.handle(Reduced(r, 0, 1))
    assert Broadcast(Apply(0, 1)) in actions
    start = started(core.handle(Disconnected(1, "killed")))
    assert (start.step, start.members) == (1, (0, 2))


def test_below_min_workers_the_run_holds_then_a_joiner_takes_a_members_state() -> None:
    core = elastic(3, 3 - 1)
    run_step(core, 0, (0, 1, 2))
    core.handle(Disconnected(2, "killed"))
    actions = core.handle(Disconnected(1, "killed"))
    holds = [a.message for a in actions if isinstance(a, Broadcast) and isinstance(a.message, Hold)]
    assert holds and holds[0].step == 1 and core.view.state is RunState.HOLDING
    start = started(join(core, 2, 1.0))
    assert (start.step, start.members, start.donor, start.receivers) == (1, (0, 2), 0, (2,))
    assert core.view.state is RunState.RUNNING


def test_a_new_epoch_negotiates_its_buckets_afresh() -> None:
    """The response cache lives for one epoch: the survivors' ring is new, so their first
    step must negotiate again, and a report cached from the old epoch is refused."""
    core = elastic()
    run_step(core, 0, (0, 1, 2))  # epoch 1 agrees on bucket 0
    assert core.handle(Ready(0, 1, 0, SPEC, 1, cached=True)) == []
    start = started(core.handle(Disconnected(2, "killed")))
    assert (start.epoch, start.step) == (2, 1)
    core.handle(Digest(0, 0, b"d0", (), 2))
    core.handle(Digest(1, 0, b"d0", (), 2))
    actions = core.handle(Ready(0, 1, 0, SPEC, 2, cached=True))
    assert any(
        isinstance(a, Evict)
        and a.rank == 0
        and "agreed on no spec for bucket 0 in epoch 2" in a.reason
        for a in actions
    ), actions


def test_cached_reports_in_an_elastic_epoch_skip_the_go_and_may_trail_reduced() -> None:
    core = elastic()
    run_step(core, 0, (0, 1, 2))
    assert core.view.seq == 1
    out: list[Any] = []
    out += core.handle(Ready(0, 1, 0, SPEC, 1, cached=True))
    out += core.handle(Reduced(0, 1, 1))  # rank 0's ring ended before the others' reports
    for r in (1, 2):
        out += core.handle(Ready(r, 1, 0, SPEC, 1, cached=True))
    for r in (1, 2):
        out += core.handle(Reduced(r, 1, 1))
    assert out == [Broadcast(Apply(1, 1))]
    for r in (0, 1, 2):
        out = core.handle(Digest(r, 1, b"d1", (), 1))
    assert out == [Broadcast(Commit(1, 1))] and core.view.seq == 1


def test_holding_past_the_rejoin_deadline_stops_the_run_clearly() -> None:
    core = elastic(2, 1, rejoin_seconds=5.0)
    core.handle(Tick(0.0))
    core.handle(Disconnected(1, "killed"))  # one left: min 1, keeps going
    actions = core.handle(Disconnected(0, "killed"))
    assert any(isinstance(a, Abort) for a in actions) or core.view.state is RunState.HOLDING
    if core.view.state is RunState.HOLDING:
        actions = core.handle(Tick(10.0))
        assert isinstance(actions[-1], Abort) and "min_workers=1" in actions[-1].reason


def test_stale_messages_are_dropped_and_future_epochs_evict_the_sender() -> None:
    core = elastic()
    core.handle(Disconnected(2, "killed"))
    assert core.handle(Ready(0, 0, 0, SPEC, 1)) == [] and core.view.stale_messages == 1
    actions = core.handle(Ready(1, 0, 0, SPEC, 9))
    assert isinstance(actions[0], Evict) and actions[0].rank == 1 and "epoch 9" in actions[0].reason


def test_a_restarted_coordinator_resumes_from_the_newest_majority_state() -> None:
    core = CoordinatorCore(3, min_workers=2)
    join(core, 0, step=5, digest=b"x", epoch=4)
    join(core, 1, step=5, digest=b"x", epoch=4)
    start = started(join(core, 2, step=4, digest=b"y", epoch=4))
    assert (start.step, start.donor, start.receivers, start.epoch) == (5, 0, (2,), 5)
    assert start.verify and not start.broadcast


def test_a_stall_is_reported_naming_the_ranks_and_the_phase() -> None:
    core = elastic(3, 2, stall_seconds=2.0)
    core.handle(Ready(0, 0, 0, SPEC, 1))
    core.handle(Ready(1, 0, 0, SPEC, 1))
    core.handle(Tick(0.0))
    assert core.handle(Tick(1.0)) == []
    (report,) = core.handle(Tick(3.0))
    assert isinstance(report, Report) and "ranks [2]" in report.text and "backward" in report.text


def test_a_stall_past_its_deadline_drops_the_stalled_rank() -> None:
    core = elastic(3, 2, stall_seconds=1.0, stall_deadline=4.0)
    for r in (0, 1):
        core.handle(Ready(r, 0, 0, SPEC, 1))
    core.handle(Tick(0.0))
    actions = core.handle(Tick(5.0))
    assert any(isinstance(a, Evict) and a.rank == 2 for a in actions)
    assert started(actions).members == (0, 1)


# --------------------------------------------------------------------------- the machine


class Sim:
    """One honest simulated worker."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epoch = 0
        self.step = 0
        self.phase = "joining"
        self.bucket = 0
        self.last: Any = None


class ElasticMachine(RuleBasedStateMachine):
    """Honest workers plus deaths, rejoins, duplicated, stale and reordered messages, and
    time."""

    @initialize(n=st.integers(2, 4), buckets=st.integers(1, 2), interval=st.integers(1, 2))
    def setup(self, n: int, buckets: int, interval: int) -> None:
        self.n, self.buckets, self.total = n, buckets, 4
        self.core = CoordinatorCore(
            n, min_workers=1, digest_interval=interval, heartbeat_deadline=1e9
        )
        self.sims: dict[int, Sim] = {}
        self.epochs_seen = [0]
        self.trained_commits: set[int] = set()
        self.applies: set[int] = set()
        self.gone: set[tuple[int, int, int]] = set()
        self.applied_in: dict[int, int] = {}
        self.reduced: dict[tuple[int, int], set[int]] = {}
        """(epoch, step) -> the ranks that reported every bucket of it all-reduced."""
        self.now = 0.0
        for r in range(n):
            self.sims[r] = Sim(r)
            self.feed(Joined(r, SIG, ("h", 1000 + r), 0.0))

    # ---------------------------------------------------------------- plumbing

    def feed(self, event: Any, sender: Sim | None = None) -> list[Any]:
        if sender is not None:
            sender.last = event
        before = self.core.view.epoch
        actions = self.core.handle(event)
        if isinstance(event, Reduced) and event.epoch == before == self.core.view.epoch:
            self.reduced.setdefault((event.epoch, event.step), set()).add(event.rank)
        for action in actions:
            self.check(action)
            if isinstance(action, Evict):
                self.sims.pop(action.rank, None)
            if isinstance(action, Broadcast):
                for rank in self.core.view.members:
                    if rank in self.sims:
                        self.deliver(self.sims[rank], action.message)
        return actions

    def check(self, action: Any) -> None:
        if isinstance(action, Broadcast):
            message = action.message
            if isinstance(message, StartRun | Hold):
                assert message.epoch > self.epochs_seen[-1], "epochs only grow"
                self.epochs_seen.append(message.epoch)
            if isinstance(message, Apply):
                assert message.step not in self.applies, f"step {message.step} applied twice"
                self.applies.add(message.step)
                self.applied_in[message.step] = message.epoch
            if isinstance(message, Commit):
                record = self.core.view.last_commit
                assert record is not None and record.step == message.step
                if self.core.view.is_digest_step(message.step) or record.digests:
                    assert set(record.digests) == set(record.members), "commit without digests"
                if message.step in self.trained_commits and record.digests == ():
                    raise AssertionError(f"step {message.step} committed twice")
                if not record.digests or message.step not in self.trained_commits:
                    self.trained_commits.add(message.step)
                    # One membership per step: committed in the epoch that trained it, by
                    # ranks that all all-reduced it there. (A later epoch commits a step only
                    # as its opening check: every member's digest of that state, above.)
                    if self.applied_in.get(message.step, record.epoch) == record.epoch:
                        ran = self.reduced.get((record.epoch, message.step), set())
                        assert set(record.members) <= ran, (
                            f"step {message.step} committed by {record.members}, but only "
                            f"{ran} all-reduced it in epoch {record.epoch}"
                        )
        if isinstance(action, Abort):
            assert "diverged" not in action.reason, action.reason

    def deliver(self, sim: Sim, message: Any) -> None:
        if isinstance(message, StartRun):
            sim.epoch = message.epoch
            sim.step = message.step
            sim.bucket = 0
            sim.phase = "verify" if message.verify else "ready"
        elif isinstance(message, Hold):
            sim.epoch, sim.phase = message.epoch, "hold"
        elif isinstance(message, Go):
            self.gone.add((message.epoch, message.step, message.bucket))
        elif isinstance(message, Apply) and sim.phase == "wait_apply":
            sim.phase = "done"
        elif (
            isinstance(message, Commit) and message.step == sim.step and sim.phase == "wait_commit"
        ):
            sim.step += 1
            sim.bucket = 0
            sim.phase = "finish" if sim.step >= self.total else "ready"

    def honest_move(self, sim: Sim) -> Any:
        e, s = sim.epoch, sim.step
        if sim.phase == "verify":
            sim.phase = "ready"
            return Digest(sim.rank, s - 1, b"d%d" % (s - 1), (), e)
        if sim.phase == "ready":
            if sim.bucket < self.buckets:
                sim.bucket += 1
                return Ready(sim.rank, s, sim.bucket - 1, SPEC, e)
            if all((e, s, b) in self.gone for b in range(self.buckets)):
                sim.phase = "wait_apply"
                return Reduced(sim.rank, s, e)
            return None
        if sim.phase == "done":
            sim.phase = "wait_commit"
            if self.core.view.is_digest_step(s):
                return Digest(sim.rank, s, b"d%d" % s, (), e)
            return StepDone(sim.rank, s, e)
        if sim.phase == "finish":
            sim.phase = "finished"
            return Finished(sim.rank, s, e)
        return None

    def pick(self, index: int) -> Sim | None:
        alive = sorted(self.sims)
        return self.sims[alive[index % len(alive)]] if alive else None

    # ---------------------------------------------------------------- rules

    @rule(index=st.integers(0, 7), moves=st.integers(1, 6))
    def advance(self, index: int, moves: int) -> None:
        for _ in range(moves):
            sim = self.pick(index)
            if sim is None or self.core.view.state not in (RunState.RUNNING, RunState.HOLDING):
                return
            event = self.honest_move(sim)
            if event is None:
                return
            actions = self.feed(event, sim)
            assert not any(isinstance(a, Evict) for a in actions), (event, actions)
            assert not any(isinstance(a, Abort) for a in actions), (event, actions)

    @rule(index=st.integers(0, 7))
    def kill(self, index: int) -> None:
        sim = self.pick(index)
        if sim is not None and len(self.sims) > 1:
            del self.sims[sim.rank]
            self.feed(Disconnected(sim.rank, "killed"))

    @rule(rank=st.integers(0, 3))
    def rejoin(self, rank: int) -> None:
        if (
            rank < self.n
            and rank not in self.sims
            and self.core.view.state is not RunState.FINISHED
        ):
            self.sims[rank] = Sim(rank)
            self.feed(Joined(rank, SIG, ("h", 2000 + rank), self.now))

    @rule(index=st.integers(0, 7))
    def stale(self, index: int) -> None:
        sim = self.pick(index)
        if sim is None or sim.last is None or not hasattr(sim.last, "epoch"):
            return
        if sim.last.epoch < self.core.view.epoch:
            actions = self.feed(sim.last)
            assert actions == [], "a stale message must be dropped"

    @rule(index=st.integers(0, 7))
    def duplicate(self, index: int) -> None:
        sim = self.pick(index)
        if sim is not None and isinstance(sim.last, Ready | Reduced | Digest | StepDone):
            self.feed(sim.last)  # a protocol break: the sender is dropped, the run goes on

    @rule(index=st.integers(0, 7))
    def reorder(self, index: int) -> None:
        """A worker's next two messages arrive swapped: dropped as a protocol break or taken
        as they come, the run itself never aborts and the invariants hold."""
        sim = self.pick(index)
        if sim is None or self.core.view.state is not RunState.RUNNING:
            return
        first = self.honest_move(sim)
        second = self.honest_move(sim) if first is not None else None
        for event in (second, first):
            if event is not None and sim.rank in self.sims:
                actions = self.feed(event, sim)
                assert not any(isinstance(a, Abort) for a in actions), (event, actions)

    @rule(dt=st.floats(0, 5))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))

    @invariant()
    def epochs_only_grow(self) -> None:
        assert self.core.view.epoch >= self.epochs_seen[-1]
        assert self.core.view.state is not RunState.ABORTED or self.core.view.abort_reason


ElasticMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestElasticCore = ElasticMachine.TestCase


def test_a_new_epoch_needs_the_tensor_names_listed_again() -> None:
    """Packed per-tensor digests reuse the names a rank listed earlier in the same epoch only:
    after a membership change its first digest must list them again."""
    core = elastic()
    for r in (0, 1, 2):
        core.handle(Ready(r, 0, 0, SPEC, 1))
    for r in (0, 1, 2):
        core.handle(Reduced(r, 0, 1))
    out: list[Any] = []
    for r in (0, 1, 2):
        out += core.handle(Digest(r, 0, b"d0", (), 1, packed=b"t" * 16, names=("param/w",)))
    assert Broadcast(Commit(0, 1)) in out
    start = started(core.handle(Disconnected(2, "killed")))
    assert start.epoch == 2 and start.members == (0, 1)
    out = core.handle(Digest(0, 0, b"d0", (), 2, packed=b"t" * 16, names=("param/w",)))
    out += core.handle(Digest(1, 0, b"d0", (), 2, packed=b"t" * 16))
    evicted = [a for a in out if isinstance(a, Evict)]
    assert evicted and evicted[0].rank == 1
    assert "rank 1 sent packed per-tensor digests without their names" in evicted[0].reason
