"""Nothing before authentication builds a tensor or imports torch (issue 31, row 3).

A 98-byte ``hello`` holding a 4-byte typed array made the coordinator import torch (1.28 s with
every other handshake blocked, RSS 43 -> 235 MiB for good). Now every handshake frame is decoded
with typed arrays refused, naming the kind and the field, and so is every frame a coordinator
daemon receives (no message to it holds a tensor): the daemon never imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import pytest

from paramsync.runtime.errors import ProtocolError
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.wire import decode_head, decode_item

ROOT = Path(__file__).resolve().parent.parent
INLINE = cbor2.CBORTag(40, [[1], cbor2.CBORTag(85, b"\x00\x00\x80\x3f")])
BARE = cbor2.CBORTag(85, b"\x00\x00\x80\x3f")

PRE_AUTH = {
    "hello": {
        "group": "g",
        "world_size": 2,
        "rank": 0,
        "nonce": b"\x01" * 32,
    },
    "challenge": {"nonce": b"\x02" * 32, "salt": b"\x07" * 16, "share": b"\x06" * 32},
    "auth": {"share": b"\x05" * 32, "proof": b"\x03" * 32},
    "welcome": {"group": "g", "world_size": 2, "rank": -1, "proof": b"\x04" * 32},
    "refuse": {"reason": "no"},
}
"""Every kind a handshake carries, with valid fields."""


@pytest.mark.parametrize("kind", sorted(PRE_AUTH))
@pytest.mark.parametrize("value", [INLINE, BARE, [1, {"x": INLINE}]], ids=["tag40", "bare", "deep"])
def test_a_typed_array_in_any_handshake_field_is_refused_naming_the_kind_and_field(
    kind: str, value: object
) -> None:
    for field in PRE_AUTH[kind]:
        item = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": kind, **PRE_AUTH[kind], field: value})
        with pytest.raises(ProtocolError, match=f"{kind} message: field {field} holds a typed"):
            decode_item(item, tensors=False)
    decode_item(cbor2.dumps({"v": PROTOCOL_VERSION, "kind": kind, **PRE_AUTH[kind]}), tensors=False)


def test_a_bulk_in_a_handshake_frame_is_refused_before_its_head_is_decoded() -> None:
    head = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "hello", **PRE_AUTH["hello"]})
    with pytest.raises(ProtocolError, match="hello frame carries a bulk tensor of 4 bytes"):
        decode_head(head + b"\x44", 4, tensors=False)


def test_the_daemon_refuses_typed_arrays_in_every_pre_auth_frame_and_never_imports_torch() -> None:
    """In a process of its own (this one has torch): a coordinator daemon fed a ``hello`` and
    an ``auth`` holding a typed array (inline, bare, as a bulk), a dialer fed a ``challenge``,
    a ``welcome`` and a ``refuse`` holding one, and the daemon fed an authenticated
    ``heartbeat`` holding one (tests/pre_auth_probe.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "pre_auth_probe.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    assert said["torch"] == [], said
    for case, reply in said["listener"].items():
        kind = case.split()[0]
        if case.endswith("bulk"):  # refused from the prefix, before the head is read
            assert reply == f"refuse: a {kind} frame announces 4 bulk bytes; its kind carries none"
            continue
        assert reply.startswith(f"refuse: {kind} "), (case, reply)
        assert "typed array" in reply, (case, reply)
        assert f"field {case.split()[1] if 'extra' not in case else 'pad'} " in reply
    for case, error in said["dialer"].items():
        # A ProtocolError naming the peer; a listener's bad challenge is one that broke the
        # handshake off (HandshakeAbandoned before a proof, ProofUnanswered after: ProtocolErrors).
        kind, _, rest = error.partition(": ")
        assert kind in ("ProtocolError", "HandshakeAbandoned", "ProofUnanswered"), (case, error)
        assert rest.startswith("peer 127.0.0.1:"), (case, error)
        if case.endswith("bulk"):
            assert "frame announces 4 bulk bytes; its kind carries none" in error, error
        else:
            assert "typed array" in error, (case, error)
    assert "heartbeat message: field pad holds a typed array" in said["after auth"]
    assert said["admitted afterwards"] == -1  # the daemon kept serving: a worker got in
