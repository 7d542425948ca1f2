"""One scrypt stretch per process: a worker's listener challenges with the salt of the
coordinator that proved the secret to it (`paramsync.runtime.transport.deployment_salt`).

Before, each listener used its process's own random salt, so a worker stretched the secret once
per peer listener it dialed (about 50 ms each: seconds at start for 64 workers). The salt stays
one deployment's (issue 39, row 4): only a listener that proved the secret has its salt adopted.
Each test holds a secret of its own, so the process-wide table and stretch cache start cold.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from paramsync.runtime.errors import AuthenticationError
from paramsync.runtime.protocol import handshake
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity, load_secret
from paramsync.runtime.protocol.messages import SALT_SIZE
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME
from paramsync.runtime.transport import deployment_salt
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, accept, dial

COORDINATOR = Identity(DEFAULT_GROUP, 3, -1)


def _secret() -> bytes:
    return load_secret(secrets.token_urlsafe(32), {})


async def _listen(
    nursery: trio.Nursery, secret: bytes, me: Identity, salt: bytes | None = None
) -> tuple[str, int]:
    """A listener that runs `accept` (with ``salt``, or the process's choice) on every
    connection and keeps what it welcomed open; its address."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    kept: list[Connection] = []

    async def serve(stream: trio.SocketStream) -> None:
        try:
            conn, _ = await accept(stream, secret, me, lambda _peer: None, salt=salt)
        except Exception:  # a failed handshake: this test's dialer sees why
            return
        kept.append(conn)

    nursery.start_soon(trio.serve_listeners, serve, [listener])
    return listener.socket.getsockname()[:2]


async def _challenge_salt(address: tuple[str, int], secret: bytes, me: Identity) -> bytes:
    """A whole handshake with the listener at ``address``; the salt its challenge carried."""
    conn = Connection(await trio.open_tcp_stream(*address))
    state = DialerHandshake(secret, me)
    try:
        await conn.send(*state.hello())
        challenge = await conn.recv(HANDSHAKE_MAX_FRAME)
        await conn.send(*state.on_challenge(challenge))
        state.on_verdict(await conn.recv(HANDSHAKE_MAX_FRAME))
    finally:
        await conn.aclose()
    return bytes(challenge["salt"])


def _stretches() -> int:
    return handshake._stretch.cache_info().misses


async def _within(seconds: float, body: Callable[[trio.Nursery], Awaitable[Any]]) -> Any:
    with trio.fail_after(seconds):
        async with trio.open_nursery() as nursery:
            result = await body(nursery)
            nursery.cancel_scope.cancel()
    return result


async def test_a_workers_listener_challenges_with_its_coordinators_salt() -> None:
    """A worker dials a coordinator listening under its own salt, then its peers dial the
    worker's listener: every challenge carries the coordinator's salt, and the secret was
    stretched once in all (before: once more, under the worker's own salt)."""
    secret = _secret()
    coordinator_salt = secrets.token_bytes(SALT_SIZE)
    assert coordinator_salt != handshake.PROCESS_SALT

    async def body(nursery: trio.Nursery) -> tuple[list[bytes], int]:
        before = _stretches()
        coordinator = await _listen(nursery, secret, COORDINATOR, coordinator_salt)
        link, _ = await dial(coordinator, secret, Identity(DEFAULT_GROUP, 3, 0))
        await link.aclose()
        worker = await _listen(nursery, secret, Identity(DEFAULT_GROUP, 3, 0))
        peers = [Identity(DEFAULT_GROUP, 3, rank) for rank in (1, 2)]
        seen = [await _challenge_salt(worker, secret, peer) for peer in peers]
        return seen, _stretches() - before

    seen, stretched = await _within(20, body)
    assert seen == [coordinator_salt, coordinator_salt]
    assert deployment_salt.listener_salt(secret) == coordinator_salt
    assert stretched == 1


async def test_only_a_listener_that_proved_the_secret_gives_its_salt() -> None:
    """A rogue listener holding another secret, with a salt of its choosing, is refused and
    its salt never adopted; the first listener that proves the secret gives its salt, and a
    second one (a restarted coordinator) does not replace it."""
    secret = _secret()
    rogue_salt, first, second = (secrets.token_bytes(SALT_SIZE) for _ in range(3))
    me = Identity(DEFAULT_GROUP, 3, 0)

    async def body(nursery: trio.Nursery) -> None:
        rogue = await _listen(nursery, _secret(), COORDINATOR, rogue_salt)
        with pytest.raises(AuthenticationError):
            await dial(rogue, secret, me)
        assert deployment_salt.listener_salt(secret) is None
        for salt in (first, second):
            link, _ = await dial(await _listen(nursery, secret, COORDINATOR, salt), secret, me)
            await link.aclose()

    await _within(20, body)
    assert deployment_salt.listener_salt(secret) == first


def test_the_table_is_bounded_and_checks_the_salt() -> None:
    keys = [secrets.token_bytes(16) for _ in range(deployment_salt.CAPACITY + 1)]
    for key in keys:
        deployment_salt.adopt(key, bytes(SALT_SIZE))
    assert deployment_salt.listener_salt(keys[0]) is None
    assert deployment_salt.listener_salt(keys[-1]) == bytes(SALT_SIZE)
    with pytest.raises(ValueError, match="16 bytes, got 3"):
        deployment_salt.adopt(keys[0], b"abc")
