"""TCP transport: authenticated trio socket streams between every pair of ranks.

The byte path is built for throughput: frames leave with one ``sendmsg`` whose last buffer is
the tensor's own memory, and bulk bytes land with ``recv_into`` straight in the destination
tensor. Small frames (prefix and head) come through one reusable receive buffer, so a control
message costs one system call.

After the handshake, every frame in either direction carries a MAC bound to its place in the
stream (`paramsync.runtime.protocol.frame_auth`): a frame altered, forged, dropped, replayed or
reordered on the way fails it, and the connection is closed with a `FrameAuthenticationError` naming
the peer before the message reaches anyone.

With a `TlsConfig` every connection runs TLS first, then the same handshake inside it
(`paramsync.runtime.transport.tls`); such connections go through trio's ``SSLStream`` (one copy per
received record) and cannot lend their sockets to the blocking thread path.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import select
import socket
import struct
import sys
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import stamina
import trio

from paramsync.runtime.config import DistributedConfig, advertised_host
from paramsync.runtime.errors import (
    CollectiveError,
    FrameAuthenticationError,
    HandshakeAbandoned,
    HandshakeError,
    InvalidKeyShare,
    ListenerBusy,
    PeerClosed,
    ProofUnanswered,
    ProtocolError,
    StallError,
    one_line,
    quoted,
)
from paramsync.runtime.protocol.frame_auth import FrameSealer, frame_session
from paramsync.runtime.protocol.frame_reader import (
    BUFFER_SIZE,
    CONTROL_DUE,
    NO_TENSORS,
    Frame,
    FrameReader,
    Into,
    Need,
    Placement,
    Scratch,
)
from paramsync.runtime.protocol.handshake import (
    DialerHandshake,
    Identity,
    ListenerHandshake,
    load_secret,
)
from paramsync.runtime.protocol.messages import RdvJoin, RdvTable, Refusal, decode_message
from paramsync.runtime.protocol.wire import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    check_bulk_destination,
    decode_head,
    encode_frame,
    encode_frame_bytes,
    landed_as_sent,
    tensor_buffer,
)
from paramsync.runtime.transport import deployment_salt, keylog
from paramsync.runtime.transport.admission import AdmissionGate
from paramsync.runtime.transport.base import BulkRoute
from paramsync.runtime.transport.capabilities import (
    AllReducePlane,
    BlockingLinkProvider,
    BlockingLinkSet,
    PolledLinkProvider,
    PolledLinkSet,
    SharedMemoryHolder,
)
from paramsync.runtime.transport.tls import TlsConfig, describe_tls_error

if TYPE_CHECKING:
    # Connection's ``socket`` property hides the module in its methods' annotations.
    from socket import socket as RawSocket

    import torch

    from paramsync.runtime.protocol.wire import BulkSpec


def _tensor_over(landing: bytearray, spec: BulkSpec) -> torch.Tensor:
    """The tensor a verified bulk that had no destination of its own is (its scratch bytes,
    uncopied). torch is imported here, not at the top: the coordinator frames and reads
    messages through this module and never needs it; here the frame has passed its tag."""
    import torch

    flat = torch.frombuffer(landing, dtype=spec.dtype)
    if sys.byteorder != "little" and spec.dtype.itemsize > 1:  # pragma: no cover
        flat = flat.view(torch.uint8).view(-1, spec.dtype.itemsize).flip(1).contiguous()
        flat = flat.view(spec.dtype)
    return flat.view(spec.shape)


def _into(out: torch.Tensor) -> Into:
    """The placement of a bulk in ``out``, a landing buffer (`recv_into`, `recv_into_blocking`)."""
    return Into(
        out.numel() * out.element_size(),
        functools.partial(tensor_buffer, out),
        functools.partial(_holds, out),
    )


def _holds(out: torch.Tensor) -> str:
    return f"{out.dtype} with {out.numel()} elements"


__all__ = [
    "TcpTransport",
    "Connection",
    "BlockingLinks",
    "PolledLinks",
    "DEFAULT_GROUP",
    "dial",
    "dial_with_retry",
    "accept",
    "form_mesh",
    "listener_gate",
]

log = logging.getLogger("paramsync.tcp")

DEFAULT_GROUP = "paramsync"
_BUFFER_SIZE = BUFFER_SIZE
_HEAD_READ = 4096
"""A blocking read for a frame's prefix and head asks for at most this many bytes (or what the
head needs), so a bulk that follows mostly lands straight in its destination."""
_SOCKET_BUFFER = 4 * 1024 * 1024
"""Socket buffers that hold a whole 4 MiB ring part, so a blocking send rarely waits."""
_TLS_COALESCE = 64 * 1024
"""Under TLS, a frame up to this size leaves as one write (one record), larger ones by part."""
_TLS_SEND = 1 << 20
"""Under TLS, bulk is encrypted and sent this many bytes at a time (bounds the copy)."""
_TLS_READ = 64 * 1024
"""Under TLS, the most bytes asked of one read (a TLS record holds at most 16 KiB)."""

_Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]
_THREAD_DECODE = 64 * 1024
"""A head longer than this is decoded on a worker thread, not on the event loop (a 64 KiB
head decodes in well under a millisecond; the largest caps allow 64 MiB)."""


class Connection:
    """One authenticated byte stream to a peer, framed by the wire codec.

    ``stream`` is a ``trio.SocketStream``, or a ``trio.SSLStream`` over one (then the instance
    is a TLS connection, without the blocking thread path: see `supports_blocking`).
    """

    supports_blocking = True
    """Whether `TcpTransport.blocking_links` may lend this connection to worker threads."""
    direct = hasattr(socket, "MSG_DONTWAIT")
    """Whether sends and receives that need no wait may skip trio's scheduler (plain TCP)."""

    def __new__(cls, stream: _Stream, peer: object = None) -> Connection:
        if cls is Connection and isinstance(stream, trio.SSLStream):
            cls = _TlsConnection
        return super().__new__(cls)

    def __init__(self, stream: _Stream, peer: object = None) -> None:
        self.stream = stream
        self.peer = peer
        self._sock = (
            stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket
        )
        self._send_lock = trio.StrictFIFOLock()
        self._recv_lock = trio.StrictFIFOLock()
        self._reader = FrameReader(_BUFFER_SIZE)
        """Every read rule and the receive buffer; this class only moves its bytes."""
        self.closed = False
        self._raw: RawSocket | None = None
        self._sealer: FrameSealer | None = None
        """Tags outgoing frames once the handshake is done (None before: handshake frames)."""
        self._refusal: FrameAuthenticationError | None = None
        """Why this end shut the connection down itself (a frame failed authentication, or
        the counter ran out): a worker thread still using it then raises this, not the
        hang-up it sees (`_hung_up`)."""
        self.tensors = True
        """Whether a frame `recv` reads may hold a tensor. False while the handshake runs
        (`dial`, `accept`) and on a coordinator's control links: a typed array or a bulk there
        is refused naming the field, and nothing builds a tensor or imports torch (issue 31,
        row 3)."""
        _tune(self._sock)

    def authenticate_frames(self, session_key: bytes, *, dialer: bool) -> None:
        """From now on, tag every frame sent and check every frame received with the keys of
        ``session_key`` (`paramsync.runtime.protocol.frame_auth`); ``dialer`` says which end this
        is. Called by `dial` and `accept` right after the handshake's welcome."""
        session = frame_session(session_key, dialer=dialer)
        self._sealer, self._reader.opener = session.sealer, session.opener

    @property
    def frames_authenticated(self) -> bool:
        """Whether frames on this connection carry and are checked against a MAC."""
        return self._reader.opener is not None

    @property
    def socket(self) -> trio.socket.SocketType:
        """The TCP socket under the stream (TLS or not): for its addresses, not for I/O."""
        return self._sock

    @property
    def _buf(self) -> bytearray:
        """The receive buffer (its size stays bounded between frames: docs/protocol.md §1)."""
        return self._reader.buffer

    def opened_like_tls(self) -> bool:
        """Whether the first bytes this connection received open a TLS record (a handshake or
        an alert) where a paramsync frame was due: the peer speaks TLS and this side does not.

        Such a prefix announces a head of over 350 MB, refused before the handshake's limit,
        so the first bytes still sit at the front of the receive buffer."""
        first = self._reader.buffer
        return first[1] == 0x03 and first[0] in (0x15, 0x16)

    @asynccontextmanager
    async def lent(self) -> AsyncIterator[None]:
        """Hold both of this connection's locks, so that no trio task sends or receives on it
        while it is lent to worker threads (`TcpTransport.blocking_links`, `polled_links`).
        A free lock is taken without a schedule point."""
        held: list[trio.StrictFIFOLock] = []
        try:
            for lock in (self._send_lock, self._recv_lock):
                if lock.locked():
                    await lock.acquire()
                else:
                    lock.acquire_nowait()
                held.append(lock)
            yield
        finally:
            for lock in held:
                lock.release()

    # ---------------------------------------------------------------- sending

    async def send(
        self, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message; ``bulk`` leaves from the tensor's memory.

        A frame the socket takes at once leaves without a trip through trio's scheduler (see
        `_may_skip_schedule`): a cancel point, but a schedule point only now and then."""
        await self._send_locked(encode_frame(kind, fields, bulk))

    async def send_frame(self, frame: bytes) -> None:
        """Send one frame encoded beforehand (`paramsync.runtime.protocol.wire.encode_frame_bytes`):
        a message sent often, such as a step signal, is encoded once."""
        await self._send_locked([frame])

    async def _send_locked(self, parts: Sequence[bytes | memoryview]) -> None:
        async with self._holding(self._send_lock) as direct:
            views = [memoryview(part).cast("B") for part in parts]
            if self._sealer is None:
                await self._send_views(views, direct)
                return
            views.append(memoryview(self._seal(views)))
            total = sum(len(view) for view in views)
            try:
                await self._send_views(views, direct)
            except BaseException:
                if views and sum(len(view) for view in views) == total:
                    self._sealer.rewind()  # no byte left: the next frame takes this number
                raise

    async def _send_views(self, views: list[memoryview], direct: bool) -> None:
        """Send ``views`` (consumed in place, so a caller sees what did not leave)."""
        if direct:  # try the socket at once; what it does not take goes through trio
            try:
                _consume(views, self._raw_socket().sendmsg(views, (), _DONTWAIT))
            except BlockingIOError:
                pass
            except OSError as exc:
                raise PeerClosed(f"connection lost while sending: {exc}", peer=self.peer) from None
        if views:
            await self._send_parts(views)

    def _seal(self, parts: Sequence[bytes | memoryview]) -> bytes:
        """The tag trailer of the frame made of ``parts`` (frame authentication on)."""
        assert self._sealer is not None
        try:
            return self._sealer.seal(parts)
        except FrameAuthenticationError as exc:  # the counter ran out
            raise self._refuse(exc) from None

    def _refuse(self, exc: FrameAuthenticationError) -> FrameAuthenticationError:
        """Shut the connection down for ``exc`` and return it naming the peer; remembered, so
        that a thread blocked on the connection meanwhile wakes with it (`_hung_up`)."""
        error = exc.with_peer(self.peer)
        assert isinstance(error, FrameAuthenticationError)
        # A copy of its own is remembered: the raised one's traceback holds the frame's
        # buffers (a bulk read aside), which must go with the frame, not with the connection.
        kept = exc.with_peer(self.peer)
        assert isinstance(kept, FrameAuthenticationError)
        self._refusal = kept
        self.abort()
        return error

    def _hung_up(self, error: PeerClosed) -> ProtocolError:
        """What a worker thread raises when the connection fails under it: ``error``, or, if
        this end shut it down for a refused frame, that refusal. Both threads of a threaded
        ring then report the forged frame, whichever of them is recorded first."""
        if self._refusal is None:
            return error
        return FrameAuthenticationError(
            f"{self._refusal.reason} (this end closed the connection: {error.reason})",
            peer=self.peer,
        )

    @asynccontextmanager
    async def _holding(self, lock: trio.StrictFIFOLock) -> AsyncIterator[bool]:
        """Hold ``lock``; yields True when it was free and taken without a scheduler trip
        (`_may_skip_schedule`), so the caller may try the socket directly too."""
        if self.direct and not lock.locked() and _may_skip_schedule():
            await trio.lowlevel.checkpoint_if_cancelled()
            lock.acquire_nowait()
            try:
                yield True
            finally:
                lock.release()
            return
        async with lock:
            yield False

    async def _send_parts(self, views: list[memoryview]) -> None:
        """Send ``views`` (byte views), consuming the list as bytes leave."""
        try:
            while views:
                _consume(views, await self._sock.sendmsg(views))
        except OSError as exc:
            raise PeerClosed(f"connection lost while sending: {exc}", peer=self.peer) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise PeerClosed("connection closed", peer=self.peer) from None

    # ---------------------------------------------------------------- receiving
    #
    # Every read rule (the prefix, the limits from it and a peek at the kind, the tag checked
    # before anything is decoded, where a bulk lands) is `FrameReader`'s
    # (`paramsync.runtime.protocol.frame_reader`). The three I/O modes below, a trio task, a worker
    # thread on a blocking socket and a worker thread polling a non-blocking one, only move the
    # bytes it asks for and decode the heads it hands back.

    def _next(self) -> Need | Frame:
        """The reader's next step; a frame that fails its tag closes the connection and raises
        FrameAuthenticationError naming the peer."""
        try:
            return self._reader.next()
        except FrameAuthenticationError as exc:
            raise self._refuse(exc) from None

    async def _read_frame(
        self,
        max_frame: int,
        placement: Placement,
        expected: bytes | None = None,
        kinds: frozenset[str] | None = None,
    ) -> Frame:
        """Read one frame (trio): its bytes from the socket wherever the reader asks."""
        reader = self._reader
        reader.start(max_frame, placement, expected, kinds=kinds)
        while True:
            try:
                step = reader.next()
            except FrameAuthenticationError as exc:
                raise self._refuse(exc) from None
            if type(step) is Frame:
                return step
            assert isinstance(step, Need)
            count = await self._recv_into(step.view)
            if step.bulk:
                reader.landed(count)
            else:
                reader.filled(count)

    async def _recv_into(self, view: memoryview) -> int:
        try:
            if self.direct and _may_skip_schedule():
                try:
                    count = self._raw_socket().recv_into(view, 0, _DONTWAIT)
                except BlockingIOError:
                    count = await self._sock.recv_into(view)
            else:
                count = await self._sock.recv_into(view)
        except OSError as exc:
            raise PeerClosed(f"connection lost: {exc}", peer=self.peer) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise PeerClosed("connection closed", peer=self.peer) from None
        if count == 0:
            raise PeerClosed("connection closed by the peer", peer=self.peer)
        return count

    async def _decode(self, head: bytes, bulk_len: int) -> tuple[dict[str, Any], Any]:
        """`decode_head`, once the frame verified; a head long enough for its decode to take
        a while (a large manifest, a coordinator table) is decoded on a worker thread, never
        on the event loop."""
        if len(head) > _THREAD_DECODE:
            return await trio.to_thread.run_sync(
                functools.partial(decode_head, head, bulk_len, tensors=self.tensors)
            )
        return decode_head(head, bulk_len, tensors=self.tensors)

    async def wait_readable(self) -> None:
        """Return once bytes from the peer wait to be read (or the connection has ended), so
        that the `recv` after it starts at once. Cancelling it loses nothing.

        Bytes that already wait in the socket are taken into the buffer at once (one
        non-blocking read, a cancel point but no schedule point): a reader that waited for
        something else meanwhile (`CoordinatorClient.reads_deferred`) then needs no trip
        through the scheduler to find them."""
        if self._reader.buffered:
            return
        if self.direct and not self._recv_lock.locked() and self._took_waiting_bytes():
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        try:
            await trio.lowlevel.wait_readable(self._sock)
        except (trio.ClosedResourceError, OSError):
            return  # the recv after it says what happened

    def _took_waiting_bytes(self) -> bool:
        """Read what waits in the socket into the buffer without waiting; whether the next
        `recv` can start (bytes came, or the connection ended: it says so)."""
        try:
            raw = self._raw_socket()
            count = raw.recv_into(self._reader.space(1), 0, _DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the recv after it says what happened
        self._reader.filled(count)
        return True

    async def recv(
        self, max_frame: int = DEFAULT_MAX_FRAME, *, kinds: frozenset[str] | None = None
    ) -> dict[str, Any]:
        """Receive one message; a bulk tensor is allocated and filled.

        With no destination given, the bulk counts against ``max_frame`` too: a peer cannot
        make this side allocate more than that. On a connection that takes no tensors
        (`tensors` false: a handshake, a coordinator's control link) any bulk is refused from
        the prefix, unread. ``kinds``: the only message kinds accepted (None: any), any other
        refused from the prefix and the peek at its kind. The frame's tag is checked before
        anything of it is decoded (docs/protocol.md §5.4)."""
        placement = Scratch(max_frame) if self.tensors else NO_TENSORS
        async with self._holding(self._recv_lock):
            try:
                frame = await self._read_frame(max_frame, placement, kinds=kinds)
                message, spec = await self._decode(frame.head, frame.bulk_len)
                if spec is not None:
                    assert isinstance(frame.bulk, bytearray)
                    message["data"] = _tensor_over(frame.bulk, spec)
                return message
            except ProtocolError as exc:
                raise exc.with_peer(self.peer) from None

    async def recv_matching(
        self, expected: bytes, max_frame: int = DEFAULT_MAX_FRAME
    ) -> dict[str, Any] | None:
        """Receive one message: None if its frame is byte for byte ``expected`` (a frame the
        caller encoded), else the message, checked and decoded as `recv` does; a frame with
        bulk is refused from its prefix, unread.

        A step signal is then a comparison of a few dozen bytes, not a CBOR decode."""
        async with self._holding(self._recv_lock):
            try:
                frame = await self._read_frame(max_frame, CONTROL_DUE, expected)
                if frame.matched:
                    return None
                return (await self._decode(frame.head, 0))[0]
            except ProtocolError as exc:
                raise exc.with_peer(self.peer) from None

    async def recv_into(
        self, out: torch.Tensor, max_frame: int = DEFAULT_MAX_FRAME
    ) -> dict[str, Any]:
        """Receive one message whose bulk is written straight into ``out``, uncopied.

        ``out`` is a landing buffer: its bytes arrive before the frame's tag is checked, so
        when this raises ``out`` holds unspecified bytes. Pass only a buffer the caller owns
        and drops (or rewrites) on failure, never live model or optimizer state
        (docs/protocol.md §5.4). The head is decoded only once the frame verified; a bulk of
        another size than ``out`` is read aside and verified when it is within ``max_frame``
        (so the error names what was sent), refused from the prefix, unread, when larger."""
        async with self._holding(self._recv_lock):
            try:
                placement = _into(out)
                frame = await self._read_frame(max_frame, placement)
                message, spec = await self._decode(frame.head, frame.bulk_len)
                check_bulk_destination(spec, out, self.peer, message)
                if frame.misfit:
                    raise placement.misfit(frame.bulk_len)
                message["data"] = out
                return message
            except ProtocolError as exc:
                raise exc.with_peer(self.peer) from None

    async def recv_routed(
        self, route: BulkRoute, max_frame: int = DEFAULT_MAX_FRAME, max_bulk: int = 0
    ) -> dict[str, Any]:
        """Receive one message whose bulk lands where ``route`` says, once the frame verified
        and its head is decoded: in the tensor it returns (checked as `recv_into` checks), or,
        for None, a fresh one.

        The bulk is read into a scratch buffer first, at most ``max(max_frame, max_bulk)``
        bytes (refused from the prefix beyond that: ``max_bulk`` is the largest destination
        the caller has posted), the whole frame checked against its tag, then the head decoded
        and routed; a chosen destination (a posted receive, maybe live state) receives one copy
        of verified bytes and nothing else."""
        async with self._holding(self._recv_lock):
            try:
                frame = await self._read_frame(max_frame, Scratch(max(max_frame, max_bulk)))
                message, spec = await self._decode(frame.head, frame.bulk_len)
                if spec is not None:
                    landing = frame.bulk
                    assert isinstance(landing, bytearray)
                    out = route(message, spec.dtype, spec.shape)
                    if out is None:
                        message["data"] = _tensor_over(landing, spec)
                    else:
                        check_bulk_destination(spec, out, self.peer, message)
                        tensor_buffer(out)[:] = landing
                        message["data"] = out
                return message
            except ProtocolError as exc:
                raise exc.with_peer(self.peer) from None

    # ---------------------------------------------------------------- blocking bulk path
    #
    # Large transfers run in worker threads with the socket switched to blocking mode: one
    # system call moves a whole part (MSG_WAITALL), the GIL is free meanwhile, and sends and
    # receives proceed on two cores at once. Only `BlockingLinks` switches the mode, while it
    # holds both of this connection's locks, so the trio path never sees a blocking socket.

    def _raw_socket(self) -> RawSocket:
        if self._raw is None:
            fd = self._sock.fileno()
            self._raw = socket.socket(self._sock.family, self._sock.type, fileno=os.dup(fd))
        return self._raw

    def send_blocking(
        self, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message from a worker thread (blocking mode only)."""
        views = [memoryview(part).cast("B") for part in encode_frame(kind, fields, bulk)]
        if self._sealer is not None:
            views.append(memoryview(self._seal(views)))
        raw = self._raw_socket()
        try:
            while views:
                _consume(views, raw.sendmsg(views))
        except BlockingIOError:
            raise StallError(f"send to peer {self.peer} stalled past its deadline") from None
        except OSError as exc:
            lost = PeerClosed(f"connection lost while sending: {exc}", peer=self.peer)
            raise self._hung_up(lost) from None

    def _recv_some_blocking(
        self, raw: RawSocket, view: memoryview, size: int, flags: int = 0
    ) -> int:
        """One blocking ``recv_into``; its failures as the errors that name this peer."""
        try:
            count = raw.recv_into(view, size, flags)
        except BlockingIOError:
            raise StallError(f"peer {self.peer} sent nothing before the deadline") from None
        except OSError as exc:
            raise self._hung_up(PeerClosed(f"connection lost: {exc}", peer=self.peer)) from None
        if count == 0:
            raise self._hung_up(PeerClosed("connection closed by the peer", peer=self.peer))
        return count

    # ---------------------------------------------------------------- polled control path
    #
    # Small control frames (step signals) from a worker thread, with the socket left in trio's
    # non-blocking mode: a call that cannot proceed waits in poll(2) until ``deadline``
    # (time.monotonic()). Only `PolledLinks` lends a connection to this path, while the event
    # loop holds both of its locks.

    def _poll(self, events: int, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        poller = select.poll()
        poller.register(self._raw_socket(), events)
        if left <= 0 or not poller.poll(left * 1000.0):
            raise StallError(f"{what} before the deadline", peer=self.peer)

    def send_frame_polled(self, frame: bytes, deadline: float) -> None:
        """`send_frame` from a worker thread (polled mode only)."""
        views = [memoryview(frame)]
        if self._sealer is not None:
            views.append(memoryview(self._seal(views)))
        raw = self._raw_socket()
        while views:
            try:
                _consume(views, raw.sendmsg(views, (), _DONTWAIT))
            except BlockingIOError:
                self._poll(select.POLLOUT, deadline, "took no bytes")
            except OSError as exc:
                raise PeerClosed(f"connection lost while sending: {exc}", peer=self.peer) from None

    def _recv_polled(self, view: memoryview, deadline: float) -> int:
        """One non-blocking ``recv_into`` (polled mode), waiting in poll(2) until ``deadline``
        while nothing has come."""
        raw = self._raw_socket()
        while True:
            try:
                count = raw.recv_into(view, 0, _DONTWAIT)
            except BlockingIOError:
                self._poll(select.POLLIN, deadline, "sent nothing")
                continue
            except OSError as exc:
                raise PeerClosed(f"connection lost: {exc}", peer=self.peer) from None
            if count == 0:
                raise PeerClosed("connection closed by the peer", peer=self.peer)
            return count

    def recv_matching_polled(
        self, expected: bytes, deadline: float, max_frame: int = DEFAULT_MAX_FRAME
    ) -> dict[str, Any] | None:
        """`recv_matching` from a worker thread (polled mode only): a frame with bulk is
        refused from its prefix, any other checked against its tag before it is decoded."""
        try:
            reader = self._reader
            reader.start(max_frame, CONTROL_DUE, expected)
            while True:
                step = self._next()
                if type(step) is Frame:
                    break
                assert isinstance(step, Need)  # never a bulk: a control message is due
                reader.filled(self._recv_polled(step.view, deadline))
            if step.matched:
                return None
            return decode_head(step.head, 0, tensors=self.tensors)[0]
        except ProtocolError as exc:
            raise exc.with_peer(self.peer) from None

    def recv_into_blocking(
        self, out: torch.Tensor, max_frame: int = DEFAULT_MAX_FRAME
    ) -> dict[str, Any]:
        """Receive one message into ``out`` from a worker thread (blocking mode only).

        As `recv_into`: every limit from the prefix and a peek at the head, the bulk landed
        in ``out`` (a landing buffer) with one ``MSG_WAITALL`` read, the whole frame checked
        against its tag, and only then the head decoded."""
        try:
            placement = _into(out)
            reader = self._reader
            reader.start(max_frame, placement, direct_read=0)
            raw = self._raw_socket()
            while True:
                step = self._next()
                if type(step) is Frame:
                    break
                assert isinstance(step, Need)
                if step.bulk:
                    size = step.count
                    reader.landed(self._recv_some_blocking(raw, step.view, size, _WAITALL))
                else:  # one wake-up usually brings prefix and head together
                    size = min(len(step.view), max(_HEAD_READ, step.count))
                    reader.filled(self._recv_some_blocking(raw, step.view, size))
            message, spec = decode_head(step.head, step.bulk_len, tensors=self.tensors)
            check_bulk_destination(spec, out, self.peer, message)
            if step.misfit:
                raise placement.misfit(step.bulk_len)
            message["data"] = landed_as_sent(spec, out, message)
            return message
        except ProtocolError as exc:
            raise exc.with_peer(self.peer) from None

    def set_blocking(self, blocking: bool, deadline_seconds: float | None = None) -> None:
        """Switch the socket between trio's non-blocking mode and the threads' blocking mode."""
        raw = self._raw_socket()
        raw.setblocking(blocking)
        seconds = deadline_seconds if blocking and deadline_seconds else 0.0
        timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def abort(self) -> None:
        """Wake any thread blocked on this connection by shutting the socket down."""
        self.closed = True
        try:
            self._raw_socket().shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    async def aclose(self) -> None:
        """Close the stream; safe to call twice."""
        self.closed = True
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        await self.stream.aclose()


class _TlsConnection(Connection):
    """A `Connection` over ``trio.SSLStream``: same framing, records in and out of trio."""

    supports_blocking = False
    direct = False

    async def _send_parts(self, views: list[memoryview]) -> None:
        try:
            if sum(len(view) for view in views) <= _TLS_COALESCE:
                await self.stream.send_all(b"".join(views))
                views.clear()
                return
            while views:
                view = views[0]
                await self.stream.send_all(view[:_TLS_SEND])
                if len(view) > _TLS_SEND:
                    views[0] = view[_TLS_SEND:]
                else:
                    views.pop(0)
        except trio.BrokenResourceError as exc:
            raise _TlsBroken("connection lost while sending", exc, peer=self.peer) from None
        except trio.ClosedResourceError:
            raise PeerClosed("connection closed", peer=self.peer) from None

    async def _recv_into(self, view: memoryview) -> int:
        try:
            data = await self.stream.receive_some(min(len(view), _TLS_READ))
        except trio.BrokenResourceError as exc:
            raise _TlsBroken("connection lost", exc, peer=self.peer) from None
        except trio.ClosedResourceError:
            raise PeerClosed("connection closed", peer=self.peer) from None
        count = len(data)
        if count == 0:
            raise PeerClosed("connection closed by the peer", peer=self.peer)
        view[:count] = data
        return count

    async def wait_readable(self) -> None:
        """Returns at once: decrypted bytes may wait inside the TLS layer, where the socket
        cannot show them, so a TLS link is read as its messages come."""
        await trio.lowlevel.checkpoint()

    def _raw_socket(self) -> RawSocket:
        raise CollectiveError(
            f"the connection to {self.peer} is TLS: the blocking thread path needs plaintext TCP"
        )

    def abort(self) -> None:
        """Shut the TCP socket under the TLS stream down, waking every task blocked on it."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _TlsBroken(PeerClosed):
    """The TLS layer failed (an alert from the peer, a bad record): the reason is OpenSSL's."""

    def __init__(self, what: str, error: BaseException, *, peer: object) -> None:
        self.tls_reason = describe_tls_error(error)
        super().__init__(f"{what}: {self.tls_reason}", peer=peer)


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # direct is off where it is missing
_WAITALL = socket.MSG_WAITALL
_SCHEDULE_EVERY = 16
"""A direct send or receive yields to trio's scheduler once in this many."""
_direct_ops = 0


def _may_skip_schedule() -> bool:
    """Whether this direct socket operation may finish without yielding to the scheduler.

    Every trio socket call yields, even when the kernel took or had the bytes at once: a trip
    through the run loop (an epoll call, a reschedule) per small frame. Skipping it when the
    call needs no wait (with the step signals encoded once and matched by their bytes) took a
    training worker's event loop from 48 to 25 task steps and from 4.3 to 3.6 ms of CPU a
    step (4 workers, `benchmarks/ddp.py`, BENCHMARKS.md). The call stays a cancel point; one
    in `_SCHEDULE_EVERY` takes the yielding path, so a task that never has to wait still lets
    the others run."""
    global _direct_ops
    _direct_ops += 1
    if _direct_ops >= _SCHEDULE_EVERY:
        _direct_ops = 0
        return False
    return True


def _consume(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of a partly sent ``sendmsg`` buffer list, in place."""
    while sent:
        if sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0


def _tune(sock: Any) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    except OSError:  # pragma: no cover - options are advisory
        pass


# -------------------------------------------------------------------------- handshake shells


@functools.cache
def _loopback_secret() -> str:
    """The secret of the groups `TcpTransport.open_group` forms without one: random, and one
    per process, so its scrypt stretching is paid once per process, not once per group."""
    return secrets.token_urlsafe(32)


async def dial(
    address: tuple[str, int],
    secret: bytes,
    me: Identity,
    *,
    handshake_seconds: float = 10.0,
    tls: TlsConfig | None = None,
) -> tuple[Connection, Identity]:
    """Connect to ``address`` and run the dialer's handshake; raises HandshakeError if refused.

    With ``tls``, the TLS handshake runs first, within the same deadline.
    """
    stream = await trio.open_tcp_stream(*address)
    where = f"{address[0]}:{address[1]}"
    conn: Connection | None = None
    state = DialerHandshake(secret, me)
    try:
        with trio.fail_after(handshake_seconds):
            conn = Connection(
                stream if tls is None else await tls.wrap_client(stream, where), peer=where
            )
            conn.tensors = False  # until the listener has proven the secret
            await conn.send(*state.hello())
            reply = await conn.recv(HANDSHAKE_MAX_FRAME)
            await conn.send(*state.on_challenge(reply))
            peer = state.on_verdict(await conn.recv(HANDSHAKE_MAX_FRAME))
            assert state.listener_salt is not None
            deployment_salt.adopt(secret, state.listener_salt)  # it proved the secret
            conn.authenticate_frames(state.session_key(), dialer=True)
            keylog.log_connection(state.nonces(), state.session_key())
            conn.tensors = True
    except trio.TooSlowError:
        await _close(conn, stream)
        if state.proof_sent:
            raise ProofUnanswered(
                f"the listener took this side's proof and gave none of its own within "
                f"{handshake_seconds} s",
                peer=where,
            ) from None
        raise HandshakeError(
            f"no handshake answer from {where} within {handshake_seconds} s"
        ) from None
    except ProtocolError as exc:
        await _close(conn, stream)
        if isinstance(exc, _TlsBroken):
            # TLS 1.3: the listener checks this side's certificate after our handshake ended.
            reason = exc.tls_reason
            raise HandshakeError(f"TLS handshake failed: {reason}", peer=where) from None
        if tls is None and conn is not None and conn.opened_like_tls():
            raise HandshakeError(
                "the listener speaks TLS: this side needs --tls-cert, --tls-key and --tls-ca",
                peer=where,
            ) from None
        raise _handshake_failure(exc, state.proof_sent, where) from None
    except BaseException:
        await _close(conn, stream)
        raise
    conn.peer = peer.rank if peer.rank >= 0 else conn.peer
    return conn, peer


def _handshake_failure(exc: ProtocolError, proof_sent: bool, where: str) -> ProtocolError:
    """What a dialer's failed handshake says happened, naming the listener at ``where``: a
    refusal or a failed proof as they are; the listener closing, or its bytes not being a
    message, as breaking the handshake off before its proof (`ProofUnanswered` once this side's
    proof was sent, else `HandshakeAbandoned`), never as a wrong secret."""
    if isinstance(exc, InvalidKeyShare | HandshakeAbandoned):
        return exc.with_peer(where)
    if isinstance(exc, HandshakeError):
        return exc
    if isinstance(exc, PeerClosed):
        what = "closed the connection"
    else:
        what = f"sent what is not a handshake message ({exc.reason})"
    if proof_sent:
        return ProofUnanswered(f"the listener {what} before its proof", peer=where)
    return HandshakeAbandoned(f"the listener {what} before its challenge", peer=where)


async def accept(
    stream: trio.SocketStream,
    secret: bytes,
    me: Identity,
    admit: Any,
    *,
    handshake_seconds: float = 10.0,
    tls: TlsConfig | None = None,
    salt: bytes | None = None,
) -> tuple[Connection, Identity]:
    """Run the listener's handshake on an accepted stream (with ``tls``: TLS first, within
    the same deadline). ``salt``: the scrypt salt of the challenge; None: the one this process
    adopted for ``secret`` from the first listener that proved it
    (`paramsync.runtime.transport.deployment_salt`), else the process's own.

    Any failure closes the stream and raises a ProtocolError naming the remote address; the
    caller logs it and keeps serving.
    """
    try:
        remote = stream.socket.getpeername()
        where = f"{remote[0]}:{remote[1]}"
    except OSError:
        where = "unknown peer"
    conn: Connection | None = None
    if salt is None:
        salt = deployment_salt.listener_salt(secret)
    state = ListenerHandshake(secret, me, admit, salt=salt)
    try:
        with trio.fail_after(handshake_seconds):
            secured: _Stream = stream
            if tls is not None:
                secured = await tls.wrap_server(stream, where, plaintext_reply=_TLS_REQUIRED)
            conn = Connection(secured, peer=where)
            conn.tensors = False  # until the dialer has proven the secret
            try:
                hello = await conn.recv(HANDSHAKE_MAX_FRAME)
                await conn.send(*state.on_hello(hello))
                auth = await conn.recv(HANDSHAKE_MAX_FRAME)
            except PeerClosed:
                raise
            except ProtocolError as exc:
                refusal = exc
                if tls is None and conn.opened_like_tls():
                    refusal = HandshakeError(
                        "the peer speaks TLS but this side has no TLS configured "
                        "(--tls-cert, --tls-key, --tls-ca)"
                    )
                await _refuse(conn, refusal.reason)
                raise refusal from None
            kind, fields, error = state.on_auth(auth)
            await conn.send(kind, fields)
            if error is not None:
                raise error
            conn.authenticate_frames(state.session_key(), dialer=False)
            keylog.log_connection(state.nonces(), state.session_key())
            conn.tensors = True
    except trio.TooSlowError:
        await _close(conn, stream)
        raise HandshakeError(
            f"handshake not finished within {handshake_seconds} s", peer=where
        ) from None
    except ProtocolError as exc:
        await _close(conn, stream)
        raise exc.with_peer(where) from None
    except BaseException:
        await _close(conn, stream)
        raise
    assert state.peer is not None
    conn.peer = state.peer.rank
    return conn, state.peer


async def _close(conn: Connection | None, stream: trio.SocketStream) -> None:
    """Close a connection that failed its handshake (or its bare stream, before TLS wrapped it)."""
    if conn is not None:
        await conn.aclose()
    else:
        await trio.aclose_forcefully(stream)


_TLS_REQUIRED = encode_frame_bytes(
    *Refusal("this listener requires TLS (--tls-cert, --tls-key, --tls-ca)").to_wire()
)
"""What a TLS listener answers, in the clear, to a peer that opens with a paramsync frame."""


async def _refuse(conn: Connection, reason: str) -> None:
    try:
        with trio.move_on_after(1):
            await conn.send(*Refusal(reason).to_wire())
    except ProtocolError:
        pass


# -------------------------------------------------------------------------- transport


class BlockingLinks(BlockingLinkSet):
    """Blocking send/receive on a few connections, for collectives' worker threads."""

    def __init__(self, conns: dict[int, Connection], max_frame: int) -> None:
        self._conns = conns
        self._max_frame = max_frame

    def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        """Send one message to ``peer``; returns when the kernel has taken every byte."""
        self._conns[peer].send_blocking(kind, fields, bulk)

    def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        """Receive the next message from ``peer`` with its bulk written into ``out``."""
        return self._conns[peer].recv_into_blocking(out, self._max_frame)

    def abort(self) -> None:
        """Shut every lent connection down, waking blocked threads with an error."""
        for conn in self._conns.values():
            conn.abort()


class PolledLinks(PolledLinkSet):
    """Small control frames on a few connections from one worker thread: each wait is a
    poll(2) with the transport's stall deadline, the sockets stay non-blocking."""

    def __init__(self, conns: dict[int, Connection], max_frame: int, stall_seconds: float) -> None:
        self._conns = conns
        self._max_frame = max_frame
        self.stall_seconds = stall_seconds

    def send_frame(self, peer: int, frame: bytes) -> None:
        """Send a frame encoded beforehand to ``peer``."""
        self._conns[peer].send_frame_polled(frame, time.monotonic() + self.stall_seconds)

    def recv_matching(self, peer: int, expected: bytes, deadline: float) -> dict[str, Any] | None:
        """The next message from ``peer`` by ``deadline``: None if it is ``expected`` byte for
        byte, else the message."""
        return self._conns[peer].recv_matching_polled(expected, deadline, self._max_frame)

    def abort(self) -> None:
        """Shut every lent connection down, waking the thread with an error."""
        for conn in self._conns.values():
            conn.abort()


class TcpTransport(BlockingLinkProvider, PolledLinkProvider, SharedMemoryHolder):
    """A rank's authenticated TCP connections to every other rank of its group.

    Declares every capability of `paramsync.runtime.transport.capabilities`: blocking and polled
    links (plaintext TCP only: under TLS `supports_blocking` and `supports_polled` are False),
    frames encoded beforehand, and a shared-memory plane (`paramsync.runtime.transport.shm`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        connections: dict[int, Connection],
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self.connections = connections
        self.max_frame = max_frame
        self.secret = secret
        """The key the connections authenticated with, kept so that process groups
        (`paramsync.runtime.collectives.groups`) can form their own meshes; None if not given."""
        self.tls = tls
        """The TLS configuration of the connections (None: plain TCP), for the same purpose."""
        self.stall_seconds = 300.0
        """A blocking transfer that moves no byte for this long fails as a stall."""
        self.shared_memory: AllReducePlane | None = None
        """The group's shared-memory plane (`paramsync.runtime.transport.shm.attach_shared_memory`),
        if any: all-reduce then moves large tensors through it instead of the sockets."""

    def _conn(self, peer: int) -> Connection:
        self.check_peer(peer)
        return self.connections[peer]

    async def send(
        self, peer: int, kind: str, fields: Mapping[str, Any], bulk: torch.Tensor | None = None
    ) -> None:
        await self._conn(peer).send(kind, fields, bulk)

    async def recv(self, peer: int) -> dict[str, Any]:
        return await self._conn(peer).recv(self.max_frame)

    async def recv_into(self, peer: int, out: torch.Tensor) -> dict[str, Any]:
        conn = self._conn(peer)
        self.check_destination(out)
        return await conn.recv_into(out, self.max_frame)

    async def recv_routed(
        self, peer: int, route: BulkRoute, *, max_bulk: int = 0
    ) -> dict[str, Any]:
        """The next message from ``peer``, its bulk copied, once verified, into the tensor
        ``route`` chooses (see `Transport.recv_routed` and `Connection.recv_routed`)."""
        return await self._conn(peer).recv_routed(route, self.max_frame, max_bulk)

    async def send_frame(self, peer: int, frame: bytes) -> None:
        """Send a frame encoded beforehand to ``peer`` (see `Connection.send_frame`)."""
        await self._conn(peer).send_frame(frame)

    async def recv_matching(self, peer: int, expected: bytes) -> dict[str, Any] | None:
        """The next message from ``peer``: None if it is ``expected`` byte for byte, else the
        message (see `Connection.recv_matching`)."""
        return await self._conn(peer).recv_matching(expected, self.max_frame)

    async def aclose(self) -> None:
        self._drop_shared_memory()
        for conn in self.connections.values():
            await conn.aclose()

    def abort(self) -> None:
        """Shut every connection down: blocked collective threads wake with an error."""
        self._drop_shared_memory()
        for conn in self.connections.values():
            conn.abort()

    def _drop_shared_memory(self) -> None:
        plane, self.shared_memory = self.shared_memory, None
        if plane is not None:
            plane.close()

    @property
    def supports_blocking(self) -> bool:
        """Whether `blocking_links` can lend these connections to threads: not under TLS."""
        return all(conn.supports_blocking for conn in self.connections.values())

    @property
    def supports_polled(self) -> bool:
        """Whether `polled_links` can lend these connections to a thread: not under TLS."""
        return all(conn.supports_blocking for conn in self.connections.values())

    @asynccontextmanager
    async def blocking_links(self, peers: set[int]) -> AsyncIterator[BlockingLinks]:
        """Lend the connections to ``peers`` to worker threads, in blocking mode.

        Holds both locks of each connection meanwhile, so no trio task uses them. If the block
        is left by an error or a cancellation, the connections are shut down: threads blocked on
        them wake up, and the transport is broken, as it is after any failed collective.
        Raises CollectiveError for TLS connections (see `supports_blocking`).
        """
        conns = {peer: self._conn(peer) for peer in sorted(peers)}
        tls = sorted(peer for peer, conn in conns.items() if not conn.supports_blocking)
        if tls:
            raise CollectiveError(
                f"blocking links need plaintext TCP, but the connections to ranks {tls} are "
                f"TLS: use the trio path (collectives choose it themselves under TLS)"
            )
        async with AsyncExitStack() as stack:
            for conn in conns.values():
                await stack.enter_async_context(conn.lent())
            for conn in conns.values():
                conn.set_blocking(True, self.stall_seconds)
            links = BlockingLinks(conns, self.max_frame)
            ok = False
            try:
                yield links
                ok = True
            finally:
                if not ok:
                    links.abort()
                for conn in conns.values():
                    if not conn.closed:
                        conn.set_blocking(False)

    @asynccontextmanager
    async def polled_links(self, peers: set[int]) -> AsyncIterator[PolledLinks]:
        """Lend the connections to ``peers`` to one worker thread for small control frames
        (`PolledLinks`), holding both locks of each so no trio task uses them meanwhile.

        The sockets keep trio's non-blocking mode, so lending costs no system call. If the
        block is left by an error or a cancellation, the connections are shut down, which
        wakes the thread, and the transport is broken. Raises CollectiveError under TLS."""
        conns = {peer: self._conn(peer) for peer in sorted(peers)}
        tls = sorted(peer for peer, conn in conns.items() if not conn.supports_blocking)
        if tls:
            raise CollectiveError(
                f"polled links need plaintext TCP, but the connections to ranks {tls} are TLS"
            )
        ok = False
        links = PolledLinks(conns, self.max_frame, self.stall_seconds)
        try:
            async with AsyncExitStack() as stack:
                for conn in conns.values():
                    await stack.enter_async_context(conn.lent())
                yield links
                ok = True
        finally:
            if not ok:
                links.abort()

    # ---------------------------------------------------------------- group formation

    @classmethod
    @asynccontextmanager
    async def open_group(
        cls,
        n: int,
        *,
        secret: bytes | str | None = None,
        group: str = DEFAULT_GROUP,
        tls: TlsConfig | None = None,
        shared_memory: bool = False,
        **shm_options: Any,
    ) -> AsyncIterator[list[TcpTransport]]:
        """Yield ``n`` connected transports on loopback in this process (tests, benchmarks).

        Every pair of ranks is a real authenticated TCP connection (over TLS with ``tls``).
        With ``shared_memory``, the ranks attach a shared-memory plane (``shm_options`` go to
        `paramsync.runtime.transport.shm.attach_shared_memory`).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"group size must be a positive int, got {n!r}")
        key = load_secret(secret if secret is not None else _loopback_secret(), {})
        listeners = [
            (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0] if n > 1 else None
            for _ in range(n)
        ]
        addresses = [
            tuple(lst.socket.getsockname()[:2]) if lst is not None else ("", 0) for lst in listeners
        ]
        meshes: list[dict[int, Connection]] = [{} for _ in range(n)]
        try:
            async with trio.open_nursery() as nursery:
                for rank in range(n):
                    nursery.start_soon(
                        functools.partial(_form_mesh, tls=tls),
                        Identity(group, n, rank),
                        listeners[rank],
                        addresses,
                        key,
                        meshes[rank],
                        range(n),
                    )
        finally:
            for lst in listeners:
                if lst is not None:
                    await lst.aclose()
        transports = [cls(rank, n, meshes[rank], secret=key, tls=tls) for rank in range(n)]
        try:
            if shared_memory:
                await _attach_all(transports, shm_options)
            yield transports
        finally:
            with trio.CancelScope(shield=True):
                for transport in transports:
                    await transport.aclose()

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        config: DistributedConfig,
        *,
        secret: bytes | str | None = None,
        group: str = DEFAULT_GROUP,
        join_seconds: float = 60.0,
        tls: TlsConfig | None = None,
        shared_memory: bool | None = None,
    ) -> AsyncIterator[TcpTransport]:
        """Join a multi-process group: rank 0 listens at ``config.coordinator_addr``.

        Every other rank dials rank 0, authenticates, announces where it listens, receives the
        table of all ranks' addresses, then connects to the ranks below it. The whole formation
        must finish within ``join_seconds`` seconds. With ``tls``, every connection is TLS.

        Then the ranks negotiate a shared-memory plane (`paramsync.runtime.transport.shm`), used
        when every rank wants it and all run on one host. ``shared_memory`` None means on unless
        ``PARAMSYNC_SHM=0`` or TLS (its results are bitwise those of the TCP ring, so only the speed
        changes); True asks for it even under TLS; False opts this rank, and so the group, out.
        """
        key = load_secret(secret)
        me = Identity(group, config.world_size, config.rank)
        mesh: dict[int, Connection] = {}
        if config.world_size > 1:
            with trio.fail_after(join_seconds):
                if config.rank == 0:
                    await _rendezvous_root(me, config.address, key, mesh, tls=tls)
                else:
                    await _rendezvous_member(me, config.address, key, mesh, tls=tls)
        transport = cls(config.rank, config.world_size, mesh, secret=key, tls=tls)
        try:
            if config.world_size > 1:
                from paramsync.runtime.transport.shm import attach_shared_memory

                await attach_shared_memory(transport, want=shared_memory, seconds=join_seconds)
            yield transport
        finally:
            with trio.CancelScope(shield=True):
                await transport.aclose()


async def _attach_all(transports: list[TcpTransport], options: dict[str, Any]) -> None:
    """Attach a shared-memory plane on every rank of an in-process group, concurrently."""
    from paramsync.runtime.transport.shm import attach_shared_memory

    async with trio.open_nursery() as nursery:
        for transport in transports:
            nursery.start_soon(functools.partial(attach_shared_memory, transport, **options))


_LISTENER_GATES: weakref.WeakKeyDictionary[trio.SocketListener, AdmissionGate] = (
    weakref.WeakKeyDictionary()
)


def listener_gate(listener: trio.SocketListener, name: str) -> AdmissionGate:
    """The admission gate of a worker's ``listener``: one for the listener's life, so its
    budgets of failed proofs (`paramsync.runtime.transport.guess_budget`) hold across the
    meshes formed on it (a run keeps one listener for all its epochs). ``name`` names a gate
    made now; a gate already made keeps its name."""
    gate = _LISTENER_GATES.get(listener)
    if gate is None:
        gate = _LISTENER_GATES[listener] = AdmissionGate(name)
    return gate


def _admit_ranks(
    me: Identity, claimed: set[int], allowed: range | set[int], granted: list[int] | None = None
) -> Any:
    """The admission policy of a mesh or rendezvous listener: a rank above ``me`` in
    ``allowed``, not yet ``claimed``. The check and the claim are one step (no checkpoint
    between), so two dialers claiming one rank at once cannot both be welcomed; the granted
    rank is appended to ``granted``, so a handshake that fails after it can give it back."""

    def admit(peer: Identity) -> str | None:
        if peer.rank in claimed:
            return f"rank {peer.rank} is already taken"
        if peer.rank not in allowed or peer.rank <= me.rank:
            return f"rank {peer.rank} is not expected to dial rank {me.rank}"
        claimed.add(peer.rank)
        if granted is not None:
            granted.append(peer.rank)
        return None

    return admit


async def _serve_until(
    listener: trio.SocketListener,
    me: Identity,
    secret: bytes,
    mesh: dict[int, Connection],
    expected: set[int],
    on_joined: Any = None,
    *,
    tls: TlsConfig | None = None,
) -> None:
    """Accept connections until every rank in ``expected`` has joined ``mesh``.

    A connection that fails its handshake is logged and dropped; the listener keeps serving.
    """
    claimed = set(mesh)
    all_in = trio.Event()

    async def handle(stream: trio.SocketStream, ticket: Any) -> None:
        granted: list[int] = []
        admit = _admit_ranks(me, claimed, expected, granted)
        try:
            # deadline, pending slot; logs and counts a failure
            # (paramsync.runtime.transport.admission)
            with ticket:
                conn, peer = await accept(
                    stream, secret, me, admit, handshake_seconds=ticket.seconds, tls=tls
                )
        except (ProtocolError, OSError, trio.BrokenResourceError):
            claimed.difference_update(granted)  # failed after its rank was granted: free it
            return
        if on_joined is not None:
            try:
                await on_joined(peer.rank, conn)
            except (ProtocolError, OSError) as exc:
                log.warning(
                    "rank %d dropped rank %d after its handshake: %s",
                    me.rank,
                    peer.rank,
                    one_line(exc),
                )
                claimed.discard(peer.rank)
                await conn.aclose()
                return
        mesh[peer.rank] = conn
        if expected <= mesh.keys():
            all_in.set()

    async with trio.open_nursery() as nursery:

        async def accept_loop() -> None:
            await listener_gate(listener, f"rank {me.rank}").serve(listener, nursery, handle)

        if expected - mesh.keys():
            nursery.start_soon(accept_loop)
            await all_in.wait()
        nursery.cancel_scope.cancel()


_REDIAL_FIRST = 0.01
"""Seconds before the first redial; each later wait doubles, up to `_REDIAL_MAX`."""
_REDIAL_MAX = 0.5
_REDIAL_JITTER = 0.1
"""Up to this many seconds, drawn at random, are added to every wait: workers that all lost a
restarted coordinator at once redial spread out, not in one herd."""


async def dial_with_retry(
    address: tuple[str, int], secret: bytes, me: Identity, *, tls: TlsConfig | None = None
) -> tuple[Connection, Identity]:
    """`dial`, retrying while nobody listens yet or the listener is busy, with exponential
    backoff and random jitter (`stamina`); any other failure is raised at once. It retries
    for as long as it takes: the caller sets the deadline (a cancel scope)."""
    async for attempt in stamina.retry_context(
        on=(OSError, ListenerBusy),
        attempts=None,
        timeout=None,
        wait_initial=_REDIAL_FIRST,
        wait_max=_REDIAL_MAX,
        wait_jitter=_REDIAL_JITTER,
    ):
        with attempt:
            return await dial(address, secret, me, tls=tls)
    raise AssertionError("unreachable: retries stop only by success, error or cancellation")


async def _form_mesh(
    me: Identity,
    listener: trio.SocketListener | None,
    addresses: list[tuple[str, int]],
    secret: bytes,
    mesh: dict[int, Connection],
    members: range | list[int],
    *,
    tls: TlsConfig | None = None,
) -> None:
    """Connect ``me`` to every other member: dial those below, accept those above."""
    below = [rank for rank in members if rank < me.rank and rank not in mesh]
    above = {rank for rank in members if rank > me.rank}

    async def dial_one(rank: int) -> None:
        conn, peer = await dial_with_retry(addresses[rank], secret, me, tls=tls)
        if peer.rank != rank:
            await conn.aclose()
            raise HandshakeError(f"dialed rank {rank} at {addresses[rank]}, found rank {peer.rank}")
        mesh[rank] = conn

    async with trio.open_nursery() as nursery:
        for rank in below:
            nursery.start_soon(dial_one, rank)
        if above and listener is not None:
            nursery.start_soon(
                functools.partial(_serve_until, listener, me, secret, mesh, above, tls=tls)
            )


async def form_mesh(
    me: Identity,
    listener: trio.SocketListener,
    addresses: list[tuple[str, int]],
    secret: bytes,
    *,
    tls: TlsConfig | None = None,
) -> dict[int, Connection]:
    """Connect ``me`` to every rank listed in ``addresses`` (by rank): dial the ranks below,
    accept the ranks above on ``listener`` (all over TLS with ``tls``). Returns the
    connections by rank."""
    if len(addresses) != me.world_size:
        raise HandshakeError(
            f"{len(addresses)} addresses for a group of {me.world_size}: cannot form the mesh"
        )
    mesh: dict[int, Connection] = {}
    await _form_mesh(me, listener, addresses, secret, mesh, range(me.world_size), tls=tls)
    return mesh


async def _rendezvous_root(
    me: Identity,
    address: tuple[str, int],
    secret: bytes,
    mesh: dict[int, Connection],
    *,
    tls: TlsConfig | None = None,
) -> None:
    listeners = await trio.open_tcp_listeners(address[1], host=address[0])
    joins: dict[int, tuple[str, int]] = {}

    async def on_joined(rank: int, conn: Connection) -> None:
        raw = await conn.recv(HANDSHAKE_MAX_FRAME)
        if raw.get("kind") != RdvJoin.KIND:  # the kind first: a report needs a context to decode
            raise ProtocolError(f"expected rdv_join, got {quoted(raw.get('kind'))}", peer=rank)
        join = decode_message(raw, peer=rank)
        assert isinstance(join, RdvJoin)
        joins[rank] = (join.host, join.port)

    try:
        await _serve_until(
            listeners[0], me, secret, mesh, set(range(1, me.world_size)), on_joined, tls=tls
        )
    finally:
        for lst in listeners:
            await lst.aclose()
    table = ((address[0], address[1]), *(joins[r] for r in range(1, me.world_size)))
    for rank in range(1, me.world_size):
        await mesh[rank].send(*RdvTable(table).to_wire())


async def _rendezvous_member(
    me: Identity,
    address: tuple[str, int],
    secret: bytes,
    mesh: dict[int, Connection],
    *,
    tls: TlsConfig | None = None,
) -> None:
    conn, peer = await dial_with_retry(address, secret, me, tls=tls)
    if peer.rank != 0:
        await conn.aclose()
        raise HandshakeError(f"{address[0]}:{address[1]} is rank {peer.rank}, not rank 0")
    mesh[0] = conn
    local_host = advertised_host() or conn.socket.getsockname()[0]
    listeners = await trio.open_tcp_listeners(0, host=local_host)
    try:
        port = listeners[0].socket.getsockname()[1]
        await conn.send(*RdvJoin(local_host, port).to_wire())
        table = decode_message(await conn.recv(), peer=0)
        if not isinstance(table, RdvTable) or len(table.addresses) != me.world_size:
            raise ProtocolError("rendezvous table does not list every rank", peer=0)
        await _form_mesh(
            me, listeners[0], list(table.addresses), secret, mesh, range(1, me.world_size), tls=tls
        )
    finally:
        for lst in listeners:
            await lst.aclose()
