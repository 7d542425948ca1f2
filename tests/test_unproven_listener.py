"""A worker dialing a listener that does not prove the secret (third security review, issue 39,
rows 5 and 6): what the worker says, and how many proofs it hands out.

The listener here is a rogue at the coordinator's address, without the secret: it answers a
hello with a low-order key share, or hangs up before its challenge, or takes the worker's proof
(one offline-testable guess of the secret) and then refuses it, hangs up, or welcomes with a
proof of its own that is no proof.
"""

from __future__ import annotations

import pytest
import trio

from paramsync.actors.client.client import CoordinatorClient
from paramsync.runtime.errors import (
    AuthenticationError,
    HandshakeAbandoned,
    InvalidKeyShare,
    PeerLacksSecret,
    ProofUnanswered,
    configuration_error,
)
from paramsync.runtime.protocol.handshake import Identity, ListenerHandshake, NonceLedger
from paramsync.runtime.protocol.messages import StartRun, Welcome
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME
from paramsync.runtime.transport.link import MemoryLink
from paramsync.runtime.transport.tcp import Connection, dial

SECRET = b"unproven-listener-tests-7Hq2vX9pLm"
ROGUE_GUESS = b"a guess of the secret, not the secret"
GROUP = "paramsync"
WORKER = Identity(GROUP, 2, 0)
_EPOCH_0 = StartRun(addresses=(("in-process", 1),), ring=(0,), epoch=0)


async def rogue_listener(
    mode: str, proofs: list[bytes], *, task_status: trio.TaskStatus[str]
) -> None:
    """Listen on 127.0.0.1 as a rogue in ``mode``; every proof a dialer hands over is kept in
    ``proofs``. Reports its HOST:PORT when started."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    async def handle(stream: trio.SocketStream) -> None:
        conn = Connection(stream, peer="dialer")
        me = Identity(GROUP, 2, -1)
        state = ListenerHandshake(ROGUE_GUESS, me, lambda _p: None, ledger=NonceLedger())
        try:
            hello = await conn.recv(HANDSHAKE_MAX_FRAME)
            if mode == "closes before its challenge":
                return
            if mode == "sends a low-order share":
                await conn.send(
                    "challenge", {"nonce": b"\x01" * 32, "salt": b"\x02" * 16, "share": bytes(32)}
                )
                await trio.sleep(1)
                return
            await conn.send(*state.on_hello(hello))
            auth = await conn.recv(HANDSHAKE_MAX_FRAME)
            proofs.append(auth["proof"])
            if mode == "refuses the proof":
                kind, fields, _error = state.on_auth(auth)
                await conn.send(kind, fields)
            elif mode == "welcomes without a proof":
                welcome = Welcome(group=GROUP, world_size=2, rank=-1, proof=bytes(64))
                await conn.send(*welcome.to_wire())
            # "closes before its proof": nothing more
        finally:
            await conn.aclose()

    host, port = listener.socket.getsockname()[:2]
    task_status.started(f"{host}:{port}")
    await trio.serve_listeners(handle, [listener])


def _address(where: str) -> tuple[str, int]:
    host, port = where.rsplit(":", 1)
    return host, int(port)


ROW_6 = {
    "sends a low-order share": (InvalidKeyShare, "key share is invalid"),
    "closes before its challenge": (
        HandshakeAbandoned,
        "closed the connection before its challenge",
    ),
    "closes before its proof": (ProofUnanswered, "closed the connection before its proof"),
    "refuses the proof": (AuthenticationError, "wrong shared secret"),
    "welcomes without a proof": (AuthenticationError, "failed to prove the shared secret"),
}
PROOF_FAILED = ("refuses the proof", "welcomes without a proof")
NO_PROOF = ("sends a low-order share", "closes before its challenge")


@pytest.mark.parametrize("mode", list(ROW_6))
def test_the_worker_says_what_the_listener_did(mode: str) -> None:
    """Row 6: one packet from whoever answers at the coordinator's address stopped a starting
    worker blaming the secret. Now the line says what happened, names the address, and speaks
    of the secret only when a proof failed."""
    error_type, what = ROW_6[mode]
    proofs: list[bytes] = []

    async def main() -> BaseException:
        async with trio.open_nursery() as nursery:
            where = await nursery.start(rogue_listener, mode, proofs)
            with pytest.raises(error_type) as failed:
                with trio.fail_after(20):
                    await dial(_address(where), SECRET, WORKER, handshake_seconds=5.0)
            nursery.cancel_scope.cancel()
        if mode not in PROOF_FAILED:
            assert where in str(failed.value)  # the address whose peer did it
        return failed.value

    error = trio.run(main)
    assert what in str(error), str(error)
    line = configuration_error(error)  # the worker's line, as `paramsync worker` prints it
    proof_failed = mode in PROOF_FAILED
    if proof_failed:
        assert line is not None and "set the same PARAMSYNC_SECRET" in line, line
    else:
        assert line is None, line  # no setting to blame: the error's own words are the line
        assert "secret" not in str(error).lower(), str(error)
    assert len(proofs) == (0 if mode in NO_PROOF else 1)


@pytest.mark.parametrize(
    "mode", ["refuses the proof", "closes before its proof", "welcomes without a proof"]
)
def test_a_reconnecting_worker_gives_a_listener_that_failed_one_proof_only(mode: str) -> None:
    """Row 5: a worker whose coordinator was lost kept redialing whoever answered at its
    address, one proof (one guess of the secret) a redial, for its whole reconnect window. Now
    a listener that failed authentication once gets no further proof: the worker stops with one
    line saying the peer at that address does not know the secret."""
    proofs: list[bytes] = []

    async def main() -> PeerLacksSecret:
        async with trio.open_nursery() as nursery:
            where = await nursery.start(rogue_listener, mode, proofs)

            async def redial() -> Connection:
                link, _ = await dial(_address(where), SECRET, WORKER, handshake_seconds=5.0)
                return link

            coordinator, mine = MemoryLink.pair("worker", "coordinator")
            client = CoordinatorClient(mine, 0, redial=redial, reconnect_seconds=4.0, address=where)
            client.begin_epoch(_EPOCH_0)
            await coordinator.aclose()  # the coordinator is lost; the rogue holds its address
            with pytest.raises(PeerLacksSecret) as stopped:
                with trio.fail_after(20):
                    await client.serve()
            nursery.cancel_scope.cancel()
        assert where in str(stopped.value)
        return stopped.value

    error = trio.run(main)
    assert len(proofs) == 1, f"{len(proofs)} proofs handed to a listener that failed once"
    line = configuration_error(error)
    assert line is not None and "does not know the shared secret" in line, line
    assert "\n" not in line
