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

from runtime.coordinator.service import Coordinator, CoordinatorOptions
from runtime.errors import HandshakeError, PeerClosed
from runtime.protocol.handshake import Identity, load_secret
from runtime.transport.tcp import DEFAULT_GROUP, Connection, dial

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
