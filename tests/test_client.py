"""The worker's side of the control link (`paramsync.actors.client.client`): deferred reads, and a
lost coordinator's redials.

The test plays the coordinator on the other end of an in-process link, on trio's mock clock.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing

from paramsync.actors.client.client import CoordinatorClient, CoordinatorLost
from paramsync.actors.client.protocol import Phase
from paramsync.actors.graph.messages import OptimizerStep, Verify
from paramsync.actors.graph.optimizer import OptimizerActor
from paramsync.actors.train.trainer import TrainerOptions
from paramsync.runtime.actor.base import ActorSystem
from paramsync.runtime.errors import FrameAuthenticationError
from paramsync.runtime.observe.trace import TraceRecorder
from paramsync.runtime.protocol.messages import Commit, StartRun
from paramsync.runtime.transport.link import MemoryLink

_EPOCH_0 = StartRun(addresses=(("in-process", 1),), ring=(0,), epoch=0)
"""An epoch the tests' client takes part in without a join."""


async def _send(link: MemoryLink, message: Commit) -> None:
    kind, fields = message.to_wire()
    await link.send(kind, fields)


async def _committed(client: CoordinatorClient, step: int) -> bool:
    """Whether ``step``'s commit has been read (without waiting for it)."""
    with trio.move_on_after(0.001) as scope:
        await client.wait_commit(step)
    return not scope.cancelled_caught


async def test_messages_wait_while_reads_are_deferred_and_are_read_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    coordinator, worker = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(worker, rank=0, heartbeat_seconds=5.0)
    client.begin_epoch(_EPOCH_0)  # attached to a conversation under way: no join
    async with trio.open_nursery() as nursery:
        await nursery.start(client.serve)
        await _send(coordinator, Commit(step=0, epoch=0))
        await trio.testing.wait_all_tasks_blocked()
        assert await _committed(client, 0)  # read at once

        with client.reads_deferred():  # the reader is waiting: its wait is called off
            await _send(coordinator, Commit(step=1, epoch=0))
            await trio.sleep(12)
            assert not await _committed(client, 1)
            with client.reads_deferred():  # nested blocks: reads resume after the outer
                pass
            await trio.testing.wait_all_tasks_blocked()
            assert not await _committed(client, 1)
            # Heartbeats still leave on time meanwhile (12 s at one per 5 s).
            beats = 0
            for _ in range(2):
                with trio.move_on_after(0.001):
                    beats += (await coordinator.recv())["kind"] == "heartbeat"
            assert beats == 2
        with trio.fail_after(1):
            await client.wait_commit(1)  # read as soon as the block ended
        nursery.cancel_scope.cancel()


async def test_the_silence_deadline_still_holds_outside_deferred_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reader that waits for readability still notices a coordinator gone silent."""
    _coordinator, worker = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(worker, rank=0, heartbeat_seconds=100.0)
    client.begin_epoch(StartRun(addresses=(("127.0.0.1", 1),), ring=(0,), heartbeat_deadline=3))
    with pytest.raises(ExceptionGroup) as info:
        with trio.fail_after(10):
            await client.serve()
    assert info.group_contains(CoordinatorLost, match="sent nothing for 3 s")


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model, optimizer


async def test_an_optimizer_step_waits_for_the_previous_steps_commit() -> None:
    """Step s's report leaves without waiting; step s+1's weights change only once step s is
    committed everywhere (C-DDP-001: the check compares states no step has moved on from).
    On the real clock: the optimizer step runs on a thread, which a mock clock would not
    wait for."""
    coordinator, worker = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(worker, rank=0, heartbeat_seconds=100.0)
    client.begin_epoch(_EPOCH_0)
    model, optimizer = _model_and_optimizer()
    actor = OptimizerActor(
        model, optimizer, client, TrainerOptions(), TraceRecorder.disabled(), epoch=0
    )
    async with trio.open_nursery() as nursery, ActorSystem() as system:
        await nursery.start(client.serve)
        await system.start(actor)
        await _send(coordinator, Commit(step=0, epoch=0))
        await actor.ask(OptimizerStep(1))
        after_1 = model.weight.detach().clone()
        await actor.tell(Verify(1))
        report = await coordinator.recv()
        while report["kind"] == "heartbeat":
            report = await coordinator.recv()
        assert (report["kind"], report["step"]) == ("digest", 1)

        for param in model.parameters():  # step 2's gradients (step 1 zeroed them)
            param.grad.fill_(1.0)
        applied = trio.Event()

        async def step_2() -> None:
            await actor.ask(OptimizerStep(2))
            applied.set()

        nursery.start_soon(step_2)
        await trio.sleep(0.5)
        assert not applied.is_set()
        assert torch.equal(model.weight, after_1)  # no weight moved before the commit
        await _send(coordinator, Commit(step=1, epoch=0))
        with trio.fail_after(30):
            await applied.wait()
        assert not torch.equal(model.weight, after_1)
        nursery.cancel_scope.cancel()


async def test_an_optimizer_step_with_verify_reports_its_digest_before_answering() -> None:
    """``OptimizerStep(verify=True)`` (the trainer's overlapped check): the step's digest is
    on its way to the coordinator by the time the step is answered, with no `Verify` told;
    a step off the digest interval reports its end instead."""
    coordinator, worker = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(worker, rank=0, heartbeat_seconds=100.0)
    client.begin_epoch(
        StartRun(addresses=(("in-process", 1),), ring=(0,), epoch=0, digest_interval=2)
    )
    model, optimizer = _model_and_optimizer()
    actor = OptimizerActor(
        model, optimizer, client, TrainerOptions(), TraceRecorder.disabled(), epoch=0
    )

    async def next_report() -> dict[str, Any]:
        with trio.move_on_after(0.001):  # already sent: no wait
            while (report := await coordinator.recv())["kind"] == "heartbeat":
                pass
            return report
        raise AssertionError("no report was waiting")

    async with trio.open_nursery() as nursery, ActorSystem() as system:
        await nursery.start(client.serve)
        await system.start(actor)
        await _send(coordinator, Commit(step=1, epoch=0))
        await actor.ask(OptimizerStep(2, verify=True))
        report = await next_report()
        assert (report["kind"], report["step"]) == ("digest", 2)
        assert client.digest_interval == 2 and actor.last_digest == report["digest"]
        await _send(coordinator, Commit(step=2, epoch=0))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        await actor.ask(OptimizerStep(3, verify=True))
        report = await next_report()
        assert (report["kind"], report["step"]) == ("step_done", 3)
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- a lost coordinator


async def test_workers_losing_one_coordinator_spread_their_redials(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A herd of workers that lose the coordinator at one instant redial with jitter, so a
    restarted coordinator is not met by all of them at once; each gives up on time."""
    redials: dict[int, list[float]] = {rank: [] for rank in range(4)}
    outcomes: dict[int, BaseException] = {}

    async def worker(rank: int, link: MemoryLink) -> None:
        async def redial() -> MemoryLink:
            redials[rank].append(trio.current_time())
            raise ConnectionRefusedError("nobody listens")

        client = CoordinatorClient(link, rank, redial=redial, reconnect_seconds=3.0)
        client.begin_epoch(_EPOCH_0)
        try:
            await client.serve()
        except CoordinatorLost as exc:
            outcomes[rank] = exc

    coordinator_ends = []
    async with trio.open_nursery() as nursery:
        for rank in range(4):
            theirs, mine = MemoryLink.pair("worker", "coordinator")
            coordinator_ends.append(theirs)
            nursery.start_soon(worker, rank, mine)
        await trio.testing.wait_all_tasks_blocked()
        lost_at = trio.current_time()
        for link in coordinator_ends:  # the coordinator dies
            await link.aclose()
    assert {rank: str(exc) for rank, exc in outcomes.items()} == dict.fromkeys(
        range(4),
        "peer coordinator: the coordinator did not come back within 3 s (last: nobody listens)",
    )
    assert all(times[0] == lost_at for times in redials.values())  # at once, then backing off
    assert len({times[1] for times in redials.values()}) == 4  # jitter: no two alike
    assert all(len(times) >= 4 for times in redials.values())


class _TamperedLink:
    """A worker's link whose next frame fails authentication (an on-path relay altered it):
    the connection reports it as `Connection.recv` does, and is closed under the reader."""

    def __init__(self, inner: MemoryLink) -> None:
        self.inner = inner
        self.peer = inner.peer

    async def send(self, kind: str, fields: Any, bulk: Any = None) -> None:
        await self.inner.send(kind, fields, bulk)

    async def wait_readable(self) -> None:
        await self.inner.wait_readable()

    async def recv(self, max_frame: int = 0) -> dict[str, Any]:
        await self.inner.aclose()
        raise FrameAuthenticationError(
            "frame authentication failed on frame 3 (40 bytes)", peer=self.peer
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_frame_failing_authentication_makes_the_worker_redial_not_fail(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tampered frame from the coordinator closes the link unread; with a ``redial`` the
    worker treats it as a lost link (a new handshake, new keys) rather than failing the run."""
    redials: list[float] = []

    async def redial() -> MemoryLink:
        redials.append(trio.current_time())
        raise ConnectionRefusedError("nobody listens")

    coordinator, mine = MemoryLink.pair("worker", "coordinator")
    client = CoordinatorClient(_TamperedLink(mine), 0, redial=redial, reconnect_seconds=2.0)
    client.begin_epoch(_EPOCH_0)
    await _send(coordinator, Commit(step=0, epoch=0))  # the frame the relay tampers with
    with pytest.raises(CoordinatorLost) as lost:
        await client.serve()
    assert redials[0] == 0.0, "the worker did not redial at once after the tampered frame"
    assert "did not come back within 2 s" in str(lost.value)
    await coordinator.aclose()


async def test_reports_of_a_step_in_flight_are_dropped_while_the_coordinator_is_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With the coordinator gone the trainer holds; its reports neither wait nor fail."""
    theirs, mine = MemoryLink.pair("worker", "coordinator")
    redialing = trio.Event()

    async def redial() -> MemoryLink:
        redialing.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    client = CoordinatorClient(mine, 0, redial=redial, heartbeat_seconds=100.0)
    client.begin_epoch(_EPOCH_0)
    held: list[object] = []
    client.on_epoch = held.append
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.serve)
        await theirs.aclose()
        await redialing.wait()
        assert client.protocol.phase is Phase.LOST
        assert [type(message).__name__ for message in held] == ["Hold"]
        with trio.fail_after(0.001):
            await client.step_done(0, 0)
            await client.digest(1, b"d" * 16, b"", 0, names=())
        assert client.protocol.stale == 2
        nursery.cancel_scope.cancel()
