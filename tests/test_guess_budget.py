"""Failed proofs cost the guesser, not the run (issue 39, row 2).

Each handshake tests one guess of the secret; before, one address made 411 a second and found
a human secret in 300 handshakes. Now every admission gate (the coordinator's, every worker's
listener) keeps a budget of failed proofs per source and in all
(`paramsync.runtime.transport.guess_budget`): a source over its budget is refused at once,
before any handshake work, with an exponential back-off; a source that never failed is never
refused by it.

The budget alone and the gate run under a simulated clock (exact); two live tests put a guesser
thread with a small dictionary on 127.0.0.2 against a coordinator and a worker's listener on
loopback, while a worker dials from 127.0.0.3 (distinct sources on Linux loopback).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing
from test_admission import SourcedStream

from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import AuthenticationError, HandshakeError, ListenerBusy
from paramsync.runtime.observe.metrics import Metrics
from paramsync.runtime.protocol.handshake import Identity, load_secret
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.admission import AdmissionGate, AdmissionLimits
from paramsync.runtime.transport.guess_budget import GuessBudget, GuessLimits

SECRET = secrets.token_hex(16)
"""The run's secret: one `paramsync secret` would make, so that only guessing is tested."""
DICTIONARY = [f"Summer202{i % 10}!team{i}".encode() for i in range(40)]
"""Wrong guesses, as a guesser's small dictionary: tried as they are (a guesser's dialer does
not check its guesses' strength)."""
ADMITTED_WITHIN = 1.0
"""A worker's admission time while a guesser runs (RELIABILITY.md, Admission: milliseconds)."""


# --------------------------------------------------------------------------- the budget alone


def greedy_guesses(budget: GuessBudget, source: str, until: float) -> list[float]:
    """When a guesser that retries the moment it may fails its proofs, up to ``until``."""
    now, times = 0.0, []
    while now < until:
        throttled = budget.check(source, now)
        if throttled is None:
            budget.backoff_after_failure(source, now)
            times.append(now)
        else:
            now += throttled.seconds
    return times


def test_one_source_gets_13_guesses_in_256_s_then_one_every_5_minutes() -> None:
    times = greedy_guesses(GuessBudget(), "10.9.9.9", 3600.0)
    assert times[:13] == [0, 0, 0, 0, 0, 1, 3, 7, 15, 31, 63, 127, 255]
    assert times[13:15] == [511, 811]
    assert len(times) == 24  # in the first hour; then 12 an hour


def test_the_back_off_doubles_from_the_first_failure_over_budget_to_its_cap() -> None:
    limits = GuessLimits()
    assert [limits.backoff(n) for n in range(1, 8)] == [0, 0, 0, 0, 1, 2, 4]
    assert limits.backoff(14) == limits.backoff(1000) == 300.0
    with pytest.raises(ValueError, match="max_backoff"):
        GuessLimits(first_backoff=10, max_backoff=5)


def test_a_source_that_never_failed_is_admitted_even_when_every_budget_is_spent() -> None:
    budget = GuessBudget(GuessLimits(global_burst=32, global_per_second=0.2))
    for i in range(40):  # 40 sources, one failure each: the global budget is spent at 32
        budget.backoff_after_failure(f"10.1.0.{i}", 0.0)
    assert budget.check("10.2.0.1", 0.0) is None  # a worker's address, never failed
    early = budget.check("10.1.0.0", 0.0)
    assert early is not None and early.scope == "global" and early.seconds == pytest.approx(5.0)
    late = budget.check("10.1.0.39", 0.0)  # failed once the budget was spent: no free failure
    assert late is not None and late.scope == "source"
    assert budget.check("10.1.0.0", 5.0) is None  # one refilled


def test_a_quiet_source_is_forgotten_and_its_budget_whole_again() -> None:
    budget = GuessBudget()
    for _ in range(6):
        budget.backoff_after_failure("10.9.9.9", 0.0)
    assert budget.failures_of("10.9.9.9", 100.0) == 6
    assert budget.failures_of("10.9.9.9", 0.0 + 2.0 + 600.0) == 0
    assert len(budget) == 0


# --------------------------------------------------------------------------- the gate


async def fail_a_proof(gate: AdmissionGate, host: str) -> bool:
    """One connection from ``host`` that fails its proof; False when it was refused first."""
    ticket = await gate.admit(SourcedStream(host))  # type: ignore[arg-type]
    if ticket is None:
        return False
    with pytest.raises(AuthenticationError), ticket:
        raise AuthenticationError("authentication failed: wrong shared secret")
    return True


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_guessing_source_is_refused_at_once_and_a_worker_from_elsewhere_is_admitted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="paramsync.admission")
    metrics = Metrics("coordinator")
    failed_before = sample(metrics, "paramsync_failed_authentications_total")
    gate = AdmissionGate("coordinator", AdmissionLimits(log_lines_per_second=None))
    assert [await fail_a_proof(gate, "10.9.9.9") for _ in range(6)] == [True] * 5 + [False]
    assert gate.stats.throttled == {"source": 1} and gate.stats.failed["authentication"] == 5
    assert gate.stats.pending == 0  # the refused one never held a slot
    worker = await gate.admit(SourcedStream("10.0.0.1"))  # type: ignore[arg-type]
    assert worker is not None
    with worker:
        pass
    await trio.sleep(1.0)  # the guesser's back-off is over: one more proof, then 2 s
    assert await fail_a_proof(gate, "10.9.9.9")
    assert not await fail_a_proof(gate, "10.9.9.9")
    assert sample(metrics, "paramsync_failed_authentications_total") - failed_before == 6
    assert sample(metrics, "paramsync_throttled_connections_total", scope="source") >= 2
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        "[authentication]" in line
        and "5 failed authentications from 10.9.9.9" in line
        and "refused for 1 s" in line
        for line in lines
    ), lines
    assert any("[throttled]" in line and "from 10.9.9.9" in line for line in lines), lines


# --------------------------------------------------------------------------- live, on loopback


class Guesser(threading.Thread):
    """Dials ``address`` from 127.0.0.2 with one guess after another (a trio run of its own)
    until stopped; counts the proofs the listener checked and the refusals before any."""

    def __init__(self, address: tuple[str, int], me: Identity) -> None:
        super().__init__(daemon=True)
        self.address, self.me = address, me
        self.keys = DICTIONARY
        self.stop = threading.Event()
        self.proofs = 0
        self.throttled = 0

    def run(self) -> None:
        trio.run(self._guess)

    async def _guess(self) -> None:
        for key in self.keys * 100:
            if self.stop.is_set():
                return
            try:
                conn, _ = await tcp.dial(self.address, key, self.me)
                await conn.aclose()
            except ListenerBusy:
                self.throttled += 1
                await trio.sleep(0.01)
            except AuthenticationError:
                self.proofs += 1
            except (HandshakeError, OSError):
                await trio.sleep(0.01)


@pytest.fixture
def from_127_0_0_2(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every connection `tcp.dial` opens from this test goes out from 127.0.0.2 unless asked."""
    real = trio.open_tcp_stream

    async def sourced(host: Any, port: int, **kwargs: Any) -> trio.SocketStream:
        kwargs.setdefault("local_address", _LOCAL.get(threading.get_ident(), "127.0.0.2"))
        return await real(host, port, **kwargs)

    monkeypatch.setattr(trio, "open_tcp_stream", sourced)
    yield
    _LOCAL.clear()


_LOCAL: dict[int, str] = {}
"""The source address per thread (the test's own thread dials as the worker)."""


async def admitted_in(address: tuple[str, int], key: bytes, me: Identity) -> float:
    """Seconds until a worker dialing from 127.0.0.3 is admitted (retrying while busy)."""
    _LOCAL[threading.get_ident()] = "127.0.0.3"
    start = time.perf_counter()
    conn, _ = await tcp.dial_with_retry(address, key, me)
    took = time.perf_counter() - start
    await conn.aclose()
    return took


async def test_a_live_guesser_at_the_coordinator_is_held_back_and_a_worker_gets_in(
    from_127_0_0_2: None,
) -> None:
    coordinator = Coordinator(2, secret=SECRET)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            guesser = Guesser(address, Identity(tcp.DEFAULT_GROUP, 2, 1))
            guesser.start()
            await trio.sleep(2.0)
            took = await admitted_in(
                address, load_secret(SECRET, {}), Identity(tcp.DEFAULT_GROUP, 2, 0)
            )
            guesser.stop.set()
            await trio.to_thread.run_sync(guesser.join)
            nursery.cancel_scope.cancel()
    stats = coordinator.admission.stats
    assert took < ADMITTED_WITHIN, took
    assert guesser.proofs <= 7 and stats.failed["authentication"] <= 7, (guesser.proofs, stats)
    assert guesser.throttled >= 10 and stats.throttled["source"] >= 10, stats


async def test_a_live_guesser_at_a_workers_listener_is_held_back_and_the_rank_gets_in(
    from_127_0_0_2: None,
) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    address = tuple(listener.socket.getsockname()[:2])
    key = load_secret(SECRET, {})
    me = Identity(tcp.DEFAULT_GROUP, 2, 0)
    mesh: dict[int, tcp.Connection] = {}
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tcp._serve_until, listener, me, key, mesh, {1})
            guesser = Guesser(address, Identity(tcp.DEFAULT_GROUP, 2, 1))
            guesser.start()
            await trio.sleep(2.0)
            guesser.stop.set()
            await trio.to_thread.run_sync(guesser.join)
            took = await admitted_in(address, key, Identity(tcp.DEFAULT_GROUP, 2, 1))
    gate = tcp.listener_gate(listener, "unused")
    assert gate.name == "rank 0" and set(mesh) == {1}
    assert took < ADMITTED_WITHIN, took
    assert guesser.proofs <= 7 and gate.stats.failed["authentication"] <= 7, gate.stats
    assert gate.stats.throttled["source"] >= 10, gate.stats
    assert gate.guesses.failures_of("127.0.0.2", trio.current_time()) == guesser.proofs
    await mesh[1].aclose()
    await listener.aclose()
