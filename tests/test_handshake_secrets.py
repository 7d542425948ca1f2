"""The shared secret under attack (issue 18, rows 2 and 12): an offline guesser against a live
listener, the scrypt stretching, the session key, `paramsync secret` and the secret file's
permissions.

Row 2: a stranger that connects and sends one hello must get a reply with nothing to test
guesses of the secret against (no proof, no identity of the listener); the dialer proves first,
and every HMAC is keyed with the secret stretched by scrypt, so even a rogue listener holding a
dialer's proof pays one scrypt per guess. The proofs and the session key are recomputed here
from docs/protocol.md section 5.1 alone, as an independent implementation would.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import string
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cpace_spec
import pytest
import trio

import paramsync.runtime.protocol.handshake as handshake_module
from paramsync.runtime.cli.main import main as cli_main
from paramsync.runtime.coordinator.service import Coordinator
from paramsync.runtime.errors import AuthenticationError, HandshakeError
from paramsync.runtime.protocol.handshake import (
    NONCE_SIZE,
    PROCESS_SALT,
    SALT_SIZE,
    SECRET_FILE_ENV,
    SECRET_MIN_BITS,
    DialerHandshake,
    Identity,
    ListenerHandshake,
    NonceLedger,
    dialer_proof,
    listener_proof,
    load_secret,
    new_secret,
    secret_strength_bits,
    stretch_secret,
)
from paramsync.runtime.protocol.wire import HANDSHAKE_MAX_FRAME, decode_frame, encode_frame_bytes
from paramsync.runtime.transport import tcp

ROOT = Path(__file__).resolve().parent.parent
WEAK_SECRET = b"password12345678"
"""A weak secret (16 bytes, the minimum, and in any attacker's dictionary)."""
DICTIONARY = [
    f"{word}{digits}".encode()
    for word in ("letmein", "qwerty", "password", "paramsync", "dragon", "monkey")
    for digits in ("12345678", "123456789", "87654321", "00000000", "11111111")
]
assert WEAK_SECRET in DICTIONARY
SECRET = b"handshake-secrets-tests-32-bytes"
GROUP = tcp.DEFAULT_GROUP
DIALER = Identity(GROUP, 4, 2)
LISTENER = Identity(GROUP, 4, 0)


# --------------------------------------------------------------------------- the spec, again


def spec_transcript(
    label: bytes, version: int, first: bytes, second: bytes, *identities: Identity
) -> bytes:
    """docs/protocol.md section 5.1's transcript, written from the document."""
    out = label + version.to_bytes(2, "big") + first + second
    for ident in identities:
        group = ident.group.encode("utf-8")
        out += len(group).to_bytes(2, "big") + group
        out += ident.world_size.to_bytes(4, "big") + (ident.rank + 1).to_bytes(4, "big")
    return out


def spec_key(secret: bytes, salt: bytes) -> bytes:
    """docs/protocol.md section 5.1's key: scrypt with the documented parameters, salted with
    the label and the listener's salt."""
    return hashlib.scrypt(
        secret, salt=b"paramsync/secret/v4" + salt, n=16384, r=8, p=1, maxmem=64 << 20, dklen=32
    )


def spec_mac(key: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, transcript, hashlib.sha256).digest()


# --------------------------------------------------------------------------- the guesser


def guess_test(hello: dict[str, Any], reply: dict[str, Any]) -> Callable[[bytes], bool] | None:
    """What one hello's reply lets an offline guesser test candidate secrets against: a
    function saying whether a candidate is the secret, or None when the reply carries nothing
    to test against (no proof, or no identity to rebuild the proof's transcript from).

    It knows every handshake this project has spoken: a listener proof in the first reply, over
    (dialer nonce, listener nonce, dialer, listener), keyed by the raw or the stretched secret."""
    proof = reply.get("proof")
    if not isinstance(proof, bytes) or not {"group", "world_size", "rank"} <= set(reply):
        return None
    dialer = Identity(hello["group"], hello["world_size"], hello["rank"])
    listener = Identity(reply["group"], reply["world_size"], reply["rank"])
    transcript = spec_transcript(
        b"paramsync/listener", reply["v"], hello["nonce"], reply["nonce"], dialer, listener
    )

    def is_the_secret(candidate: bytes) -> bool:
        return any(
            hmac.compare_digest(spec_mac(key, transcript), proof)
            for key in (candidate, spec_key(candidate, reply.get("salt", b"")))
        )

    return is_the_secret


def crack(test: Callable[[bytes], bool] | None, candidates: list[bytes]) -> bytes | None:
    if test is None:
        return None
    return next((candidate for candidate in candidates if test(candidate)), None)


async def one_hello(address: tuple[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stranger's one hello (claiming rank 0 of a world of 2) and the listener's reply."""
    hello_kind, hello = DialerHandshake(
        b"the stranger holds no secret", Identity(GROUP, 2, 0)
    ).hello()
    stream = await trio.open_tcp_stream(*address)
    conn = tcp.Connection(stream)
    try:
        await conn.send(hello_kind, hello)
        with trio.fail_after(10):
            reply = await conn.recv(HANDSHAKE_MAX_FRAME)
    finally:
        await conn.aclose()
    return hello, reply


async def hello_the_coordinator(secret: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    coordinator = Coordinator(2, secret=secret.decode())
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(coordinator.serve_tcp, "127.0.0.1", 0)
            exchange = await one_hello(address)
            nursery.cancel_scope.cancel()
    return exchange


async def hello_a_mesh_listener(secret: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    address = listener.socket.getsockname()[:2]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tcp._serve_until, listener, Identity(GROUP, 2, 0), secret, {}, {1})
            exchange = await one_hello(address)
            nursery.cancel_scope.cancel()
    await listener.aclose()
    return exchange


@pytest.mark.parametrize("daemon", ["coordinator", "mesh-listener"])
def test_one_hello_gives_an_offline_guesser_nothing_to_test_guesses_against(
    daemon: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18 row 2. Before: the reply to one unauthenticated hello held the listener's
    identity and an HMAC over a transcript the stranger knows, and the dictionary below
    recovered the weak secret from it. Now the reply is a challenge with a nonce only."""
    # load_secret refuses the weak secret (issue 39, row 3); the daemon holds it all the same
    # here, to show the handshake leaks nothing to test it against.
    monkeypatch.setattr(handshake_module, "SECRET_MIN_BITS", 0.0)
    serve = hello_the_coordinator if daemon == "coordinator" else hello_a_mesh_listener
    hello, reply = trio.run(serve, WEAK_SECRET)
    recovered = crack(guess_test(hello, reply), DICTIONARY)
    assert recovered is None, f"recovered the secret {recovered!r} from one hello's reply"
    assert reply["kind"] == "challenge", reply
    assert set(reply) == {"v", "kind", "nonce", "salt", "share"}, f"it discloses {sorted(reply)}"
    assert len(reply["nonce"]) == NONCE_SIZE
    assert reply["salt"] == PROCESS_SALT and len(PROCESS_SALT) == SALT_SIZE  # this process's


def rogue_listener(guess: bytes) -> tuple[bytes, bytes]:
    """A rogue listener answers a worker (who holds WEAK_SECRET) with a share built on the
    generator of its ``guess``; returns the dialer's proof and the proof the rogue expects
    from it if the guess is right (the rogue's own end of the key exchange)."""
    dialer = DialerHandshake(WEAK_SECRET, Identity(GROUP, 2, 1))
    hello = decode_frame(encode_frame_bytes(*dialer.hello()))
    me = Identity(hello["group"], hello["world_size"], hello["rank"])
    y_l, nonce_l, salt = os.urandom(32), os.urandom(NONCE_SIZE), os.urandom(SALT_SIZE)
    share_l = cpace_spec.x25519(
        y_l, cpace_spec.generator(spec_key(guess, salt), GROUP, 2, hello["nonce"])
    )
    challenge = {"kind": "challenge", "nonce": nonce_l, "salt": salt, "share": share_l}
    auth = decode_frame(encode_frame_bytes(*dialer.on_challenge(challenge)))
    isk = cpace_spec.isk(cpace_spec.x25519(y_l, auth["share"]), auth["share"], share_l)
    transcript = spec_transcript(b"paramsync/dialer", 4, nonce_l, hello["nonce"], me)
    return auth["proof"], spec_mac(isk, transcript)


def test_a_rogue_listener_tests_one_guess_per_handshake() -> None:
    """Second security review, row 9. Version 2: a rogue listener got the dialer's proof, an
    HMAC under the stretched secret over a transcript it knows, and guessed offline, a scrypt
    a guess. Now the proof is keyed by the CPace exchange: the rogue's one handshake confirms
    or refutes the one guess its share was built on, and nothing it holds tests any other."""
    proof, expected = rogue_listener(b"letmein12345678")
    assert proof != expected  # its guess was wrong: that is all it learns
    assert proof != spec_mac(
        spec_key(WEAK_SECRET, PROCESS_SALT), b""
    )  # (nothing under K alone either)
    proof, expected = rogue_listener(WEAK_SECRET)
    assert proof == expected  # the right guess: confirmed, online, for this one handshake


def test_a_passive_observer_has_nothing_to_guess_against() -> None:
    """Second security review, row 9: a whole handshake seen on a link without TLS (hello,
    challenge, auth, welcome) under a dictionary secret. Every key an observer can derive from
    a candidate and the transcript (the candidate, its stretched key, a hash of that key and the
    shares) fails to reproduce either proof, the true secret included: the proofs need one
    side's scalar."""
    dialer_id, listener_id = Identity(GROUP, 2, 1), Identity(GROUP, 2, 0)
    dialer = DialerHandshake(WEAK_SECRET, dialer_id)
    listener = ListenerHandshake(WEAK_SECRET, listener_id, lambda _p: None, ledger=NonceLedger())
    hello = decode_frame(encode_frame_bytes(*dialer.hello()))
    challenge = decode_frame(encode_frame_bytes(*listener.on_hello(hello)))
    auth = decode_frame(encode_frame_bytes(*dialer.on_challenge(challenge)))
    kind, fields, _ = listener.on_auth(auth)
    welcome = decode_frame(encode_frame_bytes(kind, fields))
    n_d, n_l = hello["nonce"], challenge["nonce"]
    transcript = spec_transcript(b"paramsync/dialer", 4, n_l, n_d, dialer_id)
    for candidate in DICTIONARY:
        k = spec_key(candidate, challenge["salt"])
        g = cpace_spec.generator(k, GROUP, 2, n_d)
        for key in (candidate, k, cpace_spec.isk(g, auth["share"], challenge["share"])):
            assert spec_mac(key, transcript) != auth["proof"], candidate
    assert welcome["kind"] == "welcome"


# --------------------------------------------------------------------------- the KDF


SALT = b"\x5a" * SALT_SIZE


def test_the_handshake_key_is_scrypt_of_the_secret_and_the_listeners_salt_as_documented() -> None:
    assert stretch_secret(SECRET, SALT) == spec_key(SECRET, SALT)
    assert len(stretch_secret(SECRET, SALT)) == 32
    assert stretch_secret(bytearray(SECRET), SALT) == stretch_secret(SECRET, SALT)
    assert stretch_secret(SECRET + b"!", SALT) != stretch_secret(SECRET, SALT)
    assert stretch_secret(SECRET, b"\x5b" * SALT_SIZE) != stretch_secret(SECRET, SALT)
    with pytest.raises(ValueError, match=f"salt is {SALT_SIZE} bytes"):
        stretch_secret(SECRET, b"short")


def test_one_guess_costs_at_least_10_ms_and_is_paid_once_per_secret_and_salt() -> None:
    costs = []
    for _ in range(3):
        fresh = os.urandom(32)  # never stretched before: no cache
        started = time.perf_counter()
        first = stretch_secret(fresh, SALT)
        costs.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert stretch_secret(fresh, SALT) == first
        again = time.perf_counter() - started
        assert again < min(costs) / 10, (again, costs)  # cached
        started = time.perf_counter()
        stretch_secret(fresh, os.urandom(SALT_SIZE))  # another listener's salt: paid again
        costs.append(time.perf_counter() - started)
    assert min(costs) >= 0.010, costs


def test_a_dictionary_stretched_for_one_listener_is_worthless_against_another() -> None:
    """Third security review, row 4: the scrypt salt was one constant for every deployment, so
    one stretched dictionary served all of them. Now each listener process draws its own salt
    and sends it in its challenge: a rogue dialer holding the right secret's key stretched
    under another salt fails the proof; stretched under this listener's salt, it succeeds."""

    def dial_with(key_for: Callable[[bytes], bytes]) -> tuple[str, Exception | None]:
        listener = ListenerHandshake(
            WEAK_SECRET, LISTENER, lambda _p: None, ledger=NonceLedger(), salt=SALT
        )
        nonce_d, y_d = os.urandom(NONCE_SIZE), os.urandom(32)
        challenge = decode_frame(
            encode_frame_bytes(
                *listener.on_hello({"kind": "hello", **DIALER.fields(), "nonce": nonce_d})
            )
        )
        g = cpace_spec.generator(key_for(challenge["salt"]), GROUP, 4, nonce_d)
        share_d = cpace_spec.x25519(y_d, g)
        isk = cpace_spec.isk(
            cpace_spec.x25519(y_d, challenge["share"]), share_d, challenge["share"]
        )
        proof = spec_mac(
            isk, spec_transcript(b"paramsync/dialer", 4, challenge["nonce"], nonce_d, DIALER)
        )
        kind, _, error = listener.on_auth({"kind": "auth", "share": share_d, "proof": proof})
        return kind, error

    precomputed = spec_key(WEAK_SECRET, b"\x00" * SALT_SIZE)  # another deployment's dictionary
    kind, error = dial_with(lambda _salt: precomputed)
    assert kind == "refuse" and isinstance(error, AuthenticationError)
    assert dial_with(lambda salt: spec_key(WEAK_SECRET, salt)) == ("welcome", None)


def test_every_proof_is_keyed_by_the_key_exchange() -> None:
    """Proofs and the session key recomputed from the document match the implementation's:
    HMACs under the ISK of the CPace exchange (section 5.1), the scalars fixed here."""
    dialer_id, listener_id = Identity(GROUP, 4, 2), Identity(GROUP, 4, 0)
    y_d, y_l = b"\x07" * 32, b"\x08" * 32
    dialer = DialerHandshake(SECRET, dialer_id, scalar=y_d)
    listener = ListenerHandshake(
        SECRET, listener_id, lambda _peer: None, ledger=NonceLedger(), scalar=y_l
    )
    hello = decode_frame(encode_frame_bytes(*dialer.hello()))
    challenge = decode_frame(encode_frame_bytes(*listener.on_hello(hello)))
    auth = decode_frame(encode_frame_bytes(*dialer.on_challenge(challenge)))
    kind, fields, error = listener.on_auth(auth)
    assert kind == "welcome" and error is None
    welcome = decode_frame(encode_frame_bytes(kind, fields))
    assert dialer.on_verdict(welcome) == listener_id
    n_d, n_l = hello["nonce"], challenge["nonce"]
    k = spec_key(SECRET, challenge["salt"])
    _, share_d, share_l, key = cpace_spec.exchange(k, GROUP, 4, n_d, y_d, y_l)
    assert (auth["share"], challenge["share"]) == (share_d, share_l)
    v = welcome["v"]
    assert v == 4
    assert auth["proof"] == spec_mac(
        key, spec_transcript(b"paramsync/dialer", v, n_l, n_d, dialer_id)
    )
    assert welcome["proof"] == spec_mac(
        key, spec_transcript(b"paramsync/listener", v, n_d, n_l, dialer_id, listener_id)
    )
    session = spec_mac(
        key, spec_transcript(b"paramsync/session", v, n_d, n_l, dialer_id, listener_id)
    )
    assert dialer.session_key() == listener.session_key() == session


def test_a_low_order_share_is_refused() -> None:
    """A share whose exchange gives the all-zero point (u = 0, or the order-2 point u = 1 is
    not: u = 0 is) is an AuthenticationError, on either side."""
    dialer = DialerHandshake(SECRET, DIALER)
    challenge = {"kind": "challenge", "nonce": b"\x01" * 32, "salt": SALT, "share": bytes(32)}
    with pytest.raises(AuthenticationError, match="low-order point"):
        dialer.on_challenge(challenge)
    listener = ListenerHandshake(SECRET, LISTENER, lambda _p: None, ledger=NonceLedger())
    listener.on_hello({**DIALER.fields(), "kind": "hello", "nonce": b"\x02" * 32})
    kind, fields, error = listener.on_auth({"kind": "auth", "share": bytes(32), "proof": b""})
    assert kind == "refuse" and isinstance(error, AuthenticationError)
    assert "low-order point" in fields["reason"] and fields["reason"] == error.reason


# --------------------------------------------------------------------------- the session key


def handshake(
    dialer_secret: bytes = SECRET,
    listener_secret: bytes = SECRET,
    dialer_id: Identity = DIALER,
    listener_id: Identity = LISTENER,
    dialer_nonce: bytes = b"\x01" * NONCE_SIZE,
    listener_nonce: bytes = b"\x02" * NONCE_SIZE,
    *,
    dialer_scalar: bytes | None = None,
    listener_scalar: bytes | None = None,
    salt: bytes | None = None,
) -> tuple[DialerHandshake, ListenerHandshake]:
    """A completed handshake (no codec: the sans-I/O machines only)."""
    dialer = DialerHandshake(dialer_secret, dialer_id, nonce=dialer_nonce, scalar=dialer_scalar)
    listener = ListenerHandshake(
        listener_secret,
        listener_id,
        lambda _peer: None,
        nonce=listener_nonce,
        ledger=NonceLedger(),
        scalar=listener_scalar,
        salt=salt,
    )
    auth = dialer.on_challenge(
        {"kind": "challenge", **listener.on_hello({"kind": "hello", **dialer.hello()[1]})[1]}
    )
    kind, fields, error = listener.on_auth({"kind": "auth", **auth[1]})
    assert kind == "welcome" and error is None, fields
    dialer.on_verdict({"kind": kind, **fields})
    return dialer, listener


def test_both_sides_derive_the_same_session_key() -> None:
    dialer, listener = handshake()
    assert len(dialer.session_key()) == 32
    assert dialer.session_key() == listener.session_key()


def test_the_session_key_changes_with_either_nonce_either_identity_or_the_secret() -> None:
    base = handshake()[0].session_key()
    variants = {
        "dialer nonce": handshake(dialer_nonce=b"\x03" * NONCE_SIZE),
        "listener nonce": handshake(listener_nonce=b"\x03" * NONCE_SIZE),
        "dialer identity": handshake(dialer_id=Identity(GROUP, 4, 3)),
        "listener identity": handshake(listener_id=Identity(GROUP, 4, -1)),
        "secret": handshake(SECRET[::-1], SECRET[::-1]),
    }
    keys = {base}
    for name, (dialer, listener) in variants.items():
        key = dialer.session_key()
        assert key == listener.session_key(), name
        assert key not in keys, f"the session key does not depend on the {name}"
        keys.add(key)


def test_no_session_key_before_the_handshake_completed() -> None:
    dialer = DialerHandshake(SECRET, Identity(GROUP, 4, 2))
    listener = ListenerHandshake(
        SECRET, Identity(GROUP, 4, 0), lambda _peer: None, ledger=NonceLedger()
    )
    for side in (dialer, listener):
        with pytest.raises(HandshakeError, match="the handshake has not completed"):
            side.session_key()
    challenge = listener.on_hello({"kind": "hello", **dialer.hello()[1]})
    auth = dialer.on_challenge({"kind": "challenge", **challenge[1]})
    with pytest.raises(HandshakeError, match="the handshake has not completed"):
        dialer.session_key()  # the welcome has not come
    refusing = ListenerHandshake(
        SECRET,
        Identity(GROUP, 4, 0),
        lambda peer: "no",
        nonce=challenge[1]["nonce"],
        ledger=NonceLedger(),
    )
    refusing.on_hello({"kind": "hello", **dialer.hello()[1]})
    assert refusing.on_auth({"kind": "auth", **auth[1]})[0] == "refuse"
    with pytest.raises(HandshakeError, match="the handshake has not completed"):
        refusing.session_key()  # authenticated, but refused at admission


# --------------------------------------------------------------------------- paramsync secret


def test_paramsync_secret_prints_a_fresh_random_secret(capsys: pytest.CaptureFixture[str]) -> None:
    printed = []
    for _ in range(2):
        assert cli_main(["secret"]) == 0
        printed.append(capsys.readouterr().out)
    first, second = (text.strip() for text in printed)
    assert all(text.endswith("\n") and text.count("\n") == 1 for text in printed)
    assert len(first) == 43 and first != second
    assert set(first) <= set(string.ascii_letters + string.digits + "-_")
    assert load_secret(first, {}) == first.encode()


def test_paramsync_secret_as_a_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "paramsync.runtime.cli.main", "secret"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) == 43


# --------------------------------------------------------------------------- row 12


def load_from_file(path: Path) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_secret(None, {SECRET_FILE_ENV: str(path)}) == SECRET
    return list(caught)


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_private_secret_file_loads_without_a_warning(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(mode)
    assert load_from_file(path) == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=oct)
def test_a_secret_file_others_may_read_is_warned_about(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(mode)
    caught = load_from_file(path)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert str(path) in message and f"{mode:04o}" in message and "chmod 600" in message
    assert stat.S_IMODE(path.stat().st_mode) == mode  # warned, not changed


# --------------------------------------------------------------------------- the document


def test_the_test_vector_in_the_protocol_document_is_what_the_code_computes() -> None:
    """docs/protocol.md section 5.1's example: the key, both proofs and the session key."""
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    names = "K|G|share_d|share_l|ISK|proof_d|proof_l|session"
    values = dict(re.findall(rf"^({names}) +([0-9a-f]{{64}})$", text, re.M))
    assert set(values) == set(names.split("|")), values
    secret = b"example-secret-0123456789abcdef!"
    dialer_id, listener_id = Identity("paramsync", 2, 1), Identity("paramsync", 2, -1)
    n_d, n_l = b"\x11" * NONCE_SIZE, b"\x22" * NONCE_SIZE
    y_d, y_l, salt_l = b"\x33" * 32, b"\x44" * 32, b"\x55" * SALT_SIZE
    dialer, listener = handshake(
        secret,
        secret,
        dialer_id,
        listener_id,
        n_d,
        n_l,
        dialer_scalar=y_d,
        listener_scalar=y_l,
        salt=salt_l,
    )
    key = stretch_secret(secret, salt_l)
    assert key.hex() == values["K"]
    g, share_d, share_l, isk = cpace_spec.exchange(key, "paramsync", 2, n_d, y_d, y_l)
    assert (g.hex(), share_d.hex(), share_l.hex()) == (
        values["G"],
        values["share_d"],
        values["share_l"],
    )
    assert isk.hex() == values["ISK"]
    assert dialer_proof(isk, n_d, n_l, dialer_id).hex() == values["proof_d"]
    welcome = listener_proof(isk, n_d, n_l, dialer_id, listener_id)
    assert welcome.hex() == values["proof_l"]
    assert dialer.session_key().hex() == listener.session_key().hex() == values["session"]
    assert "export PARAMSYNC_SECRET=$(paramsync secret)" in text


# --------------------------------------------------------------------------- weak secrets


@pytest.mark.parametrize(
    "weak",
    [b"a" * 16, b"A" * 64, b"abababababababababababab", b"0123012301230123"],
    ids=["one-letter-16", "one-letter-64", "two-letters", "four-digits"],
)
def test_a_secret_with_too_little_entropy_is_refused_saying_how_to_make_one(weak: bytes) -> None:
    """Second security review, row 9: a 16-byte secret of one repeated letter was accepted."""
    assert secret_strength_bits(weak) < SECRET_MIN_BITS
    with pytest.raises(ValueError, match="too little entropy") as info:
        load_secret(weak)
    assert "paramsync secret" in str(info.value)


def test_made_secrets_and_ordinary_passphrases_are_strong_enough() -> None:
    for _ in range(20):
        assert secret_strength_bits(new_secret().encode()) > 150
    assert secret_strength_bits(os.urandom(16).hex().encode()) > 100
    for fine in (SECRET, b"correct horse battery staple"):
        assert load_secret(fine) == fine
    with pytest.raises(ValueError, match="too little entropy"):  # issue 39, row 3
        load_secret(WEAK_SECRET)


def test_the_daemons_refuse_a_weak_secret_with_one_line_and_exit_code_2() -> None:
    env = dict(os.environ, PARAMSYNC_SECRET="x" * 32)
    done = subprocess.run(
        [sys.executable, "-m", "paramsync.runtime.cli.main", "coordinator", "--world-size", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "too little entropy" in done.stderr and "paramsync secret" in done.stderr
