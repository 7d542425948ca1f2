"""Control links: one framed, ordered message stream between a worker and the coordinator.

A TCP `paramsync.runtime.transport.tcp.Connection` is a link; `MemoryLink.pair()` makes two
connected in-process ends that carry the same encoded frames, so the coordinator and workers can run
in one trio run (tests, the embedded form) and still refuse exactly what they refuse over TCP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import trio

from paramsync.runtime.errors import PeerClosed, ProtocolError
from paramsync.runtime.protocol.limits import PEEK_SIZE, check_kind_accepted
from paramsync.runtime.protocol.wire import (
    DEFAULT_MAX_FRAME,
    PREFIX_SIZE,
    decode_frame,
    encode_frame_bytes,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Link", "MemoryLink"]


@runtime_checkable
class Link(Protocol):
    """An ordered message stream to one peer."""

    peer: object

    async def send(
        self, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message."""
        ...

    async def recv(
        self, max_frame: int = DEFAULT_MAX_FRAME, *, kinds: frozenset[str] | None = None
    ) -> dict[str, Any]:
        """Receive the next message; PeerClosed when the other end is gone. ``kinds``: the only
        message kinds accepted (None: any); a frame of another kind is refused (ProtocolError)
        before its head is decoded."""
        ...

    async def wait_readable(self) -> None:
        """Return once the next `recv` need not wait for the peer (a message, or the end of
        the link, is there), or earlier where the link cannot tell. Cancelling it loses
        nothing: a reader can stop waiting without touching the stream."""
        ...

    async def aclose(self) -> None:
        """Close this end; the other end's receive raises PeerClosed."""
        ...


class MemoryLink:
    """One end of an in-process link carrying encoded frames over bounded memory channels."""

    def __init__(
        self,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        peer: object = None,
    ) -> None:
        self._send = send
        self._receive = receive
        self.peer = peer
        self.closed = False
        self._ahead: bytes | None = None
        """A frame `wait_readable` took off the channel, for the next `recv`."""

    @classmethod
    def pair(
        cls, a_name: object = None, b_name: object = None, buffer_frames: int = 64
    ) -> tuple[MemoryLink, MemoryLink]:
        """Two connected ends; ``a_name``/``b_name`` label each end's peer in errors."""
        a_to_b, b_from_a = trio.open_memory_channel[bytes](buffer_frames)
        b_to_a, a_from_b = trio.open_memory_channel[bytes](buffer_frames)
        return cls(a_to_b, a_from_b, peer=b_name), cls(b_to_a, b_from_a, peer=a_name)

    async def send(
        self, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        frame = encode_frame_bytes(kind, fields, bulk)
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerClosed("link closed", peer=self.peer) from None

    async def send_raw(self, frame: bytes) -> None:
        """Send bytes as they are (for tests that feed a receiver garbage)."""
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerClosed("link closed", peer=self.peer) from None

    async def wait_readable(self) -> None:
        if self._ahead is None:
            try:
                self._ahead = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
                return  # recv raises PeerClosed
        else:
            await trio.lowlevel.checkpoint()

    async def recv(
        self, max_frame: int = DEFAULT_MAX_FRAME, *, kinds: frozenset[str] | None = None
    ) -> dict[str, Any]:
        frame, self._ahead = self._ahead, None
        if frame is None:
            try:
                frame = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
                raise PeerClosed("link closed", peer=self.peer) from None
        else:
            await trio.lowlevel.checkpoint()
        try:
            if kinds is not None:
                check_kind_accepted(frame[PREFIX_SIZE : PREFIX_SIZE + PEEK_SIZE], kinds)
            return decode_frame(frame, max_frame)
        except ProtocolError as exc:
            raise exc.with_peer(self.peer) from None

    async def aclose(self) -> None:
        self.closed = True
        self._send.close()
        self._receive.close()
