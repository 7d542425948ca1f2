"""The connection handshake: the sans-I/O state machines, the shared secret, and the TCP
listener under hostile input.

Sans-I/O tests pass every message through the real codec (encode, then decode under the
handshake's frame cap), so they exercise exactly what would cross the wire. TCP tests drive
``paramsync.runtime.transport.tcp.accept``/``dial`` (and ``_serve_until``, the rendezvous' accept
loop) on loopback, always under ``trio.fail_after`` so a hang is a failure.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Any

import cbor2
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from paramsync.runtime.errors import (
    AuthenticationError,
    FrameTooLarge,
    HandshakeError,
    PeerClosed,
    ProtocolError,
    ReplayedHandshake,
)
from paramsync.runtime.protocol.handshake import (
    NONCE_SIZE,
    SECRET_ENV,
    SECRET_FILE_ENV,
    DialerHandshake,
    Identity,
    ListenerHandshake,
    NonceLedger,
    listener_proof,
    load_secret,
    stretch_secret,
)
from paramsync.runtime.protocol.wire import (
    HANDSHAKE_MAX_FRAME,
    PROTOCOL_VERSION,
    decode_frame,
    encode_frame_bytes,
)
from paramsync.runtime.transport import tcp

SECRET = b"correct horse battery staple"
OTHER_SECRET = b"incorrect donkey battery staple"
SHARE = b"\x09" * 32
"""A key share (a point of no low order) for forged auth messages."""
GROUP = "test-group"
LISTENER = Identity(GROUP, 4, 0)
DIALER = Identity(GROUP, 4, 2)


def over_the_wire(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Encode and decode a handshake message, as a peer would receive it."""
    frame = encode_frame_bytes(kind, fields)
    assert len(frame) <= HANDSHAKE_MAX_FRAME + 8
    return decode_frame(frame, HANDSHAKE_MAX_FRAME)


def admit_all(_peer: Identity) -> str | None:
    return None


def run_sans_io(
    dialer: DialerHandshake, listener: ListenerHandshake
) -> tuple[Identity | Exception, Exception | str | None]:
    """Play the four messages. Returns (the dialer's outcome, the listener's error)."""
    challenge = over_the_wire(*listener.on_hello(over_the_wire(*dialer.hello())))
    assert set(challenge) == {"v", "kind", "nonce", "salt", "share"}  # nothing about the listener
    auth = over_the_wire(*dialer.on_challenge(challenge))
    kind, fields, error = listener.on_auth(auth)
    assert (kind == "welcome") == (error is None)
    verdict = over_the_wire(kind, fields)
    try:
        return dialer.on_verdict(verdict), error
    except HandshakeError as exc:
        return exc, error


# --------------------------------------------------------------------------- sans-I/O


def test_happy_path_admits_the_authenticated_dialer() -> None:
    admitted: list[Identity] = []

    def admit(peer: Identity) -> str | None:
        admitted.append(peer)
        return None

    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit)
    outcome, error = run_sans_io(dialer, listener)
    assert outcome == LISTENER and error is None
    assert listener.peer == DIALER and dialer.peer == LISTENER
    assert admitted == [DIALER]


@settings(max_examples=30, deadline=None)  # each new secret costs one scrypt (~50 ms)
@given(
    group=st.text(max_size=128),
    world_size=st.integers(1, 1 << 16),
    data=st.data(),
    secret=st.binary(min_size=16, max_size=256),
)
def test_happy_path_for_any_identity(
    group: str, world_size: int, data: st.DataObject, secret: bytes
) -> None:
    dialer_rank = data.draw(st.integers(-1, world_size - 1))
    listener_rank = data.draw(st.integers(-1, world_size - 1))
    dialer = DialerHandshake(secret, Identity(group, world_size, dialer_rank))
    listener = ListenerHandshake(secret, Identity(group, world_size, listener_rank), admit_all)
    outcome, error = run_sans_io(dialer, listener)
    assert error is None
    assert outcome == Identity(group, world_size, listener_rank)


def test_listener_with_the_wrong_secret_refuses_and_both_sides_raise() -> None:
    """The dialer proves first, so a listener holding another secret refuses its proof."""
    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(OTHER_SECRET, LISTENER, admit_all)
    outcome, error = run_sans_io(dialer, listener)
    assert isinstance(outcome, AuthenticationError), outcome
    assert isinstance(error, AuthenticationError), error


def test_dialer_with_the_wrong_secret_is_refused_on_both_sides() -> None:
    """A dialer holding the wrong secret sends its auth and is refused; both sides raise
    AuthenticationError with the same sentence, and the listener said nothing about itself."""
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    dialer = DialerHandshake(OTHER_SECRET, DIALER)
    challenge = over_the_wire(*listener.on_hello(over_the_wire(*dialer.hello())))
    kind, fields, error = listener.on_auth(over_the_wire(*dialer.on_challenge(challenge)))
    assert kind == "refuse" and isinstance(error, AuthenticationError)
    assert set(fields) <= {"reason", "auth", "busy"}  # no identity, no proof
    with pytest.raises(AuthenticationError) as dialer_error:
        dialer.on_verdict(over_the_wire(kind, fields))
    assert fields["reason"] in str(dialer_error.value)
    assert fields["reason"] == str(error)
    assert listener.peer is None and dialer.peer is None


def test_a_rogue_listener_without_the_secret_fails_the_dialers_check() -> None:
    """A listener that welcomes without the secret (its proof made with another secret, or
    the dialer's own proof reflected) is caught by the dialer before it trusts the welcome."""
    for forge in ("other-secret", "reflected", "zeros"):
        dialer = DialerHandshake(SECRET, DIALER)
        rogue = ListenerHandshake(OTHER_SECRET, LISTENER, admit_all, ledger=NonceLedger())
        challenge = over_the_wire(*rogue.on_hello(over_the_wire(*dialer.hello())))
        auth = over_the_wire(*dialer.on_challenge(challenge))
        if forge == "other-secret":  # a listener that skips the dialer's check
            proof = listener_proof(
                stretch_secret(OTHER_SECRET, challenge["salt"]),
                dialer._nonce,
                challenge["nonce"],
                DIALER,
                LISTENER,
            )
        elif forge == "reflected":
            proof = auth["proof"]
        else:
            proof = bytes(32)
        welcome = over_the_wire("welcome", {**LISTENER.fields(), "proof": proof})
        with pytest.raises(AuthenticationError, match="failed to prove the shared secret"):
            dialer.on_verdict(welcome)
        assert dialer.peer is None
        with pytest.raises(HandshakeError, match="has not completed"):
            dialer.session_key()


@given(proof=st.binary(max_size=64))
def test_a_forged_proof_is_refused(proof: bytes) -> None:
    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    dialer.on_challenge(over_the_wire(*listener.on_hello(over_the_wire(*dialer.hello()))))
    kind, fields, error = listener.on_auth(over_the_wire("auth", {"share": SHARE, "proof": proof}))
    assert kind == "refuse" and isinstance(error, AuthenticationError)
    assert "secret" in fields["reason"]


REFUSALS = {
    "group": (Identity("other-group", 4, 2), admit_all, "group"),
    "world-size": (Identity(GROUP, 8, 2), admit_all, "world size"),
    "taken-rank": (DIALER, lambda peer: f"rank {peer.rank} is already taken", "already taken"),
    "group-named-secret": (Identity("secret", 4, 2), admit_all, "group"),
    "group-with-secret": (Identity("team-secret-7", 4, 2), admit_all, "group"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_admission_refusals_raise_handshake_error_with_the_reason_on_both_sides(case: str) -> None:
    """The dialer authenticated fine, so neither side may call this an authentication error,
    whatever the group names contain."""
    dialer_identity, admit, words = REFUSALS[case]
    dialer = DialerHandshake(SECRET, dialer_identity)
    listener = ListenerHandshake(SECRET, LISTENER, admit)
    outcome, error = run_sans_io(dialer, listener)
    assert type(error) is HandshakeError, repr(error)
    assert type(outcome) is HandshakeError, repr(outcome)
    assert words in str(error)
    assert str(error) in str(outcome)  # the same sentence on both sides


def test_a_replayed_auth_fails_against_a_fresh_challenge() -> None:
    """An eavesdropper replays a recorded session's hello and auth: the listener's new nonce
    makes the old proof worthless."""
    dialer = DialerHandshake(SECRET, DIALER)
    first = ListenerHandshake(SECRET, LISTENER, admit_all)
    hello = over_the_wire(*dialer.hello())
    challenge = over_the_wire(*first.on_hello(hello))
    auth = over_the_wire(*dialer.on_challenge(challenge))
    kind, fields, _ = first.on_auth(auth)
    assert kind == "welcome"
    welcome = over_the_wire(kind, fields)

    # A listener that saw the recorded hello refuses its replay by name...
    with pytest.raises(ReplayedHandshake, match="replayed handshake"):
        ListenerHandshake(SECRET, LISTENER, admit_all).on_hello(hello)
    # ...and one that did not (another process) still fails the recorded proof.
    second = ListenerHandshake(SECRET, LISTENER, admit_all, ledger=NonceLedger())
    second.on_hello(hello)  # the replayed hello
    kind, _, error = second.on_auth(auth)  # the replayed auth
    assert kind == "refuse" and isinstance(error, AuthenticationError)

    # ...and a recorded welcome is worthless to a dialer with a fresh nonce
    fresh = DialerHandshake(SECRET, DIALER)
    fresh.on_challenge(challenge)
    with pytest.raises(AuthenticationError):
        fresh.on_verdict(welcome)


def test_a_reflected_proof_is_refused() -> None:
    """A listener's proof sent back as a dialer's fails, and so does a dialer's sent back as
    a listener's: the labels and transcripts differ."""
    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    challenge = over_the_wire(*listener.on_hello(over_the_wire(*dialer.hello())))
    auth = over_the_wire(*dialer.on_challenge(challenge))
    kind, fields, _ = listener.on_auth(auth)
    assert kind == "welcome"
    # the listener's proof, reflected to a second listener session with the same nonces
    other = ListenerHandshake(
        SECRET, LISTENER, admit_all, nonce=challenge["nonce"], ledger=NonceLedger()
    )
    other.on_hello(over_the_wire(*dialer.hello()))
    kind, _, error = other.on_auth(
        over_the_wire("auth", {"share": auth["share"], "proof": fields["proof"]})
    )
    assert kind == "refuse" and isinstance(error, AuthenticationError)


def test_a_tampered_identity_breaks_the_proof() -> None:
    """A man in the middle rewriting the hello's rank, or the welcome's, cannot produce a
    proof that verifies."""
    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    hello = over_the_wire(*dialer.hello())
    hello["rank"] = 3
    auth = over_the_wire(*dialer.on_challenge(over_the_wire(*listener.on_hello(hello))))
    kind, _, error = listener.on_auth(auth)
    assert kind == "refuse" and isinstance(error, AuthenticationError)

    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    challenge = over_the_wire(*listener.on_hello(over_the_wire(*dialer.hello())))
    kind, fields, _ = listener.on_auth(over_the_wire(*dialer.on_challenge(challenge)))
    with pytest.raises(AuthenticationError):
        dialer.on_verdict(over_the_wire(kind, {**fields, "rank": 1}))


def test_out_of_order_messages_are_handshake_errors() -> None:
    dialer = DialerHandshake(SECRET, DIALER)
    listener = ListenerHandshake(SECRET, LISTENER, admit_all)
    with pytest.raises(HandshakeError):
        listener.on_hello(over_the_wire("auth", {"share": SHARE, "proof": b"x"}))
    short = {**DIALER.fields(), "nonce": b"\x00" * (NONCE_SIZE - 1)}
    with pytest.raises(HandshakeError, match="nonce"):
        listener.on_hello(over_the_wire("hello", short))
    kind, _, error = listener.on_auth(over_the_wire("auth", {"share": SHARE, "proof": b"x" * 32}))
    assert kind == "refuse" and type(error) is HandshakeError  # auth before any hello
    welcome = {**LISTENER.fields(), "proof": b"\x00" * 32}
    with pytest.raises(HandshakeError):
        dialer.on_challenge(over_the_wire("welcome", welcome))
    with pytest.raises(HandshakeError):
        dialer.on_verdict(over_the_wire("welcome", welcome))  # welcome before a challenge
    with pytest.raises(HandshakeError, match="refused: 'busy'"):
        dialer.on_challenge(over_the_wire("refuse", {"reason": "busy"}))


# --------------------------------------------------------------------------- the secret


def test_load_secret_prefers_the_argument_then_the_env_then_the_file(tmp_path: Any) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"from-the-file-123\n")
    path.chmod(0o600)
    env = {SECRET_ENV: "from-the-env-123", SECRET_FILE_ENV: str(path)}
    assert load_secret("from-the-arg-123", env) == b"from-the-arg-123"
    assert load_secret(b"\x00\xffbytes-arg-1234", env) == b"\x00\xffbytes-arg-1234"
    assert load_secret(None, env) == b"from-the-env-123"
    assert load_secret(None, {SECRET_FILE_ENV: str(path)}) == b"from-the-file-123"
    assert load_secret(None, {SECRET_ENV: "", SECRET_FILE_ENV: str(path)}) == b"from-the-file-123"


def test_load_secret_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "process-wide-secret")
    assert load_secret() == b"process-wide-secret"


def test_missing_secret_names_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    for call in (lambda: load_secret(None, {}), lambda: load_secret()):
        with pytest.raises(ValueError, match=SECRET_ENV) as error:
            call()
        assert SECRET_FILE_ENV in str(error.value)


def test_unreadable_or_short_secrets_are_refused(tmp_path: Any) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_secret(None, {SECRET_FILE_ENV: str(missing)})
    with pytest.raises(ValueError, match=r"16 bytes.*paramsync secret"):
        load_secret("short", {})
    with pytest.raises(ValueError, match="16 bytes"):
        load_secret("fifteen-bytes!!", {})  # one short of the minimum
    assert load_secret("sixteen-bytes!!!", {}) == b"sixteen-bytes!!!"
    short_file = tmp_path / "short"
    short_file.write_text("abc\n")
    short_file.chmod(0o600)
    with pytest.raises(ValueError, match="16 bytes"):
        load_secret(None, {SECRET_FILE_ENV: str(short_file)})


# --------------------------------------------------------------------------- over TCP


async def open_listener() -> tuple[trio.SocketListener, tuple[str, int]]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    host, port = listener.socket.getsockname()[:2]
    return listener, (host, port)


async def dial_and_accept(
    dialer_secret: bytes, dialer_identity: Identity, admit: Any = admit_all
) -> tuple[Any, Any]:
    """One dial against one accept on loopback: each side's (conn, peer) or exception."""
    listener, address = await open_listener()
    outcomes: dict[str, Any] = {}

    async def listen() -> None:
        stream = await listener.accept()
        try:
            outcomes["listener"] = await tcp.accept(stream, SECRET, LISTENER, admit)
        except Exception as exc:
            outcomes["listener"] = exc

    async def dial() -> None:
        try:
            outcomes["dialer"] = await tcp.dial(address, dialer_secret, dialer_identity)
        except Exception as exc:
            outcomes["dialer"] = exc

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            nursery.start_soon(dial)
    await listener.aclose()
    return outcomes["dialer"], outcomes["listener"]


async def test_tcp_handshake_happy_path_then_messages_flow() -> None:
    dialer, listener = await dial_and_accept(SECRET, DIALER)
    (dial_conn, dial_peer), (accept_conn, accept_peer) = dialer, listener
    assert dial_peer == LISTENER and accept_peer == DIALER
    assert dial_conn.peer == LISTENER.rank and accept_conn.peer == DIALER.rank
    await dial_conn.send("refuse", {"reason": "ping"})
    assert (await accept_conn.recv())["reason"] == "ping"
    await dial_conn.aclose()
    await accept_conn.aclose()


async def test_tcp_dialer_with_the_wrong_secret_gets_authentication_error() -> None:
    dialer, listener = await dial_and_accept(OTHER_SECRET, DIALER)
    assert isinstance(dialer, AuthenticationError), repr(dialer)
    assert isinstance(listener, ProtocolError), repr(listener)  # it hung up: PeerClosed


async def test_tcp_admission_refusal_reaches_both_sides() -> None:
    dialer, listener = await dial_and_accept(SECRET, Identity(GROUP, 9, 2))
    assert type(dialer) is HandshakeError and type(listener) is HandshakeError
    assert "world size" in str(dialer) and "world size" in str(listener)


# Hostile clients. Each is a list of steps: bytes to send, "read" (wait for one frame or EOF),
# then the connection closes (politely, or with a reset).


def frame(kind: str, fields: dict[str, Any]) -> bytes:
    return encode_frame_bytes(kind, fields)


def hello_frame(identity: Identity = DIALER, nonce: bytes | None = None) -> bytes:
    return frame("hello", {**identity.fields(), "nonce": nonce or b"\x07" * NONCE_SIZE})


def bytes_header(length: int) -> bytes:
    """The canonical CBOR byte-string header (major type 2) for ``length`` bytes."""
    if length < 24:
        return bytes([0x40 | length])
    for info, size in ((24, 1), (25, 2), (26, 4)):
        if length < 1 << (8 * size):
            return bytes([0x40 | info]) + length.to_bytes(size, "big")
    raise ValueError(length)


def bulk_head(bulk_len: int) -> bytes:
    """A coll frame's prefix and head announcing ``bulk_len`` bytes of uint8, without them."""
    item = cbor2.dumps(
        {
            "v": PROTOCOL_VERSION,
            "kind": "coll",
            "op": 0,
            "hop": 0,
            "part": 0,
            "data": cbor2.CBORTag(40, [[bulk_len], cbor2.CBORTag(64, b"")]),
        }
    )
    head = item[:-1] + bytes_header(bulk_len)
    return struct.pack(">II", len(head) + bulk_len, bulk_len) + head


def flip(data: bytes, at: int, bit: int) -> bytes:
    at %= len(data)
    return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1 :]


@st.composite
def hostile_clients(draw: st.DrawFn) -> tuple[list[bytes | str], bool]:
    style = draw(
        st.sampled_from(
            [
                "random",
                "random-behind-prefix",
                "mutated-hello",
                "truncated-hello",
                "oversized-prefix",
                "huge-bulk",
                "wrong-first-kind",
                "hello-then-garbage",
                "hello-then-forged-auth",
                "hello-then-reflected-auth",
                "hello-then-hello",
                "bad-hello-fields",
                "silent",
            ]
        )
    )
    garbage = st.binary(min_size=1, max_size=300)
    steps: list[bytes | str]
    if style == "random":
        steps = [draw(garbage)]
    elif style == "random-behind-prefix":
        body = draw(garbage)
        steps = [struct.pack(">II", len(body), 0) + body]
    elif style == "mutated-hello":
        data = hello_frame()
        for _ in range(draw(st.integers(1, 4))):
            data = flip(data, draw(st.integers(0, 10**6)), draw(st.integers(0, 7)))
        steps = [data, "read"]
    elif style == "truncated-hello":
        data = hello_frame()
        steps = [data[: draw(st.integers(1, len(data) - 1))]]
    elif style == "oversized-prefix":
        item_len = draw(st.integers(HANDSHAKE_MAX_FRAME + 1, 2**32 - 1))
        steps = [struct.pack(">II", item_len, 0) + draw(st.binary(max_size=64))]
    elif style == "huge-bulk":
        steps = [bulk_head(draw(st.integers(1, 64 << 20))) + draw(st.binary(max_size=64))]
    elif style == "wrong-first-kind":
        steps = [
            draw(
                st.sampled_from(
                    [
                        frame("welcome", {**LISTENER.fields(), "proof": b"\x00" * 32}),
                        frame("auth", {"share": SHARE, "proof": b"\x00" * 32}),
                        frame("refuse", {"reason": "x"}),
                        frame("rdv_join", {"host": "h", "port": 1}),
                        frame("coll", {"op": 0, "hop": 0, "part": 0, "data": torch.zeros(2)}),
                    ]
                )
            ),
            "read",
        ]
    elif style == "hello-then-garbage":
        steps = [hello_frame(), "read", draw(garbage)]
    elif style == "hello-then-forged-auth":
        proof = draw(st.binary(max_size=64))
        steps = [hello_frame(), "read", frame("auth", {"share": SHARE, "proof": proof}), "read"]
    elif style == "hello-then-reflected-auth":
        steps = [hello_frame(), "read", "reflect", "read"]
    elif style == "hello-then-hello":
        steps = [hello_frame(), "read", hello_frame(), "read"]
    elif style == "bad-hello-fields":
        fields = {**DIALER.fields(), "nonce": b"\x01" * NONCE_SIZE}
        key = draw(st.sampled_from(sorted(fields)))
        fields[key] = draw(st.sampled_from([None, -5, "x" * 200, b"\x00" * 40, 2**70, [1]]))
        item = cbor2.dumps({"v": PROTOCOL_VERSION, "kind": "hello", **fields})
        steps = [struct.pack(">II", len(item), 0) + item, "read"]
    else:  # silent: connect and close without a word
        steps = []
    return steps, draw(st.booleans())


async def play_hostile_client(
    address: tuple[str, int], steps: list[bytes | str], reset: bool
) -> None:
    try:
        stream = await trio.open_tcp_stream(*address)
    except OSError:  # pragma: no cover - loopback refusing a connection
        return
    conn = tcp.Connection(stream)
    challenge: dict[str, Any] | None = None
    try:
        for step in steps:
            if step == "read":
                with trio.move_on_after(0.5):
                    try:
                        challenge = await conn.recv(HANDSHAKE_MAX_FRAME)
                    except ProtocolError:
                        return
            elif step == "reflect":  # the listener's own nonce, as if it were a proof
                proof = challenge["nonce"] if challenge and "nonce" in challenge else b"\x00"
                await stream.send_all(frame("auth", {"share": SHARE, "proof": proof}))
            else:
                assert isinstance(step, bytes)
                await stream.send_all(step)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if reset:  # close with RST instead of FIN
            linger = struct.pack("ii", 1, 0)
            try:
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            except OSError:
                pass
        await stream.aclose()


async def serve_and_judge(clients: list[tuple[list[bytes | str], bool]]) -> list[Any]:
    """A listener serving with paramsync.runtime.transport.tcp.accept in a loop that logs refusals
    and continues, as the rendezvous does. The hostile clients connect one after the other, then a
    good dialer joins on the same listener. Returns every accept outcome in order of completion."""
    listener, address = await open_listener()
    outcomes: list[Any] = []
    all_judged = trio.Event()
    claimed: set[int] = set()

    def admit(peer: Identity) -> str | None:
        if peer.rank in claimed:
            return f"rank {peer.rank} is already taken"
        claimed.add(peer.rank)
        return None

    async def handle(stream: trio.SocketStream) -> None:
        try:
            outcomes.append(await tcp.accept(stream, SECRET, LISTENER, admit))
        except ProtocolError as exc:
            logging.getLogger(__name__).info("refused: %s", exc)
            outcomes.append(exc)
        except Exception as exc:  # the bug this test hunts: recorded, then asserted on
            outcomes.append(exc)
        if len(outcomes) == len(clients) + 1:
            all_judged.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(handle, stream)

            nursery.start_soon(serve)
            for steps, reset in clients:
                await play_hostile_client(address, steps, reset)
            conn, peer = await tcp.dial(address, SECRET, DIALER)
            assert peer == LISTENER
            await all_judged.wait()
            await conn.aclose()
            nursery.cancel_scope.cancel()
    await listener.aclose()
    return outcomes


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clients=st.lists(hostile_clients(), min_size=1, max_size=3))
def test_listener_only_raises_protocol_errors_and_keeps_serving(
    clients: list[tuple[list[bytes | str], bool]],
) -> None:
    for steps, reset in clients:
        note(f"reset={reset} steps={[s if isinstance(s, str) else s[:80].hex() for s in steps]}")
    outcomes = trio.run(serve_and_judge, clients)
    good = [o for o in outcomes if isinstance(o, tuple)]
    bad = [o for o in outcomes if not isinstance(o, tuple)]
    assert len(good) == 1 and good[0][1] == DIALER, outcomes
    for error in bad:
        assert isinstance(error, ProtocolError), f"{type(error).__name__}: {error!r}"


async def test_serve_until_survives_garbage_and_admits_the_real_rank() -> None:
    """The rendezvous' own accept loop, fed a fixed battery of hostile connections first."""
    listener, address = await open_listener()
    me = Identity(GROUP, 2, 0)
    mesh: dict[int, tcp.Connection] = {}
    battery: list[tuple[list[bytes | str], bool]] = [
        ([os.urandom(200)], False),
        ([struct.pack(">II", 2**32 - 1, 0)], False),
        ([hello_frame(Identity(GROUP, 2, 1))[:20]], True),
        (
            [
                hello_frame(Identity(GROUP, 2, 1)),
                "read",
                frame("auth", {"share": SHARE, "proof": b"x" * 32}),
            ],
            False,
        ),
        ([b"\x00\x00\x00\x0b\x00\x00\x00\x00" + b"\x81" * 10 + b"\x00"], False),
        ([frame("welcome", {**LISTENER.fields(), "proof": b"\x00" * 32}), "read"], True),
        ([bulk_head(1000) + b"\x00" * 10], False),
        ([], True),
    ]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tcp._serve_until, listener, me, SECRET, mesh, {1})
            for steps, reset in battery:
                await play_hostile_client(address, steps, reset)
            conn, peer = await tcp.dial(address, SECRET, Identity(GROUP, 2, 1))
            assert peer == me
    assert set(mesh) == {1}
    await mesh[1].send("refuse", {"reason": "hi"})
    assert (await conn.recv())["reason"] == "hi"
    await conn.aclose()
    await mesh[1].aclose()
    await listener.aclose()


async def test_listener_refuses_a_pre_auth_frame_without_reading_its_bulk() -> None:
    """Before authentication a frame is capped at HANDSHAKE_MAX_FRAME bytes, bulk included: a
    stranger announcing a 1 GiB tensor must be refused at once, not served a 1 GiB buffer that
    the listener then waits to fill (it would stall until the handshake deadline)."""
    listener, address = await open_listener()
    result: list[Any] = []
    judged = trio.Event()

    async def listen() -> None:
        stream = await listener.accept()
        try:
            result.append(await tcp.accept(stream, SECRET, LISTENER, admit_all))
        except Exception as exc:
            result.append(exc)
        judged.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        client = await trio.open_tcp_stream(*address)
        await client.send_all(bulk_head(1 << 30))  # and then keep the connection open
        with trio.move_on_after(3):
            await judged.wait()
        nursery.cancel_scope.cancel()
        await client.aclose()
    await listener.aclose()
    assert result, "the listener was still reading the stranger's bulk 3 s later"
    assert isinstance(result[0], ProtocolError), repr(result[0])


async def test_oversized_pre_auth_prefix_is_frame_too_large_and_refused() -> None:
    listener, address = await open_listener()
    result: list[Any] = []

    async def listen() -> None:
        stream = await listener.accept()
        try:
            result.append(await tcp.accept(stream, SECRET, LISTENER, admit_all))
        except Exception as exc:
            result.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            client = await trio.open_tcp_stream(*address)
            await client.send_all(struct.pack(">II", HANDSHAKE_MAX_FRAME + 1, 0))
            reply = await tcp.Connection(client).recv(HANDSHAKE_MAX_FRAME)
    assert reply["kind"] == "refuse"
    assert isinstance(result[0], FrameTooLarge), repr(result[0])
    await client.aclose()
    await listener.aclose()


async def test_listener_hangs_up_on_a_silent_client_at_its_deadline() -> None:
    listener, address = await open_listener()
    result: list[Any] = []

    async def listen() -> None:
        stream = await listener.accept()
        try:
            result.append(
                await tcp.accept(stream, SECRET, LISTENER, admit_all, handshake_seconds=0.3)
            )
        except Exception as exc:
            result.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            client = await trio.open_tcp_stream(*address)
            with pytest.raises(PeerClosed):
                await tcp.Connection(client).recv(HANDSHAKE_MAX_FRAME)
    assert isinstance(result[0], HandshakeError) and "within" in str(result[0])
    await client.aclose()
    await listener.aclose()
