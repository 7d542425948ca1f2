"""Point-to-point transports: send/recv/recv_into, ordering, closing, and the TCP rendezvous.

Every test runs over both transports where both apply, since collectives rely on the two
behaving the same: the same messages accepted, the same refused, the same errors.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import trio
from conftest import TRANSPORT_KINDS, bitwise_equal, free_port, open_group, run_ranks

from paramsync.runtime.collectives.ring import all_reduce, barrier, broadcast
from paramsync.runtime.config import DistributedConfig
from paramsync.runtime.errors import (
    AuthenticationError,
    CollectiveError,
    HandshakeError,
    ListenerBusy,
    PeerClosed,
    ProtocolError,
    StallError,
)
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION, encode_frame_bytes
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, TcpTransport

SECRET = "rendezvous-secret-for-tests"
COLL = {"op": 0, "hop": 0, "part": 0}


def sample_tensor(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, (numel,), generator=gen).to(dtype)


# --------------------------------------------------------------------------- send / recv


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_send_and_recv_every_kind_of_payload(kind: str) -> None:
    messages: list[tuple[str, dict[str, Any], torch.Tensor | None]] = [
        ("refuse", {"reason": "just text"}, None),
        ("rdv_join", {"host": "10.0.0.1", "port": 29500}, None),
        ("rdv_table", {"addresses": [["a", 1], ["b", 2]]}, None),
        ("coll", {"op": 7, "hop": 2, "part": 1}, sample_tensor(torch.float32, 5000)),
        ("coll", {"op": 8, "hop": 0, "part": 0}, sample_tensor(torch.bfloat16, 3)),
        ("coll", {"op": 9, "hop": 0, "part": 0}, torch.empty(0, dtype=torch.int64)),
        ("coll", COLL, sample_tensor(torch.float64, 1).reshape(())),
        ("coll", COLL, sample_tensor(torch.int32, 300_000)),  # larger than socket buffers
    ]
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, t1):

            async def sender() -> None:
                for msg_kind, fields, bulk in messages:
                    await t0.send(1, msg_kind, fields, bulk)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                for msg_kind, fields, bulk in messages:
                    got = await t1.recv(0)
                    assert got["kind"] == msg_kind and got["v"] == PROTOCOL_VERSION
                    assert {k: got[k] for k in fields} == fields
                    if bulk is not None:
                        assert bitwise_equal(got["data"], bulk)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_recv_into_writes_the_bulk_into_the_destination(kind: str) -> None:
    data = sample_tensor(torch.float16, 100_000, seed=3)
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, t1):
            out = torch.zeros(100_000, dtype=torch.float16)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(t0.send, 1, "coll", COLL, data)
                message = await t1.recv_into(0, out)
            assert message["data"] is out
            assert bitwise_equal(out, data)
            # a destination of another shape but the same dtype and size is fine
            grid = torch.zeros(100, 1000, dtype=torch.float16)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(t0.send, 1, "coll", COLL, data)
                await t1.recv_into(0, grid)
            assert bitwise_equal(grid.reshape(-1), data)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_non_contiguous_bulk_arrives_intact(kind: str) -> None:
    """A transposed tensor travels as its contiguous copy: the copy must outlive the send."""
    matrix = torch.arange(64 * 48, dtype=torch.float32).view(64, 48)
    view = matrix.t()
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, t1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(t0.send, 1, "coll", COLL, view)
                got = await t1.recv(0)
    assert torch.equal(got["data"], view)


MISMATCHES = {
    "dtype": (sample_tensor(torch.float32, 1000), torch.empty(1000, dtype=torch.float64)),
    "dtype-same-bytes": (sample_tensor(torch.int32, 1000), torch.empty(1000)),
    "too-small": (sample_tensor(torch.float32, 1000), torch.empty(999)),
    "too-large": (sample_tensor(torch.float32, 1000), torch.empty(1001)),
    "empty-destination": (sample_tensor(torch.float32, 10), torch.empty(0)),
    "empty-bulk": (torch.empty(0), torch.empty(5)),
    "no-tensor": (None, torch.empty(5)),
}


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
async def test_recv_into_a_wrong_destination_names_the_peer(kind: str, case: str) -> None:
    bulk, out = MISMATCHES[case]
    with trio.fail_after(10):
        async with open_group(kind, 3) as transports:
            if bulk is None:
                await transports[2].send(1, "refuse", {"reason": "no tensor here"})
            else:
                await transports[2].send(1, "coll", COLL, bulk)
            with pytest.raises(ProtocolError) as error:
                await transports[1].recv_into(2, out)
    assert error.value.peer == 2
    assert str(error.value).startswith("peer 2:")


EMPTY_MISMATCHES = {
    "empty-of-another-dtype": (
        torch.empty(0, dtype=torch.float32),
        torch.empty(0, dtype=torch.int64),
    ),
    "no-tensor-into-empty": (None, torch.empty(0)),
}


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("case", sorted(EMPTY_MISMATCHES))
async def test_empty_destinations_are_checked_the_same_on_both_transports(
    kind: str, case: str
) -> None:
    """The in-process transport refuses these (dtype differs / no tensor at all); TCP must
    refuse the same messages, as both share one codec and one contract."""
    bulk, out = EMPTY_MISMATCHES[case]
    with trio.fail_after(10):
        async with open_group(kind, 2) as (t0, t1):
            if bulk is None:
                await t0.send(1, "welcome", {})
            else:
                await t0.send(1, "coll", COLL, bulk)
            with pytest.raises(ProtocolError) as error:
                await t1.recv_into(0, out)
    assert error.value.peer == 0


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_messages_arrive_in_order_per_peer_without_crosstalk(kind: str) -> None:
    """Three ranks all send 60 numbered messages (some with bulk) to both others at once."""
    n, count = 3, 60

    def payload(src: int, dst: int, seq: int) -> torch.Tensor | None:
        if seq % 3 == 0:
            return None
        return torch.full((seq * 97 % 5000,), float(src * 1000 + dst * 100 + seq))

    with trio.fail_after(30):
        async with open_group(kind, n) as transports:

            async def send_to(src: int, dst: int) -> None:
                for seq in range(count):
                    bulk = payload(src, dst, seq)
                    fields = {"op": src, "hop": dst, "part": seq}
                    if bulk is None:
                        fields = {"host": f"{src}->{dst}", "port": seq + 1}
                        await transports[src].send(dst, "rdv_join", fields)
                    else:
                        await transports[src].send(dst, "coll", fields, bulk)

            async def recv_from(dst: int, src: int) -> None:
                for seq in range(count):
                    message = await transports[dst].recv(src)
                    expected = payload(src, dst, seq)
                    if expected is None:
                        assert message["kind"] == "rdv_join"
                        assert (message["host"], message["port"]) == (f"{src}->{dst}", seq + 1)
                    else:
                        assert (message["op"], message["hop"], message["part"]) == (src, dst, seq)
                        assert torch.equal(message["data"], expected)

            async with trio.open_nursery() as nursery:
                for src in range(n):
                    for dst in range(n):
                        if src != dst:
                            nursery.start_soon(send_to, src, dst)
                            nursery.start_soon(recv_from, dst, src)


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
@pytest.mark.parametrize("peer", [0, -1, 2, 5, True, "1", 1.0])
async def test_sending_to_self_or_outside_the_group_is_refused(kind: str, peer: Any) -> None:
    with trio.fail_after(10):
        async with open_group(kind, 2) as (t0, _t1):
            with pytest.raises(CollectiveError):
                await t0.send(peer, "welcome", {})
            with pytest.raises(CollectiveError):
                await t0.recv(peer)
            with pytest.raises(CollectiveError):
                await t0.recv_into(peer, torch.empty(1))


# --------------------------------------------------------------------------- closing


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_peer_closed_on_recv_and_send_after_the_other_side_closes(kind: str) -> None:
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, t1):
            await t0.send(1, "refuse", {"reason": "last words"})
            await t0.aclose()
            assert (await t1.recv(0))["reason"] == "last words"  # what was sent still arrives
            with pytest.raises(PeerClosed) as on_recv:
                await t1.recv(0)
            assert on_recv.value.peer == 0
            with pytest.raises(PeerClosed) as on_send:
                for _ in range(1000):  # TCP may take a few sends to notice the reset
                    await t1.send(0, "coll", COLL, torch.zeros(16_384))
            assert on_send.value.peer == 0


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_a_pending_recv_fails_with_peer_closed_when_the_peer_closes(kind: str) -> None:
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, t1):
            errors: list[BaseException] = []

            async def waiting() -> None:
                try:
                    await t1.recv(0)
                except BaseException as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                await trio.sleep(0.05)
                await t0.aclose()
    assert len(errors) == 1 and isinstance(errors[0], PeerClosed), errors
    assert errors[0].peer == 0


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
async def test_closing_a_transport_fails_its_own_pending_and_later_calls_with_peer_closed(
    kind: str,
) -> None:
    """A receive loop blocked when its own transport closes (a shutdown) gets the same
    PeerClosed on both transports, not a transport-specific exception."""
    with trio.fail_after(20):
        async with open_group(kind, 2) as (t0, _t1):
            errors: list[BaseException] = []

            async def waiting() -> None:
                try:
                    await t0.recv(1)
                except BaseException as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                await trio.sleep(0.05)
                await t0.aclose()
            with pytest.raises(PeerClosed):
                await t0.recv(1)
            with pytest.raises(PeerClosed):
                await t0.send(1, "welcome", {})
    assert len(errors) == 1 and isinstance(errors[0], PeerClosed), errors


# --------------------------------------------------------------------------- rendezvous


def connect_rank(world_size: int, rank: int, port: int, secret: str = SECRET) -> Any:
    """TcpTransport.connect for one rank of a group whose rank 0 listens on ``port``."""
    config = DistributedConfig(world_size, rank, f"127.0.0.1:{port}")
    return TcpTransport.connect(config, secret=secret, join_seconds=20)


@pytest.mark.parametrize("world_size", [1, 2, 4])
async def test_connect_forms_a_full_mesh_that_can_all_reduce(world_size: int) -> None:
    port = free_port()
    results: dict[int, torch.Tensor] = {}

    async def rank_main(rank: int) -> None:
        async with connect_rank(world_size, rank, port) as transport:
            assert (transport.rank, transport.world_size) == (rank, world_size)
            assert set(transport.connections) == set(range(world_size)) - {rank}
            value = torch.full((1000,), float(rank + 1))
            await all_reduce(transport, value)
            results[rank] = value
            root_value = torch.full((10,), float(rank))
            await broadcast(transport, root_value, world_size - 1)
            assert torch.equal(root_value, torch.full((10,), float(world_size - 1)))
            await barrier(transport)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for rank in reversed(range(world_size)):  # members may start before rank 0
                nursery.start_soon(rank_main, rank)
    total = float(world_size * (world_size + 1) // 2)
    for rank in range(world_size):
        assert torch.equal(results[rank], torch.full((1000,), total))


async def test_a_rank_with_another_secret_is_refused_and_the_real_one_joins() -> None:
    port = free_port()
    results: dict[int, float] = {}

    async def member(rank: int, secret: str) -> None:
        async with connect_rank(2, rank, port, secret) as transport:
            value = torch.tensor([float(rank + 1)])
            await all_reduce(transport, value)
            results[rank] = value.item()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0, SECRET)
            with pytest.raises(AuthenticationError):
                await member(1, "an entirely different secret")
            await member(1, SECRET)
    assert results == {0: 3.0, 1: 3.0}


async def test_a_duplicate_rank_is_refused_and_the_group_still_forms() -> None:
    """Two processes claim rank 1 of 3: one is refused with HandshakeError ("already taken"),
    the other completes the mesh with ranks 0 and 2."""
    port = free_port()
    refused: list[BaseException] = []
    one_refused = trio.Event()
    results: dict[str, float] = {}

    async def member(name: str, rank: int) -> None:
        try:
            async with connect_rank(3, rank, port) as transport:
                value = torch.tensor([float(rank + 1)])
                await all_reduce(transport, value)
                results[name] = value.item()
        except HandshakeError as exc:
            refused.append(exc)
            one_refused.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, "rank0", 0)
            nursery.start_soon(member, "rank1-a", 1)
            nursery.start_soon(member, "rank1-b", 1)
            await one_refused.wait()  # rank 0 still waits for rank 2, so both dialed it
            nursery.start_soon(member, "rank2", 2)
    assert len(refused) == 1 and type(refused[0]) is HandshakeError, refused
    assert "already taken" in str(refused[0])
    assert len(results) == 3 and {"rank0", "rank2"} <= set(results), results
    assert set(results.values()) == {6.0}


# ------------------------------------------------------------- direct and polled control paths


async def test_recv_matching_recognizes_the_expected_frame_and_decodes_anything_else() -> None:
    async with TcpTransport.open_group(2) as (t0, t1):
        signal = encode_frame_bytes("shm_step", {"op": 3, "step": 1})
        await t0.send_frame(1, signal)
        await t0.send(1, "shm_step", {"op": 3, "step": 2})  # same prefix length, other bytes
        await t0.send(1, "refuse", {"reason": "a longer message than the signal"})
        await t0.send_frame(1, signal)
        await t0.send(1, "coll", COLL, torch.arange(10, dtype=torch.float32))
        assert await t1.recv_matching(0, signal) is None
        other = await t1.recv_matching(0, signal)
        assert other is not None and (other["kind"], other["op"], other["step"]) == (
            "shm_step",
            3,
            2,
        )
        refusal = await t1.recv_matching(0, signal)
        assert refusal is not None and refusal["kind"] == "refuse"
        assert await t1.recv_matching(0, signal) is None
        with pytest.raises(ProtocolError, match="coll message with 40 bulk bytes") as info:
            await t1.recv_matching(0, signal)
        assert info.value.peer == 0


async def test_direct_sends_still_let_other_tasks_run() -> None:
    """Sends that never wait skip the scheduler, but not every time: a busy sender cannot
    starve its neighbours."""
    async with TcpTransport.open_group(2) as (t0, _t1):
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.lowlevel.checkpoint()
            before = ticks
            for step in range(200):  # ~9 KB in all: the socket buffer takes every frame
                await t0.send(1, "shm_step", {"op": 0, "step": step})
            assert ticks - before >= 200 // 16 - 1
            nursery.cancel_scope.cancel()


async def test_a_big_direct_send_finishes_through_the_event_loop() -> None:
    """A frame larger than the socket takes at once leaves partly at once, then the rest."""
    async with TcpTransport.open_group(2) as (t0, t1):
        big = torch.arange(24 << 20, dtype=torch.int32)  # 96 MiB: beyond any socket buffer
        out = torch.zeros_like(big)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t0.send, 1, "coll", COLL, big)
            await t1.recv_into(0, out)
        assert bitwise_equal(out, big)


async def test_polled_links_carry_signals_between_threads_and_name_a_silent_peer() -> None:
    async with TcpTransport.open_group(3) as group:
        signal = encode_frame_bytes("shm_step", {"op": 7, "step": 0})

        def exchange(links: Any, rank: int) -> list[object]:
            peers = [peer for peer in range(3) if peer != rank]
            for peer in peers:
                links.send_frame(peer, signal)
            deadline = time.monotonic() + 5
            return [links.recv_matching(peer, signal, deadline) for peer in peers]

        async def rank_fn(transport: Any) -> list[object]:
            peers = {peer for peer in range(3) if peer != transport.rank}
            async with transport.polled_links(peers) as links:
                return await trio.to_thread.run_sync(exchange, links, transport.rank)

        assert await run_ranks(group, rank_fn) == [[None, None]] * 3
        # The connections are the event loop's again, in trio's non-blocking mode.
        await group[0].send(1, "shm_step", {"op": 8, "step": 0})
        assert (await group[1].recv(0))["op"] == 8

        async with group[1].polled_links({0, 2}) as links:
            started = time.monotonic()
            with pytest.raises(StallError, match="sent nothing before the deadline") as info:
                await trio.to_thread.run_sync(
                    links.recv_matching, 2, signal, time.monotonic() + 0.3
                )
            assert info.value.peer == 2 and time.monotonic() - started < 3


async def test_a_cancelled_polled_wait_breaks_the_links_and_wakes_the_thread() -> None:
    async with TcpTransport.open_group(2) as (t0, _t1):
        signal = encode_frame_bytes("shm_step", {"op": 0, "step": 0})
        woke = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wait(links: Any) -> None:
            try:
                links.recv_matching(1, signal, time.monotonic() + 30)
            finally:
                token.run_sync_soon(woke.set)

        with trio.move_on_after(0.2):
            async with t0.polled_links({1}) as links:
                await trio.to_thread.run_sync(wait, links, abandon_on_cancel=True)
        with trio.fail_after(5):  # the abort shut the socket down: the thread is out at once
            await woke.wait()
        with pytest.raises(PeerClosed):
            await t0.send(1, "shm_step", {"op": 0, "step": 0})


# --------------------------------------------------------------------------- redialing


class FlakyDial:
    """Stands in for `tcp.dial`: fails ``failures`` times with ``error``, then connects;
    records the (mock clock) time of every attempt."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures = failures
        self.error = error
        self.times: list[float] = []

    async def __call__(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        self.times.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if len(self.times) <= self.failures:
            raise self.error
        return ("conn", "peer")


DIAL_ARGS: tuple[Any, ...] = (("127.0.0.1", 1), b"k" * 32, None)


@pytest.mark.parametrize("error", [ConnectionRefusedError("nobody listens"), ListenerBusy("busy")])
async def test_dial_with_retry_backs_off_exponentially_with_jitter(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any, error: BaseException
) -> None:
    """Waits start at 10 ms and double up to 0.5 s, each plus up to 0.1 s of jitter, so two
    dialers that fail at the same instant do not redial at the same instants."""
    dialers = [FlakyDial(9, error), FlakyDial(9, error)]
    for dialer in dialers:
        monkeypatch.setattr(tcp, "dial", dialer)
        assert await tcp.dial_with_retry(*DIAL_ARGS) == ("conn", "peer")
    for dialer in dialers:
        waits = [b - a for a, b in zip(dialer.times, dialer.times[1:])]
        assert len(waits) == 9
        for k, wait in enumerate(waits):
            floor = min(0.5, 0.01 * 2**k)
            assert floor - 1e-9 <= wait <= min(0.5, floor + 0.1) + 1e-9, (k, wait)
    first, second = ([b - a for a, b in zip(d.times, d.times[1:])] for d in dialers)
    assert first != second  # jittered: the odds of nine equal uniform draws are nil


async def test_dial_with_retry_retries_until_the_callers_deadline(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    dialer = FlakyDial(10**9, ConnectionRefusedError("nobody listens"))
    monkeypatch.setattr(tcp, "dial", dialer)
    with trio.move_on_after(30) as scope:
        await tcp.dial_with_retry(*DIAL_ARGS)
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(30)
    assert len(dialer.times) >= 30 / 0.6  # no attempt cap: the deadline alone stops it


async def test_dial_with_retry_does_not_retry_a_refusal(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    dialer = FlakyDial(1, AuthenticationError("wrong secret"))
    monkeypatch.setattr(tcp, "dial", dialer)
    with pytest.raises(AuthenticationError, match="wrong secret"):
        await tcp.dial_with_retry(*DIAL_ARGS)
    assert len(dialer.times) == 1


async def test_dial_with_retry_connects_once_a_late_listener_comes_up() -> None:
    port = free_port()
    me = Identity(DEFAULT_GROUP, 2, 1)
    key = load_secret(SECRET, {})
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:

            async def listen_late() -> None:
                await trio.sleep(0.3)
                listener = (await trio.open_tcp_listeners(port, host="127.0.0.1"))[0]
                stream = await listener.accept()
                conn, peer = await tcp.accept(
                    stream, key, Identity(DEFAULT_GROUP, 2, 0), lambda _peer: None
                )
                assert peer.rank == 1
                await conn.aclose()
                await listener.aclose()

            nursery.start_soon(listen_late)
            conn, peer = await tcp.dial_with_retry(("127.0.0.1", port), key, me)
            assert peer.rank == 0
            await conn.aclose()
