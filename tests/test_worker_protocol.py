"""The worker's sans-I/O protocol core (`paramsync.actors.client.protocol`): its tables, and a
stateful model wiring it to the coordinator's core.

Both cores are pure, so hypothesis drives them directly (no trio): the state machine plays
the trainers and the links. Every message crosses as a CBOR frame through per-link queues
(order kept per link, as TCP does), delivered in random interleavings; the coordinator may
restart (every queued message is lost, the workers rejoin with what they hold) and a worker's
link may drop. Invariants: no weight moves before its commit, steps are reported in order, a
rejoin presents the state it holds, and every message the tables do not allow is a
ProtocolError naming the coordinator, the message kind and its step.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paramsync.actors.client.events import (
    Announce,
    ConnectionLost,
    Ended,
    EnterEpoch,
    HeartbeatDue,
    HeartbeatReceived,
    Join,
    Progress,
    Received,
    ReportDigest,
    ReportFinished,
    ReportFolded,
    ReportReady,
    ReportReduced,
    ReportStepDone,
    RunGo,
    Send,
    Silent,
    Started,
    Tick,
    WorkerAction,
)
from paramsync.actors.client.protocol import (
    COORDINATOR_TRANSITIONS,
    EpochRegression,
    LocalProtocolError,
    Phase,
    WorkerProtocol,
)
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import (
    Abort,
    Broadcast,
    Disconnected,
    Evict,
    Refuse,
    agreement_hash,
    spec_hash,
)
from paramsync.runtime.coordinator.run_state import RunState
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Apply,
    Commit,
    Digest,
    Go,
    Hold,
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

SIG = (("w", (4, 2), "float32", True), ("b", (2,), "float32", True))
SPECS = ((((4, 2), "float32"),), (((2,), "float32"),))
START = StartRun(addresses=(("h", 1), ("h", 2)), ring=(0, 1), epoch=1)


def wire(message: Any) -> dict[str, Any]:
    """``message`` as the peer decodes it: one CBOR frame, validated."""
    kind, fields = message.to_wire()
    return decode_frame(encode_frame_bytes(kind, fields))


def sent(actions: list[WorkerAction]) -> list[Any]:
    return [a.message for a in actions if isinstance(a, Send)]


def joined(rank: int = 0, start: StartRun = START) -> WorkerProtocol:
    protocol = WorkerProtocol(rank)
    protocol.handle(Join(SIG, ("h", rank + 1)))
    protocol.handle(Received(start, 0.0))
    return protocol


# --------------------------------------------------------------------------- examples


def test_a_join_sends_the_joined_message_and_the_start_enters_the_epoch() -> None:
    protocol = WorkerProtocol(3)
    (message,) = sent(protocol.handle(Join(SIG, ("h", 7), step=5, digest=b"d" * 16, fold=True)))
    assert isinstance(message, Joined)
    assert wire(message) == {
        "v": PROTOCOL_VERSION,
        "kind": "join",
        "host": "h",
        "port": 7,
        "params": [["w", [4, 2], "float32", True], ["b", [2], "float32", True]],
        "step": 5,
        "digest": b"d" * 16,
        "epoch": 0,
        "fold": True,
    }
    assert protocol.phase is Phase.JOINING
    start = StartRun(addresses=(("h", 7),), ring=(0,), members=(3,), step=5, broadcast=False)
    actions = protocol.handle(Received(start, 1.0))
    assert actions == [Started(start, False), Progress()]
    assert protocol.phase is Phase.RUNNING and protocol.epoch == 1
    assert protocol.committed == 3 and protocol.applied == 4  # step 4 is verified first


def test_reports_are_the_core_message_classes_and_fold_into_the_first_report() -> None:
    protocol = joined()
    (ready,) = sent(protocol.handle(ReportReady(0, 1, SPECS[1], 1)))
    assert ready == Ready(0, 0, 1, SPECS[1], 1)
    assert event_from_wire(wire(ready), rank=0, now=0.0) == ready
    protocol.handle(Received(Go(0, 1, 0, 1)))
    agreed = agreement_hash({1: spec_hash(SPECS[1])})
    protocol.handle(ReportFolded(1, 1, agreed))
    (first,) = sent(protocol.handle(ReportStepDone(1, 1)))
    assert first == StepDone(0, 1, 1, agreed)
    (digest,) = sent(protocol.handle(ReportDigest(2, b"x" * 16, b"a" * 32, 1, ("w", "b"))))
    assert isinstance(digest, Digest) and digest.names == ("w", "b") and not digest.cached
    assert wire(digest)["tensors"] == b"a" * 32
    (pairs,) = sent(protocol.handle(ReportDigest(3, b"x" * 16, [("w", b"1"), ("b", b"2")], 1)))
    assert wire(pairs)["tensors"] == [["w", b"1"], ["b", b"2"]]
    (finished,) = sent(protocol.handle(ReportFinished(4)))
    assert wire(finished) == {"v": PROTOCOL_VERSION, "kind": "finished", "epoch": 1, "step": 4}


def test_commits_and_applies_of_the_epoch_move_the_counters_older_ones_are_dropped() -> None:
    protocol = joined()
    assert protocol.handle(Received(Commit(0, 1))) == [Progress()]
    assert protocol.handle(Received(Apply(1, 1))) == [Progress()]
    assert (protocol.committed, protocol.applied) == (0, 1)
    later = StartRun(addresses=START.addresses, ring=(0, 1), epoch=3, step=2, broadcast=False)
    assert protocol.handle(Received(later)) == [Announce(later)]
    assert protocol.handle(Received(Commit(5, 2))) == []  # raced the membership change
    assert protocol.handle(Received(Go(2, 0, 9, 1))) == []
    assert protocol.stale == 2 and protocol.committed == 0
    with pytest.raises(ProtocolError, match=r"peer coordinator: commit \{step 2, epoch 4\}"):
        protocol.handle(Received(Commit(2, 4)))


def test_gos_answer_ready_reports_and_agree_the_response_cache() -> None:
    protocol = joined()
    with pytest.raises(ProtocolError, match=r"go \{step 0, epoch 1, bucket 0\}.*did not report"):
        protocol.handle(Received(Go(0, 0, 0, 1)))
    protocol.handle(ReportReady(0, 0, SPECS[0], 1))
    protocol.handle(ReportReady(0, 1, SPECS[1], 1))
    assert protocol.awaiting_go == {(0, 0), (0, 1)} and protocol.agreement == "none"
    with pytest.raises(LocalProtocolError, match="agreed on no spec for it"):
        protocol.handle(ReportReady(1, 0, spec_hash(SPECS[0]), 1, cached=True))
    assert protocol.handle(Received(Go(0, 0, 0, 1))) == [RunGo(Go(0, 0, 0, 1))]
    assert protocol.handle(Received(Go(0, 1, 1, 1))) == [RunGo(Go(0, 1, 1, 1))]
    agreed = agreement_hash({0: spec_hash(SPECS[0]), 1: spec_hash(SPECS[1])})
    assert protocol.agreement == agreed
    (cached,) = sent(protocol.handle(ReportReady(1, 0, spec_hash(SPECS[0]), 1, cached=True)))
    assert wire(cached)["cached"] is True and wire(cached)["spec"] == spec_hash(SPECS[0])
    with pytest.raises(LocalProtocolError, match=r"as xxh3:.*but epoch 1 agreed on xxh3:"):
        protocol.handle(ReportReady(1, 1, SPECS[0], 1, cached=True))
    with pytest.raises(LocalProtocolError, match="folds step 2 under agreement xxh3:other"):
        protocol.handle(ReportFolded(2, 1, "xxh3:other"))
    protocol.handle(ReportFolded(2, 1, agreed))
    # A peer that negotiates bucket 0 again: its go answers this worker's cached report.
    assert protocol.handle(Received(Go(1, 0, 2, 1))) == [RunGo(Go(1, 0, 2, 1))]
    protocol.handle(ReportStepDone(1, 1))
    assert protocol.awaiting_go == set()
    later = StartRun(addresses=START.addresses, ring=(0, 1), epoch=2, step=2, broadcast=False)
    protocol.handle(Received(later))
    assert protocol.agreement == "none"  # a new epoch starts without an agreement


def test_a_hold_runs_nothing_until_the_next_start() -> None:
    protocol = joined()
    hold = Hold(3, 2, "too few")
    assert protocol.handle(Received(hold)) == [Announce(hold)]
    assert protocol.phase is Phase.HOLDING
    assert protocol.handle(Received(Commit(2, 1))) == []
    with pytest.raises(ProtocolError, match=r"go \{step 3, epoch 2, bucket 0\} while holding"):
        protocol.handle(Received(Go(3, 0, 0, 2)))
    with pytest.raises(ProtocolError, match="resync"):
        protocol.handle(Received(ResyncOrder(3, 0, (1,))))
    assert sent(protocol.handle(ReportStepDone(2, 1))) == []  # the coordinator would drop it


def test_losing_the_coordinator_holds_and_the_rejoin_presents_the_state_held() -> None:
    protocol = joined()
    protocol.handle(Received(Apply(4, 1)))
    actions = protocol.handle(ConnectionLost("link broke"))
    assert actions == [Announce(Hold(5, 1, "coordinator lost: link broke")), Progress()]
    assert protocol.phase is Phase.LOST
    assert sent(protocol.handle(ReportDigest(5, b"x", b"", 1))) == []  # dropped, held
    assert protocol.handle(HeartbeatDue(1.0)) == []
    with pytest.raises(LocalProtocolError, match="presents the state it holds"):
        protocol.handle(Join(None, None, step=6, digest=b"s", epoch=0))
    (rejoin,) = sent(protocol.handle(Join(None, None, step=6, digest=b"s", epoch=1)))
    assert rejoin == Joined(0, SIG, ("h", 1), None, 6, b"s", 1, False)
    stale = StartRun(addresses=START.addresses, ring=(0, 1), epoch=1, step=6, broadcast=False)
    with pytest.raises(EpochRegression, match="opened epoch 1, not after 1"):
        protocol.handle(Received(stale))
    protocol.handle(ConnectionLost("cut off again"))
    assert protocol.phase is Phase.LOST
    protocol.handle(Join(None, None, step=6, digest=b"s", epoch=1))
    fresh = StartRun(addresses=START.addresses, ring=(0, 1), epoch=2, step=6, broadcast=False)
    assert protocol.handle(Received(fresh)) == [Started(fresh, True), Progress(), Announce(fresh)]
    assert (protocol.phase, protocol.committed, protocol.applied) == (Phase.RUNNING, 4, 5)


def test_without_a_redial_a_loss_ends_the_run_and_silence_is_reported() -> None:
    protocol = joined()
    protocol.handle(Received(Commit(0, 1), now=10.0))
    assert protocol.handle(Tick(12.0)) == []
    assert protocol.handle(Tick(20.0)) == [
        Silent("the coordinator sent nothing for 10 s (heartbeat deadline)")
    ]
    assert protocol.handle(ConnectionLost("silent", rejoin=False)) == []
    assert protocol.phase is Phase.ENDED
    assert protocol.handle(ReportStepDone(1, 1)) == []


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (Shutdown("finished"), None),
        (Shutdown("stopped by hand"), "coordinator ended the run: stopped by hand"),
        (AbortRun("ranks differ"), "coordinator stopped the run: ranks differ"),
    ],
)
def test_the_end_of_the_run(message: Any, error: str | None) -> None:
    protocol = joined()
    assert protocol.handle(Received(message)) == [Ended(message, error), Progress()]
    assert protocol.ended


def test_a_refused_join_ends_naming_the_rank_and_anything_but_a_start_is_an_error() -> None:
    protocol = WorkerProtocol(2)
    protocol.handle(Join(SIG, ("h", 1)))
    assert protocol.handle(HeartbeatReceived(1.0)) == []
    (ended, _) = protocol.handle(Received(JoinRefused("rank 2 is taken")))
    assert isinstance(ended, Ended) and ended.error == "coordinator refused rank 2: rank 2 is taken"
    protocol = WorkerProtocol(2)
    protocol.handle(Join(SIG, ("h", 1)))
    with pytest.raises(
        ProtocolError, match=r"commit \{step 0, epoch 1\}.*expected the run's start"
    ):
        protocol.handle(Received(Commit(0, 1)))


def test_trainer_requests_the_phase_forbids_are_local_errors() -> None:
    protocol = WorkerProtocol(0)
    with pytest.raises(LocalProtocolError, match="rank 0 asked to send digest while unjoined"):
        protocol.handle(ReportDigest(0, b"", b"", 0))
    protocol.handle(Join(SIG, ("h", 1)))
    with pytest.raises(LocalProtocolError, match="ready while joining"):
        protocol.handle(ReportReady(0, 0, SPECS[0], 1))
    protocol.handle(Received(START))
    with pytest.raises(LocalProtocolError, match="epoch 2, which the coordinator never"):
        protocol.handle(ReportStepDone(0, 2))
    with pytest.raises(LocalProtocolError, match="enters epoch 5"):
        protocol.handle(EnterEpoch(StartRun(addresses=(("h", 1),), ring=(0,), epoch=5)))
    with pytest.raises(TypeError, match="not a worker protocol event"):
        protocol.handle(Commit(0, 1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the oracle


def legal(protocol: WorkerProtocol, message: Any) -> bool:
    """Whether the coordinator may send ``message`` to ``protocol`` now (docs/protocol.md)."""
    phase, epoch = protocol.phase, protocol.epoch
    kind = message.KIND
    if phase in (Phase.UNJOINED, Phase.LOST, Phase.ENDED):
        return False
    ends = kind in ("shutdown", "abort", "join_refused", "heartbeat")
    if phase in (Phase.JOINING, Phase.REJOINING):
        if kind == "start_run":
            return phase is Phase.JOINING or message.epoch > epoch
        return ends
    if ends:
        return True
    if kind in ("start_run", "hold"):
        return message.epoch > epoch
    if kind == "resync":
        return phase is Phase.RUNNING
    if message.epoch < epoch:
        return True  # a go, commit or apply of an older epoch: dropped
    if phase is Phase.HOLDING or message.epoch > epoch:
        return False  # a hold runs nothing; a newer epoch was never announced
    # A go answers a ready report this worker sent in the epoch.
    return kind != "go" or (message.step, message.bucket) in protocol.awaiting_go


def coordinator_messages(epoch: int) -> st.SearchStrategy[Any]:
    epochs = st.integers(max(0, epoch - 1), epoch + 1)
    steps = st.integers(0, 6)
    start = st.builds(
        lambda e, s: StartRun(addresses=START.addresses, ring=(0, 1), epoch=e, step=s),
        epochs,
        steps,
    )
    return st.one_of(
        start,
        st.builds(Go, steps, st.integers(0, 1), st.integers(0, 9), epochs),
        st.builds(Commit, steps, epochs),
        st.builds(Apply, steps, epochs),
        st.builds(Hold, steps, epochs, st.just("held")),
        st.builds(ResyncOrder, steps, st.just(0), st.just((1,))),
        st.builds(Shutdown, st.sampled_from(["finished", "stopped"])),
        st.builds(AbortRun, st.just("aborted")),
        st.builds(JoinRefused, st.just("refused")),
        st.builds(HeartbeatReceived, st.just(0.0)),
    )


def test_the_oracle_and_the_tables_name_the_same_kinds() -> None:
    kinds = {"start_run", "go", "commit", "apply", "hold", "resync", "shutdown", "abort"}
    kinds |= {"join_refused", "heartbeat"}
    assert set().union(*COORDINATOR_TRANSITIONS.values()) == kinds
    assert set(COORDINATOR_TRANSITIONS) == set(Phase)


# --------------------------------------------------------------------------- the model

WORLD = 2
STEPS = 5
INTERVAL = 2


def state_digest(step: int) -> bytes:
    """The (deterministic) training state's digest once steps 0..step-1 are applied."""
    return b"state-%010d" % step


class Trainer:
    """A worker's trainer as the protocol sees it: it reports buckets, waits for their gos,
    waits for the previous step's commit before its optimizer step, reports the step."""

    def __init__(self) -> None:
        self.step = 0
        """The next step to run: steps 0..step-1 are applied to the weights."""
        self.mode = "idle"  # idle | ready | wait_go | apply | report | finish | done
        self.gos: set[int] = set()
        self.announced: list[StartRun | Hold] = []
        self.epoch_start: StartRun | None = None
        self.verify_due = False


class WiredMachine(RuleBasedStateMachine):
    """Two workers' protocols and a coordinator core, talking through CBOR frame queues."""

    @initialize(drops=st.sampled_from([False, False, True]), elastic=st.booleans())
    def setup(self, drops: bool, elastic: bool = False) -> None:
        self.elastic = elastic
        """An elastic run (min_workers 1): a lost worker ends its epoch, not the run."""
        self.core = self._new_core()
        self.protocols = [WorkerProtocol(rank) for rank in range(WORLD)]
        self.trainers = [Trainer() for _ in range(WORLD)]
        self.up: list[list[bytes]] = [[] for _ in range(WORLD)]
        self.down: list[list[bytes]] = [[] for _ in range(WORLD)]
        self.commits: set[tuple[int, int]] = set()
        """(epoch, step) of every commit a coordinator broadcast."""
        self.reported: dict[tuple[int, int], list[int]] = defaultdict(list)
        """(rank, epoch) -> the steps its step reports named, in sending order."""
        self.restarts = 0
        self.drops_allowed = drops
        self.dropped = False
        self.cut: set[int] = set()
        """Ranks whose link broke for good (this model's coordinator does not re-admit)."""
        self.now = 0.0
        for rank in range(WORLD):
            self._execute(rank, self.protocols[rank].handle(Join(SIG, ("h", rank + 1))))

    # --------------------------------------------------------------- plumbing

    def _execute(self, rank: int, actions: list[WorkerAction]) -> None:
        trainer = self.trainers[rank]
        protocol = self.protocols[rank]
        for action in actions:
            if isinstance(action, Send):
                message = action.message
                if isinstance(message, Digest | StepDone):
                    steps = self.reported[(rank, message.epoch)]
                    assert not steps or message.step > steps[-1], (rank, steps, message)
                    steps.append(message.step)
                kind, fields = message.to_wire()
                self.up[rank].append(encode_frame_bytes(kind, fields))
            elif isinstance(action, Started):
                if not action.rejoined:
                    trainer.announced.append(action.start)
            elif isinstance(action, Announce):
                trainer.announced.append(action.message)
                start = trainer.epoch_start
                if start is not None and start.apply_barrier and trainer.mode == "wait_apply":
                    if protocol.applied >= trainer.step:  # every member holds its gradients
                        self._apply(rank)
                trainer.mode = "idle"  # the step in flight is dropped (the state kept)
            elif isinstance(action, RunGo):
                go = action.go
                assert trainer.mode == "wait_go" and go.step == trainer.step, (rank, go)
                assert go.epoch == protocol.epoch
                trainer.gos.add(go.bucket)
            elif isinstance(action, Ended):
                trainer.mode = "done"
            else:
                assert isinstance(action, Progress), action

    def _new_core(self) -> CoordinatorCore:
        return CoordinatorCore(
            WORLD,
            digest_interval=INTERVAL,
            heartbeat_deadline=1e9,
            min_workers=1 if self.elastic else None,
        )

    def _coordinate(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Broadcast):
                if isinstance(action.message, Commit):
                    self.commits.add((action.message.epoch, action.message.step))
                for rank in self.core.view.members:
                    self._tell(rank, action.message)
            elif isinstance(action, Abort):
                assert self.dropped and not self.elastic, f"the run aborted: {action.reason}"
                for rank in range(WORLD):
                    self._tell(rank, action.message)
            else:
                assert not isinstance(action, Refuse | Evict), action

    def _tell(self, rank: int, message: Any) -> None:
        if rank not in self.cut:  # a broken link carries nothing
            self.down[rank].append(encode_frame_bytes(*message.to_wire()))

    # --------------------------------------------------------------- links

    @rule(rank=st.integers(0, WORLD - 1))
    def deliver_to_coordinator(self, rank: int) -> None:
        if not self.up[rank]:
            return
        frame = self.up[rank].pop(0)
        self.now += 0.01
        event = event_from_wire(decode_frame(frame), rank=rank, now=self.now)
        if isinstance(event, Joined):
            self.cut.discard(rank)  # it dialed again
            trainer = self.trainers[rank]
            # A rejoin presents the state it holds, and the epoch it last took part in.
            if self.protocols[rank].phase is Phase.REJOINING:
                assert (event.step, event.digest) == (trainer.step, state_digest(trainer.step))
                assert event.epoch == self.protocols[rank].epoch
        self._coordinate(self.core.handle(event))

    @rule(rank=st.integers(0, WORLD - 1))
    def deliver_to_worker(self, rank: int) -> None:
        if not self.down[rank]:
            return
        raw = decode_frame(self.down[rank].pop(0))
        self.now += 0.01
        protocol = self.protocols[rank]
        if raw["kind"] == "heartbeat":
            self._execute(rank, protocol.handle(HeartbeatReceived(self.now)))
            return
        message = message_from_wire(raw)
        assert legal(protocol, message), (protocol.phase, protocol.epoch, message)
        self._execute(rank, protocol.handle(Received(message, self.now)))

    @precondition(lambda self: self.restarts < 2)
    @rule()
    def restart_coordinator(self) -> None:
        """The coordinator dies: every queued frame is lost; a fresh one listens."""
        if any(p.phase not in (Phase.RUNNING, Phase.HOLDING) for p in self.protocols):
            return
        self.restarts += 1
        self.core = self._new_core()
        for rank in range(WORLD):
            self.up[rank].clear()
            self.down[rank].clear()
            self._execute(rank, self.protocols[rank].handle(ConnectionLost("coordinator died")))

    @precondition(lambda self: self.drops_allowed and not self.dropped)
    @rule(rank=st.integers(0, WORLD - 1))
    def drop_worker_link(self, rank: int) -> None:
        """One worker's link breaks (its queued frames lost): a static run then aborts, an
        elastic one goes on without it until it rejoins."""
        if self.protocols[rank].phase is not Phase.RUNNING or self.trainers[rank].step < 1:
            return
        self.dropped = True
        self.cut.add(rank)
        self.up[rank].clear()
        self.down[rank].clear()
        self._execute(rank, self.protocols[rank].handle(ConnectionLost("link broke")))
        self._coordinate(self.core.handle(Disconnected(rank, "link broke")))

    @rule(rank=st.integers(0, WORLD - 1))
    def rejoin(self, rank: int) -> None:
        protocol, trainer = self.protocols[rank], self.trainers[rank]
        if protocol.phase is not Phase.LOST or trainer.announced:
            return  # the trainer holds still first (its resume point waits for the hold)
        step = trainer.step
        join = Join(None, None, step, state_digest(step), protocol.epoch)
        self._execute(rank, protocol.handle(join))

    @rule(rounds=st.integers(1, 6), order=st.permutations(range(3 * WORLD)))
    def advance(self, rounds: int, order: list[int]) -> None:
        """Every party moves, in a random interleaving, ``rounds`` times."""
        moves = (self.deliver_to_coordinator, self.deliver_to_worker, self.train)
        for _ in range(rounds):
            for index in order:
                moves[index % 3](index // 3)

    @rule(rank=st.integers(0, WORLD - 1))
    def heartbeat(self, rank: int) -> None:
        self._execute(rank, self.protocols[rank].handle(HeartbeatDue(self.now)))

    # --------------------------------------------------------------- the trainer

    @rule(rank=st.integers(0, WORLD - 1))
    def train(self, rank: int) -> None:
        """The trainer's next move, if it can make one."""
        protocol, trainer = self.protocols[rank], self.trainers[rank]
        handle = protocol.handle
        if trainer.announced and trainer.mode in ("idle", "ready", "finish"):
            self._enter(rank, trainer.announced.pop(0))
            return
        start = trainer.epoch_start
        if start is None or protocol.phase is not Phase.RUNNING or start.epoch != protocol.epoch:
            return
        epoch = start.epoch
        if trainer.verify_due:  # the epoch's opening check of the state it starts from
            trainer.verify_due = False
            check = ReportDigest(start.step - 1, state_digest(trainer.step), b"", epoch, ())
            self._execute(rank, handle(check))
        elif trainer.mode == "ready":
            if trainer.step >= STEPS:
                trainer.mode = "finish"
                return
            for bucket, spec in enumerate(SPECS):
                self._execute(rank, handle(ReportReady(trainer.step, bucket, spec, epoch)))
            trainer.mode, trainer.gos = "wait_go", set()
        elif trainer.mode == "wait_go" and len(trainer.gos) == len(SPECS):
            trainer.mode = "reduce" if start.apply_barrier else "apply"
        elif trainer.mode == "reduce" and protocol.committed >= trainer.step - 1:
            self._execute(rank, handle(ReportReduced(trainer.step, epoch)))
            trainer.mode = "wait_apply"
        elif trainer.mode == "wait_apply" and protocol.applied >= trainer.step:
            self._apply(rank)
        elif trainer.mode == "apply" and protocol.committed >= trainer.step - 1:
            self._apply(rank)
        elif trainer.mode == "report":
            step = trainer.step - 1
            if step % INTERVAL == 0:
                report: Any = ReportDigest(step, state_digest(trainer.step), b"", epoch, ())
            else:
                report = ReportStepDone(step, epoch)
            self._execute(rank, handle(report))
            trainer.mode = "ready"  # step s+1 may report before step s commits
        elif trainer.mode == "finish" and protocol.committed >= trainer.step - 1:
            self._execute(rank, handle(ReportFinished(trainer.step, epoch)))
            trainer.mode = "finished"

    def _apply(self, rank: int) -> None:
        """The optimizer step: no weight moves before the previous step's commit (by the
        coordinator in this epoch, or the state the epoch started from)."""
        trainer, start = self.trainers[rank], self.trainers[rank].epoch_start
        assert start is not None
        previous = trainer.step - 1
        baseline = start.step - 2 if start.verify else start.step - 1
        assert previous <= baseline or (start.epoch, previous) in self.commits, (rank, previous)
        trainer.step += 1
        trainer.mode = "report"

    def _enter(self, rank: int, message: StartRun | Hold) -> None:
        trainer = self.trainers[rank]
        if isinstance(message, Hold):
            trainer.epoch_start, trainer.mode = None, "idle"
            return
        start = message
        if start.donor >= 0 and rank in start.receivers:
            trainer.step = start.step  # the donor's whole state arrives
        elif start.broadcast:
            trainer.step = start.step
        assert trainer.step == start.step, (rank, trainer.step, start)
        self._execute(rank, self.protocols[rank].handle(EnterEpoch(start)))
        trainer.epoch_start, trainer.mode = start, "ready"
        trainer.verify_due = start.verify

    # --------------------------------------------------------------- probes and invariants

    @rule(rank=st.integers(0, WORLD - 1), data=st.data())
    def probe(self, rank: int, data: st.DataObject) -> None:
        """Any coordinator message: what the tables forbid is a ProtocolError naming the
        coordinator, the kind and the step; what they allow goes through."""
        protocol = copy.deepcopy(self.protocols[rank])
        message = data.draw(coordinator_messages(protocol.epoch))
        if isinstance(message, HeartbeatReceived):
            event: Any = message
        else:
            event = Received(message, self.now)
        if legal(protocol, message):
            protocol.handle(event)
            return
        with pytest.raises(ProtocolError) as caught:
            protocol.handle(event)
        error = caught.value
        assert error.peer == "coordinator"
        assert message.KIND in error.reason and protocol.phase.value in error.reason
        if hasattr(message, "step"):
            assert f"step {message.step}" in error.reason

    @invariant()
    def counters_follow_the_coordinators_commits(self) -> None:
        for protocol in self.protocols:
            start = protocol.start
            if start is None:
                continue
            baseline = start.step - 2 if start.verify else start.step - 1
            assert protocol.committed <= baseline or (start.epoch, protocol.committed) in (
                self.commits
            ), (protocol.committed, start)

    @invariant()
    def an_honest_run_never_aborts(self) -> None:
        if self.elastic or not self.dropped:
            assert self.core.view.state is not RunState.ABORTED, self.core.view.abort_reason

    @invariant()
    def a_finished_run_ends_everyone_at_the_same_state(self) -> None:
        if self.core.view.state is RunState.FINISHED and not any(self.down):
            members = self.core.view.members
            assert {self.trainers[rank].step for rank in members} == {STEPS}
            assert all(self.protocols[rank].phase is Phase.ENDED for rank in members)


WiredMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=120, deadline=None)
TestWiredMachine = WiredMachine.TestCase


@pytest.mark.parametrize("elastic", [False, True])
def test_an_uninterrupted_run_reaches_its_end(elastic: bool) -> None:
    """The model's trainer finishes a run: the wiring is not vacuous."""
    machine = WiredMachine()
    machine.setup(drops=False, elastic=elastic)
    for _ in range(400):
        for rank in range(WORLD):
            machine.deliver_to_coordinator(rank)
            machine.deliver_to_worker(rank)
            machine.train(rank)
        machine.counters_follow_the_coordinators_commits()
        machine.an_honest_run_never_aborts()
    assert machine.core.view.state is RunState.FINISHED
    machine.a_finished_run_ends_everyone_at_the_same_state()
    assert machine.reported[(0, 1)] == list(range(STEPS))
    assert spec_hash(SPECS[0]).startswith("xxh3:")


@pytest.mark.parametrize("elastic", [False, True])
def test_a_run_survives_a_coordinator_restart_and_a_lost_link_when_elastic(elastic: bool) -> None:
    """Scripted: the coordinator restarts mid-run, every worker rejoins with what it holds
    and the run finishes; in an elastic run a worker's link then breaks and it rejoins."""
    machine = WiredMachine()
    machine.setup(drops=elastic, elastic=elastic)

    def run(rounds: int, until: Any = lambda: False) -> None:
        for _ in range(rounds):
            if until():
                return
            for rank in range(WORLD):
                machine.rejoin(rank)
                machine.deliver_to_coordinator(rank)
                machine.deliver_to_worker(rank)
                machine.train(rank)
            machine.counters_follow_the_coordinators_commits()
            machine.an_honest_run_never_aborts()

    run(400, lambda: min(t.step for t in machine.trainers) >= 2)
    machine.restart_coordinator()
    assert machine.restarts == 1
    assert all(p.phase is Phase.LOST for p in machine.protocols)
    run(400, lambda: machine.core.view.epoch >= 2 and min(t.step for t in machine.trainers) >= 3)
    assert machine.core.view.epoch >= 2
    if elastic:
        machine.drop_worker_link(1)
        assert machine.dropped and machine.protocols[1].phase is Phase.LOST
    run(600)
    assert machine.core.view.state is RunState.FINISHED
    machine.a_finished_run_ends_everyone_at_the_same_state()
    assert {t.step for t in machine.trainers} == {STEPS}
