"""A rank's slot at the coordinator daemon is held by a join, and freed with its connection.

Issue 31, row 5: any first frame lifted the join deadline, so a peer that authenticated as a
rank, sent one heartbeat and went quiet held that rank for ever (the real worker was refused
"rank 1 is already taken"). The deadline now holds until a join the core accepted.

Row 6: a member evicted from an elastic run (here: silent past the heartbeat deadline) kept its
connection open, ESTABLISHED, with its task: a descriptor and a task leaked per eviction. The
daemon now closes the connection at eviction; the descriptors are counted across 20 evictions.

Real sockets, so real time: the deadlines are a fraction of a second.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions
from paramsync.runtime.errors import HandshakeError, PeerClosed
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.messages import Shutdown
from paramsync.runtime.transport.link import MemoryLink
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, dial

SECRET = "coordinator-slots-tests-secret"


def join(rank: int) -> dict[str, Any]:
    """A join's fields: a data-plane address of its own, one two-element float32 parameter
    (every joiner declares the same model)."""
    return {"host": "127.0.0.1", "port": 9 + rank, "params": [["w", [2], "float32", True]]}


async def dial_as(address: tuple[str, int], rank: int, world_size: int) -> Connection:
    conn, _ = await dial(
        address, load_secret(SECRET, {}), Identity(DEFAULT_GROUP, world_size, rank)
    )
    return conn


async def closed_by_the_daemon(conn: Connection, seconds: float) -> list[str]:
    """Read until the daemon closes the connection (the kinds read), or fail after
    ``seconds`` (the connection stayed open)."""
    kinds: list[str] = []
    with trio.fail_after(seconds):
        while True:
            try:
                kinds.append((await conn.recv())["kind"])
            except PeerClosed:
                return kinds


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_heartbeat_before_the_join_does_not_lift_the_join_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Authenticate as rank 1, send one heartbeat, go quiet: the rank is taken only until the
    join deadline, then the connection is dropped and the real rank 1 is admitted."""
    caplog.set_level(logging.WARNING, logger="paramsync.coordinator")
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=0.5), secret=SECRET)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            squatter = await dial_as(address, 1, 2)
            await squatter.send("heartbeat", {})
            with pytest.raises(HandshakeError, match="rank 1 is already taken"):
                await dial_as(address, 1, 2)  # held while the deadline runs
            assert await closed_by_the_daemon(squatter, 5.0) == []
            await squatter.aclose()
            real = await dial_as(address, 1, 2)  # the slot was freed
            await real.send("join", join(1))
            await real.aclose()
            nursery.cancel_scope.cancel()
    assert "rank 1 authenticated but sent no join within 0.5 s" in caplog.text


async def test_heartbeats_kept_up_without_a_join_do_not_hold_the_rank() -> None:
    """Only a join the core accepts stops the deadline: a peer that keeps sending heartbeats
    (the one kind the core takes quietly from a rank that has not joined; every other kind is
    refused at once) is still dropped at the deadline."""
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=0.5), secret=SECRET)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            squatter = await dial_as(address, 0, 2)

            async def keep_beating() -> None:
                try:
                    while True:
                        await squatter.send("heartbeat", {})
                        await trio.sleep(0.1)
                except PeerClosed:
                    return

            nursery.start_soon(keep_beating)
            kinds = await closed_by_the_daemon(squatter, 5.0)
            assert kinds == [] or kinds[-1] == "join_refused", kinds
            await squatter.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.soak
async def test_an_evicted_members_connection_is_closed_no_descriptor_leaks() -> None:
    """An elastic run (min_workers 1): rank 0 stays (it heartbeats), and 20 times over a rank
    1 joins, goes silent and is evicted at the heartbeat deadline. Each evicted connection is
    closed by the daemon at its eviction, and the process holds no more descriptors after the
    20 evictions than after the first."""
    options = CoordinatorOptions(
        heartbeat_deadline=0.3, min_workers=1, rendezvous_seconds=0.05, rejoin_seconds=60
    )
    coordinator = Coordinator(2, options, secret=SECRET)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            stayer = await dial_as(address, 0, 2)
            await stayer.send("join", join(0))

            started = trio.Event()

            async def stay() -> None:  # heartbeat, and read whatever comes
                async def beat() -> None:
                    while True:
                        await stayer.send("heartbeat", {})
                        await trio.sleep(0.05)

                async with trio.open_nursery() as inner:
                    inner.start_soon(beat)
                    while True:
                        if (await stayer.recv())["kind"] == "start_run":
                            started.set()

            nursery.start_soon(stay)
            await started.wait()
            counts = []
            for round_ in range(20):
                silent = await dial_as(address, 1, 2)
                await silent.send("join", join(1))
                kinds = await closed_by_the_daemon(silent, 5.0)
                assert kinds[-1] == "abort", (round_, kinds)  # the eviction
                await silent.aclose()
                counts.append(open_descriptors())
            assert counts[-1] <= counts[0], counts
            assert list(coordinator._members) == [0]
            nursery.cancel_scope.cancel()


async def test_a_member_whose_queue_overflows_is_dropped_and_its_link_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A member that stops reading until its outbound queue is full is lost to the core, and
    its link is closed as an evicted member's is: its reader stops waiting, what is queued gets
    `_FLUSH_SECONDS` (virtual time here) to leave, then the link is closed."""
    coordinator = Coordinator(2)
    near, _far = MemoryLink.pair("coordinator", 1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator._serve_member, 1, near)
            await wait_all_tasks_blocked()
            member = coordinator._members[1]
            while True:  # nobody reads `far`: the writer blocks once the link is full
                try:
                    member.outbox_send.send_nowait(Shutdown("queued"))
                except trio.WouldBlock:
                    break
            coordinator._enqueue(1, Shutdown("one too many"))
            assert 1 not in coordinator._members and member.evicted
    assert near.closed
