"""One scrypt salt per deployment: a process's listeners adopt the salt of the first listener
that proved the secret to it.

Every handshake stretches the secret by scrypt under the listener's salt (about 50 ms of a core,
`paramsync.runtime.protocol.handshake.stretch_secret`, cached per process by secret and salt). If
each process's listeners used its own random salt (`PROCESS_SALT`), a worker would stretch once
per peer listener it dials: N + 1 times in a mesh of N workers, seconds at start for 64 of them.
Instead a worker's listeners use the salt of the coordinator (or rendezvous root) that proved the
secret to it: `adopt` is called by `paramsync.runtime.transport.tcp.dial` once the listener's
proof in the welcome has verified, and `tcp.accept` asks `listener_salt` for its challenge. So
every link of a deployment uses its coordinator's salt, and each process stretches once.

The salt still serves one deployment at most (issue 39, row 4): the coordinator draws it at
random when its process starts, and only a listener that proved the secret (which a guesser does
not hold) can have its salt adopted. The first listener that proves a secret wins; a process
that later dials another (a restarted coordinator) stretches for that one as a dialer and keeps
its listeners' salt. Nothing is persisted: the table lives in the process's memory, a bounded
number of secrets (`CAPACITY`), and the secret is kept as the stretch cache keeps it.
"""

from __future__ import annotations

from collections import OrderedDict

from paramsync.runtime.protocol.messages import SALT_SIZE

__all__ = ["CAPACITY", "adopt", "forget", "listener_salt"]

CAPACITY = 64
"""Secrets whose adopted salt a process remembers (the least recently adopted go first)."""

_adopted: OrderedDict[bytes, bytes] = OrderedDict()


def adopt(secret: bytes, salt: bytes) -> None:
    """Remember ``salt``, the salt of a listener that has just proved ``secret``, as this
    process's listeners' salt for ``secret``, unless one is adopted already."""
    if len(salt) != SALT_SIZE:
        raise ValueError(f"a scrypt salt is {SALT_SIZE} bytes, got {len(salt)}")
    key = bytes(secret)
    if key in _adopted:
        return
    _adopted[key] = bytes(salt)
    while len(_adopted) > CAPACITY:
        _adopted.popitem(last=False)


def listener_salt(secret: bytes) -> bytes | None:
    """The salt this process's listeners use for ``secret``: the adopted one, or None (then
    the process's own, `PROCESS_SALT`)."""
    return _adopted.get(bytes(secret))


def forget() -> None:
    """Drop every adopted salt (tests that need a process's first dial again)."""
    _adopted.clear()
