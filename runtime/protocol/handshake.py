"""The connection handshake: identity, admission, a password-authenticated key exchange and
challenge-response proofs (sans-I/O).

Four messages, each one frame::

    dialer -> listener  hello      {group, world_size, rank, nonce}
    listener -> dialer  challenge  {nonce, salt, share}                  (or refuse: busy, replay)
    dialer -> listener  auth       {share, proof}
    listener -> dialer  welcome    {group, world_size, rank, proof}      (or refuse)

The shares are CPace's (`paramsync.runtime.protocol.pake`): X25519 multiples of a generator derived
from the secret (stretched by scrypt with the listener's salt, `stretch_secret`), the group and
the dialer's nonce. The salt is the listener's: its process's own random one (`PROCESS_SALT`),
or the one its process adopted from its coordinator
(`paramsync.runtime.transport.deployment_salt`), so a dictionary stretched for one deployment is
worthless against any other. Both
sides derive the intermediate session key (ISK) from the exchange, and every proof and the session
key are HMACs keyed by the ISK: whoever watches a handshake (no TLS) or answers a dialer (a rogue
listener) has nothing to test guesses of the secret against offline; an active attacker tests one
guess per handshake. The dialer proves first: its proof covers both nonces and its own identity. The
listener says nothing about itself (no identity, no proof) until that proof has verified and the
dialer is admitted. The listener's proof, in the welcome, covers both nonces and both identities;
the dialer checks it before trusting anything the welcome says. The two proofs and the session key
use different labels, so none can stand for another, and a replayed handshake fails on the fresh
nonces and shares. Once it has succeeded, both sides hold the same 32-byte session key
(`DialerHandshake.session_key`, `ListenerHandshake.session_key`), from which every later frame's MAC
key is derived (`paramsync.runtime.protocol.frame_auth`). Both sides of a refusal get the same
sentence: the listener raises it, the dialer receives it.

A secret with too little entropy is refused when it is loaded (`load_secret`,
`secret_strength_bits`): one a guesser finds among its first tries (common words and passwords,
keyboard and alphabet runs, years, repetition; `paramsync.runtime.protocol.secret_strength`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paramsync.runtime.errors import (
    AuthenticationError,
    HandshakeAbandoned,
    HandshakeError,
    ListenerBusy,
    ProofUnanswered,
    ReplayedHandshake,
    plain_or_quoted,
    quoted,
)
from paramsync.runtime.protocol.messages import (
    NONCE_SIZE,
    SALT_SIZE,
    Auth,
    Challenge,
    Hello,
    Refusal,
    Welcome,
)
from paramsync.runtime.protocol.pake import Cpace, generator
from paramsync.runtime.protocol.schema import PROTOCOL_VERSION
from paramsync.runtime.protocol.secret_strength import strength_bits

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "SECRET_MIN_BYTES",
    "SECRET_MIN_BITS",
    "secret_strength_bits",
    "KDF_SALT_LABEL",
    "SALT_SIZE",
    "PROCESS_SALT",
    "KDF_N",
    "KDF_R",
    "KDF_P",
    "KDF_MAXMEM",
    "KEY_SIZE",
    "NONCE_SIZE",
    "Identity",
    "new_secret",
    "load_secret",
    "stretch_secret",
    "dialer_proof",
    "listener_proof",
    "derive_session_key",
    "DialerHandshake",
    "ListenerHandshake",
    "NonceLedger",
    "PROCESS_LEDGER",
]

SECRET_ENV = "PARAMSYNC_SECRET"
SECRET_FILE_ENV = "PARAMSYNC_SECRET_FILE"
SECRET_MIN_BYTES = 16
"""The shortest shared secret `load_secret` accepts."""
SECRET_MIN_BITS = 48.0
"""The least estimated entropy (`secret_strength_bits`) of a secret `load_secret` accepts.
The handshake is a balanced PAKE, so a secret can only be guessed online, one handshake a
guess: 48 bits is some 10^14 handshakes. `paramsync secret` makes 256-bit ones."""

KDF_SALT_LABEL = b"paramsync/secret/v4"
KDF_N = 2**14
KDF_R = 8
KDF_P = 1
KDF_MAXMEM = 64 * 2**20
KEY_SIZE = 32
"""scrypt's parameters: the handshake key is ``scrypt(secret, KDF_SALT_LABEL || salt, N, r, p)``,
32 bytes (16 MiB of memory and about 50 ms of one core per derivation), ``salt`` being the
listener's (`PROCESS_SALT`, carried in its challenge)."""
PROCESS_SALT = secrets.token_bytes(SALT_SIZE)
"""This process's own scrypt salt: random, drawn once per process and sent in every challenge
of its listeners unless they adopted another (a worker's: its coordinator's,
`paramsync.runtime.transport.deployment_salt`), so a coordinator's salt is its deployment's and
a precomputed (stretched) dictionary serves one deployment at most."""


def new_secret() -> str:
    """A fresh random shared secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def secret_strength_bits(secret: bytes) -> float:
    """An estimate of a secret's entropy in bits, as a guesser who tries what people choose
    first sees it (`paramsync.runtime.protocol.secret_strength`): common words and passwords
    (whatever their case, reversed or with common substitutions), keyboard walks, alphabet and
    digit runs, years, dates and repetition are rated by the few guesses they take, anything
    else as random characters. Only `paramsync secret`'s random bytes are strong for sure."""
    return strength_bits(bytes(secret))


def _how_to_make_one() -> str:
    return f"make one with `paramsync secret` (e.g. export {SECRET_ENV}=$(paramsync secret))"


def _warn_if_readable_by_others(path: str) -> None:
    """Warn when the secret file may be read by the group or by anyone (issue 18, row 12)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        warnings.warn(
            f"the secret file {path!r} has mode {mode:04o}: its group or other users may read "
            f"it; restrict it with `chmod 600 {path}`",
            UserWarning,
            stacklevel=3,
        )


def load_secret(secret: bytes | str | None = None, environ: dict[str, str] | None = None) -> bytes:
    """The group's shared secret: the argument, else $PARAMSYNC_SECRET, else the file named by
    $PARAMSYNC_SECRET_FILE (warning when the group or others may read it). Raises ValueError
    saying how to make one when none is found or it is shorter than `SECRET_MIN_BYTES`."""
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
        _warn_if_readable_by_others(path)
    if secret is None:
        raise ValueError(
            f"no shared secret: set {SECRET_ENV}, or {SECRET_FILE_ENV} to a file holding one; "
            + _how_to_make_one()
        )
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(
            f"the shared secret must be at least {SECRET_MIN_BYTES} bytes long "
            f"(this one has {len(secret)}); " + _how_to_make_one()
        )
    bits = secret_strength_bits(secret)
    if bits < SECRET_MIN_BITS:
        raise ValueError(
            f"the shared secret has too little entropy (about {bits:.0f} bits, at least "
            f"{SECRET_MIN_BITS:.0f} needed: common words, keyboard or alphabet runs, years "
            "and repetition are among a guesser's first tries); " + _how_to_make_one()
        )
    return bytes(secret)


@functools.lru_cache(maxsize=256)
def _stretch(secret: bytes, salt: bytes) -> bytes:
    return hashlib.scrypt(
        secret,
        salt=KDF_SALT_LABEL + salt,
        n=KDF_N,
        r=KDF_R,
        p=KDF_P,
        maxmem=KDF_MAXMEM,
        dklen=KEY_SIZE,
    )


def stretch_secret(secret: bytes, salt: bytes) -> bytes:
    """The key the CPace generator is derived from: the shared secret stretched by scrypt
    (salt `KDF_SALT_LABEL` || ``salt``, N=2^14, r=8, p=1, 32 bytes), ``salt`` being a
    listener's (`SALT_SIZE` bytes). Memory-hard and slow on purpose, so every guess of the
    secret costs one derivation per deployment; cached per process, secret and salt (in
    memory only), so a process of a deployment, whose links all use its coordinator's salt,
    pays it once."""
    if len(salt) != SALT_SIZE:
        raise ValueError(f"a scrypt salt is {SALT_SIZE} bytes, got {len(salt)}")
    return _stretch(bytes(secret), bytes(salt))


@dataclass(frozen=True)
class Identity:
    """Who one end of a connection is: group name, world size and rank (-1: not a rank)."""

    group: str
    world_size: int
    rank: int

    def fields(self) -> dict[str, Any]:
        return {"group": self.group, "world_size": self.world_size, "rank": self.rank}


DIALER_LABEL = b"paramsync/dialer"
LISTENER_LABEL = b"paramsync/listener"
SESSION_LABEL = b"paramsync/session"


def _transcript(label: bytes, first: bytes, second: bytes, *identities: Identity) -> bytes:
    """``label || u16 version || first || second`` then, per identity, ``u16 len(group) ||
    group || u32 world_size || u32 rank+1`` (docs/protocol.md §5.1)."""
    parts = [label, PROTOCOL_VERSION.to_bytes(2, "big"), first, second]
    for ident in identities:
        group = ident.group.encode()
        parts += [len(group).to_bytes(2, "big"), group]
        parts += [ident.world_size.to_bytes(4, "big"), (ident.rank + 1).to_bytes(4, "big")]
    return b"".join(parts)


def _mac(key: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, transcript, hashlib.sha256).digest()


def dialer_proof(key: bytes, dialer_nonce: bytes, listener_nonce: bytes, dialer: Identity) -> bytes:
    """The dialer's proof (in ``auth``): both nonces, listener's first, and its own identity."""
    return _mac(key, _transcript(DIALER_LABEL, listener_nonce, dialer_nonce, dialer))


def listener_proof(
    key: bytes, dialer_nonce: bytes, listener_nonce: bytes, dialer: Identity, listener: Identity
) -> bytes:
    """The listener's proof (in ``welcome``): both nonces, dialer's first, both identities."""
    return _mac(key, _transcript(LISTENER_LABEL, dialer_nonce, listener_nonce, dialer, listener))


def derive_session_key(
    key: bytes, dialer_nonce: bytes, listener_nonce: bytes, dialer: Identity, listener: Identity
) -> bytes:
    """The 32-byte key both ends of a completed handshake share (never sent)."""
    return _mac(key, _transcript(SESSION_LABEL, dialer_nonce, listener_nonce, dialer, listener))


def _kind(message: dict[str, Any]) -> str:
    """A received message's kind as it may enter an error (a peer's string: quoted if odd)."""
    return plain_or_quoted(message["kind"])


_NOT_COMPLETED = "the handshake has not completed"


class DialerHandshake:
    """The connecting side's handshake state: feed it the listener's replies."""

    def __init__(
        self,
        secret: bytes,
        me: Identity,
        nonce: bytes | None = None,
        *,
        scalar: bytes | None = None,
    ) -> None:
        """``nonce`` and ``scalar`` (the CPace scalar) are fresh random ones unless given
        (test vectors only)."""
        self.me = me
        self._secret = bytes(secret)
        self._scalar = scalar
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        self._key = b""
        """The ISK (`paramsync.runtime.protocol.pake`), once the listener's share has arrived."""
        self._listener_nonce: bytes | None = None
        self.proof_sent = False
        """Whether `on_challenge` has handed out this side's proof (the listener may test one
        guess of the secret against it)."""
        self.peer: Identity | None = None
        """The listener's identity, once its proof in the welcome has verified."""
        self.listener_salt: bytes | None = None
        """The listener's scrypt salt, from its challenge (proven with the secret once `peer`
        is set)."""

    def hello(self) -> tuple[str, dict[str, Any]]:
        """The first message to send."""
        return Hello(**self.me.fields(), nonce=self._nonce).to_wire()

    def on_challenge(self, message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Take the listener's nonce, salt and share; return the auth message (this side's
        share and proof) to send. The secret is stretched here, with the listener's salt.

        Raises, sending no proof: `ListenerBusy` or `HandshakeError` for a refusal,
        `HandshakeAbandoned` for an answer that is no challenge, `InvalidKeyShare` for a share
        no honest listener sends."""
        if message["kind"] == "refuse":
            error = ListenerBusy if message.get("busy") else HandshakeError
            raise error(f"refused: {quoted(message['reason'])}")
        if message["kind"] != "challenge":
            raise HandshakeAbandoned(
                f"the peer answered the hello with a {_kind(message)} message, not a challenge"
            )
        nonce = message["nonce"]
        if len(nonce) != NONCE_SIZE:
            raise HandshakeAbandoned(f"the challenge's nonce is not {NONCE_SIZE} bytes")
        salt = message["salt"]
        if len(salt) != SALT_SIZE:
            raise HandshakeAbandoned(f"the challenge's salt is not {SALT_SIZE} bytes")
        key = stretch_secret(self._secret, salt)
        self.listener_salt = bytes(salt)
        cpace = Cpace(generator(key, self.me.group, self.me.world_size, self._nonce), self._scalar)
        share = message["share"]
        self._key = cpace.isk(share, dialer_share=cpace.share, listener_share=share)
        self._listener_nonce = nonce
        self.proof_sent = True
        proof = dialer_proof(self._key, self._nonce, nonce, self.me)
        return Auth(share=cpace.share, proof=proof).to_wire()

    def on_verdict(self, message: dict[str, Any]) -> Identity:
        """The listener's last word: a welcome whose proof verifies (returns the listener's
        identity), or a refusal (raises). Only a failed proof, the listener's or its refusal of
        this side's, is an `AuthenticationError`; another answer is `ProofUnanswered`."""
        if message["kind"] == "refuse":
            error = AuthenticationError if message.get("auth") else HandshakeError
            raise error(f"refused: {quoted(message['reason'])}")
        if message["kind"] != "welcome" or self._listener_nonce is None:
            raise ProofUnanswered(
                f"the listener answered this side's proof with a {_kind(message)} message, "
                "not a welcome with its own proof"
            )
        peer = Identity(message["group"], message["world_size"], message["rank"])
        expected = listener_proof(self._key, self._nonce, self._listener_nonce, self.me, peer)
        if not hmac.compare_digest(expected, message["proof"]):
            raise AuthenticationError(
                "the listener failed to prove the shared secret (secrets differ)"
            )
        self.peer = peer
        return peer

    def session_key(self) -> bytes:
        """The key this connection shares with the listener (after `on_verdict` returned)."""
        if self.peer is None or self._listener_nonce is None:
            raise HandshakeError(_NOT_COMPLETED)
        return derive_session_key(self._key, self._nonce, self._listener_nonce, self.me, self.peer)

    def nonces(self) -> tuple[bytes, bytes]:
        """(the dialer's nonce, the listener's): the connection's name in a key log
        (`paramsync.runtime.transport.keylog`), after `on_verdict` returned."""
        if self._listener_nonce is None:
            raise HandshakeError(_NOT_COMPLETED)
        return self._nonce, self._listener_nonce


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
        *,
        scalar: bytes | None = None,
        salt: bytes | None = None,
    ) -> None:
        """``salt`` is this listener's scrypt salt (default `PROCESS_SALT`); ``scalar`` the
        CPace scalar (default a fresh random one per handshake): both given for test vectors."""
        self._scalar = scalar
        self._salt = PROCESS_SALT if salt is None else salt
        self._secret_key = stretch_secret(secret, self._salt)
        self._cpace: Cpace | None = None
        """This side of the exchange, once the hello has arrived."""
        self._key = b""
        """The ISK (`paramsync.runtime.protocol.pake`), once the auth's share has arrived."""
        self.me = me
        self._admit = admit
        self._ledger = PROCESS_LEDGER if ledger is None else ledger
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        self._claimed: Identity | None = None
        self._dialer_nonce = b""
        self.peer: Identity | None = None
        """The dialer's identity, once its proof has verified."""
        self._welcomed = False

    def on_hello(self, message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Answer a hello with a challenge: this side's nonce, salt and share, and nothing
        about this side."""
        if message["kind"] != "hello":
            raise HandshakeError(f"expected hello, got a {_kind(message)} message")
        if len(message["nonce"]) != NONCE_SIZE:
            raise HandshakeError(f"hello nonce must be {NONCE_SIZE} bytes")
        if self._ledger.seen_before(message["nonce"]):
            raise ReplayedHandshake(
                "replayed handshake: this hello's nonce was sent by an earlier connection"
            )
        claimed = Identity(message["group"], message["world_size"], message["rank"])
        # The generator is the dialer's claimed group's: a group that is not this one fails
        # the proof (or admission), never earlier, so a stranger learns nothing.
        base = generator(self._secret_key, claimed.group, claimed.world_size, message["nonce"])
        self._cpace = Cpace(base, self._scalar)
        self._claimed = claimed
        self._dialer_nonce = message["nonce"]
        return Challenge(nonce=self._nonce, salt=self._salt, share=self._cpace.share).to_wire()

    def on_auth(self, message: dict[str, Any]) -> tuple[str, dict[str, Any], Exception | None]:
        """Check the dialer's proof and admission: the verdict to send (a welcome carrying
        this side's identity and proof, or a refusal), and the error to raise on this side
        after sending it (None when welcome)."""
        claimed, cpace = self._claimed, self._cpace
        if message["kind"] != "auth" or claimed is None or cpace is None:
            reason = f"expected auth, got a {_kind(message)} message"
            return (*Refusal(reason).to_wire(), HandshakeError(reason))
        share = message["share"]
        try:
            self._key = cpace.isk(share, dialer_share=share, listener_share=cpace.share)
        except AuthenticationError as exc:
            return (*Refusal(exc.reason).to_wire(), exc)
        expected = dialer_proof(self._key, self._dialer_nonce, self._nonce, claimed)
        if not hmac.compare_digest(expected, message["proof"]):
            failed = "authentication failed: wrong shared secret"
            return (*Refusal(failed, auth=True).to_wire(), AuthenticationError(failed))
        self.peer = claimed
        refused = self._admit_reason(claimed)
        if refused is not None:
            return (*Refusal(refused).to_wire(), HandshakeError(refused))
        self._welcomed = True
        proof = listener_proof(self._key, self._dialer_nonce, self._nonce, claimed, self.me)
        return (*Welcome(**self.me.fields(), proof=proof).to_wire(), None)

    def session_key(self) -> bytes:
        """The key this connection shares with the dialer (after `on_auth` returned a welcome)."""
        if not self._welcomed or self.peer is None:
            raise HandshakeError(_NOT_COMPLETED)
        return derive_session_key(self._key, self._dialer_nonce, self._nonce, self.peer, self.me)

    def nonces(self) -> tuple[bytes, bytes]:
        """(the dialer's nonce, the listener's): the connection's name in a key log
        (`paramsync.runtime.transport.keylog`), after the hello."""
        if self._claimed is None:
            raise HandshakeError(_NOT_COMPLETED)
        return self._dialer_nonce, self._nonce

    def _admit_reason(self, peer: Identity) -> str | None:
        if peer.group != self.me.group:
            return f"group {peer.group!r} does not match this group {self.me.group!r}"
        if peer.world_size != self.me.world_size:
            return f"world size {peer.world_size} does not match this group's {self.me.world_size}"
        return self._admit(peer)
