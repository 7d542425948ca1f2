"""The sans-I/O frame reader (`paramsync.runtime.protocol.frame_reader`): every read rule of every
TCP mode, fed bytes.

A hypothesis state machine writes authenticated frames (control messages, bulk tensors of
every size, empty tensors inline), delivers the stream split at random points (through the
receive buffer or straight into a bulk's destination, as a socket would), reads each frame with
a placement of its own (a scratch buffer, the caller's destination or one of another size, a
control read that expects the frame byte for byte or another one) and flips random bits of what
is not delivered yet. An untouched stream yields exactly the frames the writer wrote; a frame
with a flipped bit is never handed back (the reader never decodes, so nothing of it is decoded)
and is refused at the latest once a bounded number of further bytes arrive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paramsync.runtime.errors import FrameAuthenticationError, FrameTooLarge, ProtocolError
from paramsync.runtime.protocol.frame_auth import FrameOpener, FrameSealer
from paramsync.runtime.protocol.frame_reader import (
    BUFFER_SIZE,
    CONTROL_DUE,
    Frame,
    FrameReader,
    Into,
    Need,
    Placement,
    Scratch,
)
from paramsync.runtime.protocol.limits import PEEK_SIZE
from paramsync.runtime.protocol.wire import (
    PREFIX_SIZE,
    TRAILER_SIZE,
    decode_head,
    encode_frame,
    encode_frame_bytes,
)

MAX_FRAME = 16 * 1024
SCRATCH_LIMIT = 8 * 1024
REFUSED_WITHIN = MAX_FRAME + max(SCRATCH_LIMIT, MAX_FRAME) + TRAILER_SIZE + PREFIX_SIZE
"""Bytes after a frame's first byte by which a frame with a flipped bit is refused at the
latest: its head is at most the limit, a bulk read aside at most the limit too (a scratch
buffer at most its own), then the trailer."""

OTHER_SIGNAL = encode_frame_bytes("refuse", {"reason": "not this one"})


def _into(dest: bytearray) -> Into:
    return Into(len(dest), lambda: memoryview(dest), lambda: f"{len(dest)} bytes")


@dataclass
class Written:
    """One frame as the writer put it on the stream."""

    start: int  # offset of its first byte in the stream
    end: int  # offset after its trailer
    raw: bytes  # prefix and item, without the trailer
    head: bytes
    bulk: bytes
    placement: Placement
    expected: bytes | None
    refusal: str | None  # a read rule refuses it though it is intact (a bulk where none is due)
    dest: bytearray | None


def _message(kind: str, fields: dict[str, Any], bulk: torch.Tensor | None) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(kind, fields, bulk))


FRAMES = st.one_of(
    st.builds(
        lambda host, port: ("rdv_join", {"host": host, "port": port}, None),
        st.text("abcdefghij.0123456789", min_size=1, max_size=40),
        st.integers(1, 65535),
    ),
    st.builds(lambda reason: ("refuse", {"reason": reason}, None), st.text(max_size=300)),
    st.builds(
        lambda op, n: (
            "coll",
            {"op": op, "hop": 0, "part": 0},
            torch.arange(n, dtype=torch.float32),
        ),
        st.integers(0, 1 << 30),
        st.integers(0, 600),
    ),
    st.builds(
        lambda tag, n: ("p2p", {"tag": tag}, torch.full((n,), 7, dtype=torch.int8)),
        st.integers(0, 1 << 40),
        st.integers(0, 3000),
    ),
)


class FrameStreamMachine(RuleBasedStateMachine):
    """One direction of an authenticated connection: the writer's sealer, the bytes on the
    way, the reader."""

    @initialize(
        key=st.binary(min_size=32, max_size=32),
        buffer_size=st.sampled_from([PREFIX_SIZE + PEEK_SIZE + TRAILER_SIZE, 300, BUFFER_SIZE]),
        direct_read=st.sampled_from([0, 100, 64 * 1024]),
    )
    def connect(self, key: bytes, buffer_size: int, direct_read: int) -> None:
        self.key, self.buffer_size, self.direct_read = key, buffer_size, direct_read
        self.sealer = FrameSealer(key)
        self.reader = FrameReader(buffer_size)
        self.reader.opener = FrameOpener(key)
        self.wire = bytearray()  # written, not yet delivered
        self.delivered = 0  # stream offset of wire[0]
        self.written = 0  # stream offset after the last frame written
        self.pending: deque[Written] = deque()  # written, not yet read back
        self.reading = False  # the head of `pending` is started on the reader
        self.need: Need | None = None
        self.flips: dict[int, int] = {}  # stream offset -> the bits flipped there
        self.refused: ProtocolError | None = None
        self.frames_read = 0

    # ---------------------------------------------------------------- the writer

    @precondition(lambda self: self.refused is None)
    @rule(frame=FRAMES, how=st.integers(0, 3), delta=st.integers(1, 64))
    def write(
        self, frame: tuple[str, dict[str, Any], torch.Tensor | None], how: int, delta: int
    ) -> None:
        kind, fields, bulk = frame
        raw = _message(kind, fields, bulk)
        item_len, bulk_len = int.from_bytes(raw[0:4], "big"), int.from_bytes(raw[4:8], "big")
        head = raw[PREFIX_SIZE : PREFIX_SIZE + item_len - bulk_len]
        bulk_bytes = raw[PREFIX_SIZE + item_len - bulk_len :]
        trailer = self.sealer.seal((raw,))
        limit = SCRATCH_LIMIT if delta % 3 else max(0, bulk_len - delta)
        placement: Placement = Scratch(limit)
        expected, refusal, dest = None, None, None
        if bulk_len:
            if how == 1:
                dest = bytearray(bulk_len)
                placement = _into(dest)
            elif how == 2:
                dest = bytearray(bulk_len + delta if delta % 2 else max(0, bulk_len - delta))
                placement = _into(dest)
            elif how == 3:  # a control message was due
                placement = CONTROL_DUE
                refusal = "where a control message was expected"
            elif limit == 0:  # a scratch of no bytes: a link that takes no tensors
                refusal = "on a link that takes no tensors"
            elif bulk_len > limit:
                refusal = "more than this receiver's limit"
        else:
            if how == 1:
                placement, expected = CONTROL_DUE, raw
            elif how == 2:  # another signal, or one that differs from this frame in one byte
                near = bytearray(raw)
                near[-1 - delta // 2 % len(raw) if delta % 2 else delta % len(raw)] ^= 0x40
                placement, expected = CONTROL_DUE, OTHER_SIGNAL if delta % 5 == 0 else bytes(near)
            elif how == 3:
                dest = bytearray(delta)
                placement = _into(dest)
        start = self.written
        self.wire += raw + trailer
        self.written += len(raw) + len(trailer)
        self.pending.append(
            Written(start, self.written, raw, head, bulk_bytes, placement, expected, refusal, dest)
        )
        self._pump()

    @precondition(lambda self: self.refused is None and len(self.wire) > 0)
    @rule(where=st.integers(0, 1 << 30), bit=st.integers(0, 7))
    def flip(self, where: int, bit: int) -> None:
        """Flip one bit of the bytes still on the way."""
        position = where % len(self.wire)
        self.wire[position] ^= 1 << bit
        offset = self.delivered + position
        self.flips[offset] = self.flips.get(offset, 0) ^ (1 << bit)
        if not self.flips[offset]:  # flipped back
            del self.flips[offset]

    @property
    def flipped(self) -> int | None:
        """Stream offset of the first byte that differs from what the writer wrote."""
        return min(self.flips) if self.flips else None

    # ---------------------------------------------------------------- the way

    @precondition(lambda self: self.refused is None and len(self.wire) > 0)
    @rule(size=st.integers(1, 5000), in_place=st.booleans())
    def deliver(self, size: int, in_place: bool) -> None:
        """Deliver the next ``size`` bytes: into the bulk's destination when the reader asked
        for them there (``in_place``), else into its receive buffer."""
        chunk = bytes(self.wire[:size])
        del self.wire[:size]
        self.delivered += len(chunk)
        self._receive(chunk, in_place)
        self._pump()

    @precondition(lambda self: self.refused is None and self.flipped is not None)
    @rule()
    def deliver_all_then_garbage(self) -> None:
        """Everything left, then up to `REFUSED_WITHIN` bytes of garbage: a frame with a
        flipped bit is refused by then."""
        assert self.flipped is not None
        chunk = bytes(self.wire)
        self.wire.clear()
        self.delivered += len(chunk)
        self._receive(chunk, True)
        self._pump()
        garbage = 0
        while self.refused is None and garbage < REFUSED_WITHIN:
            self._receive(bytes(512), False)
            garbage += 512
            self._pump()
        assert self.refused is not None, "a frame with a flipped bit was never refused"
        assert isinstance(self.refused, ProtocolError)

    @precondition(lambda self: self.refused is not None)
    @rule(key=st.binary(min_size=32, max_size=32))
    def reconnect(self, key: bytes) -> None:
        """The refused connection is closed; a new handshake gives a new key."""
        self.connect(key, self.buffer_size, self.direct_read)

    def _receive(self, chunk: bytes, in_place: bool) -> None:
        need = self.need
        if in_place and need is not None and need.bulk and chunk:
            count = min(len(need.view), len(chunk))
            need.view[:count] = chunk[:count]
            self.reader.landed(count)
            chunk = chunk[count:]
            self.need = None
        if chunk:
            self.reader.feed(chunk)

    # ---------------------------------------------------------------- the reader

    def _pump(self) -> None:
        """Read frames as far as the delivered bytes allow."""
        while self.pending and self.refused is None:
            frame = self.pending[0]
            if not self.reading:
                self.reader.start(MAX_FRAME, frame.placement, frame.expected, self.direct_read)
                self.reading = True
            try:
                step = self.reader.next()
            except ProtocolError as exc:
                self._refused(frame, exc)
                return
            if isinstance(step, Need):
                assert step.count > 0
                self.need = step
                return
            self._check(frame, step)
            self.pending.popleft()
            self.reading, self.need = False, None
            self.frames_read += 1

    def _refused(self, frame: Written, exc: ProtocolError) -> None:
        self.refused = exc
        if self.flipped is not None and frame.start <= self.flipped < frame.end:
            return  # refused for the flip (a tag, or a limit from a flipped prefix or kind)
        assert frame.refusal is not None and frame.refusal in str(exc), repr(exc)
        assert not isinstance(exc, FrameAuthenticationError)

    def _check(self, frame: Written, got: Frame) -> None:
        """A frame handed back is the frame written, whole, and authenticated."""
        assert self.flipped is None or self.flipped >= frame.end, "a flipped frame came back"
        assert frame.refusal is None, f"not refused: {frame.refusal}"
        assert got.authenticated
        if got.matched:
            assert frame.expected == frame.raw
            return
        assert frame.expected is None or frame.expected != frame.raw
        assert got.head == frame.head
        assert got.bulk_len == len(frame.bulk)
        if not frame.bulk:
            assert got.bulk is None
        else:
            assert got.bulk is not None and bytes(got.bulk) == frame.bulk
            fits = frame.dest is not None and len(frame.dest) == len(frame.bulk)
            assert got.misfit == (frame.dest is not None and not fits)
            if fits:
                assert frame.dest == frame.bulk  # landed in place
        message, spec = decode_head(got.head, got.bulk_len)
        if spec is not None:
            assert spec.nbytes == len(frame.bulk)
        assert message["kind"] == got.kind

    @invariant()
    def an_untouched_stream_is_read_to_its_end(self) -> None:
        if self.flipped is None and self.refused is None and not self.wire:
            assert not self.pending, f"{len(self.pending)} frames delivered whole, not read"

    @invariant()
    def the_buffer_is_its_size_between_frames_when_empty(self) -> None:
        if not self.reading and self.reader.buffered == 0:
            assert len(self.reader.buffer) == self.buffer_size


FrameStreamMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestFrameStream = FrameStreamMachine.TestCase


# --------------------------------------------------------------------------- rules one by one


def _read(
    data: bytes,
    placement: Placement,
    *,
    max_frame: int = MAX_FRAME,
    opener: FrameOpener | None = None,
) -> Frame | Need:
    reader = FrameReader()
    reader.opener = opener
    reader.feed(data)
    reader.start(max_frame, placement)
    return reader.next()


def test_an_unauthenticated_stream_split_at_every_point_yields_its_frames() -> None:
    """Before the handshake has keyed the stream, frames have no trailer."""
    frames = [
        encode_frame_bytes("rdv_join", {"host": "10.0.0.2", "port": 29500}),
        encode_frame_bytes("p2p", {"tag": 3}, torch.arange(5, dtype=torch.int16)),
        encode_frame_bytes("refuse", {"reason": "x" * 100}),
    ]
    stream = b"".join(frames)
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        reader.feed(stream[:cut])
        rest, got = stream[cut:], []
        for _ in frames:
            reader.start(MAX_FRAME, Scratch(MAX_FRAME))
            while isinstance(step := reader.next(), Need):
                assert rest, f"cut {cut}: stuck with the whole stream delivered"
                reader.feed(rest[:7])
                rest = rest[7:]
            got.append(step)
        assert not rest and reader.buffered == 0
        assert [frame.authenticated for frame in got] == [False] * 3
        assert [frame.head + bytes(frame.bulk or b"") for frame in got] == [
            frame[PREFIX_SIZE:] for frame in frames
        ]


@pytest.mark.parametrize(
    ("prefix", "error", "words"),
    [
        ((0, 0), ProtocolError, "empty CBOR item"),
        ((10, 11), ProtocolError, "11 bulk bytes in a 10-byte item"),
        ((MAX_FRAME + 1, 0), FrameTooLarge, f"limit of {MAX_FRAME}"),
    ],
)
def test_a_bad_prefix_is_refused_from_its_eight_bytes(
    prefix: tuple[int, int], error: type[Exception], words: str
) -> None:
    data = prefix[0].to_bytes(4, "big") + prefix[1].to_bytes(4, "big")
    with pytest.raises(error, match=words):
        _read(data, Scratch(MAX_FRAME))


def _bulk_frame_start(kind: str, fields: dict[str, Any], bulk: torch.Tensor) -> bytes:
    """A bulk frame's prefix and the head's first `PEEK_SIZE` bytes: all a refusal from the
    prefix and the peek may see."""
    return encode_frame_bytes(kind, fields, bulk)[: PREFIX_SIZE + PEEK_SIZE]


def test_limits_from_the_prefix_and_the_peek_need_nothing_more() -> None:
    """Every refusal that comes before the head is read needs only the prefix and the peek."""
    coll = _bulk_frame_start("coll", {"op": 1, "hop": 0, "part": 0}, torch.zeros(4096))
    with pytest.raises(FrameTooLarge, match="coll message carries 16384 bulk bytes, more than"):
        _read(coll, Scratch(16383))
    with pytest.raises(ProtocolError, match="sent a coll message with 16384 bulk bytes where"):
        _read(coll, CONTROL_DUE)
    with pytest.raises(ProtocolError, match=r"sent 16384 bulk bytes, expected 8 bytes \(8 bytes\)"):
        _read(coll, _into(bytearray(8)), max_frame=1024)  # larger than the limit: unread
    body = b"\xa3av\x03dkindfrefusefreasonax"
    refuse = (len(body) + 64).to_bytes(4, "big") + (64).to_bytes(4, "big") + body
    with pytest.raises(ProtocolError, match="refuse frame announces 64 bulk bytes; its kind"):
        _read(refuse, Scratch(MAX_FRAME))
    heartbeat = (20000).to_bytes(4, "big") + bytes(4) + b"\xa2av\x03dkindiheartbeat" + bytes(32)
    with pytest.raises(FrameTooLarge, match="heartbeat frame of 20000 bytes exceeds the 16384"):
        _read(heartbeat, Scratch(MAX_FRAME), max_frame=1 << 20)


def test_a_bulk_of_another_size_within_the_limit_is_read_aside_and_authenticated() -> None:
    key = bytes(range(32))
    raw = encode_frame_bytes("p2p", {"tag": 1}, torch.ones(10))
    frame = raw + FrameSealer(key).seal((raw,))
    dest = bytearray(12)
    got = _read(frame, _into(dest), opener=FrameOpener(key))
    assert isinstance(got, Frame) and got.misfit and got.authenticated
    assert bytes(got.bulk or b"") == bytes(torch.ones(10).numpy().tobytes())
    assert dest == bytearray(12)  # the destination kept nothing of it


def test_a_forged_tag_is_refused_and_the_frame_never_returned() -> None:
    key = bytes(range(32))
    raw = encode_frame_bytes("rdv_join", {"host": "h", "port": 1})
    trailer = bytearray(FrameSealer(key).seal((raw,)))
    trailer[5] ^= 0x10
    with pytest.raises(FrameAuthenticationError, match="frame authentication failed on frame 0"):
        _read(raw + bytes(trailer), Scratch(MAX_FRAME), opener=FrameOpener(key))


def test_the_receive_buffer_grows_for_a_long_head_and_shrinks_back() -> None:
    raw = encode_frame_bytes("refuse", {"reason": "r" * 1000})
    reader = FrameReader(PREFIX_SIZE + PEEK_SIZE + TRAILER_SIZE)
    reader.feed(raw)
    assert len(reader.buffer) >= len(raw)
    reader.start(MAX_FRAME, Scratch(MAX_FRAME))
    assert isinstance(reader.next(), Frame)
    assert len(reader.buffer) == PREFIX_SIZE + PEEK_SIZE + TRAILER_SIZE


def test_bulk_bytes_reported_where_none_were_asked_for_are_refused() -> None:
    reader = FrameReader()
    with pytest.raises(ValueError, match="landed where none were asked for"):
        reader.landed(1)
    with pytest.raises(RuntimeError, match="no frame started"):
        reader.next()
