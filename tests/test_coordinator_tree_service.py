"""The coordinator tree's trio shells (`paramsync.runtime.coordinator.tree_service`) in one trio
run: a `RootCoordinator`, a `SubCoordinator` per host, and workers on in-process links that
speak the worker protocol as they do to the flat coordinator.

Real trainers train a few steps under the tree and under the flat coordinator and end bitwise
identical; scripted workers then exercise the faults: a worker killed (its host reports the
loss, the root changes the membership once), a host's link lost (one membership change naming
the host and its ranks), a host gone silent, and a nudged worker's divergence named with its
rank and tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
import trio.testing
from torch import nn

from paramsync.actors.client.client import CoordinatorClient
from paramsync.actors.train.trainer import DistributedTrainer
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.coordinator.events import model_signature
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.coordinator.tree_service import (
    RootCoordinator,
    SubCoordinator,
    dial_root,
    host_group,
)
from paramsync.runtime.errors import HandshakeError, PeerClosed
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.messages import (
    AbortRun,
    Apply,
    Commit,
    Digest,
    Go,
    Joined,
    Ready,
    Reduced,
    StartRun,
    message_from_wire,
)
from paramsync.runtime.transport.base import InProcessTransport
from paramsync.runtime.transport.link import MemoryLink
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, dial

RUN_SECONDS = 30.0
HOSTS = [[0, 1], [2, 3]]
WORLD = 4


# --------------------------------------------------------------------------- the tree, in-process


class TreeRun:
    """A root and a sub-coordinator per host of ``hosts``, wired by memory links; ``link(r)``
    is worker rank r's end of its link to its host."""

    def __init__(self, hosts: list[list[int]], options: CoordinatorOptions) -> None:
        world = sum(len(ranks) for ranks in hosts)
        self.root = RootCoordinator(world, options)
        self.subs = [
            SubCoordinator(world, f"node{i}", i, ranks, options) for i, ranks in enumerate(hosts)
        ]
        self.uplinks = [MemoryLink.pair(f"root of node{i}", f"host {i}") for i in range(len(hosts))]
        self.pairs = {
            rank: MemoryLink.pair(f"node{i}", f"rank {rank}")
            for i, ranks in enumerate(hosts)
            for rank in ranks
        }
        self.hosts = hosts
        self.outcomes: dict[str, BaseException | None] = {}
        self.scopes: dict[int, trio.CancelScope] = {}

    def link(self, rank: int) -> MemoryLink:
        return self.pairs[rank][1]

    async def _capture(self, name: str, serve: Callable[..., Any], *args: Any, **kw: Any) -> None:
        try:
            await serve(*args, **kw)
            self.outcomes[name] = None
        except RunFailed as exc:
            self.outcomes[name] = exc

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(
            self._capture,
            "root",
            self.root.serve_links,
            {i: pair[0] for i, pair in enumerate(self.uplinks)},
        )
        for i in range(len(self.subs)):
            self._start_host(nursery, i)

    def _start_host(self, nursery: trio.Nursery, i: int) -> None:
        sub, links = self.subs[i], {rank: self.pairs[rank][0] for rank in self.hosts[i]}
        scope = self.scopes[i] = trio.CancelScope()

        async def serve() -> None:
            with scope:
                await self._capture(f"node{i}", sub.serve_links, links, root=self.uplinks[i][1])

        nursery.start_soon(serve)

    def kill_host(self, i: int) -> None:
        """Host ``i``'s sub-coordinator process dies: its tasks end, its links close."""
        self.scopes[i].cancel()

    def restart_host(self, nursery: trio.Nursery, i: int, options: CoordinatorOptions) -> None:
        """Host ``i``'s sub-coordinator starts again: a fresh one, new links to its workers
        and to the root (which serves the new link as it serves an accepted connection)."""
        world = sum(len(ranks) for ranks in self.hosts)
        self.subs[i] = SubCoordinator(world, f"node{i}", i, self.hosts[i], options)
        self.uplinks[i] = MemoryLink.pair(f"root of node{i}", f"host {i}")
        for rank in self.hosts[i]:
            self.pairs[rank] = MemoryLink.pair(f"node{i}", f"rank {rank}")
        nursery.start_soon(self.root._serve_member, i, self.uplinks[i][0])
        self._start_host(nursery, i)


# --------------------------------------------------------------------------- real trainers


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)


async def train(link: MemoryLink, rank: int, transport: InProcessTransport, steps: int) -> bytes:
    """A real worker on its control link; its final parameters' bytes."""
    model = mlp(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    client = CoordinatorClient(link, rank)
    try:
        await client.join(model_signature(model.named_parameters()), ("in-process", rank + 1))
        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            config = DistributedConfig(WORLD, rank)
            async with DistributedTrainer.open(
                model, optimizer, loss_fn, config, transport, client
            ) as trainer:
                for step in range(steps):
                    await trainer.train_batch(batch(step + 10 * rank))
                await trainer.verified()
                await client.finished(trainer.step)
        return b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    finally:
        with trio.CancelScope(shield=True):
            await link.aclose()


async def train_all(links: dict[int, MemoryLink], steps: int) -> dict[int, bytes]:
    worlds = InProcessTransport.create_group(WORLD)
    states: dict[int, bytes] = {}

    async def one(rank: int) -> None:
        try:
            states[rank] = await train(links[rank], rank, worlds[rank], steps)
        finally:
            with trio.CancelScope(shield=True):
                await worlds[rank].aclose()

    async with trio.open_nursery() as nursery:
        for rank in links:
            nursery.start_soon(one, rank)
    return states


async def test_training_under_the_tree_is_bitwise_the_flat_run() -> None:
    steps = 4
    options = CoordinatorOptions(heartbeat_deadline=5.0)
    with trio.fail_after(RUN_SECONDS):
        flat = Coordinator(WORLD, options)
        pairs = {rank: MemoryLink.pair("coordinator", f"rank {rank}") for rank in range(WORLD)}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flat.serve_links, {r: p[0] for r, p in pairs.items()})
            flat_states = await train_all({r: p[1] for r, p in pairs.items()}, steps)

        tree = TreeRun(HOSTS, options)
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            tree_states = await train_all({r: tree.link(r) for r in range(WORLD)}, steps)
    assert tree.outcomes == {"root": None, "node0": None, "node1": None}
    assert len(set(tree_states.values())) == 1  # every worker holds one state
    assert tree_states == flat_states  # and it is the flat run's, bit for bit
    assert tree.root.root.last_commit is not None
    assert tree.root.root.last_commit.step == steps - 1
    # The root heard one report per host, not one per worker.
    assert [sub.driver.fold.forwarded for sub in tree.subs] == [
        tree.subs[0].driver.fold.forwarded
    ] * 2


# --------------------------------------------------------------------------- scripted workers

TENSORS = ("0.weight", "0.bias", "2.weight")
SIGNATURE = tuple((name, (3, 3), "float32", True) for name in TENSORS)
SPEC = (((3, 3), "float32"),) * 3
DEADLINE = 2.0


class Scripted:
    """A worker that speaks the worker protocol by hand over its control link."""

    def __init__(self, rank: int, link: MemoryLink) -> None:
        self.rank, self.link = rank, link
        self.listed = False
        self.beating = trio.CancelScope()

    async def send(self, message: Any) -> None:
        await self.link.send(*message.to_wire())

    async def expect(self, kind: type) -> Any:
        while True:
            item = await self.link.recv()
            if item["kind"] == "heartbeat":
                continue
            message = message_from_wire(item)
            assert isinstance(message, kind), f"rank {self.rank}: {message!r}, not a {kind}"
            return message

    async def beat(self) -> None:
        """Heartbeats, as a worker sends them from its join on, until its link closes."""
        with self.beating:
            try:
                while True:
                    await self.link.send("heartbeat", {})
                    await trio.sleep(DEADLINE / 4)
            except PeerClosed:
                return

    def digest(self, step: int, epoch: int, nudged_at: int | None) -> Digest:
        packed = bytearray(bytes([step % 251]) * (16 * len(TENSORS)))
        digest = b"d%015d" % step
        if nudged_at is not None:
            packed[nudged_at * 16] ^= 0xFF
            digest = b"x%015d" % step
        names = None if self.listed else TENSORS
        self.listed = True
        return Digest(self.rank, step, digest, (), epoch, bytes(packed), names, "", "xxh3-128")


class Workers:
    """Scripted workers of ``ranks`` on ``tree``, each with its heartbeat task."""

    def __init__(self, tree: TreeRun, nursery: trio.Nursery, elastic: bool) -> None:
        self.all = {rank: Scripted(rank, tree.link(rank)) for rank in tree.pairs}
        self.alive = dict(self.all)
        self.elastic = elastic
        self.nursery = nursery

    async def join(self) -> StartRun:
        for worker in self.all.values():
            await worker.send(Joined(worker.rank, SIGNATURE, ("10.0.0.1", 20_000 + worker.rank)))
            self.nursery.start_soon(worker.beat)
        return await self.started()

    async def started(self) -> StartRun:
        starts = [await w.expect(StartRun) for w in self.alive.values()]
        assert len({(s.epoch, s.members) for s in starts}) == 1, starts
        for worker in self.alive.values():
            worker.listed = False  # a new epoch: the names are listed again
        return starts[0]

    async def kill(self, rank: int) -> None:
        await self.alive.pop(rank).link.aclose()

    async def check(self, step: int, epoch: int) -> None:
        """An epoch's check of the state at ``step`` (a start after a loss)."""
        for worker in self.alive.values():
            await worker.send(worker.digest(step, epoch, None))
        for worker in self.alive.values():
            assert (await worker.expect(Commit)).step == step

    async def step(self, step: int, epoch: int, nudged: int | None = None) -> type:
        """One training step; what ended it: a commit, or an abort (every worker's)."""
        alive = self.alive.values()
        for worker in alive:
            await worker.send(Ready(worker.rank, step, 0, SPEC, epoch))
        for worker in alive:
            await worker.expect(Go)
        if self.elastic:
            for worker in alive:
                await worker.send(Reduced(worker.rank, step, epoch))
            for worker in alive:
                await worker.expect(Apply)
        for worker in alive:
            await worker.send(worker.digest(step, epoch, 1 if worker.rank == nudged else None))
        answers = {type(await w.expect(Commit | AbortRun)) for w in alive}
        assert len(answers) == 1, answers
        return answers.pop()


def _reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "paramsync.coordinator"]


ELASTIC = CoordinatorOptions(heartbeat_deadline=DEADLINE, min_workers=1)


async def test_a_killed_worker_is_handled_on_its_host_and_named_by_the_root(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    tree = TreeRun(HOSTS, ELASTIC)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=True)
            start = await workers.join()
            assert (start.epoch, start.members) == (1, (0, 1, 2, 3))
            assert await workers.step(0, 1) is Commit
            await workers.kill(3)
            again = await workers.started()
            assert (again.epoch, again.members, again.step) == (2, (0, 1, 2), 1)
            await workers.check(0, 2)
            assert await workers.step(1, 2) is Commit
            nursery.cancel_scope.cancel()
    changes = [t for t in _reports(caplog) if "epoch 1:" in t]
    assert changes == ["step 1, epoch 1: rank 3 disconnected: link closed"], changes
    assert [record.members for record in tree.root.root.history] == [(0, 1, 2, 3), (0, 1, 2)]


async def test_a_silent_worker_is_lost_on_its_host_after_the_heartbeat_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    tree = TreeRun(HOSTS, ELASTIC)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=True)
            await workers.join()
            assert await workers.step(0, 1) is Commit
            silent = workers.alive.pop(2)
            silent.beating.cancel()  # rank 2 stays connected but sends nothing more
            again = await workers.started()
            assert (again.epoch, again.members) == (2, (0, 1, 3))
            removed = await silent.expect(AbortRun)  # its host evicts it, naming why
            assert "rank 2 was removed from the run: missed heartbeats" in removed.reason
            nursery.cancel_scope.cancel()
    changes = [t for t in _reports(caplog) if "epoch 1:" in t]
    assert len(changes) == 1 and changes[0].startswith(
        "step 1, epoch 1: rank 2 disconnected: missed heartbeats for"
    ), changes


async def test_a_restarted_sub_coordinator_rejoins_and_its_workers_take_the_state(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="paramsync.coordinator")
    tree = TreeRun(HOSTS, ELASTIC)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=True)
            await workers.join()
            assert await workers.step(0, 1) is Commit
            tree.kill_host(1)  # node1's sub-coordinator dies; its workers keep their state
            for rank in (2, 3):
                with pytest.raises(PeerClosed):
                    await workers.alive.pop(rank).expect(StartRun)
            without = await workers.started()
            assert (without.epoch, without.members) == (2, (0, 1))
            await workers.check(0, 2)
            assert await workers.step(1, 2) is Commit
            tree.restart_host(nursery, 1, ELASTIC)
            for rank in (2, 3):  # they redial their host and join where they stand
                worker = workers.alive[rank] = workers.all[rank] = Scripted(rank, tree.link(rank))
                address = ("10.0.0.1", 20_000 + rank)
                await worker.send(Joined(rank, SIGNATURE, address, step=1, epoch=1))
                nursery.start_soon(worker.beat)
            whole = await workers.started()
            assert (whole.epoch, whole.members) == (3, (0, 1, 2, 3))
            assert (whole.donor, whole.receivers) == (0, (2, 3))  # the state goes to them
            await workers.check(1, 3)
            assert await workers.step(2, 3) is Commit
            nursery.cancel_scope.cancel()
    opened = [t for t in _reports(caplog) if t.startswith("epoch 3 starts")]
    assert opened == [
        "epoch 3 starts at step 2 with ranks [0, 1, 2, 3] (host 'node1' (ranks [2, 3]) joined)"
    ], opened


async def test_a_lost_host_link_is_one_membership_change_naming_the_host_and_its_ranks(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    tree = TreeRun(HOSTS, ELASTIC)
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=True)
            await workers.join()
            assert await workers.step(0, 1) is Commit
            await tree.uplinks[1][1].aclose()  # host node1's link to the root is cut
            for rank in (2, 3):  # its workers hear that their host lost the root
                aborted = await workers.alive.pop(rank).expect(AbortRun)
                assert "host 'node1' lost the root coordinator" in aborted.reason
                await tree.link(rank).aclose()
            again = await workers.started()
            assert (again.epoch, again.members) == (2, (0, 1))
            await workers.check(0, 2)
            assert await workers.step(1, 2) is Commit
            while "node1" not in tree.outcomes:  # noqa: ASYNC110 - the shell's own outcome
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    changes = [t for t in _reports(caplog) if "epoch 1:" in t]
    assert changes == ["step 1, epoch 1: host 'node1' (ranks [2, 3]) disconnected: link closed"]
    assert [record.members for record in tree.root.root.history] == [(0, 1, 2, 3), (0, 1)]
    assert isinstance(tree.outcomes["node1"], RunFailed)


async def test_a_silent_host_is_lost_after_the_heartbeat_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    tree = TreeRun(HOSTS, ELASTIC)
    mute = trio.Event()
    uplink = tree.uplinks[1][1]
    send = uplink.send

    async def muted(kind: str, fields: Any, bulk: Any = None) -> None:
        if not mute.is_set():
            await send(kind, fields, bulk)

    uplink.send = muted  # type: ignore[method-assign]
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=True)
            await workers.join()
            assert await workers.step(0, 1) is Commit
            mute.set()  # node1 goes on, but nothing it sends reaches the root
            for rank in (2, 3):
                workers.alive.pop(rank)
            again = await workers.started()
            assert (again.epoch, again.members) == (2, (0, 1))
            nursery.cancel_scope.cancel()
    changes = [t for t in _reports(caplog) if "epoch 1:" in t]
    assert len(changes) == 1 and changes[0].startswith(
        "step 1, epoch 1: host 'node1' (ranks [2, 3]) disconnected: missed heartbeats for"
    ), changes


async def test_a_nudged_worker_is_named_with_its_rank_and_tensor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tree = TreeRun(HOSTS, CoordinatorOptions(heartbeat_deadline=DEADLINE))
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            tree.start(nursery)
            workers = Workers(tree, nursery, elastic=False)
            await workers.join()
            assert await workers.step(0, 1) is Commit
            assert await workers.step(1, 1, nudged=3) is AbortRun
    failed = tree.outcomes["root"]
    assert isinstance(failed, RunFailed)
    text = str(failed)
    assert "step 1" in text and "ranks [3] differ from the majority (ranks [0, 1, 2])" in text
    assert "rank 3 first differs from rank 0 at tensor '0.bias'" in text, text
    for host in ("node0", "node1"):  # each host's workers got the root's reason
        assert str(tree.outcomes[host]) == text


async def test_the_root_admits_hosts_by_group_and_index_and_refuses_a_worker() -> None:
    """The root's listener is the flat coordinator's (handshake, admission) in the group of
    the hosts' links: a worker dialing it is refused naming the group; a host index is
    admitted once."""
    secret = "tree-service-tests-secret"
    root = RootCoordinator(WORLD, CoordinatorOptions(heartbeat_deadline=DEADLINE), secret=secret)
    key = load_secret(secret, {})
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(root.serve_tcp, "127.0.0.1", 0)
            worker = Identity(DEFAULT_GROUP, WORLD, 0)
            with pytest.raises(HandshakeError, match="group 'paramsync' does not match"):
                await dial(address, key, worker)
            host = Identity(host_group(DEFAULT_GROUP), WORLD, 1)
            conn, _ = await dial(address, key, host)
            with pytest.raises(HandshakeError, match="rank 1 is already taken"):
                await dial(address, key, host)
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_a_sub_coordinator_dialing_a_flat_coordinator_is_told_what_to_start() -> None:
    """A flat coordinator (``paramsync coordinator`` without ``--tree root``) refuses a host's
    link by its group; the sub-coordinator's error says the coordinator there is flat and what
    to start instead."""
    secret = "tree-service-tests-secret"
    flat = Coordinator(WORLD, CoordinatorOptions(heartbeat_deadline=DEADLINE), secret=secret)
    key = load_secret(secret, {})
    with trio.fail_after(RUN_SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(flat.serve_tcp, "127.0.0.1", 0)
            host = Identity(host_group(DEFAULT_GROUP), WORLD, 0)
            with pytest.raises(HandshakeError) as refused:
                await dial_root(address, key, host)
            nursery.cancel_scope.cancel()
    text = str(refused.value)
    assert "group 'paramsync/hosts' does not match" in text, text
    assert "is a flat one" in text and "paramsync coordinator --tree root" in text, text
