"""The exception families paramsync raises.

Every failure that comes from a peer's bytes is a `ProtocolError`; every failure to join a
group (wrong secret, version, group, world size, taken rank) is a `HandshakeError`, itself a
`ProtocolError`, so one ``except ProtocolError`` covers all hostile or broken input. Every
replica divergence (C-DDP-001, C-DP-002) is a `StateDiverged`, whoever found it: the
coordinator (`paramsync.actors.client.client.RunDiverged`), a shard's dp group in band
(`paramsync.actors.parallel.replica_check.ShardReplicasDiverged`) or the replicas of one process
(`paramsync.actors.multidevice.ReplicaDivergedError`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = [
    "ParamsyncError",
    "ConfigError",
    "ProtocolError",
    "FrameTooLarge",
    "HandshakeError",
    "AuthenticationError",
    "InvalidKeyShare",
    "PeerLacksSecret",
    "HandshakeAbandoned",
    "ProofUnanswered",
    "ListenerBusy",
    "ReplayedHandshake",
    "FrameAuthenticationError",
    "PeerClosed",
    "StallError",
    "CollectiveError",
    "ActorFailed",
    "StateDiverged",
    "pick_error",
    "first_error",
    "configuration_error",
    "quoted",
    "plain_or_quoted",
    "one_line",
    "QUOTED_LIMIT",
]

QUOTED_LIMIT = 200
"""The most characters of a peer-supplied string that `quoted` keeps."""


def quoted(value: object, limit: int = QUOTED_LIMIT) -> str:
    """A peer-supplied value as it may enter a log line or a refusal/abort reason: its
    ``repr`` (a string in quotes, newlines and control characters escaped, so it cannot forge a
    log line), clipped to about ``limit`` characters with the clipped length said."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) > limit + 2:
        return f"{text[:limit]}... ({len(text)} characters)"
    return text


def one_line(value: object, limit: int = 4000) -> str:
    """``str(value)`` made safe for one log line: printable text stays as it is, every newline
    or control character is escaped (``\\n``, ``\\x1b``), so no text a peer put into it can
    start a line of its own; clipped to ``limit`` characters."""
    text = str(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-[]")


def plain_or_quoted(value: object, limit: int = 64) -> str:
    """A peer-supplied name that is usually plain (a dtype, a host): as it is when it is a
    short string of letters, digits and ``_.:-[]``, else `quoted` (so it cannot forge a line)."""
    if isinstance(value, str) and 0 < len(value) <= limit and _PLAIN.issuperset(value):
        return value
    return quoted(value)


class ParamsyncError(Exception):
    """Base class of every error paramsync raises on purpose."""


class ConfigError(ParamsyncError, ValueError):
    """This process was configured so that it cannot run: no secret, a bad address, a rank out
    of range, a port that cannot be bound. The message is one line naming what to set; entry
    points print it alone and exit with code 2. A ``ValueError`` too, for older callers."""


class ProtocolError(ParamsyncError):
    """A peer sent bytes that are not a valid paramsync message, or the wrong message now.

    ``peer`` names the peer (a rank or an address) when it is known.
    """

    def __init__(self, message: str, *, peer: object = None) -> None:
        self.peer = peer
        self.reason = message
        super().__init__(f"peer {peer}: {message}" if peer is not None else message)

    def with_peer(self, peer: object) -> ProtocolError:
        """Return a copy of this error that names ``peer`` (keeps the subclass)."""
        if self.peer is not None:
            return self
        err = type(self).__new__(type(self))
        ProtocolError.__init__(err, self.reason, peer=peer)
        return err


class FrameTooLarge(ProtocolError):
    """A frame's length prefix announced more bytes than this receiver accepts."""


class HandshakeError(ProtocolError):
    """A connection handshake was refused (version, group, world size or rank)."""


class AuthenticationError(HandshakeError):
    """The peer failed to authenticate. A failed proof (its own, or its refusal of this side's)
    means it does not hold this side's shared secret; `InvalidKeyShare` says nothing about the
    secret."""


class InvalidKeyShare(AuthenticationError):
    """The peer's CPace key share is not one an honest peer sends (the wrong size, or a
    low-order point): whatever answered is not a paramsync peer, and no proof was exchanged, so
    nothing is known about its secret."""


class PeerLacksSecret(AuthenticationError):
    """A listener failed authentication once in this run (its proof failed, it refused this
    side's, or it took this side's proof and gave none back), so this worker gives it no
    further proof: every proof would be one more guess of the secret for whoever listens
    there."""


class HandshakeAbandoned(HandshakeError):
    """The peer closed the connection, went silent or answered out of protocol in the middle of
    a handshake, before any proof was exchanged: nothing says it holds another secret."""


class ProofUnanswered(HandshakeAbandoned):
    """The listener took this side's proof, then closed, went silent or answered out of
    protocol instead of proving the secret itself (`PeerLacksSecret` in a worker's reconnect
    loop: one proof was all such a listener gets)."""


class ReplayedHandshake(AuthenticationError):
    """A hello repeated a nonce seen before: a recorded handshake played back."""


class FrameAuthenticationError(ProtocolError):
    """A frame after the handshake failed its MAC (`paramsync.runtime.protocol.frame_auth`): it was
    altered, forged, dropped, replayed or reordered on the way. The connection is closed."""


class ListenerBusy(HandshakeError):
    """The listener turned the connection away before any handshake (too many in progress);
    dialing again later is expected to work."""


class PeerClosed(ProtocolError):
    """The peer closed the connection (cleanly or not) in the middle of an exchange."""


class StallError(PeerClosed):
    """A peer moved no byte within the deadline: it is stalled, or gone without a word."""


class CollectiveError(ParamsyncError):
    """A collective was called with arguments that cannot work (dtype, size, rank)."""


class ActorFailed(ParamsyncError):
    """An actor raised; the message names the actor, the cause is chained."""

    def __init__(self, actor: str, cause: BaseException) -> None:
        self.actor = actor
        super().__init__(f"actor {actor!r} failed: {type(cause).__name__}: {cause}")


class StateDiverged(ParamsyncError):
    """Replicas that must hold bitwise identical training state do not (C-DDP-001, C-DP-002).

    ``step``: the step after which the states were compared (0: before the first). ``ranks``:
    the ranks (the replica indices, for replicas inside one process) grouped by the state they
    hold, the reference group first (the majority, rank 0's, replica 0's). ``first_tensor``: the
    name of the first tensor whose digest differs, None when no single tensor is to blame (the
    layout, the parameter-group settings or the scheduler differ)."""

    def __init__(
        self,
        message: str,
        *,
        step: int,
        ranks: Sequence[Sequence[int]],
        first_tensor: str | None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = [list(group) for group in ranks]
        self.first_tensor = first_tensor

    @property
    def diverged_ranks(self) -> list[int]:
        """The ranks outside the reference group, sorted."""
        return sorted(rank for group in self.ranks[1:] for rank in group)


def pick_error(error: BaseException) -> BaseException:
    """The most telling leaf of a (nested) exception group: a paramsync error other than a
    hang-up, else a hang-up, else the first leaf that is not a cancellation; the group itself
    if all leaves are cancellations."""
    # No cancellation can exist before trio is imported, so this module never imports it.
    trio = sys.modules.get("trio")
    cancelled: type[BaseException] | tuple[()] = trio.Cancelled if trio is not None else ()
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        elif not isinstance(exc, cancelled):
            leaves.append(exc)

    walk(error)
    # A hang-up is usually the echo of an error found elsewhere: prefer the error itself.
    for wanted in (
        lambda e: isinstance(e, ParamsyncError) and not isinstance(e, PeerClosed),
        lambda e: isinstance(e, ParamsyncError),
    ):
        for leaf in leaves:
            if wanted(leaf):
                return leaf
    return leaves[0] if leaves else error


@contextmanager
def first_error() -> Iterator[None]:
    """Around a nursery: raise its most telling error (see `pick_error`) instead of the group.

    trio wraps every failure of a nursery's tasks in an exception group; callers of a
    collective want ``except ProtocolError`` to work.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = pick_error(group)
        if leaf is group:
            raise
        raise leaf from None


def configuration_error(error: BaseException) -> str | None:
    """The one-line message to print when ``error`` (or the most telling leaf of its exception
    group, `pick_error`) is a configuration problem, else None.

    Configuration problems: a `ConfigError`, a listener this worker stopped giving proofs
    (`PeerLacksSecret`), and a join the other end refused or could not authenticate
    (`HandshakeError` other than `ListenerBusy`: wrong secret, world size, group, protocol
    version or a rank already taken), each with what to set. The secret is named only when a
    proof failed: a peer that sent an invalid key share (`InvalidKeyShare`) or broke the
    handshake off (`HandshakeAbandoned`) is no configuration problem of this side's (None).
    """
    leaf = pick_error(error)
    if isinstance(leaf, ConfigError | PeerLacksSecret):
        return one_line(leaf)
    if isinstance(leaf, InvalidKeyShare | HandshakeAbandoned):
        return None  # what the peer did, said as it is: no proof failed, no setting to blame
    if isinstance(leaf, AuthenticationError) and not isinstance(leaf, ReplayedHandshake):
        return one_line(
            f"{leaf}: set the same PARAMSYNC_SECRET (or PARAMSYNC_SECRET_FILE) on every process"
        )
    if isinstance(leaf, HandshakeError) and not isinstance(leaf, ListenerBusy | ReplayedHandshake):
        return one_line(
            f"{leaf}: every process of a run needs the same WORLD_SIZE (--world-size) and "
            "protocol version, and each rank its own RANK (--rank)"
        )
    return None
