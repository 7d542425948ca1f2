"""Frame authentication after the handshake (`paramsync.runtime.protocol.frame_auth`, issue 18 row
1): the session key both handshake sides derive, and the per-frame MAC with its implicit counter
(any single-bit flip, drop, duplicate or swap of frames is detected)."""

from __future__ import annotations

import hashlib
import hmac

import cpace_spec
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from paramsync.runtime.errors import FrameAuthenticationError, HandshakeError
from paramsync.runtime.protocol.frame_auth import (
    COUNTER_LIMIT,
    DIALER_TO_LISTENER,
    LISTENER_TO_DIALER,
    FrameOpener,
    FrameSealer,
    direction_keys,
    frame_nonce,
    frame_session,
)
from paramsync.runtime.protocol.handshake import (
    PROCESS_SALT,
    DialerHandshake,
    Identity,
    ListenerHandshake,
    NonceLedger,
    stretch_secret,
)
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.wire import TRAILER_SIZE, encode_frame, encode_frame_bytes

SECRET = b"correct horse battery staple"
DIALER = Identity("g", 4, 2)
LISTENER = Identity("g", 4, 0)
Y_D, Y_L = b"\x05" * 32, b"\x06" * 32
"""The key exchange's scalars, fixed so the spec's values can be recomputed here."""


def _handshake(
    secret: bytes = SECRET,
    dialer: Identity = DIALER,
    listener: Identity = LISTENER,
    dialer_nonce: bytes = b"d" * 32,
    listener_nonce: bytes = b"l" * 32,
) -> tuple[DialerHandshake, ListenerHandshake]:
    dial = DialerHandshake(secret, dialer, nonce=dialer_nonce, scalar=Y_D)
    listen = ListenerHandshake(
        secret,
        listener,
        lambda _peer: None,
        nonce=listener_nonce,
        ledger=NonceLedger(),
        scalar=Y_L,
    )
    kind, fields = dial.hello()
    kind, fields = listen.on_hello({"kind": kind, **fields})
    kind, fields = dial.on_challenge({"kind": kind, **fields})
    kind, fields, error = listen.on_auth({"kind": kind, **fields})
    assert error is None
    dial.on_verdict({"kind": kind, **fields})
    return dial, listen


# ------------------------------------------------------------------------- the session key


def test_both_sides_derive_the_same_session_key_as_the_spec_says() -> None:
    dial, listen = _handshake()
    key = dial.session_key()
    assert key == listen.session_key() and len(key) == 32
    transcript = (
        b"paramsync/session"
        + PROTOCOL_VERSION.to_bytes(2, "big")
        + b"d" * 32
        + b"l" * 32
        + b"\x00\x01g"
        + (4).to_bytes(4, "big")
        + (3).to_bytes(4, "big")
        + b"\x00\x01g"
        + (4).to_bytes(4, "big")
        + (1).to_bytes(4, "big")
    )
    # The session key is keyed by the key exchange's ISK (section 5.1), recomputed from the
    # document: the generator from the stretched secret, the dialer's group and nonce.
    *_, isk = cpace_spec.exchange(stretch_secret(SECRET, PROCESS_SALT), "g", 4, b"d" * 32, Y_D, Y_L)
    assert key == hmac.new(isk, transcript, hashlib.sha256).digest()


@pytest.mark.parametrize(
    "change",
    [
        {"dialer_nonce": b"D" * 32},
        {"listener_nonce": b"L" * 32},
        {"dialer": Identity("g", 4, 3)},
        {"listener": Identity("g", 4, 1)},
        {"secret": b"another secret entirely"},
    ],
    ids=["dialer-nonce", "listener-nonce", "dialer-identity", "listener-identity", "secret"],
)
def test_the_session_key_changes_with_each_input(change: dict) -> None:
    base = _handshake()[0].session_key()
    dial, listen = _handshake(**change)
    assert dial.session_key() == listen.session_key() != base


def test_no_session_key_before_the_handshake_completes() -> None:
    dial = DialerHandshake(SECRET, DIALER)
    listen = ListenerHandshake(SECRET, LISTENER, lambda _peer: None, ledger=NonceLedger())
    for side in (dial, listen):
        with pytest.raises(HandshakeError, match="the handshake has not completed"):
            side.session_key()
    kind, fields = dial.hello()
    kind, fields = listen.on_hello({"kind": kind, **fields})
    kind, fields = dial.on_challenge({"kind": kind, **fields})
    with pytest.raises(HandshakeError, match="has not completed"):
        dial.session_key()  # the challenge checked out, but no welcome yet
    refusing = ListenerHandshake(SECRET, LISTENER, lambda _peer: "no", ledger=NonceLedger())
    kind, fields = refusing.on_hello(
        {"kind": "hello", **DialerHandshake(SECRET, DIALER).hello()[1]}
    )
    refusing.on_auth({"kind": "auth", "share": b"\x09" * 32, "proof": b"x" * 32})
    with pytest.raises(HandshakeError, match="has not completed"):
        refusing.session_key()


# ------------------------------------------------------------------------- keys and tags


def test_direction_keys_and_tags_follow_the_spec() -> None:
    session = bytes(range(32))
    to_listener, to_dialer = direction_keys(session)
    assert to_listener == hmac.new(session, DIALER_TO_LISTENER, hashlib.sha256).digest()
    assert to_dialer == hmac.new(session, LISTENER_TO_DIALER, hashlib.sha256).digest()
    frame = encode_frame_bytes("abort", {"reason": "stop"})
    sealer = FrameSealer(to_listener, counter=5)
    trailer = sealer.seal([frame])
    assert len(trailer) == TRAILER_SIZE and trailer[0] == 0x50
    # GMAC: AES-256-GCM, empty plaintext, the frame as associated data, nonce 0^4 || u64 BE.
    assert trailer[1:] == AESGCM(to_listener).encrypt(frame_nonce(5), b"", frame)
    assert frame_nonce(5) == bytes(4) + (5).to_bytes(8, "big")


def test_dialer_and_listener_ends_pair_up() -> None:
    key = bytes(32)
    dialer, listener = frame_session(key, dialer=True), frame_session(key, dialer=False)
    frame = encode_frame_bytes("abort", {"reason": "x"})
    listener.opener.open([frame], dialer.sealer.seal([frame]))
    dialer.opener.open([frame], listener.sealer.seal([frame]))
    # A frame reflected back to its sender fails: the two directions have their own keys.
    with pytest.raises(FrameAuthenticationError):
        dialer.opener.open([frame], dialer.sealer.seal([frame]))


def test_a_bulk_frame_is_tagged_part_by_part_as_one_byte_string() -> None:
    import torch

    bulk = torch.arange(100_000, dtype=torch.float32)  # 400 kB: the streaming path
    parts = encode_frame("abort", {"reason": "g"}, bulk)
    assert len(parts) == 2
    key = bytes(range(32))
    trailer = FrameSealer(key).seal(parts)
    joined = b"".join(bytes(part) for part in parts)
    assert trailer == FrameSealer(key).seal([joined])
    FrameOpener(key).open([joined[:3], joined[3:]], trailer)  # the split does not matter
    flipped = bytearray(joined)
    flipped[-5] ^= 0x01
    with pytest.raises(FrameAuthenticationError, match="frame authentication failed"):
        FrameOpener(key).open([bytes(flipped)], trailer)


def test_rewind_gives_back_the_number_of_a_frame_that_never_left() -> None:
    key = bytes(32)
    sealer, opener = FrameSealer(key), FrameOpener(key)
    first, second = b"\0\0\0\1\0\0\0\0a", b"\0\0\0\1\0\0\0\0b"
    sealer.seal([first])
    sealer.rewind()  # cancelled before a byte was sent
    opener.open([second], sealer.seal([second]))
    with pytest.raises(ValueError):
        FrameSealer(key).rewind()


def test_the_counter_stops_before_wrapping() -> None:
    sealer = FrameSealer(bytes(32), counter=COUNTER_LIMIT - 1)
    trailer = sealer.seal([b"last"])
    FrameOpener(bytes(32), counter=COUNTER_LIMIT - 1).open([b"last"], trailer)
    with pytest.raises(FrameAuthenticationError, match="counter reached"):
        sealer.seal([b"one too many"])
    with pytest.raises(FrameAuthenticationError, match="counter reached"):
        FrameOpener(bytes(32), counter=COUNTER_LIMIT).open([b"x"], trailer)


def test_a_malformed_trailer_is_a_frame_authentication_error() -> None:
    frame = encode_frame_bytes("abort", {"reason": "x"})
    trailer = FrameSealer(bytes(32)).seal([frame])
    with pytest.raises(FrameAuthenticationError, match="must end with its 16-byte tag"):
        FrameOpener(bytes(32)).open([frame], b"\x00" + trailer[1:])


# ------------------------------------------------------------------------- tampering


def _frames(count: int) -> list[bytes]:
    return [encode_frame_bytes("abort", {"reason": f"frame {i}"}) for i in range(count)]


def _receive(wire: list[tuple[bytes, bytes]], key: bytes) -> list[bytes]:
    """What a receiver accepts of ``wire`` (frame, trailer pairs) before the first failure."""
    opener, accepted = FrameOpener(key), []
    for frame, trailer in wire:
        try:
            opener.open([frame], trailer)
        except FrameAuthenticationError:
            break
        accepted.append(frame)
    return accepted


def _sent(frames: list[bytes], key: bytes) -> list[tuple[bytes, bytes]]:
    sealer = FrameSealer(key)
    return [(frame, sealer.seal([frame])) for frame in frames]


KEYS = st.binary(min_size=32, max_size=32)


@settings(max_examples=150, deadline=None)
@given(key=KEYS, data=st.data())
def test_any_single_bit_flip_is_detected(key: bytes, data: st.DataObject) -> None:
    wire = _sent(_frames(4), key)
    index = data.draw(st.integers(0, len(wire) - 1))
    frame, trailer = wire[index]
    whole = bytearray(frame + trailer)
    bit = data.draw(st.integers(0, len(whole) * 8 - 1))
    whole[bit // 8] ^= 1 << (bit % 8)
    wire[index] = (bytes(whole[: len(frame)]), bytes(whole[len(frame) :]))
    assert _receive(wire, key) == [f for f, _ in wire[:index]]


@settings(max_examples=60, deadline=None)
@given(key=KEYS, count=st.integers(2, 6), data=st.data())
def test_a_dropped_duplicated_or_swapped_frame_is_detected(
    key: bytes, count: int, data: st.DataObject
) -> None:
    frames = _frames(count)
    wire = _sent(frames, key)
    how = data.draw(st.sampled_from(["drop", "duplicate", "swap"]))
    index = data.draw(st.integers(0, count - 2))
    if how == "drop":
        tampered = wire[:index] + wire[index + 1 :]
    elif how == "duplicate":
        tampered = wire[: index + 1] + wire[index:]
    else:
        tampered = [*wire[:index], wire[index + 1], wire[index], *wire[index + 2 :]]
    # Everything before the tampering is accepted, nothing from it on.
    assert _receive(tampered, key) == frames[: index + (how == "duplicate")]
    assert _receive(wire, key) == frames


@settings(max_examples=40, deadline=None)
@given(key=KEYS, other=KEYS, reason=st.text(max_size=40))
def test_a_frame_forged_without_the_key_is_refused(key: bytes, other: bytes, reason: str) -> None:
    frame = encode_frame_bytes("abort", {"reason": reason})
    forged = FrameSealer(other).seal([frame])
    if other != key:
        with pytest.raises(FrameAuthenticationError):
            FrameOpener(key).open([frame], forged)
