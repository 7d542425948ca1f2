"""The point-to-point interface collectives run on, and its in-process implementation.

A `Transport` connects one rank to every other rank of its group. Messages to one peer arrive in
the order they were sent. Collectives are the only users of the data path, one at a time, in the
same order on every rank, so a receiver always knows what the next frame from a peer must be.

What a transport can do beyond this contract (lend links to threads, carry a shared-memory
plane) it declares by inheriting the interfaces of `paramsync.runtime.transport.capabilities`;
`paramsync.runtime.testing.transport_conformance` checks an implementation against both.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from paramsync.runtime.errors import CollectiveError, PeerClosed, ProtocolError
from paramsync.runtime.protocol.schema import is_tensor
from paramsync.runtime.protocol.wire import (
    DEFAULT_MAX_FRAME,
    decode_frame,
    encode_frame_bytes,
    tensor_buffer,
)

__all__ = ["Transport", "InProcessTransport", "BulkRoute", "land_tensor"]

if TYPE_CHECKING:  # torch only in annotations: the coordinator imports this module without it
    import torch

    BulkRoute = Callable[[dict[str, Any], torch.dtype, tuple[int, ...]], torch.Tensor | None]
else:
    BulkRoute = Callable[[dict[str, Any], Any, tuple[int, ...]], Any]
"""Where a message's bulk should land, chosen once its head is read (`Transport.recv_routed`):
given the message (without ``data``), the bulk's dtype and shape, a contiguous CPU tensor of that
dtype and size to write it into, or None to allocate one."""


class Transport(abc.ABC):
    """One rank's connections to the rest of its group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._op_counter = 0

    def next_op_id(self) -> int:
        """A fresh id for the next collective; ranks agree because they call in one order."""
        op_id = self._op_counter
        self._op_counter += 1
        return op_id

    def bind_next_op(self, op_id: int) -> None:
        """Make ``op_id`` the next collective's id (later ones count on from it). For a
        caller that numbers its collectives itself: a torch process group gives each call an
        id made from the call's description, so that peers running different calls refuse
        each other's frames (the op id travels in every collective frame and is checked)."""
        if isinstance(op_id, bool) or not isinstance(op_id, int) or not 0 <= op_id < 1 << 63:
            raise ValueError(f"an op id is an int in 0..2**63-1, got {op_id!r}")
        self._op_counter = op_id

    def describe_peer(self, peer: int) -> str:
        """A peer as errors name it (a group names its world rank too)."""
        return f"rank {peer}"

    def check_peer(self, peer: int) -> None:
        """Refuse a peer rank that is this rank or outside the group."""
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise CollectiveError(f"peer must be a rank (int), got {peer!r}")
        if peer == self.rank or not 0 <= peer < self.world_size:
            raise CollectiveError(
                f"rank {self.rank} cannot talk to peer {peer} in a group of {self.world_size}"
            )

    def check_destination(self, out: torch.Tensor) -> None:
        """Refuse a `recv_into` destination that is not a contiguous CPU tensor, before any
        byte of the message is read (it stays for the next receive)."""
        if not is_tensor(out):
            raise CollectiveError(f"recv_into needs a torch.Tensor, got {type(out).__name__}")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise CollectiveError(
                f"recv_into needs a contiguous CPU tensor to write into, got a "
                f"{'contiguous' if out.is_contiguous() else 'non-contiguous'} one on {out.device}"
            )

    @abc.abstractmethod
    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message to ``peer``; ``bulk`` becomes its ``data`` field, sent uncopied."""

    @abc.abstractmethod
    async def recv(self, peer: int) -> dict[str, Any]:
        """Receive the next message from ``peer``, a bulk tensor materialised as ``data``."""

    @abc.abstractmethod
    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        """Receive the next message from ``peer``, its bulk written into ``out``.

        ``out`` must be a contiguous CPU tensor, else a CollectiveError before anything is read
        (`check_destination`); a bulk of another dtype or size is a ProtocolError naming the
        peer. The returned message's ``data`` is ``out``.

        ``out`` is a landing buffer: a transport may write the bulk into it before the frame's
        tag is checked (TCP does, uncopied), so when this raises ``out`` holds unspecified
        bytes. Receive live state through a scratch buffer (`recv_routed`, `broadcast`).
        """

    async def recv_routed(
        self, peer: int, route: BulkRoute, *, max_bulk: int = 0
    ) -> dict[str, Any]:
        """Receive the next message from ``peer``, its bulk written where ``route`` says.

        ``max_bulk``: the largest destination ``route`` may choose, in bytes; a transport that
        reads the bulk before the head is decoded (TCP, checking the tag first) accepts a bulk
        up to that size or its frame limit, whichever is larger.

        ``route`` sees the message's head before any bulk byte is read, so a receiver that
        expects several messages (point-to-point tags) can land each in its own tensor. The
        chosen tensor changes only once the whole frame has verified: this default receives
        the message whole and copies the bulk over; `TcpTransport` reads it into a scratch
        tensor and copies it over after the tag check.
        """
        message = await self.recv(peer)
        data = message.get("data")
        if not is_tensor(data):
            return message
        head = {key: value for key, value in message.items() if key != "data"}
        out = route(head, data.dtype, tuple(data.shape))
        return message if out is None else land_tensor(message, out, peer)

    def abort(self) -> None:  # noqa: B027 - optional hook, most transports have no threads
        """Break the transport at once, waking any thread blocked on it (default: nothing to
        wake; async receivers end when their task is cancelled)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every connection; pending and later calls raise."""

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class InProcessTransport(Transport):
    """Ranks in one trio run, joined by bounded memory channels carrying encoded frames.

    Frames go through the same codec as on TCP, so both transports accept and refuse the same
    messages; only the bytes' path differs. It declares no capability: collectives take their
    trio paths over it.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        senders: dict[int, trio.MemorySendChannel[bytes]],
        receivers: dict[int, trio.MemoryReceiveChannel[bytes]],
        max_frame: int = DEFAULT_MAX_FRAME,
        registry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self._senders = senders
        self._receivers = receivers
        self.max_frame = max_frame
        self.registry: dict[str, Any] = registry if registry is not None else {}
        """State shared by every rank of one `create_group` call: process groups built over
        these transports (`paramsync.runtime.collectives.groups`) find one another's channels
        here."""

    @classmethod
    def create_group(
        cls,
        n: int,
        *,
        buffer_frames: int = 8,
        max_frame: int = DEFAULT_MAX_FRAME,
        registry: dict[str, Any] | None = None,
    ) -> list[InProcessTransport]:
        """Return ``n`` transports, rank 0 to n-1, each connected to all the others.

        Each direction buffers ``buffer_frames`` frames; a sender beyond that waits (backpressure).
        The transports share ``registry`` (a fresh dict by default; see `registry`).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"group size must be a positive int, got {n!r}")
        senders: list[dict[int, trio.MemorySendChannel[bytes]]] = [{} for _ in range(n)]
        receivers: list[dict[int, trio.MemoryReceiveChannel[bytes]]] = [{} for _ in range(n)]
        for src in range(n):
            for dst in range(n):
                if src != dst:
                    send, receive = trio.open_memory_channel[bytes](buffer_frames)
                    senders[src][dst] = send
                    receivers[dst][src] = receive
        shared: dict[str, Any] = registry if registry is not None else {}
        return [
            cls(rank, n, senders[rank], receivers[rank], max_frame, shared) for rank in range(n)
        ]

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        self.check_peer(peer)
        frame = encode_frame_bytes(kind, fields, bulk)
        try:
            await self._senders[peer].send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerClosed("connection closed", peer=peer) from None

    async def _receive_frame(self, peer: int) -> dict[str, Any]:
        self.check_peer(peer)
        try:
            frame = await self._receivers[peer].receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise PeerClosed("connection closed", peer=peer) from None
        try:
            return decode_frame(frame, self.max_frame)
        except ProtocolError as exc:
            raise exc.with_peer(peer) from None

    async def recv(self, peer: int) -> dict[str, Any]:
        return await self._receive_frame(peer)

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        self.check_destination(out)
        return land_tensor(await self._receive_frame(peer), out, peer)

    async def aclose(self) -> None:
        for sender in self._senders.values():
            sender.close()
        for receiver in self._receivers.values():
            receiver.close()


def land_tensor(message: dict[str, Any], out: torch.Tensor, peer: int) -> dict[str, Any]:
    """Copy a decoded message's tensor into ``out`` (what `Transport.recv_into` does for a
    transport that decodes whole frames): its dtype and element count must be ``out``'s, else a
    `ProtocolError` naming ``peer``; ``message["data"]`` becomes ``out``."""
    data = message.get("data")
    if not is_tensor(data):
        raise ProtocolError(f"{message['kind']} message carries no tensor", peer=peer)
    if data.dtype != out.dtype or data.numel() != out.numel():
        raise ProtocolError(
            f"sent a {data.dtype} tensor of shape {list(data.shape)}, expected {out.dtype} "
            f"with {out.numel()} elements",
            peer=peer,
        )
    if out.numel():
        tensor_buffer(out)[:] = tensor_buffer(data.contiguous())
    message["data"] = out
    return message
