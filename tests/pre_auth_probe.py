"""Typed arrays in the frames before authentication, in a process that has not imported torch.

Run as ``python tests/pre_auth_probe.py`` from the repository root (tests/test_pre_auth_tensors.py
does, issue 31 row 3). It serves a coordinator daemon (`Coordinator.serve_tcp`) on loopback and
sends it every frame a stranger may send before authentication (``hello``, ``auth``) holding a
typed array, inline or as a bulk; it dials fake listeners that answer with a ``challenge``, a
``welcome`` or a ``refuse`` holding one; an authenticated peer then sends the daemon a
``heartbeat`` holding one. It prints one JSON object: what each side said, whether the daemon
still admits a worker afterwards, and the torch modules this process imported (none, as the
daemon must never import torch). This file must not import torch, nor tests/conftest.py.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import cbor2
import trio

from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.handshake import DialerHandshake, Identity, ListenerHandshake
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME
from paramsync.runtime.transport import tcp

SECRET = b"pre-auth-probe-secret-0123456789"
GROUP = tcp.DEFAULT_GROUP
FLOAT_ONE = b"\x00\x00\x80\x3f"  # 1.0 as little-endian float32
INLINE = cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, FLOAT_ONE)])
"""A 4-byte float32 tensor, as RFC 8746 encodes it (tag 40 around a typed array)."""
BARE = cbor2.CBORTag(85, FLOAT_ONE)
"""A bare typed array (tag 85, float32)."""


def frame(kind: str, fields: dict[str, Any]) -> bytes:
    item = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": kind, **fields})
    return struct.pack(">II", len(item), 0) + item


def bulk_frame(kind: str, fields: dict[str, Any]) -> bytes:
    """``kind`` with a 4-byte float32 bulk tensor as its last field, laid out as `encode_frame`
    lays out a bulk (the typed array's byte string ends the item)."""
    head = cbor2.dumps(
        {"v": PROTOCOL_VERSION, "kind": kind, **fields, "data": cbor2.CBORTag(40, [[1], BARE])}
    )
    head = head[: -len(FLOAT_ONE) - 1] + b"\x44"  # the byte string's header only
    item = head + FLOAT_ONE
    return struct.pack(">II", len(item), len(FLOAT_ONE)) + item


def hello_fields(rank: int = 0) -> dict[str, Any]:
    _, fields = DialerHandshake(SECRET, Identity(GROUP, 2, rank)).hello()
    return fields


async def listener_says(address: tuple[str, int], frames: list[bytes]) -> str:
    """Send ``frames`` one by one, reading a reply after each: the last reply's refusal
    reason, or what ended the exchange."""
    stream = await trio.open_tcp_stream(*address)
    conn = tcp.Connection(stream, peer="daemon")
    try:
        reply: dict[str, Any] = {}
        for raw in frames:
            await stream.send_all(raw)
            with trio.fail_after(10):
                reply = await conn.recv(HANDSHAKE_MAX_FRAME)
        return f"{reply['kind']}: {reply.get('reason', '')}"
    except ProtocolError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        await conn.aclose()


async def dialer_says(answer: Callable[[tcp.Connection], Awaitable[None]]) -> str:
    """Dial a fake listener that answers with ``answer``: what `tcp.dial` raised."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    address = listeners[0].socket.getsockname()[:2]

    async def fake() -> None:
        stream = await listeners[0].accept()
        conn = tcp.Connection(stream, peer="dialer")
        try:
            await answer(conn)
            await trio.sleep_forever()
        finally:
            await conn.aclose()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake)
            try:
                await tcp.dial(address, SECRET, Identity(GROUP, 2, 1), handshake_seconds=10)
                return "admitted"
            except ProtocolError as exc:
                return f"{type(exc).__name__}: {exc}"
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for listener in listeners:
            await listener.aclose()


async def challenge_with(conn: tcp.Connection, field: str, value: Any) -> None:
    await conn.recv(HANDSHAKE_MAX_FRAME)  # the hello
    fields: dict[str, Any] = {"nonce": b"\x22" * 32, "salt": b"\x33" * 16, "share": b"\x09" * 32}
    fields[field] = value
    await conn.stream.send_all(frame("challenge", fields))


async def welcome_with(conn: tcp.Connection, field: str, value: Any) -> None:
    listener = ListenerHandshake(SECRET, Identity(GROUP, 2, -1), lambda _peer: None)
    await conn.send(*listener.on_hello(await conn.recv(HANDSHAKE_MAX_FRAME)))
    await conn.recv(HANDSHAKE_MAX_FRAME)  # the auth
    fields: dict[str, Any] = {**Identity(GROUP, 2, -1).fields(), "proof": b"\x00" * 32}
    fields[field] = value
    await conn.stream.send_all(frame("welcome", fields))


async def refuse_with(conn: tcp.Connection, value: Any) -> None:
    await conn.recv(HANDSHAKE_MAX_FRAME)
    await conn.stream.send_all(frame("refuse", {"reason": value}))


async def probe() -> dict[str, Any]:
    coordinator = Coordinator(2, secret=SECRET)
    out: dict[str, Any] = {"listener": {}, "dialer": {}}
    async with trio.open_nursery() as nursery:
        address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
        said = out["listener"]
        said["hello nonce"] = await listener_says(
            address, [frame("hello", {**hello_fields(), "nonce": INLINE})]
        )
        said["hello group"] = await listener_says(
            address, [frame("hello", {**hello_fields(), "group": BARE})]
        )
        said["hello bulk"] = await listener_says(address, [bulk_frame("hello", hello_fields())])
        said["hello extra field"] = await listener_says(
            address, [frame("hello", {**hello_fields(), "pad": INLINE})]
        )
        said["auth proof"] = await listener_says(
            address, [frame("hello", hello_fields()), frame("auth", {"proof": INLINE})]
        )
        said["auth bulk"] = await listener_says(
            address, [frame("hello", hello_fields()), bulk_frame("auth", {})]
        )
        dialer = out["dialer"]
        dialer["challenge nonce"] = await dialer_says(
            lambda conn: challenge_with(conn, "nonce", INLINE)
        )
        dialer["challenge bulk"] = await dialer_says(
            lambda conn: _send_after_hello(conn, bulk_frame("challenge", {}))
        )
        dialer["welcome proof"] = await dialer_says(
            lambda conn: welcome_with(conn, "proof", INLINE)
        )
        dialer["welcome rank"] = await dialer_says(lambda conn: welcome_with(conn, "rank", BARE))
        dialer["refuse reason"] = await dialer_says(lambda conn: refuse_with(conn, INLINE))

        # An authenticated peer (rank 0) sends a heartbeat holding a typed array: the daemon
        # drops it without decoding a tensor.
        conn, _ = await tcp.dial(address, SECRET, Identity(GROUP, 2, 0))
        await conn.send("heartbeat", {"pad": INLINE})
        try:
            with trio.fail_after(10):
                reply = await conn.recv()
            out["after auth"] = f"{reply['kind']}: {reply.get('reason', '')}"
        except ProtocolError as exc:
            out["after auth"] = f"{type(exc).__name__}: {exc}"
        await conn.aclose()

        # The daemon keeps serving: a worker is still admitted.
        with trio.fail_after(10):
            conn, peer = await tcp.dial(address, SECRET, Identity(GROUP, 2, 1))
        out["admitted afterwards"] = peer.rank
        await conn.aclose()
        nursery.cancel_scope.cancel()
    out["torch"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]
    return out


async def _send_after_hello(conn: tcp.Connection, raw: bytes) -> None:
    await conn.recv(HANDSHAKE_MAX_FRAME)
    await conn.stream.send_all(raw)


if __name__ == "__main__":
    print(json.dumps(trio.run(probe)))
