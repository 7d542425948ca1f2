"""Admission control for listeners: what a stranger may cost before it has authenticated.

An unauthenticated connection costs a task, a file descriptor and a receive buffer (256 KiB,
`runtime.transport.tcp.Connection`) until its handshake ends. An `AdmissionGate` bounds all three
for one
serving endpoint (the coordinator's listeners, or a worker's data-plane listener):

* at most ``max_pending`` handshakes run at once; a connection over the cap is answered with a
  ``refuse`` frame and closed at once, before any task or buffer exists for it;
* every handshake has a deadline (``handshake_seconds``, from the accept), enforced around the
  whole handshake block, so a slow-drip peer holds its slot for a bounded time;
* running out of file descriptors (EMFILE and friends) makes the accept loop back off and retry
  instead of crashing the listener;
* refusals are logged one line each, naming the remote address and a category in brackets,
  at most ``log_lines_per_second`` a second; the rest are counted and summed up in one line.

Frames stay capped at `runtime.protocol.wire.HANDSHAKE_MAX_FRAME` until the peer authenticates (the
prefix is checked before any byte of the item is read), so pending handshakes cost at most
``max_pending`` x 256 KiB of buffers. Counters (`AdmissionStats`) are exact whatever the logging.

Usage, inside a listener's nursery::

    gate = AdmissionGate("coordinator", AdmissionLimits(max_pending=64, handshake_seconds=10))

    async def handle(stream: trio.SocketStream, ticket: HandshakeTicket) -> None:
        try:
            with ticket:  # the deadline, the slot, the outcome's count and log line
                conn, peer = await accept(stream, key, me, admit,
                                          handshake_seconds=ticket.seconds)
        except (ProtocolError, OSError, trio.BrokenResourceError):
            return  # already logged and counted by the ticket
        ...  # serve the authenticated peer

    await gate.serve(listener, nursery, handle)
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import trio

from runtime.errors import (
    AuthenticationError,
    FrameTooLarge,
    HandshakeError,
    PeerClosed,
    ProtocolError,
)
from runtime.protocol.messages import Refusal
from runtime.protocol.wire import encode_frame_bytes

__all__ = [
    "AdmissionGate",
    "AdmissionLimits",
    "AdmissionStats",
    "HandshakeTicket",
    "FAILURE_CATEGORIES",
    "classify_failure",
]

log = logging.getLogger("paramsync.admission")

FAILURE_CATEGORIES = (
    "closed",
    "deadline",
    "frame_too_large",
    "malformed",
    "authentication",
    "refused",
    "connection_error",
    "other",
)
"""How a handshake can fail (`classify_failure`); ``over_cap`` is counted separately."""

_EXHAUSTION_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM")
    if hasattr(errno, name)
)
_ACCEPT_BACKOFF = 0.1
_DRAIN_BYTES = 4096
_LOG_WINDOW = 1.0


@dataclass(frozen=True)
class AdmissionLimits:
    """What one serving endpoint grants unauthenticated peers."""

    max_pending: int = 64
    """Handshakes in progress at once; a connection over the cap is refused at once."""
    handshake_seconds: float = 10.0
    """Deadline of one handshake, from its accept."""
    log_lines_per_second: int | None = 20
    """Refusal log lines per second (None: no limit); the others are summed up in one line."""

    def __post_init__(self) -> None:
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int):
            raise ValueError(f"max_pending must be an int, got {self.max_pending!r}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {self.max_pending}")
        if not self.handshake_seconds > 0:  # also refuses NaN
            raise ValueError(f"handshake_seconds must be positive, got {self.handshake_seconds}")
        if self.log_lines_per_second is not None and self.log_lines_per_second < 1:
            raise ValueError(
                f"log_lines_per_second must be at least 1 (or None), got "
                f"{self.log_lines_per_second}"
            )


@dataclass
class AdmissionStats:
    """Exact counts of what a gate did (logging may be rate-limited, these never are)."""

    connections: int = 0
    """Connections accepted from the OS, refused ones included."""
    refused_by_cap: int = 0
    admitted: int = 0
    """Handshakes that finished with the peer authenticated and admitted."""
    failed: Counter[str] = field(default_factory=Counter)
    """Failed handshakes by category (`FAILURE_CATEGORIES`)."""
    pending: int = 0
    peak_pending: int = 0
    accept_errors: int = 0
    """Accepts that failed for lack of resources (EMFILE, ...) and were retried."""
    log_lines_suppressed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain JSON-able values."""
        return {
            "connections": self.connections,
            "refused_by_cap": self.refused_by_cap,
            "admitted": self.admitted,
            "failed": {name: self.failed[name] for name in FAILURE_CATEGORIES if self.failed[name]},
            "pending": self.pending,
            "peak_pending": self.peak_pending,
            "accept_errors": self.accept_errors,
            "log_lines_suppressed": self.log_lines_suppressed,
        }


def classify_failure(error: BaseException, elapsed: float, deadline: float) -> str:
    """The category of a failed handshake, given how long it ran and its deadline."""
    if isinstance(error, FrameTooLarge):
        return "frame_too_large"
    if isinstance(error, AuthenticationError):
        return "authentication"
    if isinstance(error, PeerClosed):
        return "closed"
    if isinstance(error, HandshakeError):
        return "deadline" if elapsed >= deadline else "refused"
    if isinstance(error, ProtocolError):
        return "malformed"
    if isinstance(error, OSError | trio.BrokenResourceError | trio.ClosedResourceError):
        return "connection_error"
    return "other"


def _remote_address(stream: trio.abc.Stream) -> str:
    sock = getattr(stream, "socket", None)
    try:
        remote = sock.getpeername() if sock is not None else None
    except OSError:
        remote = None
    if isinstance(remote, tuple) and len(remote) >= 2:
        return f"{remote[0]}:{remote[1]}"
    return "unknown peer"


class HandshakeTicket:
    """One connection's handshake slot: use it as ``with ticket:`` around the handshake.

    The block must finish within ``seconds`` of the accept, or it is cancelled and raises
    `HandshakeError` naming the peer. Leaving the block frees the slot, counts the outcome and
    logs a failure (the exception propagates unchanged).
    """

    def __init__(self, gate: AdmissionGate, where: str, seconds: float, started: float) -> None:
        self.gate = gate
        self.where = where
        """The remote ``host:port``."""
        self.seconds = seconds
        """The deadline; pass it on to the handshake (``accept(..., handshake_seconds=)``)."""
        self._started = started
        self._scope = trio.CancelScope(deadline=started + seconds)
        self._released = False

    def __enter__(self) -> HandshakeTicket:
        self._scope.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            self._scope.__exit__(exc_type, exc, tb)
        except BaseException as raised:
            self._finish(raised)
            raise
        if self._scope.cancelled_caught:  # our deadline: the Cancelled was swallowed
            late = HandshakeError(
                f"handshake not finished within {self.seconds} s", peer=self.where
            )
            self._finish(late)
            raise late from None
        self._finish(exc)
        return False

    def _finish(self, error: BaseException | None) -> None:
        if self._released:
            return
        if error is None:
            self.gate.stats.admitted += 1
        elif isinstance(error, Exception):
            elapsed = trio.current_time() - self._started
            category = classify_failure(error, elapsed, self.seconds)
            self.gate.stats.failed[category] += 1
            reason = error.reason if isinstance(error, ProtocolError) else str(error)
            self.gate._log_refusal(self.where, category, reason or type(error).__name__)
        self.release()

    def release(self) -> None:
        """Free the slot (idempotent); the handshake's outcome is not counted."""
        if not self._released:
            self._released = True
            self.gate.stats.pending -= 1


Handle = Callable[[trio.SocketStream, HandshakeTicket], Awaitable[None]]
"""A connection handler: runs the handshake under ``with ticket:``, then serves the peer."""


class AdmissionGate:
    """Bounds the unauthenticated connections of one serving endpoint (see the module doc).

    ``name`` starts every log line (``"coordinator"``, ``"rank 2"``). One gate may serve several
    listeners (IPv4 and IPv6 of one address); the cap is shared.
    """

    def __init__(self, name: str = "listener", limits: AdmissionLimits | None = None) -> None:
        self.name = name
        self.limits = limits or AdmissionLimits()
        self.stats = AdmissionStats()
        self._serving = 0
        self._window_start = -float("inf")
        self._window_lines = 0
        self._suppressed: Counter[str] = Counter()

    # ---------------------------------------------------------------- serving

    async def serve(
        self, listener: trio.abc.Listener[Any], nursery: trio.Nursery, handle: Handle
    ) -> None:
        """Accept connections forever; each admitted one runs ``handle(stream, ticket)`` in
        ``nursery``. Logs the totals when the last listener of this gate stops serving."""
        self._serving += 1
        try:
            while True:
                stream = await self.accept(listener)
                ticket = await self.admit(stream)
                if ticket is not None:
                    nursery.start_soon(self._run, handle, stream, ticket)
        finally:
            self._serving -= 1
            if not self._serving:
                self._log_totals()

    async def accept(self, listener: trio.abc.Listener[Any]) -> Any:
        """The next connection; out of descriptors or memory, back off and retry."""
        while True:
            try:
                return await listener.accept()
            except OSError as exc:
                if exc.errno not in _EXHAUSTION_ERRNOS:
                    raise
                self.stats.accept_errors += 1
                self._log_refusal(
                    "(not accepted)", "accept_error", f"{exc}; retrying in {_ACCEPT_BACKOFF} s"
                )
                await trio.sleep(_ACCEPT_BACKOFF)

    async def admit(self, stream: trio.SocketStream) -> HandshakeTicket | None:
        """A ticket for ``stream``, or None when the cap is reached: then the peer gets a
        ``refuse`` frame, the stream is closed and the refusal logged."""
        self.stats.connections += 1
        where = _remote_address(stream)
        cap = self.limits.max_pending
        if self.stats.pending >= cap:
            self.stats.refused_by_cap += 1
            reason = f"{self.stats.pending} handshakes already in progress (the cap is {cap})"
            _refuse_at_once(stream, f"{self.name} is busy: {reason}; try again later")
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._log_refusal(where, "over_cap", f"{reason}; closed at once")
            return None
        self.stats.pending += 1
        self.stats.peak_pending = max(self.stats.peak_pending, self.stats.pending)
        return HandshakeTicket(self, where, self.limits.handshake_seconds, trio.current_time())

    async def _run(
        self, handle: Handle, stream: trio.SocketStream, ticket: HandshakeTicket
    ) -> None:
        try:
            await handle(stream, ticket)
        finally:
            ticket.release()  # a handler that never used its ticket still frees the slot

    # ---------------------------------------------------------------- logging

    def _log_refusal(self, where: str, category: str, reason: str) -> None:
        now = trio.current_time()
        if now - self._window_start >= _LOG_WINDOW:
            self.flush_log(now)
        limit = self.limits.log_lines_per_second
        if limit is not None and self._window_lines >= limit:
            self._suppressed[category] += 1
            self.stats.log_lines_suppressed += 1
            return
        self._window_lines += 1
        log.warning("%s refused a connection from %s [%s]: %s", self.name, where, category, reason)

    def flush_log(self, now: float | None = None) -> None:
        """Log one line summing up the refusals not logged one by one, and start a new window."""
        now = trio.current_time() if now is None else now
        if self._suppressed:
            counts = " ".join(f"{k}={v}" for k, v in sorted(self._suppressed.items()))
            log.warning(
                "%s refused %d more connections, not logged one by one (at most %s lines/s): %s",
                self.name,
                sum(self._suppressed.values()),
                self.limits.log_lines_per_second,
                counts,
            )
            self._suppressed.clear()
        self._window_start = now
        self._window_lines = 0

    def _log_totals(self) -> None:
        self.flush_log()
        stats = self.stats
        failed = " ".join(f"{name}={stats.failed[name]}" for name in FAILURE_CATEGORIES)
        log.info(
            "%s admission totals: connections=%d admitted=%d over_cap=%d %s peak_pending=%d "
            "accept_errors=%d",
            self.name,
            stats.connections,
            stats.admitted,
            stats.refused_by_cap,
            failed,
            stats.peak_pending,
            stats.accept_errors,
        )


def _refuse_at_once(stream: trio.abc.Stream, reason: str) -> None:
    """Best effort, without waiting: send a refuse frame and drop what the peer sent, so the
    close is a FIN the peer reads after the frame (not a reset that may discard it)."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return
    try:
        fd = sock.fileno()
        os.write(fd, encode_frame_bytes(*Refusal(reason, busy=True).to_wire()))
        sock.shutdown(socket.SHUT_WR)
        os.read(fd, _DRAIN_BYTES)
    except OSError:  # buffer full, peer gone, nothing to read: the close alone will do
        pass
