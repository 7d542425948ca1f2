"""Admission control for listeners: what a stranger may cost before it has authenticated.

An unauthenticated connection costs a task, a file descriptor and a receive buffer (256 KiB,
`paramsync.runtime.transport.tcp.Connection`) until its handshake ends. An `AdmissionGate` bounds
all three for one serving endpoint (the coordinator's listeners, or a worker's data-plane listener):

* at most ``max_pending`` handshakes run at once, and at most ``max_pending_per_source`` from
  one source (`source_key`: an IPv4 address, or an IPv6 /64); a connection over either cap
  is answered with a ``refuse`` frame (``busy``: the dialer retries) and closed at once,
  before any task or buffer exists for it;
* every handshake has a deadline (``handshake_seconds``, from the accept), enforced around the
  whole handshake block, so a slow-drip peer holds its slot for a bounded time;
* a handshake of a source that has been sitting on slots is evicted when a newcomer from a
  source that has held fewer needs the slot (see *Fairness* below), so slow holders, from one
  source or from many, cannot keep the workers out for the length of the deadline;
* running out of file descriptors (EMFILE and friends) makes the accept loop back off and retry
  instead of crashing the listener;
* a failed proof of the secret costs its source (*Guessing* below): a source over its budget
  of failed proofs is refused at once, like a connection over a cap, before any handshake
  work (no task, no key exchange);
* refusals are logged one line each, naming the remote address and a category in brackets,
  at most ``log_lines_per_second`` a second; the rest are counted and summed up in one line.

Fairness (issue 18, row 3; issue 31, row 7). Who a dialer is (its rank) is known only once it
has proven the secret, at the end of the handshake, so no slot can be set aside for "a rank the
run expects" before that point without trusting what a stranger claims (under protocol version
2 the dialer's proof comes in its second message, after it already holds a slot). Instead the
gate shares the slots fairly among sources, and makes a slot impossible to hold against a
newcomer from a source that has held less:

0. What a source is (`source_key`): an IPv4 address; an IPv6 address's /64, because one IPv6
   host is routinely given a whole /64 (SLAAC, privacy addresses) and can connect from 2^64
   addresses of it; an IPv4 address mapped into IPv6 (a dual-stack listener's
   ``::ffff:a.b.c.d``) is that IPv4 address. IPv4 addresses are not grouped by prefix: the
   workers of one cluster often share a /24, and grouping them would put them in one source
   with any attacker of that subnet.
1. Per-source cap: one source holds at most ``max_pending_per_source`` slots (default 8 of
   64), so a single host cannot take them all. A newcomer whose own source is at its cap can
   only take the oldest slot of its own source, once that handshake is ``evict_after_seconds``
   old (default 1 s; a real handshake takes a round trip and two HMACs, milliseconds).
2. Fair shares between sources, by what each source has *held*, not by how old its current
   connections are. The gate keeps, per source, its load: the number of slots it held,
   averaged over about the last ``evict_after_seconds`` (an exponentially weighted average
   with that time constant). A newcomer that finds the global cap reached takes a slot from a
   source that holds at least two slots more than the newcomer's own and whose load is at
   least 1 (it has been sitting on slots, not finishing handshakes): the source holding the
   most, its oldest handshake. The evicted peer gets a ``refuse`` frame marked ``busy`` (a
   real dialer waiting for its challenge then retries, as over the cap) and its connection is
   closed; the log names it with the category ``evicted``.

   Why load and not the age of a connection (the rule until session 10): holders that come
   back whenever they are cut, or that hang up and reconnect on their own, renew their
   connections faster than any age threshold, and under rule 1 each address's own newcomers
   took its slots back the instant they became old enough. A worker backing off between
   dials then arrived between those instants, every time: ranks 0 and 1 were refused "busy"
   for their whole 2.5 s window in one run of ``make reliability-hostile``
   (tests/test_admission.py reproduces it under a mock clock). An address's load does not
   fall when its connections are renewed, only when it holds fewer slots.
3. Many sources holding one slot each (issue 31, row 7). Rule 2 never applies to 96 holders
   from 96 addresses (each holds one slot, the worker's address none: nobody is two ahead),
   so they kept a worker out until a holder's deadline (28 s and more in the review). Each
   source therefore also has a share: its load with a longer time constant,
   ``_SHARE_TAU`` x ``evict_after_seconds`` (2 s by default). At the global cap a newcomer
   also takes a slot from a source that holds more slots than the newcomer's own and whose
   share is at least ``_SHARE_MARGIN`` (0.5) above the newcomer's source's share: of all such
   sources (and those of rule 2), the one holding the most, then with the largest share, its
   oldest handshake. A real handshake holds its slot for milliseconds, so a worker's source
   has a share near 0: it takes a slot from any source that has held one for about 1.4 s
   (2 ln 2) of the last few seconds, and no holder can take the worker's slot back.

   Why it holds against many sources: while the gate is full, the shares of all sources add
   up to the same average of the slots held, so after the gate has been full for t seconds
   they sum to ``max_pending`` x (1 - e^(-t/2)) (the 64 slots of the defaults: 48 after 2.8 s).
   To give the worker no victim, every source holding a slot must have a share under 0.5 at
   the moment it dials; a source that keeps that at every moment never has a share of 0.5 or
   more at all (a share grows only while the source holds). With N sources the sum then stays
   under N x 0.5, so holders from N < 2 x ``max_pending`` sources (under 128 with the
   defaults: 96 addresses, or many more addresses of fewer /64s, included) cannot keep every
   slot unevictable once the gate has been full for 2 ln(64 / (64 - N/2)) s (2.8 s for 96),
   whatever they do; the worker redials at least every 0.5 s (`tcp.dial_with_retry`) and is
   in at its next dial. Holders that hold until they are cut, come back at once, or renew
   every connection every 0.3 s let a worker dialing 3 s into the attack in at its first dial,
   and one dialing from the start within 2.7 s (tests/test_admission_sources.py, mock clock).
   What this bound does not cover: holders timed to the worker's dials (an attacker who
   could see them), or from 128 and more sources; a schedule that charges some sources
   above 0.5 while others hold can only give the worker no victim part of the time (about
   half in the schedules analysed), and each dial is then a fresh chance.

   The longer time constant keeps bursts of real handshakes safe: eight handshakes of one
   host arriving at once have a share of 0.5 only after 0.13 s, the same moment rule 2's
   load of 1 would make one of them evictable anyway.
4. What that guarantees. A worker dialing from a source that holds at least two slots fewer
   than some source of load 1 or more, or fewer slots and 0.5 less share than some source,
   gets a slot at its first dial, however the attacker connects, holds, hangs up or
   reconnects; it then finishes its handshake in milliseconds, and nobody can take that slot
   back (its source now holds one slot, a load far below 1 and a share near 0). Holders that
   just arrived have a load under 1 and a share under 0.5 for a moment (a source holding 8
   slots reaches a load of 1 after 0.13 ``evict_after_seconds``), and a burst of real
   handshakes from one host never reaches either, so those are not evicted. To keep such a
   worker out an attacker needs about 2 x ``max_pending`` sources of its own, each holding
   less than half a slot on average, not a handful of slow connections nor a single /64.
   Rejoins after a coordinator restart go through the same gate and get the same guarantee.
   What it cannot do: tell an attacker from a worker *of the same source* (the same IPv4
   address, or the same IPv6 /64) before the proof; there the attacker holds at most
   ``max_pending_per_source`` slots and shares the source's evictions with the worker (a
   worker's host running hostile code, or an attacker on the workers' own IPv6 subnet, is out
   of scope).

Guessing (issue 39, row 2). Each handshake tests one guess of the secret, and a dialer that
does not know it learns nothing else (docs/protocol.md section 5.1), so the guesses a source may
make are what protects a human secret. Every gate keeps a `GuessBudget`
(`paramsync.runtime.transport.guess_budget`, limits in ``AdmissionLimits.guesses``): a source
(`source_key`) that failed 4 proofs is refused for 1 s after its next failure, 2 s after the one
after, doubling to 5 minutes; all sources together have 32 failures, refilled at one every 5 s,
and once those are spent a source that has failed before is refused until they refill. A
refusal is a ``refuse`` frame marked busy (category ``throttled`` in the log, counted in
``AdmissionStats.throttled``); a failed proof's log line gives the source's count and back-off;
both are counted for the metrics (`paramsync.runtime.observe.admission_tally`). A source that
has never failed is never throttled, so workers from other sources are admitted as usual while
a guesser is held back (tests/test_guess_budget.py). A worker's listener keeps one gate, and
its budget, for the listener's life (`paramsync.runtime.transport.tcp.listener_gate`), not one
per mesh it forms.

Once the proof is checked, the rank claim is atomic (the listener's ``admit`` callback
reserves the rank before the welcome is sent; see `paramsync.runtime.coordinator.service` and
`paramsync.runtime.transport.tcp._admit_ranks`), so two dialers claiming one rank at once cannot
both be welcomed (issue 18, row 9).

Frames stay capped at `paramsync.runtime.protocol.wire.HANDSHAKE_MAX_FRAME` until the peer
authenticates (the prefix is checked before any byte of the item is read), so pending handshakes
cost at most ``max_pending`` x 256 KiB of buffers. Counters (`AdmissionStats`) are exact whatever
the logging.

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
import ipaddress
import logging
import math
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol, runtime_checkable

import trio

from paramsync.runtime.errors import (
    AuthenticationError,
    FrameTooLarge,
    HandshakeError,
    PeerClosed,
    ProtocolError,
    one_line,
)
from paramsync.runtime.observe.admission_tally import TALLY
from paramsync.runtime.protocol.messages import Refusal
from paramsync.runtime.protocol.wire import encode_frame_bytes
from paramsync.runtime.transport.guess_budget import GuessBudget, GuessLimits

__all__ = [
    "AdmissionGate",
    "AdmissionLimits",
    "AdmissionStats",
    "HandshakeTicket",
    "SocketBacked",
    "SourceLoad",
    "FAILURE_CATEGORIES",
    "classify_failure",
    "source_key",
]

log = logging.getLogger("paramsync.admission")

FAILURE_CATEGORIES = (
    "closed",
    "deadline",
    "evicted",
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
_HOLDING_LOAD = 1.0
"""A source whose load (`SourceLoad`) is at least this may lose a slot to a poorer source."""
_FORGOTTEN_LOAD = 0.01
"""A source holding no slot is forgotten once its load and its share have decayed below this."""
_SHARE_MARGIN = 0.5
"""At the global cap, a source whose share is this much above the newcomer's (and which holds
more slots) gives one up (module doc, *Fairness*, rule 3)."""
_SHARE_TAU = 2.0
"""The time constant of a source's share, in ``evict_after`` units."""
_IPV6_SOURCE_PREFIX = 64
"""IPv6 peers are grouped by this prefix: one host commonly holds a whole /64."""


@dataclass(frozen=True)
class AdmissionLimits:
    """What one serving endpoint grants unauthenticated peers."""

    max_pending: int = 64
    """Handshakes in progress at once; a connection over the cap is refused at once."""
    handshake_seconds: float = 10.0
    """Deadline of one handshake, from its accept."""
    log_lines_per_second: int | None = 20
    """Refusal log lines per second (None: no limit); the others are summed up in one line."""
    max_pending_per_source: int = 8
    """Handshakes in progress at once from one source (`source_key`: an IPv4 address or an IPv6
    /64; at most ``max_pending``)."""
    guesses: GuessLimits = field(default_factory=GuessLimits)
    """The budgets of failed proofs of the secret, per source and in all (module doc,
    *Guessing*)."""
    evict_after_seconds: float = 1.0
    """A handshake this old (or ``handshake_seconds``, if shorter) may be evicted to make room
    for a newcomer from its own source at that source's cap; also the time constant of the
    load (`SourceLoad`) by which sources give slots up to poorer ones at the global cap, and
    half that of their share (module doc, *Fairness*, rules 2 and 3)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int):
            raise ValueError(f"max_pending must be an int, got {self.max_pending!r}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {self.max_pending}")
        if not self.handshake_seconds > 0:  # also refuses NaN
            raise ValueError(f"handshake_seconds must be positive, got {self.handshake_seconds}")
        per_source = self.max_pending_per_source
        if isinstance(per_source, bool) or not isinstance(per_source, int) or per_source < 1:
            raise ValueError(f"max_pending_per_source must be an int >= 1, got {per_source!r}")
        if not self.evict_after_seconds > 0:
            raise ValueError(
                f"evict_after_seconds must be positive, got {self.evict_after_seconds}"
            )
        if self.log_lines_per_second is not None and self.log_lines_per_second < 1:
            raise ValueError(
                f"log_lines_per_second must be at least 1 (or None), got "
                f"{self.log_lines_per_second}"
            )

    @property
    def per_source(self) -> int:
        """The per-source cap in force: ``max_pending_per_source``, at most ``max_pending``."""
        return min(self.max_pending_per_source, self.max_pending)

    @property
    def evict_after(self) -> float:
        """The age from which a pending handshake may be evicted (at most the deadline)."""
        return min(self.evict_after_seconds, self.handshake_seconds)


class SourceLoad:
    """How many slots one source address has held lately: the number it holds, averaged
    exponentially over time with time constant ``tau`` (``load`` is 0 for a new source and
    tends to the number held while that stays the same).

    Renewing connections does not lower it, holding fewer slots does: this is what the gate's
    fair shares go by (module doc, *Fairness*)."""

    __slots__ = ("_at", "_load", "held", "tau")

    def __init__(self, tau: float, now: float) -> None:
        self.held = 0
        """Slots held now."""
        self.tau = tau
        self._load = 0.0
        self._at = now

    def load(self, now: float) -> float:
        """The average number of slots held, weighted toward the last ``tau`` seconds."""
        elapsed = max(0.0, now - self._at)
        return self.held + (self._load - self.held) * math.exp(-elapsed / self.tau)

    def change(self, delta: int, now: float) -> None:
        """The source took (``+1``) or gave up (``-1``) a slot at ``now``."""
        self._load = self.load(now)
        self._at = max(self._at, now)
        self.held += delta


@dataclass
class AdmissionStats:
    """Exact counts of what a gate did (logging may be rate-limited, these never are)."""

    connections: int = 0
    """Connections accepted from the OS, refused ones included."""
    refused_by_cap: int = 0
    """Refused at once: the global cap, or the source's, was reached and nobody was evictable."""
    refused_by_source: int = 0
    """Of ``refused_by_cap``, those refused by their source's cap."""
    evicted: int = 0
    """Pending handshakes evicted to make room for a newcomer (also in ``failed``)."""
    admitted: int = 0
    """Handshakes that finished with the peer authenticated and admitted."""
    failed: Counter[str] = field(default_factory=Counter)
    """Failed handshakes by category (`FAILURE_CATEGORIES`)."""
    pending: int = 0
    peak_pending: int = 0
    accept_errors: int = 0
    """Accepts that failed for lack of resources (EMFILE, ...) and were retried."""
    throttled: Counter[str] = field(default_factory=Counter)
    """Refused at once because their source spent its budget of failed proofs (``source``)
    or every source did (``global``): not in ``refused_by_cap``."""
    log_lines_suppressed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain JSON-able values."""
        return {
            "connections": self.connections,
            "refused_by_cap": self.refused_by_cap,
            "refused_by_source": self.refused_by_source,
            "evicted": self.evicted,
            "admitted": self.admitted,
            "failed": {name: self.failed[name] for name in FAILURE_CATEGORIES if self.failed[name]},
            "pending": self.pending,
            "peak_pending": self.peak_pending,
            "accept_errors": self.accept_errors,
            "throttled": dict(self.throttled),
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


def source_key(address: str) -> str:
    """What the gate counts as one source: an IPv4 address as it is, an IPv6 address by its
    /64 (``2001:db8:1:2::/64``; the scope of a link-local address dropped), an IPv4 address
    mapped into IPv6 (a dual-stack listener's ``::ffff:10.0.0.1``) as the IPv4 address.
    Anything that is not an IP address is its own key.

    Why /64: IPv6 hosts are routinely given a whole /64 (SLAAC, privacy addresses), so one
    host can connect from 2^64 addresses, while an IPv4 host has one (or a handful)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, _IPV6_SOURCE_PREFIX), strict=False))
    return str(ip)


class _PeerSocket(Protocol):
    """What the gate uses of an accepted stream's OS socket."""

    def getpeername(self) -> Any: ...

    def fileno(self) -> int: ...

    def shutdown(self, how: int, /) -> None: ...


@runtime_checkable
class SocketBacked(Protocol):
    """A stream over one OS socket, as `trio.SocketStream` is (a declared capability): the
    gate names and counts its peer by the socket's address, and refuses it over capacity by
    writing straight to the socket. A stream without it is admitted as "unknown peer" (one
    source) and refused by a plain close."""

    @property
    def socket(self) -> _PeerSocket:
        """The stream's socket."""


def _remote_address(stream: trio.abc.Stream) -> tuple[str, str]:
    """(``host:port``, the source key: `source_key` of the IP address) of the peer of
    ``stream``."""
    try:
        remote = stream.socket.getpeername() if isinstance(stream, SocketBacked) else None
    except OSError:
        remote = None
    if isinstance(remote, tuple) and len(remote) >= 2:
        return f"{remote[0]}:{remote[1]}", source_key(str(remote[0]))
    return "unknown peer", "unknown peer"


class HandshakeTicket:
    """One connection's handshake slot: use it as ``with ticket:`` around the handshake.

    The block must finish within ``seconds`` of the accept, or it is cancelled and raises
    `HandshakeError` naming the peer. Leaving the block frees the slot, counts the outcome and
    logs a failure (the exception propagates unchanged).
    """

    def __init__(
        self,
        gate: AdmissionGate,
        where: str,
        seconds: float,
        started: float,
        source: str | None = None,
        stream: trio.abc.Stream | None = None,
    ) -> None:
        self.gate = gate
        self.where = where
        """The remote ``host:port``."""
        self.source = source_key(where.rsplit(":", 1)[0]) if source is None else source
        """The remote source (`source_key`): what the per-source cap counts."""
        self.seconds = seconds
        """The deadline; pass it on to the handshake (``accept(..., handshake_seconds=)``)."""
        self._started = started
        self._stream = stream
        self._scope = trio.CancelScope(deadline=started + seconds)
        self._released = False
        self._eviction = ""
        self.evicted = False
        """Whether the gate took this slot back for a newcomer (`AdmissionGate.admit`)."""

    @property
    def started(self) -> float:
        """When the connection was accepted (trio's clock)."""
        return self._started

    def evict(self, reason: str) -> None:
        """Take the slot back now: send the peer a ``refuse`` frame marked busy (a dialer
        waiting for its challenge retries), cancel the handshake and free the slot (the
        handler's ``with`` block then raises `HandshakeError` naming the eviction)."""
        if self._released:
            return
        self.evicted = True
        self._eviction = reason
        if self._stream is not None:
            _refuse_at_once(self._stream, f"{self.gate.name} is busy: {reason}; try again later")
        self._scope.cancel()
        self.gate.stats.evicted += 1
        self.gate.stats.failed["evicted"] += 1
        self.gate._log_refusal(self.where, "evicted", reason)
        self.release()

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
        if self.evicted:  # counted and logged by evict()
            raise HandshakeError(f"evicted: {self._eviction}", peer=self.where) from None
        if self._scope.cancelled_caught:  # our deadline: the Cancelled was swallowed
            late = HandshakeError(
                f"handshake not finished within {self.seconds} s", peer=self.where
            )
            self._finish(late)
            raise late from None
        self._finish(exc)
        return False

    def _finish(self, error: BaseException | None) -> None:
        if self._released:  # also: evicted, already counted
            return
        if error is None:
            self.gate.stats.admitted += 1
        elif isinstance(error, Exception):
            elapsed = trio.current_time() - self._started
            category = classify_failure(error, elapsed, self.seconds)
            self.gate.stats.failed[category] += 1
            reason = error.reason if isinstance(error, ProtocolError) else str(error)
            reason = reason or type(error).__name__
            if category == "authentication":
                reason += self.gate._charge_failed_proof(self.source)
            self.gate._log_refusal(self.where, category, reason)
        self.release()

    def release(self) -> None:
        """Free the slot (idempotent); the handshake's outcome is not counted."""
        if not self._released:
            self._released = True
            self.gate._forget(self)


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
        self.guesses = GuessBudget(self.limits.guesses)
        """The budgets of failed proofs (`paramsync.runtime.transport.guess_budget`)."""
        self._pending: dict[str, list[HandshakeTicket]] = {}
        """Pending handshakes by source, oldest first."""
        self._loads: dict[str, SourceLoad] = {}
        """Each source's load; kept after its last slot until the load has decayed."""
        self._shares: dict[str, SourceLoad] = {}
        """Each source's share (its load over ``_SHARE_TAU`` x ``evict_after``), kept as long."""
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
        """A ticket for ``stream``, or None when a cap is reached and no pending handshake is
        old enough to evict: then the peer gets a ``refuse`` frame, the stream is closed and
        the refusal logged. See the module doc (*Fairness*) for who is evicted."""
        self.stats.connections += 1
        where, source = _remote_address(stream)
        now = trio.current_time()
        throttled = self.guesses.check(source, now)
        if throttled is not None:  # before any handshake work: no task, no key exchange
            self.stats.throttled[throttled.scope] += 1
            TALLY.throttled(self.name, throttled.scope)
            reason = throttled.reason(source)
            _refuse_at_once(stream, f"{self.name} is busy: {reason}; try again later")
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._log_refusal(where, "throttled", f"{reason}; closed at once")
            return None
        refusal = self._make_room(source, now)
        if refusal is not None:
            self.stats.refused_by_cap += 1
            _refuse_at_once(stream, f"{self.name} is busy: {refusal}; try again later")
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self._log_refusal(where, "over_cap", f"{refusal}; closed at once")
            return None
        ticket = HandshakeTicket(
            self, where, self.limits.handshake_seconds, now, source=source, stream=stream
        )
        self._pending.setdefault(source, []).append(ticket)
        self._load_of(source, now).change(+1, now)
        self._shares[source].change(+1, now)
        self.stats.pending += 1
        self.stats.peak_pending = max(self.stats.peak_pending, self.stats.pending)
        return ticket

    def _charge_failed_proof(self, source: str) -> str:
        """``source`` failed a proof: charge its budget; what to add to the refusal's line."""
        TALLY.failed_authentication(self.name)
        now = trio.current_time()
        backoff = self.guesses.backoff_after_failure(source, now)
        failures = self.guesses.failures_of(source, now)
        if not backoff:
            return f" ({failures} failed authentication(s) from {source})"
        return (
            f" ({failures} failed authentications from {source}: its handshakes are refused "
            f"for {backoff:g} s)"
        )

    def pending_from(self, source: str) -> int:
        """Handshakes in progress from one source (`source_key`)."""
        return len(self._pending.get(source, ()))

    def load_of(self, source: str) -> float:
        """How many slots ``source`` held lately (`SourceLoad`); 0 for an unknown source."""
        tracked = self._loads.get(source)
        return 0.0 if tracked is None else tracked.load(trio.current_time())

    def share_of(self, source: str) -> float:
        """How many slots ``source`` held over the last few seconds: its load with a time
        constant of ``_SHARE_TAU`` x ``evict_after`` (module doc, *Fairness*, rule 3)."""
        tracked = self._shares.get(source)
        return 0.0 if tracked is None else tracked.load(trio.current_time())

    def _load_of(self, source: str, now: float) -> SourceLoad:
        tracked = self._loads.get(source)
        if tracked is None:
            if len(self._loads) > 2 * len(self._pending) + 64:
                self._forget_idle_sources(now)
            tracked = self._loads[source] = SourceLoad(self.limits.evict_after, now)
            self._shares[source] = SourceLoad(_SHARE_TAU * self.limits.evict_after, now)
        return tracked

    def _forget_idle_sources(self, now: float) -> None:
        """Drop the loads of sources that hold nothing and whose load and share have (nearly)
        decayed: the table stays proportional to the sources seen in the last few seconds,
        and a source is never forgotten while its share could still count against it."""
        for source in [
            s
            for s, tracked in self._loads.items()
            if not tracked.held
            and tracked.load(now) < _FORGOTTEN_LOAD
            and self._shares[s].load(now) < _FORGOTTEN_LOAD
        ]:
            del self._loads[source]
            del self._shares[source]

    def _make_room(self, source: str, now: float) -> str | None:
        """Make room for a newcomer from ``source``: None when there is (evicting a holder if
        a cap is reached), else the reason it is refused."""
        per_source, cap = self.limits.per_source, self.limits.max_pending
        old_enough = now - self.limits.evict_after
        mine = self._pending.get(source, [])
        if len(mine) >= per_source:
            if mine[0].started > old_enough:
                if per_source >= cap:  # one source fills the whole gate: the global cap
                    return f"{self.stats.pending} handshakes already in progress (the cap is {cap})"
                self.stats.refused_by_source += 1
                return (
                    f"{len(mine)} handshakes already in progress from {source} (the cap per "
                    f"source is {per_source})"
                )
            mine[0].evict(
                f"{source} holds {len(mine)} pending handshakes (the cap per source is "
                f"{per_source}); this one made no progress for "
                f"{now - mine[0].started:.1f} s and a newcomer from it needs the slot"
            )
            return None
        if self.stats.pending < cap:
            return None
        # Fair shares (module doc, *Fairness*). Rule 2: a source holding at least two slots
        # more than the newcomer's gives one up (so the swap never leaves the newcomer's
        # source ahead of it) if it has been sitting on slots (its load), however young its
        # connections are. Rule 3: a source holding more slots than the newcomer's gives one
        # up if its share is at least _SHARE_MARGIN above the newcomer's source's.
        mine_share = self._share_now(source, now)
        candidates = [
            held[0]
            for held in self._pending.values()
            if (
                len(held) >= len(mine) + 2
                and self._loads[held[0].source].load(now) >= _HOLDING_LOAD
            )
            or (
                len(held) > len(mine)
                and self._shares[held[0].source].load(now) >= mine_share + _SHARE_MARGIN
            )
        ]
        if not candidates:
            return f"{self.stats.pending} handshakes already in progress (the cap is {cap})"
        victim = max(
            candidates,
            key=lambda t: (self.pending_from(t.source), self._shares[t.source].load(now)),
        )
        victim.evict(
            f"{self.stats.pending} handshakes in progress (the cap is {cap}), "
            f"{self.pending_from(victim.source)} of them from {victim.source}, which held "
            f"{self._loads[victim.source].load(now):.1f} slots on average lately "
            f"({self._shares[victim.source].load(now):.2f} over {self._share_tau:g} s); "
            f"this one made no progress for {now - victim.started:.1f} s and a newcomer from "
            f"a source holding {len(mine)} ({mine_share:.2f} over {self._share_tau:g} s) "
            f"needs the slot"
        )
        return None

    @property
    def _share_tau(self) -> float:
        return _SHARE_TAU * self.limits.evict_after

    def _share_now(self, source: str, now: float) -> float:
        tracked = self._shares.get(source)
        return 0.0 if tracked is None else tracked.load(now)

    def _forget(self, ticket: HandshakeTicket) -> None:
        self.stats.pending -= 1
        held = self._pending.get(ticket.source)
        if held is not None and ticket in held:
            held.remove(ticket)
            now = trio.current_time()
            self._loads[ticket.source].change(-1, now)
            self._shares[ticket.source].change(-1, now)
            if not held:
                del self._pending[ticket.source]

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
        log.warning(
            "%s refused a connection from %s [%s]: %s",
            self.name,
            one_line(where),
            category,
            one_line(reason),
        )

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
            "accept_errors=%d over_source_cap=%d throttled=%d",
            self.name,
            stats.connections,
            stats.admitted,
            stats.refused_by_cap,
            failed,
            stats.peak_pending,
            stats.accept_errors,
            stats.refused_by_source,
            sum(stats.throttled.values()),
        )


def _refuse_at_once(stream: trio.abc.Stream, reason: str) -> None:
    """Best effort, without waiting: send a refuse frame and drop what the peer sent, so the
    close is a FIN the peer reads after the frame (not a reset that may discard it)."""
    if not isinstance(stream, SocketBacked):
        return
    sock = stream.socket
    try:
        fd = sock.fileno()
        os.write(fd, encode_frame_bytes(*Refusal(reason, busy=True).to_wire()))
        sock.shutdown(socket.SHUT_WR)
        os.read(fd, _DRAIN_BYTES)
    except OSError:  # buffer full, peer gone, nothing to read: the close alone will do
        pass
