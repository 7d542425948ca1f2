"""The connection handshake: identity, admission and HMAC challenge-response (sans-I/O).

Four messages, each one frame::

    dialer -> listener  hello      {group, world_size, rank, nonce}
    listener -> dialer  challenge  {group, world_size, rank, nonce, proof}   (or refuse)
    dialer -> listener  auth       {proof}
    listener -> dialer  welcome    {}                                       (or refuse)

Each side proves it holds the shared secret with HMAC-SHA256 over both nonces and both
identities, under a label naming its role, so the secret never crosses the wire, a proof cannot be
reflected back, and a replayed handshake fails on the fresh nonce. Once it has succeeded, both
sides hold the same 32-byte session key (`DialerHandshake.session_key`,
`ListenerHandshake.session_key`): HMAC-SHA256 over both nonces and both identities under the
label ``paramsync/session``, from which every later frame's MAC key is derived
(`runtime.protocol.frame_auth`). Admission (group, world size,
rank free) is checked only after the dialer has authenticated, so strangers learn nothing.
Both sides of a refusal get the same sentence: the listener raises it, the dialer receives it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.errors import (
    AuthenticationError,
    HandshakeError,
    ListenerBusy,
    ReplayedHandshake,
    plain_or_quoted,
    quoted,
)
from runtime.protocol.messages import NONCE_SIZE, Auth, Challenge, Hello, Refusal, Welcome
from runtime.protocol.schema import PROTOCOL_VERSION

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "NONCE_SIZE",
    "Identity",
    "load_secret",
    "DialerHandshake",
    "ListenerHandshake",
    "NonceLedger",
    "PROCESS_LEDGER",
]

SECRET_ENV = "PARAMSYNC_SECRET"
SECRET_FILE_ENV = "PARAMSYNC_SECRET_FILE"


def load_secret(secret: bytes | str | None = None, environ: dict[str, str] | None = None) -> bytes:
    """The group's shared secret: the argument, else $PARAMSYNC_SECRET, else the file named by
    $PARAMSYNC_SECRET_FILE. Raises ValueError saying how to set one when none is found."""
    env = os.environ if environ is None else environ
    if secret is None and env.get(SECRET_ENV):
        secret = env[SECRET_ENV]
    if secret is None and env.get(SECRET_FILE_ENV):
        path = env[SECRET_FILE_ENV]
        try:
            with open(path, "rb") as handle:
                secret = handle.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the secret file {path!r}: {exc.strerror}") from None
    if secret is None:
        raise ValueError(
            f"no shared secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} to a file holding one"
        )
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < 8:
        raise ValueError("the shared secret must be at least 8 bytes long")
    return bytes(secret)


@dataclass(frozen=True)
class Identity:
    """Who one end of a connection is: group name, world size and rank (-1: not a rank)."""

    group: str
    world_size: int
    rank: int

    def fields(self) -> dict[str, Any]:
        return {"group": self.group, "world_size": self.world_size, "rank": self.rank}


def _transcript(label: bytes, first: bytes, second: bytes, a: Identity, b: Identity) -> bytes:
    parts = [label, PROTOCOL_VERSION.to_bytes(2, "big"), first, second]
    for ident in (a, b):
        group = ident.group.encode()
        parts += [len(group).to_bytes(2, "big"), group]
        parts += [ident.world_size.to_bytes(4, "big"), (ident.rank + 1).to_bytes(4, "big")]
    return b"".join(parts)


def _proof(
    secret: bytes, label: bytes, nonces: tuple[bytes, bytes], a: Identity, b: Identity
) -> bytes:
    return hmac.new(secret, _transcript(label, *nonces, a, b), hashlib.sha256).digest()


def _session_key(
    secret: bytes, dialer_nonce: bytes, listener_nonce: bytes, dialer: Identity, listener: Identity
) -> bytes:
    """The key both sides hold after a successful handshake (the shared spec: label
    ``paramsync/session``, dialer's nonce and identity first)."""
    transcript = _transcript(b"paramsync/session", dialer_nonce, listener_nonce, dialer, listener)
    return hmac.new(secret, transcript, hashlib.sha256).digest()


_NOT_DONE = "the handshake has not completed"


def _kind(message: dict[str, Any]) -> str:
    """A received message's kind as it may enter an error (a peer's string: quoted if odd)."""
    return plain_or_quoted(message["kind"])


class DialerHandshake:
    """The connecting side's handshake state: feed it the listener's replies."""

    def __init__(self, secret: bytes, me: Identity, nonce: bytes | None = None) -> None:
        self._secret = secret
        self.me = me
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        self.peer: Identity | None = None
        self._listener_nonce = b""
        self._session: bytes | None = None

    def hello(self) -> tuple[str, dict[str, Any]]:
        """The first message to send."""
        return Hello(**self.me.fields(), nonce=self._nonce).to_wire()

    def on_challenge(self, message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Check the listener's proof; return the auth message to send."""
        if message["kind"] == "refuse":
            error = ListenerBusy if message.get("busy") else HandshakeError
            raise error(f"refused: {quoted(message['reason'])}")
        if message["kind"] != "challenge":
            raise HandshakeError(f"expected a challenge, got a {_kind(message)} message")
        peer = Identity(message["group"], message["world_size"], message["rank"])
        nonce = message["nonce"]
        if len(nonce) != NONCE_SIZE:
            raise HandshakeError(f"challenge nonce must be {NONCE_SIZE} bytes")
        expected = _proof(self._secret, b"paramsync/listener", (self._nonce, nonce), self.me, peer)
        if not hmac.compare_digest(expected, message["proof"]):
            raise AuthenticationError(
                "the listener failed to prove the shared secret (secrets differ)"
            )
        self.peer = peer
        self._listener_nonce = nonce
        proof = _proof(self._secret, b"paramsync/dialer", (nonce, self._nonce), peer, self.me)
        return Auth(proof).to_wire()

    def on_verdict(self, message: dict[str, Any]) -> Identity:
        """The listener's last word: welcome (returns its identity) or refuse (raises)."""
        if message["kind"] == "refuse":
            error = AuthenticationError if message.get("auth") else HandshakeError
            raise error(f"refused: {quoted(message['reason'])}")
        if message["kind"] != "welcome" or self.peer is None:
            raise HandshakeError(f"expected welcome or refuse, got a {_kind(message)} message")
        self._session = _session_key(
            self._secret, self._nonce, self._listener_nonce, self.me, self.peer
        )
        return self.peer

    def session_key(self) -> bytes:
        """The 32-byte session key, once `on_verdict` has returned (a welcome)."""
        if self._session is None:
            raise HandshakeError(_NOT_DONE)
        return self._session


Admit = Callable[[Identity], str | None]
"""Admission policy: given an authenticated dialer, return a refusal reason or None."""


class NonceLedger:
    """The dialer nonces a process has seen lately (a bounded memory): a hello repeating one
    is a replayed recording, refused as such before any proof is computed."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def seen_before(self, nonce: bytes) -> bool:
        """Whether ``nonce`` was seen already; remember it either way."""
        if nonce in self._seen:
            self._seen.move_to_end(nonce)
            return True
        self._seen[nonce] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return False


PROCESS_LEDGER = NonceLedger()
"""Shared by every listener of this process (a nonce is 32 random bytes: only a replay repeats)."""


class ListenerHandshake:
    """The accepting side's handshake state: feed it the dialer's messages."""

    def __init__(
        self,
        secret: bytes,
        me: Identity,
        admit: Admit,
        nonce: bytes | None = None,
        ledger: NonceLedger | None = None,
    ) -> None:
        self._secret = secret
        self.me = me
        self._admit = admit
        self._ledger = PROCESS_LEDGER if ledger is None else ledger
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        self.peer: Identity | None = None
        self._dialer_nonce = b""
        self._session: bytes | None = None

    def on_hello(self, message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Answer a hello with a challenge carrying this side's proof."""
        if message["kind"] != "hello":
            raise HandshakeError(f"expected hello, got a {_kind(message)} message")
        if len(message["nonce"]) != NONCE_SIZE:
            raise HandshakeError(f"hello nonce must be {NONCE_SIZE} bytes")
        if self._ledger.seen_before(message["nonce"]):
            raise ReplayedHandshake(
                "replayed handshake: this hello's nonce was sent by an earlier connection"
            )
        self.peer = Identity(message["group"], message["world_size"], message["rank"])
        self._dialer_nonce = message["nonce"]
        proof = _proof(
            self._secret,
            b"paramsync/listener",
            (self._dialer_nonce, self._nonce),
            self.peer,
            self.me,
        )
        return Challenge(**self.me.fields(), nonce=self._nonce, proof=proof).to_wire()

    def on_auth(self, message: dict[str, Any]) -> tuple[str, dict[str, Any], Exception | None]:
        """Check the dialer's proof and admission: the verdict to send, and the error to raise
        on this side after sending it (None when welcome)."""
        if message["kind"] != "auth" or self.peer is None:
            reason = f"expected auth, got a {_kind(message)} message"
            return (*Refusal(reason).to_wire(), HandshakeError(reason))
        expected = _proof(
            self._secret, b"paramsync/dialer", (self._nonce, self._dialer_nonce), self.me, self.peer
        )
        if not hmac.compare_digest(expected, message["proof"]):
            failed = "authentication failed: wrong shared secret"
            return (*Refusal(failed, auth=True).to_wire(), AuthenticationError(failed))
        refused = self._admit_reason(self.peer)
        if refused is not None:
            return (*Refusal(refused).to_wire(), HandshakeError(refused))
        self._session = _session_key(
            self._secret, self._dialer_nonce, self._nonce, self.peer, self.me
        )
        return (*Welcome().to_wire(), None)

    def session_key(self) -> bytes:
        """The 32-byte session key, once `on_auth` has returned a welcome."""
        if self._session is None:
            raise HandshakeError(_NOT_DONE)
        return self._session

    def _admit_reason(self, peer: Identity) -> str | None:
        if peer.group != self.me.group:
            return f"group {peer.group!r} does not match this group {self.me.group!r}"
        if peer.world_size != self.me.world_size:
            return f"world size {peer.world_size} does not match this group's {self.me.world_size}"
        return self._admit(peer)
