"""The CBOR wire codec: round trips, the bytes a foreign decoder sees, zero-copy bulk, and
fuzzing of every decoding entry point with random and mutated frames.

The one rule the fuzz tests enforce: whatever bytes arrive, ``decode_frame``, ``parse_prefix``
and ``decode_head`` either return a valid message or raise ``ProtocolError`` (or a subclass);
no other exception, however malformed the input.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
import torch
from conftest import bitwise_equal
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from paramsync.runtime.errors import FrameTooLarge, ProtocolError
from paramsync.runtime.protocol.messages import KINDS
from paramsync.runtime.protocol.schema import WireType
from paramsync.runtime.protocol.wire import (
    BFLOAT16_TAG,
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    PREFIX_SIZE,
    PROTOCOL_VERSION,
    BulkSpec,
    decode_frame,
    decode_head,
    encode_frame,
    encode_frame_bytes,
    parse_prefix,
    tensor_buffer,
)
from paramsync.runtime.testing.strategies import key_types, random_tensor, wire_fields

V = PROTOCOL_VERSION

# The RFC 8746 little-endian typed-array tags, written out independently of
# paramsync.runtime.protocol.wire.
WIRE_TAGS = {
    torch.uint8: 64,
    torch.int8: 72,
    torch.int16: 77,
    torch.int32: 78,
    torch.int64: 79,
    torch.float16: 84,
    torch.float32: 85,
    torch.float64: 86,
    torch.bfloat16: 0xBF16,
}
LITTLE_ENDIAN_NUMPY = {
    torch.uint8: "u1",
    torch.int8: "i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
}
DTYPES = tuple(WIRE_TAGS)
SHAPES = [(), (0,), (1,), (7,), (2, 3), (0, 5), (3, 0, 2), (1, 1, 1, 4)]
COLL = {"op": 3, "hop": 1, "part": 2}
FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def little_endian_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as little-endian bytes, computed without the codec."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    return tensor.numpy().astype(LITTLE_ENDIAN_NUMPY[tensor.dtype]).tobytes()


def prefix(item_len: int, bulk_len: int) -> bytes:
    return struct.pack(">II", item_len, bulk_len)


def only_protocol_errors(call: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``call``: (True, result) on success, (False, error) on ProtocolError; anything else
    fails the test with the offending exception."""
    try:
        return True, call()
    except ProtocolError as exc:
        return False, exc
    except Exception as exc:  # pragma: no cover - this is the bug the fuzzers look for
        pytest.fail(f"{type(exc).__name__} escaped instead of ProtocolError: {exc!r}")


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bulk_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(dtype, shape, seed=len(shape))
    frame = encode_frame_bytes("coll", COLL, bulk=tensor)
    message = decode_frame(frame)
    assert message["v"] == PROTOCOL_VERSION and message["kind"] == "coll"
    assert {k: message[k] for k in COLL} == COLL
    assert bitwise_equal(message["data"], tensor)

    item_len, bulk_len = parse_prefix(frame[:PREFIX_SIZE], DEFAULT_MAX_FRAME)
    assert item_len == len(frame) - PREFIX_SIZE
    assert bulk_len == (tensor.numel() * tensor.element_size() if tensor.numel() else 0)
    head, spec = decode_head(frame[PREFIX_SIZE : PREFIX_SIZE + item_len - bulk_len], bulk_len)
    if bulk_len:
        assert spec == BulkSpec(dtype, shape, bulk_len)
        assert "data" not in head
        out = torch.empty(shape, dtype=dtype)
        tensor_buffer(out)[:] = frame[len(frame) - bulk_len :]
        assert bitwise_equal(out, tensor)
    else:  # an empty bulk travels inline
        assert spec is None and bitwise_equal(head["data"], tensor)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inline_round_trip_every_dtype_and_shape(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = random_tensor(dtype, shape, seed=7)
    frame = encode_frame_bytes("coll", {**COLL, "data": tensor})
    assert struct.unpack(">II", frame[:PREFIX_SIZE])[1] == 0  # no bulk
    assert bitwise_equal(decode_frame(frame)["data"], tensor)


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 6), max_size=4).map(tuple),
    seed=st.integers(0, 2**31),
    inline=st.booleans(),
    fields=st.fixed_dictionaries(
        {
            "op": st.integers(0, 2**64 - 1),
            "hop": st.integers(0, 1 << 20),
            "part": st.integers(0, 2**64 - 1),  # CBOR's largest plain integer
        }
    ),
)
def test_coll_round_trip_property(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, inline: bool, fields: dict
) -> None:
    tensor = random_tensor(dtype, shape, seed)
    if inline:
        frame = encode_frame_bytes("coll", {**fields, "data": tensor})
    else:
        frame = encode_frame_bytes("coll", fields, bulk=tensor)
    message = decode_frame(frame)
    assert {k: message[k] for k in fields} == fields
    assert bitwise_equal(message["data"], tensor)


def test_non_contiguous_bulk_travels_as_its_contiguous_copy() -> None:
    """encode_frame sends a contiguous copy of a non-contiguous bulk: the buffers it returns
    must keep that copy alive (a view of freed memory sends garbage)."""
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    view = base.t()[1:3]
    assert not view.is_contiguous()
    parts = encode_frame("coll", COLL, bulk=view)
    junk = [torch.full((8,), -1.0) for _ in range(64)]  # reuse whatever memory was freed
    message = decode_frame(b"".join(bytes(p) for p in parts))
    del junk
    assert torch.equal(message["data"], view.contiguous())
    assert torch.equal(decode_frame(encode_frame_bytes("coll", COLL, bulk=view))["data"], view)


def test_large_non_contiguous_bulk_does_not_crash_the_encoder() -> None:
    """The same with a 16 MB transposed tensor, whose temporary copy is unmapped when freed:
    reading a view of it kills the process, so this runs in a child interpreter."""
    code = (
        "import torch\n"
        "from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes\n"
        "x = torch.arange(4_000_000, dtype=torch.float32).view(2000, 2000).t()\n"
        "frame = encode_frame_bytes('coll', {'op': 0, 'hop': 0, 'part': 0}, bulk=x)\n"
        "print(torch.equal(decode_frame(frame)['data'], x))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, f"child died with {child.returncode}: {child.stderr[-800:]}"
    assert child.stdout.strip() == "True"


# Valid field values, generated from the message declarations themselves.

KIND_STRATEGIES = {kind: wire_fields(KINDS[kind]) for kind in sorted(KINDS)}
assert {"hello", "challenge", "auth", "welcome", "refuse", "rdv_join", "rdv_table", "coll"} <= set(
    KIND_STRATEGIES
)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@st.composite
def valid_messages(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(sorted(KIND_STRATEGIES)))
    return kind, draw(KIND_STRATEGIES[kind])


@settings(max_examples=200, deadline=None)
@given(valid_messages())
def test_every_message_kind_round_trips(message: tuple[str, dict[str, Any]]) -> None:
    kind, fields = message
    decoded = decode_frame(encode_frame_bytes(kind, fields))
    assert decoded.pop("v") == PROTOCOL_VERSION
    assert decoded.pop("kind") == kind
    assert decoded.keys() == fields.keys()
    for name, value in fields.items():
        assert same_value(decoded[name], value), name


# --------------------------------------------------------------------------- zero copy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bulk_buffer_is_a_view_of_the_tensor_memory(dtype: torch.dtype) -> None:
    tensor = torch.zeros(64, dtype=dtype)
    parts = encode_frame("coll", COLL, bulk=tensor)
    assert len(parts) == 2
    view = parts[-1]
    assert isinstance(view, memoryview)
    assert view.nbytes == tensor.numel() * tensor.element_size()
    before = bytes(view)
    tensor[5] = 3
    tensor[63] = 1
    after = bytes(view)
    assert after != before and after == little_endian_bytes(tensor)
    # the frame sent now carries the new values: nothing was copied at encode time
    assert bitwise_equal(decode_frame(b"".join(bytes(p) for p in parts))["data"], tensor)


def test_small_frames_are_one_buffer_with_the_prefix() -> None:
    parts = encode_frame("refuse", {"reason": "no"})
    assert len(parts) == 1
    item_len, bulk_len = struct.unpack(">II", bytes(parts[0])[:PREFIX_SIZE])
    assert (item_len, bulk_len) == (len(parts[0]) - PREFIX_SIZE, 0)


# --------------------------------------------------------------------------- foreign decoders


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inline", [False, True], ids=["bulk", "inline"])
def test_a_plain_cbor_decoder_reads_frames(dtype: torch.dtype, inline: bool) -> None:
    """cbor2.loads alone, with no paramsync hook, sees RFC 8949 / RFC 8746 data."""
    tensor = random_tensor(dtype, (2, 3), seed=11)
    if inline:
        frame = encode_frame_bytes("coll", {**COLL, "data": tensor})
    else:
        frame = encode_frame_bytes("coll", COLL, bulk=tensor)
    item_len, bulk_len = struct.unpack(">II", frame[:8])
    item = frame[8:]
    assert len(item) == item_len
    obj = cbor2.loads(item)  # one complete CBOR data item, nothing after it
    assert isinstance(obj, dict)
    assert obj["v"] == PROTOCOL_VERSION and obj["kind"] == "coll"
    assert {k: obj[k] for k in COLL} == COLL
    assert list(obj)[-1] == "data"  # the tensor is the last map value
    array = obj["data"]
    assert isinstance(array, cbor2.CBORTag) and array.tag == 40
    shape, typed = array.value
    assert list(shape) == [2, 3]
    assert isinstance(typed, cbor2.CBORTag) and typed.tag == WIRE_TAGS[dtype]
    assert typed.value == little_endian_bytes(tensor)
    if inline:
        assert bulk_len == 0
    else:
        assert bulk_len == len(typed.value) and item[-bulk_len:] == typed.value


def test_bfloat16_uses_paramsyncs_extension_tag() -> None:
    assert BFLOAT16_TAG == 0xBF16 == 48918
    tensor = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    obj = cbor2.loads(encode_frame_bytes("coll", COLL, bulk=tensor)[8:])
    typed = obj["data"].value[1]
    assert typed.tag == 48918
    assert typed.value == bytes.fromhex("803f00c0003f")  # bf16 1.0, -2.0, 0.5, little-endian


@settings(max_examples=60, deadline=None)
@given(valid_messages())
def test_a_plain_cbor_decoder_reads_every_kind(message: tuple[str, dict[str, Any]]) -> None:
    kind, fields = message
    frame = encode_frame_bytes(kind, fields)
    obj = cbor2.loads(frame[8:])
    assert isinstance(obj, dict) and obj["v"] == PROTOCOL_VERSION and obj["kind"] == kind
    assert set(obj) == {"v", "kind", *fields}


# --------------------------------------------------------------------------- prefixes


def test_oversized_prefix_is_frame_too_large() -> None:
    with pytest.raises(FrameTooLarge):
        parse_prefix(prefix(HANDSHAKE_MAX_FRAME + 1, 0), HANDSHAKE_MAX_FRAME)
    with pytest.raises(FrameTooLarge):
        parse_prefix(prefix(2**32 - 1, 0), DEFAULT_MAX_FRAME)
    assert parse_prefix(prefix(HANDSHAKE_MAX_FRAME, 0), HANDSHAKE_MAX_FRAME) == (4096, 0)
    # bulk bytes do not count against the limit: they land in the receiver's own buffer
    assert parse_prefix(prefix(100 + 2**31, 2**31), 100) == (100 + 2**31, 2**31)
    big = encode_frame_bytes("refuse", {"reason": "x" * 1000})
    with pytest.raises(FrameTooLarge):
        decode_frame(big, max_frame=500)


def test_bulk_longer_than_its_item_is_refused() -> None:
    with pytest.raises(ProtocolError, match="bulk"):
        parse_prefix(prefix(10, 11), DEFAULT_MAX_FRAME)
    with pytest.raises(ProtocolError):
        parse_prefix(prefix(0, 0), DEFAULT_MAX_FRAME)
    for short in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(ProtocolError):
            parse_prefix(short, DEFAULT_MAX_FRAME)


def test_frame_length_must_match_its_prefix() -> None:
    frame = encode_frame_bytes("refuse", {"reason": "bye"})
    for bad in (frame[:-1], frame + b"\x00", frame[:PREFIX_SIZE], frame[:3]):
        with pytest.raises(ProtocolError):
            decode_frame(bad)


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ({"v": 5, "kind": "heartbeat"}, "version 5"),
        ({"v": 3, "kind": "heartbeat"}, "version 3"),  # the version before the salted handshake
        ({"v": 2, "kind": "heartbeat"}, "version 2"),  # the version before the v3 handshake
        ({"v": 1, "kind": "heartbeat"}, "version 1"),  # the version before the v2 handshake
        ({"v": 0, "kind": "heartbeat"}, "version 0"),
        ({"v": "4", "kind": "heartbeat"}, "version"),
        ({"v": True, "kind": "heartbeat"}, "version"),  # a bool is no version on the wire
        ({"v": 4.0, "kind": "heartbeat"}, "version"),  # a float is not the integer 4
        ({"kind": "heartbeat"}, "version"),
        ({"v": V}, "kind"),
        ({"v": V, "kind": 7}, "kind"),
        ({"v": V, "kind": "gossip"}, "unknown message kind"),
        ({"v": V, "kind": "heartbeat", "extra": 1}, "unknown field"),
        ({"v": V, "kind": "welcome"}, "missing field"),
        ({"v": V, "kind": "refuse"}, "missing field 'reason'"),
        ({"v": V, "kind": "refuse", "reason": 5}, "'reason' must be str"),
        ({"v": V, "kind": "refuse", "reason": "x" * 1025}, "longer than"),
        ({"v": V, "kind": "rdv_join", "host": "h", "port": 0}, "below"),
        ({"v": V, "kind": "rdv_join", "host": "h", "port": 70000}, "above"),
        ({"v": V, "kind": "rdv_join", "host": "h", "port": True}, "must be int"),
        ({"v": V, "kind": "rdv_join", "host": "h", "port": 80.0}, "must be int"),
        ({"v": V, "kind": "rdv_table", "addresses": [["h", 1], "h:2"]}, r"'addresses'\[1\]"),
        (["v", 1], "map"),
        ("hello", "map"),
    ],
)
def test_invalid_items_are_refused_with_a_reason(item: Any, match: str) -> None:
    body = cbor2.dumps(item)
    with pytest.raises(ProtocolError, match=match):
        decode_frame(prefix(len(body), 0) + body)


def test_trailing_bytes_after_the_item_are_refused() -> None:
    body = cbor2.dumps({"v": V, "kind": "heartbeat"}) + b"\x00"
    with pytest.raises(ProtocolError, match="trailing"):
        decode_frame(prefix(len(body), 0) + body)


# --------------------------------------------------------------------------- fuzzing


def feed_everything(frame: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bool:
    """Feed ``frame`` to every decoding entry point; True when decode_frame accepted it."""
    accepted, result = only_protocol_errors(lambda: decode_frame(frame, max_frame))
    if accepted:
        assert isinstance(result, dict) and result["v"] == PROTOCOL_VERSION
        assert result["kind"] in KINDS
    if len(frame) >= PREFIX_SIZE:
        ok, lengths = only_protocol_errors(lambda: parse_prefix(frame[:PREFIX_SIZE], max_frame))
        if ok:
            item_len, bulk_len = lengths
            assert 0 < item_len and 0 <= bulk_len <= item_len
            assert item_len - bulk_len <= max_frame
            item = frame[PREFIX_SIZE : PREFIX_SIZE + item_len]
            head = item[: max(0, len(item) - bulk_len)]
            ok, decoded = only_protocol_errors(lambda: decode_head(head, bulk_len))
            if ok:
                message, spec = decoded
                assert isinstance(message, dict)
                if bulk_len:
                    assert isinstance(spec, BulkSpec) and spec.nbytes == bulk_len
                else:
                    assert spec is None
    return accepted


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    feed_everything(data)
    feed_everything(data, HANDSHAKE_MAX_FRAME)
    only_protocol_errors(lambda: parse_prefix(data[:8], len(data)))


@FUZZ
@given(body=st.binary(max_size=600), bulk=st.integers(0, 700), max_frame=st.integers(0, 700))
def test_random_items_behind_a_consistent_prefix_only_raise_protocol_error(
    body: bytes, bulk: int, max_frame: int
) -> None:
    """A correct prefix gets random bytes through to the CBOR decoder itself."""
    feed_everything(prefix(len(body), min(bulk, len(body))) + body)
    feed_everything(prefix(len(body), 0) + body, max_frame)
    only_protocol_errors(lambda: decode_head(body, bulk))


@given(data=st.binary(min_size=0, max_size=12), max_frame=st.integers(0, 2**40))
def test_parse_prefix_fuzz(data: bytes, max_frame: int) -> None:
    ok, result = only_protocol_errors(lambda: parse_prefix(data, max_frame))
    if ok:
        item_len, bulk_len = result
        assert len(data) == PREFIX_SIZE and 0 < item_len and bulk_len <= item_len
        assert item_len - bulk_len <= max_frame
    elif len(data) == PREFIX_SIZE:
        item_len, bulk_len = struct.unpack(">II", data)
        assert item_len == 0 or bulk_len > item_len or item_len - bulk_len > max_frame


# Hand-made CBOR: what a hostile encoder can send that cbor2.dumps never would.


def head_of(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | info]) + value.to_bytes(size, "big")
    raise ValueError(value)


def raw_map(pairs: list[tuple[bytes, bytes]], indefinite: bool = False) -> bytes:
    body = b"".join(key + value for key, value in pairs)
    if indefinite:
        return b"\xbf" + body + b"\xff"
    return head_of(5, len(pairs)) + body


def tensor_tag(tensor: torch.Tensor) -> cbor2.CBORTag:
    """RFC 8746 encoding of a tensor, built here without the codec."""
    typed = cbor2.CBORTag(WIRE_TAGS[tensor.dtype], little_endian_bytes(tensor))
    return cbor2.CBORTag(40, [list(tensor.shape), typed])


def enc(value: Any) -> bytes:
    return cbor2.dumps(value, default=lambda encoder, v: encoder.encode(tensor_tag(v)))


SEMANTIC_TAGS = (0, 1, 2, 3, 4, 5, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 32, 33, 34, 35, 36)
SEMANTIC_TAGS += (37, 38, 40, 64, 72, 78, 79, 84, 85, 86, 100, 256, 258, 260, 261, 262, 263)
SEMANTIC_TAGS += (1004, 1040, 0xBF16, 55799, 2**32 + 1)

# Raw CBOR values a hostile peer could put anywhere a value goes.
hostile_values = st.one_of(
    st.just(b"\x81" * 10000 + b"\x00"),  # array nesting bomb
    st.just(b"\xa1\x61a" * 5000 + b"\x00"),  # map nesting bomb
    st.just(b"\xd8\x28" * 5000 + b"\x00"),  # tag nesting bomb
    st.just(b"\xd8\x63" * 5000 + b"\x00"),
    st.just(b"\x9f" * 3000 + b"\xff" * 3000),  # indefinite nesting
    st.just(b"\x9f\x01\x02\xff"),  # indefinite array
    st.just(b"\x5f\x41a\x41b\xff"),  # indefinite byte string
    st.just(b"\x7f\x61a\x61b\xff"),  # indefinite text string
    st.just(b"\xbf\x61a\x01\xff"),  # indefinite map
    st.just(b"\x5b" + b"\xff" * 8),  # 2**64-1 byte string, no bytes
    st.just(b"\x5a\xff\xff\xff\xff"),
    st.just(b"\x7b\x00\x00\x00\x01\x00\x00\x00\x00"),
    st.just(b"\x9b\x7f\xff\xff\xff\xff\xff\xff\xff"),  # huge array
    st.just(b"\xbb\x7f\xff\xff\xff\xff\xff\xff\xff"),  # huge map
    st.just(b"\xc2\x5a\xff\xff\xff\xff"),  # bignum with a huge declared length
    st.just(b"\xf7"),  # undefined
    st.just(b"\xf8\x20"),  # simple value 32
    st.just(b"\xf8\x10"),  # non-well-formed simple value
    st.just(b"\xe0"),
    st.just(b"\xf9\x7e\x00"),  # half NaN
    st.just(b"\xfb\x7f\xf0\x00\x00\x00\x00\x00\x00"),  # +inf
    st.just(b"\x1f"),  # reserved additional info
    st.just(b"\x1c"),
    st.just(b"\xff"),  # a lone break
    st.just(b"\x62\xff\xfe"),  # invalid UTF-8
    st.just(b"\x62\xed\xa0"),
    st.just(b"\xd8\x28\x82\x81\x1b\xff\xff\xff\xff\xff\xff\xff\xff\xd8\x55\x40"),
    st.just(b"\xd8\x28\x82\x82\x1b\x00\x00\x00\x01\x00\x00\x00\x00\x00\xd8\x55\x40"),
    st.just(enc(cbor2.CBORTag(40, [[2**39, 2**39, 0], cbor2.CBORTag(85, b"")]))),
    st.just(enc(cbor2.CBORTag(40, [[3], cbor2.CBORTag(85, b"\x00" * 8)]))),
    st.just(enc(cbor2.CBORTag(40, [[-1], cbor2.CBORTag(85, b"")]))),
    st.just(enc(cbor2.CBORTag(40, [[1.5], cbor2.CBORTag(85, b"\x00" * 4)]))),
    st.just(enc(cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, "abcd")]))),
    st.just(enc(cbor2.CBORTag(40, [[1], cbor2.CBORTag(87, b"\x00" * 4)]))),
    st.just(enc(cbor2.CBORTag(40, [[1], b"\x00" * 4]))),
    st.just(enc(cbor2.CBORTag(40, [[1]]))),
    st.just(enc(cbor2.CBORTag(40, "x"))),
    st.just(enc(cbor2.CBORTag(85, [1, 2]))),
    st.builds(lambda t, v: head_of(6, t) + enc(v), st.sampled_from(SEMANTIC_TAGS), st.integers()),
    st.builds(
        lambda t, v: head_of(6, t) + enc(v),
        st.sampled_from(SEMANTIC_TAGS),
        st.one_of(st.binary(max_size=9), st.text(max_size=9), st.lists(st.integers(), max_size=3)),
    ),
    st.builds(enc, st.one_of(st.none(), st.booleans(), st.integers(), st.floats())),
    st.builds(enc, st.one_of(st.text(max_size=20), st.binary(max_size=20))),
    st.builds(enc, st.lists(st.integers(), max_size=4)),
    st.builds(enc, st.dictionaries(st.text(max_size=4), st.integers(), max_size=3)),
    st.builds(enc, st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=3)),
)


@st.composite
def valid_frames(draw: st.DrawFn) -> tuple[str, list[tuple[bytes, bytes]], bytes]:
    """A valid message as raw map pairs, plus the bulk bytes that end it (possibly empty)."""
    kind, fields = draw(valid_messages())
    bulk = b""
    pairs = [(enc("v"), enc(V)), (enc("kind"), enc(kind))]
    if kind == "coll" and draw(st.booleans()):
        fields = {k: v for k, v in fields.items() if k != "data"}
        dtype = draw(st.sampled_from(DTYPES))
        tensor = random_tensor(dtype, (draw(st.integers(1, 9)),), draw(st.integers(0, 99)))
        bulk = little_endian_bytes(tensor)
        data_head = b"\xd8\x28\x82" + enc(list(tensor.shape)) + head_of(6, WIRE_TAGS[dtype])
        fields_pairs = [(enc(k), enc(v)) for k, v in fields.items()]
        return kind, [*pairs, *fields_pairs, (enc("data"), data_head + head_of(2, len(bulk)))], bulk
    return kind, [*pairs, *((enc(k), enc(v)) for k, v in fields.items())], bulk


SHAPE_LEN = 2  # enc([k]) for the 1..9-element bulk tensors of valid_frames


def assemble(pairs: list[tuple[bytes, bytes]], bulk: bytes, indefinite: bool = False) -> bytes:
    item = raw_map(pairs, indefinite) + bulk
    return prefix(len(item), len(bulk)) + item


STRUCTURAL = (
    "duplicate-key",
    "duplicate-key-other-value",
    "wrong-version",
    "no-version",
    "unknown-kind",
    "kind-not-text",
    "no-kind",
    "wrong-field-type",
    "unknown-field",
    "hostile-field-value",
    "hostile-item",
    "indefinite-map",
    "tagged-item",
    "tagged-key",
    "non-text-key",
    "bulk-not-last",
    "bulk-shape-mismatch",
    "bulk-dtype-unknown",
)
ALWAYS_REFUSED = set(STRUCTURAL) - {"hostile-field-value"}


def wrong_type_value(types: tuple[WireType, ...]) -> st.SearchStrategy[bytes]:
    candidates: list[Any] = ["text", b"bytes", [1], {"k": 1}, None, True, 1.5, -(2**40), 7]
    bad = [enc(value) for value in candidates if not any(t.accepts(value) for t in types)]
    return st.sampled_from(bad)


@st.composite
def structural_mutations(draw: st.DrawFn) -> tuple[str, bytes]:
    kind, pairs, bulk = draw(valid_frames())
    mutation = draw(st.sampled_from(STRUCTURAL))
    fields = pairs[2:]
    indefinite = False
    if mutation == "duplicate-key":
        pair = draw(st.sampled_from(pairs))
        pairs.insert(draw(st.integers(0, len(pairs) - (1 if bulk else 0))), pair)
    elif mutation == "duplicate-key-other-value":
        key, _ = draw(st.sampled_from(pairs[:-1] if bulk else pairs))
        pairs.insert(draw(st.integers(0, len(pairs) - (1 if bulk else 0))), (key, enc(2)))
    elif mutation == "wrong-version":
        # (4.0, which compares equal to 4, has its own test above)
        value = draw(
            st.sampled_from([0, 1, 2, 3, 5, -1, 2**64 - 1, "4", 1.5, False, None, b"\x04", [4]])
        )
        pairs[0] = (enc("v"), enc(value))
    elif mutation == "no-version":
        del pairs[0]
    elif mutation == "unknown-kind":
        name = draw(st.text(max_size=30).filter(lambda s: s not in KINDS))
        pairs[1] = (enc("kind"), enc(name))
    elif mutation == "kind-not-text":
        value = draw(st.sampled_from([5, b"coll", None, ["coll"], {"k": "coll"}, True]))
        pairs[1] = (enc("kind"), enc(value))
    elif mutation == "no-kind":
        del pairs[1]
    elif mutation == "wrong-field-type":
        keys = key_types(KINDS[kind])
        candidates = [i for i, (k, _) in enumerate(pairs[2:], 2) if cbor2.loads(k) != "data"]
        assume(candidates)
        index = draw(st.sampled_from(candidates))
        name = cbor2.loads(pairs[index][0])
        pairs[index] = (pairs[index][0], draw(wrong_type_value(keys[name][0])))
    elif mutation == "unknown-field":
        name = draw(st.text(min_size=1, max_size=10).filter(lambda s: s not in ("v", "kind")))
        assume(name not in key_types(KINDS[kind]))
        pairs.insert(2, (enc(name), enc(1)))
    elif mutation == "hostile-field-value":
        index = draw(st.integers(0, len(pairs) - 1))
        pairs[index] = (pairs[index][0], draw(hostile_values))
    elif mutation == "hostile-item":
        item = draw(hostile_values)
        return mutation, prefix(len(item), 0) + item
    elif mutation == "indefinite-map":
        indefinite = True
    elif mutation == "tagged-item":
        tag = draw(st.sampled_from(SEMANTIC_TAGS).filter(lambda t: t != 55799))
        item = head_of(6, tag) + raw_map(pairs) + bulk
        return mutation, prefix(len(item), len(bulk)) + item
    elif mutation == "tagged-key":
        tag = draw(st.sampled_from(SEMANTIC_TAGS).filter(lambda t: t != 55799))
        index = draw(st.integers(0, len(pairs) - 1))
        pairs[index] = (head_of(6, tag) + pairs[index][0], pairs[index][1])
    elif mutation == "non-text-key":
        index = draw(st.integers(0, len(pairs) - 1))
        key = draw(st.sampled_from([enc(1), enc(-1), enc(None), enc(1.5), enc([1]), b"\xf5"]))
        pairs[index] = (key, pairs[index][1])
    elif mutation == "bulk-not-last":
        assume(bulk and fields)
        pairs.insert(2, pairs.pop())
    elif mutation == "bulk-shape-mismatch":
        assume(bulk)
        key, value = pairs[-1]
        shape = draw(st.sampled_from([[len(bulk) + 1], [0], [len(bulk), 2], [2**40 - 1]]))
        pairs[-1] = (key, b"\xd8\x28\x82" + enc(shape) + value[3 + SHAPE_LEN :])
    elif mutation == "bulk-dtype-unknown":
        assume(bulk)
        key, value = pairs[-1]
        shape_end = 3 + SHAPE_LEN
        tail = value[shape_end:]
        tag_len = {0xD8: 2, 0xD9: 3}[tail[0]]
        new_tag = draw(st.sampled_from([65, 68, 80, 81, 87, 1, 2, 0xBF17]))
        pairs[-1] = (key, value[:shape_end] + head_of(6, new_tag) + tail[tag_len:])
    return mutation, assemble(pairs, bulk, indefinite)


@FUZZ
@given(structural_mutations())
def test_structurally_invalid_frames_are_refused_with_protocol_error(
    mutated: tuple[str, bytes],
) -> None:
    mutation, frame = mutated
    note(f"{mutation}: {frame[:200].hex()}")
    accepted = feed_everything(frame)
    if mutation in ALWAYS_REFUSED:
        assert not accepted, f"{mutation} frame was accepted"
    feed_everything(frame, HANDSHAKE_MAX_FRAME)


@settings(max_examples=120, deadline=None)
@given(valid_frames())
def test_hand_built_valid_frames_are_accepted(valid: tuple[str, list, bytes]) -> None:
    """The fuzzers' raw builder makes frames the decoder accepts (so mutations start valid)."""
    kind, pairs, bulk = valid
    message = decode_frame(assemble(pairs, bulk))
    assert message["kind"] == kind
    if bulk:
        assert little_endian_bytes(message["data"]) == bulk


BYTE_MUTATIONS = ("flip", "truncate", "insert", "delete", "append", "overwrite")


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    """A valid frame with a few random byte-level edits; the prefix is often re-fixed so the
    corrupted item reaches the CBOR decoder."""
    _, pairs, bulk = draw(valid_frames())
    frame = bytearray(assemble(pairs, bulk))
    bulk_len = len(bulk)
    for _ in range(draw(st.integers(1, 3))):
        mutation = draw(st.sampled_from(BYTE_MUTATIONS))
        at = draw(st.integers(0, len(frame)))
        if mutation == "flip" and at < len(frame):
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif mutation == "truncate":
            del frame[at:]
        elif mutation == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif mutation == "delete":
            del frame[at : at + draw(st.integers(1, 16))]
        elif mutation == "append":
            frame += draw(st.binary(min_size=1, max_size=16))
        elif mutation == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            frame[at : at + len(chunk)] = chunk
    if len(frame) >= PREFIX_SIZE and draw(st.booleans()):
        item_len = len(frame) - PREFIX_SIZE
        frame[:PREFIX_SIZE] = prefix(item_len, min(bulk_len, item_len))
    return bytes(frame)


@FUZZ
@given(byte_mutations())
def test_byte_mutated_frames_only_raise_protocol_error(frame: bytes) -> None:
    feed_everything(frame)
    feed_everything(frame, HANDSHAKE_MAX_FRAME)


@FUZZ
@given(
    valid=valid_frames(),
    item_len=st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1])),
    bulk_len=st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1])),
)
def test_lying_prefixes_only_raise_protocol_error(
    valid: tuple[str, list, bytes], item_len: int, bulk_len: int
) -> None:
    """Huge, zero or inconsistent declared lengths in front of a valid item."""
    _, pairs, bulk = valid
    frame = assemble(pairs, bulk)
    lied = prefix(item_len, bulk_len) + frame[PREFIX_SIZE:]
    accepted = feed_everything(lied)
    if accepted:  # only the truth, or an inline tensor re-read as an equal bulk, decodes
        assert item_len == len(frame) - PREFIX_SIZE
        assert decode_frame(lied).keys() == decode_frame(frame).keys()


def test_nesting_bombs_are_refused() -> None:
    for bomb in (b"\x81" * 10000 + b"\x00", b"\xd8\x28" * 10000 + b"\x00", b"\xa1\x61a" * 10000):
        for item in (bomb, raw_map([(enc("v"), enc(V)), (enc("kind"), bomb)])):
            with pytest.raises(ProtocolError):
                decode_frame(prefix(len(item), 0) + item)


# --------------------------------------------------------------------------- the document


def test_the_hex_dumps_in_the_protocol_document_are_what_the_encoder_writes() -> None:
    """docs/protocol.md shows real frames; if the encoder changes, the document must too."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
    dumps: list[bytes] = []
    current = bytearray()
    for line in doc.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([0-9a-f]{8})  ((?:[0-9a-f]{2} ?)+)\s+\|", line)
        if match:
            if int(match.group(1), 16) == 0 and current:
                dumps.append(bytes(current))
                current = bytearray()
            current += bytes.fromhex(match.group(2))
    if current:
        dumps.append(bytes(current))
    expected = [
        encode_frame_bytes("coll", {"op": 5, "hop": 1, "part": 0}, bulk=torch.tensor([1.0, 2, 3])),
        encode_frame_bytes(
            "coll",
            {"op": 0, "hop": 0, "part": 0},
            bulk=torch.tensor([1.0, -2], dtype=torch.bfloat16),
        ),
        encode_frame_bytes("refuse", {"reason": "rank 1 is already taken"}),
    ]
    assert dumps == expected
    text = doc.read_text(encoding="utf-8")
    for kind in (
        "hello",
        "challenge",
        "auth",
        "welcome",
        "refuse",
        "rdv_join",
        "rdv_table",
        "coll",
    ):
        assert f"| `{kind}` |" in text, f"message kind {kind} is not documented"
    assert "48918" in text and "0xBF16" in text


def test_a_process_without_torch_frames_and_decodes_and_imports_it_for_a_tensor() -> None:
    # The coordinator and the launcher frame messages without importing torch; a tensor that
    # arrives all the same (inline or as a bulk) is decoded, torch imported on the spot.
    inline = encode_frame_bytes("coll", {"op": 1, "hop": 0, "part": 0, "data": torch.arange(3)})
    bulk = encode_frame_bytes(
        "coll", {"op": 1, "hop": 0, "part": 0}, bulk=torch.ones(2, 2, dtype=torch.bfloat16)
    )
    code = f"""
import sys
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes
plain = decode_frame(encode_frame_bytes("heartbeat", {{}}))
assert "torch" not in sys.modules, "framing a message imported torch"
inline = decode_frame(bytes.fromhex({inline.hex()!r}))
assert "torch" in sys.modules
bulk = decode_frame(bytes.fromhex({bulk.hex()!r}))
import paramsync.runtime.protocol.wire as wire
print(plain["kind"], inline["data"].tolist(), bulk["data"].dtype, bulk["data"].shape,
      sorted(map(str, wire.DTYPE_TAGS))[:2])
"""
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == [
        "heartbeat",
        "[0,",
        "1,",
        "2]",
        "torch.bfloat16",
        "torch.Size([2,",
        "2])",
        "['torch.bfloat16',",
        "'torch.float16']",
    ]
