"""The message declarations of `paramsync.runtime.protocol.messages` and the generic codec of
`paramsync.runtime.protocol.schema`: every kind round-trips, every bad field is refused naming the
kind, the field and the peer, and the kind table is the closed set of declared kinds."""

from __future__ import annotations

import dataclasses
import inspect
import struct
from typing import Any

import cbor2
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paramsync.runtime.cli.main
import paramsync.runtime.testing.fault_trials  # noqa: F401
from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol import messages
from paramsync.runtime.protocol.messages import (
    COORDINATOR_KINDS,
    KINDS,
    WORKER_KINDS,
    AbortRun,
    Digest,
    Go,
    Joined,
    Ready,
    StartRun,
    decode_message,
    event_from_wire,
    message_from_wire,
    validate_message,
)
from paramsync.runtime.protocol.schema import (
    PROTOCOL_VERSION,
    Bytes,
    Either,
    Float,
    Int,
    Map,
    Record,
    Seq,
    Str,
    WireMessage,
    WireType,
    encode,
    schema,
)
from paramsync.runtime.protocol.wire import decode_frame, encode_frame_bytes
from paramsync.runtime.testing.strategies import instances, key_types, wire_fields

KIND_NAMES = sorted(KINDS)
PEER = 7
QUICK = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def locals_of(message: Any) -> dict[str, Any]:
    """The attributes a receiver supplies (never on the wire)."""
    return {name: getattr(message, name) for name in schema(type(message)).locals_}


def same(a: Any, b: Any) -> bool:
    """Equal messages, tensors compared bit for bit."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or (x.dtype, x.shape) != (y.dtype, y.shape):
                return False
            bits_x = x.contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(bits_x, y.contiguous().reshape(-1).view(torch.uint8)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def item(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "kind": kind, **fields}


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KIND_NAMES)
@QUICK
@given(data=st.data())
def test_every_kind_round_trips_through_a_frame(kind: str, data: st.DataObject) -> None:
    message = data.draw(instances(KINDS[kind]))
    name, fields = message.to_wire()
    assert name == kind
    decoded = decode_message(
        decode_frame(encode_frame_bytes(name, fields)), peer=PEER, **locals_of(message)
    )
    assert same(decoded, message), (decoded, message)


@pytest.mark.parametrize("kind", KIND_NAMES)
@QUICK
@given(data=st.data())
def test_every_valid_field_map_decodes_and_encodes_back(kind: str, data: st.DataObject) -> None:
    fields = data.draw(wire_fields(KINDS[kind]))
    message = decode_message(item(kind, fields), rank=1, host=1, now=2.0)
    again = message.to_wire()[1]
    assert same(decode_message(item(kind, again), rank=1, host=1, now=2.0), message)
    # The same map up to CBOR's view (tuples are lists), except that an optional field at the
    # value the encoder leaves out is left out, and a default may be written.
    omitted = {key: omit for _, key, _, _, omit in schema(KINDS[kind]).slots}
    for key, value in fields.items():
        if key in again:
            assert cbor_view(again[key]) == cbor_view(value), key
        else:
            assert value == omitted[key], key


def cbor_view(value: Any) -> Any:
    return cbor2.loads(cbor2.dumps(value, default=_tensors))


def _tensors(encoder: Any, value: Any) -> None:
    bits = value.contiguous().reshape(-1).view(torch.uint8)
    encoder.encode([str(value.dtype), list(value.shape), bytes(bits.numpy())])


def test_frames_keep_the_field_order_and_leave_defaults_out() -> None:
    """The encoder writes what the per-message encoders wrote before it, key for key."""
    assert Go(2, 5, 17).to_wire() == ("go", {"epoch": 1, "step": 2, "bucket": 5, "seq": 17})
    assert list(Go(2, 5, 17).to_wire()[1]) == ["epoch", "step", "bucket", "seq"]
    ready = Ready(3, 4, 1, [[[2, 2], "float32"]], cached=True)
    assert list(ready.to_wire()[1].items()) == [
        ("epoch", 1),
        ("step", 4),
        ("bucket", 1),
        ("spec", [[[2, 2], "float32"]]),
        ("cached", True),
    ]
    assert "cached" not in Ready(3, 4, 1, "xxh3:0").to_wire()[1]
    packed = Digest(0, 9, b"d", packed=b"ab", names=("w", "v"), cached="xxh3:1")
    assert list(packed.to_wire()[1].items()) == [
        ("epoch", 1),
        ("step", 9),
        ("digest", b"d"),
        ("tensors", b"ab"),
        ("names", ["w", "v"]),
        ("cached", "xxh3:1"),
    ]
    assert Digest(0, 9, b"d", (("w", b"1"),)).to_wire()[1]["tensors"] == [["w", b"1"]]
    named = Digest(0, 9, b"d", packed=b"ab", names=("w", "v"), algorithm="fold31x4")
    assert list(named.to_wire()[1])[-1] == "algorithm"
    assert named.to_wire()[1]["algorithm"] == "fold31x4"
    assert "algorithm" not in packed.to_wire()[1]
    joined = Joined(2, (("w", (3,), "float32", True),), ("h", 9), now=1.0, fold=True)
    assert list(joined.to_wire()[1]) == [
        "host",
        "port",
        "params",
        "step",
        "digest",
        "epoch",
        "fold",
    ]
    start = StartRun((("h", 1),), (0,))
    assert "fold" not in start.to_wire()[1] and start.members == (0,)
    assert AbortRun("x" * 5000).to_wire()[1]["reason"] == "x" * 4093 + "..."


def test_a_locally_built_message_is_normalized_like_a_decoded_one() -> None:
    built = Ready(1, 0, 0, [[[4, 2], "bfloat16"]])
    assert built.spec == (((4, 2), "bfloat16"),)
    decoded = event_from_wire(item("ready", built.to_wire()[1]), rank=1, now=0.0)
    assert decoded == built
    with pytest.raises(ProtocolError, match=r"Ready: field 'spec'\[0\] shape\[0\]=-1 is below 0"):
        Ready(1, 0, 0, [[[-1], "float32"]])
    with pytest.raises(ProtocolError, match="Digest: field 'names' comes only with packed"):
        Digest(1, 0, b"", names=("w",))


# --------------------------------------------------------------------------- refusals


def bad_values(ftype: WireType) -> list[Any]:
    """Values ``ftype`` refuses: wrong CBOR types, out of range, too long, bad elements."""
    wrong = ["text", b"bytes", [1], {"k": 1}, None, True, 1.5, -(2**40), 7]
    out = [value for value in wrong if not ftype.accepts(value)]
    if isinstance(ftype, Int):
        out.append(ftype.lo - 1)
        if ftype.hi is not None:
            out.append(ftype.hi + 1)
    elif isinstance(ftype, Float) and ftype.lo is not None:
        out.append(ftype.lo - 1.0)
    elif isinstance(ftype, Str):
        out.append("x" * (ftype.max_len + 1))
        if ftype.min_len:
            out.append("")
    elif isinstance(ftype, Bytes) and ftype.max_len <= 4096:
        out.append(b"x" * (ftype.max_len + 1))
    elif isinstance(ftype, Seq):
        out += [[bad] for bad in bad_values(ftype.item)[:3]]
        if ftype.max_len <= 64:
            out.append([None] * (ftype.max_len + 1))
    elif isinstance(ftype, Record):
        out.append([])
        for index, (_, part) in enumerate(ftype.parts):
            for bad in bad_values(part)[:2]:
                out.append([bad if i == index else None for i in range(len(ftype.parts))])
    elif isinstance(ftype, Either):
        out += [
            bad
            for option in ftype.options
            for bad in bad_values(option)
            if not any(o.accepts(bad) for o in ftype.options if o is not option)
        ]
    elif isinstance(ftype, Map):
        out.append({1: 2})
    return out


def refused(kind: str, fields: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_message(item(kind, fields), peer=PEER, rank=PEER, host=PEER, now=0.0)
    return info.value


@pytest.mark.parametrize("kind", [k for k in KIND_NAMES if key_types(KINDS[k])])
@QUICK
@given(data=st.data())
def test_every_bad_field_value_is_refused_naming_kind_field_and_peer(
    kind: str, data: st.DataObject
) -> None:
    fields = data.draw(wire_fields(KINDS[kind]))
    keys = key_types(KINDS[kind])
    key = data.draw(st.sampled_from(sorted(keys)))
    types = keys[key][0]
    candidates = [
        bad
        for t in types
        for bad in bad_values(t)
        if not any(other.accepts(bad) for other in types if other is not t)
    ]
    bad = data.draw(st.sampled_from(candidates))
    error = refused(kind, {**fields, key: bad})
    assert error.peer == PEER
    assert f"{kind} message" in error.reason and repr(key) in error.reason, error.reason
    with pytest.raises(ProtocolError, match=repr(key)):  # the frame layer refuses it too
        validate_message(item(kind, {**fields, key: bad}))


@pytest.mark.parametrize("kind", [k for k in KIND_NAMES if key_types(KINDS[k])])
@QUICK
@given(data=st.data())
def test_missing_required_fields_are_refused_by_name(kind: str, data: st.DataObject) -> None:
    keys = key_types(KINDS[kind])
    required = sorted(key for key, (_, needed) in keys.items() if needed)
    if not required:
        return
    fields = data.draw(wire_fields(KINDS[kind]))
    key = data.draw(st.sampled_from(required))
    del fields[key]
    error = refused(kind, fields)
    assert error.reason == f"{kind} message is missing field {key!r}"


@QUICK
@given(
    kind=st.sampled_from(KIND_NAMES),
    extra=st.text(min_size=1, max_size=12),
    data=st.data(),
)
def test_extra_fields_are_refused(kind: str, extra: str, data: st.DataObject) -> None:
    if extra in key_types(KINDS[kind]) or extra in ("v", "kind"):
        return
    fields = data.draw(wire_fields(KINDS[kind]))
    error = refused(kind, {**fields, extra: 1})
    assert f"{kind} message has an unknown field" in error.reason


@QUICK
@given(kind=st.text(max_size=20))
def test_unknown_kinds_are_refused(kind: str) -> None:
    if kind in KINDS:
        return
    with pytest.raises(ProtocolError, match="unknown message kind"):
        decode_message(item(kind, {}))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        validate_message(item(kind, {}))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        encode_frame_bytes(kind, {})


def test_invariants_between_fields_are_refused_naming_the_field() -> None:
    start = StartRun((("h", 1), ("h", 2)), (1, 0)).to_wire()[1]
    for change, field in (
        ({"ring": [0, 0]}, "'ring' is not a permutation"),
        ({"members": [3, 3]}, "'members' must list one distinct worker"),
        ({"donor": 9, "receivers": [0]}, "'donor' 9 is not a member"),
        ({"donor": 0, "receivers": [0]}, "'receivers' must be members other than the donor"),
    ):
        with pytest.raises(ProtocolError, match=f"peer 3: start_run message: field {field}"):
            message_from_wire(item("start_run", {**start, **change}), peer=3)


def test_the_direction_of_coordinator_messages_is_checked() -> None:
    go = item("go", Go(0, 0, 0).to_wire()[1])
    with pytest.raises(ProtocolError, match="a go message is not for the coordinator"):
        event_from_wire(go, rank=1, now=0.0)
    with pytest.raises(ProtocolError, match="a ready message does not come from the coordinator"):
        message_from_wire(item("ready", Ready(0, 0, 0, "h").to_wire()[1]))
    with pytest.raises(ProtocolError, match="expected a commit message, got a go message"):
        messages.Commit.from_wire(go)


# --------------------------------------------------------------------------- the closed set


def test_the_kind_table_is_the_closed_set_of_declared_kinds() -> None:
    declared = {
        cls
        for _, cls in inspect.getmembers(messages, inspect.isclass)
        if dataclasses.is_dataclass(cls) and cls.__module__ == messages.__name__
    }
    assert declared == set(KINDS.values())
    assert all(KINDS[cls.KIND] is cls for cls in declared)
    assert set(COORDINATOR_KINDS.values()) | set(WORKER_KINDS.values()) <= declared
    assert not set(COORDINATOR_KINDS) & set(WORKER_KINDS)
    # No other module declares a kind: every WireMessage class anywhere is in the table.
    seen, todo = set(), list(WireMessage.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo += cls.__subclasses__()
    assert seen == set(KINDS.values())
    with pytest.raises(TypeError):  # the table is read-only
        KINDS["gossip"] = Go  # type: ignore[index]


def test_every_kind_is_a_frozen_dataclass_with_its_schema() -> None:
    for kind, cls in KINDS.items():
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, kind
        spec = schema(cls)
        assert spec.kind == kind
        for f in dataclasses.fields(cls):
            assert "wire" in f.metadata, f"{kind}.{f.name} has no wire declaration"
    assert encode(Go(1, 2, 3)) == Go(1, 2, 3).to_wire()


def test_a_tensor_field_travels_as_the_frames_bulk() -> None:
    tensor = torch.arange(6, dtype=torch.float32)
    kind, fields, bulk = messages.StateTensor(4, 2, tensor).to_wire_bulk()
    assert (kind, fields) == ("state", {"step": 4, "index": 2}) and bulk is tensor
    frame = encode_frame_bytes(kind, fields, bulk)
    assert struct.unpack(">II", frame[:8])[1] == tensor.numel() * 4  # the bulk, not inline
    decoded = decode_message(decode_frame(frame))
    assert same(decoded, messages.StateTensor(4, 2, tensor))
    with pytest.raises(TypeError):
        messages.Heartbeat().to_wire_bulk()


# --------------------------------------------------------------------------- process groups

_SIG = (("w", (2,), "float32", True),)
_PEERS = (("a", (0, 2), (("h", 1), ("h", 3))), ("b", (0,), (("h", 1),)))


@pytest.mark.parametrize(
    "message",
    [
        Joined(1, _SIG, ("h", 2), mesh=(("dp", "tp"), (2, 2))),
        Joined(1, _SIG, ("h", 2), groups=(("a", (0, 2)), ("b", (1, 3)))),
        StartRun(addresses=(("h", 1), ("h", 2), ("h", 3)), ring=(0, 1, 2), groups=_PEERS),
        Ready(1, 3, 4, "spec-hash", 2, cached=True, group="a"),
        Go(3, 4, 7, 2, group="a"),
    ],
    ids=["join-mesh", "join-groups", "start_run-groups", "ready-group", "go-group"],
)
def test_group_fields_round_trip_through_a_frame(message: Any) -> None:
    name, fields = message.to_wire()
    decoded = decode_message(
        decode_frame(encode_frame_bytes(name, fields)), peer=PEER, **locals_of(message)
    )
    assert same(decoded, message), (decoded, message)
    assert {"mesh", "groups", "group"} & set(fields)


def test_without_groups_the_frames_carry_no_group_field() -> None:
    for message in (
        Joined(1, _SIG, ("h", 2)),
        StartRun(addresses=(("h", 1),), ring=(0,)),
        Ready(1, 3, 4, "spec-hash", 2),
        Go(3, 4, 7, 2),
    ):
        assert not {"mesh", "groups", "group"} & set(message.to_wire()[1])


@pytest.mark.parametrize(
    ("kind", "fields", "problem"),
    [
        ("start_run", {"groups": [["a", [0, 1], [["h", 1]]]]}, "one address each"),
        ("start_run", {"groups": [["a", [0], [["h", 1]]], ["a", [1], [["h", 2]]]]}, "twice"),
        ("join", {"mesh": [["dp"], [0]]}, "'mesh'"),
        ("join", {"groups": [["", [0]]]}, "'groups'"),
    ],
)
def test_bad_group_fields_are_refused_by_name(
    kind: str, fields: dict[str, Any], problem: str
) -> None:
    base: dict[str, Any] = (
        StartRun(addresses=(("h", 1), ("h", 2)), ring=(0, 1)).to_wire()[1]
        if kind == "start_run"
        else {"host": "h", "port": 2, "params": []}
    )
    with pytest.raises(ProtocolError, match=problem):
        decode_message(item(kind, {**base, **fields}), peer=PEER, rank=1, host=1, now=0.0)
