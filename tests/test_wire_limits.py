"""Issue 18, rows 4 and 10, against the frame decoder: bounded decoding before the schema check
(a per-kind frame cap and a bound on decoded items) and an allow-list of decoded types."""

from __future__ import annotations

import ipaddress
import struct
import time
import tracemalloc

import cbor2
import pytest
import torch

from paramsync.runtime.errors import FrameTooLarge, ProtocolError
from paramsync.runtime.protocol.wire import PROTOCOL_VERSION, decode_frame, encode_frame_bytes

MIB = 1024 * 1024


def framed(body: bytes) -> bytes:
    return struct.pack(">II", len(body), 0) + body


def join_of_empty_arrays(size: int) -> bytes:
    """A `join` whose ``params`` is one array of ``size`` empty arrays (row 4's attack)."""
    head = b"\xa3\x61v\x02\x64kind\x64join\x66params\x9a" + size.to_bytes(4, "big")
    return framed(head + b"\x80" * size)


def join_of_nested_arrays(size: int) -> bytes:
    """The same bytes as arrays of 255 empty arrays, so no single length announces it."""
    inner = b"\x98\xff" + b"\x80" * 255
    count = size // len(inner)
    head = b"\xa3\x61v\x02\x64kind\x64join\x66params\x9a" + count.to_bytes(4, "big")
    return framed(head + inner * count)


def refused_cheaply(frame: bytes, seconds: float) -> ProtocolError:
    """Refused within ``seconds`` (timed untraced) allocating under 4 MiB (traced run)."""
    start = time.perf_counter()
    with pytest.raises(ProtocolError) as info:
        decode_frame(frame)
    elapsed = time.perf_counter() - start
    assert elapsed < seconds, f"refused after {elapsed:.3f} s"
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode_frame(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB, f"allocated {peak / MIB:.1f} MiB before refusing"
    return info.value


def test_a_16_mib_join_of_empty_arrays_is_refused_fast_and_small() -> None:
    error = refused_cheaply(join_of_empty_arrays(16 * MIB), 0.05)
    assert "CBOR data items" in str(error), error


def test_a_16_mib_join_of_nested_empty_arrays_is_refused_fast_and_small() -> None:
    error = refused_cheaply(join_of_nested_arrays(16 * MIB), 0.5)
    assert "more than 262144 CBOR data items" in str(error), error


def test_a_control_kind_has_a_small_frame_cap() -> None:
    body = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "heartbeat", "pad": b"\x00" * (1 * MIB)})
    with pytest.raises(FrameTooLarge, match=r"heartbeat frame of .* exceeds the 16384-byte cap"):
        decode_frame(framed(body))


def test_a_frame_not_led_by_v_and_kind_is_held_to_the_control_cap() -> None:
    body = cbor2.dumps({"kind": "join", "v": PROTOCOL_VERSION, "params": [[]] * (1 * MIB)})
    with pytest.raises(FrameTooLarge, match=r"not led by 'v' and a known 'kind' of \d+ bytes"):
        decode_frame(framed(body))
    with pytest.raises(ProtocolError, match="version"):  # small: the decoder names the problem
        decode_frame(framed(cbor2.dumps({"kind": "heartbeat", "v": PROTOCOL_VERSION + 1})))


@pytest.mark.parametrize(
    "value",
    [
        ipaddress.ip_address("10.0.0.1"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_network("10.0.0.0/24"),
        cbor2.CBORTag(52, b"\x0a\x00\x00\x01"),
        cbor2.CBORTag(54, b"\x00" * 16),
    ],
)
def test_a_state_manifest_carrying_ip_address_tags_is_refused_naming_the_tag(value: object) -> None:
    body = cbor2.dumps(
        {"v": PROTOCOL_VERSION, "kind": "state_manifest", "manifest": {"host": value}}
    )
    with pytest.raises(ProtocolError, match=r"CBOR tag 5[24] is not part of the paramsync"):
        decode_frame(framed(body))


def test_a_tag_refusal_keeps_its_own_reason_not_cbor2s_wrapper() -> None:
    inner = cbor2.CBORTag(40, [[1], cbor2.CBORTag(999, b"")])
    body = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "state_manifest", "manifest": {"t": inner}})
    with pytest.raises(ProtocolError) as info:
        decode_frame(framed(body))
    assert str(info.value) == "CBOR tag 999 is not part of the paramsync protocol"
    assert "error decoding" not in str(info.value)


def test_undefined_and_other_simple_values_are_refused_by_the_type_allow_list() -> None:
    body = cbor2.dumps(
        {"v": PROTOCOL_VERSION, "kind": "state_manifest", "manifest": {"x": cbor2.undefined}}
    )
    with pytest.raises(ProtocolError, match="of type UndefinedType is refused"):
        decode_frame(framed(body))


def test_real_frames_still_decode() -> None:
    manifest = {"tensors": [["w", [2, 2], "float32"]], "step": 3}
    assert decode_frame(encode_frame_bytes("state_manifest", {"manifest": manifest}))[
        "manifest"
    ] == {"tensors": [["w", [2, 2], "float32"]], "step": 3}
    tensor = torch.arange(6, dtype=torch.float32)
    frame = encode_frame_bytes("state", {"step": 1, "index": 0}, bulk=tensor)
    assert torch.equal(decode_frame(frame)["data"], tensor)


async def test_a_tcp_reader_refuses_an_oversized_control_head_before_reading_it() -> None:
    """The peer announces a 1 MiB `heartbeat` head and sends only its first bytes: the reader
    refuses it from the prefix and the peeked kind, without waiting for (or buffering) the
    rest."""
    import trio

    from paramsync.runtime.transport.tcp import Connection

    left, right = trio.socket.socketpair()
    sender, receiver = trio.SocketStream(left), trio.SocketStream(right)
    body = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "heartbeat", "pad": b"\x00" * MIB})
    conn = Connection(receiver, peer=7)
    try:
        await sender.send_all(struct.pack(">II", len(body), 0) + body[:64])
        with trio.fail_after(5), pytest.raises(FrameTooLarge, match="heartbeat frame of"):
            await conn.recv()
    finally:
        await sender.aclose()
        await receiver.aclose()
