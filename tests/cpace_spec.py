"""docs/protocol.md section 5.1's key exchange, written again from the document alone (as an
independent implementation would), for the tests to check the code against: Elligator 2 to
curve25519 (RFC 9380, Z = 2) by hand, X25519 from `cryptography`, the hashes as written."""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

P = 2**255 - 19
A = 486662


def elligator2(u: int) -> int:
    u %= P
    den = (1 + 2 * u * u) % P
    x1 = (-A * pow(den, P - 2, P)) % P if den else (-A) % P
    gx1 = (pow(x1, 3, P) + A * x1 * x1 + x1) % P
    square = gx1 == 0 or pow(gx1, (P - 1) // 2, P) == 1
    return x1 if square else (-x1 - A) % P


def generator(key: bytes, group: str, world_size: int, nonce_d: bytes) -> bytes:
    name = group.encode("utf-8")
    digest = hashlib.sha512(
        b"paramsync/cpace/generator/v4"
        + (32).to_bytes(2, "big")
        + key
        + len(name).to_bytes(2, "big")
        + name
        + world_size.to_bytes(4, "big")
        + (32).to_bytes(2, "big")
        + nonce_d
    ).digest()
    return elligator2(int.from_bytes(digest, "little")).to_bytes(32, "little")


def x25519(scalar: bytes, point: bytes) -> bytes:
    private = X25519PrivateKey.from_private_bytes(scalar)
    return private.exchange(X25519PublicKey.from_public_bytes(point))


def isk(z: bytes, share_d: bytes, share_l: bytes) -> bytes:
    return hashlib.sha256(b"paramsync/cpace/isk/v4" + z + share_d + share_l).digest()


def exchange(
    key: bytes, group: str, world_size: int, nonce_d: bytes, y_d: bytes, y_l: bytes
) -> tuple[bytes, bytes, bytes, bytes]:
    """(G, share_d, share_l, ISK) of one handshake with the scalars y_d and y_l."""
    g = generator(key, group, world_size, nonce_d)
    share_d, share_l = x25519(y_d, g), x25519(y_l, g)
    z = x25519(y_d, share_l)
    assert z == x25519(y_l, share_d)
    return g, share_d, share_l, isk(z, share_d, share_l)
