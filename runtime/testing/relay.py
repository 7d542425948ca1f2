"""An on-path relay holding no secret, for attacking frame authentication (issue 18 row 1).

`FrameRelay` listens on loopback and forwards each connection it accepts to an upstream
listener (a coordinator, a rank), frame by frame. It passes the handshake through untouched
(it cannot forge it: it holds no secret), then hands every later frame to an `Attack`, which
says what to forward instead: the frame, nothing (a drop), the frame twice (a replay), a held
frame after the next one (a reorder), the frame with bytes flipped, or a forged frame before
it (an injection). The relay finds frame boundaries from the 8-byte prefixes; past the
handshake it tells by the first byte after an item whether frames carry a tag trailer
(``0x50``, `paramsync.runtime.protocol.wire.TRAILER_SIZE` bytes) and forwards trailers as it found
them, so it works against a peer that authenticates frames and one that does not.

`relayed_pair` gives two ranks of a group of two whose connection runs through such a relay.
Used by ``tests/test_frame_relay.py`` and ``benchmarks/hostile.py``.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from paramsync.runtime.protocol.handshake import Identity
from paramsync.runtime.protocol.wire import PREFIX_SIZE, TRAILER_SIZE, encode_frame_bytes
from paramsync.runtime.transport.tcp import DEFAULT_GROUP, Connection, TcpTransport, accept, dial

__all__ = [
    "TO_LISTENER",
    "TO_DIALER",
    "RelayedFrame",
    "Attack",
    "Inject",
    "FlipBulk",
    "Drop",
    "Replay",
    "Swap",
    "forged_abort",
    "FrameRelay",
    "relayed_pair",
]

TO_LISTENER = "to_listener"
"""The direction from the dialer (who connected to the relay) to the upstream listener."""
TO_DIALER = "to_dialer"
_HANDSHAKE_FRAMES = 2
"""Frames each direction sends in the handshake (hello, auth; challenge, welcome)."""
_TRAILER_HEADER = 0x50
_DETECT_SECONDS = 1.0
"""How long the relay waits for the byte after the first frame past the handshake to tell
whether a trailer follows (a trailer leaves with its frame, so it is there at once)."""
_PREFIX = struct.Struct(">II")


@dataclass
class RelayedFrame:
    """One frame past the handshake, as the relay read it."""

    direction: str
    index: int
    """Its number among the frames past the handshake in its direction (0: the first)."""
    prefix: bytes
    item: bytes
    trailer: bytes
    """Its tag trailer (b"" when frames carry none)."""

    @property
    def bulk_len(self) -> int:
        return _PREFIX.unpack(self.prefix)[1]

    @property
    def raw(self) -> bytes:
        return self.prefix + self.item + self.trailer


class Attack:
    """Forwards every frame as it is; subclasses rewrite some. `done` is set once the attack
    has been carried out."""

    def __init__(self) -> None:
        self.done = False
        self.log: list[str] = []

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        return [frame.raw]


def forged_abort(reason: str = "forged by an on-path relay", trailer: bool = True) -> bytes:
    """An ``abort`` frame as a relay without the secret can make it: a well-formed message,
    with a trailer of random bytes where the tag belongs (when frames carry one)."""
    frame = encode_frame_bytes("abort", {"reason": reason})
    if trailer:
        frame += bytes([_TRAILER_HEADER]) + secrets.token_bytes(TRAILER_SIZE - 1)
    return frame


class Inject(Attack):
    """Slip a forged ``abort`` into ``direction`` right after its first ``after`` genuine
    frames past the handshake (``after >= 1``)."""

    def __init__(self, direction: str, after: int, reason: str = "forged by an on-path relay"):
        super().__init__()
        if after < 1:
            raise ValueError("the relay injects after at least one genuine frame")
        self.direction, self.after, self.reason = direction, after, reason

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction == self.direction and frame.index == self.after - 1:
            self.done = True
            self.log.append(f"injected an abort after {self.after} {frame.direction} frames")
            return [frame.raw, forged_abort(self.reason, trailer=bool(frame.trailer))]
        return [frame.raw]


class FlipBulk(Attack):
    """Flip one byte in the bulk of the ``nth`` frame of ``direction`` that carries bulk."""

    def __init__(self, direction: str, nth: int = 0, offset: int = 0):
        super().__init__()
        self.direction, self.nth, self.offset = direction, nth, offset
        self._seen = 0

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction != self.direction or not frame.bulk_len or self.done:
            return [frame.raw]
        self._seen += 1
        if self._seen - 1 != self.nth:
            return [frame.raw]
        item = bytearray(frame.item)
        at = len(item) - frame.bulk_len + self.offset % frame.bulk_len
        item[at] ^= 0xFF
        self.done = True
        self.log.append(f"flipped bulk byte {at} of {frame.direction} frame {frame.index}")
        return [frame.prefix + bytes(item) + frame.trailer]


class Drop(Attack):
    """Drop frame ``index`` of ``direction``."""

    def __init__(self, direction: str, index: int):
        super().__init__()
        self.direction, self.index = direction, index

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction == self.direction and frame.index == self.index:
            self.done = True
            self.log.append(f"dropped {frame.direction} frame {frame.index}")
            return []
        return [frame.raw]


class Replay(Attack):
    """Forward frame ``index`` of ``direction`` twice."""

    def __init__(self, direction: str, index: int):
        super().__init__()
        self.direction, self.index = direction, index

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction == self.direction and frame.index == self.index:
            self.done = True
            self.log.append(f"replayed {frame.direction} frame {frame.index}")
            return [frame.raw, frame.raw]
        return [frame.raw]


class Swap(Attack):
    """Hold frame ``index`` of ``direction`` and forward it after the next one."""

    def __init__(self, direction: str, index: int):
        super().__init__()
        self.direction, self.index = direction, index
        self._held: bytes | None = None

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction != self.direction:
            return [frame.raw]
        if frame.index == self.index:
            self._held = frame.raw
            return []
        if self._held is not None:
            held, self._held = self._held, None
            self.done = True
            self.log.append(f"swapped {frame.direction} frames {self.index} and {frame.index}")
            return [frame.raw, held]
        return [frame.raw]


class _Reader:
    """Exact reads over a trio stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _more(self) -> None:
        data = await self.stream.receive_some(1 << 20)
        if not data:
            raise EOFError
        self.buf += data

    async def exactly(self, count: int) -> bytes:
        while len(self.buf) < count:
            await self._more()
        out = bytes(self.buf[:count])
        del self.buf[:count]
        return out

    async def peek(self, seconds: float) -> int | None:
        """The next byte without consuming it, or None if none came within ``seconds``."""
        with trio.move_on_after(seconds):
            while not self.buf:
                await self._more()
        return self.buf[0] if self.buf else None


@dataclass
class FrameRelay:
    """A relay from a loopback port to ``upstream``, rewriting frames with ``attack``."""

    upstream: tuple[str, int]
    attack: Callable[[RelayedFrame], list[bytes]] = field(default_factory=Attack)
    trailer: bool | None = None
    """Whether frames past the handshake carry a tag trailer (None: tell from the bytes)."""
    frames: dict[str, int] = field(default_factory=lambda: {TO_LISTENER: 0, TO_DIALER: 0})
    """Frames past the handshake read so far, per direction."""
    connections: int = 0

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 (an ephemeral port, given to ``nursery.start``) and relay every
        connection until cancelled."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        address = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            task_status.started((address[0], address[1]))
            await trio.serve_listeners(self._relay, listeners, handler_nursery=nursery)

    async def _relay(self, downstream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            upstream = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await downstream.aclose()
            return
        async with downstream, upstream, trio.open_nursery() as nursery:

            async def pump(source: trio.SocketStream, sink: trio.SocketStream, way: str) -> None:
                try:
                    await self._pump(source, sink, way)
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                nursery.cancel_scope.cancel()  # one side gone: so is the relayed connection

            nursery.start_soon(pump, downstream, upstream, TO_LISTENER)
            nursery.start_soon(pump, upstream, downstream, TO_DIALER)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream, way: str) -> None:
        reader = _Reader(source)
        for _ in range(_HANDSHAKE_FRAMES):
            prefix = await reader.exactly(PREFIX_SIZE)
            await sink.send_all(prefix + await reader.exactly(_PREFIX.unpack(prefix)[0]))
        while True:
            prefix = await reader.exactly(PREFIX_SIZE)
            item = await reader.exactly(_PREFIX.unpack(prefix)[0])
            if self.trailer is None:
                self.trailer = await reader.peek(_DETECT_SECONDS) == _TRAILER_HEADER
            trailer = await reader.exactly(TRAILER_SIZE) if self.trailer else b""
            frame = RelayedFrame(way, self.frames[way], prefix, item, trailer)
            self.frames[way] += 1
            for data in self.attack(frame):
                await sink.send_all(data)


@asynccontextmanager
async def relayed_pair(
    secret: bytes, attack: Callable[[RelayedFrame], list[bytes]]
) -> AsyncIterator[tuple[TcpTransport, TcpTransport]]:
    """Ranks 0 and 1 of a group of two (transports of this process) whose one connection
    runs through a `FrameRelay` with ``attack``: rank 1 dials the relay, the relay dials
    rank 0. Both ends ran the real handshake (`dial`, `accept`) with ``secret``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    host, port = listeners[0].socket.getsockname()[:2]
    relay = FrameRelay((host, port), attack)
    accepted: list[Connection] = []
    welcomed = trio.Event()
    ranks: tuple[TcpTransport, TcpTransport] | None = None
    async with trio.open_nursery() as nursery:
        relay_address = await nursery.start(relay.serve)

        async def listen() -> None:
            stream = await listeners[0].accept()
            me = Identity(DEFAULT_GROUP, 2, 0)
            accepted.append((await accept(stream, secret, me, lambda _peer: None))[0])
            welcomed.set()

        try:
            nursery.start_soon(listen)
            dialed, _ = await dial(relay_address, secret, Identity(DEFAULT_GROUP, 2, 1))
            await welcomed.wait()
            ranks = (TcpTransport(0, 2, {1: accepted[0]}), TcpTransport(1, 2, {0: dialed}))
            yield ranks
        finally:
            with trio.CancelScope(shield=True):
                for transport in ranks or ():
                    await transport.aclose()
                await listeners[0].aclose()
            nursery.cancel_scope.cancel()
