"""Reading frames off a byte stream: every read rule in one place (sans-I/O).

A `FrameReader` is one connection's receiving side. It owns the receive buffer, is fed bytes
and never does I/O itself: each call of `FrameReader.next` either returns a `Need` (where the
next bytes go and how many at least) or a `Frame` (a whole frame, authenticated). The
transports are shells around it that only move bytes (`paramsync.runtime.transport.tcp`: a trio
task, a worker thread on a blocking socket, a worker thread polling a non-blocking one).

The rules, in the order they apply (docs/protocol.md §1 and §5.4):

1. the 8-byte prefix: an empty item, a bulk longer than its item and a head (item minus bulk)
   over the receiver's limit are refused (`paramsync.runtime.protocol.wire.parse_prefix`);
2. a peek at the head's first bytes (`paramsync.runtime.protocol.limits`): a kind the read does
   not accept (``kinds``), a head over its kind's cap, a bulk announced where a control message is
   due, by a kind that carries none or on a link that takes no tensors (`NO_TENSORS`), and a bulk
   that does not fit where it would land are refused before the head is read;
3. the head is read undecoded, then the bulk lands where the read's `Placement` says: the
   caller's destination (`Into`, a landing buffer of exactly the announced size) or a fresh
   scratch buffer (`Scratch`, at most its limit);
4. the 17-byte tag trailer is checked against the whole frame (`FrameOpener`) before the frame
   is handed back: a frame that fails raises `FrameAuthenticationError` and nothing of it has
   been decoded. Decoding the head is the caller's next step, never this module's.

A read expecting a control message may name the frame it expects byte for byte (``expected``):
a frame equal to it comes back as `Frame.matched`, with its tag checked and nothing to decode.

After an error the stream is out of step: the connection is closed, and the reader with it.
"""

from __future__ import annotations

from collections.abc import Callable

from paramsync.runtime.errors import FrameTooLarge, ProtocolError
from paramsync.runtime.protocol.frame_auth import FrameOpener
from paramsync.runtime.protocol.limits import (
    PEEK_SIZE,
    check_bulk_kind,
    check_kind_accepted,
    check_kind_size,
)
from paramsync.runtime.protocol.wire import PREFIX_SIZE, TRAILER_SIZE, parse_prefix

__all__ = [
    "BUFFER_SIZE",
    "DIRECT_READ",
    "Scratch",
    "NO_TENSORS",
    "Into",
    "ControlDue",
    "CONTROL_DUE",
    "Placement",
    "Need",
    "Frame",
    "FrameReader",
]

BUFFER_SIZE = 256 * 1024
"""Size of the receive buffer between frames; it grows for a longer head (at most that head's
cap) and returns to this size once that head is consumed."""
DIRECT_READ = 64 * 1024
"""Default of `FrameReader.start`'s ``direct_read``: a bulk remainder at least this long is
asked for straight into its destination; a shorter one through the receive buffer (one read
then brings the trailer and what follows too)."""

Buffer = bytes | bytearray | memoryview


class Scratch:
    """Placement of a read with no destination of its own: a bulk lands in a fresh buffer of
    its size, and a bulk over ``limit`` bytes is refused from the prefix, unread."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        self.limit = limit


NO_TENSORS = Scratch(0)
"""Placement of every read on a link that takes no tensors (a coordinator's control link, a
handshake): any bulk is refused from the prefix and the peek at its kind, unread."""


class Into:
    """Placement in the caller's destination of ``nbytes`` bytes (a landing buffer: its bytes
    arrive before the frame's tag is checked). ``view`` makes the destination's writable byte
    view, asked for only when a bulk of exactly ``nbytes`` comes; ``describe`` names what the
    destination holds, for the refusal of a bulk of another size (e.g. ``"torch.float32 with
    1024 elements"``).

    A bulk of another size within the read's limit is read aside into a scratch buffer and
    authenticated, so that the caller can name what was sent and the stream stays in step
    (`Frame.misfit`); a larger one is refused from the prefix, unread."""

    __slots__ = ("describe", "nbytes", "view")

    def __init__(
        self, nbytes: int, view: Callable[[], memoryview], describe: Callable[[], str]
    ) -> None:
        self.nbytes = nbytes
        self.view = view
        self.describe = describe

    def misfit(self, bulk_len: int) -> ProtocolError:
        """The refusal of a bulk of ``bulk_len`` bytes, which is not this destination's size."""
        return ProtocolError(
            f"sent {bulk_len} bulk bytes, expected {self.describe()} ({self.nbytes} bytes)"
        )


class ControlDue:
    """Placement of a read that expects a control message: a frame announcing bulk bytes is
    refused from its prefix and the peek at its kind, unread."""

    __slots__ = ()


CONTROL_DUE = ControlDue()

Placement = Scratch | Into | ControlDue

_BULK_NOT_EXPECTED = "sent a {} message with {} bulk bytes where a control message was expected"


class Need:
    """Bytes the reader needs before it can go on: write them into ``view`` and report how
    many with `FrameReader.filled` (``bulk`` false: ``view`` is the receive buffer's free
    tail) or `FrameReader.landed` (``bulk`` true: ``view`` is the rest of the bulk's
    destination). At least ``count`` more bytes are needed; ``view`` may take more only when
    it is the receive buffer."""

    __slots__ = ("bulk", "count", "view")

    def __init__(self, view: memoryview, count: int, bulk: bool) -> None:
        self.view = view
        self.count = count
        self.bulk = bulk


class Frame:
    """A whole frame read and, on an authenticated stream, its tag checked: nothing decoded.

    ``head`` is the item's bytes before its bulk (decode it with
    `paramsync.runtime.protocol.wire.decode_head` and ``bulk_len``), ``kind`` what the peek at the
    head found (None: the head does not open with ``"v"`` and a known kind), ``bulk`` where the bulk
    landed (the `Into` destination's view, or a scratch ``bytearray``; None without bulk).
    ``misfit``: the bulk is not the `Into` destination's size and was read aside (the caller refuses
    the frame once it has named what was sent). ``matched``: the frame is the read's ``expected``
    frame byte for byte (then ``head`` is empty). ``authenticated``: a tag was checked (False before
    the handshake has keyed the stream)."""

    __slots__ = ("authenticated", "bulk", "bulk_len", "head", "kind", "matched", "misfit")

    def __init__(
        self,
        head: bytes,
        bulk_len: int,
        kind: str | None,
        bulk: memoryview | bytearray | None,
        misfit: bool,
        matched: bool,
        authenticated: bool,
    ) -> None:
        self.head = head
        self.bulk_len = bulk_len
        self.kind = kind
        self.bulk = bulk
        self.misfit = misfit
        self.matched = matched
        self.authenticated = authenticated


_IDLE, _PREFIX, _MATCH, _PEEK, _HEAD, _BULK, _TRAILER = range(7)


class FrameReader:
    """The receiving side of one framed byte stream (see the module's docstring).

    Feed it bytes (`feed`, or write into `space` and call `filled`); begin each frame with
    `start`, then call `next` until it returns a `Frame`, supplying what each `Need` asks for.
    Set `opener` once the handshake has keyed the stream: from then on each frame is followed
    by its tag trailer, checked before the frame is returned."""

    def __init__(self, buffer_size: int = BUFFER_SIZE) -> None:
        if buffer_size < PREFIX_SIZE + PEEK_SIZE + TRAILER_SIZE:
            raise ValueError(f"a receive buffer of {buffer_size} bytes is too small")
        self._size = buffer_size
        self.buffer = bytearray(buffer_size)
        """The receive buffer (replaced when it grows for a long head and when it shrinks
        back): the unread bytes are ``buffer[start:end]``."""
        self._view = memoryview(self.buffer)
        self._start = 0
        self._end = 0
        self.opener: FrameOpener | None = None
        """Checks each frame's tag once set (None before the handshake: frames without one)."""
        self._state = _IDLE
        self._max_frame = 0
        self._placement: Placement = CONTROL_DUE
        self._expected: bytes | None = None
        self._direct_read = DIRECT_READ
        self._kinds: frozenset[str] | None = None
        self._prefix = b""
        self._head_len = 0
        self._bulk_len = 0
        self._kind: str | None = None
        self._head = b""
        self._landing: memoryview | bytearray | None = None
        self._got = 0
        self._misfit = False

    # ------------------------------------------------------------------ bytes in

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed."""
        return self._end - self._start

    def space(self, need: int = 1) -> memoryview:
        """The receive buffer's free tail, made room for so that at least ``need`` unread
        bytes fit in all (moving what is unread to the front, growing the buffer if need be).
        Write into it, then call `filled`."""
        self._make_room(need)
        return self._view[self._end :]

    def filled(self, count: int) -> None:
        """``count`` bytes were written at the start of the last `space` (or `Need.view` of a
        `Need` that is not ``bulk``)."""
        if not 0 <= count <= len(self.buffer) - self._end:
            raise ValueError(f"{count} bytes do not fit the receive buffer's free tail")
        self._end += count

    def feed(self, data: Buffer) -> None:
        """Append ``data`` to the receive buffer (a copy; the shells write in place)."""
        size = len(data)
        self.space(self.buffered + size)[:size] = data
        self._end += size

    def landed(self, count: int) -> None:
        """``count`` bulk bytes were written at the start of a ``bulk`` `Need`'s view."""
        if self._state != _BULK or not 0 <= count <= self._bulk_len - self._got:
            raise ValueError(f"{count} bulk bytes landed where none were asked for")
        self._got += count

    # ------------------------------------------------------------------ frames out

    def start(
        self,
        max_frame: int,
        placement: Placement,
        expected: bytes | None = None,
        direct_read: int = DIRECT_READ,
        kinds: frozenset[str] | None = None,
    ) -> None:
        """Begin reading the next frame: its head at most ``max_frame`` bytes, its bulk placed
        as ``placement`` says. ``expected``: the frame a control read expects (its encoding),
        recognised by its bytes. ``direct_read``: a bulk remainder shorter than this comes
        through the receive buffer (0: every bulk byte is asked for in place). ``kinds``: the
        only message kinds this read accepts (None: any); a frame of another kind is refused
        from its prefix and the peek at its kind, unread."""
        self._state = _PREFIX
        self._max_frame = max_frame
        self._placement = placement
        self._expected = expected
        self._direct_read = direct_read
        self._kinds = kinds

    def next(self) -> Need | Frame:
        """Go as far as the buffered bytes allow: the `Need` that stops the read, or the
        frame once whole (and authenticated). Raises `ProtocolError` (`FrameTooLarge`,
        `FrameAuthenticationError`) for a frame refused; nothing of it has been decoded."""
        state = self._state
        if state == _PREFIX:
            if self._end - self._start < PREFIX_SIZE:
                return self._need(PREFIX_SIZE)
            expected = self._expected
            start = self._start
            if (
                expected is not None
                and len(expected) > PREFIX_SIZE
                and self._view[start : start + PREFIX_SIZE] == expected[:PREFIX_SIZE]
            ):
                state = _MATCH  # the prefix says the frame is this long (then its trailer)
            else:
                state = self._parse_prefix()
        if state == _MATCH:
            expected = self._expected
            assert expected is not None
            size = len(expected)
            if self._end - self._start < size + self._trailer_size:
                self._state = _MATCH
                return self._need(size + self._trailer_size)
            if self._view[self._start : self._start + size] == expected:
                self._consume(size)
                self._verify((expected,))
                self._state = _IDLE
                return Frame(b"", 0, None, None, False, True, self.opener is not None)
            state = self._parse_prefix()
        if state == _PEEK:
            peek = min(self._head_len, PEEK_SIZE)
            if self._end - self._start < peek:
                self._state = _PEEK
                return self._need(peek)
            start = self._start
            peeked = self._view[start : start + peek]
            if self._kinds is not None:
                check_kind_accepted(peeked, self._kinds)
            self._kind = check_kind_size(peeked, self._head_len)
            if self._bulk_len:
                self._check_placement()
            state = _HEAD
        if state == _HEAD:
            head_len = self._head_len
            # a frame without bulk is buffered with its trailer: one read brings both
            trailer = TRAILER_SIZE if self._bulk_len == 0 and self.opener is not None else 0
            if self._end - self._start < head_len + trailer:
                self._state = _HEAD
                return self._need(head_len + trailer)
            self._head = self._take(head_len)
            if self._bulk_len == 0:
                self._landing = None
                state = _TRAILER
            else:
                self._landing = self._land_where()
                self._got = 0
                state = _BULK
        if state == _BULK:
            landing = self._landing
            assert landing is not None
            got, bulk_len = self._got, self._bulk_len
            buffered = self._end - self._start
            if buffered and got < bulk_len:
                count = min(buffered, bulk_len - got)
                landing[got : got + count] = self._view[self._start : self._start + count]
                self._consume(count)
                got = self._got = got + count
            if got < bulk_len:
                self._state = _BULK
                remaining = bulk_len - got
                if remaining < self._direct_read:
                    return self._need(remaining)
                return Need(memoryview(landing)[got:], remaining, True)
            state = _TRAILER
        if state == _TRAILER:
            if self.opener is not None:
                if self._end - self._start < TRAILER_SIZE:
                    self._state = _TRAILER
                    return self._need(TRAILER_SIZE)
                landing = self._landing
                parts = (
                    (self._prefix, self._head)
                    if landing is None
                    else (self._prefix, self._head, landing)
                )
                self._verify(parts)
            self._state = _IDLE
            frame = Frame(
                self._head,
                self._bulk_len,
                self._kind,
                self._landing,
                self._misfit,
                False,
                self.opener is not None,
            )
            self._head, self._landing = b"", None  # the frame's buffers go with the frame
            return frame
        raise RuntimeError("FrameReader.next called with no frame started (call start first)")

    # ------------------------------------------------------------------ the rules

    def _parse_prefix(self) -> int:
        """Rule 1: consume the prefix and apply its limits; the next state."""
        self._prefix = self._take(PREFIX_SIZE)
        item_len, bulk_len = parse_prefix(self._prefix, self._max_frame)
        self._head_len = item_len - bulk_len
        self._bulk_len = bulk_len
        self._misfit = False
        return _PEEK

    def _check_placement(self) -> None:
        """Rule 2, from the prefix and the peeked kind: where the announced bulk may land, if
        anywhere."""
        bulk_len, kind, placement = self._bulk_len, self._kind, self._placement
        if type(placement) is ControlDue:
            raise ProtocolError(_BULK_NOT_EXPECTED.format(kind or "frame", bulk_len))
        check_bulk_kind(kind, bulk_len)
        if type(placement) is Scratch:
            if not placement.limit:
                raise ProtocolError(
                    f"a {kind} message announces {bulk_len} bulk bytes on a link that takes no "
                    f"tensors"
                )
            if bulk_len > placement.limit:
                raise FrameTooLarge(
                    f"{kind or 'frame'} message carries {bulk_len} bulk bytes, more than this "
                    f"receiver's limit of {placement.limit}"
                )
        elif type(placement) is Into and bulk_len != placement.nbytes:
            if bulk_len > self._max_frame:
                raise placement.misfit(bulk_len)  # from the prefix, unread
            self._misfit = True  # read aside and verified, then refused by the caller

    def _land_where(self) -> memoryview | bytearray:
        """Rule 3: the buffer this frame's bulk lands in."""
        placement = self._placement
        if type(placement) is Into and not self._misfit:
            view = placement.view()
            if len(view) != self._bulk_len:
                raise ValueError(
                    f"the destination's view holds {len(view)} bytes, not the "
                    f"{placement.nbytes} it was declared with"
                )
            return view
        return bytearray(self._bulk_len)

    def _verify(self, parts: tuple[Buffer, ...]) -> None:
        """Rule 4: check the buffered trailer against the frame made of ``parts``."""
        if self.opener is not None:
            self.opener.open(parts, self._take(TRAILER_SIZE))

    # ------------------------------------------------------------------ the buffer

    @property
    def _trailer_size(self) -> int:
        return 0 if self.opener is None else TRAILER_SIZE

    def _need(self, unread: int) -> Need:
        """A `Need` for ``unread`` buffered bytes in all."""
        self._make_room(unread)
        return Need(self._view[self._end :], unread - (self._end - self._start), False)

    def _make_room(self, need: int) -> None:
        """Move unread bytes to the buffer's front (growing it) so ``need`` bytes fit."""
        if self._end - self._start >= need or need <= len(self.buffer) - self._start:
            return
        pending = self.buffer[self._start : self._end]
        if need > len(self.buffer):
            self.buffer = bytearray(max(need, self._size))
            self._view = memoryview(self.buffer)
        self.buffer[: len(pending)] = pending
        self._start, self._end = 0, len(pending)

    def _consume(self, count: int) -> None:
        """Drop ``count`` buffered bytes. A buffer that grew for a long head goes back to its
        usual size once empty, so a peer's memory here stays bounded between frames."""
        self._start += count
        if self._start == self._end:
            self._start = self._end = 0
            if len(self.buffer) > self._size:
                self.buffer = bytearray(self._size)
                self._view = memoryview(self.buffer)

    def _take(self, count: int) -> bytes:
        """Consume ``count`` buffered bytes, returned as a copy (`_consume`, inlined: this runs
        three times a frame)."""
        start = self._start
        data = bytes(self._view[start : start + count])
        self._start = start = start + count
        if start == self._end:
            self._start = self._end = 0
            if len(self.buffer) > self._size:
                self.buffer = bytearray(self._size)
                self._view = memoryview(self.buffer)
        return data
