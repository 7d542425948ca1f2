"""An on-path relay holding no secret, between a worker and the coordinator or between two
ranks (`paramsync.runtime.testing.relay.FrameRelay`), against frame authentication (issue 18 row 1).

The relay passes the handshake through, then (a) injects a forged ``abort``, (b) flips a byte
in a bulk gradient frame of the TCP ring, (c) drops, replays or reorders a frame. Every time
the receiving side closes the connection with a `FrameAuthenticationError` naming the peer,
and acts on nothing the relay forged or altered.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio

from paramsync.runtime.collectives.ring import all_reduce
from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import FrameAuthenticationError, PeerClosed, ProtocolError, pick_error
from paramsync.runtime.protocol.frame_auth import frame_session
from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.wire import encode_frame
from paramsync.runtime.testing.relay import (
    TO_DIALER,
    TO_LISTENER,
    Attack,
    Drop,
    FlipBulk,
    FrameRelay,
    Inject,
    Replay,
    Swap,
    relayed_pair,
)
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, TcpTransport, dial

SECRET = b"relay-test-secret-0123456789"
SECONDS = 30


@asynccontextmanager
async def relayed_ranks(attack: Attack) -> AsyncIterator[tuple[TcpTransport, TcpTransport]]:
    """Ranks 0 and 1 whose connection runs through the relay (rank 1 dials it)."""
    async with relayed_pair(SECRET, attack) as (rank0, rank1):
        assert rank0.connections[1].frames_authenticated
        assert rank1.connections[0].frames_authenticated
        yield rank0, rank1


def _refused_by_frame_authentication(error: BaseException | None, peer: object) -> None:
    assert isinstance(error, FrameAuthenticationError), repr(error)
    assert "frame authentication" in str(error)
    assert error.peer == peer and str(error).startswith(f"peer {peer}: ")


# --------------------------------------------------------------------------- (a) injection


async def test_a_forged_abort_toward_a_worker_is_refused_not_acted_on() -> None:
    """Relay between a worker (rank 0) and the coordinator: after the coordinator's first
    genuine frame (start_run), the relay slips in an ``abort``. The worker's connection is
    closed naming the coordinator and frame authentication; it never sees the abort."""
    coordinator = Coordinator(2, secret=SECRET)
    attack = Inject(TO_DIALER, after=1)
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(coordinator.serve_tcp, "127.0.0.1", 0))
            relay = FrameRelay(address, attack)
            relay_address = await nursery.start(relay.serve)
            worker, _ = await dial(relay_address, SECRET, Identity(DEFAULT_GROUP, 2, 0))
            other, _ = await dial(address, SECRET, Identity(DEFAULT_GROUP, 2, 1))
            for rank, conn in enumerate((worker, other)):
                await conn.send("join", {"host": "127.0.0.1", "port": 9000 + rank, "params": []})
            assert (await other.recv())["kind"] == "start_run"
            assert (await worker.recv())["kind"] == "start_run"
            with pytest.raises(ProtocolError) as refused:
                while True:
                    message = await worker.recv()
                    assert message["kind"] != "abort", f"the worker got a forged {message}"
            assert attack.done, attack.log
            where = f"{relay_address[0]}:{relay_address[1]}"  # the coordinator, as dialed
            _refused_by_frame_authentication(refused.value, where)
            assert worker.closed
            await worker.aclose()
            await other.aclose()
            nursery.cancel_scope.cancel()


async def test_a_forged_abort_after_200_genuine_frames_between_ranks_is_refused() -> None:
    attack = Inject(TO_DIALER, after=200)
    with trio.fail_after(SECONDS):
        async with relayed_ranks(attack) as (rank0, rank1):
            for step in range(201):
                await rank0.send(1, "commit", {"epoch": 1, "step": step})
            for step in range(200):
                assert (await rank1.recv(0))["step"] == step
            with pytest.raises(ProtocolError) as refused:
                message = await rank1.recv(0)
                raise AssertionError(f"rank 1 got a forged {message}")
            _refused_by_frame_authentication(refused.value, 0)
            assert rank1.connections[0].closed


# --------------------------------------------------------------------------- (b) bulk


async def _ring_errors(
    ranks: tuple[TcpTransport, TcpTransport], tensors: list[torch.Tensor], **options: Any
) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None, None]

    async def reduce(rank: int) -> None:
        try:
            await all_reduce(ranks[rank], tensors[rank], **options)
        except BaseException as exc:
            errors[rank] = pick_error(exc)
            ranks[rank].abort()

    async with trio.open_nursery() as nursery:
        for rank in range(2):
            nursery.start_soon(reduce, rank)
    return errors


@pytest.mark.parametrize("threaded", [True, False], ids=["blocking-threads", "trio-tasks"])
@pytest.mark.parametrize("offset", [1000, (1 << 20) - 3], ids=["first-slice", "last-slice"])
async def test_a_flipped_byte_in_a_gradient_frame_is_refused_never_reduced(
    threaded: bool, offset: int
) -> None:
    """The relay flips one byte of the first bulk frame toward rank 0 (a part it reduces
    into its own): rank 0 refuses the frame, naming rank 1, and no element of its tensor
    holds a sum with the altered bytes (1 + 2 = 3 or its own 1, nothing else). The blocking
    path checks a bulk slice by slice as it lands (`paramsync.runtime.transport.tcp._MAC_SLICE`): a
    flip in its first slice or in its last is refused alike."""
    attack = FlipBulk(TO_LISTENER, nth=0, offset=offset)
    elements = 1 << 20  # 4 MiB: two ring segments of 2 MiB, parts of 1 MiB
    tensors = [torch.full((elements,), 1.0), torch.full((elements,), 2.0)]
    options = {"chunk_bytes": 1 << 20, "threaded_min_bytes": 0 if threaded else 1 << 40}
    with trio.fail_after(SECONDS):
        async with relayed_ranks(attack) as ranks:
            errors = await _ring_errors(ranks, tensors, **options)
    assert attack.done, attack.log
    values = set(torch.unique(tensors[0]).tolist())
    assert values <= {1.0, 3.0}, f"rank 0 reduced the altered bytes: {values}"
    _refused_by_frame_authentication(errors[0], 1)
    assert isinstance(errors[1], PeerClosed | FrameAuthenticationError), repr(errors[1])


async def test_an_untouched_ring_through_the_relay_reduces_correctly() -> None:
    """The relay itself is transparent: the same ring with no attack gives the sum."""
    tensors = [torch.full((1 << 20,), 1.0), torch.full((1 << 20,), 2.0)]
    with trio.fail_after(SECONDS):
        async with relayed_ranks(Attack()) as ranks:
            errors = await _ring_errors(ranks, tensors, chunk_bytes=1 << 20, threaded_min_bytes=0)
    assert errors == [None, None]
    assert torch.equal(tensors[0], torch.full((1 << 20,), 3.0))
    assert torch.equal(tensors[1], tensors[0])


# --------------------------------------------------------------------------- (c) stream order


@pytest.mark.parametrize("attack_type", [Drop, Replay, Swap])
@pytest.mark.parametrize("path", ["recv", "recv_matching", "polled"])
async def test_a_dropped_replayed_or_reordered_frame_is_refused(
    attack_type: type[Attack], path: str
) -> None:
    """Rank 0 sends ten step signals; the relay drops, replays or swaps the fifth. Rank 1
    takes the first four (five with a replay: the fifth is genuine, its copy is not) and
    refuses what comes next (by `recv`, by the precoded byte
    compare of `recv_matching`, or on the polled thread path)."""
    attack = attack_type(TO_DIALER, 4)  # type: ignore[call-arg]
    with trio.fail_after(SECONDS):
        async with relayed_ranks(attack) as (rank0, rank1):
            frames = [_signal(step) for step in range(10)]
            for frame in frames:
                await rank0.send_frame(1, frame)
            with pytest.raises(ProtocolError) as refused:
                for step in range(10):
                    if path == "recv":
                        assert (await rank1.recv(0))["step"] == step
                    elif path == "recv_matching":
                        assert await rank1.recv_matching(0, frames[step]) is None
                    else:
                        await _polled_matching(rank1, frames[step])
                    genuine = 5 if attack_type is Replay else 4
                    assert step < genuine, f"frame {step} accepted after the {attack.log}"
            assert attack.done, attack.log
            _refused_by_frame_authentication(refused.value, 0)


def _signal(step: int) -> bytes:
    from paramsync.runtime.protocol.wire import encode_frame_bytes

    return encode_frame_bytes("commit", {"epoch": 1, "step": step})


async def _polled_matching(transport: TcpTransport, frame: bytes) -> None:
    async with transport.polled_links({0}) as links:
        got = await trio.to_thread.run_sync(
            lambda: links.recv_matching(0, frame, time.monotonic() + SECONDS)
        )
    assert got is None, got


async def test_a_thread_still_sending_gets_the_refusal_not_the_hang_up_it_caused() -> None:
    """On the threaded ring one thread sends while the other receives on the same
    connection. When the receiving thread refuses a forged frame, its end shuts the
    connection down; the sending thread, blocked meanwhile, then wakes with the refusal
    itself, not with the broken pipe (`make reliability-hostile`'s `flip_bulk_threads` once
    reported "NOT REFUSED: PeerClosed ... Broken pipe": the echo had been recorded first)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]
    near = Connection(await trio.open_tcp_stream(*address), peer=1)
    far = Connection(await listeners[0].accept(), peer=0)
    key = bytes(range(32))
    near.authenticate_frames(key, dialer=True)
    forger = frame_session(key, dialer=False).sealer  # what `far` would send, then altered
    parts = encode_frame("coll", {"op": 1, "hop": 0, "part": 0}, torch.ones(1 << 16))
    frame = bytearray(b"".join(bytes(part) for part in parts) + forger.seal(parts))
    frame[len(frame) - 1000] ^= 0x01  # in the bulk
    await far.stream.send_all(bytes(frame))
    near.set_blocking(True, 30.0)
    errors: dict[str, BaseException] = {}

    def send() -> None:  # far never reads: this blocks once the socket buffers are full
        try:
            near.send_blocking("coll", {"op": 1, "hop": 0, "part": 0}, torch.ones(1 << 24))
        except ProtocolError as exc:
            errors["send"] = exc

    def receive() -> None:
        try:
            near.recv_into_blocking(torch.empty(1 << 16))
        except ProtocolError as exc:
            errors["receive"] = exc

    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, send)
            nursery.start_soon(trio.to_thread.run_sync, receive)
    for side in ("receive", "send"):
        assert isinstance(errors[side], FrameAuthenticationError), (side, repr(errors[side]))
        assert "peer 1: frame authentication failed on frame 0" in str(errors[side])
    assert "this end closed the connection" in str(errors["send"])
    for conn in (near, far):
        await conn.aclose()
    await listeners[0].aclose()
