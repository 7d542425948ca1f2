"""CPace over X25519: the handshake's balanced password-authenticated key exchange (sans-I/O).

Why a PAKE: the handshake's HMAC proofs, keyed by the shared secret alone, let anyone who sees
one handshake (a passive observer on a link without TLS) or who answers a dialer (a rogue
listener) test guesses of the secret offline, one scrypt per guess: a human password falls. An
ephemeral Diffie-Hellman exchange alone would stop the passive observer but not the rogue
listener, who does its half of the exchange and then guesses against the dialer's proof.
CPace (draft-irtf-cfrg-cpace) binds the secret into the Diffie-Hellman generator itself: each
side's share is a random multiple of a point that only the secret's holders can compute, so a
transcript is worthless offline to everyone, an active attacker tests exactly one guess per
handshake it takes part in, and the shares carry nothing about the secret.

The construction, for a handshake between ``dialer`` and ``listener`` identities:

* the generator G: the Montgomery u-coordinate that Elligator 2 (RFC 9380, section 6.7.1,
  curve25519, Z = 2) maps ``SHA-512(GENERATOR_LABEL || key || channel)`` reduced mod p to,
  where ``key`` is the secret stretched by scrypt with the listener's salt and ``channel`` the
  group name, the world size and the dialer's nonce (the session id, fresh per connection);
* each side picks a fresh X25519 scalar y and sends ``share = X25519(y, G)`` (the listener in
  its challenge, the dialer in its auth: it learns the salt from the challenge);
* both compute ``K = X25519(y, peer's share)`` (an all-zero K, a low-order share, is refused)
  and the intermediate session key ``ISK = SHA-256(ISK_LABEL || K || dialer's share ||
  listener's share)``, which keys the proofs and the session key
  (`paramsync.runtime.protocol.handshake`).

X25519's clamping clears the cofactor, so a share on the twist or in a small subgroup yields
either the all-zero K (refused) or a point the honest side's scalar maps into the prime-order
subgroup: nothing about the other side's scalar leaks.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from paramsync.runtime.errors import InvalidKeyShare
from paramsync.runtime.protocol.messages import SHARE_SIZE

__all__ = ["GENERATOR_LABEL", "ISK_LABEL", "SHARE_SIZE", "Cpace", "generator", "elligator2"]

GENERATOR_LABEL = b"paramsync/cpace/generator/v4"
ISK_LABEL = b"paramsync/cpace/isk/v4"
_P = 2**255 - 19
_A = 486662
_Z = 2


def _is_square(value: int) -> bool:
    """Euler's criterion: 0 or a quadratic residue mod p."""
    return value == 0 or pow(value, (_P - 1) // 2, _P) == 1


def elligator2(field_element: int) -> int:
    """RFC 9380's map_to_curve_elligator2 for curve25519 (Z = 2): the Montgomery
    u-coordinate a field element maps to (only the u-coordinate: X25519 needs no v)."""
    u = field_element % _P
    denominator = (1 + _Z * u * u) % _P
    x1 = (-_A * pow(denominator, _P - 2, _P)) % _P if denominator else (-_A) % _P
    gx1 = (x1 * x1 * x1 + _A * x1 * x1 + x1) % _P
    if _is_square(gx1):
        return x1
    return (-x1 - _A) % _P


def generator(key: bytes, group: str, world_size: int, session: bytes) -> bytes:
    """The CPace generator G (a u-coordinate, 32 bytes little-endian) for this secret
    (``key``: the stretched secret), group and session id (the dialer's nonce)."""
    name = group.encode()
    digest = hashlib.sha512(
        GENERATOR_LABEL
        + len(key).to_bytes(2, "big")
        + key
        + len(name).to_bytes(2, "big")
        + name
        + world_size.to_bytes(4, "big")
        + len(session).to_bytes(2, "big")
        + session
    ).digest()
    return elligator2(int.from_bytes(digest, "little")).to_bytes(SHARE_SIZE, "little")


class Cpace:
    """One side of the exchange: a fresh scalar, its share, and the ISK once the peer's share
    arrives."""

    def __init__(self, base: bytes, scalar: bytes | None = None) -> None:
        """``scalar``: this side's 32-byte X25519 scalar (clamped by X25519; default a fresh
        random one: given only for test vectors)."""
        self._scalar = (
            X25519PrivateKey.generate()
            if scalar is None
            else X25519PrivateKey.from_private_bytes(scalar)
        )
        self.share = self._scalar.exchange(X25519PublicKey.from_public_bytes(base))
        """This side's share, X25519(y, G): sent to the peer."""

    def isk(self, peer_share: bytes, *, dialer_share: bytes, listener_share: bytes) -> bytes:
        """The intermediate session key from the peer's share (the shares in transcript
        order). Raises `InvalidKeyShare` (an `AuthenticationError` that blames no secret) for a
        share of the wrong size or one that makes K all zero (a low-order point)."""
        if len(peer_share) != SHARE_SIZE:
            raise InvalidKeyShare(
                f"the peer's key share is invalid: {len(peer_share)} bytes, not {SHARE_SIZE}"
            )
        try:
            shared = self._scalar.exchange(X25519PublicKey.from_public_bytes(peer_share))
        except ValueError:
            raise InvalidKeyShare(
                "the peer's key share is invalid: a low-order point (refused)"
            ) from None
        return hashlib.sha256(ISK_LABEL + shared + dialer_share + listener_share).digest()
