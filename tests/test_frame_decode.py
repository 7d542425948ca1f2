"""Nothing of a frame is decoded before its tag checks out; every limit comes from the prefix
(and a peek at the kind); long decodes leave the event loop; a peer's receive memory is
bounded: issue 31 row 2.

An on-path relay without the secret (`paramsync.runtime.testing.relay`) alters frames on the way;
the receiver's `decode_head` is watched, so a test sees whether an unverified head was decoded.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import cbor2
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from paramsync.runtime.collectives import p2p
from paramsync.runtime.errors import FrameAuthenticationError, FrameTooLarge, ProtocolError
from paramsync.runtime.protocol import limits, wire
from paramsync.runtime.protocol.limits import kind_max_frame
from paramsync.runtime.testing.relay import TO_LISTENER, Attack, RelayedFrame, relayed_pair
from paramsync.runtime.transport import tcp
from paramsync.runtime.transport.tcp import TcpTransport

SECRET = b"decode-test-secret-0123456789"
SECONDS = 30


@contextmanager
def watched_decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every `decode_head` the TCP transport makes (the thread it ran on)."""
    calls: list[str] = []
    real = wire.decode_head

    def decode_head(head: Any, bulk_len: int, **options: Any) -> Any:
        calls.append(threading.current_thread().name)
        return real(head, bulk_len, **options)

    monkeypatch.setattr(tcp, "decode_head", decode_head)
    yield calls


class FlipTag(Attack):
    """Replace the tag of the ``nth`` frame of ``direction`` by random bytes (what a relay
    without the secret sends as its own frame)."""

    def __init__(self, direction: str, nth: int = 0, where: str = "tag", offset: int = 0):
        super().__init__()
        self.direction, self.nth, self.where, self.offset = direction, nth, where, offset

    def __call__(self, frame: RelayedFrame) -> list[bytes]:
        if frame.direction != self.direction or frame.index != self.nth:
            return [frame.raw]
        self.done = True
        if self.where == "tag":
            trailer = bytearray(frame.trailer)
            trailer[1 + self.offset % 16] ^= 0x01
            return [frame.prefix + frame.item + bytes(trailer)]
        item = bytearray(frame.item)
        head_len = len(item) - frame.bulk_len
        if self.where == "head":
            item[self.offset % head_len] ^= 0x01
        else:
            item[head_len + self.offset % frame.bulk_len] ^= 0x01
        return [frame.prefix + bytes(item) + frame.trailer]


async def _pair(
    attack: Attack,
    receive: Callable[[TcpTransport], Awaitable[Any]],
    send: Callable[[TcpTransport], Awaitable[Any]],
    decodes: list[str] | None = None,
) -> tuple[BaseException | None, Any]:
    """Rank 1 sends through the relay, rank 0 receives: (rank 0's error, what it got).
    ``decodes`` is emptied once the handshakes (whose frames are decoded) are over."""
    result: list[Any] = [None, None]
    with trio.fail_after(SECONDS):
        async with relayed_pair(SECRET, attack) as (rank0, rank1):
            if decodes is not None:
                decodes.clear()

            async def receiver() -> None:
                try:
                    result[1] = await receive(rank0)
                except ProtocolError as exc:
                    result[0] = exc
                    rank0.abort()

            async def sender() -> None:
                try:
                    await send(rank1)
                except ProtocolError:
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                nursery.start_soon(sender)
    return result[0], result[1]


# --------------------------------------------------------------------------- tag first


async def _recv_blocking(transport: TcpTransport, out: torch.Tensor) -> Any:
    async with transport.blocking_links({1}) as links:
        return await trio.to_thread.run_sync(links.recv_into, 1, out)


RECEIVERS: dict[str, Callable[[TcpTransport, torch.Tensor], Awaitable[Any]]] = {
    "recv": lambda t, out: t.recv(1),
    "recv_into": lambda t, out: t.recv_into(1, out),
    "recv_routed": lambda t, out: t.recv_routed(1, lambda *_: out),
    "recv_into_blocking": _recv_blocking,
    "p2p": lambda t, out: p2p.recv(t, out, 1, tag=0),
}


@pytest.mark.parametrize("path", sorted(RECEIVERS))
async def test_a_bulk_frame_with_a_forged_tag_is_refused_before_its_head_is_decoded(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's relay: a bulk frame whose tag is random. Today its head is decoded (and
    torch imported, the destination chosen) before the tag fails."""
    out = torch.zeros(4096)
    attack = FlipTag(TO_LISTENER, nth=0, where="tag", offset=3)
    with watched_decodes(monkeypatch) as decodes:
        error, _ = await _pair(
            attack,
            lambda t: RECEIVERS[path](t, out),
            lambda t: p2p.send(t, torch.ones(4096), 0, tag=0),
            decodes,
        )
    assert attack.done
    assert isinstance(error, FrameAuthenticationError), repr(error)
    assert decodes == [], "a head was decoded before its frame's tag checked out"


async def test_a_bulk_frame_where_a_control_message_is_due_is_refused_undecoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`recv_matching_polled` (a step signal expected) meets a bulk frame: refused from its
    prefix, nothing decoded. Today its head is decoded first."""

    async def receive(transport: TcpTransport) -> Any:
        async with transport.polled_links({1}) as links:
            deadline = time.monotonic() + SECONDS
            return await trio.to_thread.run_sync(links.recv_matching, 1, b"\0" * 20, deadline)

    with watched_decodes(monkeypatch) as decodes:
        coll = {"op": 0, "hop": 0, "part": 0}
        error, _ = await _pair(
            Attack(), receive, lambda t: t.send(0, "coll", coll, torch.ones(8)), decodes
        )
    assert isinstance(error, ProtocolError) and "32 bulk bytes" in str(error), repr(error)
    assert decodes == []


async def test_a_bulk_announced_by_a_kind_that_carries_none_is_refused_from_the_peek(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``refuse`` frame (authenticated) announcing 1 MiB of bulk: refused before any bulk
    byte is read or allocated and before its head is decoded."""
    body = cbor2.dumps({"v": 2, "kind": "refuse", "reason": "x"})
    bulk = 1 << 20
    frame = struct.pack(">II", len(body) + bulk, bulk) + body + bytes(bulk)
    with watched_decodes(monkeypatch) as decodes:
        error, _ = await _pair(
            Attack(), lambda t: t.recv(1), lambda t: t.send_frame(0, frame), decodes
        )
    assert isinstance(error, ProtocolError), repr(error)
    assert "refuse frame announces 1048576 bulk bytes; its kind carries none" in str(error)
    assert decodes == []


# --------------------------------------------------------------------------- caps


def test_kinds_whose_tensor_is_their_bulk_have_control_sized_head_caps() -> None:
    """Today coll, p2p, state and probe_data heads may be 64 MiB (an inline tensor)."""
    assert getattr(limits, "BULK_KINDS", None) == {"coll", "p2p", "state", "probe_data"}
    for kind in ("coll", "p2p", "state", "probe_data"):
        assert kind_max_frame(kind) == 16 * 1024, kind


async def test_a_large_inline_coll_is_refused_from_its_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's 60 MiB inline ``coll`` with the secret (here 1 MiB): refused from the
    prefix and the peeked kind, undecoded. Today it is decoded on the event loop."""
    fields = {"op": 0, "hop": 0, "part": 0, "data": torch.zeros(1 << 18)}
    with watched_decodes(monkeypatch) as decodes:
        error, _ = await _pair(
            Attack(), lambda t: t.recv(1), lambda t: t.send(0, "coll", fields), decodes
        )
    assert isinstance(error, FrameTooLarge), repr(error)
    assert "coll frame of" in str(error) and "16384-byte cap" in str(error)
    assert decodes == []


# --------------------------------------------------------------------------- the loop, memory


async def test_a_long_head_is_decoded_off_the_event_loop_and_its_buffer_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 200 KiB ``state_manifest`` head is decoded on a worker thread, and the receive
    buffer that grew for it returns to its usual size (today it keeps the largest head)."""
    manifest = {"names": ["t" * 100] * 2000}
    main = threading.current_thread().name
    with watched_decodes(monkeypatch) as decodes:
        async with TcpTransport.open_group(2) as (t0, t1):
            decodes.clear()  # the handshakes'
            with trio.fail_after(SECONDS):
                await t1.send(0, "state_manifest", {"manifest": manifest})
                message = await t0.recv(1)
            assert message["manifest"] == manifest
            assert len(t0.connections[1]._buf) == tcp._BUFFER_SIZE
    assert decodes and all(name != main for name in decodes), decodes


# --------------------------------------------------------------------------- property


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    path=st.sampled_from(sorted(RECEIVERS)),
    where=st.sampled_from(["none", "tag", "head", "bulk"]),
    offset=st.integers(0, 1 << 16),
)
def test_no_unverified_frame_is_decoded_or_lands_in_a_kept_destination(
    monkeypatch: pytest.MonkeyPatch, path: str, where: str, offset: int
) -> None:
    """Authenticated frames, and frames with a random byte of their tag, head or bulk
    altered, on every TCP read path: an altered frame is refused with nothing of it decoded,
    and a kept destination (a posted receive, `recv_routed`) unchanged; an authentic one
    arrives whole."""
    note(f"{path} {where} {offset}")
    out = torch.zeros(1024)
    sent = torch.arange(1024, dtype=torch.float32)
    attack = Attack() if where == "none" else FlipTag(TO_LISTENER, 0, where, offset)
    with watched_decodes(monkeypatch) as decodes:
        error, got = trio.run(
            _pair,
            attack,
            lambda t: RECEIVERS[path](t, out),
            lambda t: p2p.send(t, sent, 0, tag=0),
            decodes,
        )
    if where == "none":
        assert error is None, repr(error)
        data = got if path == "p2p" else got["data"]
        assert torch.equal(data, sent)
        return
    assert attack.done
    assert isinstance(error, ProtocolError), repr(error)  # the tag, or a limit from the peek
    assert decodes == []
    if path in ("p2p", "recv_routed"):
        assert torch.equal(out, torch.zeros(1024))


async def test_a_refused_bulk_is_not_kept_by_the_connection() -> None:
    """The connection remembers why it refused a frame (for its worker threads), but not the
    refused frame's buffers: the remembered error carries no traceback (whose frames hold the
    bulk read aside), so a 4 MiB forged bulk is freed with the receive."""
    attack = FlipTag(TO_LISTENER, nth=0, where="tag")
    with trio.fail_after(SECONDS):
        async with relayed_pair(SECRET, attack) as (rank0, rank1):
            await rank1.send(0, "p2p", {"tag": 0}, torch.zeros(1 << 20))
            with pytest.raises(FrameAuthenticationError):
                await rank0.recv(1)
            refusal = rank0.connections[1]._refusal
            assert refusal is not None and refusal.__traceback__ is None


def test_a_decoded_map_is_checked_once_and_again_after_any_change() -> None:
    """`decode_item` checks a frame's fields once; the message is built from that check, and
    a map changed afterwards (any way a dict changes) is checked again when decoded."""
    from paramsync.runtime.protocol.messages import StepDone, event_from_wire
    from paramsync.runtime.protocol.schema import CheckedItem

    frame = wire.encode_frame_bytes(*StepDone(0, 5, 2).to_wire())
    item = wire.decode_frame(frame)
    assert type(item) is CheckedItem and dict(item) == cbor2.loads(frame[wire.PREFIX_SIZE :])
    assert event_from_wire(item, rank=3, now=0.0) == StepDone(3, 5, 2)
    changes: list[Callable[[dict[str, Any]], Any]] = [
        lambda m: m.__setitem__("step", -1),
        lambda m: m.update(step="five"),
        lambda m: m.__ior__({"step": 2**70}),
        lambda m: m.setdefault("cached", 7),
        lambda m: m.pop("step"),
        lambda m: m.__delitem__("epoch") or m.__setitem__("epoch", "x"),
    ]
    for change in changes:
        changed = wire.decode_frame(frame)
        change(changed)
        with pytest.raises(ProtocolError, match="step_done message"):
            event_from_wire(changed, rank=3, now=0.0)
