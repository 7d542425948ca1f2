"""Control links (`paramsync.runtime.transport.link`): `Link.wait_readable` over an in-process pair
and over TCP.

A reader that waits for readability can stop waiting (its reads deferred) without touching
the stream, so each test checks that a cancelled wait loses no message and that the waits
see buffered, arriving and ended streams alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from paramsync.runtime.errors import PeerClosed
from paramsync.runtime.transport.link import Link, MemoryLink
from paramsync.runtime.transport.tcp import TcpTransport

LINK_KINDS = ("memory", "tcp")


@asynccontextmanager
async def link_pair(kind: str) -> AsyncIterator[tuple[Any, Any]]:
    """Two connected link ends: (sender, receiver)."""
    if kind == "memory":
        yield MemoryLink.pair("receiver", "sender")
        return
    async with TcpTransport.open_group(2) as (t0, t1):
        yield t0.connections[1], t1.connections[0]


@pytest.mark.parametrize("kind", LINK_KINDS)
async def test_both_ends_are_links(kind: str) -> None:
    async with link_pair(kind) as (a, b):
        assert isinstance(a, Link) and isinstance(b, Link)


@pytest.mark.parametrize("kind", LINK_KINDS)
async def test_wait_readable_returns_once_a_message_arrives(kind: str) -> None:
    async with link_pair(kind) as (a, b):
        woke = trio.Event()

        async def waiter() -> None:
            await b.wait_readable()
            woke.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert not woke.is_set()
            await a.send("refuse", {"reason": "first"})
            with trio.fail_after(10):
                await woke.wait()
        message = await b.recv()
        assert (message["kind"], message["reason"]) == ("refuse", "first")


@pytest.mark.parametrize("kind", LINK_KINDS)
async def test_a_cancelled_wait_loses_nothing(kind: str) -> None:
    async with link_pair(kind) as (a, b):
        with trio.move_on_after(0.05) as scope:
            await b.wait_readable()
        assert scope.cancelled_caught
        await a.send("refuse", {"reason": "one"})
        await a.send("refuse", {"reason": "two"})
        with trio.fail_after(10):
            await b.wait_readable()
            await b.wait_readable()  # again: returns at once and takes nothing
        assert (await b.recv())["reason"] == "one"
        with trio.fail_after(10):
            await b.wait_readable()  # the second is buffered (TCP) or queued (memory)
        assert (await b.recv())["reason"] == "two"


@pytest.mark.parametrize("kind", LINK_KINDS)
async def test_wait_readable_returns_when_the_peer_closes_and_recv_says_so(kind: str) -> None:
    async with link_pair(kind) as (a, b):
        await a.aclose()
        with trio.fail_after(10):
            await b.wait_readable()
        with pytest.raises(PeerClosed):
            await b.recv()


async def test_tcp_bytes_already_waiting_are_found_without_a_trip_through_the_scheduler() -> None:
    """A reader that waited elsewhere while a message arrived (its reads deferred) finds it in
    one non-blocking read: no schedule point, so no extra wake-up of its task. With nothing
    waiting it sleeps in the scheduler as before, and a closed peer is still reported by the
    recv after it."""
    async with link_pair("tcp") as (a, b):
        await a.send("refuse", {"reason": "waiting"})
        await a.send("refuse", {"reason": "next"})
        with trio.fail_after(10):
            await b.wait_readable()  # the bytes may still be on their way: maybe a wait
        task = trio.lowlevel.current_task()
        scheduled = task._schedule_points
        assert (await b.recv())["reason"] == "waiting"
        scheduled = task._schedule_points
        await b.wait_readable()  # "next" came with the first read, or waits in the socket
        assert task._schedule_points == scheduled
        assert (await b.recv())["reason"] == "next"
        await trio.testing.wait_all_tasks_blocked(0.05)
        await a.send("refuse", {"reason": "third"})
        await trio.sleep(0.05)  # the frame lands in b's socket while nobody waits for it
        scheduled = task._schedule_points
        await b.wait_readable()
        assert task._schedule_points == scheduled
        assert (await b.recv())["reason"] == "third"
        with trio.move_on_after(0.05) as scope:
            await b.wait_readable()  # nothing waits: it sleeps until cancelled
        assert scope.cancelled_caught
        await a.aclose()
        with trio.fail_after(10):
            await b.wait_readable()
        with pytest.raises(PeerClosed):
            await b.recv()
