"""Fault-injection trials with real worker processes (paramsync.runtime.testing.fault_trials), and
the wrappers that inject the faults (paramsync.runtime.testing.faults,
paramsync.actors.testing.faults).

Hypothesis picks where a worker is SIGKILLed (phase and step); every trial must end with the
survivors bitwise identical and equal to a reference run with the same membership history. A
bounded number of trials runs in ``make test``; ``make soak`` runs many more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_trainer import RUN_SECONDS, RecordingDataset, mse_loss, tiny_replica

from paramsync.actors.graph.compute import ComputeActor
from paramsync.actors.graph.factory import ActorFactory, actors_in_context, context_actors
from paramsync.actors.graph.gradcomm import GradCommActor
from paramsync.actors.graph.loader import DataLoaderActor
from paramsync.actors.graph.optimizer import OptimizerActor
from paramsync.actors.testing.faults import faulty_actors
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.actors.train.worker import train_in_process
from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.coordinator.core import CoordinatorCore
from paramsync.runtime.coordinator.events import Broadcast, Event
from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.protocol.messages import Commit, Digest, Joined, Ready
from paramsync.runtime.testing.fault_trials import (
    JOB_FLAGS,
    run_coordinator_restart_trial,
    run_trial,
)
from paramsync.runtime.testing.faults import (
    PHASES,
    Fault,
    FaultyTransport,
    commit_fault_core,
    parse_fault,
)
from paramsync.runtime.testing.faulty_daemon import arm
from paramsync.runtime.transport.base import InProcessTransport
from paramsync.runtime.transport.capabilities import BlockingLinkProvider, SharedMemoryHolder

_REFERENCES: dict[int, str] = {}


def reference_digest(step: int) -> str:
    """The final model of a run whose last worker is killed before it touches ``step``."""
    if step not in _REFERENCES:
        reference = run_trial("data", step)
        assert reference.ok, reference.problems
        _REFERENCES[step] = next(iter(reference.digests.values()))
    return _REFERENCES[step]


def check_trial(phase: str, step: int) -> None:
    result = run_trial(phase, step)
    assert result.ok, result.problems
    assert result.resumed_at in (step, step + 1)
    if phase in ("data", "forward", "backward"):
        assert result.resumed_at == step  # nothing of the step was applied: it is rerun
    if phase == "digest":
        assert result.resumed_at == step + 1  # applied everywhere before the digest
    assert result.detection_seconds is not None and result.detection_seconds < 3.0
    assert set(result.digests.values()) == {reference_digest(result.resumed_at)}


@pytest.mark.soak  # two 18 s trials; the all-reduce and optimizer kills below stay in make test
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(phase=st.sampled_from(PHASES), step=st.sampled_from([2, 3]))
def test_a_killed_worker_is_survived_at_any_phase(phase: str, step: int) -> None:
    check_trial(phase, step)


@pytest.mark.parametrize("phase", ["allreduce", pytest.param("optimizer", marks=pytest.mark.soak)])
def test_a_worker_killed_mid_all_reduce_or_optimizer_is_survived(phase: str) -> None:
    check_trial(phase, 2)


@pytest.mark.soak  # a 25 s trial; live rejoin stays covered by the trainer's in-process tests
def test_a_killed_worker_restarts_rejoins_live_and_matches_everyone() -> None:
    """~40 s. It failed once in three runs under load in session 2 (the coordinator exited 1
    on a reset connection; not reproduced since). Two epoch-change races were fixed after that
    (an event swapped under a waiting step; an ending epoch's actor failure taken for the
    step's own) and 4 of 4 runs passed."""
    flags = list(JOB_FLAGS)
    flags[flags.index("--steps") + 1] = "1500"  # long enough for a process to start again
    result = run_trial("backward", 2, rejoin=True, job_flags=flags, timeout=240)
    assert result.ok, result.problems
    assert result.exit_codes["rejoined"] == 0
    assert len(set(result.digests.values())) == 1 and len(result.digests) == 3
    members = [tuple(e["members"]) for e in result.epochs]
    assert members[0] == (0, 1, 2) and (0, 1) in members and members[-1] == (0, 1, 2)


@pytest.mark.soak  # a 29 s daemon trial; test_coordinator_restart.py covers restarts
def test_the_coordinator_killed_and_restarted_the_run_resumes_and_finishes() -> None:
    """SIGKILL of the coordinator daemon as it commits step 3; a new one on the same port.
    Every worker redials, rejoins with its step and digest, and finishes with the model of a
    run that was never interrupted."""
    result = run_coordinator_restart_trial(3)
    assert result.ok, result.problems
    assert result.exit_codes["coordinator"] == -9
    assert result.exit_codes["restarted coordinator"] == 0
    assert [e["members"] for e in result.epochs] == [[0, 1, 2], [0, 1, 2]]
    assert result.recovery_seconds is not None
    reference = run_coordinator_restart_trial(None)
    assert reference.ok, reference.problems
    assert len(reference.epochs) == 1
    assert set(result.digests.values()) == set(reference.digests.values())


def test_parse_fault_names_the_problem() -> None:
    assert parse_fault("backward:3") == ("backward", 3)
    assert parse_fault("commit:4") == ("commit", 4)
    assert parse_fault("") is None
    with pytest.raises(ValueError, match="PHASE:STEP"):
        parse_fault("sideways:3")
    with pytest.raises(ValueError, match="PHASE:STEP"):
        parse_fault("backward:x")


@pytest.mark.soak
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.integers(0, 6))
def test_soak_coordinator_restarted_at_random_commits(step: int) -> None:
    result = run_coordinator_restart_trial(step)
    assert result.ok, result.problems
    assert set(result.digests.values()) == {coordinator_reference()}


_COORDINATOR_REFERENCE: list[str] = []


def coordinator_reference() -> str:
    """The final model of the trial job never interrupted."""
    if not _COORDINATOR_REFERENCE:
        reference = run_coordinator_restart_trial(None)
        assert reference.ok, reference.problems
        _COORDINATOR_REFERENCE.append(next(iter(reference.digests.values())) or "")
    return _COORDINATOR_REFERENCE[0]


@pytest.mark.soak
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(phase=st.sampled_from(PHASES), step=st.integers(1, 6))
def test_soak_killed_workers_at_random_points(phase: str, step: int) -> None:
    check_trial(phase, step)


class _Killed(Exception):
    """What a `Fault` that records instead of killing raises (in-process tests)."""


class _RecordedFault(Fault):
    def kill(self) -> None:
        raise _Killed(f"{self.phase}:{self.step}")


def test_fault_parse_and_strike_only_at_its_point() -> None:
    fault = Fault.parse("optimizer:4", stamp="/tmp/x")
    assert (fault.phase, fault.step, fault.stamp) == ("optimizer", 4, "/tmp/x")
    assert fault.at("optimizer", 4) and not fault.at("optimizer", 3)
    assert not fault.at("digest", 4)
    with pytest.raises(ValueError, match="PHASE:STEP"):
        Fault.parse("")
    recorded = _RecordedFault("digest", 2)
    recorded.strike("digest", 1)
    recorded.strike("optimizer", 2)
    with pytest.raises(_Killed, match="digest:2"):
        recorded.strike("digest", 2)


@dataclass(frozen=True)
class _ReachedFault(Fault):
    """A `Fault` that records each time it would have killed the process, and lets it run on."""

    reached: list[tuple[str, int]] = field(default_factory=list, compare=False)

    def kill(self) -> None:
        self.reached.append((self.phase, self.step))


@pytest.mark.parametrize("phase", PHASES)
async def test_every_declared_kill_point_is_reached(phase: str) -> None:
    """Each phase a trial may kill a worker at is reached, in a 2-rank in-process run of
    `DistributedTrainer.fit` with the same wrapped actors a faulty worker daemon arms
    (`faulty_actors`, only the kill recorded). A code path that moves away from its wrapper
    fails here, in ``make test``, not in a soak run by hand (a digest moved into the optimizer
    step would otherwise leave every ``digest:N`` trial killing no one)."""
    fault = _ReachedFault(phase, 2)

    async def body(trainer: DistributedTrainer) -> int:
        await trainer.fit(RecordingDataset(24), 2, steps=4)
        return trainer.step

    with trio.fail_after(RUN_SECONDS):
        steps = await train_in_process(2, tiny_replica, mse_loss, body, actors=faulty_actors(fault))
    assert steps == [4, 4]
    assert (phase, 2) in fault.reached, f"the kill point {phase}:2 was never reached"


class _PlaneHolder(InProcessTransport, SharedMemoryHolder):
    """An in-process transport that can carry a shared-memory plane (never sends frames)."""

    shared_memory = None
    stall_seconds = 1.0

    async def send_frame(self, peer: int, frame: bytes) -> None:
        raise NotImplementedError

    async def recv_matching(self, peer: int, expected: bytes) -> dict | None:
        raise NotImplementedError


async def test_faulty_transport_reduces_like_its_transport_and_dies_after_a_frame_once_armed() -> (
    None
):
    inner = InProcessTransport.create_group(3)
    wrapped = [FaultyTransport(t, _RecordedFault("allreduce", 1)) for t in inner]
    tensors = [torch.arange(40_000, dtype=torch.float32) * (rank + 1) for rank in range(3)]
    async with trio.open_nursery() as nursery:
        for rank in range(3):
            nursery.start_soon(partial(all_reduce, wrapped[rank], tensors[rank], "avg"))
    assert all(torch.equal(t, torch.arange(40_000, dtype=torch.float32) * 2) for t in tensors)
    # The wrapper shares its transport's op ids: a collective on either stays in step.
    assert [w.next_op_id() for w in wrapped] == [t._op_counter - 1 for t in inner]
    assert not isinstance(wrapped[0], BlockingLinkProvider)  # it lends no blocking links
    (holder,) = _PlaneHolder.create_group(1)
    around = FaultyTransport(holder, _RecordedFault("allreduce", 1))
    assert isinstance(around, SharedMemoryHolder) and around.shared_memory is None
    holder.shared_memory = plane = object()  # type: ignore[assignment]
    assert around.shared_memory is plane  # the collectives find the wrapped plane
    wrapped[0].arm()
    with pytest.raises(_Killed):
        await wrapped[0].send(1, "coll", {"op": 99, "hop": 0, "part": 0}, torch.ones(2))
    message = await inner[1].recv(0)
    assert (message["kind"], message["op"]) == ("coll", 99)  # it left before the process died


def test_the_daemon_is_armed_only_for_its_own_kind_of_fault() -> None:
    with (
        pytest.raises(ValueError, match="starts no coordinator"),
        arm(Fault("commit", 3), ["worker", "--rank", "1"]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="starts no worker"),
        arm(Fault("forward", 3), ["coordinator", "--world-size", "3"]),
    ):
        pass
    with (
        pytest.raises(ValueError, match="cannot be imported"),
        arm(Fault("forward", 3), ["worker"], worker_faults="no.such.module"),
    ):
        pass
    with arm(Fault("commit", 3), ["coordinator"]) as main_options:
        core_type = main_options["coordinator_core"]
        assert issubclass(core_type, CoordinatorCore)
        assert core_type is not CoordinatorCore
        assert context_actors() == ActorFactory()  # a coordinator's fault arms no worker
    with arm(Fault("forward", 3), ["worker"]) as main_options:
        assert main_options == {}
        factory = context_actors()
        assert factory.compute is not ComputeActor
        assert (factory.comm, factory.optimizer, factory.loader) == (
            GradCommActor,
            OptimizerActor,
            DataLoaderActor,
        )
    assert context_actors() == ActorFactory()  # nothing outlives the block


def test_actors_in_context_takes_a_factory_and_nests() -> None:
    with pytest.raises(TypeError, match="takes an ActorFactory, not type"):
        with actors_in_context(ComputeActor):  # type: ignore[arg-type]
            pass
    outer, inner = faulty_actors(Fault("data", 1)), faulty_actors(Fault("optimizer", 1))
    with actors_in_context(outer):
        with actors_in_context(inner):
            assert context_actors() is inner
        assert context_actors() is outer
    assert context_actors() == ActorFactory()


def test_a_coordinator_builds_the_core_it_is_given() -> None:
    with arm(Fault("commit", 3), ["coordinator"]) as main_options:
        core_type = main_options["coordinator_core"]
    assert type(Coordinator(2, core_type=core_type).core) is core_type
    assert type(Coordinator(2).core) is CoordinatorCore


def test_faulty_actors_wrap_only_the_phase_s_actor() -> None:
    assert faulty_actors(Fault("allreduce", 1)).compute is ComputeActor
    assert faulty_actors(Fault("allreduce", 1)).comm is not GradCommActor
    assert faulty_actors(Fault("data", 1)).loader is not DataLoaderActor
    assert faulty_actors(Fault("digest", 1)).optimizer is not OptimizerActor
    with pytest.raises(ValueError, match="a worker's phase"):
        faulty_actors(Fault("commit", 1))


def test_commit_fault_core_dies_when_it_commits_its_step() -> None:
    """The wrapped core answers every event like the plain one until the actions it returns
    commit the fault's step: it dies before returning them (before anyone hears of it)."""
    signature = (("w", (4, 4), "float32", True),)
    spec = (((4, 4), "float32"),)
    events: list[Event] = [
        Joined(rank, signature, ("10.0.0.1", 7000 + rank), now=0.0) for rank in (0, 1)
    ]
    for step in (0, 1):
        events += [Ready(rank, step, 0, spec) for rank in (0, 1)]
        events += [Digest(rank, step, b"d%d" % step, (("w", b"w%d" % step),)) for rank in (0, 1)]
    plain = CoordinatorCore(2, heartbeat_deadline=10.0)
    faulty = commit_fault_core(_RecordedFault("commit", 1))(2, heartbeat_deadline=10.0)
    commits = []
    for event in events[:-1]:
        actions = plain.handle(event)
        assert faulty.handle(event) == actions
        commits += [
            a.message.step for a in actions if isinstance(getattr(a, "message", None), Commit)
        ]
    assert commits == [0]
    assert any(
        isinstance(a.message, Commit) for a in plain.handle(events[-1]) if isinstance(a, Broadcast)
    )
    with pytest.raises(_Killed, match="commit:1"):
        faulty.handle(events[-1])
