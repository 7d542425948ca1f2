"""Admission that slow holders cannot starve, and ranks reserved atomically (issue 18, rows 3
and 9), against a live coordinator listener on real loopback sockets.

Row 3: connections that open and then hold or dribble their handshake must not keep a worker
out: a worker (the right secret, a free rank) joins, leaves and rejoins well within the
handshake deadline while holders fill every slot and reconnect whenever they are cut, whether
the holders come from many addresses (127.0.0.2-9: the workers' slots are taken from them) or
from one (127.0.0.2: it never holds more than its share).

Row 9: two dialers holding the secret and claiming the same free rank at the same moment: the
coordinator welcomes exactly one of them, in every trial.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import trio
import trustme

from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import HandshakeError, PeerClosed, ProtocolError
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME, encode_frame_bytes
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.admission import AdmissionLimits
from paramsync.runtime.transport.tls import TlsConfig

SECRET = "admission-fairness-secret"
GROUP = tcp.DEFAULT_GROUP
WORLD = 2
HOLD_DEADLINE = 20.0
"""The handshake deadline under test: a holder may keep its slot this long if nothing evicts it."""
JOIN_WITHIN = 5.0
"""What a worker gets to join (or rejoin) while the holders flood: a quarter of the deadline."""
PER_SOURCE = 8
"""The gate's default cap per source address."""
OTHER_SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


def me(rank: int) -> Identity:
    return Identity(GROUP, WORLD, rank)


async def wait_until(predicate: Any, seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling the gate's counters
            await trio.sleep(0.005)


async def hold(address: tuple[str, int], source: str, stop: trio.Event, cut: Counter[str]) -> None:
    """A slow holder that comes back: open a connection from ``source``, send the first bytes
    of a hello and nothing more, wait for the listener to hang up, and open another one, until
    ``stop``. ``cut[source]`` counts the hang-ups."""
    hello = encode_frame_bytes(*DialerHandshake(b"no-secret-at-all", me(0)).hello())
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(*address, local_address=source)
        except OSError:
            await trio.sleep(0.01)
            continue
        try:
            await stream.send_all(hello[:5])  # the prefix, then silence
            with trio.move_on_after(HOLD_DEADLINE + 5):
                while await stream.receive_some(4096):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()
        cut[source] += 1
        await trio.sleep(0.05)  # and back


async def join_as(address: tuple[str, int], rank: int) -> tuple[tcp.Connection, float]:
    """Dial as ``rank`` the way a worker does (retrying while busy, and while the rank is still
    held by its previous connection); the connection and the seconds it took."""
    started = trio.current_time()
    while True:
        try:
            conn, peer = await tcp.dial_with_retry(address, SECRET.encode(), me(rank))
        except HandshakeError as exc:
            if "already taken" not in str(exc):
                raise
            await trio.sleep(0.02)  # the coordinator has not yet seen the old link close
            continue
        assert peer.rank == -1
        return conn, trio.current_time() - started


async def flood_then_join_and_rejoin(sources: list[str], holders: int) -> dict[str, Any]:
    coordinator = Coordinator(WORLD, secret=SECRET)
    cap = 16
    coordinator.admission.limits = AdmissionLimits(max_pending=cap, handshake_seconds=HOLD_DEADLINE)
    cut: Counter[str] = Counter()
    stop = trio.Event()
    took: dict[str, float] = {}
    with trio.fail_after(HOLD_DEADLINE * 3):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            for index in range(holders):
                nursery.start_soon(hold, address, sources[index % len(sources)], stop, cut)
            stats = coordinator.admission.stats
            held = min(cap, holders, PER_SOURCE * len(set(sources)))
            await wait_until(lambda: stats.pending >= held and stats.connections >= holders)
            with trio.move_on_after(JOIN_WITHIN) as joining:
                rank0, took["join 0"] = await join_as(address, 0)
                rank1, took["join 1"] = await join_as(address, 1)
                await rank0.aclose()  # rank 0's link drops; it rejoins through the flood
                rank0, took["rejoin 0"] = await join_as(address, 0)
            stop.set()
            nursery.cancel_scope.cancel()
    assert not joining.cancelled_caught, (
        f"slow holders kept the workers out for {JOIN_WITHIN} s (joined: {took}; "
        f"admission: {coordinator.admission.stats.as_dict()})"
    )
    for conn in (rank0, rank1):
        await conn.aclose()
    return {"took": took, "stats": coordinator.admission.stats, "cut": cut}


async def test_slow_holders_from_many_sources_do_not_keep_workers_out() -> None:
    """Holders from eight other addresses fill every slot and come back when cut; the workers
    join and rejoin well within the deadline, and no address ever holds more than its share."""
    result = await flood_then_join_and_rejoin(OTHER_SOURCES, holders=32)
    assert max(result["took"].values()) < JOIN_WITHIN
    assert result["stats"].admitted == 3
    assert result["stats"].evicted >= 1  # the workers' slots were the holders'


async def test_slow_holders_from_one_address_hold_at_most_its_share() -> None:
    """The whole flood from one address (127.0.0.2): it holds at most the per-source cap, so
    the workers (127.0.0.1) find free slots without waiting for any eviction."""
    result = await flood_then_join_and_rejoin(["127.0.0.2"], holders=32)
    assert max(result["took"].values()) < JOIN_WITHIN
    assert result["stats"].admitted == 3
    assert result["stats"].peak_pending <= PER_SOURCE + 1


# --------------------------------------------------------------------------- row 9


async def _raw_dialer_to_auth(
    address: tuple[str, int], rank: int, tls: TlsConfig | None
) -> tuple[tcp.Connection, bytes]:
    """A dialer holding the secret, stopped just before it sends its auth: the connection and
    the auth frame, ready to go."""
    stream = await trio.open_tcp_stream(*address)
    where = f"{address[0]}:{address[1]}"
    conn = tcp.Connection(stream if tls is None else await tls.wrap_client(stream, where))
    state = DialerHandshake(SECRET.encode(), me(rank))
    await conn.send(*state.hello())
    challenge = await conn.recv(HANDSHAKE_MAX_FRAME)
    return conn, encode_frame_bytes(*state.on_challenge(challenge))


async def _verdict(conn: tcp.Connection) -> str:
    try:
        with trio.fail_after(5):
            message = await conn.recv(HANDSHAKE_MAX_FRAME)
    except (PeerClosed, ProtocolError) as exc:
        return f"error: {exc}"
    return f"{message['kind']}: {message.get('reason', '')}"


async def duplicate_dialers_once(tls: TlsConfig | None) -> list[str]:
    """Two rank-0 dialers whose auths reach a fresh coordinator together; their verdicts."""
    coordinator = Coordinator(WORLD, secret=SECRET)
    verdicts: list[str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(
                functools.partial(coordinator.serve_tcp, "127.0.0.1", 0, tls=tls)
            )
            pair = [await _raw_dialer_to_auth(address, 0, tls) for _ in range(2)]
            for conn, auth in pair:  # back to back: both arrive before either is answered
                await conn.stream.send_all(auth)

            async def hear(conn: tcp.Connection) -> None:
                verdicts.append(await _verdict(conn))

            async with trio.open_nursery() as both:
                for conn, _ in pair:
                    both.start_soon(hear, conn)
            for conn, _ in pair:
                await conn.aclose()
            nursery.cancel_scope.cancel()
    return verdicts


@pytest.fixture(scope="module")
def tls_config(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    """One certificate (from a throwaway CA) that the coordinator and the dialers all use."""
    directory = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("node", "127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(directory / "node.crt")
    leaf.private_key_pem.write_to_path(directory / "node.key")
    ca.cert_pem.write_to_path(directory / "ca.pem")
    return TlsConfig.from_paths(
        directory / "node.crt", directory / "node.key", directory / "ca.pem"
    )


@pytest.mark.parametrize("transport", ["plaintext", "tls"])
async def test_concurrent_duplicate_dialers_get_one_welcome(
    transport: str, tls_config: TlsConfig
) -> None:
    """Over TLS every send goes through trio's scheduler, so the welcome of the first dialer
    leaves the listener's task before its rank is recorded: the window the second one used."""
    tls = tls_config if transport == "tls" else None
    trials = 64 if tls is None else 24
    outcomes: Counter[str] = Counter()
    for _ in range(trials):
        verdicts = await duplicate_dialers_once(tls)
        welcomed = sum(v.startswith("welcome") for v in verdicts)
        outcomes[f"{welcomed} welcomed"] += 1
        if welcomed == 1:
            (refusal,) = [v for v in verdicts if not v.startswith("welcome")]
            assert "rank 0 is already taken" in refusal, refusal
    assert outcomes == {"1 welcomed": trials}, dict(outcomes)


@pytest.mark.parametrize("transport", ["plaintext", "tls"])
async def test_a_mesh_listener_welcomes_one_of_two_concurrent_dialers_of_a_rank(
    transport: str, tls_config: TlsConfig
) -> None:
    """The same race at a worker's data-plane listener (`_serve_until`): one welcome, and the
    mesh holds the welcomed connection; the other rank still joins."""
    tls = tls_config if transport == "tls" else None
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    address = tuple(listener.socket.getsockname()[:2])
    me0 = Identity(GROUP, 3, 0)
    mesh: dict[int, tcp.Connection] = {}
    secret = SECRET.encode()

    async def dialer_at_auth(rank: int) -> tuple[tcp.Connection, bytes]:
        stream = await trio.open_tcp_stream(*address)
        where = f"{address[0]}:{address[1]}"
        conn = tcp.Connection(stream if tls is None else await tls.wrap_client(stream, where))
        state = DialerHandshake(secret, Identity(GROUP, 3, rank))
        await conn.send(*state.hello())
        return conn, encode_frame_bytes(*state.on_challenge(await conn.recv(HANDSHAKE_MAX_FRAME)))

    verdicts: list[str] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(tcp._serve_until, listener, me0, secret, mesh, {1, 2}, tls=tls)
            )
            pair = [await dialer_at_auth(1) for _ in range(2)]
            for conn, auth in pair:
                await conn.stream.send_all(auth)

            async def hear(conn: tcp.Connection) -> None:
                verdicts.append(await _verdict(conn))

            async with trio.open_nursery() as both:
                for conn, _ in pair:
                    both.start_soon(hear, conn)
            other, _ = await tcp.dial(address, secret, Identity(GROUP, 3, 2), tls=tls)
    assert sum(v.startswith("welcome") for v in verdicts) == 1, verdicts
    assert any("rank 1 is already taken" in v for v in verdicts), verdicts
    assert set(mesh) == {1, 2}
    for conn in [*(c for c, _ in pair), other, *mesh.values()]:
        await conn.aclose()
    await listener.aclose()
