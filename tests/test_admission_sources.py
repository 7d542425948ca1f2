"""Slow holders from many source addresses do not keep a worker out (issue 31, row 7).

Before: the gate shared slots between addresses only when one held at least two more than the
newcomer's, so 96 holders from 96 addresses (one slot each) kept a worker out until a holder's
deadline, and 96 addresses of one IPv6 /64 counted as 96 sources. Now a source is an IPv4
address or an IPv6 /64 (`source_key`), and at the global cap a newcomer takes the oldest slot of
a source that holds more than its own and whose share (slots held, averaged over
``2 x evict_after_seconds``) is at least 0.5 above its own (`paramsync.runtime.transport.admission`,
*Fairness*, rule 3).

Gate-only tests run under trio's MockClock (autojump) with fake peers, default limits (64
slots, 10 s deadline): exact and fast. One test floods a live coordinator listener from 96 real
loopback addresses (127.0.1.1-96; every 127/8 address routes to loopback on Linux).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing
from test_admission import SourcedStream, holder

from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity
from paramsync.runtime.protocol.wire import encode_frame_bytes
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.admission import AdmissionGate, AdmissionLimits, source_key

JOIN_WITHIN = 5.0
"""The guarantee under test: a worker is admitted within 5 s."""
DEFAULTS = AdmissionLimits(log_lines_per_second=None)
"""The defaults (64 slots, 8 per source, 10 s deadline, evict_after 1 s), logging unlimited."""
IPV4_HOLDERS = [f"127.0.1.{i}" for i in range(1, 97)]
IPV6_HOLDERS = [f"2001:db8:31:7::{i:x}" for i in range(1, 97)]
"""96 addresses of one /64."""


# --------------------------------------------------------------------------- the source key


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:31:7::1", "2001:db8:31:7::/64"),
        ("2001:db8:31:7:ffff:ffff:ffff:ffff", "2001:db8:31:7::/64"),
        ("2001:DB8:31:7:0:0:0:60", "2001:db8:31:7::/64"),
        ("2001:db8:31:8::1", "2001:db8:31:8::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:127.0.0.5", "127.0.0.5"),  # an IPv4 peer on a dual-stack listener
        ("::1", "::/64"),
        ("not an address", "not an address"),
    ],
)
def test_source_key_is_the_ipv4_address_or_the_ipv6_64(address: str, key: str) -> None:
    assert source_key(address) == key


def test_96_addresses_of_one_64_are_one_source_and_96_ipv4_addresses_are_96() -> None:
    assert {source_key(a) for a in IPV6_HOLDERS} == {"2001:db8:31:7::/64"}
    assert len({source_key(a) for a in IPV4_HOLDERS}) == 96


# --------------------------------------------------------------------------- the gate alone


async def test_a_one_slot_source_gives_its_slot_up_once_its_share_is_half(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rule 3 at its boundary: a source holding one slot has a share of 1 - e^(-t/2) after t
    seconds; a newcomer from a source with none takes it from 0.5 on (t = 2 ln 2 = 1.39 s),
    and the source that lost it cannot take the newcomer's back (its share is the higher)."""
    gate = AdmissionGate("test", AdmissionLimits(max_pending=2, log_lines_per_second=None))
    first = await gate.admit(SourcedStream("10.0.0.1"))  # type: ignore[arg-type]
    second = await gate.admit(SourcedStream("10.0.0.2"))  # type: ignore[arg-type]
    assert first is not None and second is not None
    await trio.sleep(1.3)
    assert gate.share_of("10.0.0.1") == pytest.approx(1 - math.exp(-0.65))  # 0.478
    assert await gate.admit(SourcedStream("10.0.0.3")) is None  # type: ignore[arg-type]
    await trio.sleep(0.1)  # 0.503
    newcomer = await gate.admit(SourcedStream("10.0.0.3"))  # type: ignore[arg-type]
    assert newcomer is not None and [first.evicted, second.evicted].count(True) == 1
    loser = "10.0.0.1" if first.evicted else "10.0.0.2"
    assert await gate.admit(SourcedStream(loser)) is None  # type: ignore[arg-type]
    assert gate.stats.evicted == 1 and gate.share_of("10.0.0.3") < 0.01


async def join_with_backoff(
    gate: AdmissionGate, source: str, handshake: float = 0.05
) -> tuple[float | None, int]:
    """Dial from ``source`` as `tcp.dial_with_retry` does (without its jitter: 10 ms doubling
    to 0.5 s) until admitted, then take ``handshake`` seconds (a round trip and the scrypt-keyed
    proofs) to finish: (seconds from the first dial to the end of the handshake, or None if not
    within `JOIN_WITHIN`; dials)."""
    started, wait, dials = trio.current_time(), 0.01, 0
    with trio.move_on_after(JOIN_WITHIN):
        while True:
            dials += 1
            ticket = await gate.admit(SourcedStream(source))  # type: ignore[arg-type]
            if ticket is not None:
                with ticket:  # raises HandshakeError if a holder took the slot back
                    await trio.sleep(handshake)
                return trio.current_time() - started, dials
            await trio.sleep(wait)
            wait = min(2 * wait, 0.5)
    return None, dials


async def flood_then_join(
    sources: list[str], worker: str, *, hold_first: float, pause: float, hang_up_after: float | None
) -> tuple[AdmissionGate, dict[str, tuple[float | None, int]]]:
    """96 holders, one from each of ``sources`` in turn, for ``hold_first`` s; then a worker
    from ``worker`` joins, and joins again (a rejoin) once it is in."""
    gate = AdmissionGate("coordinator", DEFAULTS)
    took: dict[str, tuple[float | None, int]] = {}
    async with trio.open_nursery() as nursery:
        for index in range(96):
            nursery.start_soon(holder, gate, sources[index % len(sources)], pause, hang_up_after)
        await trio.sleep(hold_first)
        took["join"] = await join_with_backoff(gate, worker)
        took["rejoin"] = await join_with_backoff(gate, worker)
        nursery.cancel_scope.cancel()
    return gate, took


HOLDERS = [
    pytest.param(0.05, None, id="hold-until-cut"),  # benchmarks/hostile.py's holders
    pytest.param(0.01, None, id="back-at-once"),
    pytest.param(0.01, 0.3, id="renew-every-0.3s"),  # never an old connection
]


@pytest.mark.parametrize("hold_first", [0.0, 3.0])
@pytest.mark.parametrize(("pause", "hang_up_after"), HOLDERS)
async def test_holders_from_96_ipv4_addresses_do_not_keep_a_worker_out(
    autojump_clock: trio.testing.MockClock,
    hold_first: float,
    pause: float,
    hang_up_after: float | None,
) -> None:
    gate, took = await flood_then_join(
        IPV4_HOLDERS, "127.0.0.1", hold_first=hold_first, pause=pause, hang_up_after=hang_up_after
    )
    assert all(seconds is not None and seconds < JOIN_WITHIN for seconds, _ in took.values()), took
    assert gate.stats.admitted == 2, gate.stats.as_dict()
    assert gate.stats.peak_pending == 64  # the holders kept the gate full


@pytest.mark.parametrize("hold_first", [0.0, 1.0])
@pytest.mark.parametrize(("pause", "hang_up_after"), HOLDERS)
async def test_holders_from_96_addresses_of_one_ipv6_64_do_not_keep_a_worker_out(
    autojump_clock: trio.testing.MockClock,
    hold_first: float,
    pause: float,
    hang_up_after: float | None,
) -> None:
    """The whole /64 is one source: it holds at most 8 slots, and the worker (another /64)
    finds a free one at its first dial."""
    gate, took = await flood_then_join(
        IPV6_HOLDERS,
        "2001:db8:31:8::1",
        hold_first=hold_first,
        pause=pause,
        hang_up_after=hang_up_after,
    )
    assert all(seconds is not None and dials == 1 for seconds, dials in took.values()), took
    assert gate.stats.peak_pending <= 8 + 1
    assert gate.stats.admitted == 2


async def test_a_real_handshake_is_never_taken_back_by_many_address_holders(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Once in, the worker's handshake (its source holds one slot for 50 ms: a share near 0)
    is not a victim for holders that come back from 96 addresses every 10 ms."""
    gate, took = await flood_then_join(
        IPV4_HOLDERS, "127.0.0.1", hold_first=3.0, pause=0.01, hang_up_after=None
    )
    assert took["join"][0] is not None and took["rejoin"][0] is not None
    assert gate.stats.failed["evicted"] >= 2  # the two slots the worker took
    assert gate.stats.admitted == 2  # and neither handshake of the worker was evicted


# --------------------------------------------------------------------------- over loopback

SECRET = "admission-sources-secret"


async def hold(address: tuple[str, int], source: str) -> None:
    """A slow holder from ``source``: the first 5 bytes of a hello, then silence until the
    listener hangs up, and again 50 ms later."""
    me = Identity(tcp.DEFAULT_GROUP, 2, 0)
    hello = encode_frame_bytes(*DialerHandshake(b"no-secret-at-all", me).hello())
    while True:
        try:
            stream = await trio.open_tcp_stream(*address, local_address=source)
        except OSError:
            await trio.sleep(0.05)
            continue
        try:
            await stream.send_all(hello[:5])
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()
        await trio.sleep(0.05)


async def test_holders_from_96_loopback_addresses_do_not_keep_a_worker_out() -> None:
    """96 holders, each from its own loopback address, fill a live coordinator's 64 slots
    (default limits: 10 s deadline); a worker from 127.0.0.1 dialing with `dial_with_retry`
    is admitted within 5 s."""
    coordinator = Coordinator(2, secret=SECRET)
    stats = coordinator.admission.stats
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            address: Any = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            for source in IPV4_HOLDERS:
                nursery.start_soon(hold, address, source)
            with trio.fail_after(10):
                while stats.pending < 64 or stats.connections < 96:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            started = trio.current_time()
            with trio.move_on_after(JOIN_WITHIN):
                conn, _ = await tcp.dial_with_retry(
                    address, SECRET.encode(), Identity(tcp.DEFAULT_GROUP, 2, 0)
                )
                took = trio.current_time() - started
            nursery.cancel_scope.cancel()
    assert stats.admitted == 1, f"not admitted within {JOIN_WITHIN} s: {stats.as_dict()}"
    assert took < JOIN_WITHIN and stats.evicted >= 1
    await conn.aclose()
