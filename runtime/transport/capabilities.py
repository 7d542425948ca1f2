"""Capabilities a `Transport` may have beyond the base contract, as declared interfaces.

A transport that has a capability inherits its abstract class here, as trio's streams inherit
``HalfCloseableStream`` (``trio/_abc.py``); code that can use a capability asks
``isinstance(transport, Capability)``, never whether an attribute happens to exist. Each class
says what its members must do, and `paramsync.runtime.testing.transport_conformance` checks that a
transport declaring one keeps that contract.

- `BlockingLinkProvider`: lends connections to OS threads as a `BlockingLinkSet` (blocking
  send and receive of whole parts; the ring collectives run large tensors this way).
- `PolledLinkProvider`: lends connections to one OS thread as a `PolledLinkSet` (small frames
  waited for with poll(2) and a deadline; the threaded shared-memory plane signals this way).
- `PrecodedFrames`: sends a frame encoded beforehand and recognises one by its bytes (step
  signals without a CBOR encode or decode per signal).
- `SharedMemoryHolder`: carries an `AllReducePlane` (`paramsync.runtime.transport.shm`) that
  all-reduce uses instead of the connections for the tensors the plane accepts.
- `NativeCollectives`: runs the collectives on another engine (torch.distributed process
  groups, `paramsync.runtime.transport.torch_plane`); the ring's functions hand it the tensors it
  accepts.

Nothing here imports a concrete transport: the capabilities sit between
`paramsync.runtime.transport.base` and the transports (tcp.py, shm.py) that implement or use them.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from paramsync.runtime.transport.base import Transport

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockingLinkSet",
    "PolledLinkSet",
    "BlockingLinkProvider",
    "PolledLinkProvider",
    "PrecodedFrames",
    "AllReducePlane",
    "SharedMemoryHolder",
    "NativeCollectives",
]


# ------------------------------------------------------------------------ what threads get


class BlockingLinkSet(abc.ABC):
    """Connections to a few peers, lent to OS threads in blocking mode.

    One thread may send to a peer while another receives from it. Every call blocks the
    calling thread (never an event loop) until done; a peer that moves no byte within the
    provider's stall deadline fails the call with `paramsync.runtime.errors.StallError`, a peer that
    is gone with `paramsync.runtime.errors.PeerClosed`, both naming the peer.
    """

    @abc.abstractmethod
    def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message to ``peer``; returns once every byte has left this process's hands
        (``bulk`` may be reused then)."""

    @abc.abstractmethod
    def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        """Receive the next message from ``peer``, its bulk written into ``out`` (contiguous,
        CPU); a bulk of another dtype or size is a `paramsync.runtime.errors.ProtocolError` naming
        the peer. The returned message's ``data`` is ``out``, or, when the sender's tensor had
        another shape of the same size, ``out`` viewed in that shape (the same storage), so that a
        receiver that cares about shapes can tell. ``out`` is a landing buffer, as for
        `Transport.recv_into`: the bulk lands before the frame's tag is checked, so when this raises
        ``out`` holds unspecified bytes (never pass live state)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Break every lent connection at once: a thread blocked in `send` or `recv_into`
        wakes with an error. Safe to call from any thread, and more than once."""


class PolledLinkSet(abc.ABC):
    """Connections to a few peers, lent to one OS thread for small, pre-encoded frames.

    Each wait is bounded: `send_frame` by ``stall_seconds``, `recv_matching` by the caller's
    deadline; running past it is a `paramsync.runtime.errors.StallError` naming the peer.
    """

    stall_seconds: float
    """How long a send may wait for the peer to take bytes."""

    @abc.abstractmethod
    def send_frame(self, peer: int, frame: bytes) -> None:
        """Send ``frame`` (encoded with `paramsync.runtime.protocol.wire.encode_frame_bytes`) to
        ``peer``."""

    @abc.abstractmethod
    def recv_matching(self, peer: int, expected: bytes, deadline: float) -> dict[str, Any] | None:
        """The next message from ``peer`` by ``deadline`` (``time.monotonic()``): None when its
        frame is byte for byte ``expected``, else the message, decoded and validated. A message
        with a bulk is a `paramsync.runtime.errors.ProtocolError` naming the peer."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Break every lent connection, waking the thread with an error (any thread, repeatable)."""


# ------------------------------------------------------------------------ transport capabilities


class BlockingLinkProvider(Transport):
    """A transport that can lend its connections to OS threads (`BlockingLinkSet`).

    Threads moving whole parts with blocking system calls release the GIL, so a ring's sends
    and receives run on two cores at once (`paramsync.runtime.collectives.ring`).
    """

    @property
    @abc.abstractmethod
    def supports_blocking(self) -> bool:
        """Whether `blocking_links` can lend the connections now. False (TLS connections, whose
        records live in trio): `blocking_links` raises `paramsync.runtime.errors.CollectiveError`,
        and callers take the trio path instead."""

    @abc.abstractmethod
    def blocking_links(self, peers: set[int]) -> AbstractAsyncContextManager[BlockingLinkSet]:
        """Lend the connections to ``peers`` to threads for the duration of the block.

        No trio task uses those connections meanwhile (their sends and receives wait). Leaving
        the block by an error or a cancellation aborts the lent links and so breaks the
        transport, as any failed collective does; leaving it normally gives the connections back
        in working order, with nothing buffered lost.
        """


class PolledLinkProvider(Transport):
    """A transport that can lend its connections to one OS thread for small frames
    (`PolledLinkSet`), without switching them out of the event loop's mode."""

    stall_seconds: float
    """A lent link that moves no byte for this long fails as a stall."""

    @property
    @abc.abstractmethod
    def supports_polled(self) -> bool:
        """Whether `polled_links` can lend the connections now (False: it raises
        `paramsync.runtime.errors.CollectiveError`)."""

    @abc.abstractmethod
    def polled_links(self, peers: set[int]) -> AbstractAsyncContextManager[PolledLinkSet]:
        """Lend the connections to ``peers`` to one thread for the duration of the block, on
        the same terms as `BlockingLinkProvider.blocking_links`."""


class PrecodedFrames(Transport):
    """A transport that sends frames encoded beforehand and recognises one by its bytes: a
    message sent often (a step signal) costs no CBOR encode or decode."""

    stall_seconds: float
    """How long a peer may stay silent in the middle of a signalled exchange."""

    @abc.abstractmethod
    async def send_frame(self, peer: int, frame: bytes) -> None:
        """Send ``frame`` (from `paramsync.runtime.protocol.wire.encode_frame_bytes`) to ``peer``,
        in order with every other message to it."""

    @abc.abstractmethod
    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        """The next message from ``peer``: None when its frame is byte for byte ``expected``,
        else the message, decoded and validated as `Transport.recv` does; a message with a
        bulk is a `paramsync.runtime.errors.ProtocolError` naming the peer."""


class AllReducePlane(abc.ABC):
    """A data path beside a transport's connections that all-reduces some tensors, with results
    bitwise those of the ring (`paramsync.runtime.collectives.ring.all_reduce`)."""

    threaded: bool
    """Whether `all_reduce` runs its steps on a worker thread (through the transport's
    `PolledLinkProvider.polled_links`) rather than on the event loop; each rank's own choice."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the plane was closed (then it accepts nothing)."""

    @abc.abstractmethod
    def accepts(self, flat: torch.Tensor) -> bool:
        """Whether this all-reduce of ``flat`` (contiguous, 1-D, CPU) should run here. Every
        rank holding the plane answers alike for the same tensor."""

    @abc.abstractmethod
    async def all_reduce(
        self, transport: SharedMemoryHolder, flat: torch.Tensor, op: str, op_id: int
    ) -> None:
        """Reduce ``flat`` in place across the group (``op`` "sum" or "avg"). A failure or a
        cancellation breaks ``transport`` (`Transport.abort`), so the peers fail at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the plane; safe to call twice."""


class NativeCollectives(Transport):
    """A transport whose collectives run natively on another engine (torch.distributed process
    groups: `paramsync.runtime.transport.torch_plane`), not as rings of its frames.

    `paramsync.runtime.collectives.ring`'s `all_reduce`, `broadcast`, `all_gather`, `reduce_scatter`
    and `barrier` hand a tensor the transport `native_accepts` to these methods, after checking it
    as they check any. Each method is collective (every rank calls it, in one order), exact
    (integers reduce exactly; every rank ends bitwise identical, as the ring promises), has a
    deadline (a peer that stalls fails it with `paramsync.runtime.errors.StallError` rather than
    hanging) and fails at once when the transport is aborted.
    """

    @abc.abstractmethod
    def native_accepts(self, tensor: torch.Tensor) -> bool:
        """Whether the collectives of this (contiguous) tensor run natively: its dtype and
        device are ones the engine reduces. Every rank answers alike for the same tensor."""

    @abc.abstractmethod
    async def native_all_reduce(self, flat: torch.Tensor, op: str) -> None:
        """Reduce ``flat`` (1-D, contiguous) in place across the group: ``op`` "sum" or "avg"
        (true division for floats, floor division for integers, as the ring)."""

    @abc.abstractmethod
    async def native_broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Copy rank ``root``'s ``flat`` into every rank's, in place."""

    @abc.abstractmethod
    async def native_all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """Write every rank's ``flat`` into ``out`` (``world_size * flat.numel()`` elements), row
        r rank r's."""

    @abc.abstractmethod
    async def native_reduce_scatter(
        self, flat: torch.Tensor, op: str, bounds: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Reduce ``flat`` across the group and return this rank's segment,
        ``bounds[rank]``, as a new tensor (``flat`` is scratch afterwards)."""

    @abc.abstractmethod
    async def native_barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""


class SharedMemoryHolder(PrecodedFrames):
    """A transport that can carry a shared-memory plane (`paramsync.runtime.transport.shm`): the
    plane's step signals travel as its pre-encoded frames.

    ``shared_memory`` is None until `paramsync.runtime.transport.shm.attach_shared_memory` sets it,
    and again once the transport is closed or aborted (which closes the plane). While it is set,
    `paramsync.runtime.collectives.ring.all_reduce` sends the tensors it accepts through it.
    """

    shared_memory: AllReducePlane | None
