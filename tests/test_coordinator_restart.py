"""A coordinator that dies mid-run and restarts: workers keep their state, redial with backoff,
rejoin with (step, digest, epoch), and the run resumes and finishes as if nothing happened.

In one trio run: each worker's control link is a `MemoryLink`, and its ``redial`` fails like a
refused TCP dial until the replacement coordinator is up. A coordinator that goes silent (hung,
cut off) is noticed through its missing heartbeats. The multi-process form (real SIGKILL of the
coordinator daemon) is in tests/test_fault_trials.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import trio
from torch import nn

from paramsync.actors.client.client import CoordinatorClient, CoordinatorLost
from paramsync.actors.state.digest import state_digest
from paramsync.actors.train.trainer import DistributedTrainer, TrainerOptions
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.events import model_signature
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.protocol.messages import StartRun
from paramsync.runtime.transport.base import InProcessTransport, Transport
from paramsync.runtime.transport.link import Link, MemoryLink

WORLD = 3
STEPS = 8
DEADLINE = 1.0


class Masked(nn.Module):
    """A small net with a bool buffer (the wire has no bool dtype: it travels as uint8)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        self.register_buffer("mask", torch.tensor([True, False]))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs) * self.mask


def replica() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = Masked()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def batch(step: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + position)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def loss_fn(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = data
    return nn.functional.mse_loss(model(inputs), targets)


class Cluster:
    """Workers that redial whichever coordinator is up; the test kills and restarts it."""

    def __init__(
        self, restart_at: int | None, stray: int | None = None, *, ahead: bool = False
    ) -> None:
        self.restart_at = restart_at
        self.stray = stray
        """This rank's state is damaged while the coordinator is down (its digest differs);
        then every worker waits at ``restart_at`` for the restart."""
        self.ahead = ahead
        """The stray rank's damaged state is also one step ahead of the others (a step it
        took alone, never checked): the donor rule rolls it back (tests/test_donor_rule.py)."""
        self.arrived = 0
        self.restarted = trio.Event()
        self.masks: dict[int, torch.Tensor] = {}
        self.up = True
        self.pending_send, self.pending = trio.open_memory_channel[tuple[int, MemoryLink]](64)
        self.groups: dict[int, list[Transport]] = {}
        self.digests: dict[int, bytes] = {}
        self.steps: dict[int, int] = {}
        self.reconnects: dict[int, int] = {}
        self.epochs: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
        self.reached = trio.Event()
        self.redial_refusals = 0

    def options(self) -> CoordinatorOptions:
        return CoordinatorOptions(heartbeat_deadline=DEADLINE)

    async def dial(self, rank: int) -> Link:
        if not self.up:
            self.redial_refusals += 1
            raise ConnectionRefusedError(f"nobody listens for rank {rank}")
        theirs, mine = MemoryLink.pair("coordinator", f"rank {rank}")
        await self.pending_send.send((rank, theirs))
        return mine

    async def coordinator(self) -> None:
        """Serve one coordinator life: gather every rank's link, run until the run ends."""
        links: dict[int, Link] = {}
        while len(links) < WORLD:
            rank, link = await self.pending.receive()
            links[rank] = link
        await Coordinator(WORLD, self.options()).serve_links(links)

    async def worker(self, rank: int) -> None:
        model, optimizer = replica()
        client = CoordinatorClient(
            await self.dial(rank),
            rank,
            redial=lambda: self.dial(rank),
            reconnect_seconds=30.0,
        )
        await client.join(model_signature(model.named_parameters()), ("in-process", rank + 1))

        async def connect(start: StartRun) -> Transport:
            if start.epoch not in self.groups:
                self.groups[start.epoch] = list(InProcessTransport.create_group(len(start.members)))
            return self.groups[start.epoch][start.position(rank)]

        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            async with DistributedTrainer.open(
                model,
                optimizer,
                loss_fn,
                DistributedConfig(WORLD, rank),
                None,
                client,
                TrainerOptions(),
                connect=connect,
            ) as trainer:
                if rank == self.stray:
                    resume_point = client.resume_point
                    assert resume_point is not None

                    async def damaged() -> tuple[int, bytes]:
                        with torch.no_grad():
                            model.body[0].weight.add_(1.0)
                            model.mask.logical_not_()
                        if self.ahead:
                            trainer.run.step += 1
                        return await resume_point()

                    client.resume_point = damaged
                while trainer.step < STEPS:
                    await trainer.train_batch(batch(trainer.step, trainer.supervisor.position))
                    if trainer.step != self.restart_at:
                        continue
                    if self.stray is None:
                        if rank == 0:
                            self.reached.set()
                        continue
                    await trainer.verified()
                    self.arrived += 1
                    if self.arrived == WORLD:
                        self.reached.set()
                    await self.restarted.wait()
                await trainer.finish()
                self.epochs[rank] = list(trainer.run.epochs)
        # The run is over for this worker: its end of the link closes, as a worker process's
        # does when it exits, and the coordinator stops at once instead of waiting out its
        # flush period (5 s) for members that would never leave.
        await client.link.aclose()
        self.digests[rank] = state_digest(model, optimizer).digest
        self.masks[rank] = model.mask.clone()
        self.steps[rank] = trainer.step
        self.reconnects[rank] = client.reconnects

    async def run(self) -> None:
        first_life = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._first_life, first_life)
            for rank in range(WORLD):
                nursery.start_soon(self.worker, rank)
            if self.restart_at is None:
                return
            await self.reached.wait()
            # Kill the coordinator: its links close, the workers see it gone.
            self.up = False
            first_life.cancel()
            await trio.sleep(0.3)  # the redials are refused meanwhile
            self.up = True
            nursery.start_soon(self.coordinator)
            self.restarted.set()

    async def _first_life(self, scope: trio.CancelScope) -> None:
        with scope:
            await self.coordinator()


async def run_cluster(
    restart_at: int | None, stray: int | None = None, *, ahead: bool = False
) -> Cluster:
    cluster = Cluster(restart_at, stray, ahead=ahead)
    with trio.fail_after(60):
        await cluster.run()
    return cluster


@pytest.mark.trio
@pytest.mark.parametrize(
    "restart_at",
    [1, pytest.param(4, marks=pytest.mark.soak)],  # a restart later on: make soak
)
async def test_run_survives_a_coordinator_restart_and_equals_an_uninterrupted_run(
    restart_at: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    reference = await run_cluster(None)
    restarted = await run_cluster(restart_at)
    assert set(restarted.steps.values()) == {STEPS}
    assert len(set(restarted.digests.values())) == 1
    assert restarted.digests[0] == reference.digests[0]
    assert set(restarted.reconnects.values()) == {1}
    assert restarted.redial_refusals > 0  # they backed off while nobody listened
    for rank, epochs in restarted.epochs.items():
        assert [e[0] for e in epochs] == [1, 2], (rank, epochs)
        # It resumed where every worker stood: no step rerun beyond the one in flight.
        assert epochs[1][1] in (restart_at, restart_at + 1), (rank, epochs)
    assert "lost the coordinator" in caplog.text
    assert "rejoined the coordinator" in caplog.text


@pytest.mark.trio
async def test_a_worker_whose_state_differs_at_the_restart_receives_the_majoritys() -> None:
    """Rank 2's weights and bool buffer are damaged while the coordinator is down: its rejoin
    digest differs, so the majority's state (bool buffer included) is sent to it live."""
    reference = await run_cluster(None)
    restarted = await run_cluster(3, stray=2)
    assert set(restarted.digests.values()) == {reference.digests[0]}
    for mask in restarted.masks.values():
        assert mask.tolist() == [True, False]
    assert restarted.epochs[2][1][1] == 3  # resumed after the step every worker applied


class SilentCoordinator:
    """Answers a join with a start, then says nothing (a hung coordinator)."""

    def __init__(self) -> None:
        self.links: list[MemoryLink] = []

    async def dial(self) -> Link:
        theirs, mine = MemoryLink.pair("coordinator", "rank 0")
        self.links.append(theirs)
        return mine


@pytest.mark.trio
async def test_a_silent_coordinator_is_lost_after_the_heartbeat_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hung = SilentCoordinator()
    redials = 0

    async def redial() -> Link:
        nonlocal redials
        redials += 1
        raise ConnectionRefusedError("still down")

    client = CoordinatorClient(await hung.dial(), 0, redial=redial, reconnect_seconds=5.0)
    start = StartRun(addresses=(("h", 1),), ring=(0,), step=0, heartbeat_deadline=2.0)

    async def coordinator_side() -> None:
        link = hung.links[0]
        await link.recv()  # the join
        await link.send(*start.to_wire())
        await trio.sleep_forever()

    held: list[Any] = []
    client.on_epoch = held.append
    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator_side)
        await client.join((), ("h", 1))
        began = trio.current_time()
        with pytest.raises(CoordinatorLost, match="did not come back within 5 s") as caught:
            await client.serve()
        nursery.cancel_scope.cancel()
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert "sent nothing for 2 s" in held[0].reason
    # Lost after the 2 s deadline of silence, then 5 s of redials with backoff.
    assert 6.9 <= trio.current_time() - began <= 7.5
    assert redials >= 4
    assert [type(m).__name__ for m in held] == ["Hold"]


@pytest.mark.trio
async def test_heartbeats_keep_a_quiet_coordinator_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A coordinator with nothing to say still heartbeats; the worker never gives up on it."""
    coordinator = Coordinator(1, CoordinatorOptions(heartbeat_deadline=1.0))
    theirs, mine = MemoryLink.pair("coordinator", "rank 0")
    client = CoordinatorClient(mine, 0, redial=None)
    model, _ = replica()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator.serve_links, {0: theirs})
        await client.join(model_signature(model.named_parameters()), ("h", 1))
        with trio.move_on_after(30):  # 30 deadlines of the coordinator having nothing to say
            await client.serve()
        assert client.shutdown_reason is None and not client.done.is_set()
        nursery.cancel_scope.cancel()
