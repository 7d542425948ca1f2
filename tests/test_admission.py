"""Admission control: the pending-handshake cap, the handshake deadline, accept back-off, the
refusal log and its rate limit (`paramsync.runtime.transport.admission`), alone and wired into the
coordinator's and
the rendezvous' listeners.

Gate-only tests run under trio's MockClock with fake listeners and streams, so time is exact.
Socket tests use real loopback connections under a deadline; their outcomes do not depend on
timing beyond generous margins.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import re
import struct
import tracemalloc
from typing import Any

import pytest
import trio
import trio.testing

from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import (
    AuthenticationError,
    FrameTooLarge,
    HandshakeError,
    ListenerBusy,
    PeerClosed,
    ProtocolError,
    StallError,
)
from paramsync.runtime.protocol.handshake import NONCE_SIZE, Identity
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME, encode_frame_bytes
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.admission import (
    FAILURE_CATEGORIES,
    AdmissionGate,
    AdmissionLimits,
    HandshakeTicket,
    SourceLoad,
    classify_failure,
)

SECRET = b"admission-tests-secret"
GROUP = "admission"
LISTENER = Identity(GROUP, 2, 0)
DIALER = Identity(GROUP, 2, 1)
ADMISSION_LOG = "paramsync.admission"


def admit_all(_peer: Identity) -> str | None:
    return None


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ADMISSION_LOG and r.levelno >= 30]


class FakeStream:
    """Stands in for an accepted stream where the gate only needs ``aclose``."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class FakeListener:
    """Hands out what ``script`` lists (streams, or OSErrors to raise), then blocks."""

    def __init__(self, script: list[Any]) -> None:
        self.script = list(script)

    async def accept(self) -> Any:
        await trio.lowlevel.checkpoint()
        if not self.script:
            await trio.sleep_forever()
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        pass


# --------------------------------------------------------------------------- limits, categories


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_pending": 0}, "max_pending"),
        ({"max_pending": True}, "max_pending"),
        ({"handshake_seconds": 0.0}, "handshake_seconds"),
        ({"handshake_seconds": math.nan}, "handshake_seconds"),
        ({"log_lines_per_second": 0}, "log_lines_per_second"),
        ({"max_pending_per_source": 0}, "max_pending_per_source"),
        ({"evict_after_seconds": 0.0}, "evict_after_seconds"),
    ],
)
def test_limits_refuse_values_that_cannot_work(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        AdmissionLimits(**kwargs)


def test_default_limits() -> None:
    limits = AdmissionLimits()
    assert (limits.max_pending, limits.handshake_seconds) == (64, 10.0)
    assert (limits.per_source, limits.evict_after) == (8, 1.0)
    assert AdmissionLimits(max_pending=4, handshake_seconds=0.5).per_source == 4
    assert AdmissionLimits(max_pending=4, handshake_seconds=0.5).evict_after == 0.5


# --------------------------------------------------------------------------- fairness


class _FakeSocket:
    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)

    def getpeername(self) -> tuple[str, int]:
        return self.address

    def fileno(self) -> int:
        raise OSError("a fake socket has no descriptor")


class SourcedStream(FakeStream):
    """A fake accepted stream from ``host`` (what the per-source cap counts)."""

    ports = itertools.cycle(range(40000, 60000))

    def __init__(self, host: str) -> None:
        super().__init__()
        self.socket = _FakeSocket(host, next(self.ports))


FAIR = AdmissionLimits(max_pending=4, max_pending_per_source=2, evict_after_seconds=1.0)


async def test_one_source_holds_at_most_its_share(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = AdmissionGate("test", FAIR)
    held = [await gate.admit(SourcedStream("10.0.0.1")) for _ in range(2)]  # type: ignore[arg-type]
    assert all(held) and gate.pending_from("10.0.0.1") == 2
    extra = SourcedStream("10.0.0.1")
    assert await gate.admit(extra) is None  # type: ignore[arg-type]
    assert extra.closed and gate.stats.refused_by_source == 1
    assert any(
        "[over_cap]" in line and "from 10.0.0.1 (the cap per source is 2)" in line
        for line in refusal_lines(caplog)
    )
    assert await gate.admit(SourcedStream("10.0.0.2")) is not None  # type: ignore[arg-type]


async def test_a_source_at_its_cap_evicts_its_own_oldest_holder(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = AdmissionGate("test", FAIR)
    oldest = await gate.admit(SourcedStream("10.0.0.1"))  # type: ignore[arg-type]
    await trio.sleep(0.5)
    younger = await gate.admit(SourcedStream("10.0.0.1"))  # type: ignore[arg-type]
    assert oldest is not None and younger is not None
    await trio.sleep(0.6)  # the oldest is 1.1 s old, the younger 0.6 s
    newcomer = await gate.admit(SourcedStream("10.0.0.1"))  # type: ignore[arg-type]
    assert newcomer is not None and oldest.evicted and not younger.evicted
    assert gate.stats.evicted == 1 and gate.stats.failed == {"evicted": 1}
    assert gate.pending_from("10.0.0.1") == 2 and gate.stats.pending == 2
    with pytest.raises(HandshakeError, match=r"evicted: .*made no progress for 1\.1 s"):
        with oldest:  # the evicted handshake's block is cancelled at once
            await trio.sleep(60)
    assert gate.stats.pending == 2  # its slot was freed once, at the eviction
    assert any("[evicted]" in line for line in refusal_lines(caplog))


async def test_a_newcomer_takes_an_old_slot_from_the_busiest_source_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(max_pending=4, evict_after_seconds=1.0))
    busiest = [await gate.admit(SourcedStream("10.0.0.1")) for _ in range(3)]  # type: ignore[arg-type]
    other = await gate.admit(SourcedStream("10.0.0.2"))  # type: ignore[arg-type]
    assert all(busiest) and other is not None
    # Young holders are never evicted: a newcomer is refused.
    assert await gate.admit(SourcedStream("10.0.0.3")) is None  # type: ignore[arg-type]
    await trio.sleep(1.0)
    # 10.0.0.2 holds 1 slot: it may take one from 10.0.0.1 (3 >= 1 + 2), its oldest.
    assert await gate.admit(SourcedStream("10.0.0.2")) is not None  # type: ignore[arg-type]
    assert busiest[0] is not None and busiest[0].evicted
    assert [t.evicted for t in busiest if t is not None] == [True, False, False]
    # Now 2 and 2: nobody is two ahead, so 10.0.0.2 cannot take another.
    assert await gate.admit(SourcedStream("10.0.0.2")) is None  # type: ignore[arg-type]
    # A fresh source (0 slots) may: 10.0.0.1 and 10.0.0.2 both hold 2 >= 0 + 2.
    assert await gate.admit(SourcedStream("10.0.0.3")) is not None  # type: ignore[arg-type]
    assert gate.stats.evicted == 2 and gate.stats.pending == 4


# The slow-holders phase of `make reliability-hostile` (issue 18, row 3), played against the
# gate alone under the mock clock: 96 holders from eight addresses (127.0.0.2-9) fill the 64
# slots and come back whenever they lose one; after 2 s ranks 0 and 1 join and rank 0 rejoins
# from 127.0.0.1, each with 2.5 s, dialing as `tcp.dial_with_retry` does (a busy refusal, then
# a wait from 10 ms doubling to 0.5 s). Until session 10 the gate let a source take a slot
# only from a handshake 1 s old, and each address's own holders took theirs back the instant
# they were: the workers, backing off, arrived between those instants every time.

HOLDER_SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]
WORKER_SOURCE = "127.0.0.1"
ROW3 = AdmissionLimits(max_pending=64, handshake_seconds=10.0, log_lines_per_second=None)


async def holder(
    gate: AdmissionGate, source: str, pause: float, hang_up_after: float | None
) -> None:
    """A slow holder that comes back ``pause`` s after it loses its slot (refused, evicted or
    at the deadline); with ``hang_up_after`` it also hangs up on its own after holding that
    long, to keep every connection young."""
    while True:
        ticket = await gate.admit(SourcedStream(source))  # type: ignore[arg-type]
        if ticket is not None:
            try:
                with ticket:
                    if hang_up_after is None:
                        await trio.sleep_forever()
                    await trio.sleep(hang_up_after)
                    raise PeerClosed("the holder hung up")
            except (HandshakeError, PeerClosed):
                pass
        await trio.sleep(pause)


async def join_with_backoff(gate: AdmissionGate, within: float) -> tuple[float | None, int]:
    """Dial from the workers' address like `tcp.dial_with_retry` (without its jitter) until
    admitted, then finish the handshake in 5 ms: (seconds it took or None, dials)."""
    started, wait, dials = trio.current_time(), 0.01, 0
    with trio.move_on_after(within):
        while True:
            dials += 1
            ticket = await gate.admit(SourcedStream(WORKER_SOURCE))  # type: ignore[arg-type]
            if ticket is not None:
                with ticket:
                    await trio.sleep(0.005)
                return trio.current_time() - started, dials
            await trio.sleep(wait)
            wait = min(2 * wait, 0.5)
    return None, dials


@pytest.mark.parametrize(
    ("pause", "hang_up_after"),
    [
        (0.02, None),  # cut, and back 20 ms later: the churn of the failed run (3925 connections)
        (0.05, None),  # the pause of benchmarks/hostile.py's holders
        (0.003, 0.9),  # hang up on their own before any connection is 1 s old, back at once
    ],
)
async def test_churning_holders_cannot_keep_known_ranks_out(
    autojump_clock: trio.testing.MockClock, pause: float, hang_up_after: float | None
) -> None:
    gate = AdmissionGate("coordinator", ROW3)
    took: dict[str, tuple[float | None, int]] = {}
    async with trio.open_nursery() as nursery:
        for index in range(96):
            source = HOLDER_SOURCES[index % len(HOLDER_SOURCES)]
            nursery.start_soon(holder, gate, source, pause, hang_up_after)
        await trio.sleep(2.0)
        assert gate.stats.pending == 64 and gate.stats.refused_by_cap > 32
        for step in ("join 0", "join 1", "rejoin 0"):
            took[step] = await join_with_backoff(gate, 2.5)
        nursery.cancel_scope.cancel()
    # Each got in at its first dial: the holders' addresses had been sitting on their slots.
    assert all(dials == 1 and seconds is not None for seconds, dials in took.values()), took
    assert gate.stats.admitted == 3 and gate.stats.failed["evicted"] >= 1
    assert all(gate.pending_from(s) == 0 for s in HOLDER_SOURCES)  # every slot freed


async def test_a_source_that_just_arrived_is_not_evicted_until_it_has_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Eight connections of one address arriving at once (a burst of real handshakes looks
    the same at first) keep their slots until the address's load reaches 1: 0.13 s for 8."""
    gate = AdmissionGate("test", AdmissionLimits(max_pending=8, evict_after_seconds=1.0))
    burst = [await gate.admit(SourcedStream("10.0.0.1")) for _ in range(8)]  # type: ignore[arg-type]
    assert all(burst)
    await trio.sleep(0.1)
    assert gate.load_of("10.0.0.1") == pytest.approx(8 * (1 - math.exp(-0.1)))
    assert await gate.admit(SourcedStream("10.0.0.2")) is None  # type: ignore[arg-type]
    await trio.sleep(0.04)  # load 1.07
    assert await gate.admit(SourcedStream("10.0.0.2")) is not None  # type: ignore[arg-type]
    assert [t.evicted for t in burst if t is not None] == [True] + [False] * 7


async def test_a_source_keeps_its_load_while_it_renews_its_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Hanging up and reconnecting does not lower an address's load; holding fewer does."""
    gate = AdmissionGate("test", AdmissionLimits(max_pending=4, evict_after_seconds=1.0))
    tickets = [await gate.admit(SourcedStream("10.0.0.1")) for _ in range(4)]
    for _ in range(20):  # every 0.1 s one of them hangs up and another connects at once
        await trio.sleep(0.1)
        oldest = tickets.pop(0)
        assert oldest is not None
        oldest.release()
        tickets.append(await gate.admit(SourcedStream("10.0.0.1")))  # type: ignore[arg-type]
    assert gate.load_of("10.0.0.1") > 3.4  # 4 * (1 - e^-2)
    assert all(t is not None and trio.current_time() - t.started < 0.5 for t in tickets)
    newcomer = await gate.admit(SourcedStream("10.0.0.2"))  # type: ignore[arg-type]
    assert newcomer is not None and tickets[0] is not None and tickets[0].evicted
    before = gate.load_of("10.0.0.1")
    for ticket in tickets:
        if ticket is not None:
            ticket.release()
    await trio.sleep(1.0)  # holding nothing, its load decays
    assert gate.load_of("10.0.0.1") == pytest.approx(before * math.exp(-1.0))


def test_source_load_is_an_exponential_average_of_the_slots_held() -> None:
    load = SourceLoad(tau=2.0, now=10.0)
    assert load.load(10.0) == 0.0 and load.held == 0
    load.change(+1, 10.0)
    load.change(+1, 10.0)
    assert load.load(12.0) == pytest.approx(2 * (1 - math.exp(-1.0)))
    load.change(-2, 12.0)
    assert load.load(14.0) == pytest.approx(2 * (1 - math.exp(-1.0)) * math.exp(-1.0))
    assert load.load(1e6) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("error", "elapsed", "category"),
    [
        (FrameTooLarge("big"), 0.0, "frame_too_large"),
        (AuthenticationError("secret"), 0.0, "authentication"),
        (PeerClosed("gone"), 0.0, "closed"),
        (StallError("stalled"), 0.0, "closed"),
        (HandshakeError("handshake not finished within 1 s"), 1.0, "deadline"),
        (HandshakeError("rank 1 is already taken"), 0.1, "refused"),
        (ProtocolError("malformed CBOR"), 0.0, "malformed"),
        (ConnectionResetError(), 0.0, "connection_error"),
        (trio.BrokenResourceError(), 0.0, "connection_error"),
        (RuntimeError("bug"), 0.0, "other"),
    ],
)
def test_failures_are_classified(error: Exception, elapsed: float, category: str) -> None:
    assert category in FAILURE_CATEGORIES
    assert classify_failure(error, elapsed, deadline=1.0) == category


# --------------------------------------------------------------------------- the gate alone


async def test_ticket_deadline_covers_the_whole_block(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(handshake_seconds=0.5))
    ticket = await gate.admit(FakeStream())  # type: ignore[arg-type]
    assert ticket is not None and ticket.seconds == 0.5 and gate.stats.pending == 1
    started = trio.current_time()
    with pytest.raises(HandshakeError, match=r"not finished within 0\.5 s") as error:
        with ticket:
            await trio.sleep(60)  # e.g. a TLS handshake that accept's own deadline misses
    assert trio.current_time() - started == pytest.approx(0.5)
    assert error.value.peer == "unknown peer"
    assert gate.stats.pending == 0 and gate.stats.failed == {"deadline": 1}
    assert any("[deadline]" in line for line in refusal_lines(caplog))


async def test_ticket_counts_success_and_failure_and_frees_the_slot_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(max_pending=2))
    first = await gate.admit(FakeStream())  # type: ignore[arg-type]
    second = await gate.admit(FakeStream())  # type: ignore[arg-type]
    assert first is not None and second is not None
    assert gate.stats.pending == gate.stats.peak_pending == 2
    with first:
        await trio.lowlevel.checkpoint()
    with pytest.raises(AuthenticationError), second:
        raise AuthenticationError("authentication failed: wrong shared secret")
    second.release()  # idempotent
    assert gate.stats.pending == 0
    assert gate.stats.admitted == 1 and gate.stats.failed == {"authentication": 1}


async def test_a_cancelled_handshake_frees_its_slot_without_counting_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate("test")
    ticket = await gate.admit(FakeStream())  # type: ignore[arg-type]
    assert ticket is not None
    with trio.CancelScope() as scope:
        with ticket:
            scope.cancel()
            await trio.sleep(1)
    assert gate.stats.pending == 0 and not gate.stats.failed and gate.stats.admitted == 0


async def test_over_the_cap_the_stream_is_closed_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(max_pending=1))
    held = await gate.admit(FakeStream())  # type: ignore[arg-type]
    extra = FakeStream()
    assert held is not None
    assert await gate.admit(extra) is None  # type: ignore[arg-type]
    assert extra.closed
    assert gate.stats.refused_by_cap == 1 and gate.stats.pending == 1
    (line,) = refusal_lines(caplog)
    assert "[over_cap]" in line and "the cap is 1" in line and "closed at once" in line
    held.release()
    assert await gate.admit(FakeStream()) is not None  # type: ignore[arg-type]


async def test_refusal_lines_are_rate_limited_and_summed_up(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    limits = AdmissionLimits(max_pending=1, log_lines_per_second=5, evict_after_seconds=10)
    gate = AdmissionGate("test", limits)  # (no eviction within the test's 1 s)
    assert await gate.admit(FakeStream()) is not None  # type: ignore[arg-type]
    for _ in range(30):
        assert await gate.admit(FakeStream()) is None  # type: ignore[arg-type]
    lines = refusal_lines(caplog)
    assert len(lines) == 5 and all("[over_cap]" in line for line in lines)
    assert gate.stats.refused_by_cap == 30 and gate.stats.log_lines_suppressed == 25
    await trio.sleep(1.0)  # a new window: the next refusal first sums up the previous one
    assert await gate.admit(FakeStream()) is None  # type: ignore[arg-type]
    summary, line = refusal_lines(caplog)[5:]
    assert "refused 25 more connections" in summary and "over_cap=25" in summary
    assert "[over_cap]" in line


async def test_serve_backs_off_when_out_of_descriptors(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    emfile = OSError(errno.EMFILE, "Too many open files")
    stream = FakeStream()
    listener = FakeListener([emfile, emfile, stream])
    gate = AdmissionGate("test")
    handled: list[Any] = []

    async def handle(got: Any, ticket: HandshakeTicket) -> None:
        with ticket:
            handled.append((got, trio.current_time()))

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.serve, listener, nursery, handle)
        await wait_until(lambda: bool(handled))
        nursery.cancel_scope.cancel()
    assert handled[0][0] is stream
    assert handled[0][1] - started >= 0.2  # two back-offs of 0.1 s
    assert gate.stats.accept_errors == 2 and gate.stats.admitted == 1
    lines = refusal_lines(caplog)
    assert sum("[accept_error]" in line and "Too many open files" in line for line in lines) == 2


async def test_accept_lets_other_errors_through(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate("test")
    listener = FakeListener([OSError(errno.EINVAL, "Invalid argument")])
    with pytest.raises(OSError, match="Invalid argument"):
        await gate.accept(listener)  # type: ignore[arg-type]
    assert gate.stats.accept_errors == 0


async def test_a_handler_that_ignores_its_ticket_still_frees_the_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(max_pending=1))
    send, receive = trio.open_memory_channel[Any](0)
    seen: list[Any] = []

    class ChannelListener:
        async def accept(self) -> Any:
            return await receive.receive()

    async def handle(stream: Any, _ticket: HandshakeTicket) -> None:
        seen.append(stream)

    streams = [FakeStream() for _ in range(3)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.serve, ChannelListener(), nursery, handle)
            for count, stream in enumerate(streams, 1):
                await send.send(stream)
                await wait_until(lambda count=count: len(seen) == count and not gate.stats.pending)
            nursery.cancel_scope.cancel()
    assert seen == streams and gate.stats.refused_by_cap == 0


async def test_totals_are_logged_when_serving_stops(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ADMISSION_LOG)
    gate = AdmissionGate("test")

    async def handle(_stream: Any, ticket: HandshakeTicket) -> None:
        with pytest.raises(PeerClosed), ticket:
            raise PeerClosed("connection closed by the peer")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.serve, FakeListener([FakeStream()]), nursery, handle)
        await wait_until(lambda: bool(gate.stats.failed))
        nursery.cancel_scope.cancel()
    totals = [r.getMessage() for r in caplog.records if "admission totals" in r.getMessage()]
    assert len(totals) == 1
    assert "connections=1 admitted=0 over_cap=0 closed=1" in totals[0]
    assert gate.stats.as_dict()["failed"] == {"closed": 1}


# --------------------------------------------------------------------------- over loopback


async def serve_gate(
    gate: AdmissionGate,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A listener whose connections run paramsync.runtime.transport.tcp.accept under the gate's
    tickets."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    claimed: set[int] = set()

    def admit(peer: Identity) -> str | None:
        if peer.rank in claimed:
            return f"rank {peer.rank} is already taken"
        claimed.add(peer.rank)
        return None

    async def handle(stream: trio.SocketStream, ticket: HandshakeTicket) -> None:
        try:
            with ticket:
                conn, _ = await tcp.accept(
                    stream, SECRET, LISTENER, admit, handshake_seconds=ticket.seconds
                )
        except (ProtocolError, OSError, trio.BrokenResourceError):
            return
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        task_status.started(tuple(listener.socket.getsockname()[:2]))
        try:
            await gate.serve(listener, nursery, handle)
        finally:
            await listener.aclose()


def local_address(stream: trio.SocketStream) -> str:
    host, port = stream.socket.getsockname()[:2]
    return f"{host}:{port}"


async def wait_until(predicate: Any, seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling the gate's counters
            await trio.sleep(0.005)


async def read_refusal(stream: trio.SocketStream) -> dict[str, Any]:
    with trio.fail_after(2):
        return await tcp.Connection(stream).recv(HANDSHAKE_MAX_FRAME)


async def test_tcp_over_the_cap_is_refused_with_a_reason_then_slots_free_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = AdmissionGate("test", AdmissionLimits(max_pending=2, handshake_seconds=10))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_gate, gate)
            silent = [await trio.open_tcp_stream(*address) for _ in range(2)]
            await wait_until(lambda: gate.stats.pending == 2)
            extra = await trio.open_tcp_stream(*address)
            refusal = await read_refusal(extra)
            assert refusal["kind"] == "refuse"
            assert "busy" in refusal["reason"] and "the cap is 2" in refusal["reason"]
            with pytest.raises(PeerClosed):
                await read_refusal(extra)  # then the gate hung up
            assert any(
                f"from {local_address(extra)} [over_cap]" in line and "the cap is 2" in line
                for line in refusal_lines(caplog)
            ), refusal_lines(caplog)
            # A dialer over the cap hears why (not just a closed connection)...
            with pytest.raises(ListenerBusy, match="busy"):
                await tcp.dial(address, SECRET, DIALER)
            # ... and a retrying dialer gets in once the slots free up.
            retried: list[Any] = []

            async def dial_again() -> None:
                retried.append(await tcp.dial_with_retry(address, SECRET, DIALER))

            nursery.start_soon(dial_again)
            await trio.sleep(0.2)
            assert not retried and gate.stats.refused_by_cap >= 3
            for stream in [*silent, extra]:
                await stream.aclose()
            await wait_until(lambda: bool(retried))
            conn, peer = retried[0]
            assert peer == LISTENER
            await conn.aclose()
            nursery.cancel_scope.cancel()
    stats = gate.stats
    retries = stats.refused_by_cap - 2  # the retrying dialer's refused attempts
    assert retries >= 1
    assert (stats.admitted, stats.failed["closed"]) == (1, 2)
    assert stats.connections == 5 + retries and stats.peak_pending == 2


async def test_tcp_flood_never_holds_more_than_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    cap, flood = 16, 200
    limits = AdmissionLimits(max_pending=cap, handshake_seconds=10, evict_after_seconds=10)
    gate = AdmissionGate("test", limits)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_gate, gate)
            # From eight addresses: one alone would hit the cap per source (8) first.
            streams = [
                await trio.open_tcp_stream(*address, local_address=f"127.0.0.{1 + i % 8}")
                for i in range(flood)
            ]
            await wait_until(lambda: gate.stats.connections == flood, seconds=10)
            assert gate.stats.pending == cap and gate.stats.refused_by_cap == flood - cap
            for stream in streams:
                await stream.aclose()
            await wait_until(lambda: gate.stats.pending == 0, seconds=10)
            conn, _ = await tcp.dial(address, SECRET, DIALER)  # the listener still serves
            await conn.aclose()
            nursery.cancel_scope.cancel()
    assert gate.stats.peak_pending == cap
    lines = refusal_lines(caplog)
    individual = sum("[over_cap]" in line for line in lines)
    summed = sum(int(n) for line in lines for n in re.findall(r"over_cap=(\d+)", line))
    assert 0 < individual < flood - cap  # rate-limited: at most 20 lines a second
    assert individual + summed == flood - cap  # every refusal is in the log, one way or another


async def test_tcp_slow_drip_is_cut_at_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    gate = AdmissionGate("test", AdmissionLimits(handshake_seconds=0.5))
    hello = encode_frame_bytes("hello", {**DIALER.fields(), "nonce": b"\x01" * NONCE_SIZE})
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_gate, gate)
            stream = await trio.open_tcp_stream(*address)
            started = trio.current_time()
            sent = 0
            for byte in hello:  # one byte every 50 ms: the whole hello would take ~5 s
                if gate.stats.failed:
                    break
                try:
                    await stream.send_all(bytes([byte]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                sent += 1
                await trio.sleep(0.05)
            cut_after = trio.current_time() - started
            try:  # the gate hung up without a word
                data = await stream.receive_some(100)
            except trio.BrokenResourceError:
                data = b""
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert data == b""
    assert sent < len(hello)
    assert 0.4 <= cut_after < 2.0, cut_after
    assert gate.stats.failed == {"deadline": 1}
    assert any("[deadline]" in line and "within 0.5 s" in line for line in refusal_lines(caplog))


async def test_tcp_oversized_prefix_is_refused_at_once_without_allocating() -> None:
    gate = AdmissionGate("test", AdmissionLimits(handshake_seconds=10))
    tracemalloc.start()
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_gate, gate)
                tracemalloc.reset_peak()
                before = tracemalloc.get_traced_memory()[0]
                stream = await trio.open_tcp_stream(*address)
                await stream.send_all(struct.pack(">II", 0xFFFFFFFF, 0))  # claims 4 GiB
                refusal = await read_refusal(stream)
                await wait_until(lambda: bool(gate.stats.failed))
                peak = tracemalloc.get_traced_memory()[1] - before
                await stream.aclose()
                nursery.cancel_scope.cancel()
    finally:
        tracemalloc.stop()
    assert refusal["kind"] == "refuse" and "limit of 4096" in refusal["reason"]
    assert gate.stats.failed == {"frame_too_large": 1}
    assert peak < 4 << 20, f"the listener allocated {peak} bytes for a 4 GiB claim"


# --------------------------------------------------------------------------- wired in


async def test_coordinator_listener_uses_its_gate(caplog: pytest.LogCaptureFixture) -> None:
    coordinator = Coordinator(2, secret=SECRET.decode())
    coordinator.admission.limits = AdmissionLimits(max_pending=2, handshake_seconds=0.5)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            silent = [await trio.open_tcp_stream(*address) for _ in range(2)]
            await wait_until(lambda: coordinator.admission.stats.pending == 2)
            extra = await trio.open_tcp_stream(*address)
            assert "busy" in (await read_refusal(extra))["reason"]
            # The silent ones are cut at the coordinator's 0.5 s deadline, not the default 10 s.
            await wait_until(lambda: coordinator.admission.stats.failed["deadline"] == 2, 2.0)
            nursery.cancel_scope.cancel()
    for stream in [*silent, extra]:
        await stream.aclose()
    assert coordinator.hostile_refused == 2
    assert coordinator.admission.stats.refused_by_cap == 1
    lines = refusal_lines(caplog)
    assert any(line.startswith("coordinator refused") and "[deadline]" in line for line in lines)


async def test_rendezvous_listener_is_gated_and_still_admits_the_rank() -> None:
    """`_serve_until` (rank 0's rendezvous, every worker's data-plane listener) has the default
    gate: 64 strangers at most; the 65th is refused at once; once they go, the rank joins."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    address = tuple(listener.socket.getsockname()[:2])
    mesh: dict[int, tcp.Connection] = {}
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tcp._serve_until, listener, LISTENER, SECRET, mesh, {1})
            # Eight addresses, eight each (the cap per source); the 65th from a ninth address.
            strangers = [
                await trio.open_tcp_stream(*address, local_address=f"127.0.0.{1 + i % 8}")
                for i in range(64)
            ]
            extra = await trio.open_tcp_stream(*address, local_address="127.0.0.9")
            refusal = await read_refusal(extra)
            assert "rank 0 is busy" in refusal["reason"] and "the cap is 64" in refusal["reason"]
            for stream in [*strangers, extra]:
                await stream.aclose()
            conn = None
            while conn is None:  # the strangers' slots free up as their closes are seen
                try:
                    conn, _ = await tcp.dial(address, SECRET, DIALER)
                except HandshakeError as exc:
                    assert "busy" in str(exc)
                    await trio.sleep(0.05)
    assert set(mesh) == {1}
    await conn.aclose()
    await mesh[1].aclose()
    await listener.aclose()
