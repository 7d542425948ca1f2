"""What the coordinator reads from a peer's link (issue 39, row 7).

The coordinator accepts no tensors: a bulk announced on its link is refused from the frame's
prefix and the peek at its kind, unread (it used to read up to 64 MiB into a scratch buffer
before checking the frame's tag, also from a relay that does not hold the secret). Before a
peer has joined, only what a joining peer sends (a join, heartbeats) is accepted, capped at what
a join needs: a peer that never joined has no 60 MiB digest read or decoded.

The frames below are written raw and stop after their head's first bytes: a receiver that
waited for the rest (the old rules) would hang, so each refusal is checked to come at once.
"""

from __future__ import annotations

import logging
import secrets
import struct
from typing import Any

import cbor2
import pytest
import trio

from paramsync.runtime.coordinator.frame_caps import (
    FIRST_JOIN_MAX_FRAME,
    JOIN_ENTRY_BYTES,
    JOINING_KINDS,
    MAX_MODEL_TENSORS,
    MEMBER_FRAME_ALLOWANCE,
    join_frame_cap,
    member_frame_cap,
)
from paramsync.runtime.coordinator.service import Coordinator, CoordinatorOptions, RunFailed
from paramsync.runtime.errors import PeerClosed, ProtocolError
from paramsync.runtime.protocol.frame_reader import NO_TENSORS, FrameReader, Need
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.limits import MAX_ITEMS, PEEK_SIZE, count_items
from paramsync.runtime.protocol.messages import Joined
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.wire import DEFAULT_MAX_FRAME, encode_frame_bytes
from paramsync.runtime.transport.link import MemoryLink
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, dial

SECRET = "coordinator-link-tests-secret"
SIG = (("w", (2,), "float32", True),)


def join(rank: int) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": 9 + rank, "params": [["w", [2], "float32", True]]}


def announced(kind: str, head_len: int, bulk_len: int = 0) -> bytes:
    """The prefix and the first bytes of a frame of ``kind`` announcing a head of ``head_len``
    bytes and a bulk of ``bulk_len``: enough for a peek at its kind, never the whole frame."""
    item = cbor2.dumps(
        {"v": PROTOCOL_VERSION, "kind": kind, "epoch": 1, "step": 1, "pad": b"p" * PEEK_SIZE}
    )
    assert len(item) < head_len
    return struct.pack(">II", head_len + bulk_len, bulk_len) + item


async def dial_as(address: tuple[str, int], rank: int) -> Connection:
    conn, _ = await dial(address, load_secret(SECRET, {}), Identity(DEFAULT_GROUP, 2, rank))
    return conn


async def closed_by_the_daemon(conn: Connection, seconds: float) -> list[str]:
    """The kinds read until the daemon closes the connection; fails after ``seconds``."""
    kinds: list[str] = []
    with trio.fail_after(seconds):
        while True:
            try:
                kinds.append((await conn.recv())["kind"])
            except PeerClosed:
                return kinds


# --------------------------------------------------------------------------- the rules


def test_a_read_of_some_kinds_refuses_any_other_from_the_peek() -> None:
    """A digest announcing a 60 MiB head where only a join or a heartbeat is accepted: refused
    once the prefix and the peek are in, the reader never asking for the rest."""
    reader = FrameReader()
    reader.start(DEFAULT_MAX_FRAME, NO_TENSORS, kinds=JOINING_KINDS)
    reader.feed(announced("digest", 60 << 20))
    with pytest.raises(ProtocolError, match="sent a digest frame where only heartbeat, join"):
        reader.next()
    reader = FrameReader()  # after a refusal the stream is out of step: a new connection
    reader.start(DEFAULT_MAX_FRAME, NO_TENSORS, kinds=JOINING_KINDS)
    reader.feed(announced("join", 1 << 20))
    assert isinstance(reader.next(), Need)  # a join of 1 MiB: its head is asked for


def _head_of_join(signature: tuple[Any, ...]) -> tuple[int, bytes]:
    """The head size of a join of ``signature`` as a worker sends it, and its CBOR item."""
    frame = encode_frame_bytes(*Joined(0, signature, ("10.0.0.1", 29500)).to_wire())
    item_len, bulk_len = struct.unpack(">II", frame[:8])
    return item_len - bulk_len, frame[8:]


def test_a_join_before_the_model_is_known_is_capped_at_what_the_largest_model_needs() -> None:
    """Before any model is known a join may hold `MAX_MODEL_TENSORS` entries of
    `JOIN_ENTRY_BYTES`: some 6 MiB, not the join's 64 MiB schema cap. A mixture of experts with
    that many tensors and long names fits (in bytes and in CBOR items); once the model is known,
    the cap is the model's."""
    assert join_frame_cap(None, DEFAULT_MAX_FRAME) == FIRST_JOIN_MAX_FRAME
    assert FIRST_JOIN_MAX_FRAME == MEMBER_FRAME_ALLOWANCE + MAX_MODEL_TENSORS * JOIN_ENTRY_BYTES
    assert FIRST_JOIN_MAX_FRAME < 8 << 20 < DEFAULT_MAX_FRAME
    experts = tuple(
        (f"model.layers.{i // 768}.block_sparse_moe.experts.{i % 768 // 3}.w{i % 3 + 1}.weight",
         (14336, 4096), "bfloat16", True)
        for i in range(MAX_MODEL_TENSORS)
    )  # fmt: skip
    size, item = _head_of_join(experts)
    assert size < FIRST_JOIN_MAX_FRAME and count_items(item) <= MAX_ITEMS, size
    cap = join_frame_cap(SIG, DEFAULT_MAX_FRAME)
    assert cap < member_frame_cap(SIG, DEFAULT_MAX_FRAME) and cap < 128 * 1024


async def test_a_bulk_on_a_link_that_takes_none_is_refused_unread_from_a_relay_too() -> None:
    """The coordinator's side of a connection (``tensors`` false), keyed as after a handshake:
    a relay that does not hold the secret injects a ``coll`` frame announcing 64 MiB of bulk.
    Refused from its prefix and peek, before its tag could be checked; not one bulk byte is
    waited for. (A peer holding the key sends the same prefix: the live tests below.)"""
    left, right = trio.socket.socketpair()
    receiver = Connection(trio.SocketStream(left), peer="rank 0")
    relay = trio.SocketStream(right)
    receiver.authenticate_frames(secrets.token_bytes(32), dialer=False)
    receiver.tensors = False
    await relay.send_all(announced("coll", 100, bulk_len=(64 << 20) - 200))
    with trio.fail_after(2), pytest.raises(ProtocolError, match="takes no tensors"):
        await receiver.recv()
    await receiver.aclose()
    await relay.aclose()


async def test_an_in_process_link_refuses_the_kinds_a_joining_peer_does_not_send() -> None:
    mine, theirs = MemoryLink.pair("coordinator", "rank 0")
    await theirs.send("finished", {"epoch": 1, "step": 3})
    with pytest.raises(ProtocolError, match="sent a finished frame where only heartbeat, join"):
        await mine.recv(kinds=JOINING_KINDS)
    await theirs.send("heartbeat", {})
    assert (await mine.recv(kinds=JOINING_KINDS))["kind"] == "heartbeat"


# --------------------------------------------------------------------------- the daemon


async def test_a_peer_that_never_joined_has_no_60_mib_digest_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer holding the secret authenticates as rank 1 and, before any join, announces a
    digest: the daemon refuses it at once (join_refused, the connection closed) without reading
    it, and the real rank 1 is admitted afterwards. 4 MiB: within a first join's cap, so its
    kind refuses it (a 60 MiB one is refused by its size first, as below)."""
    caplog.set_level(logging.WARNING, logger="paramsync.coordinator")
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=5.0), secret=SECRET)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            squatter = await dial_as(address, 1)
            await squatter.stream.send_all(announced("digest", 4 << 20))
            assert await closed_by_the_daemon(squatter, 2.0) == ["join_refused"]
            await squatter.aclose()
            real = await dial_as(address, 1)
            await real.send("join", join(1))
            await real.aclose()
            nursery.cancel_scope.cancel()
    assert "sent a digest frame where only heartbeat, join is accepted" in caplog.text


async def test_a_first_join_beyond_what_a_join_needs_is_refused_from_its_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before any model is known, a peer holding the secret authenticates as rank 1 and
    announces a 10 MiB join (under the join's 64 MiB schema cap): refused from the prefix, not
    a byte of the head waited for, in one line naming the rank, the frame's size and the
    limit; the real rank 1 joins afterwards."""
    caplog.set_level(logging.WARNING, logger="paramsync.coordinator")
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=5.0), secret=SECRET)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            squatter = await dial_as(address, 1)
            await squatter.stream.send_all(announced("join", 10 << 20))
            assert await closed_by_the_daemon(squatter, 2.0) == ["join_refused"]
            await squatter.aclose()
            real = await dial_as(address, 1)
            await real.send("join", join(1))
            await real.aclose()
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "sent a bad message" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("rank 1 sent a bad message")
    limit = f"frame of {10 << 20} bytes exceeds this receiver's limit of {FIRST_JOIN_MAX_FRAME}"
    assert limit in lines[0], lines[0]
    assert "only a join" in lines[0] and "FIRST_JOIN_MAX_FRAME" in lines[0]


async def test_a_member_announcing_a_bulk_to_the_coordinator_is_refused_unread() -> None:
    """Rank 0 joins, then announces a ``coll`` frame with 60 KiB of bulk (within the frame cap
    of its model): refused from the prefix, at once; the run, not started, is aborted naming
    the frame."""
    coordinator = Coordinator(2, CoordinatorOptions(heartbeat_deadline=5.0), secret=SECRET)
    aborted = False
    with trio.fail_after(20):
        try:
            async with trio.open_nursery() as nursery:
                address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
                member = await dial_as(address, 0)
                await member.send("join", join(0))
                await member.stream.send_all(announced("coll", 100, bulk_len=60 * 1024))
                assert await closed_by_the_daemon(member, 2.0) == ["abort"]
                await member.aclose()
        except* RunFailed:
            aborted = True
    assert aborted
    reason = coordinator.core.view.abort_reason or ""
    assert "a coll message announces 61440 bulk bytes on a link that takes no tensors" in reason
