"""The decode memo (`paramsync.runtime.protocol.decode_memo`): bytes decoded and checked once
are answered again without decoding them, as a fresh copy; anything else is decoded whole."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest

from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol import wire
from paramsync.runtime.protocol.decode_memo import MEMO_ENTRIES, MEMO_MAX_ITEM
from paramsync.runtime.protocol.messages import (
    Digest,
    HostDigest,
    Joined,
    Ready,
    event_from_wire,
    host_event_from_wire,
)
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.wire import MEMO, decode_frame, encode_frame_bytes

DIGEST = HostDigest(0, 7, 2, ((b"\x0f", b"d" * 16, "xxh3-128"),), "xxh3:" + "0" * 32)


def framed(message: Any) -> bytes:
    return encode_frame_bytes(*message.to_wire())


def raw(fields: dict[str, Any]) -> bytes:
    body = cbor2.dumps({"v": PROTOCOL_VERSION, **fields})
    return len(body).to_bytes(4, "big") + bytes(4) + body


@pytest.fixture(autouse=True)
def fresh_memo() -> None:
    MEMO.clear()


def test_the_same_bytes_are_decoded_and_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = framed(DIGEST)
    first = host_event_from_wire(decode_frame(frame, tensors=False), host=4)
    assert first == HostDigest(4, 7, 2, DIGEST.groups, DIGEST.cached)

    def no_decoding(*args: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr(wire, "_loads_exact", no_decoding)
    monkeypatch.setattr(wire, "validate_message", no_decoding)
    for host in (5, 6):  # other hosts' identical frames, as a new bytes object each
        again = host_event_from_wire(
            decode_frame(bytes(bytearray(frame)), tensors=False), host=host
        )
        assert again == HostDigest(host, 7, 2, DIGEST.groups, DIGEST.cached)
    ready = framed(Ready(0, 3, 1, "xxh3:" + "1" * 32, 2, cached=True))
    with pytest.raises(AssertionError, match="decoded again"):
        decode_frame(ready)  # bytes it has not seen are decoded


def test_a_kept_map_is_handed_out_as_a_copy() -> None:
    frame = framed(DIGEST)
    for _ in range(2):  # the map decoded (then kept), then one answered from the memo
        first = decode_frame(frame)
        first["step"] = 99
        first["groups"][0][2] = "changed"
        first["groups"].append("more")
    again = decode_frame(frame)
    assert again == {
        "v": PROTOCOL_VERSION,
        "kind": "host_digest",
        "epoch": 2,
        "step": 7,
        "groups": [[b"\x0f", b"d" * 16, "xxh3-128"]],
        "cached": "xxh3:" + "0" * 32,
    }
    assert host_event_from_wire(again, host=0) == DIGEST
    # A changed map is checked again, as it now says: the changed field is refused.
    again["groups"] = [[b"\x0f", b"d" * 16, 3]]
    with pytest.raises(ProtocolError, match=r"host_digest message: field 'groups'\[0\] algorithm"):
        host_event_from_wire(again, host=0)


def test_refused_bytes_are_refused_every_time() -> None:
    bad = raw({"kind": "host_digest", "epoch": 2, "step": -1, "groups": []})
    for _ in range(2):
        with pytest.raises(ProtocolError, match="field 'step'=-1 is below 0"):
            decode_frame(bad)
    assert len(MEMO) == 0
    ready = raw({"kind": "ready", "epoch": 1, "step": 0, "bucket": 0, "spec": "h", "x": 1})
    for _ in range(2):
        with pytest.raises(ProtocolError, match="ready message has an unknown field 'x'"):
            event_from_wire(decode_frame(ready), rank=3, now=0.0)
    assert len(MEMO) == 0


def test_only_short_items_of_the_hot_report_kinds_are_kept() -> None:
    join = Joined(1, (("w", (2,), "float32", True),), ("10.0.0.1", 7001))
    decode_frame(framed(join))
    assert len(MEMO) == 0  # a join: decoded whole every time
    long = Ready(0, 1, 0, tuple(((4, 4), "float32") for _ in range(400)), 1)
    assert len(framed(long)) > MEMO_MAX_ITEM
    decode_frame(framed(long))
    assert len(MEMO) == 0
    for step in range(MEMO_ENTRIES + 5):
        decode_frame(framed(Ready(0, step, 0, "xxh3:" + "2" * 32, 1, cached=True)))
        assert 1 <= len(MEMO) <= MEMO_ENTRIES


@pytest.mark.parametrize(
    ("message", "key"),
    [
        (
            Ready(0, 0, 2, (((4, 4), "float32"), ((3,), "float16")), 1),
            "spec",
        ),  # lists of lists of lists
        (Digest(0, 1, b"d" * 16, (), 1, b"\x01" * 32, ("a", "b")), "names"),  # a list of text
    ],
)
def test_every_list_of_a_kept_map_is_a_copy(message: Any, key: str) -> None:
    frame = framed(message)
    pristine = cbor2.loads(frame[8:])[key]
    for _ in range(2):  # the map decoded (then kept), then one answered from the memo
        value = decode_frame(frame)[key]
        value.append("more")
        if type(value[0]) is list:
            value[0].append("more")
            if type(value[0][0]) is list:
                value[0][0].append(7)
    assert decode_frame(frame)[key] == pristine
    assert event_from_wire(decode_frame(frame), rank=0, now=0.0) == message
